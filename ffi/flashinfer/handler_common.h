// Host-side helpers shared by the FlashInfer CUTLASS MoE handlers (ffi/flashinfer/cutlass_moe.cu,
// ffi/flashinfer/cutlass_moe_fp8_block.cu): the current-device guard and the key of a traced
// problem shape under which a handler caches its runner or tactic choice.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <tuple>

namespace jax_moe_fi {

// Makes `device` current for the lifetime of the guard.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    cudaGetDevice(&prev_);
    if (prev_ != device) cudaSetDevice(device);
  }
  ~DeviceGuard() {
    int cur = -1;
    cudaGetDevice(&cur);
    if (cur != prev_ && prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(DeviceGuard const&) = delete;
  DeviceGuard& operator=(DeviceGuard const&) = delete;

 private:
  int prev_ = -1;
};

// One traced problem: tokens, hidden and intermediate sizes, experts, top-k, activation code.
struct ShapeKey {
  int64_t t, h, i;
  int e, k, act;
  bool operator<(ShapeKey const& o) const {
    return std::tie(t, h, i, e, k, act) < std::tie(o.t, o.h, o.i, o.e, o.k, o.act);
  }
};

}  // namespace jax_moe_fi
