"""Event time on the Spark runner: watermarks and their status over the Flight
channels (the codec first, without Spark), then windows and event-time timers on a
local Spark, equal to the embedded runner's output and to a brute-force reference,
with and without an injected failure and restore."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import Counter, defaultdict
from typing import Any, Dict, List, Tuple

import pytest
from spark_sessions import local_spark

import pyengine as pe
from pyengine.connectors.base import Source
from pyengine.io import CheckpointBarrier, CheckpointOptions, EndOfPartition
from pyengine.io.events import MAX_WATERMARK, MIN_WATERMARK, WATERMARK_ACTIVE, WATERMARK_IDLE, Watermark
from pyengine.runners.flight import RemoteChannel, decode_event, encode_event, serve
from pyengine.state import ValueStateDescriptor
from pyengine.testing import RecordingListener

TOKEN = "event-time-token"

# -- the codec, and a Flight channel (no Spark) --------------------------------------------------


def test_watermarks_and_their_status_round_trip_through_the_channel_codec() -> None:
    for event in [Watermark(0), Watermark(-5), Watermark(MIN_WATERMARK), Watermark(MAX_WATERMARK)]:
        assert decode_event(encode_event(event)) == event
    assert decode_event(encode_event(WATERMARK_IDLE)) == WATERMARK_IDLE
    assert decode_event(encode_event(WATERMARK_ACTIVE)) == WATERMARK_ACTIVE
    assert len(encode_event(Watermark(MIN_WATERMARK))) < 40  # JSON, tiny


@pytest.mark.parametrize(
    "body",
    [
        {"e": "wm", "ts": 1.5},  # a float is not a timestamp
        {"e": "wm", "ts": 1e300},
        {"e": "wm", "ts": True},  # nor a bool (an int subclass in Python)
        {"e": "wm", "ts": "17"},  # nor a string that looks like one
        {"e": "wm", "ts": 2**63},  # one past the largest watermark
        {"e": "wm", "ts": -(2**63) - 1},
        {"e": "wm", "ts": None},
        {"e": "wm"},
        {"e": "wm", "ts": 1, "extra": "x"},
        {"e": "idle", "ts": 1},
        {"e": "active", "idle": False},
        {"e": ["wm"], "ts": 1},
        {"e": "barrier", "id": "3", "ts": 1, "type": "checkpoint", "unaligned": False},
        {"e": "barrier", "id": 3, "ts": 1.0, "type": "checkpoint", "unaligned": False},
        {"e": "barrier", "id": 3, "ts": 1, "type": "checkpoint", "unaligned": 1},
        {"e": "cancel", "id": 2.5},
        ["wm", 1],
        "wm",
        17,
    ],
)
def test_a_corrupt_or_hostile_time_event_is_refused(body: Any) -> None:
    raw = json.dumps(body).encode()
    with pytest.raises(ValueError, match=r"corrupt|unknown"):
        decode_event(raw)


def test_unknown_kinds_and_oversized_events_are_refused_before_anything_is_built() -> None:
    with pytest.raises(ValueError, match="unknown channel event"):
        decode_event(b'{"e":"watermark","ts":1}')
    with pytest.raises(ValueError, match="at most 4096"):
        decode_event(b'{"e":"wm","ts":' + b"1" * 5000 + b"}")  # big ints are refused by size, not parsed
    with pytest.raises(ValueError, match="corrupt"):
        decode_event(b'{"e":"wm","ts":' + b"9" * 400 + b"}")  # parsed, then out of range


def test_a_flight_channel_keeps_watermarks_in_order_with_the_data() -> None:
    gate = pe.io.CheckpointedInputGate(1, RecordingListener(), capacity=2)
    server, _ = serve(gate, TOKEN)
    out = RemoteChannel(server.location, 0, TOKEN, capacity=2)
    try:
        items: List[Any] = []
        for i in range(30):
            items += [[{"i": i}], Watermark(i * 10)]
            if i == 10:
                items += [WATERMARK_IDLE, WATERMARK_ACTIVE, CheckpointBarrier(1, 5, CheckpointOptions())]
        items += [Watermark(MAX_WATERMARK), EndOfPartition()]
        got: List[Any] = []

        def receive() -> None:  # the channel holds a few items, not all: the gate is read as they come
            deadline = time.monotonic() + 20
            while (not got or not isinstance(got[-1], EndOfPartition)) and time.monotonic() < deadline:
                item = gate.next(timeout=0.1)
                if item is not None:
                    got.append(item[1])

        receiver = threading.Thread(target=receive)
        receiver.start()
        for item in items:
            assert out.put(0, item, timeout=10)
        receiver.join(30)
        assert got == items, f"{len(got)} of {len(items)} arrived"
    finally:
        out.close()
        server.shutdown()


def test_a_tasks_reported_event_time_is_kept_only_well_formed_and_only_for_the_current_attempt() -> None:
    """What a Spark task sends with its poll is JSON from another process: the driver
    keeps its three figures only as 64-bit ints, and only the current attempt's."""
    import threading

    from pyengine.coordinator import ExecutionAttempt
    from pyengine.runners.spark import EVENT_TIME_KEY, _clean_time_metrics, _SparkJob

    good = {"currentInputWatermark": 5, "currentOutputWatermark": 4, "numLateRecordsDropped": 2}
    assert _clean_time_metrics(good) == good
    for bad in (
        None,
        [],
        "x",
        {"currentInputWatermark": 5},
        {**good, "numLateRecordsDropped": True},
        {**good, "currentInputWatermark": 2**63},
        {**good, "currentOutputWatermark": "4"},
        {**good, "currentOutputWatermark": 4.0},
    ):
        assert _clean_time_metrics(bad) is None, bad
    job = object.__new__(_SparkJob)  # just the driver's bookkeeping, no Spark
    job._attempt_number, job._time_lock, job._time_reports, job.monitor = 1, threading.Lock(), {}, None
    job._on_report(ExecutionAttempt("v1", 1, 1), {EVENT_TIME_KEY: {**good, "currentInputWatermark": 7}})
    job._on_report(ExecutionAttempt("v1", 0, 1), {EVENT_TIME_KEY: good})
    job._on_report(ExecutionAttempt("v1", 0, 0), {EVENT_TIME_KEY: {**good, "currentInputWatermark": 99}})  # stale
    job._on_report(ExecutionAttempt("v0", 0, 1), {EVENT_TIME_KEY: {"currentInputWatermark": "hostile"}})
    job._on_report(ExecutionAttempt("v0", 1, 1), ["not", "a", "dict"])
    stats = job.event_time_statistics()
    assert stats.watermarks == {"v1": [5, 7]} and stats.output_watermarks == {"v1": [4, 4]}
    assert stats.late_records_dropped == 4


