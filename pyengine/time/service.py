"""``ctx.timer_service()``: what a ``KeyedProcessFunction`` sees of its timers."""

from __future__ import annotations

from typing import Any, Callable

from .domain import now_ms

__all__ = ["TimerService"]


class TimerService:
    """Timers of the current key (PyFlink's ``TimerService``): register or delete one
    at a timestamp in event time or processing time, and read both clocks.

    A timer is per key and timestamp: registering the same one twice fires it once.
    An event-time timer fires (``on_timer``) once the watermark reaches its
    timestamp, before the watermark goes on downstream; a processing-time timer once
    the wall clock does, from the task's mailbox, between buffers. Timers are keyed
    state: checkpointed, restored and rescaled with it.

    The four timer methods are the timer queues' own, bound when the service is made:
    a job that sets a timer per record pays no call through this class."""

    __slots__ = (
        "_service",
        "delete_event_time_timer",
        "delete_processing_time_timer",
        "register_event_time_timer",
        "register_processing_time_timer",
    )

    register_event_time_timer: Callable[[int], None]
    """Calls ``on_timer(timestamp, ctx)`` for the current key when the watermark
    reaches ``timestamp`` (at the next watermark if it already has)."""
    register_processing_time_timer: Callable[[int], None]
    """Calls ``on_timer`` for the current key once the wall clock (ms since the epoch,
    ``current_processing_time()``) reaches ``timestamp``."""
    delete_event_time_timer: Callable[[int], Any]
    delete_processing_time_timer: Callable[[int], Any]

    def __init__(self, service: Any) -> None:
        self._service = service
        self.register_event_time_timer = service.event.register
        self.register_processing_time_timer = service.processing.register
        self.delete_event_time_timer = service.event.delete
        self.delete_processing_time_timer = service.processing.delete

    def current_watermark(self) -> int:
        """The operator's event time: ``-2**63`` before the first watermark."""
        return int(self._service.current_watermark)

    def current_processing_time(self) -> int:
        return now_ms()

    def __repr__(self) -> str:
        return f"<TimerService watermark={self.current_watermark()}>"
