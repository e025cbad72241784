// One OrtCustomOp (ort_abi.h) per (op name, fixed input/output types): ONNX Runtime's custom-op registry builds
// one schema per name from all the ops of that name and picks, per node, the first op whose input types match;
// an output whose type is fixed in that op gets exactly that type. Fixing every type (instead of "any") is what
// lets a PagedAttention node whose cache type differs from its activation type infer each output's type.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "ort_api.h"

namespace ortpa::native {

// A kernel instance: made once per node at session creation, run on every Run.
class Kernel {
 public:
  virtual ~Kernel() = default;
  virtual void Compute(OrtKernelContext* context) = 0;
};

struct OpDef;
using KernelFactory = std::unique_ptr<Kernel> (*)(const OpDef& def, const ort::Api& api, const OrtKernelInfo* info);
// Output shape inference at session creation (OrtCustomOp::InferOutputShapeFn): declares the shapes it can, may
// throw (the glue drops the error: ONNX Runtime ignores the status this callback returns, and the kernel checks
// every call anyway).
using ShapeInference = void (*)(const ort::Api& api, const OrtShapeInferContext* context);

struct Port {
  int type;            // an OrtElementType; kOrtUndefined = any type
  int characteristic;  // kOrtRequired / kOrtOptional
  int memory = kOrtMemTypeDefault;
};

// OrtCustomOp must be the first base: ONNX Runtime hands the callbacks the OrtCustomOp* it was given.
struct OpDef : OrtCustomOp {
  OpDef(std::string op_name, std::vector<Port> op_inputs, std::vector<Port> op_outputs, KernelFactory op_factory,
        ShapeInference op_shapes = nullptr);
  std::string name;
  std::vector<Port> inputs;
  std::vector<Port> outputs;
  KernelFactory factory;
  ShapeInference shapes;
  // the table RegisterCustomOps got (shape inference gets none from ONNX Runtime); set before the op is added
  const OrtApi* api = nullptr;
};

}  // namespace ortpa::native
