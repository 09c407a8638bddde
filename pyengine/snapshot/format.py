"""The keyed state file: an Arrow IPC file, LZ4-compressed, one per subtask and snapshot.

Every file is readable with ``pyarrow.ipc.open_file`` alone. Columns:

* ``key_group`` and ``state`` (an index into the state list in the schema
  metadata): run-end encoded, a few runs per batch instead of a value per row;
* ``key``: int64 when every key in the file is a 64-bit int, else a dense union
  of ``int`` (int64), ``str`` (utf8) and ``packed`` (binary: the key through the
  safe serializer), whichever holds a key exactly;
* ``value``: with one state, that state's storage type (version 1); with
  several states of at most four distinct storage types (the usual case: a few
  declared types, binary for untyped states, int64 for timers), a sparse union
  with one child per storage type, the metadata mapping each state to its child
  (version 3: a sparse union has no offset per row, where a dense one costs 4
  bytes a row that LZ4 cannot shrink; the other children of a batch are nulls,
  which it can); with more types, a dense union with one child per state
  (version 1), or, past the 128 children an Arrow union can have (its type codes
  are int8), one child per distinct storage type and the map (version 2). Files
  of version 1 are the layout every pyengine reads; a pyengine that does not know
  a version refuses the file by its number. A state with a declared Arrow type and no
  time-to-live stores its values as that type (lists as ``list<type>``, maps as
  ``map<key, value>``); any other state stores each entry through its
  serializer as binary. Deletions in a delta are null values.

Each record batch holds entries of one state and of a range of consecutive key
groups; small key groups share a batch, so per-batch costs stay low. Runs are in
key-group order, except in a delta of columnar state, which lists its upserts in
key-group order and then its deletions (a key group may then have two runs).
The schema metadata ``pyengine`` (JSON) names the format version, backend,
key-group range, states and the (first key group, last key group, state) of
every batch; the state handle also records each batch's byte range and xxh3-64,
so a subtask reads and verifies only the batches holding its key groups.
"""

from __future__ import annotations

import functools
import itertools
import json
import operator
import pickle
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import msgpack
import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ..state.keygroups import KeyGroupRange
from ..state.serializers import (
    LIST_TYPECODES,
    TYPED_LIST,
    PickledBytes,
    PickleNotAllowedError,
    SafeSerializer,
    StateSerializationError,
    serializer_for,
)
from ..state.serializers import _default as _msgpack_default
from ..storage.filesystem import CorruptStateError, open_input_file, read_bytes, read_range
from ..storage.handles import BatchIndexEntry, KeyGroupsStateHandle, StreamStateHandle
from . import pacing
from .ipcfile import write_ipc_file
from .stamped import declared_types, decode_stamped, encode_stamped, stamped_type

__all__ = [
    "TOMBSTONE",
    "ColumnarChanges",
    "ColumnarSlice",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "FORMAT_VERSION_LIST_TAILS",
    "GrowingLists",
    "MAX_STATES_PER_FILE",
    "MAX_UNION_CHILDREN",
    "StateColumn",
    "check_state_count",
    "read_keyed_state",
    "read_schema_info",
    "write_keyed_state",
]

