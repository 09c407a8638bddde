#include "pe_chanqueue.h"

int pe_chanqueue_init(pe_chanqueue *q, uint32_t nchannels, const pe_allocator *alloc)
{
    uint32_t cap;
    int rc;
    q->buf = NULL;
    q->head = 0;
    q->tail = 0;
    if (nchannels == 0 || nchannels > PE_MAX_CHANNELS) {
        return PE_ERR_ARG;
    }
    cap = pe_next_pow2(nchannels);
    q->mask = cap - 1u;
    rc = pe_bitset_init(&q->queued, nchannels, alloc);
    if (rc != PE_OK) {
        return rc;
    }
    q->buf = (uint32_t *)alloc->calloc(cap, sizeof(uint32_t));
    if (!q->buf) {
        pe_bitset_destroy(&q->queued, alloc);
        return PE_ERR_NOMEM;
    }
    return PE_OK;
}

void pe_chanqueue_destroy(pe_chanqueue *q, const pe_allocator *alloc)
{
    if (q->buf) {
        alloc->free(q->buf);
    }
    q->buf = NULL;
    pe_bitset_destroy(&q->queued, alloc);
}
