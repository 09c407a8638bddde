# Included by _native.pyx: typed keyed state stored in columns.
#
# One ColumnarGroup per key group and state: an int64 -> position map (C) over
# dense NumPy arrays of keys and values, entries 0..n-1, deletion by moving the
# last entry into the hole. A snapshot takes keys[:n] and values[:n] as they are
# (zero-copy into Arrow); after a freeze, the first write copies the two arrays,
# so what the snapshot holds never changes.
#
# With change tracking on (the incremental backend), a group also records which
# positions were written since the last take_changes() (a byte per position plus
# the list of marked positions) and which keys were removed: a delta is then
# gathered by position, with no hash lookup and no Python int per changed key.

cimport numpy as cnp
from libc.string cimport memcpy
import numpy as np

cnp.import_array()

cdef enum:  # ColumnarGroup.kind: dtypes whose values are read and written through raw pointers
    GROUP_OTHER = 0
    GROUP_INT64 = 1
    GROUP_FLOAT64 = 2


cdef class ColumnarGroup:
    cdef pe_i64map index
    cdef int kind
    cdef bint index_ready
    cdef object keys
    cdef object values
    cdef Py_ssize_t n
    cdef public bint shared
    cdef bint tracking
    cdef cnp.uint8_t[::1] dirty  # per position (capacity of keys): written since the last take
    cdef cnp.int64_t[::1] dirty_pos  # the positions marked in dirty, in marking order
    cdef Py_ssize_t ndirty
    cdef set removed  # keys removed since the last take

    def __cinit__(self, dtype, Py_ssize_t capacity=8):
        if capacity < 8:
            capacity = 8
        if pe_i64map_init(&self.index, <uint32_t>capacity, &PY_ALLOC) != PE_OK:
            raise MemoryError()
        self.index_ready = True
        self.keys = np.empty(capacity, np.int64)
        self.values = np.empty(capacity, dtype)
        # A value state's get and put run once per record: for the two common dtypes
        # they read and write the array's memory, where NumPy's item() and item
        # assignment cost a Python call and a scalar conversion each (~60-90 ns).
        if self.values.dtype == np.int64:
            self.kind = GROUP_INT64
        elif self.values.dtype == np.float64:
            self.kind = GROUP_FLOAT64

    def __dealloc__(self):
        if self.index_ready:
            pe_i64map_destroy(&self.index, &PY_ALLOC)

    def __len__(self):
        return self.n

    @property
    def dtype(self):
        return self.values.dtype

    def track_changes(self):
        """Starts recording changes (see take_changes), forgetting any recorded so far."""
        self.tracking = True
        self.dirty = np.zeros(len(self.keys), np.uint8)
        self.dirty_pos = np.empty(16, np.int64)
        self.ndirty = 0
        self.removed = set()

    cdef inline int mark(self, Py_ssize_t pos) except -1:
        if not self.tracking or self.dirty[pos]:
            return 0
        self.dirty[pos] = 1
        if self.ndirty == self.dirty_pos.shape[0]:
            grown = np.empty(2 * self.ndirty, np.int64)
            grown[: self.ndirty] = np.asarray(self.dirty_pos)
            self.dirty_pos = grown
        self.dirty_pos[self.ndirty] = pos
        self.ndirty += 1
        return 0

    cdef int resized(self, Py_ssize_t capacity) except -1:
        """The arrays now hold ``capacity`` positions: the dirty bytes follow."""
        if self.tracking:
            dirty = np.zeros(capacity, np.uint8)
            keep = min(capacity, self.dirty.shape[0])
            dirty[:keep] = np.asarray(self.dirty)[:keep]
            self.dirty = dirty
        return 0

    cdef int own(self) except -1:
        if self.shared:
            self.keys = self.keys.copy()
            self.values = self.values.copy()
            self.shared = False
        return 0

    cdef Py_ssize_t append(self, int64_t key) except -1:
        cdef Py_ssize_t pos = self.n
        if pos == len(self.keys):
            grown = max(16, pos * 2)
            keys = np.empty(grown, np.int64)
            values = np.empty(grown, self.values.dtype)
            keys[:pos] = self.keys[:pos]
            values[:pos] = self.values[:pos]
            self.keys, self.values = keys, values
            self.resized(grown)
        # the key through the array's memory: NumPy's item assignment costs ~0.1 us
        (<int64_t*>cnp.PyArray_DATA(<cnp.ndarray>self.keys))[pos] = key
        if pe_i64map_put(&self.index, key, pos, &PY_ALLOC) < 0:
            raise MemoryError()
        self.n += 1
        return pos

    def position(self, int64_t key):
        """Where ``key`` is in the arrays, or -1."""
        return pe_i64map_get(&self.index, key)

    def contains(self, int64_t key):
        return pe_i64map_get(&self.index, key) >= 0

    cpdef object get(self, int64_t key, object default=None):
        cdef int64_t pos = pe_i64map_get(&self.index, key)
        if pos < 0:
            return default
        if self.kind == GROUP_INT64:
            return (<int64_t*>cnp.PyArray_DATA(<cnp.ndarray>self.values))[pos]
        if self.kind == GROUP_FLOAT64:
            return (<double*>cnp.PyArray_DATA(<cnp.ndarray>self.values))[pos]
        return self.values.item(pos)

    cpdef put(self, int64_t key, object value):
        cdef int64_t pos = pe_i64map_get(&self.index, key)
        cdef int64_t raw
        self.own()
        if pos < 0:
            pos = self.append(key)
        if self.kind == GROUP_INT64 and type(value) is int:
            try:
                raw = value
            except OverflowError:  # NumPy's assignment raises the error it always did
                self.values[pos] = value
            else:
                (<int64_t*>cnp.PyArray_DATA(<cnp.ndarray>self.values))[pos] = raw
        elif self.kind == GROUP_FLOAT64 and type(value) is float:
            (<double*>cnp.PyArray_DATA(<cnp.ndarray>self.values))[pos] = <double>value
        else:
            self.values[pos] = value
        self.mark(pos)

    cpdef remove(self, int64_t key):
        """Deletes ``key``; True if it was there."""
        cdef int64_t pos, last_key
        cdef Py_ssize_t last, itemsize
        cdef int64_t* keys
        cdef char* data
        # Shared with a pending snapshot: a key that is not there must not copy the arrays.
        if self.shared:
            if pe_i64map_get(&self.index, key) < 0:
                return False
            self.own()
        if not pe_i64map_remove(&self.index, key, &pos):
            return False
        last = self.n - 1
        if pos != last:  # the last entry moves into the hole: raw copies, no NumPy scalar per call
            keys = <int64_t*>cnp.PyArray_DATA(<cnp.ndarray>self.keys)
            last_key = keys[last]
            keys[pos] = last_key
            itemsize = (<cnp.ndarray>self.values).itemsize
            data = <char*>cnp.PyArray_DATA(<cnp.ndarray>self.values)
            memcpy(data + pos * itemsize, data + last * itemsize, itemsize)
            pe_i64map_put(&self.index, last_key, pos, &PY_ALLOC)
            self.mark(pos)  # another key now lives here; a mark on `last` stays, unused past n
        self.n -= 1
        if self.tracking:
            self.removed.add(key)
        return True

    def clear(self):
        cdef int64_t i
        if self.tracking:
            self.removed.update(self.keys[: self.n].tolist())
        for i in range(self.n):
            pe_i64map_remove(&self.index, self.keys[i], NULL)
        self.n = 0
        self.shared = False
        self.keys = np.empty(8, np.int64)
        self.values = np.empty(8, self.values.dtype)
        if self.tracking:
            self.dirty = np.zeros(8, np.uint8)
            self.ndirty = 0

    def arrays(self):
        """(keys, values) of every entry, as views: valid until the next write
        unless the group is frozen first."""
        return self.keys[: self.n], self.values[: self.n]

    def freeze(self):
        """``arrays()``, made safe to keep: the next write copies them first
        (copy-on-write), so a snapshot can read them on another thread."""
        self.shared = True
        return self.keys[: self.n], self.values[: self.n]

    def put_many(self, keys, values):
        """Inserts or replaces many entries (keys: int64 array), in one C loop."""
        positions, _ = self._upsert(keys)
        self.values[positions] = values

    def merge_many(self, keys, values, how):
        """Folds ``values`` into the entries of ``keys`` (distinct int64 keys) with
        ``how``: "add", "min" or "max"; a missing key takes its value as it is.
        Returns the new values. One probe per key, where get_many + put_many take two."""
        positions, fresh = self._upsert(keys)
        current = self.values
        values = np.asarray(values, dtype=current.dtype)
        old = current[positions]
        if how == "add":
            new = old + values
        elif how == "min":
            new = np.minimum(old, values)
        elif how == "max":
            new = np.maximum(old, values)
        else:
            raise ValueError(f"merge_many: how must be add, min or max, got {how!r}")
        new[fresh] = values[fresh]
        current[positions] = new
        return new

    cdef int prepare_write(self, Py_ssize_t m) except -1:
        """Before writing up to m keys: owned arrays (copy-on-write), room for
        every key being new (one growth at most), and a map sized once when an
        empty group is loaded."""
        self.own()
        if self.n + m > len(self.keys):
            grown = max(16, self.n + m, 2 * len(self.keys))
            new_keys = np.empty(grown, np.int64)
            new_values = np.empty(grown, self.values.dtype)
            new_keys[: self.n] = self.keys[: self.n]
            new_values[: self.n] = self.values[: self.n]
            self.keys, self.values = new_keys, new_values
            self.resized(grown)
        if self.n == 0 and m > 64:
            pe_i64map_destroy(&self.index, &PY_ALLOC)
            if pe_i64map_init(&self.index, <uint32_t>m, &PY_ALLOC) != PE_OK:
                self.index_ready = False
                raise MemoryError()
        return 0

    cdef tuple _upsert(self, keys):
        """Positions of ``keys``, appending the missing ones (fresh: which were missing)."""
        cdef const cnp.int64_t[::1] k = np.ascontiguousarray(keys, dtype=np.int64)
        cdef Py_ssize_t i, m = k.shape[0]
        cdef int64_t pos
        cdef cnp.int64_t[::1] dense
        positions = np.empty(m, np.int64)
        fresh = np.zeros(m, np.bool_)
        cdef cnp.int64_t[::1] p = positions
        cdef cnp.uint8_t[::1] f = fresh.view(np.uint8)
        self.prepare_write(m)
        dense = self.keys
        for i in range(m):
            pos = pe_i64map_get(&self.index, k[i])
            if pos < 0:
                pos = self.n
                dense[pos] = k[i]
                if pe_i64map_put(&self.index, k[i], pos, &PY_ALLOC) < 0:
                    raise MemoryError()
                self.n += 1
                f[i] = 1
            p[i] = pos
            self.mark(pos)
        return positions, fresh

    def get_many(self, keys):
        """(found: bool array, values: array) for many keys."""
        cdef const cnp.int64_t[::1] k = np.ascontiguousarray(keys, dtype=np.int64)
        cdef Py_ssize_t i, m = k.shape[0]
        positions = np.empty(m, np.int64)
        cdef cnp.int64_t[::1] p = positions
        for i in range(m):
            p[i] = pe_i64map_get(&self.index, k[i])
        found = positions >= 0
        values = np.zeros(m, self.values.dtype)
        values[found] = self.values[positions[found]]
        return found, values


