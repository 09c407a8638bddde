"""Configuration and listener validation shared by the native and reference gates.

Both implementations take an already validated GateConfig and bound Callbacks,
so they cannot disagree about what is accepted or about the wording of errors.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .errors import ChannelIndexError

__all__ = [
    "DEFAULT_CAPACITY",
    "EVENT_RESERVE",
    "MAX_CAPACITY",
    "MAX_CHANNELS",
    "Callbacks",
    "GateConfig",
    "check_channel",
    "item_nbytes",
]

MAX_CHANNELS = 65536
DEFAULT_CAPACITY = 64
MAX_CAPACITY = 1 << 20
# Events may use this many slots beyond a channel's data capacity, so a barrier
# or end-of-partition is never stuck behind a full channel (backpressure must
# not delay an unaligned checkpoint, which exists precisely to overtake it).
EVENT_RESERVE = 4

MODES = ("exactly_once", "at_least_once")


@dataclass(frozen=True)
class GateConfig:
    num_channels: int
    mode: str
    unaligned: bool
    aligned_timeout_ns: int
    capacity: int
    clock: Optional[Callable[[], int]]

    @property
    def exactly_once(self) -> bool:
        return self.mode == "exactly_once"

    @property
    def event_limit(self) -> int:
        """How many items a channel may hold when the next one is an event."""
        return self.capacity + EVENT_RESERVE

    @classmethod
    def create(
        cls,
        num_channels: Any,
        *,
        mode: Any,
        unaligned: Any,
        aligned_timeout_ms: Any,
        capacity: Any,
        clock: Any,
    ) -> GateConfig:
        if type(num_channels) is bool or not isinstance(num_channels, int):
            raise TypeError(f"num_channels must be an int, got {num_channels!r}")
        if not 1 <= num_channels <= MAX_CHANNELS:
            raise ValueError(f"num_channels must be between 1 and {MAX_CHANNELS}, got {num_channels}")
        if mode not in MODES:
            raise ValueError(f"mode must be 'exactly_once' or 'at_least_once', got {mode!r}")
        if not isinstance(unaligned, bool):
            raise TypeError(f"unaligned must be a bool, got {unaligned!r}")
        if unaligned and mode == "at_least_once":
            raise ValueError(
                "unaligned=True needs mode='exactly_once': at-least-once never aligns, "
                "so there is nothing for unaligned checkpoints to skip"
            )
        if type(aligned_timeout_ms) is bool or not isinstance(aligned_timeout_ms, (int, float)):
            raise TypeError(f"aligned_timeout_ms must be a number, got {aligned_timeout_ms!r}")
        if aligned_timeout_ms < 0:
            raise ValueError(f"aligned_timeout_ms must be >= 0, got {aligned_timeout_ms}")
        if aligned_timeout_ms > 0 and not unaligned:
            raise ValueError(
                f"aligned_timeout_ms={aligned_timeout_ms} needs unaligned=True: the timeout is "
                "when an aligned checkpoint switches to unaligned"
            )
        if type(capacity) is bool or not isinstance(capacity, int):
            raise TypeError(f"capacity must be an int, got {capacity!r}")
        if not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"capacity must be between 1 and {MAX_CAPACITY}, got {capacity}")
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning nanoseconds, got {clock!r}")
        return cls(
            num_channels=num_channels,
            mode=mode,
            unaligned=unaligned,
            aligned_timeout_ns=int(aligned_timeout_ms * 1_000_000),
            capacity=capacity,
            clock=clock,
        )


@dataclass(frozen=True)
class Callbacks:
    """The listener's methods, looked up once instead of on every event."""

    trigger: Callable[[Any, Any], Any]
    abort: Callable[[int, Any], Any]
    add_input_data: Optional[Callable[[int, int, Any], Any]]
    finish_input: Optional[Callable[[int], Any]]

    @classmethod
    def bind(cls, listener: Any) -> Callbacks:
        missing = [
            name
            for name in ("trigger_checkpoint_on_barrier", "abort_checkpoint_on_barrier")
            if not callable(getattr(listener, name, None))
        ]
        if missing:
            raise TypeError(
                f"listener {listener!r} must have trigger_checkpoint_on_barrier(barrier, metrics) "
                f"and abort_checkpoint_on_barrier(checkpoint_id, reason); missing: {', '.join(missing)}"
            )
        # The channel-state writer is the listener itself or its channel_state_writer attribute.
        writer = listener
        if not callable(getattr(writer, "add_input_data", None)):
            writer = getattr(listener, "channel_state_writer", None)
        add = getattr(writer, "add_input_data", None) if writer is not None else None
        finish = getattr(writer, "finish_input", None) if writer is not None else None
        return cls(
            trigger=listener.trigger_checkpoint_on_barrier,
            abort=listener.abort_checkpoint_on_barrier,
            add_input_data=add if callable(add) else None,
            finish_input=finish if callable(finish) else None,
        )


def check_channel(channel: Any, num_channels: int) -> int:
    try:
        ch = operator.index(channel)
    except TypeError:
        raise TypeError(f"channel must be an int, got {channel!r}") from None
    if not 0 <= ch < num_channels:
        raise ChannelIndexError(
            f"channel {ch} is out of range for a gate of {num_channels} channels (0..{num_channels - 1})"
        )
    return ch


def item_nbytes(item: Any) -> int:
    """Size of a buffer for alignment metrics: ``len`` of bytes-like items,
    else an integer ``nbytes`` attribute (Arrow batches, NumPy arrays), else 0."""
    t = type(item)
    if t is bytes or t is bytearray:
        return len(item)
    nbytes = getattr(item, "nbytes", None)
    return nbytes if type(nbytes) is int else 0


def default_mono_ns() -> int:
    return time.monotonic_ns()


def default_wall_ns() -> int:
    return time.time_ns()
