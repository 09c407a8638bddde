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

from .descriptors import ValueStateDescriptor

__all__ = ["EVENT", "PROCESSING", "SEVERAL", "InternalTimerService", "TimerQueue"]

SEVERAL = -(2**63)
"""What the primary timer state holds for a key with several timers."""

EVENT, PROCESSING = "event", "processing"


class TimerQueue:
    """The timers of one domain; see the module docstring. Methods act on the
    backend's current key, except ``due``, which sets it to each firing key."""

    def __init__(self, backend: Any, domain: str) -> None:
        self.domain = domain
        self._backend = backend
        self._one_name = f"_timer_state/{domain}_timers"
        self._more_name = f"_timer_state/{domain}_timers_more"
        self._one = backend.get_state(ValueStateDescriptor(self._one_name, None, pa.int64()))
        self._more = backend.get_state(ValueStateDescriptor(self._more_name))
        self._heap: List[int] = []
        self._keys: Dict[int, List[Any]] = {}
        self._rebuild()

    # -- the state ---------------------------------------------------------------------------

    def register(self, ts: int) -> None:
        if type(ts) is not int:
            ts = _timestamp(ts)
        one = self._one
        current = one.value()
        if current is None:
            if ts == SEVERAL:
                raise ValueError(f"a timer cannot be registered at {SEVERAL} (the smallest int64)")
            one.update(ts)
        elif current == ts:
            return
        elif current == SEVERAL:
            more = self._more.value()
            if ts in more:
                return
            self._more.update((*more, ts))
        else:
            one.update(SEVERAL)
            self._more.update((current, ts))
        keys = self._keys.get(ts)
        if keys is None:
            self._keys[ts] = [self._backend.current_key]
            heapq.heappush(self._heap, ts)
        else:
            keys.append(self._backend.current_key)

    def delete(self, ts: int) -> bool:
        """Removes the current key's timer at ``ts``; True if there was one."""
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
        heap, index, backend = self._heap, self._keys, self._backend
        while heap and heap[0] <= upto:
            ts = heapq.heappop(heap)
            for key in index.pop(ts):
                backend.set_current_key(key)
                if self.delete(ts):  # else deleted meanwhile (or a second entry of one re-registered)
                    yield key, ts

    def __len__(self) -> int:
        """Timers in the index, stale ones included (an upper bound of the live ones)."""
        return sum(len(k) for k in self._keys.values())

    def _rebuild(self) -> None:
        """The index from the states (after a restore: this subtask's key groups)."""
        self._heap, self._keys = [], {}
        keys, times = _entries(self._backend, self._one_name)
        several = times == SEVERAL
        if several.any():
            backend = self._backend
            extra_keys: List[Any] = []
            extra_times: List[int] = []
            for key in keys[several].tolist() if isinstance(keys, np.ndarray) else _pick(keys, several):
                backend.set_current_key(key)
                for ts in self._more.value() or ():
                    extra_keys.append(key)
                    extra_times.append(ts)
            keep = ~several
            keys = keys[keep] if isinstance(keys, np.ndarray) else _pick(keys, keep)
            times = np.concatenate([times[keep], np.array(extra_times, np.int64)])
            keys = (list(keys.tolist()) if isinstance(keys, np.ndarray) else list(keys)) + extra_keys
        if not len(times):
            return
        order = np.argsort(times, kind="stable")
        sorted_times = times[order]
        uniq, starts = np.unique(sorted_times, return_index=True)
        ordered = keys[order] if isinstance(keys, np.ndarray) else [keys[i] for i in order.tolist()]
        bounds = [*starts.tolist()[1:], len(sorted_times)]
        ordered_list = ordered.tolist() if isinstance(ordered, np.ndarray) else ordered
        start = 0
        for ts, end in zip(uniq.tolist(), bounds, strict=True):
            self._keys[ts] = ordered_list[start:end]
            start = end
        self._heap = uniq.tolist()  # sorted: already a heap


def _pick(keys: List[Any], mask: np.ndarray) -> List[Any]:
    return [k for k, m in zip(keys, mask.tolist(), strict=True) if m]


def _timestamp(ts: Any) -> int:
    if isinstance(ts, (int, np.integer)) and not isinstance(ts, bool):
        return int(ts)
    raise TypeError(f"a timer's timestamp must be int milliseconds, got {ts!r}")


def _entries(backend: Any, name: str) -> Tuple[Any, np.ndarray]:
    """(keys, int64 timestamps) of every entry of the primary timer state: NumPy
    arrays straight from columnar storage (int keys), else a list of keys."""
    from .columnar import ColumnarValueTable

    table = backend._tables.get(name)
    if table is None:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    if isinstance(table, ColumnarValueTable):
        pairs = [g.arrays() for g in table.groups]
        if not pairs:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return np.concatenate([k for k, _ in pairs]), np.concatenate([v for _, v in pairs]).astype(np.int64)
    keys: List[Any] = []
    times: List[int] = []
    for group in table.groups:
        for k, v in group.items():
            keys.append(k)
            times.append(v)
    return keys, np.array(times, np.int64)


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
