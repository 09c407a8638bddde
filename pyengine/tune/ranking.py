"""How measurements are ordered for a goal under constraints: shared by the search and
the report (which lists the settings in the same order)."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from .measure import Measurement

__all__ = ["rank"]


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


def rank(
    measurements: Sequence[Measurement],
    goal: str,
    max_latency_ms: Optional[float] = None,
    max_recovery_s: Optional[float] = None,
) -> List[Measurement]:
    """Best first: the measurements inside the constraints by the goal, then the others
    by how far outside they are."""

    def key(m: Measurement) -> Tuple[float, float]:
        v = _violations(m, max_latency_ms, max_recovery_s)
        return (0.0, -_score(m, goal)) if v == 0 else (1.0 + v, -_score(m, goal))

    return sorted(measurements, key=key)
