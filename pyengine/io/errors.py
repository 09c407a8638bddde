"""Errors raised by the input gate.

Each also derives from the builtin a caller would naturally catch, so
``except IndexError`` / ``except ValueError`` / ``except RuntimeError`` work.
"""

from __future__ import annotations

__all__ = ["ChannelClosedError", "ChannelIndexError", "CorruptStreamError", "GateError"]


class GateError(Exception):
    """Base class of the gate's own errors."""


class ChannelIndexError(GateError, IndexError, ValueError):
    """A channel index outside ``0 .. num_channels - 1``."""


class ChannelClosedError(GateError, ValueError, RuntimeError):
    """Something was pushed to a channel after its ``EndOfPartition``."""


class CorruptStreamError(GateError, RuntimeError):
    """The events on a channel cannot have come from a correct producer
    (for example the same checkpoint's barrier twice on one channel)."""
