/*
 * Blocking without the GIL: the consumer waits for data, producers wait for
 * space. Sequence numbers rather than predicates make a wake-up impossible to
 * lose: a waiter records the sequence it saw while it still held its own lock
 * (the GIL in the bindings) and sleeps only while the sequence is unchanged.
 * Signalling is skipped entirely when nobody waits, so the per-buffer path
 * pays for the mutex only when a thread is actually blocked.
 */
#ifndef PE_WAITER_H
#define PE_WAITER_H

#include "pe_common.h"

#include <pthread.h>

typedef struct pe_waiter {
    pthread_mutex_t mu;
    pthread_cond_t data_cv;
    pthread_cond_t space_cv;
    uint64_t data_seq;
    uint64_t space_seq;
    uint32_t data_waiters;  /* guarded by the caller's lock, not mu */
    uint32_t space_waiters; /* guarded by the caller's lock, not mu */
} pe_waiter;

int pe_waiter_init(pe_waiter *w);
void pe_waiter_destroy(pe_waiter *w);

/* Bumps the sequence and wakes every waiter. */
void pe_waiter_signal_data(pe_waiter *w);
void pe_waiter_signal_space(pe_waiter *w);

uint64_t pe_waiter_data_seq(pe_waiter *w);
uint64_t pe_waiter_space_seq(pe_waiter *w);

/*
 * Sleeps until the sequence differs from seen or the monotonic clock passes
 * deadline_ns (deadline_ns < 0: no deadline). 1 when woken by a signal, 0 on
 * timeout.
 */
int pe_waiter_wait_data(pe_waiter *w, uint64_t seen, int64_t deadline_ns);
int pe_waiter_wait_space(pe_waiter *w, uint64_t seen, int64_t deadline_ns);

int64_t pe_monotonic_ns(void);
int64_t pe_wall_ns(void);

#endif /* PE_WAITER_H */
