"""Joins of two streams: the interval join and the window join (PyFlink's names).

Skeleton: the builders exist so the job API's methods type-check; they are being
written (issue #20)."""

from __future__ import annotations

from typing import Any

__all__ = ["IntervalJoin", "JoinedStreams"]


class IntervalJoin:
    """``a.key_by(k).interval_join(b.key_by(k))``; ``.between(lower_ms, upper_ms)``."""

    def __init__(self, left: Any, right: Any) -> None:
        raise NotImplementedError("interval_join is not built yet")


class JoinedStreams:
    """``a.join(b)``; ``.where(k1).equal_to(k2).window(assigner).apply(fn)``."""

    def __init__(self, left: Any, right: Any) -> None:
        raise NotImplementedError("join is not built yet")
