/*
 * A set of (key, timestamp) pairs: the pending timers of one key group, as Flink's
 * HeapPriorityQueueSet keeps them. One lookup decides whether a key has a timer at a
 * timestamp, so registering a timer and removing a fired one cost one probe each
 * (a key's timers in "slot" value states cost a probe per slot walked).
 *
 * Open addressing, linear probing, backward-shift deletion, growing at 50% load
 * (two timers of a key share the key, so pairs cluster less than keys do). A slot is
 * the pair itself, 16 bytes: a probe reads one cache line. INT64_MIN is no
 * timestamp (the engine refuses it), so it marks an empty slot.
 */
#ifndef PE_TSET_H
#define PE_TSET_H

#include "pe_common.h"
#include "pe_i64map.h"

#define PE_TSET_EMPTY INT64_MIN

typedef struct pe_timer {
    int64_t key;
    int64_t ts; /* PE_TSET_EMPTY: an empty slot */
} pe_timer;

typedef struct pe_tset {
    pe_timer *slots;
    uint32_t cap;  /* power of two */
    uint32_t bits; /* log2(cap) */
    uint32_t size;
} pe_tset;

/* min_cap 0: no slots (slots NULL) until the first add, which makes 16; every call
   takes a set in that state. A job's operator has a set per key group and domain,
   most of them often empty (16 MB of empty slots at 32768 key groups otherwise). */
int pe_tset_init(pe_tset *s, uint32_t min_cap, const pe_allocator *alloc);
void pe_tset_destroy(pe_tset *s, const pe_allocator *alloc);

/* 1 added, 0 there already, PE_ERR_ARG for ts == PE_TSET_EMPTY, PE_ERR_NOMEM. */
int pe_tset_add(pe_tset *s, int64_t key, int64_t ts, const pe_allocator *alloc);

/* 1 removed, 0 not there. */
int pe_tset_remove(pe_tset *s, int64_t key, int64_t ts);

int pe_tset_contains(const pe_tset *s, int64_t key, int64_t ts);

/* A copy of src into dst (uninitialised): a snapshot's copy-on-write. */
int pe_tset_copy(pe_tset *dst, const pe_tset *src, const pe_allocator *alloc);

/* Every pair, in slot order, into keys[] and ts[] (room for s->size each); returns
   how many. */
uint32_t pe_tset_collect(const pe_tset *s, int64_t *keys, int64_t *ts);

static inline uint32_t pe_tset_slot(const pe_tset *s, int64_t key, int64_t ts)
{
    /* high bits, as pe_i64map: a key group's keys share their hash's low bits */
    return (uint32_t)(pe_fmix64((uint64_t)key * 0x9E3779B97F4A7C15ULL ^ (uint64_t)ts) >> (64u - s->bits));
}

/* Asks for the line a lookup of (key, ts) reads first; see pe_i64map_prefetch. */
PE_PREFETCH_INLINE void pe_tset_prefetch(const pe_tset *s, int64_t key, int64_t ts)
{
    if (s->slots != NULL) {
        PE_PREFETCH(&s->slots[pe_tset_slot(s, key, ts)]);
    }
}

#endif /* PE_TSET_H */
