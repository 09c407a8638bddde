"""The Spark runner on a local Spark (``local[4]``, started once for the module)."""

from __future__ import annotations

import os
import random
import threading
from collections import Counter
from typing import Any, List

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from chaos import FlakyFiles
from spark_sessions import local_spark

import pyengine as pe
import pyengine.spark
from pyengine.state import ValueStateDescriptor

pyspark = pytest.importorskip("pyspark", reason="the Spark runner needs pyspark (the test extra installs it)")

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SLOTS = 4
COUNT = ValueStateDescriptor("count", 0, pa.int64())
N = 3000
RECORDS = [{"user": i % 13, "v": i} for i in range(N)]


@pytest.fixture(scope="module")
def spark():
    import chaos
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(chaos)  # FlakyFiles goes to the executors as test code does
    yield from local_spark(__name__, "pyengine-tests", SLOTS, {"spark.sql.shuffle.partitions": "4"})


class FailOnce:
    """Fails at one record, once across every process of the job: a marker file
    says it happened (Spark workers are separate processes)."""

    def __init__(self, marker: str, at: int, how: str = "raise") -> None:
        self.marker, self.at, self.how = marker, at, how

    def __call__(self, record: Any) -> Any:
        if record["v"] == self.at:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return record
            os.close(fd)
            if self.how == "exit":
                os._exit(3)  # the Python worker dies
            raise RuntimeError(f"injected failure at record {self.at}")
        return record


def _unchanged(record: Any) -> Any:
    return record


class ExitAfterACheckpoint:
    """Kills its Python worker at the first record from ``at`` on once a checkpoint has
    completed. Until one has, each of those records takes 2 ms: the job slows down but
    goes on, so checkpoints still pass this task (a task waiting here for one cannot
    take part in it: on a loaded machine the first checkpoint had not completed when
    ``at`` came, and the worker exited with none to resume from)."""

    def __init__(self, storage: str, at: int) -> None:
        self.storage, self.at = storage, at
        self.looked = 0.0

    def __call__(self, record: Any) -> Any:
        if record["v"] >= self.at:
            import time

            now = time.monotonic()
            if now - self.looked >= 0.01:  # a walk of the storage at most every 10 ms
                self.looked = now
                if any("_metadata" in f for _, _, f in os.walk(self.storage)):
                    os._exit(3)
            time.sleep(0.002)
        return record


class Count(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Any:
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "n": n}


def expected() -> Counter:
    per_user = Counter(r["user"] for r in RECORDS)
    return Counter({(u, n): 1 for u, c in per_user.items() for n in range(1, c + 1)})


def job(tmp_path, *, backend: str = "heap", unaligned: bool = False, step: Any = None, parallelism: int = 2):
    env = pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=20, unaligned=unaligned),
        checkpoint_storage=str(tmp_path / "ckpt"),
        state_backend=backend,
        buffer_size=32,
        buffer_timeout_ms=2,
        restart_attempts=2,
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    stream = env.from_collection(RECORDS)
    if step is not None:
        stream = stream.map(step)
    stream.key_by("user").process(Count()).uid("counter").sink_to(sink)
    return env, sink


def pairs(records: List[Any]) -> Counter:
    return Counter((r["user"], r["n"]) for r in records)


def test_a_job_runs_on_spark_exactly_once_and_spark_reads_its_output(tmp_path, spark) -> None:
    env, sink = job(tmp_path)
    result = env.execute("on-spark", runner=pe.runners.SparkRunner(spark))
    assert result.status == "FINISHED", result.cause
    assert result.checkpoints.counts["completed"] >= 1
    assert pairs(sink.read_committed()) == expected()
    df = spark.read.parquet(*sink.committed_files())  # committed part files only
    assert df.count() == N


def _with_freeze_count(record: Any) -> Any:
    import gc

    return {**record, "frozen": gc.get_freeze_count()}


def test_a_spark_subtask_freezes_what_its_worker_held_while_it_runs(tmp_path, spark) -> None:
    """As the embedded runner does (``_FrozenHeap``): on an executor too, a per-record
    job's full collections must not walk the Python worker's whole heap."""
    env = pe.StreamEnvironment(parallelism=2, monitoring=None, checkpoint_storage=str(tmp_path / "ckpt"))
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    env.from_collection(RECORDS[:50]).map(_with_freeze_count).sink_to(sink)
    result = env.execute("frozen-on-spark", runner=pe.runners.SparkRunner(spark))
    assert result.status == "FINISHED", result.cause
    records = sink.read_committed()
    assert len(records) == 50 and min(r["frozen"] for r in records) > 0


