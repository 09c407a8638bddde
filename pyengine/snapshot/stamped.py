"""Stamped (time-to-live) entries of a state, as columns (state file version 6).

A TTL state stores every entry with its last write (or read) time: a value as a
``(value, stamp)`` tuple, a list as a ``StampedList`` (values and stamps in two
parallel lists; restored or copied lists may be lists of tuples), a map as a dict of
``user key -> (value, stamp)``. Up to version 4 a snapshot wrote each entry with its
stamps through the safe serializer (a list's elements made into (value, stamp) tuples
one by one, each tuple an extension type of the serializer's, and the expired ones
filtered in Python), holding the interpreter the task needs: the issue #43
sessionizer's asynchronous part took 3.4-4.1x the CPU of the same state without TTL.
With declared types the entries are written as Arrow columns, built in bulk:

* value, reducing, aggregating: ``struct<value: T, stamp: int64>``;
* list: ``list<struct<value: T, stamp: int64>>``;
* map: ``map<K, struct<value: V, stamp: int64>>``.

Without declared types the values are serialized as a state without TTL serializes
them, one call per key, and the stamps are columns beside them:

* value, reducing, aggregating: ``struct<value: binary, stamp: int64>``;
* list: ``struct<values: binary, stamps: list<int64>>`` (the list of values, serialized);
* map: ``struct<entries: binary, stamps: list<int64>>`` (the dict of user key -> value,
  serialized; the stamps in its order, which the serializer keeps).

The stamps become one int64 array, and the entries that expired by the snapshot's
``limit`` (stamps at or below it) are left out with NumPy masks: no Python call per
element. What remains per element is the C loops of ``zip``, ``itertools`` and the
Arrow conversion of the values.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from .._native import StampedList

__all__ = [
    "STAMP_FIELD",
    "VALUE_FIELD",
    "StampError",
    "decode_stamped",
    "declared_types",
    "encode_stamped",
    "serialized_type",
    "stamped_type",
]

VALUE_FIELD = "value"
STAMP_FIELD = "stamp"
_STAMP_LISTS = pa.list_(pa.field("item", pa.int64(), nullable=False))
_MAX_OFFSET = 2**31 - 1  # list<T> and map<K, V> have int32 offsets
_values_of = operator.attrgetter("values")
_second = operator.itemgetter(1)
_stamps_of = operator.attrgetter("stamps")


class StampError(ValueError):
    """A stamp that is not an int64 (a TTL clock must give int milliseconds)."""


def entry_type(arrow_type: pa.DataType) -> pa.DataType:
    """One stamped entry: its value (null for a None value) and its stamp."""
    return pa.struct([pa.field(VALUE_FIELD, arrow_type), pa.field(STAMP_FIELD, pa.int64(), nullable=False)])


def serialized_type(kind: str) -> pa.DataType:
    """The file type of a stamped state of ``kind`` without declared types."""
    if kind == "list":
        return pa.struct([pa.field("values", pa.binary()), pa.field("stamps", _STAMP_LISTS)])
    if kind == "map":
        return pa.struct([pa.field("entries", pa.binary()), pa.field("stamps", _STAMP_LISTS)])
    return entry_type(pa.binary())


def stamped_type(kind: str, arrow_type: Optional[pa.DataType], map_key_type: Optional[pa.DataType]) -> pa.DataType:
    """The file type of a stamped state of ``kind`` with the declared types (None:
    serialized values)."""
    if arrow_type is None or (kind == "map" and map_key_type is None):
        return serialized_type(kind)
    if kind == "list":
        return pa.list_(entry_type(arrow_type))
    if kind == "map":
        assert map_key_type is not None
        return pa.map_(map_key_type, entry_type(arrow_type))
    return entry_type(arrow_type)


def declared_types(file_type: pa.DataType, kind: str) -> Tuple[Optional[pa.DataType], Optional[pa.DataType]]:
    """(value or element type, map key type) of a typed stamped state's file type."""
    if kind == "list":
        return file_type.value_type.field(VALUE_FIELD).type, None
    if kind == "map":
        return file_type.item_type.field(VALUE_FIELD).type, file_type.key_type
    return file_type.field(VALUE_FIELD).type, None


