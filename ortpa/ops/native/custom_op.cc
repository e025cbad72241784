#include "custom_op.h"

#include <exception>
#include <utility>

namespace ortpa::native {
namespace {

const OpDef& Def(const OrtCustomOp* op) { return *static_cast<const OpDef*>(op); }

// What any exception becomes at the C boundary: an OrtStatus ONNX Runtime turns into its own error.
OrtStatus* ToStatus(const ort::Api& api, const char* op_name) {
  try {
    throw;
  } catch (const ort::Error& e) {
    return api.MakeStatus(e.code(), e.what());
  } catch (const std::exception& e) {
    return api.MakeStatus(kOrtFail, (std::string(op_name) + ": " + e.what()).c_str());
  } catch (...) {
    return api.MakeStatus(kOrtFail, (std::string(op_name) + ": unknown error").c_str());
  }
}

struct Instance {
  ort::Api api;
  std::string op_name;
  std::unique_ptr<Kernel> kernel;
};

OrtStatus* CreateKernelV2(const OrtCustomOp* op, const OrtApi* raw_api, const OrtKernelInfo* info, void** out) {
  ort::Api api(raw_api);
  try {
    auto instance = std::make_unique<Instance>(Instance{api, Def(op).name, Def(op).factory(Def(op), api, info)});
    *out = instance.release();
    return nullptr;
  } catch (...) {
    return ToStatus(api, Def(op).name.c_str());
  }
}

OrtStatus* KernelComputeV2(void* kernel, OrtKernelContext* context) {
  auto* instance = static_cast<Instance*>(kernel);
  try {
    instance->kernel->Compute(context);
    return nullptr;
  } catch (...) {
    return ToStatus(instance->api, instance->op_name.c_str());
  }
}

void KernelDestroy(void* kernel) { delete static_cast<Instance*>(kernel); }

// ONNX Runtime ignores (and never releases) the status this returns, so an error here is dropped, not returned: an
// output whose shape was not declared stays unknown until the kernel runs, which checks every call.
OrtStatus* InferOutputShape(const OrtCustomOp* op, OrtShapeInferContext* context) {
  const OpDef& def = Def(op);
  if (def.shapes == nullptr || def.api == nullptr) return nullptr;
  try {
    def.shapes(ort::Api(def.api), context);
  } catch (...) {
  }
  return nullptr;
}

}  // namespace

OpDef::OpDef(std::string op_name, std::vector<Port> op_inputs, std::vector<Port> op_outputs, KernelFactory op_factory,
             ShapeInference op_shapes)
    : OrtCustomOp{}, name(std::move(op_name)), inputs(std::move(op_inputs)), outputs(std::move(op_outputs)),
      factory(op_factory), shapes(op_shapes) {
  version = ort::kCustomOpVersion;
  GetName = [](const OrtCustomOp* op) { return Def(op).name.c_str(); };
  GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return "CPUExecutionProvider"; };
  GetInputType = [](const OrtCustomOp* op, size_t i) { return Def(op).inputs[i].type; };
  GetInputTypeCount = [](const OrtCustomOp* op) { return Def(op).inputs.size(); };
  GetOutputType = [](const OrtCustomOp* op, size_t i) { return Def(op).outputs[i].type; };
  GetOutputTypeCount = [](const OrtCustomOp* op) { return Def(op).outputs.size(); };
  GetInputCharacteristic = [](const OrtCustomOp* op, size_t i) { return Def(op).inputs[i].characteristic; };
  GetOutputCharacteristic = [](const OrtCustomOp* op, size_t i) { return Def(op).outputs[i].characteristic; };
  GetInputMemoryType = [](const OrtCustomOp* op, size_t i) { return Def(op).inputs[i].memory; };
  GetVariadicInputMinArity = [](const OrtCustomOp*) { return 1; };
  GetVariadicInputHomogeneity = [](const OrtCustomOp*) { return 1; };
  GetVariadicOutputMinArity = [](const OrtCustomOp*) { return 1; };
  GetVariadicOutputHomogeneity = [](const OrtCustomOp*) { return 1; };
  // the V2 callbacks return errors as statuses; ONNX Runtime uses them instead of CreateKernel/KernelCompute
  CreateKernelV2 = &ortpa::native::CreateKernelV2;
  KernelComputeV2 = &ortpa::native::KernelComputeV2;
  KernelDestroy = &ortpa::native::KernelDestroy;
  // output types come from the fixed port types; shapes from the op's own rule where it has one (ONNX Runtime then
  // knows them when the session opens, for every node downstream). GetStartVersion, GetEndVersion stay null: the
  // op is valid from opset 1 of its domain.
  InferOutputShapeFn = &InferOutputShape;
}

}  // namespace ortpa::native
