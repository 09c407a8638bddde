"""The heap keyed state backend: state in dictionaries, one per key group.

Per state there is one dict per key group (user key -> value), so a snapshot can
freeze state at key-group granularity: the synchronous part of a snapshot only
marks every key group *shared* (O(number of key groups), never O(state)), and
the first write to a shared key group copies that key group's dict. Containers
the backend owns (the lists of list state, the dicts of map state) are copied
the first time they are changed after a freeze, and a mutable value read from a
shared key group is deep-copied before the caller gets it, so nothing a job
does after the synchronous part can change what the snapshot writes.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np
import pyarrow as pa

from .._native import int_key_group as _int_key_group
from .columnar import NoCurrentKeyError
from .descriptors import (
    AggregatingStateDescriptor,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateTtlConfig,
    StateVisibility,
    TtlUpdateType,
    ValueStateDescriptor,
)
from .keygroups import DEFAULT_MAX_PARALLELISM, KeyGroupRange, assign_to_key_group, check_parallelism

__all__ = ["HeapKeyedStateBackend", "NoCurrentKeyError", "StateTable"]

_ABSENT = object()
_ATOMIC = (int, float, str, bytes, bool, type(None))


def _is_immutable(value: Any) -> bool:
    t = type(value)
    if t in _ATOMIC:
        return True
    return t is tuple and all(_is_immutable(v) for v in value)


def _validator(arrow_type: Optional[pa.DataType], what: str) -> Optional[Callable[[Any], None]]:
    """A cheap per-write check that a value fits a declared Arrow type, so a bad
    value fails where it is written, not later in a snapshot."""
    if arrow_type is None:
        return None
    if pa.types.is_integer(arrow_type):
        bits = arrow_type.bit_width
        lo, hi = (
            (0, (1 << bits) - 1)
            if pa.types.is_unsigned_integer(arrow_type)
            else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
        )

        def check_int(v: Any) -> None:
            if type(v) is not int or not lo <= v <= hi:
                raise TypeError(f"{what}: {v!r} is not a {arrow_type} value")

        return check_int
    simple = {
        pa.types.is_floating: (int, float),
        pa.types.is_string: (str,),
        pa.types.is_large_string: (str,),
        pa.types.is_binary: (bytes,),
        pa.types.is_large_binary: (bytes,),
        pa.types.is_boolean: (bool,),
    }
    for test, types in simple.items():
        if test(arrow_type):

            def check(v: Any, types: Tuple[type, ...] = types) -> None:
                if type(v) not in types:
                    raise TypeError(f"{what}: {v!r} is not a {arrow_type} value")

            return check
    return None  # other types are checked when the snapshot converts the column


def _private_copy(value: Any) -> Any:
    return value if _is_immutable(value) else copy.deepcopy(value)


class StateTable:
    """The stored entries of one state: a dict per key group of the backend's range.

    Copy-on-write bookkeeping, per key group ``i``:

    * ``shared[i]``: the dict itself is referenced by an unfinished snapshot, so
      the first write copies it;
    * ``tainted[i]``: values stored before the last freeze may be referenced by an
      unfinished snapshot, except those of the keys in ``owned[i]``, which were
      stored or made private since. A tainted value is deep-copied before anyone
      may change it in place.

    Both reset when the last unfinished snapshot releases the table.
    """

    __slots__ = ("active_snapshots", "changes", "descriptor", "groups", "owned", "pickled", "shared", "tainted")

    def __init__(self, descriptor: StateDescriptor, num_key_groups: int) -> None:
        self.descriptor = descriptor
        self.groups: List[Dict[Any, Any]] = [{} for _ in range(num_key_groups)]
        self.shared = [False] * num_key_groups
        self.tainted = [False] * num_key_groups
        self.owned: List[Set[Any]] = [set() for _ in range(num_key_groups)]
        self.active_snapshots = 0
        self.pickled = False  # restored values still pickled, waiting for an opt-in
        # Keys changed since the last snapshot, per key group; kept only by the
        # incremental backend (None: not tracked).
        self.changes: Optional[List[Set[Any]]] = None

    def writable(self, index: int) -> Dict[Any, Any]:
        """The key group's dict, copied first if a snapshot still references it."""
        if self.shared[index]:
            self.groups[index] = dict(self.groups[index])
            self.shared[index] = False
        return self.groups[index]

    def store(self, index: int, key: Any, value: Any) -> None:
        """Stores a value object that no snapshot references."""
        self.writable(index)[key] = value
        if self.tainted[index]:
            self.owned[index].add(key)
        if self.changes is not None:
            self.changes[index].add(key)

    def restamp(self, index: int, key: Any, stored: Any) -> None:
        """Replaces a stored entry by one holding the same value objects (a new TTL stamp)."""
        self.writable(index)[key] = stored
        if self.changes is not None:
            self.changes[index].add(key)

    def delete(self, index: int, key: Any) -> None:
        if key in self.groups[index]:
            self.writable(index).pop(key, None)
            if self.changes is not None:
                self.changes[index].add(key)

    def needs_private(self, index: int, key: Any) -> bool:
        return self.tainted[index] and key not in self.owned[index]

    def own(self, index: int, key: Any, container: Any) -> Any:
        """A version of the list or dict stored under ``key`` that may be changed
        in place, elements included, without touching an unfinished snapshot."""
        if not self.needs_private(index, key):
            if self.changes is not None:
                self.changes[index].add(key)  # the caller is about to change it
            return container
        if isinstance(container, dict):
            container = {k: _private_copy(v) for k, v in container.items()}
        else:
            container = [_private_copy(v) for v in container]
        self.store(index, key, container)
        return container

    def freeze(self) -> List[Dict[Any, Any]]:
        """The synchronous part of a snapshot: every key group becomes shared and
        tainted, and the snapshot gets the dicts as they are now."""
        for i in range(len(self.groups)):
            self.shared[i] = True
            self.tainted[i] = True
            self.owned[i] = set()
        self.active_snapshots += 1
        return list(self.groups)

    def release(self) -> None:
        """A snapshot finished with the dicts it froze."""
        self.active_snapshots -= 1
        if self.active_snapshots == 0:
            n = len(self.groups)
            self.shared = [False] * n
            self.tainted = [False] * n
            self.owned = [set() for _ in range(n)]

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)