FORMAT_NAME = "pyengine-keyed-state"
FORMAT_VERSION = 1  # what a file of one state, or of many states of many types, is written as
FORMAT_VERSION_SHARED_CHILDREN = 2  # a file of more states: union children shared by storage type
FORMAT_VERSION_SPARSE = 3  # several states of at most SPARSE_MAX_CHILDREN storage types: a sparse union by type
# Any of the layouts above, with the timestamps of every ``timers`` state as SPLIT_TIMESTAMPS
# (metadata ``"timers_encoding": "split"``): a pyengine reading versions up to 3 refuses the file.
FORMAT_VERSION_SPLIT_TIMERS = 4
# Any of the layouts above (split timers included, with ``"timers_encoding": "split"``), in a
# delta holding list tails: a column marked ``"appends": true`` whose lists are elements
# appended to that key's list since the chain's previous file (a pyengine reading versions up
# to 4 would take them for whole lists, so it refuses the file by its number).
FORMAT_VERSION_LIST_TAILS = 5
# Any of the layouts above (list tails as in version 5 included), with TTL states (but those
# that opted in to pickle) written as columns of values and stamps (metadata
# ``"ttl_encoding": "columns"``, the state's ``"stamped"``; see ``snapshot/stamped.py``), timers
# split as in version 4: a pyengine reading up to 5 refuses it.
FORMAT_VERSION_STAMPED = 6
READ_VERSIONS = (
    FORMAT_VERSION,
    FORMAT_VERSION_SHARED_CHILDREN,
    FORMAT_VERSION_SPARSE,
    FORMAT_VERSION_SPLIT_TIMERS,
    FORMAT_VERSION_LIST_TAILS,
    FORMAT_VERSION_STAMPED,
)
# A timer's int64 timestamp as its high and low 32 bits, t == (hi << 32) | lo. LZ4 spends
# ~1.6 ns a byte on an int64 column of nearby values (matches of a few zero bytes, a token
# each: 8 MB of a second's spread of timestamps took 13 ms, to 4.7 MB); ``hi`` is one
# value over a 49-day span, which it stores in next to nothing, and ``lo`` it gives up on
# at ~4 GB/s and stores as is (1 ms, 4 MB). Any Arrow reader can join them back.
SPLIT_TIMESTAMPS = pa.struct([pa.field("hi", pa.int32(), nullable=False), pa.field("lo", pa.uint32(), nullable=False)])
# A sparse union has no offsets (a dense one costs 4 bytes a row, which LZ4 cannot
# shrink: they count 0, 1, 2...), but every child is as long as the batch: the
# children other than the batch's own are nulls (zeroed buffers), which LZ4 reduces
# to almost nothing but which are still made and compressed. With few children that costs less than the
# offsets; with many, more.
SPARSE_MAX_CHILDREN = 4
# An Arrow union's type codes are int8 (0..127), so it has at most 128 children.
MAX_UNION_CHILDREN = 128
# The ``state`` column's run values are int16.
MAX_STATES_PER_FILE = (1 << 15) - 1
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
    # as a file says them (str of the declared types), typed or not: what its writes were checked against
    declared: Tuple[Optional[str], Optional[str]] = (None, None)  # (map key type, value or element type)
    # A list state's tails (version 5): each entry's elements are appended to the key's list as
    # the chain's previous files left it, rather than replacing it. The same state has its
    # ordinary column in the file too, for the keys whose list was rewritten or cleared.
    appends: bool = False
    # a TTL state's entries as columns of values and stamps (written now; read: what the file says)
    ttl_columns: bool = True

    @property
    def typed(self) -> bool:
        if self.ttl or self.serializer == "pickle":
            return False
        if self.kind == "map":
            return self.arrow_type is not None and self.map_key_type is not None
        return self.arrow_type is not None

    @property
    def stamped(self) -> bool:
        """A TTL state written as columns of values and stamps (version 5): the values
        in their declared types (``stamped_typed``), or serialized per key as without
        TTL, rather than each entry serialized with its stamps. A state that opted in
        to pickle keeps the older layout."""
        return self.ttl and self.ttl_columns and self.serializer != "pickle" and self.kind != "timers"

    @property
    def stamped_typed(self) -> bool:
        """A stamped state's values are in their declared types (not serialized)."""
        if not self.stamped or self.arrow_type is None:
            return False
        return self.kind != "map" or self.map_key_type is not None

    @property
    def split_timestamps(self) -> bool:
        """A ``timers`` state's timestamps, written as SPLIT_TIMESTAMPS."""
        return self.kind == "timers" and self.typed and pa.types.is_int64(self.arrow_type)

    @property
    def file_type(self) -> pa.DataType:
        """The type of this state's values in a file written now (``storage_type``, but
        for a timers state's split timestamps)."""
        return SPLIT_TIMESTAMPS if self.split_timestamps else self.storage_type

    @property
    def storage_type(self) -> pa.DataType:
        if self.stamped:
            return stamped_type(self.kind, self.arrow_type if self.stamped_typed else None, self.map_key_type)
        if not self.typed:
            return pa.binary()
        return self.plain_type

    @property
    def plain_type(self) -> pa.DataType:
        """The declared types' layout without stamps (a typed state's storage type)."""
        assert self.arrow_type is not None
        if self.kind == "list":
            return pa.list_(self.arrow_type)
        if self.kind == "map":
            assert self.map_key_type is not None
            return pa.map_(self.map_key_type, self.arrow_type)
        return self.arrow_type

    def to_json(self) -> Dict[str, Any]:
        out = {
            "name": self.name,
            "kind": self.kind,
            "type": None if self.arrow_type is None else str(self.arrow_type),
            "map_key_type": None if self.map_key_type is None else str(self.map_key_type),
            "serializer": self.serializer,
            "ttl": self.ttl,
            "typed": self.typed,
            **({"stamped": "typed" if self.stamped_typed else "serialized"} if self.stamped else {}),
        }
        if self.appends:  # only then: files without tails stay as every version 1-4 reader knows them
            out["appends"] = True
        return out


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


