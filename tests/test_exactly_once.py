"""Exactly-once end to end: a keyed job with a FileSink, a failure injected at a
random point, and the committed output compared with a failure-free run; then
the run's latest checkpoint is read back.

State is written to files here, never inlined into ``_metadata`` (which 13 keys'
state otherwise always is): the incremental backend's deltas and bases go to
``shared/`` and are deleted as checkpoints are subsumed, so the runs exercise the
shared-file lifecycle that a completed checkpoint's restorability depends on."""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from typing import Any, Dict, List, Tuple

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chaos import Chaos, FlakyFiles

import pyengine as pe
import pyengine.snapshot.strategies as strategies_module
import pyengine.state.incremental as incremental_module
from pyengine.errors import JobFailedError
from pyengine.state import ValueStateDescriptor
from pyengine.state.heap import HeapKeyedStateBackend
from pyengine.state.incremental import IncrementalKeyedStateBackend
from pyengine.state.reader import read_keyed_state
from pyengine.storage.metadata import load_metadata
from pyengine.storage.store import stream_paths

COUNT = ValueStateDescriptor("count", 0, pa.int64())
N = 3000
RECORDS = [{"user": i % 13, "v": i} for i in range(N)]
FINAL_COUNTS = dict(Counter(r["user"] for r in RECORDS))


@pytest.fixture(autouse=True)
def state_in_files(monkeypatch) -> None:
    """Keyed state goes to files (shared/ for incremental, chk-<n>/ for heap), not
    inline into _metadata."""
    for module in (incremental_module, strategies_module):
        monkeypatch.setattr(module, "INLINE_THRESHOLD", 0)


def check_latest_checkpoint(result: Any, where: str, *, exact: bool = True) -> None:
    """The run's latest checkpoint restores: every file it uses is there, and its
    keyed state reads back - as every user's final count when ``exact`` (an
    at-least-once checkpoint's state may count a record twice)."""
    assert result.latest_checkpoint is not None, f"{where}: no checkpoint completed"
    metadata = load_metadata(result.latest_checkpoint)
    paths = stream_paths(metadata)
    missing = [p for p in paths if not os.path.exists(p)]
    assert not missing, f"{where}: checkpoint {metadata.checkpoint_id} uses missing files {missing[:3]}"
    table = read_keyed_state(result.latest_checkpoint, "counter", "count")
    counts = dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist(), strict=True))
    assert counts.keys() == FINAL_COUNTS.keys(), f"{where}: checkpoint {metadata.checkpoint_id} lost keys"
    if exact:
        assert counts == FINAL_COUNTS, f"{where}: checkpoint {metadata.checkpoint_id} holds other counts"


class Count(pe.KeyedProcessFunction):
    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos

    def __deepcopy__(self, memo: Any) -> Count:
        return Count(self.chaos)  # one chaos for every subtask and attempt

    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        self.chaos.hit("user")
        if value["v"] % 32 == 0:
            # A run long enough for a few checkpoints before its final one (the last since no
            # checkpoint starts after it): a failure at the third commit or snapshot happens.
            time.sleep(0.001)
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "n": n, "v": value["v"]}


class ChaosSink(pe.sinks.FileSink):
    def __init__(self, path: str, chaos: Chaos, format: str = "jsonl") -> None:
        super().__init__(path, format=format)
        self.chaos = chaos

    def commit(self, subtask: int, checkpoint_id: int) -> None:
        self.chaos.hit("commit")
        super().commit(subtask, checkpoint_id)


def run(
    tmp_path, chaos: Chaos, *, backend: str, mode: str, unaligned: bool, tag: str, files: Any = None
) -> Tuple[Any, List[Any]]:
    """The job over ``RECORDS``: from a collection, or with ``files`` (a ``FlakyFiles``)
    read from parquet files through its filesystem, whose reads may fail."""
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=5, mode=mode, unaligned=unaligned),
        state_backend=backend,
        checkpoint_storage=str(tmp_path / f"ckpt-{tag}"),
        buffer_size=64,
        buffer_timeout_ms=1,
        restart_attempts=3,
        channel_capacity=4,
    )
    sink = ChaosSink(str(tmp_path / f"out-{tag}"), chaos)
    if files is not None:
        source = env.read_files(write_parquet(tmp_path / f"in-{tag}"), filesystem=files.filesystem())
        files.arm()
    else:
        source = env.from_collection(RECORDS)
    (
        source.map(lambda r: r)
        .key_by("user")
        .process(Count(chaos))
        .uid("counter")
        .map(lambda r: r)
        .rebalance()
        .map(lambda r: r)
        .sink_to(sink)
    )
    result = env.execute(f"exactly-once-{tag}")
    return result, sink.read_committed()


