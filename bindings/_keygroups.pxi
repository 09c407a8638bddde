# Included by _native.pyx: the key group of an int key, the per-record hot case of
# pyengine.state.keygroups.assign_to_key_group (same result: murmur3's fmix64 of the
# key's 64-bit two's complement, modulo max_parallelism).

from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow


cdef inline uint64_t fmix64(uint64_t x) nogil:
    x ^= x >> 33
    x *= <uint64_t>0xFF51AFD7ED558CCD
    x ^= x >> 33
    x *= <uint64_t>0xC4CEB9FE1A85EC53
    x ^= x >> 33
    return x


cdef inline Py_ssize_t _int_group(object key, Py_ssize_t max_parallelism) except -2:
    """``int_key_group``'s answer, for C callers: -1 when the key is not an int (or
    bool) within int64."""
    cdef int overflow = 0
    cdef long long v
    if type(key) is not int and type(key) is not bool:
        return -1
    v = PyLong_AsLongLongAndOverflow(key, &overflow)
    if overflow:
        return -1
    return <Py_ssize_t>(fmix64(<uint64_t>v) % <uint64_t>max_parallelism)


def int_key_group(object key, Py_ssize_t max_parallelism):
    """The key group of an int (or bool) key within int64, or -1 for anything else
    (the caller then takes the general path)."""
    if max_parallelism < 1:
        return -1
    return _int_group(key, max_parallelism)


def route_int_keys(list records, object get_key, Py_ssize_t max_parallelism, list buffers):
    """A hash exchange's routing of a buffer of Python records, in C, while their keys
    are ints: each record is appended to ``buffers[subtask]``, the subtask of its
    key's group (Flink's ``key_group * parallelism // max_parallelism``), the key
    read by ``get_key`` (a ``key_by(field)``'s ``operator.itemgetter``). Returns how
    many records it routed: at the first key that is not an int (or that ``get_key``
    cannot read) it stops, and the caller routes the rest its general way, which also
    raises the right error for a record without the key. The same subtasks as the
    per-record path: the key group is ``int_key_group``'s own (``_int_group``)."""
    cdef Py_ssize_t i, n = len(records), channels = len(buffers)
    cdef Py_ssize_t group
    cdef object key, record
    if max_parallelism < 1 or channels < 1:
        return 0
    for i in range(n):
        if i >= PyList_GET_SIZE(records):  # a key read that changed the buffer (a record's __getitem__)
            return i
        record = <object>PyList_GET_ITEM(records, i)
        try:
            key = get_key(record)
        except Exception:
            return i
        group = _int_group(key, max_parallelism)
        if group < 0:
            return i
        (<list>PyList_GET_ITEM(buffers, group * channels // max_parallelism)).append(record)
    return n