# Element types of a typed list state whose lists are written and read through one
# flat NumPy array instead of one Python list per key: NumPy builds these from the
# Python values the state's checks let in (ints, floats, bools), and its tolist()
# gives back the very objects pyarrow's to_pylist() gives. pyarrow's own conversion
# of nested lists costs ~4x as much per element to write and ~3x to read.
_FLAT_LIST_DTYPES: Dict[pa.DataType, Any] = {
    t: t.to_pandas_dtype()
    for t in (
        pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(), pa.uint64(),
        pa.float32(), pa.float64(), pa.bool_(),
    )
}  # fmt: skip
_MAX_LIST_OFFSET = 2**31 - 1  # list<T> has int32 offsets


class GrowingLists(list):  # type: ignore[type-arg]
    """A typed list state's frozen key groups (dicts of key -> array.array) whose arrays
    the running job may still append to: copy-on-write by tail (``state.table``) leaves
    an append made after the freeze in place rather than copying the key's list.

    ``frozen_lengths()`` gives ``{id(array): its length at the freeze}`` for the arrays
    that grew since; the writer calls it after it has read the arrays' bytes (the task
    records a length before the append it stands for, so every append those bytes hold
    is in it; the frozen dicts keep the arrays alive, so no other object has their id).
    ``starts``: in a delta's tails column, per key group, each key's first element to
    write (what the chain's previous file did not hold)."""

    __slots__ = ("frozen_lengths", "starts")

    def __init__(self, groups: Iterable[Any], frozen_lengths: Any, starts: Any = None) -> None:
        super().__init__(groups)
        self.frozen_lengths = frozen_lengths
        self.starts = starts


# bytes.join lets the interpreter go for a join of 1 MiB or more (CPython's GIL_THRESHOLD)
# while it holds the arrays' buffers; an append to an array that exports its buffer fails.
# A join below it holds the interpreter throughout, so no append meets it.
_JOIN_CHUNK_BYTES = (1 << 20) - (1 << 16)


def _array_elements(values: Sequence[Any], dtype: Any) -> Tuple[np.ndarray, np.ndarray]:
    """The lengths of ``values`` (array.arrays the task may append to meanwhile) and
    their elements joined, consistent with each other: read in chunks under
    ``_JOIN_CHUNK_BYTES``, each by one join; a chunk that an append changed between its
    lengths and its join (appends only grow an array) is read again array by array,
    whose ``tobytes`` holds the interpreter whatever the size, as it does for an array
    of a chunk's size alone."""
    n = len(values)
    itemsize = np.dtype(dtype).itemsize
    lens = np.fromiter(map(len, values), np.int64, n)
    ends = np.cumsum(lens) * itemsize
    pieces: List[bytes] = []
    a = 0
    while a < n:
        base = int(ends[a - 1]) if a else 0
        b = max(int(np.searchsorted(ends, base + _JOIN_CHUNK_BYTES, side="right")), a + 1)
        if b == a + 1:
            data = values[a].tobytes()
            lens[a] = len(data) // itemsize
        else:
            chunk = values[a:b]
            data = b"".join(chunk)
            if len(data) != int(lens[a:b].sum()) * itemsize:  # grown since its lengths were read
                parts = [v.tobytes() for v in chunk]  # each array's bytes say its length
                lens[a:b] = [len(p) // itemsize for p in parts]
                data = b"".join(parts)
        pieces.append(data)
        a = b
    # bytes, which nothing changes: one more join may let the interpreter go
    return lens, np.frombuffer(pieces[0] if len(pieces) == 1 else b"".join(pieces), dtype)


def _typed_list_elements(
    values: Sequence[Any], dtype: Any, starts: Optional[np.ndarray], frozen_lengths: Any
) -> Tuple[np.ndarray, np.ndarray]:
    """(lengths, elements) of typed lists held as array.arrays: each array's elements
    from its start (0, or a tail's first element) to its length at the freeze."""
    lens, flat = _array_elements(values, dtype)
    stops = lens
    cuts = frozen_lengths() if frozen_lengths is not None else None
    if cuts and len(values):
        # each value's id looked up among the grown arrays' ids, sorted: no Python call per value
        ids = np.fromiter(map(id, values), np.uint64, len(values))
        cut_ids = np.fromiter(cuts.keys(), np.uint64, len(cuts))
        cut_lens = np.fromiter(cuts.values(), np.int64, len(cuts))
        order = np.argsort(cut_ids)
        cut_ids, cut_lens = cut_ids[order], cut_lens[order]
        at = np.minimum(np.searchsorted(cut_ids, ids), len(cut_ids) - 1)
        hit = cut_ids[at] == ids
        if hit.any():
            stops = lens.copy()
            stops[hit] = np.minimum(cut_lens[at[hit]], lens[hit])
    if starts is None and stops is lens:
        return lens, flat
    begin = np.zeros(len(lens), np.int64) if starts is None else np.minimum(starts, stops)
    kept = stops - begin
    total = int(kept.sum())
    source = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=source[1:])  # each array's first element in flat
    target = np.zeros(len(lens), np.int64)
    np.cumsum(kept[:-1], out=target[1:])
    index = np.arange(total, dtype=np.int64) + np.repeat(source + begin - target, kept)
    return kept, flat[index]


