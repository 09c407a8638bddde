"""Timers as keyed state: Flink's ``InternalTimerService`` over a keyed backend.

A timer is a (key, timestamp) pair, in one of two domains (event time and
processing time). Registering one twice is one timer; deleting one that is not
there does nothing.

Where they are kept: value states in the operator's keyed backend, so timers are
snapshotted, restored and rescaled by key group exactly like the rest of the
keyed state, by either backend, with no code of their own:

* *slots* ``_timer_state/<domain>_timers``, ``..._timers@1``, ... up to
  ``MAX_SLOTS``, typed int64: a key's timers fill slots 0, 1, ... without holes
  (removing one moves the key's last one into its place); with int keys these
  are columnar, written as Arrow columns;
* ``_timer_state/<domain>_timers_more``: a key's further timestamps once all
  its slots are taken, a ``TimerSet`` (a dict of them inside), so that a hot key
  with thousands of pending timers registers, deletes and fires each in O(1), as
  Flink's heap timers do (a tuple, as it was, cost a copy of them all per call).
  It is checkpointed as the list of its timestamps, as the tuple was.

``pe.state.read_keyed_state(checkpoint, uid, "_timer_state/event_timers")``
lists the first slot (most keys have one timer). The synchronous part of a
snapshot freezes them copy-on-write like any state (O(key groups)).

Which timer fires next is an index in memory, rebuilt from the states on
restore and never snapshotted: for int keys (columnar storage) the native
``TimerHeap`` (``bindings/_timers.pxi``), which also does the common register,
remove and fire in C (a registration waits in its buffer, applied with up to 1,023
others in one pass that prefetches their lookups, before anything reads the timers
and before a snapshot: ``backend.add_pending_writes``); for other keys a heap of
distinct timestamps with, per timestamp, the keys that registered one. Deletions
leave stale entries in it, which firing skips by checking the state (the state is
the truth)."""

from __future__ import annotations

import heapq
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from ..errors import NonRetryableError, not_records, refuse_non_records
from .columnar import ColumnarValueTable
from .descriptors import ValueStateDescriptor
from .serializers import stored_as_list

__all__ = ["EVENT", "MAX_SLOTS", "PROCESSING", "SEVERAL", "InternalTimerService", "TimerQueue"]

SEVERAL = -(2**63)
"""Never a timer's timestamp (Flink's ``Long.MIN_VALUE``: before any watermark)."""

MAX_SLOTS = 8
"""Slot states per domain: a key's timers past this many go to the overflow (``TimerSet``)."""

EVENT, PROCESSING = "event", "processing"

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _slot_name(base: str, j: int) -> str:
    return base if j == 0 else f"{base}@{j}"


