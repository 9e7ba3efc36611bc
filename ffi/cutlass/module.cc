// jax_moe._jax_moe_cutlass: jax_moe's own CUTLASS (SM90) kernels as XLA FFI handler capsules, plus the
// host query the Python shape rule needs at trace time (workspace bytes) and the constants Python checks
// itself against (tiles, kinds, alignments). Built only where CUTLASS's headers were found and the CUDA
// archs include 90a (CMakeLists.txt, JAX_MOE_WITH_CUTLASS).
#include <nanobind/nanobind.h>

#include <cstdint>

#include "grouped_gemm.h"

namespace nb = nanobind;

NB_MODULE(_jax_moe_cutlass, m) {
  m.doc() = "jax_moe's CUTLASS SM90 grouped GEMMs (bf16, fp8 with row/column scales, the gated activation in GEMM1's epilogue, the weighted un-permute in GEMM2's epilogue, and bf16 backward) as XLA FFI custom calls";
  m.def("registrations", []() {
    nb::dict d;
    d["jax_moe_cutlass_grouped_gemm"] = nb::capsule(reinterpret_cast<void*>(&JaxMoeCutlassGroupedGemm));
    d["jax_moe_cutlass_grouped_gemm_fp8"] = nb::capsule(reinterpret_cast<void*>(&JaxMoeCutlassGroupedGemmFp8));
    d["jax_moe_cutlass_grouped_gemm_dgrad"] = nb::capsule(reinterpret_cast<void*>(&JaxMoeCutlassGroupedGemmDgrad));
    d["jax_moe_cutlass_grouped_gemm_wgrad"] = nb::capsule(reinterpret_cast<void*>(&JaxMoeCutlassGroupedGemmWgrad));
    d["jax_moe_cutlass_grouped_gemm_act"] = nb::capsule(reinterpret_cast<void*>(&JaxMoeCutlassGroupedGemmAct));
    d["jax_moe_cutlass_grouped_gemm_scatter"] =
        nb::capsule(reinterpret_cast<void*>(&JaxMoeCutlassGroupedGemmScatter));
    return d;
  }, "FFI target name -> handler capsule (platform CUDA).");
  m.def(
      "workspace_size",
      [](int64_t num_groups, int tile, int sm_count, int kind) {
        if (sm_count <= 0) sm_count = jax_moe::CutlassCurrentSmCount();
        if (sm_count <= 0) throw nb::value_error("no CUDA device to read the SM count from");
        const size_t bytes = jax_moe::CutlassGroupedGemmWorkspaceBytes(num_groups, tile, sm_count, kind);
        if (bytes == 0) throw nb::value_error("unknown tile or kind");
        return bytes;
      },
      nb::arg("num_groups"), nb::arg("tile"), nb::arg("sm_count") = 0, nb::arg("kind") = 0,
      "Bytes of the uint8 workspace result for num_groups experts, this tile and kind (0 bf16, 1 fp8, "
      "2 bf16 dgrad, 3 bf16 wgrad, 4 bf16 act, 5 fp8 act, 6 bf16 act on transposed b, 7 bf16 scatter on "
      "transposed b, 8 fp8 scatter); "
      "sm_count 0: the current device's.");
  m.def("current_sm_count", &jax_moe::CutlassCurrentSmCount, "SMs of the current CUDA device (0: none).");
  m.attr("num_tiles") = static_cast<int>(jax_moe::kNumCutlassTiles);
  m.attr("num_kinds") = static_cast<int>(jax_moe::kNumCutlassGemmKinds);
  m.attr("align_n") = jax_moe::kCutlassAlignN;
  m.attr("align_k_bf16") = jax_moe::kCutlassAlignKBf16;
  m.attr("align_k_fp8") = jax_moe::kCutlassAlignKFp8;
}
