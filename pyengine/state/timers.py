"""Timers as keyed state: Flink's ``InternalTimerService`` over a keyed backend.

A timer is a (key, timestamp) pair, in one of two domains (event time and
processing time). Registering one twice is one timer; deleting one that is not
there does nothing.

Where they are kept: per domain, one table of the operator's keyed backend,
``_timer_state/<domain>_timers`` (a ``TimerTable``), holding per key group the set
of its (key, timestamp) pairs, as Flink's heap timers keep a
``HeapPriorityQueueSet`` per key group. Registering costs one probe of the set,
firing or deleting one more, whatever the key's other timers (a key's timers kept
in value states, as before, cost a probe per timer of the key walked past).

* With int64 keys the sets are native (``_native.TimerSets``, ``csrc/pe_tset.c``):
  a registration waits in a buffer, applied with up to 1,023 others in one pass that
  prefetches their probes, before anything reads the timers and before a snapshot
  (``backend.add_pending_writes``).
* The first key that is no int64 moves the timers to Python: a dict of (key,
  timestamp) pairs per key group and a heap of timestamps with, per timestamp, the
  keys that registered one.

Snapshots. The synchronous part freezes each key group's set copy-on-write (O(key
groups)); the asynchronous part writes the pairs as rows (key, timestamp) of a state
of kind ``timers`` (a key may have several rows). The incremental backend writes a
domain's timers whole in every delta, as Flink writes heap timers beside
incremental RocksDB state, and on restore a file's rows replace the timers of its
key groups. ``pe.state.read_keyed_state(checkpoint, uid,
"_timer_state/event_timers")`` lists them, one row per timer.

Checkpoints written before the sets kept a key's timers in "slot" value states
(``_timer_state/<domain>_timers``, ``..._timers@1`` ... and ``..._timers_more``, a
list per key); restoring one moves their timers into the sets, drops those states,
and makes the incremental backend's next checkpoint a full one.

Which timer fires next is an order in memory, rebuilt on restore and never
snapshotted: ``_native.TimerOrder`` (a sorted run and a heap) for int keys. A deleted
timer's entry stays in it and is skipped when it comes up (the set is the truth)."""

from __future__ import annotations

import heapq
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import pyarrow as pa

from ..errors import NonRetryableError, not_records, refuse_non_records
from ..snapshot.writer import ColumnarSlice

__all__ = ["EVENT", "PROCESSING", "SEVERAL", "InternalTimerService", "TimerQueue", "TimerTable"]

SEVERAL = -(2**63)
"""Never a timer's timestamp (Flink's ``Long.MIN_VALUE``: before any watermark)."""

EVENT, PROCESSING = "event", "processing"
TIMERS_KIND = "timers"
"""The state kind of a domain's timers in a state file: rows (key, timestamp)."""

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_Pairs = Dict[Tuple[Any, int], None]


def timers_table_name(domain: str) -> str:
    return f"_timer_state/{domain}_timers"


class TimersDescriptor:
    """What the backend's snapshot code asks of a state's descriptor, for a timer table:
    rows of kind ``timers`` with int64 timestamps as values."""

    kind = TIMERS_KIND
    type = pa.int64()
    ttl = None
    allows_pickle = False

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"TimersDescriptor({self.name!r})"


def _is_int64(key: Any) -> bool:
    return type(key) is int and _INT64_MIN <= key <= _INT64_MAX


class _FrozenTimers(ColumnarSlice):
    """One key group's timers as a snapshot froze them (native sets): the pairs are
    read into arrays when the writer first asks, on the snapshot's thread."""

    __slots__ = ("_frozen",)

    def __init__(self, frozen: Any) -> None:  # no ColumnarSlice.__init__: keys/values come lazily
        self._frozen = frozen

    def __len__(self) -> int:
        return len(self._frozen)

    def __getattr__(self, name: str) -> Any:  # keys / values, not read yet
        if name not in ("keys", "values"):
            raise AttributeError(name)
        keys, ts = self._frozen.arrays()
        ColumnarSlice.__init__(self, keys, ts)
        return keys if name == "keys" else ts


