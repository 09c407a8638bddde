"""The keyed state file: an Arrow IPC file, LZ4-compressed, one per subtask and snapshot.

Every file is readable with ``pyarrow.ipc.open_file`` alone. Columns:

* ``key_group`` (int16) and ``state`` (int16, an index into the state list in the
  schema metadata);
* ``key``: a dense union of ``int`` (int64), ``str`` (utf8) and ``packed``
  (binary: the key through the safe serializer), whichever holds a batch's keys
  exactly;
* ``value``: a dense union with one child per state. A state with a declared
  Arrow type and no time-to-live stores its values in a column of that type
  (lists as ``list<type>``, maps as ``map<key, value>``); any other state stores
  each entry through its serializer as binary.

Each record batch holds entries of one key group and one state, in key-group
order (batch 0 is empty: it makes the writer emit the file header first, so every
other batch has an exact byte range). The schema metadata ``pyengine`` (JSON)
names the format version, backend, key-group range, states and the (key group,
state) of every batch; the state handle also records each batch's byte range and
xxh3-64, so a subtask can read and verify only its own key groups.
"""

from __future__ import annotations

import itertools
import json
import pickle
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ..state.keygroups import KeyGroupRange
from ..state.serializers import PickleNotAllowedError, SafeSerializer, StateSerializationError, serializer_for
from ..storage.filesystem import CorruptStateError, open_input_file, read_bytes, read_range
from ..storage.handles import BatchIndexEntry, KeyGroupsStateHandle, StreamStateHandle

__all__ = [
    "TOMBSTONE",
    "ColumnarSlice",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "StateColumn",
    "read_keyed_state",
    "read_schema_info",
    "write_keyed_state",
]

FORMAT_NAME = "pyengine-keyed-state"
FORMAT_VERSION = 1
ROWS_PER_BATCH = 1 << 20
_KEY_INT, _KEY_STR, _KEY_PACKED = 0, 1, 2
_KEY_TYPE = pa.dense_union([pa.field("int", pa.int64()), pa.field("str", pa.string()), pa.field("packed", pa.binary())])
_SAFE = SafeSerializer()


class _Tombstone:
    """An entry deleted since the previous snapshot (incremental deltas): a null value.
    Live state never holds None (``update(None)`` clears), so a null is unambiguous."""

    def __repr__(self) -> str:
        return "TOMBSTONE"


TOMBSTONE = _Tombstone()
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class StateColumn:
    """How one state is stored in a file."""

    name: str
    kind: str
    arrow_type: Optional[pa.DataType]  # the declared type, if any
    map_key_type: Optional[pa.DataType]
    serializer: str  # "msgpack" or "pickle"
    ttl: bool

    @property
    def typed(self) -> bool:
        if self.ttl or self.serializer == "pickle":
            return False
        if self.kind == "map":
            return self.arrow_type is not None and self.map_key_type is not None
        return self.arrow_type is not None

    @property
    def storage_type(self) -> pa.DataType:
        if not self.typed:
            return pa.binary()
        assert self.arrow_type is not None
        if self.kind == "list":
            return pa.list_(self.arrow_type)
        if self.kind == "map":
            assert self.map_key_type is not None
            return pa.map_(self.map_key_type, self.arrow_type)
        return self.arrow_type

    def to_json(self) -> Dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "type": None if self.arrow_type is None else str(self.arrow_type),
            "map_key_type": None if self.map_key_type is None else str(self.map_key_type),
            "serializer": self.serializer,
            "ttl": self.ttl,
            "typed": self.typed,
        }


def _key_array(keys: List[Any]) -> pa.Array:
    n = len(keys)
    code, child = _KEY_PACKED, None
    if all(type(k) is int for k in keys) and all(_INT64_MIN <= k <= _INT64_MAX for k in keys):
        code, child = _KEY_INT, pa.array(keys, pa.int64())
    elif all(type(k) is str for k in keys):
        code, child = _KEY_STR, pa.array(keys, pa.string())
    else:
        child = pa.array([_SAFE.dumps(k) for k in keys], pa.binary())
    children = [pa.array([], t.type) for t in _KEY_TYPE]
    children[code] = child
    return pa.UnionArray.from_dense(
        pa.array(np.full(n, code, np.int8)),
        pa.array(np.arange(n, dtype=np.int32)),
        children,
        ["int", "str", "packed"],
    )