ctypedef fused merged_t:
    cnp.int64_t
    cnp.float64_t

cdef enum:
    MERGE_ADD = 0
    MERGE_MIN = 1
    MERGE_MAX = 2
    MERGE_SET = 3


cdef int merge_runs(list groups, list active, const cnp.int64_t[::1] keys, const cnp.int64_t[::1] bounds,
                    merged_t[::1] values, merged_t[::1] out, int how) except -1:
    """ColumnarGroup.merge_many for each active key group g on keys[bounds[g]:bounds[g + 1]]
    (distinct), one probe and one fold per key; the new values go to out."""
    cdef Py_ssize_t i, g
    cdef int64_t pos
    cdef merged_t old, v
    cdef ColumnarGroup group
    cdef cnp.int64_t[::1] dense
    cdef merged_t[::1] current
    cdef Py_ssize_t ngroups = len(groups)
    if bounds.shape[0] != ngroups + 1 or values.shape[0] != keys.shape[0] or out.shape[0] != keys.shape[0]:
        raise ValueError(f"merge_groups: {keys.shape[0]} keys, {values.shape[0]} values and {bounds.shape[0]} "
                         f"bounds for {ngroups} key groups (bounds: one more than groups)")
    for index in active:
        g = index
        if g < 0 or g >= ngroups or not 0 <= bounds[g] <= bounds[g + 1] <= keys.shape[0]:
            raise IndexError(f"merge_groups: key group {g} or its bounds are out of range")
        group = groups[g]
        group.prepare_write(bounds[g + 1] - bounds[g])
        dense = group.keys
        current = group.values
        for i in range(bounds[g], bounds[g + 1]):
            v = values[i]
            pos = pe_i64map_get(&group.index, keys[i])
            if pos < 0:
                pos = group.n
                dense[pos] = keys[i]
                if pe_i64map_put(&group.index, keys[i], pos, &PY_ALLOC) < 0:
                    raise MemoryError()
                group.n += 1
            else:
                old = current[pos]
                if how == MERGE_ADD:
                    if merged_t is cnp.int64_t:
                        v = <cnp.int64_t>(<uint64_t>old + <uint64_t>v)  # wraps, as NumPy's int64 does
                    else:
                        v = old + v
                elif how == MERGE_MIN:
                    if old < v or old != old:  # a NaN stays, as with np.minimum
                        v = old
                elif how == MERGE_MAX:
                    if old > v or old != old:
                        v = old
            current[pos] = v
            out[i] = v
            group.mark(pos)
    return 0


