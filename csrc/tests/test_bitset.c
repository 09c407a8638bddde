#include "pe_bitset.h"
#include "pe_test.h"

static void test_set_clear_count(void)
{
    pe_bitset b;
    CHECK_EQ(pe_bitset_init(&b, 130, pe_default_allocator()), PE_OK);
    CHECK_EQ(b.nwords, 3);
    CHECK_EQ(pe_bitset_set(&b, 0), 1);
    CHECK_EQ(pe_bitset_set(&b, 0), 0);
    CHECK_EQ(pe_bitset_set(&b, 64), 1);
    CHECK_EQ(pe_bitset_set(&b, 129), 1);
    CHECK_EQ(b.count, 3);
    CHECK(pe_bitset_test(&b, 64));
    CHECK(!pe_bitset_test(&b, 63));
    CHECK_EQ(pe_bitset_clear(&b, 64), 1);
    CHECK_EQ(pe_bitset_clear(&b, 64), 0);
    CHECK_EQ(b.count, 2);
    pe_bitset_clear_all(&b);
    CHECK_EQ(b.count, 0);
    CHECK(!pe_bitset_test(&b, 129));
    pe_bitset_destroy(&b, pe_default_allocator());
}

static void test_next(void)
{
    pe_bitset b;
    CHECK_EQ(pe_bitset_init(&b, 200, pe_default_allocator()), PE_OK);
    CHECK_EQ(pe_bitset_next(&b, 0), -1);
    pe_bitset_set(&b, 3);
    pe_bitset_set(&b, 63);
    pe_bitset_set(&b, 64);
    pe_bitset_set(&b, 199);
    CHECK_EQ(pe_bitset_next(&b, 0), 3);
    CHECK_EQ(pe_bitset_next(&b, 3), 3);
    CHECK_EQ(pe_bitset_next(&b, 4), 63);
    CHECK_EQ(pe_bitset_next(&b, 64), 64);
    CHECK_EQ(pe_bitset_next(&b, 65), 199);
    CHECK_EQ(pe_bitset_next(&b, 200), -1);
    pe_bitset_destroy(&b, pe_default_allocator());
}

static void test_max_channels(void)
{
    pe_bitset b;
    uint32_t i, n = 0;
    int64_t j;
    CHECK_EQ(pe_bitset_init(&b, PE_MAX_CHANNELS, pe_default_allocator()), PE_OK);
    for (i = 0; i < PE_MAX_CHANNELS; i += 7) {
        pe_bitset_set(&b, i);
        n++;
    }
    CHECK_EQ(b.count, n);
    i = 0;
    for (j = pe_bitset_next(&b, 0); j >= 0; j = pe_bitset_next(&b, (uint32_t)j + 1)) {
        CHECK_EQ(j % 7, 0);
        i++;
    }
    CHECK_EQ(i, n);
    pe_bitset_destroy(&b, pe_default_allocator());
}

int main(void)
{
    RUN(test_set_clear_count);
    RUN(test_next);
    RUN(test_max_channels);
    FINISH();
}
