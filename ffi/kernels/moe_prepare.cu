// CUDA handlers of permute_rows and act_and_mul (contracts in moe_prepare_finalize.h, references in
// jax_moe/kernels.py). act_and_mul runs one CUDA block per output row; permute_rows one per two
// (kPermuteRowsPerBlock; one with the per-token scale), with an inverse per slot, in slot order,
// written to the slot's sorted row. The row's values are produced in
// float32 (a gathered input row, or act(gate) * up with the row's expert bias added first), optionally quantized to FP8 E4M3 with a
// per-row scale (amax pass, then a second pass that re-reads the row from cache) or a given
// static scale. Rows at or past valid_rows are written as zeros. No allocation, no host sync.
#include <cstdint>
#include <limits>
#include <type_traits>

#include "moe_device.cuh"

namespace jax_moe {
namespace {

// Row r = x[sorted_slots[r] / top_k]; a slot outside [0, T*k) makes the row invalid (zeros).
template <typename In, int V>
struct GatherRow {
  static constexpr bool kMultiRow = true;  // Begin is per thread: RowsKernel may run it
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
  static constexpr bool kMultiRow = true;
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

// Row r = act(gate) * up of h[r] + bias[expert of r] (bias optional), in float32. Gate and up are
// columns [0, I) and [I, 2I) (concat) or 2i and 2i+1 (interleaved); the bias row has h's column order.
template <typename In, int V>
struct GatedActRow {
  static constexpr bool kMultiRow = false;  // Begin synchronizes the block
  const In* h;
  const float* bias;       // [E, 2I], or nullptr: no bias
  const int32_t* offsets;  // [E+1] with a bias
  int64_t cols;            // I
  int experts, activation, layout;
  float alpha, limit;
  const In* src;
  const float* bias_row;

  __device__ int64_t Dest(int64_t r) const { return r; }
  // Called by every thread of the block (the row is uniform over it): the row's expert is looked up
  // once, by thread 0, and shared.
  __device__ bool Begin(int64_t r) {
    src = h + r * 2 * cols;
    bias_row = nullptr;
    if (bias != nullptr) {
      __shared__ int expert;
      if (threadIdx.x == 0) expert = ExpertOfRow(offsets, experts, r);
      __syncthreads();
      bias_row = bias + int64_t(expert) * 2 * cols;
    }
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

// One block per row b of Op, written to row r = Op::Dest(b) of out [rows, cols] (skipped where r is
// outside [0, rows)); Op produces the row's float32 values V at a time.
template <typename Out, int V, int Quant, typename Op>
__global__ void RowKernel(Op op, int64_t rows, int64_t cols, const int32_t* valid_rows, const float* static_scale,
                          Out* out, float* scales) {
  const int64_t b = blockIdx.x;
  Op o = op;
  const int64_t r = o.Dest(b);  // uniform over the block
  if (r < 0 || r >= rows) return;
  Out* dst = out + r * cols;
  const int64_t vectors = cols / V;
  const bool valid = r < ValidRows(valid_rows, rows) && o.Begin(b);  // uniform over the block
  if (!valid) {
    float zero[V] = {};
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) StoreF32<Out, V>(dst + c * V, zero);
    if (Quant == kQuantPerToken && threadIdx.x == 0) scales[r] = kFp8MinScale;
    return;
  }
  float inv = 1.0f, scale = 0.0f;
  if constexpr (Quant == kQuantPerToken) {
    float amax = 0.0f;
    for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
      float v[V];
      o.Load(c * V, v);
#pragma unroll
      for (int i = 0; i < V; ++i) amax = fmaxf(amax, fabsf(v[i]));
    }
    scale = AmaxToScale(BlockMax(amax));
    inv = 1.0f / scale;
  } else if constexpr (Quant == kQuantStatic) {
    inv = 1.0f / *static_scale;
  }
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
    float v[V];
    o.Load(c * V, v);
    if constexpr (Quant != kQuantNone) {
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] *= inv;
    }
    StoreF32<Out, V>(dst + c * V, v);
  }
  if (Quant == kQuantPerToken && threadIdx.x == 0) scales[r] = scale;
}

// Slots (or rows) per block of permute_rows: RowsKernel's kRows, except per-token FP8 (RowKernel). On an
// H100, two per block took the permute from 62 to 58 us (FP8 static) and from 64 to 58 us (bf16) at
// Qwen3-30B's T=4096, and 250 -> 228 / 263 -> 236 us at T=16384; four were no faster than two.
constexpr int kPermuteRowsPerBlock = 2;

// RowKernel for kRows rows of Op per block (Ops whose Begin is per thread: the gathers), without the
// per-token amax: each thread loads its vector of every row first, then stores them, so that a block
// has kRows independent loads in flight where RowKernel has one. A block of RowKernel does little
// (Qwen3-30B's 2048-column rows: one 16-byte load and one 8-byte FP8 store per thread) behind a chain of
// dependent loads (slot, destination row, source row).
template <typename Out, int V, int Quant, int kRows, typename Op>
__global__ void RowsKernel(Op op, int64_t rows, int64_t cols, const int32_t* valid_rows, const float* static_scale,
                           Out* out) {
  static_assert(Quant != kQuantPerToken, "the per-token scale needs a block-wide amax per row (RowKernel)");
  const int64_t b0 = int64_t(blockIdx.x) * kRows, valid_n = ValidRows(valid_rows, rows);
  Op o[kRows];
  Out* dst[kRows];
  bool live[kRows], ok[kRows];  // uniform over the block: row written, row read
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    o[j] = op;
    const int64_t r = b0 + j < rows ? o[j].Dest(b0 + j) : -1;
    live[j] = r >= 0 && r < rows;
    dst[j] = out + (live[j] ? r : 0) * cols;
    ok[j] = live[j] && r < valid_n && o[j].Begin(b0 + j);
  }
  float inv = 1.0f;
  if constexpr (Quant == kQuantStatic) inv = 1.0f / *static_scale;
  const int64_t vectors = cols / V;
  for (int64_t c = threadIdx.x; c < vectors; c += blockDim.x) {
    float v[kRows][V];
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (ok[j]) {
        o[j].Load(c * V, v[j]);
      } else {
#pragma unroll
        for (int i = 0; i < V; ++i) v[j][i] = 0.0f;
      }
    }
#pragma unroll
    for (int j = 0; j < kRows; ++j) {
      if (!live[j]) continue;
      if constexpr (Quant != kQuantNone) {
#pragma unroll
        for (int i = 0; i < V; ++i) v[j][i] *= inv;
      }
      StoreF32<Out, V>(dst[j] + c * V, v[j]);
    }
  }
}

