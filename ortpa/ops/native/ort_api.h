// Typed, exception-based wrappers over the OrtApi entries declared in ort_abi.h, and the OrtCustomOp glue every
// ortpa op shares. C++ exceptions never cross into ONNX Runtime: the op callbacks catch them and return an
// OrtStatus (made by CreateStatus) carrying the message.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "ort_abi.h"

namespace ortpa::ort {

// An error to hand back to ONNX Runtime as an OrtStatus with this code.
class Error : public std::runtime_error {
 public:
  Error(int code, const std::string& message) : std::runtime_error(message), code_(code) {}
  int code() const { return code_; }

 private:
  int code_;
};

// A tensor's element type and shape.
struct TensorInfo {
  int element_type = kOrtUndefined;
  std::vector<int64_t> shape;
};

// A tensor's element type and shape as shape inference sees it: a dimension is a value (`names[d]` empty), a
// symbol (`names[d]`, `shape[d]` = -1) or unknown (-1 and no name).
struct SymbolicInfo {
  int element_type = kOrtUndefined;
  std::vector<int64_t> shape;
  std::vector<std::string> names;
  bool Known(size_t d) const { return shape[d] >= 0 || !names[d].empty(); }
};

class Api {
 public:
  explicit Api(const OrtApi* api) : api_(api) {}
  const OrtApi* raw() const { return api_; }

  OrtStatus* MakeStatus(int code, const char* message) const {
    return Entry<CreateStatusFn>(api_, entry::CreateStatus)(code, message);
  }

  // Throws Error with ONNX Runtime's code and message when `status` is an error; releases it either way.
  void Check(OrtStatus* status, const char* what) const {
    if (status == nullptr) return;
    const int code = Entry<GetErrorCodeFn>(api_, entry::GetErrorCode)(status);
    std::string message = std::string(what) + ": " + Entry<GetErrorMessageFn>(api_, entry::GetErrorMessage)(status);
    Entry<ReleaseStatusFn>(api_, entry::ReleaseStatus)(status);
    throw Error(code, message);
  }

  // An attribute, or `fallback` when the node does not set it (ONNX Runtime reports absence as an error status).
  int64_t AttrInt(const OrtKernelInfo* info, const char* name, int64_t fallback) const {
    int64_t value = 0;
    OrtStatus* status = Entry<KernelInfoGetAttribute_int64Fn>(api_, entry::KernelInfoGetAttribute_int64)(info, name, &value);
    return Absent(status) ? fallback : value;
  }
  float AttrFloat(const OrtKernelInfo* info, const char* name, float fallback) const {
    float value = 0.0f;
    OrtStatus* status = Entry<KernelInfoGetAttribute_floatFn>(api_, entry::KernelInfoGetAttribute_float)(info, name, &value);
    return Absent(status) ? fallback : value;
  }
  std::string AttrString(const OrtKernelInfo* info, const char* name, const std::string& fallback) const {
    auto get = Entry<KernelInfoGetAttribute_stringFn>(api_, entry::KernelInfoGetAttribute_string);
    size_t size = 0;  // asking with a null buffer returns the size, terminating NUL included
    if (Absent(get(info, name, nullptr, &size))) return fallback;
    std::string value(size, '\0');
    Check(get(info, name, value.data(), &size), name);
    value.resize(size > 0 ? size - 1 : 0);
    return value;
  }
  std::string NodeName(const OrtKernelInfo* info) const {
    auto get = Entry<KernelInfo_GetNodeNameFn>(api_, entry::KernelInfo_GetNodeName);
    size_t size = 0;
    if (Absent(get(info, nullptr, &size)) || size == 0) return "";
    std::string value(size, '\0');
    Check(get(info, value.data(), &size), "KernelInfo_GetNodeName");
    value.resize(size - 1);
    return value;
  }

