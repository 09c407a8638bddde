#define _POSIX_C_SOURCE 200809L
#include "pe_waiter.h"
#include "pe_test.h"

#include <pthread.h>
#include <time.h>

static pe_waiter w;

static void *signaller(void *arg)
{
    struct timespec ts = {0, 20 * 1000 * 1000};
    (void)arg;
    nanosleep(&ts, NULL);
    pe_waiter_signal_data(&w);
    return NULL;
}

static void test_timeout_without_signal(void)
{
    int64_t start = pe_monotonic_ns();
    uint64_t seen = pe_waiter_data_seq(&w);
    CHECK_EQ(pe_waiter_wait_data(&w, seen, start + 10 * 1000 * 1000), 0);
    CHECK(pe_monotonic_ns() - start >= 10 * 1000 * 1000);
}

static void test_signal_wakes_waiter(void)
{
    pthread_t t;
    uint64_t seen = pe_waiter_data_seq(&w);
    int64_t deadline = pe_monotonic_ns() + 5LL * 1000 * 1000 * 1000;
    pthread_create(&t, NULL, signaller, NULL);
    CHECK_EQ(pe_waiter_wait_data(&w, seen, deadline), 1);
    CHECK(pe_monotonic_ns() < deadline);
    pthread_join(t, NULL);
}

static void test_signal_before_wait_is_not_lost(void)
{
    uint64_t seen = pe_waiter_space_seq(&w);
    pe_waiter_signal_space(&w);
    /* No deadline: would hang forever if the earlier signal were lost. */
    CHECK_EQ(pe_waiter_wait_space(&w, seen, -1), 1);
}

int main(void)
{
    CHECK_EQ(pe_waiter_init(&w), PE_OK);
    RUN(test_timeout_without_signal);
    RUN(test_signal_wakes_waiter);
    RUN(test_signal_before_wait_is_not_lost);
    pe_waiter_destroy(&w);
    FINISH();
}
