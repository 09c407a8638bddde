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

import bisect
import copy
import gc
import itertools
import math
import operator
import threading
import time
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    FrozenSet,
    Generic,
    Iterable,
    Iterator,
    List,
    Mapping,
    MutableSequence,
    Optional,
    Sequence,
    Set,
    Tuple,
    cast,
    overload,
)

import numpy as np
import pyarrow as pa

from .._native import ListCalls as _ListCalls
from .._native import ListViewBase as _ListViewBase
from .._native import MapCalls as _MapCalls
from .._native import StampedList
from .._native import StateCalls as _StateCalls
from .._native import StateTableBase as _StateTableBase
from .._native import ValueCalls as _ValueCalls
from .._native import int_key_group as _int_key_group
from .._native import ttl_values as _ttl_values
from .columnar import NO_KEY_HINT, NoCurrentKeyError
from .descriptors import (
    IN,
    OUT,
    AggregatingStateDescriptor,
    K,
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateDescriptor,
    StateDescriptorError,
    StateNameConflictError,
    StateTtlConfig,
    StateTypeError,
    StateVisibility,
    T,
    TtlUpdateType,
    V,
    ValueStateDescriptor,
)
from .keygroups import DEFAULT_MAX_PARALLELISM, KeyGroupRange, assign_to_key_group, check_parallelism
from .serializers import TYPED_LIST, list_typecode, plain_check, stored_as_list

__all__ = [
    "AggregatingState",
    "HeapKeyedStateBackend",
    "ListState",
    "ListView",
    "MapState",
    "NoCurrentKeyError",
    "ReducingState",
    "StateTable",
    "ValueState",
]


_ABSENT = object()
_ATOMIC = (int, float, str, bytes, bool, type(None))


def _is_immutable(value: Any) -> bool:
    t = type(value)
    if t in _ATOMIC:
        return True
    return t is tuple and all(_is_immutable(v) for v in value)


def _a(arrow_type: Any) -> str:
    """``arrow_type`` with its article: "an int64", "a uint8", "a double"."""
    name = str(arrow_type)
    return f"{'an' if name[:1] in 'aeio' else 'a'} {name}"


def _plain(descriptor: Any, what: str) -> Optional[Callable[[Any], Any]]:
    """The write check of a state without a declared type (``serializers.plain_check``),
    or None when the state opted in to pickle (which takes what it can pickle)."""
    if getattr(descriptor, "allows_pickle", False):
        return None
    return plain_check(what)  # type: ignore[no-any-return]


def _validator(arrow_type: Optional[pa.DataType], what: str) -> Optional[Callable[[Any], Any]]:
    """A cheap per-write check that a value fits a declared Arrow type, so a bad
    value fails where it is written, not later in a snapshot. It returns the value
    to store: the value itself, but for a floating type an int as a float, so a
    float state reads floats whether or not it was restored since, and whatever
    its keys (a columnar one stored floats already; a new-user trial saw a parquet
    column turn from int64 to double after a failure). A NumPy scalar (what pandas
    and NumPy hand out: ``np.float64``, ``np.int32``, ``np.bool_``, ``np.str_``) is
    stored as the Python value it stands for; the C calls take the exact Python types
    and leave the rest to this check."""
    if arrow_type is None:
        return None
    if pa.types.is_floating(arrow_type):

        def check_float(v: Any) -> Any:
            t = type(v)
            if t is float:
                return v
            if t is int or isinstance(v, (float, np.floating, np.integer)):
                try:
                    return float(v)
                except OverflowError:
                    pass
            raise StateTypeError(f"{what}: {v!r} is not {_a(arrow_type)} value")

        check_float.pyengine_types = (float,)  # type: ignore[attr-defined]  # C takes floats; ints come here
        return check_float
    if pa.types.is_integer(arrow_type):
        bits = arrow_type.bit_width
        lo, hi = (
            (0, (1 << bits) - 1)
            if pa.types.is_unsigned_integer(arrow_type)
            else (-(1 << (bits - 1)), (1 << (bits - 1)) - 1)
        )

        def check_int(v: Any) -> Any:
            if type(v) is not int and isinstance(v, np.integer):
                v = int(v)
            if type(v) is not int or not lo <= v <= hi:
                raise StateTypeError(f"{what}: {v!r} is not {_a(arrow_type)} value")
            return v

        check_int.pyengine_int_range = (lo, hi)  # type: ignore[attr-defined]  # the C state calls run it
        return check_int
    simple: Dict[Any, Tuple[Tuple[type, ...], Any]] = {
        pa.types.is_string: ((str,), np.str_),
        pa.types.is_large_string: ((str,), np.str_),
        pa.types.is_binary: ((bytes,), np.bytes_),
        pa.types.is_large_binary: ((bytes,), np.bytes_),
        pa.types.is_boolean: ((bool,), np.bool_),
    }
    for test, (types, numpy_type) in simple.items():
        if test(arrow_type):

            def check(v: Any, types: Tuple[type, ...] = types, numpy_type: Any = numpy_type) -> Any:
                if type(v) not in types:
                    if not isinstance(v, numpy_type):
                        raise StateTypeError(f"{what}: {v!r} is not {_a(arrow_type)} value")
                    v = types[0](v)
                return v

            check.pyengine_types = types  # type: ignore[attr-defined]  # the C state calls run it
            return check
    return None  # other types are checked when the snapshot converts the column


def _private_copy(value: Any) -> Any:
    return value if _is_immutable(value) else copy.deepcopy(value)


