"""Sources: the order a key's records arrive in (issue 11, "per-key order"), and the
``Source`` contract's "nothing now" against "end of split" (issue 11, "a source's short
read ends its split")."""

from __future__ import annotations

import threading
from collections import Counter, defaultdict
from typing import Any, Dict, List, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pyengine as pe
from pyengine.connectors.base import Source
from pyengine.connectors.collection import CollectionSource, GeneratorSource
from pyengine.connectors.files import FileSource
from pyengine.errors import NonRetryableError
from pyengine.runtime.base import OperatorContext
from pyengine.runtime.sources import SourceOperator
from pyengine.state import ValueStateDescriptor

LAST = ValueStateDescriptor("last", -1, pa.int64())


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


class RecordOrder(pe.KeyedProcessFunction):
    """Emits (key, seq, in order?) per record: in order when seq exceeds the key's last one."""

    def open(self, ctx: Any) -> None:
        self.last = ctx.get_state(LAST)

    def process_element(self, value: Any, ctx: Any) -> Any:
        seq = value["seq"]
        ok = seq > self.last.value()
        self.last.update(seq)
        yield {"key": ctx.current_key, "seq": seq, "ok": ok}


def collection(n: int, keys: int) -> List[Dict[str, int]]:
    rng = np.random.default_rng(7)
    return [{"key": int(k), "seq": i} for i, k in enumerate(rng.integers(0, keys, n))]


def ordered_run(records: Any, parallelism: int, **kw: Any) -> List[Dict[str, Any]]:
    env = pe.StreamEnvironment(parallelism=parallelism, buffer_size=16, buffer_timeout_ms=1, **kw)
    sink = pe.sinks.CollectSink()
    env.from_collection(records).key_by("key").process(RecordOrder()).sink_to(sink)
    result = execute(env, f"order-p{parallelism}")
    assert result.status == "FINISHED", result.cause
    return list(result.records)


# -- per-key order -------------------------------------------------------------------------


@pytest.mark.parametrize("parallelism", [2, 4])
@pytest.mark.parametrize("arrow", [False, True], ids=["list", "arrow"])
def test_a_keyed_function_sees_each_keys_records_in_collection_order(parallelism: int, arrow: bool) -> None:
    records = collection(6000, 37)
    out = ordered_run(pa.Table.from_pylist(records) if arrow else records, parallelism)
    assert len(out) == len(records)
    assert all(r["ok"] for r in out), [r for r in out if not r["ok"]][:5]
    seen: Dict[int, List[int]] = defaultdict(list)
    for r in sorted(out, key=lambda r: r["seq"]):
        seen[r["key"]].append(r["seq"])
    want: Dict[int, List[int]] = defaultdict(list)
    for r in records:
        want[r["key"]].append(r["seq"])
    assert seen == want


def test_per_key_order_holds_across_a_restore(tmp_path) -> None:
    """A failure mid-way at parallelism 3 with checkpoints: every key still sees its
    records in order, each once (the split that reads the collection is restored to its row)."""
    records = collection(4000, 11)
    fired, lock = [False], threading.Lock()

    def once(r: Any) -> Any:
        with lock:
            if r["seq"] == 2500 and not fired[0]:
                fired[0] = True
                raise RuntimeError("injected")
        return r

    env = pe.StreamEnvironment(
        parallelism=3,
        buffer_size=16,
        buffer_timeout_ms=1,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(tmp_path / "ckpt"),
    )
    sink = pe.sinks.CollectSink()
    env.from_collection(records).map(once).key_by("key").process(RecordOrder()).sink_to(sink)
    result = execute(env, "order-restore")
    assert result.status == "FINISHED", result.cause
    assert fired[0] and result.restarts == 1
    assert sorted(r["seq"] for r in result.records) == list(range(len(records)))
    assert all(r["ok"] for r in result.records)


def test_collection_source_is_read_by_subtask_0_in_order() -> None:
    source = CollectionSource(list(range(10)))
    assert source.read(1, 2, 0, 4) is None and source.read(3, 4, 0, 4) is None
    assert source.read(0, 2, 0, 4) == [0, 1, 2, 3]
    assert source.read(0, 2, 8, 4) == [8, 9]
    assert source.read(0, 2, 10, 4) is None
    table = pa.Table.from_batches(
        [pa.record_batch({"x": list(range(0, 5))}), pa.record_batch({"x": list(range(5, 12))})]
    )
    source = CollectionSource(table)
    assert source.schema == table.schema
    got: List[int] = []
    position = 0
    while (batch := source.read(0, 4, position, 4)) is not None:
        assert isinstance(batch, pa.RecordBatch)
        got.extend(batch.column("x").to_pylist())
        position += batch.num_rows
    assert got == list(range(12))
    assert CollectionSource(pa.table({"x": pa.array([], pa.int64())})).read(0, 1, 0, 4) is None


def test_a_checkpoint_of_the_round_robin_collection_source_is_refused() -> None:
    with pytest.raises(NonRetryableError, match="older pyengine"):
        CollectionSource(list(range(10))).read(1, 2, 3, 4)


def test_every_source_says_what_order_it_keeps() -> None:
    for cls in (CollectionSource, FileSource, GeneratorSource):
        assert "Ordering:" in (cls.__doc__ or ""), cls


