// CUDA handler of route (contract in route.h; reference: jax_moe/routing.py's pure-JAX path).
// A warp per row: lane l holds the logits l, l + 32, ... in registers, and every step of the router
// is warp-wide on them: the row's softmax max and sum, the biased choice scores, the group scores
// (each group's max, or the sum of its top two with a bias) and the best groups, k rounds of a warp
// argmax in lax.top_k's order (warp_order.cuh), and the weights of the k chosen on lanes 0..k-1.
// The argmax and the group scores are warp reductions (redux.sync), not shuffle trees.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "../common/binding.h"
#include "../common/errors.h"
#include "moe_device.cuh"
#include "route.h"
#include "warp_order.cuh"

namespace jax_moe {
namespace {

namespace ffi = ::xla::ffi;

constexpr int kRouteWarpsPerBlock = 4;

struct RouteParams {
  int e, k, groups, topk_group;
  bool sigmoid, renormalize, biased;
  float scale;
};

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// log(sigmoid(x)) without underflow: min(x, 0) - log1p(exp(-|x|)).
__device__ __forceinline__ float LogSigmoid(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }

// The softmax over lanes 0..k-1 of v (other lanes' v ignored), on those lanes.
// WarpMax drops a NaN, but a NaN logit still makes its row's softmax NaN through expf(NaN - max).
__device__ __forceinline__ float LaneSoftmax(float v, bool mine) {
  const float m = WarpMax(mine ? v : -INFINITY);
  const float ex = mine ? expf(v - m) : 0.0f;
  return ex / WarpSum(ex);
}

// The sum of the two largest of the warp's keys (a multiset: lane l offers its two largest, a >= b).
__device__ __forceinline__ float WarpTop2Sum(uint32_t a, uint32_t b) {
  const uint32_t top = __reduce_max_sync(0xffffffffu, a);
  const uint32_t holders = __ballot_sync(0xffffffffu, a == top);
  // a second lane holding the top key makes it the second too; else the best of the rest
  const uint32_t second = __popc(holders) > 1 ? top : __reduce_max_sync(0xffffffffu, a == top ? b : a);
  return KeyValue(top) + KeyValue(second);
}

template <int P>
__global__ void RouteRows(const float* logits, const float* bias, int64_t rows, int64_t rows_per_bias,
                          RouteParams p, float* weights, int32_t* ids) {
  const int lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * kRouteWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= rows) return;
  const int e = p.e;
  const float* lr = logits + row * e;
  float l[P];
  const uint32_t valid = LoadLanes(lr, e, lane, l);  // bit i: value lane + 32 i is in the row
  // The row's softmax max and denominator, where a softmax over the whole row is used.
  float row_max = 0.0f, row_sum = 1.0f;
  if (!p.sigmoid && (p.biased || !p.renormalize)) {
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < P; ++i) m = fmaxf(m, l[i]);
    row_max = WarpMax(m);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < P; ++i) s += ((valid >> i) & 1u) ? expf(l[i] - row_max) : 0.0f;
    row_sum = WarpSum(s);
  }
  // The choice: the logits (which order the experts as their scores do), or the scores plus bias.
  uint32_t key[P];
  const float* br = p.biased ? bias + (row / rows_per_bias) * e : nullptr;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    float choice = l[i];
    if (p.biased && ((valid >> i) & 1u)) {
      const float score = p.sigmoid ? Sigmoid(l[i]) : expf(l[i] - row_max) / row_sum;
      choice = score + br[lane + 32 * i];
    }
    key[i] = ((valid >> i) & 1u) ? OrderKey(choice) : 0u;
  }
  if (p.groups > 0) {
    const int per = e / p.groups;
    int group[P];  // the group of value i
#pragma unroll
    for (int i = 0; i < P; ++i) group[i] = (lane + 32 * i) / per;
    uint32_t group_key = 0;  // lane g < groups: group g's score
    for (int g = 0; g < p.groups; ++g) {
      uint32_t a = 0, b = 0;  // the lane's two best choices in group g
#pragma unroll
      for (int i = 0; i < P; ++i) {
        if (((valid >> i) & 1u) && group[i] == g) {
          b = max(b, min(a, key[i]));
          a = max(a, key[i]);
        }
      }
      // biased: the sum of the group's two best choices, else its best one
      const uint32_t score = p.biased ? OrderKey(WarpTop2Sum(a, b)) : __reduce_max_sync(0xffffffffu, a);
      if (lane == g) group_key = score;
    }
    uint32_t keep = 0;  // bit g: group g is among the topk_group best
    const uint32_t group_keys[1] = {group_key};
    for (int r = 0; r < p.topk_group; ++r)
      keep |= 1u << WarpTopIndex(group_keys, lane < p.groups && !((keep >> lane) & 1u) ? 1u : 0u, lane);
    const uint32_t masked = OrderKey(-INFINITY);
#pragma unroll
    for (int i = 0; i < P; ++i)
      if (((valid >> i) & 1u) && !((keep >> group[i]) & 1u)) key[i] = masked;
  }
  // k rounds of the warp's largest choice; lane r keeps the r-th expert and reads its logit.
  uint32_t left = valid;
  int my_id = 0;
  for (int r = 0; r < p.k; ++r) {
    const int index = WarpTopIndex(key, left, lane);
    if ((index & 31) == lane) left &= ~(1u << (index >> 5));
    if (lane == r) my_id = index;
  }
  const bool mine = lane < p.k;
  const float my_logit = mine ? lr[my_id] : 0.0f;
  float w;
  if (p.sigmoid) {
    w = p.renormalize ? LaneSoftmax(LogSigmoid(my_logit), mine) : Sigmoid(my_logit);
  } else {
    w = p.renormalize ? LaneSoftmax(my_logit, mine) : expf(my_logit - row_max) / row_sum;
  }
  if (mine) {
    weights[row * p.k + lane] = p.scale == 1.0f ? w : w * p.scale;
    ids[row * p.k + lane] = my_id;
  }
}