def write_parquet(root: Any) -> str:
    """``RECORDS`` as 3 parquet files of 4 row groups each: 12 splits, a read or more each."""
    os.makedirs(root)
    table = pa.Table.from_pylist(RECORDS)
    third = N // 3
    for k in range(3):
        pq.write_table(table.slice(k * third, third), f"{root}/part-{k}.parquet", row_group_size=third // 4)
    return str(root)


def pairs(records: List[Any]) -> Counter:
    return Counter((r["user"], r["n"]) for r in records)


@pytest.fixture(scope="module")
def expected() -> Counter:
    per_user = Counter(r["user"] for r in RECORDS)
    return Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})


def _snapshot_chaos(monkeypatch, chaos: Chaos, backend: type = HeapKeyedStateBackend) -> None:
    """A failure in the asynchronous part of the keyed state's snapshot."""
    original = backend.snapshot

    def snapshot(self, checkpoint_id, location):
        inner = original(self, checkpoint_id, location)
        real_run = inner.run

        def run_async():
            chaos.hit("async")
            return real_run()

        inner.run = run_async
        return inner

    monkeypatch.setattr(backend, "snapshot", snapshot)


def _notify_chaos(monkeypatch, chaos: Chaos) -> None:
    """A crash after a checkpoint completed and before any subtask heard of it."""
    from pyengine.runners.local import LocalRunner

    original = LocalRunner.notify_complete

    def notify_complete(self, task, checkpoint_id):
        try:
            chaos.hit("notify")
        except RuntimeError as exc:
            self.fail_job(exc)
            return
        original(self, task, checkpoint_id)

    monkeypatch.setattr(LocalRunner, "notify_complete", notify_complete)


POINTS = ("user", "async", "notify", "commit")


def _case(seed: int) -> Tuple[str, str, bool, int]:
    """(failure point, backend, unaligned, at): every combination recurs every 16 seeds."""
    point = POINTS[seed % 4]
    backend = ("heap", "incremental")[(seed // 4) % 2]
    unaligned = (seed // 8) % 2 == 1
    at = random.Random(seed).randint(1, N if point == "user" else 3)
    return point, backend, unaligned, at


def _run_case(tmp_path, monkeypatch, seed: int, mode: str) -> Tuple[Any, List[Any], Chaos, str]:
    point, backend, unaligned, at = _case(seed)
    chaos = Chaos(point, at=at)
    if point == "async":
        backend_class = IncrementalKeyedStateBackend if backend == "incremental" else HeapKeyedStateBackend
        _snapshot_chaos(monkeypatch, chaos, backend_class)
    elif point == "notify":
        _notify_chaos(monkeypatch, chaos)
    result, out = run(tmp_path, chaos, backend=backend, mode=mode, unaligned=unaligned, tag=str(seed))
    where = f"seed {seed}: failure at {point} #{at} (fired={chaos.fired}), {backend}, unaligned={unaligned}"
    return result, out, chaos, where


SEEDS = int(os.environ.get("PYENGINE_EXACTLY_ONCE_SEEDS", "112"))


@pytest.mark.parametrize("seed", range(SEEDS))
def test_committed_output_equals_the_failure_free_output(tmp_path, monkeypatch, expected, seed) -> None:
    result, out, chaos, where = _run_case(tmp_path, monkeypatch, seed, "exactly_once")
    assert result.status == "FINISHED", f"{where}: {result.cause}"
    assert pairs(out) == expected, where
    assert chaos.fired, f"{where}: the failure was never injected, so this run tested nothing"
    assert result.restarts >= 1, where
    check_latest_checkpoint(result, where)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SEEDS, SEEDS + 400))
def test_committed_output_equals_the_failure_free_output_soak(tmp_path, monkeypatch, expected, seed) -> None:
    test_committed_output_equals_the_failure_free_output(tmp_path, monkeypatch, expected, seed)


def _read_error_case(tmp_path, monkeypatch, seed: int) -> None:
    """A file source whose ``at``-th read fails once (an object store's transient
    error); odd seeds also fail once at one of the other points. Either backend,
    aligned or not."""
    point, backend, unaligned, other = _case(seed)
    at = random.Random(10_000 + seed).randint(1, READS)
    chaos = Chaos(point, at=other) if seed % 2 else Chaos([])
    if seed % 2 and point == "async":
        backend_class = IncrementalKeyedStateBackend if backend == "incremental" else HeapKeyedStateBackend
        _snapshot_chaos(monkeypatch, chaos, backend_class)
    elif seed % 2 and point == "notify":
        _notify_chaos(monkeypatch, chaos)
    files = FlakyFiles(str(tmp_path / "read-failed"), at)
    tag = f"read-{seed}"
    result, out = run(tmp_path, chaos, backend=backend, mode="exactly_once", unaligned=unaligned, tag=tag, files=files)
    also = f", then {point} #{other} (fired={chaos.fired})" if seed % 2 else ""
    where = f"seed {seed}: read #{at} fails{also}, {backend}, unaligned={unaligned}"
    assert result.status == "FINISHED", f"{where}: {result.cause}"
    assert files.fired(), f"{where}: the read error was never injected, so this run tested nothing"
    assert result.restarts >= 1, where
    assert pairs(out) == expected_pairs(), where
    check_latest_checkpoint(result, where)


READS = 12  # write_parquet's row groups: a job reads at least one chunk of each
READ_SEEDS = int(os.environ.get("PYENGINE_READ_ERROR_SEEDS", "4"))


def expected_pairs() -> Counter:
    per_user = Counter(r["user"] for r in RECORDS)
    return Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})


