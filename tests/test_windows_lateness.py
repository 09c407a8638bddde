"""Windows: allowed lateness (updated rows, drops counted), processing time,
``.process(fn)``, and a savepoint at parallelism 2 with open windows resumed at 3."""

from __future__ import annotations

import threading
import time
from typing import Any, ClassVar, Dict, List, Tuple

import pytest
from test_windows import make_records, reference, rows

import pyengine as pe
from pyengine.connectors.base import Source
from pyengine.io.events import MAX_WATERMARK

# -- lateness, step by step ----------------------------------------------------------------------


class Steps(Source):
    """One subtask emits ``steps`` one at a time, each only once the window vertex's
    watermark has reached what the step before it implies: lateness decided exactly."""

    client: ClassVar[Any] = None

    def __init__(self, steps: List[Tuple[int, List[Dict[str, Any]]]]) -> None:
        self.steps = steps  # (watermark to wait for, records)

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        if subtask:
            return None
        done, step = 0, 0
        while step < len(self.steps) and done < position:  # position: records read, step by step
            done += len(self.steps[step][1])
            step += 1
        if step >= len(self.steps):
            return None
        wait_for, records = self.steps[step]
        client = Steps.client
        if client is None or min(client.watermarks().get("v1", [-(2**63)])) < wait_for:
            return []
        return records


LATE_STEPS = [
    (-(2**63), [{"k": 1, "ts": 10}, {"k": 1, "ts": 20}, {"k": 1, "ts": 130}]),  # then watermark 129: [0,100) fires
    (129, [{"k": 1, "ts": 60}]),  # inside the lateness (cleanup 99 + 50 = 149): an updated row at once
    (129, [{"k": 1, "ts": 160}]),  # watermark 159: [0,100) is purged
    (159, [{"k": 1, "ts": 70}]),  # too late: dropped and counted
]


def _steps_job(window: Any, by_function: bool, steps: List[Tuple[int, List[Dict[str, Any]]]]) -> Any:
    env = pe.StreamEnvironment(parallelism=1, auto_watermark_interval_ms=1)
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    sink = pe.sinks.CollectSink()
    source = Steps(steps)
    stream = env.from_source(source, watermark_strategy=strategy)
    keyed = stream.key_by((lambda r: r["k"]) if by_function else "k")
    keyed.window(window).allowed_lateness(50).aggregate(pe.agg.count(), pe.agg.max("ts")).sink_to(sink)
    client = env.execute_async("late")
    Steps.client = client
    try:
        return client.wait(60)
    finally:
        Steps.client = None


@pytest.mark.parametrize("by_function", [False, True], ids=["vectorised", "per-record"])
def test_allowed_lateness_updates_the_window_and_later_records_are_dropped_and_counted(by_function: bool) -> None:
    result = _steps_job(pe.windows.tumbling(100), by_function, LATE_STEPS)
    key = "key" if by_function else "k"
    rows = [(r[key], r["window_start"], r["window_end"], r["count"], r["max_ts"]) for r in result.records]
    assert rows == [(1, 0, 100, 2, 20), (1, 0, 100, 3, 60), (1, 100, 200, 2, 160)]
    assert result.event_time is not None and result.event_time.late_records_dropped == 1
    assert result.event_time.watermarks["v1"] == [MAX_WATERMARK]


def test_a_late_record_within_the_lateness_merges_into_a_fired_session() -> None:
    steps = [
        (-(2**63), [{"k": 1, "ts": 100}, {"k": 1, "ts": 110}, {"k": 1, "ts": 160}]),  # wm 159: [100, 130) fires
        (159, [{"k": 1, "ts": 125}]),  # [125, 145) merges into it ([100, 145), cleanup 194): updated at once
        (159, [{"k": 1, "ts": 10}]),  # [10, 30), cleanup 79 <= 159: late
    ]
    result = _steps_job(pe.windows.session(20), False, steps)
    rows = [(r["window_start"], r["window_end"], r["count"]) for r in result.records]
    assert rows == [(100, 130, 2), (100, 145, 3), (160, 180, 1)]
    assert result.event_time.late_records_dropped == 1


# -- processing time and .process(fn) ------------------------------------------------------------


class Slow(Source):
    def __init__(self, n: int) -> None:
        self.n = n

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        first = subtask + position * parallelism
        if first >= self.n:
            return None
        time.sleep(0.002)
        return [{"k": first % 3, "v": first}]


@pytest.mark.parametrize("kind", ["tumbling", "session"])
def test_processing_time_windows_count_every_record_once(kind: str) -> None:
    env = pe.StreamEnvironment(parallelism=2)
    window = (
        pe.windows.tumbling(40, time="processing") if kind == "tumbling" else pe.windows.session(5, time="processing")
    )
    sink = pe.sinks.CollectSink()
    env.from_source(Slow(300)).key_by("k").window(window).aggregate(pe.agg.count(), pe.agg.sum("v")).sink_to(sink)
    result = env.execute("proc")
    assert sum(r["count"] for r in result.records) == 300
    assert sum(r["sum_v"] for r in result.records) == sum(range(300))
    assert len(result.records) > 3, "windows fired while the job ran, not only one per key"
    if kind == "tumbling":
        assert all(r["window_start"] % 40 == 0 and r["window_end"] == r["window_start"] + 40 for r in result.records)


class Collect(pe.windows.ProcessWindowFunction):
    def open(self, ctx: Any) -> None:
        self.opened = True

    def process(self, key: Any, context: Any, elements: List[Any]) -> Any:
        assert self.opened and context.current_watermark() >= context.window().max_timestamp
        window = context.window()
        yield (key, window.start, window.end, sorted(e["v"] for e in elements))