template <int P>
void Launch(cudaStream_t stream, const float* logits, const float* bias, int64_t rows, int64_t rows_per_bias,
            const RouteParams& p, float* weights, int32_t* ids) {
  const auto blocks = static_cast<unsigned>((rows + kRouteWarpsPerBlock - 1) / kRouteWarpsPerBlock);
  RouteRows<P><<<blocks, 32 * kRouteWarpsPerBlock, 0, stream>>>(logits, bias, rows, rows_per_bias, p, weights, ids);
}

ffi::Error RouteCuda(cudaStream_t stream, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> bias,
                     ffi::ResultBuffer<ffi::F32> weights, ffi::ResultBuffer<ffi::S32> ids, int64_t k, bool sigmoid,
                     bool renormalize, int64_t groups, int64_t topk_group, bool biased, float scale) {
  const auto ld = logits.dimensions();
  const auto bd = bias.dimensions();
  const auto wd = weights->dimensions();
  const auto id = ids->dimensions();
  if (ld.size() < 1) return InvalidArgument("route: logits must have rank >= 1 [..., E]");
  const int64_t e = ld.back();
  if (e < 1 || e > kTopKMaxN) return InvalidArgument("route: logits' last axis E must be in [1, 1024]");
  if (k < 1 || k > e || k > kRouteMaxK) return InvalidArgument("route: k must be in [1, min(E, 32)]");
  if (groups < 0 || groups > kRouteMaxGroups || (groups > 0 && e % groups))
    return InvalidArgument("route: groups must be 0, or at most 32 and divide E");
  if (groups > 0 && (topk_group < 1 || topk_group > groups))
    return InvalidArgument("route: topk_group must be in [1, groups]");
  if (groups > 0 && biased && e / groups < 2) return InvalidArgument("route: a biased group needs >= 2 experts");
  if (wd.size() != ld.size() || id.size() != ld.size() || wd.back() != k || id.back() != k)
    return InvalidArgument("route: weights and ids must be [..., k]");
  if (biased && (bd.size() < 1 || bd.size() > ld.size() || bd.back() != e))
    return InvalidArgument("route: bias must be [..., E] with a prefix of logits' leading axes");
  int64_t rows = 1, bias_rows = 1;
  for (size_t d = 0; d + 1 < ld.size(); ++d) {
    if (wd[d] != ld[d] || id[d] != ld[d]) return InvalidArgument("route: weights and ids must have logits' leading axes");
    if (biased && d + 1 < bd.size()) {
      if (bd[d] != ld[d]) return InvalidArgument("route: bias's leading axes must be a prefix of logits'");
      bias_rows *= bd[d];
    }
    rows *= ld[d];
  }
  if (rows == 0) return ffi::Error::Success();
  if (rows > std::numeric_limits<int32_t>::max() * int64_t{kRouteWarpsPerBlock})
    return InvalidArgument("route: too many rows");
  const RouteParams p{static_cast<int>(e), static_cast<int>(k), static_cast<int>(groups), static_cast<int>(topk_group),
                      sigmoid, renormalize, biased, scale};
  const int64_t rows_per_bias = rows / bias_rows;
  const float* lp = logits.typed_data();
  const float* bp = bias.typed_data();
  float* wp = weights->typed_data();
  int32_t* ip = ids->typed_data();
  WithValuesPerLane(e, [&](auto lanes) {
    Launch<decltype(lanes)::value>(stream, lp, bp, rows, rows_per_bias, p, wp, ip);
  });
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_moe

// logits, bias -> weights, ids; attributes as route.h lists them (common/binding.h).
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeRouteCuda, jax_moe::RouteCuda, "k", "sigmoid", "renormalize", "groups",
                            "topk_group", "biased", "scale");
