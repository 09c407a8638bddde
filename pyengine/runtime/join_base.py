"""What the join operators share (``runtime.joins``, ``runtime.arrow_joins``): the
watermark and the count of late records in operator state, where a late record goes,
and the check of a record's key."""

from __future__ import annotations

from typing import Any, Optional, Tuple

from ..state import ListStateDescriptor
from .base import EventTimeOperatorMixin, OperatorContext
from .keyed import KeyedOperator, NaNKeyError

__all__ = ["LateCounting", "check_key"]

_LATE = ListStateDescriptor("join-late-records")  # [count]: split on rescaling, the sum stays


def check_key(op: Any, key: Any, record: Any) -> None:
    if key.__class__ is float and key != key:
        raise NaNKeyError(f"{op.where()}: the key of record {record!r} is NaN")


class LateCounting(EventTimeOperatorMixin, KeyedOperator):
    """Shared by the join operators: the watermark and the count of late records in
    operator state, and where a late record goes (a side output per input, or dropped)."""

    def __init__(self, uid: str, name: str, late_tags: Tuple[Optional[str], Optional[str]] = (None, None)) -> None:
        super().__init__(uid, name)
        self.late_tags = late_tags
        self._late: Any = None

    def setup(self, ctx: OperatorContext, restored: Any) -> None:
        super().setup(ctx, restored)
        self._restore_watermark(restored)
        assert self.operator_state is not None
        self._late = self.operator_state.get_list_state(_LATE)
        self.late_records_dropped = sum(int(v) for v in self._late.get()) if restored is not None else 0

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        self._save_watermark()
        self._late.update([self.late_records_dropped])
        return super().snapshot(checkpoint_id, location)

    def _late_record(self, side: int, records: Any, n: int) -> None:
        tag = self.late_tags[side]
        if tag is None:
            self.late_records_dropped += n
        elif self.side_output is not None:  # as Flink: to the side output, not counted as dropped
            self.side_output(tag, records)
