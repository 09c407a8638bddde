#include "pe_chanqueue.h"
#include "pe_test.h"

static void test_round_robin_order(void)
{
    pe_chanqueue q;
    CHECK_EQ(pe_chanqueue_init(&q, 5, pe_default_allocator()), PE_OK);
    CHECK_EQ(pe_chanqueue_pop(&q), -1);
    CHECK_EQ(pe_chanqueue_push(&q, 3), 1);
    CHECK_EQ(pe_chanqueue_push(&q, 1), 1);
    CHECK_EQ(pe_chanqueue_push(&q, 3), 0); /* already queued */
    CHECK_EQ(pe_chanqueue_len(&q), 2);
    CHECK_EQ(pe_chanqueue_peek(&q), 3);
    CHECK_EQ(pe_chanqueue_pop(&q), 3);
    CHECK(!pe_chanqueue_contains(&q, 3));
    CHECK_EQ(pe_chanqueue_push(&q, 3), 1); /* re-queued at the back */
    CHECK_EQ(pe_chanqueue_pop(&q), 1);
    CHECK_EQ(pe_chanqueue_pop(&q), 3);
    CHECK_EQ(pe_chanqueue_pop(&q), -1);
    pe_chanqueue_destroy(&q, pe_default_allocator());
}

static void test_never_overflows(void)
{
    pe_chanqueue q;
    uint32_t round, ch;
    CHECK_EQ(pe_chanqueue_init(&q, 1000, pe_default_allocator()), PE_OK);
    for (round = 0; round < 10; round++) {
        for (ch = 0; ch < 1000; ch++) {
            pe_chanqueue_push(&q, (ch * 7 + round) % 1000);
        }
        CHECK_EQ(pe_chanqueue_len(&q), 1000);
        for (ch = 0; ch < 1000; ch++) {
            CHECK_EQ(pe_chanqueue_pop(&q), (int64_t)((ch * 7 + round) % 1000));
        }
    }
    pe_chanqueue_destroy(&q, pe_default_allocator());
}

int main(void)
{
    RUN(test_round_robin_order);
    RUN(test_never_overflows);
    FINISH();
}
