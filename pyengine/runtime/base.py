"""The operator base: what a task runs on each buffer, and the state each one owns.

An operator takes a buffer (a list of records) and returns the records it
produces; it snapshots in two parts (a synchronous freeze returning the
asynchronous writer), and hears about completed checkpoints. Chained operators
of a task call each other through plain lists: no queue, no copy. Here: the
``Operator`` base and its context, side-output tags, the event-time mixin that
keeps a watermark in operator state, and the buffer helpers every operator uses."""

from __future__ import annotations

import logging
from typing import Any, Callable, FrozenSet, List, Optional, Set

import pyarrow as pa

from ..errors import NonRetryableError
from ..io.events import MIN_WATERMARK
from ..state import ListStateDescriptor, OperatorStateBackend, key_group_range_for_subtask
from ..state.serializers import unviewed
from ..storage.filesystem import CheckpointStorageLocation
from ..storage.metadata import OperatorState, SubtaskState

log = logging.getLogger("pyengine.runtime.operators")  # the logger name users configure; kept across the split


class UserFunctionError(RuntimeError):
    """A user function raised: says which operator and subtask."""


class OutputTag:
    """Names a side output (PyFlink's ``OutputTag``): a function sends a record to it
    with ``ctx.output(tag, value)``, and ``stream.get_side_output(tag)`` is the stream
    of those records. ``type_hint`` is documentation only for now (records are not
    converted). Two tags with the same name are the same side output."""

    __slots__ = ("name", "type_hint")

    def __init__(self, name: str, type_hint: Any = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"OutputTag needs a non-empty name, got {name!r}")
        self.name = name
        self.type_hint = type_hint

    def __eq__(self, other: object) -> bool:
        return isinstance(other, OutputTag) and other.name == self.name

    def __hash__(self) -> int:
        return hash(("OutputTag", self.name))

    def __repr__(self) -> str:
        return f"OutputTag({self.name!r})"


class _NotATag(NonRetryableError, TypeError):
    """``ctx.output`` given something other than a ``pe.OutputTag``."""


class OperatorContext:
    """What an operator knows about where it runs."""

    def __init__(
        self,
        *,
        job_name: str,
        subtask: int,
        parallelism: int,
        max_parallelism: int,
        state_backend: str,
        local_recovery_dir: Optional[str],
        attempt: int,
    ) -> None:
        self.job_name = job_name
        self.subtask = subtask
        self.parallelism = parallelism
        self.max_parallelism = max_parallelism
        self.state_backend = state_backend
        self.local_recovery_dir = local_recovery_dir
        self.attempt = attempt


