"""``SinkOperator``: the operator at the end of a chain that hands records to a
``Sink`` (``pyengine.connectors.base``): staged per checkpoint, committed when the
checkpoint completes (two-phase commit), or at the end of input without checkpoints."""

from __future__ import annotations

from typing import Any, List

from ..connectors.base import FINAL, Sink
from .base import Operator
from .outputs import _combined

__all__ = ["SinkOperator"]


class SinkOperator(Operator):
    """Stages records per checkpoint; commits on completion (two-phase commit)."""

    def __init__(self, uid: str, name: str, sink: Sink, checkpointing: bool) -> None:
        super().__init__(uid, name)
        self.sink = sink
        self.checkpointing = checkpointing
        self._buffer: List[Any] = []

    def open(self) -> None:
        assert self.ctx is not None
        self._call(self.sink.open, self.ctx.subtask)

    def process(self, records: Any) -> List[Any]:
        if self.sink.transactional:
            self._buffer.append(records)
        else:
            assert self.ctx is not None
            self._call(self.sink.stage, self.ctx.subtask, 0, _combined([records]))
        return []

    def prepare_snapshot_pre_barrier(self, checkpoint_id: int) -> List[Any]:
        assert self.ctx is not None
        if self._buffer:
            pieces, self._buffer = self._buffer, []
            self._call(self.sink.stage, self.ctx.subtask, checkpoint_id, _combined(pieces))
        return []

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        assert self.ctx is not None
        self._call(self.sink.commit, self.ctx.subtask, checkpoint_id)

    def end_input(self) -> List[Any]:
        if not self.checkpointing:  # without checkpoints, the end of input is the only commit point
            self.prepare_snapshot_pre_barrier(FINAL)
            assert self.ctx is not None
            self._call(self.sink.commit, self.ctx.subtask, FINAL)
        return []