class StateTable(_StateTableBase):
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

    # Its fields are ``_native.StateTableBase``'s, so the C state calls read them directly.
    __slots__ = ()

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
        elif type(container) is StampedList:
            container = StampedList([(_private_copy(v), s) for v, s in container])
        elif type(container) is TYPED_LIST:
            container = container[:]  # numbers: one copy of the buffer
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
    """Time-to-live bookkeeping of one state: entries are stored as (value, last_access_ms)
    tuples; a list's elements as a ``StampedList`` (values and stamps in two parallel
    lists, read as the sequence of those tuples), or a list of the tuples.

    Nothing scans a key's entries on a write. Expiry is checked for what is read
    (an expired entry found by a read is removed then, unless the state may return
    expired entries), the snapshot's asynchronous part leaves expired entries out
    of the file, and an incremental cleanup (Flink's, bounded per record) checks
    ``CLEANUP_SIZE`` entries every ``CLEANUP_EVERY`` records that use TTL state
    (the backend counts them where it reads its clock: once per record, or once
    per step of the task for all of the step's records, so no state call counts).
    A cursor walks the key groups, the keys of each and, for a map, its entries,
    so the cost never depends on how much state a key holds. The cleanup costs one
    comparison while nothing can have expired (``may_have_expired``):
    ``floor`` is a lower bound of the stamps in the state (the state's creation
    for a new one; after a restore, the oldest stamp a full pass of the cursor saw).
    """

    __slots__ = (
        "_entries",
        "_epos",
        "_group",
        "_keys",
        "_kpos",
        "_pass_min",
        "_pass_start",
        "clock",
        "config",
        "floor",
        "on_read",
        "return_expired",
        "ttl_ms",
    )

    CLEANUP_EVERY = 32  # writes between two cleanup steps
    CLEANUP_SIZE = 16  # key groups, keys or map entries checked per step

    def __init__(self, config: StateTtlConfig, clock: Callable[[], int], empty: bool = False) -> None:
        self.config = config
        self.clock = clock
        self.ttl_ms = config.ttl_ms
        self.on_read = config.update_type is TtlUpdateType.ON_READ_AND_WRITE
        self.return_expired = config.state_visibility is StateVisibility.RETURN_EXPIRED_IF_NOT_CLEANED_UP
        self._group = -1  # the cleanup cursor: key group, its keys, a map's user keys
        self._keys: List[Any] = []
        self._kpos = 0
        self._entries: Optional[List[Any]] = None
        self._epos = 0
        now = clock()
        # Every stamp in the state is >= floor: a new state's entries are all written
        # from now on; restored ones may be of any age until a full pass has seen them.
        self.floor: float = now if empty else -math.inf
        self._pass_start = now  # the pass of the cursor under way: when it began,
        self._pass_min = math.inf  # and the oldest stamp it has kept

    def expired(self, stamp: int, now: int) -> bool:
        return now - stamp >= self.ttl_ms

    def visible(self, stamp: int, now: int) -> bool:
        return now - stamp < self.ttl_ms or self.return_expired

    def may_have_expired(self, now: int) -> bool:
        return now - self.ttl_ms >= self.floor

    def cleanup(self, table: StateTable, budget: int, now: Optional[int] = None) -> None:
        """Checks about ``budget`` entries at the cursor and removes the expired ones
        (expired as of ``now``, by default the TTL clock's time)."""
        kind = table.descriptor.kind
        if now is None:
            now = self.clock()
        limit = now - self.ttl_ms  # stamps at or below this have expired
        groups = table.groups
        n = len(groups)
        moves = n  # key groups entered in one step, at most: all may be empty
        while budget > 0:
            if self._kpos >= len(self._keys):
                g = self._group
                while True:  # the next key group with entries (an empty one costs a test)
                    if moves == 0:
                        self._group, self._keys, self._kpos = g, [], 0
                        return
                    moves -= 1
                    if g + 1 < n:
                        g += 1
                    else:  # a full pass: every entry it did not remove is >= the floor
                        g = 0
                        self.floor = min(self._pass_min, self._pass_start)
                        self._pass_start, self._pass_min = now, math.inf
                    if groups[g]:
                        break
                self._group = g
                self._keys = list(groups[g])
                self._kpos = 0
                self._entries = None
                budget -= 1
                continue
            index, group = self._group, groups[self._group]
            if kind == "list" or kind == "map":
                key = self._keys[self._kpos]
                stored = group.get(key, _ABSENT)
                if stored is _ABSENT:
                    self._kpos += 1
                    budget -= 1
                elif kind == "list":
                    budget -= 1 + self._clean_list(table, index, key, stored, limit)
                    self._kpos += 1
                else:
                    budget -= self._clean_map(table, index, key, stored, limit, budget)
                continue
            # one value per key: a chunk of the keys in one comprehension
            chunk = self._keys[self._kpos : self._kpos + budget]
            self._kpos += len(chunk)
            budget -= len(chunk)
            get = group.get
            oldest = self._pass_min
            for key in chunk:
                e = get(key)
                if e is None:
                    continue
                if e[1] <= limit:
                    table.delete(index, key)
                elif e[1] < oldest:
                    oldest = e[1]
            self._pass_min = oldest

    def _clean_list(self, table: StateTable, index: int, key: Any, stored: List[Any], limit: int) -> int:
        """Drops the expired prefix of a list (elements are appended in stamp order,
        so expired ones gather at its front); copies only when at least half of the
        list goes, so the copying is paid for by the elements it removes."""
        if not stored:
            return 0
        if stored[0][1] > limit:
            self._pass_min = min(self._pass_min, stored[0][1])
            return 0
        cut = bisect.bisect_right(stored, limit, key=_stamp_of)
        if 2 * cut < len(stored):
            self._pass_min = min(self._pass_min, stored[0][1])  # expired ones stay: the floor stays below
            return 1
        live = [e for e in stored[:cut] if e[1] > limit]  # stamps out of order (a clock set back)
        live.extend(stored[cut:])
        if live:
            # A new list of the same element objects: not owned, so an unfinished snapshot's
            # elements are still copied before a read could hand them out to be changed.
            # (A restored list of tuples takes the stored form here too.)
            table.restamp(index, key, StampedList(live))
            self._pass_min = min(self._pass_min, live[0][1])
        else:
            table.delete(index, key)
        return 1 + cut // 64

    def _clean_map(
        self, table: StateTable, index: int, key: Any, stored: Dict[Any, Any], limit: int, budget: int
    ) -> int:
        if self._entries is None:
            self._entries = list(stored)
            self._epos = 0
        stop = min(len(self._entries), self._epos + budget)
        dead = []
        oldest = self._pass_min
        for user_key in self._entries[self._epos : stop]:
            entry = stored.get(user_key, _ABSENT)
            if entry is _ABSENT:
                continue
            if entry[1] <= limit:
                dead.append(user_key)
            elif entry[1] < oldest:
                oldest = entry[1]
        self._pass_min = oldest
        checked = stop - self._epos
        self._epos = stop
        if stop >= len(self._entries):
            self._entries = None
            self._kpos += 1
        if dead:
            owned = table.own(index, key, stored)
            for user_key in dead:
                del owned[user_key]
            if not owned:
                table.delete(index, key)
        return max(1, checked)


