#pragma once

#include <vector>

#include "custom_op.h"

namespace ortpa::native {

// The library registers PagedAttention in ONNX Runtime's own domain: a custom-op domain's registry is searched
// before the built-in ones, for schemas and kernels alike, so a session with this library registered runs the
// converted model's com.microsoft::PagedAttention nodes here, on the CPU provider, from the file as written
// (measured with onnxruntime 1.31; the model's other com.microsoft ops keep their own schemas and kernels).
inline constexpr const char* kPagedAttentionDomain = "com.microsoft";

// PagedAttention, one OpDef per (activation type T, cache type T_CACHE) pair (paged_attention_op.cc).
std::vector<OpDef*> PagedAttentionOps();

}  // namespace ortpa::native
