/* Minimal assertion helpers for the C unit tests: fail loudly with file:line. */
#ifndef PE_TEST_H
#define PE_TEST_H

#include <stdio.h>
#include <stdlib.h>

static int pe_test_failures = 0;

#define CHECK(cond)                                                              \
    do {                                                                         \
        if (!(cond)) {                                                           \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            pe_test_failures++;                                                  \
        }                                                                        \
    } while (0)

#define CHECK_EQ(a, b)                                                           \
    do {                                                                         \
        long long pe_a_ = (long long)(a), pe_b_ = (long long)(b);                \
        if (pe_a_ != pe_b_) {                                                    \
            fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%lld != %lld)\n", \
                    __FILE__, __LINE__, #a, #b, pe_a_, pe_b_);                   \
            pe_test_failures++;                                                  \
        }                                                                        \
    } while (0)

#define RUN(test)                                                                \
    do {                                                                         \
        int before_ = pe_test_failures;                                          \
        test();                                                                  \
        printf("%s %s\n", pe_test_failures == before_ ? "ok  " : "FAIL", #test); \
    } while (0)

#define FINISH() return pe_test_failures == 0 ? 0 : 1

#endif
