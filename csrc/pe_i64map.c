#include "pe_i64map.h"

#include <string.h>

static uint32_t pe_slot(const pe_i64map *m, int64_t key)
{
    return (uint32_t)(pe_fmix64((uint64_t)key) >> (64u - m->bits));
}

static int pe_alloc_slots(pe_i64map *m, uint32_t cap, const pe_allocator *alloc)
{
    uint32_t bits = 0;
    while ((1u << bits) < cap) {
        bits++;
    }
    if (bits == 0) {
        bits = 1;
        cap = 2;
    }
    m->slots = (pe_i64slot *)alloc->calloc(cap, sizeof(pe_i64slot)); /* all empty */
    if (!m->slots) {
        return PE_ERR_NOMEM;
    }
    m->cap = cap;
    m->bits = bits;
    m->size = 0;
    return PE_OK;
}

int pe_i64map_init(pe_i64map *m, uint32_t min_cap, const pe_allocator *alloc)
{
    uint32_t cap = pe_next_pow2(min_cap < 8 ? 8 : min_cap + min_cap / 2);
    return pe_alloc_slots(m, cap, alloc);
}

void pe_i64map_destroy(pe_i64map *m, const pe_allocator *alloc)
{
    if (m->slots) alloc->free(m->slots);
    m->slots = NULL;
    m->size = 0;
}

int64_t pe_i64map_get(const pe_i64map *m, int64_t key)
{
    uint32_t mask = m->cap - 1u;
    uint32_t i = pe_slot(m, key);
    const pe_i64slot *s;
    for (;;) {
        s = &m->slots[i];
        if (s->stored == 0) {
            return -1;
        }
        if (s->key == key) {
            return s->stored - 1;
        }
        i = (i + 1u) & mask;
    }
}

static int pe_grow(pe_i64map *m, const pe_allocator *alloc)
{
    pe_i64map old = *m;
    uint32_t i;
    if (old.cap >= (1u << 31)) {
        return PE_ERR_NOMEM;
    }
    if (pe_alloc_slots(m, old.cap * 2u, alloc) != PE_OK) {
        *m = old;
        return PE_ERR_NOMEM;
    }
    for (i = 0; i < old.cap; i++) {
        if (old.slots[i].stored != 0) {
            pe_i64map_put(m, old.slots[i].key, old.slots[i].stored - 1, alloc);
        }
    }
    pe_i64map_destroy(&old, alloc);
    return PE_OK;
}

int pe_i64map_put(pe_i64map *m, int64_t key, int64_t val, const pe_allocator *alloc)
{
    uint32_t mask, i;
    pe_i64slot *s;
    if (val < 0 || val == INT64_MAX) {
        return PE_ERR_ARG;
    }
    if ((uint64_t)(m->size + 1u) * 10u > (uint64_t)m->cap * 7u) {
        if (pe_grow(m, alloc) != PE_OK) {
            return PE_ERR_NOMEM;
        }
    }
    mask = m->cap - 1u;
    i = pe_slot(m, key);
    for (;;) {
        s = &m->slots[i];
        if (s->stored == 0) {
            break;
        }
        if (s->key == key) {
            s->stored = val + 1;
            return 0;
        }
        i = (i + 1u) & mask;
    }
    s->key = key;
    s->stored = val + 1;
    m->size++;
    return 1;
}

int pe_i64map_remove(pe_i64map *m, int64_t key, int64_t *old)
{
    uint32_t mask = m->cap - 1u;
    uint32_t i = pe_slot(m, key);
    uint32_t j;
    while (m->slots[i].stored != 0 && m->slots[i].key != key) {
        i = (i + 1u) & mask;
    }
    if (m->slots[i].stored == 0) {
        return 0;
    }
    if (old) {
        *old = m->slots[i].stored - 1;
    }
    /* Backward-shift: pull later entries of the probe run into the hole. */
    j = i;
    for (;;) {
        uint32_t home;
        j = (j + 1u) & mask;
        if (m->slots[j].stored == 0) {
            break;
        }
        home = pe_slot(m, m->slots[j].key);
        /* Move j to i if its home lies cyclically outside (i, j]. */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].stored = 0;
    m->size--;
    return 1;
}
