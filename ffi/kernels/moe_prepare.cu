// CUDA handlers of permute_rows and act_and_mul (contracts in moe_prepare_finalize.h, references in
// jax_moe/kernels.py). Both run a warp per output row (permute_rows with an inverse: a warp per slot,
// written to the slot's sorted row, or, for many tokens, a warp per token that reads the token's row
// once and writes it to its k slots' rows). The row's values are produced in float32 (a
// gathered input row, or act(gate) * up with the row's expert bias added first), optionally quantized
// to FP8 E4M3 as jax_moe/quant/fp8.py does (infinities to NaN, an amax over the finite values) with a
// per-row scale (amax pass, then a second pass that re-reads the row from cache) or a given static
// scale. Rows at or past valid_rows are written as zeros. No allocation, no host sync.
#include <cstdint>
#include <limits>
#include <type_traits>

#include "moe_device.cuh"

namespace jax_moe {
namespace {

// Row r = x[sorted_slots[r] / top_k]; a slot outside [0, T*k) makes the row invalid (zeros).
template <typename In, int V>
struct GatherRow {
  const In* x;
  const int32_t* slots;
  int64_t cols, num_slots, top_k;
  const In* src;

  __device__ int64_t Dest(int64_t r) const { return r; }
  __device__ bool Begin(int64_t r) {
    const int64_t slot = slots[r];
    if (slot < 0 || slot >= num_slots) return false;
    src = x + (slot / top_k) * cols;
    return true;
  }
  __device__ void Load(int64_t c, float (&v)[V]) const { LoadF32<In, V>(src + c, v); }
};

// Block s = slot s reads x[s / top_k] and writes it to row inverse[s]: in slot order, the k blocks
// of a token read its row together (from L2 after the first) instead of k times from DRAM.
template <typename In, int V>
struct SlotRow {
  const In* x;
  const int32_t* inverse;
  int64_t cols, top_k;
  const In* src;

  __device__ int64_t Dest(int64_t s) const { return inverse[s]; }
  __device__ bool Begin(int64_t s) {
    src = x + (s / top_k) * cols;
    return true;
  }
  __device__ void Load(int64_t c, float (&v)[V]) const { LoadF32<In, V>(src + c, v); }
};

// Token t's row x[t], for PermuteTokenKernel: the rows it goes to are inverse[t*k .. t*k + k).
template <typename In, int V>
struct TokenRows {
  const In* x;
  const int32_t* inverse;
  int64_t tokens, cols, top_k;
};

// Row r = act(gate) * up of h[r] + bias[expert of r] (bias optional), in float32. Gate and up are
// columns [0, I) and [I, 2I) (concat) or 2i and 2i+1 (interleaved); the bias row has h's column order.
template <typename In, int V>
struct GatedActRow {
  const In* h;
  const float* bias;       // [E, 2I], or nullptr: no bias
  const int32_t* offsets;  // [E+1] with a bias
  int64_t cols;            // I
  int experts, activation, layout;
  float alpha, limit;
  const In* src;
  const float* bias_row;

  __device__ int64_t Dest(int64_t r) const { return r; }
  // Called by every lane of the row's warp (the row is uniform over it): each looks the row's expert
  // up (the same reads of offsets for all).
  __device__ bool Begin(int64_t r) {
    src = h + r * 2 * cols;
    bias_row = bias != nullptr ? bias + int64_t(ExpertOfRow(offsets, experts, r)) * 2 * cols : nullptr;
    return true;
  }

