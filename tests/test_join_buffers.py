"""The per-record interval join's buffers (issue #43): kept by entry in the keyed
backend, checkpointed in segments (each buffered record encoded once, in bulk),
never copied whole on a read after a checkpoint, and cleaned per key once per
watermark advance. Checked against the brute-force answer; a savepoint written by
the release before (one value per key, ``{timestamp: [records]}``) still restores,
at its parallelism and rescaled."""

from __future__ import annotations

import gc
import json
import threading
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar, List, Tuple

import pyarrow as pa
import pytest
from test_joins import Pairs, env_for, interval_reference, side, strategy, window_reference
from test_windows_lateness import Held

import pyengine as pe
from pyengine.joins import ProcessJoinFunction
from pyengine.runtime.base import OperatorContext
from pyengine.runtime.joins import ArrowIntervalJoinOperator, IntervalJoinOperator, WindowJoinOperator
from pyengine.runtime.keyed import key_selector
from pyengine.storage import checkpoint_storage
from pyengine.time.strategy import TimestampAssigner

FIXTURE = Path(__file__).parent / "data" / "savepoint-interval-join-v1"
FIRST_RUN = Path(__file__).parent / "data" / "savepoint-interval-join-v1.first-run.json"
WINDOW_FIXTURE = Path(__file__).parent / "data" / "savepoint-window-join-v1"
WINDOW_FIRST_RUN = Path(__file__).parent / "data" / "savepoint-window-join-v1.first-run.json"
WINDOW = pe.windows.sliding(30, 10)
LEFT = side(400, 11, 2, 5, 31, 0)
RIGHT = side(400, 11, 2, 5, 32, 100_000)
HOLD = 120  # records per split (of 2) before the savepoint
LOWER, UPPER = -40, 40


def join_job(parallelism: int, release: threading.Event, sink: Any, storage: Path) -> pe.StreamEnvironment:
    env = env_for(
        parallelism,
        "heap",
        checkpointing=pe.CheckpointConfig(interval_ms=50),
        checkpoint_storage=str(storage / f"ckpt{parallelism}"),
    )
    a = env.from_source(Held(LEFT, HOLD, release), name="left", watermark_strategy=strategy(5)).uid("left")
    b = env.from_source(Held(RIGHT, HOLD, release), name="right", watermark_strategy=strategy(5)).uid("right")
    joined = a.key_by("k").interval_join(b.key_by("k")).between(LOWER, UPPER)
    joined.process(Pairs()).uid("join").sink_to(sink)
    return env


def window_job(parallelism: int, release: threading.Event, sink: Any, storage: Path) -> pe.StreamEnvironment:
    env = env_for(
        parallelism,
        "heap",
        checkpointing=pe.CheckpointConfig(interval_ms=50),
        checkpoint_storage=str(storage / f"ckpt{parallelism}"),
    )
    a = env.from_source(Held(LEFT, HOLD, release), name="left", watermark_strategy=strategy(5)).uid("left")
    b = env.from_source(Held(RIGHT, HOLD, release), name="right", watermark_strategy=strategy(5)).uid("right")
    windowed = a.join(b).where("k").equal_to("k").window(WINDOW)
    windowed.apply(lambda x, y: (x["v"], y["v"])).uid("join").sink_to(sink)
    return env


def test_a_savepoint_of_the_old_buffer_layout_restores_exactly(tmp_path: Path) -> None:
    """``savepoint-interval-join-v1`` (made by ``tests/data/make_join_savepoint.py`` at
    e145a3c): buffers of both sides mid-join. Resumed at 2 (its parallelism) and at 3
    (rescaled by key group), the pairs of both runs are exactly the brute-force ones."""
    first = Counter(tuple(r) for r in json.loads(FIRST_RUN.read_text()))
    expected = interval_reference(LEFT, RIGHT, LOWER, UPPER)
    assert 0 < sum(first.values()) < sum(expected.values()), "the fixture was taken mid-join"
    for parallelism in (2, 3):
        released = threading.Event()
        released.set()
        sink = pe.sinks.CollectSink()
        result = join_job(parallelism, released, sink, tmp_path).execute(
            f"join-v1-at-{parallelism}", restore_from=str(FIXTURE)
        )
        assert result.status == "FINISHED", result.cause
        assert first + Counter(tuple(r) for r in sink.records) == expected


