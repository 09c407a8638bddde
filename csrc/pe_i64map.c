#include "pe_i64map.h"

#include <string.h>

static uint32_t pe_slot(const pe_i64map *m, int64_t key)
{
    return (uint32_t)(pe_fmix64((uint64_t)key) >> (64u - m->bits));
}

static int pe_alloc_arrays(pe_i64map *m, uint32_t cap, const pe_allocator *alloc)
{
    uint32_t bits = 0;
    while ((1u << bits) < cap) {
        bits++;
    }
    if (bits == 0) {
        bits = 1;
        cap = 2;
    }
    m->keys = (int64_t *)alloc->calloc(cap, sizeof(int64_t));
    m->vals = (int64_t *)alloc->calloc(cap, sizeof(int64_t));
    m->used = (uint8_t *)alloc->calloc(cap, 1);
    if (!m->keys || !m->vals || !m->used) {
        if (m->keys) alloc->free(m->keys);
        if (m->vals) alloc->free(m->vals);
        if (m->used) alloc->free(m->used);
        m->keys = m->vals = NULL;
        m->used = NULL;
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
    return pe_alloc_arrays(m, cap, alloc);
}

void pe_i64map_destroy(pe_i64map *m, const pe_allocator *alloc)
{
    if (m->keys) alloc->free(m->keys);
    if (m->vals) alloc->free(m->vals);
    if (m->used) alloc->free(m->used);
    m->keys = m->vals = NULL;
    m->used = NULL;
    m->size = 0;
}

int64_t pe_i64map_get(const pe_i64map *m, int64_t key)
{
    uint32_t mask = m->cap - 1u;
    uint32_t i = pe_slot(m, key);
    while (m->used[i]) {
        if (m->keys[i] == key) {
            return m->vals[i];
        }
        i = (i + 1u) & mask;
    }
    return -1;
}

static int pe_grow(pe_i64map *m, const pe_allocator *alloc)
{
    pe_i64map old = *m;
    uint32_t i;
    if (old.cap >= (1u << 31)) {
        return PE_ERR_NOMEM;
    }
    if (pe_alloc_arrays(m, old.cap * 2u, alloc) != PE_OK) {
        *m = old;
        return PE_ERR_NOMEM;
    }
    for (i = 0; i < old.cap; i++) {
        if (old.used[i]) {
            pe_i64map_put(m, old.keys[i], old.vals[i], alloc);
        }
    }
    pe_i64map_destroy(&old, alloc);
    return PE_OK;
}

int pe_i64map_put(pe_i64map *m, int64_t key, int64_t val, const pe_allocator *alloc)
{
    uint32_t mask, i;
    if ((uint64_t)(m->size + 1u) * 10u > (uint64_t)m->cap * 7u) {
        if (pe_grow(m, alloc) != PE_OK) {
            return PE_ERR_NOMEM;
        }
    }
    mask = m->cap - 1u;
    i = pe_slot(m, key);
    while (m->used[i]) {
        if (m->keys[i] == key) {
            m->vals[i] = val;
            return 0;
        }
        i = (i + 1u) & mask;
    }
    m->used[i] = 1;
    m->keys[i] = key;
    m->vals[i] = val;
    m->size++;
    return 1;
}

int pe_i64map_remove(pe_i64map *m, int64_t key, int64_t *old)
{
    uint32_t mask = m->cap - 1u;
    uint32_t i = pe_slot(m, key);
    uint32_t j;
    while (m->used[i] && m->keys[i] != key) {
        i = (i + 1u) & mask;
    }
    if (!m->used[i]) {
        return 0;
    }
    if (old) {
        *old = m->vals[i];
    }
    /* Backward-shift: pull later entries of the probe run into the hole. */
    j = i;
    for (;;) {
        uint32_t home;
        j = (j + 1u) & mask;
        if (!m->used[j]) {
            break;
        }
        home = pe_slot(m, m->keys[j]);
        /* Move j to i if its home lies cyclically outside (i, j]. */
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            m->keys[i] = m->keys[j];
            m->vals[i] = m->vals[j];
            i = j;
        }
    }
    m->used[i] = 0;
    m->size--;
    return 1;
}
