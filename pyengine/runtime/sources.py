"""The source operator: the head of a source task, which reads a source's splits and
keeps each split's position in operator state, so a restore rewinds exactly to the
checkpoint. The sources themselves are connectors (``pyengine.connectors``)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..connectors.base import Source
from ..errors import NonRetryableError
from ..io.events import MIN_WATERMARK, WATERMARK_ACTIVE, WATERMARK_IDLE, Watermark
from ..state import ListStateDescriptor
from ..storage.metadata import OperatorState
from .base import Operator, OperatorContext, UserFunctionError, _mono_ms

__all__ = ["SourceOperator"]

log = logging.getLogger(__name__)

_POSITION = ListStateDescriptor("position")


class SourceOperator(Operator):
    """The head of a source task: reads its splits from their positions.

    A split is what subtask ``i`` of ``p`` read when the job first ran (``Source.read``
    with that ``i`` and ``p``); every split's position is in union list state, so a
    restore at another parallelism hands the splits round-robin to the new subtasks
    and each resumes exactly where its split stopped (as Flink's split enumerator
    reassigns splits).

    A split is read until it has nothing now, then the next one is tried; a split
    ends only when ``read`` returns ``None``. When no split has anything, ``read``
    waits ``idle_wait(seconds)`` before returning nothing: 1 ms, doubling up to
    20 ms while it stays idle, so a source that is polled gives its core to the
    other tasks instead of spinning. ``idle_wait`` is ``time.sleep`` unless the task
    gives a wait that also wakes for its mailbox.

    With a watermark strategy, each split has its own watermark generator (Flink's
    per-split watermarks): the subtask's watermark is the lowest of its splits that
    are neither ended nor idle, and the subtask is idle when all of them are. Each
    split's largest timestamp is checkpointed with its position, so a restored
    split's watermark starts where it was."""

    generates_watermarks = True

    MIN_IDLE_S = 0.001
    MAX_IDLE_S = 0.02
    WARN_IDLE_S = 60.0  # a source idle this long is told once how to end a split

    def __init__(self, uid: str, name: str, source: Source, strategy: Any = None) -> None:
        super().__init__(uid, name)
        self.source = source
        self.strategy = strategy
        self.timestamps = strategy.require_timestamps("watermark_strategy") if strategy is not None else None
        self.splits: List[List[int]] = []  # [index, count, position, done]
        self.exhausted = False
        self.idle_wait: Callable[[float], None] = time.sleep
        self._turn = 0  # which of the splits not yet done is read next
        self._idle_s = 0.0  # the current back-off; 0 while records come
        self._idle_since: Optional[float] = None
        self._warned = False
        self._generators: Dict[Tuple[int, int], Any] = {}  # per split (index, count)
        self._restored_max: Dict[Tuple[int, int], int] = {}
        self._sent = MIN_WATERMARK
        self._status_idle = False

    def setup(self, ctx: OperatorContext, restored: Optional[OperatorState]) -> None:
        super().setup(ctx, restored)
        assert self.operator_state is not None
        state = self.operator_state.get_union_list_state(_POSITION)
        if restored is None:
            self.splits = [[ctx.subtask, ctx.parallelism, 0, 0]]
        else:
            # [index, count, position, done, owner, owner_parallelism(, max timestamp)]
            entries = sorted(state.get(), key=lambda e: e[:6])
            same = all(e[5] == ctx.parallelism for e in entries)
            mine = [e for e in entries if e[4] == ctx.subtask] if same else entries[ctx.subtask :: ctx.parallelism]
            self.splits = [list(e[:4]) for e in mine]
            self._restored_max = {(e[0], e[1]): int(e[6]) for e in mine if len(e) > 6 and e[6] is not None}
        extra = {(e[0], e[1]): e[7] for e in mine if len(e) > 7} if restored is not None else {}
        for split in self.splits:
            self._call(self.source.restore_split_state, split[0], split[1], extra.get((split[0], split[1])))
        self.exhausted = all(split[3] for split in self.splits)
        self._state = state

    def open(self) -> None:
        if self.strategy is not None:
            now = _mono_ms()
            for split in self.splits:
                generator = self.strategy.create_generator(now)
                restored = self._restored_max.get((split[0], split[1]))
                if restored is not None:
                    generator.max_ts = max(generator.max_ts, restored)
                self._generators[(split[0], split[1])] = generator

    @property
    def position(self) -> int:
        """Records read so far, over this subtask's splits."""
        return sum(split[2] for split in self.splits)

    def read(self, n: int) -> Any:
        """Up to ``n`` records of the next split that has some; ``[]`` when none has
        any now (after the idle wait) or every split has ended (``exhausted``)."""
        assert self.ctx is not None
        tried = 0
        while True:
            live = [split for split in self.splits if not split[3]]
            if not live:
                self.exhausted = True
                return []
            if tried >= len(live):
                break
            split = live[self._turn % len(live)]
            records = self._call(self.source.read, split[0], split[1], split[2], n)
            if records is None:
                split[3] = 1  # the next split not done now has this turn
                continue
            if not hasattr(records, "__len__"):
                raise UserFunctionError(
                    f"{self.where()}: Source.read must return a list, a pyarrow.RecordBatch or None (end of split), "
                    f"got {type(records).__name__}"
                )
            if len(records):
                split[2] += len(records)
                self._idle_s, self._idle_since = 0.0, None
                if self.timestamps is not None:
                    self._observe(split, records)
                return records
            self._turn += 1
            tried += 1
        self._idle()
        return []

    def _observe(self, split: List[int], records: Any) -> None:
        try:
            ts = self.timestamps.of_buffer(records)  # type: ignore[union-attr]
        except NonRetryableError as exc:
            raise type(exc)(f"{self.where()}: {exc}") from None
        self._generators[(split[0], split[1])].on_timestamps(ts, _mono_ms())

    def poll_watermark(self, now_mono_ms: int) -> List[Any]:
        """The subtask's watermark over its live splits (see the class docstring)."""
        if self.strategy is None or self.exhausted:
            return []
        active = []
        for split in self.splits:
            if not split[3]:
                generator = self._generators[(split[0], split[1])]
                if not generator.check_idle(now_mono_ms):
                    active.append(generator.current)
        if not active:
            if self._status_idle:
                return []
            self._status_idle = True
            return [WATERMARK_IDLE]
        out: List[Any] = []
        if self._status_idle:
            self._status_idle = False
            out.append(WATERMARK_ACTIVE)
        watermark = min(active)
        if watermark > self._sent:
            self._sent = watermark
            out.append(Watermark(watermark))
        return out

    def _idle(self) -> None:
        """No split has records now: wait, longer while it lasts (see the class docstring)."""
        now = time.monotonic()
        if self._idle_since is None:
            self._idle_since = now
        elif not self._warned and now - self._idle_since >= self.WARN_IDLE_S:
            self._warned = True
            log.warning(
                "%s: source %s has returned no records for %.0f s; if its split has ended, read must return "
                "None (an empty read means 'nothing now' and is polled again)",
                self.where(),
                type(self.source).__name__,
                now - self._idle_since,
            )
        self._idle_s = min(self.MAX_IDLE_S, max(self.MIN_IDLE_S, self._idle_s * 2))
        self.idle_wait(self._idle_s)

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        assert self.ctx is not None
        me, p = self.ctx.subtask, self.ctx.parallelism
        entries = []
        for split in self.splits:
            generator = self._generators.get((split[0], split[1]))
            extra = self._call(self.source.split_state, split[0], split[1])
            if generator is not None or extra is not None:  # else the six fields older checkpoints have
                entries.append([*split, me, p, generator.max_ts if generator is not None else None, extra])
            else:
                entries.append([*split, me, p])
        self._state.update(entries)
        return super().snapshot(checkpoint_id, location)
