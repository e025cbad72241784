// A standalone fuzz driver for the native PagedAttention kernel, built with AddressSanitizer and
// UndefinedBehaviorSanitizer by test_native_kernel_sanitizers.py (a standalone program needs no LD_PRELOAD of
// the ASan runtime into Python). Every tensor is its own heap allocation of exactly the size its dims describe,
// so a read or write past any input is caught. Calls mix valid and hostile inputs: any int32 in the index
// inputs, shapes that disagree, every cache type and layout; the kernel must return 0 or an error, nothing
// else. Usage: fuzz_driver ITERATIONS SEED; prints "calls N ok N refused N".
#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "paged_attention.h"

namespace {

std::mt19937_64 rng;

int64_t pick(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); }
bool coin(int one_in) { return pick(0, one_in - 1) == 0; }

int64_t elem_size(int t) {
  switch (t) {
    case ORTPA_ELEM_FLOAT32: case ORTPA_ELEM_INT32: return 4;
    case ORTPA_ELEM_FLOAT16: case ORTPA_ELEM_BFLOAT16: return 2;
    default: return 1;
  }
}

struct Buffers {
  std::vector<void*> owned;
  ~Buffers() {
    for (void* p : owned) std::free(p);
  }
  // a tensor of the given dims, its bytes random (floats: any bit pattern, so NaN/Inf too, unless tame)
  void make(OrtpaTensor* t, int type, std::vector<int64_t> dims, bool tame = true) {
    t->elem_type = type;
    t->rank = (int32_t)dims.size();
    int64_t n = 1;
    for (size_t i = 0; i < dims.size(); ++i) {
      t->dims[i] = dims[i];
      n *= dims[i];
    }
    const size_t bytes = (size_t)(n * elem_size(type));
    void* p = std::malloc(bytes ? bytes : 1);
    owned.push_back(p);
    uint8_t* b = static_cast<uint8_t*>(p);
    for (size_t i = 0; i < bytes; ++i) b[i] = (uint8_t)pick(0, 255);
    if (tame && (type == ORTPA_ELEM_FLOAT16 || type == ORTPA_ELEM_BFLOAT16))
      for (size_t i = 1; i < bytes; i += 2) b[i] &= 0x3f;  // small finite values, mostly
    if (tame && type == ORTPA_ELEM_FLOAT32)
      for (int64_t i = 0; i < n; ++i) static_cast<float*>(p)[i] = (float)pick(-1000, 1000) / 500.0f;
    t->data = p;
  }
  void ints(OrtpaTensor* t, std::vector<int64_t> dims, int64_t lo, int64_t hi) {
    make(t, ORTPA_ELEM_INT32, dims);
    int32_t* v = static_cast<int32_t*>(t->data);
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    for (int64_t i = 0; i < n; ++i)
      v[i] = coin(6) ? (int32_t)pick(INT32_MIN, INT32_MAX) : (int32_t)pick(lo, hi);
  }
};

// The glue's parallel-for, standing in for ONNX Runtime's pool: two threads over an atomic counter.
void two_threads(void*, void (*fn)(void*, size_t), size_t total, void* usr) {
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < total; i = next.fetch_add(1)) fn(usr, i);
  };
  std::thread t(work);
  work();
  t.join();
}

int64_t wrong(int64_t right) { return coin(12) ? std::max<int64_t>(0, right + pick(-2, 2)) : right; }

}  // namespace

