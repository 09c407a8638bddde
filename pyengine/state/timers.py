"""Timers as keyed state: Flink's ``InternalTimerService`` over a keyed backend.

A timer is a (key, timestamp) pair, in one of two domains (event time and
processing time). Registering one twice is one timer; deleting one that is not
there does nothing.

Where they are kept: two value states per domain in the operator's keyed
backend, so timers are snapshotted, restored and rescaled by key group exactly
like the rest of the keyed state, by either backend, with no code of their own:

* ``_timer_state/<domain>_timers``, typed int64: the key's timer when it has
  one (the common case; with int keys this is columnar storage, written as one
  Arrow column), or ``-2**63`` when it has several;
* ``_timer_state/<domain>_timers_more``: the tuple of a key's timestamps when it
  has several.

``pe.state.read_keyed_state(checkpoint, uid, "_timer_state/event_timers")``
lists them. The synchronous part of a snapshot freezes them copy-on-write like
any state (O(key groups)).

Which timer fires next is an index in memory, rebuilt from the states on
restore: a heap of distinct timestamps and, per timestamp, the keys that
registered one. It is never snapshotted; deletions leave stale entries in it,
which firing skips by checking the state (the state is the truth)."""

from __future__ import annotations

import heapq
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from .columnar import ColumnarValueTable
from .descriptors import ValueStateDescriptor

__all__ = ["EVENT", "PROCESSING", "SEVERAL", "InternalTimerService", "TimerQueue"]

SEVERAL = -(2**63)
"""What the primary timer state holds for a key with several timers."""

