"""Flink's ``StatusWatermarkValve``: a subtask's watermark from its input channels'.

Each channel has its last watermark, a status (active or idle) and whether it is
*aligned*: active, and at or past what the valve last put out. The valve's
watermark is the minimum over aligned channels; it only ever advances, and it is
put out when it does. An idle channel is left out, so one input with nothing to
say does not hold the others back; when it turns active again it counts once its
watermark has caught up. When every channel is idle the valve is idle too, and
first flushes the largest watermark any channel reached (later Flink's rule: with
no active input, nothing can arrive below it)."""

from __future__ import annotations

from typing import List, Optional, Tuple

from ..io.events import MAX_WATERMARK, MIN_WATERMARK

__all__ = ["StatusWatermarkValve"]


class StatusWatermarkValve:
    """The watermark of ``num_channels`` inputs; see the module docstring.

    ``input_watermark`` and ``input_status`` return what the valve puts out as a
    result: ``(watermark or None, status or None)``, status True for idle, False
    for active again. ``initial`` is where the output starts (a restored
    operator's watermark): nothing at or below it is put out."""

    __slots__ = ("aligned", "idle", "last_idle", "last_output", "watermarks")

    def __init__(self, num_channels: int, initial: int = MIN_WATERMARK) -> None:
        if num_channels < 1:
            raise ValueError(f"a valve needs at least one channel, got {num_channels}")
        self.watermarks: List[int] = [MIN_WATERMARK] * num_channels
        self.idle: List[bool] = [False] * num_channels
        self.aligned: List[bool] = [True] * num_channels
        self.last_output = initial
        self.last_idle = False

    def input_watermark(self, watermark: int, channel: int) -> Optional[int]:
        """A watermark from ``channel``: the new output watermark, if it advanced."""
        if self.last_idle or self.idle[channel] or watermark <= self.watermarks[channel]:
            return None  # an idle channel's (or valve's) watermarks wait for it to turn active
        self.watermarks[channel] = watermark
        if not self.aligned[channel] and watermark >= self.last_output:
            self.aligned[channel] = True
        return self._advance()

    def end_channel(self, channel: int) -> Optional[int]:
        """``channel`` has ended: it can hold nothing back any more (its producer sends
        the maximum watermark first; this is for one that did not)."""
        self.idle[channel] = False
        self.aligned[channel] = True
        self.watermarks[channel] = MAX_WATERMARK
        if self.last_idle:
            self.last_idle = False
        return self._advance()

    def input_status(self, idle: bool, channel: int) -> Tuple[Optional[int], Optional[bool]]:
        """``channel`` turned idle (True) or active (False)."""
        if idle and not self.idle[channel]:
            self.idle[channel] = True
            self.aligned[channel] = False
            if all(self.idle):
                flushed = self._flush_max()
                self.last_idle = True
                return flushed, True
            if self.watermarks[channel] == self.last_output:
                return self._advance(), None
            return None, None
        if not idle and self.idle[channel]:
            self.idle[channel] = False
            if self.watermarks[channel] >= self.last_output:
                self.aligned[channel] = True
            if self.last_idle:
                self.last_idle = False
                return None, False
        return None, None

    def _advance(self) -> Optional[int]:
        low = MAX_WATERMARK + 1
        for w, a in zip(self.watermarks, self.aligned, strict=True):
            if a and w < low:
                low = w
        if low <= MAX_WATERMARK and low > self.last_output:
            self.last_output = low
            return low
        return None

    def _flush_max(self) -> Optional[int]:
        high = max(self.watermarks)
        if high > self.last_output:
            self.last_output = high
            return high
        return None
