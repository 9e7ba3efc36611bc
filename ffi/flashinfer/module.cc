// nanobind module jax_moe._jax_moe_flashinfer: exports the XLA FFI handlers of FlashInfer's CUTLASS
// fused-MoE runner and the host-side queries the Python wrapper needs at trace time (workspace
// size, tactic lists). Both live in libjax_moe_fi.so (ffi/flashinfer/cutlass_moe.cu), which this
// module links (fp8_block's handler and workspace query: ffi/flashinfer/cutlass_moe_fp8_block.cu);
// scheme ids: 0 bf16, 1 fp8, 2 mxfp4, 3 fp8_block, 4 f16, 5 w4a8.

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cutlass_moe_fp8_block.h"

namespace nb = nanobind;

// XLA_FFI_DEFINE_HANDLER_SYMBOL in cutlass_moe.cu defines it with C linkage.
struct XLA_FFI_CallFrame;
struct XLA_FFI_Error;
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoe(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeFp8(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeMxfp4(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeFp8Block(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeF16(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeFlashinferCutlassMoeW4a8(XLA_FFI_CallFrame* call_frame);

namespace jax_moe_fi {
int CompiledSchemes();
size_t WorkspaceSize(int64_t num_tokens, int64_t hidden, int64_t inter, int64_t num_experts,
                     int64_t top_k, int64_t activation, int scheme, int device);
int NumTactics(int gemm_id, int scheme, int device);
int TacticInfo(int gemm_id, int idx, int scheme, int device, char* buf, size_t buf_len);
std::pair<int, int> DefaultTactics(int64_t num_tokens, int64_t hidden, int64_t inter,
                                   int64_t num_experts, int64_t top_k, int64_t activation,
                                   int scheme, int device);
int NumCompiledSm90Tactics(int scheme);
}  // namespace jax_moe_fi

namespace {
// JAX_MOE_FI_SEGV_TRACE=1: print a native backtrace on SIGSEGV (debugging aid).
void SegvTrace(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
}  // namespace

NB_MODULE(_jax_moe_flashinfer, m) {
  if (std::getenv("JAX_MOE_FI_SEGV_TRACE")) signal(SIGSEGV, SegvTrace);
  jax_moe_fi::Fp8BlockAfterLoad();
  m.doc() = "FlashInfer CUTLASS fused-MoE (SM90; bf16, fp8, mxfp4, fp8_block, f16, w4a8) as XLA FFI custom calls";

  m.def("registrations", []() {
    nb::dict d;
    d["jax_moe_flashinfer_cutlass_moe"] =
        nb::capsule(reinterpret_cast<void*>(&JaxMoeFlashinferCutlassMoe));
    d["jax_moe_flashinfer_cutlass_moe_fp8"] =
        nb::capsule(reinterpret_cast<void*>(&JaxMoeFlashinferCutlassMoeFp8));
    d["jax_moe_flashinfer_cutlass_moe_mxfp4"] =
        nb::capsule(reinterpret_cast<void*>(&JaxMoeFlashinferCutlassMoeMxfp4));
    d["jax_moe_flashinfer_cutlass_moe_fp8_block"] =
        nb::capsule(reinterpret_cast<void*>(&JaxMoeFlashinferCutlassMoeFp8Block));
    d["jax_moe_flashinfer_cutlass_moe_f16"] =
        nb::capsule(reinterpret_cast<void*>(&JaxMoeFlashinferCutlassMoeF16));
    d["jax_moe_flashinfer_cutlass_moe_w4a8"] =
        nb::capsule(reinterpret_cast<void*>(&JaxMoeFlashinferCutlassMoeW4a8));
    return d;
  }, "FFI target name -> handler capsule (api_version=1, platform CUDA).");

  m.def("compiled_schemes", []() { return jax_moe_fi::CompiledSchemes() | jax_moe_fi::CompiledSchemesFp8Block(); },
        "Bit mask of the quant schemes compiled in: 1 << 0 bf16, 1 << 1 fp8, 1 << 2 mxfp4, "
        "1 << 3 fp8_block, 1 << 4 f16, 1 << 5 w4a8.");

  m.def("workspace_size",
        [](int64_t t, int64_t h, int64_t i, int64_t e, int64_t k, int64_t act, int scheme, int device) {
          if (scheme == jax_moe_fi::kFp8BlockSchemeId)  // no tactics: its own runner per shape
            return jax_moe_fi::Fp8BlockWorkspaceSize(t, h, i, e, k, act, device);
          return jax_moe_fi::WorkspaceSize(t, h, i, e, k, act, scheme, device);
        },
        nb::arg("num_tokens"), nb::arg("hidden"),
        nb::arg("inter"), nb::arg("num_experts"), nb::arg("top_k"), nb::arg("activation"),
        nb::arg("scheme") = 0, nb::arg("device") = -1,
        "Bytes of the uint8 workspace result the custom call needs for this problem. Needs a "
        "CUDA device (default: the current one).");

  m.def(
      "tactics",
      [](int gemm_id, int scheme, int device) {
        nb::list out;
        int const n = jax_moe_fi::NumTactics(gemm_id, scheme, device);
        char buf[256];
        for (int idx = 0; idx < n; ++idx) {
          bool const compiled =
              jax_moe_fi::TacticInfo(gemm_id, idx, scheme, device, buf, sizeof(buf)) != 0;
          out.append(nb::make_tuple(idx, nb::str(buf), compiled));
        }
        return out;
      },
      nb::arg("gemm_id"), nb::arg("scheme") = 0, nb::arg("device") = -1,
      "[(index, description, compiled)] of the runner's tactics for GEMM 1 or 2.");

  m.def("default_tactics", &jax_moe_fi::DefaultTactics, nb::arg("num_tokens"), nb::arg("hidden"),
        nb::arg("inter"), nb::arg("num_experts"), nb::arg("top_k"), nb::arg("activation"),
        nb::arg("scheme") = 0, nb::arg("device") = -1,
        "(gemm1, gemm2) tactic indices the handler uses for this shape when given -1.");

  m.def("num_compiled_sm90_tactics", &jax_moe_fi::NumCompiledSm90Tactics, nb::arg("scheme") = 0,
        "How many SM90 MoE GEMM kernels of a scheme this build compiled.");
}
