#include "pe_i64map.h"
#include "pe_test.h"

#include <stdlib.h>

static void test_put_get_replace_remove(void)
{
    pe_i64map m;
    int64_t old = 0;
    CHECK_EQ(pe_i64map_init(&m, 4, pe_default_allocator()), PE_OK);
    CHECK_EQ(pe_i64map_get(&m, 42), -1);
    CHECK_EQ(pe_i64map_put(&m, 42, 7, pe_default_allocator()), 1);
    CHECK_EQ(pe_i64map_put(&m, 42, 8, pe_default_allocator()), 0);
    CHECK_EQ(pe_i64map_get(&m, 42), 8);
    CHECK_EQ(pe_i64map_put(&m, -9223372036854775807LL - 1, 1, pe_default_allocator()), 1);
    CHECK_EQ(pe_i64map_get(&m, -9223372036854775807LL - 1), 1);
    CHECK_EQ(pe_i64map_remove(&m, 42, &old), 1);
    CHECK_EQ(old, 8);
    CHECK_EQ(pe_i64map_remove(&m, 42, &old), 0);
    CHECK_EQ(m.size, 1);
    /* values are positions: a negative one (or one with no room for the empty mark) is refused */
    CHECK_EQ(pe_i64map_put(&m, 5, -1, pe_default_allocator()), PE_ERR_ARG);
    CHECK_EQ(pe_i64map_put(&m, 5, INT64_MAX, pe_default_allocator()), PE_ERR_ARG);
    CHECK_EQ(pe_i64map_get(&m, 5), -1);
    CHECK_EQ(pe_i64map_put(&m, 5, 0, pe_default_allocator()), 1);
    CHECK_EQ(pe_i64map_get(&m, 5), 0);
    CHECK_EQ(m.size, 2);
    pe_i64map_destroy(&m, pe_default_allocator());
}

/* Against a plain array model, with keys that all share their low hash bits
   (as the keys of one key group do) and many removals. */
static void test_random_operations_match_a_model(void)
{
    enum { N = 20000, KEYS = 3000 };
    static int64_t model[KEYS];
    static int present[KEYS];
    pe_i64map m;
    int i, k;
    unsigned seed = 12345;
    CHECK_EQ(pe_i64map_init(&m, 1, pe_default_allocator()), PE_OK);
    for (i = 0; i < N; i++) {
        seed = seed * 1103515245u + 12345u;
        k = (int)((seed >> 8) % KEYS);
        if ((seed >> 4) % 3 == 0) {
            int64_t old;
            CHECK_EQ(pe_i64map_remove(&m, (int64_t)k * 128, &old), present[k]);
            if (present[k]) {
                CHECK_EQ(old, model[k]);
            }
            present[k] = 0;
        } else {
            CHECK_EQ(pe_i64map_put(&m, (int64_t)k * 128, i, pe_default_allocator()), !present[k]);
            model[k] = i;
            present[k] = 1;
        }
    }
    for (k = 0; k < KEYS; k++) {
        CHECK_EQ(pe_i64map_get(&m, (int64_t)k * 128), present[k] ? model[k] : -1);
    }
    pe_i64map_destroy(&m, pe_default_allocator());
}

int main(void)
{
    RUN(test_put_get_replace_remove);
    RUN(test_random_operations_match_a_model);
    FINISH();
}
