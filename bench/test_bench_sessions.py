"""Session windows on Arrow input against the tumbling window, and what checkpoints cost them.

Nexmark-like bids (``auction``, ``bidder``, ``price``, ``date_time``) as one Arrow table:
1,000 bids per second of event time, bidders drawn with a hot head (a fifth of the bids
from 50 bidders, the rest from 5,000), timestamps out of order by up to 2 s. Two rows:

- ``session (10 s gap)`` against ``tumbling (10 s)``: a count per bidder (Nexmark q11's
  shape), same input, keys, watermark strategy and default settings (parallelism 2,
  checkpoints every second: what users run). Target: session >= 0.5x the tumbling
  window's rows/s (reported; asserted: a guard of 0.4x, see SESSION_GUARD).
- the session count with checkpoints every second against the same job without, on
  ``PYENGINE_BENCH_SESSION_CHECKPOINT_BIDS`` bids (default 2,000,000: a run of 1.5-3 s, so
  every run takes checkpoints; on 400,000 a run is over in 0.6 s and takes at most one,
  whose fixed cost is then most of the difference). Target: checkpoints cost <= 15% of
  throughput; the row says how many completed.

Targets are ratios of the best of interleaved runs in one session (the machine is
shared); ``PYENGINE_BENCH_SESSION_BIDS`` sets the first row's input size (default
400,000, the issue's).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, List, Tuple

import numpy as np
import pyarrow as pa
import pytest
from conftest import SUMMARY, measured_again

import pyengine as pe

BIDS = int(os.environ.get("PYENGINE_BENCH_SESSION_BIDS", 400_000))
CHECKPOINT_BIDS = int(os.environ.get("PYENGINE_BENCH_SESSION_CHECKPOINT_BIDS", 2_000_000))
ROUNDS = 3
SESSION_TARGET = 0.5  # the target, reported
# Asserted is a guard below it, as the other window rows do: 0.73-0.93x on a quiet machine,
# 0.46-0.53x with a load average of 10 on its 2 cores (the tumbling job, mostly waiting, keeps
# its wall time; the session job's CPU, about 2x the tumbling one's, does not), and a red run
# on that noise would say nothing of the operator.
SESSION_GUARD = 0.4
CHECKPOINT_GUARD = 0.85


def nexmark_bids(n: int, seed: int = 0) -> pa.Table:
    """Bids at 1,000 per second of event time, a hot head of bidders, 2 s out of order."""
    rng = np.random.default_rng(seed)
    hot = rng.random(n) < 0.2
    bidder = np.where(hot, rng.integers(0, 50, n), rng.integers(50, 5_050, n)).astype(np.int64)
    ts = np.arange(n, dtype=np.int64) + rng.integers(0, 2_000, n)
    return pa.table(
        {
            "auction": rng.integers(1_000, 11_000, n).astype(np.int64),
            "bidder": bidder,
            "price": rng.integers(100, 100_000, n).astype(np.int64),
            "date_time": ts,
        }
    )


COMPLETED: List[int] = []  # checkpoints completed by each run with checkpoints


def _count(bids: pa.Table, window: Any, checkpoints: bool = True) -> None:
    env = pe.StreamEnvironment(
        parallelism=2, checkpointing=pe.CheckpointConfig(interval_ms=1_000) if checkpoints else None
    )
    strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(2_000).with_timestamp_assigner("date_time")
    stream = env.from_collection(bids, watermark_strategy=strategy).key_by("bidder")
    stream.window(window).aggregate(pe.agg.count()).sink_to(pe.sinks.DiscardSink())
    result = env.execute("bids")
    assert result.status == "FINISHED"
    if checkpoints:
        COMPLETED.append(result.checkpoints.counts["completed"])


def _timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


@pytest.fixture(scope="module")
def bids() -> pa.Table:
    return nexmark_bids(BIDS)


def _interleaved(benchmark: Any, run: Callable[[], Any], baseline: Callable[[], Any]) -> Tuple[float, float]:
    """Times ``run`` in the row's rounds with an untimed ``baseline`` run before each;
    the best of each side, in seconds."""
    base: List[float] = []
    timed: List[float] = []

    def setup() -> None:
        base.append(_timed(baseline))

    def once() -> None:
        timed.append(_timed(run))

    benchmark.pedantic(once, setup=setup, rounds=ROUNDS)
    return min(timed), min(base)


def _again(run: Callable[[], Any], baseline: Callable[[], Any], sides: List[List[float]]) -> Callable[[], float]:
    def measure() -> float:
        sides[0].append(_timed(run))
        sides[1].append(_timed(baseline))
        return min(sides[1]) / min(sides[0])

    return measure


def test_session_window_count_against_the_tumbling_window(benchmark: Any, bids: pa.Table) -> None:
    benchmark.group = "sessions: count per bidder"
    session = lambda: _count(bids, pe.windows.session(10_000))  # noqa: E731
    tumbling = lambda: _count(bids, pe.windows.tumbling(10_000))  # noqa: E731
    tumbling()  # warm-up
    s, t = _interleaved(benchmark, session, tumbling)
    sides = [[s], [t]]
    ratio, again = measured_again(t / s, SESSION_TARGET, _again(session, tumbling, sides))
    s, t = min(sides[0]), min(sides[1])
    benchmark.extra_info.update(session_rows_per_s=BIDS / s, tumbling_rows_per_s=BIDS / t, ratio=ratio)
    SUMMARY.append(
        f"session (10 s gap) count per bidder, {BIDS:,} Nexmark-like bids, p=2, checkpoints every 1 s: "
        f"{BIDS / s / 1e6:.2f} M rows/s, tumbling (10 s) {BIDS / t / 1e6:.2f} M rows/s -> {ratio:.2f}x "
        f"(target >= {SESSION_TARGET}x: {'met' if ratio >= SESSION_TARGET else 'NOT MET'}; "
        f"asserted >= {SESSION_GUARD}x; measured again {again}x)"
    )
    assert ratio >= SESSION_GUARD, f"session windows at {ratio:.2f}x of the tumbling window's rows/s"


def test_session_window_count_with_checkpoints_against_without(benchmark: Any) -> None:
    benchmark.group = "sessions: checkpoints"
    bids = nexmark_bids(CHECKPOINT_BIDS, seed=1)
    window = pe.windows.session(10_000)
    with_cp = lambda: _count(bids, window, checkpoints=True)  # noqa: E731
    without = lambda: _count(bids, window, checkpoints=False)  # noqa: E731
    without()  # warm-up
    COMPLETED.clear()
    c, w = _interleaved(benchmark, with_cp, without)
    sides = [[c], [w]]
    ratio, again = measured_again(w / c, CHECKPOINT_GUARD, _again(with_cp, without, sides))
    c, w = min(sides[0]), min(sides[1])
    n = CHECKPOINT_BIDS
    benchmark.extra_info.update(
        with_checkpoints_rows_per_s=n / c, without_rows_per_s=n / w, ratio=ratio, checkpoints_completed=COMPLETED
    )
    SUMMARY.append(
        f"session (10 s gap) count, {n:,} bids, p=2: checkpoints every 1 s {n / c / 1e6:.2f} M rows/s "
        f"(completed per run: {COMPLETED}), without {n / w / 1e6:.2f} M rows/s -> {ratio:.2f}x "
        f"(target >= {CHECKPOINT_GUARD}x: checkpoints cost <= 15%; measured again {again}x)"
    )
    assert max(COMPLETED) >= 1, "no run completed a checkpoint: the row would measure nothing"
    assert ratio >= CHECKPOINT_GUARD, f"checkpoints cost {1 - ratio:.0%} of a session-window count's throughput"
