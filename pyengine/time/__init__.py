"""Event time: watermark strategies, the watermark valve, the timer service.

``pe.WatermarkStrategy`` says where a record's event time is and how watermarks
follow it; ``StatusWatermarkValve`` combines a subtask's input channels; timers
(``ctx.timer_service()`` in a ``KeyedProcessFunction``) are keyed state, kept in
``pyengine.state.timers``. See DESIGN.md, "Event time"."""

from __future__ import annotations

from .domain import MAX_WATERMARK, MIN_WATERMARK, TimeDomain, now_ms
from .service import TimerService
from .strategy import TimestampAssigner, TimestampError, WatermarkGenerator, WatermarkStrategy
from .valve import StatusWatermarkValve

__all__ = [
    "MAX_WATERMARK",
    "MIN_WATERMARK",
    "StatusWatermarkValve",
    "TimeDomain",
    "TimerService",
    "TimestampAssigner",
    "TimestampError",
    "WatermarkGenerator",
    "WatermarkStrategy",
    "now_ms",
]