class _Ttl:
    """Time-to-live bookkeeping of one state: entries are stored as (value, last_access_ms)."""

    __slots__ = ("clock", "config", "on_read")

    def __init__(self, config: StateTtlConfig, clock: Callable[[], int]) -> None:
        self.config = config
        self.clock = clock
        self.on_read = config.update_type is TtlUpdateType.ON_READ_AND_WRITE

    def expired(self, stamp: int, now: int) -> bool:
        return now - stamp >= self.config.ttl_ms

    def visible(self, stamp: int, now: int) -> bool:
        return (
            not self.expired(stamp, now)
            or self.config.state_visibility is StateVisibility.RETURN_EXPIRED_IF_NOT_CLEANED_UP
        )


class _KeyedState:
    """Base of the state objects handed to user code; they read the backend's current key."""

    __slots__ = ("_backend", "_check", "_table", "_ttl")

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        self._backend = backend
        self._table = table
        self._ttl = ttl
        d = table.descriptor
        self._check: Optional[Callable[[Any], None]] = _validator(
            getattr(d, "type", None), f"{d.kind} state {d.name!r}"
        )

    @property
    def name(self) -> str:
        return self._table.descriptor.name

    def _where(self) -> Tuple[int, Any]:
        b = self._backend
        if b._key_index < 0:
            raise NoCurrentKeyError(f"state {self.name!r} was used before set_current_key()")
        return b._key_index, b._key

    def _load(self) -> Any:
        """The stored entry of the current key (unwrapped, TTL applied), or _ABSENT."""
        index, key = self._where()
        stored = self._table.groups[index].get(key, _ABSENT)
        if stored is _ABSENT or self._ttl is None:
            return self._readable(index, key, stored)
        value, stamp = stored
        now = self._ttl.clock()
        if not self._ttl.visible(stamp, now):
            self._table.delete(index, key)
            return _ABSENT
        if self._ttl.on_read:
            self._table.restamp(index, key, (value, now))  # the same value object, a new stamp
        return self._readable(index, key, value)

    def _readable(self, index: int, key: Any, value: Any) -> Any:
        """A value the caller may mutate without touching an unfinished snapshot."""
        if value is _ABSENT or not self._table.needs_private(index, key) or _is_immutable(value):
            return value
        value = copy.deepcopy(value)
        self._store(index, key, value)
        return value

    def _store(self, index: int, key: Any, value: Any) -> None:
        if self._ttl is not None:
            value = (value, self._ttl.clock())
        self._table.store(index, key, value)

    def clear(self) -> None:
        index, key = self._where()
        self._table.delete(index, key)


