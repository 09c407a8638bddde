"""``ctx.timer_service()``: what a ``KeyedProcessFunction`` sees of its timers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import _native
from .domain import now_ms

__all__ = ["TimerService"]


class TimerService(_native.TimerServiceCalls):
    """Timers of the current key (PyFlink's ``TimerService``): register or delete one
    at a timestamp in event time or processing time, and read both clocks.

    A timer is per key and timestamp: registering the same one twice fires it once.
    An event-time timer fires (``on_timer``) once the watermark reaches its
    timestamp, before the watermark goes on downstream; a processing-time timer once
    the wall clock does, from the task's mailbox, between buffers. Timers are keyed
    state: checkpointed, restored and rescaled with it.

    The four timer methods are C methods (``_native.TimerServiceCalls``) that go
    straight to the timer queues: a job that sets a timer per record pays a C call
    whose lookup the interpreter specialises, and no Python frame."""

    __slots__ = ("_service",)

    def __init__(self, service: Any) -> None:
        super().__init__(
            service.event.register, service.processing.register, service.event.delete, service.processing.delete
        )
        self._service = service

    if TYPE_CHECKING:  # the methods are TimerServiceCalls' (C); their types and docs, for IDEs

        def register_event_time_timer(self, ts: int) -> None:
            """Calls ``on_timer(timestamp, ctx)`` for the current key when the watermark
            reaches ``ts`` (at the next watermark if it already has)."""

        def register_processing_time_timer(self, ts: int) -> None:
            """Calls ``on_timer`` for the current key once the wall clock (ms since the
            epoch, ``current_processing_time()``) reaches ``ts``."""

        def delete_event_time_timer(self, ts: int) -> Any:
            """The current key's event-time timer at ``ts`` does not fire (nothing when
            there is none)."""

        def delete_processing_time_timer(self, ts: int) -> Any:
            """The current key's processing-time timer at ``ts`` does not fire (nothing
            when there is none)."""

    def current_watermark(self) -> int:
        """The operator's event time: ``-2**63`` before the first watermark."""
        return int(self._service.current_watermark)

    def current_processing_time(self) -> int:
        return now_ms()

    def __repr__(self) -> str:
        return f"<TimerService watermark={self.current_watermark()}>"
