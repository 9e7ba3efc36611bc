// What every FlashInfer CUTLASS MoE handler (moe_handlers.cu, fp8_block_handler.cu) does the same
// way once its scheme's operands are decoded: the operands all schemes share, the check of the
// optional ones (biases, SwigluBias parameters), and the runner call with its workspace check.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <optional>
#include <string>

#include "runner_cache.h"

namespace jax_moe_fi {

// The operands and results of every scheme's handler (its scales come separately):
//   x [T, H], w13 [E, N1, H/kPack], w2 [E, H, I/kPack], topk_ids [T, k] int32,
//   topk_weights [T, k] float32, w13_bias [E, N1] or [0], w2_bias [E, H] or [0],
//   swiglu [3, E] float32 or [0]; out [T, Hu], workspace [W] uint8.
struct MoeOperands {
  ffi::AnyBuffer x, w13, w2;
  ffi::Buffer<ffi::S32> topk_ids;
  ffi::Buffer<ffi::F32> topk_weights;
  ffi::AnyBuffer w13_bias, w2_bias;
  ffi::Buffer<ffi::F32> swiglu;
  ffi::Result<ffi::AnyBuffer> out;
  ffi::ResultBuffer<ffi::U8> workspace;
};

// The optional operands, an empty buffer meaning "none": w13_bias [E, n1] and w2_bias [E, h] in
// S's bias dtype, swiglu [3, E] float32 exactly with SwigluBias. n1_name: how messages call N1.
// The reason they are refused, if they are.
template <typename S>
std::optional<std::string> CheckOptionalOperands(MoeOperands& b, int64_t e, int64_t n1,
                                                 int64_t h, bool swiglu_bias,
                                                 std::string const& n1_name) {
  auto is_2d = [](ffi::AnyBuffer const& buf, int64_t d0, int64_t d1) {
    auto d = buf.dimensions();
    return d.size() == 2 && d[0] == d0 && d[1] == d1;
  };
  if (b.w13_bias.element_count() > 0 &&
      (!is_2d(b.w13_bias, e, n1) || b.w13_bias.element_type() != S::kBias))
    return "w13_bias must be [E, " + n1_name + "] " + S::kBiasName + " or empty";
  if (b.w2_bias.element_count() > 0 && (!is_2d(b.w2_bias, e, h) || b.w2_bias.element_type() != S::kBias))
    return std::string("w2_bias must be [E, H] ") + S::kBiasName + " or empty";
  auto sd = b.swiglu.dimensions();
  if (swiglu_bias && !(sd.size() == 2 && sd[0] == 3 && sd[1] == e))
    return std::string("SwigluBias needs swiglu [3, E] float32 (alpha, beta, limit per expert)");
  if (!swiglu_bias && b.swiglu.element_count() != 0)
    return std::string("swiglu parameters are only taken with the SwigluBias activation");
  return std::nullopt;
}

// One runMoe of runner `r` on problem `key` (hu: the columns of out written; deepseek: fp8_block's
// block-scale GEMMs), called with the runner's lock held and the device current. Checks the
// workspace, then runs `before_run()` (the tactic choice) and the runner. Errors read
// "jax_moe flashinfer_cutlass_moe (<scheme>): ..." and, from CUDA, "jax_moe <who>: CUDA error: ...".
template <typename S, typename R, typename F>
ffi::Error RunFused(R& r, char const* who, MoeOperands& b, ShapeKey const& key, int64_t hu,
                    tk::QuantParams const& quant, bool deepseek, cudaStream_t stream, F&& before_run) {
  size_t const moe_ws = RunnerWorkspaceBytes(r, key, deepseek, S::kAwq);
  size_t const need = AlignUp(moe_ws) + AlignUp(static_cast<size_t>(key.t) * key.k * sizeof(int));
  if (b.workspace->size_bytes() < need)
    return Bad(S::kName, "workspace has " + std::to_string(b.workspace->size_bytes()) + " bytes, needs " +
                             std::to_string(need) + " (use workspace_size())");
  auto* ws = static_cast<char*>(b.workspace->untyped_data());
  if (reinterpret_cast<uintptr_t>(ws) % kAlign != 0) return Bad(S::kName, "workspace is not 128-byte aligned");
  before_run();

  auto const act = static_cast<tk::ActivationType>(key.act);
  float const* sw = b.swiglu.typed_data();
  tk::ActivationParams act_params = act == tk::ActivationType::SwigluBias
                                        ? tk::ActivationParams(act, sw, sw + key.e, sw + 2 * key.e)
                                        : tk::ActivationParams(act);
  ::tensorrt_llm::kernels::LoraParams lora{};
  tk::MoeMinLatencyParams min_latency{};
  r.runMoe(b.x.untyped_data(), /*input_sf=*/nullptr, /*swizzled_input_sf=*/false,
           b.topk_ids.typed_data(), b.topk_weights.typed_data(), b.w13.untyped_data(),
           b.w13_bias.element_count() > 0 ? b.w13_bias.untyped_data() : nullptr, act_params,
           b.w2.untyped_data(), b.w2_bias.element_count() > 0 ? b.w2_bias.untyped_data() : nullptr,
           quant, key.t, key.h, /*unpadded_hidden_size=*/hu, key.i, key.e, key.k, ws,
           b.out->untyped_data(), reinterpret_cast<int*>(ws + AlignUp(moe_ws)),
           tk::MOEParallelismConfig{}, /*enable_alltoall=*/false, /*use_lora=*/false, lora,
           /*use_deepseek_fp8_block_scale=*/deepseek, /*use_mxfp8_act_scaling=*/false,
           /*min_latency_mode=*/false, min_latency, /*enable_pdl=*/false, stream);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax_moe ") + who + ": CUDA error: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace jax_moe_fi
