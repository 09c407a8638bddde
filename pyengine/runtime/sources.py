"""Replayable sources: each subtask reads its split and keeps its position in
operator state, so a restore rewinds exactly to the checkpoint."""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from ..state import ListStateDescriptor
from ..storage.metadata import OperatorState
from .operators import Operator, OperatorContext

__all__ = ["CollectionSource", "FileSource", "GeneratorSource", "Source", "SourceOperator"]

_POSITION = ListStateDescriptor("position")


class Source:
    """A bounded, replayable input: ``read(subtask, parallelism, position, n)`` gives
    up to ``n`` records from ``position`` of that subtask's split (fewer at its end)."""

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> List[Any]:
        raise NotImplementedError


class CollectionSource(Source):
    """A list, or an Arrow table (read as batches): subtask ``i`` of ``p`` reads
    elements (rows) ``i, i+p, i+2p, ...``."""

    def __init__(self, records: Any) -> None:
        if isinstance(records, pa.RecordBatch):
            records = pa.Table.from_batches([records])
        self.records = records if isinstance(records, pa.Table) else list(records)

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        start = subtask + position * parallelism
        if isinstance(self.records, pa.Table):
            stop = min(start + n * parallelism, self.records.num_rows)
            if start >= stop:
                return []
            rows = self.records.take(np.arange(start, stop, parallelism))
            return rows.combine_chunks().to_batches()[0]
        return self.records[start : start + n * parallelism : parallelism]


class FileSource(Source):
    """Files read with ``pyarrow.dataset`` (parquet, csv, json, feather/ipc), as Arrow batches.

    The input is cut into splits, a parquet row group or a whole file of the other
    formats, sorted by path; subtask ``i`` of ``p`` reads splits ``i, i+p, ...`` one
    after the other, and its position is the number of rows it has read — so a
    restore seeks to the file and row it had reached."""

    FORMATS = ("parquet", "csv", "json", "feather", "ipc", "arrow")

    def __init__(self, path: Any, format: str = "parquet", columns: Optional[List[str]] = None) -> None:
        import pyarrow.dataset as ds

        if format not in self.FORMATS:
            raise ValueError(f"read_files format must be one of {', '.join(self.FORMATS)}, got {format!r}")
        try:
            dataset = ds.dataset(path, format=format)
        except (FileNotFoundError, OSError, pa.ArrowInvalid) as exc:
            raise ValueError(f"read_files({path!r}): {exc}") from None
        if columns is not None:
            unknown = [c for c in columns if c not in dataset.schema.names]
            if unknown:
                raise ValueError(f"read_files({path!r}): no column {unknown[0]!r} (columns: {dataset.schema.names})")
        splits = []
        for fragment in sorted(dataset.get_fragments(), key=lambda f: f.path):
            if format == "parquet":
                splits.extend(fragment.split_by_row_group())
            else:
                splits.append(fragment)
        if not splits:
            raise ValueError(f"read_files({path!r}): no {format} files there")
        self.path = path
        self.schema = dataset.schema if columns is None else pa.schema([dataset.schema.field(c) for c in columns])
        self.columns = columns
        self._splits = splits
        self._readers: Dict[Tuple[int, int], _SplitReader] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> Dict[str, Any]:  # to Spark executors: no open readers, a new lock
        state = self.__dict__.copy()
        state.pop("_lock", None)
        state["_readers"] = {}
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> Any:
        with self._lock:
            reader = self._readers.get((subtask, parallelism))
            if reader is None or reader.position != position or reader.batch_size != n:
                reader = _SplitReader(self._splits[subtask::parallelism], self.schema, self.columns, n, position)
                self._readers[(subtask, parallelism)] = reader
        batch = reader.take(n)
        return batch if batch.num_rows else []


