# Included by _native.pyx: the current key's fields, read and written from C.
#
# The keyed backend's current key (``_key``; ``_key_index``, its key group's index in
# the backend's range, -1 for none) is read by every keyed state call and timer
# registration and written for every record and every firing timer; a
# ``KeyedContext``'s ``current_key`` and ``_timer_ts`` for every firing timer. As
# instance attributes, each access from C was a generic attribute lookup (~20-30 ns:
# the type's dict for descriptors, then the instance's). They are ``__slots__`` of a
# Python base class instead (``state.heap._CurrentKey``, ``runtime.operators.
# _KeyedContextFields``): Python code reads them as fast as before (3.11 specialises
# slot access), and C reads and writes them at their offsets in the object, taken
# from the slots' member descriptors when the classes are bound here.

cdef extern from "structmember.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    enum:
        T_OBJECT_EX

cdef extern from "Python.h":
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member


cdef Py_ssize_t _slot_offset(type cls, str name) except -1:
    """Where ``cls``'s ``__slots__`` field ``name`` lives in an instance."""
    d = cls.__dict__.get(name)
    if type(d).__name__ != "member_descriptor" or (<PyMemberDescrObject*>d).d_member.type != T_OBJECT_EX:
        raise TypeError(f"{cls.__name__}.{name} must be a __slots__ field of {cls.__name__}")
    return (<PyMemberDescrObject*>d).d_member.offset


cdef inline object _slot(object o, Py_ssize_t offset):
    cdef PyObject* p = (<PyObject**>((<char*><PyObject*>o) + offset))[0]
    if p is NULL:
        return None
    return <object>p


cdef inline void _set_slot(object o, Py_ssize_t offset, object value) noexcept:
    cdef PyObject** at = <PyObject**>((<char*><PyObject*>o) + offset)
    cdef PyObject* old = at[0]
    Py_INCREF(value)
    at[0] = <PyObject*>value
    Py_XDECREF(old)


cdef object _BACKEND_TYPE = None  # the class whose slots _key and _key_index are at:
cdef Py_ssize_t _KEY_AT = 0
cdef Py_ssize_t _INDEX_AT = 0
cdef object _CONTEXT_TYPE = None  # the class whose slots current_key and _timer_ts are at:
cdef Py_ssize_t _CTX_KEY_AT = 0
cdef Py_ssize_t _CTX_TS_AT = 0


def bind_backend_fields(type cls):
    """Binds the keyed backends' base class: ``_key`` and ``_key_index`` are its
    ``__slots__``, read and written here at their offsets (see _keycore.pxi)."""
    global _BACKEND_TYPE, _KEY_AT, _INDEX_AT
    _KEY_AT = _slot_offset(cls, "_key")
    _INDEX_AT = _slot_offset(cls, "_key_index")
    _BACKEND_TYPE = cls


def bind_context_fields(type cls):
    """Binds ``KeyedContext``'s base class: ``current_key`` and ``_timer_ts`` are its
    ``__slots__``, written here at their offsets as timers fire."""
    global _CONTEXT_TYPE, _CTX_KEY_AT, _CTX_TS_AT
    _CTX_KEY_AT = _slot_offset(cls, "current_key")
    _CTX_TS_AT = _slot_offset(cls, "_timer_ts")
    _CONTEXT_TYPE = cls


cdef int check_backend(object backend) except -1:
    """What a native state call or timer heap keeps: a bound backend class's instance."""
    if _BACKEND_TYPE is None or not isinstance(backend, _BACKEND_TYPE):
        raise TypeError(
            f"a keyed backend must be a {getattr(_BACKEND_TYPE, '__qualname__', 'bound backend class')}, "
            f"got {type(backend).__name__}"
        )
    return 0


cdef inline object backend_key(object backend):
    """The current key (``backend`` passed check_backend)."""
    return _slot(backend, _KEY_AT)


cdef inline Py_ssize_t backend_index(object backend) except? -2:
    """The current key's group index, -1 for none (``backend`` passed check_backend)."""
    return _slot(backend, _INDEX_AT)


cdef inline void set_backend_key(object backend, object key, object index) noexcept:
    _set_slot(backend, _KEY_AT, key)
    _set_slot(backend, _INDEX_AT, index)


cdef inline bint is_bound_context(object ctx) noexcept:
    return _CONTEXT_TYPE is not None and isinstance(ctx, _CONTEXT_TYPE)


cdef inline void set_context_timer(object ctx, object key, object ts) noexcept:
    """``ctx.current_key`` and ``ctx._timer_ts`` (``ctx`` passed is_bound_context)."""
    _set_slot(ctx, _CTX_KEY_AT, key)
    _set_slot(ctx, _CTX_TS_AT, ts)
