"""Columns of whole numbers that later hold fractions (issue #37, item 2): keyed and
window ``aggregate`` widen their accumulators as Arrow unifies the types (int64 and
float64 make float64), never truncate, agree at every parallelism and across a
restore; types Arrow cannot unify fail at once, naming the column and both types."""

from __future__ import annotations

import os
import threading
from collections import defaultdict
from typing import Any, Dict, List

import numpy as np
import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.state import ValueStateDescriptor, create_keyed_backend
from pyengine.state.reader import read_keyed_state
from pyengine.storage import checkpoint_storage

AGGS = (pe.agg.sum("price"), pe.agg.max("price"), pe.agg.min("price"), pe.agg.mean("price"), pe.agg.count())


def ints_then_floats(n: int = 600, keys: int = 7, key: Any = int) -> List[Dict[str, Any]]:
    """Whole prices first (``{"price": 10}``), then fractions (``10.3``), as in the issue."""
    whole = [{"k": key(i % keys), "price": 10 + i % 5, "ts": i} for i in range(n // 2)]
    frac = [{"k": key(i % keys), "price": 10.3 + i % 3, "ts": n // 2 + i} for i in range(n // 2)]
    return whole + frac


def reference(rows: List[Dict[str, Any]]) -> Dict[Any, Dict[str, Any]]:
    prices: Dict[Any, List[float]] = defaultdict(list)
    for r in rows:
        prices[r["k"]].append(r["price"])
    return {
        k: {
            "sum_price": sum(v),
            "max_price": max(v),
            "min_price": min(v),
            "mean_price": sum(v) / len(v),
            "count": len(v),
        }
        for k, v in prices.items()
    }


def assert_matches(got: Dict[Any, Dict[str, Any]], want: Dict[Any, Dict[str, Any]]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        for column, value in w.items():
            assert got[k][column] == pytest.approx(value, rel=1e-12), (k, column, got[k][column], value)


def final(env: pe.StreamEnvironment, rows: List[Dict[str, Any]], **kw: Any) -> Dict[Any, Dict[str, Any]]:
    sink = pe.sinks.CollectSink()
    env.from_collection(rows).key_by("k").aggregate(*AGGS, emit="final").uid("agg").sink_to(sink)
    env.execute("widening", **kw)
    return {r["k"]: r for r in sink.records}


@pytest.mark.parametrize("parallelism", [1, 2])
@pytest.mark.parametrize("key", [int, str])
def test_keyed_aggregate_widens_whole_numbers_to_fractions_at_every_parallelism(parallelism: int, key: Any) -> None:
    """Before: max 10 where 10.3 came later, sums short by the fractions, and another
    answer at p=2 (whose subtasks saw other first batches)."""
    rows = ints_then_floats(key=key)
    env = pe.StreamEnvironment(parallelism=parallelism, buffer_size=16, buffer_timeout_ms=1, monitoring=None)
    got = final(env, rows)
    assert_matches(got, reference(rows))
    assert all(isinstance(r["sum_price"], float) and isinstance(r["max_price"], float) for r in got.values())


@pytest.mark.parametrize("parallelism", [1, 2])
def test_window_aggregate_widens_whole_numbers_to_fractions(parallelism: int) -> None:
    rows = ints_then_floats()
    env = pe.StreamEnvironment(parallelism=parallelism, buffer_size=16, buffer_timeout_ms=1, monitoring=None)
    sink = pe.sinks.CollectSink()
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner(lambda r: r["ts"])
    (
        env.from_collection(rows, watermark_strategy=strategy)
        .key_by("k")
        .window(pe.windows.tumbling(10_000))
        .aggregate(*AGGS)
        .sink_to(sink)
    )
    env.execute("window-widening")
    got = {r["k"]: r for r in sink.records}
    assert len(sink.records) == len(got)  # one window
    assert_matches(got, reference(rows))


def test_the_update_stream_turns_float_where_fractions_came() -> None:
    rows = ints_then_floats(n=64, keys=1)
    env = pe.StreamEnvironment(parallelism=1, buffer_size=8, buffer_timeout_ms=1, monitoring=None)
    sink = pe.sinks.CollectSink()
    env.from_collection(rows).key_by("k").aggregate(pe.agg.sum("price")).sink_to(sink)
    env.execute("updates")
    last = max(sink.records, key=lambda r: r["_seq"])
    assert last["sum_price"] == pytest.approx(sum(r["price"] for r in rows))
    firsts = sorted(sink.records, key=lambda r: r["_seq"])
    assert isinstance(firsts[0]["sum_price"], int)  # whole numbers stay int64 until fractions come


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_a_widened_aggregate_is_exactly_once_across_a_failure(tmp_path: Any, backend: str) -> None:
    """Checkpoints before and after the widening, a failure after it: the restored
    float64 state (an incremental chain across the type change) and the replay give
    the failure-free totals."""
    rows = ints_then_floats(n=4000, keys=50)
    calls, lock = [0], threading.Lock()

    def flaky(r: Any) -> Any:
        with lock:
            calls[0] += 1
            if calls[0] == 3500:
                raise RuntimeError("injected")
        if calls[0] % 50 == 0:
            threading.Event().wait(0.002)  # room for checkpoints
        return r

    env = pe.StreamEnvironment(
        parallelism=2,
        buffer_size=16,
        buffer_timeout_ms=1,
        state_backend=backend,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(tmp_path / "ckpt"),
        monitoring=None,
    )
    sink = pe.sinks.CollectSink()
    env.from_collection(rows).map(flaky).key_by("k").aggregate(*AGGS, emit="final").uid("agg").sink_to(sink)
    result = env.execute("widened-failover")
    assert result.status == "FINISHED" and result.restarts == 1
    assert result.checkpoints.counts["completed"] >= 2
    assert_matches({r["k"]: r for r in sink.records}, reference(rows))
    state = read_keyed_state(result.latest_checkpoint, "agg", "sum(price)")  # the documented name stays
    assert pa.types.is_floating(state.schema.field("value").type)


@pytest.mark.parametrize("whole", [16, 20])  # the strings in buffers of their own, or one buffer of both
def test_a_column_arrow_cannot_unify_fails_naming_it_and_both_types(whole: int) -> None:
    rows = [{"k": 1, "price": 10}] * whole + [{"k": 1, "price": "10.3"}] * 16
    env = pe.StreamEnvironment(parallelism=1, buffer_size=8, restart_attempts=0, monitoring=None)
    env.from_collection(rows).key_by("k").aggregate(pe.agg.sum("price")).sink_to(pe.sinks.CollectSink())
    with pytest.raises(pe.JobFailedError) as failed:
        env.execute("mixed")
    message = str(failed.value)
    assert "'price'" in message and "int" in message and "str" in message, message
    assert "give the column one type" in message
    assert failed.value.result.restarts == 0


# -- the backend's in-place retype -------------------------------------------------------------


@pytest.mark.parametrize("kind", ["heap", "incremental"])
def test_retype_value_state_keeps_every_entry_and_restores_across_the_type_change(tmp_path: Any, kind: str) -> None:
    storage = checkpoint_storage(str(tmp_path), "job")
    b = create_keyed_backend(kind, max_parallelism=16)
    ints = b.get_state(ValueStateDescriptor("sum(price)", 0, pa.int64()))
    for k in range(100):
        b.set_current_key(k)
        ints.update(k * 10)
    first = b.snapshot(1, storage.location(1)).run()
    b.notify_checkpoint_complete(1)
    floats = b.retype_value_state(ValueStateDescriptor("sum(price)", 0, pa.float64()))
    keys = np.arange(100, dtype=np.int64)
    found, values = floats.get_many(keys)
    assert found.all() and values.dtype == np.float64 and values.tolist() == [k * 10.0 for k in range(100)]
    floats.merge_many(keys[:10], np.full(10, 0.5), "add")
    b.set_current_key(99)
    floats.clear()
    second = b.snapshot(2, storage.location(2)).run()
    assert first.handles
    restored = create_keyed_backend(kind, max_parallelism=16)
    restored.restore(second.handles)
    from pyengine.runtime.aggregate import value_state

    state = value_state(restored, ValueStateDescriptor("sum(price)", 0, pa.float64()))
    found, values = state.get_many(keys)
    assert found.tolist() == [k != 99 for k in range(100)]
    want = [k * 10.0 + (0.5 if k < 10 else 0.0) for k in range(99)]
    assert values[:99].tolist() == want and values.dtype == np.float64


# -- a parquet FileSink keeps one type per column (issue #37, item 4) -----------------------------


def _slowly(r: Any) -> Any:
    """Room for checkpoints between the whole numbers and the fractions: several part files."""
    if r["ts"] % 20 == 0:
        threading.Event().wait(0.003)
    return r


def _checkpointed(tmp_path: Any, parallelism: int) -> pe.StreamEnvironment:
    return pe.StreamEnvironment(
        parallelism=parallelism,
        buffer_size=16,
        buffer_timeout_ms=1,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(tmp_path / "ckpt"),
        monitoring=None,
    )


def _read_dir(path: str) -> pa.Table:
    import pyarrow.parquet as pq

    return pq.read_table(path)  # the directory as one dataset: its first file's schema


@pytest.mark.parametrize("parallelism", [1, 2])
def test_a_parquet_file_sink_reads_back_whole_after_whole_numbers_then_fractions(
    tmp_path: Any, parallelism: int
) -> None:
    """Before: part files of int64 and of double, and ``pq.read_table(dir)`` failed
    ("Float value 10.3 was truncated converting to int64")."""
    rows = ints_then_floats(n=400)
    out = str(tmp_path / "out")
    env = _checkpointed(tmp_path, parallelism)
    env.from_collection(rows).map(_slowly).sink_to(pe.sinks.FileSink(out, format="parquet"))
    env.execute("sink-widening")
    assert len([p for p in os.listdir(out) if p.startswith("part-")]) > 2
    table = _read_dir(out)
    assert table.schema.field("price").type == pa.float64()
    assert sorted(table.column("price").to_pylist()) == sorted(float(r["price"]) for r in rows)


def test_an_aggregate_into_parquet_reads_back_at_p2(tmp_path: Any) -> None:
    """p=2: one subtask's sums may stay int64 while the other's turn float64; the
    directory still reads as one table."""
    rows = ints_then_floats(n=400, keys=5)
    out = str(tmp_path / "out")
    env = _checkpointed(tmp_path, 2)
    sink = pe.sinks.FileSink(out, format="parquet")
    env.from_collection(rows).map(_slowly).key_by("k").aggregate(*AGGS).sink_to(sink)
    env.execute("agg-parquet")
    updates = _read_dir(out).to_pylist()
    got = {r["k"]: max((u for u in updates if u["k"] == r["k"]), key=lambda u: u["_seq"]) for r in updates}
    assert_matches(got, reference(rows))


def test_a_later_run_with_fractions_widens_an_earlier_runs_whole_numbers(tmp_path: Any) -> None:
    out = str(tmp_path / "out")
    for i, price in enumerate([10, 10.3]):
        env = pe.StreamEnvironment(parallelism=1, monitoring=None)
        env.from_collection([{"price": price}] * 3).sink_to(pe.sinks.FileSink(out, format="parquet", mode="append"))
        env.execute(f"run-{i}")
    assert sorted(_read_dir(out).column("price").to_pylist()) == [10.0] * 3 + [10.3] * 3


def test_a_parquet_column_arrow_cannot_unify_is_refused_naming_it_and_both_types(tmp_path: Any) -> None:
    out = str(tmp_path / "out")
    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    env.from_collection([{"price": 10}] * 4).sink_to(pe.sinks.FileSink(out, format="parquet"))
    env.execute("ints")
    env = pe.StreamEnvironment(parallelism=1, restart_attempts=0, monitoring=None)
    env.from_collection([{"price": "ten"}] * 4).sink_to(pe.sinks.FileSink(out, format="parquet", mode="append"))
    with pytest.raises(pe.JobFailedError) as failed:
        env.execute("refused")
    message = str(failed.value)
    assert "RecordRejectedError" in message and "'price'" in message and "int64" in message and "string" in message


def test_a_rewrite_cut_short_is_finished_by_the_next_run(tmp_path: Any) -> None:
    """A crash between recording the wider type and rewriting the files: the record
    says so, and the next run rewrites what is left before it writes."""
    import json

    import pyarrow.parquet as pq

    out = tmp_path / "out"
    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    env.from_collection([{"price": 10}] * 3).sink_to(pe.sinks.FileSink(str(out), format="parquet"))
    env.execute("first")
    record = out / "_pyengine" / "schema.json"
    body = json.loads(record.read_text())
    (part,) = [p for p in out.iterdir() if p.name.startswith("part-")]
    # what a widening writer leaves when it dies after the record, before the rewrite
    pq.write_table(pa.table({"price": [1.5]}), str(out / ("part-" + "0" * 12 + "-0-1-0.parquet")))
    sink = pe.sinks.FileSink(str(out), format="parquet", mode="append")
    schema = pa.schema([("price", pa.float64())])
    sink._write_schema(*sink._fs(), schema, rewriting=True)
    assert body["columns"] == {"price": "int64"}
    env = pe.StreamEnvironment(parallelism=1, monitoring=None)
    env.from_collection([{"price": 2}]).sink_to(sink)
    env.execute("second")
    assert pq.read_schema(str(part)).field("price").type == pa.float64()
    assert sorted(_read_dir(str(out)).column("price").to_pylist()) == [1.5, 2.0, 10.0, 10.0, 10.0]
    assert json.loads(record.read_text())["rewriting"] is False


# -- DeltaSink: one type per column, refused by name (issue #37, item 4) ---------------------------


@pytest.mark.parametrize("as_batches", [True, False])
def test_delta_refuses_fractions_after_whole_numbers_saying_deltasink_and_both_types(
    tmp_path: Any, as_batches: bool
) -> None:
    pytest.importorskip("deltalake")
    from pyengine.sinks import RecordRejectedError, RunInfo

    sink = pe.sinks.DeltaSink(str(tmp_path / "t"))
    sink.begin_run(RunInfo(job_name="j", run_id="r1", lineage_id="r1"))
    sink.recover(())

    def records(price: Any) -> Any:
        rows = [{"k": 1, "price": price}]
        return pa.RecordBatch.from_pylist(rows) if as_batches else rows

    sink.stage(0, 1, records(10))
    sink.commit(0, 1)
    with pytest.raises(RecordRejectedError) as refused:
        sink.stage(0, 2, records(10.3))
    message = str(refused.value)
    assert message.startswith("DeltaSink") and "FileSink cannot" not in message, message
    assert "'price'" in message and "int64" in message and ("double" in message or "10.3" in message), message
    assert sink.read_table().column("price").to_pylist() == [10]  # nothing truncated went in


# -- joins' projected columns --------------------------------------------------------------------


def _join_inputs(env: pe.StreamEnvironment) -> Any:
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(100).with_timestamp_assigner("ts")
    orders = [{"user": i % 3, "ts": i * 10, "price": 10 if i < 40 else 10.3} for i in range(80)]
    pays = [{"user": i % 3, "ts": i * 10 + 5, "paid": 5 if i < 40 else 5.5} for i in range(80)]
    return env.from_collection(orders, watermark_strategy=strategy), env.from_collection(
        pays, watermark_strategy=strategy
    )


@pytest.mark.parametrize("parallelism", [1, 2])
@pytest.mark.parametrize("kind", ["interval", "window"])
def test_a_projected_join_widens_whole_numbers_to_fractions(parallelism: int, kind: str) -> None:
    """Before: ``ArrowInvalid: Schema at index 0 was different`` (int64 vs double)."""
    env = pe.StreamEnvironment(parallelism=parallelism, buffer_size=8, buffer_timeout_ms=1, monitoring=None)
    orders, pays = _join_inputs(env)
    sink = pe.sinks.CollectSink()
    if kind == "interval":
        joined = orders.key_by("user").interval_join(pays.key_by("user")).between(0, 9)
        joined.project(left=["price"], right=["paid"]).sink_to(sink)
    else:
        joined = orders.join(pays).where("user").equal_to("user").window(pe.windows.tumbling(400))
        joined.project(left=["price"], right=["paid"]).sink_to(sink)
    env.execute("join-widening")
    prices = sorted(r["price"] for r in sink.records)
    assert set(prices) == {10, 10.3} and 10.3 in prices
    if kind == "interval":  # each order pairs with the payment 5 ms after it
        assert sorted((r["price"], r["paid"]) for r in sink.records) == sorted([(10, 5)] * 40 + [(10.3, 5.5)] * 40)


@pytest.mark.parametrize("kind", ["heap", "incremental"])
def test_a_rescaled_restore_of_int64_and_float64_halves_reads_one_float64_state(tmp_path: Any, kind: str) -> None:
    """At p=2 one subtask saw whole numbers only (its sums int64), the other fractions
    (float64); restored at p=1 both files meet in one state: every value, as float64,
    in columns again (the operator unifies the subtasks' schemas, ``unified_schema``)."""
    from pyengine.runtime.aggregate import unified_schema, value_state
    from pyengine.state import key_group_range_for_subtask
    from pyengine.state.keygroups import assign_to_key_group

    storage = checkpoint_storage(str(tmp_path), "job")
    handles = []
    want = {}
    for subtask, (arrow_type, value) in enumerate([(pa.int64(), 7), (pa.float64(), 7.5)]):
        r = key_group_range_for_subtask(16, 2, subtask)
        b = create_keyed_backend(kind, max_parallelism=16, key_group_range=r)
        state = b.get_state(ValueStateDescriptor("sum(price)", 0, arrow_type))
        for k in range(200):
            if r.start <= assign_to_key_group(k, 16) <= r.end:
                b.set_current_key(k)
                state.update(value)
                want[k] = float(value)
        handles += b.snapshot(1, storage.location(1)).run().handles
    restored = create_keyed_backend(kind, max_parallelism=16)
    restored.restore(handles)
    schema = unified_schema("op", pa.schema([("price", pa.int64())]), pa.schema([("price", pa.float64())]), ["price"])
    assert schema.field("price").type == pa.float64()
    state = value_state(restored, ValueStateDescriptor("sum(price)", 0, pa.float64()))
    keys = np.arange(200, dtype=np.int64)
    found, values = state.get_many(keys)  # columnar again: get_many works
    assert found.all() and values.tolist() == [want[k] for k in range(200)]


def test_a_part_file_deleted_while_it_is_rewritten_is_not_brought_back(tmp_path: Any, monkeypatch: Any) -> None:
    """A widening rewrites a part file through a temp file moved over it; a ``recover()``
    that deleted the part meanwhile (it came after the restore point) must win, or the
    part's records would be there twice once the run replays them."""
    import pyarrow.fs as pafs
    import pyarrow.parquet as pq

    from pyengine.connectors import filesink

    path = str(tmp_path / "part-x.parquet")
    pq.write_table(pa.table({"price": pa.array([10, 11], pa.int64())}), path)
    real_write = pq.write_table

    def write_then_lose_the_part(table: Any, where: Any, **kwargs: Any) -> None:
        real_write(table, where, **kwargs)
        os.remove(path)  # what a concurrent recover() does

    monkeypatch.setattr(filesink.pq, "write_table", write_then_lose_the_part)
    with pytest.raises(FileNotFoundError):
        filesink._rewrite_part(pafs.LocalFileSystem(), path, pa.schema([("price", pa.float64())]), "test")
    assert os.listdir(tmp_path) == [], "neither the part nor its temp file is left"


def test_recover_waits_for_a_widening_that_holds_the_schema_guard(tmp_path: Any) -> None:
    """``recover()`` deletes part files under the guard a widening holds while it rewrites
    them, so the two never interleave."""
    import pyarrow.fs as pafs

    from pyengine.connectors.base import RunInfo
    from pyengine.connectors.filesink import META_DIR
    from pyengine.storage.filesystem import guarded

    out = tmp_path / "out"
    sink = pe.sinks.FileSink(str(out), format="parquet")
    sink.begin_run(RunInfo(job_name="j", run_id="r1", lineage_id="r1"))
    recovered = threading.Event()
    guard = str(out / META_DIR / ".schema-guard")
    os.makedirs(os.path.dirname(guard), exist_ok=True)
    with guarded(pafs.LocalFileSystem(), guard):
        worker = threading.Thread(target=lambda: (sink.recover(()), recovered.set()), daemon=True)
        worker.start()
        assert not recovered.wait(0.3), "recover() ran while a widening held the guard"
    assert recovered.wait(10)
    sink.end_run("FINISHED")
