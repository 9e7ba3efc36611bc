// jax_moe's cubin loader for the TRT-LLM gen batched GEMMs (see cubin_dir.h). No FlashInfer
// headers: the one symbol the export headers need is defined at the bottom with their signature.

#include "cubin_dir.h"

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>

namespace jax_moe_trtllm {
namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr ? std::string() : std::string(v);
}

}  // namespace

std::string CubinRoot() {
  for (const char* name : {"JAX_MOE_TRTLLM_CUBIN_DIR", "FLASHINFER_CUBIN_DIR"}) {
    std::string v = Env(name);
    if (!v.empty()) return v;
  }
  std::string base = Env("FLASHINFER_WORKSPACE_BASE");
  if (base.empty()) base = Env("HOME");
  if (base.empty()) base = ".";
  return base + "/.cache/flashinfer/cubins";
}

std::string ReadCubin(const std::string& relative_path) {
  std::string const path = CubinRoot() + "/" + relative_path;
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("jax_moe: TRT-LLM gen cubin not found: " + path +
                             " (cubins are read from JAX_MOE_TRTLLM_CUBIN_DIR, else "
                             "FLASHINFER_CUBIN_DIR, else FlashInfer's cache ~/.cache/flashinfer/"
                             "cubins; jax_moe.backends.flashinfer_trtllm.missing_cubins() lists "
                             "what this build needs)");
  }
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (data.empty()) throw std::runtime_error("jax_moe: TRT-LLM gen cubin is empty: " + path);
  return data;
}

}  // namespace jax_moe_trtllm

// Declared by the batched-GEMM export headers (GemmOptions.h under TLLM_GEN_EXPORT_FLASHINFER).
// The sha256 is not checked here; the Python side can (flashinfer_trtllm.missing_cubins(verify=True)).
namespace flashinfer::trtllm_cubin_loader {
std::string getCubin(const std::string& kernelName, const std::string& sha256) {
  (void)sha256;
  return jax_moe_trtllm::ReadCubin(kernelName);
}
}  // namespace flashinfer::trtllm_cubin_loader