class TimerQueue:
    """The timers of one domain; see the module docstring. Methods act on the
    backend's current key, except ``due`` and ``fire``, which set it to each firing
    key.

    ``register`` is the native heap's own method while the slot states are columnar
    (int keys), so a job that sets a timer per record pays one C call for it; so are
    the common changes of a key's overflow set. What the native code does not do
    itself (making a key's overflow set: ``_register_overflow``; a slot state still to
    make, a key that is not an int: ``_register``) comes back here. The first non-int
    key turns the slot states into dicts: the index then moves to Python for good."""

    def __init__(self, backend: Any, domain: str) -> None:
        from .. import _native

        self.domain = domain
        self._backend = backend
        self._base = f"_timer_state/{domain}_timers"
        self._more_name = f"_timer_state/{domain}_timers_more"
        self._tables = backend._tables
        self._slots: List[str] = []
        self._add_slot()
        while _slot_name(self._base, len(self._slots)) in self._tables:  # restored ones
            self._add_slot()
        self._more = backend.get_state(ValueStateDescriptor(self._more_name))
        self._native: Any = _native.TimerHeap(
            backend, self._tables, self._slots, MAX_SLOTS, self._register, self._register_overflow
        )
        self._heap: List[int] = []  # the Python index: distinct timestamps
        self._keys: Dict[int, List[Tuple[Any, int]]] = {}  # timestamp -> (key, key group index)
        self._native.use_overflow(self._more_name, TimerSet)  # its common changes in C too
        self.register: Callable[[int], None] = self._native.register
        # The native heap applies registrations in batches (see its register): the
        # backend applies them before a snapshot reads the slot states.
        backend.add_pending_writes(self._flush)
        self._rebuild()

    def _add_slot(self) -> str:
        name = _slot_name(self._base, len(self._slots))
        self._backend.get_state(ValueStateDescriptor(name, None, pa.int64()))
        if getattr(self, "_native", True) is None and type(self._tables[name]) is ColumnarValueTable:
            self._backend._columnar_table_to_dict(name)  # the slots are dicts already: this one too
            self._backend._states.pop(name, None)
        self._slots.append(name)  # the native heap holds this very list
        return name

    # -- the state, in Python ----------------------------------------------------------------

    def _to_dicts(self) -> None:
        """A key that is no int64: the slot states go to dict storage (as a typed value
        state does at its first such key), and the index to Python."""
        self._flush()  # the registrations waiting go to the slots before they move
        for name in self._slots:
            if type(self._tables[name]) is ColumnarValueTable:
                self._backend._columnar_table_to_dict(name)
                self._backend._states.pop(name, None)  # its state object read the columns: a new one reads the dicts
        if self._native is not None:
            self._native.disabled = True  # its cached columns are gone: TimerService's bound register falls back
            ts, keys, indexes = self._native.drain()
            self._native = None
            self.register = self._register
            for t, key, index in zip(ts, keys, indexes, strict=True):
                self._index(t, key, index)

    def _flush(self) -> None:
        """Registrations the native heap holds back go to the slot states now."""
        if self._native is not None:
            self._native.flush()

    def _index(self, ts: int, key: Any, index: int) -> None:
        if self._native is not None:
            self._native.push(ts, key, index)
            return
        bucket = self._keys.get(ts)
        if bucket is None:
            self._keys[ts] = [(key, index)]
            heapq.heappush(self._heap, ts)
        else:
            bucket.append((key, index))

    def _get(self, name: str, index: int, key: Any) -> Any:
        return self._tables[name].groups[index].get(key)

    def _put(self, name: str, index: int, key: Any, ts: int) -> None:
        table = self._tables[name]
        if type(table) is ColumnarValueTable:
            table.groups[index].put(key, ts)
        else:
            table.store(index, key, ts)

    def _drop(self, name: str, index: int, key: Any) -> None:
        table = self._tables[name]
        if type(table) is ColumnarValueTable:
            table.groups[index].remove(key)
        else:
            table.delete(index, key)

    def _current(self) -> Tuple[Any, int]:
        b = self._backend
        key, index = b._key, b._key_index
        if index < 0:
            from .columnar import NO_KEY_HINT, NoCurrentKeyError

            raise NoCurrentKeyError(f"a timer was used with no current key: {NO_KEY_HINT}")
        if not (type(key) is int and _INT64_MIN <= key <= _INT64_MAX) and self._native is not None:
            self._to_dicts()
        return key, index

    def _register(self, ts: int) -> None:
        """Registers the current key's timer at ``ts`` in Python: what the native
        ``register`` hands over (a key with every slot state taken, other keys)."""
        if type(ts) is not int:
            ts = _timestamp(ts)
        if not _INT64_MIN < ts <= _INT64_MAX:
            raise InvalidTimerError(
                f"a timer's timestamp must be an int64, above {SEVERAL} and at most {_INT64_MAX}, got {ts}"
            )
        key, index = self._current()
        for name in self._slots:
            current = self._get(name, index, key)
            if current is None:
                self._put(name, index, key, ts)
                self._index(ts, key, index)
                return
            if current == ts:
                return
        if len(self._slots) < MAX_SLOTS:
            self._put(self._add_slot(), index, key, ts)
            self._index(ts, key, index)
            return
        self._add_overflow(ts, key, index)

    def _register_overflow(self, ts: int) -> None:
        """The native ``register``'s hand-over for a key whose every slot is taken by
        another timestamp (``ts`` checked and the key current: only the overflow is left)
        and whose overflow set C cannot change (none yet, or one a snapshot holds)."""
        b = self._backend
        self._add_overflow(ts, b._key, b._key_index)

    # -- the overflow: a key's timers past its slots, a TimerSet per key --------------------

    def _overflow(self, index: int, key: Any, change: bool) -> Optional[TimerSet]:
        """The key's overflow, or None; with ``change``, one that may be changed in
        place (copied first while an unfinished snapshot holds it)."""
        table = self._tables[self._more_name]
        more = table.groups[index].get(key)
        if more is None:
            return None
        if type(more) is not TimerSet:  # a tuple or list, as a checkpoint restores it
            more = TimerSet(more)
            table.store(index, key, more)
        elif change:
            if table.needs_private(index, key):
                more = TimerSet(more)
                table.store(index, key, more)
            elif table.changes is not None:
                table.changes[index].add(key)
        return more  # type: ignore[no-any-return]

    def _add_overflow(self, ts: int, key: Any, index: int) -> None:
        table = self._tables[self._more_name]
        more = table.groups[index].get(key)
        if more is None:
            table.store(index, key, TimerSet((ts,)))
        elif ts in (more.times if more.__class__ is TimerSet else more):
            return
        elif more.__class__ is TimerSet and not table.needs_private(index, key):  # the common case, inline
            more.times[ts] = None
            if table.changes is not None:
                table.changes[index].add(key)
        else:
            self._overflow(index, key, True).times[ts] = None  # type: ignore[union-attr]
        self._index(ts, key, index)

    def _delete_overflow(self, ts: int, key: Any, index: int) -> bool:
        table = self._tables[self._more_name]
        more = table.groups[index].get(key)
        if more is None or ts not in (more.times if more.__class__ is TimerSet else more):
            return False
        if len(more) == 1:
            table.delete(index, key)
        elif more.__class__ is TimerSet and not table.needs_private(index, key):  # the common case, inline
            del more.times[ts]
            if table.changes is not None:
                table.changes[index].add(key)
        else:
            del self._overflow(index, key, True).times[ts]  # type: ignore[union-attr]
        return True

    def _check_overflow(self, ts: int) -> bool:
        """The native firing loop's question for a key whose slots are all taken by
        other timestamps, where it cannot answer in C (the set's last timer, a set a
        snapshot holds): removes ``ts`` from the current key's overflow; was it there?"""
        b = self._backend
        return self._delete_overflow(ts, b._key, b._key_index)

    def delete(self, ts: int) -> bool:
        """Removes the current key's timer at ``ts``; True if there was one. ``ts`` is
        checked as ``register`` checks it: a float (``1500.5``) is refused, not cut to
        the timer at 1500."""
        if ts.__class__ is not int:
            ts = _timestamp(ts)
        if not _INT64_MIN < ts <= _INT64_MAX:
            return False  # no timer is registered there
        if self._native is not None:
            code = self._native.remove_current(ts)
            if code == 1:
                return True
            if code == 0:
                return False
            if code == 2:
                self._refill()
                return True
            if code == -3:
                return self._check_overflow(ts)
        return self._delete_python(ts)

    def _delete_python(self, ts: int) -> bool:
        key, index = self._current()
        found, last = -1, -1
        for j, name in enumerate(self._slots):
            current = self._get(name, index, key)
            if current is None:
                break
            last = j
            if found < 0 and current == ts:
                found = j
        full = last == MAX_SLOTS - 1
        if found >= 0:
            if found != last:  # no holes: the key's last timer moves into this one's place
                self._put(self._slots[found], index, key, self._get(self._slots[last], index, key))
            self._drop(self._slots[last], index, key)
            if full:
                self._refill()
            return True
        if not full:
            return False
        return self._delete_overflow(ts, key, index)

    def _refill(self) -> None:
        """A timer left a key whose slots were all taken: one from its overflow, if
        any, takes the last slot (a key's overflow exists only while its slots are full).
        The native firing loop does this itself but for the set's last timer and a set
        a snapshot holds."""
        b = self._backend
        key, index = b._key, b._key_index
        more = self._overflow(index, key, True)
        if not more:
            return
        ts, _ = more.times.popitem()  # the newest: O(1), where the oldest would walk the dict's holes
        self._put(self._slots[MAX_SLOTS - 1], index, key, ts)
        if not more:
            self._tables[self._more_name].delete(index, key)

    def timestamps(self) -> Tuple[int, ...]:
        """The current key's timers, in order."""
        self._flush()
        key, index = self._current()
        out = []
        for name in self._slots:
            current = self._get(name, index, key)
            if current is None:
                break
            out.append(current)
        out.extend(self._tables[self._more_name].groups[index].get(key, ()))
        return tuple(sorted(out))

    # -- the index ---------------------------------------------------------------------------

    def next_time(self) -> Optional[int]:
        """The earliest timestamp in the index (possibly a deleted timer's), or None."""
        if self._native is not None:
            return self._native.peek()  # type: ignore[no-any-return]
        return self._heap[0] if self._heap else None

    def due(self, upto: int) -> Iterator[Tuple[Any, int]]:
        """Timers at or before ``upto``, in timestamp order, each removed from the state
        just before it is yielded with the backend's current key set to its key. Timers
        registered meanwhile at or before ``upto`` are yielded too (as Flink fires them)."""
        b = self._backend
        while True:
            native = self._native
            if native is not None:
                got = native.pop_due(upto)
                if got is None:
                    return
                key, ts, code = got
                if code == 2:
                    self._refill()
                elif code == -1 and not self._delete_python(ts):
                    continue
                elif code == -3 and not self._check_overflow(ts):
                    continue
                yield key, ts
                continue
            heap = self._heap
            if not heap or heap[0] > upto:
                return
            ts = heap[0]
            bucket = self._keys[ts]
            if not bucket:
                heapq.heappop(heap)
                del self._keys[ts]
                continue
            key, index = bucket.pop()
            b._key, b._key_index = key, index
            if self._delete_python(ts):  # else deleted meanwhile (or a second entry of one re-registered)
                yield key, ts

    def fire(self, upto: int, ctx: Any, on_timer: Callable[[int, Any], Any], out: List[Any]) -> None:
        """Fires the timers at or before ``upto`` in order: for each, the backend's
        current key and ``ctx.current_key`` / ``ctx._timer_ts`` set, ``on_timer(ts,
        ctx)``, its results into ``out``. The native heap does the loop itself (one C
        iteration and the call per timer); the Python index, if any, follows."""
        if self._native is not None:
            self._native.fire_due(upto, ctx, on_timer, out, self._delete_python, self._refill, self._check_overflow)
        for key, ts in self.due(upto):
            ctx.current_key = key
            ctx._timer_ts = ts
            result = on_timer(ts, ctx)
            if result is not None:
                if result.__class__ is dict or result.__class__ is str:
                    raise not_records(result, "", "on_timer")
                try:
                    out.extend(result)
                except TypeError:
                    refuse_non_records(result, "", "on_timer")
                    raise

    def __len__(self) -> int:
        """Timers in the index, stale ones included (an upper bound of the live ones)."""
        native = len(self._native) if self._native is not None else 0
        return native + sum(len(k) for k in self._keys.values())

    def last_time(self) -> Optional[int]:
        """The latest pending timer's timestamp (this subtask's key groups), or None: a
        pass over the timer states, for the rare caller that needs it (the end of input)."""
        self._flush()
        latest: Optional[int] = None
        for name in self._slots:
            table = self._tables[name]
            for group in table.groups:
                if type(table) is ColumnarValueTable:
                    times = group.arrays()[1]
                    top = int(times.max()) if len(times) else None
                else:
                    top = max(group.values(), default=None)
                if top is not None and (latest is None or top > latest):
                    latest = top
        more = self._tables.get(self._more_name)
        for group in more.groups if more is not None else []:
            for times in group.values():
                top = max(times, default=None)
                if top is not None and (latest is None or top > latest):
                    latest = top
        return latest

    def _rebuild(self) -> None:
        """The index from the states (after a restore: this subtask's key groups)."""
        b = self._backend
        if any(type(self._tables[name]) is not ColumnarValueTable for name in self._slots):
            self._to_dicts()
        for name in self._slots:
            table = self._tables[name]
            for index, group in enumerate(table.groups):
                if type(table) is ColumnarValueTable:
                    keys, times = group.arrays()
                    if len(keys):
                        self._native.push_many(times, keys, np.full(len(keys), index))
                else:
                    for key, ts in list(group.items()):
                        self._index(ts, key, index)
        more = self._tables.get(self._more_name)
        for index, group in enumerate(more.groups if more is not None else []):
            for key, times in list(group.items()):
                if self._native is not None and not (type(key) is int and _INT64_MIN <= key <= _INT64_MAX):
                    b._key, b._key_index = key, index
                    self._to_dicts()
                for ts in times:
                    self._index(ts, key, index)


