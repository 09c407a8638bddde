# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, embedsignature=True, embedsignature.format=clinic, binding=False
"""Native checkpointed input gate (``pyengine._native``).

A Cython twin of ``pyengine.io.reference``: the same state machine, with the
channel rings, bitsets, channel queue and barrier tables in C (``csrc/``). This
module owns the reference counts of queued items (one per queued slot) and
releases the GIL only while waiting. It knows nothing of the package around it:
``pyengine.io.native`` hands it the event classes, error classes and failure
reasons once, through ``bind``. Use it through ``pyengine.io``.
"""

cimport cython
from cpython.object cimport PyTypeObject, Py_TYPE
from cpython.ref cimport PyObject, Py_INCREF, Py_XDECREF
from cpython.list cimport PyList_Append
from cpython.sequence cimport PySequence_Fast_GET_ITEM
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int64_t, uint32_t, uint64_t

from pe_core cimport *

import array as _array_module
import collections

cdef extern from "Python.h":
    void *PyMem_RawCalloc(size_t nelem, size_t elsize) nogil
    void PyMem_RawFree(void *ptr) nogil
    int PyObject_GC_IsTracked(object o)
    void PyObject_GC_UnTrack(void *o)
    void PyObject_GC_Track(void *o)
    PyTypeObject *type_of "Py_TYPE"(PyObject *o)

# Memory through Python's raw allocator, so tracemalloc accounts for the gate.
cdef pe_allocator PY_ALLOC
PY_ALLOC.calloc = PyMem_RawCalloc
PY_ALLOC.free = PyMem_RawFree

cdef enum:
    K_DATA = 0
    K_BARRIER = 1
    K_CANCEL = 2
    K_EOP = 3

cdef enum:
    ALIGNED = 0
    UNALIGNED = 1

# Bound by ``bind``: the classes and enum members the gate needs.
cdef PyTypeObject *T_BARRIER = NULL
cdef PyTypeObject *T_CANCEL = NULL
cdef PyTypeObject *T_EOP = NULL
cdef object Metrics = None
cdef object CHECKPOINT = None
cdef object SUBSUMED = None
cdef object ON_CANCELLATION = None
cdef object END_OF_STREAM = None
cdef object ChannelIndexError = None
cdef object ChannelClosedError = None
cdef object CorruptStreamError = None
cdef object item_nbytes = None
cdef object _bound = None


def bind(barrier_type, cancel_type, eop_type, metrics_type, checkpoint_member,
         subsumed, on_cancellation, end_of_stream, channel_index_error,
         channel_closed_error, corrupt_stream_error, nbytes_function):
    """Tell the gate which classes are events and how to report; called once by pyengine.io."""
    global T_BARRIER, T_CANCEL, T_EOP, Metrics, CHECKPOINT, SUBSUMED, ON_CANCELLATION
    global END_OF_STREAM, ChannelIndexError, ChannelClosedError, CorruptStreamError
    global item_nbytes, _bound
    # Keep the classes alive: the gate compares borrowed type pointers.
    _bound = (barrier_type, cancel_type, eop_type)
    T_BARRIER = <PyTypeObject *>barrier_type
    T_CANCEL = <PyTypeObject *>cancel_type
    T_EOP = <PyTypeObject *>eop_type
    Metrics = metrics_type
    CHECKPOINT = checkpoint_member
    SUBSUMED = subsumed
    ON_CANCELLATION = on_cancellation
    END_OF_STREAM = end_of_stream
    ChannelIndexError = channel_index_error
    ChannelClosedError = channel_closed_error
    CorruptStreamError = corrupt_stream_error
    item_nbytes = nbytes_function


cdef inline int built(int rc) except -1:
    if rc != PE_OK:
        raise MemoryError("not enough memory for the input gate's channel structures")
    return 0


cdef inline tuple result(object channel, object item):
    """A (channel, item) pair. Like CPython's own lazy rule for tuples, it is left
    out of the cyclic GC when the item is: then it cannot be part of a cycle, and
    large batches of pairs no longer make every young collection walk them."""
    cdef tuple pair = (channel, item)
    if not PyObject_GC_IsTracked(item):
        PyObject_GC_UnTrack(<void *>pair)
    return pair


cdef inline int kind_of(object item):
    return kind_of_type(Py_TYPE(item))


cdef inline int kind_of_type(PyTypeObject *t):
    if t == T_BARRIER:
        return K_BARRIER
    if t == T_CANCEL:
        return K_CANCEL
    if t == T_EOP:
        return K_EOP
    return K_DATA