_stamp_of = operator.itemgetter(1)


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
        elif stored.__class__ is not list or (table.tainted[index] and key not in table.owned[index]):
            table.own(index, key, stored).append(element)  # copied once per key and snapshot
        else:
            stored.append(element)
            if table.changes is not None:
                table.changes[index].add(key)

    def _put(self, index: int, key: Any, elements: Any) -> None:
        table = self._table
        if table.shared[index]:
            table.writable(index)
        table.groups[index][key] = elements
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
        if table.tainted[index] and key not in table.owned[index]:
            stored = table.own(index, key, stored)  # copied once per key and snapshot
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
        table = self._table
        stored = table.groups[index].get(key)
        if stored is None:
            return None
        ttl = self._ttl
        if ttl is not None and not ttl.return_expired:
            limit = ttl.clock() - ttl.ttl_ms
            dead = [k for k, e in stored.items() if e[1] <= limit]
            if dead:
                stored = self._writable(index, key)
                for k in dead:
                    del stored[k]
                if not stored:
                    table.delete(index, key)
                    return None
        if table.needs_private(index, key) and not self._atomic:
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
            table.own(index, key, stored).append((value, now))  # copied once per key and snapshot
        else:
            stored.append((value, now))
            if table.changes is not None:
                table.changes[index].add(key)


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
            if table.tainted[index] and key not in table.owned[index]:
                stored = table.own(index, key, stored)
            elif table.changes is not None:
                table.changes[index].add(key)
            stored[user_key] = (value, now)


_TTL_STATE_CLASSES = {"value": _TtlValueState, "list": _TtlListState, "map": _TtlMapState}


_STATE_CLASSES = {
    "value": ValueState,
    "list": ListState,
    "map": MapState,
    "reducing": ReducingState,
    "aggregating": AggregatingState,
}


_time_ns = time.time_ns


def _wall_clock_ms() -> int:
    return _time_ns() // 1_000_000


