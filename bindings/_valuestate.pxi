# Included by _native.pyx: the per-record calls of a typed (columnar) value state.
#
# ``value()``, ``update()`` and ``clear()`` run once per record or more in a
# KeyedProcessFunction. In Python each paid an attribute walk, an int64 range test
# and a call into ColumnarGroup; here the common case (an int key within int64, a
# current key set, columnar storage) is one C path, and everything else (no current
# key, other keys, state that left columnar storage) goes to the Python subclass,
# ``pyengine.state.columnar.ColumnarValueState``, whose ``_value_slow`` /
# ``_update_slow`` / ``_clear_slow`` hold the rules.


cdef class ColumnarValueCalls:
    """The C half of ``ColumnarValueState``: see the module comment above."""
    cdef KeyFields _ccurrent  # the backend's current key, read in place (see _keycore.pxi)
    cdef list _cgroups  # the table's ColumnarGroup per key group (a fixed list)
    cdef object _cdefault
    cdef object _ccheck  # the descriptor type's per-write check, or None
    cdef bint _int64  # values are int64 and the check is int64's range: skipped for an int that fits
    cdef public object _fallback  # the dict-backed state once a key left int64 (Python sets it)

    def __init__(self, backend, groups, default, check, bint int64_checked):
        self._ccurrent = KeyFields(backend)
        self._cgroups = groups
        self._cdefault = default
        self._ccheck = check
        self._int64 = int64_checked
        self._fallback = None

    cdef inline ColumnarGroup _current(self, int64_t* k):
        """The current key's group, ``k`` set to the key; None when not the common case."""
        cdef KeyFields current = self._ccurrent
        if current is None:  # never initialised: the Python path says so
            return None
        key = current.key()
        if type(key) is not int:
            return None
        cdef Py_ssize_t i = current.index()
        if i < 0:
            return None
        try:
            k[0] = key
        except OverflowError:
            return None
        return <ColumnarGroup>self._cgroups[i]

    def value(self):
        cdef int64_t k
        cdef ColumnarGroup g
        if self._fallback is None:
            g = self._current(&k)
            if g is not None:
                return g.get(k, self._cdefault)
        return self._value_slow()

    def update(self, value):
        cdef int64_t k
        cdef int64_t probe
        cdef ColumnarGroup g
        if value is None:
            self.clear()
            return
        if self._fallback is None:
            g = self._current(&k)
            if g is not None:
                if self._ccheck is not None:
                    if not (self._int64 and type(value) is int):
                        self._ccheck(value)
                    else:
                        try:
                            probe = value
                        except OverflowError:
                            self._ccheck(value)  # raises the check's TypeError
                g.put(k, value)
                return
        self._update_slow(value)

    def clear(self):
        cdef int64_t k
        cdef ColumnarGroup g
        if self._fallback is None:
            g = self._current(&k)
            if g is not None:
                g.remove(k)
                return
        self._clear_slow()
