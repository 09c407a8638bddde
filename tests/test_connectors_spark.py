"""read_delta and PostgresSink on the Spark runner: the source and the sink travel to
executors (pickled, their readers and connections made anew there), a task fails once
and the barrier stage restarts; the table holds each row of the Delta table once."""

from __future__ import annotations

import os
import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from spark_sessions import local_spark
from test_postgres import _DOWN, DSN, _ids, sql

import pyengine as pe

pyspark = pytest.importorskip("pyspark", reason="the Spark runner needs pyspark (the test extra installs it)")
deltalake = pytest.importorskip("deltalake")

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.skipif(bool(_DOWN), reason=_DOWN)]

SLOTS = 4


@pytest.fixture(scope="module")
def spark():
    yield from local_spark(__name__, "pyengine-connector-tests", SLOTS)


class FailOnce:
    """Fails at one record, once across every process of the job (a marker file)."""

    def __init__(self, marker: str, at: int) -> None:
        self.marker, self.at = marker, at

    def __call__(self, record: Any) -> Any:
        if record["id"] == self.at:
            try:
                fd = os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return {"id": record["id"], "v": 1.0}
            os.close(fd)
            raise RuntimeError(f"injected failure at record {self.at}")
        return {"id": record["id"], "v": 1.0}


def test_a_delta_table_into_postgres_on_spark_exactly_once_across_a_failure(tmp_path: Any, spark: Any) -> None:
    delta = str(tmp_path / "delta")
    for v in range(4):
        deltalake.write_deltalake(delta, pa.table({"id": list(range(v * 500, (v + 1) * 500))}), mode="append")
    name = f"t_{uuid.uuid4().hex[:12]}"
    sql(f"CREATE TABLE public.{name} (id bigint NOT NULL, v double precision)")
    try:
        env = pe.StreamEnvironment(
            parallelism=2,
            checkpointing=pe.CheckpointConfig(interval_ms=30),
            checkpoint_storage=str(tmp_path / "ckpt"),
            buffer_size=16,
            buffer_timeout_ms=2,
            restart_attempts=2,
            monitoring=None,
        )
        step = FailOnce(str(tmp_path / "failed-once"), 1234)
        env.read_delta(delta).map(step).sink_to(pe.sinks.PostgresSink(DSN, f"public.{name}"))
        result = env.execute("delta-to-pg-on-spark", runner=pe.runners.SparkRunner(spark))
        assert result.status == "FINISHED", result.cause
        assert os.path.exists(tmp_path / "failed-once") and result.restarts == 1
        assert _ids(name) == Counter(range(2000))
    finally:
        sql(f"DROP TABLE IF EXISTS public.{name}")
