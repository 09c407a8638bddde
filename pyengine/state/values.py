"""The state handles of one value per key: ``ValueState``, ``ReducingState``,
``AggregatingState`` (and their TTL variant), on ``_KeyedState``, the base of every
handle the heap backend hands to user code.

The handles read the backend's current key; their per-record calls run in C
(``_native.StateCalls``) and come back to the ``_*_py`` methods for the rest.
"""

from __future__ import annotations

import copy
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Generic,
    Optional,
    Tuple,
    cast,
)

from .._native import StateCalls as _StateCalls
from .._native import ValueCalls as _ValueCalls
from .columnar import NO_KEY_HINT, NoCurrentKeyError
from .descriptors import (
    IN,
    OUT,
    AggregatingStateDescriptor,
    ReducingStateDescriptor,
    T,
    ValueStateDescriptor,
)
from .table import _ABSENT, _ATOMIC, StateTable, _is_immutable, _plain, _private_copy, _validator
from .ttl import _Ttl

if TYPE_CHECKING:
    from .heap import HeapKeyedStateBackend

__all__ = [
    "AggregatingState",
    "ReducingState",
    "ValueState",
]


def _no_key(state: Any) -> NoCurrentKeyError:
    return NoCurrentKeyError(f"state {state.name!r} was used with no current key: {NO_KEY_HINT}")


class _KeyedState(_StateCalls):
    """Base of the state objects handed to user code; they read the backend's current key.

    Its fields (``_backend``, ``_table``, ``_ttl``, ``_check``) are ``_native.StateCalls``'s:
    the per-record calls of value, list and map state run in C in the common case
    (``bindings/_statecalls.pxi``) and come back to the ``_*_py`` methods for the rest."""

    __slots__ = ()

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        self._backend = backend
        self._table = table
        self._ttl = ttl
        d = table.descriptor
        what = f"{d.kind} state {d.name!r}"
        self._check: Optional[Callable[[Any], Any]] = _validator(getattr(d, "type", None), what) or _plain(d, what)

    @property
    def name(self) -> str:
        return self._table.descriptor.name

    def _where(self) -> Tuple[int, Any]:
        b = self._backend
        if b._key_index < 0:
            raise _no_key(self)
        return b._key_index, b._key

    def _out(self, index: int, key: Any, value: Any) -> Any:
        """``value``, the state's own object, handed to user code: a mutable one may
        be changed in place without a write, so for an incremental backend the key is
        changed (in its next delta), or a restore would bring back the old value while
        the running job went on with the new one (``_native``'s ``_handed_out``)."""
        if value.__class__ not in _ATOMIC and not _is_immutable(value):
            changes = self._table.changes
            if changes is not None:
                changes[index].add(key)
        return value

    def _load(self) -> Any:
        """The stored entry of the current key (unwrapped, TTL applied), or _ABSENT."""
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        key = b._key
        table = self._table
        stored = table.groups[index].get(key, _ABSENT)
        if stored is _ABSENT:
            return stored
        ttl = self._ttl
        if ttl is not None:
            value, stamp = stored
            now = b._ttl_now or ttl.clock()
            if now - stamp >= ttl.ttl_ms and not ttl.return_expired:
                table.delete(index, key)
                return _ABSENT
            if ttl.on_read:
                table.restamp(index, key, (value, now))  # the same value object, a new stamp
            stored = value
        if stored.__class__ in _ATOMIC or not table.tainted[index] or key in table.owned[index]:
            return stored
        return self._readable(index, key, stored)

    def _handed(self, value: Any) -> Any:
        """``_load``'s value as ``get`` hands it out (``_out``; ``add`` stores what it
        folded, which marks the key itself)."""
        if value is not _ABSENT:
            index, key = self._where()
            self._out(index, key, value)
        return value

    def _readable(self, index: int, key: Any, value: Any) -> Any:
        """A value the caller may mutate without touching an unfinished snapshot."""
        if value is _ABSENT or not self._table.needs_private(index, key) or _is_immutable(value):
            return value
        value = copy.deepcopy(value)
        # a private copy is not a write: it keeps the entry's stamp (a read must not
        # extend a value's time to live unless the TTL says reads do)
        stamp = self._table.groups[index][key][1] if self._ttl is not None else None
        self._store(index, key, value, stamp)
        return value

    def _store(self, index: int, key: Any, value: Any, stamp: Optional[int] = None) -> None:
        ttl = self._ttl
        table = self._table
        if ttl is not None:
            value = (value, stamp if stamp is not None else (self._backend._ttl_now or ttl.clock()))
        if table.shared[index]:
            table.writable(index)
        table.groups[index][key] = value
        if table.tainted[index]:
            table.owned[index].add(key)
        if table.changes is not None:
            table.changes[index].add(key)

    def clear(self) -> None:
        """Removes the current key's entry of this state."""
        index, key = self._where()
        self._table.delete(index, key)


