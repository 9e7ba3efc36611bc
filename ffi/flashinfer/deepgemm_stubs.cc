// What libjax_moe_fi.so needs around DeepGEMM's JIT (FlashInfer's nv_internal/tensorrt_llm/
// deep_gemm, compiled in through fp8_blockscale_gemm.cu for scheme fp8_block), which it never runs:
// DeepGEMM's JIT compiler reports itself valid only after its include directories are set
// (deep_gemm::jit::Compiler::setIncludeDirs), which jax_moe never does, so the block-scale GEMM
// always runs its precompiled kernel. Built with scheme fp8_block only (cmake/flashinfer_moe.cmake).
//
// 1. Stand-ins for the CUDA driver functions DeepGEMM's JIT runtime calls directly
//    (deep_gemm/runtime.cuh, jit_utils.cuh), so that the library needs no libcuda link (not on a
//    pip JAX install's loader path; the rest of the library reaches the driver through
//    cudaGetDriverEntryPoint). Hidden: they bind only inside this library. Each reports failure.
// 2. DeepGEMM's compiler singleton is constructed while the library loads (a static initializer in
//    fp8_blockscale_gemm_kernel.cuh asks whether the JIT is enabled) and creates its cache
//    directories then: $TRTLLM_DG_CACHE_DIR, else ~/.tensorrt_llm, throwing (and so terminating
//    the process) where that cannot be created. Unless TRTLLM_DG_CACHE_DIR is set, it is set here,
//    before any default-priority static initializer of this library runs, to a directory under
//    the system temporary directory, so that loading never writes into $HOME; the nanobind module
//    removes it again right after the library has loaded (JaxMoeDeepGemmRestoreEnv, through
//    jax_moe_fi::Fp8BlockAfterLoad), so the process environment is left as it was.

#include <cstdlib>  // before the pragma: the C library's declarations keep their visibility
#include <string>

#pragma GCC visibility push(hidden)  // for cuda.h's declarations of the stand-ins below
#include <cuda.h>

namespace {
constexpr char kMsg[] = "jax_moe: DeepGEMM's JIT runtime is not available in this build";
constexpr char kEnv[] = "TRTLLM_DG_CACHE_DIR";
bool g_env_set_here = false;

__attribute__((constructor(101))) void JaxMoeDeepGemmCacheDir() {
  if (std::getenv(kEnv) != nullptr) return;
  char const* tmp = std::getenv("TMPDIR");
  std::string dir = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/jax_moe_deepgemm_unused";
  g_env_set_here = setenv(kEnv, dir.c_str(), /*overwrite=*/0) == 0;
}
}  // namespace

extern "C" {

// Undoes JaxMoeDeepGemmCacheDir's setenv (DeepGEMM has read it by now).
void JaxMoeDeepGemmRestoreEnv() {
  if (g_env_set_here) unsetenv(kEnv);
  g_env_set_here = false;
}

CUresult CUDAAPI cuGetErrorString(CUresult, const char** str) {
  if (str) *str = kMsg;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLibraryLoadData(CUlibrary*, const void*, CUjit_option*, void**, unsigned int,
                                   CUlibraryOption*, void**, unsigned int) {
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult CUDAAPI cuLibraryUnload(CUlibrary) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI cuLibraryGetKernelCount(unsigned int*, CUlibrary) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult CUDAAPI cuLibraryEnumerateKernels(CUkernel*, unsigned int, CUlibrary) {
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult CUDAAPI cuKernelGetName(const char**, CUkernel) { return CUDA_ERROR_NOT_SUPPORTED; }

}  // extern "C"

#pragma GCC visibility pop