@pytest.mark.parametrize("fn", [Collect(), lambda key, w, es: [(key, w.start, w.end, sorted(e["v"] for e in es))]])
def test_process_gets_every_element_of_a_window(fn: Any) -> None:
    records = [{"k": i % 2, "ts": i * 7, "v": i} for i in range(100)]
    env = pe.StreamEnvironment(parallelism=2)
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    sink = pe.sinks.CollectSink()
    env.from_collection(records, watermark_strategy=strategy).key_by("k").window(pe.windows.sliding(100, 50)).process(
        fn
    ).sink_to(sink)
    result = env.execute("process")
    expected = {}
    for r in records:
        for start in (r["ts"] // 50 * 50, r["ts"] // 50 * 50 - 50):
            expected.setdefault((r["k"], start, start + 100), []).append(r["v"])
    assert sorted(result.records) == sorted((k, s, e, sorted(v)) for (k, s, e), v in expected.items())


def test_window_build_errors_say_what_to_do() -> None:
    env = pe.StreamEnvironment()

    def stream() -> Any:  # a fresh line each time: a refused call leaves its stream continued
        return env.from_collection([{"k": 1, "ts": 1}])

    with pytest.raises(ValueError, match="no timestamps"):
        stream().key_by("k").window(pe.windows.tumbling(10))
    with pytest.raises(ValueError, match="offset_ms"):
        pe.windows.tumbling(10, 10)
    with pytest.raises(ValueError, match="slide_ms"):
        pe.windows.sliding(10, 0)
    with pytest.raises(ValueError, match="allowed_lateness applies to event-time"):
        stream().key_by("k").window(pe.windows.tumbling(10, time="processing")).allowed_lateness(5)
    with pytest.raises(ValueError, match="unique"):
        stream().key_by("k").window(pe.windows.tumbling(10, time="processing")).aggregate(pe.agg.count(alias="k"))


# -- a savepoint with open windows, resumed at another parallelism -------------------------------


class Held(Source):
    def __init__(self, records: List[Dict[str, Any]], hold: int, release: threading.Event) -> None:
        self.records, self.hold, self.release = records, hold, release

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        mine = self.records[subtask::parallelism]
        if position >= self.hold and not self.release.is_set():
            return []
        if position >= len(mine):
            return None
        end = len(mine) if self.release.is_set() else min(len(mine), self.hold)
        return mine[position : min(end, position + n)]


@pytest.mark.parametrize("backend", ["heap", "incremental"])
@pytest.mark.parametrize("window", [pe.windows.sliding(60, 20), pe.windows.session(15)], ids=["sliding", "session"])
def test_savepoint_at_2_with_open_windows_resumed_at_3(tmp_path: Any, backend: str, window: Any) -> None:
    records = make_records(600, keys=11, step=2, jitter=8, seed=5)
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(8).with_timestamp_assigner("ts")
    sink = pe.sinks.CollectSink()  # one for both runs: the resumed run's recover() commits what the savepoint covers

    def job(parallelism: int, release: threading.Event) -> Any:
        env = pe.StreamEnvironment(
            parallelism=parallelism,
            checkpointing=pe.CheckpointConfig(interval_ms=20),
            state_backend=backend,
            checkpoint_storage=str(tmp_path / f"ckpt{parallelism}"),
            auto_watermark_interval_ms=1,
        )
        aggs = (pe.agg.count(), pe.agg.sum("v"), pe.agg.min("v"), pe.agg.max("v"), pe.agg.mean("v"))
        env.from_source(Held(records, 150, release), watermark_strategy=strategy).key_by("k").window(window).aggregate(
            *aggs
        ).uid("windows").sink_to(sink)
        return env

    client = job(2, threading.Event()).execute_async("sp")
    held_ts = sorted(r["ts"] for r in records[0::2][:150] + records[1::2][:150])
    deadline = time.monotonic() + 30
    while min(client.watermarks().get("v1", [-(2**63)])) < held_ts[-40] - 20:
        assert time.monotonic() < deadline, client.watermarks()
        time.sleep(0.01)
    savepoint = client.stop_with_savepoint(str(tmp_path / "savepoint"))
    client.wait(30)
    open_state = [n for n in _keyed_state_names(savepoint, "windows") if n.startswith(("window", "session"))]
    open_state += _pane_entries(savepoint, "windows")  # tumbling and sliding windows keep panes
    assert open_state, "no open window in the savepoint: the test would prove nothing"
    released = threading.Event()
    released.set()
    after = job(3, released).execute("sp", restore_from=savepoint)
    assert rows(after) == reference(records, window)


def _pane_entries(path: str, uid: str) -> List[str]:
    """The open panes in the operator state of an ``AlignedWindowAggregateOperator``."""
    from pyengine.state.operator import _read
    from pyengine.storage.metadata import load_metadata

    return [
        f"pane {start}"
        for handle in load_metadata(path).operator(uid).operator_handles()
        for name, _, _, values in _read(handle)
        if name == "window-panes"
        for start in values
    ]


def _keyed_state_names(path: str, uid: str) -> List[str]:
    from pyengine.snapshot.reader import read_keyed_state
    from pyengine.state import KeyGroupRange
    from pyengine.storage.metadata import load_metadata

    names = set()
    for handle in load_metadata(path).operator(uid).keyed_handles():
        _, entries = read_keyed_state(handle, KeyGroupRange(handle.key_group_start, handle.key_group_end))
        names.update(spec.name for _, spec, keys, _ in entries if len(keys))
    return sorted(names)
