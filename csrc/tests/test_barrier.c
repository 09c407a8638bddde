#include "pe_barrier.h"
#include "pe_test.h"

static void test_pending_find_and_pop(void)
{
    pe_pending_table t;
    int64_t evicted;
    pe_pending_entry *e;
    CHECK_EQ(pe_pending_init(&t, 3, pe_default_allocator()), PE_OK);
    e = pe_pending_push_back(&t, 5, &evicted);
    CHECK_EQ(evicted, -1);
    CHECK_EQ(pe_pending_count(e, 0), 1);
    CHECK_EQ(pe_pending_count(e, 0), 0); /* repeated channel */
    CHECK_EQ(pe_pending_count(e, 2), 1);
    CHECK_EQ(e->seen.count, 2);
    pe_pending_push_back(&t, 7, &evicted);
    pe_pending_push_back(&t, 9, &evicted);
    CHECK_EQ(pe_pending_find(&t, 7), 1);
    CHECK_EQ(pe_pending_find(&t, 8), -1);
    pe_pending_pop_front(&t, 2);
    CHECK_EQ(t.len, 1);
    CHECK_EQ(pe_pending_at(&t, 0)->checkpoint_id, 9);
    CHECK_EQ(pe_pending_at(&t, 0)->seen.count, 0);
    pe_pending_destroy(&t, pe_default_allocator());
}

static void test_pending_evicts_oldest_beyond_limit(void)
{
    pe_pending_table t;
    int64_t evicted, id;
    CHECK_EQ(pe_pending_init(&t, 2, pe_default_allocator()), PE_OK);
    for (id = 1; id <= (int64_t)PE_MAX_PENDING_CHECKPOINTS; id++) {
        pe_pending_entry *e = pe_pending_push_back(&t, id, &evicted);
        pe_pending_count(e, 1);
        CHECK_EQ(evicted, -1);
    }
    pe_pending_push_back(&t, 100, &evicted);
    CHECK_EQ(evicted, 1);
    CHECK_EQ(t.len, PE_MAX_PENDING_CHECKPOINTS);
    CHECK_EQ(pe_pending_at(&t, 0)->checkpoint_id, 2);
    /* The recycled slot starts clean. */
    CHECK_EQ(pe_pending_at(&t, t.len - 1)->seen.count, 0);
    CHECK_EQ(pe_pending_find(&t, 100), (int)PE_MAX_PENDING_CHECKPOINTS - 1);
    pe_pending_destroy(&t, pe_default_allocator());
}

static void test_alignment_counts_closed_channels(void)
{
    pe_alignment a;
    CHECK_EQ(pe_alignment_init(&a, 4, pe_default_allocator()), PE_OK);
    CHECK_EQ(a.checkpoint_id, -1);
    pe_alignment_reset(&a, 3);
    a.closed = 2;
    CHECK_EQ(pe_alignment_mark(&a, 0), 1);
    CHECK(!pe_alignment_complete(&a));
    CHECK_EQ(pe_alignment_mark(&a, 0), 0);
    CHECK_EQ(pe_alignment_mark(&a, 3), 1);
    CHECK(pe_alignment_complete(&a));
    pe_alignment_reset(&a, 4);
    CHECK_EQ(a.received.count, 0);
    CHECK_EQ(a.checkpoint_id, 4);
    pe_alignment_destroy(&a, pe_default_allocator());
}

int main(void)
{
    RUN(test_pending_find_and_pop);
    RUN(test_pending_evicts_oldest_beyond_limit);
    RUN(test_alignment_counts_closed_channels);
    FINISH();
}
