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
# slot access), and C reads and writes them at their offsets in the object.
#
# The offsets come from the member descriptors that the object's own type (its C type,
# not ``__class__``, which a mock may fake) resolves the names to, so a subclass that
# shadows a field with a property, or any other class, is never written at a wrong
# place: it is refused (a backend) or gets ordinary attribute writes (a context).

cdef extern from "structmember.h":
    ctypedef struct PyMemberDef:
        int type
        Py_ssize_t offset
    enum:
        T_OBJECT_EX

cdef extern from "Python.h":
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    PyTypeObject* PyDescr_TYPE(object descr)
    int PyType_IsSubtype(PyTypeObject* a, PyTypeObject* b)

cdef object _MEMBER_DESCRIPTOR = type(type.__dict__["__dictoffset__"])  # what __slots__ make


cdef Py_ssize_t slot_offset(object o, str name) except -2:
    """Where the ``__slots__`` field ``name`` lives in ``o``, as ``o``'s type resolves
    the name; -1 when that is not an object slot of a class ``o`` really is."""
    cls = type(o)
    d = getattr(cls, name, None)
    if type(d) is not _MEMBER_DESCRIPTOR:
        return -1
    if (<PyMemberDescrObject*>d).d_member.type != T_OBJECT_EX:
        return -1
    if not PyType_IsSubtype(<PyTypeObject*>cls, PyDescr_TYPE(d)):
        return -1
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


cdef class KeyFields:
    """Where a keyed backend keeps its current key: the offsets of its ``_key`` and
    ``_key_index`` slots, checked once (the backend's type does not change)."""
    cdef object backend
    cdef Py_ssize_t key_at
    cdef Py_ssize_t index_at

    def __cinit__(self, backend):
        self.key_at = slot_offset(backend, "_key")
        self.index_at = slot_offset(backend, "_key_index")
        if self.key_at < 0 or self.index_at < 0:
            raise TypeError(
                f"a keyed backend's _key and _key_index must be the __slots__ of "
                f"pyengine.state.heap._CurrentKey; {type(backend).__qualname__!r} has no such slots"
            )
        self.backend = backend

    cdef inline object key(self):
        return _slot(self.backend, self.key_at)

    cdef inline Py_ssize_t index(self) except? -2:
        """The current key's group index, -1 for none."""
        return _slot(self.backend, self.index_at)

    cdef inline void set(self, object key, object index) noexcept:
        _set_slot(self.backend, self.key_at, key)
        _set_slot(self.backend, self.index_at, index)


cdef struct TimerContextFields:
    Py_ssize_t key_at  # -1: ordinary attribute writes
    Py_ssize_t ts_at


cdef inline TimerContextFields timer_context_fields(object ctx) except *:
    """Where ``ctx`` keeps ``current_key`` and ``_timer_ts`` (-1: not as slots)."""
    cdef TimerContextFields f
    f.key_at = slot_offset(ctx, "current_key")
    f.ts_at = slot_offset(ctx, "_timer_ts")
    if f.ts_at < 0:
        f.key_at = -1
    return f


cdef type _service_cls = None  # the last context type timer_service() found _service in
cdef Py_ssize_t _service_at = -1


@cython.auto_pickle(False)  # no C fields: copy and pickle take the subclass's slots as for any object
cdef class KeyedContextCalls:
    """``runtime.operators.KeyedContext``'s ``timer_service()``, as a method of a C
    type: a job that sets a timer per record calls it per record. Python 3.11
    specialises the lookup of a method its type has (``LOAD_METHOD_WITH_DICT``) and
    the call runs no Python frame; an instance attribute that shadows a method (as
    before) is looked up generically, a Python method costs a frame.
    The service is read from the context's ``_service`` slot; until there is one, the
    operator makes it (``ctx._op.timer_service()``)."""

    def timer_service(self):
        """Register and delete the current key's timers; read the clocks."""
        global _service_cls, _service_at
        cdef object service
        cdef Py_ssize_t at
        if type(self) is not _service_cls:
            at = slot_offset(self, "_service")  # may run Python code: both globals set after it
            _service_at = at
            _service_cls = type(self)
        else:
            at = _service_at
        service = _slot(self, at) if at >= 0 else getattr(self, "_service", None)
        if service is not None:
            return service
        return self._op.timer_service()


cdef inline int set_timer_context(object ctx, TimerContextFields* f, object key, object ts) except -1:
    """``ctx.current_key = key; ctx._timer_ts = ts``, in place where they are slots."""
    if f.key_at >= 0:
        _set_slot(ctx, f.key_at, key)
        _set_slot(ctx, f.ts_at, ts)
    else:
        ctx.current_key = key
        ctx._timer_ts = ts
    return 0