@stored_as_list
class TimerSet:
    """A key's timers past its slot states: a set of timestamps in a dict (insertion
    ordered, O(1) to add, find and remove), checkpointed as the list of them, as the
    tuple it replaces was (so a checkpoint's overflow reads as ``list<int64>``, either
    version). Changed in place only while no unfinished snapshot holds it."""

    __slots__ = ("times",)

    def __init__(self, times: Iterable[int] = ()) -> None:
        self.times: Dict[int, None] = dict.fromkeys(times)

    def __contains__(self, ts: object) -> bool:
        return ts in self.times

    def __iter__(self) -> Iterator[int]:
        return iter(self.times)

    def __len__(self) -> int:
        return len(self.times)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TimerSet):
            return self.times.keys() == other.times.keys()
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # changed in place

    def __reduce__(self) -> Tuple[Any, ...]:
        return (TimerSet, (list(self.times),))

    def __repr__(self) -> str:
        return f"TimerSet({list(self.times)!r})"


class InvalidTimerError(NonRetryableError, ValueError):
    """A timer's timestamp that is no int64 of milliseconds: the same call fails the
    same way after any restart, so the job fails at once."""


class InvalidTimerTypeError(InvalidTimerError, TypeError):
    """A timer's timestamp of another type than int (a float, a string, None)."""


def _timestamp(ts: Any) -> int:
    if isinstance(ts, (int, np.integer)) and not isinstance(ts, bool):
        return int(ts)
    raise InvalidTimerTypeError(
        f"a timer's timestamp must be int milliseconds, got {type(ts).__name__} {ts!r}: "
        "pass a whole number of milliseconds, e.g. int(seconds * 1000)"
    )


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
