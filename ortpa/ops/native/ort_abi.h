// ONNX Runtime's C API as ortpa uses it, declared here from the documented ABI (docs/native.md).
//
// No package this project can install ships ONNX Runtime's headers, and the C API is a stable ABI: OrtApiBase is
// two function pointers, OrtApi is a table of function pointers that only ever grows at its end (an entry's index
// never changes once released), OrtCustomOp is a struct whose `version` field tells ONNX Runtime which of its
// trailing members exist. So this file declares only what ortpa's library calls: each OrtApi entry by its index
// in the table and its signature. tests/ops/test_native_abi.py round-trips every entry through checkable results,
// so a wrong index or signature fails a test.
#pragma once

#include <cstddef>
#include <cstdint>

extern "C" {
// Opaque ONNX Runtime objects: only ever handled through pointers.
struct OrtApi;
struct OrtStatus;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKernelInfo;
struct OrtKernelContext;
struct OrtValue;
struct OrtTensorTypeAndShapeInfo;
struct OrtShapeInferContext;
struct OrtOpAttr;

// OrtApiBase: what ONNX Runtime passes to RegisterCustomOps.
struct OrtApiBase {
  const OrtApi* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// The element types ortpa reads (ONNXTensorElementDataType: the same numbers as onnx.TensorProto.DataType).
enum OrtElementType : int {
  kOrtUndefined = 0,
  kOrtFloat = 1,
  kOrtUint8 = 2,
  kOrtInt8 = 3,
  kOrtInt32 = 6,
  kOrtInt64 = 7,
  kOrtFloat16 = 10,
  kOrtBfloat16 = 16,
  kOrtFloat8E4M3FN = 17,
};

// OrtErrorCode (the values ortpa returns)
enum OrtErrorCode : int {
  kOrtOk = 0,
  kOrtFail = 1,
  kOrtInvalidArgument = 2,
  kOrtNotImplemented = 9,
};

// OrtCustomOpInputOutputCharacteristic
enum OrtCustomOpCharacteristic : int {
  kOrtRequired = 0,
  kOrtOptional = 1,
  kOrtVariadic = 2,
};

// OrtMemType: kOrtMemTypeCPUInput keeps an input in host memory whatever the provider (attention_metadata).
enum OrtMemType : int {
  kOrtMemTypeCPUInput = -2,
  kOrtMemTypeDefault = 0,
};

// OrtOpAttrType (the values ReadOpAttr reads here)
enum OrtOpAttrType : int {
  kOrtOpAttrInt = 1,
  kOrtOpAttrFloat = 3,
  kOrtOpAttrString = 5,
};

// OrtCustomOp as of custom-op version 17: ONNX Runtime reads the members past GetInputMemoryType only when
// `version` says they exist (variadic: 14, CreateKernelV2/KernelComputeV2: 16, InferOutputShapeFn and the
// opset range: 17), so this layout with version = kOrtpaCustomOpVersion is complete; the later members
// (GetMayInplace, GetAliasMap, ...) are never read.
struct OrtCustomOp {
  uint32_t version;
  void* (*CreateKernel)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info);
  const char* (*GetName)(const OrtCustomOp* op);
  const char* (*GetExecutionProviderType)(const OrtCustomOp* op);
  int (*GetInputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(const OrtCustomOp* op);
  int (*GetOutputType)(const OrtCustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(const OrtCustomOp* op);
  void (*KernelCompute)(void* op_kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* op_kernel);
  int (*GetInputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(const OrtCustomOp* op, size_t index);
  int (*GetInputMemoryType)(const OrtCustomOp* op, size_t index);
  int (*GetVariadicInputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicInputHomogeneity)(const OrtCustomOp* op);
  int (*GetVariadicOutputMinArity)(const OrtCustomOp* op);
  int (*GetVariadicOutputHomogeneity)(const OrtCustomOp* op);
  OrtStatus* (*CreateKernelV2)(const OrtCustomOp* op, const OrtApi* api, const OrtKernelInfo* info, void** kernel);
  OrtStatus* (*KernelComputeV2)(void* op_kernel, OrtKernelContext* context);
  OrtStatus* (*InferOutputShapeFn)(const OrtCustomOp* op, OrtShapeInferContext* ctx);
  int (*GetStartVersion)(const OrtCustomOp* op);
  int (*GetEndVersion)(const OrtCustomOp* op);
};
}  // extern "C"

namespace ortpa::ort {

// The OrtApi version ortpa asks for: the release that added the newest entry used below
// (KernelContext_ParallelFor, ONNX Runtime 1.17, index 274; the shape-inference entries 267-272 sit before it).
// GetApi returns null on an older runtime.
constexpr uint32_t kApiVersion = 17;
// The OrtCustomOp layout above.
constexpr uint32_t kCustomOpVersion = 17;

// OrtApi entries: index in the table (its ABI position) and signature.
namespace entry {
constexpr size_t CreateStatus = 0;
constexpr size_t GetErrorCode = 1;
constexpr size_t GetErrorMessage = 2;
constexpr size_t CreateCustomOpDomain = 26;
constexpr size_t CustomOpDomain_Add = 27;
constexpr size_t AddCustomOpDomain = 28;
constexpr size_t GetTensorMutableData = 51;
constexpr size_t CreateTensorTypeAndShapeInfo = 57;
constexpr size_t SetTensorElementType = 58;
constexpr size_t SetDimensions = 59;
constexpr size_t GetTensorElementType = 60;
constexpr size_t GetDimensionsCount = 61;
constexpr size_t GetDimensions = 62;
constexpr size_t GetSymbolicDimensions = 63;
constexpr size_t GetTensorTypeAndShape = 65;
constexpr size_t KernelInfoGetAttribute_float = 85;
constexpr size_t KernelInfoGetAttribute_int64 = 86;
constexpr size_t KernelInfoGetAttribute_string = 87;
constexpr size_t KernelContext_GetInputCount = 88;
constexpr size_t KernelContext_GetOutputCount = 89;
constexpr size_t KernelContext_GetInput = 90;
constexpr size_t KernelContext_GetOutput = 91;
constexpr size_t ReleaseStatus = 93;
constexpr size_t ReleaseTensorTypeAndShapeInfo = 99;
constexpr size_t KernelInfo_GetNodeName = 244;
// output shape inference (OrtCustomOp::InferOutputShapeFn): the context owns the infos it hands out
constexpr size_t ShapeInferContext_GetInputCount = 267;
constexpr size_t ShapeInferContext_GetInputTypeShape = 268;
constexpr size_t ShapeInferContext_GetAttribute = 269;
constexpr size_t ShapeInferContext_SetOutputTypeShape = 270;
constexpr size_t SetSymbolicDimensions = 271;
constexpr size_t ReadOpAttr = 272;
constexpr size_t KernelContext_ParallelFor = 274;
}  // namespace entry

using CreateStatusFn = OrtStatus* (*)(int code, const char* msg);
using GetErrorCodeFn = int (*)(const OrtStatus* status);
using GetErrorMessageFn = const char* (*)(const OrtStatus* status);
using CreateCustomOpDomainFn = OrtStatus* (*)(const char* domain, OrtCustomOpDomain** out);
using CustomOpDomain_AddFn = OrtStatus* (*)(OrtCustomOpDomain* domain, const OrtCustomOp* op);
using AddCustomOpDomainFn = OrtStatus* (*)(OrtSessionOptions* options, OrtCustomOpDomain* domain);
using GetTensorMutableDataFn = OrtStatus* (*)(OrtValue* value, void** out);
using CreateTensorTypeAndShapeInfoFn = OrtStatus* (*)(OrtTensorTypeAndShapeInfo** out);
using SetTensorElementTypeFn = OrtStatus* (*)(OrtTensorTypeAndShapeInfo* info, int type);
using SetDimensionsFn = OrtStatus* (*)(OrtTensorTypeAndShapeInfo* info, const int64_t* dims, size_t count);
using GetSymbolicDimensionsFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, const char** names,
                                               size_t count);
using GetTensorElementTypeFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, int* out);
using GetDimensionsCountFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, size_t* out);
using GetDimensionsFn = OrtStatus* (*)(const OrtTensorTypeAndShapeInfo* info, int64_t* dims, size_t count);
using GetTensorTypeAndShapeFn = OrtStatus* (*)(const OrtValue* value, OrtTensorTypeAndShapeInfo** out);
using KernelInfoGetAttribute_floatFn = OrtStatus* (*)(const OrtKernelInfo* info, const char* name, float* out);
using KernelInfoGetAttribute_int64Fn = OrtStatus* (*)(const OrtKernelInfo* info, const char* name, int64_t* out);
using KernelInfoGetAttribute_stringFn = OrtStatus* (*)(const OrtKernelInfo* info, const char* name, char* out,
                                                       size_t* size);
using KernelContext_GetCountFn = OrtStatus* (*)(const OrtKernelContext* context, size_t* out);
using KernelContext_GetInputFn = OrtStatus* (*)(const OrtKernelContext* context, size_t index, const OrtValue** out);
using KernelContext_GetOutputFn = OrtStatus* (*)(OrtKernelContext* context, size_t index, const int64_t* dims,
                                                 size_t dim_count, OrtValue** out);
using ReleaseStatusFn = void (*)(OrtStatus* status);
using ReleaseTensorTypeAndShapeInfoFn = void (*)(OrtTensorTypeAndShapeInfo* info);
using KernelInfo_GetNodeNameFn = OrtStatus* (*)(const OrtKernelInfo* info, char* out, size_t* size);
using ShapeInferContext_GetInputCountFn = OrtStatus* (*)(const OrtShapeInferContext* context, size_t* out);
using ShapeInferContext_GetInputTypeShapeFn = OrtStatus* (*)(const OrtShapeInferContext* context, size_t index,
                                                             OrtTensorTypeAndShapeInfo** info);
using ShapeInferContext_GetAttributeFn = OrtStatus* (*)(const OrtShapeInferContext* context, const char* name,
                                                        const OrtOpAttr** attr);
using ShapeInferContext_SetOutputTypeShapeFn = OrtStatus* (*)(const OrtShapeInferContext* context, size_t index,
                                                              const OrtTensorTypeAndShapeInfo* info);
using SetSymbolicDimensionsFn = OrtStatus* (*)(OrtTensorTypeAndShapeInfo* info, const char** names, size_t count);
using ReadOpAttrFn = OrtStatus* (*)(const OrtOpAttr* attr, int type, void* data, size_t len, size_t* out);
using KernelContext_ParallelForFn = OrtStatus* (*)(const OrtKernelContext* context, void (*fn)(void*, size_t),
                                                   size_t total, size_t num_batch, void* usr_data);

// The entry at `index` of ONNX Runtime's function table, as the signature `Fn`. OrtApi is a struct of function
// pointers only, so entry i sits at byte offset i * sizeof(void (*)()).
template <typename Fn>
inline Fn Entry(const OrtApi* api, size_t index) {
  using AnyFn = void (*)();
  return reinterpret_cast<Fn>(reinterpret_cast<const AnyFn*>(api)[index]);
}

}  // namespace ortpa::ort
