#include "pe_tset.h"
#include "pe_test.h"

#include <stdlib.h>

static void test_add_remove_contains(void)
{
    pe_tset s;
    CHECK_EQ(pe_tset_init(&s, 4, pe_default_allocator()), PE_OK);
    CHECK_EQ(pe_tset_add(&s, 7, 1000, pe_default_allocator()), 1);
    CHECK_EQ(pe_tset_add(&s, 7, 1000, pe_default_allocator()), 0); /* one timer per key and timestamp */
    CHECK_EQ(pe_tset_add(&s, 7, 1001, pe_default_allocator()), 1);
    CHECK_EQ(pe_tset_add(&s, 8, 1000, pe_default_allocator()), 1);
    CHECK_EQ(pe_tset_add(&s, 0, 0, pe_default_allocator()), 1); /* zero is a timestamp like any */
    CHECK_EQ(pe_tset_add(&s, 1, PE_TSET_EMPTY, pe_default_allocator()), PE_ERR_ARG);
    CHECK_EQ(s.size, 4);
    CHECK_EQ(pe_tset_contains(&s, 7, 1001), 1);
    CHECK_EQ(pe_tset_contains(&s, 8, 1001), 0);
    CHECK_EQ(pe_tset_contains(&s, 1, PE_TSET_EMPTY), 0);
    CHECK_EQ(pe_tset_remove(&s, 7, 1000), 1);
    CHECK_EQ(pe_tset_remove(&s, 7, 1000), 0);
    CHECK_EQ(pe_tset_remove(&s, 1, PE_TSET_EMPTY), 0);
    CHECK_EQ(pe_tset_contains(&s, 7, 1001), 1);
    CHECK_EQ(s.size, 3);
    pe_tset_destroy(&s, pe_default_allocator());
}

/* Against a plain array model: few keys with many timestamps each, keys that
   share their low hash bits, many removals (backward shifts across the wrap). */
static void test_random_operations_match_a_model(void)
{
    enum { N = 200000, KEYS = 40, TIMES = 300 };
    static unsigned char model[KEYS][TIMES];
    pe_tset s, copy;
    int i, k, t, count = 0;
    unsigned seed = 777;
    int64_t *keys, *ts;
    CHECK_EQ(pe_tset_init(&s, 0, pe_default_allocator()), PE_OK);
    for (i = 0; i < N; i++) {
        int op;
        seed = seed * 1103515245u + 12345u;
        k = (int)((seed >> 8) % KEYS);
        t = (int)((seed >> 16) % TIMES);
        op = (int)((seed >> 28) % 3);
        if (op < 2) {
            int added = pe_tset_add(&s, (int64_t)k * 128, (int64_t)t - 150, pe_default_allocator());
            CHECK_EQ(added, model[k][t] ? 0 : 1);
            count += !model[k][t];
            model[k][t] = 1;
        } else {
            CHECK_EQ(pe_tset_remove(&s, (int64_t)k * 128, (int64_t)t - 150), model[k][t]);
            count -= model[k][t];
            model[k][t] = 0;
        }
        CHECK_EQ(s.size, (uint32_t)count);
    }
    for (k = 0; k < KEYS; k++) {
        for (t = 0; t < TIMES; t++) {
            CHECK_EQ(pe_tset_contains(&s, (int64_t)k * 128, (int64_t)t - 150), model[k][t]);
        }
    }
    CHECK_EQ(pe_tset_copy(&copy, &s, pe_default_allocator()), PE_OK);
    pe_tset_remove(&s, 0, -150);
    pe_tset_add(&s, 999, 1, pe_default_allocator());
    keys = (int64_t *)malloc(sizeof(int64_t) * (copy.size + 1));
    ts = (int64_t *)malloc(sizeof(int64_t) * (copy.size + 1));
    CHECK_EQ(pe_tset_collect(&copy, keys, ts), (uint32_t)count);
    for (i = 0; i < count; i++) {
        CHECK(keys[i] % 128 == 0 && keys[i] / 128 < KEYS);
        CHECK_EQ(model[keys[i] / 128][ts[i] + 150], 1);
    }
    free(keys);
    free(ts);
    pe_tset_destroy(&copy, pe_default_allocator());
    pe_tset_destroy(&s, pe_default_allocator());
}

/* A set made with min_cap 0 has no slots until its first add; every call takes it. */
static void test_a_set_without_slots_yet(void)
{
    pe_tset s, copy;
    int64_t k, t;
    CHECK_EQ(pe_tset_init(&s, 0, pe_default_allocator()), PE_OK);
    CHECK(s.slots == NULL && s.size == 0);
    pe_tset_prefetch(&s, 1, 2);
    CHECK_EQ(pe_tset_contains(&s, 1, 2), 0);
    CHECK_EQ(pe_tset_remove(&s, 1, 2), 0);
    CHECK_EQ(pe_tset_collect(&s, &k, &t), 0u);
    CHECK_EQ(pe_tset_copy(&copy, &s, pe_default_allocator()), PE_OK);
    CHECK(copy.slots == NULL && copy.size == 0);
    pe_tset_destroy(&copy, pe_default_allocator());
    CHECK_EQ(pe_tset_add(&s, 1, PE_TSET_EMPTY, pe_default_allocator()), PE_ERR_ARG);
    CHECK(s.slots == NULL);
    CHECK_EQ(pe_tset_add(&s, 1, 2, pe_default_allocator()), 1);
    CHECK(s.slots != NULL && s.cap == 16 && s.size == 1);
    CHECK_EQ(pe_tset_contains(&s, 1, 2), 1);
    CHECK_EQ(pe_tset_remove(&s, 1, 2), 1);
    pe_tset_destroy(&s, pe_default_allocator());
    pe_tset_destroy(&s, pe_default_allocator()); /* twice: NULL again, nothing to free */
}

int main(void)
{
    RUN(test_add_remove_contains);
    RUN(test_a_set_without_slots_yet);
    RUN(test_random_operations_match_a_model);
    FINISH();
}