class ValueState(_KeyedState):
    """One value per key (Flink's ValueState)."""

    __slots__ = ("_default",)

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        d = table.descriptor
        assert isinstance(d, ValueStateDescriptor)
        self._default = d.default

    def value(self) -> Any:
        v = self._load()
        return self._default if v is _ABSENT else v

    def update(self, value: Any) -> None:
        """Sets the current key's value; ``None`` clears it, as in Flink."""
        if value is None:
            self.clear()
            return
        if self._check is not None:
            self._check(value)
        index, key = self._where()
        self._store(index, key, value)


class _FoldingState(_KeyedState):
    """Reducing and aggregating state: a value folded by ``add``."""

    __slots__ = ()

    def _fold(self, accumulated: Any, value: Any) -> Any:
        raise NotImplementedError

    def _initial(self) -> Any:
        return _ABSENT

    def add(self, value: Any) -> None:
        current = self._load()
        if current is _ABSENT:
            current = self._initial()
        folded = value if current is _ABSENT else self._fold(current, value)
        if self._check is not None:
            self._check(folded)
        index, key = self._where()
        self._store(index, key, folded)


class ReducingState(_FoldingState):
    """A value per key combined with the descriptor's reduce function (Flink's ReducingState)."""

    __slots__ = ("_reduce",)

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        d = table.descriptor
        assert isinstance(d, ReducingStateDescriptor)
        self._reduce = d.reduce_function

    def _fold(self, accumulated: Any, value: Any) -> Any:
        return self._reduce(accumulated, value)

    def get(self) -> Any:
        v = self._load()
        return None if v is _ABSENT else v


class AggregatingState(_FoldingState):
    """An accumulator per key (Flink's AggregatingState); ``get`` returns the result."""

    __slots__ = ("_function",)

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        d = table.descriptor
        assert isinstance(d, AggregatingStateDescriptor)
        self._function = d.aggregate_function

    def _initial(self) -> Any:
        return self._function.create_accumulator()

    def _fold(self, accumulated: Any, value: Any) -> Any:
        return self._function.add(value, accumulated)

    def get(self) -> Any:
        v = self._load()
        return None if v is _ABSENT else self._function.get_result(v)


