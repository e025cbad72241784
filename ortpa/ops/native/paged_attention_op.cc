// The PagedAttention custom op: reads the node's inputs and attributes through ONNX Runtime's C API, fills the
// kernel's OrtpaPagedAttentionArgs (kernel/paged_attention.h) and runs it. The caches are updated in place: when
// ONNX Runtime hands key_cache_out a buffer of its own, the input cache is copied there once and the kernel
// writes the copy; when the output is bound to the input's buffer (ortpa.PagedSession), nothing is copied.
#include "paged_attention_op.h"

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "kernel/paged_attention.h"

namespace ortpa::native {
namespace {

// input -> output cache copies made so far (ortpa_native_cache_copies): the tests' witness that a cache bound to
// one buffer as input and output is not copied
std::atomic<uint64_t> cache_copies{0};

enum Input : size_t {
  kQuery = 0,
  kKey,
  kValue,
  kKeyCache,
  kValueCache,
  kCumulativeSequenceLength,
  kPastSeqlens,
  kBlockTable,
  kCosCache,
  kSinCache,
  kSlotMapping,
  kHeadSink,
  kQNormWeight,
  kKNormWeight,
  kKScale,
  kVScale,
  kAttentionMetadata,
  kInputCount
};

size_t ElementBits(int type) {
  switch (type) {
    case kOrtUint8:
    case kOrtInt8:
    case kOrtFloat8E4M3FN:
      return 8;
    case kOrtFloat16:
    case kOrtBfloat16:
      return 16;
    case kOrtFloat:
    case kOrtInt32:
      return 32;
    case kOrtInt64:
      return 64;
    default:
      throw ort::Error(kOrtInvalidArgument, "PagedAttention: unexpected element type " + std::to_string(type));
  }
}

size_t ByteSize(const ort::TensorInfo& info) {
  size_t count = 1;
  for (int64_t d : info.shape) count *= static_cast<size_t>(d);
  return count * ElementBits(info.element_type) / 8;
}

struct ParallelContext {
  const ort::Api* api;
  const OrtKernelContext* context;
};

// The kernel's parallel-for on ONNX Runtime's intra-op pool. Should ONNX Runtime refuse (it does not for a CPU
// kernel), the work still gets done, serially: the kernel has no way to take an error from here.
void RunParallel(void* ctx, void (*fn)(void* usr, size_t i), size_t total, void* usr) {
  auto* pc = static_cast<ParallelContext*>(ctx);
  try {
    pc->api->ParallelFor(pc->context, fn, total, usr);
  } catch (const ort::Error&) {
    for (size_t i = 0; i < total; ++i) fn(usr, i);
  }
}

class PagedAttentionKernel final : public Kernel {
 public:
  PagedAttentionKernel(const ort::Api& api, const OrtKernelInfo* info)
      : api_(api),
        node_(api.NodeName(info)),
        kv_cache_layout_(api.AttrString(info, "kv_cache_layout", "SEPARATE")),
        k_quant_type_(api.AttrString(info, "k_quant_type", "NONE")),
        v_quant_type_(api.AttrString(info, "v_quant_type", "NONE")),
        k_cache_dtype_(api.AttrString(info, "k_cache_dtype", "")),
        v_cache_dtype_(api.AttrString(info, "v_cache_dtype", "")) {
    ortpa_paged_attention_args_init(&base_);
    base_.num_heads = api.AttrInt(info, "num_heads", 0);
    base_.kv_num_heads = api.AttrInt(info, "kv_num_heads", 0);
    if (base_.num_heads <= 0 || base_.kv_num_heads <= 0) {
      throw ort::Error(kOrtInvalidArgument, "PagedAttention node '" + node_ +
                                                "': the attributes num_heads and kv_num_heads are required (> 0)");
    }
    base_.scale = api.AttrFloat(info, "scale", base_.scale);
    base_.softcap = api.AttrFloat(info, "softcap", base_.softcap);
    base_.local_window_size = api.AttrInt(info, "local_window_size", base_.local_window_size);
    base_.do_rotary = api.AttrInt(info, "do_rotary", base_.do_rotary);
    base_.rotary_interleaved = api.AttrInt(info, "rotary_interleaved", base_.rotary_interleaved);
    base_.v_head_size = api.AttrInt(info, "v_head_size", base_.v_head_size);
    base_.rotary_offset = api.AttrInt(info, "rotary_offset", base_.rotary_offset);
    base_.is_causal = api.AttrInt(info, "is_causal", base_.is_causal);
    base_.qk_norm_epsilon = api.AttrFloat(info, "qk_norm_epsilon", base_.qk_norm_epsilon);
    base_.kv_cache_layout = kv_cache_layout_.c_str();
    base_.k_quant_type = k_quant_type_.c_str();
    base_.v_quant_type = v_quant_type_.c_str();
    base_.k_cache_dtype = k_cache_dtype_.c_str();
    base_.v_cache_dtype = v_cache_dtype_.c_str();
    base_.parallel_for = &RunParallel;  // num_threads stays unset: the kernel starts no threads of its own
  }

