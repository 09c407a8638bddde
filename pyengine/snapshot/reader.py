"""Reads a keyed state file (the layout is in ``format.py``): the whole file, or only the
batches holding the wanted key groups, each verified against its checksum, decoded
(``columns.py``) into (key group, state, keys, values).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List, Optional, Tuple

import pyarrow as pa
import pyarrow.ipc as ipc

from ..state.keygroups import KeyGroupRange
from ..state.serializers import (
    PickledBytes,
    PickleNotAllowedError,
    serializer_for,
)
from ..storage.filesystem import CorruptStateError, open_input_file, read_bytes, read_range
from ..storage.handles import KeyGroupsStateHandle, StreamStateHandle
from .columns import _listed, _mapped, from_split_timestamps
from .format import _KEY_INT, _KEY_PACKED, _SAFE, TOMBSTONE, SchemaInfo, StateColumn, read_schema_info
from .stamped import decode_stamped

__all__ = ["read_keyed_state"]


def _run_list(column: Any) -> List[Tuple[int, int, int]]:
    """(value, first row, end row) of each run of a run-end encoded column."""
    ends = column.run_ends.to_numpy(zero_copy_only=False).tolist()
    values = column.values.to_numpy(zero_copy_only=False).tolist()
    if not ends:  # a batch left empty (a stamped state's entries all expired)
        return []
    starts = [0, *ends[:-1]]
    return list(zip(values, starts, ends, strict=True))


def _union_child(column: Any, code: int) -> pa.Array:
    """The rows of a (possibly sliced) union as its child ``code``: the files this
    module writes use one child per batch (in a dense union, at offsets 0..n-1),
    so a slice of the union is the matching slice of that child."""
    if column.type.mode == "sparse":
        return column.field(code)  # pyarrow slices a sparse union's child with it
    if not len(column):
        return column.field(code).slice(0, 0)
    return column.field(code).slice(column.offsets[0].as_py(), len(column))


def _decode_keys(column: pa.UnionArray) -> List[Any]:
    codes = set(column.type_codes.to_numpy(zero_copy_only=False).tolist()) if len(column) else set()
    if len(codes) != 1:
        return [_decode_key(column, i) for i in range(len(column))]
    code = codes.pop()
    values = _union_child(column, code).to_pylist()
    if code == _KEY_PACKED:
        return [_SAFE.loads(v) for v in values]
    return values


def _decode_key(column: pa.UnionArray, i: int) -> Any:
    code = column.type_codes[i].as_py()
    value = column.field(code)[column.offsets[i].as_py()].as_py()
    return _SAFE.loads(value) if code == _KEY_PACKED else value


def _decode_values(
    column_spec: StateColumn,
    child: pa.Array,
    *,
    allow_pickle: bool,
    defer_pickle: bool,
    where: str,
    typed_arrays: bool = False,
) -> List[Any]:
    if column_spec.stamped:
        loads = None if column_spec.stamped_typed else serializer_for("safe").loads
        return decode_stamped(column_spec.kind, child, TOMBSTONE, loads)
    if column_spec.typed:
        if column_spec.kind == "list":
            lists = _listed(column_spec, child, typed_arrays)
            if lists is not None:
                return lists
        if column_spec.kind == "map":
            maps = _mapped(column_spec, child)
            if maps is not None:
                return maps
        values = child.to_pylist()
        if column_spec.kind == "map":
            return [TOMBSTONE if v is None else dict(v) for v in values]
        if child.null_count:
            return [TOMBSTONE if v is None else v for v in values]
        return values
    if column_spec.serializer == "pickle" and defer_pickle and not allow_pickle:
        # still pickled bytes: decoded only once someone opts in
        return [TOMBSTONE if v is None else PickledBytes(v) for v in child.to_pylist()]
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
    nulls marking deletions, and typed lists of numbers as array.arrays."""
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
            segments = [(e.offset, e.length, e.checksum) for e in handle.index]
            data = read_bytes(handle.stream, what=what, segments=segments)
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
        for spec, state_index, batch, runs in raw_batches():
            # Decode the whole batch once (unions are never sliced: pyarrow's union
            # offsets ignore a slice's own offset), then cut it into key groups.
            key_column = batch.column(2)
            value_column = (
                batch.column(3) if info.plain_values else _union_child(batch.column(3), info.value_child(state_index))
            )
            if info.split_timers and spec.kind == "timers":  # int64 again, for every reader below
                value_column = from_split_timestamps(value_column)
            int_keys: Optional[pa.Array] = None
            if info.plain_keys:
                int_keys = key_column
            else:
                codes = key_column.type_codes.to_numpy(zero_copy_only=False)
                if len(codes) and bool((codes == _KEY_INT).all()):
                    int_keys = _union_child(key_column, _KEY_INT)
            if arrays and spec.typed and spec.kind in ("value", "timers") and int_keys is not None:
                for key_group, a, b in runs:  # keys and values as Arrow arrays, for columnar state
                    yield key_group, spec, int_keys.slice(a, b - a), value_column.slice(a, b - a)
                continue
            keys = int_keys.to_pylist() if int_keys is not None else _decode_keys(key_column)
            values = _decode_values(
                spec,
                value_column,
                allow_pickle=spec.name in pickle_ok,
                defer_pickle=defer_pickle,
                where=where,
                typed_arrays=arrays,
            )
            for key_group, a, b in runs:
                yield key_group, spec, keys[a:b], values[a:b]

    def raw_batches() -> Iterator[Tuple[StateColumn, int, pa.RecordBatch, List[Tuple[int, int, int]]]]:
        for entry in handle.index:
            if not entry.overlaps(wanted.start, wanted.end):
                continue
            state_index = info.batches[entry.batch][2]
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
            # A batch may hold several key groups: (key group, first row, end row) runs.
            runs = [run for run in _run_list(batch.column(0)) if run[0] in wanted]
            if runs:
                yield info.columns[state_index], state_index, batch, runs

    return info, entries()