_NO_TIMERS = ColumnarSlice(np.empty(0, np.int64), np.empty(0, np.int64))  # an empty key group's, shared


class _PairGroup:
    """One key group's timers as (key, timestamp) pairs, for the snapshot writer's
    dict path: ``keys()`` and ``values()`` in the same order, a key once per timer."""

    __slots__ = ("_pairs",)

    def __init__(self, pairs: Any) -> None:
        self._pairs = pairs

    def __len__(self) -> int:
        return len(self._pairs)

    def __iter__(self) -> Iterator[Any]:
        return (k for k, _ in self._pairs)

    def keys(self) -> List[Any]:
        return [k for k, _ in self._pairs]

    def values(self) -> List[int]:
        return [t for _, t in self._pairs]


class RestoredTimers:
    """A domain's timers as a restore read them, until a ``TimerQueue`` takes them
    (``TimerTable.adopt``); a table of the backend meanwhile, so a snapshot taken
    before that writes them back unchanged."""

    whole_in_deltas = True

    def __init__(self, name: str, num_groups: int) -> None:
        self.descriptor = TimersDescriptor(name)
        self.pieces: List[List[Tuple[Any, Any]]] = [[] for _ in range(num_groups)]
        self.active_snapshots = 0
        self.changes: Any = None

    def reset(self, index: int) -> None:
        """A newer file (a delta of the chain) has this key group's timers whole."""
        self.pieces[index] = []

    def add(self, index: int, keys: Any, timestamps: Any) -> None:
        """Keys and timestamps of key group ``index``: Arrow int64 arrays, or lists
        (kept as lists only if a key is no int64; else arrays, for the native sets)."""
        if isinstance(keys, pa.Array):
            keys = keys.to_numpy(zero_copy_only=False)
            timestamps = timestamps.to_numpy(zero_copy_only=False)
        elif all(_is_int64(k) for k in keys):
            keys = np.array(keys, np.int64)
            timestamps = np.array(timestamps, np.int64)
        self.pieces[index].append((keys, timestamps))

    def pairs(self, index: int) -> Iterator[Tuple[Any, Any]]:
        for keys, ts in self.pieces[index]:
            yield from zip(keys.tolist() if isinstance(keys, np.ndarray) else keys, list(ts), strict=True)

    def arrays(self, index: int) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """The key group's timers as two int64 arrays, or None if a key is no int64."""
        pieces = self.pieces[index]
        if not all(isinstance(k, np.ndarray) for k, _ in pieces):
            return None
        if not pieces:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return (
            np.concatenate([k for k, _ in pieces]).astype(np.int64, copy=False),
            np.concatenate([t for _, t in pieces]).astype(np.int64, copy=False),
        )

    def freeze(self) -> List[Any]:
        """All arrays, or all pairs if any key group has a key that is no int64 (the
        writer takes a batch of neighbouring key groups the same way)."""
        self.active_snapshots += 1
        arrays = [self.arrays(i) for i in range(len(self.pieces))]
        if all(a is not None for a in arrays):
            return [ColumnarSlice(*a) for a in arrays]  # type: ignore[misc]
        return [_PairGroup(list(self.pairs(i))) for i in range(len(self.pieces))]

    def release(self) -> None:
        self.active_snapshots -= 1

    def iter_keys(self) -> Iterator[Any]:
        for i in range(len(self.pieces)):
            yield from dict.fromkeys(k for k, _ in self.pairs(i))

    def __len__(self) -> int:
        return sum(len(k) for piece in self.pieces for k, _ in piece)