class ValueState(_ValueCalls, _KeyedState, Generic[T]):
    """One value per key (Flink's ValueState); ``value()`` and ``update()`` touch
    one slot whatever the state holds."""

    __slots__ = ()

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        d = table.descriptor
        assert isinstance(d, ValueStateDescriptor)
        # as stored: an int default of a float state reads as a float, as its values do
        self._default = d.default if d.default is None or self._check is None else self._check(d.default)

    def _fresh_default(self) -> Any:
        """The default for a key without a value: a mutable one copied each time, as
        Flink does, so a change to it stays with the caller, not in every key's default."""
        default = self._default
        return default if default.__class__ in _ATOMIC else _private_copy(default)

    if TYPE_CHECKING:  # in C (``_native.ValueCalls``), which comes back to the methods below

        def value(self) -> Optional[T]:
            """The current key's value, or the descriptor's default when it has none."""

        def update(self, value: Optional[T]) -> None:
            """Sets the current key's value; ``None`` clears it, as in Flink."""

    def _value_py(self) -> Optional[T]:
        # What the C value() does not do itself: no key, TTL, copy-on-write.
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        key = b._key
        table = self._table
        stored = table.groups[index].get(key, _ABSENT)
        if stored is _ABSENT:
            return self._fresh_default()  # type: ignore[no-any-return]
        ttl = self._ttl
        if ttl is not None:
            value, stamp = stored
            now = b._ttl_now or ttl.clock()
            if now - stamp >= ttl.ttl_ms and not ttl.return_expired:
                table.delete(index, key)
                return self._fresh_default()  # type: ignore[no-any-return]
            if ttl.on_read:
                table.restamp(index, key, (value, now))
            stored = value
        if stored.__class__ in _ATOMIC or not table.tainted[index] or key in table.owned[index]:
            return self._out(index, key, stored)  # type: ignore[no-any-return]
        return self._out(index, key, self._readable(index, key, stored))  # type: ignore[no-any-return]

    def _update_py(self, value: Optional[T]) -> None:
        if value is None:
            self.clear()
            return
        if self._check is not None:
            value = self._check(value)
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        key = b._key
        table = self._table
        ttl = self._ttl
        if ttl is not None:
            now = b._ttl_now
            value = (value, now if now is not None else ttl.clock())  # type: ignore[assignment]
        # _store, inlined: once per record in most jobs
        if table.shared[index]:
            table.writable(index)
        table.groups[index][key] = value
        if table.tainted[index]:
            table.owned[index].add(key)
        if table.changes is not None:
            table.changes[index].add(key)


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
            folded = self._check(folded)
        index, key = self._where()
        self._store(index, key, folded)


class ReducingState(_FoldingState, Generic[T]):
    """A value per key combined with the descriptor's reduce function (Flink's ReducingState)."""

    __slots__ = ("_reduce",)

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        d = table.descriptor
        assert isinstance(d, ReducingStateDescriptor)
        # the descriptor made a ReduceFunction object's reduce its function already
        self._reduce: Callable[[Any, Any], Any] = cast(Callable[[Any, Any], Any], d.reduce_function)

    def _fold(self, accumulated: Any, value: Any) -> Any:
        return self._reduce(accumulated, value)

    def add(self, value: T) -> None:
        """Folds ``value`` into the current key's value with the reduce function."""
        super().add(value)

    def get(self) -> Optional[T]:
        v = self._handed(self._load())
        return None if v is _ABSENT else v  # type: ignore[no-any-return]


class AggregatingState(_FoldingState, Generic[IN, OUT]):
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

    def add(self, value: IN) -> None:
        """Adds ``value`` to the current key's accumulator."""
        super().add(value)

    def get(self) -> Optional[OUT]:
        v = self._handed(self._load())
        return None if v is _ABSENT else self._function.get_result(v)  # type: ignore[no-any-return]


class _TtlValueState(ValueState[T]):
    __slots__ = ()

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        assert ttl is not None
        self._use_fast_ttl(ttl.ttl_ms)  # the C calls stamp and check too

    def _value_py(self) -> Optional[T]:
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        key = b._key
        table = self._table
        stored = table.groups[index].get(key)  # (value, stamp) or None
        if stored is None:
            return self._fresh_default()  # type: ignore[no-any-return]
        now = b._ttl_now
        if now is None:
            now = b._ttl_time()
        if now - stored[1] >= self._ttl_ms:
            table.delete(index, key)
            return self._fresh_default()  # type: ignore[no-any-return]
        value = stored[0]
        if value.__class__ in _ATOMIC or not table.tainted[index] or key in table.owned[index]:
            return self._out(index, key, value)  # type: ignore[no-any-return]
        return self._out(index, key, self._readable(index, key, value))  # type: ignore[no-any-return]

    def _update_py(self, value: Optional[T]) -> None:
        if value is None:
            self.clear()
            return
        if self._check is not None:
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
        if table.shared[index]:
            table.writable(index)
        table.groups[index][key] = (value, now)
        if table.tainted[index]:
            table.owned[index].add(key)
        if table.changes is not None:
            table.changes[index].add(key)