def merge_groups(list groups, keys, values, bounds, list active, str how):
    """ColumnarValueState.merge_many for every key group in one call: keys
    sorted by key group (distinct), group g's between bounds[g] and
    bounds[g + 1]; int64 or float64 values, the groups' own dtype. Returns the
    new values, in the order of keys. A Python loop over the groups cost more
    than the merging itself for the small batches of a latency-tuned job."""
    cdef int code
    if how == "add":
        code = MERGE_ADD
    elif how == "min":
        code = MERGE_MIN
    elif how == "max":
        code = MERGE_MAX
    elif how == "set":
        code = MERGE_SET
    else:
        raise ValueError(f"merge_groups: how must be add, min, max or set, got {how!r}")
    values = np.ascontiguousarray(values)
    dtype = (<ColumnarGroup>groups[0]).values.dtype if groups else values.dtype
    if values.dtype != dtype:
        raise TypeError(f"merge_groups: values are {values.dtype}, the key groups hold {dtype}")
    out = np.empty_like(values)
    k = np.ascontiguousarray(keys, dtype=np.int64)
    b = np.ascontiguousarray(bounds, dtype=np.int64)
    if dtype == np.int64:
        merge_runs[cnp.int64_t](groups, active, k, b, values, out, code)
    elif dtype == np.float64:
        merge_runs[cnp.float64_t](groups, active, k, b, values, out, code)
    else:
        raise TypeError(f"merge_groups: int64 or float64 values only, got {dtype}")
    return out