def _all_arrays(values: List[Any], typecode: Optional[str]) -> bool:
    """Whether every value is an array.array of ``typecode`` (one C pass each test)."""
    if typecode is None:
        return False
    if not values:
        return True
    return set(map(type, values)) == {TYPED_LIST} and set(map(_TYPECODE, values)) == {typecode}


_TYPECODE = operator.attrgetter("typecode")


def _flat_lists(
    column: StateColumn, values: List[Any], starts: Optional[List[int]] = None, frozen_lengths: Any = None
) -> Optional[pa.Array]:
    """A typed list state's lists (TOMBSTONE: null) as one ListArray built from a flat
    array, or None where that does not apply (pyarrow converts them then). Lists held
    as array.arrays (``GrowingLists``) are written from ``starts`` (a tail's first
    element, else 0) to their length at the freeze."""
    dtype = _FLAT_LIST_DTYPES.get(column.arrow_type)  # type: ignore[arg-type]
    if dtype is None:
        return None
    # deleted keys (a delta's): null lists of length 0; `in` compares in C, and finds none mostly
    dead = np.fromiter((v is TOMBSTONE for v in values), bool, len(values)) if TOMBSTONE in values else None
    live = values if dead is None else [v for v in values if v is not TOMBSTONE]
    lengths = np.zeros(len(values), np.int64)
    typecode = LIST_TYPECODES.get(column.arrow_type)  # type: ignore[arg-type]
    if _all_arrays(live, typecode):
        live_starts = None
        if starts is not None:
            live_starts = np.asarray(starts, np.int64) if dead is None else np.asarray(starts, np.int64)[~dead]
        live_lengths, elements = _typed_list_elements(live, dtype, live_starts, frozen_lengths)
        lengths[slice(None) if dead is None else ~dead] = live_lengths
        offsets = _offsets(lengths)
        if offsets is None:
            return None  # pyarrow says why it cannot
        flat: Optional[pa.Array] = pa.array(elements, column.arrow_type)
    else:
        if starts is not None:  # tails are only ever recorded for arrays
            raise StateSerializationError(f"state {column.name!r}: list tails of lists not held as arrays")
        if frozen_lengths is not None:  # some arrays among lists: each copied, then cut to the freeze
            copies = [v[:] if type(v) is TYPED_LIST else v for v in live]
            cuts = frozen_lengths()
            live = [c[: cuts[id(v)]] if id(v) in cuts else c for v, c in zip(live, copies, strict=True)]
        lengths[slice(None) if dead is None else ~dead] = np.fromiter(map(len, live), np.int64, len(live))
        offsets = _offsets(lengths)
        if offsets is None:
            return None  # pyarrow says why it cannot
        # a value the state's checks would have refused: None, and pyarrow names it
        flat = _flat_column(itertools.chain.from_iterable(live), int(offsets[-1]), column.arrow_type)
    if flat is None:
        return None
    return pa.ListArray.from_arrays(
        pa.array(offsets.astype(np.int32)),
        flat,
        type=column.storage_type,
        mask=None if dead is None else pa.array(dead),
    )


