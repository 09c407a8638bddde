"""Replayable sources: each subtask reads its split and keeps its position in
operator state, so a restore rewinds exactly to the checkpoint."""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from ..state import ListStateDescriptor
from ..storage.metadata import OperatorState
from .operators import Operator, OperatorContext

__all__ = ["CollectionSource", "GeneratorSource", "Source", "SourceOperator"]

_POSITION = ListStateDescriptor("position")


class Source:
    """A bounded, replayable input: ``read(subtask, parallelism, position, n)`` gives
    up to ``n`` records from ``position`` of that subtask's split (fewer at its end)."""

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> List[Any]:
        raise NotImplementedError


class CollectionSource(Source):
    """A list: subtask ``i`` of ``p`` reads elements ``i, i+p, i+2p, ...``."""

    def __init__(self, records: Sequence[Any]) -> None:
        self.records = list(records)

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> List[Any]:
        start = subtask + position * parallelism
        return self.records[start : start + n * parallelism : parallelism]


class GeneratorSource(Source):
    """``count`` records ``fn(sequence_number)``, deterministic by construction."""

    def __init__(self, fn: Callable[[int], Any], count: int) -> None:
        self.fn = fn
        self.count = count

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> List[Any]:
        first = subtask + position * parallelism
        return [self.fn(i) for i in range(first, min(self.count, first + n * parallelism), parallelism)]


class SourceOperator(Operator):
    """The head of a source task: reads its split from its position."""

    def __init__(self, uid: str, name: str, source: Source) -> None:
        super().__init__(uid, name)
        self.source = source
        self.position = 0
        self.exhausted = False

    def setup(self, ctx: OperatorContext, restored: Optional[OperatorState]) -> None:
        super().setup(ctx, restored)
        assert self.operator_state is not None
        state = self.operator_state.get_union_list_state(_POSITION)
        if restored is not None:
            positions = {sub: (par, pos) for sub, par, pos in state.get()}
            if positions and any(par != ctx.parallelism for par, _ in positions.values()):
                old = next(iter(positions.values()))[0]
                raise ValueError(
                    f"source {self.name!r} was checkpointed at parallelism {old} and cannot resume at "
                    f"{ctx.parallelism}: its splits are by subtask"
                )
            self.position = positions.get(ctx.subtask, (ctx.parallelism, 0))[1]
        self._state = state

    def read(self, n: int) -> List[Any]:
        assert self.ctx is not None
        records = self._call(self.source.read, self.ctx.subtask, self.ctx.parallelism, self.position, n)
        self.position += len(records)
        if len(records) < n:
            self.exhausted = True
        return records  # type: ignore[no-any-return]

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        assert self.ctx is not None
        self._state.update([[self.ctx.subtask, self.ctx.parallelism, self.position]])
        return super().snapshot(checkpoint_id, location)
