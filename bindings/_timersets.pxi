# Included by _native.pyx after _timers.pxi (branch proto/timer-set, see proto/PLAN.md):
# a keyed operator's pending timers of one domain as a (key, timestamp) set per key
# group (csrc/pe_tset.h), in the order of TimerOrder's run and heap. One probe
# registers a timer, one removes a fired or deleted one: Flink's
# HeapPriorityQueueSet. The slot states of TimerHeap needed one probe per slot walked
# and moves to keep a key's slots without holes.
#
# A snapshot freezes a key group's set (freeze(): copy-on-write, O(1)): the frozen
# set and the live one share the slots until the live one changes, which copies
# them first; the frozen one reads them on the snapshot's thread (arrays()).

from libc.stdlib cimport calloc


cdef extern from "pe_tset.h":
    ctypedef struct pe_timer:
        int64_t key
        int64_t ts
    ctypedef struct pe_tset:
        pe_timer* slots
        uint32_t cap
        uint32_t bits
        uint32_t size
    int pe_tset_init(pe_tset* s, uint32_t min_cap, const pe_allocator* alloc) nogil
    void pe_tset_destroy(pe_tset* s, const pe_allocator* alloc) nogil
    int pe_tset_add(pe_tset* s, int64_t key, int64_t ts, const pe_allocator* alloc) nogil
    int pe_tset_remove(pe_tset* s, int64_t key, int64_t ts) nogil
    int pe_tset_contains(const pe_tset* s, int64_t key, int64_t ts) nogil
    int pe_tset_copy(pe_tset* dst, const pe_tset* src, const pe_allocator* alloc) nogil
    uint32_t pe_tset_collect(const pe_tset* s, int64_t* keys, int64_t* ts) nogil
    void pe_tset_prefetch(const pe_tset* s, int64_t key, int64_t ts) noexcept nogil


cdef inline void _release_slots(pe_tset* s, int* refs) noexcept:
    """Drops one holder of ``s``'s slots (``refs``: their shared count, or NULL when
    one holder owns them); the last one frees them."""
    if refs != NULL:
        refs[0] -= 1
        if refs[0] > 0:
            return
        free(refs)
    pe_tset_destroy(s, &PY_ALLOC)


cdef class FrozenTimerSet:
    """One key group's timers as a snapshot froze them (see TimerSets.freeze)."""

    cdef pe_tset set
    cdef int* refs

    def __dealloc__(self):
        if self.set.slots != NULL:
            _release_slots(&self.set, self.refs)

    def __len__(self):
        return self.set.size

    def arrays(self):
        """(keys, timestamps): two int64 arrays, in no particular order."""
        keys = np.empty(self.set.size, np.int64)
        ts = np.empty(self.set.size, np.int64)
        cdef int64_t[::1] k = keys
        cdef int64_t[::1] t = ts
        if self.set.size:
            with nogil:
                pe_tset_collect(&self.set, &k[0], &t[0])
        return keys, ts


