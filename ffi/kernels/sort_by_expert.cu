// CUDA handler of sort_by_expert: a deterministic, stable counting sort.
// Up to kSmallSortLimit slots (T*k) over at most 1023 experts, one launch of one block, SortSmall, runs
// the three steps below with the histograms in shared memory. Above, three launches:
//   1. per chunk of kSortChunk slots: each slot's rank among earlier equal ids of its chunk, and the
//      chunk's histogram (hist[chunk][bucket]); block 0 also zeroes the ticket. WarpRanks (at most 1023
//      experts) takes a slot's rank among its warp's equal ids from __match_any_sync and adds the counts
//      of the chunk's earlier warps; ChunkRanks (more experts) compares every pair of the chunk's slots;
//   2. ScanBuckets, one block per bucket: the block-wide exclusive scan of its histogram column over
//      the chunks (in place) and its count; the last block to finish scans the counts into offsets;
//   3. Place, per slot: position = offsets[bucket] + chunk base + rank.
// Bucket E collects the ids outside [0, E). Workspace (int32): hist [chunks * (E+1)], then the ticket
// (one int32: blocks of ScanBuckets done). Every call writes what it reads (the workspace's contents
// on entry do not matter), so the handler is re-entrant and CUDA-graph safe: no allocation, no host
// synchronisation.
#include <cstdint>

#include "../common/binding.h"
#include "../common/errors.h"
#include "sort_by_expert.h"

