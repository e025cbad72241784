#pragma once

#include <string>

namespace ortpa::native {

// The version string of the ONNX Runtime that registered ortpa's ops (OrtApiBase::GetVersionString).
const std::string& OrtVersionString();

}  // namespace ortpa::native
