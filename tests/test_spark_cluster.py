"""The Spark runner on a real standalone cluster: a master and two workers as separate
processes (``spark_cluster``), each executor its own JVM with its own Python workers,
reached over the machine's address (mutual TLS off loopback). Three faults, each
recovered within ``restart_attempts`` with exact output: a raised error, a killed
Python worker, and ``kill -9`` of an executor JVM (into a Delta table).

The executors do not see the driver's environment: they run a virtualenv with
pyengine installed from its wheel, packed by venv-pack and shipped through
``spark.archives`` (``spark_cluster.packed_venv``), as a user whose cluster nodes
lack pyengine ships it."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections import Counter
from typing import Any, List

import pyarrow as pa
import pytest

import pyengine as pe
from pyengine.state import ValueStateDescriptor

pytest.importorskip("pyspark", reason="the Spark runner needs pyspark (the test extra installs it)")
import spark_cluster

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.spark_cluster]

COUNT = ValueStateDescriptor("count", 0, pa.int64())
N = 2000
RECORDS = [{"user": i % 7, "v": i} for i in range(N)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not sys.platform.startswith("linux"):
        pytest.skip("the cluster fixture finds executor JVMs through /proc")
    started = spark_cluster.start_cluster(tmp_path_factory.mktemp("spark-cluster"))
    yield started
    started.stop()


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    started = time.monotonic()
    packed = spark_cluster.packed_venv(tmp_path_factory.mktemp("packed-venv"))
    print(f"packed virtualenv: {packed.stat().st_size / 2**20:.0f} MiB in {time.monotonic() - started:.1f} s")
    return packed


@pytest.fixture(scope="module")
def spark(cluster, archive):
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # not installed on the executors
    session = cluster.session("pyengine-cluster-tests", archive)
    session.sparkContext.setLogLevel("ERROR")
    cluster.wait_for_executors(session)
    yield session
    session.stop()


class Step:
    """Slows the stream down (the job outlives a few checkpoints) and fails once, at
    one record, across every process of the job (a marker file says it happened)."""

    def __init__(self, marker: str = "", at: int = -1, how: str = "") -> None:
        self.marker, self.at, self.how = marker, at, how

    def __call__(self, record: Any) -> Any:
        if record["v"] % 4 == 0:
            time.sleep(0.002)
        if record["v"] == self.at:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return record
            os.close(fd)
            if self.how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)  # this Python worker, as the OOM killer would
            raise RuntimeError(f"injected failure at record {self.at}")
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


def pairs(rows: List[Any]) -> Counter:
    return Counter((r["user"], r["n"]) for r in rows)


def job(tmp_path, step: Step, sink: Any) -> pe.StreamEnvironment:
    env = pe.StreamEnvironment(
        parallelism=1,  # 2 operator chains: one task on each executor
        checkpointing=pe.CheckpointConfig(interval_ms=100),
        checkpoint_storage=str(tmp_path / "ckpt"),  # one machine: every executor reaches it
        buffer_size=32,
        buffer_timeout_ms=5,
        restart_attempts=2,
    )
    env.from_collection(RECORDS).map(step).key_by("user").process(Count()).uid("counter").sink_to(sink)
    return env


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_raised_error_or_a_killed_python_worker_on_a_cluster_recovers_exactly(tmp_path, spark, how) -> None:
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    env = job(tmp_path, Step(str(tmp_path / "failed-once"), N // 2, how), sink)
    result = env.execute(f"cluster-{how}", runner=pe.runners.SparkRunner(spark))
    assert result.status == "FINISHED", result.cause
    assert os.path.exists(tmp_path / "failed-once"), "the failure was never injected"
    assert result.restarts == 1
    assert pairs(sink.read_committed()) == expected()


def test_kill_9_of_an_executor_jvm_recovers_exactly_into_a_delta_table(tmp_path, spark, cluster) -> None:
    deltalake = pytest.importorskip("deltalake")
    uri = str(tmp_path / "table")
    env = job(tmp_path, Step(), pe.sinks.DeltaSink(uri))
    killed: List[int] = []

    def kill_an_executor_after_a_checkpoint() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list((tmp_path / "ckpt").glob("*/chk-*/_metadata")):
            time.sleep(0.02)
        pids = cluster.executor_pids()
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])

    killer = threading.Thread(target=kill_an_executor_after_a_checkpoint, daemon=True)
    killer.start()
    result = env.execute("cluster-kill-9", runner=pe.runners.SparkRunner(spark))
    killer.join(5)
    assert killed, "no executor was killed"
    assert result.status == "FINISHED", result.cause
    assert result.restarts == 1, result.restarts
    table = deltalake.DeltaTable(uri)
    assert pairs(pa.table(table.to_pyarrow_table()).to_pylist()) == expected()
    commits = [h for h in table.history() if "pyengine.checkpoint_id" in h]
    keys = [(c["pyengine.run_id"], c["pyengine.checkpoint_id"]) for c in commits]
    described = [{k: v for k, v in c.items() if k.startswith("pyengine.") or k == "version"} for c in commits]
    assert len(keys) == len(set(keys)), described
    assert sum(c["pyengine.rows"] for c in commits) == N, described


def test_executors_run_pyengine_from_the_packed_virtualenv(spark) -> None:
    """Every executor's Python workers start from the unpacked archive and import
    pyengine (the same version as the driver's) from it, not from the driver's checkout."""

    def where(_: Any) -> Any:
        import pyengine

        yield (os.getpid(), sys.prefix, pyengine.__file__, pyengine.__version__)

    seen = spark.sparkContext.parallelize(range(4), 4).mapPartitions(where).collect()
    driver = os.path.dirname(os.path.dirname(os.path.abspath(pe.__file__)))
    for _, prefix, module, version in seen:
        assert os.path.basename(prefix) == spark_cluster.PACKED_ENV, prefix
        assert module.startswith(prefix + os.sep) and not module.startswith(driver + os.sep), module
        assert version == pe.__version__


def test_an_executor_with_another_pyengine_is_named_before_the_job_starts(tmp_path, spark, monkeypatch) -> None:
    monkeypatch.setattr(sys.modules["pyengine"], "__version__", "0.0.0+driver")
    env = job(tmp_path, Step(), pe.sinks.FileSink(str(tmp_path / "out")))
    with pytest.raises(RuntimeError, match=r"cannot run on this cluster: executor \d+ on host .* driver runs"):
        env.execute("cluster-version", runner=pe.runners.SparkRunner(spark))
    assert not (tmp_path / "ckpt").exists() or not list((tmp_path / "ckpt").iterdir()), "the run was opened"
