# Included by _native.pyx (after _keygroups.pxi, whose cimport of
# PyLong_AsLongLongAndOverflow it uses): the live values of a TTL list state.
#
# With a TTL a list state stores its elements with their stamps: as a StampedList
# (values and stamps in parallel lists, what the state writes) or, restored from a
# checkpoint or copied, as (value, stamp) tuples. Reading the list is a pass that
# checks the stamps and leaves out the expired elements (for a StampedList whose
# elements are all live, a slice of its values). In Python that pass
# costs ~25 ns an element (map over an itemgetter, or a comprehension): 0.25 ms for a
# list of 10,000, 13x a plain list's copy. Here it is a C loop over the tuples with the
# stamps compared as C integers; anything else (a stamp or limit beyond int64, a float
# from a custom clock) is compared by Python, with the same result.


cdef class StampedList:
    """A TTL list state's elements and their stamps, in two parallel lists.

    Stored as ``(value, stamp)`` tuples, a list pays for a tuple per element: one
    allocated by every ``add``, kept (an object the collector walks), unwrapped by
    every ``get`` and freed, cold, when the list is cleared: about a fifth of a
    microsecond per element of the sessionizer's amounts (issue #19). Here ``add``
    appends to ``values`` and ``stamps`` (the step's clock object, shared by all the
    step's writes) and ``get`` copies ``values`` after checking ``stamps``.

    To everything else it is the sequence of ``(value, stamp)`` tuples it stands
    for (indexing, slicing, iteration, ``append``/``extend`` of tuples, equality
    with a list of them), so the rare paths (cleanup, copy-on-write, other TTL
    settings) read it as they read a list of tuples; pickled, it becomes that list,
    which is also what a snapshot writes (the file format does not change)."""

    cdef readonly list values  # never rebound: C code reads both without bounds checks
    cdef readonly list stamps

    def __init__(self, entries=()):
        self.values = []
        self.stamps = []
        self.extend(entries)

    def __len__(self):
        return len(self.values)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(zip(self.values[i], self.stamps[i]))
        return (self.values[i], self.stamps[i])

    def __iter__(self):
        return zip(self.values, self.stamps)

    def append(self, entry):
        value, stamp = entry
        self.values.append(value)
        self.stamps.append(stamp)

    def extend(self, entries):
        for value, stamp in list(entries):
            self.values.append(value)
            self.stamps.append(stamp)

    def __eq__(self, other):
        if isinstance(other, (list, StampedList)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None

    def __reduce__(self):
        return (list, (list(self),))

    def __repr__(self):
        return f"StampedList({list(self)!r})"


cdef list _stamped_values(StampedList stored, Py_ssize_t n, object limit):
    """``ttl_values`` of a StampedList: its values when no stamp of the first ``n``
    is at or below ``limit`` (a slice: one C copy), else the live ones."""
    cdef list values = stored.values
    cdef list stamps = stored.stamps
    cdef Py_ssize_t i
    cdef Py_ssize_t end = min(n, len(values), len(stamps))
    cdef int overflow = 0
    cdef long long lim = 0
    cdef long long st
    cdef object stamp
    cdef object last = None
    if type(limit) is not int:
        return None
    lim = PyLong_AsLongLongAndOverflow(limit, &overflow)
    if overflow:
        return None
    for i in range(end):  # stamps repeat (one object per step): compare each object once
        stamp = <object>PyList_GET_ITEM(stamps, i)
        if stamp is last:
            continue
        if type(stamp) is not int:
            return None
        st = PyLong_AsLongLongAndOverflow(stamp, &overflow)
        if overflow:
            return None
        if st <= lim:  # copies first: a later stamp's __gt__ (any object) cannot shorten what is read
            return [v for v, s in zip(values[:end], stamps[:end]) if s > limit]
        last = stamp
    return values[:end]


def ttl_values(stored, Py_ssize_t n, limit):
    """The values of the (value, stamp) entries in ``stored[:n]`` whose stamp is above
    ``limit`` (not yet expired), in order, as a new list. ``stored`` is a list (any
    other sequence is copied into one first)."""
    if type(stored) is StampedList:
        fast = _stamped_values(<StampedList>stored, n, limit)
        if fast is not None:
            return fast
    cdef list entries = stored if type(stored) is list else list(stored)
    cdef Py_ssize_t i
    cdef Py_ssize_t end = min(n, len(entries))
    cdef list out = []
    cdef int overflow = 0
    cdef long long lim = 0
    cdef long long st
    cdef bint c_limit = False
    cdef tuple e
    if type(limit) is int:
        lim = PyLong_AsLongLongAndOverflow(limit, &overflow)
        c_limit = not overflow
    for i in range(end):
        if i >= len(entries):  # a custom stamp's __gt__ (Python code) may have shortened it
            break
        e = <tuple?>entries[i]
        if len(e) != 2:  # the module runs without bounds checks: e[1] must exist
            raise TypeError(f"a TTL list element is a (value, stamp) tuple, got {e!r}")
        stamp = e[1]
        if c_limit and type(stamp) is int:
            st = PyLong_AsLongLongAndOverflow(stamp, &overflow)
            if not overflow:
                if st > lim:
                    out.append(e[0])
                continue
        if stamp > limit:
            out.append(e[0])
    return out


cdef class ListViewBase:
    """The fields of ``pyengine.state.heap.ListView`` (its methods are Python's): a
    view is made by every ``ListState.get()``, and made here it costs a C allocation
    instead of a Python ``__init__`` setting four slots (about half of the call)."""

    cdef public object _list  # the state's list (never changed in place but by appends), or the view's own copy
    cdef public Py_ssize_t _n  # the elements of the view: _list[:_n]; -1 once the view owns _list
    cdef public object _ttl  # > 0: elements are (value, stamp), those expired at _now left out
    cdef public object _now

    def __init__(self, stored, Py_ssize_t n, ttl_ms=0, now=0):
        self._list = stored
        self._n = n
        self._ttl = ttl_ms
        self._now = now
