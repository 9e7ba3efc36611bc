// CUDA handler of sort_by_expert: a deterministic, stable counting sort in three launches.
//   1. per chunk of kSortChunk slots: each slot's rank among earlier equal ids of its chunk, and the
//      chunk's histogram (workspace[chunk][bucket]);
//   2. one thread per bucket: exclusive scan of the histograms over chunks (in place), the counts;
//      then the exclusive scan over buckets (offsets);
//   3. per slot: position = offsets[bucket] + chunk base + rank.
// Bucket E collects the ids outside [0, E). No allocation, no host synchronisation.
#include <cstdint>

#include "../common/binding.h"
#include "../common/errors.h"
#include "sort_by_expert.h"

namespace jax_moe {
namespace {

__device__ __forceinline__ int Bucket(int32_t e, int num_experts) {
  return (e >= 0 && e < num_experts) ? e : num_experts;
}

__global__ void ChunkRanks(const int32_t* ids, int64_t n, int num_experts, int32_t* rank, int32_t* hist) {
  __shared__ int32_t chunk_ids[kSortChunk];
  const int64_t base = int64_t(blockIdx.x) * kSortChunk;
  const int t = threadIdx.x;
  const int64_t i = base + t;
  chunk_ids[t] = i < n ? Bucket(ids[i], num_experts) : -1;
  int32_t* my_hist = hist + int64_t(blockIdx.x) * (num_experts + 1);
  for (int e = t; e <= num_experts; e += blockDim.x) my_hist[e] = 0;
  __syncthreads();
  if (i < n) {
    const int32_t mine = chunk_ids[t];
    int32_t r = 0, total = 0;
    for (int j = 0; j < kSortChunk; ++j) {
      const bool same = chunk_ids[j] == mine;
      r += (same && j < t);
      total += same;
    }
    rank[i] = r;
    if (r == total - 1) my_hist[mine] = total;  // the last of its bucket writes the count
  }
}

__global__ void ScanChunks(int64_t chunks, int num_experts, int32_t* hist, int32_t* counts, int32_t* offsets) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e <= num_experts) {
    int32_t running = 0;
    for (int64_t c = 0; c < chunks; ++c) {
      int32_t* h = hist + c * (num_experts + 1) + e;
      const int32_t v = *h;
      *h = running;
      running += v;
    }
    if (e < num_experts) counts[e] = running;
  }
}

__global__ void ScanExperts(int num_experts, const int32_t* counts, int32_t* offsets) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    int32_t running = 0;
    for (int e = 0; e < num_experts; ++e) {
      offsets[e] = running;
      running += counts[e];
    }
    offsets[num_experts] = running;
  }
}

__global__ void Place(const int32_t* ids, int64_t n, int num_experts, const int32_t* hist, const int32_t* offsets,
                      int32_t* sorted, int32_t* inverse) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int b = Bucket(ids[i], num_experts);
  const int64_t chunk = i / kSortChunk;
  const int32_t pos = offsets[b] + hist[chunk * (num_experts + 1) + b] + inverse[i];  // inverse holds the rank
  sorted[pos] = static_cast<int32_t>(i);
  inverse[i] = pos;
}

ffi::Error SortByExpertCuda(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::S32> sorted,
                            ffi::ResultBuffer<ffi::S32> inverse, ffi::ResultBuffer<ffi::S32> counts,
                            ffi::ResultBuffer<ffi::S32> offsets, ffi::ResultBuffer<ffi::S32> workspace,
                            int64_t num_experts) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (num_experts < 1 || num_experts > (1 << 20)) return InvalidArgument("num_experts must be in [1, 2^20]");
  const int64_t chunks = (n + kSortChunk - 1) / kSortChunk;
  if (static_cast<int64_t>(sorted->element_count()) != n || static_cast<int64_t>(inverse->element_count()) != n ||
      static_cast<int64_t>(counts->element_count()) != num_experts ||
      static_cast<int64_t>(offsets->element_count()) != num_experts + 1 ||
      static_cast<int64_t>(workspace->element_count()) < chunks * (num_experts + 1))
    return InvalidArgument("sort_by_expert: output or workspace sizes do not match T*k and num_experts");
  const int e = static_cast<int>(num_experts);
  int32_t* hist = workspace->typed_data();
  if (chunks > 0) {
    ChunkRanks<<<chunks, kSortChunk, 0, stream>>>(ids.typed_data(), n, e, inverse->typed_data(), hist);
    JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  ScanChunks<<<(e + 1 + 255) / 256, 256, 0, stream>>>(chunks, e, hist, counts->typed_data(), offsets->typed_data());
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  ScanExperts<<<1, 32, 0, stream>>>(e, counts->typed_data(), offsets->typed_data());
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  if (n > 0) {
    Place<<<(n + 255) / 256, 256, 0, stream>>>(ids.typed_data(), n, e, hist, offsets->typed_data(),
                                               sorted->typed_data(), inverse->typed_data());
    JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_moe

// ids -> sorted, inverse, counts, offsets, workspace; attribute num_experts (common/binding.h).
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeSortByExpertCuda, jax_moe::SortByExpertCuda, "num_experts");
