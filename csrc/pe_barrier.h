/*
 * Barrier bookkeeping for the checkpoint barrier handlers.
 *
 * pe_pending_table: the at-least-once tracker's ordered table of checkpoints
 * whose barriers are still being counted. Like Flink it tracks at most
 * PE_MAX_PENDING_CHECKPOINTS; unlike Flink it remembers which channels each
 * checkpoint was counted on, so a repeated barrier is reported instead of
 * completing a checkpoint early (which would lose records on restore).
 *
 * pe_alignment: the exactly-once handlers' counters for the one checkpoint in
 * progress: which channels delivered its barrier, and how many are closed.
 */
#ifndef PE_BARRIER_H
#define PE_BARRIER_H

#include "pe_bitset.h"

#define PE_MAX_PENDING_CHECKPOINTS 50u

typedef struct pe_pending_entry {
    int64_t checkpoint_id;
    int64_t start_delay_ns;
    int aborted;
    pe_bitset seen; /* channels counted; seen.count is the barrier count */
} pe_pending_entry;

typedef struct pe_pending_table {
    pe_pending_entry entries[PE_MAX_PENDING_CHECKPOINTS];
    uint32_t head; /* physical index of the oldest entry */
    uint32_t len;
} pe_pending_table;

int pe_pending_init(pe_pending_table *t, uint32_t nchannels, const pe_allocator *alloc);
void pe_pending_destroy(pe_pending_table *t, const pe_allocator *alloc);

/* The entry at logical position pos (0 = oldest); pos < len. */
static inline pe_pending_entry *pe_pending_at(pe_pending_table *t, uint32_t pos)
{
    return &t->entries[(t->head + pos) % PE_MAX_PENDING_CHECKPOINTS];
}

/* Logical position of the entry for checkpoint_id, or -1. */
int pe_pending_find(const pe_pending_table *t, int64_t checkpoint_id);

/*
 * Appends a fresh entry (no channel counted, not aborted). When the table is
 * full the oldest entry is dropped first and *evicted_id receives its id
 * (otherwise -1). Returns the new entry.
 */
pe_pending_entry *pe_pending_push_back(pe_pending_table *t, int64_t checkpoint_id,
                                       int64_t *evicted_id);

/* Removes the n oldest entries (n <= len). */
void pe_pending_pop_front(pe_pending_table *t, uint32_t n);

/* Counts channel ch for the entry: 1 if counted now, 0 if it already was. */
static inline int pe_pending_count(pe_pending_entry *e, uint32_t ch)
{
    return pe_bitset_set(&e->seen, ch);
}

typedef struct pe_alignment {
    int64_t checkpoint_id; /* latest checkpoint seen; -1 before the first */
    pe_bitset received;    /* channels that delivered checkpoint_id's barrier */
    uint32_t nchannels;
    uint32_t closed;       /* channels that delivered end of partition */
} pe_alignment;

int pe_alignment_init(pe_alignment *a, uint32_t nchannels, const pe_allocator *alloc);
void pe_alignment_destroy(pe_alignment *a, const pe_allocator *alloc);

/* Starts tracking a new checkpoint id: nothing received yet. */
static inline void pe_alignment_reset(pe_alignment *a, int64_t checkpoint_id)
{
    pe_bitset_clear_all(&a->received);
    a->checkpoint_id = checkpoint_id;
}

/* Records ch's barrier: 1 if new, 0 if ch already delivered it (a corrupt stream). */
static inline int pe_alignment_mark(pe_alignment *a, uint32_t ch)
{
    return pe_bitset_set(&a->received, ch);
}

/* Every channel either delivered the barrier or is closed. */
static inline int pe_alignment_complete(const pe_alignment *a)
{
    return a->received.count + a->closed >= a->nchannels;
}

#endif /* PE_BARRIER_H */
