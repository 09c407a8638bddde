"""Writes ``tests/data/savepoint-tws-e145a3c``, the transformWithState adapter's state as
the release before issue #41 checkpointed it (no ``_tws_schemas`` operator state): run
from the repository's root with that commit's pyengine first on ``PYTHONPATH`` (a
worktree of e145a3c, built): ``python tests/data/make_tws_savepoint.py``.

The job (``build``) counts per user in a value state of two fields with a nested struct,
keeps the values in a list state and a map state, and sets an event-time timer per user;
``tests/test_tws_acceptance.py`` restores it with the current code."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

from pyspark.sql import Row
from pyspark.sql.streaming import StatefulProcessor

import pyengine as pe

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "savepoint-tws-e145a3c"
OUTPUT = "user bigint, count bigint, last string, listed bigint, mapped bigint"


class Keeper(StatefulProcessor):
    def init(self, handle: Any) -> None:
        self.handle = handle
        self.state = handle.getValueState("state", "count bigint, meta struct<tag: string, n: int>")
        self.seen = handle.getListState("seen", "v bigint")
        self.by_tag = handle.getMapState("by_tag", "tag string", "n bigint")

    def handleInputRows(self, key: Any, rows: Iterator[Any], timerValues: Any) -> Iterator[Any]:
        old = self.state.get()
        count = old[0] if old else 0
        last = old[1][0] if old else ""
        for r in rows:
            count += 1
            last = r["tag"]
            self.seen.appendValue((r["v"],))
            got = self.by_tag.getValue((last,))
            self.by_tag.updateValue((last,), ((got[0] if got else 0) + 1,))
            self.handle.registerTimer(r["ts"] + 1_000_000)
        self.state.update((count, (last, count)))
        yield Row(
            user=key[0],
            count=count,
            last=last,
            listed=len(list(self.seen.get())),
            mapped=sum(v for (v,) in self.by_tag.values()),
        )


def records(lo: int, hi: int) -> list:
    return [{"user": i % 5, "v": i, "tag": "abc"[i % 3], "ts": 1_000 * i} for i in range(lo, hi)]


def build(env: Any, lo: int, hi: int, sink: Any, processor: Any = Keeper, more: int = 0) -> None:
    """The job: records ``lo..hi-1``; ``more`` records after them from a second source
    (a restore of the fixture, whose source has ended, reads those)."""
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(0).with_timestamp_assigner("ts")
    stream = env.from_collection(records(lo, hi), watermark_strategy=strategy)
    if more:
        stream = stream.union(env.from_collection(records(hi, hi + more), "more", watermark_strategy=strategy))
    out = stream.key_by("user").transform_with_state(processor(), OUTPUT, time_mode="EventTime").uid("keeper")
    out.sink_to(sink).uid("3-sink")  # the name the fixture's sink got


if __name__ == "__main__":
    scratch = Path(tempfile.mkdtemp())
    env = pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=50), checkpoint_storage=str(scratch)
    )
    build(env, 0, 60, pe.sinks.CollectSink())
    result = env.execute("tws-fixture")
    assert result.status == "FINISHED" and result.latest_checkpoint, result
    if FIXTURE.exists():
        shutil.rmtree(FIXTURE)
    shutil.copytree(result.latest_checkpoint, FIXTURE)
    print("wrote", FIXTURE, "from", result.latest_checkpoint, file=sys.stderr)