class Operator:
    """Base: stateless, passes records through.

    Event time: ``process_watermark`` hears each advance of the watermark (after
    every record before it) and returns what it emits because of it (fired timers,
    windows); the task sends the watermark on after that. ``next_processing_time``
    / ``on_processing_time`` are the same for processing-time timers, called from
    the task's mailbox. An operator that makes watermarks of its own
    (``generates_watermarks``) stops the ones from upstream, and the task asks it
    for its own with ``poll_watermark``."""

    generates_watermarks = False
    # Set by the task on the last operator of its chain when a side output of it is
    # consumed: ``side_output(tag_name, records)`` sends them on (else they are dropped,
    # as Flink drops a side output nobody asked for).
    side_output: Optional[Callable[[str, Any], None]] = None
    side_tags: FrozenSet[str] = frozenset()  # the names of those consumed side outputs

    def __init__(self, uid: str, name: str) -> None:
        self.uid = uid
        self.name = name
        self.ctx: Optional[OperatorContext] = None
        self.operator_state: Optional[OperatorStateBackend] = None
        self.current_watermark = MIN_WATERMARK
        self.late_records_dropped = 0

    def where(self) -> str:
        """How errors name this operator: its name, the uid a user gave it when that is
        another (a name left to pyengine, such as '2-process', says little), the subtask."""
        about = [f"uid {self.uid!r}"] if self.uid != self.name else []
        if self.ctx is not None:
            about.append(f"subtask {self.ctx.subtask}")
        return f"operator {self.name!r}" + (f" ({', '.join(about)})" if about else "")

    def emit_side(self, tag: OutputTag, value: Any) -> None:
        """One record to the side output ``tag`` (``ctx.output``). A tag no stream reads
        drops its records, as in Flink, but says so once (a misspelt tag's name would
        otherwise lose them unnoticed)."""
        if not isinstance(tag, OutputTag):  # refused whether or not a side output is read; no restart fixes it
            raise _NotATag(
                f"{self.where()}: ctx.output takes a pe.OutputTag, got {tag!r}: make one with pe.OutputTag('name')"
            )
        name = tag.name
        send = self.side_output
        if send is not None and name in self.side_tags:
            send(name, [value])
        else:
            self._unread_side_output(name)

    _unread_tags: Optional[Set[str]] = None  # the unread tags warned about (made on the first)

    def _unread_side_output(self, name: str) -> None:
        warned = self._unread_tags
        if warned is None:
            warned = self._unread_tags = set()
        if name not in warned:
            warned.add(name)
            log.warning(
                "%s: ctx.output(OutputTag(%r), ...): no stream of the job reads that side output "
                "(stream.get_side_output(tag)), so its records are dropped; is the tag's name right?",
                self.where(),
                name,
            )

    def process2(self, records: Any) -> List[Any]:
        """A buffer of the second input (two-input operators: ``connect``)."""
        raise NotImplementedError(f"{self.where()} has one input")

    def setup(self, ctx: OperatorContext, restored: Optional[OperatorState]) -> None:
        self.ctx = ctx
        self.operator_state = OperatorStateBackend(subtask_index=ctx.subtask, parallelism=ctx.parallelism)
        if restored is not None:
            self.operator_state.restore(restored.operator_handles())

    def open(self) -> None:
        pass

    def process(self, records: List[Any]) -> List[Any]:
        return records

    def end_input(self) -> List[Any]:
        """Records produced at the end of bounded input."""
        return []

    def prepare_snapshot_pre_barrier(self, checkpoint_id: int) -> List[Any]:
        """Records to emit before the barrier goes downstream."""
        return []

    def process_watermark(self, watermark: int) -> List[Any]:
        """The watermark advanced to ``watermark``: records to emit before it goes on."""
        if watermark > self.current_watermark:
            self.current_watermark = watermark
        return []

    def poll_watermark(self, now_mono_ms: int) -> List[Any]:
        """Operators that generate watermarks: the ``Watermark`` / ``WatermarkStatus``
        events to send on now (asked every ``auto_watermark_interval_ms``)."""
        return []

    def next_processing_time(self) -> Optional[int]:
        """When the earliest processing-time timer is due (ms since the epoch), or None."""
        return None

    def on_processing_time(self, now_ms: int) -> List[Any]:
        """Fires the processing-time timers due at ``now_ms``; returns what they emit."""
        return []

    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation) -> Callable[[], SubtaskState]:
        """The synchronous part; returns the asynchronous part."""
        op_snapshot = self.operator_state.snapshot(checkpoint_id, location) if self.operator_state else None

        def write() -> SubtaskState:
            handles = op_snapshot.run().handles if op_snapshot is not None else []
            return SubtaskState(operator=list(handles))

        return write

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        pass

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        pass

    def close(self) -> None:
        pass

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc


_WATERMARK_STATE = ListStateDescriptor("_watermark")


class EventTimeOperatorMixin:
    """A time-aware operator keeps its watermark in operator state, so a restored
    one goes on from where its checkpoint was: nothing it had already closed (a
    window, a timer) opens again for a record that was late then. At another
    parallelism a subtask takes the lowest watermark of the old subtasks whose key
    groups it now has (never later than any of them was)."""

    operator_state: Optional[OperatorStateBackend]
    ctx: Optional[OperatorContext]
    current_watermark: int

    def _restore_watermark(self, restored: Any) -> None:
        assert self.operator_state is not None and self.ctx is not None
        state = self.operator_state.get_union_list_state(_WATERMARK_STATE)
        if restored is None:
            return
        mine = key_group_range_for_subtask(self.ctx.max_parallelism, self.ctx.parallelism, self.ctx.subtask)
        marks = [int(e[2]) for e in state.get() if int(e[0]) <= mine.end and int(e[1]) >= mine.start]
        if marks:
            self.current_watermark = min(marks)

    def _save_watermark(self) -> None:
        assert self.operator_state is not None and self.ctx is not None
        mine = key_group_range_for_subtask(self.ctx.max_parallelism, self.ctx.parallelism, self.ctx.subtask)
        state = self.operator_state.get_union_list_state(_WATERMARK_STATE)
        state.update([[mine.start, mine.end, int(self.current_watermark)]])


def _mono_ms() -> int:
    import time

    return time.monotonic_ns() // 1_000_000


def rows_of(records: Any) -> List[Any]:
    """A buffer as a list of records: an Arrow batch becomes dicts (one per row)."""
    if isinstance(records, (pa.RecordBatch, pa.Table)):
        return records.to_pylist()  # type: ignore[no-any-return]
    return records  # type: ignore[no-any-return]


def batch_of(records: Any) -> pa.RecordBatch:
    """A buffer as an Arrow batch: records must be dicts (columns by key)."""
    if isinstance(records, pa.RecordBatch):
        return records
    if isinstance(records, pa.Table):
        batches = records.combine_chunks().to_batches()
        return batches[0] if batches else pa.RecordBatch.from_pylist([])
    if records and not isinstance(records[0], dict):
        raise TypeError(f"an Arrow batch needs records that are dicts, got {type(records[0]).__name__}")
    try:
        return pa.RecordBatch.from_pylist(records)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        plain = unviewed(records)  # a ListState.get() in a record: pyarrow takes lists only
        if plain is None:
            raise
        return pa.RecordBatch.from_pylist(plain)