class _CollectorPause:
    """The cyclic garbage collector off while any restore runs, as it was before
    once the last one ends (counted: subtasks restore on their own threads).

    Why: a restore makes every container of the state at once (a list per key of
    a list state, a dict per key of a map state), and those allocations set off the
    collector's full passes, each of which walks everything made so far, element
    by element. Measured on 10 M float64 list elements over 100,000 keys: a
    restore of 1.4-1.5 s with the collector, 0.55-0.65 s without. A restore makes
    no reference cycles of its own, so nothing is left for it to find; garbage
    other threads make meanwhile is collected once the pause ends. The switch is
    the process's: a ``gc.disable()`` made by other code during a restore is undone
    when the restore ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._depth = 0
        self._was_enabled = False

    def __enter__(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._was_enabled = gc.isenabled()
                gc.disable()
            self._depth += 1

    def __exit__(self, *exc: Any) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0 and self._was_enabled:
                gc.enable()


COLLECTOR_PAUSE = _CollectorPause()


class _CurrentKey:
    """The current key of a keyed backend: ``_key``, and ``_key_index``, its key
    group's index in the backend's range (-1: no key). Slots, not instance
    attributes: the native state calls and timers (``_native``, see
    ``bindings/_keycore.pxi``) read and write them at their place in the object,
    once per state call, timer registration and firing timer."""

    __slots__ = ("_key", "_key_index")

    def __init__(self) -> None:
        self._key: Any = None
        self._key_index: int = -1


class HeapKeyedStateBackend(_CurrentKey):
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
        self._ttl_clock = ttl_clock_ms or _wall_clock_ms
        # TTL's processing time (Flink's TtlTimeProvider). The wall clock is read at
        # most once per record (per set_current_key) for TTL stamps and checks:
        # reading it costs a system call on some hosts, and every state call would
        # pay it. A given clock is read on every call. Inside a step (``begin_ttl_step``:
        # the operator processing one buffer) any clock is read once for the step.
        self._ttl_cached = ttl_clock_ms is None
        self._ttl_now: Optional[int] = None
        self._ttl_step = False  # inside begin_ttl_step / end_ttl_step
        # The TTL states (and their tables), for the incremental cleanup, which counts
        # records at the clock's reads: once per record, or per step.
        self._ttl_states: List[Tuple[_Ttl, StateTable]] = []
        self._ttl_countdown = _Ttl.CLEANUP_EVERY  # records until the next cleanup step
        self._ttl_step_now: Optional[int] = None  # what set_current_key leaves in _ttl_now
        # Tables are StateTable (dicts) or columnar.ColumnarValueTable; states likewise.
        self._tables: Dict[str, Any] = {}
        # Every state the restored checkpoint names, with or without an entry in this
        # backend's key groups (state_names has only the latter), and its kind: a
        # state an older job had, though no key of it lands here.
        self.restored_state_kinds: Dict[str, str] = {}
        self._states: Dict[str, Any] = {}
        self._pending_writes: List[Callable[[], None]] = []  # see add_pending_writes
        super().__init__()  # no current key
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
        self._key_index = index
        self._ttl_now = self._ttl_step_now  # None (read the clock afresh) but inside a step

    def _ttl_time(self) -> int:
        """Processing time for TTL, in ms: the clock, read once per record, or once
        per step inside ``begin_ttl_step`` / ``end_ttl_step``."""
        now = self._ttl_now
        if now is None:
            if self._ttl_step:
                now = self._ttl_now = self._ttl_step_now = self._ttl_clock()
            elif self._ttl_cached:  # the wall clock, without a call of _wall_clock_ms
                now = self._ttl_now = _time_ns() // 1_000_000
            else:
                now = self._ttl_clock()
            self._ttl_countdown -= 1  # a record (or a call) that uses TTL: the cleanup's count
            if self._ttl_countdown <= 0:
                self._ttl_cleanup(0, now)
        return now

    def _ttl_cleanup(self, records: int, now: int) -> None:
        """Counts ``records`` more records for the incremental cleanup of the TTL
        states and runs the cleanup steps they are due (one per ``CLEANUP_EVERY``)."""
        every = _Ttl.CLEANUP_EVERY
        countdown = self._ttl_countdown - records
        if countdown > 0:
            self._ttl_countdown = countdown
            return
        steps = (every - countdown) // every
        self._ttl_countdown = countdown + steps * every
        for ttl, table in self._ttl_states:
            if ttl.may_have_expired(now):
                ttl.cleanup(table, _Ttl.CLEANUP_SIZE * steps, now)

    def begin_ttl_step(self, now_ms: Optional[int] = None, records: int = 1) -> None:
        """A step of the task's mailbox begins (an operator processing one buffer):
        until ``end_ttl_step``, every TTL stamp and expiry check uses one processing
        time, ``now_ms`` or else the TTL clock read now, once (Flink's
        ``TtlTimeProvider``, read per mailbox step rather than per state call).

        The granularity of expiry is then the step: an entry expires for a record
        when its TTL has passed as of the moment the record's buffer began to be
        processed (a buffer takes milliseconds), and entries written in the step
        are stamped with that moment. Time never goes back: the steps of a task
        follow each other. A backend without TTL state reads no clock.

        ``records``: how many records the step processes, for the incremental
        cleanup of expired entries, which runs here, once for the step (as much as
        that many records would run one by one), so no state call counts."""
        self._ttl_step = True
        if self._ttl_states:
            if now_ms is None:
                now_ms = self._ttl_clock()
            self._ttl_cleanup(records, now_ms)
        self._ttl_now = self._ttl_step_now = now_ms

    def advance_ttl_step(self) -> None:
        """Within a step, the TTL clock read again, for the next records of a long
        buffer (the cleanup was counted for the whole step when it began)."""
        if self._ttl_states:
            self._ttl_now = self._ttl_step_now = self._ttl_clock()

    def end_ttl_step(self) -> None:
        """The step is over: outside steps TTL reads the clock once per record again."""
        self._ttl_step = False
        self._ttl_now = self._ttl_step_now = None

    @property
    def current_key(self) -> Any:
        return self._key

    @property
    def current_key_group(self) -> int:
        # Derived, not stored: set_current_key and a firing timer set the key and its
        # index only (one attribute write fewer per record and per timer).
        index = self._key_index
        return self._kg_start + index if index >= 0 else -1

    # -- states -------------------------------------------------------------------

    @overload
    def get_state(self, descriptor: ValueStateDescriptor[T]) -> ValueState[T]: ...

    @overload
    def get_state(self, descriptor: ListStateDescriptor[T]) -> ListState[T]: ...

    @overload
    def get_state(self, descriptor: MapStateDescriptor[K, V]) -> MapState[K, V]: ...

    @overload
    def get_state(self, descriptor: ReducingStateDescriptor[T]) -> ReducingState[T]: ...

    @overload
    def get_state(self, descriptor: AggregatingStateDescriptor[IN, OUT]) -> AggregatingState[IN, OUT]: ...

    @overload
    def get_state(self, descriptor: StateDescriptor) -> Any: ...

    def get_state(self, descriptor: StateDescriptor) -> Any:
        """The state object for ``descriptor``, created on first use. Asking again
        with an equal descriptor returns the same object; a different descriptor
        under the same name is refused."""
        state = self._states.get(descriptor.name)
        if state is not None:
            if state._table.descriptor != descriptor:
                raise StateNameConflictError(
                    f"state {descriptor.name!r} is already registered as {state._table.descriptor!r}; "
                    f"it cannot also be {descriptor!r}"
                )
            return state
        cls = _STATE_CLASSES.get(descriptor.kind)
        if cls is None:
            raise TypeError(f"not a keyed state descriptor: {descriptor!r}")
        default = getattr(descriptor, "default", None)
        if default is not None:  # a key without a value reads it: it must fit the type as an update must
            check_default = _validator(getattr(descriptor, "type", None), f"value state {descriptor.name!r} default")
            if check_default is not None:
                try:
                    check_default(default)
                except TypeError as exc:
                    raise StateDescriptorError(str(exc)) from None
        from .columnar import ColumnarValueState, ColumnarValueTable, columnar_dtype

        dtype = columnar_dtype(descriptor) if self._columnar else None
        table: Any = self._tables.get(descriptor.name)
        if isinstance(table, ColumnarValueTable) and (dtype is None or dtype != table.dtype):
            table = self._columnar_table_to_dict(descriptor.name)
        if table is None and dtype is not None:
            self._check_room(descriptor)
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
            self._check_room(descriptor)
            table = StateTable(descriptor, len(self.key_group_range))
            self._tables[descriptor.name] = table
        elif table.descriptor.kind != descriptor.kind:
            raise ValueError(
                f"state {descriptor.name!r} holds {table.descriptor.kind} state; it cannot be read as {descriptor.kind}"
            )
        else:
            self._adopt(table, descriptor)
        ttl_config = getattr(descriptor, "ttl", None)
        ttl = _Ttl(ttl_config, self._ttl_time, empty=len(table) == 0) if ttl_config is not None else None
        if ttl is not None:
            self._ttl_states.append((ttl, table))
        if ttl is not None and not ttl.on_read and not ttl.return_expired:
            cls = _TTL_STATE_CLASSES.get(descriptor.kind, cls)  # Flink's default TTL: the direct paths
        state = cls(self, table, ttl)
        self._states[descriptor.name] = state
        return state

    def retype_value_state(self, descriptor: ValueStateDescriptor[Any]) -> Any:
        """The value state ``descriptor`` names, with every stored entry converted to the
        descriptor's (wider) type: ``pe.agg.sum`` over a column of whole numbers that now
        holds fractions keeps its sums as int64 no longer but as float64, under the same
        name, so what a reader or a restore finds stays where it was. Columnar storage
        stays columnar (a restored chain across the type change, held as dicts, becomes
        columns again where its keys allow). Values are converted as Arrow casts them
        (``safe``): a conversion that would change a value raises ``StateTypeError``.
        An unfinished snapshot keeps the entries it froze."""
        from .columnar import ColumnarValueTable, columnar_dtype

        name = descriptor.name
        if descriptor.kind != "value" or getattr(descriptor, "ttl", None) is not None:
            raise TypeError(f"retype_value_state takes a value state descriptor without a TTL, got {descriptor!r}")
        old = self._tables.get(name)
        self._states.pop(name, None)
        if old is None:
            return self.get_state(descriptor)
        arrow_type = descriptor.type
        dtype = columnar_dtype(descriptor) if self._columnar else None
        # an incremental backend's change log: the keys written or removed since its last take
        changed: Optional[List[Set[Any]]] = None
        if isinstance(old, ColumnarValueTable):
            parts = [group.arrays() for group in old.groups]
            changed = old.pending_key_sets() if old.tracking else None
        else:
            parts = [(list(group), list(group.values())) for group in old.groups]
            changed = old.changes

        def converted(values: Any) -> pa.Array:
            try:
                return pa.array(values).cast(arrow_type, safe=True) if arrow_type is not None else pa.array(values)
            except (pa.ArrowException, TypeError, ValueError) as exc:
                raise StateTypeError(f"value state {name!r} cannot hold its values as {arrow_type}: {exc}") from None

        int_keys = all(
            isinstance(keys, np.ndarray) or all(type(k) is int and -(1 << 63) <= k < (1 << 63) for k in keys)
            for keys, _ in parts
        )
        new: Any
        if dtype is not None and int_keys:
            new = ColumnarValueTable(descriptor, len(self.key_group_range), dtype)
            if changed is not None:
                new.track_changes()  # every entry is written anew, in the new type
            for index, (group, (keys, values)) in enumerate(zip(new.groups, parts, strict=True)):
                if len(keys):
                    group.put_many(np.asarray(keys, np.int64), converted(values).to_numpy(zero_copy_only=False))
                for key in changed[index] if changed is not None else ():
                    if not group.contains(key):  # removed since the last take: logged as removed again
                        group.put(key, 0)
                        group.remove(key)
        else:
            new = StateTable(descriptor, len(self.key_group_range))
            for group, (keys, values) in zip(new.groups, parts, strict=True):
                if len(keys):
                    keys = keys.tolist() if isinstance(keys, np.ndarray) else keys
                    group.update(zip(keys, converted(values).to_pylist(), strict=True))
            if changed is not None:
                new.changes = [set(c) | set(g) for c, g in zip(changed, new.groups, strict=True)]
        self._tables[name] = new
        self._retyped(name)
        return self.get_state(descriptor)

    def _retyped(self, name: str) -> None:
        """Called when ``retype_value_state`` replaced a state's table (see the
        incremental backend: the next snapshot writes it whole)."""

    def _check_room(self, descriptor: StateDescriptor) -> None:
        """Refuses a new state that one keyed state file could not hold (more than
        32767 states, or past 128 states more than 128 distinct storage types:
        ``pyengine.snapshot.format.check_state_count``) when it is declared, in the
        function's ``open``, rather than at the job's first checkpoint."""
        from ..snapshot.format import MAX_UNION_CHILDREN, check_state_count

        count = len(self._tables) + 1
        if count <= MAX_UNION_CHILDREN:
            return  # one union child per state: always room
        from ..snapshot.strategies import column_of

        descriptors = [t.descriptor for t in self._tables.values()] + [descriptor]
        check_state_count(count, [column_of(d).file_type for d in descriptors], where=f"state {descriptor.name!r}")

    def add_pending_writes(self, flush: Callable[[], None]) -> None:
        """``flush()`` applies writes that a state's owner holds back to batch them
        (the timers' registrations; the owner applies them itself before it reads its
        states): called before a snapshot freezes the states. Only ever on the task's
        thread: a flush changes the timer sets, which the task changes too."""
        self._pending_writes.append(flush)

    def apply_pending_writes(self) -> None:
        for flush in self._pending_writes:
            flush()

    @property
    def restored_state_names(self) -> FrozenSet[str]:
        """The states the restored checkpoint names (``restored_state_kinds``)."""
        return frozenset(self.restored_state_kinds)

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
        """Entries of one state or of all (read from other threads, by the monitoring: it
        applies no held-back writes, so timers registered since the last flush are not
        counted yet)."""
        tables = list(self._tables.values()) if state_name is None else [self._tables[state_name]]
        return sum(len(t) for t in tables)

    def dispose(self) -> None:
        self._pending_writes.clear()
        self._tables.clear()
        self._states.clear()
        self._ttl_states.clear()
        self._key_index = -1

    # -- snapshots ----------------------------------------------------------------

    def snapshot(self, checkpoint_id: int, location: Any) -> Any:
        """The synchronous part of a snapshot: freezes every state (copy-on-write,
        O(number of key groups)) and returns the asynchronous part, whose ``run()``
        writes the state file and returns a SnapshotResult."""
        from ..snapshot.strategies import FullSnapshot, column_of

        self.apply_pending_writes()
        names = sorted(self._tables)
        with self._freeze_lock:
            tables = [self._tables[n] for n in names]
            frozen = [_without_expired(t, t.freeze(), self._ttl_clock) for t in tables]

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
        (or the state is named in ``allow_pickle``). The cyclic garbage collector
        is paused meanwhile (``COLLECTOR_PAUSE``). Writes held back for the state it
        replaces (``add_pending_writes``) are dropped with it: their owners (the timer
        queues) are made again over the restored states."""
        with COLLECTOR_PAUSE:
            self._restore(handles, allow_pickle)
        self._pending_writes.clear()  # after: a restore that fails leaves the queues as they were

    def _restore(self, handles: Any, allow_pickle: Any) -> None:
        from ..snapshot.format import TOMBSTONE, read_keyed_state
        from ..storage.handles import KeyGroupsStateHandle
        from .columnar import ColumnarValueTable
        from .timers import TIMERS_KIND, RestoredTimers

        restored: Dict[str, Any] = {}
        named: Dict[str, str] = {}
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
            info, entries = read_keyed_state(
                handle, self.key_group_range, allow_pickle=allow_pickle, defer_pickle=True, arrays=self._columnar
            )
            named.update((column.name, column.kind) for column in info.columns)
            # A file's timers are its key groups' timers whole (a delta's too): what an
            # older file of the chain said of those key groups goes.
            for column in info.columns:
                if column.kind == TIMERS_KIND:
                    timers = restored.get(column.name)
                    if timers is None:
                        timers = restored[column.name] = RestoredTimers(column.name, len(self.key_group_range))
                    overlap = self.key_group_range.intersection(
                        KeyGroupRange(handle.key_group_start, handle.key_group_end)
                    )
                    for key_group in overlap:
                        timers.reset(key_group - self.key_group_range.start)
            for key_group, spec, keys, values in entries:
                table = restored.get(spec.name)
                if spec.kind == TIMERS_KIND:  # its RestoredTimers made above
                    restored[spec.name].add(key_group - self.key_group_range.start, keys, values)
                    continue
                # typed value state with int keys: straight into columns, if NumPy can hold the
                # type (a struct- or string-typed value state restores into dicts, as any other)
                if isinstance(keys, pa.Array) and not (
                    pa.types.is_integer(values.type)
                    or pa.types.is_floating(values.type)
                    or pa.types.is_boolean(values.type)
                ):
                    keys = keys.to_pylist()
                    values = [TOMBSTONE if v is None else v for v in values.to_pylist()]
                if isinstance(keys, pa.Array):  # typed value state with int keys: straight into columns
                    dtype = np.dtype(values.type.to_pandas_dtype())
                    if table is None:
                        table = ColumnarValueTable(_RestoredDescriptor(spec), len(self.key_group_range), dtype)
                        restored[spec.name] = table
                    # another file of another type (a chain across a type change): dict storage
                    # below, not a cast into the first file's columns (1.5 into int64 is 1)
                    if isinstance(table, ColumnarValueTable) and table.dtype == dtype:
                        table.load(key_group - self.key_group_range.start, keys, values)
                        continue
                    keys = keys.to_pylist()
                    values = [TOMBSTONE if v is None else v for v in values.to_pylist()]
                if isinstance(table, ColumnarValueTable):  # mixed key types: dict storage after all
                    dict_table = StateTable(table.descriptor, len(self.key_group_range))
                    dict_table.groups = table.to_dicts()
                    restored[spec.name] = table = dict_table
                if table is None:
                    table = StateTable(_RestoredDescriptor(spec), len(self.key_group_range))
                    table.pickled = spec.serializer == "pickle" and spec.name not in allow_pickle
                    restored[spec.name] = table
                elif table.descriptor.kind != spec.kind:
                    raise ValueError(
                        f"state {spec.name!r} is {table.descriptor.kind} in one file, {spec.kind} in another"
                    )
                else:
                    table.descriptor.refile(spec, table, self._ttl_time())
                group = table.groups[key_group - self.key_group_range.start]
                for k, v in zip(keys, values, strict=True):
                    if v is TOMBSTONE:  # a later delta deleted it
                        group.pop(k, None)
                    else:
                        group[k] = v
        self._tables = restored
        self.restored_state_kinds = named
        self._states = {}
        self._ttl_states = []

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
        restored = table.descriptor if isinstance(table.descriptor, _RestoredDescriptor) else None
        ttl = getattr(descriptor, "ttl", None) is not None
        if restored is not None and restored.stamped != ttl:
            _migrate_ttl(table, descriptor.kind, ttl, self._ttl_time())
            object.__setattr__(restored, "stamped", ttl)  # done: a declaration refused below does not redo it
        if restored is not None and restored.types != _declared_types(descriptor):
            _check_restored_types(table, descriptor, restored.types, ttl)
            object.__setattr__(restored, "types", _declared_types(descriptor))
        if descriptor.kind == "list":
            _retype_lists(table, list_typecode(descriptor))
        table.descriptor = descriptor

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Full snapshots keep nothing between checkpoints but local copies."""
        self._prune_local(checkpoint_id)


def _declared_types(descriptor: Any) -> Tuple[Optional[str], Optional[str]]:
    """A descriptor's declared types as a state file's column records them
    (``StateColumn.declared``: map key type, value or element type, as text)."""
    if descriptor.kind == "map":
        key, value = descriptor.key_type, descriptor.value_type
    else:
        key, value = None, getattr(descriptor, "type", None)
    return (None if key is None else str(key), None if value is None else str(value))


def _check_restored_types(table: StateTable, descriptor: Any, written: Tuple[Any, Any], stamped: bool) -> None:
    """A restored state declared with other types than it was checkpointed with: every
    value must pass the check a write of it would (and is stored as that check gives
    it: an int as a float for a float type), or the state is refused at once, naming
    both types. Before, a float64 state declared int64 handed out floats and
    truncated them in the next checkpoint, silently."""
    kind = descriptor.kind
    what = f"{kind} state {descriptor.name!r}"
    value_type = descriptor.value_type if kind == "map" else getattr(descriptor, "type", None)
    check = _validator(value_type, what)
    check_key = _validator(descriptor.key_type, f"{what} key") if kind == "map" else None
    if check is None and check_key is None:
        return  # untyped now: any value goes

    def value(v: Any) -> Any:
        return v if check is None else check(v)

    def key(k: Any) -> Any:
        return k if check_key is None else check_key(k)

    try:
        for index, group in enumerate(table.groups):
            for k, stored in list(group.items()):
                if kind == "list":
                    if stamped:
                        new: Any = StampedList([(value(e), st) for e, st in stored])
                    else:
                        new = [value(e) for e in stored]
                elif kind == "map":
                    if stamped:
                        new = {key(u): (None if e[0] is None else value(e[0]), e[1]) for u, e in stored.items()}
                    else:
                        new = {key(u): None if v is None else value(v) for u, v in stored.items()}
                else:
                    new = (value(stored[0]), stored[1]) if stamped else value(stored)
                table.restamp(index, k, new)
    except (StateTypeError, TypeError, ValueError) as exc:
        raise StateTypeError(
            f"{what} was checkpointed {_types_name(written, kind)} and is declared "
            f"{_types_name(_declared_types(descriptor), kind)}, and a restored value does not fit: {exc}. Declare it "
            "as it was checkpointed, or under a new name to start that state empty"
        ) from None


_SEVERAL_TYPES = ("several types", "several types")  # files of one state that disagree: checked when declared


def _types_name(types: Tuple[Any, Any], kind: str) -> str:
    if types == (None, None):
        return "untyped"
    if types == _SEVERAL_TYPES:
        return "in files of different types"
    if kind != "map":
        return f"as {types[1]}"
    return f"as {'any key' if types[0] is None else types[0]} -> {'any value' if types[1] is None else types[1]}"


def _migrate_ttl(table: StateTable, kind: str, add: bool, now: int) -> None:
    """A restored state whose descriptor added a TTL (``add``) or dropped it: every
    entry gets the restore's time as its write time (nothing in the checkpoint says
    when it was written, so it lives a whole TTL from now), or loses its write time.
    Before, the first read of such state failed, or, without the TTL, returned
    ``(value, stamp)`` tuples as values."""
    for index, group in enumerate(table.groups):
        for k, stored in list(group.items()):
            if kind == "list":
                new: Any = StampedList([(e, now) for e in stored]) if add else [e[0] for e in stored]
            elif kind == "map":
                new = {u: (v, now) for u, v in stored.items()} if add else {u: e[0] for u, e in stored.items()}
            else:  # value, reducing, aggregating: one entry
                new = (stored, now) if add else stored[0]
            table.restamp(index, k, new)


def _retype_lists(table: StateTable, typecode: Optional[str]) -> None:
    """A restored list state's elements in the containers its descriptor asks for: an
    array.array of ``typecode``, or lists (a restore makes arrays of a typed list
    column's elements; the descriptor may since have changed its type or added a TTL).
    Every key is looked at: a chain of incremental files may mix typed and untyped ones."""
    for index, group in enumerate(table.groups):
        for k, stored in list(group.items()):
            if type(stored) is TYPED_LIST:
                if stored.typecode != typecode:
                    retyped = stored.tolist() if typecode is None else _retyped(stored.tolist(), typecode)
                    table.restamp(index, k, retyped)  # copy-on-write: a pending snapshot keeps its dict
            elif typecode is not None and type(stored) is list:
                table.restamp(index, k, _retyped(stored, typecode))


def _retyped(elements: List[Any], typecode: str) -> Any:
    """``elements`` in an array.array of ``typecode``, or left a list when one does not
    fit (the state's check refuses it at its next write, as before)."""
    try:
        return TYPED_LIST(typecode, elements)
    except (TypeError, OverflowError):
        return elements


def _without_expired(table: Any, frozen: List[Any], clock: Callable[[], int]) -> Any:
    """A TTL state's frozen key groups as the snapshot's asynchronous part will
    write them: without the entries expired by then (Flink's cleanup in full
    snapshots). Filtering happens there, on the snapshot's thread, one key group
    at a time; the synchronous part stays O(number of key groups)."""
    ttl = getattr(table.descriptor, "ttl", None)
    if ttl is None or not isinstance(table, StateTable):
        return frozen
    return _ExpiringGroups(frozen, table.descriptor.kind, ttl.ttl_ms, clock)


class _ExpiringGroups(Sequence[Dict[Any, Any]]):
    """Frozen key-group dicts, each filtered of expired entries on first access."""

    def __init__(self, frozen: List[Dict[Any, Any]], kind: str, ttl_ms: int, clock: Callable[[], int]) -> None:
        self._frozen = frozen
        self._kind = kind
        self._ttl_ms = ttl_ms
        self._clock = clock
        self._limit: Optional[int] = None
        self._done: Dict[int, Dict[Any, Any]] = {}

    def __len__(self) -> int:
        return len(self._frozen)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        done = self._done.get(i)
        if done is None:
            if self._limit is None:
                self._limit = self._clock() - self._ttl_ms  # stamps at or below it have expired
            done = self._done[i] = self._filter(self._frozen[i], self._limit)
        return done

    def _filter(self, group: Dict[Any, Any], limit: int) -> Dict[Any, Any]:
        return _live_entries(group, self._kind, limit)

    def get_live(self, i: int, key: Any, default: Any) -> Any:
        """Key group ``i``'s entry of ``key`` without what expired (an incremental
        snapshot's delta reads its changed keys this way, never a whole key group);
        ``default`` when it has none or all of it expired."""
        entry = self._frozen[i].get(key, _ABSENT)
        if entry is _ABSENT:
            return default
        if self._limit is None:
            self._limit = self._clock() - self._ttl_ms
        live = _live_entry(entry, self._kind, self._limit)
        return default if live is _ABSENT else live


def _live_entry(entry: Any, kind: str, limit: int) -> Any:
    """One stored TTL entry without what expired at ``limit`` (stamps at or below it
    have expired): the entry itself when nothing did, ``_ABSENT`` when all of it did."""
    if kind == "list":  # written as a list of (value, stamp) tuples, whatever its stored form
        if type(entry) is list and entry and entry[0][1] > limit and entry[-1][1] > limit:
            if all(e[1] > limit for e in entry):
                return entry  # nothing expired: the stored list itself
        live = [e for e in entry if e[1] > limit]  # a StampedList: its tuples made here, in one pass
        return live if live else _ABSENT
    if kind == "map":
        live_map = {u: e for u, e in entry.items() if e[1] > limit}
        if not live_map:
            return _ABSENT
        return live_map if len(live_map) < len(entry) else entry
    return entry if entry[1] > limit else _ABSENT


def _live_entries(group: Dict[Any, Any], kind: str, limit: int) -> Dict[Any, Any]:
    """A key group's dict of TTL entries without what expired at ``limit``."""
    if kind == "list":
        out: Dict[Any, Any] = {}
        for k, elements in group.items():
            live = _live_entry(elements, kind, limit)
            if live is not _ABSENT:
                out[k] = live
        return out
    if kind == "map":
        out = {}
        for k, entries in group.items():
            live_map = {u: e for u, e in entries.items() if e[1] > limit}
            if live_map:
                out[k] = live_map if len(live_map) < len(entries) else entries
        return out
    return {k: e for k, e in group.items() if e[1] > limit}


class _RestoredDescriptor(StateDescriptor):
    """Stands in for a restored state's descriptor until get_state provides the real
    one: made from the state file's column (``spec``), so a checkpoint taken before
    the state is declared again writes it as it was written (its types, serializer
    and TTL layout)."""

    stamped: bool
    types: Tuple[Optional[str], Optional[str]]

    def __init__(self, spec: Any) -> None:
        object.__setattr__(self, "name", spec.name)
        object.__setattr__(self, "kind", spec.kind)  # shadows the class attribute of the kind
        # written with a TTL: its entries carry write times (snapshots keep the layout)
        object.__setattr__(self, "stamped", spec.ttl)
        # the types its writes were checked against (text; None: none), kept in the file even
        # where its values are serialized (a TTL, pickle)
        object.__setattr__(self, "types", spec.declared)
        object.__setattr__(self, "serializer", "pickle" if spec.serializer == "pickle" else "safe")
        if spec.kind == "map":
            object.__setattr__(self, "key_type", spec.map_key_type)
            object.__setattr__(self, "value_type", spec.arrow_type)
        else:
            object.__setattr__(self, "type", spec.arrow_type)

    def refile(self, spec: Any, table: Any, now: int) -> None:
        """Another file of this state (a later one of an incremental chain, or another
        old subtask's on a rescale): its entries go into the same table, so the table
        takes their TTL layout (converting what it holds), and differing declared
        types leave the check to the state's declaration."""
        if spec.ttl != self.stamped:
            _migrate_ttl(table, self.kind, spec.ttl, now)
            object.__setattr__(self, "stamped", spec.ttl)
        if spec.declared != self.types:
            object.__setattr__(self, "types", _SEVERAL_TYPES)