cdef class TimerSets(TimerOrder):
    """The pending timers of one domain: a (key, timestamp) set per key group of
    ``backend`` and their order; see _timersets.pxi. Keys and timestamps are int64;
    anything else goes to ``fallback(ts)`` (Python's)."""

    cdef pe_tset* sets
    cdef int** refs  # per key group: the slots' shared count while a frozen set shares them, else NULL
    cdef Py_ssize_t groups
    cdef KeyFields current
    cdef object fallback
    cdef object tables  # the backend's tables: on_timer's columnar states are prefetched for the keys to fire
    cdef TimerEntry* pending
    cdef Py_ssize_t npending
    cdef bint flushing
    cdef public bint disabled  # the timers left for Python's storage: register hands everything to fallback

    def __cinit__(self, backend, Py_ssize_t groups, fallback, tables=None):
        cdef Py_ssize_t i
        if groups <= 0:
            raise ValueError(f"TimerSets: a backend has at least one key group, got {groups}")
        self.current = KeyFields(backend)
        self.fallback = fallback
        self.tables = tables
        self.sets = <pe_tset*>calloc(groups, sizeof(pe_tset))
        self.refs = <int**>calloc(groups, sizeof(int*))
        self.pending = <TimerEntry*>malloc(PENDING_MAX * sizeof(TimerEntry))
        if self.sets == NULL or self.refs == NULL or self.pending == NULL:
            raise MemoryError()
        self.groups = groups
        for i in range(groups):
            if pe_tset_init(&self.sets[i], 0, &PY_ALLOC) != PE_OK:
                raise MemoryError()

    def __dealloc__(self):
        cdef Py_ssize_t i
        if self.sets != NULL:
            for i in range(self.groups):
                if self.sets[i].slots != NULL:
                    _release_slots(&self.sets[i], self.refs[i])
        free(self.sets)
        free(self.refs)
        free(self.pending)

    cdef inline pe_tset* _writable(self, Py_ssize_t i) except NULL:
        """Key group ``i``'s set, made its own first if a frozen set shares its slots."""
        cdef int* refs = self.refs[i]
        cdef pe_tset copy
        if refs != NULL:
            if refs[0] == 1:  # the frozen sets let go: the slots are this set's alone again
                free(refs)
            else:
                if pe_tset_copy(&copy, &self.sets[i], &PY_ALLOC) != PE_OK:
                    raise MemoryError()
                refs[0] -= 1
                self.sets[i] = copy
            self.refs[i] = NULL
        return &self.sets[i]

    cdef int _check(self, Py_ssize_t i) except -1:
        if not 0 <= i < self.groups:
            raise IndexError(f"timer key group index {i} out of range 0-{self.groups - 1}")
        return 0

    def freeze(self, Py_ssize_t i):
        """Key group ``i``'s timers as they are now, for a snapshot: shares the slots
        (O(1)); the next change here copies them first."""
        self._check(i)
        self._flush()
        cdef FrozenTimerSet frozen = FrozenTimerSet.__new__(FrozenTimerSet)
        if self.sets[i].slots == NULL:  # no timer ever: nothing to share (the frozen set is empty)
            return frozen
        if self.refs[i] == NULL:
            self.refs[i] = <int*>malloc(sizeof(int))
            if self.refs[i] == NULL:
                raise MemoryError()
            self.refs[i][0] = 1
        self.refs[i][0] += 1
        frozen.set = self.sets[i]
        frozen.refs = self.refs[i]
        return frozen

    def freeze_all(self):
        """Every key group's timers for a snapshot (see freeze): None for an empty
        group, so a backend of many key groups with few timers makes few objects."""
        cdef Py_ssize_t i
        self._flush()
        return [self.freeze(i) if self.sets[i].size else None for i in range(self.groups)]

    def clear(self):
        """Drops every timer and the order (the timers moved to Python's storage):
        frozen sets keep the slots they share."""
        cdef Py_ssize_t i
        self.npending = 0
        for i in range(self.groups):
            _release_slots(&self.sets[i], self.refs[i])
            self.refs[i] = NULL
            if pe_tset_init(&self.sets[i], 0, &PY_ALLOC) != PE_OK:
                raise MemoryError()
        self.n = 0
        self.run_head = self.run_tail = 0

    def size(self, Py_ssize_t i):
        self._check(i)
        self._flush()
        return self.sets[i].size

    def __len__(self):
        """The timers applied so far (registrations still waiting are not counted):
        safe to call from another thread, as the monitoring does."""
        cdef Py_ssize_t i, total = 0
        for i in range(self.groups):
            total += self.sets[i].size
        return total

    def load(self, Py_ssize_t i, keys, timestamps):
        """Adds timers to key group ``i`` (a restore): two int64 arrays."""
        cdef const int64_t[::1] k = np.ascontiguousarray(keys, dtype=np.int64)
        cdef const int64_t[::1] t = np.ascontiguousarray(timestamps, dtype=np.int64)
        cdef Py_ssize_t j
        cdef pe_tset* s
        cdef int r
        if k.shape[0] != t.shape[0]:
            raise ValueError("load: keys and timestamps differ in length")
        self._check(i)
        self._flush()
        s = self._writable(i)
        for j in range(k.shape[0]):
            r = pe_tset_add(s, k[j], t[j], &PY_ALLOC)
            if r == PE_ERR_ARG:
                raise ValueError(f"load: {t[j]} is no timer timestamp")
            if r < 0:
                raise MemoryError()
            if r == 1:
                self._push(t[j], k[j], i)

    def register(self, ts):
        """The current key's timer at ``ts``, applied at the next flush (every call
        that reads the timers flushes first). A key or timestamp that is no int64, or no
        current key: ``fallback(ts)``, after the waiting ones."""
        return self._register(ts)

    cdef object _register(self, object ts):
        cdef int64_t k, t
        cdef Py_ssize_t i
        if self.disabled:
            return self.fallback(ts)
        i = self.current.index()
        key = self.current.key()
        if type(ts) is not int or type(key) is not int or not 0 <= i < self.groups:
            self._flush()
            return self.fallback(ts)
        try:
            k = key
            t = ts
        except OverflowError:
            self._flush()
            return self.fallback(ts)
        if t == INT64_MIN:
            self._flush()
            return self.fallback(ts)
        if self.flushing:
            self._add(k, t, i)
            return None
        if self.npending == PENDING_MAX:
            self._flush()
        e = &self.pending[self.npending]
        e.ts = t
        e.key = k
        e.index = i
        self.npending += 1
        return None

    cdef int _add(self, int64_t k, int64_t t, Py_ssize_t i) except -1:
        cdef int r = pe_tset_add(self._writable(i), k, t, &PY_ALLOC)
        if r < 0:
            raise MemoryError()
        if r == 1:
            self._push(t, k, i)
        return 0

    def flush(self):
        self._flush()

    cdef int _flush(self) except -1:
        """Applies the waiting registrations in order, each one's probe asked for
        PREFETCH_AHEAD entries early, so the misses overlap."""
        cdef Py_ssize_t n = self.npending, j = 0
        cdef TimerEntry* e
        if n == 0 or self.flushing:
            return 0
        self.flushing = True
        try:
            while j < n:
                if j + PREFETCH_AHEAD < n:
                    e = &self.pending[j + PREFETCH_AHEAD]
                    pe_tset_prefetch(&self.sets[e.index], e.key, e.ts)
                e = &self.pending[j]
                j += 1
                self._add(e.key, e.ts, e.index)
        finally:
            if j < n:
                memmove(self.pending, self.pending + j, (n - j) * sizeof(TimerEntry))
            self.npending = n - j
            self.flushing = False
        return 0

    cdef int _current(self, int64_t* k, Py_ssize_t* i) except -1:
        """The current key as int64 (1), or 0 when it is none / no int64."""
        key = self.current.key()
        i[0] = self.current.index()
        if type(key) is not int or not 0 <= i[0] < self.groups:
            return 0
        try:
            k[0] = key
        except OverflowError:
            return 0
        return 1

    def delete_current(self, int64_t ts):
        """Deletes the current key's timer ``ts``: True if it was pending. Its entry
        in the order stays and is skipped when it comes up."""
        cdef int64_t k
        cdef Py_ssize_t i
        self._flush()
        if not self._current(&k, &i):
            return False
        return self._remove(k, ts, i)

    cdef inline bint _remove(self, int64_t k, int64_t t, Py_ssize_t i) except -1:
        """Removes (k, t) from key group ``i``'s set: False if it was not there. One
        probe, but where a frozen set shares the slots: a probe first, so an absent
        timer does not copy them."""
        if self.refs[i] != NULL and not pe_tset_contains(&self.sets[i], k, t):
            return False
        return pe_tset_remove(self._writable(i), k, t) == 1

    def contains_current(self, int64_t ts):
        cdef int64_t k
        cdef Py_ssize_t i
        self._flush()
        if not self._current(&k, &i):
            return False
        return pe_tset_contains(&self.sets[i], k, ts) == 1

    def timestamps_of(self, int64_t key, Py_ssize_t i):
        """``key``'s pending timers, earliest first (a scan of its key group)."""
        self._check(i)
        self._flush()
        keys, ts = FrozenTimerSet.arrays(self.freeze(i))
        return sorted(ts[keys == key].tolist())

    def peek(self):
        """The earliest timestamp in the order (perhaps a deleted timer's), or None."""
        self._flush()
        if not self._count():
            return None
        if self.run_tail > self.run_head and (self.n == 0 or timer_before(&self.run[self.run_head], &self.entries[0])):
            return self.run[self.run_head].ts
        return self.entries[0].ts

    cdef list _state_groups(self):
        """The groups lists of the first PREFETCH_STATES columnar states."""
        cdef list out = []
        if self.tables is None:
            return out
        for name, table in self.tables.items():
            groups = getattr(table, "groups", None)
            if type(groups) is list and groups and type((<list>groups)[0]) is ColumnarGroup:
                out.append(groups)
                if len(out) == PREFETCH_STATES:
                    break
        return out

    cdef bint _take(self, TimerEntry* e) except -1:
        """Removes the entry's timer from its set: False if it was deleted."""
        return self._remove(e.key, e.ts, e.index)

    def pop_due(self, int64_t upto):
        """The next timer at or before ``upto``, removed, with the backend's current key
        set to its key: ``(key, ts)``; None when nothing more is due."""
        cdef TimerEntry e
        self._flush()
        while self._due(upto):
            e = self._pop()
            if self._take(&e):
                self.current.set(e.key, e.index)
                return (e.key, e.ts)
        return None

    def fire_due(self, int64_t upto, ctx, on_timer, list out):
        """Fires every timer at or before ``upto``, in order: for each, the backend's
        current key and ``ctx.current_key`` / ``ctx._timer_ts`` are set, the timer is
        removed, ``on_timer(ts, ctx)`` runs and what it returns (an iterable, or None)
        goes into ``out``. Returns how many fired."""
        cdef TimerEntry e
        cdef Py_ssize_t fired = 0, next_at
        cdef TimerContextFields fields = timer_context_fields(ctx)
        cdef list ahead = None
        cdef int64_t last_ts = INT64_MIN  # never a timer's timestamp
        ts = None
        self._flush()
        while self._due(upto):
            # The next keys to fire are known: their timers' probes and their columnar
            # states' lookups (what on_timer likely reads) are asked for PREFETCH_AHEAD
            # timers early; half as far ahead, those lookups' values.
            next_at = self.run_head + PREFETCH_AHEAD
            if next_at < self.run_tail and self.run[next_at].ts <= upto:
                pe_tset_prefetch(&self.sets[self.run[next_at].index], self.run[next_at].key, self.run[next_at].ts)
                if ahead is None:
                    ahead = self._state_groups()
                prefetch_state_keys(ahead, self.run[next_at].key, self.run[next_at].index)
                next_at = self.run_head + PREFETCH_AHEAD // 2
                prefetch_state_values(ahead, self.run[next_at].key, self.run[next_at].index)
            e = self._pop()
            if not self._take(&e):
                continue
            key = e.key
            if e.ts != last_ts:  # timers in a row often share a timestamp: one int object for them
                ts = e.ts
                last_ts = e.ts
            self.current.set(key, e.index)
            set_timer_context(ctx, &fields, key, ts)
            result = on_timer(ts, ctx)
            if result is not None and result is not ():
                if type(result) is dict or type(result) is str:
                    from pyengine.errors import not_records
                    raise not_records(result, "", "on_timer")
                try:
                    out.extend(result)
                except TypeError:
                    from pyengine.errors import refuse_non_records
                    refuse_non_records(result, "", "on_timer")
                    raise
            fired += 1
            if self.disabled:  # on_timer moved the timers to Python's storage: Python fires the rest
                break
            if self.npending:
                self._flush()
        return fired


