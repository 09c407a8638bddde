#include "pe_bitset.h"

#include <string.h>

int pe_bitset_init(pe_bitset *b, uint32_t nbits, const pe_allocator *alloc)
{
    b->nbits = nbits;
    b->nwords = (nbits + 63u) / 64u;
    b->count = 0;
    b->words = NULL;
    if (b->nwords == 0) {
        b->nwords = 1;
    }
    b->words = (uint64_t *)alloc->calloc(b->nwords, sizeof(uint64_t));
    return b->words ? PE_OK : PE_ERR_NOMEM;
}

void pe_bitset_destroy(pe_bitset *b, const pe_allocator *alloc)
{
    if (b->words) {
        alloc->free(b->words);
    }
    b->words = NULL;
    b->count = 0;
}

void pe_bitset_clear_all(pe_bitset *b)
{
    if (b->count == 0) {
        return;
    }
    memset(b->words, 0, (size_t)b->nwords * sizeof(uint64_t));
    b->count = 0;
}

static inline int pe_ctz64(uint64_t v)
{
#if defined(__GNUC__) || defined(__clang__)
    return __builtin_ctzll(v);
#else
    int n = 0;
    while (!(v & 1u)) {
        v >>= 1;
        n++;
    }
    return n;
#endif
}

int64_t pe_bitset_next(const pe_bitset *b, uint32_t from)
{
    uint32_t wi;
    uint64_t w;
    if (from >= b->nbits || b->count == 0) {
        return -1;
    }
    wi = from >> 6;
    w = b->words[wi] & (~(uint64_t)0 << (from & 63u));
    for (;;) {
        if (w) {
            int64_t i = (int64_t)wi * 64 + pe_ctz64(w);
            return i < (int64_t)b->nbits ? i : -1;
        }
        if (++wi >= b->nwords) {
            return -1;
        }
        w = b->words[wi];
    }
}