  // Columns [c, c + V) of the row's gate and up (bias added), in float32.
  __device__ void LoadGateUp(int64_t c, float (&gate)[V], float (&up)[V]) const {
    if (layout == kLayoutInterleaved) {
      float lo[V], hi[V];  // h[2c, 2c + V) and h[2c + V, 2c + 2V): pairs (gate, up)
      LoadF32<In, V>(src + 2 * c, lo);
      LoadF32<In, V>(src + 2 * c + V, hi);
      if (bias_row != nullptr) {
        float blo[V], bhi[V];
        LoadF32<float, V>(bias_row + 2 * c, blo);
        LoadF32<float, V>(bias_row + 2 * c + V, bhi);
#pragma unroll
        for (int i = 0; i < V; ++i) lo[i] += blo[i], hi[i] += bhi[i];
      }
#pragma unroll
      for (int i = 0; i < V; ++i) {  // element j of the 2V loaded: lo[j] or hi[j - V]
        const int j = 2 * i;
        gate[i] = j < V ? lo[j] : hi[j - V];
        up[i] = j + 1 < V ? lo[j + 1] : hi[j + 1 - V];
      }
      return;
    }
    LoadF32<In, V>(src + c, gate);
    LoadF32<In, V>(src + cols + c, up);
    if (bias_row != nullptr) {
      float bg[V], bu[V];
      LoadF32<float, V>(bias_row + c, bg);
      LoadF32<float, V>(bias_row + cols + c, bu);
#pragma unroll
      for (int i = 0; i < V; ++i) gate[i] += bg[i], up[i] += bu[i];
    }
  }