@cython.auto_pickle(False)  # a copy would lose the subclass's slots: refused, as for the queues it calls
cdef class TimerServiceCalls:
    """``pyengine.time.TimerService``'s four timer calls, as methods of its C type.

    A job that sets a timer per record calls ``register_event_time_timer`` per record.
    Python 3.11 specialises the lookup of a method an object's type has when the
    object has no ``__dict__`` (``LOAD_METHOD_NO_DICT``); a slot that held a bound
    method was looked up generically each time (``_PyObject_GetMethod``: the type's
    MRO, then the slot; perf showed those lookups gone with this). A domain whose
    registrations are a ``TimerSets``' is then one C call into its sets."""

    cdef object _register_event, _register_processing, _delete_event, _delete_processing
    cdef TimerSets _event_sets, _processing_sets

    def __init__(self, register_event, register_processing, delete_event, delete_processing):
        self._register_event = register_event
        self._register_processing = register_processing
        self._delete_event = delete_event
        self._delete_processing = delete_processing
        self._event_sets = _sets_of(register_event)
        self._processing_sets = _sets_of(register_processing)

    def register_event_time_timer(self, ts):
        """Calls ``on_timer(timestamp, ctx)`` for the current key when the watermark
        reaches ``ts`` (at the next watermark if it already has)."""
        if self._event_sets is not None:
            return self._event_sets._register(ts)
        return self._register_event(ts)

    def register_processing_time_timer(self, ts):
        """Calls ``on_timer`` for the current key once the wall clock (ms since the
        epoch, ``current_processing_time()``) reaches ``ts``."""
        if self._processing_sets is not None:
            return self._processing_sets._register(ts)
        return self._register_processing(ts)

    def delete_event_time_timer(self, ts):
        """The current key's event-time timer at ``ts`` does not fire (nothing when
        there is none)."""
        return self._delete_event(ts)

    def delete_processing_time_timer(self, ts):
        """The current key's processing-time timer at ``ts`` does not fire (nothing
        when there is none)."""
        return self._delete_processing(ts)


cdef TimerSets _sets_of(object register):
    """The sets whose own ``register`` this is, else None."""
    owner = getattr(register, "__self__", None)
    if type(owner) is TimerSets and register == owner.register:
        return <TimerSets>owner
    return None