class TimerTable:
    """One domain's timers, the backend's table ``_timer_state/<domain>_timers``: a
    set of (key, timestamp) pairs per key group, native while every key is an int64
    (``native``), else Python dicts of pairs (``pairs``, copied on the first write
    after a snapshot froze them). See the module docstring."""

    whole_in_deltas = True  # the incremental backend writes it whole in every delta

    def __init__(self, backend: Any, domain: str, fallback: Callable[[int], None]) -> None:
        from .. import _native

        self.descriptor = TimersDescriptor(timers_table_name(domain))
        self.groups_count = len(backend.key_group_range)
        self.native: Any = _native.TimerSets(backend, self.groups_count, fallback, backend._tables)
        self.pairs: Optional[List[_Pairs]] = None
        self._shared: List[bool] = []
        self.active_snapshots = 0
        self.changes: Any = None

    # -- the backend's table protocol -----------------------------------------------------

    def freeze(self) -> List[Any]:
        """Synchronous part of a snapshot: each key group's timers, shared from now on."""
        self.active_snapshots += 1
        if self.native is not None:
            return [_NO_TIMERS if f is None else _FrozenTimers(f) for f in self.native.freeze_all()]
        assert self.pairs is not None
        self._shared = [True] * self.groups_count
        return [_PairGroup(group) for group in self.pairs]

    def release(self) -> None:
        self.active_snapshots -= 1
        if self.active_snapshots == 0 and self.pairs is not None:
            self._shared = [False] * self.groups_count

    def __len__(self) -> int:
        """Timers applied so far (safe from another thread: the monitoring reads it)."""
        native, pairs = self.native, self.pairs  # read once: the task may move them to Python meanwhile
        if native is not None:
            return len(native)
        return sum(len(g) for g in pairs or ())

    def iter_keys(self) -> Iterator[Any]:
        """Each key with a timer, once."""
        for i in range(self.groups_count):
            yield from dict.fromkeys(key for key, _ in self.group_pairs(i))

    # -- storage --------------------------------------------------------------------------

    def group_pairs(self, i: int) -> List[Tuple[Any, int]]:
        """Key group ``i``'s timers as (key, timestamp) pairs, in no order."""
        if self.native is not None:
            self.native.flush()
            keys, ts = self.native.freeze(i).arrays()
            return list(zip(keys.tolist(), ts.tolist(), strict=True))
        assert self.pairs is not None
        return list(self.pairs[i])

    def writable(self, i: int) -> _Pairs:
        """Python storage: key group ``i``'s dict, copied first if a snapshot holds it."""
        assert self.pairs is not None
        if self._shared[i]:
            self.pairs[i] = dict(self.pairs[i])
            self._shared[i] = False
        return self.pairs[i]

    def to_python(self) -> List[Tuple[int, Any, int]]:
        """Moves the timers to Python storage (a key that is no int64); returns them as
        (timestamp, key, key group index) for the Python order."""
        native = self.native
        native.flush()  # first: if it fails, the timers stay native and whole
        self.native = None
        native.disabled = True  # TimerService's bound register goes to the fallback from now on
        self.pairs = []
        out: List[Tuple[int, Any, int]] = []
        for i in range(self.groups_count):
            keys, ts = native.freeze(i).arrays()
            pairs = list(zip(keys.tolist(), ts.tolist(), strict=True))
            self.pairs.append(dict.fromkeys(pairs))
            out.extend((t, k, i) for k, t in pairs)
        self._shared = [False] * self.groups_count
        native.clear()  # TimerService still holds its register: the sets and the order go now
        return out


