// Small helpers shared by the XLA FFI handlers: error construction and the CUDA check.
#pragma once

#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_moe {

namespace ffi = xla::ffi;

inline ffi::Error InvalidArgument(const std::string& msg) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_moe: " + msg);
}

}  // namespace jax_moe

#ifdef __CUDACC__
#include <cuda_runtime.h>
#define JAX_MOE_CUDA_RETURN_IF_ERROR(expr)                                              \
  do {                                                                                  \
    cudaError_t err_ = (expr);                                                          \
    if (err_ != cudaSuccess)                                                            \
      return ::xla::ffi::Error(::xla::ffi::ErrorCode::kInternal,                        \
                               std::string("jax_moe: CUDA error: ") + cudaGetErrorString(err_)); \
  } while (0)
#endif
