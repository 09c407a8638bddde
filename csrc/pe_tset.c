#include "pe_tset.h"

#include <string.h>

static int pe_tset_alloc(pe_tset *s, uint32_t cap, const pe_allocator *alloc)
{
    uint32_t bits = 1, i;
    while ((1u << bits) < cap) {
        bits++;
    }
    cap = 1u << bits;
    s->slots = (pe_timer *)alloc->calloc(cap, sizeof(pe_timer));
    if (!s->slots) {
        return PE_ERR_NOMEM;
    }
    for (i = 0; i < cap; i++) {
        s->slots[i].ts = PE_TSET_EMPTY;
    }
    s->cap = cap;
    s->bits = bits;
    s->size = 0;
    return PE_OK;
}

int pe_tset_init(pe_tset *s, uint32_t min_cap, const pe_allocator *alloc)
{
    if (min_cap == 0) { /* no slots until the first add: most key groups of a job may have no timers */
        s->slots = NULL;
        s->cap = 0;
        s->bits = 0;
        s->size = 0;
        return PE_OK;
    }
    return pe_tset_alloc(s, pe_next_pow2(min_cap < 8 ? 16 : 2 * min_cap), alloc);
}

void pe_tset_destroy(pe_tset *s, const pe_allocator *alloc)
{
    if (s->slots) alloc->free(s->slots);
    s->slots = NULL;
    s->size = 0;
}

static void pe_tset_place(pe_tset *s, pe_timer t)
{
    uint32_t mask = s->cap - 1u, i = pe_tset_slot(s, t.key, t.ts);
    while (s->slots[i].ts != PE_TSET_EMPTY) {
        i = (i + 1u) & mask;
    }
    s->slots[i] = t;
    s->size++;
}

static int pe_tset_grow(pe_tset *s, const pe_allocator *alloc)
{
    pe_tset old = *s;
    uint32_t i;
    if (old.cap >= (1u << 30)) {
        return PE_ERR_NOMEM;
    }
    if (pe_tset_alloc(s, old.cap * 2u, alloc) != PE_OK) {
        *s = old;
        return PE_ERR_NOMEM;
    }
    for (i = 0; i < old.cap; i++) {
        if (old.slots[i].ts != PE_TSET_EMPTY) {
            pe_tset_place(s, old.slots[i]);
        }
    }
    pe_tset_destroy(&old, alloc);
    return PE_OK;
}

int pe_tset_add(pe_tset *s, int64_t key, int64_t ts, const pe_allocator *alloc)
{
    uint32_t mask, i;
    if (ts == PE_TSET_EMPTY) {
        return PE_ERR_ARG;
    }
    if (s->slots == NULL && pe_tset_alloc(s, 16, alloc) != PE_OK) {
        return PE_ERR_NOMEM;
    }
    mask = s->cap - 1u;
    for (i = pe_tset_slot(s, key, ts); s->slots[i].ts != PE_TSET_EMPTY; i = (i + 1u) & mask) {
        if (s->slots[i].ts == ts && s->slots[i].key == key) {
            return 0;
        }
    }
    if ((uint64_t)(s->size + 1u) * 2u > (uint64_t)s->cap) {
        pe_timer t;
        if (pe_tset_grow(s, alloc) != PE_OK) {
            return PE_ERR_NOMEM;
        }
        t.key = key;
        t.ts = ts;
        pe_tset_place(s, t);
        return 1;
    }
    s->slots[i].key = key;
    s->slots[i].ts = ts;
    s->size++;
    return 1;
}

int pe_tset_contains(const pe_tset *s, int64_t key, int64_t ts)
{
    uint32_t mask = s->cap - 1u, i;
    if (ts == PE_TSET_EMPTY || s->slots == NULL) {
        return 0;
    }
    for (i = pe_tset_slot(s, key, ts); s->slots[i].ts != PE_TSET_EMPTY; i = (i + 1u) & mask) {
        if (s->slots[i].ts == ts && s->slots[i].key == key) {
            return 1;
        }
    }
    return 0;
}

int pe_tset_remove(pe_tset *s, int64_t key, int64_t ts)
{
    uint32_t mask = s->cap - 1u, i, j;
    if (ts == PE_TSET_EMPTY || s->slots == NULL) {
        return 0;
    }
    for (i = pe_tset_slot(s, key, ts);; i = (i + 1u) & mask) {
        if (s->slots[i].ts == PE_TSET_EMPTY) {
            return 0;
        }
        if (s->slots[i].ts == ts && s->slots[i].key == key) {
            break;
        }
    }
    /* Backward shift: pull later entries of the probe run into the hole. */
    for (j = i;;) {
        uint32_t home;
        j = (j + 1u) & mask;
        if (s->slots[j].ts == PE_TSET_EMPTY) {
            break;
        }
        home = pe_tset_slot(s, s->slots[j].key, s->slots[j].ts);
        /* j may move to i when i lies cyclically in [home, j) */
        if (((j - home) & mask) >= ((j - i) & mask)) {
            s->slots[i] = s->slots[j];
            i = j;
        }
    }
    s->slots[i].ts = PE_TSET_EMPTY;
    s->size--;
    return 1;
}

int pe_tset_copy(pe_tset *dst, const pe_tset *src, const pe_allocator *alloc)
{
    if (src->slots == NULL) {
        *dst = *src; /* nothing allocated yet: nothing to copy */
        return PE_OK;
    }
    dst->slots = (pe_timer *)alloc->calloc(src->cap, sizeof(pe_timer));
    if (!dst->slots) {
        return PE_ERR_NOMEM;
    }
    memcpy(dst->slots, src->slots, (size_t)src->cap * sizeof(pe_timer));
    dst->cap = src->cap;
    dst->bits = src->bits;
    dst->size = src->size;
    return PE_OK;
}

uint32_t pe_tset_collect(const pe_tset *s, int64_t *keys, int64_t *ts)
{
    /* Branch-free: every slot is written at keys[n] / ts[n] and n moves on only
       past a timer. A third to a half of the slots are taken, in no pattern, so a
       branch per slot was mispredicted about every other slot (2x slower). The
       loop stops at the last timer, so no write goes past s->size entries. */
    uint32_t i, n = 0;
    const uint32_t size = s->size;
    for (i = 0; i < s->cap && n < size; i++) {
        const int64_t k = s->slots[i].key;
        const int64_t t = s->slots[i].ts;
        keys[n] = k;
        ts[n] = t;
        n += (t != PE_TSET_EMPTY);
    }
    return n;
}