def _value_child(column: StateColumn, values: List[Any]) -> pa.Array:
    try:
        if not column.typed:
            dumps = serializer_for("pickle" if column.serializer == "pickle" else "safe").dumps
            return pa.array([None if v is TOMBSTONE else dumps(v) for v in values], pa.binary())
        if column.kind == "map":
            return pa.array([None if v is TOMBSTONE else list(v.items()) for v in values], column.storage_type)
        if any(v is TOMBSTONE for v in values):
            values = [None if v is TOMBSTONE else v for v in values]
        return pa.array(values, column.storage_type)
    except (TypeError, ValueError, AttributeError, pickle.PicklingError, pa.ArrowException) as exc:
        raise StateSerializationError(f"cannot snapshot state {column.name!r}: {exc}") from exc


@dataclass(frozen=True)
class ColumnarSlice:
    """Entries of one key group given as arrays (typed columnar state): int64 keys
    and their values, plus keys deleted since the previous snapshot (deltas)."""

    keys: np.ndarray
    values: np.ndarray
    deleted: Optional[np.ndarray] = None

    def __len__(self) -> int:
        return len(self.keys) + (0 if self.deleted is None else len(self.deleted))


def _columnar_batch_columns(
    column: StateColumn, piece: ColumnarSlice, start: int, stop: int
) -> Tuple[pa.Array, pa.Array]:
    keys, values = piece.keys, piece.values
    mask = None
    if piece.deleted is not None and len(piece.deleted):
        keys = np.concatenate([keys, piece.deleted])
        values = np.concatenate([values, np.zeros(len(piece.deleted), values.dtype)])
        mask = np.zeros(len(keys), bool)
        mask[len(piece.keys) :] = True
    keys, values = keys[start:stop], values[start:stop]
    n = len(keys)
    key_children = [pa.array(keys, pa.int64()), pa.array([], pa.string()), pa.array([], pa.binary())]
    key_array = pa.UnionArray.from_dense(
        pa.array(np.zeros(n, np.int8)), pa.array(np.arange(n, dtype=np.int32)), key_children, ["int", "str", "packed"]
    )
    value_child = pa.array(values, column.storage_type, mask=None if mask is None else mask[start:stop])
    return key_array, value_child


def _union_of(children_types: Sequence[pa.DataType], names: Sequence[str], index: int, child: pa.Array) -> pa.Array:
    n = len(child)
    children = [pa.array([], t) for t in children_types]
    children[index] = child
    return pa.UnionArray.from_dense(
        pa.array(np.full(n, index, np.int8)), pa.array(np.arange(n, dtype=np.int32)), children, list(names)
    )


