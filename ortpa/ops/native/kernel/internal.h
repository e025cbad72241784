// Internal to the kernel: the validated parameters of one call, element conversions, the attention entry
// points of each ISA path. Not part of the C interface (paged_attention.h).
#ifndef ORTPA_OPS_NATIVE_KERNEL_INTERNAL_H_
#define ORTPA_OPS_NATIVE_KERNEL_INTERNAL_H_

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "paged_attention.h"

namespace ortpa_native {

enum QuantType { kQuantNone = 0, kQuantPerTensor = 1, kQuantPerChannel = 2 };

// Everything the compute needs, derived and checked by validate(); sizes are int64 throughout.
struct Params {
  int act_type = 0;    // OrtpaElemType of T
  int kcache_type = 0; // storage element type of key_cache (value_cache has the same, T_CACHE binds both)
  int64_t tokens = 0, num_heads = 0, kv_heads = 0, head_size = 0, v_head_size = 0;
  int64_t q_stride = 0, q_offset = 0;  // query row stride and where Q starts in it
  int64_t k_stride = 0, k_offset = 0;  // key rows: the key input, or the packed row's K part
  int64_t v_stride = 0, v_offset = 0;
  const void* k_src = nullptr;
  const void* v_src = nullptr;
  int64_t batch = 0, num_blocks = 0, block_size = 0, max_blocks = 0;
  int64_t cache_row = 0;  // elements (bytes for int4) per [block, slot, kv head] row of the cache
  bool latent = false, packed = false, causal = true, rotary = false, interleaved = false;
  int64_t rotary_offset = 0, rotary_dim = 0, cos_rows = 0;
  int64_t window = -1;
  float scale = 1.0f, softcap = 0.0f, eps = 1e-6f;
  bool qk_norm = false, has_sink = false, has_slots = false;
  int k_quant = kQuantNone, v_quant = kQuantNone;
  bool int4 = false;
};

struct Error {
  std::string text;  // "[rule] input: message", as ortpa.errors.InvalidArgument prints
  bool failed() const { return !text.empty(); }
};

// Validate the whole call as ortpa.ops.validate.check_inputs does (same rules, same order, same wording);
// returns false with err set on the first broken rule.
bool validate(const OrtpaPagedAttentionArgs& a, Params* p, Error* err);

// ---- element conversions (exact, round-to-nearest-even like NumPy / ml_dtypes) -----------------------

inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return bits_to_float(sign);
    float v = std::ldexp((float)mant, -24);  // subnormal: mant * 2^-24, exact in float32
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));  // inf / nan
  if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520: overflow to inf
  if (a < 0x38800000u) {  // below the smallest normal 2^-14: subnormal, quantum 2^-24
    float v = bits_to_float(a) * 16777216.0f;  // exact (power of two scaling)
    return (uint16_t)(sign | (uint16_t)std::nearbyint(v));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);  // round the 13 dropped bits to nearest even
  return (uint16_t)(sign | (((r >> 13) - (112u << 10)) & 0x7fffu));
}

inline float bf16_to_float(uint16_t b) { return bits_to_float((uint32_t)b << 16); }

inline uint16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  // quiet nan
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline float fp8_to_float(uint8_t v) {
  uint32_t sign = (uint32_t)(v & 0x80u) << 24;
  uint32_t exp = (v >> 3) & 0xfu, mant = v & 7u;
  if (exp == 0xf && mant == 7) return bits_to_float(sign | 0x7fc00000u);
  if (exp == 0) {
    float x = std::ldexp((float)mant, -9);
    return sign ? -x : x;
  }
  return bits_to_float(sign | ((exp + 120) << 23) | (mant << 20));
}

// float8 e4m3fn of a value already clamped to [-448, 448] (NaN stays NaN).
inline uint8_t float_to_fp8(float f) {
  uint32_t u = float_to_bits(f);
  uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return (uint8_t)(sign | 0x7fu);
  if (a > 0x43e00000u) a = 0x43e00000u;    // 448, the largest finite value
  if (a < 0x3c800000u) {                    // below 2^-6: subnormal, quantum 2^-9
    float v = bits_to_float(a) * 512.0f;    // exact
    return (uint8_t)(sign | (uint8_t)std::nearbyint(v));  // 8 rounds up into the smallest normal, 0x08
  }
  uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
  return (uint8_t)(sign | (((r >> 20) - (120u << 3)) & 0x7fu));
}

inline float load_act(const void* base, int type, int64_t i) {
  switch (type) {
    case ORTPA_ELEM_FLOAT16: return half_to_float(static_cast<const uint16_t*>(base)[i]);
    case ORTPA_ELEM_BFLOAT16: return bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return static_cast<const float*>(base)[i];
  }
}

// Round a float32 to the activation type T and back (identity for float32).
inline float round_act(float x, int type) {
  switch (type) {
    case ORTPA_ELEM_FLOAT16: return half_to_float(float_to_half(x));
    case ORTPA_ELEM_BFLOAT16: return bf16_to_float(float_to_bf16(x));
    default: return x;
  }
}

