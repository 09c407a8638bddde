"""The foreachBatch handler's added time per micro-batch, in one run.

A Structured Streaming query (Spark's file source, one parquet file of 20,000 rows over
10,000 keys per micro-batch, as in issue 14's measurements) on ``local[2]`` calls, for
each micro-batch, first ``df.toArrow()`` alone (the baseline: collecting the batch to the
driver, what any driver-side step pays), then ``pyengine.spark.ForeachBatchHandler`` on
the same batch (collect, feed to the long-running job, keyed count, checkpoint). Both are
timed per batch, interleaved, so the machine's load hits both alike. Reported: the
medians and the handler's added time, its feed-to-checkpoint part (the collect inside
it is what any foreachBatch step pays). Asserted: the handler's median is at most
``GUARD`` x the baseline's, a regression guard. Measured on the shared 2-core machine
at load ~20: handler 1185 ms vs collecting 1361 ms (its collect, the batch's second,
is the faster one), feed to checkpoint 117-292 ms."""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any, List

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import SUMMARY, start_spark

import pyengine as pe
import pyengine.spark

pytest.importorskip("pyspark")

BATCHES = 8
ROWS = 20_000
KEYS = 10_000
GUARD = 5.0
SPARK_BATCHES = 3  # Spark's transformWithState runs ~6 s per batch here: three bound the bench's time


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = start_spark(
        SparkSession.builder.master("local[2]")
        .appName("pyengine-bench-foreach-batch")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


def _run(spark: Any, inputs: str, each: Any) -> None:
    location = tempfile.mkdtemp(prefix="pyengine-bench-fb-spark-")
    query = (
        spark.readStream.schema("user long, v long")
        .option("maxFilesPerTrigger", 1)
        .parquet(inputs)
        .writeStream.foreachBatch(each)
        .option("checkpointLocation", location)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert query.exception() is None


ADDED_MS: List[float] = []  # the handler's added time per batch, for the comparison with Spark's


@pytest.fixture(scope="module")
def inputs() -> str:
    """The micro-batches: one parquet file each."""
    directory = tempfile.mkdtemp(prefix="pyengine-bench-fb-in-")
    rng = np.random.default_rng(0)
    for i in range(BATCHES):
        table = pa.table({"user": rng.integers(0, KEYS, ROWS), "v": rng.integers(0, 1000, ROWS)})
        pq.write_table(table, os.path.join(directory, f"part-{i:03d}.parquet"))
    return directory


def test_foreach_batch_added_time_per_micro_batch(spark: Any, inputs: str) -> None:

    handler = pe.spark.ForeachBatchHandler(
        lambda s: s.key_by("user").aggregate(pe.agg.count()),
        name="bench",
        checkpoint_storage=tempfile.mkdtemp(prefix="pyengine-bench-fb-ckpt-"),
        sink=pe.sinks.DiscardSink(),
        env=pe.StreamEnvironment(monitoring=None),
    )
    baseline: List[float] = []
    with_handler: List[float] = []

    def each(df: Any, batch_id: int) -> None:
        started = time.perf_counter()
        assert df.toArrow().num_rows == ROWS
        collected = time.perf_counter()
        handler(df, batch_id)
        if batch_id > 0:  # the first batch starts the job
            baseline.append((collected - started) * 1000)
            with_handler.append((time.perf_counter() - collected) * 1000)

    try:
        _run(spark, inputs, each)
    finally:
        handler.close()
    assert len(with_handler) == BATCHES - 1 and handler.last_batch_id == BATCHES - 1
    base, ours = statistics.median(baseline), statistics.median(with_handler)
    inside = statistics.median(handler.batch_times_s[1:]) * 1000
    SUMMARY.append(
        f"foreachBatch, {ROWS} rows/batch over {KEYS} keys: handler median {ours:.0f} ms per micro-batch vs "
        f"{base:.0f} ms collecting it only ({ours / base:.2f}x); added by pyengine (feed to checkpoint "
        f"completed): {inside:.0f} ms"
    )
    assert ours <= GUARD * base, (ours, base)
    ADDED_MS.append(inside)


@pytest.mark.skipif(
    os.environ.get("PYENGINE_BENCH_SPARK_TWS") != "1",
    reason="opt-in (PYENGINE_BENCH_SPARK_TWS=1): Spark's transformWithState takes 6-13 s per batch here",
)
def test_foreach_batch_against_sparks_own_transform_with_state(spark: Any, inputs: str) -> None:
    """The same running count as Spark's own streaming ``transformWithState`` (RocksDB
    state store, as it requires) over the same micro-batches: Spark's batch duration
    against what the handler adds to a batch (measured in the test above). Opt-in for
    CI's time budget: measured here, 13,284 ms per Spark batch against 63 ms added by
    the handler (210x), at load ~6. Asserted when run: the handler adds less than a
    tenth of Spark's batch duration."""
    if not ADDED_MS:
        pytest.fail("run with test_foreach_batch_added_time_per_micro_batch: it measures the handler")
    spark_ms = _spark_transform_with_state_batch_ms(spark, inputs)
    added = ADDED_MS[-1]
    SUMMARY.append(
        f"foreachBatch vs Spark's own transformWithState (RocksDB state store) on the same micro-batch "
        f"({ROWS} rows, {KEYS} keys, the same running count): Spark's batch duration median {spark_ms:.0f} ms; "
        f"the handler adds {added:.0f} ms to a batch ({spark_ms / max(added, 1e-3):.0f}x less)"
    )
    assert added * 10 <= spark_ms, (added, spark_ms)


class RunningCount:
    """The bench's running count as a Spark ``StatefulProcessor`` (built lazily: the
    class needs pyspark, imported only when this bench runs)."""

    @staticmethod
    def make() -> Any:
        from pyspark.sql import Row
        from pyspark.sql.streaming import StatefulProcessor

        class Count(StatefulProcessor):
            def init(self, handle: Any) -> None:
                self.count = handle.getValueState("count", "count bigint")

            def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:
                n = sum(1 for _ in rows)
                old = self.count.get()
                total = (old[0] if old else 0) + n
                self.count.update((total,))
                yield Row(user=key[0], count=total)

            def close(self) -> None:
                pass

        return Count()


def _spark_transform_with_state_batch_ms(spark: Any, inputs: str) -> float:
    """The median batch duration (Spark's ``triggerExecution``) of a streaming
    ``transformWithState`` query over the first ``SPARK_BATCHES`` of the same files, one
    per micro-batch; the first batch (state store set-up, Python workers starting) is
    left out, as the handler's is."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the bench is not installed on the workers
    subset = tempfile.mkdtemp(prefix="pyengine-bench-fb-tws-in-")
    for name in sorted(os.listdir(inputs))[:SPARK_BATCHES]:
        os.link(os.path.join(inputs, name), os.path.join(subset, name))
    spark.conf.set(
        "spark.sql.streaming.stateStore.providerClass",
        "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider",
    )
    query = (
        spark.readStream.schema("user long, v long")
        .option("maxFilesPerTrigger", 1)
        .parquet(subset)
        .groupBy("user")
        .transformWithState(RunningCount.make(), "user long, count long", "Update", "None")
        .writeStream.format("noop")
        .option("checkpointLocation", tempfile.mkdtemp(prefix="pyengine-bench-fb-tws-"))
        .outputMode("update")
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    assert query.exception() is None
    durations = [p["durationMs"]["triggerExecution"] for p in query.recentProgress if p["numInputRows"] > 0]
    assert len(durations) == SPARK_BATCHES, durations
    return float(statistics.median(durations[1:]))
