// ortpa.test::AbiEcho: a debug op that returns what ONNX Runtime's C API told it, so that a test can check every
// OrtApi entry ortpa declares (ort_abi.h) against values it knows: a misplaced entry or a wrong signature gives a
// wrong value, an error or a crash, never a passing test. Registered in its own domain; no model ortpa writes
// uses it.
#include <cstring>
#include <string>
#include <vector>

#include "abi_echo_op.h"
#include "registry.h"

namespace ortpa::native {
namespace {

size_t ElementBytes(int type) {
  switch (type) {
    case kOrtUint8:
    case kOrtInt8:
    case kOrtFloat8E4M3FN:
      return 1;
    case kOrtFloat16:
    case kOrtBfloat16:
      return 2;
    case kOrtFloat:
    case kOrtInt32:
      return 4;
    case kOrtInt64:
      return 8;
    default:
      throw ort::Error(kOrtInvalidArgument, "AbiEcho: unsupported element type " + std::to_string(type));
  }
}

class AbiEcho final : public Kernel {
 public:
  AbiEcho(const ort::Api& api, const OrtKernelInfo* info)
      : api_(api),
        int_attr_(api.AttrInt(info, "int_attr", -1)),
        float_attr_(api.AttrFloat(info, "float_attr", -1.0f)),
        string_attr_(api.AttrString(info, "string_attr", "<absent>")),
        fail_(api.AttrInt(info, "fail", 0)),
        node_name_(api.NodeName(info)) {}

  void Compute(OrtKernelContext* context) override {
    if (fail_ != 0) throw ort::Error(kOrtInvalidArgument, "AbiEcho: failing as asked (fail=1)");
    const OrtValue* input = api_.Input(context, 0);
    const ort::TensorInfo info = api_.Info(input);
    Bytes(context, 0, OrtVersionString());
    std::vector<int64_t> ints{info.element_type, static_cast<int64_t>(info.shape.size())};
    ints.insert(ints.end(), info.shape.begin(), info.shape.end());
    ints.push_back(int_attr_);
    ints.push_back(static_cast<int64_t>(api_.InputCount(context)));
    ints.push_back(static_cast<int64_t>(api_.OutputCount(context)));
    OrtValue* out_ints = api_.Output(context, 1, {static_cast<int64_t>(ints.size())});
    std::memcpy(api_.Data(out_ints), ints.data(), ints.size() * sizeof(int64_t));
    OrtValue* out_float = api_.Output(context, 2, {1});
    std::memcpy(api_.Data(out_float), &float_attr_, sizeof(float));
    Bytes(context, 3, string_attr_);
    Bytes(context, 4, node_name_);
    // the input's bytes, copied one element per task on the session's intra-op pool
    size_t count = 1;
    for (int64_t d : info.shape) count *= static_cast<size_t>(d);
    Copy copy{static_cast<const char*>(api_.Data(input)), nullptr, ElementBytes(info.element_type)};
    OrtValue* out_bytes = api_.Output(context, 5, {static_cast<int64_t>(count * copy.size)});
    copy.dst = static_cast<char*>(api_.Data(out_bytes));
    api_.ParallelFor(context, &Copy::Run, count, &copy);
  }

 private:
  struct Copy {
    const char* src;
    char* dst;
    size_t size;
    static void Run(void* usr, size_t i) {
      auto* self = static_cast<Copy*>(usr);
      std::memcpy(self->dst + i * self->size, self->src + i * self->size, self->size);
    }
  };

  void Bytes(OrtKernelContext* context, size_t index, const std::string& text) {
    OrtValue* out = api_.Output(context, index, {static_cast<int64_t>(text.size())});
    if (!text.empty()) std::memcpy(api_.Data(out), text.data(), text.size());
  }

  ort::Api api_;
  int64_t int_attr_;
  float float_attr_;
  std::string string_attr_;
  int64_t fail_;
  std::string node_name_;
};

}  // namespace

OpDef& AbiEchoOp() {
  static OpDef def(
      "AbiEcho", {{kOrtUndefined, kOrtRequired}},
      {{kOrtUint8, kOrtRequired},
       {kOrtInt64, kOrtRequired},
       {kOrtFloat, kOrtRequired},
       {kOrtUint8, kOrtRequired},
       {kOrtUint8, kOrtRequired},
       {kOrtUint8, kOrtRequired}},
      [](const OpDef&, const ort::Api& api, const OrtKernelInfo* info) -> std::unique_ptr<Kernel> {
        return std::make_unique<AbiEcho>(api, info);
      });
  return def;
}

}  // namespace ortpa::native