class _SplitReader:
    """Reads a subtask's splits in order, ``n`` rows at a time, from a row position."""

    def __init__(self, splits: List[Any], schema: pa.Schema, columns: Any, n: int, position: int) -> None:
        self.batch_size = n
        self.schema = schema
        self.position = 0
        self._batches = (
            b for split in splits for b in split.to_batches(batch_size=n, columns=columns, use_threads=False)
        )
        self._pending: List[pa.RecordBatch] = []
        self._pending_rows = 0
        while self.position < position:  # seek: whole batches skipped, the last one sliced
            batch = next(self._batches, None)
            if batch is None:
                break
            skip = min(batch.num_rows, position - self.position)
            self.position += skip
            if skip < batch.num_rows:
                self._pending, self._pending_rows = [batch.slice(skip)], batch.num_rows - skip

    def take(self, n: int) -> pa.RecordBatch:
        while self._pending_rows < n:
            batch = next(self._batches, None)
            if batch is None:
                break
            if batch.num_rows:
                self._pending.append(batch)
                self._pending_rows += batch.num_rows
        pieces, taken = [], 0
        while self._pending and taken < n:
            head = self._pending[0]
            want = n - taken
            if head.num_rows <= want:
                pieces.append(self._pending.pop(0))
                taken += head.num_rows
            else:
                pieces.append(head.slice(0, want))
                self._pending[0] = head.slice(want)
                taken += want
        self._pending_rows -= taken
        self.position += taken
        if not pieces:
            return pa.RecordBatch.from_pylist([], self.schema)
        return pieces[0] if len(pieces) == 1 else pa.concat_batches(pieces)


class GeneratorSource(Source):
    """``count`` records ``fn(sequence_number)``, deterministic by construction."""

    def __init__(self, fn: Callable[[int], Any], count: int) -> None:
        self.fn = fn
        self.count = count

    def read(self, subtask: int, parallelism: int, position: int, n: int) -> List[Any]:
        first = subtask + position * parallelism
        return [self.fn(i) for i in range(first, min(self.count, first + n * parallelism), parallelism)]


class SourceOperator(Operator):
    """The head of a source task: reads its splits, one after the other, from their positions.

    A split is what subtask ``i`` of ``p`` read when the job first ran (``Source.read``
    with that ``i`` and ``p``); every split's position is in union list state, so a
    restore at another parallelism hands the splits round-robin to the new subtasks
    and each resumes exactly where its split stopped (as Flink's split enumerator
    reassigns splits)."""

    def __init__(self, uid: str, name: str, source: Source) -> None:
        super().__init__(uid, name)
        self.source = source
        self.splits: List[List[int]] = []  # [index, count, position, done]
        self.exhausted = False

    def setup(self, ctx: OperatorContext, restored: Optional[OperatorState]) -> None:
        super().setup(ctx, restored)
        assert self.operator_state is not None
        state = self.operator_state.get_union_list_state(_POSITION)
        if restored is None:
            self.splits = [[ctx.subtask, ctx.parallelism, 0, 0]]
        else:
            entries = sorted(state.get())  # [index, count, position, done, owner, owner_parallelism]
            same = all(e[5] == ctx.parallelism for e in entries)
            mine = [e for e in entries if e[4] == ctx.subtask] if same else entries[ctx.subtask :: ctx.parallelism]
            self.splits = [list(e[:4]) for e in mine]
        self.exhausted = all(split[3] for split in self.splits)
        self._state = state

    @property
    def position(self) -> int:
        """Records read so far, over this subtask's splits."""
        return sum(split[2] for split in self.splits)

    def read(self, n: int) -> Any:
        assert self.ctx is not None
        for split in self.splits:
            if split[3]:
                continue
            records = self._call(self.source.read, split[0], split[1], split[2], n)
            split[2] += len(records)
            if len(records) < n:
                split[3] = 1
            self.exhausted = all(s[3] for s in self.splits)
            return records
        self.exhausted = True
        return []

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        assert self.ctx is not None
        me, p = self.ctx.subtask, self.ctx.parallelism
        self._state.update([[*split, me, p] for split in self.splits])
        return super().snapshot(checkpoint_id, location)