  __device__ void Load(int64_t c, float (&v)[V]) const {
    float gate[V], up[V];
    LoadGateUp(c, gate, up);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = GatedAct(activation, gate[i], up[i], alpha, limit);
  }
};

// Vectors each lane loads before it stores any: a row's loads in flight per lane.
constexpr int kLaneVectors = 8;

// The quantization scale of a row of `vectors` V-vectors (load(c, v) gives vector c in float32), per Quant:
// per token, from the warp's amax over the row's finite values (kLaneVectors loads in flight per lane); or
// the static one. Returns (dequantization scale, its inverse): (0, 1) without quantization; every lane
// gets them.
template <int V, int Quant, typename Load>
__device__ __forceinline__ float2 RowQuantScale(int64_t vectors, int lane, const float* static_scale, Load&& load) {
  if constexpr (Quant == kQuantPerToken) {
    float amax = 0.0f;
    for (int64_t c0 = lane; c0 < vectors; c0 += 32 * kLaneVectors) {
      float v[kLaneVectors][V];
#pragma unroll
      for (int u = 0; u < kLaneVectors; ++u)
        if (c0 + 32 * u < vectors) load(c0 + 32 * u, v[u]);
#pragma unroll
      for (int u = 0; u < kLaneVectors; ++u)
        if (c0 + 32 * u < vectors) {
#pragma unroll
          for (int i = 0; i < V; ++i) amax = fmaxf(amax, FiniteAbs(v[u][i]));
        }
    }
    amax = WarpMax(amax);
    const float scale = AmaxToScale(amax);
    return make_float2(scale, 1.0f / scale);
  } else if constexpr (Quant == kQuantStatic) {
    return make_float2(*static_scale, 1.0f / *static_scale);
  }
  return make_float2(0.0f, 1.0f);
}

// A vector's V values scaled for FP8 by inv (ScaleForFp8) where Quant quantizes, unchanged where not.
template <int V, int Quant>
__device__ __forceinline__ void ScaleForQuant(float (&v)[V], float inv) {
  if constexpr (Quant != kQuantNone) ScaleForFp8(v, inv);
}

// A warp per row b of Op (kWarpsPerBlock to a block), written to row r = Op::Dest(b) of out
// [rows, cols] (skipped where r is outside [0, rows)); Op produces the row's float32 values V at a
// time, and lane l takes the row's vectors l, l + 32, ... . The row's setup (its slot, destination and
// source; its expert) is paid once per lane for the whole row, and each lane has kLaneVectors loads in
// flight. Per-token FP8 takes the row's amax in a first pass (a warp reduction), then re-reads the row
// (from cache) to store it.
template <typename Out, int V, int Quant, typename Op>
__global__ void RowWarpKernel(Op op, int64_t rows, int64_t cols, const int32_t* valid_rows,
                              const float* static_scale, Out* out, float* scales) {
  const int lane = threadIdx.x & 31;
  const int64_t b = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (b >= rows) return;
  Op o = op;
  const int64_t r = o.Dest(b);  // uniform over the warp
  if (r < 0 || r >= rows) return;
  Out* dst = out + r * cols;
  const int64_t vectors = cols / V;
  const bool valid = r < ValidRows(valid_rows, rows) && o.Begin(b);  // uniform over the warp
  if (!valid) {
    float zero[V] = {};
    for (int64_t c = lane; c < vectors; c += 32) StoreF32<Out, V>(dst + c * V, zero);
    if (Quant == kQuantPerToken && lane == 0) scales[r] = kFp8MinScale;
    return;
  }
  const float2 q = RowQuantScale<V, Quant>(vectors, lane, static_scale,
                                           [&](int64_t c, float(&v)[V]) { o.Load(c * V, v); });
  const float scale = q.x, inv = q.y;
  for (int64_t c0 = lane; c0 < vectors; c0 += 32 * kLaneVectors) {
    float v[kLaneVectors][V];
#pragma unroll
    for (int u = 0; u < kLaneVectors; ++u)
      if (c0 + 32 * u < vectors) o.Load((c0 + 32 * u) * V, v[u]);
#pragma unroll
    for (int u = 0; u < kLaneVectors; ++u) {
      if (c0 + 32 * u >= vectors) continue;
      ScaleForQuant<V, Quant>(v[u], inv);
      StoreF32<Out, V>(dst + (c0 + 32 * u) * V, v[u]);
    }
  }
  if (Quant == kQuantPerToken && lane == 0) scales[r] = scale;
}

// A warp per token t of op: its row is read once (its amax too, for per-token FP8), converted, and
// written to each of its k slots' rows inverse[t*k + j] (zeros where that row is at or past
// valid_rows; skipped where it is outside [0, T*k)). So the token's row crosses the L2 once, not
// once per slot, and its k rows' stores share its loads.
template <typename Out, int V, int Quant, typename In>
__global__ void PermuteTokenKernel(TokenRows<In, V> op, const int32_t* valid_rows, const float* static_scale,
                                   Out* out, float* scales) {
  const int lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (t >= op.tokens) return;
  const int64_t rows = op.tokens * op.top_k, cols = op.cols, vectors = cols / V;
  const int64_t valid = ValidRows(valid_rows, rows);
  const int32_t* dest = op.inverse + t * op.top_k;
  const In* src = op.x + t * cols;
  const float2 q = RowQuantScale<V, Quant>(vectors, lane, static_scale,
                                           [&](int64_t c, float(&v)[V]) { LoadF32<In, V>(src + c * V, v); });
  const float scale = q.x, inv = q.y;
  for (int64_t c0 = lane; c0 < vectors; c0 += 32 * kLaneVectors) {
    float v[kLaneVectors][V];
#pragma unroll
    for (int u = 0; u < kLaneVectors; ++u)
      if (c0 + 32 * u < vectors) {
        LoadF32<In, V>(src + (c0 + 32 * u) * V, v[u]);
        ScaleForQuant<V, Quant>(v[u], inv);
      }
    for (int64_t j = 0; j < op.top_k; ++j) {
      const int64_t r = dest[j];  // uniform over the warp
      if (r < 0 || r >= rows) continue;
      Out* dst = out + r * cols;
      if (r < valid) {
#pragma unroll
        for (int u = 0; u < kLaneVectors; ++u)
          if (c0 + 32 * u < vectors) StoreF32Words<Out, V>(dst + (c0 + 32 * u) * V, v[u]);
      } else {
        const float zero[V] = {};
#pragma unroll
        for (int u = 0; u < kLaneVectors; ++u)
          if (c0 + 32 * u < vectors) StoreF32Words<Out, V>(dst + (c0 + 32 * u) * V, zero);
      }
    }
  }
  if constexpr (Quant == kQuantPerToken) {
    for (int64_t j = lane; j < op.top_k; j += 32) {
      const int64_t r = dest[j];
      if (r >= 0 && r < rows) scales[r] = r < valid ? scale : kFp8MinScale;
    }
  }
}

// The fewest tokens for which permute_rows with an inverse runs a warp per token. Below, a warp per
// slot: at T = 64 a warp per token, writing its k rows alone, was 1.4-3x slower than a warp per slot
// (H200; DeepSeek-V3's FP8 permute 7.0 -> 21.6 us), and at T = 4096 0.62-1.01x (Qwen3-30B's FP8
// permute 40.4 -> 25.0 us), as a token's row then crosses the L2 once, not k times. Wide unquantized
// rows gain least, and no width limit paid: DeepSeek-V3's and GPT-OSS's bf16 rows (14 and 5.6 KiB) by
// token took 0.92-1.09x and 0.96-1.01x the time of a warp per slot from T = 1024 to 4096.
constexpr int64_t kPermuteByTokenMinTokens = 1024;

// Warps (rows) per block of RowWarpKernel. On an H100, a warp per row with its 8 loads in flight (and
// FP8 converted in pairs) took the FP8 permute of Qwen3-30B's T=4096 from 57 to 43 us in the forward,
// and GPT-OSS's bf16 one at T=16384 from 192 to 173 us; 2048-column bf16 rows were already at the
// write ceiling.
constexpr int kWarpsPerBlock = 4;

template <typename Out, int V, int Quant, typename Op>
ffi::Error LaunchRows(cudaStream_t stream, const Op& op, int64_t rows, int64_t cols, const int32_t* valid_rows,
                      const float* static_scale, Out* out, float* scales) {
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  const auto blocks = static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
  RowWarpKernel<Out, V, Quant, Op>
      <<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(op, rows, cols, valid_rows, static_scale, out, scales);
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

// TokenRows: a warp per token (rows, T*k, is the rows written).
template <typename Out, int V, int Quant, typename In>
ffi::Error LaunchRows(cudaStream_t stream, const TokenRows<In, V>& op, int64_t rows, int64_t cols,
                      const int32_t* valid_rows, const float* static_scale, Out* out, float* scales) {
  if (op.tokens == 0 || rows == 0 || cols == 0) return ffi::Error::Success();
  const auto blocks = static_cast<unsigned>((op.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock);
  PermuteTokenKernel<Out, V, Quant, In>
      <<<blocks, 32 * kWarpsPerBlock, 0, stream>>>(op, valid_rows, static_scale, out, scales);
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

// Launches op's rows with the quant mode (and with it the output type) fixed at compile time. Without
// quantization the output is of type Out where the caller fixes it (permute_rows: x's type), else of
// any float type.
template <int V, typename Out = void, typename Op>
ffi::Error DispatchQuant(cudaStream_t stream, const Op& op, int64_t quant, int64_t rows, int64_t cols,
                         const int32_t* valid_rows, const float* static_scale, ffi::Result<ffi::AnyBuffer>& out,
                         float* scales) {
  void* dst = out->untyped_data();
  switch (quant) {
    case kQuantPerToken:
      return LaunchRows<Fp8, V, kQuantPerToken>(stream, op, rows, cols, valid_rows, static_scale,
                                                 static_cast<Fp8*>(dst), scales);
    case kQuantStatic:
      return LaunchRows<Fp8, V, kQuantStatic>(stream, op, rows, cols, valid_rows, static_scale,
                                               static_cast<Fp8*>(dst), scales);
    default:
      if constexpr (!std::is_void_v<Out>) {
        return LaunchRows<Out, V, kQuantNone>(stream, op, rows, cols, valid_rows, static_scale,
                                              static_cast<Out*>(dst), scales);
      } else {
        return WithFloatType(out->element_type(), "out", [&](auto tag) {
          using O = typename decltype(tag)::type;
          return LaunchRows<O, V, kQuantNone>(stream, op, rows, cols, valid_rows, static_scale,
                                              static_cast<O*>(dst), scales);
        });
      }
  }
}

// Checks shared by both handlers: the quant mode, its output dtype, scale operand and scales result.
ffi::Error CheckQuant(const char* name, int64_t quant, int64_t rows, ffi::DataType out_type,
                      int64_t scale_count, int64_t scales_count) {
  const std::string n(name);
  if (quant != kQuantNone && quant != kQuantPerToken && quant != kQuantStatic)
    return InvalidArgument(n + ": quant must be 0 (none), 1 (fp8 per token) or 2 (fp8 static)");
  if (quant != kQuantNone && out_type != ffi::DataType::F8E4M3FN)
    return InvalidArgument(n + ": a quantized output must be float8_e4m3fn");
  if (scale_count != (quant == kQuantStatic ? 1 : 0))
    return InvalidArgument(n + ": scale must have 1 element with quant=2 (static), 0 otherwise");
  if (scales_count != (quant == kQuantPerToken ? rows : 0))
    return InvalidArgument(n + ": scales must have one element per row with quant=1 (per token), 0 otherwise");
  if (rows > std::numeric_limits<int32_t>::max()) return InvalidArgument(n + ": more than 2^31 - 1 rows");
  return ffi::Error::Success();
}

ffi::Error PermuteRowsCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> sorted_slots,
                           ffi::Buffer<ffi::S32> inverse, ffi::Buffer<ffi::S32> valid_rows, ffi::Buffer<ffi::F32> scale,
                           ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> scales, int64_t top_k,
                           int64_t quant) {
  const auto xd = x.dimensions();
  if (xd.size() != 2) return InvalidArgument("permute_rows: x must have rank 2 [T, H]");
  const int64_t t = xd[0], h = xd[1];
  if (top_k < 1) return InvalidArgument("permute_rows: top_k must be >= 1");
  const int64_t n = t * top_k;
  if (static_cast<int64_t>(sorted_slots.element_count()) != n)
    return InvalidArgument("permute_rows: sorted_slots must have T*k elements");
  const int64_t inverse_count = static_cast<int64_t>(inverse.element_count());
  if (inverse_count != 0 && inverse_count != n)
    return InvalidArgument("permute_rows: inverse must have T*k elements (slot order) or 0 (gather order)");
  if (valid_rows.element_count() != 1) return InvalidArgument("permute_rows: valid_rows must have 1 element");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != n || od[1] != h) return InvalidArgument("permute_rows: out must be [T*k, H]");
  if (quant == kQuantNone && out->element_type() != x.element_type())
    return InvalidArgument("permute_rows: without quantization out must have x's dtype");
  if (auto err = CheckQuant("permute_rows", quant, n, out->element_type(), scale.element_count(),
                                scales->element_count()); err.failure()) return err;
  return WithFloatType(x.element_type(), "permute_rows: x", [&](auto tag) -> ffi::Error {
    using In = typename decltype(tag)::type;
    const int out_bytes = quant == kQuantNone ? sizeof(In) : 1;
    const int32_t* slots = sorted_slots.typed_data();
    const float* s = quant == kQuantStatic ? scale.typed_data() : nullptr;
    float* sc = quant == kQuantPerToken ? scales->typed_data() : nullptr;
    const int32_t* inv = inverse_count != 0 ? inverse.typed_data() : nullptr;
    const In* src = static_cast<const In*>(x.untyped_data());
    // With an inverse: a warp per token where there are tokens enough to fill the GPU, else per slot.
    auto launch = [&](auto vec) -> ffi::Error {
      constexpr int V = decltype(vec)::value;
      if (inv != nullptr && t >= kPermuteByTokenMinTokens)
        return DispatchQuant<V, In>(stream, TokenRows<In, V>{src, inv, t, h, top_k}, quant, n, h,
                                    valid_rows.typed_data(), s, out, sc);
      if (inv != nullptr)
        return DispatchQuant<V, In>(stream, SlotRow<In, V>{src, inv, h, top_k, nullptr}, quant, n, h,
                                    valid_rows.typed_data(), s, out, sc);
      return DispatchQuant<V, In>(stream, GatherRow<In, V>{src, slots, h, n, top_k, nullptr}, quant, n, h,
                                  valid_rows.typed_data(), s, out, sc);
    };
    if (CanVectorize(h, kVec<In>, {{src, sizeof(In)}, {out->untyped_data(), out_bytes}}))
      return launch(std::integral_constant<int, kVec<In>>{});
    return launch(std::integral_constant<int, 1>{});
  });
}

ffi::Error ActAndMulCuda(cudaStream_t stream, ffi::AnyBuffer h, ffi::Buffer<ffi::S32> valid_rows,
                         ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::S32> offsets,
                         ffi::Result<ffi::AnyBuffer> out, ffi::ResultBuffer<ffi::F32> scales, int64_t activation,
                         int64_t quant, int64_t layout, float alpha, float limit) {
  const auto hd = h.dimensions();
  if (hd.size() != 2 || hd[1] % 2 != 0) return InvalidArgument("act_and_mul: h must be [M, 2I]");
  const int64_t m = hd[0], i = hd[1] / 2;
  if (activation != kActSilu && activation != kActGelu && activation != kActSwigluOai)
    return InvalidArgument("act_and_mul: activation must be 0 (silu), 1 (gelu) or 2 (swigluoai)");
  if (layout != kLayoutConcat && layout != kLayoutInterleaved)
    return InvalidArgument("act_and_mul: layout must be 0 (concat) or 1 (interleaved)");
  if (valid_rows.element_count() != 1) return InvalidArgument("act_and_mul: valid_rows must have 1 element");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != m || od[1] != i) return InvalidArgument("act_and_mul: out must be [M, I]");
  if (auto err = CheckQuant("act_and_mul", quant, m, out->element_type(), scale.element_count(),
                                scales->element_count()); err.failure()) return err;
  int64_t experts = 0;
  if (auto err = CheckBias("act_and_mul", bias, offsets, 2 * i, &experts); err.failure()) return err;
  return WithFloatType(h.element_type(), "act_and_mul: h", [&](auto tag) -> ffi::Error {
    using In = typename decltype(tag)::type;
    const int out_bytes = quant != kQuantNone                          ? 1
                          : out->element_type() == ffi::DataType::F32 ? 4
                                                                        : 2;
    const float* s = quant == kQuantStatic ? scale.typed_data() : nullptr;
    float* sc = quant == kQuantPerToken ? scales->typed_data() : nullptr;
    const In* src = static_cast<const In*>(h.untyped_data());
    const float* b = experts > 0 ? bias.typed_data() : nullptr;
    const int32_t* off = experts > 0 ? offsets.typed_data() : nullptr;
    const int act = static_cast<int>(activation), lay = static_cast<int>(layout), ne = static_cast<int>(experts);
    if (CanVectorize(i, kVec<In>, {{src, sizeof(In)}, {out->untyped_data(), out_bytes}, {b, sizeof(float)}})) {
      GatedActRow<In, kVec<In>> op{src, b, off, i, ne, act, lay, alpha, limit, nullptr, nullptr};
      return DispatchQuant<kVec<In>>(stream, op, quant, m, i, valid_rows.typed_data(), s, out, sc);
    }
    GatedActRow<In, 1> op{src, b, off, i, ne, act, lay, alpha, limit, nullptr, nullptr};
    return DispatchQuant<1>(stream, op, quant, m, i, valid_rows.typed_data(), s, out, sc);
  });
}

}  // namespace
}  // namespace jax_moe

// Bindings read off the handlers' signatures (common/binding.h).
// x, sorted_slots, inverse, valid_rows, scale -> rows, scales; attributes top_k, quant.
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoePermuteRowsCuda, jax_moe::PermuteRowsCuda, "top_k", "quant");
// h, valid_rows, scale, bias, offsets -> out, scales; attributes activation, quant, layout, alpha, limit.
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeActAndMulCuda, jax_moe::ActAndMulCuda, "activation", "quant", "layout", "alpha",
                            "limit");
