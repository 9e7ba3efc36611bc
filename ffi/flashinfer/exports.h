// Host-side entry points of the fp8_block scheme's handler (ffi/flashinfer/cutlass_moe_fp8_block.cu)
// for the nanobind module (ffi/flashinfer/module.cc). C types only across the library boundary.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_moe_fi {

// fp8_block's id in jax_moe.backends.flashinfer_cutlass.SCHEME_IDS and compiled_schemes()'s mask.
inline constexpr int kFp8BlockSchemeId = 3;

// 1 << kFp8BlockSchemeId when fp8_block is compiled into libjax_moe_fi.so, else 0.
int CompiledSchemesFp8Block();

// Bytes of the uint8 workspace result of jax_moe_flashinfer_cutlass_moe_fp8_block for this problem
// (activation: TRT-LLM ActivationType; device -1: the current one). Creates the shape's runner.
size_t Fp8BlockWorkspaceSize(int64_t num_tokens, int64_t hidden, int64_t inter, int64_t num_experts,
                             int64_t top_k, int64_t activation, int device);

// Called once by the nanobind module after libjax_moe_fi.so has loaded: restores the process
// environment that the library's load-time DeepGEMM guard changed (ffi/flashinfer/deepgemm_stubs.cc).
void Fp8BlockAfterLoad();

}  // namespace jax_moe_fi