def test_a_window_join_savepoint_of_tuple_elements_restores_exactly(tmp_path: Path) -> None:
    """``savepoint-window-join-v1`` (``tests/data/make_join_savepoint.py`` at e145a3c):
    the window join's elements were ``(side, record)`` tuples (a MessagePack extension,
    one Python call each to encode), now ``[side, record]`` lists; the old ones still
    restore, at 2 and rescaled to 3."""
    first = Counter(tuple(r) for r in json.loads(WINDOW_FIRST_RUN.read_text()))
    expected: Counter = Counter()
    for (x, y, _start), n in window_reference(LEFT, RIGHT, WINDOW).items():
        expected[(x, y)] += n
    assert 0 < sum(first.values()) < sum(expected.values()), "the fixture was taken mid-join"
    for parallelism in (2, 3):
        released = threading.Event()
        released.set()
        sink = pe.sinks.CollectSink()
        result = window_job(parallelism, released, sink, tmp_path).execute(
            f"window-v1-at-{parallelism}", restore_from=str(WINDOW_FIXTURE)
        )
        assert result.status == "FINISHED", result.cause
        assert first + Counter(tuple(r) for r in sink.records) == expected


# -- the operator alone -------------------------------------------------------------------------


class Seen(ProcessJoinFunction):
    """Keeps the objects it is given, to check they are the buffered ones."""

    def __init__(self) -> None:
        self.pairs: List[Tuple[Any, Any]] = []

    def process_element(self, left: Any, right: Any, ctx: Any) -> Any:
        self.pairs.append((left, right))
        yield (left["v"], right["v"])


def _operator(backend: str, fn: ProcessJoinFunction, lower: int = 0, upper: int = 10_000) -> IntervalJoinOperator:
    select = key_selector("k")
    stamps = (TimestampAssigner(column="ts"), TimestampAssigner(column="ts"))
    op = IntervalJoinOperator("j", "join", (select, select), stamps, lower, upper, fn)
    ctx = OperatorContext(
        job_name="j",
        subtask=0,
        parallelism=1,
        max_parallelism=128,
        state_backend=backend,
        local_recovery_dir=None,
        attempt=0,
    )
    op.setup(ctx, None)
    op.open()
    return op


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_a_checkpoint_encodes_each_buffered_record_once_and_a_read_copies_nothing(tmp_path: Path, backend: str) -> None:
    """Three checkpoints while a hot key's records wait: each record is encoded by the
    first checkpoint after it came, never again, in one encoding call per key and
    side; the function then gets the very objects that were buffered (the buffer was
    not deep-copied on its first read after the checkpoint)."""
    fn = Seen()
    op = _operator(backend, fn)
    encoded: List[int] = []
    dumps = op._dumps

    def counting(value: Any) -> bytes:
        encoded.append(len(value[0]))
        return dumps(value)

    op._dumps = counting
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    hot = [{"k": 1, "ts": 1000 + i, "v": i} for i in range(2000)]
    op.process([*hot[:1000], {"k": 2, "ts": 1000, "v": -1}])
    op.snapshot(1, storage.location(1))()
    assert sorted(encoded) == [1, 1000], "one call per key and side, each record once"
    op.process(hot[1000:])
    op.snapshot(2, storage.location(2))()
    op.snapshot(3, storage.location(3))()
    assert sorted(encoded) == [1, 1000, 1000], "only what came since: the first 1,000 are not encoded again"
    out = op.process2([{"k": 1, "ts": 2999, "v": 10**6}])
    assert len(out) == 2000
    assert all(left is record for (left, _), record in zip(fn.pairs, hot, strict=True)), "the buffered objects"


@pytest.mark.parametrize("backend", ["heap", "incremental"])
def test_the_first_read_after_a_checkpoint_copies_nothing(tmp_path: Path, backend: str) -> None:
    """A checkpoint (its synchronous part, its asynchronous part still to run), then
    a record that pairs with the hot key's buffer: the function gets the objects
    that were buffered, not copies (the release before deep-copied the key's whole
    buffer here), and the checkpoint, run after, still writes what it froze."""
    fn = Seen()
    op = _operator(backend, fn)
    storage = checkpoint_storage(str(tmp_path / "ckpt"), "job")
    hot = [{"k": 1, "ts": 1000 + i, "v": i} for i in range(500)]
    op.process(hot)
    write = op.snapshot(1, storage.location(1))
    assert len(op.process2([{"k": 1, "ts": 1600, "v": -1}])) == 500
    write()
    assert [left for left, _ in fn.pairs] == hot
    assert all(left is record for (left, _), record in zip(fn.pairs, hot, strict=True))


def test_a_hot_key_has_one_cleanup_timer_and_a_watermark_cleans_it_once() -> None:
    """2,000 records of one key at 2,000 timestamps: one timer (not one per
    timestamp), and a watermark that expires half of them drops that half in one
    cleanup, the other half still joins."""
    op = _operator("heap", Seen(), lower=-5, upper=0)
    op.process2([{"k": 1, "ts": 1000 + i, "v": i} for i in range(2000)])  # right records: kept to ts + 5
    timers = "_timer_state/event_timers"
    op.backend.apply_pending_writes()  # registrations the native timer sets hold back
    assert op.backend.num_entries(timers) == 1
    op.process_watermark(1000 + 999 + 5)  # the first 1,000 (ts <= 1999) are due
    op.backend.apply_pending_writes()
    assert op.backend.num_entries(timers) == 1, "moved to the next earliest cleanup time"
    buffer = op._views[1][1]
    assert buffer is not None and buffer.times[0] == 2000 and len(buffer.times) == 1000
    assert op.process([{"k": 1, "ts": 2004, "v": -1}]) == [(-1, i) for i in range(999, 1005) if i >= 1000]


