"""The Spark runner through Spark Connect (``SparkSession.builder.remote``): no
``SparkContext`` and no RDDs, so the job is one ``mapInArrow(..., barrier=True)``
stage. A Connect server (its own driver JVM, ``local[3]`` behind it) is started by
the fixture on the machine's address, so the coordinator in this client process is
reached over mutual TLS. The cluster tests' jobs, faults and checks, through Connect."""

from __future__ import annotations

import os
import sys

import pytest

import pyengine as pe

pytest.importorskip("pyspark", reason="the Spark runner needs pyspark (the test extra installs it)")
pytest.importorskip("grpc", reason="Spark Connect's client needs pyspark[connect] (the test extra installs it)")
pytest.importorskip("pandas", reason="Spark Connect's client needs pyspark[connect] (the test extra installs it)")
import spark_cluster
import test_spark_cluster as cluster_tests
from test_spark_cluster import N, Step, expected, job, pairs

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.spark_cluster]


@pytest.fixture(scope="module")
def connect_url(tmp_path_factory):
    server, url = spark_cluster.start_connect(tmp_path_factory.mktemp("spark-connect"), "local[3]")
    yield url
    server.stop()


@pytest.fixture(scope="module")
def spark(connect_url):
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    for module in (sys.modules[__name__], cluster_tests):  # not installed on the executors
        cloudpickle.register_pickle_by_value(module)
    before = {k: os.environ.get(k) for k in ("SPARK_CONNECT_MODE_ENABLED", "SPARK_REMOTE", "SPARK_LOCAL_REMOTE")}
    session = SparkSession.builder.remote(connect_url).getOrCreate()
    yield session
    session.stop()
    # A Connect session marks the whole process as Connect (SPARK_CONNECT_MODE_ENABLED):
    # the test modules after this one build classic local sessions.
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.parametrize("how", ["raise", "kill"])
def test_through_spark_connect_a_failure_recovers_exactly(tmp_path, spark, how) -> None:
    assert type(spark).__module__.startswith("pyspark.sql.connect"), type(spark)
    sink = pe.sinks.FileSink(str(tmp_path / "out"), format="parquet")
    env = job(tmp_path, Step(str(tmp_path / "failed-once"), N // 2, how), sink)
    result = env.execute(f"connect-{how}", runner=pe.runners.SparkRunner(spark))
    assert result.status == "FINISHED", result.cause
    assert os.path.exists(tmp_path / "failed-once"), "the failure was never injected"
    assert result.restarts == 1
    assert pairs(sink.read_committed()) == expected()


def test_through_spark_connect_an_executor_with_another_pyengine_is_named(tmp_path, spark, monkeypatch) -> None:
    monkeypatch.setattr(sys.modules["pyengine"], "__version__", "0.0.0+driver")
    env = job(tmp_path, Step(), pe.sinks.FileSink(str(tmp_path / "out")))
    with pytest.raises(RuntimeError, match=r"cannot run on this cluster: .*executor .* driver runs pyengine 0\.0\.0"):
        env.execute("connect-version", runner=pe.runners.SparkRunner(spark))
