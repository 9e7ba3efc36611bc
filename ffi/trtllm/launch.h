// One TRT-LLM gen MoE call once a handler has checked its operands: plan the workspace, check
// its size, run FlashInfer's routing kernels in precomputed-ids mode (the expert-sorted
// permutation and the CTA tables from the caller's top-k ids), then MoE::Runner::run (permute,
// GEMM1 with the gated activation fused, GEMM2, finalize: weighted top-k reduce).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "runner.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moe_trtllm {

namespace ffi = xla::ffi;

// The data pointers every scheme passes (null where a scheme has none).
struct MoeData {
  void* x;
  void* x_scale;
  void* w13;
  void* w13_scale;
  void* w2;
  void* w2_scale;
  void* out;
};

// `args` (BaseArgs plus the scheme's own scales and biases) with `data` set, run on `stream`.
// Errors read "jax_moe: <who>: ...".
ffi::Error Launch(char const* who, Problem const& p, tmoe::MoE::MoERunnerArgs args, MoeData const& data,
                  int64_t config, int device, cudaStream_t stream, bool enable_pdl,
                  ffi::Buffer<ffi::S32>& topk_ids, ffi::Buffer<ffi::F32>& topk_weights,
                  ffi::Result<ffi::Buffer<ffi::U8>>& workspace);

}  // namespace jax_moe_trtllm