def test_generator_and_file_sources_end_their_splits_with_none(tmp_path) -> None:
    gen = GeneratorSource(lambda i: i, 5)
    assert gen.read(1, 2, 0, 10) == [1, 3] and gen.read(1, 2, 2, 10) is None
    pq.write_table(pa.table({"x": list(range(10))}), tmp_path / "a.parquet")
    files = FileSource(str(tmp_path))
    assert files.read(0, 1, 0, 8).num_rows == 8
    assert files.read(0, 1, 8, 8).num_rows == 2
    assert files.read(0, 1, 10, 8) is None
    assert files.read(1, 2, 0, 8) is None  # one split, read by subtask 0


# -- "nothing now" is not "end of split" ---------------------------------------------------


class Poller(Source):
    """A split of ``total`` numbers per source subtask that arrives in dribs: every read
    gives at most 7 (fewer than asked), and every third read gives nothing now; the
    split ends (None) only when all its numbers have been read. Deterministic by
    position, as the contract asks."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.calls = 0
        self.empty = 0
        self.lock = threading.Lock()

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Optional[List[int]]:
        mine = range(subtask, self.total, parallelism)
        if position >= len(mine):
            return None
        with self.lock:
            self.calls += 1
            if self.calls % 3 == 0:
                self.empty += 1
                return []
        return list(mine[position : position + min(n, 7)])


@pytest.mark.parametrize("parallelism", [1, 2])
def test_short_and_empty_reads_do_not_end_the_split(parallelism: int) -> None:
    poller = Poller(1000)
    env = pe.StreamEnvironment(parallelism=parallelism, buffer_size=50, buffer_timeout_ms=1)
    sink = pe.sinks.CollectSink()
    env.from_source(poller).sink_to(sink)
    result = execute(env, "poller")
    assert result.status == "FINISHED", result.cause
    assert sorted(result.records) == list(range(1000))  # all, each once
    assert poller.empty > 0


def test_a_poller_is_exactly_once_across_a_failure(tmp_path) -> None:
    poller = Poller(1000)
    fired, lock = [False], threading.Lock()

    def once(r: int) -> int:
        with lock:
            if r == 600 and not fired[0]:
                fired[0] = True
                raise RuntimeError("injected")
        return r

    env = pe.StreamEnvironment(
        parallelism=2,
        buffer_size=50,
        buffer_timeout_ms=1,
        checkpointing=pe.CheckpointConfig(interval_ms=5),
        checkpoint_storage=str(tmp_path / "ckpt"),
    )
    sink = pe.sinks.CollectSink()
    env.from_source(poller).map(once).sink_to(sink)
    result = execute(env, "poller-failover")
    assert result.status == "FINISHED", result.cause
    assert fired[0] and result.restarts == 1
    assert Counter(result.records) == Counter(range(1000))


def _operator(source: Source, splits: List[List[int]], waits: List[float]) -> SourceOperator:
    op = SourceOperator("src", "src", source)
    ctx = OperatorContext(
        job_name="t",
        subtask=0,
        parallelism=1,
        max_parallelism=128,
        state_backend="heap",
        local_recovery_dir=None,
        attempt=0,
    )
    op.setup(ctx, None)
    op.splits = splits
    op.exhausted = False
    op.idle_wait = waits.append
    return op


class Scripted(Source):
    """Each split plays its script: a list of results, one per read."""

    def __init__(self, scripts: Dict[int, List[Any]]) -> None:
        self.scripts = {k: list(v) for k, v in scripts.items()}

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        return self.scripts[subtask].pop(0)


def test_an_idle_split_lets_the_others_be_read_and_nothing_now_backs_off() -> None:
    source = Scripted({0: [[], [1], None], 1: [[10, 11], [], [12], None]})
    waits: List[float] = []
    op = _operator(source, [[0, 2, 0, 0], [1, 2, 0, 0]], waits)
    assert op.read(5) == [10, 11]  # split 0 has nothing now: split 1's turn
    assert op.read(5) == [1]  # split 1 had nothing, split 0 has something
    assert waits == []
    assert op.read(5) == [12]  # split 0 ended; split 1 goes on
    assert op.read(5) == [] and op.exhausted
    assert [s[2:] for s in op.splits] == [[1, 1], [3, 1]]


def test_when_no_split_has_records_the_wait_grows_to_a_cap() -> None:
    source = Scripted({0: [[]] * 12 + [[5], [], None]})
    waits: List[float] = []
    op = _operator(source, [[0, 1, 0, 0]], waits)
    for _ in range(12):
        assert op.read(5) == [] and not op.exhausted
    assert waits[0] == SourceOperator.MIN_IDLE_S
    assert waits == sorted(waits) and waits[-1] == SourceOperator.MAX_IDLE_S
    assert op.read(5) == [5]
    op.read(5)
    assert waits[-1] == SourceOperator.MIN_IDLE_S  # records came: the back-off starts again
    assert op.read(5) == [] and op.exhausted


def test_a_source_that_never_ends_its_split_is_told_how(caplog) -> None:
    source = Scripted({0: [[]] * 3})
    op = _operator(source, [[0, 1, 0, 0]], [])
    op.WARN_IDLE_S = 0.0
    for _ in range(3):
        op.read(5)
    assert "must return None" in caplog.text


def test_read_must_return_records_or_none() -> None:
    op = _operator(Scripted({0: [42]}), [[0, 1, 0, 0]], [])
    with pytest.raises(Exception, match="must return a list"):
        op.read(5)
