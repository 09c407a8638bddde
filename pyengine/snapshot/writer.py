"""Writes a keyed state file (the layout is in ``format.py``): plans the record batches —
key groups sharing a batch up to ``TARGET_ROWS`` — from dicts or columnar slices and changes,
encodes their columns (``columns.py``) and writes them (``ipcfile.py``, paced: ``pacing.py``), with each
batch's byte range and checksum in the handle's index. The batch sizes and write options
live here, beside the only code that reads them.
"""

from __future__ import annotations

import functools
import itertools
import json
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ..state.keygroups import KeyGroupRange
from ..storage.handles import BatchIndexEntry, KeyGroupsStateHandle
from .columns import GrowingLists, _key_array, _stamped_child, _value_child, to_split_timestamps
from .format import (
    _INT64_MAX,
    _INT64_MIN,
    _KEY_TYPE,
    FORMAT_NAME,
    FORMAT_VERSION,
    FORMAT_VERSION_LIST_TAILS,
    FORMAT_VERSION_SHARED_CHILDREN,
    FORMAT_VERSION_SPARSE,
    FORMAT_VERSION_SPLIT_TIMERS,
    FORMAT_VERSION_STAMPED,
    StateColumn,
    value_layout,
)
from .ipcfile import write_ipc_file

__all__ = ["ColumnarChanges", "ColumnarSlice", "write_keyed_state"]

ROWS_PER_BATCH = 1 << 20
TARGET_ROWS = 1 << 17
OWN_BATCH_ROWS = 1 << 15  # a key group this large is a batch of its own: no copying to merge it
_RUNS = pa.run_end_encoded(pa.int32(), pa.int16())
_WRITE_OPTIONS = ipc.IpcWriteOptions(compression="lz4")
# Compressing a batch's columns on pyarrow's threads pays off only for large ones:
# for a small batch (a delta) the hand-off costs more than it saves.
_SERIAL_WRITE_OPTIONS = ipc.IpcWriteOptions(compression="lz4", use_threads=False)
PARALLEL_COLUMNS_ROWS = 1 << 16
_FILE_MAGIC = b"ARROW1\0\0"  # the IPC file's leading magic and its padding to 8 bytes


class ColumnarSlice:
    """The entries of one key group given as arrays (typed columnar state, a full
    snapshot): int64 keys and their values.

    A plain slotted class, not a frozen dataclass: a snapshot's synchronous part
    makes one per key group, and a frozen dataclass's ``__init__`` costs 3x."""

    __slots__ = ("keys", "values")

    def __init__(self, keys: np.ndarray, values: np.ndarray) -> None:
        self.keys = keys
        self.values = values

    def __len__(self) -> int:
        return len(self.keys)


class ColumnarChanges:
    """The changed entries of a whole columnar state (an incremental delta), all key
    groups' concatenated in key-group order: group i's upserts are the next
    ``upserts[i]`` of (keys, values), its deletions the next ``deletes[i]`` of
    ``deleted``. Written as it is, with no per-group slicing or copying."""

    __slots__ = ("deleted", "deletes", "keys", "upserts", "values")

    def __init__(
        self, keys: np.ndarray, values: np.ndarray, deleted: np.ndarray, upserts: np.ndarray, deletes: np.ndarray
    ) -> None:
        self.keys = keys
        self.values = values
        self.deleted = deleted
        self.upserts = upserts
        self.deletes = deletes

    def key_sets(self) -> List[Set[Any]]:
        """Every changed key (upserted or deleted) per group."""
        out = []
        u = d = 0
        for up, de in zip(self.upserts.tolist(), self.deletes.tolist(), strict=True):
            out.append(set(self.keys[u : u + up].tolist()) | set(self.deleted[d : d + de].tolist()))
            u += up
            d += de
        return out


class _Batch(NamedTuple):
    """One planned record batch: entries of one state, key groups first..last.
    Parts are (key group, group, start, stop), or for ColumnarChanges one part
    (first key group, changes, first group offset, end group offset)."""

    state: int
    first: int
    last: int
    parts: List[Tuple[int, Any, int, int]]
    rows: int


def _joined(pieces: List[np.ndarray]) -> np.ndarray:
    if len(pieces) == 1:
        return pieces[0]
    dtype = pieces[0].dtype
    # Into a buffer from Arrow's memory pool, which keeps its pages: a fresh NumPy
    # array of a few MB is a fresh mmap whose page faults cost 20x the copy.
    out = np.frombuffer(pa.allocate_buffer(sum(len(p) for p in pieces) * dtype.itemsize), dtype)
    np.concatenate(pieces, out=out)
    return out


