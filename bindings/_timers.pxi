# Included by _native.pyx: the index of a keyed operator's timers (pyengine.state.timers).
#
# The timers themselves are keyed state: "slots", typed int64 value states keyed by
# the record key, per key group a ColumnarGroup. A key's timers fill slots 0..m-1
# (one timestamp each, no holes: removing one moves the key's last into its place);
# past the last slot they go to an overflow state, a dict-backed state with a TimerSet
# per key (a hot key's thousands of pending timers cost O(1) each there too). TimerHeap is the
# index over them for int keys: a binary min-heap of (timestamp, arrival) entries
# with their key and key-group index, never snapshotted (rebuilt from the state on
# restore). The heap says which timer may be due next; the slots say whether it
# still is (a deleted timer's entry is skipped when it comes up).
#
# register(), remove and firing run once per record in a job that sets a timer per
# record, so their common case is here in C, and so are the common changes of a key's
# overflow set (adding, removing, moving its newest up into a freed slot) when no
# unfinished snapshot holds it. Everything else (no current key, a key that is not an
# int64, a table that left columnar storage, making or dropping a key's overflow set,
# a set a snapshot holds) goes back to Python.

from libc.stdint cimport INT64_MIN
from libc.stdlib cimport free, malloc, realloc
from libc.string cimport memmove


cdef extern from "pe_common.h":
    void PE_PREFETCH(const void* p) noexcept nogil


cdef struct TimerEntry:
    int64_t ts
    int64_t seq
    int64_t key
    Py_ssize_t index


cdef inline bint timer_before(TimerEntry* a, TimerEntry* b) noexcept nogil:
    return a.ts < b.ts or (a.ts == b.ts and a.seq < b.seq)


cdef inline int64_t* timer_values(ColumnarGroup g):
    return <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>g.values)


cdef int timer_group_remove(ColumnarGroup g, int64_t key) except -1:
    """ColumnarGroup.remove for an int64 group, without a Python call."""
    cdef int64_t pos, last_key
    cdef Py_ssize_t last
    cdef int64_t* keys
    cdef int64_t* values
    if g.shared:  # a key that is not there must not copy a pending snapshot's arrays
        if pe_i64map_get(&g.index, key) < 0:
            return 0
        g.own()
    if not pe_i64map_remove(&g.index, key, &pos):
        return 0
    last = g.n - 1
    if pos != last:
        keys = <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>g.keys)
        values = timer_values(g)
        last_key = keys[last]
        keys[pos] = last_key
        values[pos] = values[last]
        pe_i64map_put(&g.index, last_key, pos, &PY_ALLOC)
        g.mark(pos)
    g.n -= 1
    if g.tracking:
        g.removed.add(key)
    return 1


cdef Py_ssize_t timer_group_append(ColumnarGroup g, int64_t key, int64_t ts) except -1:
    """A new entry ``key -> ts`` in an int64 group (owned already): written through
    the arrays' data pointers while they have room, else by ColumnarGroup.append,
    which grows them."""
    cdef Py_ssize_t pos = g.n
    if pos < cnp.PyArray_DIM(<cnp.ndarray>g.keys, 0):
        if pe_i64map_put(&g.index, key, pos, &PY_ALLOC) < 0:
            raise MemoryError()
        (<int64_t*>cnp.PyArray_DATA(<cnp.ndarray>g.keys))[pos] = key
        g.n = pos + 1
    else:
        pos = g.append(key)
    timer_values(g)[pos] = ts
    g.mark(pos)
    return pos


cdef enum:
    # Registrations wait in a buffer of this many and are applied in one pass: by
    # then the pass knows the keys to come and asks for their slots' cache lines
    # PREFETCH_AHEAD entries early (pe_i64map_prefetch), so the lookups' misses
    # overlap. Applied one by one, each register() waited on memory: its lookup cost
    # ~0.13 us in a job at 100k keys (the call 0.44 us in all; 0.21 us batched).
    PENDING_MAX = 1024
    PREFETCH_AHEAD = 8
    PREFETCH_STATES = 4


cdef enum:  # results of TimerHeap._apply
    APPLIED = 0
    TO_OVERFLOW = 1  # every slot taken by other timestamps: the key's overflow (_overflow_add, else overflow(ts))
    TO_FALLBACK = 2  # a slot state still to make, or a slot not columnar: Python's fallback(ts)