@pytest.mark.parametrize(
    ("backend", "unaligned", "how"),
    [
        ("heap", False, "raise"),
        ("incremental", True, "raise"),
        ("heap", True, "exit"),
        ("incremental", False, "exit"),
    ],
)
def test_a_failed_task_restarts_the_stage_and_the_output_stays_exact(tmp_path, spark, backend, unaligned, how) -> None:
    at = random.Random(f"{backend}{unaligned}{how}").randint(N // 4, 3 * N // 4)
    step = FailOnce(str(tmp_path / "failed-once"), at, how)
    env, sink = job(tmp_path, backend=backend, unaligned=unaligned, step=step)
    result = env.execute("failing-on-spark", runner=pe.runners.SparkRunner(spark))
    assert result.status == "FINISHED", result.cause
    assert os.path.exists(tmp_path / "failed-once"), "the failure was never injected"
    assert result.restarts == 1
    assert pairs(sink.read_committed()) == expected()


def test_a_crashed_python_worker_is_named_and_running_the_job_again_resumes_it(tmp_path, spark) -> None:
    env, _ = job(tmp_path, step=ExitAfterACheckpoint(str(tmp_path / "ckpt"), N // 2))
    env.restart_attempts = 0
    with pytest.raises(pe.JobFailedError, match="Python worker crashed"):
        env.execute("crashing", runner=pe.runners.SparkRunner(spark))
    env, sink = job(tmp_path, step=_unchanged)  # the same job, storage and output: resume="auto"
    result = env.execute("crashing", runner=pe.runners.SparkRunner(spark))
    assert result.checkpoints.counts["restored"] == 1
    assert pairs(sink.read_committed()) == expected()


def test_too_few_slots_is_refused_with_what_is_needed(tmp_path, spark) -> None:
    env, _ = job(tmp_path, parallelism=3)  # 2 operator chains x 3 = 6 tasks at once > 4 slots
    with pytest.raises(RuntimeError, match=r"needs 6 task slots.*has 4"):
        env.execute("too-wide", runner=pe.runners.SparkRunner(spark))


def test_a_job_that_cannot_be_pickled_is_refused_before_anything_runs(tmp_path, spark) -> None:
    lock = threading.Lock()

    def uses_a_lock(r: Any) -> Any:
        with lock:
            return r

    env, _ = job(tmp_path, step=uses_a_lock)
    with pytest.raises(TypeError, match="cannot be pickled"):
        env.execute("unpicklable", runner=pe.runners.SparkRunner(spark))
    # The refused run left no lease, lock or server behind: the fixed job runs at once.
    env, sink = job(tmp_path, step=_unchanged)
    env.execute("unpicklable", runner=pe.runners.SparkRunner(spark))
    assert pairs(sink.read_committed()) == expected()


def test_collect_sink_is_refused_on_spark(spark) -> None:
    env = pe.StreamEnvironment(parallelism=1)
    env.from_collection([1, 2]).sink_to(pe.sinks.CollectSink())
    with pytest.raises(ValueError, match="FileSink"):
        env.execute("collect", runner=pe.runners.SparkRunner(spark))


def test_storage_the_executors_cannot_reach_fails_clearly(tmp_path, spark) -> None:
    env = pe.StreamEnvironment(
        parallelism=1,
        checkpointing=pe.CheckpointConfig(interval_ms=50),
        checkpoint_storage="memory://driver-only",  # in the driver's memory: no executor sees it
        restart_attempts=0,
    )
    env.from_collection(RECORDS).map(lambda r: r).sink_to(pe.sinks.FileSink(str(tmp_path / "out")))
    with pytest.raises(pe.errors.JobFailedError, match="not reachable from this executor") as info:
        env.execute("unreachable", runner=pe.runners.SparkRunner(spark))
    assert info.value.result.status == "FAILED"


def test_a_dataframe_is_a_replayable_source(tmp_path, spark) -> None:
    df = spark.createDataFrame([(i % 13, i) for i in range(N)], "user long, v long")
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=20),
        checkpoint_storage=str(tmp_path / "ckpt"),
        buffer_size=64,
        restart_attempts=2,
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    step = FailOnce(str(tmp_path / "failed-once"), N // 2)
    env.from_dataframe(df).map(step).key_by("user").process(Count()).uid("counter").sink_to(sink)
    result = env.execute("from-dataframe", runner=pe.runners.SparkRunner(spark))
    assert result.status == "FINISHED", result.cause
    assert result.restarts == 1
    assert pairs(sink.read_committed()) == expected()
    with pytest.raises(TypeError, match="DataFrame"):
        env.from_dataframe([1, 2, 3])
    # The copy lived in the job's checkpoint directory, and went when the job finished.
    assert not list((tmp_path / "ckpt").glob("*/_sources/*"))


def test_a_parquet_dataframe_is_read_in_place_and_a_streaming_one_is_refused(tmp_path, spark) -> None:
    spark.createDataFrame([(i % 13, i) for i in range(N)], "user long, v long").write.parquet(str(tmp_path / "in"))
    df = spark.read.parquet(str(tmp_path / "in"))
    env = pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=20), checkpoint_storage=str(tmp_path / "ckpt")
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    env.from_dataframe(df).key_by("user").process(Count()).uid("counter").sink_to(sink)
    env.execute("in-place", runner=pe.runners.SparkRunner(spark))
    assert pairs(sink.read_committed()) == expected()
    assert not list((tmp_path / "ckpt").glob("**/_sources")), "a plain parquet scan was copied"
    filtered = df.filter("v > 10")  # not a plain scan: copied, never read in place
    src = pe.spark.DataFrameSource(filtered, "filtered")
    src.prepare(str(tmp_path / "job"))
    assert src.copied is not None
    streaming = spark.readStream.format("rate").load()
    with pytest.raises(TypeError, match="streaming"):
        pe.StreamEnvironment().from_dataframe(streaming)


class Poison(Exception):
    """A user's own exception type: it must come back from the executor as itself."""


def test_a_users_exception_comes_back_from_spark_as_itself_with_its_traceback(tmp_path, spark) -> None:
    def poison(r: Any) -> Any:
        if r["v"] == 100:
            raise Poison(f"bad record {r['v']}")
        return r

    env = pe.StreamEnvironment(parallelism=1, restart_attempts=0)
    env.from_collection(RECORDS).map(poison).sink_to(pe.sinks.FileSink(str(tmp_path / "out")))
    with pytest.raises(pe.JobFailedError) as info:
        env.execute("poison", runner=pe.runners.SparkRunner(spark))
    cause = info.value.cause
    assert type(cause) is Poison and str(cause) == "bad record 100"
    assert "in poison" in "".join(getattr(cause, "__notes__", []))


@pytest.mark.parametrize("seed", range(6))
def test_randomized_failures_on_spark_keep_the_output_exact(tmp_path, spark, seed) -> None:
    """As the embedded runner's randomized test: a random record, a random way to die
    (an exception or the Python worker exiting), either backend, aligned or not."""
    rng = random.Random(1000 + seed)
    how, backend, unaligned = rng.choice(["raise", "exit"]), rng.choice(["heap", "incremental"]), rng.random() < 0.5
    step = FailOnce(str(tmp_path / "failed-once"), rng.randrange(N), how)
    env, sink = job(tmp_path, backend=backend, unaligned=unaligned, step=step)
    result = env.execute(f"random-{seed}", runner=pe.runners.SparkRunner(spark))
    where = f"seed {seed}: {how} at {step.at}, {backend}, unaligned={unaligned}"
    assert result.status == "FINISHED", f"{where}: {result.cause}"
    assert os.path.exists(tmp_path / "failed-once"), where
    assert pairs(sink.read_committed()) == expected(), where


@pytest.mark.parametrize("seed", range(2))
def test_transient_read_errors_in_a_file_source_on_spark_keep_the_output_exact(tmp_path, spark, seed) -> None:
    """The soak's file-source fault on Spark: an executor's ``at``-th read of the
    parquet files fails once across executors and stages (a marker file); the new
    stage reopens the files at the checkpointed position. Seed 1 also has a Python
    worker exit at a record later on."""
    root = tmp_path / "in"
    root.mkdir()
    table = pa.Table.from_pylist(RECORDS)
    for k in range(3):  # 12 row groups, 6 for each of the 2 source subtasks
        pq.write_table(table.slice(k * (N // 3), N // 3), str(root / f"part-{k}.parquet"), row_group_size=N // 12)
    rng = random.Random(2000 + seed)
    files = FlakyFiles(str(tmp_path / "read-failed"), rng.randint(1, 6))
    backend, unaligned = rng.choice(["heap", "incremental"]), rng.random() < 0.5
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=20, unaligned=unaligned),
        checkpoint_storage=str(tmp_path / "ckpt"),
        state_backend=backend,
        buffer_size=32,
        buffer_timeout_ms=2,
        restart_attempts=3,
    )
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    stream = env.read_files(str(root), filesystem=files.filesystem())
    if seed:
        stream = stream.map(FailOnce(str(tmp_path / "failed-once"), rng.randrange(N), "exit"))
    stream.key_by("user").process(Count()).uid("counter").sink_to(sink)
    files.arm()
    result = env.execute(f"read-errors-{seed}", runner=pe.runners.SparkRunner(spark))
    where = f"seed {seed}: read #{files.at} fails, {backend}, unaligned={unaligned}"
    assert result.status == "FINISHED", f"{where}: {result.cause}"
    assert files.fired(), f"{where}: the read error was never injected"
    assert result.restarts >= 1, where
    assert pairs(sink.read_committed()) == expected(), where


def test_an_executor_without_the_drivers_pyengine_is_named_with_the_fix(tmp_path, spark, monkeypatch) -> None:
    """Every task checks, before it unpickles the job, that its Python imports the
    driver's pyengine version; here the driver claims another version."""
    import sys

    real = pe.__version__
    monkeypatch.setattr(sys.modules["pyengine"], "__version__", "0.0.0+driver")
    env = pe.StreamEnvironment(parallelism=1, restart_attempts=3)
    env.from_collection(RECORDS).map(_unchanged).sink_to(pe.sinks.FileSink(str(tmp_path / "out")))
    with pytest.raises(pe.JobFailedError) as info:
        env.execute("wrong-version", runner=pe.runners.SparkRunner(spark))
    message = str(info.value.cause)
    assert "executor on host" in message and f"imports pyengine {real}" in message, message
    assert "driver runs pyengine 0.0.0+driver" in message and "spark.archives" in message, message
    assert info.value.result.restarts == 0  # no restart installs a package


@pytest.mark.parametrize("seed", range(2))
def test_ints_then_floats_on_spark_stay_exact_and_spark_reads_them(tmp_path, spark, seed) -> None:
    """The soak's column of whole numbers that later holds fractions (issue #37) on
    Spark: keyed aggregates go to a parquet directory that pyarrow and Spark read as
    one table, the totals exact across the failure."""
    from test_exactly_once import PRICED, check_priced

    rng = random.Random(2000 + seed)
    how, backend, unaligned = ("raise", "exit")[seed], ("heap", "incremental")[seed], rng.random() < 0.5
    step = FailOnce(str(tmp_path / "failed-once"), rng.randrange(N // 4, N), how)
    env = pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=20, unaligned=unaligned),
        checkpoint_storage=str(tmp_path / "ckpt"),
        state_backend=backend,
        buffer_size=32,
        buffer_timeout_ms=2,
        restart_attempts=2,
    )
    tag = "spark"
    totals = pe.sinks.FileSink(str(tmp_path / f"totals-{tag}"), format="parquet")
    priced = env.from_collection(PRICED).map(step)
    aggs = (pe.agg.sum("price"), pe.agg.max("price"), pe.agg.min("price"), pe.agg.count())
    priced.key_by("user").aggregate(*aggs).uid("agg").sink_to(totals)
    # (the records themselves are not written here: a third chain would need 6 slots)
    result = env.execute(f"priced-{seed}", runner=pe.runners.SparkRunner(spark))
    where = f"seed {seed}: {how} at {step.at}, {backend}, unaligned={unaligned}"
    assert result.status == "FINISHED", f"{where}: {result.cause}"
    assert os.path.exists(tmp_path / "failed-once"), where
    check_priced(tmp_path, tag, where, rows=False)
    read = spark.read.parquet(str(tmp_path / f"totals-{tag}"))
    assert dict(read.dtypes)["sum_price"] == "double" and read.count() >= 13, where
