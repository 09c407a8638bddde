# Included by _native.pyx (after _keygroups.pxi, whose cimport of
# PyLong_AsLongLongAndOverflow it uses): the live values of a TTL list state.
#
# With a TTL a list state stores (value, stamp) tuples, so reading the list is a pass
# that unwraps every element and leaves out the expired ones. In Python that pass
# costs ~25 ns an element (map over an itemgetter, or a comprehension): 0.25 ms for a
# list of 10,000, 13x a plain list's copy. Here it is a C loop over the tuples with the
# stamps compared as C integers; anything else (a stamp or limit beyond int64, a float
# from a custom clock) is compared by Python, with the same result.


def ttl_values(stored, Py_ssize_t n, limit):
    """The values of the (value, stamp) entries in ``stored[:n]`` whose stamp is above
    ``limit`` (not yet expired), in order, as a new list. ``stored`` is a list (any
    other sequence is copied into one first)."""
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
