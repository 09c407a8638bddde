"""``pyengine demo``: a stateful job that fails mid-run, recovers, and proves its output exact.

A seeded clickstream (user, page, dwell time) is counted per user with the
vectorised keyed aggregate — clicks, total and longest dwell — and written by an
exactly-once parquet ``FileSink``, with checkpoints every ``interval_ms``. Once
about half the stream has gone through, one batch raises: the job restarts from
its latest completed checkpoint, replays the rest, and the demo then compares
the committed output with the answer computed directly from the clickstream.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List, Optional, TextIO

import numpy as np
import pyarrow as pa

import pyengine as pe

PAGES = 40


def clickstream(events: int, users: int, seed: int) -> pa.Table:
    """The input: deterministic for a seed."""
    rng = np.random.default_rng(seed)
    # a few heavy users and a long tail, as click logs have
    user = (rng.zipf(1.3, events) % users).astype(np.int64)
    return pa.table(
        {
            "user": user,
            "page": rng.integers(0, PAGES, events),
            "dwell_ms": rng.integers(100, 60_000, events),
        }
    )


def expected_totals(table: pa.Table, users: int) -> Dict[int, tuple]:
    """clicks, total and longest dwell per user, straight from the input."""
    user = table.column("user").to_numpy()
    dwell = table.column("dwell_ms").to_numpy()
    clicks = np.bincount(user, minlength=users)
    total = np.bincount(user, weights=dwell, minlength=users).astype(np.int64)
    longest = np.zeros(users, np.int64)
    np.maximum.at(longest, user, dwell)
    return {u: (int(clicks[u]), int(total[u]), int(longest[u])) for u in np.nonzero(clicks)[0].tolist()}


class _FailOnce:
    """A map_batches step that counts records, and raises once past ``at`` records."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.seen = 0
        self.failed = False
        self._lock = threading.Lock()

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        with self._lock:
            self.seen += batch.num_rows
            fire = not self.failed and self.seen >= self.at
            if fire:
                self.failed = True
        if fire:
            raise RuntimeError(f"injected failure after {self.at:,} records (the demo's planned crash)")
        return batch


class _SayOnOwnLine(logging.Handler):
    """The runner's warnings during the demo (the planned failure's restart), as
    lines of the demo's own output. Left to logging's last-resort handler they go
    to stderr, into the middle of the progress line the demo redraws with ``\r``."""

    def __init__(self, out: TextIO, interactive: bool) -> None:
        super().__init__(logging.WARNING)
        self.out = out
        self.interactive = interactive

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(("\n" if self.interactive else "") + "  " + record.getMessage(), file=self.out, flush=True)
        except Exception:
            self.handleError(record)


ANNOUNCE_AFTER_S = 1.0
"""Off a terminal, the monitoring address is printed once the job has run this long."""


def _bar(done: float, width: int = 28) -> str:
    filled = int(width * min(1.0, done))
    return "#" * filled + "-" * (width - filled)


def run(
    out: TextIO = sys.stdout,
    *,
    events: int = 2_000_000,
    users: int = 50_000,
    parallelism: int = 2,
    interval_ms: int = 200,
    seed: int = 7,
    workdir: Optional[str] = None,
    fail: bool = True,
) -> bool:
    """Runs the demo; True when the recovered output equals the failure-free answer."""
    own_dir = workdir is None
    root = workdir or tempfile.mkdtemp(prefix="pyengine-demo-")
    try:
        return _run(out, events, users, parallelism, interval_ms, seed, root, fail)
    finally:
        if own_dir:
            shutil.rmtree(root, ignore_errors=True)