class ListState(_KeyedState):
    """A list per key (Flink's ListState). With a TTL, each element expires on its own."""

    __slots__ = ()

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        d = table.descriptor
        assert isinstance(d, ListStateDescriptor)

    def _elements(self, write: bool) -> Optional[List[Any]]:
        """The stored elements of the current key, expired ones dropped; private
        (safe to change in place) when ``write``."""
        index, key = self._where()
        table = self._table
        stored = table.groups[index].get(key)
        if stored is None:
            return None
        if self._ttl is not None:
            now = self._ttl.clock()
            live = [e for e in stored if self._ttl.visible(e[1], now)]
            if self._ttl.on_read:
                live = [(v, now) for v, _ in live]
            if len(live) != len(stored) or self._ttl.on_read:
                if not live:
                    self.clear()
                    return None
                if table.needs_private(index, key):
                    live = [_private_copy(e) for e in live]
                table.store(index, key, live)
                stored = live
        return table.own(index, key, stored) if write else stored

    def get(self) -> List[Any]:
        """The current key's elements, as a new list (empty when there are none)."""
        index, key = self._where()
        stored = self._elements(write=False)
        if not stored:
            return []
        if self._table.needs_private(index, key) and not all(_is_immutable(e) for e in stored):
            stored = self._table.own(index, key, stored)
        return [e[0] for e in stored] if self._ttl is not None else list(stored)

    def _wrap(self, values: List[Any]) -> List[Any]:
        for v in values:
            if v is None:
                raise ValueError(f"list state {self.name!r}: None cannot be added to a list state")
            if self._check is not None:
                self._check(v)
        if self._ttl is not None:
            now = self._ttl.clock()
            return [(v, now) for v in values]
        return values

    def add(self, value: Any) -> None:
        self.add_all([value])

    def add_all(self, values: List[Any]) -> None:
        values = self._wrap(list(values))
        if not values:
            return
        stored = self._elements(write=True)
        if stored is None:
            index, key = self._where()
            self._table.store(index, key, values)
        else:
            stored.extend(values)

    def update(self, values: List[Any]) -> None:
        """Replaces the current key's elements (an empty list clears them)."""
        values = self._wrap(list(values))
        if not values:
            self.clear()
            return
        index, key = self._where()
        self._table.store(index, key, values)


class MapState(_KeyedState):
    """A map per key (Flink's MapState). With a TTL, each entry expires on its own."""

    __slots__ = ("_check_key",)

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        d = table.descriptor
        assert isinstance(d, MapStateDescriptor)
        self._check_key = _validator(d.key_type, f"map state {d.name!r} key")
        self._check = _validator(d.value_type, f"map state {d.name!r} value")

    def _map(self, write: bool) -> Optional[Dict[Any, Any]]:
        """The stored map of the current key, expired entries dropped; private
        (safe to change in place, values included) when ``write``."""
        index, key = self._where()
        table = self._table
        stored = table.groups[index].get(key)
        if stored is None:
            return None
        if self._ttl is not None:
            now = self._ttl.clock()
            dead = [k for k, (_, stamp) in stored.items() if not self._ttl.visible(stamp, now)]
            if dead:
                stored = table.own(index, key, stored)
                for k in dead:
                    del stored[k]
                if not stored:
                    self.clear()
                    return None
        return table.own(index, key, stored) if write else stored

    def _readable_map(self) -> Optional[Dict[Any, Any]]:
        """The stored map, made private first if a value handed out could reach a snapshot."""
        stored = self._map(write=False)
        index, key = self._backend._key_index, self._backend._key
        if stored and self._table.needs_private(index, key) and not all(_is_immutable(v) for v in stored.values()):
            stored = self._table.own(index, key, stored)
        return stored

    def get(self, user_key: Any) -> Any:
        stored = self._map(write=True) if self._ttl is not None and self._ttl.on_read else self._readable_map()
        if stored is None or user_key not in stored:
            return None
        if self._ttl is None:
            return stored[user_key]
        value, _ = stored[user_key]
        if self._ttl.on_read:
            stored[user_key] = (value, self._ttl.clock())
        return value

    def contains(self, user_key: Any) -> bool:
        stored = self._map(write=False)
        return stored is not None and user_key in stored

    def put(self, user_key: Any, value: Any) -> None:
        self.put_all({user_key: value})

    def put_all(self, entries: Dict[Any, Any]) -> None:
        if not entries:
            return
        for k, v in entries.items():
            if self._check_key is not None:
                self._check_key(k)
            if self._check is not None and v is not None:
                self._check(v)
        if self._ttl is not None:
            now = self._ttl.clock()
            entries = {k: (v, now) for k, v in entries.items()}
        stored = self._map(write=True)
        if stored is None:
            index, key = self._where()
            self._table.store(index, key, dict(entries))
        else:
            stored.update(entries)

    def remove(self, user_key: Any) -> None:
        stored = self._map(write=True)
        if stored is not None:
            stored.pop(user_key, None)
            if not stored:
                self.clear()

    def items(self) -> List[Tuple[Any, Any]]:
        stored = self._readable_map()
        if not stored:
            return []
        if self._ttl is None:
            return list(stored.items())
        return [(k, v) for k, (v, _) in stored.items()]

    def keys(self) -> List[Any]:
        stored = self._map(write=False)
        return list(stored) if stored else []

    def values(self) -> List[Any]:
        return [v for _, v in self.items()]

    def is_empty(self) -> bool:
        return not self._map(write=False)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.keys())


