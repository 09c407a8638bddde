"""The map state handle: ``MapState`` and its TTL variant."""

from __future__ import annotations

from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Generic,
    Iterator,
    List,
    Mapping,
    Optional,
    Tuple,
)

from .._native import MapCalls as _MapCalls
from .descriptors import (
    K,
    MapStateDescriptor,
    V,
)
from .table import _ABSENT, _ATOMIC, StateTable, _is_immutable, _plain, _validator
from .ttl import _own_stamped, _stamped_atomic, _Ttl
from .values import _KeyedState, _no_key

if TYPE_CHECKING:
    from .heap import HeapKeyedStateBackend

__all__ = [
    "MapState",
]


class MapState(_MapCalls, _KeyedState, Generic[K, V]):
    """A map per key (Flink's MapState). With a TTL, each entry expires on its own.

    ``get``, ``put``, ``contains`` and ``remove`` touch one entry: with a TTL,
    only that entry's expiry is checked (and an expired entry is removed then);
    ``items``, ``keys``, ``values`` and ``is_empty`` read (and clean) the map."""

    __slots__ = ()

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        d = table.descriptor
        assert isinstance(d, MapStateDescriptor)
        what = f"map state {d.name!r}"
        self._check_key = _validator(d.key_type, f"{what} key") or _plain(d, f"{what} key")
        self._check = _validator(d.value_type, f"{what} value") or _plain(d, f"{what} value")
        self._atomic = getattr(d, "value_type", None) is not None

    def _writable(self, index: int, key: Any) -> Dict[Any, Any]:
        """The current key's map, private (copied once per key and snapshot), created if absent."""
        table = self._table
        stored = table.groups[index].get(key)
        if stored is None:
            stored = {}
            table.store(index, key, stored)
            return stored
        if table.tainted[index] and key not in table.owned[index]:
            if self._ttl is not None:  # its pointers when its values are immutable
                return _own_stamped(table, index, key, stored, self._atomic)  # type: ignore[no-any-return]
            return table.own(index, key, stored)  # type: ignore[no-any-return]
        if table.changes is not None:
            table.changes[index].add(key)
        return stored  # type: ignore[no-any-return]

    def _drop(self, index: int, key: Any, user_key: Any) -> None:
        """Removes one (expired) entry; the key's map goes when it empties."""
        stored = self._writable(index, key)
        stored.pop(user_key, None)
        if not stored:
            self._table.delete(index, key)

    if TYPE_CHECKING:  # in C (``_native.MapCalls``), which comes back to the _*_py methods

        def get(self, user_key: K) -> Optional[V]:
            """The value under ``user_key`` for the current key, or None."""

        def contains(self, user_key: K) -> bool:
            """Whether the current key's map has a (live) entry under ``user_key``."""

        def put(self, user_key: K, value: V) -> None:
            """Sets the value under ``user_key`` for the current key."""

    def _get_py(self, user_key: K) -> Optional[V]:
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        key = b._key
        table = self._table
        stored = table.groups[index].get(key)
        if stored is None:
            return None
        entry = stored.get(user_key, _ABSENT)
        if entry is _ABSENT:
            return None
        ttl = self._ttl
        if ttl is not None:
            value, stamp = entry
            now = b._ttl_now or ttl.clock()
            if now - stamp >= ttl.ttl_ms and not ttl.return_expired:
                self._drop(index, key, user_key)
                return None
            if ttl.on_read:
                stored = self._writable(index, key)
                value, _ = stored[user_key]
                stored[user_key] = (value, now)
            entry = value
        if entry.__class__ in _ATOMIC or not table.tainted[index] or key in table.owned[index]:
            return self._out(index, key, entry)  # type: ignore[no-any-return]
        if _is_immutable(entry):
            return entry  # type: ignore[no-any-return]
        entry = self._writable(index, key)[user_key]  # private now, values included
        return entry[0] if ttl is not None else entry  # type: ignore[no-any-return]

    def _contains_py(self, user_key: K) -> bool:
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        stored = self._table.groups[index].get(b._key)
        if stored is None:
            return False
        ttl = self._ttl
        if ttl is None:
            return user_key in stored
        entry = stored.get(user_key, _ABSENT)
        if entry is _ABSENT:
            return False
        if (b._ttl_now or ttl.clock()) - entry[1] >= ttl.ttl_ms and not ttl.return_expired:
            self._drop(index, b._key, user_key)
            return False
        return True

    def _put_py(self, user_key: K, value: V) -> None:
        if self._check_key is not None:
            user_key = self._check_key(user_key)
        if self._check is not None and value is not None:
            value = self._check(value)
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        ttl = self._ttl
        if ttl is not None:
            now = b._ttl_now
            value = (value, now if now is not None else ttl.clock())  # type: ignore[assignment]
        key = b._key
        table = self._table
        stored = table.groups[index].get(key)  # _writable, inlined: once per record in most jobs
        if stored is None:
            table.store(index, key, {user_key: value})
            return
        if table.tainted[index] and key not in table.owned[index]:  # copied once per key and snapshot
            stored = (
                table.own(index, key, stored) if ttl is None else _own_stamped(table, index, key, stored, self._atomic)
            )
        elif table.changes is not None:
            table.changes[index].add(key)
        stored[user_key] = value

    def put_all(self, entries: Mapping[K, V]) -> None:
        """Sets several entries of the current key's map."""
        if not entries:
            return
        check_key = self._check_key
        if check_key is not None:
            entries = {check_key(k): v for k, v in entries.items()}
        check = self._check
        if check is not None:
            entries = {k: v if v is None else check(v) for k, v in entries.items()}
        index, key = self._where()
        ttl = self._ttl
        if ttl is not None:
            now = ttl.clock()
            self._writable(index, key).update({k: (v, now) for k, v in entries.items()})
        else:
            self._writable(index, key).update(entries)

    def remove(self, user_key: K) -> None:
        """Removes the entry under ``user_key`` (if any) from the current key's map."""
        index, key = self._where()
        stored = self._table.groups[index].get(key)
        if stored is not None and user_key in stored:
            self._drop(index, key, user_key)

    def _live(self, values: bool = True) -> Optional[Dict[Any, Any]]:
        """The current key's map for a whole read: expired entries removed first
        (this read scans the map anyway); private when a value handed out could
        reach an unfinished snapshot."""
        index, key = self._where()
        ttl = self._ttl
        # The clock first: reading it may run a cleanup step, which may replace or drop this map.
        limit = ttl.clock() - ttl.ttl_ms if ttl is not None and not ttl.return_expired else None
        table = self._table
        stored = table.groups[index].get(key)
        if stored is None:
            return None
        if limit is not None:
            dead = [k for k, e in stored.items() if e[1] <= limit]
            if dead:
                stored = self._writable(index, key)
                for k in dead:
                    del stored[k]
                if not stored:
                    table.delete(index, key)
                    return None
        if table.needs_private(index, key) and not self._atomic:
            if ttl is None or not _stamped_atomic(stored):  # immutable values: handed out as they are
                stored = table.own(index, key, stored)
        elif values and not self._atomic and table.changes is not None:
            table.changes[index].add(key)  # its values handed out (see _out)
        return stored  # type: ignore[no-any-return]

    def items(self) -> List[Tuple[K, V]]:
        """The current key's (user key, value) pairs."""
        stored = self._live()
        if not stored:
            return []
        if self._ttl is None:
            return list(stored.items())
        if self._ttl.on_read:
            now = self._ttl.clock()
            stored = self._writable(*self._where())
            for k, (v, _) in list(stored.items()):
                stored[k] = (v, now)
        return [(k, e[0]) for k, e in stored.items()]

    def keys(self) -> List[K]:
        """The current key's user keys."""
        stored = self._live(values=False)
        return list(stored) if stored else []

    def values(self) -> List[V]:
        """The current key's values."""
        return [v for _, v in self.items()]

    def is_empty(self) -> bool:
        """Whether the current key's map has no live entry."""
        index, key = self._where()
        stored = self._table.groups[index].get(key)
        if not stored:
            return True
        ttl = self._ttl
        if ttl is None or ttl.return_expired:
            return False
        limit = ttl.clock() - ttl.ttl_ms
        for e in stored.values():  # stops at the first live entry
            if e[1] > limit:
                return False
        self._table.delete(index, key)  # every entry expired
        return True

    def __iter__(self) -> Iterator[K]:
        return iter(self.keys())


