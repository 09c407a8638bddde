/*
 * An int64 -> int64 hash map for non-negative values (pyengine stores positions):
 * open addressing, linear probing, backward-shift deletion (no tombstones),
 * growing at 70% load.
 *
 * The slot comes from the high bits of murmur3's fmix64: pyengine derives a key's
 * key group from the same hash's low bits, so inside one key group the low bits
 * are all alike and must not choose the slot.
 *
 * A slot holds its key and value side by side (stored as value + 1: a slot that
 * stores 0 is empty, as calloc's memory is), so a lookup reads one cache line (two
 * when its probe run crosses into the next). With the keys, the values and a used
 * flag in three arrays, a lookup that missed the cache waited on three lines: a
 * keyed job's maps outgrow the L2 cache, and those misses were most of a state
 * call's cost.
 */
#ifndef PE_I64MAP_H
#define PE_I64MAP_H

#include "pe_common.h"

typedef struct pe_i64slot {
    int64_t key;
    int64_t stored; /* the value + 1; 0: an empty slot (so calloc's memory is empty) */
} pe_i64slot;

typedef struct pe_i64map {
    pe_i64slot *slots;
    uint32_t cap;  /* power of two */
    uint32_t bits; /* log2(cap) */
    uint32_t size;
} pe_i64map;

int pe_i64map_init(pe_i64map *m, uint32_t min_cap, const pe_allocator *alloc);
void pe_i64map_destroy(pe_i64map *m, const pe_allocator *alloc);

/* The value of key, or -1 when absent. */
int64_t pe_i64map_get(const pe_i64map *m, int64_t key);

/* Inserts or replaces; 1 inserted, 0 replaced, PE_ERR_NOMEM when it cannot grow,
   PE_ERR_ARG for a value outside 0..INT64_MAX-1. */
int pe_i64map_put(pe_i64map *m, int64_t key, int64_t val, const pe_allocator *alloc);

/* Removes key; 1 if it was there (its value in *old), 0 otherwise. */
int pe_i64map_remove(pe_i64map *m, int64_t key, int64_t *old);

static inline uint64_t pe_fmix64(uint64_t x)
{
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

/*
 * Asks the CPU for the cache line that a lookup of key reads first (its home
 * slot). A loop that knows its next keys (a batch of timers to register or fire)
 * prefetches them some entries ahead, so their misses overlap instead of queueing.
 */
PE_PREFETCH_INLINE void pe_i64map_prefetch(const pe_i64map *m, int64_t key)
{
    if (m->slots != NULL) {
        PE_PREFETCH(&m->slots[pe_fmix64((uint64_t)key) >> (64u - m->bits)]);
    }
}

#endif /* PE_I64MAP_H */
