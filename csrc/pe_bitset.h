/*
 * Fixed-size bitsets with a maintained population count.
 *
 * The count makes "how many channels are blocked / closed / have delivered the
 * barrier" an O(1) read, so barrier handling never scans the channel set.
 */
#ifndef PE_BITSET_H
#define PE_BITSET_H

#include "pe_common.h"

typedef struct pe_bitset {
    uint64_t *words;
    uint32_t nbits;
    uint32_t nwords;
    uint32_t count;
} pe_bitset;

int pe_bitset_init(pe_bitset *b, uint32_t nbits, const pe_allocator *alloc);
void pe_bitset_destroy(pe_bitset *b, const pe_allocator *alloc);

/* Clears every bit; O(nwords) but free when nothing is set. */
void pe_bitset_clear_all(pe_bitset *b);

/* Index of the first set bit >= from, or -1 when there is none. */
int64_t pe_bitset_next(const pe_bitset *b, uint32_t from);

static inline int pe_bitset_test(const pe_bitset *b, uint32_t i)
{
    return (int)((b->words[i >> 6] >> (i & 63u)) & 1u);
}

/* Sets bit i; returns 1 if it was clear before, 0 if it was already set. */
static inline int pe_bitset_set(pe_bitset *b, uint32_t i)
{
    uint64_t *w = &b->words[i >> 6];
    uint64_t m = (uint64_t)1 << (i & 63u);
    if (*w & m) {
        return 0;
    }
    *w |= m;
    b->count++;
    return 1;
}

/* Clears bit i; returns 1 if it was set before, 0 otherwise. */
static inline int pe_bitset_clear(pe_bitset *b, uint32_t i)
{
    uint64_t *w = &b->words[i >> 6];
    uint64_t m = (uint64_t)1 << (i & 63u);
    if (!(*w & m)) {
        return 0;
    }
    *w &= ~m;
    b->count--;
    return 1;
}

#endif /* PE_BITSET_H */
