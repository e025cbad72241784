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

namespace {
// float16 rounding of 8 floats (round to nearest even: F16C's conversion, exact like float_to_half)
inline __m256 round8_f16(__m256 x) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
}  // namespace

void f16_to_f32_avx2(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

void f32_to_f16_avx2(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0) {  // a NaN: float_to_half's bits for it
      for (int64_t j = i; j < i + 8; ++j) dst[j] = float_to_half(src[j]);
      continue;
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  for (; i < n; ++i) dst[i] = float_to_half(src[i]);
}

void rope_f16_avx2(float* xa, float* xb, const float* cs, const float* sn, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_loadu_ps(xa + i), b = _mm256_loadu_ps(xb + i);
    const __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(sn + i);
    const __m256 na = round8_f16(_mm256_sub_ps(round8_f16(_mm256_mul_ps(a, c)), round8_f16(_mm256_mul_ps(b, s))));
    const __m256 nb = round8_f16(_mm256_add_ps(round8_f16(_mm256_mul_ps(b, c)), round8_f16(_mm256_mul_ps(a, s))));
    _mm256_storeu_ps(xa + i, na);
    _mm256_storeu_ps(xb + i, nb);
  }
  const int T = ORTPA_ELEM_FLOAT16;
  for (; i < n; ++i) {
    const float a = xa[i], b = xb[i];
    xa[i] = round_act(round_act(a * cs[i], T) - round_act(b * sn[i], T), T);
    xb[i] = round_act(round_act(b * cs[i], T) + round_act(a * sn[i], T), T);
  }
}
}  // namespace ortpa_native

#if defined(__clang__)
#pragma clang attribute pop
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif
#endif