class TimerQueue:
    """The timers of one domain; see the module docstring. Methods act on the
    backend's current key, except ``due`` and ``fire``, which set it to each firing
    key.

    ``register`` is the native sets' own method while keys are int64, so a job that
    sets a timer per record pays one C call for it; what C does not take (a key or a
    timestamp that is no int64) comes back to ``_register``."""

    def __init__(self, backend: Any, domain: str) -> None:
        self.domain = domain
        self._backend = backend
        self._name = timers_table_name(domain)
        restored = _take_restored(backend, domain)
        self._table = TimerTable(backend, domain, self._register)
        backend._tables[self._name] = self._table
        self._heap: List[int] = []  # the Python order: distinct timestamps
        self._keys: Dict[int, List[Tuple[Any, int]]] = {}  # timestamp -> (key, key group index)
        self.register: Callable[[int], None] = self._table.native.register
        # Registrations wait in the native buffer (see TimerSets.register): the backend
        # applies them before a snapshot reads the sets.
        backend.add_pending_writes(self._flush)
        if restored is not None:
            self._load(restored)

    @property
    def _native(self) -> Any:
        return self._table.native

    def _load(self, restored: RestoredTimers) -> None:
        """The timers of a restore into the sets (or Python's storage) and the order."""
        for i in range(len(restored.pieces)):
            got = restored.arrays(i)
            if self._native is not None:
                if got is not None:
                    self._native.load(i, *got)
                    continue
                self._to_python()  # a key that is no int64
            for key, ts in restored.pairs(i):
                self._add(int(ts), key, i)

    def _to_python(self) -> None:
        for ts, key, index in self._table.to_python():
            self._index(ts, key, index)
        self.register = self._register

    def _flush(self) -> None:
        """Registrations the native sets hold back are applied now."""
        if self._native is not None:
            self._native.flush()

    def _index(self, ts: int, key: Any, index: int) -> None:
        bucket = self._keys.get(ts)
        if bucket is None:
            self._keys[ts] = [(key, index)]
            heapq.heappush(self._heap, ts)
        else:
            bucket.append((key, index))

    def _add(self, ts: int, key: Any, index: int) -> None:
        """Python storage: adds the timer unless it is there."""
        group = self._table.writable(index)
        if (key, ts) in group:
            return
        group[(key, ts)] = None
        self._index(ts, key, index)

    def _current(self) -> Tuple[Any, int]:
        b = self._backend
        key, index = b._key, b._key_index
        if index < 0:
            from .columnar import NO_KEY_HINT, NoCurrentKeyError

            raise NoCurrentKeyError(f"a timer was used with no current key: {NO_KEY_HINT}")
        return key, index

    def _register(self, ts: int) -> None:
        """Registers the current key's timer at ``ts`` in Python: what the native
        ``register`` hands over (a key or timestamp that is no int64, no current key)."""
        if type(ts) is not int:
            ts = _timestamp(ts)
        if not _INT64_MIN < ts <= _INT64_MAX:
            raise InvalidTimerError(_outside(ts))
        key, index = self._current()
        if self._native is not None:
            if _is_int64(key):
                self._native.register(ts)  # an int subclass or numpy int as timestamp, made an int above
                return
            self._to_python()
        self._add(ts, key, index)

    def delete(self, ts: int) -> bool:
        """Removes the current key's timer at ``ts``; True if there was one. ``ts`` is
        checked as ``register`` checks it: a float (``1500.5``) is refused, not cut to
        the timer at 1500."""
        if ts.__class__ is not int:
            ts = _timestamp(ts)
        if not _INT64_MIN < ts <= _INT64_MAX:
            return False  # no timer is registered there
        key, index = self._current()
        if self._native is not None:
            if _is_int64(key):
                return bool(self._native.delete_current(ts))
            # A key equal to an int one (1.0, True) is that key, as in every keyed state:
            # Python's storage finds it (and the next registration would move there anyway).
            self._to_python()
        group = self._table.pairs[index]  # type: ignore[index]
        if (key, ts) not in group:
            return False
        del self._table.writable(index)[(key, ts)]
        return True

    def timestamps(self) -> Tuple[int, ...]:
        """The current key's timers, in order (a scan of its key group)."""
        key, index = self._current()
        if self._native is not None:
            if _is_int64(key):
                return tuple(self._native.timestamps_of(key, index))
            self._to_python()  # as in delete
        return tuple(sorted(t for k, t in self._table.pairs[index] if k == key))  # type: ignore[index]

    # -- the order ---------------------------------------------------------------------------

    def next_time(self) -> Optional[int]:
        """The earliest timestamp in the order (possibly a deleted timer's), or None."""
        if self._native is not None:
            return self._native.peek()  # type: ignore[no-any-return]
        return self._heap[0] if self._heap else None

    def due(self, upto: int) -> Iterator[Tuple[Any, int]]:
        """Timers at or before ``upto``, in timestamp order, each removed just before it
        is yielded with the backend's current key set to its key. Timers registered
        meanwhile at or before ``upto`` are yielded too (as Flink fires them)."""
        b = self._backend
        while True:
            native = self._native
            if native is not None:
                got = native.pop_due(upto)
                if got is None:
                    return
                yield got
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
            if (key, ts) not in self._table.pairs[index]:  # type: ignore[index]
                continue  # deleted meanwhile (or a second entry of one registered again)
            del self._table.writable(index)[(key, ts)]
            b._key, b._key_index = key, index
            yield key, ts

    def fire(self, upto: int, ctx: Any, on_timer: Callable[[int, Any], Any], out: List[Any]) -> None:
        """Fires the timers at or before ``upto`` in order: for each, the backend's
        current key and ``ctx.current_key`` / ``ctx._timer_ts`` set, ``on_timer(ts,
        ctx)``, its results into ``out``. The native sets do the loop themselves (one C
        iteration and the call per timer); Python's order, if any, follows."""
        if self._native is not None:
            self._native.fire_due(upto, ctx, on_timer, out)
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
        """Pending timers."""
        self._flush()
        return len(self._table)

    def last_time(self) -> Optional[int]:
        """The latest pending timer's timestamp (this subtask's key groups), or None: a
        pass over the timers, for the rare caller that needs it (the end of input)."""
        native = self._native
        if native is not None:
            tops = [int(f.arrays()[1].max()) for f in native.freeze_all() if f is not None]
        else:
            tops = [max(t for _, t in group) for group in self._table.pairs or () if group]
        return max(tops, default=None)