cdef enum:  # results of TimerHeap._remove
    REMOVED = 1
    ABSENT = 0
    ASK_PYTHON = -1  # all slots taken and ts not in them (it may be in the overflow), or not columnar
    REMOVED_FULL = 2  # removed from a key whose every slot was taken: refilled from its overflow (_overflow_refill)
    IN_OVERFLOW = -3  # every slot taken and ts not in them: only the key's overflow may hold it


cdef class TimerHeap:
    """Min-heap of int64-keyed timers by (timestamp, arrival) over slot states; see _timers.pxi."""

    cdef TimerEntry* entries  # the heap
    cdef Py_ssize_t n
    cdef Py_ssize_t cap
    cdef TimerEntry* run  # a sorted run: entries that came in timestamp order, popped from run_head
    cdef Py_ssize_t run_head
    cdef Py_ssize_t run_tail
    cdef Py_ssize_t run_cap
    cdef int64_t seq
    cdef object backend  # the keyed backend
    cdef KeyFields current  # its current key and key-group index, in place (see _keycore.pxi)
    cdef object tables  # the backend's tables by name
    cdef public list slots  # the slot states' names, in order (Python appends one when it makes it)
    cdef public Py_ssize_t max_slots  # slots a key may use before the overflow
    cdef object fallback  # fallback(ts): registers through Python
    cdef object overflow  # overflow(ts): the current key's slots are all taken, ts in none: its overflow
    cdef list groups  # per slot: its table's list of groups (cached; the tables stay while columnar)
    cdef public bint disabled  # the state left columnar storage: everything goes to Python
    cdef TimerEntry* pending  # registrations not yet applied (ts, key, index; seq unused)
    cdef object more_name  # the overflow state's name (use_overflow), or None: Python does it all
    cdef object timer_set  # the overflow's TimerSet class
    cdef Py_ssize_t npending
    cdef bint flushing

    def __cinit__(self, backend, tables, list slots, Py_ssize_t max_slots, fallback, overflow):
        self.current = KeyFields(backend)
        self.cap = 256
        self.entries = <TimerEntry*>malloc(self.cap * sizeof(TimerEntry))
        self.run_cap = 256
        self.run = <TimerEntry*>malloc(self.run_cap * sizeof(TimerEntry))
        self.pending = <TimerEntry*>malloc(PENDING_MAX * sizeof(TimerEntry))
        self.npending = 0
        self.flushing = False
        if self.entries == NULL or self.run == NULL or self.pending == NULL:
            raise MemoryError()
        self.run_head = self.run_tail = 0
        self.n = 0
        self.seq = 0
        self.backend = backend
        self.tables = tables
        self.slots = slots
        self.max_slots = max_slots
        self.fallback = fallback
        self.overflow = overflow
        self.groups = []
        self.disabled = False

    cdef ColumnarGroup group(self, Py_ssize_t slot, Py_ssize_t index):
        """Slot ``slot``'s group of key group ``index``, or None if it is not an int64
        ColumnarGroup (the caller hands over to Python)."""
        cdef object groups
        while len(self.groups) < len(self.slots):  # a slot Python made since
            table = self.tables[self.slots[len(self.groups)]]
            # Checked once per slot, not per call: the slot's table is an int64
            # ColumnarValueTable (a list of ColumnarGroup), or None (Python's slots).
            groups = getattr(table, "groups", None)
            if type(groups) is not list or getattr(table, "dtype", None) != np.int64:
                groups = None
            self.groups.append(groups)
        groups = self.groups[slot]
        if groups is None:
            return None
        if index >= len(<list>groups):
            raise IndexError(f"timer key group index {index} out of range")
        group = (<list>groups)[index]
        if type(group) is not ColumnarGroup:
            return None
        return <ColumnarGroup>group

    def use_overflow(self, str name, type timer_set):
        """The overflow state (dict-backed, a ``timer_set`` per key) whose common
        changes run here: adding to, removing from and refilling a slot from a key's
        set that no unfinished snapshot holds. Everything else stays Python's."""
        self.more_name = name
        self.timer_set = timer_set

    cdef object _overflow_of(self, Py_ssize_t index, object key, bint* absent):
        """``key``'s overflow set, when it exists and may be changed in place; else
        None (Python decides: one a snapshot holds, a restored tuple), with ``absent``
        set when the key has no overflow at all."""
        cdef PyObject* p
        absent[0] = False
        if self.more_name is None:
            return None
        table = self.tables.get(self.more_name)
        group = _group(table, index)
        if group is None:
            return None
        p = PyDict_GetItemWithError(group, key)
        if p is NULL:
            absent[0] = True
            return None
        if type(<object>p) is not self.timer_set:
            return None
        more = <object>p
        if _private(table, index, key) != 1:
            return None
        return more

    cdef int _overflow_changed(self, Py_ssize_t index, object key) except -1:
        """An incremental backend's delta takes ``key``'s overflow set."""
        changes = (<StateTableBase>self.tables[self.more_name]).changes
        if changes is not None:
            PySet_Add(changes[index], key)
        return 0

    cdef bint _overflow_add(self, int64_t k, int64_t t, Py_ssize_t i) except -1:
        """Adds timer ``t`` to ``k``'s overflow set (all its slots taken by others);
        False: Python must."""
        cdef bint absent
        key = k
        more = self._overflow_of(i, key, &absent)
        if more is None:
            return False  # Python makes the set (or copies one a snapshot holds)
        times = more.times
        ts = t
        if type(times) is not dict:
            return False
        if ts in <dict>times:
            return True  # registered already
        (<dict>times)[ts] = None
        self._overflow_changed(i, key)
        self._push(t, k, i)
        return True

    cdef int _overflow_remove(self, object key, Py_ssize_t index, object ts) except -2:
        """Removes ``ts`` from ``key``'s overflow set: 1 removed, 0 not there, -1
        Python must (no set to change in place, or its last timer: the set goes)."""
        cdef bint absent
        more = self._overflow_of(index, key, &absent)
        if more is None:
            return 0 if absent else -1
        times = more.times
        if type(times) is not dict:
            return -1
        if ts not in <dict>times:
            return 0
        if len(<dict>times) == 1:
            return -1
        del (<dict>times)[ts]
        self._overflow_changed(index, key)
        return 1

    cdef bint _overflow_refill(self, object key, int64_t k, Py_ssize_t index) except -1:
        """A timer left ``key``'s full slots: its overflow's newest timer takes the
        last slot (as Python's ``_refill``); False: Python must (see _overflow_remove)."""
        cdef ColumnarGroup g
        cdef bint absent
        more = self._overflow_of(index, key, &absent)
        if more is None:
            return absent  # no overflow: nothing to move up
        times = more.times
        if type(times) is not dict or len(<dict>times) < 2:
            return False  # not a dict, or its last timer: the set goes (Python)
        g = self.group(self.max_slots - 1, index)
        if g is None or len(self.slots) != self.max_slots:
            return False
        ts, _ = (<dict>times).popitem()
        self._overflow_changed(index, key)
        g.put(k, ts)
        return True

    def __dealloc__(self):
        free(self.entries)
        free(self.run)
        free(self.pending)

    def __len__(self):
        self._flush()
        return self.n + self.run_tail - self.run_head

    # Timers mostly come in timestamp order (an event time plus a delay, a window's
    # end): those go to the sorted run, O(1) in and out with memory read in order; the
    # rest to the heap. The next timer is the earlier of the two heads, by (ts, seq).

    cdef int _push(self, int64_t ts, int64_t key, Py_ssize_t index) except -1:
        cdef TimerEntry* grown
        cdef Py_ssize_t live
        if self.run_tail == self.run_head or ts >= self.run[self.run_tail - 1].ts:
            if self.run_tail == self.run_cap:
                live = self.run_tail - self.run_head
                if self.run_head >= self.run_cap // 2:  # room at the front: move the live part there
                    memmove(self.run, self.run + self.run_head, live * sizeof(TimerEntry))
                else:
                    grown = <TimerEntry*>realloc(self.run, 2 * self.run_cap * sizeof(TimerEntry))
                    if grown == NULL:
                        raise MemoryError()
                    self.run = grown
                    self.run_cap *= 2
                    memmove(self.run, self.run + self.run_head, live * sizeof(TimerEntry))
                self.run_head, self.run_tail = 0, live
            self.seq += 1
            self.run[self.run_tail].ts = ts
            self.run[self.run_tail].seq = self.seq
            self.run[self.run_tail].key = key
            self.run[self.run_tail].index = index
            self.run_tail += 1
            return 0
        return self._heap_push(ts, key, index)

    cdef inline bint _count(self) noexcept:
        return self.n > 0 or self.run_tail > self.run_head

    cdef inline bint _due(self, int64_t upto) noexcept:
        return (self.n > 0 and self.entries[0].ts <= upto) or (
            self.run_tail > self.run_head and self.run[self.run_head].ts <= upto
        )

    cdef TimerEntry _pop(self) noexcept:
        """The earliest entry (there is one)."""
        cdef TimerEntry e
        if self.run_tail > self.run_head and (self.n == 0 or timer_before(&self.run[self.run_head], &self.entries[0])):
            e = self.run[self.run_head]
            self.run_head += 1
            if self.run_head == self.run_tail:
                self.run_head = self.run_tail = 0
            return e
        return self._heap_pop()

    cdef int _heap_push(self, int64_t ts, int64_t key, Py_ssize_t index) except -1:
        cdef TimerEntry* grown
        cdef TimerEntry e
        cdef Py_ssize_t i, parent
        if self.n == self.cap:
            grown = <TimerEntry*>realloc(self.entries, 2 * self.cap * sizeof(TimerEntry))
            if grown == NULL:
                raise MemoryError()
            self.entries = grown
            self.cap *= 2
        self.seq += 1
        e.ts, e.seq, e.key, e.index = ts, self.seq, key, index
        i = self.n
        self.n += 1
        while i > 0:
            parent = (i - 1) >> 1
            if timer_before(&e, &self.entries[parent]):
                self.entries[i] = self.entries[parent]
                i = parent
            else:
                break
        self.entries[i] = e
        return 0

    cdef TimerEntry _heap_pop(self) noexcept:
        cdef TimerEntry top = self.entries[0]
        cdef TimerEntry last
        cdef Py_ssize_t i = 0, child
        self.n -= 1
        if self.n > 0:
            last = self.entries[self.n]
            while True:
                child = 2 * i + 1
                if child >= self.n:
                    break
                if child + 1 < self.n and timer_before(&self.entries[child + 1], &self.entries[child]):
                    child += 1
                if timer_before(&self.entries[child], &last):
                    self.entries[i] = self.entries[child]
                    i = child
                else:
                    break
            self.entries[i] = last
        return top

    cdef int _remove(self, int64_t key, Py_ssize_t index, int64_t ts) except -2:
        """Removes timer ``ts`` of ``key`` from its slot, keeping the key's slots without
        holes; see the REMOVED / ABSENT / ASK_PYTHON / REMOVED_FULL / IN_OVERFLOW results."""
        cdef Py_ssize_t j, m = 0, found = -1, nslots = len(self.slots)
        cdef ColumnarGroup g, last
        cdef int64_t pos, last_pos
        cdef ColumnarGroup found_group = None
        cdef int64_t found_pos = -1
        if self.disabled:
            return ASK_PYTHON
        for j in range(nslots):
            g = self.group(j, index)
            if g is None:
                return ASK_PYTHON
            pos = pe_i64map_get(&g.index, key)
            if pos < 0:
                break
            m = j + 1
            if found < 0 and timer_values(g)[pos] == ts:
                found, found_group, found_pos = j, g, pos
        if found < 0:
            return IN_OVERFLOW if m == self.max_slots else ABSENT
        if found != m - 1:  # the key's last timer fills the hole
            last = self.group(m - 1, index)
            last_pos = pe_i64map_get(&last.index, key)
            found_group.own()
            timer_values(found_group)[found_pos] = timer_values(last)[last_pos]
            found_group.mark(found_pos)
            timer_group_remove(last, key)
        else:
            timer_group_remove(found_group, key)
        return REMOVED_FULL if m == self.max_slots else REMOVED

    def push(self, int64_t ts, int64_t key, Py_ssize_t index):
        """Adds an entry (the state already holds the timer)."""
        if index < 0:
            raise ValueError(f"push: a key group index is never negative, got {index}")
        self._flush()  # registrations waiting came first (the order of equal timestamps)
        self._push(ts, key, index)

    def push_many(self, timestamps, keys, indexes):
        """Adds many entries (a restore): int64 arrays and an index array of one length."""
        cdef const int64_t[::1] t = np.ascontiguousarray(timestamps, dtype=np.int64)
        cdef const int64_t[::1] k = np.ascontiguousarray(keys, dtype=np.int64)
        cdef const int64_t[::1] x = np.ascontiguousarray(indexes, dtype=np.int64)
        cdef Py_ssize_t i
        if t.shape[0] != k.shape[0] or t.shape[0] != x.shape[0]:
            raise ValueError("push_many: timestamps, keys and indexes differ in length")
        self._flush()
        for i in range(t.shape[0]):
            if x[i] < 0:
                raise ValueError(f"push_many: a key group index is never negative, got {x[i]}")
            self._push(t[i], k[i], <Py_ssize_t>x[i])

    def peek(self):
        """The earliest timestamp in the heap (perhaps a deleted timer's), or None."""
        cdef TimerEntry e
        self._flush()
        if not self._count():
            return None
        if self.run_tail > self.run_head and (self.n == 0 or timer_before(&self.run[self.run_head], &self.entries[0])):
            return self.run[self.run_head].ts
        return self.entries[0].ts

    def drain(self):
        """Every entry, earliest first, as three lists (ts, keys, indexes); empties the heap."""
        cdef TimerEntry e
        self._flush()
        ts, keys, indexes = [], [], []
        while self._count():
            e = self._pop()
            ts.append(e.ts)
            keys.append(e.key)
            indexes.append(e.index)
        return ts, keys, indexes

    def register(self, ts):
        """The current key's timer at ``ts``, applied at the next ``flush()`` (any
        call that reads the timers flushes first; so does the backend's snapshot):
        a timer the key has already is kept once; else it goes to the key's first
        free slot and into the heap; with every slot taken, to the key's overflow set
        (in C while it may be changed in place, else ``overflow(ts)``); with
        a slot state still to make (or anything unusual), to ``fallback(ts)``.
        Anything not the common case (a key or timestamp that is no int64, no
        current key) goes to ``fallback(ts)`` now, after the waiting ones."""
        cdef int64_t k, t
        cdef Py_ssize_t i = self.current.index()
        key = self.current.key()
        if self.disabled or type(ts) is not int or type(key) is not int or i < 0:
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
        if self.flushing:  # from Python that a flush called: applied now, in order
            self._register_now(k, t, i, ts)
            return None
        if self.npending == PENDING_MAX:
            try:
                self._flush()
            finally:  # kept even if the flush raised (another entry's error): that left room
                self._hold(k, t, i)
            return None
        self._hold(k, t, i)
        return None

    cdef inline void _hold(self, int64_t k, int64_t t, Py_ssize_t i) noexcept:
        """Appends a registration to the buffer (there is room)."""
        cdef TimerEntry* e = &self.pending[self.npending]
        e.ts = t
        e.key = k
        e.index = i
        self.npending += 1

    def flush(self):
        """Applies the registrations waiting (see ``register``)."""
        self._flush()

    cdef int _apply(self, int64_t k, int64_t t, Py_ssize_t i) except -1:
        """Registers ``k``'s timer ``t`` in key group index ``i`` in C; TO_OVERFLOW or
        TO_FALLBACK where Python must."""
        cdef ColumnarGroup g
        cdef int64_t pos
        cdef Py_ssize_t j
        if self.disabled:  # the slots went to dicts during this flush: Python registers the rest
            return TO_FALLBACK
        for j in range(len(self.slots)):
            g = self.group(j, i)
            if g is None:
                return TO_FALLBACK
            pos = pe_i64map_get(&g.index, k)
            if pos < 0:
                g.own()
                timer_group_append(g, k, t)
                self._push(t, k, i)
                return APPLIED
            if timer_values(g)[pos] == t:
                return APPLIED  # registered already: one timer per key and timestamp
        return TO_OVERFLOW if len(self.slots) == self.max_slots else TO_FALLBACK

    cdef int _register_now(self, int64_t k, int64_t t, Py_ssize_t i, ts) except -1:
        """``_apply``, with the Python hand-over run as for the key current then: the
        backend's current key is ``k`` (an int, as registered) for the call and is put
        back after it. Only an int current key counts as ``k`` already: one equal to
        it may be no int (True, 1.0), and Python would take it for another key."""
        cdef int r = self._apply(k, t, i)
        if r == APPLIED:
            return 0
        if r == TO_OVERFLOW and self._overflow_add(k, t, i):
            return 0
        current = self.current.key()
        cdef Py_ssize_t current_index = self.current.index()
        if type(current) is int and current == k and current_index == i:  # the key current already
            (self.overflow if r == TO_OVERFLOW else self.fallback)(ts)
            return 0
        self.current.set(k, i)
        try:
            (self.overflow if r == TO_OVERFLOW else self.fallback)(ts)
        finally:
            self.current.set(current, current_index)
        return 0

    cdef int _flush(self) except -1:
        """Applies the waiting registrations in order, each key's slot-0 lookup asked
        for PREFETCH_AHEAD entries early. One that fails (no room for another slot
        state, no memory) raises here and is dropped; those after it stay waiting."""
        cdef Py_ssize_t n = self.npending, i = 0, ahead
        cdef TimerEntry* e
        cdef list groups0
        cdef object g0
        cdef int64_t pos
        if n == 0 or self.flushing:
            return 0
        self.flushing = True
        try:
            groups0 = self.tables[self.slots[0]].groups
            while i < n:
                ahead = i + PREFETCH_AHEAD
                if ahead < n:
                    e = &self.pending[ahead]
                    if 0 <= e.index < len(groups0):  # else _apply raises its IndexError when it gets there
                        g0 = groups0[e.index]
                        if type(g0) is ColumnarGroup:
                            pe_i64map_prefetch(&(<ColumnarGroup>g0).index, e.key)
                # Half as far ahead the slot's line has come: a key with a timer
                # already has its timestamp compared next, so that is asked for too.
                ahead = i + PREFETCH_AHEAD // 2
                if ahead < n:
                    e = &self.pending[ahead]
                    if 0 <= e.index < len(groups0):
                        g0 = groups0[e.index]
                        if type(g0) is ColumnarGroup and (<ColumnarGroup>g0).index_ready:
                            pos = pe_i64map_get(&(<ColumnarGroup>g0).index, e.key)
                            if pos >= 0:
                                PE_PREFETCH(timer_values(<ColumnarGroup>g0) + pos)
                e = &self.pending[i]
                i += 1  # consumed, whether it succeeds or raises
                if self._apply(e.key, e.ts, e.index) != APPLIED:
                    self._register_now(e.key, e.ts, e.index, e.ts)
        finally:
            if i < n:  # an error: the entries after the failed one wait for the next flush
                memmove(self.pending, self.pending + i, (n - i) * sizeof(TimerEntry))
            self.npending = n - i
            self.flushing = False
        return 0

    def remove_current(self, int64_t ts):
        """Removes the current key's timer ``ts``: 1 removed, 0 not there, -1 Python
        must look (not columnar), 2 removed from a key whose slots were all taken
        (Python refills from the overflow), -3 only the key's overflow may hold it."""
        self._flush()
        key = self.current.key()
        cdef Py_ssize_t index = self.current.index()
        if type(key) is not int or index < 0:
            return ASK_PYTHON
        try:
            return self._remove(key, index, ts)
        except OverflowError:
            return ASK_PYTHON

    def fire_due(self, int64_t upto, ctx, on_timer, list out, check, refill, check_overflow):
        """Fires every timer at or before ``upto``, in order: for each, the backend's
        current key (``_key``, ``_key_index``) and ``ctx.current_key`` /
        ``ctx._timer_ts`` are set, the timer is removed from its slot, then
        ``on_timer(ts, ctx)`` runs and what it returns (an iterable, or None) goes into
        ``out``. Where the slots cannot tell, ``check(ts)`` (Python, key set) removes
        the timer and says whether it was live; where only the key's overflow may hold
        it, that set is asked in C (``check_overflow(ts)`` when Python must: the set's
        last timer, a set a snapshot holds); after a removal from a key whose slots were
        all taken, its newest overflow timer moves up in C (``refill()`` when Python
        must). Entries of deleted timers are skipped. Returns how many fired."""
        cdef TimerEntry e
        cdef Py_ssize_t fired = 0
        cdef int r, c
        cdef bint live
        cdef list ahead = None
        cdef Py_ssize_t next_at
        cdef TimerContextFields fields = timer_context_fields(ctx)  # written in place if slots
        self._flush()
        while self._due(upto):
            # The keys of the timers to fire next are known: their columnar states'
            # lookups (the slots', and what on_timer will likely read: the key's
            # value states) are asked for PREFETCH_AHEAD timers early.
            # Then, half as far ahead, those lookups are done (their lines have come)
            # and the values they point at are asked for in turn.
            next_at = self.run_head + PREFETCH_AHEAD
            if next_at < self.run_tail and self.run[next_at].ts <= upto:
                if ahead is None:
                    ahead = self._state_groups()
                self._prefetch_key(ahead, self.run[next_at].key, self.run[next_at].index)
                next_at = self.run_head + PREFETCH_AHEAD // 2
                self._prefetch_values(ahead, self.run[next_at].key, self.run[next_at].index)
            e = self._pop()
            key = e.key
            ts = e.ts
            self.current.set(key, e.index)
            r = self._remove(e.key, e.index, e.ts)
            if r == REMOVED:
                live = True
            elif r == ABSENT:
                live = False
            elif r == REMOVED_FULL:
                if not self._overflow_refill(key, e.key, e.index):
                    refill()
                live = True
            elif r == IN_OVERFLOW:
                c = self._overflow_remove(key, e.index, ts)
                live = check_overflow(ts) if c < 0 else c == 1
            else:
                live = check(ts)
            if not live:
                continue
            set_timer_context(ctx, &fields, key, ts)
            result = on_timer(ts, ctx)
            if result is not None and result is not ():  # () is a singleton: nothing to add
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
            if self.npending:  # on_timer registered timers: one may be due already
                self._flush()
        return fired

    cdef list _state_groups(self):
        """The groups lists to prefetch a firing key's lookups in: the first two slots'
        (a key with one timer: the one that fires, and the next slot found empty) and
        the first PREFETCH_STATES columnar states that are not the timers' own (those
        on_timer may read; past a few, the lookups would cost more than they save)."""
        cdef list out = []
        cdef list first_slots = self.slots[:2]
        cdef Py_ssize_t states = 0
        for name, table in self.tables.items():
            timers = name.startswith("_timer_state/")
            if (timers and name not in first_slots) or (not timers and states == PREFETCH_STATES):
                continue
            groups = getattr(table, "groups", None)
            if type(groups) is list and groups and type((<list>groups)[0]) is ColumnarGroup:
                out.append(groups)
                states += not timers
        return out

    cdef void _prefetch_values(self, list groups_of_states, int64_t key, Py_ssize_t index) noexcept:
        cdef list groups
        cdef int64_t pos
        cdef Py_ssize_t last
        cdef cnp.ndarray values
        for groups in groups_of_states:
            if index < len(groups):
                g = groups[index]
                if type(g) is ColumnarGroup and (<ColumnarGroup>g).index_ready:
                    pos = pe_i64map_get(&(<ColumnarGroup>g).index, key)
                    if pos >= 0:
                        values = <cnp.ndarray>(<ColumnarGroup>g).values
                        PE_PREFETCH(<char*>cnp.PyArray_DATA(values) + pos * cnp.PyArray_ITEMSIZE(values))
                        # a removal moves the group's last entry into the hole and
                        # rewrites that key's slot in the map: ask for it too
                        last = (<ColumnarGroup>g).n - 1
                        if last > pos:
                            pe_i64map_prefetch(
                                &(<ColumnarGroup>g).index,
                                (<int64_t*>cnp.PyArray_DATA(<cnp.ndarray>(<ColumnarGroup>g).keys))[last],
                            )

    cdef void _prefetch_key(self, list groups_of_states, int64_t key, Py_ssize_t index) noexcept:
        cdef list groups
        for groups in groups_of_states:
            if index < len(groups):
                g = groups[index]
                if type(g) is ColumnarGroup:
                    pe_i64map_prefetch(&(<ColumnarGroup>g).index, key)

    def pop_due(self, int64_t upto):
        """The next timer at or before ``upto``, with the backend's current key set to its
        key: ``(key, ts, code)``, ``code`` as ``remove_current``'s (1 or 2: removed; -1
        or -3: Python decides); None when nothing more is due. Entries of deleted timers are
        skipped."""
        cdef TimerEntry e
        cdef int r
        self._flush()
        while self._due(upto):
            e = self._pop()
            self.current.set(e.key, e.index)
            r = self._remove(e.key, e.index, e.ts)
            if r != ABSENT:
                return (e.key, e.ts, r)
        return None