def _changes_columns(
    part: Tuple[int, Any, int, int], column: StateColumn, plain_keys: bool
) -> Tuple[List[int], List[int], pa.Array, pa.Array]:
    """(run key groups, run lengths, keys, values) of groups ``a:b`` of a delta: its
    upserts as they are (slices, no copy), then its deletions as nulls. A key group
    with both has two runs."""
    first_group, changes, a, b = part
    up = changes.upserts[a:b]
    de = changes.deletes[a:b]
    ua, da = int(changes.upserts[:a].sum()), int(changes.deletes[:a].sum())
    ub, db = ua + int(up.sum()), da + int(de.sum())
    groups = np.arange(first_group, first_group + (b - a))
    live_up, live_de = up > 0, de > 0
    run_groups = np.concatenate([groups[live_up], groups[live_de]]).tolist()
    lengths = np.concatenate([up[live_up], de[live_de]]).tolist()
    keys, values = changes.keys[ua:ub], changes.values[ua:ub]
    mask = None
    if db > da:
        keys = _joined([keys, changes.deleted[da:db]])
        values = _joined([values, np.zeros(db - da, values.dtype)])
        mask = np.zeros(len(keys), bool)
        mask[ub - ua :] = True
    key_array = pa.array(keys, pa.int64()) if plain_keys else _int_key_union(keys)
    return run_groups, lengths, key_array, pa.array(values, column.storage_type, mask=mask)


def _all_int64_keys(group: Any) -> bool:
    if isinstance(group, (ColumnarSlice, ColumnarChanges)):
        return True
    if not group:
        return True
    # three passes in C (types, then the range), not a Python test per key
    return set(map(type, group)) == {int} and _INT64_MIN <= min(group) and max(group) <= _INT64_MAX


def _int_key_union(keys: Any) -> pa.Array:
    n = len(keys)
    children = [pa.array(keys, pa.int64()), pa.array([], pa.string()), pa.array([], pa.binary())]
    return pa.UnionArray.from_dense(
        pa.array(np.zeros(n, np.int8)), pa.array(np.arange(n, dtype=np.int32)), children, ["int", "str", "packed"]
    )


def _union_of(
    children_types: Sequence[pa.DataType], names: Sequence[str], index: int, child: pa.Array, sparse: bool
) -> pa.Array:
    n = len(child)
    codes = pa.array(np.full(n, index, np.int8))
    if sparse:  # the other children: nulls, as long as the batch
        children = [child if i == index else pa.nulls(n, t) for i, t in enumerate(children_types)]
        return pa.UnionArray.from_sparse(codes, children, list(names))
    children = [pa.array([], t) for t in children_types]
    children[index] = child
    return pa.UnionArray.from_dense(codes, pa.array(np.arange(n, dtype=np.int32)), children, list(names))


def _plan_batches(groups: Sequence[Any], key_group_range: KeyGroupRange, num_states: int) -> List[_Batch]:
    """Batches of one state each, consecutive key groups merged until a batch has
    TARGET_ROWS rows (few, large batches keep per-batch costs down), none over
    ROWS_PER_BATCH."""
    plan: List[_Batch] = []
    for state_index in range(num_states):
        if isinstance(groups[state_index], ColumnarChanges):
            plan.extend(_plan_changes(state_index, groups[state_index], key_group_range))
            continue
        parts: List[Tuple[int, Any, int, int]] = []
        rows = 0

        for offset, key_group in enumerate(key_group_range):
            group = groups[state_index][offset]
            size, start = len(group), 0
            if size >= OWN_BATCH_ROWS and parts:  # large groups are not merged with others
                plan.append(_Batch(state_index, parts[0][0], parts[-1][0], parts, rows))
                parts, rows = [], 0
            while start < size:
                take = min(size - start, ROWS_PER_BATCH - rows)
                parts.append((key_group, group, start, start + take))
                rows += take
                start += take
                if rows >= ROWS_PER_BATCH:
                    plan.append(_Batch(state_index, parts[0][0], parts[-1][0], parts, rows))
                    parts, rows = [], 0
            if rows >= TARGET_ROWS or (size >= OWN_BATCH_ROWS and parts):
                plan.append(_Batch(state_index, parts[0][0], parts[-1][0], parts, rows))
                parts, rows = [], 0
        if parts:
            plan.append(_Batch(state_index, parts[0][0], parts[-1][0], parts, rows))
    return plan


