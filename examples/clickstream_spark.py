"""The clickstream job of ``clickstream.py`` on Apache Spark.

Every subtask is a task of one barrier-mode Spark stage. A task fails once halfway
(a passing fault); the runner cancels the stage and starts a new one that restores
the latest completed checkpoint, and the committed output is exact. Spark then reads
the output. Needs ``pip install ".[spark]"`` in the repository.

    python examples/clickstream_spark.py [--events N] [--users N] [--master local[4]]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import List, Optional

import clickstream  # the job, beside this file
from pyspark import cloudpickle
from pyspark.sql import SparkSession

import pyengine as pe


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--users", type=int, default=1_000)
    parser.add_argument("--master", default="local[4]", help="2 operator chains x parallelism 2 = 4 task slots")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="pyengine-clickstream-spark-")
    # On a cluster, checkpoints and output go to storage every executor reaches
    # (s3://, gs://, hdfs://); local[N] shares this machine's disk.
    storage, out = os.path.join(workdir, "checkpoints"), os.path.join(workdir, "out")

    # The job's code is in a module the executors do not have installed: ship it by value.
    cloudpickle.register_pickle_by_value(clickstream)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(args.master)
        .appName("pyengine clickstream")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    try:
        env = clickstream.environment(storage, restart_attempts=2)
        bug = clickstream.BugAt(args.events // 2, os.path.join(workdir, "failed-once"), once=True)
        sink = clickstream.build(env, args.events, args.users, bug, out)
        result = env.execute("clickstream", runner=pe.runners.SparkRunner(spark))
        print(f"{result.status} after {result.restarts} restart(s)")

        updates = spark.read.parquet(*sink.committed_files())
        print(f"Spark reads {updates.count()} update rows of {updates.select('user').distinct().count()} users")
        return 0 if clickstream.same_as_expected(sink, args.events, args.users) and result.restarts == 1 else 1
    finally:
        spark.stop()


if __name__ == "__main__":
    raise SystemExit(main())
