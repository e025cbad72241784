// The library's entry point: ONNX Runtime calls RegisterCustomOps when a session's options register this file
// (SessionOptions.register_custom_ops_library in Python).
#include <mutex>
#include <string>
#include <vector>

#include "abi_echo_op.h"
#include "custom_op.h"
#include "kernel/paged_attention.h"
#include "paged_attention_op.h"
#include "registry.h"

#if defined(_WIN32)
#define ORTPA_EXPORT extern "C" __declspec(dllexport)
#else
#define ORTPA_EXPORT extern "C" __attribute__((visibility("default")))
#endif

namespace ortpa::native {
namespace {

std::string& VersionSlot() {
  static std::string version;
  return version;
}

// The domains and the ops in them, made once per process: ONNX Runtime keeps pointers to both in every session
// registered with them, so they live as long as the library.
struct Domains {
  std::vector<OrtCustomOpDomain*> domains;
};

void AddDomain(const ort::Api& api, Domains& out, const char* name, const std::vector<OpDef*>& ops) {
  OrtCustomOpDomain* domain = nullptr;
  api.Check(ort::Entry<ort::CreateCustomOpDomainFn>(api.raw(), ort::entry::CreateCustomOpDomain)(name, &domain),
            "CreateCustomOpDomain");
  for (OpDef* op : ops) {
    op->api = api.raw();
    api.Check(ort::Entry<ort::CustomOpDomain_AddFn>(api.raw(), ort::entry::CustomOpDomain_Add)(domain, op),
              "CustomOpDomain_Add");
  }
  out.domains.push_back(domain);
}

}  // namespace

const std::string& OrtVersionString() { return VersionSlot(); }

}  // namespace ortpa::native

using ortpa::native::Domains;

ORTPA_EXPORT OrtStatus* RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* base) {
  const OrtApi* raw = base->GetApi(ortpa::ort::kApiVersion);
  if (raw == nullptr) {
    // CreateStatus is entry 0 of every version of the table, so version 1's serves to say why
    const OrtApi* v1 = base->GetApi(1);
    const std::string message = std::string("ortpa's native PagedAttention library needs ONNX Runtime's C API version ") +
                                std::to_string(ortpa::ort::kApiVersion) + " (onnxruntime >= 1." +
                                std::to_string(ortpa::ort::kApiVersion) + "); this onnxruntime is " +
                                base->GetVersionString() + " and does not provide it";
    return ortpa::ort::Entry<ortpa::ort::CreateStatusFn>(v1, ortpa::ort::entry::CreateStatus)(
        kOrtFail, message.c_str());
  }
  ortpa::ort::Api api(raw);
  static std::mutex mutex;
  static Domains* domains = nullptr;
  try {
    std::lock_guard<std::mutex> lock(mutex);
    if (domains == nullptr) {
      ortpa::native::VersionSlot() = base->GetVersionString();
      auto* made = new Domains();  // never freed: sessions of any later time may hold its pointers
      ortpa::native::AddDomain(api, *made, "ortpa.test", {&ortpa::native::AbiEchoOp()});
      ortpa::native::AddDomain(api, *made, ortpa::native::kPagedAttentionDomain, ortpa::native::PagedAttentionOps());
      domains = made;
    }
    for (OrtCustomOpDomain* domain : domains->domains) {
      api.Check(ortpa::ort::Entry<ortpa::ort::AddCustomOpDomainFn>(raw, ortpa::ort::entry::AddCustomOpDomain)(options,
                                                                                                          domain),
                "AddCustomOpDomain");
    }
    return nullptr;
  } catch (const ortpa::ort::Error& e) {
    return api.MakeStatus(e.code(), e.what());
  } catch (const std::exception& e) {
    return api.MakeStatus(kOrtFail, e.what());
  }
}