// Op's rows, kPermuteRowsPerBlock per block where Op's Begin is per thread and no per-token amax is
// needed (RowsKernel), else one per block (RowKernel).
template <typename Out, int V, int Quant, typename Op>
ffi::Error LaunchRows(cudaStream_t stream, const Op& op, int64_t rows, int64_t cols, const int32_t* valid_rows,
                      const float* static_scale, Out* out, float* scales) {
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  const int threads = RowThreads(cols / V);
  if constexpr (Quant != kQuantPerToken && Op::kMultiRow) {
    const auto blocks = static_cast<unsigned>((rows + kPermuteRowsPerBlock - 1) / kPermuteRowsPerBlock);
    RowsKernel<Out, V, Quant, kPermuteRowsPerBlock, Op>
        <<<blocks, threads, 0, stream>>>(op, rows, cols, valid_rows, static_scale, out);
  } else {
    RowKernel<Out, V, Quant, Op><<<static_cast<unsigned>(rows), threads, 0, stream>>>(op, rows, cols, valid_rows,
                                                                                      static_scale, out, scales);
  }
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

// Launches op's rows with the quant mode (and with it the output type) fixed at compile time.
template <int V, typename Op>
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
      return WithFloatType(out->element_type(), "out", [&](auto tag) {
        using Out = typename decltype(tag)::type;
        return LaunchRows<Out, V, kQuantNone>(stream, op, rows, cols, valid_rows, static_scale,
                                              static_cast<Out*>(dst), scales);
      });
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
    auto launch = [&](auto vec) -> ffi::Error {  // blocks of kPermuteRowsPerBlock slots with an inverse, else of rows
      constexpr int V = decltype(vec)::value;
      if (inv != nullptr)
        return DispatchQuant<V>(stream, SlotRow<In, V>{src, inv, h, top_k, nullptr}, quant, n, h,
                                valid_rows.typed_data(), s, out, sc);
      return DispatchQuant<V>(stream, GatherRow<In, V>{src, slots, h, n, top_k, nullptr}, quant, n, h,
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
