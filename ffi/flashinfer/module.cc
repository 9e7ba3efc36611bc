// nanobind module jax_moe._jax_moe_flashinfer: exports the XLA FFI handlers of FlashInfer's CUTLASS
// fused-MoE runner and the host-side queries the Python wrapper needs at trace time (workspace
// size, tactic lists). Both live in libjax_moe_fi.so (exports.h), which this module links;
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

#include "../common/capsules.h"
#include "exports.h"

namespace nb = nanobind;

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
  jax_moe_fi::AfterLoad();
  m.doc() = "FlashInfer CUTLASS fused-MoE (SM90; bf16, fp8, mxfp4, fp8_block, f16, w4a8) as XLA FFI custom calls";

  m.def("registrations", []() {
    return jax_moe::HandlerCapsules({{"jax_moe_flashinfer_cutlass_moe", &JaxMoeFlashinferCutlassMoe},
                                     {"jax_moe_flashinfer_cutlass_moe_fp8", &JaxMoeFlashinferCutlassMoeFp8},
                                     {"jax_moe_flashinfer_cutlass_moe_mxfp4", &JaxMoeFlashinferCutlassMoeMxfp4},
                                     {"jax_moe_flashinfer_cutlass_moe_fp8_block", &JaxMoeFlashinferCutlassMoeFp8Block},
                                     {"jax_moe_flashinfer_cutlass_moe_f16", &JaxMoeFlashinferCutlassMoeF16},
                                     {"jax_moe_flashinfer_cutlass_moe_w4a8", &JaxMoeFlashinferCutlassMoeW4a8}});
  }, "FFI target name -> handler capsule (api_version=1, platform CUDA).");

  m.def("compiled_schemes", &jax_moe_fi::CompiledSchemes,
        "Bit mask of the quant schemes compiled in: 1 << 0 bf16, 1 << 1 fp8, 1 << 2 mxfp4, "
        "1 << 3 fp8_block, 1 << 4 f16, 1 << 5 w4a8.");

  m.def("workspace_size", &jax_moe_fi::WorkspaceSize,
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
