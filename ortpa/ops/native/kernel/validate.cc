// The call's validation: ortpa.ops.validate.check_inputs rule by rule, in its order and with its wording
// (reference paged_attention_facts.md §1). Messages read "[rule] input: message" like
// ortpa.errors.InvalidArgument. Rules the kernel adds (tensor ranks and buffers a C caller could get wrong)
// are named "native.*".
#include <cctype>
#include <cstdarg>
#include <cstdio>

#include "internal.h"

namespace ortpa_native {
namespace {

struct In {
  const char* name;
  const OrtpaTensor* t;
  bool has() const { return t->data != nullptr; }
  int64_t rank() const { return t->rank; }
  int64_t dim(int i) const { return t->dims[i]; }
  int64_t size() const {
    int64_t n = 1;
    for (int i = 0; i < t->rank; ++i) n *= t->dims[i];
    return n;
  }
};

class Checker {
 public:
  explicit Checker(Error* e) : err_(e) {}
  bool fail(const char* rule, const char* name, const char* fmt, ...) __attribute__((format(printf, 4, 5))) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    err_->text = std::string("[") + rule + "] " + name + ": " + buf;
    return false;
  }

 private:
  Error* err_;
};

const char* type_name(int t) {
  switch (t) {
    case ORTPA_ELEM_FLOAT32: return "tensor(float)";
    case ORTPA_ELEM_UINT8: return "tensor(uint8)";
    case ORTPA_ELEM_INT8: return "tensor(int8)";
    case ORTPA_ELEM_INT32: return "tensor(int32)";
    case ORTPA_ELEM_INT64: return "tensor(int64)";
    case ORTPA_ELEM_FLOAT16: return "tensor(float16)";
    case ORTPA_ELEM_BFLOAT16: return "tensor(bfloat16)";
    case ORTPA_ELEM_FLOAT8E4M3FN: return "tensor(float8e4m3fn)";
    default: return "tensor(unknown)";
  }
}

std::string fmt_shape(const OrtpaTensor& t) {
  std::string s = "{";
  for (int i = 0; i < t.rank; ++i) {
    if (i) s += ",";
    s += std::to_string((long long)t.dims[i]);
  }
  return s + "}";
}

// A float as Python's str() prints it in the validator's messages (0.0, -1.0, nan, inf, 1e-06).
std::string py_float(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e16) {
    snprintf(buf, sizeof buf, "%.1f", v);
  } else {
    snprintf(buf, sizeof buf, "%.9g", v);
  }
  return buf;
}

std::string upper(const char* s) {
  std::string r = s ? s : "";
  for (char& c : r) c = (char)std::toupper((unsigned char)c);
  return r;
}

std::string lower(const char* s) {
  std::string r = s ? s : "";
  for (char& c : r) c = (char)std::tolower((unsigned char)c);
  return r;
}

bool is_float_act(int t) {
  // float32 is ortpa's extension: ONNX Runtime's schema binds T to float16 / bfloat16 only
  return t == ORTPA_ELEM_FLOAT16 || t == ORTPA_ELEM_BFLOAT16 || t == ORTPA_ELEM_FLOAT32;
}

bool is_cache_type(int t) {
  return t == ORTPA_ELEM_FLOAT16 || t == ORTPA_ELEM_BFLOAT16 || t == ORTPA_ELEM_INT8 ||
         t == ORTPA_ELEM_FLOAT8E4M3FN || t == ORTPA_ELEM_UINT8 || t == ORTPA_ELEM_FLOAT32;
}

const char* storage_name(int t) {
  switch (t) {
    case ORTPA_ELEM_UINT8: return "int4";
    case ORTPA_ELEM_INT8: return "int8";
    case ORTPA_ELEM_FLOAT8E4M3FN: return "float8e4m3fn";
    case ORTPA_ELEM_BFLOAT16: return "bfloat16";
    case ORTPA_ELEM_FLOAT32: return "float32";
    default: return "float16";
  }
}

}  // namespace

