# Included by _native.pyx: the order of a keyed operator's int64-keyed timers
# (pyengine.state.timers): TimerOrder, a sorted run plus a binary min-heap of
# (timestamp, arrival) entries with their key and key-group index, never snapshotted
# (rebuilt from the timers on restore). The timers themselves are a (key, timestamp)
# set per key group (_timersets.pxi): the order says which timer may be due next, the
# set whether it still is (a deleted timer's entry is skipped when it comes up).
#
# Also here: what firing asks of the function's own columnar states ahead of time
# (prefetch_state_keys/values), so on_timer's lookups do not each wait on memory.

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


cdef enum:
    # Registrations wait in a buffer of this many and are applied in one pass: by
    # then the pass knows the keys to come and asks for their set's cache lines
    # PREFETCH_AHEAD entries early (pe_tset_prefetch), so the probes' misses
    # overlap. Applied one by one, each register() waits on memory.
    PENDING_MAX = 1024
    PREFETCH_AHEAD = 8
    PREFETCH_STATES = 4  # the function's columnar states whose lookups firing prefetches


cdef void prefetch_state_values(list groups_of_states, int64_t key, Py_ssize_t index) noexcept:
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

cdef void prefetch_state_keys(list groups_of_states, int64_t key, Py_ssize_t index) noexcept:
    cdef list groups
    for groups in groups_of_states:
        if index < len(groups):
            g = groups[index]
            if type(g) is ColumnarGroup:
                pe_i64map_prefetch(&(<ColumnarGroup>g).index, key)


cdef class TimerOrder:
    """The order of int64-keyed timers: a sorted run for those that come in timestamp
    order and a binary min-heap for the rest, by (timestamp, arrival)."""

    cdef TimerEntry* entries  # the heap
    cdef Py_ssize_t n
    cdef Py_ssize_t cap
    cdef TimerEntry* run  # a sorted run: entries that came in timestamp order, popped from run_head
    cdef Py_ssize_t run_head
    cdef Py_ssize_t run_tail
    cdef Py_ssize_t run_cap
    cdef int64_t seq

    def __cinit__(self, *args, **kwargs):
        self.cap = 256
        self.entries = <TimerEntry*>malloc(self.cap * sizeof(TimerEntry))
        self.run_cap = 256
        self.run = <TimerEntry*>malloc(self.run_cap * sizeof(TimerEntry))
        if self.entries == NULL or self.run == NULL:
            raise MemoryError()
        self.run_head = self.run_tail = 0
        self.n = 0
        self.seq = 0

    def __dealloc__(self):
        free(self.entries)
        free(self.run)

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
