"""Watermarks: strategies, the valve, per-split generation, and watermarks in
channels (ordered with the data, aligned and unaligned, to the end of input)."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any, Dict, List

import numpy as np
import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.connectors.base import Source
from pyengine.io import CheckpointedInputGate
from pyengine.io.events import (
    MAX_WATERMARK,
    MIN_WATERMARK,
    Watermark,
    WatermarkStatus,
    time_event_from_json,
    time_event_to_json,
)
from pyengine.runtime.base import OperatorContext
from pyengine.runtime.sources import SourceOperator
from pyengine.testing import RecordingListener
from pyengine.time import StatusWatermarkValve, TimestampAssigner, TimestampError, WatermarkStrategy

# -- strategies ----------------------------------------------------------------------------------


def test_bounded_out_of_orderness_trails_the_largest_timestamp_by_the_bound_plus_one() -> None:
    g = WatermarkStrategy.for_bounded_out_of_orderness(100).with_timestamp_assigner("ts").create_generator(0)
    assert g.current == MIN_WATERMARK
    g.on_timestamps(np.array([1000, 1500, 1200]), 0)
    assert g.current == 1500 - 100 - 1  # a record exactly 100 behind the newest is still on time
    g.on_timestamps(np.array([900]), 0)
    assert g.current == 1399, "an older record never moves the watermark back"


def test_monotonous_and_no_watermarks() -> None:
    g = WatermarkStrategy.for_monotonous_timestamps().create_generator(0)
    g.on_timestamps(np.array([7]), 0)
    assert g.current == 6
    n = WatermarkStrategy.no_watermarks().create_generator(0)
    n.on_timestamps(np.array([10**6]), 0)
    assert n.current == MIN_WATERMARK


def test_idleness_is_processing_time_without_records() -> None:
    g = WatermarkStrategy.for_bounded_out_of_orderness(0).with_idleness(50).create_generator(now=1000)
    assert not g.check_idle(1049)
    assert g.check_idle(1050)
    g.on_timestamps(np.array([5]), 1060)
    assert not g.check_idle(1100)
    with pytest.raises(ValueError, match=r"idle_timeout_ms must be milliseconds \(an int >= 1\)"):
        WatermarkStrategy.for_monotonous_timestamps().with_idleness(0)


def test_strategies_are_values_checked_when_built() -> None:
    base = WatermarkStrategy.for_bounded_out_of_orderness(dt.timedelta(seconds=2))
    assert base.out_of_orderness_ms == 2000
    named = base.with_timestamp_assigner("ts")
    assert base.timestamps is None and named.timestamps == TimestampAssigner(column="ts")
    with pytest.raises(ValueError, match="milliseconds"):
        WatermarkStrategy.for_bounded_out_of_orderness(-1)
    with pytest.raises(TypeError, match="column name or a function"):
        base.with_timestamp_assigner(3.5)  # type: ignore[arg-type]
    env = pe.StreamEnvironment()
    with pytest.raises(ValueError, match="with_timestamp_assigner"):
        env.from_collection([{"ts": 1}], watermark_strategy=base)


def test_timestamps_of_arrow_batches_are_read_as_one_array(monkeypatch: Any) -> None:
    import pyengine.time.strategy as strategy

    def per_row(value: Any) -> int:
        raise AssertionError("a per-row Python call on an Arrow batch")

    monkeypatch.setattr(strategy, "_ms", per_row)
    n = 100_000
    ints = pa.record_batch({"ts": pa.array(np.arange(n, dtype=np.int64))})
    assert TimestampAssigner(column="ts").of_buffer(ints).sum() == n * (n - 1) // 2
    micros = pa.record_batch(
        {"ts": pa.array(np.arange(3, dtype=np.int64) * 1000 + 1_700_000_000_000_000, pa.timestamp("us", "UTC"))}
    )
    assert TimestampAssigner(column="ts").of_buffer(micros).tolist() == [
        1_700_000_000_000,
        1_700_000_000_001,
        1_700_000_000_002,
    ]
    shifted = TimestampAssigner(column="ts", offset=-1).of_buffer(ints[:3])
    assert shifted.tolist() == [-1, 0, 1]


def test_timestamps_of_records_and_what_is_refused() -> None:
    a = TimestampAssigner(column="when")
    assert a.of_record({"when": dt.datetime(1970, 1, 1, 0, 0, 1, tzinfo=dt.timezone.utc)}) == 1000
    assert a.of_record({"when": dt.datetime(1970, 1, 1, 0, 0, 2)}) == 2000  # naive: UTC
    assert TimestampAssigner(fn=lambda r: r[1]).of_record(("x", 42)) == 42
    with pytest.raises(TimestampError, match=r"no timestamp field 'when': name the record's time field"):
        a.of_record({"other": 1})
    with pytest.raises(TimestampError, match=r"raised KeyError: 'ts', on record \{'other': 1\}"):
        TimestampAssigner(fn=lambda r: r["ts"]).of_record({"other": 1})
    # a bad value names the record, where its time came from and the way out
    with pytest.raises(TimestampError, match=r"record \{'when': None\}, timestamp from column 'when': .*None.*filter"):
        a.of_record({"when": None})
    with pytest.raises(TimestampError, match=r"1 null value.*fill or drop them"):
        a.of_buffer(pa.record_batch({"when": pa.array([1, None], pa.int64())}))
    with pytest.raises(TimestampError, match=r"int milliseconds or a datetime, got str 'yesterday': convert it"):
        a.of_record({"when": "yesterday"})
    with pytest.raises(TimestampError, match=r"record \('x', None\), timestamp from <lambda>"):
        TimestampAssigner(fn=lambda r: r[1]).of_record(("x", None))
    with pytest.raises(TimestampError, match=r"\.\.\."):  # a long record is cut short in the message
        a.of_record({"when": None, "payload": "x" * 10_000})


def test_time_events_travel_as_json_and_are_final() -> None:
    for event in (Watermark(5), Watermark(MAX_WATERMARK), WatermarkStatus(True), WatermarkStatus(False)):
        assert time_event_from_json(time_event_to_json(event)) == event
    with pytest.raises(TypeError, match="final"):

        class Mine(Watermark):  # type: ignore[misc]
            pass

    with pytest.raises(TypeError):
        Watermark(1.5)  # type: ignore[arg-type]


# -- the valve -----------------------------------------------------------------------------------


def test_valve_puts_out_the_minimum_over_channels_once_it_advances() -> None:
    v = StatusWatermarkValve(3)
    assert v.input_watermark(10, 0) is None
    assert v.input_watermark(20, 1) is None
    assert v.input_watermark(5, 2) == 5
    assert v.input_watermark(4, 2) is None, "a channel's watermark never goes back"
    assert v.input_watermark(30, 2) == 10
    assert v.input_watermark(10, 0) is None, "no advance, nothing put out"
    assert v.input_watermark(25, 0) == 20


def test_valve_leaves_idle_channels_out_and_takes_them_back_once_caught_up() -> None:
    v = StatusWatermarkValve(2)
    assert v.input_watermark(100, 0) is None
    assert v.input_status(True, 1) == (100, None), "the idle channel held it back: the other's goes out"
    assert v.input_watermark(150, 0) == 150
    assert v.input_status(False, 1) == (None, None)
    assert v.input_watermark(120, 1) is None, "behind the output: not aligned, ignored for the minimum"
    assert v.input_watermark(200, 0) == 200
    assert v.input_watermark(190, 1) is None
    assert v.input_watermark(210, 1) is None
    assert v.input_watermark(300, 0) == 210, "caught up: it counts again"


def test_valve_all_idle_flushes_the_largest_and_goes_idle() -> None:
    v = StatusWatermarkValve(2)
    v.input_watermark(10, 0)
    v.input_watermark(40, 1)
    assert v.input_status(True, 0) == (40, None)
    assert v.input_status(True, 1) == (None, True)
    assert v.input_watermark(50, 1) is None, "an idle channel's watermarks wait for it to turn active"
    assert v.input_status(False, 1) == (None, False)
    assert v.input_watermark(60, 1) == 60


def test_valve_restored_output_is_never_put_out_again() -> None:
    v = StatusWatermarkValve(2, initial=500)
    assert v.input_watermark(300, 0) is None
    assert v.input_watermark(400, 1) is None
    assert v.input_watermark(600, 0) is None
    assert v.input_watermark(700, 1) == 600
    assert v.end_channel(0) == 700


def test_watermarks_pass_the_native_gate_as_data_behind_a_blocked_channel() -> None:
    """Aligned: a watermark after the barrier on a blocked channel waits with its data."""
    from pyengine.io import CheckpointBarrier

    listener = RecordingListener()
    gate = CheckpointedInputGate(2, listener)
    gate.push(0, CheckpointBarrier(1, 1))
    gate.push(0, Watermark(50))
    gate.push(1, ["a"])
    got = []
    while (item := gate.poll_next()) is not None:
        got.append(item)
    assert (0, Watermark(50)) not in got and (1, ["a"]) in got
    gate.push(1, CheckpointBarrier(1, 1))
    while (item := gate.poll_next()) is not None:
        got.append(item)
    assert got[-1] == (0, Watermark(50)), "released with the channel, in order"


# -- per-split watermarks ------------------------------------------------------------------------


class Splits(Source):
    """Split i has timestamps i*1000 + position."""

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        if position >= 10:
            return None
        return [{"ts": subtask * 1000 + p} for p in range(position, min(10, position + n))]


def test_a_source_subtask_has_the_lowest_watermark_of_its_live_splits() -> None:
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    op = SourceOperator("s", "s", Splits(), strategy)
    ctx = OperatorContext(
        job_name="j",
        subtask=0,
        parallelism=1,
        max_parallelism=128,
        state_backend="heap",
        local_recovery_dir=None,
        attempt=0,
    )
    op.setup(ctx, None)
    op.splits = [[0, 2, 0, 0], [1, 2, 0, 0]]  # two splits, as after rescaling from 2 to 1
    op.open()
    op.read(4)  # split 0: ts 0..3
    assert op.poll_watermark(0) == [], "split 1 has not said anything: MIN"
    op._turn = 1
    op.read(4)  # split 1: ts 1000..1003
    assert op.poll_watermark(0) == [Watermark(2)], "the lower split's: monotonous, ts 3 - 1"
    op._turn = 0
    while not op.splits[0][3]:
        op.read(4)
    split1 = op._generators[(1, 2)].current
    assert split1 > 1000
    assert op.poll_watermark(0) == [Watermark(split1)], "an ended split holds nothing back"


# -- watermarks in jobs --------------------------------------------------------------------------


class WatchLateness(pe.KeyedProcessFunction):
    """Emits (key, ts, watermark when the record arrived)."""

    def process_element(self, value: Any, ctx: Any) -> Any:
        yield (ctx.current_key, ctx.timestamp(), ctx.timer_service().current_watermark())

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        return None


@pytest.mark.parametrize("parallelism", [1, 3])
@pytest.mark.parametrize("unaligned", [False, True])
def test_no_record_is_ever_behind_the_watermark_within_the_bound(
    tmp_path: Any, parallelism: int, unaligned: bool
) -> None:
    """Each split is out of order by at most 30 ms and the strategy allows 30: however
    barriers (aligned, or unaligned and overtaking) and backpressure interleave with
    the data, no record may arrive behind its subtask's watermark, and watermarks
    do advance during the run."""
    n = 3000

    def record(i: int) -> Dict[str, Any]:
        return {"k": i % 17, "ts": i * 2 + (i * 7919) % 31}

    env = pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=5, unaligned=unaligned),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=8,
        buffer_timeout_ms=1,
        channel_capacity=2,
        auto_watermark_interval_ms=1,
    )
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(30).with_timestamp_assigner("ts")
    sink = pe.sinks.CollectSink()
    (
        env.from_generator(record, n, watermark_strategy=strategy)
        .rebalance()
        .map(lambda r: r)
        .key_by("k")
        .process(WatchLateness())
        .sink_to(sink)
    )
    result = env.execute("lateness")
    assert len(result.records) == n
    late = [r for r in result.records if r[1] <= r[2]]
    assert not late, f"records behind the watermark: {late[:5]}"
    assert max(r[2] for r in result.records) > n, "watermarks never advanced during the run"


class LastTimer(pe.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        ctx.timer_service().register_event_time_timer(10**15)  # far past every record
        return []

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        yield (ctx.current_key, timestamp, ctx.timer_service().current_watermark())


def test_a_bounded_source_ends_with_the_maximum_watermark(tmp_path: Any) -> None:
    env = pe.StreamEnvironment(parallelism=2)
    strategy = WatermarkStrategy.no_watermarks().with_timestamp_assigner("ts")
    sink = pe.sinks.CollectSink()
    env.from_collection([{"k": k, "ts": k} for k in range(5)], watermark_strategy=strategy).key_by("k").process(
        LastTimer()
    ).sink_to(sink)
    result = env.execute("end")
    assert sorted(result.records) == [(k, 10**15, MAX_WATERMARK) for k in range(5)]


class Gated(Source):
    """Split 0 has records; split 1 has one record and then nothing (not ended)
    until ``release`` is set."""

    def __init__(self, release: threading.Event, n: int) -> None:
        self.release = release
        self.n = n

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        if subtask == 1:
            if position == 0:
                return [{"k": 1, "ts": 0}]
            return None if self.release.is_set() else []
        if position >= self.n:
            return None if self.release.is_set() else []
        time.sleep(0.002)
        return [{"k": 0, "ts": p * 10} for p in range(position, min(self.n, position + 5))]


def _idle_run(idleness: bool) -> tuple:
    release = threading.Event()
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    if idleness:
        strategy = strategy.with_idleness(50)
    env = pe.StreamEnvironment(parallelism=2, auto_watermark_interval_ms=5)
    sink = pe.sinks.CollectSink()
    env.from_source(Gated(release, 400), watermark_strategy=strategy).key_by("k").window(
        pe.windows.tumbling(100)
    ).aggregate(pe.agg.count()).sink_to(sink)
    client = env.execute_async("idle")
    deadline = time.monotonic() + (20 if idleness else 1.5)
    seen: List[int] = []
    while time.monotonic() < deadline:
        marks = client.watermarks().get("v1", [])
        seen = [m for m in marks if m is not None]
        if seen and min(seen) >= 2000:
            break
        time.sleep(0.05)
    held = seen
    release.set()
    result = client.wait(60)
    return held, result


def test_an_idle_split_holds_windows_back_only_without_idleness() -> None:
    held, result = _idle_run(idleness=True)
    assert held and min(held) >= 2000, f"with idleness the window operator's watermark moved on: {held}"
    assert sorted((r["k"], r["window_start"], r["count"]) for r in result.records)[:2] == [(0, 0, 10), (0, 100, 10)]
    held, result = _idle_run(idleness=False)
    assert held == [-1, -1], f"without idleness the quiet split (its one record at ts 0) holds it back: {held}"
    assert len(result.records) == 41, "every window fires at the end of input all the same"


def test_a_runner_without_event_time_refuses_an_event_time_job_up_front() -> None:
    class Elsewhere:  # a runner that has not opted in with supports_event_time
        def job(self, *args: Any) -> Any:
            raise AssertionError("the job must be refused before the runner gets it")

    env = pe.StreamEnvironment()
    strategy = WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts")
    env.from_collection([{"k": 1, "ts": 1}], watermark_strategy=strategy).key_by("k").window(
        pe.windows.tumbling(10)
    ).aggregate(pe.agg.count()).sink_to(pe.sinks.CollectSink())
    with pytest.raises(ValueError, match="uses event time"):
        env.execute("elsewhere", runner=Elsewhere())
    plain = pe.StreamEnvironment()
    plain.from_collection([{"k": 1}]).key_by("k").aggregate(pe.agg.count()).sink_to(pe.sinks.CollectSink())
    with pytest.raises(AssertionError, match="refused before"):  # a job without event time goes through
        plain.execute("elsewhere", runner=Elsewhere())