# -- jobs on Spark ---------------------------------------------------------------------------------

pyspark = pytest.importorskip("pyspark", reason="the Spark runner needs pyspark (the test extra installs it)")

SLOTS = 4  # two operator chains at parallelism 2: each keyed subtask's valve has two remote channels
JITTER, SIZE, KEYS, N = 20, 100, 11, 1200
BUCKETS = ValueStateDescriptor("buckets")  # {bucket end: records}


def make_records(seed: int) -> List[Dict[str, Any]]:
    """Event times that advance with pauses and are out of order by at most JITTER, so
    within the strategy's bound nothing is late and the output does not depend on timing."""
    rng = random.Random(seed)
    out, t = [], 0
    for v in range(N):
        t += rng.choice([1, 2, 3, 60])
        out.append({"k": rng.randrange(KEYS), "ts": t + rng.randrange(JITTER + 1), "v": v})
    return out


RECORDS = make_records(13)


@pytest.fixture(scope="module")
def spark():
    yield from local_spark(__name__, "pyengine-event-time-tests", SLOTS)


class FailOnce:
    """Raises at one record, once across every process of the job (a marker file)."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at = marker, at

    def __call__(self, record: Any) -> Any:
        if record["v"] == self.at:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return record
            os.close(fd)
            raise RuntimeError(f"injected failure at record {self.at}")
        return record


def _same(record: Any) -> Any:
    return record


class Buckets(pe.KeyedProcessFunction):
    """Each key's records per SIZE ms of event time, with timers: one timer per record
    at its bucket's end (deduplicated per key and time), the bucket emitted and
    cleared when the watermark passes it."""

    def open(self, ctx: Any) -> None:
        self.buckets = ctx.get_state(BUCKETS)

    def process_element(self, value: Any, ctx: Any) -> Any:
        end = ctx.timestamp() // SIZE * SIZE + SIZE - 1
        buckets = self.buckets.value() or {}
        buckets[end] = buckets.get(end, 0) + 1
        self.buckets.update(buckets)
        ctx.timer_service().register_event_time_timer(end)
        return []

    def on_timer(self, timestamp: int, ctx: Any) -> Any:
        buckets = self.buckets.value()
        yield {"k": ctx.current_key, "end": timestamp, "n": buckets.pop(timestamp)}
        self.buckets.update(buckets or None)


def window_reference() -> Counter:
    counts: Dict[Tuple[int, int], int] = defaultdict(int)
    for r in RECORDS:
        counts[(r["k"], r["ts"] // SIZE * SIZE)] += 1
    return Counter((k, start, start + SIZE, n) for (k, start), n in counts.items())


def timer_reference() -> Counter:
    return Counter((k, start + SIZE - 1, n) for k, start, _, n in window_reference())


def window_rows(records: List[Any]) -> Counter:
    return Counter((r["k"], r["window_start"], r["window_end"], r["count"]) for r in records)


def timer_rows(records: List[Any]) -> Counter:
    return Counter((r["k"], r["end"], r["n"]) for r in records)


def run(tmp_path: Any, kind: str, runner: Any, fail_at: int = -1) -> Tuple[Any, List[Any]]:
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=30),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=32,
        buffer_timeout_ms=2,
        restart_attempts=2,
        auto_watermark_interval_ms=5,
    )
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(JITTER).with_timestamp_assigner("ts")
    stream = env.from_collection(RECORDS, watermark_strategy=strategy)
    stream = stream.map(FailOnce(str(tmp_path / "failed-once"), fail_at) if fail_at >= 0 else _same)
    keyed = stream.key_by("k")
    out = (
        keyed.window(pe.windows.tumbling(SIZE)).aggregate(pe.agg.count()).uid("windows")
        if kind == "window"
        else keyed.process(Buckets()).uid("buckets")
    )
    if runner == "embedded":
        sink: Any = pe.sinks.CollectSink()
        out.sink_to(sink)
        result = env.execute(f"{kind}-embedded")
        return result, result.records
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    out.sink_to(sink)
    result = env.execute(f"{kind}-spark", runner=runner)
    return result, sink.read_committed()


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["window", "timer"])
def test_event_time_on_spark_equals_embedded_across_a_failure_and_restore(tmp_path, spark, kind) -> None:
    """One Spark run per kind (Spark runs are the slow part): a record raises once, in
    the middle, after checkpoints with open windows and pending timers completed; the
    stage restarts from the latest one and the committed output is still exact."""
    rows, reference = (window_rows, window_reference) if kind == "window" else (timer_rows, timer_reference)
    expected = reference()
    embedded, records = run(tmp_path / "embedded", kind, "embedded")
    assert rows(records) == expected

    at = random.Random(kind).randrange(N // 3, 2 * N // 3)
    on_spark, records = run(tmp_path / "spark", kind, pe.runners.SparkRunner(spark), fail_at=at)
    assert on_spark.status == "FINISHED", on_spark.cause
    assert os.path.exists(tmp_path / "spark" / "failed-once"), "the failure was never injected"
    assert on_spark.restarts == 1
    assert rows(records) == expected == rows(embedded.records), "Spark repeated or lost a window or a firing"
    # Each subtask's watermarks came to the driver with its poll (the restarted
    # attempt's): the end of input is the maximum watermark everywhere, nothing late.
    stats = on_spark.event_time
    assert stats is not None and sorted(stats.watermarks) == ["v0", "v1"], stats
    for vertex in ("v0", "v1"):
        assert stats.watermarks[vertex] == [MAX_WATERMARK, MAX_WATERMARK], stats
        assert stats.output_watermarks[vertex] == [MAX_WATERMARK, MAX_WATERMARK], stats
    assert stats.late_records_dropped == 0


class OneQuietSplit(Source):
    """Unbounded: split 0 a record every 10 ms of event time (keys 0-2), at most 40 per
    read, paced; split 1 one record at ts 0, then nothing, ever. Without idleness the
    quiet split holds every window back for good."""

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        if subtask == 1:
            return [{"k": 9, "ts": 0}] if position == 0 else []
        time.sleep(0.005)
        return [{"k": (position + i) % 3, "ts": (position + i) * 10} for i in range(min(n, 40))]


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("stop", ["cancel", "savepoint"])
def test_an_idle_split_on_spark_does_not_hold_windows_back_and_the_stream_stops(tmp_path, spark, stop) -> None:
    """The quiet split's IDLE status crosses the Flight channels to the window tasks, so
    windows fire and commit while the unbounded job runs; client.cancel() or
    stop_with_savepoint ends it."""
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=50),
        checkpoint_storage=str(tmp_path / "ckpt"),
        auto_watermark_interval_ms=10,
        buffer_timeout_ms=2,
    )
    strategy = pe.WatermarkStrategy.for_monotonous_timestamps().with_timestamp_assigner("ts").with_idleness(200)
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    env.from_source(OneQuietSplit(), watermark_strategy=strategy).key_by("k").window(
        pe.windows.tumbling(1_000)
    ).aggregate(pe.agg.count()).sink_to(sink)
    client = env.execute_async("idle-on-spark", runner=pe.runners.SparkRunner(spark))
    deadline = time.monotonic() + 120
    committed: List[Any] = []
    while time.monotonic() < deadline and len(committed) < 6 and not client.done():
        time.sleep(0.5)
        committed = sink.read_committed()
    if stop == "cancel":
        client.cancel()
    else:
        path = client.stop_with_savepoint(str(tmp_path / "savepoints"), timeout_s=120)
        assert os.path.exists(os.path.join(path, "_metadata")), path
    result = client.wait(120, raise_failure=False)
    assert result.status == ("CANCELED" if stop == "cancel" else "FINISHED"), result.cause
    rows = sink.read_committed()
    assert len(rows) >= 6, f"windows never fired while the job ran: {rows}"
    # every committed window is whole: 100 records of event time per second, keys in turn,
    # and the quiet split's one record (key 9) fired with the first window
    expected = {
        (k, w): sum(1 for i in range(w // 10, w // 10 + 100) if i % 3 == k)
        for k in range(3)
        for w in range(0, 10**6, 1000)
    }
    expected[(9, 0)] = 1
    got = {(r["k"], r["window_start"]): r["count"] for r in rows}
    assert len(got) == len(rows), "a window was committed twice"
    assert all(expected[w] == n for w, n in got.items()), rows
    assert (9, 0) in got and (0, 0) in got, rows
