# Included by _native.pyx: the per-record calls of dict-backed keyed state.
#
# ``ValueState.value/update``, ``ListState.add`` and ``MapState.get/put/contains``
# run several times per record in a KeyedProcessFunction (issue #19's sessionizer
# makes five such calls per event). In Python each one is some forty bytecodes:
# an attribute walk to the backend's current key, the table's copy-on-write
# flags, a TTL stamp. Here the common case is one C path:
#
# * a current key is set, and
# * no TTL, or the common TTL (``StateTtlConfig``'s defaults: stamps written on
#   create and write, expired values never returned; the ``_Ttl*`` classes of
#   ``pyengine.state.heap`` switch it on with ``_use_fast_ttl``) with the step's
#   clock already read (``backend._ttl_now``) and int stamps, and
# * nothing to copy for an unfinished snapshot (the key group's dict not
#   shared; a value handed out that is atomic, or not tainted, or owned).
#
# Anything else (no key, an expired entry to remove, a value to copy first, the
# clock to read, another TTL configuration, a type check that fails) is handed,
# before any change, to the Python method the class defines for it
# (``_value_py``, ``_update_py``, ``_add_py``, ``_get_py``, ``_put_py``,
# ``_contains_py``), which holds the rules; ``tests/test_state_calls.py`` and the
# copy-on-write freeze tests run both paths against the same models.

from cpython.dict cimport PyDict_SetItem
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.set cimport PySet_Add, PySet_Contains


cdef extern from "Python.h":
    # A missing key is NULL without an error; an unhashable one raises, as ``d[k]`` does.
    PyObject* PyDict_GetItemWithError(object d, object key) except? NULL
    long long PyLong_AsLongLongAndOverflow(object v, int* overflow) except? -1
    Py_ssize_t _refcnt "Py_REFCNT"(PyObject* o)
    Py_ssize_t _size "Py_SIZE"(PyObject* o)
    PyTypeObject PyTuple_Type
    PyObject* _tuple_item "PyTuple_GET_ITEM"(PyObject* t, Py_ssize_t i)
    void _tuple_set "PyTuple_SET_ITEM"(PyObject* t, Py_ssize_t i, PyObject* v)


cdef extern from *:
    """
    /* A tuple rewritten in place (_restamp) is safe where the GIL makes a reference
       count of 1 mean no other holder, and tuples cache no hash: CPython before 3.14,
       not free-threaded. */
    #if PY_VERSION_HEX >= 0x030E0000 || defined(Py_GIL_DISABLED)
    #define PE_RESTAMP_IN_PLACE 0
    #else
    #define PE_RESTAMP_IN_PLACE 1
    #endif
    """
    bint PE_RESTAMP_IN_PLACE


# Stamps, clocks and TTLs within this bound are compared in C without overflow;
# others go to the Python paths.
cdef int64_t _TTL_BOUND = (<int64_t>1) << 62
cdef object _TYPED_LIST = _array_module.array  # a typed list state's elements (integers, float64), one buffer per key


cdef class StateTableBase:
    """The fields of ``pyengine.state.heap.StateTable`` (its methods are Python's),
    so the calls below read them without an attribute lookup."""
    cdef public object descriptor
    cdef public object groups  # list of dicts, one per key group
    cdef public object shared  # list of bools
    cdef public object tainted  # list of bools
    cdef public object owned  # list of sets
    cdef public object changes  # None, or a list of sets (incremental backend)
    cdef public Py_ssize_t active_snapshots
    cdef public bint pickled
    # copy-on-write by tail (``StateTable.track_tails``): None, or one dict per key group
    # (key -> its list's length at its first append since the last freeze), and one dict
    # (id(array) -> that length) for every array appended to in place since
    cdef public object tails
    cdef public object grown