cdef class InputGate:
    """Base of ``pyengine.io.native.NativeCheckpointedInputGate``."""

    cdef pe_rings rings
    cdef pe_chanqueue available
    cdef pe_bitset blocked
    cdef pe_bitset eop_pushed
    cdef pe_bitset closed
    cdef pe_alignment align
    cdef pe_pending_table table
    cdef pe_waiter waiter
    cdef PyObject **chan_objs
    cdef int64_t *last_barrier_pushed
    cdef int ready  # bit flags of what __cinit__ initialised, for __dealloc__

    cdef uint32_t n
    cdef uint32_t capacity
    cdef uint32_t event_limit
    cdef bint exactly_once
    cdef bint unaligned
    cdef int64_t aligned_timeout_ns
    cdef object clock
    cdef object cb_trigger
    cdef object cb_abort
    cdef object cb_add
    cdef object cb_finish

    cdef object priority
    cdef Py_ssize_t prio_len
    cdef bint in_poll
    cdef object stashed
    cdef object failure

    cdef bint pending
    cdef int phase
    cdef bint timeout_eligible
    cdef object current_barrier
    cdef int64_t alignment_start
    cdef int64_t latest_pending
    cdef int64_t last_alignment_ns
    cdef int64_t last_start_delay_ns
    cdef int64_t bytes_during_alignment

    def __cinit__(self, config, callbacks):
        if T_BARRIER == NULL:
            raise RuntimeError("pyengine._native.bind() was not called; import pyengine.io first")
        self.n = config.num_channels
        self.capacity = config.capacity
        self.event_limit = config.event_limit
        self.exactly_once = config.mode == "exactly_once"
        self.unaligned = config.unaligned
        self.aligned_timeout_ns = config.aligned_timeout_ns
        self.clock = config.clock
        self.cb_trigger = callbacks.trigger
        self.cb_abort = callbacks.abort
        self.cb_add = callbacks.add_input_data
        self.cb_finish = callbacks.finish_input
        self.priority = collections.deque()
        self.latest_pending = -1

        # Each step records what it built, so __dealloc__ frees exactly that.
        built(pe_rings_init(&self.rings, self.n, self.event_limit, &PY_ALLOC))
        self.ready |= 1
        built(pe_chanqueue_init(&self.available, self.n, &PY_ALLOC))
        self.ready |= 2
        built(pe_bitset_init(&self.blocked, self.n, &PY_ALLOC))
        self.ready |= 4
        built(pe_bitset_init(&self.eop_pushed, self.n, &PY_ALLOC))
        self.ready |= 8
        built(pe_bitset_init(&self.closed, self.n, &PY_ALLOC))
        self.ready |= 16
        built(pe_alignment_init(&self.align, self.n, &PY_ALLOC))
        self.ready |= 32
        if not self.exactly_once:
            built(pe_pending_init(&self.table, self.n, &PY_ALLOC))
            self.ready |= 64
        built(pe_waiter_init(&self.waiter))
        self.ready |= 128
        self.chan_objs = <PyObject **>PyMem_RawCalloc(self.n, sizeof(PyObject *))
        self.last_barrier_pushed = <int64_t *>PyMem_RawCalloc(self.n, sizeof(int64_t))
        if self.chan_objs == NULL or self.last_barrier_pushed == NULL:
            raise MemoryError()
        cdef uint32_t ch
        for ch in range(self.n):
            self.last_barrier_pushed[ch] = -1

    def __dealloc__(self):
        cdef uint32_t ch
        cdef void *p
        if self.ready & 1:
            for ch in range(self.n):
                p = pe_rings_pop(&self.rings, ch)
                while p != NULL:
                    Py_XDECREF(<PyObject *>p)
                    p = pe_rings_pop(&self.rings, ch)
            pe_rings_destroy(&self.rings, &PY_ALLOC)
        if self.ready & 2:
            pe_chanqueue_destroy(&self.available, &PY_ALLOC)
        if self.ready & 4:
            pe_bitset_destroy(&self.blocked, &PY_ALLOC)
        if self.ready & 8:
            pe_bitset_destroy(&self.eop_pushed, &PY_ALLOC)
        if self.ready & 16:
            pe_bitset_destroy(&self.closed, &PY_ALLOC)
        if self.ready & 32:
            pe_alignment_destroy(&self.align, &PY_ALLOC)
        if self.ready & 64:
            pe_pending_destroy(&self.table, &PY_ALLOC)
        if self.ready & 128:
            pe_waiter_destroy(&self.waiter)
        if self.chan_objs != NULL:
            for ch in range(self.n):
                Py_XDECREF(self.chan_objs[ch])
            PyMem_RawFree(self.chan_objs)
        if self.last_barrier_pushed != NULL:
            PyMem_RawFree(self.last_barrier_pushed)

    # ------------------------------------------------------------------ helpers

    cdef inline object chan(self, uint32_t ch):
        """The channel number as a Python int, created once per channel."""
        cdef PyObject *o = self.chan_objs[ch]
        if o == NULL:
            obj = int(ch)
            Py_INCREF(obj)
            self.chan_objs[ch] = <PyObject *>obj
            return obj
        return <object>o

    cdef uint32_t check_channel(self, Py_ssize_t channel) except? 0xFFFFFFFF:
        if channel < 0 or channel >= self.n:
            raise ChannelIndexError(
                f"channel {channel} is out of range for a gate of {self.n} channels (0..{self.n - 1})")
        return <uint32_t>channel

    cdef inline int64_t mono(self) except? -1:
        if self.clock is None:
            return pe_monotonic_ns()
        return self.clock()

    cdef int64_t start_delay(self, object barrier) except? -1:
        wall = pe_wall_ns() if self.clock is None else self.clock()
        delay = max(0, wall // 1_000_000 - barrier.timestamp) * 1_000_000
        return min(delay, 0x7FFFFFFFFFFFFFFF)

    # ------------------------------------------------------------------ producer

    @cython.final
    cdef inline int push_one(self, uint32_t ch, object item) except -1:
        cdef int kind = kind_of(item)
        if pe_bitset_test(&self.eop_pushed, ch):
            raise ChannelClosedError(
                f"channel {ch} already delivered EndOfPartition; cannot push {item!r} after it")
        if pe_rings_len(&self.rings, ch) >= (self.capacity if kind == K_DATA else self.event_limit):
            return 0
        Py_INCREF(item)
        pe_rings_push(&self.rings, ch, <void *>item)
        if kind != K_DATA:
            if kind == K_EOP:
                pe_bitset_set(&self.eop_pushed, ch)
            elif kind == K_BARRIER:
                self.barrier_pushed(ch, item)
        if not pe_bitset_test(&self.blocked, ch):
            pe_chanqueue_push(&self.available, ch)
        if self.waiter.data_waiters:
            pe_waiter_signal_data(&self.waiter)
        return 1

    cdef int barrier_pushed(self, uint32_t ch, object barrier) except -1:
        cdef int64_t checkpoint_id = barrier.checkpoint_id
        if checkpoint_id == self.last_barrier_pushed[ch] and self.failure is None:
            # A producer never sends one checkpoint's barrier twice. The consumer
            # fails, not the producer: that is the task the corrupt input belongs to.
            self.failure = CorruptStreamError(
                f"stream corrupt: repeated barrier for checkpoint {checkpoint_id} on channel {ch}")
        self.last_barrier_pushed[ch] = checkpoint_id
        if self.unaligned and self.overtakes_on_push(barrier):
            self.priority.append((self.chan(ch), checkpoint_id))
            self.prio_len += 1
        return 0

    cdef object corrupt(self, str message):
        """The gate stays failed: everything after a corrupt event is suspect."""
        self.failure = CorruptStreamError(message)
        return self.failure

    cdef bint overtakes_on_push(self, object barrier) except -1:
        if barrier.options.checkpoint_type is not CHECKPOINT:
            return False
        if self.aligned_timeout_ns == 0:
            return True
        return (self.pending and self.phase == UNALIGNED
                and barrier.checkpoint_id == self.align.checkpoint_id)

    def push(self, Py_ssize_t channel, object item):
        return self.push_one(self.check_channel(channel), item) == 1

    def push_many(self, Py_ssize_t channel, items):
        cdef uint32_t ch = self.check_channel(channel)
        cdef Py_ssize_t pushed = 0
        cdef Py_ssize_t i, n
        if type(items) is list or type(items) is tuple:
            n = len(items)
            pushed = self.push_data_run(ch, items, n)
            # Whatever the run stopped at (an event, a full channel, a closed
            # one) takes the general path, which raises or refuses as push does.
            for i in range(pushed, n):
                if not self.push_one(ch, <object>PySequence_Fast_GET_ITEM(items, i)):
                    break
                pushed += 1
            return pushed
        for item in items:
            if not self.push_one(ch, item):
                break
            pushed += 1
        return pushed

    @cython.final
    cdef inline Py_ssize_t push_data_run(self, uint32_t ch, object seq, Py_ssize_t n) except -1:
        """Queues the leading data items of a list or tuple that fit, with the
        per-push bookkeeping (channel queue, waking the consumer) done once for
        the run: no Python code runs in between, so nobody can tell."""
        cdef Py_ssize_t i = 0, room
        cdef uint32_t queued
        cdef PyObject *item
        if pe_bitset_test(&self.eop_pushed, ch):
            return 0
        queued = pe_rings_len(&self.rings, ch)
        room = self.capacity - queued if queued < self.capacity else 0
        if n < room:
            room = n
        while i < room:
            item = PySequence_Fast_GET_ITEM(seq, i)
            if kind_of_type(type_of(item)) != K_DATA:
                break
            Py_INCREF(<object>item)
            pe_rings_push(&self.rings, ch, <void *>item)
            i += 1
        if i:
            if not pe_bitset_test(&self.blocked, ch):
                pe_chanqueue_push(&self.available, ch)
            if self.waiter.data_waiters:
                pe_waiter_signal_data(&self.waiter)
        return i

    def put(self, Py_ssize_t channel, object item, timeout=None):
        cdef uint32_t ch = self.check_channel(channel)
        cdef int64_t deadline = -1
        cdef uint64_t seen
        if timeout is not None:
            deadline = pe_monotonic_ns() + <int64_t>(float(timeout) * 1e9)
        while True:
            if self.push_one(ch, item):
                return True
            if deadline >= 0 and pe_monotonic_ns() >= deadline:
                return False
            self.waiter.space_waiters += 1
            seen = pe_waiter_space_seq(&self.waiter)
            with nogil:
                pe_waiter_wait_space(&self.waiter, seen, deadline)
            self.waiter.space_waiters -= 1

    # ------------------------------------------------------------------ consumer

    cdef int enter(self) except -1:
        if self.in_poll:
            raise RuntimeError(
                "the gate is already being polled, from one of its listener callbacks or another thread: "
                "a gate has a single consumer")
        self.in_poll = True
        if self.failure is not None:
            self.in_poll = False
            raise self.failure
        exc = self.stashed
        if exc is not None:
            self.stashed = None
            self.in_poll = False
            raise exc
        return 0

    def poll_next(self):
        self.enter()
        try:
            return self.poll_one()
        finally:
            self.in_poll = False

    def poll_priority(self):
        """Only what must not wait behind data: a barrier overtaking in-flight buffers
        (unaligned), or the switch to unaligned when the aligned timeout has passed."""
        self.enter()
        try:
            return self.take_urgent()
        finally:
            self.in_poll = False

    cdef object take_urgent(self):
        """A priority item, or None once there is none and no aligned timeout is
        due (a due timeout switches to unaligned first, which may queue some)."""
        while True:
            if self.prio_len:
                taken = self.take_priority()
                if taken is not None:
                    return taken
            if self.timeout_eligible and self.timeout_due():
                self.switch_to_unaligned()
                continue
            return None

    @cython.final
    cdef inline int append_plain_data(self, list out, uint32_t ch, void *ptr) except -1:
        """Moves the data item at ptr, the head of ch, into out as a (channel, item)
        pair, when no checkpoint is in progress: then polling data has no effect
        beyond the channel queue. The channel's reference to the item passes to
        its pair, and the pair exists before anything is popped, so a failed
        allocation leaves the item queued."""
        cdef tuple pair = PyTuple_New(2)
        channel = self.chan(ch)
        Py_INCREF(channel)
        PyTuple_SET_ITEM(pair, 0, channel)
        pe_rings_pop(&self.rings, ch)
        PyTuple_SET_ITEM(pair, 1, <object>ptr)
        pe_chanqueue_pop(&self.available)
        if pe_rings_len(&self.rings, ch):
            pe_chanqueue_push(&self.available, ch)
        if not PyObject_GC_IsTracked(<object>ptr):
            PyObject_GC_UnTrack(<void *>pair)
        PyList_Append(out, pair)
        return 0

    def poll_batch(self, Py_ssize_t max_items):
        cdef list out
        if max_items < 1:
            raise ValueError(f"max_items must be a positive int, got {max_items!r}")
        self.enter()
        try:
            first = self.poll_one()
            if first is None:
                return []
            out = [first]
            if kind_of((<tuple>first)[1]) != K_DATA:
                return out
            # While it fills, the batch stays out of the cyclic GC, which would
            # otherwise walk the whole growing list every few hundred pairs.
            # An untracked container only keeps its items alive, never frees them.
            PyObject_GC_UnTrack(<void *>out)
            try:
                self.fill_batch(out, max_items)
            finally:
                PyObject_GC_Track(<void *>out)
            return out
        finally:
            self.in_poll = False

    cdef int fill_batch(self, list out, Py_ssize_t max_items) except -1:
        """Adds data pairs to out until an event, a priority barrier or max_items:
        a batch is data only, or one event alone (see the reference)."""
        cdef Py_ssize_t count = 1
        cdef int64_t sch
        cdef uint32_t ch
        cdef void *ptr
        while count < max_items:
            if self.prio_len or (self.timeout_eligible and self.timeout_due()):
                break
            sch = self.next_channel()
            if sch < 0:
                break
            ch = <uint32_t>sch
            ptr = pe_rings_peek(&self.rings, ch, 0)
            if kind_of(<object>ptr) != K_DATA:
                break
            if not self.pending:
                self.append_plain_data(out, ch, ptr)
            else:
                # In-flight data or alignment bytes: the general path.
                try:
                    out.append(self.poll_one())
                except Exception as exc:
                    self.stashed = exc
                    break
            count += 1
        if self.waiter.space_waiters:
            pe_waiter_signal_space(&self.waiter)
        return 0

    def next(self, timeout=None):
        cdef int64_t deadline = -1
        cdef int64_t wait_until, align_deadline
        cdef uint64_t seen
        if timeout is not None:
            deadline = pe_monotonic_ns() + <int64_t>(float(timeout) * 1e9)
        while True:
            self.enter()
            try:
                r = self.poll_one()
            finally:
                self.in_poll = False
            if r is not None or self.align.closed == self.n:
                return r
            if deadline >= 0 and pe_monotonic_ns() >= deadline:
                return None
            wait_until = deadline
            if self.clock is None and self.timeout_pending():
                align_deadline = self.alignment_start + self.aligned_timeout_ns
                if wait_until < 0 or align_deadline < wait_until:
                    wait_until = align_deadline
            self.waiter.data_waiters += 1
            seen = pe_waiter_data_seq(&self.waiter)
            with nogil:
                pe_waiter_wait_data(&self.waiter, seen, wait_until)
            self.waiter.data_waiters -= 1

    @cython.final
    cdef inline int64_t next_channel(self):
        """Front of the available queue, dropping channels that are empty or blocked."""
        cdef int64_t ch
        while True:
            ch = pe_chanqueue_peek(&self.available)
            if ch < 0:
                return -1
            if pe_rings_len(&self.rings, <uint32_t>ch) and not pe_bitset_test(&self.blocked, <uint32_t>ch):
                return ch
            pe_chanqueue_pop(&self.available)

    cdef object poll_one(self):
        cdef int64_t sch
        cdef uint32_t ch
        cdef int kind
        cdef list notes
        while True:
            taken = self.take_urgent()
            if taken is not None:
                return taken
            sch = self.next_channel()
            if sch < 0:
                return None
            ch = <uint32_t>sch
            item = <object>pe_rings_peek(&self.rings, ch, 0)
            kind = kind_of(item)
            if (kind == K_DATA and self.pending and self.phase == UNALIGNED
                    and not pe_bitset_test(&self.align.received, ch)):
                # Hand in-flight data over before taking it, so a failing writer loses nothing.
                if self.cb_add is not None:
                    self.cb_add(self.align.checkpoint_id, self.chan(ch), item)
            Py_XDECREF(<PyObject *>pe_rings_pop(&self.rings, ch))  # `item` keeps its own reference
            pe_chanqueue_pop(&self.available)
            if self.waiter.space_waiters:
                pe_waiter_signal_space(&self.waiter)
            if kind == K_DATA:
                if self.pending and self.phase == ALIGNED:
                    self.bytes_during_alignment += item_nbytes(item)
                if pe_rings_len(&self.rings, ch):
                    pe_chanqueue_push(&self.available, ch)
                return result(self.chan(ch), item)
            notes = []
            try:
                if kind == K_BARRIER:
                    self.on_barrier(item, ch, None, notes)
                elif kind == K_CANCEL:
                    self.on_cancel(item.checkpoint_id, ch, notes)
                else:
                    self.on_end_of_partition(ch, notes)
            finally:
                if pe_rings_len(&self.rings, ch) and not pe_bitset_test(&self.blocked, ch):
                    pe_chanqueue_push(&self.available, ch)
            dispatch(notes)
            if kind != K_CANCEL:
                return (self.chan(ch), item)

    cdef object take_priority(self):
        cdef uint32_t ch, k, i, length
        cdef int64_t checkpoint_id
        cdef bint found
        cdef list overtaken, notes
        cdef object x
        cdef void *p
        while self.prio_len:
            chan_obj, checkpoint_id = self.priority.popleft()
            self.prio_len -= 1
            ch = chan_obj
            length = pe_rings_len(&self.rings, ch)
            found = False
            for k in range(length):
                x = <object>pe_rings_peek(&self.rings, ch, k)
                if kind_of(x) == K_BARRIER and x.checkpoint_id == checkpoint_id:
                    found = True
                    break
            if not found:
                continue
            overtaken = []
            for i in range(k):
                x = <object>pe_rings_peek(&self.rings, ch, i)
                if kind_of(x) == K_DATA:
                    overtaken.append(x)
            p = pe_rings_remove_at(&self.rings, ch, k)
            barrier = <object>p
            Py_XDECREF(<PyObject *>p)  # the ring's reference; `barrier` keeps its own
            if self.waiter.space_waiters:
                pe_waiter_signal_space(&self.waiter)
            notes = []
            self.on_barrier(barrier, ch, overtaken, notes)
            dispatch(notes)
            return (self.chan(ch), barrier)
        return None

    # ------------------------------------------------------------------ handlers

    cdef int on_barrier(self, object barrier, uint32_t ch, list overtaken, list notes) except -1:
        if self.exactly_once:
            self.eo_barrier(barrier, ch, overtaken, notes)
        else:
            self.tracker_barrier(barrier, ch, notes)
        return 0

    cdef int on_cancel(self, int64_t checkpoint_id, uint32_t ch, list notes) except -1:
        if self.exactly_once:
            self.eo_cancel(checkpoint_id, notes)
        else:
            self.tracker_cancel(checkpoint_id, ch, notes)
        return 0

    cdef int on_end_of_partition(self, uint32_t ch, list notes) except -1:
        cdef pe_pending_entry *e
        cdef uint32_t pos
        pe_bitset_set(&self.closed, ch)
        self.align.closed += 1
        if self.exactly_once:
            if self.pending:
                self.abort_pending(END_OF_STREAM, notes)
        else:
            for pos in range(self.table.len):
                e = pe_pending_at(&self.table, pos)
                if not e.aborted:
                    e.aborted = 1
                    notes.append((self.cb_abort, (e.checkpoint_id, END_OF_STREAM)))
            pe_pending_pop_front(&self.table, self.table.len)
        return 0

    # exactly-once --------------------------------------------------------------

    cdef int eo_barrier(self, object barrier, uint32_t ch, list overtaken, list notes) except -1:
        cdef int64_t checkpoint_id = barrier.checkpoint_id
        if self.pending:
            if checkpoint_id == self.align.checkpoint_id:
                if not pe_alignment_mark(&self.align, ch):
                    raise self.corrupt(
                        f"stream corrupt: repeated barrier for checkpoint {checkpoint_id} on channel {ch}")
                if self.phase == ALIGNED:
                    pe_bitset_set(&self.blocked, ch)
                else:
                    self.hand_overtaken(ch, overtaken, notes)
            elif checkpoint_id > self.align.checkpoint_id:
                self.abort_pending(SUBSUMED, notes)
                self.begin(barrier, ch, overtaken, notes)
            else:
                return 0
        elif checkpoint_id > self.align.checkpoint_id:
            self.begin(barrier, ch, overtaken, notes)
        else:
            return 0
        if self.pending and pe_alignment_complete(&self.align):
            self.complete(barrier, notes)
        return 0

    cdef int begin(self, object barrier, uint32_t ch, list overtaken, list notes) except -1:
        cdef bint unaligned_kind
        pe_alignment_reset(&self.align, barrier.checkpoint_id)
        self.pending = True
        self.current_barrier = barrier
        self.alignment_start = self.mono()
        self.last_start_delay_ns = self.start_delay(barrier)
        self.bytes_during_alignment = 0
        pe_alignment_mark(&self.align, ch)
        unaligned_kind = self.unaligned and barrier.options.checkpoint_type is CHECKPOINT
        if unaligned_kind and self.aligned_timeout_ns == 0:
            self.phase = UNALIGNED
            self.timeout_eligible = False
            self.last_alignment_ns = 0
            metrics = Metrics(0, self.last_start_delay_ns, 0, True)
            notes.append((self.cb_trigger, (barrier.with_alignment(True), metrics)))
            self.hand_overtaken(ch, overtaken, notes)
        else:
            self.phase = ALIGNED
            self.timeout_eligible = unaligned_kind
            pe_bitset_set(&self.blocked, ch)
        return 0

    cdef int64_t end_alignment(self) except? -1:
        """Ends the aligned phase: releases the blocked channels, records how long it took."""
        cdef int64_t duration = self.mono() - self.alignment_start
        self.release_blocks()
        self.last_alignment_ns = duration
        return duration

    cdef int complete(self, object barrier, list notes) except -1:
        cdef int64_t duration
        self.pending = False
        if self.phase == ALIGNED:
            duration = self.end_alignment()
            metrics = Metrics(duration, self.last_start_delay_ns, self.bytes_during_alignment, False)
            # An aligned-first checkpoint whose barriers all came in time is an aligned one:
            # no in-flight data and no finish_input follow, so its barrier must not say unaligned.
            notes.append((self.cb_trigger, (barrier.with_alignment(False), metrics)))
        elif self.cb_finish is not None:
            notes.append((self.cb_finish, (self.align.checkpoint_id,)))
        return 0

    cdef int abort_pending(self, object reason, list notes) except -1:
        self.pending = False
        if self.phase == ALIGNED:
            self.end_alignment()
        notes.append((self.cb_abort, (self.align.checkpoint_id, reason)))
        return 0

    cdef int eo_cancel(self, int64_t checkpoint_id, list notes) except -1:
        if self.pending:
            if checkpoint_id == self.align.checkpoint_id:
                self.abort_pending(ON_CANCELLATION, notes)
                return 0
            if checkpoint_id < self.align.checkpoint_id:
                return 0
            if self.phase == UNALIGNED:
                self.abort_pending(SUBSUMED, notes)
            else:
                self.pending = False
                self.release_blocks()
        elif checkpoint_id <= self.align.checkpoint_id:
            return 0
        pe_alignment_reset(&self.align, checkpoint_id)
        self.last_alignment_ns = 0
        notes.append((self.cb_abort, (checkpoint_id, ON_CANCELLATION)))
        return 0

    cdef inline bint timeout_pending(self):
        return self.pending and self.phase == ALIGNED and self.timeout_eligible

    cdef bint timeout_due(self) except -1:
        return self.timeout_pending() and self.mono() - self.alignment_start >= self.aligned_timeout_ns

    cdef int switch_to_unaligned(self) except -1:
        """Alignment took longer than aligned_timeout_ms: trigger now, unaligned."""
        cdef int64_t duration = self.mono() - self.alignment_start
        cdef int64_t checkpoint_id = self.align.checkpoint_id
        cdef uint32_t ch, k, length
        cdef object x
        self.phase = UNALIGNED
        self.release_blocks()
        self.last_alignment_ns = duration
        for ch in range(self.n):
            if pe_bitset_test(&self.closed, ch) or pe_bitset_test(&self.align.received, ch):
                continue
            length = pe_rings_len(&self.rings, ch)
            for k in range(length):
                x = <object>pe_rings_peek(&self.rings, ch, k)
                if kind_of(x) == K_BARRIER and x.checkpoint_id == checkpoint_id:
                    self.priority.append((self.chan(ch), checkpoint_id))
                    self.prio_len += 1
                    break
        metrics = Metrics(duration, self.last_start_delay_ns, self.bytes_during_alignment, True)
        self.cb_trigger(self.current_barrier.with_alignment(True), metrics)
        return 0

    cdef int hand_overtaken(self, uint32_t ch, list overtaken, list notes) except -1:
        if overtaken and self.cb_add is not None:
            checkpoint_id = self.align.checkpoint_id
            chan_obj = self.chan(ch)
            for item in overtaken:
                notes.append((self.cb_add, (checkpoint_id, chan_obj, item)))
        return 0

    cdef int release_blocks(self) except -1:
        cdef int64_t ch
        if self.blocked.count == 0:
            return 0
        ch = pe_bitset_next(&self.blocked, 0)
        while ch >= 0:
            if pe_rings_len(&self.rings, <uint32_t>ch):
                pe_chanqueue_push(&self.available, <uint32_t>ch)
            ch = pe_bitset_next(&self.blocked, <uint32_t>ch + 1)
        pe_bitset_clear_all(&self.blocked)
        return 0

    # at-least-once -------------------------------------------------------------

    cdef int tracker_barrier(self, object barrier, uint32_t ch, list notes) except -1:
        cdef int64_t checkpoint_id = barrier.checkpoint_id
        cdef uint32_t open_channels = self.n - self.align.closed
        cdef int pos = pe_pending_find(&self.table, checkpoint_id)
        cdef pe_pending_entry *e
        cdef int64_t evicted, delay
        cdef bint aborted
        if pos < 0:
            if checkpoint_id <= self.latest_pending:
                return 0  # an old checkpoint: it cannot complete any more
            delay = self.start_delay(barrier)
            self.last_start_delay_ns = delay
            self.latest_pending = checkpoint_id
            e = pe_pending_push_back(&self.table, checkpoint_id, &evicted)
            e.start_delay_ns = delay
            pos = self.table.len - 1
        else:
            e = pe_pending_at(&self.table, pos)
        if not pe_pending_count(e, ch):
            raise self.corrupt(
                f"stream corrupt: repeated barrier for checkpoint {checkpoint_id} on channel {ch}")
        if e.seen.count >= open_channels:
            aborted = e.aborted
            delay = e.start_delay_ns
            pe_pending_pop_front(&self.table, pos + 1)
            if not aborted:
                notes.append((self.cb_trigger, (barrier, Metrics(0, delay, 0, False))))
        return 0

    cdef int tracker_cancel(self, int64_t checkpoint_id, uint32_t ch, list notes) except -1:
        cdef pe_pending_entry *e
        cdef int64_t evicted
        while self.table.len and pe_pending_at(&self.table, 0).checkpoint_id < checkpoint_id:
            e = pe_pending_at(&self.table, 0)
            if not e.aborted:
                e.aborted = 1
                notes.append((self.cb_abort, (e.checkpoint_id, ON_CANCELLATION)))
            pe_pending_pop_front(&self.table, 1)
        if self.table.len and pe_pending_at(&self.table, 0).checkpoint_id == checkpoint_id:
            e = pe_pending_at(&self.table, 0)
            if pe_bitset_test(&e.seen, ch):
                raise self.corrupt(
                    f"stream corrupt: repeated cancellation of checkpoint {checkpoint_id} on channel {ch}")
            if not e.aborted:
                e.aborted = 1
                notes.append((self.cb_abort, (checkpoint_id, ON_CANCELLATION)))
        elif checkpoint_id > self.latest_pending:
            notes.append((self.cb_abort, (checkpoint_id, ON_CANCELLATION)))
            self.latest_pending = checkpoint_id
            e = pe_pending_push_back(&self.table, checkpoint_id, &evicted)
            e.aborted = 1
        else:
            return 0
        pe_pending_count(e, ch)
        if e.seen.count >= self.n - self.align.closed:
            pe_pending_pop_front(&self.table, 1)
        return 0

    # ------------------------------------------------------------------ inspection

    @property
    def num_channels(self):
        return self.n

    @property
    def is_finished(self):
        return self.align.closed == self.n

    @property
    def latest_checkpoint_id(self):
        return self.align.checkpoint_id if self.exactly_once else self.latest_pending

    @property
    def blocked_channels(self):
        cdef list out = []
        cdef int64_t ch = pe_bitset_next(&self.blocked, 0)
        while ch >= 0:
            out.append(ch)
            ch = pe_bitset_next(&self.blocked, <uint32_t>ch + 1)
        return out

    @property
    def last_alignment_duration_ns(self):
        return self.last_alignment_ns

    @property
    def last_checkpoint_start_delay_ns(self):
        return self.last_start_delay_ns

    @property
    def bytes_processed_during_alignment(self):
        return self.bytes_during_alignment

    def queued(self, Py_ssize_t channel):
        return pe_rings_len(&self.rings, self.check_channel(channel))


cdef int dispatch(list notes) except -1:
    for fn, args in notes:
        fn(*args)
    return 0
include "_keycore.pxi"
include "_columnar.pxi"
include "_keygroups.pxi"
include "_ttl.pxi"
include "_timers.pxi"
include "_timersets.pxi"
include "_valuestate.pxi"
include "_statecalls.pxi"
