"""Checkpoints of large per-record state (issue #43): the 1 M-key job.

A per-record job keeps a typed ``ValueState`` (int64) and a typed ``ListState`` (float64)
for each key: 4 records per key, keys visited round-robin (every interval changes a new
stretch of keys: the worst case for a per-key change log), parallelism 2, the
incremental backend, checkpoints every second, the default settings otherwise. The
issue's job has 1 M keys (``PYENGINE_BENCH_LARGE=1``); the default run scales it to
``PYENGINE_BENCH_STATE_KEYS`` (150,000) to stay within about a minute.

Rows, the job with and without checkpoints interleaved, best of ``ROUNDS`` each:

- the job's wall time without checkpoints and with them: target (issue #43) >= 0.75x
  of its own speed without checkpoints; measured again before it fails (a shared
  machine's slow spell hits one run, not every one);
- its slowest checkpoint (end to end, the coordinator's figure): target <= 2 s, reported;
- restoring the keyed state of its last checkpoint at p=2 and rescaled to p=3 (the
  slowest subtask's restore): target <= 3 s each, reported.

Wall-time ratios of whole jobs swing widely on a loaded 2-core machine (the commit before
copy-on-write by tail measured 0.2x and 0.8x in two runs of this very row); the second test,
CPU time of the task's side alone, is the steady figure (docs/benchmarks.md).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pyarrow as pa
from conftest import SUMMARY, measured_again

import pyengine as pe
from pyengine.runtime.keyed import KeyedContext, KeyedProcessFunction
from pyengine.state import (
    DEFAULT_MAX_PARALLELISM,
    ListStateDescriptor,
    ValueStateDescriptor,
    create_keyed_backend,
    key_group_range_for_subtask,
)
from pyengine.storage import checkpoint_storage
from pyengine.storage.metadata import load_metadata

LARGE = os.environ.get("PYENGINE_BENCH_LARGE") == "1"
KEYS = 1_000_000 if LARGE else int(os.environ.get("PYENGINE_BENCH_STATE_KEYS", 150_000))
RECORDS = 4 * KEYS
PARALLELISM = 2
INTERVAL_MS = 1_000
ROUNDS = 2 if LARGE else 3
TARGET_RATIO = 0.75  # with checkpoints against without (issue #43)
GUARD_RATIO = 0.4  # asserted (a shared 2-core machine under load); the target is reported met or not
TARGET_SLOWEST_S = 2.0
TARGET_RESTORE_S = 3.0


class KeepBoth(KeyedProcessFunction):
    """A count and the amounts per key, nothing emitted."""

    def open(self, ctx: KeyedContext) -> None:
        self.count = ctx.get_state(ValueStateDescriptor("count", type=pa.int64()))
        self.amounts = ctx.get_list_state(ListStateDescriptor("amounts", pa.float64()))

    def process_element(self, value: Tuple[int, float], ctx: KeyedContext) -> Iterator[Any]:
        self.count.update((self.count.value() or 0) + 1)
        self.amounts.add(value[1])
        return iter(())


def _record(i: int) -> Tuple[int, float]:
    return (i % KEYS, i * 0.5)


def _job(checkpoints: bool, storage: str, parallelism: int = PARALLELISM, resume: Optional[str] = None) -> Any:
    config = pe.CheckpointConfig(interval_ms=INTERVAL_MS) if checkpoints else None
    env = pe.StreamEnvironment(
        parallelism=parallelism, checkpointing=config, state_backend="incremental", checkpoint_storage=storage
    )
    env.from_generator(_record, RECORDS).key_by(0).process(KeepBoth()).uid("keep").sink_to(pe.sinks.DiscardSink())
    started = time.perf_counter()
    result = env.execute("large-state", resume=resume) if resume else env.execute("large-state")
    return time.perf_counter() - started, result


def _directory() -> str:
    return tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)


def test_large_state_checkpoints_restore_and_rescale() -> None:
    best: Dict[bool, float] = {False: float("inf"), True: float("inf")}
    slowest: List[float] = []
    latest: Optional[str] = None

    def measure() -> float:
        nonlocal latest
        for checkpoints in (False, True):
            seconds, result = _job(checkpoints, _directory())
            assert result.succeeded
            best[checkpoints] = min(best[checkpoints], seconds)
            if checkpoints:
                durations = result.checkpoints.summary()["end_to_end_duration_ms"]
                if result.checkpoints.counts["completed"]:
                    slowest.append(durations["max"] / 1e3)
                latest = result.latest_checkpoint or latest
        return best[False] / best[True]

    for _ in range(ROUNDS - 1):
        measure()
    ratio, again = measured_again(measure(), GUARD_RATIO, measure)
    assert latest is not None, "no checkpoint completed"
    restore = {parallelism: _restore_seconds(latest, parallelism) for parallelism in (PARALLELISM, 3)}
    worst = max(slowest) if slowest else float("nan")
    SUMMARY.append(
        f"large state ({KEYS:,} keys, a typed value and a typed list each, {RECORDS:,} records, p={PARALLELISM}, "
        f"incremental, checkpoints every {INTERVAL_MS} ms; best of {ROUNDS}, measured again {again}x):"
    )
    SUMMARY.append(
        f"  {RECORDS / best[True] / 1e3:.0f} k records/s with checkpoints, {RECORDS / best[False] / 1e3:.0f} k "
        f"without: {ratio:.2f}x (target >= {TARGET_RATIO}: {'met' if ratio >= TARGET_RATIO else 'NOT MET'})"
    )
    SUMMARY.append(
        f"  slowest checkpoint {worst:.2f} s (target <= {TARGET_SLOWEST_S} s: "
        f"{'met' if worst <= TARGET_SLOWEST_S else 'NOT MET'}); restore of its last checkpoint at p=2 "
        f"{restore[PARALLELISM]:.2f} s, rescaled to p=3 {restore[3]:.2f} s (target <= {TARGET_RESTORE_S} s each: "
        f"{'met' if max(restore.values()) <= TARGET_RESTORE_S else 'NOT MET'})"
    )
    assert ratio >= GUARD_RATIO, f"checkpoints cost the large-state job {1 - ratio:.0%} (guard: {1 - GUARD_RATIO:.0%})"


def test_appends_after_a_freeze_cost_about_what_appends_cost() -> None:
    """The task's side of a checkpoint, alone: one append to each of ``KEYS`` keys of
    the backend of one subtask (CPU time of this thread), right after a snapshot's
    synchronous part against with no snapshot taken. Copy-on-write by tail records a
    length where the first append to a key after a freeze copied its list (measured
    at 200,000 keys: 4.9-6.2 us an append after a freeze, against 1.3-1.6 us now)."""
    rounds = 3
    best = {False: float("inf"), True: float("inf")}
    for _ in range(rounds):
        for frozen in (False, True):
            backend = create_keyed_backend("incremental")
            amounts = backend.get_state(ListStateDescriptor("amounts", pa.float64()))
            keys = list(range(KEYS))
            for k in keys:
                backend.set_current_key(k)
                amounts.add(0.5)
            location = checkpoint_storage(_directory(), "appends").location(1)
            pending = backend.snapshot(1, location) if frozen else None
            started = time.thread_time()
            for k in keys:
                backend.set_current_key(k)
                amounts.add(1.5)
            best[frozen] = min(best[frozen], time.thread_time() - started)
            if pending is not None:
                pending.release()
    ratio = best[False] / best[True]
    SUMMARY.append(
        f"  appends right after a freeze: {best[True] / KEYS * 1e9:.0f} ns each (CPU), {best[False] / KEYS * 1e9:.0f} "
        f"ns with no snapshot: {ratio:.2f}x (guard >= 0.3)"
    )
    assert ratio >= 0.3, f"an append right after a freeze costs {1 / ratio:.1f}x an append (guard: 3.3x)"


def _restore_seconds(checkpoint: str, parallelism: int) -> float:
    """Restoring the job's keyed state from ``checkpoint`` at ``parallelism`` (3: a
    rescale, each new subtask reading the batches of its key groups from both old
    subtasks' chains): the slowest subtask's restore, best of two. The subtasks of a
    job restore at once, on their own threads; here one after the other, each timed."""
    handles = load_metadata(checkpoint).operator("keep").keyed_handles()
    slowest = 0.0
    for subtask in range(parallelism):
        key_groups = key_group_range_for_subtask(DEFAULT_MAX_PARALLELISM, parallelism, subtask)
        best = float("inf")
        for _ in range(2):
            backend = create_keyed_backend("incremental", key_group_range=key_groups)
            started = time.perf_counter()
            backend.restore(handles)
            best = min(best, time.perf_counter() - started)
            entries = backend.num_entries()
            del backend
        assert entries > 0
        slowest = max(slowest, best)
    return slowest
