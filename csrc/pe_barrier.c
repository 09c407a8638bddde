#include "pe_barrier.h"

int pe_pending_init(pe_pending_table *t, uint32_t nchannels, const pe_allocator *alloc)
{
    uint32_t i;
    t->head = 0;
    t->len = 0;
    for (i = 0; i < PE_MAX_PENDING_CHECKPOINTS; i++) {
        t->entries[i].seen.words = NULL;
    }
    for (i = 0; i < PE_MAX_PENDING_CHECKPOINTS; i++) {
        int rc = pe_bitset_init(&t->entries[i].seen, nchannels, alloc);
        if (rc != PE_OK) {
            pe_pending_destroy(t, alloc);
            return rc;
        }
    }
    return PE_OK;
}

void pe_pending_destroy(pe_pending_table *t, const pe_allocator *alloc)
{
    uint32_t i;
    for (i = 0; i < PE_MAX_PENDING_CHECKPOINTS; i++) {
        pe_bitset_destroy(&t->entries[i].seen, alloc);
    }
    t->len = 0;
}

int pe_pending_find(const pe_pending_table *t, int64_t checkpoint_id)
{
    uint32_t pos;
    for (pos = 0; pos < t->len; pos++) {
        if (t->entries[(t->head + pos) % PE_MAX_PENDING_CHECKPOINTS].checkpoint_id == checkpoint_id) {
            return (int)pos;
        }
    }
    return -1;
}

pe_pending_entry *pe_pending_push_back(pe_pending_table *t, int64_t checkpoint_id,
                                       int64_t *evicted_id)
{
    pe_pending_entry *e;
    *evicted_id = -1;
    if (t->len == PE_MAX_PENDING_CHECKPOINTS) {
        *evicted_id = pe_pending_at(t, 0)->checkpoint_id;
        pe_pending_pop_front(t, 1);
    }
    e = pe_pending_at(t, t->len);
    t->len++;
    e->checkpoint_id = checkpoint_id;
    e->start_delay_ns = 0;
    e->aborted = 0;
    pe_bitset_clear_all(&e->seen);
    return e;
}

void pe_pending_pop_front(pe_pending_table *t, uint32_t n)
{
    if (n > t->len) {
        n = t->len;
    }
    t->head = (t->head + n) % PE_MAX_PENDING_CHECKPOINTS;
    t->len -= n;
}

int pe_alignment_init(pe_alignment *a, uint32_t nchannels, const pe_allocator *alloc)
{
    a->checkpoint_id = -1;
    a->nchannels = nchannels;
    a->closed = 0;
    return pe_bitset_init(&a->received, nchannels, alloc);
}

void pe_alignment_destroy(pe_alignment *a, const pe_allocator *alloc)
{
    pe_bitset_destroy(&a->received, alloc);
}
