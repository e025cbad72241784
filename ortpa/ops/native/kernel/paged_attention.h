/* ortpa's native CPU kernel of com.microsoft::PagedAttention: the C interface.
 *
 * Plain C (usable from C++, from ONNX Runtime custom-op glue and from Python's ctypes). The caller describes
 * every input of the op as an OrtpaTensor (null data = input absent), every attribute as a field, and the
 * output buffer; ortpa_paged_attention() validates the whole call as ortpa.ops.validate does (same rules, same
 * order, the validator's wording), sanitizes index inputs as ortpa.ops.oracle.sanitize does, writes the new
 * keys/values into the caches IN PLACE, and writes the attention output.
 *
 * Caches: key_cache.data / value_cache.data are written. The glue passes the buffer of key_cache_out /
 * value_cache_out (ONNX Runtime aliases it to the input when both are IO-bound to one buffer; where they
 * differ, the glue copies input -> output first), or, when the cache outputs are absent, the input buffer
 * itself (the op's contract: the cache is updated in place).
 *
 * Every index read from the index inputs (block ids, lengths, slots, positions) is checked before it
 * addresses anything; malformed values are sanitized exactly as the oracle does or rejected with an error.
 * Thread safety: the function keeps no state; concurrent calls on disjoint buffers are safe.
 */
#ifndef ORTPA_OPS_NATIVE_KERNEL_PAGED_ATTENTION_H_
#define ORTPA_OPS_NATIVE_KERNEL_PAGED_ATTENTION_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define ORTPA_NATIVE_EXPORT __declspec(dllexport)
#else
#define ORTPA_NATIVE_EXPORT __attribute__((visibility("default")))
#endif

/* Bumped whenever OrtpaPagedAttentionArgs or a signature below changes. */
#define ORTPA_PAGED_ATTENTION_ABI_VERSION 1

#define ORTPA_MAX_RANK 8

/* Element types (values of OrtpaTensor.elem_type). ONNX's TensorProto numbering, so the glue can pass
 * ONNX_TENSOR_ELEMENT_DATA_TYPE_* through unchanged: a uint8 cache is packed int4 (two per byte, logical
 * element 2*i in the low nibble of byte i, each nibble biased by 8), as in ONNX Runtime. */
enum OrtpaElemType {
  ORTPA_ELEM_UNDEFINED = 0,
  ORTPA_ELEM_FLOAT32 = 1,
  ORTPA_ELEM_UINT8 = 2, /* packed int4 cache */
  ORTPA_ELEM_INT8 = 3,
  ORTPA_ELEM_INT32 = 6,
  ORTPA_ELEM_INT64 = 7,
  ORTPA_ELEM_FLOAT16 = 10,
  ORTPA_ELEM_BFLOAT16 = 16,
  ORTPA_ELEM_FLOAT8E4M3FN = 17
};

/* One tensor: dense, row-major (C-contiguous), in CPU memory. data == NULL means "input absent".
 * rank is the tensor's true rank; a rank above ORTPA_MAX_RANK is rejected (dims beyond are not read). */
typedef struct OrtpaTensor {
  void* data;
  int32_t elem_type; /* enum OrtpaElemType */
  int32_t rank;
  int64_t dims[ORTPA_MAX_RANK];
} OrtpaTensor;

/* A parallel-for: run fn(usr, i) for every i in [0, total), in any order, possibly concurrently, and
 * return when all have finished. The glue routes it to ONNX Runtime's KernelContext_ParallelFor so that the
 * session's intra-op thread setting holds. NULL: the kernel runs on num_threads threads of its own for the
 * call (num_threads <= 1: serially). Results never depend on the threads used. */
typedef void (*OrtpaParallelFor)(void* ctx, void (*fn)(void* usr, size_t i), size_t total, void* usr);