def _take_restored(backend: Any, domain: str) -> Optional[RestoredTimers]:
    """The domain's restored timers, taken out of the backend's tables: as the restore
    read them, or moved out of the slot states of checkpoints written before the sets
    (which go; the incremental backend's next checkpoint is then a full one)."""
    tables = backend._tables
    name = timers_table_name(domain)
    table = tables.get(name)
    if isinstance(table, RestoredTimers):
        del tables[name]
        return table
    if isinstance(table, TimerTable):
        raise RuntimeError(f"the {domain} timers of this backend have a TimerQueue already")
    old = [n for n in tables if n == name or n.startswith(name + "@") or n == name + "_more"]
    if not old:
        return None
    restored = RestoredTimers(name, len(backend.key_group_range))
    for n in old:
        for i, group in enumerate(_groups_as_dicts(tables[n])):
            keys, ts = [], []
            for key, value in group.items():
                for t in value if n.endswith("_more") else (value,):
                    keys.append(key)
                    ts.append(int(t))
            if keys:
                restored.add(i, keys, ts)
        del tables[n]
        backend._states.pop(n, None)
    # A delta must not build on files that hold the slot states: their entries would
    # come back at the next restore beside the sets' rows.
    start_new_chain = getattr(backend, "start_new_chain", None)
    if start_new_chain is not None:
        start_new_chain()
    return restored


def _groups_as_dicts(table: Any) -> Iterable[Dict[Any, Any]]:
    to_dicts = getattr(table, "to_dicts", None)
    if to_dicts is not None:  # columnar
        return to_dicts()  # type: ignore[no-any-return]
    return table.groups  # type: ignore[no-any-return]


class InvalidTimerError(NonRetryableError, ValueError):
    """A timer's timestamp that is no int64 of milliseconds: the same call fails the
    same way after any restart, so the job fails at once."""


class InvalidTimerTypeError(InvalidTimerError, TypeError):
    """A timer's timestamp of another type than int (a float, a string, None)."""


def _outside(ts: int) -> str:
    where = "-2**63 stands for 'before any watermark' here" if ts == SEVERAL else "outside int64"
    return (
        f"a timer's timestamp must be an int64 above {SEVERAL} and at most {_INT64_MAX}, got {ts} ({where}): a "
        "timer at or before the current watermark fires at the next one anyway, so register a time within the "
        "range (e.g. max(ts, -2**63 + 1), min(ts, 2**63 - 1))"
    )


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
