"""Columnar storage for typed value state: the fast path behind ``type=pa.int64()``.

A value state whose descriptor declares a fixed-width Arrow type (integers,
floats, bool) and has no time-to-live is stored per key group as int64 keys and
NumPy values (``pyengine._native.ColumnarGroup``): a snapshot writes those arrays
as they are, restore loads Arrow columns straight into them, and vectorised code
reads and writes many keys per call. Keys must be ints within int64; the first
other key turns the state into ordinary (dict) storage, transparently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, NamedTuple, Optional, Set

import numpy as np
import pyarrow as pa

from .. import _native
from ..errors import NonRetryableError
from .descriptors import StateDescriptor, ValueStateDescriptor
from .keygroups import key_groups_of_int64

if TYPE_CHECKING:
    from ..snapshot.writer import ColumnarChanges

__all__ = ["ColumnarValueState", "ColumnarValueTable", "KeySplit", "NoCurrentKeyError", "columnar_dtype"]

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_MISSING = object()
_MERGED_NATIVELY = (np.dtype(np.int64), np.dtype(np.float64))  # merge_groups: every key group in one C call


class NoCurrentKeyError(NonRetryableError, RuntimeError):
    """Keyed state (or a timer) was used with no current key: in a function, outside the
    calls that have one (``open``, ``close``, a broadcast element); on a backend, before
    ``set_current_key``. No restart changes that, so the job fails at once. Defined here,
    below ``heap`` (which re-exports it), so that ``heap`` -> ``columnar`` is the only
    direction."""


# What to do, said by every NoCurrentKeyError: a function's author rarely calls set_current_key.
NO_KEY_HINT = (
    "keyed state and timers belong to the key of the record or timer being processed: use them in "
    "process_element or on_timer (a Spark processor: handleInputRows or handleExpiredTimer), not in open(), "
    "close() or init(); a state backend used on its own needs set_current_key() first"
)


def columnar_dtype(descriptor: StateDescriptor) -> Optional[np.dtype]:
    """The NumPy dtype a value state is stored in columnar, or None if it is not eligible."""
    if not isinstance(descriptor, ValueStateDescriptor) or descriptor.ttl is not None:
        return None
    if descriptor.serializer != "safe" or descriptor.type is None:
        return None
    t = descriptor.type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return np.dtype(t.to_pandas_dtype())
    return None


class ColumnarValueTable:
    """Same role as ``table.StateTable``, for one columnar value state."""

    def __init__(self, descriptor: StateDescriptor, num_key_groups: int, dtype: np.dtype) -> None:
        self.descriptor = descriptor
        self.dtype = dtype
        self.groups = [_native.ColumnarGroup(dtype) for _ in range(num_key_groups)]
        self.active_snapshots = 0
        self.pickled = False
        self.tracking = False  # recording changes for incremental checkpoints (in the groups, natively)

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)

    def iter_keys(self) -> Iterator[Any]:
        for group in self.groups:
            yield from group.arrays()[0].tolist()

    def freeze(self) -> List[Any]:
        """Synchronous part of a snapshot: the arrays as they are, shared from now on."""
        from ..snapshot.writer import ColumnarSlice

        frozen = [ColumnarSlice(*group.freeze()) for group in self.groups]
        self.active_snapshots += 1
        return frozen

    def track_changes(self) -> None:
        """From now on every group records what is written and removed, for ``take_changes``."""
        for group in self.groups:
            group.track_changes()
        self.tracking = True

    def take_changes(self) -> ColumnarChanges:
        """The entries written and the keys removed since the last take (or since
        tracking began), and starts a new log."""
        from ..snapshot.writer import ColumnarChanges

        return ColumnarChanges(*_native.take_changes(self.groups))

    def pending_key_sets(self) -> List[Set[Any]]:
        """The keys changed since the last take, per group, as sets (the dict storage's log)."""
        return self.take_changes().key_sets()

    def freeze_changes(self, touched: List[Set[Any]]) -> ColumnarChanges:
        """The entries of the given changed keys (an incremental delta over several
        change logs), gathered now, while nothing writes."""
        from ..snapshot.writer import ColumnarChanges

        self.active_snapshots += 1
        return ColumnarChanges(*_native.gather_changes(self.groups, touched))

    def freeze_taken(self, changes: ColumnarChanges) -> ColumnarChanges:
        """An incremental delta that is exactly one change log, already gathered."""
        self.active_snapshots += 1
        return changes

    def release(self) -> None:
        self.active_snapshots -= 1
        if self.active_snapshots == 0:
            for group in self.groups:
                group.shared = False

    def to_dicts(self) -> List[Dict[Any, Any]]:
        out = []
        for group in self.groups:
            keys, values = group.arrays()
            out.append(dict(zip(keys.tolist(), values.tolist(), strict=True)))
        return out

    def load(self, index: int, keys: pa.Array, values: pa.Array) -> None:
        """Restores a batch of entries into key group ``index`` (nulls delete)."""
        group = self.groups[index]
        k = keys.to_numpy(zero_copy_only=False)
        if values.null_count:
            deleted = np.asarray(values.is_null())
            for key in k[deleted].tolist():
                group.remove(key)
            k = k[~deleted]
            values = values.filter(pa.array(~deleted))
        group.put_many(k, values.to_numpy(zero_copy_only=False))


class ColumnarValueState(_native.ColumnarValueCalls):
    """A value state in columns; the same interface as ``values.ValueState``, plus
    ``update_many``/``get_many`` for many keys at once.

    ``value``, ``update`` and ``clear`` are ``_native.ColumnarValueCalls``'s: one C
    path for an int key within int64 with a current key set (a record's state calls
    cost 0.13-0.16 us each in Python, most of it the checks around one map probe).
    Everything else comes here, to the ``_slow`` methods."""

    def __init__(self, backend: Any, table: ColumnarValueTable, check: Any) -> None:
        default = table.descriptor.default  # type: ignore[attr-defined]
        if default is not None and check is not None:
            default = check(default)  # as stored: a float column's int default reads as a float
        # The int64 column's check is int64's range: the C path skips it for an int that fits.
        int64_checked = check is not None and table.dtype == np.dtype(np.int64)
        super().__init__(backend, table.groups, default, check, int64_checked)
        self._backend = backend
        self._table = table
        self._default = default
        self._check = check

    @property
    def name(self) -> str:
        return self._table.descriptor.name

    def _group(self) -> Any:
        b = self._backend
        key = b._key
        if b._key_index < 0:
            raise NoCurrentKeyError(f"state {self.name!r} was used with no current key: {NO_KEY_HINT}")
        if type(key) is not int or not _INT64_MIN <= key <= _INT64_MAX:
            self._fallback = self._backend._columnar_to_dict(self.name)
            return None
        return self._table.groups[b._key_index]

    def _value_slow(self) -> Any:
        if self._fallback is None:
            group = self._group()
            if group is not None:
                v = group.get(self._backend._key, _MISSING)
                return self._default if v is _MISSING else v
        return self._fallback.value()

    def _update_slow(self, value: Any) -> None:
        if self._fallback is None:
            group = self._group()
            if group is not None:
                if self._check is not None:
                    value = self._check(value)
                group.put(self._backend._key, value)
                return
        self._fallback.update(value)

    def _clear_slow(self) -> None:
        if self._fallback is None:
            group = self._group()
            if group is not None:
                group.remove(self._backend._key)
                return
        self._fallback.clear()

    def split_keys(self, keys: Any) -> KeySplit:
        """Sorts int64 keys by key group once, for several ``*_many`` calls on the same keys."""
        keys = np.ascontiguousarray(keys, dtype=np.int64)
        start = self._backend.key_group_range.start
        groups = key_groups_of_int64(keys, self._backend.max_parallelism) - start
        if len(groups) and (groups.min() < 0 or groups.max() >= len(self._table.groups)):
            raise ValueError(f"state {self.name!r}: some keys are outside this backend's key groups")
        order = np.argsort(groups, kind="stable")
        bounds = np.searchsorted(groups[order], np.arange(len(self._table.groups) + 1))
        active = np.nonzero(np.diff(bounds))[0].tolist()
        return KeySplit(keys, order, bounds, keys[order], active)

    def _columnar(self, what: str) -> None:
        if self._fallback is not None:
            raise TypeError(f"state {self.name!r} holds non-int keys; {what} needs columnar state")

    def update_many(self, keys: Any, values: Any, split: Optional[KeySplit] = None) -> None:
        """Sets the values of many int64 keys at once (no Python call per key)."""
        self._columnar("update_many")
        sp = split if split is not None else self.split_keys(keys)
        values = np.asarray(values, dtype=self._table.dtype)[sp.order]
        for index in sp.active:
            a, b = sp.bounds[index], sp.bounds[index + 1]
            self._table.groups[index].put_many(sp.sorted_keys[a:b], values[a:b])

    def merge_many(self, keys: Any, values: Any, how: str, split: Optional[KeySplit] = None) -> Any:
        """Folds values into many distinct int64 keys ("add", "min" or "max"; a missing
        key takes its value) and returns the new values, in the order of ``keys``."""
        self._columnar("merge_many")
        sp = split if split is not None else self.split_keys(keys)
        values = np.asarray(values, dtype=self._table.dtype)[sp.order]
        if self._table.dtype in _MERGED_NATIVELY:
            merged = _native.merge_groups(self._table.groups, sp.sorted_keys, values, sp.bounds, sp.active, how)
        else:
            merged = np.empty(len(sp.keys), self._table.dtype)
            for index in sp.active:
                a, b = sp.bounds[index], sp.bounds[index + 1]
                merged[a:b] = self._table.groups[index].merge_many(sp.sorted_keys[a:b], values[a:b], how)
        out = np.empty_like(merged)
        out[sp.order] = merged
        return out

    def get_many(self, keys: Any, split: Optional[KeySplit] = None) -> Any:
        """(found, values) arrays for many int64 keys; values are 0 where not found."""
        self._columnar("get_many")
        sp = split if split is not None else self.split_keys(keys)
        found = np.zeros(len(sp.keys), bool)
        values = np.zeros(len(sp.keys), self._table.dtype)
        for index in sp.active:
            a, b = sp.bounds[index], sp.bounds[index + 1]
            f, v = self._table.groups[index].get_many(sp.sorted_keys[a:b])
            found[sp.order[a:b]], values[sp.order[a:b]] = f, v
        return found, values


class KeySplit(NamedTuple):
    """Keys sorted by key group: ``sorted_keys[bounds[g]:bounds[g + 1]]`` are group g's."""

    keys: np.ndarray
    order: np.ndarray
    bounds: np.ndarray
    sorted_keys: np.ndarray
    active: List[int]