@pytest.mark.parametrize("seed", range(READ_SEEDS))
def test_transient_read_errors_in_a_file_source_stay_exactly_once(tmp_path, monkeypatch, seed) -> None:
    _read_error_case(tmp_path, monkeypatch, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(READ_SEEDS, READ_SEEDS + 100))
def test_transient_read_errors_in_a_file_source_stay_exactly_once_soak(tmp_path, monkeypatch, seed) -> None:
    _read_error_case(tmp_path, monkeypatch, seed)


@pytest.mark.parametrize("seed", [s for s in range(32) if not _case(s)[2]])  # unaligned needs exactly-once
def test_at_least_once_may_duplicate_but_never_loses(tmp_path, monkeypatch, expected, seed) -> None:
    result, out, chaos, where = _run_case(tmp_path, monkeypatch, seed, "at_least_once")
    assert result.status == "FINISHED", f"{where}: {result.cause}"
    got = pairs(out)
    assert all(got[p] >= 1 for p in expected), f"{where}: lost {sorted(p for p in expected if not got[p])[:5]}"
    assert chaos.fired, where
    check_latest_checkpoint(result, where, exact=False)


def test_a_job_that_keeps_failing_returns_failed_with_the_cause(tmp_path) -> None:
    env = pe.StreamEnvironment(parallelism=2, restart_attempts=2)

    def boom(r: Any) -> Any:
        raise ValueError("bad record")

    env.from_collection(range(10)).map(boom).name("parse").sink_to(pe.sinks.CollectSink())
    with pytest.raises(JobFailedError) as info:
        env.execute("failing")
    result = info.value.result
    assert result.status == "FAILED" and result.restarts == 2
    assert isinstance(info.value.cause, ValueError)
    assert "parse" in str(result.cause) and "subtask" in str(result.cause) and "bad record" in str(result.cause)


class SlowFileSink(pe.sinks.FileSink):
    """Staging takes a while: the job runs backpressured."""

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        import time

        time.sleep(0.002)
        super().stage(subtask, checkpoint_id, records)


@pytest.mark.parametrize("seed", range(4))
def test_unaligned_under_backpressure_persists_output_in_flight_and_stays_exact(
    tmp_path, monkeypatch, expected, seed
) -> None:
    """Backpressured tasks let unaligned barriers overtake their waiting output, which
    the checkpoint persists and a restore sends again: still exactly once."""
    chaos = Chaos("user", at=random.Random(seed).randint(N // 3, 2 * N // 3))
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=5, unaligned=True),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=16,
        buffer_timeout_ms=1,
        channel_capacity=2,
        restart_attempts=2,
    )
    sink = SlowFileSink(str(tmp_path / "out"))
    persisted: List[int] = []
    from pyengine.runtime.task import StreamTask

    write = StreamTask._write_channel_state

    def counting(self, checkpoint_id, inputs, outputs):
        persisted.append(len(inputs) + len(outputs))
        return write(self, checkpoint_id, inputs, outputs)

    monkeypatch.setattr(StreamTask, "_write_channel_state", counting)

    def watch(r: Any) -> Any:
        return r

    (
        env.from_collection(RECORDS)
        .map(watch)
        .key_by("user")
        .process(Count(chaos))
        .uid("counter")
        .rebalance()
        .map(watch)
        .sink_to(sink)
    )
    result = env.execute("backpressured")
    assert result.status == "FINISHED", result.cause
    assert result.restarts == 1 and chaos.fired
    assert pairs(sink.read_committed()) == expected
    assert any(p > 0 for p in persisted), "no checkpoint had data in flight: the test did not test that"


# -- the soak with a column of whole numbers that later holds fractions (issue #37) ------------------------

