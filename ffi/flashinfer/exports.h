// What libjax_moe_fi.so exports to the nanobind glue (module.cc): the XLA FFI handler symbols
// (moe_handlers.cu, fp8_block_handler.cu) and the host-side queries the Python wrapper needs at
// trace time (host_queries.cu). C types only across the library boundary, and no FlashInfer or
// XLA headers, so that the glue compiles without them. Scheme ids
// (jax_moe.backends.flashinfer_cutlass.SCHEME_IDS): 0 bf16, 1 fp8, 2 mxfp4, 3 fp8_block, 4 f16,
// 5 w4a8. device -1: the current device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

struct XLA_FFI_CallFrame;
struct XLA_FFI_Error;
// Defined with C linkage by XLA_FFI_DEFINE_HANDLER_SYMBOL; operands in moe_handlers.cu's and
// fp8_block_handler.cu's header comments.
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoe(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeFp8(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeMxfp4(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeFp8Block(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeF16(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeW4a8(XLA_FFI_CallFrame* call_frame);

namespace jax_moe_fi {

// fp8_block's id in jax_moe.backends.flashinfer_cutlass.SCHEME_IDS and compiled_schemes()'s mask.
inline constexpr int kFp8BlockSchemeId = 3;

// Bit (1 << scheme id) for each scheme compiled in, fp8_block's included.
int CompiledSchemes();

// Bytes of the uint8 workspace result of a scheme's handler for this problem (activation:
// TRT-LLM ActivationType). Creates the device's runner (fp8_block: the shape's runner).
size_t WorkspaceSize(int64_t num_tokens, int64_t hidden, int64_t inter, int64_t num_experts,
                     int64_t top_k, int64_t activation, int scheme, int device);

// The runner's GEMM1 (gemm_id 1) or GEMM2 tactic list: its length, and tactic `idx`'s
// description (written NUL-terminated, truncated to buf_len) with whether it is compiled into
// this build (1) or not (0). Not for fp8_block, which has no tactics.
int NumTactics(int gemm_id, int scheme, int device);
int TacticInfo(int gemm_id, int idx, int scheme, int device, char* buf, size_t buf_len);

// The (gemm1, gemm2) tactic indices the handler picks for a shape when given -1.
std::pair<int, int> DefaultTactics(int64_t num_tokens, int64_t hidden, int64_t inter,
                                   int64_t num_experts, int64_t top_k, int64_t activation,
                                   int scheme, int device);

// How many SM90 MoE GEMM kernels of a scheme this build compiled.
int NumCompiledSm90Tactics(int scheme);

// Called once by the nanobind module after libjax_moe_fi.so has loaded: restores the process
// environment that the library's load-time DeepGEMM guard changed (deepgemm_stubs.cc).
void AfterLoad();

}  // namespace jax_moe_fi
