// The attention tile for AVX2 + FMA + F16C, chosen at run time (ortpa_native_isa) on CPUs that have them.
// Every standard header is included before the target pragma, so no library inline function or template is
// compiled for AVX2 here (a wider copy of one could otherwise be picked by the linker for every caller).
#include "internal.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace ortpa_native {
#define ORTPA_ATTEND_AVX2 1
#define ORTPA_ATTEND_FN attend_tile_avx2
#include "attend_impl.inc"
#undef ORTPA_ATTEND_FN
#undef ORTPA_ATTEND_AVX2
}  // namespace ortpa_native

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
#endif