cdef int get_runs(list groups, list active, const cnp.int64_t[::1] keys, const cnp.int64_t[::1] bounds,
                  merged_t[::1] out, cnp.uint8_t[::1] found) except -1:
    """ColumnarGroup.get_many for each active key group g on keys[bounds[g]:bounds[g + 1]]."""
    cdef Py_ssize_t i, g
    cdef int64_t pos
    cdef ColumnarGroup group
    cdef merged_t[::1] current
    cdef Py_ssize_t ngroups = len(groups)
    if bounds.shape[0] != ngroups + 1:
        raise ValueError(f"get_groups: {bounds.shape[0]} bounds for {ngroups} key groups (one more than groups)")
    for index in active:
        g = index
        if g < 0 or g >= ngroups or not 0 <= bounds[g] <= bounds[g + 1] <= keys.shape[0]:
            raise IndexError(f"get_groups: key group {g} or its bounds are out of range")
        group = groups[g]
        if group.n == 0:
            continue
        current = group.values
        for i in range(bounds[g], bounds[g + 1]):
            pos = pe_i64map_get(&group.index, keys[i])
            if pos >= 0:
                out[i] = current[pos]
                found[i] = 1
    return 0


def get_groups(list groups, keys, bounds, list active):
    """ColumnarGroup.get_many for every key group in one call (keys sorted by key
    group, as merge_groups takes them; int64 or float64 groups): (found, values),
    values 0 where not found, in the order of keys."""
    dtype = (<ColumnarGroup>groups[0]).values.dtype if groups else np.dtype(np.int64)
    k = np.ascontiguousarray(keys, dtype=np.int64)
    b = np.ascontiguousarray(bounds, dtype=np.int64)
    out = np.zeros(k.shape[0], dtype)
    found = np.zeros(k.shape[0], np.uint8)
    if dtype == np.int64:
        get_runs[cnp.int64_t](groups, active, k, b, out, found)
    elif dtype == np.float64:
        get_runs[cnp.float64_t](groups, active, k, b, out, found)
    else:
        raise TypeError(f"get_groups: int64 or float64 values only, got {dtype}")
    return found.view(np.bool_), out


