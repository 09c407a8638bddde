"""The monitoring server under the Spark runner: it runs on the driver beside the
coordinator, ``execute_async`` gives its address at once, the executors' tasks
send their counters with their polls, and the REST answers and ``/metrics`` show
the coordinator's statistics and every record the tasks read."""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from typing import Any, Dict

import pytest

import pyengine as pe

pyspark = pytest.importorskip("pyspark", reason="the Spark runner needs pyspark (the test extra installs it)")

pytestmark = [
    pytest.mark.spark,
    pytest.mark.slow,
]

N = 60_000


def _record(i: int) -> Dict[str, int]:
    if i % 500 == 0:
        time.sleep(0.05)  # a job that runs for a few seconds (3 s of sleep per subtask), so it is seen running
    return {"user": i % 13, "v": i}


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
        return json.loads(body) if response.headers.get("Content-Type", "").startswith("application/json") else body


def test_the_driver_serves_the_jobs_monitoring_with_the_executors_counters(tmp_path: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from pyspark import cloudpickle
    from pyspark.sql import SparkSession

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # not installed on the executors
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[4]")
        .appName("pyengine-monitoring")
        .config("spark.ui.enabled", "false")
        .getOrCreate()
    )
    try:
        env = pe.StreamEnvironment(
            parallelism=2,
            checkpointing=pe.CheckpointConfig(interval_ms=200),
            checkpoint_storage=str(tmp_path / "ckpt"),
            monitoring=pe.Monitoring(sample_interval_s=0.2, progress=False, announce=False),
        )
        sink = pe.sinks.FileSink(str(tmp_path / "out"), format="jsonl")
        env.from_generator(_record, N).key_by("user").aggregate(pe.agg.count(), emit="final").sink_to(sink)
        client = env.execute_async("monitored-on-spark", runner=pe.runners.SparkRunner(spark))
        url = client.monitoring_url
        assert url is not None and url.startswith("http://127.0.0.1:")  # on the driver, before the stage starts
        job_id = client._runner.job_id
        deadline = time.monotonic() + 120
        seen: Dict[str, Any] = {}
        last: Any = None
        while time.monotonic() < deadline and not client.done():
            details = _get(url + f"jobs/{job_id}")
            read = details["vertices"][0]["metrics"]["read-records"]
            completed = _get(url + f"jobs/{job_id}/checkpoints")["counts"]["completed"]
            running = [v["tasks"]["RUNNING"] for v in details["vertices"]]
            last = (details["state"], read, completed, running)
            if read > 0 and completed >= 1 and details["state"] == "RUNNING" and running == [2, 2]:
                seen = {"details": details, "metrics": _get(url + "metrics").decode()}
                break
            time.sleep(0.2)
        assert seen, f"never seen running with counters and a checkpoint; last (state, read, done, running): {last}"
        families = {f.name: f for f in text_string_to_metric_families(seen["metrics"])}
        records_in = families["flink_taskmanager_job_task_numRecordsIn"].samples
        assert {(s.labels["task_id"], s.labels["subtask_index"]) for s in records_in} == {
            ("v0", "0"),
            ("v0", "1"),
            ("v1", "0"),
            ("v1", "1"),
        }
        result = client.wait()
        assert result.status == "FINISHED" and result.monitoring_url == url
        last = client._runner.monitor.history.latest
        assert sum(s.records_in for (v, _), s in last.subtasks.items() if v == "v0") == N  # read by the executors
        assert sum(s.records_in for (v, _), s in last.subtasks.items() if v == "v1") == N
        assert sum(int(r["count"]) for r in sink.read_committed()) == N
    finally:
        spark.stop()
