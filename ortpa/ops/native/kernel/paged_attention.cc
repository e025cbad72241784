// The driver of ortpa's native PagedAttention: validate, sanitize the index inputs, run the Q/K prologue,
// scatter the new keys/values into their pages, then attend through the (possibly quantized) cache with the
// ISA path this CPU supports. The order and the arithmetic follow ortpa.ops.oracle (reference §8): QK-norm in
// float32 rounded to T, RoPE in T arithmetic, quantization as ortpa.ops.oracle.quant, float32 attention.
#include <atomic>
#include <exception>
#include <new>
#include <thread>
#include <vector>

#include "internal.h"

namespace ortpa_native {
namespace {

// ---- threads ---------------------------------------------------------------------------------------------

struct Parallel {
  OrtpaParallelFor fn = nullptr;
  void* ctx = nullptr;
  int threads = 1;
};

struct OwnThreads {
  void (*fn)(void*, size_t);
  void* usr;
  size_t total;
  std::atomic<size_t> next{0};
};

// Run fn(usr, i) for i in [0, total): through the caller's parallel-for (ONNX Runtime's pool), else on
// `threads` threads of our own for this call (ctypes callers), else serially.
void parallel_for(const Parallel& par, size_t total, void (*fn)(void*, size_t), void* usr) {
  if (total == 0) return;
  if (par.fn != nullptr && total > 1) {
    par.fn(par.ctx, fn, total, usr);
    return;
  }
  const size_t nt = std::min<size_t>((size_t)std::max(par.threads, 1), total);
  if (nt <= 1) {
    for (size_t i = 0; i < total; ++i) fn(usr, i);
    return;
  }
  OwnThreads own{fn, usr, total};
  auto work = [&own]() {
    for (size_t i = own.next.fetch_add(1); i < own.total; i = own.next.fetch_add(1)) own.fn(own.usr, i);
  };
  std::vector<std::thread> pool;
  pool.reserve(nt - 1);
  for (size_t t = 1; t < nt; ++t) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
}

// A failure inside a parallel task (only std::bad_alloc can happen there) is recorded, never thrown across
// the caller's thread pool.
struct TaskFailure {
  std::atomic<bool> failed{false};
};

// ---- quantization (ortpa.ops.oracle.quant) ---------------------------------------------------------------

inline float quant_ratio(float x, float s, float lo, float hi) {
  float r = s != 0.0f ? x / s : 0.0f;  // a zero scale quantizes to zero
  if (r < lo) r = lo;
  if (r > hi) r = hi;
  return r;  // NaN stays NaN
}

inline int round_even_int(float r) {
  // NumPy's rint then cast: NaN casts to 0 on x86 (cvttss2si gives INT_MIN, whose low byte is 0)
  return std::isnan(r) ? 0 : (int)std::nearbyint(r);
}

// Encode one row of n logical channels (float32 values already rounded to T) as cache elements.
void encode_row(const float* x, int64_t n, int type, const float* scale, uint8_t* dst) {
  switch (type) {
    case ORTPA_ELEM_FLOAT16:
      for (int64_t i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(dst)[i] = float_to_half(x[i]);
      return;
    case ORTPA_ELEM_BFLOAT16:
      for (int64_t i = 0; i < n; ++i) reinterpret_cast<uint16_t*>(dst)[i] = float_to_bf16(x[i]);
      return;
    case ORTPA_ELEM_FLOAT32:
      std::memcpy(dst, x, (size_t)n * sizeof(float));
      return;
    case ORTPA_ELEM_INT8:
      for (int64_t i = 0; i < n; ++i)
        reinterpret_cast<int8_t*>(dst)[i] = (int8_t)round_even_int(quant_ratio(x[i], scale[i], -128.0f, 127.0f));
      return;
    case ORTPA_ELEM_FLOAT8E4M3FN:
      for (int64_t i = 0; i < n; ++i) dst[i] = float_to_fp8(quant_ratio(x[i], scale[i], -448.0f, 448.0f));
      return;
    case ORTPA_ELEM_UINT8:
      for (int64_t i = 0; i < n; i += 2) {
        const int lo = round_even_int(quant_ratio(x[i], scale[i], -8.0f, 7.0f)) + 8;
        const int hi = i + 1 < n ? round_even_int(quant_ratio(x[i + 1], scale[i + 1], -8.0f, 7.0f)) + 8 : 8;
        dst[i >> 1] = (uint8_t)(lo | (hi << 4));  // an odd head size pads the last high nibble with 8 (zero)
      }
      return;
    default:
      return;
  }
}

int64_t elem_bytes(int type) {
  switch (type) {
    case ORTPA_ELEM_FLOAT32: return 4;
    case ORTPA_ELEM_FLOAT16:
    case ORTPA_ELEM_BFLOAT16: return 2;
    default: return 1;
  }
}

const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = fp8_to_float((uint8_t)i);
    return t;
  }();
  return table.data();
}

// ---- ISA dispatch ----------------------------------------------------------------------------------------

bool cpu_has_avx2() {
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return has;
#else
  return false;
#endif
}

AttendFn attend_fn() {
#if defined(__x86_64__) || defined(_M_X64)
  if (cpu_has_avx2()) return attend_tile_avx2;
#endif
  return attend_tile_baseline;
}

// float16 rows through F16C (only called where cpu_has_avx2(): Call::f16_avx2)
constexpr int64_t kMaxRotaryHalf = 256;

inline void f16_load(const uint16_t* src, float* dst, int64_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  f16_to_f32_avx2(src, dst, n);
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = half_to_float(src[i]);
#endif
}

inline void f16_store(const float* src, uint16_t* dst, int64_t n) {
#if defined(__x86_64__) || defined(_M_X64)
  f32_to_f16_avx2(src, dst, n);
#else
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_half(src[i]);
#endif
}

inline void f16_rope(float* seg, int64_t half, const float* cs, const float* sn) {
#if defined(__x86_64__) || defined(_M_X64)
  rope_f16_avx2(seg, seg + half, cs, sn, half);
#else
  (void)seg, (void)half, (void)cs, (void)sn;
#endif
}

// ---- the call ----------------------------------------------------------------------------------------------

struct Call {
  const OrtpaPagedAttentionArgs* a;
  Params p;
  Parallel par;
  // sanitized lengths
  std::vector<int64_t> cu, past, kvlen, pages;  // pages: sanitized block table [batch][max_blocks]
  std::vector<uint8_t> valid;
  std::vector<int64_t> seq, pos;  // per token
  std::vector<float> q, k;        // post-prologue Q [tokens][nh][H], K [tokens][kvh][H]
  std::vector<float> kscale, vscale, sink;
  TaskFailure failure;
  bool f16_avx2 = false;  // float16 activations on a CPU with F16C: the vector conversions
};

void prologue_token(Call& c, int64_t t) {
  const Params& p = c.p;
  const OrtpaPagedAttentionArgs& a = *c.a;
  const int64_t H = p.head_size;
  const bool live = c.valid[c.seq[t]] != 0;
  float* qo = c.q.data() + t * p.num_heads * H;
  float* ko = c.k.data() + t * p.kv_heads * H;
  // float16 rows with F16C where the CPU has it: scalar conversions dominated a float16 prefill (measured 2.5x
  // the float32 one on the 8/4-head, 64-wide Llama of the bench)
  const bool f16 = c.f16_avx2;
  if (f16) {
    f16_load(static_cast<const uint16_t*>(a.query.data) + t * p.q_stride + p.q_offset, qo, p.num_heads * H);
    f16_load(static_cast<const uint16_t*>(p.k_src) + t * p.k_stride + p.k_offset, ko, p.kv_heads * H);
  } else {
    for (int64_t h = 0; h < p.num_heads; ++h)
      for (int64_t i = 0; i < H; ++i) qo[h * H + i] = load_act(a.query.data, p.act_type, t * p.q_stride + p.q_offset + h * H + i);
    for (int64_t h = 0; h < p.kv_heads; ++h)
      for (int64_t i = 0; i < H; ++i) ko[h * H + i] = load_act(p.k_src, p.act_type, t * p.k_stride + p.k_offset + h * H + i);
  }

  auto norm = [&](float* x, int64_t heads, const void* w) {
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x + h * H;
      double ss = 0.0;
      for (int64_t i = 0; i < H; ++i) ss += (double)v[i] * (double)v[i];
      const float mean = (float)ss / (float)H;
      const float inv = 1.0f / std::sqrt(mean + p.eps);
      for (int64_t i = 0; i < H; ++i) v[i] = round_act(v[i] * inv * load_act(w, p.act_type, i), p.act_type);
    }
  };
  if (p.qk_norm) {
    norm(qo, p.num_heads, a.q_norm_weight.data);
    norm(ko, p.kv_heads, a.k_norm_weight.data);
  }
  if (p.rotary && p.rotary_dim > 0 && live) {
    // RoPE in T arithmetic: every product and sum rounded to T, as the oracle (and the CUDA kernel) do
    const int64_t half = p.rotary_dim / 2, row = c.pos[t] * (a.cos_cache.dims[1]);
    const int T = p.act_type;
    if (f16 && !p.interleaved && half <= kMaxRotaryHalf) {
      float cs[kMaxRotaryHalf], sn[kMaxRotaryHalf];
      f16_load(static_cast<const uint16_t*>(a.cos_cache.data) + row, cs, half);
      f16_load(static_cast<const uint16_t*>(a.sin_cache.data) + row, sn, half);
      for (int64_t h = 0; h < p.num_heads; ++h) f16_rope(qo + h * H + p.rotary_offset, half, cs, sn);
      for (int64_t h = 0; h < p.kv_heads; ++h) f16_rope(ko + h * H + p.rotary_offset, half, cs, sn);
      return;
    }
    auto rope = [&](float* x, int64_t heads) {
      for (int64_t h = 0; h < heads; ++h) {
        float* seg = x + h * H + p.rotary_offset;
        for (int64_t i = 0; i < half; ++i) {
          const float cs = load_act(a.cos_cache.data, T, row + i), sn = load_act(a.sin_cache.data, T, row + i);
          const int64_t ia = p.interleaved ? 2 * i : i, ib = p.interleaved ? 2 * i + 1 : i + half;
          const float xa = seg[ia], xb = seg[ib];
          seg[ia] = round_act(round_act(xa * cs, T) - round_act(xb * sn, T), T);
          seg[ib] = round_act(round_act(xb * cs, T) + round_act(xa * sn, T), T);
        }
      }
    };
    rope(qo, p.num_heads);
    rope(ko, p.kv_heads);
  }
}

