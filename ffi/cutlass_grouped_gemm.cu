// XLA FFI handler of jax_moe_cutlass_grouped_gemm (contract in cutlass_grouped_gemm.h): decode and check
// the buffers on the host from their static shapes (CUTLASS's can_implement cannot see the per-group
// sizes, which live on the device), zero the rows no expert owns, and hand the call to the tile's TU.
// No allocation, no host sync, no device-to-host copy: safe inside a CUDA graph.
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "common.h"
#include "cutlass_grouped_gemm.h"
#include "cutlass_grouped_gemm_impl.cuh"

namespace jax_moe {
namespace {

// Zeros the rows of d [m, n] outside [offsets[0], offsets[groups]) (clamped to [0, m]); n % 8 == 0,
// so every row is whole 16-byte vectors.
__global__ void ZeroUnownedRows(const int32_t* offsets, int64_t groups, int64_t m, int64_t n, uint4* d) {
  int64_t lo = offsets[0], hi = offsets[groups];
  lo = lo < 0 ? 0 : (lo > m ? m : lo);
  hi = hi < lo ? lo : (hi > m ? m : hi);
  const int64_t vec_per_row = n / 8;
  const int64_t unowned = lo + (m - hi);
  for (int64_t i = blockIdx.x; i < unowned; i += gridDim.x) {
    const int64_t row = i < lo ? i : hi + (i - lo);
    uint4* dst = d + row * vec_per_row;
    for (int64_t c = threadIdx.x; c < vec_per_row; c += blockDim.x) dst[c] = make_uint4(0, 0, 0, 0);
  }
}

int SmCount(int device) {
  constexpr int kMaxDevices = 64;
  static int cache[kMaxDevices] = {};  // 0: not asked yet (benign race: every writer stores the same value)
  if (device >= 0 && device < kMaxDevices && cache[device] > 0) return cache[device];
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  if (device >= 0 && device < kMaxDevices) cache[device] = sms;
  return sms;
}

ffi::Error GroupedGemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> offsets,
                           ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, int64_t tile) {
  const std::string n_("cutlass_grouped_gemm: ");
  if (tile < 0 || tile >= kNumCutlassTiles)
    return InvalidArgument(n_ + "tile must be in [0, " + std::to_string(kNumCutlassTiles) + "), got " +
                           std::to_string(tile));
  if (a.element_type() != ffi::DataType::BF16 || b.element_type() != ffi::DataType::BF16 ||
      d->element_type() != ffi::DataType::BF16)
    return InvalidArgument(n_ + "a, b and d must be bfloat16");
  if (workspace->element_type() != ffi::DataType::U8) return InvalidArgument(n_ + "workspace must be uint8");
  const auto ad = a.dimensions(), bd = b.dimensions(), dd = d->dimensions();
  if (ad.size() != 2) return InvalidArgument(n_ + "a must have rank 2 [M, K]");
  if (bd.size() != 3) return InvalidArgument(n_ + "b must have rank 3 [E, N, K]");
  const int64_t m = ad[0], k = ad[1], groups = bd[0], n = bd[1];
  if (bd[2] != k) return InvalidArgument(n_ + "b must be [E, N, K] with a's K");
  if (groups < 1) return InvalidArgument(n_ + "b must have at least one expert");
  if (offsets.dimensions().size() != 1 || offsets.dimensions()[0] != groups + 1)
    return InvalidArgument(n_ + "offsets must be [E + 1] int32");
  if (dd.size() != 2 || dd[0] != m || dd[1] != n) return InvalidArgument(n_ + "d must be [M, N]");
  if (k < kCutlassAlign || k % kCutlassAlign || n < kCutlassAlign || n % kCutlassAlign)
    return InvalidArgument(n_ + "K and N must be positive multiples of 8 (16-byte rows for TMA), got K=" +
                           std::to_string(k) + ", N=" + std::to_string(n));
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || groups > INT32_MAX)
    return InvalidArgument(n_ + "dimensions must fit in int32");
  if (m == 0) return ffi::Error::Success();

  int device = 0;
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const int sms = SmCount(device);
  if (sms <= 0) return ffi::Error(ffi::ErrorCode::kInternal, "jax_moe: cannot read the SM count");

  constexpr int kZeroBlocks = 132;
  ZeroUnownedRows<<<kZeroBlocks, 128, 0, stream>>>(offsets.typed_data(), groups, m, n,
                                                   static_cast<uint4*>(d->untyped_data()));
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());

  GroupedGemmCall call{stream, a.untyped_data(), b.untyped_data(), offsets.typed_data(), d->untyped_data(),
                       workspace->untyped_data(), workspace->size_bytes(), groups, m, n, k, device, sms};
  switch (tile) {
    case kTileCoop128x128:
      return cutlass_gg::Run<kTileCoop128x128>(call);
    default:
      return cutlass_gg::Run<kTilePingpong64x128>(call);
  }
}

}  // namespace

size_t CutlassGroupedGemmWorkspaceBytes(int64_t num_groups, int tile, int sm_count) {
  switch (tile) {
    case kTileCoop128x128:
      return cutlass_gg::WorkspaceBytes<kTileCoop128x128>(num_groups, sm_count);
    case kTilePingpong64x128:
      return cutlass_gg::WorkspaceBytes<kTilePingpong64x128>(num_groups, sm_count);
    default:
      return 0;
  }
}

int CutlassCurrentSmCount() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return SmCount(device);
}

}  // namespace jax_moe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeCutlassGroupedGemm, jax_moe::GroupedGemmCuda,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()              // a [M, K] bf16
                                  .Arg<xla::ffi::AnyBuffer>()              // b [E, N, K] bf16
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // offsets [E + 1]
                                  .Ret<xla::ffi::AnyBuffer>()              // d [M, N] bf16
                                  .Ret<xla::ffi::AnyBuffer>()              // workspace [W] uint8
                                  .Attr<int64_t>("tile"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
