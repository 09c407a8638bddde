/*
 * pyengine native core: shared definitions.
 *
 * Plain C99 with no dependency on Python. Every structure that allocates takes
 * a pe_allocator so the bindings can route memory through Python's raw
 * allocator (visible to tracemalloc) while C tests use the C library's.
 */
#ifndef PE_COMMON_H
#define PE_COMMON_H

#include <stddef.h>
#include <stdint.h>

#define PE_MAX_CHANNELS 65536u

enum {
    PE_OK = 0,
    PE_ERR_NOMEM = -1,
    PE_ERR_ARG = -2
};

typedef struct pe_allocator {
    void *(*calloc)(size_t nmemb, size_t size);
    void (*free)(void *ptr);
} pe_allocator;

/* The C library's calloc/free. */
const pe_allocator *pe_default_allocator(void);

/* Smallest power of two >= v (v <= 2^31); 1 for v == 0. */
static inline uint32_t pe_next_pow2(uint32_t v)
{
    uint32_t p = 1;
    while (p < v) {
        p <<= 1;
    }
    return p;
}

/* A hint that the cache line at p will be read soon; nothing where the compiler has
   no such builtin (MSVC). */
#if defined(__GNUC__) || defined(__clang__)
#define PE_PREFETCH(p) __builtin_prefetch((const void *)(p), 0, 3)
#else
#define PE_PREFETCH(p) ((void)(p))
#endif

/* For a static inline function that only prefetches: GCC 12 at -O2/-O3 may judge
   such a function free of side effects and delete a call it did not inline, and
   with it the prefetch (seen with pe_tset_prefetch, whose hash made it too big to
   inline early). Forced inline, the prefetch stays at the call site. */
#if defined(__GNUC__) || defined(__clang__)
#define PE_PREFETCH_INLINE static inline __attribute__((always_inline))
#else
#define PE_PREFETCH_INLINE static inline
#endif

#endif /* PE_COMMON_H */