  size_t InputCount(const OrtKernelContext* context) const {
    size_t count = 0;
    Check(Entry<KernelContext_GetCountFn>(api_, entry::KernelContext_GetInputCount)(context, &count), "input count");
    return count;
  }
  size_t OutputCount(const OrtKernelContext* context) const {
    size_t count = 0;
    Check(Entry<KernelContext_GetCountFn>(api_, entry::KernelContext_GetOutputCount)(context, &count), "output count");
    return count;
  }
  // null for an absent optional input
  const OrtValue* Input(const OrtKernelContext* context, size_t index) const {
    if (index >= InputCount(context)) return nullptr;
    const OrtValue* value = nullptr;
    Check(Entry<KernelContext_GetInputFn>(api_, entry::KernelContext_GetInput)(context, index, &value), "input");
    return value;
  }
  // null for an output the node does not produce
  OrtValue* Output(OrtKernelContext* context, size_t index, const std::vector<int64_t>& shape) const {
    if (index >= OutputCount(context)) return nullptr;
    OrtValue* value = nullptr;
    Check(Entry<KernelContext_GetOutputFn>(api_, entry::KernelContext_GetOutput)(context, index, shape.data(),
                                                                                 shape.size(), &value),
          "output");
    return value;
  }

  TensorInfo Info(const OrtValue* value) const {
    OrtTensorTypeAndShapeInfo* info = nullptr;
    Check(Entry<GetTensorTypeAndShapeFn>(api_, entry::GetTensorTypeAndShape)(value, &info), "tensor type and shape");
    TensorInfo out;
    OrtStatus* status = Entry<GetTensorElementTypeFn>(api_, entry::GetTensorElementType)(info, &out.element_type);
    size_t rank = 0;
    if (status == nullptr) status = Entry<GetDimensionsCountFn>(api_, entry::GetDimensionsCount)(info, &rank);
    if (status == nullptr) {
      out.shape.resize(rank);
      status = Entry<GetDimensionsFn>(api_, entry::GetDimensions)(info, out.shape.data(), rank);
    }
    Entry<ReleaseTensorTypeAndShapeInfoFn>(api_, entry::ReleaseTensorTypeAndShapeInfo)(info);
    Check(status, "tensor type and shape");
    return out;
  }

