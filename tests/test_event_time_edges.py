"""Event time near the ends of the int64 range (issue #37, item 3).

Every record is counted, emitted, late, or refused with a ``TimestampError`` that
names it and the field its time came from: a time outside int64 (an Arrow
``uint64`` above 2**63 - 1, a float beyond ±2**63, a Python int of 2**70) is never
wrapped, and a record whose window would start before -2**63 or end after
2**63 - 1 is refused, on the vectorised (Arrow) and per-record paths alike.
Before, such records vanished from tumbling windows (their window bounds wrapped
in int64) or failed with an ``OverflowError`` or a timer error naming no record."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import numpy as np
import pyarrow as pa
import pytest
from test_windows_lateness import Steps

import pyengine as pe
from pyengine.errors import is_non_retryable
from pyengine.time import TimestampAssigner, TimestampError

MAX = 2**63 - 1
MIN = -(2**63)
STRATEGY = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")

# how a window step is reached: the vectorised operator from Arrow batches and from
# lists of records, the per-record WindowOperator (key by function), and sessions
PATHS = ["arrow", "list", "per-record"]


def _job(records: List[Dict[str, Any]], assigner: Any, path: str, lateness: int = 0) -> Tuple[Any, Any, Any]:
    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
    source: Any = pa.RecordBatch.from_pylist(records) if path == "arrow" else records
    keyed = env.from_collection(source, watermark_strategy=STRATEGY).key_by(
        (lambda r: r["k"]) if path == "per-record" else "k"
    )
    tag = pe.OutputTag("late")
    windowed = keyed.window(assigner).allowed_lateness(lateness).side_output_late_data(tag)
    if assigner.merging:
        out = windowed.process(
            lambda k, w, els: [{"k": k, "window_start": w.start, "window_end": w.end, "count": len(els)}]
        )
    else:
        out = windowed.aggregate(pe.agg.count())
    main, late = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    out.sink_to(main)
    out.get_side_output(tag).sink_to(late)
    return env, main, late


def _refused(env: Any) -> TimestampError:
    with pytest.raises(pe.JobFailedError) as err:
        env.execute("edges")
    result = err.value.result
    assert result.status == "FAILED" and result.restarts == 0 and is_non_retryable(result.cause)
    assert isinstance(result.cause, TimestampError), repr(result.cause)
    return result.cause


def _rows(records: List[Dict[str, Any]]) -> List[Tuple[Any, ...]]:
    return sorted((r.get("k", r.get("key")), r["window_start"], r["window_end"], r["count"]) for r in records)


# -- times that are no int64 ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("array", "value"),
    [
        (pa.array([5, 2**63 + 5], pa.uint64()), "9223372036854775813"),
        (pa.array([5.0, 1e19]), "1e+19"),
        (pa.array([-1e19, 5.0]), "-1e+19"),
    ],
)
def test_an_arrow_time_outside_int64_is_refused_naming_the_record(array: pa.Array, value: str) -> None:
    """A uint64 above 2**63 - 1 wrapped to a negative time, a float of ±1e19 cast to
    whatever the CPU gives: the record went into a window of 1970 or none."""
    batch = pa.RecordBatch.from_arrays([pa.array(["a", "b"]), array], ["k", "ts"])
    with pytest.raises(TimestampError) as err:
        TimestampAssigner(column="ts").of_buffer(batch)
    message = str(err.value)
    assert "record {'k': " in message and f"'ts': {value}" in message, message
    assert "timestamp from column 'ts'" in message and "outside the int64 milliseconds" in message
    # the largest float below 2**63 and -2**63 itself are int64: taken
    edge = pa.RecordBatch.from_pydict({"ts": pa.array([np.nextafter(2.0**63, 0), -(2.0**63)])})
    assert TimestampAssigner(column="ts").of_buffer(edge).tolist() == [2**63 - 1024, MIN]
    top = pa.RecordBatch.from_pydict({"ts": pa.array([MAX], pa.uint64())})
    assert TimestampAssigner(column="ts").of_buffer(top).tolist() == [MAX]


@pytest.mark.parametrize("value", [2**70, -(2**70), MAX + 1, 1e19, -1e19, np.uint64(2**63 + 5)])
def test_a_python_time_outside_int64_is_refused_naming_the_record(value: Any) -> None:
    """An int of 2**70 failed with OverflowError ("Python int too large to convert to
    C long"), naming no record, and the job restarted three times on it."""
    a = TimestampAssigner(column="ts")
    for call in (lambda: a.of_record({"ts": value}), lambda: a.of_buffer([{"ts": 1}, {"ts": value}])):
        with pytest.raises(
            TimestampError, match=r"record \{'ts': .*\}, timestamp from column 'ts': .*outside the int64"
        ):
            call()
    assert a.of_buffer([{"ts": MIN}, {"ts": MAX}]).tolist() == [MIN, MAX]


@pytest.mark.parametrize("path", PATHS)
def test_a_job_with_a_time_of_2_70_fails_at_once_naming_it(path: str) -> None:
    records = [{"k": 1, "ts": 5}, {"k": 1, "ts": 2**70 if path != "arrow" else 1e19}]
    env, _, _ = _job(records, pe.windows.tumbling(1000), path)
    cause = _refused(env)
    assert "record {'k': 1, 'ts': " in str(cause) and "timestamp from column 'ts'" in str(cause)


# -- windows past either end --------------------------------------------------------------------------


@pytest.mark.parametrize("path", [*PATHS, "session"])
@pytest.mark.parametrize("ts", [MAX - 10, MAX, MIN + 10])
def test_a_record_whose_window_leaves_int64_is_refused_naming_it(path: str, ts: int) -> None:
    """Within one window of the ends, a tumbling window's bounds wrapped in int64
    (the vectorised path) and the record was in no window, not late, not on the
    late side output; the per-record path failed on a timer the user never set."""
    if path == "session" and ts == MIN + 10:
        ts = MAX - 999  # a session starts at its record: only the upper end can be out
    assigner = pe.windows.session(1000) if path == "session" else pe.windows.tumbling(1000)
    env, _, _ = _job([{"k": 1, "ts": 5}, {"k": 1, "ts": ts}], assigner, "list" if path == "session" else path)
    message = str(_refused(env))
    assert f"record {{'k': 1, 'ts': {ts}}}, timestamp from column 'ts'" in message, message
    side = "ends after the largest timestamp" if ts > 0 else "starts before the smallest timestamp"
    assert f"of {assigner.describe()}, which {side}" in message, message


def test_window_assignment_near_the_ends_agrees_vectorised_and_per_record() -> None:
    """``assign_array`` (numpy int64) and ``assign`` (Python ints) give the same
    windows near the ends, and refuse the same records."""
    assigners = [
        pe.windows.tumbling(1000),
        pe.windows.tumbling(1000, 300),
        pe.windows.tumbling(1024, -5),
        pe.windows.sliding(1000, 300, 100),
        pe.windows.sliding(100, 300, -50),
    ]
    near = [MIN + d for d in range(0, 2500, 7)] + [MAX - d for d in range(0, 2500, 7)] + [-3, 0, 12_345]
    for assigner in assigners:
        inside = []
        for t in near:
            try:
                assigner.assign(t)
                inside.append(t)
            except TimestampError:
                pass
        ts = np.array(near, np.int64)
        bad = assigner.out_of_range(ts)
        assert bad is not None and near[bad] not in inside
        ok = np.array(inside, np.int64)
        assert assigner.out_of_range(ok) is None
        rows, starts = assigner.assign_array(ok)
        vectorised = sorted(zip(rows.tolist(), starts.tolist(), strict=True))
        per_record = sorted((i, w.start) for i, t in enumerate(inside) for w in assigner.assign(t))
        assert vectorised == per_record, assigner.describe()
        assert all(MIN <= s and s + assigner.size <= MAX for _, s in per_record)


@pytest.mark.parametrize("by_function", [False, True], ids=["vectorised", "per-record"])
def test_the_first_and_last_windows_count_and_late_records_are_late(by_function: bool) -> None:
    """The windows that fit: the first one starting at -2**63 (a size that divides
    it) and the last one ending at or below 2**63 - 1 count their records; a record
    after the watermark passed its window is late (on the side output), on both
    paths, and the watermark near the top end still fires the last window."""
    size = 1024
    last_start = (MAX - size) - (MAX - size) % size  # the last window: [last_start, last_start + size)
    steps = [
        (MIN, [{"k": 1, "ts": t} for t in (MIN + 1, MIN, 0, last_start + size - 2, last_start)]),
        # the watermark is last_start + size - 3 now: [0, 1024) fired, the last window did not
        (last_start + size - 3, [{"k": 1, "ts": 7}, {"k": 1, "ts": last_start + size - 1}]),
    ]
    env = pe.StreamEnvironment(parallelism=1, auto_watermark_interval_ms=1)
    tag = pe.OutputTag("late")
    keyed = env.from_source(Steps(steps), watermark_strategy=STRATEGY).key_by(
        (lambda r: r["k"]) if by_function else "k"
    )
    out = keyed.window(pe.windows.tumbling(size)).side_output_late_data(tag).aggregate(pe.agg.count())
    main, late = pe.sinks.CollectSink(), pe.sinks.CollectSink()
    out.sink_to(main)
    out.get_side_output(tag).sink_to(late)
    client = env.execute_async("edges")
    Steps.client = client
    try:
        result = client.wait(60)
    finally:
        Steps.client = None
    assert result.status == "FINISHED", result.cause
    assert _rows(main.records) == [
        (1, MIN, MIN + size, 2),
        (1, 0, size, 1),
        (1, last_start, last_start + size, 3),
    ]
    assert [r["ts"] for r in late.records] == [7]


def test_a_session_at_the_smallest_time_is_a_window() -> None:
    env, main, _ = _job([{"k": 1, "ts": MIN}, {"k": 1, "ts": MAX - 1000}], pe.windows.session(1000), "list")
    env.execute("edges")
    assert _rows(main.records) == [(1, MIN, MIN + 1000, 1), (1, MAX - 1000, MAX, 1)]


class TimerAtItsTime(pe.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        ctx.timer_service().register_event_time_timer(ctx.timestamp())
        return ()

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        yield timestamp


def test_a_timer_at_the_smallest_time_names_the_record_and_its_field() -> None:
    """-2**63 stands for "before any watermark" and is no timer: the refusal named
    only the timestamp, not the record whose time it was, nor where that came from."""
    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
    records = [{"k": 1, "ts": 5}, {"k": 2, "ts": MIN}]
    env.from_collection(records, watermark_strategy=STRATEGY).key_by("k").process(TimerAtItsTime()).sink_to(
        pe.sinks.DiscardSink()
    )
    with pytest.raises(pe.JobFailedError) as err:
        env.execute("edges")
    result = err.value.result
    assert result.restarts == 0 and is_non_retryable(result.cause)
    message = str(result.cause)
    assert f"record {{'k': 2, 'ts': {MIN}}}, event time {MIN} from column 'ts'" in message, message
    assert "'before any watermark'" in message
