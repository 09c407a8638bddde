"""How measurements are ordered for a goal under constraints, and which of them can be
recommended: shared by the search and the report (which lists the settings in the same
order and draws the same frontier), so the recommendation never contradicts the chart.

A setting is represented by its latest measurement (the search measures a setting again
on longer runs as it goes, and the finalists last, so the latest is the longest and the one
the report shows). A setting can be recommended when its checkpoints did not run back to
back (``back_to_back``: the report would warn about its interval) and it lies on the
throughput/latency frontier of those settings (no other of them has higher throughput and
lower p99 at once); among those, the constraints first, then the goal, decide."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

from .measure import Measurement

__all__ = ["back_to_back", "candidates", "dominates", "frontier", "latest", "rank"]


def _violations(m: Measurement, max_latency_ms: Optional[float], max_recovery_s: Optional[float]) -> float:
    """How far a measurement is outside the constraints (0: inside), relative to each."""
    excess = 0.0
    if max_latency_ms is not None:
        p99 = m.latency_p99_ms
        excess += 1.0 if math.isnan(p99) else max(0.0, p99 / max_latency_ms - 1)
    if max_recovery_s is not None:
        r = m.recovery_s
        excess += 1.0 if math.isnan(r) else max(0.0, r / max_recovery_s - 1)
    return excess


def _score(m: Measurement, goal: str) -> float:
    if goal == "throughput":
        return m.throughput
    return -m.latency_p99_ms if not math.isnan(m.latency_p99_ms) else -math.inf


def _p99(m: Measurement) -> float:
    """p99 latency for comparisons: a run that measured none is worse than any that did."""
    return math.inf if math.isnan(m.latency_p99_ms) else m.latency_p99_ms


def rank(
    measurements: Sequence[Measurement],
    goal: str,
    max_latency_ms: Optional[float] = None,
    max_recovery_s: Optional[float] = None,
) -> List[Measurement]:
    """Best first: the measurements inside the constraints by the goal, then the others
    by how far outside they are. A tie on the goal goes to the better other axis (higher
    throughput, lower p99), so the first of a tie is not beaten on both axes by the second."""

    def key(m: Measurement) -> Tuple[float, float, float]:
        v = _violations(m, max_latency_ms, max_recovery_s)
        other = _p99(m) if goal == "throughput" else -m.throughput
        return (0.0 if v == 0 else 1.0 + v, -_score(m, goal), other)

    return sorted(measurements, key=key)


def latest(measurements: Sequence[Measurement]) -> List[Measurement]:
    """Each setting's latest measurement, in the order the settings were first measured."""
    out: Dict[object, Measurement] = {}
    for m in measurements:
        out[m.setting] = m
    return list(out.values())


def back_to_back(m: Measurement) -> bool:
    """Whether this run's checkpoints ran back to back: their p50 over twice the interval,
    one starting as the last ended. The job may sustain it, but spends its time on it; an
    interval like that is warned about and never recommended."""
    return bool(m.checkpoints) and m.interval_ms > 0 and m.checkpoint_p50_ms > 2 * m.interval_ms


def dominates(a: Measurement, b: Measurement) -> bool:
    """Whether ``a`` beats ``b`` on both axes: throughput higher and p99 latency lower
    (or one equal and the other strictly better)."""
    at, bt, al, bl = a.throughput, b.throughput, _p99(a), _p99(b)
    return at >= bt and al <= bl and (at > bt or al < bl)


def frontier(measurements: Sequence[Measurement]) -> List[Measurement]:
    """The measurements no other of them dominates (``dominates``), in the given order."""
    return [m for m in measurements if not any(dominates(o, m) for o in measurements if o is not m)]


def candidates(
    measurements: Sequence[Measurement],
    max_latency_ms: Optional[float] = None,
    max_recovery_s: Optional[float] = None,
) -> List[Measurement]:
    """The measurements the recommendation is chosen among, and whose frontier the report
    draws: the settings (latest measurement each) whose checkpoints did not run back to
    back, and of those the ones inside the constraints when any is (when none is, all of
    them: the closest is recommended, and said to miss). Empty when every setting ran its
    checkpoints back to back."""
    eligible = [m for m in latest(measurements) if not back_to_back(m)]
    inside = [m for m in eligible if _violations(m, max_latency_ms, max_recovery_s) == 0]
    return inside or eligible
