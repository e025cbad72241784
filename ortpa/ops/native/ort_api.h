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
  bool Absent(OrtStatus* status) const {
    if (status == nullptr) return false;
    Entry<ReleaseStatusFn>(api_, entry::ReleaseStatus)(status);
    return true;
  }

  const OrtApi* api_;
};

}  // namespace ortpa::ort
