"""Time-to-live of heap state: the per-state bookkeeping and incremental cleanup
(``_Ttl``), and what a snapshot or a restore does with stamped entries (leaving
expired entries out of the file; adding or dropping stamps when a descriptor adds
or drops its TTL).
"""

from __future__ import annotations

import bisect
import math
import operator
from typing import (
    Any,
    Callable,
    Dict,
    List,
    Optional,
    Sequence,
)

from .._native import StampedList
from .descriptors import (
    StateTtlConfig,
    StateVisibility,
    TtlUpdateType,
)
from .table import _ABSENT, StateTable


def _int_clock(clock: Callable[[], Any]) -> Callable[[], int]:
    """A custom TTL clock whose readings are stamps: int milliseconds, a float reading
    rounded up (stamps and expiry checks alike, so TTL counts whole milliseconds of it),
    so a snapshot converts the stamps in one C pass (``snapshot/stamped.py``) without
    truncating any."""

    def read() -> int:
        now = clock()
        return now if type(now) is int else math.ceil(now)

    return read


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
_value_of = operator.itemgetter(0)
_ATOMIC_TYPES = frozenset((int, float, str, bytes, bool, type(None)))


def _stamped_atomic(stored: Any) -> bool:
    """Whether a TTL list's or map's values are all immutable (one C pass over their
    types): a read may then hand them out without a private copy, even while a
    snapshot holds them."""
    if type(stored) is StampedList:
        return _ATOMIC_TYPES.issuperset(map(type, stored.values))
    if type(stored) is dict:
        return _ATOMIC_TYPES.issuperset(map(type, map(_value_of, stored.values())))
    return False


def _own_stamped(table: StateTable, index: int, key: Any, stored: Any, atomic: bool) -> Any:
    """A TTL list or map that an unfinished snapshot may hold, made private for its
    first write since: when its values are immutable (``atomic``: a declared type;
    else found so by one C pass over their types), a copy of its pointers (a
    StampedList's two lists, a dict of the same ``(value, stamp)`` tuples), which the
    snapshot and the state then share element by element: ~3 ns an element, where
    ``StateTable.own`` copies every element through a Python call (~200 ns; a
    StampedList's elements also as a tuple each). Values user code could change in
    place are copied by ``own``, as before."""
    if type(stored) is StampedList:
        if atomic or _ATOMIC_TYPES.issuperset(map(type, stored.values)):
            private = StampedList()
            private.values.extend(stored.values)
            private.stamps.extend(stored.stamps)
            table.store(index, key, private)
            return private
    elif type(stored) is dict:
        if atomic or _ATOMIC_TYPES.issuperset(map(type, map(_value_of, stored.values()))):
            private_map = dict(stored)
            table.store(index, key, private_map)
            return private_map
    return table.own(index, key, stored)


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

    def stamp_limit(self) -> int:
        """The stamp at or below which an entry has expired for this snapshot (read
        once, when first asked): a state file of columns (a state with declared types)
        reads ``unfiltered`` and leaves the expired entries out with NumPy masks."""
        if self._limit is None:
            self._limit = self._clock() - self._ttl_ms
        return self._limit

    @property
    def unfiltered(self) -> List[Dict[Any, Any]]:
        """The frozen key-group dicts as they are, expired entries included."""
        return self._frozen

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