int main(int argc, char** argv) {
  const long iterations = argc > 1 ? std::atol(argv[1]) : 1000;
  rng.seed(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  long ok = 0, refused = 0;
  const int act_types[] = {ORTPA_ELEM_FLOAT16, ORTPA_ELEM_BFLOAT16, ORTPA_ELEM_FLOAT32};
  const int cache_types[] = {ORTPA_ELEM_FLOAT16, ORTPA_ELEM_BFLOAT16, ORTPA_ELEM_FLOAT32, ORTPA_ELEM_INT8,
                             ORTPA_ELEM_FLOAT8E4M3FN, ORTPA_ELEM_UINT8};
  char err[512];
  for (long it = 0; it < iterations; ++it) {
    Buffers buf;
    OrtpaPagedAttentionArgs a;
    ortpa_paged_attention_args_init(&a);
    const bool latent = coin(3);
    const bool packed = !latent && coin(3);
    const int64_t kvh = latent ? 1 : pick(1, 3);
    const int64_t g = coin(2) ? 4 * pick(1, 2) : pick(1, 3), nh = kvh * g;  // 16-bit rows: 4-, 2- and 1-row kernels
    const int64_t h = 16 * pick(1, 3);
    const int64_t bs = coin(4) ? 32 : 16;
    const int64_t tokens = pick(0, 9), batch = pick(1, 4), num_blocks = pick(0, 6), maxb = pick(1, 4);
    const int act = act_types[pick(0, 2)];
    const int ct = coin(3) ? act : cache_types[pick(0, 5)];
    a.num_heads = coin(30) ? pick(-1, 5) : nh;
    a.kv_num_heads = kvh;
    const bool q8 = ct == ORTPA_ELEM_INT8 || ct == ORTPA_ELEM_FLOAT8E4M3FN || ct == ORTPA_ELEM_UINT8;
    const int64_t row = ct == ORTPA_ELEM_UINT8 ? (h + 1) / 2 : h;
    if (latent) {
      a.kv_cache_layout = "LATENT";
      a.v_head_size = pick(0, h);
      a.scale = 0.125f;
      buf.make(&a.query, act, {tokens, wrong(nh * h)});
      buf.make(&a.key, act, {wrong(tokens), wrong(h)});
      buf.make(&a.key_cache, ct, {num_blocks, bs, 1, wrong(row)});
    } else {
      buf.make(&a.query, act, {tokens, wrong(packed ? (nh + 2 * kvh) * h : nh * h)});
      if (!packed) {
        buf.make(&a.key, act, {tokens, wrong(kvh * h)});
        buf.make(&a.value, act, {wrong(tokens), kvh * h});
      }
      buf.make(&a.key_cache, ct, {num_blocks, bs, kvh, row});
      buf.make(&a.value_cache, ct, {wrong(num_blocks), bs, kvh, wrong(row)});
    }
    if (q8) {
      const bool per_channel = coin(2);
      a.k_quant_type = per_channel ? "PER_CHANNEL" : "PER_TENSOR";
      buf.make(&a.k_scale, ORTPA_ELEM_FLOAT32, per_channel ? std::vector<int64_t>{kvh, 1, h} : std::vector<int64_t>{1});
      if (!latent) {
        a.v_quant_type = "per_tensor";
        buf.make(&a.v_scale, ORTPA_ELEM_FLOAT32, {wrong(1)});
      }
      if (ct == ORTPA_ELEM_UINT8) {
        a.k_cache_dtype = "int4";
        if (!latent) a.v_cache_dtype = "int4";
      }
    }
    buf.ints(&a.cumulative_sequence_length, {wrong(batch + 1)}, -2, tokens + 2);
    buf.ints(&a.past_seqlens, {wrong(batch)}, -2, maxb * bs + 2);
    buf.ints(&a.block_table, {wrong(batch), wrong(maxb)}, -3, num_blocks + 2);
    if (coin(3)) buf.ints(&a.slot_mapping, {wrong(tokens)}, -2, num_blocks * bs + 3);
    if (coin(3)) {
      const int64_t half = 8 * pick(0, h / 16);
      buf.make(&a.cos_cache, act, {pick(0, 2 * maxb * bs), wrong(half)});
      buf.make(&a.sin_cache, act, {pick(0, 2 * maxb * bs), half});
      a.do_rotary = coin(4) ? 0 : 1;
      a.rotary_interleaved = pick(0, 1);
      a.rotary_offset = coin(4) ? 8 * pick(0, 2) : 0;
    }
    if (!latent && coin(4)) buf.make(&a.head_sink, act, {wrong(nh)});
    if (!latent && coin(5)) {
      buf.make(&a.q_norm_weight, act, {h});
      buf.make(&a.k_norm_weight, act, {wrong(h)});
    }
    if (coin(6)) buf.ints(&a.attention_metadata, {wrong(2)}, -1, 50);
    if (coin(4)) a.local_window_size = pick(-2, 40);
    if (coin(4)) a.is_causal = pick(-1, 2);
    if (coin(4)) a.softcap = 5.0f;
    if (coin(2)) {
      a.parallel_for = two_threads;
    } else {
      a.num_threads = (int32_t)pick(1, 2);
    }
    int64_t dims[2] = {0, 0};
    if (ortpa_paged_attention_output_shape(&a, dims, err, sizeof err) != 0) {
      ++refused;
      if (std::strncmp(err, "[", 1) != 0) {
        std::fprintf(stderr, "error without a rule id: %s\n", err);
        return 2;
      }
      continue;
    }
    buf.make(&a.output, act, {dims[0], dims[1]});
    if (ortpa_paged_attention(&a, err, sizeof err) == 0) {
      ++ok;
    } else {
      ++refused;
      if (std::strncmp(err, "[", 1) != 0) {
        std::fprintf(stderr, "error without a rule id: %s\n", err);
        return 2;
      }
    }
  }
  std::printf("calls %ld ok %ld refused %ld\n", iterations, ok, refused);
  return 0;
}