void prologue_task(void* usr, size_t i) {
  Call& c = *static_cast<Call*>(usr);
  prologue_token(c, (int64_t)i);
}

struct AttendWork {
  Call* call;
  AttendShape shape;
  AttendFn fn;
  std::vector<AttendJob> jobs;
  std::vector<Tile> tiles;
  int64_t scratch_floats;
};

void attend_task(void* usr, size_t i) {
  AttendWork& w = *static_cast<AttendWork*>(usr);
  thread_local std::vector<float> scratch;
  try {
    if ((int64_t)scratch.size() < w.scratch_floats) scratch.resize((size_t)w.scratch_floats);
  } catch (...) {
    w.call->failure.failed = true;
    return;
  }
  w.fn(w.shape, w.jobs.data(), w.tiles[i], scratch.data());
}

bool fail(Error* err, const char* rule, const char* name, const std::string& message) {
  err->text = std::string("[") + rule + "] " + name + ": " + message;
  return false;
}

bool run(const OrtpaPagedAttentionArgs& a, Error* err) {
  Call c;
  c.a = &a;
  Params& p = c.p;
  if (!validate(a, &p, err)) return false;
  c.par.fn = a.parallel_for;
  c.par.ctx = a.parallel_ctx;
  c.par.threads = a.num_threads > 0 ? a.num_threads : 1;
  c.f16_avx2 = p.act_type == ORTPA_ELEM_FLOAT16 && cpu_has_avx2();
  const int64_t T = p.tokens, nh = p.num_heads, kvh = p.kv_heads, H = p.head_size, VH = p.v_head_size;
  const int64_t width = nh * VH;
  if (a.output.rank != 2 || a.output.dims[0] != T || a.output.dims[1] != width || (T * width > 0 && a.output.data == nullptr))
    return fail(err, "native.output", "output",
                "expected a buffer of shape (token_count, num_heads * v_head_size) = (" + std::to_string(T) + ", " +
                    std::to_string(width) + ")" + (a.output.data == nullptr ? ", found none" : ", found another shape"));
  if (T == 0) return true;  // the kernel returns before touching values or caches (§1.10.4)
  if (p.latent && p.int4)
    return fail(err, "native.latent_int4", "key_cache",
                "kv_cache_layout='LATENT' with a packed int4 (uint8) cache is not supported: the CUDA latent kernel "
                "reads packed bytes without nibble decoding, so the result is undefined (the oracle refuses it too)");

  // sanitize (ortpa.ops.oracle.sanitize): block ids outside [-1, num_blocks) -> -1; cumulative lengths clamped
  // and made non-decreasing; a past length that leaves no room marks its sequence invalid
  const int64_t B = p.batch, bs = p.block_size, maxb = p.max_blocks, cap = maxb * bs;
  const int32_t* cu_in = static_cast<const int32_t*>(a.cumulative_sequence_length.data);
  const int32_t* past_in = static_cast<const int32_t*>(a.past_seqlens.data);
  const int32_t* bt_in = static_cast<const int32_t*>(a.block_table.data);
  c.cu.assign((size_t)B + 1, 0);
  for (int64_t b = 1; b < B; ++b) c.cu[b] = std::min<int64_t>(T, std::max<int64_t>(0, cu_in[b]));
  c.cu[B] = T;
  for (int64_t b = 1; b <= B; ++b) c.cu[b] = std::max(c.cu[b], c.cu[b - 1]);
  c.past.assign((size_t)B, 0);
  c.kvlen.assign((size_t)B, 0);
  c.valid.assign((size_t)B, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t ql = c.cu[b + 1] - c.cu[b], max_past = std::max<int64_t>(cap - ql, 0), ps = past_in[b];
    if (ps >= 0 && ps <= max_past) {
      c.valid[b] = 1;
      c.past[b] = ps;
      c.kvlen[b] = std::min(ps + ql, cap);
    }
  }
  c.pages.resize((size_t)(B * maxb));
  for (int64_t i = 0; i < B * maxb; ++i) {
    const int64_t v = bt_in[i];
    c.pages[i] = (v >= -1 && v < p.num_blocks) ? v : -1;
  }
  c.seq.resize((size_t)T);
  c.pos.resize((size_t)T);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = c.cu[b]; t < c.cu[b + 1]; ++t) {
      c.seq[t] = b;
      c.pos[t] = c.past[b] + (t - c.cu[b]);
    }

  // RoPE reads cos/sin row `position` of live tokens: out of range is an error, never a read (the oracle's rule)
  if (p.rotary && p.rotary_dim > 0) {
    int64_t lo = INT64_MAX, hi = -1;
    for (int64_t t = 0; t < T; ++t)
      if (c.valid[c.seq[t]]) {
        lo = std::min(lo, c.pos[t]);
        hi = std::max(hi, c.pos[t]);
      }
    if (hi >= p.cos_rows)
      return fail(err, "native.rotary_position", "cos_cache",
                  "rotary: expected positions in [0, " + std::to_string(p.cos_rows) + ") (cos/sin rows), found range [" +
                      std::to_string(lo) + ", " + std::to_string(hi) + "]");
  }

  // per-channel dequantization scales [kv_heads * head_size] (PER_TENSOR broadcast)
  auto scales = [&](int quant, const OrtpaTensor& s, std::vector<float>* out) {
    if (quant == kQuantNone) return;
    const float* v = static_cast<const float*>(s.data);
    out->resize((size_t)(kvh * H));
    for (int64_t i = 0; i < kvh * H; ++i) (*out)[i] = quant == kQuantPerTensor ? v[0] : v[i];
  };
  scales(p.k_quant, a.k_scale, &c.kscale);
  scales(p.v_quant, a.v_scale, &c.vscale);
  if (p.has_sink) {
    c.sink.resize((size_t)nh);
    for (int64_t h = 0; h < nh; ++h) c.sink[h] = load_act(a.head_sink.data, p.act_type, h);
  }

  // Q/K prologue, then the cache write in token order (the last writer of a slot wins, as in the oracle)
  c.q.resize((size_t)(T * nh * H));
  c.k.resize((size_t)(T * kvh * H));
  parallel_for(c.par, (size_t)T, prologue_task, &c);
  uint8_t* kc = static_cast<uint8_t*>(a.key_cache.data);
  uint8_t* vc = p.latent ? nullptr : static_cast<uint8_t*>(a.value_cache.data);
  const int64_t row_bytes = p.cache_row * elem_bytes(p.kcache_type);
  const int32_t* slot_in = p.has_slots ? static_cast<const int32_t*>(a.slot_mapping.data) : nullptr;
  std::vector<float> vrow((size_t)H);
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = c.seq[t];
    if (!c.valid[b]) continue;
    int64_t slot = -1;
    if (slot_in != nullptr) {
      slot = slot_in[t];
    } else {
      const int64_t blk = c.pos[t] / bs;
      const int64_t page = blk < maxb ? c.pages[b * maxb + blk] : -1;
      slot = page >= 0 ? page * bs + c.pos[t] % bs : -1;
    }
    if (slot < 0 || slot >= p.num_blocks * bs) continue;  // -1 / out of range: no write
    const bool f16_rows = c.f16_avx2 && p.kcache_type == ORTPA_ELEM_FLOAT16;
    for (int64_t kh = 0; kh < kvh; ++kh) {
      const int64_t row = slot * kvh + kh;
      if (f16_rows)
        f16_store(c.k.data() + (t * kvh + kh) * H, reinterpret_cast<uint16_t*>(kc + row * row_bytes), H);
      else
        encode_row(c.k.data() + (t * kvh + kh) * H, H, p.kcache_type,
                   c.kscale.empty() ? nullptr : c.kscale.data() + kh * H, kc + row * row_bytes);
      if (vc != nullptr) {
        if (c.f16_avx2)
          f16_load(static_cast<const uint16_t*>(p.v_src) + t * p.v_stride + p.v_offset + kh * H, vrow.data(), H);
        else
          for (int64_t i = 0; i < H; ++i) vrow[i] = load_act(p.v_src, p.act_type, t * p.v_stride + p.v_offset + kh * H + i);
        if (f16_rows)
          f16_store(vrow.data(), reinterpret_cast<uint16_t*>(vc + row * row_bytes), H);
        else
          encode_row(vrow.data(), H, p.kcache_type, c.vscale.empty() ? nullptr : c.vscale.data() + kh * H,
                     vc + row * row_bytes);
      }
    }
  }

  // attention through the caches
  std::memset(a.output.data, 0, (size_t)(T * width * elem_bytes(p.act_type)));
  AttendWork w;
  w.call = &c;
  w.fn = attend_fn();
  AttendShape& s = w.shape;
  s.num_heads = nh;
  s.kv_heads = kvh;
  s.head_size = H;
  s.v_head_size = VH;
  s.block_size = bs;
  s.max_blocks = maxb;
  s.causal = p.causal;
  s.latent = p.latent;
  s.window = p.window;
  s.scale = p.scale;
  s.softcap = p.softcap;
  s.sink = p.has_sink ? c.sink.data() : nullptr;
  s.fp8_table = fp8_table();
  s.k.data = kc;
  s.k.type = p.kcache_type;
  s.k.row_bytes = row_bytes;
  s.k.width = H;
  s.k.scale = c.kscale.empty() ? nullptr : c.kscale.data();
  if (p.latent) {
    s.v = s.k;
  } else {
    s.v.data = vc;
    s.v.type = p.kcache_type;
    s.v.row_bytes = row_bytes;
    s.v.width = VH;
    s.v.scale = c.vscale.empty() ? nullptr : c.vscale.data();
  }
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t0 = c.cu[b], t1 = c.cu[b + 1];
    if (!c.valid[b] || t1 == t0 || c.kvlen[b] == 0) continue;  // zero rows
    w.jobs.push_back(AttendJob{c.q.data(), a.output.data, p.act_type, c.pages.data() + b * maxb, t0, t1, c.past[b], c.kvlen[b]});
  }
  // tiles: sequence x KV head x query tile. A decode row's key range is cut into fixed parts of kDecodePart
  // keys (each keeps its own running max / sum / accumulator, merged below), so that a few long sequences
  // still keep every thread busy. The cut depends on the sequence's own length only: its result never
  // depends on the other sequences of the batch nor on the thread count.
  const int64_t part_keys = std::max<int64_t>(kDecodePart, bs) / bs * bs;
  // few short decodes and nothing else (a single sequence's decode): each is cut by KV heads into up to
  // kDecodeTilesMin tiles in all, so the call still spreads over the threads
  int64_t short_decodes = 0;
  bool only_short_decodes = true;
  for (const AttendJob& j : w.jobs) {
    const bool short_decode = j.t1 - j.t0 == 1 && j.kvlen <= part_keys;
    short_decodes += short_decode;
    only_short_decodes = only_short_decodes && short_decode;
  }
  const int64_t head_groups = only_short_decodes && short_decodes > 0 && short_decodes < kDecodeTilesMin
                                  ? std::min<int64_t>(kvh, (kDecodeTilesMin + short_decodes - 1) / short_decodes)
                                  : 1;
  std::vector<float> parts;
  struct Merge { int64_t job, token, first_part, nparts; };  // a decode row, all KV heads
  std::vector<Merge> merges;
  int64_t part_floats = 0;
  for (size_t ji = 0; ji < w.jobs.size(); ++ji) {
    const AttendJob& j = w.jobs[ji];
    const int64_t ql = j.t1 - j.t0;
    if (ql == 1) {
      // a decode: every KV head in one tile (the pages are read as contiguous runs), the key range in parts
      if (j.kvlen <= part_keys) {
        for (int64_t gi = 0; gi < head_groups; ++gi) {
          const int64_t h0 = kvh * gi / head_groups, h1 = kvh * (gi + 1) / head_groups;
          w.tiles.push_back(Tile{(int32_t)ji, (int32_t)h0, (int32_t)(h1 - h0), 0, 1, 0, j.kvlen, nullptr});
        }
        continue;
      }
      Merge m{(int64_t)ji, 0, (int64_t)w.tiles.size(), 0};
      for (int64_t j0 = 0; j0 < j.kvlen; j0 += part_keys) {
        w.tiles.push_back(Tile{(int32_t)ji, 0, (int32_t)kvh, 0, 1, j0, std::min(j.kvlen, j0 + part_keys), nullptr});
        ++m.nparts;
      }
      merges.push_back(m);
      part_floats += m.nparts * nh * (2 + VH);
      continue;
    }
    // a prefill or chunk: one KV head per tile, query tiles of kQueryTile tokens
    for (int64_t kh = 0; kh < kvh; ++kh)
      for (int64_t i0 = 0; i0 < ql; i0 += kQueryTile)
        w.tiles.push_back(Tile{(int32_t)ji, (int32_t)kh, 1, i0, std::min(ql, i0 + kQueryTile), 0, j.kvlen, nullptr});
  }
  if (part_floats > 0) {
    parts.resize((size_t)part_floats);
    int64_t at = 0;
    for (const Merge& m : merges)
      for (int64_t k = 0; k < m.nparts; ++k) {
        w.tiles[m.first_part + k].part = parts.data() + at;
        at += nh * (2 + VH);
      }
  }
  int64_t max_q = 1, max_kh = 1;
  for (const Tile& t : w.tiles) {
    max_q = std::max(max_q, t.i1 - t.i0);
    max_kh = std::max<int64_t>(max_kh, t.kv_heads);
  }
  w.scratch_floats = std::max(attend_scratch_floats(s, max_q, 1), attend_scratch_floats(s, 1, max_kh));
  parallel_for(c.par, w.tiles.size(), attend_task, &w);
  if (c.failure.failed)
    return fail(err, "native.memory", "output", "out of memory for the attention scratch; the caches were already written");

  // merge split decodes: out = sum_s acc_s e^(m_s - M) / (sum_s l_s e^(m_s - M) + sink term); a part's rows
  // are its tile's, (kv head * 1 + 0) * g + head in group = the query head
  std::vector<float> accm((size_t)VH);
  for (const Merge& m : merges) {
    const AttendJob& j = w.jobs[m.job];
    for (int64_t head = 0; head < nh; ++head) {
      float M = s.sink ? s.sink[head] : -INFINITY;
      bool nan = false;
      for (int64_t k = 0; k < m.nparts; ++k) {
        const float pm = w.tiles[m.first_part + k].part[head * (2 + VH)];
        M = std::max(M, pm);
        nan = nan || std::isnan(pm);
      }
      float L = s.sink ? std::exp(s.sink[head] - M) : 0.0f;
      std::fill(accm.begin(), accm.end(), nan ? NAN : 0.0f);
      if (!nan && M != -INFINITY) {
        for (int64_t k = 0; k < m.nparts; ++k) {
          const float* pr = w.tiles[m.first_part + k].part + head * (2 + VH);
          if (pr[1] == 0.0f) continue;
          const float f = std::exp(pr[0] - M);
          L += pr[1] * f;
          for (int64_t i = 0; i < VH; ++i) accm[i] += pr[2 + i] * f;
        }
      }
      const float inv = L > 0.0f ? 1.0f / L : 0.0f;
      const int64_t o = ((j.t0 + m.token) * nh + head) * VH;
      for (int64_t i = 0; i < VH; ++i) store_act(a.output.data, p.act_type, o + i, accm[i] * inv);
    }
  }
  return true;
}

