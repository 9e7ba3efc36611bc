// nanobind module jax_moe._jax_moe_trtllm: the XLA FFI handler of FlashInfer's TRT-LLM gen fused MoE
// (SM100, cubins read from a directory) and the host queries the Python wrapper needs at trace
// time. Everything else lives in libjax_moe_trtllm.so (cmake/flashinfer_trtllm.cmake).

#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "../common/capsules.h"
#include "host_queries.h"

namespace nb = nanobind;

struct XLA_FFI_CallFrame;
struct XLA_FFI_Error;
extern "C" XLA_FFI_Error* JaxMoeTrtllmFp8PerTensorMoe(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeTrtllmFp4BlockScaleMoe(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeTrtllmFp8BlockScaleMoe(XLA_FFI_CallFrame* call_frame);

NB_MODULE(_jax_moe_trtllm, m) {
  m.doc() = "FlashInfer TRT-LLM gen fused MoE (SM100; fp8 per-tensor, fp4 block scale: nvfp4, mxfp4; fp8 block scale) as XLA FFI custom calls";

  m.def("registrations", []() {
    return jax_moe::HandlerCapsules({{"jax_moe_trtllm_fp8_per_tensor_moe", &JaxMoeTrtllmFp8PerTensorMoe},
                                     {"jax_moe_trtllm_fp4_block_scale_moe", &JaxMoeTrtllmFp4BlockScaleMoe},
                                     {"jax_moe_trtllm_fp8_block_scale_moe", &JaxMoeTrtllmFp8BlockScaleMoe}});
  }, "FFI target name -> handler capsule (api_version=1, platform CUDA).");

  m.def("schemes", []() { return std::vector<std::string>{"fp8", "nvfp4", "mxfp4", "fp8_block"}; },
        "The quant schemes compiled in, in jax_moe's names.");

  m.def("cubin_root", &jax_moe_trtllm::CubinRoot,
        "The directory cubins are read from (JAX_MOE_TRTLLM_CUBIN_DIR, else FLASHINFER_CUBIN_DIR, "
        "else FlashInfer's cache).");

  m.def("workspace_size", &jax_moe_trtllm::WorkspaceSize, nb::arg("tokens"), nb::arg("hidden"),
        nb::arg("inter"), nb::arg("experts"), nb::arg("top_k"), nb::arg("activation"),
        nb::arg("tile_n"), nb::arg("config") = -1, nb::arg("device") = 0, nb::arg("scheme") = 0,
        "Bytes of the uint8 workspace result (needs an SM100 device; scheme: host_queries.h).");

  m.def("default_tile_n", &jax_moe_trtllm::DefaultTileN, nb::arg("tokens"), nb::arg("top_k"),
        nb::arg("experts"), "Tokens per CTA tile the handler uses for this shape by default.");

  m.def("default_config", &jax_moe_trtllm::DefaultConfig, nb::arg("tokens"), nb::arg("hidden"),
        nb::arg("inter"), nb::arg("experts"), nb::arg("top_k"), nb::arg("activation"),
        nb::arg("tile_n"), nb::arg("device") = 0, nb::arg("scheme") = 0,
        "The runner's default config index.");

  m.def("cubins", &jax_moe_trtllm::Cubins, nb::arg("scheme") = 0, nb::arg("activation") = 3,
        nb::arg("tile_n") = -1, nb::arg("config") = -1, nb::arg("tokens") = 0,
        nb::arg("hidden") = 0, nb::arg("inter") = 0, nb::arg("experts") = 0,
        nb::arg("top_k") = 0, nb::arg("device") = 0,
        "[(relative cubin path, sha256)] the runner may load (see host_queries.h).");
}