def _offsets(lengths: np.ndarray) -> Optional[np.ndarray]:
    """A list or map column's offsets (0 and the running sum of ``lengths``), or None
    when its elements outrun the int32 offsets."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return None if int(offsets[-1]) > _MAX_LIST_OFFSET else offsets


def _with_tombstones(child: pa.Array, values: List[Any]) -> List[Any]:
    """``values`` read from ``child``, a null of it (a key a delta deleted) as TOMBSTONE."""
    if not child.null_count:
        return values
    nulls = child.is_null().to_numpy(zero_copy_only=False)
    return [TOMBSTONE if dead else v for v, dead in zip(values, nulls.tolist(), strict=True)]


def _listed(column: StateColumn, child: pa.Array, typed_arrays: bool = False) -> Optional[List[Any]]:
    """A typed list column's values as Python lists (TOMBSTONE for a null) through
    one flat array, or None where that does not apply (to_pylist then). With
    ``typed_arrays`` (a backend's restore), lists of a type in LIST_TYPECODES come
    as array.arrays, each made from its piece of the column's buffer."""
    if _FLAT_LIST_DTYPES.get(column.arrow_type) is None or not len(child):  # type: ignore[arg-type]
        return None
    offsets = child.offsets.to_numpy()
    base, end = int(offsets[0]), int(offsets[-1])
    elements = child.values.slice(base, end - base)
    if elements.null_count:
        return None
    typecode = LIST_TYPECODES.get(column.arrow_type) if typed_arrays else None  # type: ignore[arg-type]
    if typecode is not None:
        return _with_tombstones(child, _typed_lists(elements, offsets - base, typecode))
    # Each key's list made from its own piece of the array: one flat list sliced
    # per key would touch every element object twice, the second time out of cache.
    pieces = np.split(elements.to_numpy(zero_copy_only=False), (offsets[1:-1] - base).tolist())
    return _with_tombstones(child, [piece.tolist() for piece in pieces])


def _typed_lists(elements: pa.Array, offsets: np.ndarray, typecode: str) -> List[Any]:
    """An array.array of ``typecode`` per list, ``offsets`` (from 0) cutting ``elements``."""
    flat = np.ascontiguousarray(elements.to_numpy(zero_copy_only=False))
    data = flat.view(np.uint8).data
    bounds = (offsets * flat.itemsize).tolist()
    lists: List[Any] = []
    append = lists.append
    for a, b in itertools.pairwise(bounds):
        typed = TYPED_LIST(typecode)
        typed.frombytes(data[a:b])
        append(typed)
    return lists


_FLAT_STRINGS = (pa.string(), pa.large_string(), pa.binary(), pa.large_binary())


def _flat_column(elements: Iterator[Any], total: int, arrow_type: pa.DataType) -> Optional[pa.Array]:
    """``total`` elements of a typed list, or of a typed map's keys or values, as one
    Arrow array: numbers and bools through NumPy, strings and bytes through one
    pyarrow conversion of a flat list; None for other types, or a value the state's
    checks would refuse."""
    dtype = _FLAT_LIST_DTYPES.get(arrow_type)
    try:
        if dtype is not None:
            with np.errstate(all="ignore"):  # a float32 out of range becomes inf, as pyarrow makes it
                return pa.array(np.fromiter(elements, dtype, total), arrow_type)
        if arrow_type in _FLAT_STRINGS:
            return pa.array(list(elements), arrow_type)
    except (TypeError, ValueError, OverflowError, pa.ArrowException):
        return None
    return None


def _flat_maps(column: StateColumn, values: List[Any]) -> Optional[pa.Array]:
    """A typed map state's dicts as one MapArray made from a flat array of keys and
    one of values, instead of a list of (key, value) tuples per map for pyarrow to
    convert: ~3x faster. None where it does not apply (a delta's deleted keys, types
    it does not take): pyarrow's conversion then, which also names a bad value."""
    if column.map_key_type is None or column.arrow_type is None or TOMBSTONE in values:
        return None
    if _FLAT_LIST_DTYPES.get(column.arrow_type) is not None and any(None in m.values() for m in values):
        return None  # a None value (put(k, None)): NumPy would make it False or NaN, pyarrow a null
    offsets = _offsets(np.fromiter(map(len, values), np.int64, len(values)))
    if offsets is None:
        return None
    total = int(offsets[-1])
    try:
        keys = _flat_column(itertools.chain.from_iterable(values), total, column.map_key_type)
        items = _flat_column(itertools.chain.from_iterable(map(dict.values, values)), total, column.arrow_type)
    except TypeError:  # not dicts
        return None
    if keys is None or items is None or keys.null_count:
        return None
    return pa.MapArray.from_arrays(pa.array(offsets.astype(np.int32)), keys, items, type=column.storage_type)


def _mapped(column: StateColumn, child: pa.Array) -> Optional[List[Any]]:
    """A typed map column's values as dicts (TOMBSTONE for a null) from its flat keys
    and values, or None where that does not apply (to_pylist then)."""
    if not len(child):
        return None
    offsets = child.offsets.to_numpy()
    base, end = int(offsets[0]), int(offsets[-1])
    entries = child.values.slice(base, end - base)  # the unsliced entries, cut to this slice's
    keys, items = entries.field(0), entries.field(1)
    if keys.null_count or items.null_count:
        return None
    ks = _python_values(keys, column.map_key_type)
    vs = _python_values(items, column.arrow_type)
    bounds = (offsets - base).tolist()
    return _with_tombstones(child, [dict(zip(ks[a:b], vs[a:b], strict=True)) for a, b in itertools.pairwise(bounds)])


def _python_values(array: pa.Array, arrow_type: Optional[pa.DataType]) -> List[Any]:
    if _FLAT_LIST_DTYPES.get(arrow_type) is not None:  # type: ignore[arg-type]
        return array.to_numpy(zero_copy_only=False).tolist()  # type: ignore[no-any-return]
    return array.to_pylist()  # type: ignore[no-any-return]


def to_split_timestamps(timestamps: np.ndarray) -> pa.Array:
    """int64 timestamps as a SPLIT_TIMESTAMPS array."""
    ts = np.asarray(timestamps, np.int64)
    hi = pa.array((ts >> 32).astype(np.int32))
    lo = pa.array(ts.astype(np.uint32))  # the low 32 bits (NumPy's cast wraps)
    return pa.StructArray.from_arrays([hi, lo], fields=list(SPLIT_TIMESTAMPS))


def from_split_timestamps(column: pa.Array) -> pa.Array:
    """A SPLIT_TIMESTAMPS array's timestamps as int64 (a null where the struct is null)."""
    # A row of another state (a union's other child) is null: its halves are filled with
    # 0 to stay integers, and the mask makes the row null again.
    hi, lo = (half.fill_null(0).to_numpy().astype(np.int64) for half in column.flatten())
    ts = (hi << 32) | lo
    mask = column.is_null().to_numpy(zero_copy_only=False) if column.null_count else None
    return pa.array(ts, pa.int64(), mask=mask)


def _value_child(
    column: StateColumn, values: List[Any], starts: Optional[List[int]] = None, frozen_lengths: Any = None
) -> pa.Array:
    """A state's values as its value column's child (``starts`` and ``frozen_lengths``:
    a typed list state's ``GrowingLists``)."""
    try:
        if column.split_timestamps:
            return to_split_timestamps(np.array(values, np.int64))
        if not column.typed:
            dumps = serializer_for("pickle" if column.serializer == "pickle" else "safe").dumps
            if column.kind == "list":  # a typed list's arrays, restored but not declared again: as lists
                values = [v.tolist() if type(v) is TYPED_LIST else v for v in values]
            if column.serializer == "pickle":  # restored pickles not decoded yet: written back as they are
                return pacing.sliced_binary(
                    values,
                    lambda part: [
                        None if v is TOMBSTONE else bytes(v) if type(v) is PickledBytes else dumps(v) for v in part
                    ],
                )
            return pacing.sliced_binary(values, _packed)
        if column.kind == "map":
            flat = _flat_maps(column, values)
            if flat is not None:
                return flat
            return pa.array([None if v is TOMBSTONE else list(v.items()) for v in values], column.storage_type)
        if column.kind == "list":
            flat = _flat_lists(column, values, starts, frozen_lengths)
            if flat is not None:
                return flat
            if frozen_lengths is not None or starts is not None:  # pyarrow would read the arrays as they are now
                raise StateSerializationError(
                    f"cannot snapshot list state {column.name!r}: its lists outrun the int32 offsets of one batch"
                )
        if any(v is TOMBSTONE for v in values):
            values = [None if v is TOMBSTONE else v for v in values]
        return pa.array(values, column.storage_type)
    except (TypeError, ValueError, AttributeError, pickle.PicklingError, pa.ArrowException) as exc:
        error = StateSerializationError(f"cannot snapshot state {column.name!r}: {exc}")
        # the serializer's own refusal says nothing more: this one, naming the state, is the cause
        raise error from (None if isinstance(exc, StateSerializationError) else exc)


def _packed(values: List[Any]) -> List[Any]:
    """``values`` through the safe serializer (MessagePack), a tombstone as None: one
    ``Packer.pack`` per value, called from C (``map``), the very bytes ``packb`` gives."""
    pack = msgpack.Packer(default=_msgpack_default, strict_types=True, use_bin_type=True).pack
    if values.count(TOMBSTONE):  # deltas only: removed keys
        return [None if v is TOMBSTONE else pack(v) for v in values]
    return list(map(pack, values))


def _stamped_child(column: StateColumn, values: List[Any], limit: Optional[int]) -> Tuple[pa.Array, Any]:
    """A stamped state's entries as columns (``stamped.encode_stamped``), an error naming the state."""
    arrow_type = column.arrow_type if column.stamped_typed else None
    if column.kind == "list":  # a typed list's arrays, restored but not declared again: as lists
        values = [v.tolist() if type(v) is TYPED_LIST else v for v in values]
    # the very bytes of the safe serializer's dumps, without its Python frames per call
    dumps = msgpack.Packer(default=_msgpack_default, strict_types=True, use_bin_type=True).pack
    try:
        if len(values) <= pacing.SLICE:
            return encode_stamped(column.kind, arrow_type, column.map_key_type, values, limit, TOMBSTONE, dumps)
        # In slices, pacing between them (an asynchronous part's Python work, see pacing):
        # the slices' columns and row masks put together are the whole one's.
        arrays: List[pa.Array] = []
        masks: List[Any] = []
        for start in range(0, len(values), pacing.SLICE):
            part = values[start : start + pacing.SLICE]
            array, rows = encode_stamped(column.kind, arrow_type, column.map_key_type, part, limit, TOMBSTONE, dumps)
            arrays.append(array)
            masks.append(rows if rows is not None else np.ones(len(part), bool))
            pacing.pace()
        mask = np.concatenate(masks)
        return pa.concat_arrays(arrays), None if mask.all() else mask
    except (TypeError, ValueError, AttributeError, pa.ArrowException) as exc:
        raise StateSerializationError(f"cannot snapshot state {column.name!r}: {exc}") from exc


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


def value_layout(columns: Sequence[StateColumn]) -> Tuple[List[pa.DataType], Optional[List[int]], bool]:
    """The value union's children, each state's child when they are shared, and
    whether the union is sparse.

    Several states of at most ``SPARSE_MAX_CHILDREN`` distinct storage types (the
    common case: a few declared types and binary for untyped states), not counting
    the timers' split timestamps (they were int64, which the states often share; a
    fifth child of null rows costs two zeroed buffers, a dense union 4 bytes a row):
    a sparse union with one child per distinct type, in order of first use, and the
    state -> child map (version 3, or 4 with timers). Otherwise up to
    ``MAX_UNION_CHILDREN`` states: a dense union with one child per state (version
    1, None). More: a dense union with one child per distinct type and the map
    (version 2) — an operator's states are mostly a handful of types, so a union of
    types has room for any number of states. ``ValueError``, naming the limit, when
    even the distinct types are too many, or the states more than the ``state``
    column's int16 holds: ``check_state_count`` says so when the states are declared."""
    types = [c.file_type for c in columns]
    check_state_count(len(columns), types)
    children, child_of = _by_type(types)
    timers = any(t.equals(SPLIT_TIMESTAMPS) for t in children)
    if 1 < len(columns) and len(children) - timers <= SPARSE_MAX_CHILDREN:
        return children, child_of, True
    if len(columns) <= MAX_UNION_CHILDREN:
        return types, None, False
    return children, child_of, False


def _by_type(types: Sequence[pa.DataType]) -> Tuple[List[pa.DataType], List[int]]:
    """The distinct types, in order of first use, and each type's index among them."""
    children: List[pa.DataType] = []
    child_of: List[int] = []
    for t in types:
        for i, known in enumerate(children):
            if known.equals(t):
                child_of.append(i)
                break
        else:
            children.append(t)
            child_of.append(len(children) - 1)
    return children, child_of


def check_state_count(count: int, storage_types: Optional[Sequence[pa.DataType]] = None, *, where: str = "") -> None:
    """Raises ``ValueError`` when ``count`` states (of ``storage_types``, if known)
    cannot share one keyed state file: more than ``MAX_STATES_PER_FILE`` states, or,
    past ``MAX_UNION_CHILDREN`` states, more than ``MAX_UNION_CHILDREN`` distinct
    storage types. A backend can call it as states are registered (``where`` naming
    the operator), so a job is refused when it opens, not at its first checkpoint."""
    who = f"{where}: " if where else ""
    if count > MAX_STATES_PER_FILE:
        raise ValueError(
            f"{who}{count} keyed states in one operator; a keyed state file holds at most {MAX_STATES_PER_FILE} "
            "(its state column is int16): keep related values in one state (a map, or a typed struct)"
        )
    if storage_types is None or count <= MAX_UNION_CHILDREN:
        return
    distinct: List[pa.DataType] = []
    for t in storage_types:
        if not any(known.equals(t) for known in distinct):
            distinct.append(t)
    if len(distinct) > MAX_UNION_CHILDREN:
        raise ValueError(
            f"{who}{count} keyed states of {len(distinct)} distinct Arrow types in one operator; a keyed state file "
            f"with more than {MAX_UNION_CHILDREN} states holds at most {MAX_UNION_CHILDREN} distinct types (an Arrow "
            "union's type codes are int8): declare fewer distinct types, or keep related values in one state"
        )


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


def _run_list(column: Any) -> List[Tuple[int, int, int]]:
    """(value, first row, end row) of each run of a run-end encoded column."""
    ends = column.run_ends.to_numpy(zero_copy_only=False).tolist()
    values = column.values.to_numpy(zero_copy_only=False).tolist()
    if not ends:  # a batch left empty (a stamped state's entries all expired)
        return []
    starts = [0, *ends[:-1]]
    return list(zip(values, starts, ends, strict=True))


@dataclass(frozen=True)
class SchemaInfo:
    """What a state file's schema metadata says about it."""

    backend: str
    max_parallelism: int
    key_groups: KeyGroupRange
    columns: Tuple[StateColumn, ...]
    batches: Tuple[Tuple[int, int, int], ...]  # (first key group, last key group, state) of batches 1..n
    plain_keys: bool = False  # the key column is int64, not a union
    plain_values: bool = False  # the value column is the one state's own, not a union
    value_children: Optional[Tuple[int, ...]] = None  # each state's union child, when shared (version 2)
    split_timers: bool = False  # timers states' timestamps are SPLIT_TIMESTAMPS (version 4)

    def value_child(self, state_index: int) -> int:
        """The value union's child that holds ``state_index``'s values."""
        return state_index if self.value_children is None else self.value_children[state_index]


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
    version = meta.get("version")
    if version not in READ_VERSIONS:
        raise CorruptStateError(
            f"{where} has state file format version {version!r}; this pyengine reads versions "
            f"{', '.join(map(str, READ_VERSIONS))}"
        )
    value_field = schema.field("value").type
    encoding = meta.get("value_encoding")
    plain_values = encoding == "plain"
    value_children: Optional[Tuple[int, ...]] = None
    split_timers = version in (FORMAT_VERSION_SPLIT_TIMERS, FORMAT_VERSION_LIST_TAILS, FORMAT_VERSION_STAMPED) and (
        meta.get("timers_encoding") == "split"
    )
    if version == FORMAT_VERSION_SPLIT_TIMERS and not split_timers:
        raise CorruptStateError(f"{where}: version {version} without its timers encoding")
    if version == FORMAT_VERSION_STAMPED and meta.get("ttl_encoding") != "columns":
        raise CorruptStateError(f"{where}: version {version} without its TTL encoding")
    if version != FORMAT_VERSION and encoding == "union_by_type":
        value_children = _checked_children(meta.get("value_children"), len(meta["states"]), value_field, where)
    elif not plain_values and encoding not in ("union", None):  # absent: a union by state, as always
        raise CorruptStateError(f"{where}: value encoding {encoding!r} is not one of version {version}")
    columns = []
    for c in meta["states"]:
        if c.get("appends") and (c.get("kind") != "list" or not c.get("typed") or version != FORMAT_VERSION_LIST_TAILS):
            raise CorruptStateError(f"{where}: state {c.get('name')!r} holds list tails but is not a typed list state")
    for i, c in enumerate(meta["states"]):
        # The exact declared types are the value union's children, not the metadata's text.
        arrow_type = map_key_type = None
        if c.get("stamped") == "typed" and version == FORMAT_VERSION_STAMPED:
            child = value_field if plain_values else value_field.field(value_children[i] if value_children else i).type
            try:
                arrow_type, map_key_type = declared_types(child, c["kind"])
            except (AttributeError, KeyError, TypeError) as exc:
                raise CorruptStateError(f"{where}: stamped state {c['name']!r} is {child}: {exc}") from None
        elif c.get("typed"):
            child = (
                value_field
                if plain_values
                else value_field.field(i if value_children is None else value_children[i]).type
            )
            if c["kind"] == "list":
                arrow_type = child.value_type
            elif c["kind"] == "map":
                arrow_type, map_key_type = child.item_type, child.key_type
            elif split_timers and c["kind"] == "timers":
                if not child.equals(SPLIT_TIMESTAMPS):
                    raise CorruptStateError(f"{where}: timers state {c['name']!r} is {child}, not split timestamps")
                arrow_type = pa.int64()
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
                declared=(c.get("map_key_type"), c.get("type")),
                appends=version in (FORMAT_VERSION_LIST_TAILS, FORMAT_VERSION_STAMPED)
                and bool(c.get("appends", False)),
                ttl_columns=version == FORMAT_VERSION_STAMPED and c.get("stamped") in ("typed", "serialized"),
            )
        )
    start, end = meta["key_groups"]
    return SchemaInfo(
        backend=meta["backend"],
        max_parallelism=int(meta["max_parallelism"]),
        key_groups=KeyGroupRange(int(start), int(end)),
        columns=tuple(columns),
        plain_keys=meta.get("key_encoding") == "int64",
        plain_values=plain_values,
        batches=tuple((int(b[0]), int(b[1]), int(b[2])) for b in meta["batches"]),
        value_children=value_children,
        split_timers=split_timers,
    )


def _checked_children(raw: Any, count: int, value_field: pa.DataType, where: str) -> Tuple[int, ...]:
    """A version 2 file's state -> union child map, refused unless it names a child
    of the value union for every state."""
    num_children = value_field.num_fields if pa.types.is_union(value_field) else 0
    if not isinstance(raw, list) or len(raw) != count or not all(type(c) is int and 0 <= c < num_children for c in raw):
        raise CorruptStateError(f"{where}: its value_children do not map each state to a child of the value union")
    return tuple(raw)


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