def _run(
    out: TextIO, events: int, users: int, parallelism: int, interval_ms: int, seed: int, root: str, fail: bool
) -> bool:
    print(
        f"pyengine demo: {events:,} clicks of {users:,} users -> clicks and dwell per user -> exactly-once parquet",
        file=out,
    )
    print(
        f"  parallelism {parallelism}, checkpoints every {interval_ms} ms, "
        f"{'one injected failure at ~50%' if fail else 'no failure'}; files under {root}",
        file=out,
    )
    table = clickstream(events, users, seed)
    chaos = _FailOnce(events // 2 if fail else events + 1)
    env = pe.StreamEnvironment(
        parallelism=parallelism,
        checkpointing=pe.CheckpointConfig(interval_ms=interval_ms),
        checkpoint_storage=os.path.join(root, "checkpoints"),
        buffer_size=8192,
        buffer_timeout_ms=50,
        restart_attempts=2,
        # The demo draws its own progress line (the read position against the
        # planned failure); the monitor's live line on the same terminal would be a
        # second one, so it is off, and the server's address is printed below.
        monitoring=pe.Monitoring(progress=False, announce=False),
    )
    sink = pe.sinks.FileSink(os.path.join(root, "out"), format="parquet")
    (
        env.from_collection(table, name="clickstream")
        .map_batches(chaos)
        .name("parse")
        .key_by("user")
        .aggregate(pe.agg.count(alias="clicks"), pe.agg.sum("dwell_ms"), pe.agg.max("dwell_ms"))
        .uid("per-user")
        .sink_to(sink)
    )
    interactive = out.isatty() if hasattr(out, "isatty") else False
    logger = logging.getLogger("pyengine")
    handler, propagate = _SayOnOwnLine(out, interactive), logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        return _watch(out, env, sink, table, chaos, events, users, fail, interactive)
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _watch(
    out: TextIO,
    env: Any,
    sink: Any,
    table: pa.Table,
    chaos: _FailOnce,
    events: int,
    users: int,
    fail: bool,
    interactive: bool,
) -> bool:
    """Runs the job, drawing one progress line (redrawn in place on a terminal, a
    line a second elsewhere), then checks its output."""
    started = time.monotonic()
    client = env.execute_async("clickstream-demo")
    # The monitoring address is worth printing only while someone can open it: on a
    # terminal at once (a person watches), elsewhere (a log, CI) once the job has lived
    # ANNOUNCE_AFTER_S, so a job that ends sooner prints no address that is already dead.
    announced = client.monitoring_url is None
    if interactive and not announced:
        print(f"  monitoring (while it runs): {client.monitoring_url}", file=out)
        announced = True
    last_line = 0.0
    while not client.done():
        time.sleep(0.1)
        now = time.monotonic()
        if not announced and now - started >= ANNOUNCE_AFTER_S and not client.done():
            print(f"  monitoring (while it runs): {client.monitoring_url}", file=out, flush=True)
            announced = True
        if not interactive and now - last_line < 1.0:
            continue
        last_line = now
        stats = client.checkpoints
        completed = stats.counts["completed"] if stats is not None else 0
        # records seen include those replayed after the restart, hence the cap
        line = (
            f"  [{_bar(chaos.seen / (events * (1.5 if chaos.failed else 1)))}] {min(chaos.seen, events):>11,} "
            f"records read  {completed:>3} checkpoints  {client.restarts} restart(s)  {now - started:5.1f} s"
        )
        print(("\r" + line) if interactive else line, end="" if interactive else "\n", file=out, flush=True)
    from .errors import JobFailedError

    try:
        result = client.wait()
    except JobFailedError as exc:
        result = exc.result
    if interactive:
        print(file=out)
    elapsed = time.monotonic() - started
    print(
        f"  job {result.status} in {elapsed:.1f} s ({events / elapsed / 1e6:.2f} M records/s incl. the replay), "
        f"{result.restarts} restart(s)",
        file=out,
    )
    if result.status != "FINISHED":
        print(f"  FAILED: {result.cause}", file=out)
        return False
    _checkpoint_table(out, result.checkpoints)
    return _check(out, sink, table, users, fail, result.restarts)


def _checkpoint_table(out: TextIO, stats: Any) -> None:
    counts = stats.counts
    print(
        f"\n  checkpoints: {counts['completed']} completed, {counts['failed']} failed, "
        f"{counts['restored']} restored; latest {len(stats.history)}:",
        file=out,
    )
    print(f"  {'id':>4}  {'status':<10} {'duration':>9} {'size':>10} {'alignment':>10}  subtasks", file=out)
    for c in stats.history[-10:]:
        size = f"{c.full_size / 1024:,.0f} KiB" if c.full_size else "-"
        print(
            f"  {c.id:>4}  {c.status:<10} {c.end_to_end_duration_ms:>6} ms {size:>10} "
            f"{c.alignment_duration_ms:>7.1f} ms  {c.num_acknowledged}/{c.num_subtasks}",
            file=out,
        )
        if c.status == "FAILED" and c.failure_message:  # e.g. the planned crash aborted it mid-way
            print(f"        why: {c.failure_message}", file=out)
    summary = stats.summary()["end_to_end_duration_ms"]
    print(f"  end-to-end duration: p50 {summary['p50']:.0f} ms, p99 {summary['p99']:.0f} ms", file=out)


def _check(out: TextIO, sink: Any, table: pa.Table, users: int, fail: bool, restarts: int) -> bool:
    final: Dict[int, tuple] = {}
    rows: List[Dict[str, Any]] = sink.read_committed()
    latest: Dict[int, int] = {}
    for r in rows:  # an update stream: a user's row with the largest _seq holds the final totals
        if r["_seq"] >= latest.get(r["user"], -1):
            latest[r["user"]] = r["_seq"]
            final[r["user"]] = (r["clicks"], r["sum_dwell_ms"], r["max_dwell_ms"])
    want = expected_totals(table, users)
    wrong = [u for u in want if final.get(u) != want[u]]
    extra = [u for u in final if u not in want]
    print(f"\n  committed output: {len(rows):,} update rows in {len(sink.committed_files())} part files", file=out)
    if wrong or extra:
        print(f"  MISMATCH: {len(wrong)} users with wrong totals, {len(extra)} unexpected users", file=out)
        for u in wrong[:5]:
            print(f"    user {u}: got {final.get(u)}, want {want[u]} (clicks, total, longest dwell)", file=out)
        return False
    if fail and restarts < 1:
        print("  MISMATCH: the injected failure did not restart the job", file=out)
        return False
    print(
        f"  OK: all {len(want):,} users' clicks and dwell equal the failure-free answer"
        + (" after the failure and recovery" if fail else ""),
        file=out,
    )
    return True
