#include "pe_common.h"

#include <stdlib.h>

static const pe_allocator pe_libc_allocator = {calloc, free};

const pe_allocator *pe_default_allocator(void)
{
    return &pe_libc_allocator;
}
