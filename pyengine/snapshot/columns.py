"""The columns of a keyed state file (see ``format.py``): the key column's encoder and each
state's value encoders and decoders — values, typed lists (whole or as tails) and maps as flat
Arrow arrays, split timer timestamps, TTL states as stamped columns. Apart from the writer
and the reader so that both share one definition of every column's layout.
"""

from __future__ import annotations

import itertools
import operator
import pickle
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import msgpack
import numpy as np
import pyarrow as pa

from ..state.serializers import (
    LIST_TYPECODES,
    TYPED_LIST,
    PickledBytes,
    StateSerializationError,
    serializer_for,
)
from ..state.serializers import _default as _msgpack_default
from . import pacing
from .format import (
    _INT64_MAX,
    _INT64_MIN,
    _KEY_INT,
    _KEY_PACKED,
    _KEY_STR,
    _KEY_TYPE,
    _SAFE,
    SPLIT_TIMESTAMPS,
    TOMBSTONE,
    StateColumn,
)
from .stamped import encode_stamped

__all__ = ["GrowingLists", "from_split_timestamps", "to_split_timestamps"]


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