EVENT, PROCESSING = "event", "processing"


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class TimerQueue:
    """The timers of one domain; see the module docstring. Methods act on the
    backend's current key, except ``due``, which sets it to each firing key.

    Registering a timer and firing one happen once per record in a job that sets a
    timer per record, so the common case (one timer per key) reads and writes the
    backend's tables directly: a columnar group's ``get``/``put``/``remove`` for int
    keys, the key group's dict through ``StateTable.store``/``delete`` otherwise
    (both keep copy-on-write and the incremental change log). Anything else goes
    through the state objects."""

    def __init__(self, backend: Any, domain: str) -> None:
        self.domain = domain
        self._backend = backend
        self._one_name = f"_timer_state/{domain}_timers"
        self._more_name = f"_timer_state/{domain}_timers_more"
        self._one = backend.get_state(ValueStateDescriptor(self._one_name, None, pa.int64()))
        self._more = backend.get_state(ValueStateDescriptor(self._more_name))
        self._tables = backend._tables
        self._heap: List[int] = []
        self._keys: Dict[int, List[Tuple[Any, int]]] = {}  # timestamp -> (key, key group index)
        self._rebuild()

    # -- the state ---------------------------------------------------------------------------

    def register(self, ts: int) -> None:
        if type(ts) is not int:
            ts = _timestamp(ts)
        if ts == SEVERAL:
            raise ValueError(f"a timer cannot be registered at {SEVERAL} (the smallest int64)")
        b = self._backend
        key, index = b._key, b._key_index
        table = self._tables[self._one_name]
        if index < 0 or (
            type(table) is ColumnarValueTable and not (type(key) is int and _INT64_MIN <= key <= _INT64_MAX)
        ):
            if not self._register_slow(ts):  # no current key (it raises), or the first key that is no int
                return
        else:
            group = table.groups[index]
            current = group.get(key)
            if current is None:
                if type(table) is ColumnarValueTable:
                    group.put(key, ts)
                else:
                    table.store(index, key, ts)
            elif current == ts:
                return
            else:
                more_table = self._tables[self._more_name]
                if current == SEVERAL:
                    more = more_table.groups[index][key]
                    if ts in more:
                        return
                    more_table.store(index, key, (*more, ts))
                else:
                    more_table.store(index, key, (current, ts))
                    if type(table) is ColumnarValueTable:
                        group.put(key, SEVERAL)
                    else:
                        table.store(index, key, SEVERAL)
        entry = (key, index)
        bucket = self._keys.get(ts)
        if bucket is None:
            self._keys[ts] = [entry]
            heapq.heappush(self._heap, ts)
        else:
            bucket.append(entry)

    def _register_slow(self, ts: int) -> bool:
        """Through the state objects; True when the timer is new."""
        current = self._one.value()
        if current is None:
            self._one.update(ts)
            return True
        if current == ts:
            return False
        if current == SEVERAL:
            more = self._more.value()
            if ts in more:
                return False
            self._more.update((*more, ts))
        else:
            self._one.update(SEVERAL)
            self._more.update((current, ts))
        return True

    def delete(self, ts: int) -> bool:
        """Removes the current key's timer at ``ts``; True if there was one."""
        b = self._backend
        key, index = b._key, b._key_index
        table = self._tables[self._one_name]
        if index < 0 or (
            type(table) is ColumnarValueTable and not (type(key) is int and _INT64_MIN <= key <= _INT64_MAX)
        ):
            return self._delete_slow(ts)
        columnar = type(table) is ColumnarValueTable
        group = table.groups[index]
        current = group.get(key)
        if current == ts:
            if columnar:
                group.remove(key)
            else:
                table.delete(index, key)
            return True
        if current != SEVERAL:
            return False
        more_table = self._tables[self._more_name]
        more = more_table.groups[index][key]
        if ts not in more:
            return False
        rest = tuple(t for t in more if t != ts)
        if len(rest) == 1:
            more_table.delete(index, key)
            if columnar:
                group.put(key, rest[0])
            else:
                table.store(index, key, rest[0])
        else:
            more_table.store(index, key, rest)
        return True

    def _delete_slow(self, ts: int) -> bool:
        one = self._one
        current = one.value()
        if current is None:
            return False
        if current == ts:
            one.clear()
        elif current == SEVERAL:
            more = self._more.value()
            if ts not in more:
                return False
            rest = tuple(t for t in more if t != ts)
            if len(rest) == 1:
                one.update(rest[0])
                self._more.clear()
            else:
                self._more.update(rest)
        else:
            return False
        return True

    def timestamps(self) -> Tuple[int, ...]:
        """The current key's timers."""
        current = self._one.value()
        if current is None:
            return ()
        return tuple(sorted(self._more.value())) if current == SEVERAL else (current,)

    # -- the index ---------------------------------------------------------------------------

    def next_time(self) -> Optional[int]:
        """The earliest timestamp in the index (possibly a deleted timer's), or None."""
        return self._heap[0] if self._heap else None

    def due(self, upto: int) -> Iterator[Tuple[Any, int]]:
        """Timers at or before ``upto``, in timestamp order, each removed from the state
        just before it is yielded with the backend's current key set to its key. Timers
        registered meanwhile at or before ``upto`` are yielded too (as Flink fires them)."""
        heap, index_of, b = self._heap, self._keys, self._backend
        start = b.key_group_range.start
        delete = self.delete
        while heap and heap[0] <= upto:
            ts = heapq.heappop(heap)
            for key, index in index_of.pop(ts):
                # the backend's current key, set without rehashing: the index knows its key group
                b._key, b._key_group, b._key_index = key, start + index, index
                if delete(ts):  # else deleted meanwhile (or a second entry of one re-registered)
                    yield key, ts

    def __len__(self) -> int:
        """Timers in the index, stale ones included (an upper bound of the live ones)."""
        return sum(len(k) for k in self._keys.values())

    def _rebuild(self) -> None:
        """The index from the states (after a restore: this subtask's key groups)."""
        self._heap, self._keys = [], {}
        keys: List[Any] = []
        indexes: List[int] = []
        times: List[int] = []
        table = self._tables.get(self._one_name)
        if table is None:
            return
        b = self._backend
        start = b.key_group_range.start
        for index, group in enumerate(table.groups):
            if type(table) is ColumnarValueTable:
                group_keys, group_times = (a.tolist() for a in group.arrays())
            else:
                group_keys, group_times = list(group), list(group.values())
            for key, ts in zip(group_keys, group_times, strict=True):
                if ts == SEVERAL:
                    b._key, b._key_group, b._key_index = key, start + index, index
                    for more in self._more.value() or ():
                        keys.append(key)
                        indexes.append(index)
                        times.append(more)
                else:
                    keys.append(key)
                    indexes.append(index)
                    times.append(ts)
        if not times:
            return
        order = np.argsort(np.array(times, np.int64), kind="stable").tolist()
        index_of = self._keys
        for i in order:
            ts = times[i]
            bucket = index_of.get(ts)
            if bucket is None:
                index_of[ts] = [(keys[i], indexes[i])]
            else:
                bucket.append((keys[i], indexes[i]))
        self._heap = list(index_of)  # ascending: already a heap


def _timestamp(ts: Any) -> int:
    if isinstance(ts, (int, np.integer)) and not isinstance(ts, bool):
        return int(ts)
    raise TypeError(f"a timer's timestamp must be int milliseconds, got {ts!r}")


class InternalTimerService:
    """Both domains' timers of one keyed operator, and its current watermark."""

    def __init__(self, backend: Any, watermark: int) -> None:
        self.event = TimerQueue(backend, EVENT)
        self.processing = TimerQueue(backend, PROCESSING)
        self.current_watermark = watermark

    def advance_watermark(self, watermark: int) -> Iterator[Tuple[Any, int]]:
        """The event-time timers the new watermark passes, in order (see ``TimerQueue.due``)."""
        self.current_watermark = watermark
        return self.event.due(watermark)

    def fire_processing(self, now: int) -> Iterator[Tuple[Any, int]]:
        return self.processing.due(now)

    def next_processing_time(self) -> Optional[int]:
        return self.processing.next_time()


TimerCallback = Callable[[Any, int], Any]