  // -- output shape inference (OrtCustomOp::InferOutputShapeFn); the context owns the infos it hands out --
  size_t InferInputCount(const OrtShapeInferContext* context) const {
    size_t count = 0;
    Check(Entry<ShapeInferContext_GetInputCountFn>(api_, entry::ShapeInferContext_GetInputCount)(context, &count),
          "ShapeInferContext_GetInputCount");
    return count;
  }
  // false for an input past the node's last one
  bool InferInput(const OrtShapeInferContext* context, size_t index, SymbolicInfo* out) const {
    if (index >= InferInputCount(context)) return false;
    OrtTensorTypeAndShapeInfo* info = nullptr;
    Check(Entry<ShapeInferContext_GetInputTypeShapeFn>(api_, entry::ShapeInferContext_GetInputTypeShape)(
              context, index, &info),
          "ShapeInferContext_GetInputTypeShape");
    size_t rank = 0;
    Check(Entry<GetTensorElementTypeFn>(api_, entry::GetTensorElementType)(info, &out->element_type),
          "GetTensorElementType");
    Check(Entry<GetDimensionsCountFn>(api_, entry::GetDimensionsCount)(info, &rank), "GetDimensionsCount");
    out->shape.assign(rank, 0);
    std::vector<const char*> names(rank, nullptr);
    if (rank > 0) {
      Check(Entry<GetDimensionsFn>(api_, entry::GetDimensions)(info, out->shape.data(), rank), "GetDimensions");
      Check(Entry<GetSymbolicDimensionsFn>(api_, entry::GetSymbolicDimensions)(info, names.data(), rank),
            "GetSymbolicDimensions");
    }
    out->names.clear();
    for (const char* name : names) out->names.emplace_back(name != nullptr ? name : "");
    return true;
  }
  // An attribute of the node being inferred, or `fallback` when it does not set it.
  int64_t InferAttrInt(const OrtShapeInferContext* context, const char* name, int64_t fallback) const {
    const OrtOpAttr* attr = InferAttr(context, name);
    int64_t value = 0;
    size_t size = 0;
    if (attr == nullptr || Absent(Entry<ReadOpAttrFn>(api_, entry::ReadOpAttr)(attr, kOrtOpAttrInt, &value,
                                                                                sizeof(value), &size))) {
      return fallback;
    }
    return value;
  }
  std::string InferAttrString(const OrtShapeInferContext* context, const char* name,
                              const std::string& fallback) const {
    const OrtOpAttr* attr = InferAttr(context, name);
    if (attr == nullptr) return fallback;
    auto read = Entry<ReadOpAttrFn>(api_, entry::ReadOpAttr);
    // a zero-length read fails and says the size: with the terminating NUL in the sources read (docs/native.md),
    // without it in onnxruntime 1.31; one byte more either way, and the string ends at the first NUL
    size_t size = 0;
    char probe = 0;
    OrtStatus* status = read(attr, kOrtOpAttrString, &probe, 0, &size);
    if (status != nullptr) Entry<ReleaseStatusFn>(api_, entry::ReleaseStatus)(status);
    std::vector<char> buffer(size + 1, '\0');
    if (Absent(read(attr, kOrtOpAttrString, buffer.data(), buffer.size(), &size))) return fallback;
    buffer.back() = '\0';
    return std::string(buffer.data());
  }
  // Declares output `index`'s shape (its element type comes from the op's fixed output type). Every dimension
  // must be known: a value or a symbol (ONNX Runtime would write an unknown one as the value -1).
  void SetInferredOutput(const OrtShapeInferContext* context, size_t index, const SymbolicInfo& tensor) const {
    OrtTensorTypeAndShapeInfo* info = nullptr;
    Check(Entry<CreateTensorTypeAndShapeInfoFn>(api_, entry::CreateTensorTypeAndShapeInfo)(&info),
          "CreateTensorTypeAndShapeInfo");
    std::vector<const char*> names;
    for (const std::string& name : tensor.names) names.push_back(name.c_str());
    OrtStatus* status = Entry<SetTensorElementTypeFn>(api_, entry::SetTensorElementType)(info, tensor.element_type);
    if (status == nullptr) {
      status = Entry<SetDimensionsFn>(api_, entry::SetDimensions)(info, tensor.shape.data(), tensor.shape.size());
    }
    if (status == nullptr) {
      status = Entry<SetSymbolicDimensionsFn>(api_, entry::SetSymbolicDimensions)(info, names.data(), names.size());
    }
    if (status == nullptr) {
      status = Entry<ShapeInferContext_SetOutputTypeShapeFn>(api_, entry::ShapeInferContext_SetOutputTypeShape)(
          context, index, info);
    }
    Entry<ReleaseTensorTypeAndShapeInfoFn>(api_, entry::ReleaseTensorTypeAndShapeInfo)(info);
    Check(status, "ShapeInferContext_SetOutputTypeShape");
  }

  void* Data(const OrtValue* value) const {
    void* data = nullptr;
    // GetTensorMutableData takes a non-const value; ortpa writes only through outputs and the aliased caches
    Check(Entry<GetTensorMutableDataFn>(api_, entry::GetTensorMutableData)(const_cast<OrtValue*>(value), &data),
          "tensor data");
    return data;
  }

  // fn(usr, i) for i in [0, total) on the session's intra-op thread pool (the session's thread setting holds).
  void ParallelFor(const OrtKernelContext* context, void (*fn)(void*, size_t), size_t total, void* usr) const {
    Check(Entry<KernelContext_ParallelForFn>(api_, entry::KernelContext_ParallelFor)(context, fn, total, 0, usr),
          "KernelContext_ParallelFor");
  }

 private:
  const OrtOpAttr* InferAttr(const OrtShapeInferContext* context, const char* name) const {
    const OrtOpAttr* attr = nullptr;
    auto get = Entry<ShapeInferContext_GetAttributeFn>(api_, entry::ShapeInferContext_GetAttribute);
    return Absent(get(context, name, &attr)) ? nullptr : attr;
  }

  bool Absent(OrtStatus* status) const {
    if (status == nullptr) return false;
    Entry<ReleaseStatusFn>(api_, entry::ReleaseStatus)(status);
    return true;
  }

  const OrtApi* api_;
};

}  // namespace ortpa::ort
