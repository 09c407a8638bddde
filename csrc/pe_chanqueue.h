/*
 * The queue of channels with data, in the order they became available.
 *
 * A channel is in the queue at most once (a bitset guards membership), so the
 * queue never holds more than nchannels entries. The consumer pops the front
 * channel, takes one item, and re-queues the channel at the back if it still
 * has data: round-robin in arrival order, as Flink's input gate does.
 */
#ifndef PE_CHANQUEUE_H
#define PE_CHANQUEUE_H

#include "pe_bitset.h"

typedef struct pe_chanqueue {
    uint32_t *buf;
    uint32_t mask;
    uint32_t head;
    uint32_t tail;
    pe_bitset queued;
} pe_chanqueue;

int pe_chanqueue_init(pe_chanqueue *q, uint32_t nchannels, const pe_allocator *alloc);
void pe_chanqueue_destroy(pe_chanqueue *q, const pe_allocator *alloc);

static inline uint32_t pe_chanqueue_len(const pe_chanqueue *q)
{
    return q->tail - q->head;
}

static inline int pe_chanqueue_contains(const pe_chanqueue *q, uint32_t ch)
{
    return pe_bitset_test(&q->queued, ch);
}

/* Appends ch unless it is already queued; returns 1 if appended. */
static inline int pe_chanqueue_push(pe_chanqueue *q, uint32_t ch)
{
    if (!pe_bitset_set(&q->queued, ch)) {
        return 0;
    }
    q->buf[q->tail & q->mask] = ch;
    q->tail++;
    return 1;
}

/* Removes and returns the front channel, or -1 when empty. */
static inline int64_t pe_chanqueue_pop(pe_chanqueue *q)
{
    uint32_t ch;
    if (q->head == q->tail) {
        return -1;
    }
    ch = q->buf[q->head & q->mask];
    q->head++;
    pe_bitset_clear(&q->queued, ch);
    return (int64_t)ch;
}

/* The front channel without removing it, or -1 when empty. */
static inline int64_t pe_chanqueue_peek(const pe_chanqueue *q)
{
    if (q->head == q->tail) {
        return -1;
    }
    return (int64_t)q->buf[q->head & q->mask];
}

#endif /* PE_CHANQUEUE_H */