def _plan_changes(state_index: int, changes: ColumnarChanges, key_group_range: KeyGroupRange) -> List[_Batch]:
    """Batches of consecutive key groups of a delta with about TARGET_ROWS rows each
    (a key group with more changes than that is a batch of its own)."""
    plan: List[_Batch] = []
    base = key_group_range.start

    def close(a: int, b: int, rows: int) -> None:  # group offsets a..b, both with entries
        plan.append(_Batch(state_index, base + a, base + b, [(base + a, changes, a, b + 1)], rows))

    first = last = -1
    rows = 0
    for offset, size in enumerate((changes.upserts + changes.deletes).tolist()):
        if not size:
            continue
        if first >= 0 and rows + size > TARGET_ROWS:
            close(first, last, rows)
            first, rows = -1, 0
        if first < 0:
            first = offset
        rows += size
        last = offset
    if first >= 0:
        close(first, last, rows)
    return plan


def write_keyed_state(
    stream: Any,
    *,
    backend: str,
    max_parallelism: int,
    key_group_range: KeyGroupRange,
    columns: Sequence[StateColumn],
    groups: Sequence[Sequence[Any]],
) -> KeyGroupsStateHandle:
    """Writes ``groups[state][key_group - range.start]`` (dicts of key -> stored
    value, or ColumnarSlices) to ``stream`` (a CheckpointStateOutputStream, or one
    duplicating it) and returns the handle. The stream is closed here, or aborted
    on error."""
    value_types, child_of, sparse = value_layout(columns)
    # A stamped state's frozen groups come unfiltered, with the limit its entries expire
    # at (``stamp_limit``): the batches leave expired ones out in bulk.
    limits: List[Optional[int]] = [None] * len(columns)
    groups = list[Any](groups)
    for i, column in enumerate(columns):
        limit_of = getattr(groups[i], "stamp_limit", None)
        if column.stamped and limit_of is not None:
            limits[i] = limit_of()
            groups[i] = groups[i].unfiltered
    stamped = any(c.stamped for c in columns)
    shared_children = child_of is not None
    value_names = [f"{'t' if shared_children else 's'}{i}" for i in range(len(value_types))]
    plan = _plan_batches(groups, key_group_range, len(columns))
    # Plain columns where they can be: unions cost a type id and an offset per row.
    plain_keys = all(_all_int64_keys(group) for batch in plan for _, group, _, _ in batch.parts)
    plain_values = len(columns) == 1
    split_timers = any(c.split_timestamps for c in columns)
    meta: Dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": (
            FORMAT_VERSION_STAMPED
            if stamped
            else FORMAT_VERSION_LIST_TAILS
            if any(c.appends for c in columns)
            else FORMAT_VERSION_SPLIT_TIMERS
            if split_timers
            else FORMAT_VERSION
            if plain_values or not shared_children
            else FORMAT_VERSION_SPARSE
            if sparse
            else FORMAT_VERSION_SHARED_CHILDREN
        ),
        "backend": backend,
        "max_parallelism": max_parallelism,
        "key_groups": [key_group_range.start, key_group_range.end],
        "states": [c.to_json() for c in columns],
        "batches": [[batch.first, batch.last, batch.state] for batch in plan],
        "key_encoding": "int64" if plain_keys else "union",
        "value_encoding": "plain" if plain_values else "union_by_type" if shared_children else "union",
    }
    if child_of is not None:
        meta["value_children"] = child_of
    if split_timers:
        meta["timers_encoding"] = "split"
    if stamped:
        meta["ttl_encoding"] = "columns"
    value_fields = [pa.field(n, t) for n, t in zip(value_names, value_types, strict=True)]
    value_union = pa.sparse_union(value_fields) if sparse else pa.dense_union(value_fields)
    schema = pa.schema(
        [
            pa.field("key_group", _RUNS),
            pa.field("state", _RUNS),
            pa.field("key", pa.int64() if plain_keys else _KEY_TYPE),
            pa.field("value", value_types[0] if plain_values else value_union),
        ],
        metadata={"pyengine": json.dumps(meta, separators=(",", ":"))},
    )

    def build(batch: _Batch) -> pa.RecordBatch:
        state_index, parts = batch.state, batch.parts
        column = columns[state_index]
        lengths: List[int] = []
        run_groups = [kg for kg, _, _, _ in parts]
        if isinstance(parts[0][1], ColumnarChanges):  # a delta: slices of its arrays, runs from its counts
            run_groups, lengths, key_array, value_child = _changes_columns(parts[0], column, plain_keys)
        elif isinstance(parts[0][1], ColumnarSlice):  # whole arrays, no Python object per entry
            key_pieces, value_pieces = [], []
            for _, group, start, stop in parts:
                key_pieces.append(group.keys[start:stop])
                value_pieces.append(group.values[start:stop])
                lengths.append(stop - start)
            all_keys = _joined(key_pieces)
            key_array = pa.array(all_keys, pa.int64()) if plain_keys else _int_key_union(all_keys)
            all_values = _joined(value_pieces)
            value_child = (
                to_split_timestamps(all_values)
                if column.split_timestamps
                else pa.array(all_values, column.storage_type)
            )
        else:
            # Keys and values apart, from the dicts' views: no (key, value) tuple per
            # entry, whose allocations would set off the garbage collector's full
            # passes over every live state object (most of a large snapshot's time).
            key_list: List[Any] = []
            value_list: List[Any] = []
            for _, group, start, stop in parts:
                if (start, stop) == (0, len(group)):
                    key_list.extend(group.keys())
                    value_list.extend(group.values())
                else:
                    key_list.extend(itertools.islice(group.keys(), start, stop))
                    value_list.extend(itertools.islice(group.values(), start, stop))
                lengths.append(stop - start)
            if column.stamped:
                value_child, rows = _stamped_child(column, value_list, limits[state_index])
                if rows is not None:  # keys whose entries all expired: left out, their runs shortened
                    key_list = list(itertools.compress(key_list, rows))
                    ends = np.cumsum(lengths)
                    kept = np.concatenate([[0], np.cumsum(rows)])[np.concatenate([[0], ends])]
                    lengths = np.diff(kept).tolist()
                    run_groups = [kg for kg, length in zip(run_groups, lengths, strict=True) if length]
                    lengths = [length for length in lengths if length]
            else:
                growing = groups[state_index]
                if not isinstance(growing, GrowingLists):
                    value_child = _value_child(column, value_list)
                else:
                    starts: Optional[List[int]] = None
                    if growing.starts is not None:  # a delta's tails: each key's first new element
                        starts = []
                        for key_group, group, start, stop in parts:
                            first = growing.starts[key_group - key_group_range.start]
                            starts.extend(map(first.__getitem__, itertools.islice(group.keys(), start, stop)))
                    value_child = _value_child(column, value_list, starts, growing.frozen_lengths)
            key_array = pa.array(key_list, pa.int64()) if plain_keys else _key_array(key_list)
        n = len(key_array)
        child = state_index if child_of is None else child_of[state_index]
        value_array = value_child if plain_values else _union_of(value_types, value_names, child, value_child, sparse)
        return pa.record_batch(
            [_runs(run_groups, lengths), _runs([state_index] if n else [], [n] if n else []), key_array, value_array],
            schema=schema,
        )

    with stream:
        if len(plan) > 1:  # batches encoded on worker threads, written here in order
            segments = write_ipc_file(
                stream, schema, [functools.partial(build, batch) for batch in plan], _WRITE_OPTIONS
            )
        else:  # one batch: pyarrow compresses its columns in parallel itself
            segments = []
            options = _WRITE_OPTIONS if plan and plan[0].rows >= PARALLEL_COLUMNS_ROWS else _SERIAL_WRITE_OPTIONS
            writer = ipc.new_file(stream, schema, options=options)
            # The writer emits the file header (magic, padding, schema message) with the
            # first batch; it is that long, so batch 0's byte range starts right after it.
            for batch in plan:
                stream.begin_segment(len(_FILE_MAGIC) + schema.serialize().size)
                writer.write_batch(build(batch))
                segments.append(stream.end_segment())
            writer.close()
        handle = stream.close_and_get_handle()
    index = [
        BatchIndexEntry(batch.first, batch_number, offset, length, checksum, batch.last)
        for batch_number, (batch, (offset, length, checksum)) in enumerate(zip(plan, segments, strict=True))
    ]
    return KeyGroupsStateHandle(
        stream=handle,
        key_group_start=key_group_range.start,
        key_group_end=key_group_range.end,
        index=tuple(index),
        backend=backend,
    )


def _runs(values: Sequence[int], lengths: Sequence[int]) -> pa.Array:
    """A run-end encoded int16 column: a few runs per batch instead of a value per row."""
    ends = np.cumsum(np.asarray(lengths, np.int64))
    # Not RunEndEncodedArray.from_arrays: it tries to import pandas on every call
    # (about 40 us when pandas is absent), which is most of a small batch's cost.
    return pa.Array.from_buffers(
        _RUNS,
        int(ends[-1]) if len(ends) else 0,
        [None],
        children=[pa.array(ends.astype(np.int32)), pa.array(np.asarray(values, np.int16))],
    )
