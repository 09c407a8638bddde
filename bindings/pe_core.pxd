# Declarations of the C core (csrc/) for the Cython bindings. Thin on purpose:
# the C headers are the source of truth.
from libc.stdint cimport int64_t, uint32_t, uint64_t


cdef extern from "pe_common.h" nogil:
    enum:
        PE_MAX_CHANNELS
        PE_OK
        PE_ERR_NOMEM
        PE_ERR_ARG

    ctypedef struct pe_allocator:
        void *(*calloc)(size_t nmemb, size_t size)
        void (*free)(void *ptr)


cdef extern from "pe_bitset.h" nogil:
    ctypedef struct pe_bitset:
        uint64_t *words
        uint32_t nbits
        uint32_t nwords
        uint32_t count

    int pe_bitset_init(pe_bitset *b, uint32_t nbits, const pe_allocator *alloc)
    void pe_bitset_destroy(pe_bitset *b, const pe_allocator *alloc)
    void pe_bitset_clear_all(pe_bitset *b)
    int64_t pe_bitset_next(const pe_bitset *b, uint32_t start)
    int pe_bitset_test(const pe_bitset *b, uint32_t i)
    int pe_bitset_set(pe_bitset *b, uint32_t i)
    int pe_bitset_clear(pe_bitset *b, uint32_t i)


cdef extern from "pe_ring.h" nogil:
    ctypedef struct pe_rings:
        uint32_t nchannels
        uint32_t slot_cap

    int pe_rings_init(pe_rings *r, uint32_t nchannels, uint32_t slot_cap, const pe_allocator *alloc)
    void pe_rings_destroy(pe_rings *r, const pe_allocator *alloc)
    void *pe_rings_remove_at(pe_rings *r, uint32_t ch, uint32_t k)
    uint32_t pe_rings_len(const pe_rings *r, uint32_t ch)
    int pe_rings_push(pe_rings *r, uint32_t ch, void *item)
    void *pe_rings_pop(pe_rings *r, uint32_t ch)
    void *pe_rings_peek(const pe_rings *r, uint32_t ch, uint32_t k)


cdef extern from "pe_chanqueue.h" nogil:
    ctypedef struct pe_chanqueue:
        pass

    int pe_chanqueue_init(pe_chanqueue *q, uint32_t nchannels, const pe_allocator *alloc)
    void pe_chanqueue_destroy(pe_chanqueue *q, const pe_allocator *alloc)
    uint32_t pe_chanqueue_len(const pe_chanqueue *q)
    int pe_chanqueue_push(pe_chanqueue *q, uint32_t ch)
    int64_t pe_chanqueue_pop(pe_chanqueue *q)
    int64_t pe_chanqueue_peek(const pe_chanqueue *q)


cdef extern from "pe_barrier.h" nogil:
    enum:
        PE_MAX_PENDING_CHECKPOINTS

    ctypedef struct pe_pending_entry:
        int64_t checkpoint_id
        int64_t start_delay_ns
        int aborted
        pe_bitset seen

    ctypedef struct pe_pending_table:
        uint32_t head
        uint32_t len

    int pe_pending_init(pe_pending_table *t, uint32_t nchannels, const pe_allocator *alloc)
    void pe_pending_destroy(pe_pending_table *t, const pe_allocator *alloc)
    pe_pending_entry *pe_pending_at(pe_pending_table *t, uint32_t pos)
    int pe_pending_find(const pe_pending_table *t, int64_t checkpoint_id)
    pe_pending_entry *pe_pending_push_back(pe_pending_table *t, int64_t checkpoint_id, int64_t *evicted_id)
    void pe_pending_pop_front(pe_pending_table *t, uint32_t n)
    int pe_pending_count(pe_pending_entry *e, uint32_t ch)

    ctypedef struct pe_alignment:
        int64_t checkpoint_id
        pe_bitset received
        uint32_t nchannels
        uint32_t closed

    int pe_alignment_init(pe_alignment *a, uint32_t nchannels, const pe_allocator *alloc)
    void pe_alignment_destroy(pe_alignment *a, const pe_allocator *alloc)
    void pe_alignment_reset(pe_alignment *a, int64_t checkpoint_id)
    int pe_alignment_mark(pe_alignment *a, uint32_t ch)
    int pe_alignment_complete(const pe_alignment *a)


cdef extern from "pe_waiter.h" nogil:
    ctypedef struct pe_waiter:
        uint32_t data_waiters
        uint32_t space_waiters

    int pe_waiter_init(pe_waiter *w)
    void pe_waiter_destroy(pe_waiter *w)
    void pe_waiter_signal_data(pe_waiter *w)
    void pe_waiter_signal_space(pe_waiter *w)
    uint64_t pe_waiter_data_seq(pe_waiter *w)
    uint64_t pe_waiter_space_seq(pe_waiter *w)
    int pe_waiter_wait_data(pe_waiter *w, uint64_t seen, int64_t deadline_ns)
    int pe_waiter_wait_space(pe_waiter *w, uint64_t seen, int64_t deadline_ns)
    int64_t pe_monotonic_ns()
    int64_t pe_wall_ns()


cdef extern from "pe_i64map.h" nogil:
    ctypedef struct pe_i64map:
        uint32_t size

    int pe_i64map_init(pe_i64map *m, uint32_t min_cap, const pe_allocator *alloc)
    void pe_i64map_destroy(pe_i64map *m, const pe_allocator *alloc)
    int64_t pe_i64map_get(const pe_i64map *m, int64_t key)
    int pe_i64map_put(pe_i64map *m, int64_t key, int64_t val, const pe_allocator *alloc)
    int pe_i64map_remove(pe_i64map *m, int64_t key, int64_t *old)
    void pe_i64map_prefetch(const pe_i64map *m, int64_t key)
