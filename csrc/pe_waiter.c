#define _POSIX_C_SOURCE 200809L
#include "pe_waiter.h"

#include <time.h>

int pe_waiter_init(pe_waiter *w)
{
    pthread_condattr_t attr;
    w->data_seq = 0;
    w->space_seq = 0;
    w->data_waiters = 0;
    w->space_waiters = 0;
    if (pthread_mutex_init(&w->mu, NULL) != 0) {
        return PE_ERR_NOMEM;
    }
    if (pthread_condattr_init(&attr) != 0) {
        pthread_mutex_destroy(&w->mu);
        return PE_ERR_NOMEM;
    }
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    if (pthread_cond_init(&w->data_cv, &attr) != 0) {
        pthread_condattr_destroy(&attr);
        pthread_mutex_destroy(&w->mu);
        return PE_ERR_NOMEM;
    }
    if (pthread_cond_init(&w->space_cv, &attr) != 0) {
        pthread_cond_destroy(&w->data_cv);
        pthread_condattr_destroy(&attr);
        pthread_mutex_destroy(&w->mu);
        return PE_ERR_NOMEM;
    }
    pthread_condattr_destroy(&attr);
    return PE_OK;
}

void pe_waiter_destroy(pe_waiter *w)
{
    pthread_cond_destroy(&w->space_cv);
    pthread_cond_destroy(&w->data_cv);
    pthread_mutex_destroy(&w->mu);
}

static void pe_signal(pe_waiter *w, uint64_t *seq, pthread_cond_t *cv)
{
    pthread_mutex_lock(&w->mu);
    (*seq)++;
    pthread_cond_broadcast(cv);
    pthread_mutex_unlock(&w->mu);
}

void pe_waiter_signal_data(pe_waiter *w)
{
    pe_signal(w, &w->data_seq, &w->data_cv);
}

void pe_waiter_signal_space(pe_waiter *w)
{
    pe_signal(w, &w->space_seq, &w->space_cv);
}

static uint64_t pe_read_seq(pe_waiter *w, const uint64_t *seq)
{
    uint64_t v;
    pthread_mutex_lock(&w->mu);
    v = *seq;
    pthread_mutex_unlock(&w->mu);
    return v;
}

uint64_t pe_waiter_data_seq(pe_waiter *w)
{
    return pe_read_seq(w, &w->data_seq);
}

uint64_t pe_waiter_space_seq(pe_waiter *w)
{
    return pe_read_seq(w, &w->space_seq);
}

static int pe_wait(pe_waiter *w, const uint64_t *seq, pthread_cond_t *cv, uint64_t seen,
                   int64_t deadline_ns)
{
    int woken = 1;
    struct timespec ts;
    if (deadline_ns >= 0) {
        ts.tv_sec = (time_t)(deadline_ns / 1000000000LL);
        ts.tv_nsec = (long)(deadline_ns % 1000000000LL);
    }
    pthread_mutex_lock(&w->mu);
    while (*seq == seen) {
        if (deadline_ns < 0) {
            pthread_cond_wait(cv, &w->mu);
        } else if (pthread_cond_timedwait(cv, &w->mu, &ts) != 0 && *seq == seen) {
            woken = 0;
            break;
        }
    }
    pthread_mutex_unlock(&w->mu);
    return woken;
}

int pe_waiter_wait_data(pe_waiter *w, uint64_t seen, int64_t deadline_ns)
{
    return pe_wait(w, &w->data_seq, &w->data_cv, seen, deadline_ns);
}

int pe_waiter_wait_space(pe_waiter *w, uint64_t seen, int64_t deadline_ns)
{
    return pe_wait(w, &w->space_seq, &w->space_cv, seen, deadline_ns);
}

int64_t pe_monotonic_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int64_t pe_wall_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}