def write_keyed_state(
    stream: Any,
    *,
    backend: str,
    max_parallelism: int,
    key_group_range: KeyGroupRange,
    columns: Sequence[StateColumn],
    groups: Sequence[Sequence[Dict[Any, Any]]],
) -> KeyGroupsStateHandle:
    """Writes ``groups[state][key_group - range.start]`` (dicts of key -> stored
    value) to ``stream`` (a CheckpointStateOutputStream, or one duplicating it) and
    returns the handle. The stream is closed here, or aborted on error."""
    value_types = [c.storage_type for c in columns]
    value_names = [f"s{i}" for i in range(len(columns))]
    plan = [
        (key_group, state_index, -(-len(groups[state_index][offset]) // ROWS_PER_BATCH))
        for offset, key_group in enumerate(key_group_range)
        for state_index in range(len(columns))
        if groups[state_index][offset]
    ]
    meta = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "backend": backend,
        "max_parallelism": max_parallelism,
        "key_groups": [key_group_range.start, key_group_range.end],
        "states": [c.to_json() for c in columns],
        "batches": [[kg, s] for kg, s, chunks in plan for _ in range(chunks)],
    }
    schema = pa.schema(
        [
            pa.field("key_group", pa.int16()),
            pa.field("state", pa.int16()),
            pa.field("key", _KEY_TYPE),
            pa.field("value", pa.dense_union([pa.field(n, t) for n, t in zip(value_names, value_types, strict=True)])),
        ],
        metadata={"pyengine": json.dumps(meta, separators=(",", ":"))},
    )
    index: List[BatchIndexEntry] = []
    with stream:
        writer = ipc.new_file(stream, schema, options=ipc.IpcWriteOptions(compression="lz4"))
        # Batch 0 is empty: it makes the writer emit the header, so batches 1.. have exact ranges.
        writer.write_batch(_empty_batch(schema))
        batch_number = 0
        for key_group, state_index, chunks in plan:
            group = groups[state_index][key_group - key_group_range.start]
            entries = iter(group.items()) if isinstance(group, dict) else None
            for chunk in range(chunks):
                if entries is None:  # a ColumnarSlice: whole arrays, no Python object per entry
                    start = chunk * ROWS_PER_BATCH
                    key_array, value_child = _columnar_batch_columns(
                        columns[state_index], group, start, start + ROWS_PER_BATCH
                    )
                else:
                    items = list(itertools.islice(entries, ROWS_PER_BATCH))
                    key_array = _key_array([k for k, _ in items])
                    value_child = _value_child(columns[state_index], [v for _, v in items])
                n = len(key_array)
                batch = pa.record_batch(
                    [
                        pa.array(np.full(n, key_group, np.int16)),
                        pa.array(np.full(n, state_index, np.int16)),
                        key_array,
                        _union_of(value_types, value_names, state_index, value_child),
                    ],
                    schema=schema,
                )
                batch_number += 1
                stream.begin_segment()
                writer.write_batch(batch)
                offset, length, checksum = stream.end_segment()
                index.append(BatchIndexEntry(key_group, batch_number, offset, length, checksum))
        writer.close()
        handle = stream.close_and_get_handle()
    return KeyGroupsStateHandle(
        stream=handle,
        key_group_start=key_group_range.start,
        key_group_end=key_group_range.end,
        index=tuple(index),
        backend=backend,
    )


def _empty_batch(schema: pa.Schema) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays(
        [pa.array([], f.type) if not pa.types.is_union(f.type) else _empty_union(f.type) for f in schema], schema=schema
    )


def _empty_union(union_type: pa.DataType) -> pa.Array:
    children = [pa.array([], union_type.field(i).type) for i in range(union_type.num_fields)]
    names = [union_type.field(i).name for i in range(union_type.num_fields)]
    return pa.UnionArray.from_dense(pa.array([], pa.int8()), pa.array([], pa.int32()), children, names)


@dataclass(frozen=True)
class SchemaInfo:
    """What a state file's schema metadata says about it."""

    backend: str
    max_parallelism: int
    key_groups: KeyGroupRange
    columns: Tuple[StateColumn, ...]
    batches: Tuple[Tuple[int, int], ...]  # (key group, state) of batches 1..n


def read_schema_info(schema: pa.Schema, *, where: str) -> SchemaInfo:
    raw = (schema.metadata or {}).get(b"pyengine")
    if raw is None:
        raise CorruptStateError(f"{where} is not a pyengine state file (no 'pyengine' schema metadata)")
    try:
        meta = json.loads(raw)
    except ValueError:
        raise CorruptStateError(f"{where}: unreadable schema metadata") from None
    if meta.get("format") != FORMAT_NAME:
        raise CorruptStateError(f"{where} is not a keyed state file (format {meta.get('format')!r})")
    if meta.get("version") != FORMAT_VERSION:
        raise CorruptStateError(
            f"{where} has state file format version {meta.get('version')!r}; this pyengine reads version "
            f"{FORMAT_VERSION}"
        )
    value_field = schema.field("value").type
    columns = []
    for i, c in enumerate(meta["states"]):
        # The exact declared types are the value union's children, not the metadata's text.
        arrow_type = map_key_type = None
        if c.get("typed"):
            child = value_field.field(i).type
            if c["kind"] == "list":
                arrow_type = child.value_type
            elif c["kind"] == "map":
                arrow_type, map_key_type = child.item_type, child.key_type
            else:
                arrow_type = child
        columns.append(
            StateColumn(
                name=c["name"],
                kind=c["kind"],
                arrow_type=arrow_type,
                map_key_type=map_key_type,
                serializer=c["serializer"],
                ttl=bool(c["ttl"]),
            )
        )
    start, end = meta["key_groups"]
    return SchemaInfo(
        backend=meta["backend"],
        max_parallelism=int(meta["max_parallelism"]),
        key_groups=KeyGroupRange(int(start), int(end)),
        columns=tuple(columns),
        batches=tuple((int(kg), int(s)) for kg, s in meta["batches"]),
    )


def _decode_keys(column: pa.UnionArray) -> List[Any]:
    codes = set(column.type_codes.to_numpy(zero_copy_only=False).tolist()) if len(column) else set()
    if len(codes) != 1:
        return [_decode_key(column, i) for i in range(len(column))]
    code = codes.pop()
    values = column.field(code).to_pylist()
    if code == _KEY_PACKED:
        return [_SAFE.loads(v) for v in values]
    return values


def _decode_key(column: pa.UnionArray, i: int) -> Any:
    code = column.type_codes[i].as_py()
    value = column.field(code)[column.offsets[i].as_py()].as_py()
    return _SAFE.loads(value) if code == _KEY_PACKED else value


def _decode_values(
    column_spec: StateColumn, child: pa.Array, *, allow_pickle: bool, defer_pickle: bool, where: str
) -> List[Any]:
    if column_spec.typed:
        values = child.to_pylist()
        if column_spec.kind == "map":
            return [TOMBSTONE if v is None else dict(v) for v in values]
        if child.null_count:
            return [TOMBSTONE if v is None else v for v in values]
        return values
    if column_spec.serializer == "pickle" and defer_pickle and not allow_pickle:
        # still pickled bytes: decoded only once someone opts in
        return [TOMBSTONE if v is None else v for v in child.to_pylist()]
    if column_spec.serializer == "pickle" and not allow_pickle:
        raise PickleNotAllowedError(
            f"state {column_spec.name!r} in {where} was written with pickle, which can run code when read; "
            f"restore it with a descriptor that opts in (serializer='pickle') or pass allow_pickle=True"
        )
    loads = serializer_for("pickle" if column_spec.serializer == "pickle" else "safe").loads
    return [TOMBSTONE if v is None else loads(v) for v in child.to_pylist()]


def read_keyed_state(
    handle: KeyGroupsStateHandle,
    key_groups: KeyGroupRange,
    *,
    allow_pickle: Iterable[str] = (),
    defer_pickle: bool = False,
    states: Optional[Iterable[str]] = None,
    arrays: bool = False,
    what: str = "",
) -> Tuple[SchemaInfo, Iterator[Tuple[int, StateColumn, Any, Any]]]:
    """Reads the entries of ``key_groups`` from a state file, verifying checksums:
    the whole file when all of it is wanted, else just the batches of those key
    groups. Returns the file's schema info and an iterator of (key group, state
    column, keys, stored values). Pickled values of states not in ``allow_pickle``
    are refused, or with ``defer_pickle`` returned still pickled. With ``states``,
    batches of other states are skipped unread. With ``arrays``, typed value
    states whose keys are all ints come as (int64 keys, values) Arrow arrays,
    nulls marking deletions."""
    stream = handle.stream
    path = stream.path if isinstance(stream, StreamStateHandle) else getattr(stream, "name", "inline state")
    where = f"state file {path}{' (' + what + ')' if what else ''}"
    pickle_ok = set(allow_pickle)
    only = None if states is None else set(states)
    wanted = key_groups.intersection(KeyGroupRange(handle.key_group_start, handle.key_group_end))
    whole = (wanted.start == handle.key_group_start and wanted.end == handle.key_group_end) or not isinstance(
        handle.stream, StreamStateHandle
    )
    try:
        if whole:
            data = read_bytes(handle.stream, what=what)
            reader = ipc.open_file(pa.py_buffer(data))
            schema = reader.schema
        else:
            with open_input_file(path, what=what) as f:
                schema = ipc.open_file(f).schema
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, CorruptStateError):
            raise
        raise CorruptStateError(f"{where} cannot be read as an Arrow IPC file: {exc}") from None
    info = read_schema_info(schema, where=where)

    def entries() -> Iterator[Tuple[int, StateColumn, Any, Any]]:
        for key_group, spec, state_index, batch in raw_batches():
            if arrays and spec.typed and spec.kind == "value":
                key_column = batch.column(2)
                codes = key_column.type_codes.to_numpy(zero_copy_only=False)
                if len(codes) and bool((codes == _KEY_INT).all()):
                    # keys and values as Arrow arrays, for columnar state
                    yield key_group, spec, key_column.field(_KEY_INT), batch.column(3).field(state_index)
                    continue
            keys = _decode_keys(batch.column(2))
            values = _decode_values(
                spec,
                batch.column(3).field(state_index),
                allow_pickle=spec.name in pickle_ok,
                defer_pickle=defer_pickle,
                where=where,
            )
            yield key_group, spec, keys, values

    def raw_batches() -> Iterator[Tuple[int, StateColumn, int, pa.RecordBatch]]:
        for entry in handle.index:
            if entry.key_group not in wanted:
                continue
            state_index = info.batches[entry.batch - 1][1]
            if only is not None and info.columns[state_index].name not in only:
                continue
            try:
                if whole:
                    batch = reader.get_batch(entry.batch)
                else:
                    raw = read_range(path, entry.offset, entry.length, entry.checksum, what=what)
                    batch = ipc.read_record_batch(ipc.read_message(pa.py_buffer(raw)), schema)
            except (pa.ArrowInvalid, IndexError) as exc:
                raise CorruptStateError(f"{where}: batch {entry.batch} cannot be read: {exc}") from None
            yield entry.key_group, info.columns[state_index], state_index, batch

    return info, entries()