bool validate(const OrtpaPagedAttentionArgs& a, Params* p, Error* err) {
  Checker r(err);
  if (a.struct_size != sizeof(OrtpaPagedAttentionArgs) || a.abi_version != ORTPA_PAGED_ATTENTION_ABI_VERSION)
    return r.fail("native.abi", "args",
                  "expected OrtpaPagedAttentionArgs of %zu bytes, ABI version %d (call "
                  "ortpa_paged_attention_args_init); found %u bytes, version %u",
                  sizeof(OrtpaPagedAttentionArgs), ORTPA_PAGED_ATTENTION_ABI_VERSION, a.struct_size, a.abi_version);

  const In query{"query", &a.query}, key{"key", &a.key}, value{"value", &a.value},
      kc{"key_cache", &a.key_cache}, vc{"value_cache", &a.value_cache},
      cum{"cumulative_sequence_length", &a.cumulative_sequence_length}, past{"past_seqlens", &a.past_seqlens},
      bt{"block_table", &a.block_table}, cos{"cos_cache", &a.cos_cache}, sin{"sin_cache", &a.sin_cache},
      slots{"slot_mapping", &a.slot_mapping}, sink{"head_sink", &a.head_sink},
      qn{"q_norm_weight", &a.q_norm_weight}, kn{"k_norm_weight", &a.k_norm_weight}, ks{"k_scale", &a.k_scale},
      vs{"v_scale", &a.v_scale}, md{"attention_metadata", &a.attention_metadata};
  const In* all[] = {&query, &key, &value, &kc, &vc, &cum, &past, &bt, &cos, &sin, &slots, &sink, &qn, &kn,
                     &ks, &vs, &md};
  enum Param { kT, kTCache, kS, kScale };
  const Param param[] = {kT, kT, kT, kTCache, kTCache, kS, kS, kS, kT, kT, kS, kT, kT, kT, kScale, kScale, kS};

  // type.required, then type binding (T / T_CACHE / S / T_KV_SCALE), as graph resolution does
  const int required[] = {0, 3, 5, 6, 7};
  for (int i : required)
    if (!all[i]->has())
      return r.fail("type.required", all[i]->name, "Required input '%s' (input %d) of PagedAttention is missing.",
                    all[i]->name, i);
  int bound[4] = {0, 0, 0, 0};
  const char* bound_name[4] = {nullptr, nullptr, nullptr, nullptr};
  const char* param_name[] = {"T", "T_CACHE", "S", "T_KV_SCALE"};
  for (int i = 0; i < 17; ++i) {
    const In& x = *all[i];
    if (!x.has()) continue;
    // the kernel's own: a C caller describes shapes by hand
    if (x.rank() < 0 || x.rank() > ORTPA_MAX_RANK)
      return r.fail("native.rank", x.name, "expected a rank in [0, %d], found %lld", ORTPA_MAX_RANK,
                    (long long)x.rank());
    for (int d = 0; d < x.rank(); ++d)
      if (x.dim(d) < 0)
        return r.fail("native.shape", x.name, "expected non-negative dimensions, found %s",
                      fmt_shape(*x.t).c_str());
    const int t = x.t->elem_type;
    const Param pr = param[i];
    bool ok = pr == kT ? is_float_act(t) : pr == kTCache ? is_cache_type(t) : pr == kS ? t == ORTPA_ELEM_INT32
                                                                                         : t == ORTPA_ELEM_FLOAT32;
    if (!ok)
      return r.fail(pr == kT ? "type.T" : pr == kTCache ? "type.T_CACHE" : pr == kS ? "type.S" : "type.T_KV_SCALE",
                    x.name,
                    "Type Error: Type '%s' of input parameter (%s) of operator (PagedAttention) in node () is "
                    "invalid.",
                    type_name(t), x.name);
    if (!bound[pr]) {
      bound[pr] = t;
      bound_name[pr] = x.name;
    } else if (bound[pr] != t) {
      return r.fail(pr == kT ? "type.T.bind" : pr == kTCache ? "type.T_CACHE.bind" : pr == kS ? "type.S.bind"
                                                                                          : "type.T_KV_SCALE.bind",
                    x.name,
                    "Type Error: Type parameter (%s) of Optype (PagedAttention) bound to different types (%s and "
                    "%s in node ().",
                    param_name[pr], type_name(bound[pr]), type_name(t));
    }
  }
  (void)bound_name;

  // ctor.* (§1.0)
  const int64_t nh = a.num_heads, kvh = a.kv_num_heads;
  if (nh <= 0)
    return r.fail("ctor.num_heads", "num_heads",
                  "info.GetAttr(\"num_heads\", &num_heads).IsOK() && num_heads > 0 was false. Got num_heads=%lld.",
                  (long long)nh);
  if (kvh <= 0 || nh % kvh != 0)
    return r.fail("ctor.kv_num_heads", "kv_num_heads",
                  "info.GetAttr(\"kv_num_heads\", &kv_num_heads).IsOK() && kv_num_heads > 0 && num_heads %% "
                  "kv_num_heads == 0 was false. Got num_heads=%lld, kv_num_heads=%lld.",
                  (long long)nh, (long long)kvh);
  const float eps = a.qk_norm_epsilon;
  if (!(std::isfinite(eps) && eps > 0.0f))
    return r.fail("ctor.qk_norm_epsilon", "qk_norm_epsilon", "qk_norm_epsilon must be a positive finite number (got %s).",
                  py_float(eps).c_str());
  int quant[2] = {kQuantNone, kQuantNone};
  const char* qattr[2] = {"k_quant_type", "v_quant_type"};
  const char* qval[2] = {a.k_quant_type, a.v_quant_type};
  for (int i = 0; i < 2; ++i) {
    std::string s = upper(qval[i] ? qval[i] : "NONE");
    if (s == "NONE") quant[i] = kQuantNone;
    else if (s == "PER_TENSOR") quant[i] = kQuantPerTensor;
    else if (s == "PER_CHANNEL") quant[i] = kQuantPerChannel;
    else
      return r.fail("ctor.quant_type", qattr[i],
                    "Invalid KV quantization type: '%s'. Valid values are: NONE, PER_TENSOR, PER_CHANNEL.",
                    qval[i]);
  }
  std::string cdt[2];
  const char* cattr[2] = {"k_cache_dtype", "v_cache_dtype"};
  const char* cval[2] = {a.k_cache_dtype, a.v_cache_dtype};
  for (int i = 0; i < 2; ++i) {
    cdt[i] = lower(cval[i]);
    const char* known[] = {"", "float16", "bfloat16", "int8", "float8e4m3fn", "int4", "float4e2m1"};
    bool ok = false;
    for (const char* k : known) ok = ok || cdt[i] == k;
    if (!ok)
      return r.fail("ctor.cache_dtype", cattr[i],
                    "Invalid KV cache data type: '%s'. Valid values are: '' (use the cache tensor's element type), "
                    "float16, bfloat16, int8, float8e4m3fn, int4, float4e2m1. Unsigned types are excluded because "
                    "quantization here is symmetric with no zero point.",
                    cval[i]);
  }
  const std::string layout = a.kv_cache_layout ? a.kv_cache_layout : "SEPARATE";
  if (layout != "SEPARATE" && layout != "LATENT")
    return r.fail("ctor.kv_cache_layout", "kv_cache_layout", "'kv_cache_layout' must be 'SEPARATE' or 'LATENT', got '%s'",
                  layout.c_str());
  const bool latent = layout == "LATENT";
  if (a.v_head_size < 0)
    return r.fail("ctor.v_head_size", "v_head_size", "'v_head_size' must be non-negative, got %lld",
                  (long long)a.v_head_size);
  if (a.rotary_offset < 0)
    return r.fail("ctor.rotary_offset", "rotary_offset", "'rotary_offset' must be non-negative, got %lld",
                  (long long)a.rotary_offset);

  // §1.1 (rule 1.1.1, CUDA's thread-block limit on num_heads, does not apply on CPU)
  // §1.2 Q/K/V mode
  auto rank_is = [&](const char* rule, const In& x, int64_t n) {
    if (x.rank() != n)
      return r.fail(rule, x.name, "Input '%s' is expected to have %lld dimension%s, got %lld", x.name, (long long)n,
                    n == 1 ? "" : "s", (long long)x.rank());
    return true;
  };
  auto mult8 = [&](const char* rule, int64_t hs) {
    if (hs % 8 != 0)
      return r.fail(rule, "query", "head_size must be a multiple of 8. Got head_size %% 8 == %lld", (long long)(hs % 8));
    return true;
  };
  auto token_rows = [&](const char* rrule, const char* trule, const In& x, int64_t tok) {
    if (!rank_is(rrule, x, 2)) return false;
    if (x.dim(0) != tok)
      return r.fail(trule, x.name, "Input 'query' and '%s' shall have same dim 0 (token count)", x.name);
    return true;
  };
  int64_t tokens = 0, head_size = 0;
  const bool packed = !latent && !key.has();
  if (latent) {
    if (!key.has()) return r.fail("1.2.latent.1", "key", "Input 'key' is required when 'kv_cache_layout' is 'LATENT'.");
    if (value.has())
      return r.fail("1.2.latent.2", "value",
                    "Input 'value' must be absent when 'kv_cache_layout' is 'LATENT': the value of every head is the "
                    "leading 'v_head_size' channels of the latent key.");
    if (!rank_is("1.2.latent.3", query, 2)) return false;
    tokens = query.dim(0);
    const int64_t qh = query.dim(1);
    if (qh % nh != 0)
      return r.fail("1.2.latent.4", "query",
                    "Input 'query' hidden size must be a multiple of num_heads. Got %lld %% %lld == %lld",
                    (long long)qh, (long long)nh, (long long)(qh % nh));
    head_size = qh / nh;
    if (!mult8("1.2.latent.5", head_size)) return false;
    if (!token_rows("1.2.latent.6", "1.2.latent.7", key, tokens)) return false;
    if (key.dim(1) != kvh * head_size)
      return r.fail("1.2.latent.8", "key",
                    "Input 'key' is expected to have hidden size kv_num_heads * head_size = %lld in 'LATENT' mode, "
                    "got %lld",
                    (long long)(kvh * head_size), (long long)key.dim(1));
  } else if (!packed) {
    if (!rank_is("1.2.separate.1", query, 2)) return false;
    tokens = query.dim(0);
    head_size = query.dim(1) / nh;  // divisibility is not checked (ONNX Runtime's quirk)
    if (!mult8("1.2.separate.2", head_size)) return false;
    if (!value.has())
      return r.fail("1.2.separate.3", "value",
                    "Input 'key' and 'value' shall be both present, or both absent in the case of packed qkv.");
    if (!token_rows("1.2.separate.4a", "1.2.separate.4b", key, tokens)) return false;
    const int64_t kvhid = key.dim(1);
    if (kvhid % kvh != 0)
      return r.fail("1.2.separate.5a", "key",
                    "kv_hidden_size must be a multiple of kv_num_heads. Got kv_hidden_size %% kv_num_heads == %lld",
                    (long long)(kvhid % kvh));
    if (kvhid / kvh != head_size)
      return r.fail("1.2.separate.5b", "key",
                    "kv_hidden_size / kv_num_heads must be equal to head_size. Got kv_hidden_size / kv_num_heads == "
                    "%lld",
                    (long long)(kvhid / kvh));
    if (!token_rows("1.2.separate.6a", "1.2.separate.6b", value, tokens)) return false;
    if (value.dim(1) != kvhid)
      return r.fail("1.2.separate.6c", "value", "Input 'value' is expected to have same hidden size as key.");
  } else {
    if (!rank_is("1.2.packed.1", query, 2)) return false;
    tokens = query.dim(0);
    head_size = query.dim(1) / (nh + 2 * kvh);  // remainder unchecked (ONNX Runtime)
    if (!mult8("1.2.packed.2", head_size)) return false;
    if (value.has())
      return r.fail("1.2.packed.3", "value",
                    "Input 'key' and 'value' shall be both present, or both absent in the case of packed qkv.");
  }

  // §1.3 v_head_size and scale
  const bool explicit_scale = a.scale != 0.0f;
  int64_t v_head_size = head_size;
  if (a.v_head_size != 0) {
    if (a.v_head_size < 1 || a.v_head_size > head_size)
      return r.fail("1.3.1", "v_head_size", "'v_head_size' must be 0 (meaning head_size) or in [1, head_size] = [1, %lld], got %lld",
                    (long long)head_size, (long long)a.v_head_size);
    if (a.v_head_size != head_size && !latent)
      return r.fail("1.3.2", "v_head_size",
                    "'v_head_size' (%lld) may only differ from head_size (%lld) when 'kv_cache_layout' is 'LATENT'.",
                    (long long)a.v_head_size, (long long)head_size);
    v_head_size = a.v_head_size;
  }
  if (v_head_size != head_size && !explicit_scale)
    return r.fail("1.3.3", "scale",
                  "An explicit 'scale' attribute is required when 'v_head_size' (%lld) differs from head_size (%lld): "
                  "the default 1/sqrt(head_size) is not the intended scale for absorbed MLA.",
                  (long long)v_head_size, (long long)head_size);

  // §1.4 layout
  if (latent) {
    if (vc.has())
      return r.fail("1.4.latent.1", "value_cache",
                    "Input 'value_cache' must be absent when 'kv_cache_layout' is 'LATENT': the value cache is the "
                    "leading 'v_head_size' channels of 'key_cache'.");
    if (kvh != 1)
      return r.fail("1.4.latent.2", "kv_num_heads", "'kv_num_heads' must be 1 when 'kv_cache_layout' is 'LATENT', got %lld",
                    (long long)kvh);
    if (sink.has())
      return r.fail("1.4.latent.3", "head_sink", "Input 'head_sink' is not supported when 'kv_cache_layout' is 'LATENT'.");
    if (qn.has() || kn.has())
      return r.fail("1.4.latent.4", qn.has() ? "q_norm_weight" : "k_norm_weight",
                    "Inputs 'q_norm_weight' / 'k_norm_weight' are not supported when 'kv_cache_layout' is 'LATENT': "
                    "DeepSeek normalizes the latent projections in the graph, before absorption.");
    if (vs.has() || quant[1] != kQuantNone || !cdt[1].empty())
      return r.fail("1.4.latent.5", vs.has() ? "v_scale" : quant[1] != kQuantNone ? "v_quant_type" : "v_cache_dtype",
                    "Input 'v_scale' and attributes 'v_quant_type' / 'v_cache_dtype' must be unset when "
                    "'kv_cache_layout' is 'LATENT': the value elements are the key elements, so 'k_scale' and "
                    "'k_cache_dtype' describe both.");
  } else if (!vc.has()) {
    return r.fail("1.4.separate.1", "value_cache", "Input 'value_cache' is required unless 'kv_cache_layout' is 'LATENT'.");
  }

  // §1.5 CheckKVCache (§1.9: a packed int4 row holds (head_size + 1) / 2 bytes)
  if (!rank_is("1.5.1", kc, 4)) return false;
  const int64_t num_blocks = kc.dim(0), bs = kc.dim(1);
  if (bs < 16 || (bs & (bs - 1)) != 0)
    return r.fail("1.5.2", "key_cache", "block_size must be a power of two and at least 16. Got block_size == %lld",
                  (long long)bs);
  if (kc.dim(2) != kvh) return r.fail("1.5.3", "key_cache", "Input 'key_cache' shall have kv_num_heads, got %lld", (long long)kc.dim(2));
  const int ctype = a.key_cache.elem_type;
  const bool int4 = ctype == ORTPA_ELEM_UINT8;
  const int64_t expected_last = int4 ? (head_size + 1) / 2 : head_size;
  auto last_dim = [&](const In& x, const char* rule) {
    if (x.dim(3) == expected_last) return true;
    if (int4)
      return r.fail(rule, x.name, "Input '%s' dimension 3 should be (head_size + 1) / 2 = %lld for a packed int4 cache, got %lld",
                    x.name, (long long)expected_last, (long long)x.dim(3));
    return r.fail(rule, x.name, "Input '%s' dimension 3 should be same as head_size, got %lld", x.name, (long long)x.dim(3));
  };
  if (!last_dim(kc, int4 ? "1.9.2" : "1.5.4")) return false;
  if (vc.has()) {
    if (!rank_is("1.5.6", vc, 4)) return false;
    if (vc.dim(0) != kc.dim(0))
      return r.fail("1.5.7a", "value_cache", "Input 'value_cache' dimension 0 should be num_blocks, got %lld", (long long)vc.dim(0));
    if (vc.dim(1) != kc.dim(1))
      return r.fail("1.5.7b", "value_cache", "Input 'value_cache' dimension 1 should be block_size, got %lld", (long long)vc.dim(1));
    if (vc.dim(2) != kc.dim(2))
      return r.fail("1.5.8", "value_cache",
                    "Input 'key_cache' and 'value_cache' dimension 2 (kv num heads) should be the same, got %lld and %lld",
                    (long long)kc.dim(2), (long long)vc.dim(2));
    if (vc.dim(2) != kvh)
      return r.fail("1.5.9", "value_cache", "Input 'value_cache' shall have kv_num_heads, got %lld", (long long)vc.dim(2));
    if (vc.dim(3) != kc.dim(3))
      return r.fail("1.5.10", "value_cache",
                    "Input 'key_cache' and 'value_cache' dimension 3 (head size) should be the same, got %lld and %lld",
                    (long long)kc.dim(3), (long long)vc.dim(3));
    if (!last_dim(vc, int4 ? "1.9.3" : "1.5.11")) return false;
  }

  // §1.6 sequences, block table, slot mapping
  if (cum.rank() != 1 || cum.dim(0) < 2)
    return r.fail("1.6.1", "cumulative_sequence_length", "cumulative_sequence_length must be shape (batch_size + 1).");
  const int64_t batch = cum.dim(0) - 1;
  if (past.rank() != 1 || past.dim(0) != batch) return r.fail("1.6.2", "past_seqlens", "seqlens must be shape (batch_size).");
  if (bt.rank() != 2) return r.fail("1.6.3", "block_table", "block_table must be 2D.");
  if (bt.dim(0) != batch)
    return r.fail("1.6.4", "block_table", "block_table dimension 0 should be batch_size, got %lld", (long long)bt.dim(0));
  const int64_t max_blocks = bt.dim(1);
  if (max_blocks == 0) return r.fail("1.6.5", "block_table", "block_table dimension 1 must be positive, got 0");
  if (slots.has()) {
    if (!rank_is("1.6.6", slots, 1)) return false;
    if (slots.dim(0) != tokens)
      return r.fail("1.6.7", "slot_mapping", "Input 'slot_mapping' dimension 0 should be token_count (%lld), got %lld",
                    (long long)tokens, (long long)slots.dim(0));
  }

  // §1.7 extras
  if (sink.has()) {
    if (sink.rank() != 1) return r.fail("1.7.1", "head_sink", "head_sink must be a 1D tensor");
    if (sink.dim(0) != nh)
      return r.fail("1.7.2", "head_sink", "head_sink dimension 0 must be equal to the num heads, got %lld", (long long)sink.dim(0));
  }
  if (qn.has() != kn.has())
    return r.fail("1.7.3", qn.has() ? "k_norm_weight" : "q_norm_weight",
                  "Input 'q_norm_weight' and 'k_norm_weight' must be provided together.");
  if (qn.has()) {
    const In* w[2] = {&qn, &kn};
    const char* rule[2] = {"1.7.4", "1.7.5"};
    for (int i = 0; i < 2; ++i)
      if (w[i]->rank() != 1 || w[i]->dim(0) != head_size)
        return r.fail(rule[i], w[i]->name, "Input '%s' must be a 1D tensor of shape (head_size) = (%lld).", w[i]->name,
                      (long long)head_size);
    if (!(eps > 0.0f)) return r.fail("1.7.6", "qk_norm_epsilon", "qk_norm_epsilon must be positive, got %g", (double)eps);
  }
  int64_t rotary_dim = 0;
  if (cos.has() && sin.has()) {
    if (head_size % 16 != 0)
      return r.fail("1.7.7", "cos_cache", "head_size shall be a multiple of 16. Got head_size %% 16 == %lld",
                    (long long)(head_size % 16));
    for (const In* c : {&cos, &sin})
      if (c->rank() != 2)
        return r.fail("1.7.rank", c->name,
                      "Input '%s' is expected to have 2 dimensions, got %lld (ONNX Runtime does not check this and reads "
                      "dims 0 and 1 regardless)",
                      c->name, (long long)c->rank());
    const char* rule[2] = {"1.7.8", "1.7.9"};
    const In* cs[2] = {&cos, &sin};
    for (int i = 0; i < 2; ++i) {
      const int64_t d = cs[i]->dim(1);
      if (d > (head_size / 16) * 8 || d % 8 != 0)
        return r.fail(rule[i], cs[i]->name, "%s dimension 1 must be <= head_size / 2 and a multiple of 8.", cs[i]->name);
    }
    if (cos.dim(1) != sin.dim(1))
      return r.fail("1.7.10", "sin_cache", "cos_cache and sin_cache dimension 1 must be the same.");
    rotary_dim = 2 * cos.dim(1);
  } else if (cos.has() || sin.has()) {
    return r.fail("1.7.11", cos.has() ? "sin_cache" : "cos_cache",
                  "Input 'cos_cache' and 'sin_cache' shall be both present or both absent.");
  }
  const int64_t ro = a.rotary_offset;
  if (ro < 0 || ro % 8 != 0)
    return r.fail("1.7.12", "rotary_offset", "'rotary_offset' must be non-negative and a multiple of 8, got %lld", (long long)ro);
  if (ro + rotary_dim > head_size)
    return r.fail("1.7.13", "rotary_offset", "'rotary_offset' + rotary_dim must not exceed head_size. Got %lld + %lld > %lld",
                  (long long)ro, (long long)rotary_dim, (long long)head_size);

  // §1.8 quantization and cache dtypes (§1.9.1: a uint8 cache must name 'int4')
  const bool quantized = ctype == ORTPA_ELEM_INT8 || ctype == ORTPA_ELEM_FLOAT8E4M3FN || int4;
  const In* scl[2] = {&ks, &vs};
  for (int i = 0; i < (latent ? 1 : 2); ++i) {
    const char* qt = qattr[i];
    const char* sn = scl[i]->name;
    if (quant[i] == kQuantNone) {
      if (scl[i]->has()) return r.fail("1.8.1", sn, "Input '%s' must not be provided when '%s' is 'NONE'.", sn, qt);
      if (quantized)
        return r.fail("1.8.2", qt, "The KV cache has a quantized element type, so '%s' must be 'PER_TENSOR' or 'PER_CHANNEL'.", qt);
      continue;
    }
    if (!quantized)
      return r.fail("1.8.3", qt,
                    "'%s' is set, but the KV cache element type is not quantized. Use an int8 or float8e4m3fn cache, or "
                    "set '%s' to 'NONE'.",
                    qt, qt);
    if (!scl[i]->has()) return r.fail("1.8.4", sn, "Input '%s' is required when '%s' is not 'NONE'.", sn, qt);
    const int64_t count = scl[i]->size();
    if (quant[i] == kQuantPerTensor) {
      if (count != 1)
        return r.fail("1.8.5", sn, "Input '%s' must have exactly 1 element for PER_TENSOR quantization, got %lld", sn,
                      (long long)count);
    } else if (count != kvh * head_size || scl[i]->rank() == 0 || scl[i]->dim(scl[i]->rank() - 1) != head_size) {
      return r.fail("1.8.6", sn,
                    "Input '%s' must have shape (kv_num_heads, 1, head_size) = (%lld, 1, %lld) for PER_CHANNEL "
                    "quantization, got %s",
                    sn, (long long)kvh, (long long)head_size, fmt_shape(*scl[i]->t).c_str());
    }
  }
  const char* storage = storage_name(ctype);
  for (int i = 0; i < (latent ? 1 : 2); ++i) {
    const std::string& v = cdt[i];
    if (int4 && v.empty())
      return r.fail("1.9.1", cattr[i],
                    "'%s' must be 'int4' for a uint8 (packed) cache, got ''. Packed uint8 caches require an explicit "
                    "int4 logical type.",
                    cattr[i]);
    if (v.empty() || v == storage) continue;
    if (v == "int4" || v == "float4e2m1")
      return r.fail("1.8.7", cattr[i], "'%s' == '%s' requires a uint8 packed cache, which is not enabled in this build.",
                    cattr[i], v.c_str());
    return r.fail("1.8.8", cattr[i],
                  "'%s' is '%s', but the cache tensor's element type is '%s'. Leave the attribute at '' to use the "
                  "tensor's element type.",
                  cattr[i], v.c_str(), storage);
  }

  // §1.8.9 and the host-decidable §1.10 checks
  if (md.has() && (md.rank() != 1 || (md.dim(0) != 2 && md.dim(0) != 3)))
    return r.fail("1.8.9", "attention_metadata", "Input 'attention_metadata' must have shape (2) or (3), got %s",
                  fmt_shape(*md.t).c_str());
  if (a.do_rotary == 1 && !(cos.has() && sin.has()))
    return r.fail("1.10.1", "cos_cache", "cos_cache and sin_cache must be passed to PagedAttention when do_rotary = 1");
  if (tokens != 0) {
    if (num_blocks <= 0)
      return r.fail("1.10.5", "key_cache", "PagedAttention requires at least one physical cache block for non-empty input.");
    if (md.has()) {
      const int32_t* m = static_cast<const int32_t*>(a.attention_metadata.data);
      const int64_t q = m[0], kv = m[1], lo = md.dim(0) == 3 ? m[2] : 0;
      if (q < 0 || kv < 0 || lo < 0)
        return r.fail("1.10.9.1", "attention_metadata",
                      "PagedAttention: 'attention_metadata' entries must be non-negative, got [%lld, %lld, %lld]. Use 0 "
                      "for 'unknown'.",
                      (long long)q, (long long)kv, (long long)lo);
      const int64_t cap = max_blocks * bs;
      const int64_t bound = (kv > 0 && kv < cap) ? kv : cap;
      if (lo > bound)
        return r.fail("1.10.9.2", "attention_metadata",
                      "PagedAttention: attention_metadata max_kv_len_lower_bound (%lld) must not exceed max_kv_len_bound "
                      "(%lld).",
                      (long long)lo, (long long)bound);
    }
  }

  // the kernel's own: the activation types of output and caches it writes
  if (a.output.data != nullptr || a.output.elem_type != 0) {
    if (a.output.elem_type != a.query.elem_type)
      return r.fail("native.output", "output", "expected the output's element type to be the query's (%s), found %s",
                    type_name(a.query.elem_type), type_name(a.output.elem_type));
  }

  p->act_type = a.query.elem_type;
  p->kcache_type = ctype;
  p->tokens = tokens;
  p->num_heads = nh;
  p->kv_heads = kvh;
  p->head_size = head_size;
  p->v_head_size = v_head_size;
  p->q_stride = query.dim(1);
  p->q_offset = 0;
  if (packed) {
    p->k_src = a.query.data;
    p->k_stride = query.dim(1);
    p->k_offset = nh * head_size;
    p->v_src = a.query.data;
    p->v_stride = query.dim(1);
    p->v_offset = (nh + kvh) * head_size;
  } else {
    p->k_src = a.key.data;
    p->k_stride = key.dim(1);
    p->k_offset = 0;
    p->v_src = latent ? nullptr : a.value.data;
    p->v_stride = latent ? 0 : value.dim(1);
    p->v_offset = 0;
  }
  p->batch = batch;
  p->num_blocks = num_blocks;
  p->block_size = bs;
  p->max_blocks = max_blocks;
  p->cache_row = kc.dim(3);
  p->latent = latent;
  p->packed = packed;
  p->causal = a.is_causal == 1;
  p->rotary = a.do_rotary == 1;
  p->interleaved = a.rotary_interleaved == 1;
  p->rotary_offset = ro;
  p->rotary_dim = rotary_dim;
  p->cos_rows = cos.has() ? std::min(cos.dim(0), sin.dim(0)) : 0;
  p->window = a.local_window_size;
  p->scale = explicit_scale ? a.scale : (float)(1.0 / std::sqrt((double)head_size));
  p->softcap = a.softcap;
  p->eps = eps;
  p->qk_norm = qn.has();
  p->has_sink = sink.has();
  p->has_slots = slots.has();
  p->k_quant = quant[0];
  p->v_quant = latent ? kQuantNone : quant[1];
  p->int4 = int4;
  return true;
}

}  // namespace ortpa_native