void copy_error(const Error& e, char* error, size_t len) {
  if (error == nullptr || len == 0) return;
  const size_t n = std::min(len - 1, e.text.size());
  std::memcpy(error, e.text.data(), n);
  error[n] = '\0';
}

}  // namespace

int64_t attend_scratch_floats(const AttendShape& s, int64_t q_tile, int64_t kv_heads) {
  const int64_t R = kv_heads * (s.num_heads / s.kv_heads) * q_tile;
  return s.block_size * (s.head_size + s.v_head_size) + R * s.block_size + 2 * R + R * s.v_head_size;
}

}  // namespace ortpa_native

extern "C" {

void ortpa_paged_attention_args_init(OrtpaPagedAttentionArgs* args) {
  if (args == nullptr) return;
  std::memset(args, 0, sizeof *args);
  args->struct_size = sizeof(OrtpaPagedAttentionArgs);
  args->abi_version = ORTPA_PAGED_ATTENTION_ABI_VERSION;
  args->local_window_size = -1;
  args->is_causal = 1;
  args->qk_norm_epsilon = 1e-6f;
}

int ortpa_paged_attention_output_shape(const OrtpaPagedAttentionArgs* args, int64_t out_dims[2], char* error,
                                       size_t error_len) {
  ortpa_native::Error err;
  ortpa_native::Params p;
  if (args == nullptr || out_dims == nullptr) {
    err.text = "[native.args] args: expected OrtpaPagedAttentionArgs and an output shape buffer, found NULL";
    ortpa_native::copy_error(err, error, error_len);
    return 1;
  }
  try {
    if (!ortpa_native::validate(*args, &p, &err)) {
      ortpa_native::copy_error(err, error, error_len);
      return 1;
    }
  } catch (const std::exception& e) {
    err.text = std::string("[native.internal] args: ") + e.what();
    ortpa_native::copy_error(err, error, error_len);
    return 1;
  }
  out_dims[0] = p.tokens;
  out_dims[1] = p.num_heads * p.v_head_size;
  return 0;
}

int ortpa_paged_attention(const OrtpaPagedAttentionArgs* args, char* error, size_t error_len) {
  ortpa_native::Error err;
  if (args == nullptr) {
    err.text = "[native.args] args: expected OrtpaPagedAttentionArgs, found NULL";
    ortpa_native::copy_error(err, error, error_len);
    return 1;
  }
  try {
    if (ortpa_native::run(*args, &err)) return 0;
  } catch (const std::bad_alloc&) {
    err.text = "[native.memory] args: out of memory for the kernel's buffers";
  } catch (const std::exception& e) {
    err.text = std::string("[native.internal] args: ") + e.what();
  }
  ortpa_native::copy_error(err, error, error_len);
  return 1;
}

const char* ortpa_native_isa(void) { return ortpa_native::cpu_has_avx2() ? "avx2" : "baseline"; }

uint32_t ortpa_native_abi_version(void) { return ORTPA_PAGED_ATTENTION_ABI_VERSION; }

}  // extern "C"