def test_the_arrow_interval_join_cleans_only_the_batches_with_expired_rows() -> None:
    """A watermark leaves a buffered batch none of whose rows expired as it is (the
    same object: not filtered again), drops one all of whose rows expired, and
    filters only the one in between."""
    stamps = (TimestampAssigner(column="ts"), TimestampAssigner(column="ts"))
    op = ArrowIntervalJoinOperator("j", "join", 0, 10, ("left_ts", "right_ts"), ("k", "k"), stamps, (None, None), "_r")
    op.setup(_operator("heap", Seen()).ctx, None)
    for first in (100, 200, 300):  # three left batches, ten rows each at first .. first + 9
        op.process(pa.RecordBatch.from_pylist([{"k": i % 3, "ts": first + i, "x": i} for i in range(10)]))
    young = op._buckets[(0, 0)][2]
    op.process_watermark(215)  # left rows go at ts + 10 <= 215: all of the first, 200..205 of the second
    kept = op._buckets[(0, 0)]
    assert len(kept) == 2 and kept[1] is young, "the young batch untouched"
    assert kept[0].column("ts").to_pylist() == list(range(206, 210))
    out = op.process2(pa.RecordBatch.from_pylist([{"k": 0, "ts": 309, "x": -1}]))
    assert sorted(out.column("left_ts").to_pylist()) == [300, 303, 306, 309]


def test_the_window_join_keeps_its_elements_as_lists() -> None:
    """``[side, record]``, which MessagePack encodes in C, where a ``(side, record)``
    tuple took a Python call per element at every checkpoint."""
    select = key_selector("k")
    stamps = (TimestampAssigner(column="ts"), TimestampAssigner(column="ts"))
    op = WindowJoinOperator("j", "join", (select, select), stamps, WINDOW, lambda x, y: (x["v"], y["v"]))
    op.setup(_operator("heap", Seen()).ctx, None)
    op.open()
    op.process([{"k": 1, "ts": 5, "v": 1}])
    op.process2([{"k": 1, "ts": 6, "v": 2}])
    op.backend.set_current_key(1)
    elements = [e for window in op._contents.value().values() for e in window]
    assert elements and all(type(e) is list for e in elements)
    assert sorted(op.process_watermark(100)) == [(1, 2)] * 3, "in three sliding windows"


class _Cycle:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    alive = 0
    most = 0

    def __init__(self) -> None:
        self.me = self
        _Cycle.alive += 1
        _Cycle.most = max(_Cycle.most, _Cycle.alive)

    def __del__(self) -> None:
        _Cycle.alive -= 1


class _MakesCycles(ProcessJoinFunction):
    """A join function that leaves a garbage cycle per pair and notes the collector's
    youngest-generation threshold while the task runs."""

    thresholds: ClassVar[List[int]] = []

    def process_element(self, left: Any, right: Any, ctx: ProcessJoinFunction.Context) -> Any:
        _MakesCycles.thresholds.append(gc.get_threshold()[0])
        _Cycle()
        yield (left["v"], right["v"])


def test_a_running_task_raises_the_young_threshold_and_user_cycles_are_still_collected() -> None:
    """The collector's youngest generation runs every 20,000 net allocations while a
    task runs (the buffered records are walked less often), not never: garbage
    cycles the user's function makes are freed as the job goes, memory does not grow
    with the records, and the process's threshold is what it was once the job ended."""
    before = gc.get_threshold()
    _Cycle.alive = _Cycle.most = 0
    _MakesCycles.thresholds = []
    left = [{"k": 0, "ts": i, "v": i} for i in range(400)]
    right = [{"k": 0, "ts": i, "v": -i} for i in range(400)]
    env = env_for(1, "heap")
    a = env.from_generator(lambda i: left[i], len(left), name="left", watermark_strategy=strategy(0))
    b = env.from_generator(lambda i: right[i], len(right), name="right", watermark_strategy=strategy(0))
    joined = a.key_by("k").interval_join(b.key_by("k")).between(-300, 300)
    joined.process(_MakesCycles()).sink_to(pe.sinks.DiscardSink())
    result = env.execute("cycles")
    assert result.status == "FINISHED", result.cause
    made = len(_MakesCycles.thresholds)
    assert made > 150_000  # pairs, each a cycle
    assert min(_MakesCycles.thresholds) >= 20_000
    assert _Cycle.most < made // 3, f"{_Cycle.most} of {made} garbage cycles alive at once"
    assert gc.get_threshold() == before
    gc.collect()
    assert _Cycle.alive == 0
