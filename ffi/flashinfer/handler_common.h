// Host-side helpers shared by the FlashInfer CUTLASS MoE handlers (moe_handlers.cu,
// fp8_block_handler.cu), free of FlashInfer's headers: the current-device guard, the key of a
// traced problem shape under which the runner cache keeps a runner or a tactic choice, and the
// handlers' error format ("jax_moe flashinfer_cutlass_moe (<scheme>): ...").
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <tuple>

// XLA's FFI headers before any FlashInfer header (see schemes.h).
#include "xla/ffi/api/ffi.h"

namespace jax_moe_fi {

namespace ffi = xla::ffi;

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

// An operand the handler of `scheme` refuses.
inline ffi::Error Bad(char const* scheme, std::string const& m) {
  return ffi::Error::InvalidArgument(std::string("jax_moe flashinfer_cutlass_moe (") + scheme + "): " + m);
}

// The handler of a scheme left out of JAX_MOE_FI_SCHEMES.
inline ffi::Error NotCompiled(char const* scheme) {
  return ffi::Error::InvalidArgument(std::string("jax_moe flashinfer_cutlass_moe: scheme ") + scheme +
                                     " was not compiled into this build (JAX_MOE_FI_SCHEMES)");
}

// Runs `launch` (returning ffi::Error), mapping what the runner throws: std::invalid_argument to
// InvalidArgument with its message, anything else to Internal("jax_moe <who>: ...").
template <typename F>
ffi::Error Guarded(std::string const& who, F&& launch) {
  try {
    return launch();
  } catch (std::invalid_argument const& ex) {
    return ffi::Error::InvalidArgument(ex.what());
  } catch (std::exception const& ex) {
    return ffi::Error::Internal("jax_moe " + who + ": " + ex.what());
  }
}

}  // namespace jax_moe_fi
