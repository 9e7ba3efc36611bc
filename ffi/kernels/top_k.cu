// CUDA handler of top_k (contract in top_k.h, reference: jax.lax.top_k's indices, jax_moe/top_k.py).
// A warp per row of x [..., N] float32: lane l holds the row's values l, l + 32, ... as order-preserving
// uint32 keys, and each of k rounds takes the warp's largest (key, then lowest index: two warp
// reductions) and drops it.
// The keys order float32 totally, as jax.lax.top_k does: a negative NaN < -inf < ... < -0 < +0 < ...
// < +inf < NaN; equal values go to the lower index first.
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "../common/binding.h"
#include "../common/errors.h"
#include "top_k.h"
#include "warp_order.cuh"

namespace jax_moe {
namespace {

namespace ffi = ::xla::ffi;

constexpr int kTopKWarpsPerBlock = 4;

// P values per lane (N <= 32 * P), as keys of warp_order.cuh.
template <int P>
__global__ void TopKRows(const float* x, int64_t rows, int n, int k, int32_t* out) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kTopKWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  float v[P];
  uint32_t left = LoadLanes(x + row * n, n, lane, v);  // bit i: value lane + 32 i still in the row
  uint32_t key[P];
#pragma unroll
  for (int i = 0; i < P; ++i) key[i] = OrderKey(v[i]);  // past n: -inf, never open
  for (int r = 0; r < k; ++r) {
    const int index = WarpTopIndex(key, left, lane);
    if ((index & 31) == lane) left &= ~(1u << (index >> 5));
    if (lane == 0) out[row * k + r] = index;
  }
}

template <int P>
void Launch(cudaStream_t stream, const float* x, int64_t rows, int n, int k, int32_t* out) {
  const auto blocks = static_cast<unsigned>((rows + kTopKWarpsPerBlock - 1) / kTopKWarpsPerBlock);
  TopKRows<P><<<blocks, 32 * kTopKWarpsPerBlock, 0, stream>>>(x, rows, n, k, out);
}

ffi::Error TopKCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::S32> indices, int64_t k) {
  const auto xd = x.dimensions();
  const auto od = indices->dimensions();
  if (xd.size() < 1) return InvalidArgument("top_k: x must have rank >= 1 [..., N]");
  const int64_t n = xd.back();
  if (n < 1 || n > kTopKMaxN) return InvalidArgument("top_k: x's last axis N must be in [1, 1024]");
  if (k < 1 || k > n) return InvalidArgument("top_k: k must be in [1, N]");
  if (od.size() != xd.size() || od.back() != k) return InvalidArgument("top_k: indices must be [..., k]");
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < xd.size(); ++d) {
    if (od[d] != xd[d]) return InvalidArgument("top_k: indices must have x's leading axes");
    rows *= xd[d];
  }
  if (rows == 0) return ffi::Error::Success();
  if (rows > std::numeric_limits<int32_t>::max() * int64_t{kTopKWarpsPerBlock})
    return InvalidArgument("top_k: too many rows");
  const float* xp = x.typed_data();
  int32_t* op = indices->typed_data();
  const int ni = static_cast<int>(n), ki = static_cast<int>(k);
  WithValuesPerLane(n, [&](auto p) { Launch<decltype(p)::value>(stream, xp, rows, ni, ki, op); });
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_moe

// x -> indices; attribute k (common/binding.h).
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeTopKCuda, jax_moe::TopKCuda, "k");