cdef class _FastCheck:
    """A declared type's per-write check (``heap._validator``'s function ``fn``) as
    C can run it: the exact types it accepts, or an integer range within int64
    (the function carries them as ``pyengine_types`` / ``pyengine_int_range``).
    ``passes`` says 1 when the value passes, 0 when C cannot tell: the caller
    then runs the Python path, which calls ``fn`` (and raises its error)."""
    cdef object fn
    cdef tuple types
    cdef bint is_int
    cdef int64_t lo, hi
    cdef bint known

    def __init__(self, fn):
        self.fn = fn
        self.known = False
        types = getattr(fn, "pyengine_types", None)
        bounds = getattr(fn, "pyengine_int_range", None)
        if type(types) is tuple:
            self.types = types
            self.known = True
        elif type(bounds) is tuple and len(bounds) == 2:
            lo, hi = bounds
            if -(2**63) <= lo <= hi <= 2**63 - 1:
                self.lo, self.hi = lo, hi
                self.is_int = True
                self.known = True

    cdef inline int passes(self, object v) except -1:
        cdef int overflow = 0
        cdef long long x
        if not self.known:
            return 0
        if self.is_int:
            if type(v) is not int:
                return 0
            x = PyLong_AsLongLongAndOverflow(v, &overflow)
            return overflow == 0 and self.lo <= x <= self.hi
        t = type(v)
        for allowed in self.types:
            if t is allowed:
                return 1
        return 0


cdef inline bint _bounded(object v, int64_t* out) except -1:
    """An int within +-_TTL_BOUND into ``out`` (True), without a Python comparison."""
    cdef int overflow = 0
    cdef long long x = PyLong_AsLongLongAndOverflow(v, &overflow)
    if overflow != 0 or not -_TTL_BOUND < x < _TTL_BOUND:
        return False
    out[0] = x
    return True


cdef inline bint _atomic(object v):
    t = type(v)
    return t is int or t is float or t is str or t is bytes or t is bool or v is None


cdef inline PyObject* _restamp(object d, object k, object value, object stamp) except? NULL:
    """Writes ``(value, stamp)`` over the TTL entry ``d[k]`` in place, when the entry
    is a 2-tuple that only ``d`` holds (reference count 1: nothing else can see the
    change), and returns the old value, a reference the caller must release (after
    its own bookkeeping: freeing it may run a ``__del__``); NULL, without an error,
    when the entry is missing or not that (the caller then writes a new tuple).

    A TTL state writes a new (value, stamp) tuple per write otherwise: allocating it,
    then freeing the one it replaces and storing it in the dict again. ``k`` must be
    atomic (see ``_atomic``): its lookup runs no Python code. An entry the collector
    does not track (one of atomic values) gets only an atomic value."""
    cdef PyObject* e
    cdef PyObject* old
    cdef PyObject* old_stamp
    if not PE_RESTAMP_IN_PLACE:
        return NULL
    e = PyDict_GetItemWithError(d, k)
    if e is NULL or Py_TYPE(<object>e) is not &PyTuple_Type or _size(e) != 2 or _refcnt(e) != 1:
        return NULL
    if not _atomic(value) and not PyObject_GC_IsTracked(<object>e):
        return NULL
    old = _tuple_item(e, 0)
    old_stamp = _tuple_item(e, 1)
    Py_INCREF(value)
    _tuple_set(e, 0, <PyObject*>value)
    Py_INCREF(stamp)
    _tuple_set(e, 1, <PyObject*>stamp)
    Py_XDECREF(old_stamp)  # the entry is whole again before anything it frees could run
    return old


cdef inline bint _flag(object flags, Py_ssize_t i) except -1:
    """``flags[i]`` of one of the table's lists of flags (checked by ``_group``), as ``if`` reads it."""
    return bool(<object>PyList_GET_ITEM(flags, i))


cdef inline int _private(object table_obj, Py_ssize_t index, object key) except -2:
    """Whether the value stored under ``key`` in key group ``index`` may be handed out
    or changed in place: 1 when no unfinished snapshot can hold it (the group is not
    tainted, or the key is owned), 0 when it must be copied first, -1 when the table
    is not as ``_group`` checks it (user code ran since, say). Reads the table afresh,
    and holds the owned set while the lookup runs."""
    if _group(table_obj, index) is None:
        return -1
    cdef StateTableBase table = <StateTableBase>table_obj
    if not _flag(table.tainted, index):
        return 1
    owned = <object>PyList_GET_ITEM(table.owned, index)  # a reference of ours during the lookup
    return 1 if PySet_Contains(owned, key) else 0