# -- TTL's common case -----------------------------------------------------------------
#
# A state with Flink's default TTL (updated on create and write, expired entries never
# returned) gets these classes: its per-record calls check one stamp against the
# state's own ``_ttl_ms`` with no test of the TTL's options. They behave exactly as
# the general classes above do for that configuration (tests/test_state_calls.py runs
# both against the same model).


class _TtlMapState(MapState[K, V]):
    __slots__ = ()

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        assert ttl is not None
        self._use_fast_ttl(ttl.ttl_ms)

    def _get_py(self, user_key: K) -> Optional[V]:
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        key = b._key
        table = self._table
        stored = table.groups[index].get(key)
        if stored is None:
            return None
        entry = stored.get(user_key)  # (value, stamp) or None
        if entry is None:
            return None
        now = b._ttl_now
        if now is None:
            now = b._ttl_time()
        if now - entry[1] >= self._ttl_ms:
            self._drop(index, key, user_key)
            return None
        value = entry[0]
        if value.__class__ in _ATOMIC or not table.tainted[index] or key in table.owned[index]:
            return self._out(index, key, value)  # type: ignore[no-any-return]
        if _is_immutable(value):
            return value  # type: ignore[no-any-return]
        return self._writable(index, key)[user_key][0]  # type: ignore[no-any-return]  # private now

    def _contains_py(self, user_key: K) -> bool:
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        stored = self._table.groups[index].get(b._key)
        if stored is None:
            return False
        entry = stored.get(user_key)
        if entry is None:
            return False
        now = b._ttl_now
        if now is None:
            now = b._ttl_time()
        if now - entry[1] >= self._ttl_ms:
            self._drop(index, b._key, user_key)
            return False
        return True

    def _put_py(self, user_key: K, value: V) -> None:
        if self._check_key is not None:
            user_key = self._check_key(user_key)
        if self._check is not None and value is not None:
            value = self._check(value)
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        now = b._ttl_now
        if now is None:
            now = b._ttl_time()
        key = b._key
        table = self._table
        stored = table.groups[index].get(key)  # _writable, inlined
        if stored is None:
            table.store(index, key, {user_key: (value, now)})
        else:
            if table.tainted[index] and key not in table.owned[index]:  # its pointers when its values are immutable
                stored = _own_stamped(table, index, key, stored, self._atomic)
            elif table.changes is not None:
                table.changes[index].add(key)
            stored[user_key] = (value, now)
