"""``key_by(col).aggregate(pe.agg...)``, Arrow batches through the pipeline, and ``read_files``;
the update stream's ``_seq`` and ``emit="final"`` (issue 11, "an update stream with no final answer")."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Dict, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pyengine as pe
from pyengine.errors import is_non_retryable

AGGS = (pe.agg.count(), pe.agg.sum("v"), pe.agg.min("v"), pe.agg.max("v"), pe.agg.mean("v"), pe.agg.count("v"))


def reference(rows: List[Dict[str, Any]]) -> Dict[Any, Dict[str, Any]]:
    """The aggregates per key, computed the plain way."""
    values: Dict[Any, List[Any]] = defaultdict(list)
    counts: Dict[Any, int] = defaultdict(int)
    for r in rows:
        counts[r["k"]] += 1
        if r["v"] is not None:
            values[r["k"]].append(r["v"])
    out = {}
    for k, n in counts.items():
        vs = values[k]
        out[k] = {
            "count": n,
            "sum_v": sum(vs) if vs else 0,
            "min_v": min(vs) if vs else None,
            "max_v": max(vs) if vs else None,
            "mean_v": sum(vs) / len(vs) if vs else None,
            "count_v": len(vs),
        }
    return out


def final_rows(records: List[Dict[str, Any]]) -> Dict[Any, Dict[str, Any]]:
    """The update with the largest ``_seq`` per key is its final value (the output is an
    updating stream); ``_seq`` grows from one row of a key to the next, in any order of
    the rows (they may come back from files in another order)."""
    rows: Dict[Any, List[Dict[str, Any]]] = defaultdict(list)
    for r in records:
        rows[r["k"]].append(r)
    last: Dict[Any, Dict[str, Any]] = {}
    for k, updates in rows.items():
        updates.sort(key=lambda r: r["_seq"])
        seqs = [r["_seq"] for r in updates]
        assert len(set(seqs)) == len(seqs), (k, seqs)  # one row per update, none twice
        counts = [r["count"] for r in updates]
        assert counts == sorted(counts) and len(set(counts)) == len(counts), (k, counts)  # each adds rows
        last[k] = {c: updates[-1][c] for c in updates[-1] if c not in ("k", "_seq")}
    return last


def execute(env: pe.StreamEnvironment, name: str) -> Any:
    """The job's result, FINISHED or FAILED (``execute`` raises ``JobFailedError`` on failure
    in newer versions; the result rides on it)."""
    try:
        return env.execute(name)
    except Exception as exc:
        result = getattr(exc, "result", None)
        if result is None:
            raise
        return result


def assert_close(got: Dict[Any, Dict[str, Any]], want: Dict[Any, Dict[str, Any]]) -> None:
    assert got.keys() == want.keys()
    for k, w in want.items():
        for col, value in w.items():
            g = got[k][col]
            if isinstance(value, float) and g is not None:
                assert g == pytest.approx(value, rel=1e-9, abs=1e-9), (k, col)
            else:
                assert g == value, (k, col, g, value)


def run(rows_or_table: Any, *, parallelism: int = 2, buffer_size: int = 64, emit: str = "updates", **kw: Any) -> Any:
    env = pe.StreamEnvironment(parallelism=parallelism, buffer_size=buffer_size, buffer_timeout_ms=1, **kw)
    sink = pe.sinks.CollectSink()
    options = {} if emit == "updates" else {"emit": emit}
    env.from_collection(rows_or_table).key_by("k").aggregate(*AGGS, **options).uid("agg").sink_to(sink)
    return execute(env, "aggregate")


rows_strategy = st.lists(
    st.fixed_dictionaries(
        {
            "k": st.integers(-(2**62), 2**62) | st.sampled_from([0, 1, 2, 3]),
            "v": st.none() | st.integers(-1000, 1000),
        }
    ),
    min_size=1,
    max_size=300,
)


@settings(max_examples=30, deadline=None)
@given(rows=rows_strategy, parallelism=st.integers(1, 3))
def test_aggregate_of_int_keys_equals_the_plain_computation(rows, parallelism) -> None:
    result = run(
        pa.Table.from_pylist(rows, schema=pa.schema([("k", pa.int64()), ("v", pa.int64())])), parallelism=parallelism
    )
    assert result.status == "FINISHED", result.cause
    assert_close(final_rows(result.records), reference(rows))


@settings(max_examples=15, deadline=None)
@given(
    rows=st.lists(
        st.fixed_dictionaries({"k": st.sampled_from(["a", "b", "ç", ""]), "v": st.none() | st.floats(-1e6, 1e6)}),
        min_size=1,
        max_size=200,
    )
)
def test_aggregate_of_string_keys_takes_the_per_key_path_with_the_same_results(rows) -> None:
    result = run(pa.Table.from_pylist(rows, schema=pa.schema([("k", pa.string()), ("v", pa.float64())])))
    assert result.status == "FINISHED", result.cause
    assert_close(final_rows(result.records), reference(rows))


def test_aggregate_takes_records_that_are_dicts_too() -> None:
    rows = [{"k": i % 7, "v": i} for i in range(500)]
    result = run(rows)
    assert result.status == "FINISHED"
    assert_close(final_rows(result.records), reference(rows))


def test_aggregate_is_exactly_once_across_a_failure(tmp_path) -> None:
    """A failure after some checkpoints: the restored state plus the replayed input give
    the same totals as a run without it."""
    rng = np.random.default_rng(3)
    table = pa.table({"k": rng.integers(0, 50, 20_000), "v": rng.integers(0, 100, 20_000)})
    calls, lock = [0], threading.Lock()

    def flaky(batch: pa.RecordBatch) -> pa.RecordBatch:
        with lock:
            calls[0] += 1
            if calls[0] == 120:
                raise RuntimeError("injected")
        return batch

    env = pe.StreamEnvironment(
        parallelism=2,
        buffer_size=64,
        buffer_timeout_ms=1,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(tmp_path / "ckpt"),
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    env.from_collection(table).map_batches(flaky).key_by("k").aggregate(*AGGS).uid("agg").sink_to(sink)
    result = env.execute("agg-failover")
    assert result.status == "FINISHED" and result.restarts == 1
    assert result.checkpoints.counts["completed"] >= 2
    # final_rows also checks that _seq went on after the restore: no number twice for a key
    assert_close(final_rows(sink.read_committed()), reference(table.to_pylist()))


def test_read_files_reads_every_row_once_and_resumes_by_file_and_row(tmp_path) -> None:
    rng = np.random.default_rng(0)
    data = tmp_path / "data"
    data.mkdir()
    tables = []
    for i in range(3):
        t = pa.table({"k": rng.integers(0, 20, 3000), "v": rng.integers(0, 9, 3000)})
        pq.write_table(t, data / f"part-{i}.parquet", row_group_size=700)
        tables.append(t)
    fails = [True]

    def once(batch: pa.RecordBatch) -> pa.RecordBatch:
        if fails[0] and batch.num_rows and int(batch.column("v")[0].as_py()) == 7:
            fails[0] = False
            raise RuntimeError("injected")
        return batch

    env = pe.StreamEnvironment(
        parallelism=2,
        buffer_size=256,
        buffer_timeout_ms=1,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(tmp_path / "ckpt"),
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    env.read_files(str(data)).map_batches(once).sink_to(sink)
    result = env.execute("read")
    assert result.status == "FINISHED", result.cause
    got = sorted((r["k"], r["v"]) for r in sink.read_committed())
    want = sorted((r["k"], r["v"]) for t in tables for r in t.to_pylist())
    assert got == want


def test_bad_aggregate_calls_say_what_is_wrong(tmp_path) -> None:
    env = pe.StreamEnvironment()
    keyed_by_function = env.from_collection([{"k": 1, "v": 2}]).key_by(lambda r: r["k"])
    with pytest.raises(TypeError, match="key_by\\('column'\\)"):
        keyed_by_function.aggregate(pe.agg.count())
    with pytest.raises(ValueError, match="at least one"):
        env.from_collection([{"k": 1}]).key_by("k").aggregate()
    with pytest.raises(ValueError, match="repeated"):
        env.from_collection([{"k": 1}]).key_by("k").aggregate(pe.agg.count(), pe.agg.count())
    with pytest.raises(ValueError, match="column name"):
        pe.agg.sum("")
    env = pe.StreamEnvironment()
    env.from_collection([{"k": 1, "v": "text"}]).key_by("k").aggregate(pe.agg.sum("v")).sink_to(pe.sinks.CollectSink())
    result = execute(env, "bad-column")
    assert result.status == "FAILED" and "numeric column" in str(result.cause)
    assert is_non_retryable(result.cause) and result.restarts == 0  # the same records would fail again
    env = pe.StreamEnvironment()
    env.from_collection([{"k": 1}]).key_by("k").aggregate(pe.agg.max("nope")).sink_to(pe.sinks.CollectSink())
    result = execute(env, "missing-column")
    assert result.status == "FAILED" and "'nope'" in str(result.cause)
    assert is_non_retryable(result.cause) and result.restarts == 0
    env = pe.StreamEnvironment()
    env.from_collection([{"k": None, "v": 1}, {"k": 2, "v": 1}]).key_by("k").aggregate(pe.agg.sum("v")).sink_to(
        pe.sinks.CollectSink()
    )
    result = execute(env, "null-key")
    assert result.status == "FAILED" and "null keys" in str(result.cause) and result.restarts == 0
    with pytest.raises(ValueError, match="no parquet files"):
        (tmp_path / "empty").mkdir()
        env.read_files(str(tmp_path / "empty"))


# -- the update stream's order, and emit="final" ------------------------------------------------


def test_updates_carry_a_seq_that_grows_per_key_in_the_order_they_are_emitted() -> None:
    rng = np.random.default_rng(5)
    table = pa.table({"k": rng.integers(0, 30, 5000), "v": rng.integers(0, 100, 5000)})
    result = run(table, parallelism=3)
    assert result.status == "FINISHED", result.cause
    assert all(type(r["_seq"]) is int and r["_seq"] >= 1 for r in result.records)
    last_seq: Dict[Any, int] = {}
    for r in result.records:  # a key's rows arrive from its one subtask, in order
        assert r["_seq"] > last_seq.get(r["k"], 0)
        last_seq[r["k"]] = r["_seq"]
    assert_close(final_rows(result.records), reference(table.to_pylist()))


@pytest.mark.parametrize("parallelism", [1, 2])
def test_emit_final_gives_each_key_once_with_its_totals(parallelism) -> None:
    rng = np.random.default_rng(6)
    table = pa.table({"k": rng.integers(-5, 40, 4000), "v": rng.integers(0, 100, 4000)})
    result = run(table, parallelism=parallelism, emit="final")
    assert result.status == "FINISHED", result.cause
    keys = [r["k"] for r in result.records]
    assert len(keys) == len(set(keys)) == 45
    assert all("_seq" not in r for r in result.records)
    assert_close({r["k"]: {c: r[c] for c in r if c != "k"} for r in result.records}, reference(table.to_pylist()))


def test_emit_final_of_string_keys_and_only_nulls() -> None:
    rows = [{"k": k, "v": v} for k, v in [("a", 1.5), ("b", None), ("a", None), ("ç", -2.0), ("b", None)]]
    table = pa.Table.from_pylist(rows, schema=pa.schema([("k", pa.string()), ("v", pa.float64())]))
    result = run(table, emit="final", buffer_size=2)
    assert result.status == "FINISHED", result.cause
    got = {r["k"]: {c: r[c] for c in r if c != "k"} for r in result.records}
    assert len(result.records) == 3
    assert_close(got, reference(rows))  # "b" saw only nulls: min/max/mean null, sum 0


def test_emit_final_is_exactly_once_across_a_failure_mid_way(tmp_path) -> None:
    rng = np.random.default_rng(8)
    table = pa.table({"k": rng.integers(0, 50, 20_000), "v": rng.integers(0, 100, 20_000)})
    calls, lock = [0], threading.Lock()

    def flaky(batch: pa.RecordBatch) -> pa.RecordBatch:
        with lock:
            calls[0] += 1
            if calls[0] == 150:
                raise RuntimeError("injected")
        return batch

    env = pe.StreamEnvironment(
        parallelism=2,
        buffer_size=64,
        buffer_timeout_ms=1,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(tmp_path / "ckpt"),
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    env.from_collection(table).map_batches(flaky).key_by("k").aggregate(*AGGS, emit="final").uid("agg").sink_to(sink)
    result = execute(env, "final-failover")
    assert result.status == "FINISHED", result.cause
    assert result.restarts == 1 and result.checkpoints.counts["completed"] >= 2
    out = sink.read_committed()
    assert sorted(r["k"] for r in out) == list(range(50))  # each key exactly once
    assert_close({r["k"]: {c: r[c] for c in r if c != "k"} for r in out}, reference(table.to_pylist()))


class FailsOnceAfterTheFinalRows(pe.sinks.CollectSink):
    """Fails the first commit of a checkpoint that holds rows: with emit="final" that is
    the checkpoint after the final rows, so the job restores from a state in which they
    were already sent."""

    def __init__(self) -> None:
        super().__init__()
        self.with_rows: set = set()
        self.fired = False

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        super().stage(subtask, checkpoint_id, records)
        if len(records):
            self.with_rows.add((subtask, checkpoint_id))

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        if not self.fired and any(s == subtask and c <= checkpoint_id for s, c in self.with_rows):
            self.fired = True
            raise RuntimeError("injected after the final rows were checkpointed")
        super().commit(subtask, checkpoint_id)


def test_emit_final_does_not_send_the_final_rows_again_after_a_restore_past_them(tmp_path) -> None:
    rng = np.random.default_rng(9)
    table = pa.table({"k": rng.integers(0, 20, 3000), "v": rng.integers(0, 100, 3000)})
    env = pe.StreamEnvironment(
        parallelism=2,
        buffer_size=64,
        buffer_timeout_ms=1,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(tmp_path / "ckpt"),
    )
    sink = FailsOnceAfterTheFinalRows()
    env.from_collection(table).key_by("k").aggregate(*AGGS, emit="final").uid("agg").sink_to(sink)
    result = execute(env, "final-after")
    assert result.status == "FINISHED", result.cause
    assert sink.fired and result.restarts == 1
    assert sorted(r["k"] for r in result.records) == list(range(20))
    assert_close({r["k"]: {c: r[c] for c in r if c != "k"} for r in result.records}, reference(table.to_pylist()))


@pytest.mark.parametrize(
    ("keys", "said"),
    [
        ([1, "1", 2, "2"], "holds keys of types int, str"),  # in one buffer: Arrow cannot make the column
        ([1, True, 2], "holds keys of types bool, int"),
        ([1] * 40 + [2.5], "was int64 and is now double"),  # a later buffer of another kind of key
        ([1, None], "null keys (None)"),
    ],
)
def test_keys_of_several_types_are_refused_by_name_with_the_way_out(keys: List[Any], said: str) -> None:
    """A vectorised aggregate keys an Arrow column of one type: keys of several types
    fail at once, naming the column, the types and what to do, not with Arrow's
    conversion error (nor, for an int key column that later holds floats, at the end)."""
    env = pe.StreamEnvironment(parallelism=1, buffer_size=8, restart_attempts=0, monitoring=None)
    env.from_collection([{"k": k} for k in keys]).key_by("k").aggregate(pe.agg.count(), emit="final").sink_to(
        pe.sinks.CollectSink()
    )
    with pytest.raises(pe.JobFailedError) as failed:
        env.execute("mixed-keys")
    message = str(failed.value)
    assert "AggregateInputError" in message and "'k'" in message and said in message, message
    assert "key_by(...).process" in message and failed.value.result.restarts == 0


def test_the_key_column_is_blamed_only_when_its_keys_make_no_column_and_the_fix_names_it() -> None:
    from pyengine.runtime.aggregate import AggregateInputError, check_key_type, not_a_table

    exc = ValueError("arrow said no")
    # keys of one type and None make a column: the values are what failed
    other = not_a_table("op", [{"user_id": 1, "v": 1}, {"user_id": None, "v": "x"}], "user_id", exc)
    assert "the records are not a table" in str(other) and "key column" not in str(other)
    mixed = not_a_table("op", [{"user_id": 1}, {"user_id": "1"}], "user_id", exc)
    assert "'user_id' holds keys of types int, str" in str(mixed)
    assert "{**r, 'user_id': str(r['user_id'])}" in str(mixed)  # the fix names the user's column
    with pytest.raises(AggregateInputError, match="null keys"):  # a buffer of None keys after int ones
        check_key_type("op", "k", pa.int64(), pa.RecordBatch.from_pylist([{"k": None}]))