cdef inline int _grow(StateTableBase table, Py_ssize_t index, object key, object stored) except -1:
    """``StateTable.grow`` in C, for the key's array.array that ``_private`` found frozen
    by an unfinished snapshot (or not yet recorded since the last freeze): 1 when the
    table has copy-on-write by tail, its length recorded and the key owned (the caller
    then appends in place); 0 when not (the Python path copies)."""
    tails = table.tails
    grown = table.grown
    if tails is None or type(tails) is not list or type(grown) is not dict:
        return 0
    if not 0 <= index < PyList_GET_SIZE(tails) or type(<object>PyList_GET_ITEM(tails, index)) is not dict:
        return 0
    n = len(stored)
    if table.active_snapshots > 0:  # only a snapshot frozen before now reads it
        (<dict>grown)[id(stored)] = n
    if table.changes is not None:
        (<dict>PyList_GET_ITEM(tails, index))[key] = n
    PySet_Add(<object>PyList_GET_ITEM(table.owned, index), key)
    return 1


cdef inline object _handed_out(StateTableBase table, Py_ssize_t index, object key, object value):
    """``value``, the state's own mutable object, about to be handed to user code,
    which may change it in place without a write: for an incremental backend the key
    is then changed (in its next delta), or a restore would bring back the old value
    while the running job went on with the new one."""
    changes = table.changes
    if changes is not None:
        if type(changes) is not list or not 0 <= index < PyList_GET_SIZE(changes):
            raise RuntimeError(f"state table changes are {type(changes).__name__}, not one set per key group")
        PySet_Add(<object>PyList_GET_ITEM(changes, index), key)
    return value


cdef inline object _group(object table_obj, Py_ssize_t index):
    """Key group ``index``'s dict of a dict-backed table, or None when the table is
    not one, or its lists are not as ``StateTable`` makes them (the Python path then)."""
    if not isinstance(table_obj, StateTableBase):
        return None
    cdef StateTableBase table = <StateTableBase>table_obj
    if (
        type(table.groups) is not list
        or type(table.shared) is not list
        or type(table.tainted) is not list
        or type(table.owned) is not list
        or index >= PyList_GET_SIZE(table.groups)
        or index >= PyList_GET_SIZE(table.shared)
        or index >= PyList_GET_SIZE(table.tainted)
        or index >= PyList_GET_SIZE(table.owned)
    ):
        return None
    group = <object>PyList_GET_ITEM(table.groups, index)
    if type(group) is not dict or type(<object>PyList_GET_ITEM(table.owned, index)) is not set:
        return None
    return group


cdef class StateCalls:
    """The fields of every dict-backed state object (``_KeyedState``'s), and the
    current key as the C calls read it."""
    cdef public object _backend
    cdef public object _table
    cdef public object _ttl
    cdef public object _check
    cdef public object _ttl_ms  # the fast TTL classes' time to live (ms), for their Python paths
    cdef bint _fast_ttl
    cdef int64_t _ttl_ms_c
    cdef _FastCheck _vcheck  # _check, as C runs it

    cdef inline int _value_passes(self, object v) except -1:
        """1: ``v`` passes this state's declared type (or it has none); 0: the Python path decides."""
        fn = self._check
        if fn is None:
            return 1
        if self._vcheck is None or self._vcheck.fn is not fn:
            self._vcheck = _FastCheck(fn)
        return self._vcheck.passes(v)

    def _use_fast_ttl(self, ttl_ms):
        """The common TTL configuration: this state's C calls stamp and check with ``ttl_ms``."""
        self._ttl_ms = ttl_ms
        self._fast_ttl = False  # an unusual TTL (not an int, out of bounds): the Python paths only
        if type(ttl_ms) is int and 0 <= ttl_ms < _TTL_BOUND:
            self._ttl_ms_c = ttl_ms
            self._fast_ttl = True

    cdef inline bint _plain(self):
        """No TTL, or the fast one: the C paths apply."""
        return self._ttl is None or self._fast_ttl

    cdef inline object _now(self, int64_t* now):
        """The step's TTL clock (``backend._ttl_now``), also into ``now``; None when it
        is not read yet or not an int64 (the Python path then). The stamp written is
        this very object: no new int per write."""
        n = self._backend._ttl_now
        if type(n) is not int or not _bounded(n, now):
            return None
        return n

    cdef inline bint _live(self, object entry) except -1:
        """Whether ``entry`` is a (value, stamp) tuple still live at the step's clock;
        False for anything else (expired, no clock read yet, not an int64 stamp): the
        Python path then decides, and removes what expired."""
        cdef int64_t now
        if self._now(&now) is None or type(entry) is not tuple or len(<tuple>entry) != 2:
            return False
        return self._expired((<tuple>entry)[1], now) == 0

    cdef inline int _expired(self, object stamp, int64_t now) except -1:
        """1 expired, 0 live, -1 not an int64 stamp (the Python path decides)."""
        cdef int64_t s
        if type(stamp) is not int or not _bounded(stamp, &s):
            return -1
        if now - s >= self._ttl_ms_c:
            return 1
        return 0