namespace jax_moe {
namespace {

__device__ __forceinline__ int Bucket(int32_t e, int num_experts) {
  return (e >= 0 && e < num_experts) ? e : num_experts;
}

constexpr int kScanThreads = 256;  // threads of a ScanBuckets block (a multiple of 32, at most 1024)

// Launched with max(chunks, 1) blocks of kSortChunk threads (one block when n == 0, for the ticket).
__global__ void ChunkRanks(const int32_t* ids, int64_t n, int64_t chunks, int num_experts, int32_t* rank,
                           int32_t* hist, int32_t* ticket) {
  __shared__ int32_t chunk_ids[kSortChunk];
  const int64_t base = int64_t(blockIdx.x) * kSortChunk;
  const int t = threadIdx.x;
  const int64_t i = base + t;
  if (blockIdx.x == 0 && t == 0) *ticket = 0;
  if (blockIdx.x >= chunks) return;
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

// Exclusive block-wide scan of one int32 per thread (Threads threads, a multiple of 32, at most 1024):
// returns the sum of the values before this thread's, and the block's total in *total.
// Deterministic (a fixed tree).
template <int Threads = kScanThreads>
__device__ __forceinline__ int32_t BlockExclusiveScan(int32_t v, int32_t* total) {
  static_assert(Threads % 32 == 0 && Threads <= 1024, "whole warps, at most 32 of them");
  __shared__ int32_t warp_sums[Threads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t incl = v;
  for (int d = 1; d < 32; d <<= 1) {
    const int32_t up = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += up;
  }
  if (lane == 31) warp_sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int32_t w = lane < Threads / 32 ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {
      const int32_t up = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += up;
    }
    if (lane < Threads / 32) warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int32_t before = (warp > 0 ? warp_sums[warp - 1] : 0) + incl - v;
  *total = warp_sums[Threads / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

// One block per bucket b in [0, E]: the exclusive scan of hist[., b] over the chunks, in place (tiles of
// kScanThreads chunks); counts[b] = the column's total (b < E). The last block to finish (ticket, which
// ChunkRanks zeroed) then scans counts into offsets[0..E] (offsets[E] = sum of counts: bucket E, the ids
// outside [0, E), starts there) and copies offsets[E] into valid[0].
__global__ void __launch_bounds__(kScanThreads)
ScanBuckets(int64_t chunks, int num_experts, int32_t* hist, int32_t* counts, int32_t* offsets, int32_t* valid,
            int32_t* ticket) {
  const int b = blockIdx.x;
  const int64_t stride = num_experts + 1;
  int32_t carry = 0;
  for (int64_t c0 = 0; c0 < chunks; c0 += kScanThreads) {
    const int64_t c = c0 + threadIdx.x;
    const int64_t at = c * stride + b;
    const int32_t v = c < chunks ? hist[at] : 0;
    int32_t total;
    const int32_t before = BlockExclusiveScan(v, &total);
    if (c < chunks) hist[at] = carry + before;
    carry += total;
  }
  __shared__ bool last;
  if (threadIdx.x == 0) {
    if (b < num_experts) counts[b] = carry;
    __threadfence();  // counts[b] visible to every block before the ticket says so
    last = atomicAdd(ticket, 1) == static_cast<int>(gridDim.x) - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  int32_t running = 0;
  for (int e0 = 0; e0 < num_experts; e0 += kScanThreads) {
    const int e = e0 + threadIdx.x;
    const int32_t v = e < num_experts ? __ldcg(counts + e) : 0;  // L2: written by other blocks
    int32_t total;
    const int32_t before = BlockExclusiveScan(v, &total);
    if (e < num_experts) offsets[e] = running + before;
    running += total;
  }
  if (threadIdx.x == 0) offsets[num_experts] = valid[0] = running;
}

constexpr int kSmallThreads = 1024;           // SortSmall's one block, one slot per thread
constexpr int kWarpsPerChunk = kSortChunk / 32;
constexpr int kSmallChunks = kSmallThreads / kSortChunk;
constexpr int kMaxBuckets = 1024;             // E+1 at most for SortSmall and WarpRanks
// The most slots sorted in one launch, where it is the faster: on an H100, 512 slots took 5.5 us in one
// launch against 8.3 us in three; 4096 took 12.5 us in one, more than three took for 8192 (9.2 us).
constexpr int64_t kSmallSortLimit = kSmallThreads;
// Whether SortSmall takes n slots over num_experts experts.
bool SortsSmall(int64_t n, int64_t num_experts) { return n <= kSmallSortLimit && num_experts + 1 <= kMaxBuckets; }

// A slot's rank among the equal buckets of its warp's lanes before it, and the mask of those lanes
// (all 32 lanes take part; -1 marks a lane with no slot, a group of its own).
__device__ __forceinline__ int32_t WarpRank(int32_t bucket, uint32_t* peers) {
  *peers = __match_any_sync(0xffffffffu, bucket);
  return __popc(*peers & ((1u << (threadIdx.x & 31)) - 1));
}

// The three steps of the counting sort in one block of kSmallThreads threads, one slot each, the chunks'
// histograms in shared memory: the same ranks within kSortChunk-slot chunks, the same column scans and
// the same placement as the three launches, so the same (stable) order. A slot's rank in its chunk is its
// rank among its warp's equal buckets plus the counts of the chunk's earlier warps, which the warps of a
// chunk add into the chunk's histogram one after the other.
__global__ void __launch_bounds__(kSmallThreads)
SortSmall(const int32_t* ids, int64_t n, int num_experts, int32_t* sorted, int32_t* inverse, int32_t* counts,
          int32_t* offsets, int32_t* valid) {
  __shared__ int32_t hist[kSmallChunks * kMaxBuckets];  // [chunk][E+1]: counts, then prefixes over chunks
  __shared__ int32_t start[kMaxBuckets];                // [E+1] each bucket's first position
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int buckets = num_experts + 1;
  const int chunks = static_cast<int>((n + kSortChunk - 1) / kSortChunk);
  for (int i = t; i < chunks * buckets; i += kSmallThreads) hist[i] = 0;
  const int32_t mine = t < n ? Bucket(ids[t], num_experts) : -1;
  uint32_t peers;
  int32_t rank = WarpRank(mine, &peers);
  const int leader = __ffs(peers) - 1;
  int32_t* my_hist = hist + (t / kSortChunk) * buckets;
  __syncthreads();
  for (int step = 0; step < kWarpsPerChunk; ++step) {  // a chunk's warps in order: counts of the earlier ones
    if (warp % kWarpsPerChunk == step) {
      int32_t before = 0;
      if (mine >= 0 && lane == leader) {
        before = my_hist[mine];
        my_hist[mine] = before + __popc(peers);
      }
      rank += __shfl_sync(0xffffffffu, before, leader);
    }
    __syncthreads();
  }
  int32_t column = 0;  // bucket t's count: its column of hist, scanned in place over the chunks
  if (t < buckets) {
    for (int c = 0; c < chunks; ++c) {
      const int32_t v = hist[c * buckets + t];
      hist[c * buckets + t] = column;
      column += v;
    }
  }
  int32_t all;
  const int32_t first = BlockExclusiveScan<kSmallThreads>(t < buckets ? column : 0, &all);
  if (t < buckets) {
    start[t] = first;
    if (t < num_experts) {
      counts[t] = column;
      offsets[t] = first;
    } else {
      offsets[num_experts] = valid[0] = first;  // bucket E (ids outside [0, E)) starts after every expert's
    }
  }
  __syncthreads();
  if (mine >= 0) {
    const int32_t pos = start[mine] + my_hist[mine] + rank;
    sorted[pos] = t;
    inverse[t] = pos;
  }
}

// Step 1 by warps (one block of kSortChunk threads per chunk; max(chunks, 1) blocks, one when n == 0,
// for the ticket): rank[i] = slot i's rank among the equal buckets of its chunk, hist[chunk][b] = the
// chunk's count of bucket b, as ChunkRanks computes them. The warps' counts per bucket sit in shared
// memory ([warp][E+1]), so a slot adds those of its chunk's earlier warps to its rank in its warp.
__global__ void __launch_bounds__(kSortChunk)
WarpRanks(const int32_t* ids, int64_t n, int64_t chunks, int num_experts, int32_t* rank, int32_t* hist,
          int32_t* ticket) {
  __shared__ int32_t warp_hist[kWarpsPerChunk * kMaxBuckets];
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int buckets = num_experts + 1;
  if (blockIdx.x == 0 && t == 0) *ticket = 0;
  if (blockIdx.x >= chunks) return;
  for (int j = t; j < kWarpsPerChunk * buckets; j += kSortChunk) warp_hist[j] = 0;
  const int64_t i = int64_t(blockIdx.x) * kSortChunk + t;
  const int32_t mine = i < n ? Bucket(ids[i], num_experts) : -1;
  uint32_t peers;
  int32_t r = WarpRank(mine, &peers);
  __syncthreads();
  if (mine >= 0 && lane == __ffs(peers) - 1) warp_hist[warp * buckets + mine] = __popc(peers);
  __syncthreads();
  if (mine >= 0) {
    for (int w = 0; w < warp; ++w) r += warp_hist[w * buckets + mine];
    rank[i] = r;
  }
  int32_t* my_hist = hist + int64_t(blockIdx.x) * buckets;
  for (int b = t; b < buckets; b += kSortChunk) {
    int32_t sum = 0;
#pragma unroll
    for (int w = 0; w < kWarpsPerChunk; ++w) sum += warp_hist[w * buckets + b];
    my_hist[b] = sum;
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
                            ffi::ResultBuffer<ffi::S32> offsets, ffi::ResultBuffer<ffi::S32> valid,
                            ffi::ResultBuffer<ffi::S32> workspace, int64_t num_experts) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (num_experts < 1 || num_experts > (1 << 20)) return InvalidArgument("num_experts must be in [1, 2^20]");
  const int64_t chunks = (n + kSortChunk - 1) / kSortChunk;
  if (static_cast<int64_t>(sorted->element_count()) != n || static_cast<int64_t>(inverse->element_count()) != n ||
      static_cast<int64_t>(counts->element_count()) != num_experts ||
      static_cast<int64_t>(offsets->element_count()) != num_experts + 1 || valid->element_count() != 1 ||
      static_cast<int64_t>(workspace->element_count()) < chunks * (num_experts + 1) + 1)
    return InvalidArgument("sort_by_expert: output or workspace sizes do not match T*k and num_experts");
  const int e = static_cast<int>(num_experts);
  if (SortsSmall(n, num_experts)) {
    SortSmall<<<1, kSmallThreads, 0, stream>>>(ids.typed_data(), n, e, sorted->typed_data(), inverse->typed_data(),
                                               counts->typed_data(), offsets->typed_data(), valid->typed_data());
    JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    return ffi::Error::Success();
  }
  int32_t* hist = workspace->typed_data();
  int32_t* ticket = hist + chunks * (num_experts + 1);
  const unsigned rank_blocks = chunks > 0 ? static_cast<unsigned>(chunks) : 1;
  if (num_experts + 1 <= kMaxBuckets)
    WarpRanks<<<rank_blocks, kSortChunk, 0, stream>>>(ids.typed_data(), n, chunks, e, inverse->typed_data(), hist,
                                                      ticket);
  else
    ChunkRanks<<<rank_blocks, kSortChunk, 0, stream>>>(ids.typed_data(), n, chunks, e, inverse->typed_data(), hist,
                                                       ticket);
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  ScanBuckets<<<e + 1, kScanThreads, 0, stream>>>(chunks, e, hist, counts->typed_data(), offsets->typed_data(),
                                                  valid->typed_data(), ticket);
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

// ids -> sorted, inverse, counts, offsets, valid, workspace; attribute num_experts (common/binding.h).
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeSortByExpertCuda, jax_moe::SortByExpertCuda, "num_experts");
