"""The hot path's public face: channel events and the checkpointed input gate."""

from __future__ import annotations

from .errors import ChannelClosedError, ChannelIndexError, CorruptStreamError, GateError
from .events import (
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointFailureReason,
    CheckpointMetrics,
    CheckpointOptions,
    CheckpointType,
    EndOfPartition,
    Watermark,
    WatermarkStatus,
)
from .gate import CheckpointedInputGate
from .reference import ReferenceCheckpointedInputGate

__all__ = [
    "CancelCheckpointMarker",
    "ChannelClosedError",
    "ChannelIndexError",
    "CheckpointBarrier",
    "CheckpointFailureReason",
    "CheckpointMetrics",
    "CheckpointOptions",
    "CheckpointType",
    "CheckpointedInputGate",
    "CorruptStreamError",
    "EndOfPartition",
    "GateError",
    "ReferenceCheckpointedInputGate",
    "Watermark",
    "WatermarkStatus",
]