_STATE_CLASSES = {
    "value": ValueState,
    "list": ListState,
    "map": MapState,
    "reducing": ReducingState,
    "aggregating": AggregatingState,
}


class HeapKeyedStateBackend:
    """Keyed state of one subtask, held in memory; see the module docstring."""

    kind = "heap"

    def __init__(
        self,
        *,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        key_group_range: Optional[KeyGroupRange] = None,
        ttl_clock_ms: Optional[Callable[[], int]] = None,
        local_recovery_dir: Optional[str] = None,
        columnar: bool = True,
    ) -> None:
        check_parallelism(1, max_parallelism)
        if key_group_range is None:
            key_group_range = KeyGroupRange.all(max_parallelism)
        if key_group_range.start < 0 or key_group_range.end >= max_parallelism or not len(key_group_range):
            raise ValueError(f"key_group_range {key_group_range} must be a non-empty part of 0-{max_parallelism - 1}")
        self.max_parallelism = max_parallelism
        self.key_group_range = key_group_range
        self._kg_start, self._kg_count = key_group_range.start, len(key_group_range)  # per-record use
        self._ttl_clock = ttl_clock_ms or (lambda: time.time_ns() // 1_000_000)
        # Tables are StateTable (dicts) or columnar.ColumnarValueTable; states likewise.
        self._tables: Dict[str, Any] = {}
        self._states: Dict[str, Any] = {}
        self._key: Any = None
        self._key_group = -1
        self._key_index = -1
        # Freezing (task thread) and releasing (a snapshot's thread) must not interleave.
        self._freeze_lock = threading.Lock()
        self._local: Any = None
        self._local_results: Dict[int, List[Any]] = {}
        self._columnar = columnar  # typed value state in columns (see columnar.py)
        if local_recovery_dir is not None:
            from ..storage.local import LocalRecoveryDirectory

            self._local = LocalRecoveryDirectory(local_recovery_dir)

    # -- current key --------------------------------------------------------------

    def set_current_key(self, key: Any) -> None:
        """Makes ``key`` the one every state object of this backend reads and writes."""
        key_group = _int_key_group(key, self.max_parallelism)
        if key_group < 0:
            key_group = assign_to_key_group(key, self.max_parallelism)
        index = key_group - self._kg_start
        if not 0 <= index < self._kg_count:
            raise ValueError(
                f"key {key!r} belongs to key group {key_group}, outside this backend's key groups "
                f"{self.key_group_range}"
            )
        self._key = key
        self._key_group = key_group
        self._key_index = index

    @property
    def current_key(self) -> Any:
        return self._key

    @property
    def current_key_group(self) -> int:
        return self._key_group

    # -- states -------------------------------------------------------------------

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The state object for ``descriptor``, created on first use. Asking again
        with an equal descriptor returns the same object; a different descriptor
        under the same name is refused."""
        state = self._states.get(descriptor.name)
        if state is not None:
            if state._table.descriptor != descriptor:
                raise ValueError(
                    f"state {descriptor.name!r} is already registered as {state._table.descriptor!r}; "
                    f"it cannot also be {descriptor!r}"
                )
            return state
        cls = _STATE_CLASSES.get(descriptor.kind)
        if cls is None:
            raise TypeError(f"not a keyed state descriptor: {descriptor!r}")
        from .columnar import ColumnarValueState, ColumnarValueTable, columnar_dtype

        dtype = columnar_dtype(descriptor) if self._columnar else None
        table: Any = self._tables.get(descriptor.name)
        if isinstance(table, ColumnarValueTable) and (dtype is None or dtype != table.dtype):
            table = self._columnar_table_to_dict(descriptor.name)
        if table is None and dtype is not None:
            table = ColumnarValueTable(descriptor, len(self.key_group_range), dtype)
            self._tables[descriptor.name] = table
        if isinstance(table, ColumnarValueTable):
            if table.descriptor.kind != descriptor.kind:
                raise ValueError(f"state {descriptor.name!r} holds value state; it cannot be read as {descriptor.kind}")
            table.descriptor = descriptor
            check = _validator(getattr(descriptor, "type", None), f"value state {descriptor.name!r}")
            columnar_state = ColumnarValueState(self, table, check)
            self._states[descriptor.name] = columnar_state
            return columnar_state
        if table is None:
            table = StateTable(descriptor, len(self.key_group_range))
            self._tables[descriptor.name] = table
        elif table.descriptor.kind != descriptor.kind:
            raise ValueError(
                f"state {descriptor.name!r} holds {table.descriptor.kind} state; it cannot be read as {descriptor.kind}"
            )
        else:
            self._adopt(table, descriptor)
        ttl = _Ttl(descriptor.ttl, self._ttl_clock) if descriptor.ttl is not None else None  # type: ignore[attr-defined]
        state = cls(self, table, ttl)
        self._states[descriptor.name] = state
        return state

    @property
    def state_names(self) -> List[str]:
        return sorted(self._tables)

    def keys(self, state_name: str) -> Iterator[Any]:
        """Every key that has an entry in ``state_name`` (expired ones included until cleaned up)."""
        table = self._tables.get(state_name)
        if table is None:
            raise KeyError(f"no state named {state_name!r}; known: {', '.join(self.state_names) or 'none'}")
        if hasattr(table, "iter_keys"):
            yield from list(table.iter_keys())
            return
        for group in list(table.groups):
            yield from list(group)

    def num_entries(self, state_name: Optional[str] = None) -> int:
        tables = self._tables.values() if state_name is None else [self._tables[state_name]]
        return sum(len(t) for t in tables)

    def dispose(self) -> None:
        self._tables.clear()
        self._states.clear()
        self._key_index = -1

    # -- snapshots ----------------------------------------------------------------

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        """The synchronous part of a snapshot: freezes every state (copy-on-write,
        O(number of key groups)) and returns the asynchronous part, whose ``run()``
        writes the state file and returns a SnapshotResult."""
        from ..snapshot.strategies import FullSnapshot, column_of

        names = sorted(self._tables)
        with self._freeze_lock:
            tables = [self._tables[n] for n in names]
            frozen = [t.freeze() for t in tables]

        def release() -> None:
            with self._freeze_lock:
                for t in tables:
                    t.release()

        return FullSnapshot(
            checkpoint_id=checkpoint_id,
            location=location,
            backend=self.kind,
            max_parallelism=self.max_parallelism,
            key_group_range=self.key_group_range,
            columns=[column_of(t.descriptor) for t in tables],
            frozen=frozen,
            release=release,
            local=self._local,
            written=self._record_local,
        )

    def _record_local(self, checkpoint_id: int, result: Any) -> None:
        if self._local is not None:
            self._local_results[checkpoint_id] = list(result.handles)

    def _prune_local(self, checkpoint_id: int) -> None:
        """Local copies are kept for the latest completed checkpoint only."""
        handles = self._local_results.get(checkpoint_id)
        if self._local is None or handles is None:
            return
        self._local.keep_only(handles)
        self._local_results = {c: h for c, h in self._local_results.items() if c >= checkpoint_id}

    def restore(self, handles: Any, *, allow_pickle: Any = ()) -> None:
        """Replaces all state with the entries of this backend's key groups in
        ``handles`` (written by any backend, at any parallelism; incremental chains
        in order, base first). States come back
        under their names and take their descriptors from ``get_state``; values a
        state pickled stay undecoded until a descriptor that opts in asks for them
        (or the state is named in ``allow_pickle``)."""
        from ..snapshot.format import TOMBSTONE, read_keyed_state
        from ..storage.handles import KeyGroupsStateHandle
        from .columnar import ColumnarValueTable

        restored: Dict[str, Any] = {}
        if self._local is not None:
            handles = self._local.prefer_local(handles)
        for handle in handles:
            if not isinstance(handle, KeyGroupsStateHandle):
                raise TypeError(f"a keyed backend restores from KeyGroupsStateHandle, got {handle!r}")
            if handle.key_group_end >= self.max_parallelism:
                raise ValueError(
                    f"state written with key groups up to {handle.key_group_end} cannot be restored at "
                    f"max_parallelism {self.max_parallelism}: max_parallelism must not change"
                )
            _, entries = read_keyed_state(
                handle, self.key_group_range, allow_pickle=allow_pickle, defer_pickle=True, arrays=self._columnar
            )
            for key_group, spec, keys, values in entries:
                table = restored.get(spec.name)
                if isinstance(keys, pa.Array):  # typed value state with int keys: straight into columns
                    if table is None:
                        table = ColumnarValueTable(
                            _RestoredDescriptor(spec.name, spec.kind),
                            len(self.key_group_range),
                            np.dtype(values.type.to_pandas_dtype()),
                        )
                        restored[spec.name] = table
                    if isinstance(table, ColumnarValueTable):
                        table.load(key_group - self.key_group_range.start, keys, values)
                        continue
                    keys = keys.to_pylist()
                    values = [TOMBSTONE if v is None else v for v in values.to_pylist()]
                if isinstance(table, ColumnarValueTable):  # mixed key types: dict storage after all
                    dict_table = StateTable(table.descriptor, len(self.key_group_range))
                    dict_table.groups = table.to_dicts()
                    restored[spec.name] = table = dict_table
                if table is None:
                    table = StateTable(_RestoredDescriptor(spec.name, spec.kind), len(self.key_group_range))
                    table.pickled = spec.serializer == "pickle" and spec.name not in allow_pickle
                    restored[spec.name] = table
                elif table.descriptor.kind != spec.kind:
                    raise ValueError(
                        f"state {spec.name!r} is {table.descriptor.kind} in one file, {spec.kind} in another"
                    )
                group = table.groups[key_group - self.key_group_range.start]
                for k, v in zip(keys, values, strict=True):
                    if v is TOMBSTONE:  # a later delta deleted it
                        group.pop(k, None)
                    else:
                        group[k] = v
        self._tables = restored
        self._states = {}

    def _columnar_table_to_dict(self, name: str) -> StateTable:
        """Moves a columnar state into dict storage (its first non-int key, or a
        descriptor that does not fit columns)."""
        columnar = self._tables[name]
        table = StateTable(columnar.descriptor, len(self.key_group_range))
        table.groups = columnar.to_dicts()
        table.changes = columnar.pending_key_sets() if columnar.tracking else None
        self._tables[name] = table
        return table

    def _columnar_to_dict(self, name: str) -> Any:
        """As ``_columnar_table_to_dict``, returning a dict-backed state object for it."""
        return ValueState(self, self._columnar_table_to_dict(name), None)

    def _adopt(self, table: StateTable, descriptor: StateDescriptor) -> None:
        """A restored state gets its real descriptor; pickled values are decoded now,
        if and only if the descriptor opts in to pickle."""
        if getattr(table, "pickled", False):
            if not descriptor.allows_pickle:
                from .serializers import PickleNotAllowedError

                raise PickleNotAllowedError(
                    f"state {descriptor.name!r} was checkpointed with pickle, which can run code when read; "
                    "its descriptor must opt in with serializer='pickle'"
                )
            from .serializers import PickleSerializer

            loads = PickleSerializer().loads
            for group in table.groups:
                for k, raw in group.items():
                    group[k] = loads(raw)
            table.pickled = False
        table.descriptor = descriptor

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Full snapshots keep nothing between checkpoints but local copies."""
        self._prune_local(checkpoint_id)


class _RestoredDescriptor(StateDescriptor):
    """Stands in for a restored state's descriptor until get_state provides the real one."""

    def __init__(self, name: str, kind: str) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "kind", kind)  # shadows the class attribute of the kind
