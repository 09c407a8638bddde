# Included by _native.pyx: the key group of an int key, the per-record hot case of
# pyengine.state.keygroups.assign_to_key_group (same result: murmur3's fmix64 of the
# key's 64-bit two's complement, modulo max_parallelism).

from cpython.long cimport PyLong_AsLongLongAndOverflow


cdef inline uint64_t fmix64(uint64_t x) nogil:
    x ^= x >> 33
    x *= <uint64_t>0xFF51AFD7ED558CCD
    x ^= x >> 33
    x *= <uint64_t>0xC4CEB9FE1A85EC53
    x ^= x >> 33
    return x


def int_key_group(object key, Py_ssize_t max_parallelism):
    """The key group of an int (or bool) key within int64, or -1 for anything else
    (the caller then takes the general path)."""
    cdef int overflow = 0
    cdef long long v
    if (type(key) is not int and type(key) is not bool) or max_parallelism < 1:
        return -1
    v = PyLong_AsLongLongAndOverflow(key, &overflow)
    if overflow:
        return -1
    return <Py_ssize_t>(fmix64(<uint64_t>v) % <uint64_t>max_parallelism)
