"""Operators: what a task runs on each buffer, and the state each one owns.

An operator takes a buffer (a list of records) and returns the records it
produces; it snapshots in two parts (a synchronous freeze returning the
asynchronous writer), and hears about completed checkpoints. Chained operators
of a task call each other through plain lists: no queue, no copy."""

from __future__ import annotations

from typing import Any, Callable, Iterable, List, Optional

import pyarrow as pa

from ..errors import ColumnNotFoundError, NonRetryableError
from ..state import OperatorStateBackend, create_keyed_backend, key_group_range_for_subtask
from ..storage.filesystem import CheckpointStorageLocation
from ..storage.metadata import OperatorState, SubtaskState

__all__ = [
    "NaNKeyError",
    "FilterOperator",
    "FlatMapOperator",
    "KeyedProcessFunction",
    "KeyedOperator",
    "KeyedProcessOperator",
    "MapBatchesOperator",
    "MapOperator",
    "Operator",
    "OperatorContext",
    "UserFunctionError",
    "batch_of",
    "key_selector",
    "rows_of",
]


class UserFunctionError(RuntimeError):
    """A user function raised: says which operator and subtask."""


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
    """Base: stateless, passes records through."""

    def __init__(self, uid: str, name: str) -> None:
        self.uid = uid
        self.name = name
        self.ctx: Optional[OperatorContext] = None
        self.operator_state: Optional[OperatorStateBackend] = None

    def where(self) -> str:
        sub = f" (subtask {self.ctx.subtask})" if self.ctx is not None else ""
        return f"operator {self.name!r}{sub}"

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


class MapOperator(Operator):
    def __init__(self, uid: str, name: str, fn: Callable[[Any], Any]) -> None:
        super().__init__(uid, name)
        self.fn = fn

    def process(self, records: List[Any]) -> List[Any]:
        fn, records = self.fn, rows_of(records)
        try:
            return [fn(r) for r in records]
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc


class FilterOperator(MapOperator):
    def process(self, records: List[Any]) -> List[Any]:
        fn, records = self.fn, rows_of(records)
        try:
            return [r for r in records if fn(r)]
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc


class FlatMapOperator(MapOperator):
    def process(self, records: List[Any]) -> List[Any]:
        fn, records = self.fn, rows_of(records)
        out: List[Any] = []
        try:
            for r in records:
                out.extend(fn(r))
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc
        return out


class MapBatchesOperator(MapOperator):
    """``fn(pyarrow.RecordBatch) -> RecordBatch``: records that are dicts become a
    batch (columns by key); a RecordBatch buffer passes as it is, and the result
    goes on as a batch (operators that need rows convert it when they get it)."""

    def process(self, records: Any) -> Any:
        if not len(records):
            return []
        batch = self._call(batch_of, records)
        result = self._call(self.fn, batch)
        if isinstance(result, pa.Table):
            batches = result.combine_chunks().to_batches()
            return batches[0] if batches else []
        if not isinstance(result, pa.RecordBatch):
            raise UserFunctionError(f"{self.where()}: map_batches must return a RecordBatch, got {type(result)}")
        return result


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
    return pa.RecordBatch.from_pylist(records)


class KeyedProcessFunction:
    """Per-key logic with keyed state: ``open(ctx)`` gets state through
    ``ctx.get_state(descriptor)``; ``process_element(value, ctx)`` yields outputs,
    with ``ctx.current_key`` set to the record's key."""

    def open(self, ctx: Any) -> None:
        pass

    def process_element(self, value: Any, ctx: Any) -> Iterable[Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _KeyedContext:
    def __init__(self, operator: KeyedProcessOperator) -> None:
        self._op = operator
        self.current_key: Any = None

    def get_state(self, descriptor: Any) -> Any:
        assert self._op.backend is not None
        return self._op.backend.get_state(descriptor)

    @property
    def subtask(self) -> int:
        assert self._op.ctx is not None
        return self._op.ctx.subtask


class KeyedOperator(Operator):
    """An operator with keyed state: a backend over its subtask's key groups."""

    def __init__(self, uid: str, name: str) -> None:
        super().__init__(uid, name)
        self.backend: Any = None

    def setup(self, ctx: OperatorContext, restored: Optional[OperatorState]) -> None:
        super().setup(ctx, restored)
        key_groups = key_group_range_for_subtask(ctx.max_parallelism, ctx.parallelism, ctx.subtask)
        self.backend = create_keyed_backend(
            ctx.state_backend,
            max_parallelism=ctx.max_parallelism,
            key_group_range=key_groups,
            local_recovery_dir=ctx.local_recovery_dir,
        )
        if restored is not None:
            self.backend.restore(restored.keyed_handles())

    def snapshot(self, checkpoint_id: int, location: CheckpointStorageLocation) -> Callable[[], SubtaskState]:
        keyed = self.backend.snapshot(checkpoint_id, location)
        operator_part = super().snapshot(checkpoint_id, location)

        def write() -> SubtaskState:
            result = keyed.run()
            state = operator_part()
            state.keyed = list(result.handles)
            return state

        return write

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        self.backend.notify_checkpoint_complete(checkpoint_id)

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        aborted = getattr(self.backend, "notify_checkpoint_aborted", None)
        if aborted is not None:
            aborted(checkpoint_id)


class KeyedProcessOperator(KeyedOperator):
    def __init__(self, uid: str, name: str, key_selector: Callable[[Any], Any], fn: KeyedProcessFunction) -> None:
        super().__init__(uid, name)
        self.key_selector = key_selector
        self.fn = fn
        self._kctx = _KeyedContext(self)

    def open(self) -> None:
        self._call(self.fn.open, self._kctx)

    def process(self, records: List[Any]) -> List[Any]:
        out: List[Any] = []
        records = rows_of(records)
        backend, kctx, fn, select = self.backend, self._kctx, self.fn, self.key_selector
        try:
            for r in records:
                key = select(r)
                if key.__class__ is float and key != key:
                    raise NaNKeyError(f"{self.where()}: the key of record {r!r} is NaN")
                backend.set_current_key(key)
                kctx.current_key = key
                produced = fn.process_element(r, kctx)
                if produced is not None:
                    out.extend(produced)
        except NaNKeyError:
            raise
        except Exception as exc:
            raise UserFunctionError(f"{self.where()}: {type(exc).__name__}: {exc}") from exc
        return out

    def close(self) -> None:
        self._call(self.fn.close)


class NaNKeyError(NonRetryableError, ValueError):
    """A record keyed by NaN. NaN equals nothing, itself included, so each such record
    would get state of its own (4,000 NaN records, 4,000 states of one): refused, at
    once and without restarts. Map NaN to a real key (None, or a sentinel) before
    ``key_by``."""

    def __init__(self, message: str) -> None:
        super().__init__(f"{message}; NaN cannot be a key (it equals nothing): map it to a key first, e.g. None")


def key_selector(key: Any) -> Callable[[Any], Any]:
    """``key_by``'s argument as a function: a callable, or a column/field name."""
    if callable(key):
        return key  # type: ignore[no-any-return]
    if isinstance(key, (str, int)):
        name = key

        def select(record: Any) -> Any:
            try:
                return record[name]
            except (KeyError, IndexError, TypeError):
                raise ColumnNotFoundError(f"key_by({name!r}): record {record!r} has no field {name!r}") from None

        select.column = name  # type: ignore[attr-defined]  # lets Arrow batches be partitioned by column
        return select
    raise TypeError(f"key_by takes a function or a field name, got {key!r}")