cdef class ValueCalls(StateCalls):
    """The C half of ``ValueState``: see the module comment above."""
    cdef public object _default

    def value(self):
        """The current key's value, or the descriptor's default when it has none."""
        cdef Py_ssize_t index
        cdef PyObject* p
        if self._plain():
            b = self._backend
            index = b._key_index
            if index >= 0:
                group = _group(self._table, index)
                if group is not None:
                    table = <StateTableBase>self._table
                    key = b._key
                    p = PyDict_GetItemWithError(group, key)
                    if p is NULL:
                        if _atomic(self._default):
                            return self._default
                        return self._value_py()  # a copy of a mutable default
                    stored = <object>p
                    if self._ttl is not None:
                        if not self._live(stored):
                            return self._value_py()  # removes an expired one
                        stored = (<tuple>stored)[0]
                    if _atomic(stored):
                        return stored
                    if _private(table, index, key) == 1:
                        return _handed_out(table, index, key, stored)
        return self._value_py()

    def update(self, value):
        """Sets the current key's value; ``None`` clears it, as in Flink."""
        cdef Py_ssize_t index
        cdef int64_t now
        cdef PyObject* replaced
        if value is not None and self._plain() and self._value_passes(value):
            b = self._backend
            index = b._key_index
            if index >= 0:
                group = _group(self._table, index)
                if group is not None:
                    table = <StateTableBase>self._table
                    if not _flag(table.shared, index):
                        key = b._key
                        replaced = NULL
                        if self._ttl is not None:
                            stamp = self._now(&now)
                            if stamp is None:
                                self._update_py(value)
                                return
                            if _atomic(key):
                                replaced = _restamp(group, key, value, stamp)
                            if replaced is NULL:
                                value = (value, stamp)
                        # Taken before the write, which frees the old value (its __del__ may run).
                        owned = <object>PyList_GET_ITEM(table.owned, index) if _flag(table.tainted, index) else None
                        changed = table.changes[index] if table.changes is not None else None
                        if replaced is not NULL:
                            try:
                                if owned is not None:
                                    PySet_Add(owned, key)
                                if changed is not None:
                                    PySet_Add(changed, key)
                            finally:
                                Py_XDECREF(replaced)
                            return
                        PyDict_SetItem(group, key, value)
                        if owned is not None:
                            PySet_Add(owned, key)
                        if changed is not None:
                            PySet_Add(changed, key)
                        return
        self._update_py(value)


cdef class ListCalls(StateCalls):
    """The C half of ``ListState``: see the module comment above."""
    cdef public bint _atomic
    cdef public object _typecode  # an array.array typecode: the elements are stored in one (see ListState)

    def add(self, value):
        """Appends ``value`` to the current key's list."""
        cdef Py_ssize_t index
        cdef int private
        cdef int64_t now
        cdef PyObject* p
        if value is not None and self._plain() and self._value_passes(value):
            b = self._backend
            index = b._key_index
            if index >= 0:
                group = _group(self._table, index)
                if group is not None:
                    table = <StateTableBase>self._table
                    key = b._key
                    p = PyDict_GetItemWithError(group, key)
                    stored = <object>p if p is not NULL else None  # a reference of ours from here on
                    if type(stored) is list and _private(table, index, key) == 1:
                        if self._ttl is not None:
                            stamp = self._now(&now)
                            if stamp is None:
                                self._add_py(value)
                                return
                            value = (value, stamp)
                        (<list>stored).append(value)
                        if table.changes is not None:
                            PySet_Add(table.changes[index], key)
                        return
                    if type(stored) is _TYPED_LIST and self._ttl is None:
                        private = _private(table, index, key)
                        if private == 0:
                            private = _grow(table, index, key, stored)  # copy-on-write by tail
                        if private == 1:
                            stored.append(value)  # a typed list's own buffer (or its tail): the element checked above
                            if table.changes is not None:
                                PySet_Add(table.changes[index], key)
                            return
                    if type(stored) is StampedList and self._ttl is not None and _private(table, index, key) == 1:
                        stamp = self._now(&now)
                        if stamp is not None:
                            (<StampedList>stored).values.append(value)
                            (<StampedList>stored).stamps.append(stamp)
                            if table.changes is not None:
                                PySet_Add(table.changes[index], key)
                            return
        self._add_py(value)


