"""The native gate, bound to this package's event and error classes.

``gate`` imports this module and registers the class as a ``CheckpointedInputGate``;
this module imports nothing above it (no import cycle)."""

from __future__ import annotations

from .. import _native
from ._config import Callbacks, GateConfig, item_nbytes
from .errors import ChannelClosedError, ChannelIndexError, CorruptStreamError
from .events import (
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointFailureReason,
    CheckpointMetrics,
    CheckpointType,
    EndOfPartition,
)

__all__ = ["NativeCheckpointedInputGate"]

_native.bind(
    CheckpointBarrier,
    CancelCheckpointMarker,
    EndOfPartition,
    CheckpointMetrics,
    CheckpointType.CHECKPOINT,
    CheckpointFailureReason.CHECKPOINT_DECLINED_SUBSUMED,
    CheckpointFailureReason.CHECKPOINT_DECLINED_ON_CANCELLATION_BARRIER,
    CheckpointFailureReason.CHECKPOINT_DECLINED_INPUT_END_OF_STREAM,
    ChannelIndexError,
    ChannelClosedError,
    CorruptStreamError,
    item_nbytes,
)


class NativeCheckpointedInputGate(_native.InputGate):
    """The C/Cython gate; see ``CheckpointedInputGate`` for the interface."""

    # ``capacity`` (buffers per channel) is read by a producer that limits how many it
    # keeps queued (adaptive buffers, pyengine.runtime.debloat); a slot on this Python
    # subclass, so push and poll stay the C type's own methods.
    __slots__ = ("capacity",)

    def __init__(self, config: GateConfig, callbacks: Callbacks) -> None:
        self.capacity = config.capacity

    def __repr__(self) -> str:
        return (
            f"<NativeCheckpointedInputGate channels={self.num_channels} "
            f"latest_checkpoint={self.latest_checkpoint_id} blocked={len(self.blocked_channels)}>"
        )