# Whole prices first, then fractions of a power of two: every sum is exact in float64 whatever the
# order of the additions, so the committed totals compare exactly with the plain computation.
PRICED = [{"user": i % 13, "v": i, "price": i % 7 if i < N // 2 else i % 7 + 0.25 * (1 + i % 3)} for i in range(N)]


class Hit:
    """An identity map that is a failure point (``user``), one chaos for every subtask."""

    def __init__(self, chaos: Chaos) -> None:
        self.chaos = chaos

    def __deepcopy__(self, memo: Any) -> Hit:
        return Hit(self.chaos)

    def __call__(self, r: Any) -> Any:
        self.chaos.hit("user")
        return r


def priced_expected() -> Dict[int, Tuple[float, float, float, int]]:
    out: Dict[int, List[float]] = {}
    for r in PRICED:
        out.setdefault(r["user"], []).append(r["price"])
    return {u: (sum(p), max(p), min(p), len(p)) for u, p in out.items()}


def run_priced(tmp_path, chaos: Chaos, *, backend: str, unaligned: bool, parallelism: int, tag: str) -> Any:
    """Keyed aggregates over the prices into a parquet FileSink (failure points at its
    commits), and the records themselves into another: both directories must read back
    as one table (``pq.read_table``), the aggregates exact."""
    env = pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=5, unaligned=unaligned),
        state_backend=backend,
        checkpoint_storage=str(tmp_path / f"ckpt-{tag}"),
        buffer_size=32,
        buffer_timeout_ms=1,
        restart_attempts=3,
        channel_capacity=4,
    )
    totals = ChaosSink(str(tmp_path / f"totals-{tag}"), chaos, format="parquet")
    rows = pe.sinks.FileSink(str(tmp_path / f"rows-{tag}"), format="parquet")
    priced = env.from_collection(PRICED).map(Hit(chaos))
    aggs = (pe.agg.sum("price"), pe.agg.max("price"), pe.agg.min("price"), pe.agg.count())
    priced.key_by("user").aggregate(*aggs).uid("agg").sink_to(totals)
    priced.rebalance().map(lambda r: r).sink_to(rows)
    return env.execute(f"priced-{tag}")


def check_priced(tmp_path, tag: str, where: str, rows: bool = True) -> None:
    import pyarrow.parquet as pq

    updates = pq.read_table(str(tmp_path / f"totals-{tag}")).to_pylist()  # fails on int64 and double parts
    last: Dict[int, Dict[str, Any]] = {}
    for u in updates:
        if u["user"] not in last or u["_seq"] > last[u["user"]]["_seq"]:
            last[u["user"]] = u
    seqs = Counter((u["user"], u["_seq"]) for u in updates)
    assert max(seqs.values()) == 1, f"{where}: an update committed twice"
    got = {u: (r["sum_price"], r["max_price"], r["min_price"], r["count"]) for u, r in last.items()}
    assert got == priced_expected(), where
    if rows:
        table = pq.read_table(str(tmp_path / f"rows-{tag}"))
        assert table.schema.field("price").type == pa.float64(), where
        got_rows = Counter((r["v"], r["price"]) for r in table.to_pylist())
        assert got_rows == Counter((r["v"], r["price"]) for r in PRICED), where


PRICED_SEEDS = int(os.environ.get("PYENGINE_PRICED_SEEDS", "8"))


@pytest.mark.parametrize("seed", range(PRICED_SEEDS))
def test_ints_then_floats_stay_exact_and_readable_across_failures(tmp_path, monkeypatch, seed) -> None:
    point, backend, unaligned, _ = _case(seed)
    at = random.Random(seed).randint(1, N if point == "user" else 3)
    chaos = Chaos(point, at=at)
    if point == "async":
        _snapshot_chaos(
            monkeypatch, chaos, IncrementalKeyedStateBackend if backend == "incremental" else HeapKeyedStateBackend
        )
    elif point == "notify":
        _notify_chaos(monkeypatch, chaos)
    parallelism = 1 + seed % 2
    result = run_priced(tmp_path, chaos, backend=backend, unaligned=unaligned, parallelism=parallelism, tag=str(seed))
    where = f"seed {seed}: failure at {point} #{at} (fired={chaos.fired}), {backend}, unaligned={unaligned}"
    where += f", parallelism {parallelism}"
    assert result.status == "FINISHED", f"{where}: {result.cause}"
    assert chaos.fired and result.restarts >= 1, where
    check_priced(tmp_path, str(seed), where)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(PRICED_SEEDS, PRICED_SEEDS + 100))
def test_ints_then_floats_stay_exact_and_readable_across_failures_soak(tmp_path, monkeypatch, seed) -> None:
    test_ints_then_floats_stay_exact_and_readable_across_failures(tmp_path, monkeypatch, seed)
