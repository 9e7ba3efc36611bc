// CUDA handler of unpermute_reduce (contract in moe_prepare_finalize.h, reference in jax_moe/kernels.py):
// block (x: token, y: chunk of the row's columns). The token's k slots' rows, weights and (with a bias)
// experts are staged in shared memory, then each thread sums V columns over the slots in float32, slot
// order, the row's expert bias added to each row before its weight; the slots' loads go kSlotBatch at a
// time, all in flight before their sums. A row splits into chunks where there are few tokens, so that
// the grid still fills the GPU (one block per token at T=64 is 64 blocks for 132 SMs). Slots whose row
// is at or past valid_rows (expert ids outside [0, E), sorted last) are skipped, so whatever those rows
// hold never reaches the output.
#include <cstdint>
#include <limits>

#include "moe_device.cuh"

namespace jax_moe {
namespace {

constexpr int64_t kMaxTopK = 1024;  // shared memory: 12 bytes per slot

constexpr int kSlotBatch = 4;         // slots whose loads are in flight together
constexpr int64_t kFillBlocks = 1024;  // a row splits into chunks until the grid has this many blocks,
constexpr int64_t kMinChunk = 64;      // but a chunk keeps at least this many vectors (two warps)

template <typename In, typename Out, int V>
__global__ void UnpermuteReduce(const In* y, const int32_t* inverse, const float* weights,
                                const int32_t* valid_rows, const float* bias, const int32_t* offsets, int experts,
                                int64_t m, int64_t h, int k, int64_t chunk, bool weighted, Out* out) {
  extern __shared__ int32_t slot_row[];  // [k] rows, then [k] weights, then [k] experts
  float* slot_w = reinterpret_cast<float*>(slot_row + k);
  int32_t* slot_e = slot_row + 2 * k;
  const int64_t t = blockIdx.x;
  const int64_t valid = ValidRows(valid_rows, m);
  for (int j = threadIdx.x; j < k; j += blockDim.x) {
    const int32_t row = inverse[t * k + j];
    const bool ok = row >= 0 && row < valid;
    slot_row[j] = ok ? row : -1;
    slot_w[j] = weighted ? weights[t * k + j] : 1.0f;
    slot_e[j] = ok && bias != nullptr ? ExpertOfRow(offsets, experts, row) : 0;
  }
  __syncthreads();
  const int64_t first = int64_t(blockIdx.y) * chunk, end = first + chunk < h / V ? first + chunk : h / V;
  for (int64_t c = first + threadIdx.x; c < end; c += blockDim.x) {
    float acc[V] = {};
    for (int j0 = 0; j0 < k; j0 += kSlotBatch) {
      float v[kSlotBatch][V];
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) {
        const int32_t row = j0 + u < k ? slot_row[j0 + u] : -1;
        if (row < 0) continue;
        LoadF32<In, V>(y + int64_t(row) * h + c * V, v[u]);
        if (bias != nullptr) {
          float b[V];
          LoadF32<float, V>(bias + int64_t(slot_e[j0 + u]) * h + c * V, b);
#pragma unroll
          for (int i = 0; i < V; ++i) v[u][i] += b[i];
        }
      }
#pragma unroll
      for (int u = 0; u < kSlotBatch; ++u) {
        if (j0 + u >= k || slot_row[j0 + u] < 0) continue;
        const float w = slot_w[j0 + u];
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] += w * v[u][i];
      }
    }
    StoreF32<Out, V>(out + t * h + c * V, acc);
  }
}

template <typename In, typename Out, int V>
ffi::Error Launch(cudaStream_t stream, const In* y, const int32_t* inverse, const float* weights,
                  const int32_t* valid_rows, const float* bias, const int32_t* offsets, int64_t experts, int64_t m,
                  int64_t t, int64_t h, int64_t k, bool weighted, Out* out) {
  const size_t smem = static_cast<size_t>(k) * (2 * sizeof(int32_t) + sizeof(float));
  const int64_t vectors = h / V, most = (vectors + kMinChunk - 1) / kMinChunk;
  const int64_t want = (kFillBlocks + t - 1) / t, chunks = want < most ? want : most;
  const int64_t chunk = (vectors + chunks - 1) / chunks;
  UnpermuteReduce<In, Out, V><<<dim3(static_cast<unsigned>(t), static_cast<unsigned>(chunks)), RowThreads(chunk),
                                smem, stream>>>(y, inverse, weights, valid_rows, bias, offsets,
                                                static_cast<int>(experts), m, h, static_cast<int>(k), chunk,
                                                weighted, out);
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

ffi::Error UnpermuteReduceCuda(cudaStream_t stream, ffi::AnyBuffer y, ffi::Buffer<ffi::S32> inverse,
                               ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> valid_rows,
                               ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> offsets,
                               ffi::Result<ffi::AnyBuffer> out, int64_t weighted) {
  const auto yd = y.dimensions();
  const auto wd = topk_weights.dimensions();
  if (yd.size() != 2) return InvalidArgument("unpermute_reduce: y must have rank 2 [M, H]");
  if (wd.size() != 2) return InvalidArgument("unpermute_reduce: topk_weights must have rank 2 [T, k]");
  const int64_t m = yd[0], h = yd[1], t = wd[0], k = wd[1];
  if (k < 1 || k > kMaxTopK) return InvalidArgument("unpermute_reduce: k must be in [1, 1024]");
  if (static_cast<int64_t>(inverse.element_count()) != t * k)
    return InvalidArgument("unpermute_reduce: inverse must have T*k elements");
  if (valid_rows.element_count() != 1) return InvalidArgument("unpermute_reduce: valid_rows must have 1 element");
  if (m > std::numeric_limits<int32_t>::max() || t > std::numeric_limits<int32_t>::max())
    return InvalidArgument("unpermute_reduce: more than 2^31 - 1 rows or tokens");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != t || od[1] != h) return InvalidArgument("unpermute_reduce: out must be [T, H]");
  int64_t experts = 0;
  if (auto err = CheckBias("unpermute_reduce", bias, offsets, h, &experts); err.failure()) return err;
  if (t == 0 || h == 0) return ffi::Error::Success();
  return WithFloatType(y.element_type(), "unpermute_reduce: y", [&](auto in_tag) -> ffi::Error {
    using In = typename decltype(in_tag)::type;
    return WithFloatType(out->element_type(), "unpermute_reduce: out", [&](auto out_tag) -> ffi::Error {
      using Out = typename decltype(out_tag)::type;
      const In* src = static_cast<const In*>(y.untyped_data());
      Out* dst = static_cast<Out*>(out->untyped_data());
      const bool w = weighted != 0;
      const float* b = experts > 0 ? bias.typed_data() : nullptr;
      const int32_t* off = experts > 0 ? offsets.typed_data() : nullptr;
      if (CanVectorize(h, kVec<In>, {{src, sizeof(In)}, {dst, sizeof(Out)}, {b, sizeof(float)}}))
        return Launch<In, Out, kVec<In>>(stream, src, inverse.typed_data(), topk_weights.typed_data(),
                                         valid_rows.typed_data(), b, off, experts, m, t, h, k, w, dst);
      return Launch<In, Out, 1>(stream, src, inverse.typed_data(), topk_weights.typed_data(), valid_rows.typed_data(),
                                b, off, experts, m, t, h, k, w, dst);
    });
  });
}

}  // namespace
}  // namespace jax_moe

// y, inverse, topk_weights, valid_rows, bias, offsets -> out; attribute weighted (common/binding.h).
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeUnpermuteReduceCuda, jax_moe::UnpermuteReduceCuda, "weighted");
