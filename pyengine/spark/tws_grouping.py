"""The ``transformWithState`` adapter's grouping of a micro-batch by key, in bulk.

With Spark's semantics a processor gets each key's rows of a micro-batch in one call,
so the adapter groups a whole batch at once: where the keys are ints, NumPy sorts them
(stable: a key's rows keep their arrival order) and the rows are reordered as arrays
(Arrow's ``take``, pandas') and cut in one slice per key,
with no Python step per row. ``tws`` (the operator) uses these; what does not fit
(other key types, few rows) keeps its per-row grouping there."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

__all__: List[str] = []

_BULK_MIN = 64  # fewer rows than this: the dict append is cheaper than NumPy's set-up


def _order(keys: List[Any]) -> Optional[Tuple[Any, List[Any], List[int], List[int]]]:
    """A micro-batch's int keys grouped in bulk, as ``(order, uniques, starts, ends)``:
    ``order`` the rows' positions sorted by key (stable: a key's rows stay in arrival
    order), the keys in order of first arrival, and each key's slice of the sorted
    rows. NumPy sorts (a radix sort when the keys span less than 2**16), so the rows
    are reordered as arrays (Arrow's ``take``, pandas') rather than object by object.
    ``None`` for what it cannot take exactly: other key types
    (bool is not int here), ints beyond 64 bits, few rows."""
    if len(keys) < _BULK_MIN or set(map(type, keys)) != {int}:
        return None
    try:
        array = np.array(keys, dtype=np.int64)
    except OverflowError:
        return None
    low, high = int(array.min()), int(array.max())
    if high - low < 1 << 16:  # NumPy's stable sort is a radix sort on 16 bits: linear
        array = (array - low).astype(np.uint16)
    order = np.argsort(array, kind="stable")
    ordered = array[order]
    starts = np.flatnonzero(np.diff(ordered)) + 1
    starts = np.concatenate(([0], starts))
    ends = np.append(starts[1:], len(ordered))
    arrival = np.argsort(order[starts], kind="stable")  # a key's first row is its slice's first
    starts, ends = starts[arrival], ends[arrival]
    uniques = [keys[i] for i in order[starts].tolist()]
    return order, uniques, starts.tolist(), ends.tolist()


def _slices(ordered: List[Any], keys: List[Any], starts: List[int], ends: List[int]) -> List[Tuple[Any, Any]]:
    """``(key, bucket)`` per key: its rows' slice of ``ordered``, a key with one row
    that row alone (the shape ``_bucket`` gives)."""
    return [(key, ordered[a] if b - a == 1 else ordered[a:b]) for key, a, b in zip(keys, starts, ends, strict=True)]


def _frames_by_key(df: Any, keys: List[Any]) -> List[Tuple[Any, List[Any]]]:
    """One DataFrame per key (its rows in arrival order, keys in order of first
    arrival, each indexed 0..n-1 as Spark's): the frame sorted once by key (a stable
    sort keeps arrival order) and cut in slices, not a ``take`` per key (half the cost)."""
    import pandas as pd

    codes, uniques = pd.factorize(pd.Series(keys, dtype=object))
    order = np.argsort(codes, kind="stable")
    counts = np.bincount(codes)
    ends = np.cumsum(counts).tolist()
    starts = [0, *ends[:-1]]
    return _cut(df.take(order), list(uniques), starts, ends)


def _cut(ordered: Any, keys: List[Any], starts: List[int], ends: List[int]) -> List[Tuple[Any, List[Any]]]:
    """The frame sorted by key, cut in one frame per key, each indexed 0..n-1 (Spark's).
    Each is a copy (``reset_index``): a view of the sorted frame given a new index costs
    a third as much, but pandas then warns (``SettingWithCopyWarning``) when the
    processor assigns to its frame, which a frame of its own never does."""
    return [(key, [ordered.iloc[a:b].reset_index(drop=True)]) for key, a, b in zip(keys, starts, ends, strict=True)]
