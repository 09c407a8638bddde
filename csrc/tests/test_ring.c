#include "pe_ring.h"
#include "pe_test.h"

static int items[64];

static void test_fifo_and_capacity(void)
{
    pe_rings r;
    int i;
    CHECK_EQ(pe_rings_init(&r, 3, 5, pe_default_allocator()), PE_OK);
    CHECK_EQ(r.slot_cap, 8);
    for (i = 0; i < 8; i++) {
        CHECK_EQ(pe_rings_push(&r, 1, &items[i]), 0);
    }
    CHECK_EQ(pe_rings_push(&r, 1, &items[8]), -1);
    CHECK_EQ(pe_rings_len(&r, 1), 8);
    CHECK_EQ(pe_rings_len(&r, 0), 0);
    CHECK(pe_rings_peek(&r, 1, 7) == &items[7]);
    CHECK(pe_rings_peek(&r, 1, 8) == NULL);
    for (i = 0; i < 8; i++) {
        CHECK(pe_rings_pop(&r, 1) == &items[i]);
    }
    CHECK(pe_rings_pop(&r, 1) == NULL);
    pe_rings_destroy(&r, pe_default_allocator());
}

static void test_wraparound(void)
{
    pe_rings r;
    int i, next_in = 0, next_out = 0;
    CHECK_EQ(pe_rings_init(&r, 1, 4, pe_default_allocator()), PE_OK);
    /* Keep the counters wrapping over the slots many times. */
    for (i = 0; i < 1000; i++) {
        while (pe_rings_push(&r, 0, &items[next_in % 64]) == 0) {
            next_in++;
        }
        CHECK(pe_rings_pop(&r, 0) == &items[next_out % 64]);
        next_out++;
    }
    CHECK_EQ(pe_rings_len(&r, 0), (uint32_t)(next_in - next_out));
    pe_rings_destroy(&r, pe_default_allocator());
}

static void test_remove_at_keeps_order(void)
{
    pe_rings r;
    int i;
    CHECK_EQ(pe_rings_init(&r, 2, 8, pe_default_allocator()), PE_OK);
    /* Offset the head so the shift crosses the slot boundary. */
    for (i = 0; i < 6; i++) {
        pe_rings_push(&r, 0, &items[0]);
        pe_rings_pop(&r, 0);
    }
    for (i = 0; i < 6; i++) {
        CHECK_EQ(pe_rings_push(&r, 0, &items[i]), 0);
    }
    CHECK(pe_rings_remove_at(&r, 0, 3) == &items[3]);
    CHECK_EQ(pe_rings_len(&r, 0), 5);
    CHECK(pe_rings_pop(&r, 0) == &items[0]);
    CHECK(pe_rings_pop(&r, 0) == &items[1]);
    CHECK(pe_rings_pop(&r, 0) == &items[2]);
    CHECK(pe_rings_pop(&r, 0) == &items[4]);
    CHECK(pe_rings_pop(&r, 0) == &items[5]);
    CHECK(pe_rings_remove_at(&r, 0, 0) == NULL);
    CHECK_EQ(pe_rings_len(&r, 1), 0);
    pe_rings_destroy(&r, pe_default_allocator());
}

static void test_bad_arguments(void)
{
    pe_rings r;
    CHECK_EQ(pe_rings_init(&r, 0, 4, pe_default_allocator()), PE_ERR_ARG);
    CHECK_EQ(pe_rings_init(&r, PE_MAX_CHANNELS + 1, 4, pe_default_allocator()), PE_ERR_ARG);
    CHECK_EQ(pe_rings_init(&r, 4, 0, pe_default_allocator()), PE_ERR_ARG);
}

int main(void)
{
    RUN(test_fifo_and_capacity);
    RUN(test_wraparound);
    RUN(test_remove_at_keeps_order);
    RUN(test_bad_arguments);
    FINISH();
}
