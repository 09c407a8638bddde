"""Structured Streaming with pyengine (one local[2] Spark for the module): the
foreachBatch handler, exactly once across a failed and restarted query, and the
``pyengine-state`` data source."""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any, Dict, List

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import pyengine as pe
import pyengine.spark
from pyengine.state import ValueStateDescriptor

pyspark = pytest.importorskip("pyspark", reason="the Spark integrations need pyspark (the test extra installs it)")

pytestmark = [pytest.mark.spark, pytest.mark.slow]

COUNT = ValueStateDescriptor("count", 0, pa.int64())
FILES = 6
ROWS = 40  # per file: one file per micro-batch
USERS = 7


@pytest.fixture(scope="module")
def spark():
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    session = (
        SparkSession.builder.master("local[2]")
        .appName("pyengine-streaming-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


class RunningCount(pe.KeyedProcessFunction):
    """Emits (user, its count so far) per record; fails once at ``fail_at`` when set."""

    def __init__(self, fail_marker: str = "", fail_at: int = -1) -> None:
        self.fail_marker, self.fail_at = fail_marker, fail_at

    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        if value["v"] == self.fail_at and not os.path.exists(self.fail_marker):
            open(self.fail_marker, "w").close()
            raise RuntimeError(f"injected failure at record {self.fail_at}")
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": value["user"], "count": n}


def _write_inputs(directory: str, first: int, last: int) -> None:
    os.makedirs(directory, exist_ok=True)
    for f in range(first, last):
        rows = [{"user": (f * ROWS + i) % USERS, "v": f * ROWS + i} for i in range(ROWS)]
        path = os.path.join(directory, f"part-{f:03d}.parquet")
        pq.write_table(pa.Table.from_pylist(rows), path)
        # Spark's file source takes files in modification-time order: files written within
        # one clock tick could otherwise make batch f another file (the tests name batches
        # by the file they hold).
        os.utime(path, (1_700_000_000 + f, 1_700_000_000 + f))


def _expected(files: int) -> Counter:
    totals = Counter((f * ROWS + i) % USERS for f in range(files) for i in range(ROWS))
    return Counter((u, k) for u, n in totals.items() for k in range(1, n + 1))


def _query(spark: Any, inputs: str, location: str, handler: Any) -> Any:
    stream = spark.readStream.schema("user long, v long").option("maxFilesPerTrigger", 1).parquet(inputs)
    return (
        stream.writeStream.foreachBatch(handler)
        .option("checkpointLocation", location)
        .trigger(availableNow=True)
        .start()
    )


def _run(spark: Any, inputs: str, location: str, handler: Any) -> Any:
    """Runs the query to the end of its input; the exception that stopped it, or None."""
    query = _query(spark, inputs, location, handler)
    try:
        query.awaitTermination()
    except Exception as exc:  # StreamingQueryException: the handler raised
        return exc
    return query.exception()


def test_foreach_batch_output_back_to_spark_exactly_once_across_failures(spark: Any, tmp_path: Any) -> None:
    """Two failures: the Spark-side write fails after pyengine committed batch 2 (Spark
    replays it: the handler returns the same output, from its files, with a new handler
    as after a driver restart), and the pyengine job fails inside batch 4 (the query
    fails; restarted, the batch is fed again). The outputs equal a run without failures,
    each batch's output the same each time Spark is given it."""
    inputs, ckpt, location = str(tmp_path / "in"), str(tmp_path / "pe"), str(tmp_path / "spark")
    _write_inputs(inputs, 0, FILES)
    outputs: Dict[int, List[List[Any]]] = {}
    failed = {"output": False}

    def write(out_df: Any, batch_id: int) -> None:
        rows = sorted((r["user"], r["count"]) for r in out_df.collect())
        outputs.setdefault(batch_id, []).append(rows)
        if batch_id == 2 and not failed["output"]:
            failed["output"] = True
            raise RuntimeError("the Spark-side write of batch 2 fails")

    marker = str(tmp_path / "failed-once")
    env = pe.StreamEnvironment(restart_attempts=0, monitoring=None)

    def make() -> Any:
        return pe.spark.ForeachBatchHandler(
            lambda s: s.key_by("user").process(RunningCount(marker, fail_at=4 * ROWS + 5)),
            name="counts",
            checkpoint_storage=ckpt,
            output=write,
            env=env,
        )

    first = make()
    assert _run(spark, inputs, location, first) is not None  # batch 2's write failed
    assert first.last_batch_id == 2 and sorted(outputs) == [0, 1, 2]
    first.close()  # the driver goes: a new handler resumes from pyengine's checkpoints

    second = make()
    error = _run(spark, inputs, location, second)
    assert error is not None and "injected failure" in str(error)  # the job failed inside batch 4
    assert second.last_batch_id == 3
    assert _run(spark, inputs, location, second) is None  # the same handler restarts its job
    second.close()

    assert sorted(outputs) == list(range(FILES))
    assert len(outputs[2]) == 2 and outputs[2][0] == outputs[2][1]  # the replay got the committed output
    assert all(len(v) == 1 for b, v in outputs.items() if b != 2)  # batch 4's failed attempt gave nothing
    got = Counter(pair for b in outputs for pair in outputs[b][0])
    assert got == _expected(FILES)
    assert second.batch_times_s and min(second.batch_times_s) > 0

    # state read back through Spark: the count per user is its total
    pe.spark.register_state_source(spark)
    state = spark.read.format("pyengine-state").option("operator", _process_uid(ckpt)).option("stateName", "count")
    rows = {r["key"]: r["value"] for r in state.load(ckpt).collect()}
    totals = Counter((f * ROWS + i) % USERS for f in range(FILES) for i in range(ROWS))
    assert rows == dict(totals)


def _process_uid(ckpt: str) -> str:
    from pyengine.storage.jobs import list_jobs
    from pyengine.storage.metadata import load_metadata

    job = next(j for j in list_jobs(ckpt) if j.job_name == "counts")
    metadata = load_metadata(f"{job.uri}/chk-{job.checkpoints[-1]}")
    return next(u for u in metadata.operators if "process" in u)


def test_foreach_batch_into_a_pyengine_sink_stopped_and_restarted(spark: Any, tmp_path: Any) -> None:
    """Output to a pyengine FileSink; the query is stopped after three batches and
    started again from its checkpointLocation with new input arriving: every record is
    counted once, no batch's output is committed twice."""
    inputs, ckpt, location = str(tmp_path / "in"), str(tmp_path / "pe"), str(tmp_path / "spark")
    _write_inputs(inputs, 0, 3)
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    handler = pe.spark.ForeachBatchHandler(
        lambda s: s.key_by("user").process(RunningCount()).uid("running-count"),
        name="to-files",
        checkpoint_storage=ckpt,
        sink=sink,
        env=pe.StreamEnvironment(parallelism=2, state_backend="incremental", monitoring=None),
    )
    assert _run(spark, inputs, location, handler) is None
    assert handler.last_batch_id == 2
    handler.close()
    _write_inputs(inputs, 3, FILES)
    handler = pe.spark.ForeachBatchHandler(
        lambda s: s.key_by("user").process(RunningCount()).uid("running-count"),
        name="to-files",
        checkpoint_storage=ckpt,
        sink=sink,
        env=pe.StreamEnvironment(parallelism=2, state_backend="incremental", monitoring=None),
    )
    assert _run(spark, inputs, location, handler) is None
    assert handler.last_batch_id == FILES - 1
    handler.close()
    got = Counter((r["user"], r["count"]) for r in sink.read_committed())
    assert got == _expected(FILES)

    # the state source by job directory and checkpoint id; unknown options say what is there
    from pyengine.storage.jobs import list_jobs

    job = next(j for j in list_jobs(ckpt) if j.job_name == "to-files")
    pe.spark.register_state_source(spark)
    reader = spark.read.format("pyengine-state").option("operator", "running-count").option("stateVarName", "count")
    latest = {r["key"]: r["value"] for r in reader.load(job.uri).collect()}
    assert latest == dict(Counter((f * ROWS + i) % USERS for f in range(FILES) for i in range(ROWS)))
    with pytest.raises(Exception, match="no completed checkpoint 999"):
        reader.option("checkpointId", 999).load(job.uri).collect()


def test_foreach_batch_refuses_a_gap_and_bad_arguments(spark: Any, tmp_path: Any) -> None:
    handler = pe.spark.ForeachBatchHandler(
        lambda s: s.key_by("user").process(RunningCount()),
        name="gap",
        checkpoint_storage=str(tmp_path / "pe"),
        env=pe.StreamEnvironment(monitoring=None),
    )
    df = spark.createDataFrame([(1, 1), (2, 2)], "user long, v long")
    out = handler(df, 5)  # a handler put into a query that ran before: any first batch id
    assert sorted((r["user"], r["count"]) for r in out.collect()) == [(1, 1), (2, 1)]
    assert handler(df, 5).collect() == out.collect()  # a replay: the same output, not counted again
    with pytest.raises(pe.errors.NonRetryableError, match=r"batches 6\.\.6 would be missing"):
        handler(df, 7)
    handler.close()
    with pytest.raises(ValueError, match="not both"):
        pe.spark.ForeachBatchHandler(
            lambda s: s, name="x", checkpoint_storage="x", sink=pe.sinks.DiscardSink(), output=print
        )


def test_a_batchs_output_staged_under_a_declined_checkpoint_is_taken_with_the_next(tmp_path) -> None:
    """The sink stages a batch's output at checkpoint 1's barrier; checkpoint 1 is then
    declined and checkpoint 2 commits the batch: its output is checkpoint 1's pieces,
    returned now and on a replay."""
    from pyengine.sinks import RunInfo
    from pyengine.spark.foreach_batch import _BatchOutputSink

    sink = _BatchOutputSink(str(tmp_path / "out"), None)
    sink.begin_run(RunInfo("j", "r" * 32, "r" * 32, ()))
    sink.current_batch = 7
    sink.stage(0, 1, [{"user": 1, "count": 3}])
    out, staged = sink.take(2)
    assert staged == [1] and out is not None and out.to_pylist() == [{"user": 1, "count": 3}]
    sink.mark(7, "r" * 32, 2, staged)
    again = sink.read(7)
    assert again is not None and again.to_pylist() == [{"user": 1, "count": 3}]


def test_after_an_in_process_restart_a_batch_counts_as_read_only_once_read_again() -> None:
    """A failure after the reader emitted batch 0's rows, before the checkpoint: the
    restart rewinds the reader, so those rows are in no state. Until they are read
    again, the handler must not trigger the batch's checkpoint, nor may the source's
    checkpointed state claim the batch."""
    import pyarrow as pa

    from pyengine.spark.foreach_batch import _MicroBatchSource

    source = _MicroBatchSource(None)
    source.restore_split_state(0, 1, None)  # the first attempt: a fresh start
    end = source.feed(0, pa.record_batch({"v": list(range(10))}))
    assert len(source.read(0, 1, 0, 100)) == 10
    assert source.wait_read(end, lambda: True) and source.split_state(0, 1) == {"spark_batch_id": 0, "end": 10}
    source.restore_split_state(0, 1, None)  # the job fails and restarts in-process, from no checkpoint
    assert not source.wait_read(end, lambda: False), "the rewound reader has not emitted the batch again"
    assert source.split_state(0, 1) is None
    assert len(source.read(0, 1, 0, 100)) == 10  # read again from the restored position
    assert source.wait_read(end, lambda: True) and source.split_state(0, 1) == {"spark_batch_id": 0, "end": 10}


SEEN: List[Any] = []  # what the pyengine job was given (its subtasks are threads of this process)


class LatestSeen(pe.KeyedProcessFunction):
    def process_element(self, value: Any, ctx: Any) -> Any:
        SEEN.append(value["at"])
        yield {"user": value["user"], "at": value["at"]}


def test_foreach_batch_takes_micro_batches_with_a_timestamp_column(spark: Any, tmp_path: Any) -> None:
    """pyspark 4 converts a ``timestamp`` only with a time zone: the handler reads the
    micro-batches and writes its output back to Spark with timestamps as they were,
    the same instants in a session whose zone is not UTC."""
    zone = "America/New_York"
    previous = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", zone)
    SEEN.clear()
    try:
        _timestamps_through_a_handler(spark, tmp_path, zone)
    finally:
        spark.conf.set("spark.sql.session.timeZone", previous)


def _timestamps_through_a_handler(spark: Any, tmp_path: Any, zone: str) -> None:
    import datetime as dt

    inputs = str(tmp_path / "in")
    os.makedirs(inputs)
    start = dt.datetime(2024, 1, 1, tzinfo=dt.timezone.utc)
    at = [start + dt.timedelta(seconds=s) for s in range(6)]
    for f in range(2):
        path = os.path.join(inputs, f"part-{f}.parquet")
        rows = {
            "user": pa.array([1, 2, 3], pa.int64()),
            "at": pa.array(at[3 * f : 3 * f + 3], pa.timestamp("us", "UTC")),
        }
        pq.write_table(pa.table(rows), path)
        os.utime(path, (1_700_000_000 + f, 1_700_000_000 + f))
    got: List[Any] = []
    handler = pe.spark.ForeachBatchHandler(
        lambda s: s.key_by("user").process(LatestSeen()).uid("latest"),
        name="timestamps",
        checkpoint_storage=str(tmp_path / "pe"),
        output=lambda out, batch_id: got.extend(r.asDict() for r in out.collect()),
        output_schema="user bigint, at timestamp",
        env=pe.StreamEnvironment(parallelism=1, monitoring=None),
    )
    stream = spark.readStream.schema("user long, at timestamp").option("maxFilesPerTrigger", 1).parquet(inputs)
    query = (
        stream.writeStream.foreachBatch(handler)
        .option("checkpointLocation", str(tmp_path / "spark"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    handler.close()
    assert query.exception() is None
    assert sorted(SEEN) == at  # the same instants reached the job
    assert all(str(s.tzinfo) == zone for s in SEEN), SEEN[:1]  # in the session's zone, as the guide says
    shown = [a.astimezone().replace(tzinfo=None) for a in at]  # collect(): naive, in this process's zone
    users = [1, 2, 3, 1, 2, 3]
    assert sorted((r["user"], r["at"]) for r in got) == sorted(zip(users, shown, strict=True))
