"""Read a checkpoint's keyed state back: with pyarrow alone, with pyengine, with Spark.

A job counts clicks per user in keyed state (a typed ``ValueState``) and keeps its
last checkpoint. The state is then read three ways:

1. with nothing but ``json`` and ``pyarrow``, as another tool would, following
   docs/format.md: ``_metadata`` lists each subtask's state file, an Arrow IPC file;
2. with ``pyengine.state.read_keyed_state``;
3. with Spark, from that Arrow table (``pip install ".[spark]"``; skipped
   without pyspark).

    python examples/read_state.py [--users N]
"""

from __future__ import annotations

import argparse
import json
import posixpath
import tempfile
from typing import Any, Dict, Iterator, List, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc

import pyengine as pe
from pyengine.state import ValueStateDescriptor, read_keyed_state

COUNT = ValueStateDescriptor("count", 0, pa.int64())


class CountPerUser(pe.KeyedProcessFunction):
    def open(self, ctx: Any) -> None:
        self.count = ctx.get_state(COUNT)

    def process_element(self, value: Any, ctx: Any) -> Iterator[Dict[str, int]]:
        n = self.count.value() + 1
        self.count.update(n)
        yield {"user": ctx.current_key, "clicks": n}


def run_job(workdir: str, users: int) -> str:
    """Runs the job; returns its latest checkpoint's directory."""
    env = pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=100), checkpoint_storage=f"{workdir}/ckpt"
    )
    (
        env.from_generator(lambda i: {"user": i % users}, users * 5)
        .key_by("user")
        .process(CountPerUser())
        .uid("counter")
        .sink_to(pe.sinks.DiscardSink())
    )
    result = env.execute("read-state-example")
    assert result.latest_checkpoint is not None
    return result.latest_checkpoint


def state_files(checkpoint: str, operator: str) -> Iterator[pa.Buffer]:
    """The bytes of every keyed state file of ``operator``: in a file beside
    ``_metadata`` (paths are relative to its directory) or inline in it (small state)."""
    with open(posixpath.join(checkpoint, "_metadata")) as f:
        document = json.load(f)
    assert document["format"] == "pyengine-checkpoint" and document["version"] == 1
    for subtask in document["metadata"]["operators"][operator]["subtasks"].values():
        for handle in subtask["keyed"]:
            stream = handle["stream"]
            if stream["kind"] == "inline":
                yield pa.py_buffer(bytes.fromhex(stream["data"]))
            else:
                with open(posixpath.normpath(posixpath.join(checkpoint, stream["path"])), "rb") as f:
                    yield pa.py_buffer(f.read())


def read_with_pyarrow(checkpoint: str, operator: str, state: str) -> pa.Table:
    """Keyed state ``state`` of ``operator``: key, value and key group, with pyarrow only
    (a heap backend's full snapshot: one file per subtask, no delta chain)."""
    tables: List[pa.Table] = []
    for buffer in state_files(checkpoint, operator):
        reader = ipc.open_file(buffer)
        info = json.loads(reader.schema.metadata[b"pyengine"])
        index = [s["name"] for s in info["states"]].index(state)
        table = reader.read_all()
        # key_group and state are run-end encoded (a few runs per batch): decode them
        decoded = pa.table(
            {
                "key": table.column("key"),
                "value": table.column("value"),
                "key_group": pc.run_end_decode(table.column("key_group")).cast(pa.int32()),
                "state": pc.run_end_decode(table.column("state")),
            }
        )
        tables.append(decoded.filter(pc.equal(decoded.column("state"), index)).drop_columns(["state"]))
    return pa.concat_tables(tables)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=5_000)
    args = parser.parse_args(argv)
    checkpoint = run_job(tempfile.mkdtemp(prefix="pyengine-read-state-"), args.users)
    print(f"checkpoint: {checkpoint}")

    by_pyarrow = read_with_pyarrow(checkpoint, "counter", "count").sort_by("key")
    by_pyengine = read_keyed_state(checkpoint, "counter", "count").sort_by("key")
    print(f"pyarrow reads {by_pyarrow.num_rows} users; the first: {by_pyarrow.slice(0, 2).to_pylist()}")
    assert by_pyarrow.column("key").to_pylist() == by_pyengine.column("key").to_pylist()
    assert by_pyarrow.column("value").to_pylist() == by_pyengine.column("value").to_pylist()
    assert set(by_pyarrow.column("value").to_pylist()) == {5}, "each user clicked 5 times"

    try:
        from pyspark.sql import SparkSession
    except ImportError:
        print("pyspark is not installed: skipping the Spark read")
        return 0
    spark = (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    try:
        spark.sparkContext.setLogLevel("ERROR")
        spark.createDataFrame(by_pyarrow).createOrReplaceTempView("counts")
        row = spark.sql("SELECT count(*) AS users, sum(value) AS clicks FROM counts").first()
        assert row is not None
        print(f"Spark SQL over the state: {row.users} users, {row.clicks} clicks")
        assert (row.users, row.clicks) == (args.users, 5 * args.users)
    finally:
        spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