  void Compute(OrtKernelContext* context) override {
    OrtpaPagedAttentionArgs args = base_;
    OrtpaTensor* slots[kInputCount] = {
        &args.query,     &args.key,         &args.value,         &args.key_cache,     &args.value_cache,
        &args.cumulative_sequence_length,   &args.past_seqlens,  &args.block_table,   &args.cos_cache,
        &args.sin_cache, &args.slot_mapping, &args.head_sink,    &args.q_norm_weight, &args.k_norm_weight,
        &args.k_scale,   &args.v_scale,     &args.attention_metadata};
    ort::TensorInfo cache_info[2];
    for (size_t i = 0; i < kInputCount; ++i) {
      const OrtValue* value = api_.Input(context, i);
      if (value == nullptr) continue;
      const ort::TensorInfo info = api_.Info(value);
      Fill(*slots[i], api_.Data(value), info, i);
      if (i == kKeyCache) cache_info[0] = info;
      if (i == kValueCache) cache_info[1] = info;
    }
    // each cache output shares its input's buffer: the kernel writes the output's buffer, a copy of the input
    // unless ONNX Runtime gave both the same memory
    for (size_t c = 0; c < 2; ++c) {
      OrtpaTensor& cache = c == 0 ? args.key_cache : args.value_cache;
      if (cache.data == nullptr) continue;
      OrtValue* out = api_.Output(context, 1 + c, cache_info[c].shape);
      if (out == nullptr) continue;  // no cache output: the input is updated in place (the op's contract)
      void* target = api_.Data(out);
      if (target != cache.data) {
        std::memcpy(target, cache.data, ByteSize(cache_info[c]));
        cache_copies.fetch_add(1, std::memory_order_relaxed);
      }
      cache.data = target;
    }
    ParallelContext parallel{&api_, context};
    args.parallel_ctx = &parallel;
    char error[1024] = {0};
    int64_t dims[2] = {0, 0};
    if (ortpa_paged_attention_output_shape(&args, dims, error, sizeof(error)) != 0) Fail(error);
    OrtValue* output = api_.Output(context, 0, {dims[0], dims[1]});
    const ort::TensorInfo output_info = api_.Info(output);
    Fill(args.output, api_.Data(output), output_info, 0);
    if (ortpa_paged_attention(&args, error, sizeof(error)) != 0) Fail(error);
  }

 private:
  void Fill(OrtpaTensor& tensor, void* data, const ort::TensorInfo& info, size_t index) const {
    if (info.shape.size() > ORTPA_MAX_RANK) {
      throw ort::Error(kOrtInvalidArgument, "PagedAttention node '" + node_ + "': input " + std::to_string(index) +
                                                " has rank " + std::to_string(info.shape.size()) + ", at most " +
                                                std::to_string(ORTPA_MAX_RANK) + " expected");
    }
    // ONNX Runtime gives an empty tensor (a step with no tokens) no buffer; the kernel reads null as "absent"
    static char no_elements = 0;
    tensor.data = data != nullptr ? data : &no_elements;
    tensor.elem_type = info.element_type;
    tensor.rank = static_cast<int32_t>(info.shape.size());
    for (size_t d = 0; d < info.shape.size(); ++d) tensor.dims[d] = info.shape[d];
  }

  [[noreturn]] void Fail(const char* error) const {
    throw ort::Error(kOrtInvalidArgument, "PagedAttention node '" + node_ + "': " + error);
  }