typedef struct OrtpaPagedAttentionArgs {
  /* sizeof(OrtpaPagedAttentionArgs) and ORTPA_PAGED_ATTENTION_ABI_VERSION, as the caller was compiled with;
   * set by ortpa_paged_attention_args_init. A mismatch is an error, never a misread. */
  uint32_t struct_size;
  uint32_t abi_version;

  /* inputs, in the op's order (schema inputs 0..16) */
  OrtpaTensor query;                      /* T [tokens, hidden] or packed QKV */
  OrtpaTensor key;                        /* T, optional */
  OrtpaTensor value;                      /* T, optional */
  OrtpaTensor key_cache;                  /* T_CACHE, written in place */
  OrtpaTensor value_cache;                /* T_CACHE, optional (absent in LATENT), written in place */
  OrtpaTensor cumulative_sequence_length; /* int32 [batch + 1] */
  OrtpaTensor past_seqlens;               /* int32 [batch] */
  OrtpaTensor block_table;                /* int32 [batch, max_blocks_per_seq] */
  OrtpaTensor cos_cache;                  /* T, optional */
  OrtpaTensor sin_cache;                  /* T, optional */
  OrtpaTensor slot_mapping;               /* int32 [tokens], optional */
  OrtpaTensor head_sink;                  /* T [num_heads], optional */
  OrtpaTensor q_norm_weight;              /* T [head_size], optional */
  OrtpaTensor k_norm_weight;              /* T [head_size], optional */
  OrtpaTensor k_scale;                    /* float32, optional */
  OrtpaTensor v_scale;                    /* float32, optional */
  OrtpaTensor attention_metadata;         /* int32 [2] or [3], optional (bounds only; never changes results) */

  /* output 0: T [tokens, num_heads * v_head_size]; see ortpa_paged_attention_output_shape */
  OrtpaTensor output;

  /* attributes: the raw attribute values (the kernel applies ONNX Runtime's rules, e.g. is_causal == 1);
   * ortpa_paged_attention_args_init sets each to the op's default. num_heads / kv_num_heads are required:
   * the glue fails when the node lacks them. */
  int64_t num_heads;
  int64_t kv_num_heads;
  float scale;             /* 0: absent (1/sqrt(head_size)), as ONNX Runtime reads it */
  float softcap;           /* applied when > 0 */
  int64_t local_window_size;
  int64_t do_rotary;
  int64_t rotary_interleaved;
  int64_t v_head_size;     /* 0: head_size */
  int64_t rotary_offset;
  int64_t is_causal;
  float qk_norm_epsilon;
  const char* kv_cache_layout; /* NUL-terminated; NULL = default ("SEPARATE", "" for the dtypes, "NONE") */
  const char* k_quant_type;
  const char* v_quant_type;
  const char* k_cache_dtype;
  const char* v_cache_dtype;

  /* threading */
  OrtpaParallelFor parallel_for; /* NULL: serial */
  void* parallel_ctx;            /* passed as parallel_for's ctx */
  int32_t num_threads;           /* without parallel_for: threads the kernel may start; <= 1: serial */
  int32_t reserved0;
} OrtpaPagedAttentionArgs;

/* Set every field to "absent" / the op's attribute defaults (is_causal 1, local_window_size -1,
 * qk_norm_epsilon 1e-6, ...), struct_size and abi_version to this header's. */
ORTPA_NATIVE_EXPORT void ortpa_paged_attention_args_init(OrtpaPagedAttentionArgs* args);

/* Validate the call (everything but `output`) and give the output's shape [tokens, num_heads * v_head_size].
 * Returns 0, or non-zero with a NUL-terminated message in error (what was expected, what was found, which
 * input). The glue calls this to allocate output 0 before ortpa_paged_attention. */
ORTPA_NATIVE_EXPORT int ortpa_paged_attention_output_shape(const OrtpaPagedAttentionArgs* args, int64_t out_dims[2],
                                                           char* error, size_t error_len);

/* Run the op. Returns 0 on success, non-zero with a NUL-terminated message in error otherwise. Every check runs
 * before any write, so a rejected call leaves the caches and the output unchanged; only running out of memory
 * ("[native.memory] ...") can come after the cache write. */
ORTPA_NATIVE_EXPORT int ortpa_paged_attention(const OrtpaPagedAttentionArgs* args, char* error, size_t error_len);

/* The instruction-set path the kernel dispatches to on this machine: "avx2" (AVX2 + FMA + F16C) or
 * "baseline" (the ISA the library was compiled for). */
ORTPA_NATIVE_EXPORT const char* ortpa_native_isa(void);

/* ORTPA_PAGED_ATTENTION_ABI_VERSION of the compiled library. */
ORTPA_NATIVE_EXPORT uint32_t ortpa_native_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* ORTPA_OPS_NATIVE_KERNEL_PAGED_ATTENTION_H_ */
