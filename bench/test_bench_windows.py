"""Tumbling and sliding windows (``AlignedWindowAggregateOperator``, issue #40 and #43).

Each target is a ratio of two rows measured in one run (this machine is shared and
noisy: a compared row's rounds interleave untimed runs of its baseline, and the best
of each side counts); absolute figures go to the summary. Every job runs as a user's
would: Arrow input, the environment's defaults but for parallelism 2 (as the other
job benchmarks), checkpoints on at the default interval (500 ms).

1. Sliding against tumbling: a count per auction over Nexmark-like bids (hot
   auctions), 10 s windows every 2 s against 10 s tumbling windows, same input and
   keys. Panes make a record cost the same whatever the number of windows it is in.
2. Firing: a tumbling count over 20,000 keys in 1 s windows of 500 records, so a
   (key, window) holds about one record and every input row makes an output row
   (firing dominates), against the same count and input in 1 h windows (each
   (key, window) holds about 50). The issue's target is >= 1 M rows/s for the
   former; asserted as a ratio to the latter, the absolute reported.
3. Checkpoints of window contents: the sliding count of 1., checkpoints every 100 ms
   against the same job without checkpoints; checkpoint durations reported (those of
   2., the issue's "2.4 s back to back" shape, are in its summary line).

``PYENGINE_BENCH_WINDOW_RECORDS`` sets the input size (1 M by default, ~30 s for the file).
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa
import pytest
from conftest import SUMMARY, best_seconds, measured_again

import pyengine as pe

RECORDS = int(os.environ.get("PYENGINE_BENCH_WINDOW_RECORDS", 1_000_000))
AUCTIONS = 10_000
KEYS = 20_000
ROUNDS = 3
_BASELINES: Dict[str, List[float]] = {}
_CHECKPOINTS: Dict[str, List[float]] = {}  # end-to-end durations (ms) of the runs of a row


@pytest.fixture(scope="module")
def bids() -> pa.Table:
    """Nexmark-like bids: auctions drawn hot (Zipf), 4 bids a millisecond of event time."""
    rng = np.random.default_rng(0)
    return pa.table(
        {
            "auction": (rng.zipf(1.3, RECORDS) % AUCTIONS).astype(np.int64),
            "bidder": rng.integers(0, 100_000, RECORDS),
            "price": rng.integers(1, 10_000, RECORDS),
            "ts": np.arange(RECORDS, dtype=np.int64) // 4,
        }
    )


@pytest.fixture(scope="module")
def spread() -> pa.Table:
    """20,000 keys drawn uniformly, 500 records a second of event time."""
    rng = np.random.default_rng(1)
    return pa.table(
        {
            "user": rng.integers(0, KEYS, RECORDS),
            "v": rng.integers(0, 100, RECORDS),
            "ts": np.arange(RECORDS, dtype=np.int64) * 2,
        }
    )


def _window_job(
    table: pa.Table, key: str, assigner: Any, checkpoint_ms: Optional[int] = 500, row: str = ""
) -> Callable[[], None]:
    def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            kwargs: Dict[str, Any] = {}
            if checkpoint_ms is not None:
                kwargs = dict(checkpointing=pe.CheckpointConfig(interval_ms=checkpoint_ms), checkpoint_storage=tmp)
            env = pe.StreamEnvironment(parallelism=2, **kwargs)
            strategy = pe.WatermarkStrategy.for_bounded_out_of_orderness(1000).with_timestamp_assigner("ts")
            stream = env.from_collection(table, watermark_strategy=strategy).key_by(key)
            stream.window(assigner).aggregate(pe.agg.count()).sink_to(pe.sinks.DiscardSink())
            result = env.execute("windows")
            assert result.status == "FINISHED", result.cause
            if row:
                history = result.checkpoints_json().get("history", [])
                _CHECKPOINTS.setdefault(row, []).extend(
                    h["end_to_end_duration_ms"] for h in history if h.get("status") == "COMPLETED"
                )

    return run


def _timed(run: Callable[[], Any]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _baseline_row(benchmark: Any, name: str, run: Callable[[], Any]) -> None:
    times: List[float] = []
    benchmark.pedantic(lambda: times.append(_timed(run)), rounds=ROUNDS)
    _BASELINES[name] = times


def _compared_row(
    benchmark: Any, name: str, run: Callable[[], Any], baseline: Callable[[], Any]
) -> Tuple[float, float]:
    """Times ``run`` in this row's rounds with an untimed ``baseline`` run before each
    (but the first when the baseline's row ran just before); the best of each side."""
    base = _BASELINES.setdefault(name, [])
    started = [0]

    def setup() -> None:
        started[0] += 1
        if started[0] > 1 or not base:
            base.append(_timed(baseline))

    benchmark.pedantic(run, setup=setup, rounds=ROUNDS)
    return best_seconds(benchmark), min(base)


def _again(run: Callable[[], Any], baseline: Callable[[], Any], best: List[float]) -> Callable[[], float]:
    """One more run of each, alternately; the ratio of the bests (throughput of run / of baseline)."""

    def measure() -> float:
        best[0] = min(best[0], _timed(run))
        best[1] = min(best[1], _timed(baseline))
        return best[1] / best[0]

    return measure


def _percentile(values: List[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# -- 1. sliding against tumbling ------------------------------------------------------------------

# The target (reported). Asserted below it: a sliding window's results are five times
# a tumbling one's rows, and this row measured 0.38-0.64x across runs on a shared machine
# (0.47-0.67x in CPU time of the operators alone); 0.30-0.47x before panes.
SLIDING_TARGET = 0.5
SLIDING_GUARD = 0.4


@pytest.mark.parametrize("what", ["tumbling-10s", "sliding-10s-every-2s"])
def test_sliding_windows_against_tumbling(benchmark: Any, bids: pa.Table, what: str) -> None:
    benchmark.group = "windows: sliding against tumbling (count per auction)"
    tumbling = _window_job(bids, "auction", pe.windows.tumbling(10_000))
    if what == "tumbling-10s":
        _baseline_row(benchmark, "sliding", tumbling)
        return
    sliding = _window_job(bids, "auction", pe.windows.sliding(10_000, 2_000))
    best = list(_compared_row(benchmark, "sliding", sliding, tumbling))
    ratio, again = measured_again(best[1] / best[0], SLIDING_TARGET, _again(sliding, tumbling, best))
    benchmark.extra_info.update(sliding_records_per_s=RECORDS / best[0], ratio_to_tumbling=ratio)
    SUMMARY.append(
        f"sliding window count (10 s every 2 s), {RECORDS:,} bids / {AUCTIONS:,} hot auctions, p=2, checkpoints "
        f"every 500 ms: {RECORDS / best[0] / 1e6:.2f} M records/s, tumbling (10 s) {RECORDS / best[1] / 1e6:.2f} M/s "
        f"-> {ratio:.2f}x (target >= {SLIDING_TARGET}x: {'met' if ratio >= SLIDING_TARGET else 'NOT MET'}; "
        f"asserted >= {SLIDING_GUARD}x{', measured again' if again else ''})"
    )
    assert ratio >= SLIDING_GUARD, f"sliding windows at {ratio:.2f}x of tumbling"


# -- 2. firing: about one record per (key, window) ---------------------------------------------------

# 1 M rows/s is the target; the window with many records per (key, window) ran
# 2.0-3.8 M rows/s here, the one-record one 1.6-2.8 M (0.5-0.9x of it). The layout
# before panes ran the latter at 0.07-0.11 M rows/s (0.03x).
FIRING_GUARD = 0.35
FIRING_TARGET = 1_000_000


@pytest.mark.parametrize("what", ["many-records-per-key-window", "one-record-per-key-window"])
def test_firing_a_window_per_record_against_windows_of_many(benchmark: Any, spread: pa.Table, what: str) -> None:
    benchmark.group = "windows: firing (tumbling count, 20,000 keys)"
    many = _window_job(spread, "user", pe.windows.tumbling(3_600_000))
    if what == "many-records-per-key-window":
        _baseline_row(benchmark, "firing", many)
        return
    few = _window_job(spread, "user", pe.windows.tumbling(1_000), row="firing")
    best = list(_compared_row(benchmark, "firing", few, many))
    ratio, again = measured_again(best[1] / best[0], FIRING_GUARD, _again(few, many, best))
    rate = RECORDS / best[0]
    durations = _CHECKPOINTS.get("firing", [])
    benchmark.extra_info.update(records_per_s=rate, ratio_to_many=ratio, checkpoint_p50_ms=_percentile(durations, 50))
    SUMMARY.append(
        f"tumbling count, 1 s windows, {RECORDS:,} records / {KEYS:,} keys (~1 record a (key, window): a result row "
        f"per record), p=2, checkpoints every 500 ms: {rate / 1e6:.2f} M records/s (target >= "
        f"{FIRING_TARGET / 1e6:.0f} M: {'met' if rate >= FIRING_TARGET else 'NOT MET'}); 1 h windows "
        f"{RECORDS / best[1] / 1e6:.2f} M/s -> {ratio:.2f}x (asserted >= {FIRING_GUARD}x"
        f"{', measured again' if again else ''}); checkpoints p50 {_percentile(durations, 50):.0f} ms, "
        f"max {max(durations, default=float('nan')):.0f} ms"
    )
    assert ratio >= FIRING_GUARD, f"a window per record at {ratio:.2f}x of windows of many records"


# -- 3. checkpoints of window contents ---------------------------------------------------------------

# #43 asks checkpoints to cost <= 15% of throughput (reported); asserted with room for this
# machine's noise: runs back to back measured 0.93 and 0.99x, a noisy spell 0.65x.
CHECKPOINT_TARGET = 0.85
CHECKPOINT_GUARD = 0.7


@pytest.mark.parametrize("what", ["no-checkpoints", "checkpoints-every-100ms"])
def test_checkpoints_of_sliding_window_contents(benchmark: Any, bids: pa.Table, what: str) -> None:
    benchmark.group = "windows: checkpoints of window contents (sliding 10 s every 2 s, count per auction)"
    assigner = pe.windows.sliding(10_000, 2_000)
    without = _window_job(bids, "auction", assigner, checkpoint_ms=None)
    if what == "no-checkpoints":
        _baseline_row(benchmark, "checkpoints", without)
        return
    with_checkpoints = _window_job(bids, "auction", assigner, checkpoint_ms=100, row="checkpoints")
    best = list(_compared_row(benchmark, "checkpoints", with_checkpoints, without))
    ratio, again = measured_again(best[1] / best[0], CHECKPOINT_TARGET, _again(with_checkpoints, without, best))
    durations = _CHECKPOINTS.get("checkpoints", [])
    benchmark.extra_info.update(
        ratio_to_no_checkpoints=ratio,
        checkpoints=len(durations),
        checkpoint_p50_ms=_percentile(durations, 50),
        checkpoint_max_ms=max(durations, default=float("nan")),
    )
    SUMMARY.append(
        f"sliding window count (10 s every 2 s), {RECORDS:,} bids, p=2, checkpoints every 100 ms: "
        f"{RECORDS / best[0] / 1e6:.2f} M records/s, {ratio:.2f}x of the job without checkpoints "
        f"({RECORDS / best[1] / 1e6:.2f} M/s; target >= {CHECKPOINT_TARGET}x: "
        f"{'met' if ratio >= CHECKPOINT_TARGET else 'NOT MET'}, asserted >= {CHECKPOINT_GUARD}x"
        f"{', measured again' if again else ''}); "
        f"{len(durations)} checkpoints, p50 {_percentile(durations, 50):.0f} ms, "
        f"max {max(durations, default=float('nan')):.0f} ms"
    )
    assert ratio >= CHECKPOINT_GUARD, f"checkpoints of window contents cost {1 - ratio:.0%} of throughput"
