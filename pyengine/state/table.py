"""The stored entries of a heap state: one dict per key group, copied on write.

A snapshot's synchronous part only marks every key group *shared*, and the first
write to a shared key group copies that key group's dict; a mutable value read from
a shared key group is deep-copied before the caller gets it. The write checks of a
declared type (``_validator``) live here too: the table's fields are
``_native.StateTableBase``'s and the C state calls run the checks it holds.
"""

from __future__ import annotations

import copy
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Optional,
    Set,
    Tuple,
)

import numpy as np
import pyarrow as pa

from .._native import StampedList
from .._native import StateTableBase as _StateTableBase
from .descriptors import (
    StateDescriptor,
    StateTypeError,
)
from .serializers import TYPED_LIST, plain_check

__all__ = [
    "StateTable",
]


_ABSENT = object()
_ATOMIC = (int, float, str, bytes, bool, type(None))
_ATOMIC_SET = frozenset(_ATOMIC)


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

    # Its fields are ``_native.StateTableBase``'s, so the C state calls read them directly;
    # the slots below are copy-on-write by tail (``track_tails``), which only Python reads.
    __slots__ = ("_frozen_generations", "_generation", "_tail_log", "keep_tainted")

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
        # Copy-on-write by tail (typed lists held as array.arrays, see ``grow``); None: not tracked.
        # ``tails``: per key group, key -> its list's length at the key's first append since
        # the last freeze, for the keys only appended to since (an incremental delta writes
        # their new elements alone). ``grown``: id(array) -> that length, for every array
        # appended to in place since the freeze (a snapshot writes an array up to it).
        self.tails: Optional[List[Dict[Any, int]]] = None
        self.grown: Dict[int, int] = {}
        # (generation, its grown) of the generations an unfinished snapshot may need; a
        # generation starts at each freeze.
        self._tail_log: List[Tuple[int, Dict[int, int]]] = []
        self._generation = 0
        self._frozen_generations: List[int] = []  # the generation each unfinished snapshot froze at
        # The incremental backend: tainted until the next freeze, not only while a snapshot
        # runs, so the first append to a key since the last freeze records where its tail starts.
        self.keep_tainted = False

    def track_tails(self) -> None:
        """Copy-on-write by tail for this table, a typed list state whose lists are
        array.arrays of numbers changed in place only by appends (``ListState``)."""
        if self.tails is None:
            self.tails = [{} for _ in self.groups]
            self.grown = {}
            self._tail_log = [(self._generation, self.grown)]

    def grow(self, index: int, key: Any, container: Any) -> Any:
        """``container``, the array.array stored under ``key``, which the caller is about
        to append to in place (``track_tails``): copy-on-write by tail. An unfinished
        snapshot that froze it writes it only up to the length it had (``frozen_lengths``),
        so nothing is copied; its first append since the freeze records that length."""
        if self.tainted[index] and key not in self.owned[index]:
            n = len(container)
            if self.active_snapshots > 0:  # only a snapshot frozen before now reads it
                self.grown[id(container)] = n
            if self.changes is not None:
                self.tails[index][key] = n  # type: ignore[index]
            self.owned[index].add(key)
        if self.changes is not None:
            self.changes[index].add(key)
        return container

    def _rewritten(self, index: int, key: Any) -> None:
        """``key``'s list is replaced or removed: its next delta writes it whole."""
        if self.tails is not None:
            self.tails[index].pop(key, None)

    @property
    def generation(self) -> int:
        """The freeze count of a table with copy-on-write by tail: what a snapshot taken
        by ``freeze`` passes to ``frozen_lengths`` and ``release``."""
        return self._generation

    def frozen_lengths(self, generation: int) -> Dict[int, int]:
        """``{id(array): length}`` of the arrays appended to in place since the freeze
        of ``generation``, each with its length at that freeze (the earliest record of
        it from then on: appends to it before its first record were none)."""
        out: Dict[int, int] = {}
        for gen, grown in reversed(list(self._tail_log)):
            if gen < generation:
                break
            out.update(grown)  # one C call: no append of the task's comes in between
        return out

    def writable(self, index: int) -> Dict[Any, Any]:
        """The key group's dict, copied first if a snapshot still references it."""
        if self.shared[index]:
            self.groups[index] = dict(self.groups[index])
            self.shared[index] = False
        return self.groups[index]

    def store(self, index: int, key: Any, value: Any) -> None:
        """Stores a value object that no snapshot references."""
        self.writable(index)[key] = value
        if self.tails is not None:
            self._rewritten(index, key)
        if self.tainted[index]:
            self.owned[index].add(key)
        if self.changes is not None:
            self.changes[index].add(key)

    def restamp(self, index: int, key: Any, stored: Any) -> None:
        """Replaces a stored entry by one holding the same value objects (a new TTL stamp)."""
        self.writable(index)[key] = stored
        if self.tails is not None:
            self._rewritten(index, key)
        if self.changes is not None:
            self.changes[index].add(key)

    def delete(self, index: int, key: Any) -> None:
        if key in self.groups[index]:
            self.writable(index).pop(key, None)
            if self.tails is not None:
                self._rewritten(index, key)
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
        elif _ATOMIC_SET.issuperset(map(type, container)):  # plain scalars (the usual list): one C copy
            container = container[:]
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
        if self.tails is not None:  # a new generation of tails: what this snapshot's arrays grow by
            self._generation += 1
            self.tails = [{} for _ in self.groups]
            self.grown = {}
            self._tail_log.append((self._generation, self.grown))
            self._frozen_generations.append(self._generation)
            self._prune_tails()
        return list(self.groups)

    def _prune_tails(self) -> None:
        oldest = min(self._frozen_generations, default=self._generation)
        self._tail_log = [(g, grown) for g, grown in self._tail_log if g >= oldest]

    def release(self, generation: Optional[int] = None) -> None:
        """A snapshot finished with the dicts it froze (``generation``: the table's
        ``generation`` right after its freeze, for copy-on-write by tail)."""
        self.active_snapshots -= 1
        if self.tails is not None and generation in self._frozen_generations:
            self._frozen_generations.remove(generation)
            self._prune_tails()
        if self.active_snapshots == 0:
            n = len(self.groups)
            self.shared = [False] * n
            if not (self.keep_tainted and self.tails is not None):  # see keep_tainted
                self.tainted = [False] * n
                self.owned = [set() for _ in range(n)]

    def __len__(self) -> int:
        return sum(len(g) for g in self.groups)