  ort::Api api_;
  std::string node_;
  std::string kv_cache_layout_, k_quant_type_, v_quant_type_, k_cache_dtype_, v_cache_dtype_;
  OrtpaPagedAttentionArgs base_;
};

std::unique_ptr<Kernel> Make(const OpDef&, const ort::Api& api, const OrtKernelInfo* info) {
  return std::make_unique<PagedAttentionKernel>(api, info);
}

// Output 0's shape when the session opens, by ONNX Runtime's rule for the op (reference section 2.3, as
// ortpa.ops.shape_inference writes it for onnx): [tokens, num_heads * v_head_size], tokens as the query's first
// dimension (a value or a symbol), the width from the query's (packed QKV: its query heads' share; LATENT:
// num_heads * v_head_size). Where a dimension cannot be known here the shape stays undeclared, as before. The
// cache outputs are left alone: the context cannot say whether the node has them (ONNX Runtime does not bound
// the output index), and they are the cache inputs' tensors anyway.
// An absent optional input reaches shape inference as a tensor of undefined element type (onnxruntime 1.31).
bool Present(const ort::Api& api, const OrtShapeInferContext* context, size_t index) {
  ort::SymbolicInfo info;
  return api.InferInput(context, index, &info) && info.element_type != kOrtUndefined;
}

void InferShapes(const ort::Api& api, const OrtShapeInferContext* context) {
  ort::SymbolicInfo query;
  if (!api.InferInput(context, kQuery, &query) || query.shape.size() != 2 || !query.Known(0)) return;
  const int64_t num_heads = api.InferAttrInt(context, "num_heads", 0);
  const int64_t kv_heads = api.InferAttrInt(context, "kv_num_heads", 0);
  const int64_t v_head = api.InferAttrInt(context, "v_head_size", 0);
  const bool latent = api.InferAttrString(context, "kv_cache_layout", "SEPARATE") == "LATENT";
  const int64_t hidden = query.shape[1];
  if (hidden < 0 || num_heads <= 0 || kv_heads < 0) return;
  const bool separate_kv = Present(api, context, kKey) && Present(api, context, kValue);
  int64_t width = hidden;
  if (!latent && !separate_kv) {  // packed QKV: [tokens, (num_heads + 2 * kv_num_heads) * head_size]
    if (hidden % (num_heads + 2 * kv_heads) != 0) return;  // a call the kernel refuses when it runs
    width = hidden / (num_heads + 2 * kv_heads) * num_heads;
  } else if (latent && v_head > 0) {
    width = num_heads * v_head;
  }
  ort::SymbolicInfo output{query.element_type, {query.shape[0], width}, {query.names[0], ""}};
  api.SetInferredOutput(context, 0, output);
}

OpDef* Define(int t, int c) {
  const int s = kOrtInt32;
  const Port req_t{t, kOrtRequired}, opt_t{t, kOrtOptional}, opt_s{s, kOrtOptional};
  const Port opt_scale{kOrtFloat, kOrtOptional};
  std::vector<Port> inputs{req_t, opt_t, opt_t, {c, kOrtRequired}, {c, kOrtOptional}, {s, kOrtRequired},
                           {s, kOrtRequired}, {s, kOrtRequired}, opt_t, opt_t, opt_s, opt_t, opt_t, opt_t,
                           opt_scale, opt_scale, {s, kOrtOptional, kOrtMemTypeCPUInput}};
  std::vector<Port> outputs{req_t, {c, kOrtOptional}, {c, kOrtOptional}};
  return new OpDef("PagedAttention", std::move(inputs), std::move(outputs), &Make, &InferShapes);
}

}  // namespace

std::vector<OpDef*> PagedAttentionOps() {
  // made once, never freed: ONNX Runtime's sessions keep pointers to them
  static const std::vector<OpDef*> ops = [] {
    std::vector<OpDef*> made;
    for (int t : {kOrtFloat16, kOrtBfloat16, kOrtFloat}) {
      for (int c : {kOrtFloat16, kOrtBfloat16, kOrtFloat, kOrtInt8, kOrtFloat8E4M3FN, kOrtUint8}) {
        made.push_back(Define(t, c));
      }
    }
    return made;
  }();
  return ops;
}

}  // namespace ortpa::native

extern "C" ORTPA_NATIVE_EXPORT uint64_t ortpa_native_cache_copies() {
  return ortpa::native::cache_copies.load(std::memory_order_relaxed);
}
