"""The list state handle: ``ListState`` (and its TTL variant) and ``ListView``, the
live view that ``ListState.get`` returns.
"""

from __future__ import annotations

import itertools
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Iterable,
    Iterator,
    List,
    MutableSequence,
    Optional,
    Tuple,
)

from .._native import ListCalls as _ListCalls
from .._native import ListViewBase as _ListViewBase
from .._native import StampedList
from .._native import ttl_values as _ttl_values
from .descriptors import (
    ListStateDescriptor,
    T,
)
from .serializers import TYPED_LIST, list_typecode, stored_as_list
from .table import StateTable
from .ttl import _own_stamped, _stamped_atomic, _Ttl
from .values import _KeyedState, _no_key

if TYPE_CHECKING:
    from .heap import HeapKeyedStateBackend

__all__ = [
    "ListState",
    "ListView",
]


@stored_as_list
class ListView(_ListViewBase, MutableSequence[T]):
    """What ``ListState.get()`` returns: the current key's elements as they were
    at the call, read from the state without copying them.

    A copy would cost a pass over every element, a call whose cost grows with the
    list; the view costs the same for one element or ten thousand (Flink's
    ``get`` returns an ``Iterable`` for the same reason). It compares equal to a
    list with the same elements, and the first change to it (``append``,
    ``sort``, item assignment...) copies the elements into a list of its own, so
    changing it never changes the state (write back with ``update``). Elements
    added to the state after the call do not show in it. It is not a ``list``:
    ``list(view)`` makes one. In a record it reaches sinks and Arrow batches as the
    list it shows, and put into state, it is stored (checkpointed, pickled) as
    that list.
    """

    # fields and __init__(stored, n, ttl_ms=0, now=0) in _native.ListViewBase: _list (the
    # state's list, never changed in place but by appends, or the view's own copy), _n
    # (the view's elements are _list[:_n]; -1 once it owns _list), _ttl (> 0: elements
    # are (value, stamp), those expired at _now left out)
    __slots__ = ()

    def _own(self) -> List[Any]:
        if self._n >= 0:
            if self._ttl:
                self._list = _ttl_values(self._list, self._n, self._now - self._ttl)
            elif type(self._list) is TYPED_LIST:
                self._list = self._list[: self._n].tolist()  # a list: the view's owner may add anything
            else:
                self._list = self._list[: self._n]
            self._n = -1
            self._ttl = 0
        return self._list

    def __len__(self) -> int:
        if self._n < 0:
            return len(self._list)
        if self._ttl:
            return len(self._own())
        return self._n

    def __iter__(self) -> Iterator[T]:
        if self._n < 0:
            return iter(self._list)
        if self._ttl:
            return iter(self._own())  # one C pass, kept: a second read costs nothing
        return itertools.islice(self._list, self._n)

    def __getitem__(self, i: Any) -> Any:
        if self._n < 0 or self._ttl:
            return self._own()[i]
        if isinstance(i, slice):
            part: Any = self._list[: self._n][i]
            return part if type(part) is list else part.tolist()  # an array.array's slice: as a list
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("list index out of range")
        return self._list[i]

    def __setitem__(self, i: Any, value: Any) -> None:
        self._own()[i] = value

    def __delitem__(self, i: Any) -> None:
        del self._own()[i]

    def insert(self, index: int, value: T) -> None:
        self._own().insert(index, value)

    def append(self, value: T) -> None:
        self._own().append(value)

    def extend(self, values: Iterable[T]) -> None:
        if values is self:
            values = list(values)  # ``view.extend(view)``: its elements once, not for ever
        self._own().extend(values)

    def sort(self, *, key: Any = None, reverse: bool = False) -> None:
        self._own().sort(key=key, reverse=reverse)

    def copy(self) -> List[T]:
        return list(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, ListView)):
            return list(self) == list(other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list

    def __add__(self, other: Iterable[T]) -> List[T]:
        return list(self) + list(other)

    def __radd__(self, other: Iterable[T]) -> List[T]:
        return list(other) + list(self)

    def __mul__(self, n: int) -> List[T]:
        return list(self) * n

    __rmul__ = __mul__

    # ordered as lists are (``sorted`` of records holding views)
    def __lt__(self, other: Any) -> bool:
        return _as_list(self) < _as_list(other)  # type: ignore[no-any-return]

    def __le__(self, other: Any) -> bool:
        return _as_list(self) <= _as_list(other)  # type: ignore[no-any-return]

    def __gt__(self, other: Any) -> bool:
        return _as_list(self) > _as_list(other)  # type: ignore[no-any-return]

    def __ge__(self, other: Any) -> bool:
        return _as_list(self) >= _as_list(other)  # type: ignore[no-any-return]

    def __bool__(self) -> bool:
        if self._n < 0 or not self._ttl:
            return len(self) > 0
        limit = self._now - self._ttl
        for e in itertools.islice(self._list, self._n):  # stops at the first live element: usually the first
            if e[1] > limit:
                return True
        return False

    def __repr__(self) -> str:
        return repr(list(self))

    def __reduce__(self) -> Tuple[Any, ...]:
        # Pickled (a pickle-serialized state, a buffer between worker processes) as the
        # list it shows, not as the state's whole list behind it.
        return (list, (list(self),))


def _as_list(value: Any) -> Any:
    return list(value) if type(value) is ListView else value


class ListState(_ListCalls, _KeyedState, Generic[T]):
    """A list per key (Flink's ListState). With a TTL, each element expires on its own.

    ``add`` appends one element and ``get()`` reads the elements without copying
    them (a ``ListView``): neither costs more for a long list than for a short
    one. With a TTL an element is stored with its write time; expired ones are
    left out by reads, and removed by the incremental cleanup and snapshots, never
    by scanning on ``add``."""

    __slots__ = ()

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        d = table.descriptor
        assert isinstance(d, ListStateDescriptor)
        self._atomic = getattr(d, "type", None) is not None  # typed elements are immutable (ints, strs...)
        self._typecode = list_typecode(d)  # the keys' elements in an array.array (serializers.LIST_TYPECODES)
        if self._typecode is not None and ttl is None:
            table.track_tails()  # appends after a snapshot's freeze copy nothing (StateTable.grow)

    def get(self) -> ListView[T]:
        """The current key's elements as they are now (an empty view when there are
        none), read from the state without copying them: a ``ListView``, which
        costs the same for one element or ten thousand. Flink's ``get`` returns an
        ``Iterable`` for the same reason. Iterate it, index it, compare it with a
        list; ``list(state.get())`` makes a list of your own."""
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        table = self._table
        stored = table.groups[index].get(b._key)
        if not stored:
            return ListView([], 0)
        if not self._atomic:  # elements user code may change in place (typed ones cannot)
            if table.tainted[index] and b._key not in table.owned[index]:
                if self._ttl is None or not _stamped_atomic(stored):  # immutable values: read as they are
                    stored = table.own(index, b._key, stored)  # private first: an unfinished snapshot holds them
            elif table.changes is not None:
                table.changes[index].add(b._key)  # handed out: changed, for the next delta (see _out)
        ttl = self._ttl
        if ttl is None:
            return ListView(stored, len(stored))
        now = ttl.clock()
        if ttl.on_read:  # every element read restarts its clock: a new list (Flink does the same)
            limit = now - ttl.ttl_ms
            live = [(e[0], now) for e in stored if e[1] > limit or ttl.return_expired]
            if not live:
                self._table.delete(index, b._key)
                return ListView([], 0)
            self._put(index, b._key, live)
            return ListView([e[0] for e in live], -1)
        if ttl.return_expired:
            return ListView([e[0] for e in stored], -1)
        return ListView(stored, len(stored), ttl.ttl_ms, now)

    view = get  # the name ``get()`` had while it returned a copy: the same call, one Python frame

    def _element(self, value: Any) -> Any:
        if value is None:
            raise ValueError(f"list state {self.name!r}: None cannot be added to a list state")
        if self._check is not None:
            value = self._check(value)
        return value

    if TYPE_CHECKING:  # in C (``_native.ListCalls``), which comes back to _add_py

        def add(self, value: T) -> None:
            """Appends ``value`` to the current key's list."""

    def _add_py(self, value: T) -> None:
        if value is None or self._check is not None:
            value = self._element(value)
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        key = b._key
        table = self._table
        ttl = self._ttl
        element = value if ttl is None else (value, (b._ttl_now or ttl.clock()))
        stored = table.groups[index].get(key)
        if stored is None:
            self._put(index, key, [element] if self._typecode is None else TYPED_LIST(self._typecode, [element]))
        elif stored.__class__ is TYPED_LIST and table.tails is not None:
            table.grow(index, key, stored).append(element)  # copy-on-write by tail: nothing copied
        elif stored.__class__ is not list or (table.tainted[index] and key not in table.owned[index]):
            owned = (
                table.own(index, key, stored) if ttl is None else _own_stamped(table, index, key, stored, self._atomic)
            )
            owned.append(element)  # copied once per key and snapshot
        else:
            stored.append(element)
            if table.changes is not None:
                table.changes[index].add(key)

    def _put(self, index: int, key: Any, elements: Any) -> None:
        table = self._table
        if table.shared[index]:
            table.writable(index)
        table.groups[index][key] = elements
        if table.tails is not None:
            table._rewritten(index, key)
        if table.tainted[index]:
            table.owned[index].add(key)
        if table.changes is not None:
            table.changes[index].add(key)

    def _wrap(self, values: Iterable[Any]) -> Any:  # a list or array.array, or with a TTL a StampedList
        values = [self._element(v) for v in values]
        if self._ttl is not None:
            now = self._ttl.clock()
            return StampedList([(v, now) for v in values])
        return values if self._typecode is None else TYPED_LIST(self._typecode, values)

    def add_all(self, values: Iterable[T]) -> None:
        """Appends ``values`` to the current key's list."""
        elements = self._wrap(values)
        if not elements:
            return
        index, key = self._where()
        table = self._table
        stored = table.groups[index].get(key)
        if stored is None:
            self._put(index, key, elements)
        elif stored.__class__ is TYPED_LIST and table.tails is not None:
            table.grow(index, key, stored).extend(elements)  # copy-on-write by tail: nothing copied
        elif self._ttl is not None:
            _own_stamped(table, index, key, stored, self._atomic).extend(elements)
        else:
            table.own(index, key, stored).extend(elements)

    def update(self, values: Iterable[T]) -> None:
        """Replaces the current key's elements (an empty list clears them)."""
        elements = self._wrap(values)
        if not elements:
            self.clear()
            return
        index, key = self._where()
        self._put(index, key, elements)


class _TtlListState(ListState[T]):
    __slots__ = ()

    def __init__(self, backend: HeapKeyedStateBackend, table: StateTable, ttl: Optional[_Ttl]) -> None:
        super().__init__(backend, table, ttl)
        assert ttl is not None
        self._use_fast_ttl(ttl.ttl_ms)

    def _add_py(self, value: T) -> None:
        if value is None or self._check is not None:
            value = self._element(value)
        b = self._backend
        index = b._key_index
        if index < 0:
            raise _no_key(self)
        now = b._ttl_now
        if now is None:
            now = b._ttl_time()
        key = b._key
        table = self._table
        stored = table.groups[index].get(key)
        if stored is None:
            self._put(index, key, StampedList([(value, now)]))
        elif (stored.__class__ is not list and stored.__class__ is not StampedList) or (
            table.tainted[index] and key not in table.owned[index]
        ):
            # copied once per key and snapshot (its pointers, when its values are immutable)
            _own_stamped(table, index, key, stored, self._atomic).append((value, now))
        else:
            stored.append((value, now))
            if table.changes is not None:
                table.changes[index].add(key)
