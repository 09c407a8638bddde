"""Time domains and the processing-time clock."""

from __future__ import annotations

import enum
import time

from ..io.events import MAX_WATERMARK, MIN_WATERMARK

__all__ = ["MAX_WATERMARK", "MIN_WATERMARK", "TimeDomain", "now_ms"]


class TimeDomain(enum.Enum):
    """Which clock a timer ran on (PyFlink's ``TimeDomain``): ``ctx.time_domain()`` in ``on_timer``."""

    EVENT_TIME = 0
    PROCESSING_TIME = 1

    def __repr__(self) -> str:
        return f"TimeDomain.{self.name}"


def now_ms() -> int:
    """Processing time: wall-clock milliseconds since the epoch, as Flink's."""
    return time.time_ns() // 1_000_000
