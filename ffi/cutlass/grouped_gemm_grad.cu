// XLA FFI handlers of the backward pass's grouped GEMMs, jax_moe_cutlass_grouped_gemm_dgrad and
// jax_moe_cutlass_grouped_gemm_wgrad (contract in grouped_gemm.h; bf16, standard format): decode and
// check the buffers from their static shapes, zero what no group writes (dgrad: the rows no expert
// owns, in the GEMM's setup launch; wgrad: the experts without rows, a launch of its own), and run the
// (kind, tile)'s instantiation. No allocation, no host sync: safe inside a CUDA graph.
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include "../common/binding.h"
#include "../common/errors.h"
#include "grouped_gemm.h"
#include "grouped_gemm_impl.cuh"

namespace jax_moe {
namespace {

// Zeros d[g] ([per_group] 16-byte vectors each) for every group g without rows (GroupRows); one
// grid row (blockIdx.y) per group, grid-stride over its vectors.
__global__ void ZeroEmptyGroups(const int32_t* offsets, int64_t groups, int64_t m, int64_t per_group, uint4* d) {
  for (int64_t g = blockIdx.y; g < groups; g += gridDim.y) {
    int64_t lo, hi;
    GroupRows(offsets, g, m, false, 0, lo, hi);
    if (hi > lo) continue;
    uint4* dst = d + g * per_group;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < per_group;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x)
      dst[i] = make_uint4(0, 0, 0, 0);
  }
}

bool Bf16(ffi::AnyBuffer x) { return x.element_type() == ffi::DataType::BF16; }

std::string Dims(int64_t a, int64_t b) { return std::to_string(a) + "x" + std::to_string(b); }

// What both targets check alike: the tile, d's and the workspace's dtypes, offsets [groups + 1], 16-byte
// rows of the two contiguous dimensions (k, n), int32 sizes. Fills call's common fields.
ffi::Error CheckCommon(const char* name, ffi::Buffer<ffi::S32> offsets, ffi::Result<ffi::AnyBuffer>& d,
                       ffi::Result<ffi::AnyBuffer>& workspace, int64_t tile, int64_t groups, int64_t m, int64_t n,
                       int64_t k, GroupedGemmCall& call) {
  const std::string n_ = std::string(name) + ": ";
  if (tile < 0 || tile >= kNumCutlassTiles) return InvalidArgument(n_ + "tile out of range");
  if (d->element_type() != ffi::DataType::BF16) return InvalidArgument(n_ + "d must be bfloat16");
  if (workspace->element_type() != ffi::DataType::U8) return InvalidArgument(n_ + "workspace must be uint8");
  if (groups < 1) return InvalidArgument(n_ + "at least one expert is needed");
  if (offsets.dimensions().size() != 1 || offsets.dimensions()[0] != groups + 1)
    return InvalidArgument(n_ + "offsets must be [E + 1] int32");
  if (k < kCutlassAlignKBf16 || k % kCutlassAlignKBf16 || n < kCutlassAlignN || n % kCutlassAlignN)
    return InvalidArgument(n_ + "the contiguous dimensions must be positive multiples of 8 (16-byte rows), got " +
                           Dims(k, n));
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || groups > INT32_MAX)
    return InvalidArgument(n_ + "dimensions must fit in int32");
  SetCommon(call, offsets.typed_data(), d->untyped_data(), workspace->untyped_data(), workspace->size_bytes(), groups,
            m, n, k);
  return ffi::Error::Success();
}

ffi::Error DgradCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> offsets,
                     ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, int64_t tile) {
  const auto ad = a.dimensions(), bd = b.dimensions(), dd = d->dimensions();
  if (!Bf16(a) || !Bf16(b)) return InvalidArgument("cutlass_grouped_gemm_dgrad: a and b must be bfloat16");
  if (ad.size() != 2 || bd.size() != 3 || bd[1] != ad[1])
    return InvalidArgument("cutlass_grouped_gemm_dgrad: a must be [M, K] and b [E, K, N]");
  if (dd.size() != 2 || dd[0] != ad[0] || dd[1] != bd[2])
    return InvalidArgument("cutlass_grouped_gemm_dgrad: d must be [M, N]");
  GroupedGemmCall call{};
  call.stream = stream;
  call.a = a.untyped_data();
  call.b = b.untyped_data();
  if (auto err = CheckCommon("cutlass_grouped_gemm_dgrad", offsets, d, workspace, tile, bd[0], ad[0], bd[2], ad[1],
                             call);
      err.failure())
    return err;
  if (call.m == 0) return ffi::Error::Success();
  call.zero_unowned = true;  // the setup launch zeroes the rows no expert owns
  return RunKind(kGemmBf16Dgrad, tile, call);
}

ffi::Error WgradCuda(cudaStream_t stream, ffi::AnyBuffer u, ffi::AnyBuffer v, ffi::Buffer<ffi::S32> offsets,
                     ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, int64_t tile) {
  const auto ud = u.dimensions(), vd = v.dimensions(), dd = d->dimensions();
  if (!Bf16(u) || !Bf16(v)) return InvalidArgument("cutlass_grouped_gemm_wgrad: u and v must be bfloat16");
  if (ud.size() != 2 || vd.size() != 2 || vd[0] != ud[0])
    return InvalidArgument("cutlass_grouped_gemm_wgrad: u must be [M, P] and v [M, Q]");
  const int64_t groups = offsets.dimensions().size() == 1 ? offsets.dimensions()[0] - 1 : 0;
  if (dd.size() != 3 || dd[0] != groups || dd[1] != ud[1] || dd[2] != vd[1])
    return InvalidArgument("cutlass_grouped_gemm_wgrad: d must be [E, P, Q]");
  GroupedGemmCall call{};
  call.stream = stream;
  call.a = u.untyped_data();
  call.b = v.untyped_data();
  if (auto err = CheckCommon("cutlass_grouped_gemm_wgrad", offsets, d, workspace, tile, groups, ud[0], vd[1], ud[1],
                             call);
      err.failure())
    return err;
  const int64_t per_group = call.k * call.n / 8;  // 16-byte vectors of one expert's d (n % 8 == 0)
  const unsigned grid_y = static_cast<unsigned>(groups < 65535 ? groups : 65535);
  ZeroEmptyGroups<<<dim3(8, grid_y), 256, 0, stream>>>(call.offsets, groups, call.m, per_group,
                                                       static_cast<uint4*>(call.d));
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (call.m == 0) return ffi::Error::Success();
  return RunKind(kGemmBf16Wgrad, tile, call);
}

}  // namespace
}  // namespace jax_moe

JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeCutlassGroupedGemmDgrad, jax_moe::DgradCuda, "tile");
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeCutlassGroupedGemmWgrad, jax_moe::WgradCuda, "tile");