inline void store_act(void* base, int type, int64_t i, float x) {
  switch (type) {
    case ORTPA_ELEM_FLOAT16: static_cast<uint16_t*>(base)[i] = float_to_half(x); break;
    case ORTPA_ELEM_BFLOAT16: static_cast<uint16_t*>(base)[i] = float_to_bf16(x); break;
    default: static_cast<float*>(base)[i] = x;
  }
}

// ---- attention: one ISA path per translation unit --------------------------------------------------

// The read side of one cache (key or value): where rows are, how to decode them.
struct CacheView {
  const uint8_t* data = nullptr;  // the cache tensor's bytes
  int type = 0;                   // storage element type
  int64_t row_bytes = 0;          // bytes per [block, slot, kv head] row
  int64_t width = 0;              // logical channels decoded from a row (head_size, or v_head_size in LATENT)
  const float* scale = nullptr;   // per channel [kv_heads, head_size] (broadcast from PER_TENSOR), or null
};

// One sequence's attention work, prepared by the driver (all indices already sanitized and bounded).
struct AttendJob {
  const float* q;        // [tokens, num_heads, head_size], post-prologue, float32
  void* out;             // output [tokens, num_heads * v_head_size] in T
  int out_type;
  const int64_t* pages;  // sanitized block table row of the sequence (-1 = unmapped), max_blocks entries
  int64_t t0, t1;        // the sequence's tokens
  int64_t past, kvlen;
};

struct AttendShape {
  int64_t num_heads, kv_heads, head_size, v_head_size, block_size, max_blocks;
  bool causal, latent;
  int64_t window;
  float scale, softcap;
  const float* sink;       // [num_heads] float32 or null
  const float* fp8_table;  // the 256 float8 e4m3fn values
  CacheView k, v;     // v unused in LATENT (V is the leading v_head_size channels of the K row)
};

// One unit of work: sequence job, KV heads [kv_head, kv_head + kv_heads), query tile [i0, i1) (token offsets
// within the sequence), key range [j0, j1). Partial results (m, l, acc per row, rows ordered as the tile's)
// go to `part` when a decode's key range is split.
struct Tile {
  int32_t job;
  int32_t kv_head;
  int32_t kv_heads;
  int64_t i0, i1, j0, j1;
  float* part;  // null: write the output directly; else [rows][2 + v_head_size] (m, l, acc)
};

typedef void (*AttendFn)(const AttendShape& s, const AttendJob* jobs, const Tile& tile, float* scratch);

void attend_tile_baseline(const AttendShape& s, const AttendJob* jobs, const Tile& tile, float* scratch);
#if defined(__x86_64__) || defined(_M_X64)
void attend_tile_avx2(const AttendShape& s, const AttendJob* jobs, const Tile& tile, float* scratch);
#endif

// float16 <-> float32 rows with F16C (the AVX2 path; call only where cpu_has_avx2()): the same values as
// half_to_float / float_to_half, round to nearest even, subnormals and overflow included; a NaN is stored as
// float_to_half stores it. rope_f16_avx2 is RoPE of one head in float16 arithmetic, non-interleaved halves xa
// and xb (n channels each), every product and sum rounded to float16 as prologue_token's scalar loop does.
#if defined(__x86_64__) || defined(_M_X64)
void f16_to_f32_avx2(const uint16_t* src, float* dst, int64_t n);
void f32_to_f16_avx2(const float* src, uint16_t* dst, int64_t n);
void rope_f16_avx2(float* xa, float* xb, const float* cs, const float* sn, int64_t n);
#endif

// Floats of scratch one attend_tile call needs for tiles of up to q_tile tokens and kv_heads KV heads.
int64_t attend_scratch_floats(const AttendShape& s, int64_t q_tile, int64_t kv_heads);

// Query tokens per tile of a prefill (a decode is one token).
constexpr int64_t kQueryTile = 16;

// Keys per part of a decode row's split key range (rounded to whole pages).
constexpr int64_t kDecodePart = 512;

// A call with fewer short decode tiles than this (and no prefill) cuts each one by KV heads, so that a single
// sequence's decode still spreads over the threads. A head's result does not depend on which heads share its tile.
constexpr int64_t kDecodeTilesMin = 4;

// How far ahead of the page being computed the attention loop prefetches: about this many bytes of K and V rows,
// in whole pages, at least one and at most kPrefetchPages (measured, batch-4 / context-2048 decode: 1 page ahead
// of 64 KB pages (8 KV heads x 128) 2-4% faster than 3; 3 ahead of 16 KB pages (4 x 64) as fast as 2 or 4).
constexpr int64_t kPrefetchBytes = 48 << 10;
constexpr int64_t kPrefetchPages = 3;
// Before its loop a tile fetches its first pages, up to this many bytes of K and V rows (at least `ahead` pages).
constexpr int64_t kPrefetchBurstBytes = 128 << 10;

}  // namespace ortpa_native

#endif  // ORTPA_OPS_NATIVE_KERNEL_INTERNAL_H_
