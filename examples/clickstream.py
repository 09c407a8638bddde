"""Clicks per user, exactly once through a failure and a crash.

A seeded clickstream is counted per user (clicks and total dwell) by the vectorised
keyed aggregate and written to parquet by an exactly-once ``FileSink``. The first run
hits a bug halfway and fails (``JobFailedError``); running the same job again, fixed,
resumes it from its latest checkpoint (``execute(name)`` resumes by default). The
committed output then holds exactly what one failure-free run would have written.

    python examples/clickstream.py [--events N] [--users N] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any, Dict, List, Optional

import pyarrow as pa

import pyengine as pe


def click(i: int, users: int) -> Dict[str, int]:
    """The i-th click of a seeded stream: a user and a dwell time."""
    x = (i * 2654435761 + 12345) % (1 << 32)
    return {"user": x % users, "dwell_ms": (x >> 8) % 5000}


class BugAt:
    """A bug at one record until the file ``fixed`` exists, which every process of the
    job sees (Spark's Python workers too). ``once=True``: the failure creates it, as a
    passing fault (a lost machine) that a restart gets past."""

    def __init__(self, at: int, fixed: str, once: bool = False) -> None:
        self.at, self.fixed, self.once = at, fixed, once

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if not os.path.exists(self.fixed) and batch.num_rows and self._seen(batch):
            if self.once:
                open(self.fixed, "w").close()
            raise ValueError(f"a bug at click {self.at}")
        return batch.drop_columns(["i"])

    def _seen(self, batch: pa.RecordBatch) -> bool:
        return self.at in batch.column("i").to_pylist()


def build(env: pe.StreamEnvironment, events: int, users: int, bug: BugAt, out: str) -> pe.sinks.FileSink:
    sink = pe.sinks.FileSink(out, format="parquet")
    (
        env.from_generator(lambda i: {"i": i, **click(i, users)}, events)
        .map_batches(bug)
        .key_by("user")
        .aggregate(pe.agg.count(alias="clicks"), pe.agg.sum("dwell_ms", alias="dwell_ms"))
        .uid("clicks-per-user")
        .sink_to(sink)
    )
    return sink


def environment(storage: str, restart_attempts: int = 0) -> pe.StreamEnvironment:
    return pe.StreamEnvironment(
        parallelism=2,
        checkpointing=pe.CheckpointConfig(interval_ms=100),
        checkpoint_storage=storage,
        # 0 here: the bug is in the code, and a restart would only meet it again
        restart_attempts=restart_attempts,
    )


def same_as_expected(sink: pe.sinks.FileSink, events: int, users: int) -> bool:
    got = final_rows(sink.read_committed())
    want = expected(events, users)
    same = {u: {"clicks": r["clicks"], "dwell_ms": r["dwell_ms"]} for u, r in got.items()} == want
    print(f"{len(want)} users; output {'equals' if same else 'DIFFERS FROM'} the failure-free answer")
    return same


def final_rows(rows: List[Dict[str, Any]]) -> Dict[int, Dict[str, Any]]:
    """emit="updates" output: each key's row with the largest _seq is its final value."""
    latest: Dict[int, Dict[str, Any]] = {}
    for row in rows:
        if row["user"] not in latest or row["_seq"] > latest[row["user"]]["_seq"]:
            latest[row["user"]] = row
    return latest


def expected(events: int, users: int) -> Dict[int, Dict[str, int]]:
    out: Dict[int, Dict[str, int]] = {}
    for i in range(events):
        c = click(i, users)
        total = out.setdefault(c["user"], {"clicks": 0, "dwell_ms": 0})
        total["clicks"] += 1
        total["dwell_ms"] += c["dwell_ms"]
    return out


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--users", type=int, default=1_000)
    parser.add_argument("--workdir", help="keep checkpoints and output here (default: a temporary directory)")
    args = parser.parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="pyengine-clickstream-")
    storage, out = os.path.join(workdir, "checkpoints"), os.path.join(workdir, "out")
    bug = BugAt(args.events * 3 // 4, os.path.join(workdir, "fixed"))

    env = environment(storage)
    build(env, args.events, args.users, bug, out)
    try:
        env.execute("clickstream")
    except pe.JobFailedError as failed:
        print(f"first run failed: {failed.cause!r}; latest checkpoint {failed.result.latest_checkpoint}")

    open(bug.fixed, "w").close()  # fix the bug, then run the same job again: it resumes
    env = environment(storage)
    sink = build(env, args.events, args.users, bug, out)
    result = env.execute("clickstream")
    print(f"second run: {result.status}, resumed in {result.checkpoint_dir}")

    return 0 if same_as_expected(sink, args.events, args.users) else 1


if __name__ == "__main__":
    raise SystemExit(main())