cdef class MapCalls(StateCalls):
    """The C half of ``MapState``: see the module comment above."""
    cdef public bint _atomic
    cdef public object _check_key
    cdef _FastCheck _kcheck  # _check_key, as C runs it

    cdef inline int _key_passes(self, object k) except -1:
        fn = self._check_key
        if fn is None:
            return 1
        if self._kcheck is None or self._kcheck.fn is not fn:
            self._kcheck = _FastCheck(fn)
        return self._kcheck.passes(k)

    cdef inline object _map(self, Py_ssize_t* index_out, object key):
        """The stored dict of ``key`` (the current key, read by the caller before any
        user code can run); None: not found in C (no key, no map, not a dict-backed
        table); ``index_out`` -1 when the C paths do not apply."""
        cdef Py_ssize_t index
        cdef PyObject* p
        index_out[0] = -1
        if not self._plain():
            return None
        index = self._backend._key_index
        if index < 0:
            return None
        group = _group(self._table, index)
        if group is None:
            return None
        p = PyDict_GetItemWithError(group, key)
        index_out[0] = index
        if p is NULL:
            return None
        if type(<object>p) is not dict:
            index_out[0] = -1
            return None
        return <object>p

    def get(self, user_key):
        """The value under ``user_key`` for the current key, or None."""
        cdef Py_ssize_t index
        cdef PyObject* p
        key = self._backend._key
        stored = self._map(&index, key)
        if index >= 0:
            if stored is None:
                return None
            p = PyDict_GetItemWithError(stored, user_key)  # may run the user key's __eq__
            if p is NULL:
                return None
            entry = <object>p
            if self._ttl is not None:
                if not self._live(entry):
                    return self._get_py(user_key)  # removes an expired one
                entry = (<tuple>entry)[0]
            if _atomic(entry):
                return entry
            if _private(self._table, index, key) == 1:
                return _handed_out(<StateTableBase>self._table, index, key, entry)
        return self._get_py(user_key)

    def contains(self, user_key):
        """Whether the current key's map has a (live) entry under ``user_key``."""
        cdef Py_ssize_t index
        cdef PyObject* p
        stored = self._map(&index, self._backend._key)
        if index >= 0:
            if stored is None:
                return False
            p = PyDict_GetItemWithError(stored, user_key)
            if p is NULL:
                return False
            if self._ttl is None:
                return True
            if self._live(<object>p):
                return True
        return self._contains_py(user_key)

    def put(self, user_key, value):
        """Sets the value under ``user_key`` for the current key."""
        cdef Py_ssize_t index
        cdef int64_t now
        cdef StateTableBase table
        cdef PyObject* replaced
        if self._key_passes(user_key) and (value is None or self._value_passes(value)):
            key = self._backend._key
            stored = self._map(&index, key)
            if stored is not None and _private(self._table, index, key) == 1:  # the table checked
                table = <StateTableBase>self._table
                if self._ttl is not None:
                    stamp = self._now(&now)
                    if stamp is None:
                        self._put_py(user_key, value)
                        return
                    if _atomic(user_key):
                        replaced = _restamp(stored, user_key, value, stamp)
                        if replaced is not NULL:
                            try:
                                if table.changes is not None:
                                    PySet_Add(table.changes[index], key)
                            finally:
                                Py_XDECREF(replaced)
                            return
                    value = (value, stamp)
                if table.changes is not None:
                    PySet_Add(table.changes[index], key)
                PyDict_SetItem(stored, user_key, value)  # may run the user key's __eq__: nothing after it
                return
        self._put_py(user_key, value)