def _stamps(stamps: List[Any]) -> np.ndarray:
    """Stamps as int64, in one C pass (~10 ns a stamp; ``np.asarray`` of Python ints
    without a dtype costs 6x). Stamps are the backend's int milliseconds (a custom TTL
    clock's floats are rounded up where it is read); anything else is refused."""
    try:
        return np.array(stamps, np.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise StampError(f"TTL stamps must be int milliseconds within int64: {exc}") from None


def _entries(values: Any, stamps: np.ndarray, arrow_type: pa.DataType) -> pa.StructArray:
    return pa.StructArray.from_arrays(
        [pa.array(values, arrow_type), pa.array(stamps, pa.int64())],
        fields=list(entry_type(arrow_type)),
    )


def _live_counts(keep: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per list (``offsets`` cutting ``keep``), how many elements it keeps."""
    running = np.zeros(len(keep) + 1, np.int64)
    np.cumsum(keep, out=running[1:])
    return running[offsets[1:]] - running[offsets[:-1]]


def encode_stamped(
    kind: str,
    arrow_type: Optional[pa.DataType],
    map_key_type: Optional[pa.DataType],
    values: List[Any],
    limit: Optional[int],
    tombstone: Any,
    dumps: Callable[[Any], bytes],
) -> Tuple[pa.Array, Optional[np.ndarray]]:
    """Stored stamped entries (``tombstone``: a deleted key, a null) as the column of
    ``stamped_type``, without what expired at ``limit`` (stamps at or below it; None:
    keep everything), and which rows (keys) remain: None when all do, else a bool
    mask over ``values`` (a key all of whose entries expired is left out). Without
    declared types (``arrow_type`` None) values go through ``dumps``, one call per key."""
    n = len(values)
    dead = np.fromiter((v is tombstone for v in values), bool, n) if tombstone in values else None
    live = values if dead is None else list(itertools.compress(values, ~dead))
    typed = arrow_type is not None and (kind != "map" or map_key_type is not None)
    if kind == "list":
        if not typed:
            return _encode_serialized(kind, values, live, dead, limit, dumps)
        assert arrow_type is not None
        return _encode_lists(arrow_type, values, live, dead, limit)
    if kind == "map":
        if not typed:
            return _encode_serialized(kind, values, live, dead, limit, dumps)
        assert arrow_type is not None and map_key_type is not None
        return _encode_maps(arrow_type, map_key_type, values, live, dead, limit)
    # value, reducing, aggregating: one (value, stamp) per key
    vs, ss = (list(c) for c in zip(*live, strict=True)) if live else ([], [])
    stamps = _stamps(ss)
    full = np.zeros(n, np.int64)
    full[slice(None) if dead is None else ~dead] = stamps
    vals: List[Any] = vs
    if dead is not None:
        it = iter(vs)
        vals = [None if d else next(it) for d in dead.tolist()]
    rows = None if limit is None else full > limit
    if dead is not None and rows is not None:
        rows |= dead  # a deletion stays (a delta's tombstone)
    if rows is not None and not rows.all():
        vals = list(itertools.compress(vals, rows))
        full = full[rows]
        dead = None if dead is None else dead[rows]
    else:
        rows = None
    if not typed:
        vals = [None if v is None and d else dumps(v) for v, d in zip(vals, _flags(dead, len(vals)), strict=True)]
    value_type = arrow_type if typed and arrow_type is not None else pa.binary()
    column = pa.StructArray.from_arrays(
        [pa.array(vals, value_type), pa.array(full, pa.int64())],
        fields=list(entry_type(value_type)),
        mask=None if dead is None else pa.array(dead),
    )
    return column, rows


def _flags(dead: Optional[np.ndarray], n: int) -> Any:
    return itertools.repeat(False, n) if dead is None else dead.tolist()


def _encode_serialized(
    kind: str,
    values: List[Any],
    live: List[Any],
    dead: Optional[np.ndarray],
    limit: Optional[int],
    dumps: Callable[[Any], bytes],
) -> Tuple[pa.Array, Optional[np.ndarray]]:
    """A list's values (a map's dict of user key -> value) serialized per key, as a
    state without TTL writes them, and their stamps as a list<int64> column built in
    bulk; a container with expired elements is cut before it is serialized."""
    pieces: List[Any]
    if kind == "list":
        pieces = [v.values if type(v) is StampedList else [e[0] for e in v] for v in live]
        stamp_lists = [v.stamps if type(v) is StampedList else [e[1] for e in v] for v in live]
    else:
        pieces = [{u: e[0] for u, e in m.items()} for m in live]
        stamp_lists = [list(map(_second, m.values())) for m in live]
    lengths = np.fromiter(map(len, live), np.int64, len(live))
    offsets = _offsets(lengths)
    stamps = _stamps(list(itertools.chain.from_iterable(stamp_lists)))
    counts = lengths
    if limit is not None:
        keep = stamps > limit
        if not keep.all():
            counts = _live_counts(keep, offsets)
            bounds = offsets.tolist()
            for i in np.nonzero(counts != lengths)[0].tolist():  # only the keys with something expired
                cut = keep[bounds[i] : bounds[i + 1]].tolist()
                if kind == "list":
                    pieces[i] = list(itertools.compress(pieces[i], cut))
                else:
                    pieces[i] = dict(itertools.compress(pieces[i].items(), cut))
            stamps = stamps[keep]
    rows, row_counts = _rows_kept(counts, len(values), dead, limit)
    blobs: List[Optional[bytes]] = [dumps(p) for p in pieces]
    if dead is not None:
        it = iter(blobs)
        blobs = [None if d else next(it) for d in dead.tolist()]
    return _serialized_column(kind, blobs, rows, row_counts, stamps, dead)


def _serialized_column(
    kind: str,
    blobs: List[Optional[bytes]],
    rows: Optional[np.ndarray],
    row_counts: np.ndarray,
    stamps: np.ndarray,
    dead: Optional[np.ndarray],
) -> Tuple[pa.Array, Optional[np.ndarray]]:
    if rows is not None:
        blobs = list(itertools.compress(blobs, rows.tolist()))
        dead = None if dead is None else dead[rows]
    stamp_lists = pa.ListArray.from_arrays(
        pa.array(_offsets(row_counts).astype(np.int32)), pa.array(stamps, pa.int64()), type=_STAMP_LISTS
    )
    column = pa.StructArray.from_arrays(
        [pa.array(blobs, pa.binary()), stamp_lists],
        fields=list(serialized_type(kind)),
        mask=None if dead is None else pa.array(dead),
    )
    return column, rows


def _flat_lists(live: List[Any]) -> Tuple[np.ndarray, List[Any], np.ndarray]:
    """(lengths, flat values, flat stamps) of stamped lists: a StampedList's two lists
    as they are, a list of (value, stamp) pairs through ``zip``."""
    lengths = np.fromiter(map(len, live), np.int64, len(live))
    if all(type(v) is StampedList for v in live):
        flat_values = list(itertools.chain.from_iterable(map(_values_of, live)))
        return lengths, flat_values, _stamps(list(itertools.chain.from_iterable(map(_stamps_of, live))))
    flat_values, flat_stamps = [], []
    for v in live:
        if type(v) is StampedList:
            flat_values.extend(v.values)
            flat_stamps.extend(v.stamps)
        elif v:
            vs, ss = zip(*v, strict=True)
            flat_values.extend(vs)
            flat_stamps.extend(ss)
    return lengths, flat_values, _stamps(flat_stamps)


def _offsets(lengths: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if int(offsets[-1]) > _MAX_OFFSET:
        raise ValueError(f"{int(offsets[-1]):,} stamped elements in one batch: more than int32 offsets hold")
    return offsets


def _rows_kept(
    counts: np.ndarray, n: int, dead: Optional[np.ndarray], limit: Optional[int]
) -> Tuple[Optional[np.ndarray], np.ndarray]:
    """(rows kept or None for all, each kept row's element count, deleted rows 0)."""
    full = np.zeros(n, np.int64)
    full[slice(None) if dead is None else ~dead] = counts
    if limit is None:
        return None, full
    rows = full > 0
    if dead is not None:
        rows |= dead
    if rows.all():
        return None, full
    return rows, full[rows]


def _encode_lists(
    arrow_type: pa.DataType, values: List[Any], live: List[Any], dead: Optional[np.ndarray], limit: Optional[int]
) -> Tuple[pa.Array, Optional[np.ndarray]]:
    lengths, flat_values, stamps = _flat_lists(live)
    offsets = _offsets(lengths)
    counts = lengths
    if limit is not None:
        keep = stamps > limit
        if not keep.all():
            counts = _live_counts(keep, offsets)
            flat_values = list(itertools.compress(flat_values, keep))
            stamps = stamps[keep]
    rows, row_counts = _rows_kept(counts, len(values), dead, limit)
    mask = dead if rows is None or dead is None else dead[rows]
    column = pa.ListArray.from_arrays(
        pa.array(_offsets(row_counts).astype(np.int32)),
        _entries(flat_values, stamps, arrow_type),
        type=pa.list_(entry_type(arrow_type)),
        mask=None if mask is None else pa.array(mask),
    )
    return column, rows


def _encode_maps(
    arrow_type: pa.DataType,
    key_type: pa.DataType,
    values: List[Any],
    live: List[Any],
    dead: Optional[np.ndarray],
    limit: Optional[int],
) -> Tuple[pa.Array, Optional[np.ndarray]]:
    lengths = np.fromiter(map(len, live), np.int64, len(live))
    offsets = _offsets(lengths)
    user_keys = list(itertools.chain.from_iterable(live))
    entries = list(itertools.chain.from_iterable(map(dict.values, live)))
    vs, ss = (list(c) for c in zip(*entries, strict=True)) if entries else ([], [])
    stamps = _stamps(ss)
    counts = lengths
    if limit is not None:
        keep = stamps > limit
        if not keep.all():
            counts = _live_counts(keep, offsets)
            user_keys = list(itertools.compress(user_keys, keep))
            vs = list(itertools.compress(vs, keep))
            stamps = stamps[keep]
    rows, row_counts = _rows_kept(counts, len(values), dead, limit)
    mask = dead if rows is None or dead is None else dead[rows]
    column = pa.MapArray.from_arrays(
        pa.array(_offsets(row_counts).astype(np.int32)),
        pa.array(user_keys, key_type),
        _entries(vs, stamps, arrow_type),
        type=pa.map_(key_type, entry_type(arrow_type)),
        mask=None if mask is None else pa.array(mask),
    )
    return column, rows


def decode_stamped(kind: str, child: pa.Array, tombstone: Any, loads: Optional[Callable[[bytes], Any]]) -> List[Any]:
    """A stamped column's rows as the entries a heap state stores (``tombstone`` for a
    null): ``(value, stamp)`` tuples, StampedLists, dicts of ``(value, stamp)``.
    ``loads``: the serializer of a state without declared types (None: typed)."""
    if not len(child):
        return []
    nulls = child.is_null().to_numpy(zero_copy_only=False).tolist() if child.null_count else None
    out: List[Any]
    if loads is not None and kind in ("list", "map"):
        blobs, stamp_lists = child.flatten()
        offsets = stamp_lists.offsets.to_numpy()
        base = int(offsets[0])
        flat = stamp_lists.values.slice(base, int(offsets[-1]) - base).to_numpy(zero_copy_only=False).tolist()
        bounds = (offsets - base).tolist()
        out = []
        append = out.append
        for blob, a, b in zip(blobs.to_pylist(), bounds, bounds[1:], strict=False):
            if blob is None:
                append(None)
                continue
            decoded = loads(blob)
            if kind == "list":
                stamped = StampedList()
                stamped.values.extend(decoded)
                stamped.stamps.extend(flat[a:b])
                append(stamped)
            else:
                append(dict(zip(decoded, zip(decoded.values(), flat[a:b], strict=True), strict=True)))
    elif kind == "list" or kind == "map":
        offsets = child.offsets.to_numpy()
        base, end = int(offsets[0]), int(offsets[-1])
        flat_entries = child.values.slice(base, end - base)
        if kind == "map":
            user_keys = flat_entries.field(0).to_pylist()
            flat_entries = flat_entries.field(1)
        value_array, stamp_array = flat_entries.flatten()
        vs = value_array.to_pylist()
        ss = stamp_array.to_numpy(zero_copy_only=False).tolist()
        bounds = (offsets - base).tolist()
        out = []
        append = out.append
        for a, b in itertools.pairwise(bounds):
            if kind == "map":
                append(dict(zip(user_keys[a:b], zip(vs[a:b], ss[a:b], strict=True), strict=True)))
            else:
                stamped = StampedList()
                stamped.values.extend(vs[a:b])
                stamped.stamps.extend(ss[a:b])
                append(stamped)
    else:
        value_array, stamp_array = child.flatten()
        vs = value_array.to_pylist()
        if loads is not None:
            vs = [None if v is None else loads(v) for v in vs]
        out = list(zip(vs, stamp_array.fill_null(0).to_numpy().tolist(), strict=True))
    if nulls is not None:
        out = [tombstone if d else v for v, d in zip(out, nulls, strict=True)]
    return out
