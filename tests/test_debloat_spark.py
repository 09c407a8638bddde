"""Adaptive buffers on the Spark runner: a producer whose consumer, a task in another
Python worker behind a Flight channel, is slower than it tightens its limits as on the
embedded runner, and the limits reach the driver's monitor with the task's counters.

On Spark the producer measures its remote channel's send queue (docs/guide/tuning.md):
this is the test that the measurement engages there too, not only in one process."""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

import pytest
from spark_sessions import local_spark

import pyengine as pe

pytest.importorskip("pyspark", reason="the Spark runner needs pyspark (the test extra installs it)")

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SIZE, CAPACITY = 64, 8  # the configured limits, which a slow consumer must bring down


@pytest.fixture(scope="module")
def spark() -> Any:
    yield from local_spark(__name__, "pyengine-debloat-tests", 3)


class SlowSink(pe.sinks.DiscardSink):
    """Staging costs ``per_record_s`` a record: a consumer slower than its producer.

    test_debloat.py's, defined here again on purpose: Spark's Python workers get this
    module by value (``local_spark``) but cannot import test_debloat (imported from it,
    the job failed on the executors)."""

    def __init__(self, per_record_s: float) -> None:
        super().__init__()
        self.per_record_s = per_record_s

    def stage(self, subtask: int, checkpoint_id: int, records: Any) -> None:
        time.sleep(self.per_record_s * len(records))
        super().stage(subtask, checkpoint_id, records)


def _identity(record: Any) -> Any:
    return record


def test_a_slow_consumer_on_spark_brings_the_producers_limits_down(spark: Any) -> None:
    env = pe.StreamEnvironment(
        parallelism=1,
        buffer_size=SIZE,
        buffer_timeout_ms=5,
        channel_capacity=CAPACITY,
        buffer_debloat_target_ms=20,
        monitoring=pe.Monitoring(sample_interval_s=0.2, progress=False, announce=False),
    )
    (
        env.from_generator(lambda i: {"i": i}, 10_000_000)
        .map(_identity)
        .rebalance()  # the slow sink's task is another Spark task: the records cross a Flight channel
        .map(_identity)
        .sink_to(SlowSink(0.0004))  # 64 records: 25 ms, 2,500/s: 50 records in 20 ms
    )
    client = env.execute_async("debloat-on-spark", runner=pe.runners.SparkRunner(spark))
    seen: List[Tuple[Any, int, int]] = []
    tightened: Dict[Any, Tuple[int, int]] = {}
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not client.done() and not tightened:
            latest = client._runner.monitor.history.latest
            if latest is not None:
                for key, s in latest.subtasks.items():
                    if s.buffer_size is not None and s.buffers_in_flight is not None:
                        seen.append((key, s.buffer_size, s.buffers_in_flight))
                        if (s.buffer_size, s.buffers_in_flight) < (SIZE, CAPACITY):
                            tightened[key] = (s.buffer_size, s.buffers_in_flight)
            time.sleep(0.2)
    finally:
        client.cancel()
        result = client.wait(60, raise_failure=False)
    assert seen, f"no producer's limits reached the driver's monitor (the job ended {result.status})"
    assert tightened, f"the limits never came down from ({SIZE}, {CAPACITY}); the last seen: {seen[-5:]}"
    for size, in_flight in tightened.values():
        assert size >= 16 and in_flight >= 2, "the floors hold on Spark too"
