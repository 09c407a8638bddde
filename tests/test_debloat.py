"""Adaptive buffers (``StreamEnvironment(buffer_debloat=True)``, pyengine.runtime.debloat):
the sizing rule and its floors, a channel's measurement of its consumer, a job whose
consumer is slow ending with smaller limits than one whose consumer keeps up, the
statistics that show them, exactly-once with them on and off, and off being off."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from typing import Any, Dict, List, Optional

import pyarrow as pa
import pytest

import pyengine as pe
import pyengine.runtime.debloat as debloat_module
from pyengine.io import CheckpointedInputGate, EndOfPartition
from pyengine.monitoring.metrics import MetricsHistory, clean_counters
from pyengine.runtime.debloat import MIN_IN_FLIGHT, MIN_RECORDS, ChannelDebloater, Plan, plan
from pyengine.runtime.outputs import Output
from pyengine.state import ValueStateDescriptor

# -- the sizing rule ------------------------------------------------------------------------


def test_a_fast_consumer_keeps_the_configured_size_and_capacity() -> None:
    # 1 M records/s for 1 s is far more than 8 buffers of 1,024
    assert plan(1_000_000, 1000, max_size=1024, capacity=8) == Plan(1024, 8)


def test_fewer_buffers_first_then_smaller_ones() -> None:
    # 8,000/s for 20 ms: 160 records may be in flight, two full buffers of 64
    assert plan(8_000, 20, max_size=64, capacity=8) == Plan(64, 2)
    # 400 records: six buffers of 64, the size untouched
    assert plan(20_000, 20, max_size=64, capacity=8) == Plan(64, 6)
    # 3,000 records budget with buffers of 1,024: 2 of them, never smaller
    assert plan(3_000, 1000, max_size=1024, capacity=8) == Plan(1024, 2)
    # under two full buffers: MIN_IN_FLIGHT buffers, each of half the budget
    assert plan(1_000, 100, max_size=1024, capacity=8) == Plan(50, MIN_IN_FLIGHT)


def test_the_floors_hold_however_slow_the_consumer() -> None:
    """FLINK-33077: buffers shrank to 256 bytes and checkpoints took minutes. Here a
    buffer never drops below MIN_RECORDS records, nor in-flight below MIN_IN_FLIGHT."""
    for rate in (0.5, 10.0, 100.0, 500.0):
        p = plan(rate, 1000, max_size=1024, capacity=8)
        assert p.size >= MIN_RECORDS and p.in_flight == MIN_IN_FLIGHT, (rate, p)
    assert plan(10.0, 1000, max_size=1024, capacity=8).size == MIN_RECORDS
    # a configured size under the floor is kept (the ceiling wins), and capacity 1 stays 1
    assert plan(10.0, 1000, max_size=8, capacity=8) == Plan(8, MIN_IN_FLIGHT)
    assert plan(10.0, 1000, max_size=64, capacity=1) == Plan(MIN_RECORDS, 1)


def test_a_consumer_that_waited_is_not_measured() -> None:
    """Not busy (the consumer waited for data): its rate is the producer's, so nothing
    is limited; an unmeasured (zero or NaN) rate neither."""
    assert plan(10.0, 1000, max_size=1024, capacity=8, busy=False) == Plan(1024, 8)
    assert plan(0.0, 1000, max_size=1024, capacity=8) == Plan(1024, 8)
    assert plan(float("nan"), 1000, max_size=1024, capacity=8) == Plan(1024, 8)


# -- one channel's measurement --------------------------------------------------------------


def _drive(c: ChannelDebloater, *, per_period: int, periods: int, queued: int, start: float = 0.0) -> float:
    """``periods`` periods in which the consumer takes ``per_period`` records (in
    buffers of ``c.size``) and ``queued`` items stay queued at every look."""
    now = start
    for _ in range(periods):
        taken = 0
        while taken < per_period:
            size = min(c.size, c.max_size)
            c.pushed(size)
            taken += size
        step = debloat_module.PERIOD_S / 4 * 1.001  # a period ends on its 4th look
        for _ in range(4):
            now += step
            c.observe(queued, now)
    return now


def test_a_channel_converges_on_its_consumers_rate() -> None:
    c = ChannelDebloater(20, max_size=64, capacity=8)
    c._period_start = 0.0  # the fake clock below starts at 0
    # 768 records per 0.1 s period: 7,680/s, busy (the queue never empty)
    _drive(c, per_period=768, periods=5, queued=2)
    assert c.rate == pytest.approx(7_680, rel=0.05)
    assert (c.size, c.in_flight) == (64, 2)
    assert c.stats()["buffers_in_flight"] == 2


def test_a_channel_whose_consumer_waits_loosens_its_limits_step_by_step() -> None:
    c = ChannelDebloater(20, max_size=64, capacity=8)
    c._period_start = 0.0
    now = _drive(c, per_period=768, periods=5, queued=2)
    assert c.in_flight == 2
    # the consumer now finds the queue empty: one buffer more per period, up to capacity
    now = _drive(c, per_period=800, periods=1, queued=0, start=now)
    assert c.in_flight == 3
    _drive(c, per_period=800, periods=10, queued=0, start=now)
    assert (c.size, c.in_flight) == (64, 8)


def test_a_consumer_with_a_cost_per_buffer_does_not_spiral_below_the_floor() -> None:
    """Each buffer costs the consumer the same whatever its size (the FLINK-33077 case):
    shrinking buffers lowers its records/s, which would shrink them further. The floor
    ends that at MIN_RECORDS."""
    c = ChannelDebloater(10, max_size=256, capacity=8)
    c._period_start = 0.0
    now = 0.0
    for _ in range(30):  # 10 buffers per period, whatever their size
        for _ in range(10):
            c.pushed(c.size)
        now += debloat_module.PERIOD_S
        c.observe(1, now)
    assert c.size >= MIN_RECORDS and c.in_flight >= MIN_IN_FLIGHT


# -- the Output: limits applied, and off is off ---------------------------------------------


class _Listener:
    def trigger_checkpoint_on_barrier(self, barrier: Any, metrics: Any) -> None:
        pass

    def abort_checkpoint_on_barrier(self, checkpoint_id: int, reason: Any) -> None:
        pass


@pytest.mark.parametrize("implementation", ["native", "reference"])
def test_an_output_keeps_to_its_limits(implementation: str) -> None:
    gate = CheckpointedInputGate(1, _Listener(), capacity=8, implementation=implementation)
    assert gate.capacity == 8
    out = Output([gate], 0, "forward", None, 128, 64, threading.Event(), debloat_target_ms=20)
    d = out._debloat[0]  # type: ignore[index]
    d.size, d.in_flight, d.shrunk = 40, 2, True
    out.emit(list(range(200)))  # five buffers of 40: two queued, the rest wait
    assert gate.queued(0) == 2
    assert not out.available
    got = [item for _, item in gate.poll_batch(10)]
    assert [len(b) for b in got] == [40, 40]
    assert out.drain() is False and gate.queued(0) == 2  # room for two more, then the limit again
    out.wait_for_room(0.01)  # below capacity: it waits, the limit holds
    assert gate.queued(0) == 2


def _limits_after_a_slowdown(gate: Any, channel: Any, fast_s: float, slow_s: float) -> Any:
    """A producer at full speed into ``channel`` (``gate`` itself, or a Flight channel
    to it), whose consumer takes every buffer at once for ``fast_s``, then 0.4 ms a
    record for ``slow_s``: the channel's debloater after that (the producer waits for
    room as a task does). The producer ends its output and the consumer, at full speed
    again, reads it to the end, so a Flight channel closes cleanly."""
    out = Output([channel], 0, "forward", None, 128, 64, threading.Event(), debloat_target_ms=20)
    started = time.monotonic()
    ended = threading.Event()

    def consume() -> None:
        deadline = started + fast_s + slow_s + 30
        while time.monotonic() < deadline:
            got = gate.next(timeout=0.01)  # waits with the GIL released, as a task does
            if got is None:
                continue
            if isinstance(got[1], EndOfPartition):
                ended.set()
                return
            if type(got[1]) is list and fast_s < time.monotonic() - started < fast_s + slow_s:
                time.sleep(0.0004 * len(got[1]))  # afterwards at full speed again: a backlog drains

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    i = 0
    while time.monotonic() - started < fast_s + slow_s:
        out.emit(list(range(i, i + 16)))
        i += 16
        if not out.available:
            out.wait_for_room(0.05)
    d = out._debloat[0]  # type: ignore[index]
    limits = (d.size, d.in_flight, d.rate)
    out.broadcast_event(EndOfPartition())
    while not out.drain():  # a transport holding a backlog fails here, not by hanging
        assert time.monotonic() - started < fast_s + slow_s + 30, ("the backlog never drained", limits)
        out.wait_for_room(0.05)
    consumer.join(40)
    assert ended.is_set(), "the consumer never got to the end"
    return limits


@pytest.mark.parametrize("remote", [False, True], ids=["in-process-gate", "flight-channel"])
def test_a_consumer_that_slows_down_later_is_still_measured(fast_periods: None, remote: bool) -> None:
    """The limits are the configured ones while the consumer keeps up; then it slows
    down, and the producer's limits follow. Through a Flight channel too (the Spark
    runner's): there gRPC's own buffers once held the backlog (megabytes, 160 s of this
    consumer's work), the channel's send queue drained as fast as they took it, and the
    limits never came down; its credits now keep the transport to a few messages. (The
    rate is over the last 20 periods with data, which the waiting producer makes ~0.1 s
    long here: the slow phase outlasts that window.)"""
    gate = CheckpointedInputGate(1, _Listener(), capacity=8)
    if not remote:
        size, in_flight, rate = _limits_after_a_slowdown(gate, gate, 0.2, 2.5)
    else:
        from pyengine.runners.flight import RemoteChannel, serve

        server, _ = serve(gate, "debloat-test-token")
        channel = RemoteChannel(server.location, 0, "debloat-test-token", capacity=8)
        try:
            size, in_flight, rate = _limits_after_a_slowdown(gate, channel, 0.2, 2.5)
        finally:
            channel.close()
            server.shutdown()
    assert (size, in_flight) < (64, 8), (size, in_flight, rate)
    assert rate < 10_000, f"the consumer takes ~2,500 records/s, measured {rate:.0f}"


def test_off_keeps_the_fixed_sizes() -> None:
    gate = CheckpointedInputGate(1, _Listener(), capacity=8)
    out = Output([gate], 0, "forward", None, 128, 64, threading.Event(), debloat_target_ms=None)
    assert out.debloat_stats() is None
    out.emit(list(range(64 * 10)))  # one buffer of 640 (not split), as before
    assert gate.queued(0) == 1 and len(gate.poll_next()[1]) == 640  # type: ignore[index]


def test_arrow_slices_never_go_below_the_byte_floor() -> None:
    gate = CheckpointedInputGate(1, _Listener(), capacity=64)
    out = Output([gate], 0, "forward", None, 128, 1024, threading.Event(), debloat_target_ms=20)
    d = out._debloat[0]  # type: ignore[index]
    d.size, d.in_flight, d.shrunk = 100, 64, True
    batch = pa.RecordBatch.from_pydict({"a": list(range(20_000)), "b": list(range(20_000))})  # 16 bytes a row
    out.emit(batch)
    rows = [item.num_rows for _, item in gate.poll_batch(64)]
    assert sum(rows) == 20_000
    assert min(rows[:-1]) * 16 >= debloat_module.MIN_BATCH_BYTES


# -- jobs ------------------------------------------------------------------------------------


class SlowSink(pe.sinks.DiscardSink):
    """Staging costs ``per_record_s`` a record: a consumer slower than its producer."""

    def __init__(self, per_record_s: float) -> None:
        super().__init__()
        self.per_record_s = per_record_s

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        time.sleep(self.per_record_s * len(records))
        super().stage(subtask, checkpoint_id, records)


@pytest.fixture
def fast_periods(monkeypatch) -> None:
    """Re-plan every 10 ms (not 100), looking every 2: the jobs here run for about a second."""
    monkeypatch.setattr(debloat_module, "PERIOD_S", 0.01)
    monkeypatch.setattr(debloat_module, "SAMPLE_S", 0.002)


def _limits_while_running(per_record_s: float, seconds: float = 1.2) -> List[Dict[str, Any]]:
    env = pe.StreamEnvironment(
        parallelism=1,
        buffer_size=64,
        buffer_timeout_ms=5,
        channel_capacity=8,
        buffer_debloat_target_ms=20,
        monitoring=None,
    )
    (
        env.from_generator(lambda i: {"i": i}, 10_000_000)
        .map(lambda r: r)
        .rebalance()
        .map(lambda r: r)
        .sink_to(SlowSink(per_record_s))
    )
    client = env.execute_async("debloat-limits", resume="never")
    try:
        time.sleep(seconds)
        counters = client._runner.task_metrics()  # what the monitor samples
    finally:
        client.cancel()
        client.wait(30, raise_failure=False)
    return counters


def test_a_slow_consumer_ends_with_smaller_limits_and_the_statistics_show_them(fast_periods) -> None:
    slow = _limits_while_running(0.0004)  # 64 records: 25 ms, 2,500/s: 50 records in 20 ms
    fast = _limits_while_running(0.0)
    producer = [c for c in slow if "buffer_size" in c]
    assert producer, f"no subtask reported its buffers: {slow}"
    (s,) = producer
    (f,) = [c for c in fast if "buffer_size" in c]
    assert (s["buffer_size"], s["buffers_in_flight"]) < (64, 8), s
    assert s["buffer_size"] * s["buffers_in_flight"] < f["buffer_size"] * f["buffers_in_flight"]
    assert (f["buffer_size"], f["buffers_in_flight"]) == (64, 8), f
    # a sink has no output: nothing to show
    assert all("buffer_size" not in c for c in slow if c is not s)
    # through the Spark runner's cleaning and into the monitor's samples
    cleaned = [clean_counters(c) for c in slow]
    assert all(c is not None for c in cleaned)
    sample = MetricsHistory().add([c for c in cleaned if c is not None])
    seen = {(k, v.buffer_size, v.buffers_in_flight) for k, v in sample.subtasks.items()}
    assert ((s["vertex"], 0), s["buffer_size"], s["buffers_in_flight"]) in seen


def test_off_reports_nothing_and_limits_nothing() -> None:
    env = pe.StreamEnvironment(parallelism=1, buffer_size=64, buffer_debloat=False, monitoring=None)
    env.from_generator(lambda i: i, 10_000_000).rebalance().sink_to(SlowSink(0.0004))
    client = env.execute_async("debloat-off", resume="never")
    try:
        time.sleep(0.5)
        counters = client._runner.task_metrics()
    finally:
        client.cancel()
        client.wait(30, raise_failure=False)
    assert all("buffer_size" not in c and "buffers_in_flight" not in c for c in counters)


# -- exactly once ----------------------------------------------------------------------------

COUNT = ValueStateDescriptor("count", 0, pa.int64())
N = 2000
RECORDS = [{"user": i % 13, "v": i} for i in range(N)]


class FailOnce:
    def __init__(self, at: int) -> None:
        self.at, self.calls, self.fired = at, 0, False
        self.lock = threading.Lock()

    def hit(self) -> None:
        with self.lock:
            self.calls += 1
            if self.fired or self.calls < self.at:
                return
            self.fired = True
        raise RuntimeError("injected failure")


class Count(pe.KeyedProcessFunction):
    def __init__(self, chaos: FailOnce) -> None:
        self.chaos = chaos

    def __deepcopy__(self, memo: Any) -> Count:
        return Count(self.chaos)

    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        self.chaos.hit()
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "n": n}


def _slow(record: Any) -> Any:
    """A consumer slower than its producer (a transactional sink stages per checkpoint,
    so the slowness goes before it): half a millisecond a record."""
    time.sleep(0.0005)
    return record


def _exactly_once(tmp_path: Any, debloat: bool, unaligned: bool, at: int) -> Counter:
    chaos = FailOnce(at)
    tag = f"{debloat}-{unaligned}"
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=10, unaligned=unaligned),
        checkpoint_storage=str(tmp_path / f"ckpt-{tag}"),
        buffer_size=16,  # channels of 8 hold 128 records: far fewer than the job has
        buffer_timeout_ms=1,
        channel_capacity=8,
        restart_attempts=2,
        buffer_debloat=debloat,
        buffer_debloat_target_ms=5,
        monitoring=None,
    )
    sink = pe.sinks.FileSink(str(tmp_path / f"out-{tag}"))
    (
        env.from_collection(RECORDS)
        .key_by("user")
        .process(Count(chaos))
        .uid("counter")
        .rebalance()
        .map(_slow)
        .sink_to(sink)
    )
    result = env.execute(f"debloat-exactly-once-{tag}")
    assert result.status == "FINISHED", result.cause
    assert result.restarts == 1 and chaos.fired
    return Counter((r["user"], r["n"]) for r in sink.read_committed())


@pytest.mark.parametrize("unaligned", [False, True], ids=["aligned", "unaligned"])
def test_exactly_once_is_the_same_with_adaptive_buffers_on_and_off(tmp_path, fast_periods, unaligned: bool) -> None:
    shrunk: List[Optional[int]] = []
    replan = ChannelDebloater._replan

    def watching(self: ChannelDebloater, now: float) -> None:
        replan(self, now)
        shrunk.append(self.size * self.in_flight)

    at = random.Random(7).randint(N // 3, 2 * N // 3)
    per_user = Counter(r["user"] for r in RECORDS)
    expected = Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})
    off = _exactly_once(tmp_path, False, unaligned, at)
    ChannelDebloater._replan = watching  # type: ignore[method-assign]
    try:
        on = _exactly_once(tmp_path, True, unaligned, at)
    finally:
        ChannelDebloater._replan = replan  # type: ignore[method-assign]
    assert off == expected
    assert on == expected
    assert any(x is not None and x < 16 * 8 for x in shrunk), "the limits never tightened: the test did not test that"


# -- pyengine tune ----------------------------------------------------------------------------


def test_tune_tries_interval_auto_and_debloat_off() -> None:
    from pyengine.tune.search import _Search
    from pyengine.tune.settings import DEFAULT_SPACE, Setting

    assert "auto" in DEFAULT_SPACE["interval_ms"] and set(DEFAULT_SPACE["buffer_debloat"]) == {True, False}
    search = _Search(
        lambda s, t, r: None,  # type: ignore[arg-type,return-value]
        {"interval_ms": (500, "auto"), "buffer_debloat": (True, False)},
        "throughput",
        None,
        5.0,
        10,
        1,
        None,
    )
    points = [p for row in search.coordinates(Setting()) for p in row]
    auto = [p for p in points if p.interval_ms == "auto"]
    assert auto and all(p.max_recovery_s == 5.0 for p in auto)  # the search's own recovery goal
    assert auto[0].checkpoint_kwargs() == {
        "interval_ms": "auto",
        "unaligned": False,
        "aligned_timeout_ms": 0,
        "max_recovery_s": 5.0,
    }
    assert "interval=auto" in auto[0].label and "max_recovery_s=5.0" in auto[0].snippet()
    assert auto[0].nominal_interval_ms == 1000  # a quarter of the goal's budget (80% of 5 s)
    off = [p for p in points if not p.buffer_debloat]
    assert off and "buffer_debloat=False" in off[0].snippet() and "debloat=off" in off[0].label
    with pytest.raises(TypeError, match="interval_ms"):
        Setting(interval_ms="1s")


def test_a_measured_auto_interval_is_the_one_the_coordinator_used() -> None:
    from pyengine.tune import measure
    from pyengine.tune.settings import Setting

    def build(env: Any) -> None:
        env.from_generator(lambda i: {"i": i}, 10_000_000).map(lambda r: r).sink_to(pe.sinks.DiscardSink())

    m = measure(build, Setting(interval_ms="auto", max_recovery_s=1.0), seconds=2.0, parallelism=1)
    assert m.checkpoints >= 1, "no checkpoint completed: nothing to compare"
    assert 50 <= m.interval_ms <= 1000  # MIN_INTERVAL_MS .. the goal
    assert m.replay_s == pytest.approx((m.interval_ms + m.checkpoint_p50_ms) / 1000, rel=0.01)