def gather_changes(list groups, list touched):
    """The entries behind many groups' changed-key sets, in one call: per-group
    Python calls would cost more than the lookups when each group has few changes
    (1% of a large state spread over 128 key groups).

    Returns (keys, values, deleted, upserts, deletes): upserted keys and their
    values, then the keys no longer present, all groups' concatenated in group
    order; ``upserts[i]`` and ``deletes[i]`` are group i's counts."""
    cdef Py_ssize_t g, ngroups = len(groups), total = 0, u = 0, d = 0, start, dstart
    cdef ColumnarGroup group
    cdef int64_t key, pos
    if len(touched) != ngroups:
        raise ValueError(f"{ngroups} groups but {len(touched)} change sets")
    for changed in touched:
        total += len(changed)
    keys = np.empty(total, np.int64)
    positions = np.empty(total, np.int64)
    deleted = np.empty(total, np.int64)
    upserts = np.zeros(ngroups, np.int64)
    deletes = np.zeros(ngroups, np.int64)
    cdef cnp.int64_t[::1] k = keys, p = positions, dl = deleted, uc = upserts, dc = deletes
    dtype = (<ColumnarGroup?>groups[0]).values.dtype if ngroups else np.int64
    values = np.empty(total, dtype)
    for g in range(ngroups):
        group = <ColumnarGroup?>groups[g]
        start, dstart = u, d
        for changed_key in touched[g]:
            key = changed_key
            pos = pe_i64map_get(&group.index, key)
            if pos >= 0:
                k[u] = key
                p[u] = pos
                u += 1
            else:
                dl[d] = key
                d += 1
        uc[g] = u - start
        dc[g] = d - dstart
        if u > start:
            values[start:u] = group.values[positions[start:u]]
    return keys[:u], values[:u], deleted[:d], upserts, deletes


def take_changes(list groups):
    """What changed in many groups since their last take, and starts afresh: the
    same (keys, values, deleted, upserts, deletes) as gather_changes, found by
    position instead of by key. A key removed and then written again is an upsert."""
    cdef Py_ssize_t g, i, ngroups = len(groups), total = 0, total_removed = 0, u = 0, d = 0, start, dstart
    cdef ColumnarGroup group
    cdef int64_t pos
    cdef cnp.int64_t[::1] dense
    cdef char* src
    cdef char* dst
    cdef Py_ssize_t itemsize
    for g in range(ngroups):
        group = <ColumnarGroup?>groups[g]
        if not group.tracking:
            raise ValueError("take_changes() on a group that does not track changes")
        total += group.ndirty
        total_removed += len(group.removed)
    keys = np.empty(total, np.int64)
    deleted = np.empty(total_removed, np.int64)
    upserts = np.zeros(ngroups, np.int64)
    deletes = np.zeros(ngroups, np.int64)
    cdef cnp.int64_t[::1] k = keys, dl = deleted, uc = upserts, dc = deletes
    dtype = (<ColumnarGroup>groups[0]).values.dtype if ngroups else np.int64
    values = np.empty(total, dtype)
    # Values are gathered as bytes: any fixed-width dtype, no NumPy call per group.
    dst = <char*>cnp.PyArray_DATA(<cnp.ndarray>values)
    itemsize = values.itemsize
    for g in range(ngroups):
        group = <ColumnarGroup>groups[g]
        start, dstart = u, d
        dense = group.keys
        src = <char*>cnp.PyArray_DATA(<cnp.ndarray>group.values)
        for i in range(group.ndirty):
            pos = group.dirty_pos[i]
            group.dirty[pos] = 0
            if pos < group.n:  # else: emptied by a removal, and not refilled
                k[u] = dense[pos]
                memcpy(dst + u * itemsize, src + pos * itemsize, itemsize)
                u += 1
        group.ndirty = 0
        if group.removed:
            for removed_key in group.removed:
                pos = removed_key
                if pe_i64map_get(&group.index, pos) < 0:  # not written again since
                    dl[d] = pos
                    d += 1
            group.removed = set()
        uc[g] = u - start
        dc[g] = d - dstart
    return keys[:u], values[:u], deleted[:d], upserts, deletes
