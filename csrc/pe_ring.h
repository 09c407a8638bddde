/*
 * Bounded per-channel rings of opaque pointers, all channels in one slab.
 *
 * Each channel owns slot_cap consecutive slots (a power of two, so indexing is
 * a mask) and free-running 32-bit head/tail counters. The ring never interprets
 * what it stores: the caller decides what a full channel means (data and
 * events may have different limits below slot_cap) and owns the items.
 * Push, pop and peek are O(1) and never allocate.
 */
#ifndef PE_RING_H
#define PE_RING_H

#include "pe_common.h"

typedef struct pe_ring_pos {
    uint32_t head;
    uint32_t tail;
} pe_ring_pos;

typedef struct pe_rings {
    void **slots;
    pe_ring_pos *pos;
    uint32_t nchannels;
    uint32_t slot_cap;
    uint32_t shift;
    uint32_t mask;
} pe_rings;

/* slot_cap is rounded up to a power of two; 1 <= nchannels <= PE_MAX_CHANNELS. */
int pe_rings_init(pe_rings *r, uint32_t nchannels, uint32_t slot_cap, const pe_allocator *alloc);
void pe_rings_destroy(pe_rings *r, const pe_allocator *alloc);

/*
 * Removes and returns the k-th item (0 = head) of a channel, keeping the order
 * of the rest. Items ahead of it move back one slot, so the cost is O(k). Used
 * when a priority event overtakes queued buffers. NULL when k >= len.
 */
void *pe_rings_remove_at(pe_rings *r, uint32_t ch, uint32_t k);

static inline uint32_t pe_rings_len(const pe_rings *r, uint32_t ch)
{
    return r->pos[ch].tail - r->pos[ch].head;
}

static inline void **pe_rings_slot(const pe_rings *r, uint32_t ch, uint32_t counter)
{
    return &r->slots[((size_t)ch << r->shift) + (counter & r->mask)];
}

/* Appends; returns 0, or -1 when all slot_cap slots are taken. */
static inline int pe_rings_push(pe_rings *r, uint32_t ch, void *item)
{
    pe_ring_pos *p = &r->pos[ch];
    if (p->tail - p->head >= r->slot_cap) {
        return -1;
    }
    *pe_rings_slot(r, ch, p->tail) = item;
    p->tail++;
    return 0;
}

/* Removes and returns the head item, or NULL when the channel is empty. */
static inline void *pe_rings_pop(pe_rings *r, uint32_t ch)
{
    pe_ring_pos *p = &r->pos[ch];
    void **slot;
    void *item;
    if (p->tail == p->head) {
        return NULL;
    }
    slot = pe_rings_slot(r, ch, p->head);
    item = *slot;
    *slot = NULL;
    p->head++;
    return item;
}

/* The k-th item from the head without removing it, or NULL when k >= len. */
static inline void *pe_rings_peek(const pe_rings *r, uint32_t ch, uint32_t k)
{
    const pe_ring_pos *p = &r->pos[ch];
    if (k >= p->tail - p->head) {
        return NULL;
    }
    return *pe_rings_slot(r, ch, p->head + k);
}

#endif /* PE_RING_H */
