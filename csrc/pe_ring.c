#include "pe_ring.h"

int pe_rings_init(pe_rings *r, uint32_t nchannels, uint32_t slot_cap, const pe_allocator *alloc)
{
    uint32_t shift = 0;
    r->slots = NULL;
    r->pos = NULL;
    if (nchannels == 0 || nchannels > PE_MAX_CHANNELS || slot_cap == 0 || slot_cap > (1u << 24)) {
        return PE_ERR_ARG;
    }
    slot_cap = pe_next_pow2(slot_cap);
    while ((1u << shift) < slot_cap) {
        shift++;
    }
    r->nchannels = nchannels;
    r->slot_cap = slot_cap;
    r->shift = shift;
    r->mask = slot_cap - 1u;
    r->slots = (void **)alloc->calloc((size_t)nchannels * slot_cap, sizeof(void *));
    r->pos = (pe_ring_pos *)alloc->calloc(nchannels, sizeof(pe_ring_pos));
    if (!r->slots || !r->pos) {
        pe_rings_destroy(r, alloc);
        return PE_ERR_NOMEM;
    }
    return PE_OK;
}

void pe_rings_destroy(pe_rings *r, const pe_allocator *alloc)
{
    if (r->slots) {
        alloc->free(r->slots);
    }
    if (r->pos) {
        alloc->free(r->pos);
    }
    r->slots = NULL;
    r->pos = NULL;
}

void *pe_rings_remove_at(pe_rings *r, uint32_t ch, uint32_t k)
{
    pe_ring_pos *p = &r->pos[ch];
    uint32_t i;
    void *item;
    if (k >= p->tail - p->head) {
        return NULL;
    }
    item = *pe_rings_slot(r, ch, p->head + k);
    for (i = k; i > 0; i--) {
        *pe_rings_slot(r, ch, p->head + i) = *pe_rings_slot(r, ch, p->head + i - 1u);
    }
    *pe_rings_slot(r, ch, p->head) = NULL;
    p->head++;
    return item;
}
