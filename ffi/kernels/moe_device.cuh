// Device helpers shared by the MoE row kernels: element types, float conversions, warp sums and
// maxima, vector access, and FP8 E4M3 quantization with jax_moe/quant/fp8.py's exact arithmetic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>

#include "../common/binding.h"
#include "../common/errors.h"
#include "moe_prepare_finalize.h"

namespace jax_moe {

// One FP8 E4M3 byte (float8_e4m3fn: no infinities, finite max 448).
struct Fp8 {
  uint8_t bits;
};

__device__ __forceinline__ float ToF32(float v) { return v; }
__device__ __forceinline__ float ToF32(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToF32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T FromF32(float v);
template <>
__device__ __forceinline__ float FromF32<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half FromF32<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 FromF32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
// FP8 E4M3 from float32, rounded to nearest even and saturating, as cast_to_fp8: finite values and
// infinities beyond +-448 become +-448 (float8_e4m3fn has no infinity); NaN stays NaN.
template <>
__device__ __forceinline__ Fp8 FromF32<Fp8>(float v) {
  return Fp8{static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3))};
}
// What FP8 quantization does around its scale (nonfinite_to_nan, finite_absmax): +-inf become NaN,
// since no FP8 format holds an infinity and saturating one would pass an overflow off as a plausible
// finite value; an amax counts only finite values, so a NaN or an infinity never moves its row's scale.
// ScaleForFp8 is v * inv with +-inf made NaN, in two instructions: v * 0 is NaN for an infinity or a
// NaN, and a zero of v's sign otherwise, which the fused add leaves v * inv exactly (inv > 0).
__device__ __forceinline__ float ScaleForFp8(float v, float inv) { return fmaf(v, inv, v * 0.0f); }
// The same over a vector of V values, in place.
template <int V>
__device__ __forceinline__ void ScaleForFp8(float (&v)[V], float inv) {
#pragma unroll
  for (int i = 0; i < V; ++i) v[i] = ScaleForFp8(v[i], inv);
}
__device__ __forceinline__ float FiniteAbs(float v) {
  const float a = fabsf(v);
  return a < INFINITY ? a : 0.0f;  // false for NaN too
}
// Two at a time, one instruction: lo in bits [0, 8), hi in [8, 16).
__device__ __forceinline__ uint32_t PackFp8x2(float lo, float hi) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
}

// x summed over the warp: every lane gets it.
__device__ __forceinline__ float WarpSum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// The warp's largest x: every lane gets it. fmaxf drops a NaN unless every lane holds one.
__device__ __forceinline__ float WarpMax(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

// V consecutive elements, loaded or stored as one access (the caller checks the alignment).
template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

template <typename T, int V>
__device__ __forceinline__ void LoadF32(const T* p, float (&out)[V]) {
  const Vec<T, V> in = *reinterpret_cast<const Vec<T, V>*>(p);
#pragma unroll
  for (int i = 0; i < V; ++i) out[i] = ToF32(in.v[i]);
}

// 4 / sizeof(T) values from float32 in one 32-bit word, the first in the low bits (converted in pairs:
// one instruction per pair, float32 aside).
template <typename T>
__device__ __forceinline__ uint32_t PackWord(const float* v) {
  if constexpr (std::is_same_v<T, Fp8>) {
    return PackFp8x2(v[0], v[1]) | (PackFp8x2(v[2], v[3]) << 16);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[0], v[1]);
    return *reinterpret_cast<const uint32_t*>(&pair);
  } else if constexpr (std::is_same_v<T, __half>) {
    const __half2 pair = __floats2half2_rn(v[0], v[1]);
    return *reinterpret_cast<const uint32_t*>(&pair);
  } else {
    static_assert(std::is_same_v<T, float>);
    return __float_as_uint(v[0]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void StoreF32(T* p, const float (&vals)[V]) {
  Vec<T, V> o;
  if constexpr (std::is_same_v<T, Fp8> && V % 2 == 0) {  // pairs converted together
#pragma unroll
    for (int i = 0; i < V; i += 2) {
      const uint32_t pair = PackFp8x2(vals[i], vals[i + 1]);
      o.v[i].bits = static_cast<uint8_t>(pair);
      o.v[i + 1].bits = static_cast<uint8_t>(pair >> 8);
    }
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) o.v[i] = FromF32<T>(vals[i]);
  }
  *reinterpret_cast<Vec<T, V>*>(p) = o;
}

// StoreF32 to global memory, the values packed into 32-bit words and stored by vector instructions
// where they fill 8 or 16 bytes (p aligned to the store). Where a row's values stay in registers
// across several stores (PermuteTokenKernel writes them to k rows), nvcc split StoreF32's store into
// a 2-byte store per bf16 value, and a plain store of packed words into 4-byte ones: the bf16 permute
// ran 6.8x slower.
template <typename T, int V>
__device__ __forceinline__ void StoreF32Words(T* p, const float (&vals)[V]) {
  constexpr int kBytes = sizeof(T) * V, kWords = kBytes / 4, kPerWord = 4 / sizeof(T);
  if constexpr (kBytes % 4 != 0) {  // a value or two under a word (the scalar path): one store either way
    StoreF32<T, V>(p, vals);
  } else if constexpr (kWords == 1) {
    *reinterpret_cast<uint32_t*>(p) = PackWord<T>(vals);
  } else {
    uint32_t w[kWords];
#pragma unroll
    for (int q = 0; q < kWords; ++q) w[q] = PackWord<T>(vals + q * kPerWord);
    if constexpr (kWords % 4 == 0) {
#pragma unroll
      for (int q = 0; q < kWords; q += 4)
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(reinterpret_cast<char*>(p) + 4 * q),
                     "r"(w[q]), "r"(w[q + 1]), "r"(w[q + 2]), "r"(w[q + 3]) : "memory");
    } else {
      static_assert(kWords == 2);
      asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(p), "r"(w[0]), "r"(w[1]) : "memory");
    }
  }
}

// The gated activations of jax_moe/activations.py, in float32.
__device__ __forceinline__ float Sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }
__device__ __forceinline__ float Silu(float g) { return g / (1.0f + expf(-g)); }
__device__ __forceinline__ float Gelu(float g) { return 0.5f * g * (1.0f + erff(g * 0.70710678118654752440f)); }
// GPT-OSS's swigluoai: gate clamped above at limit, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).
__device__ __forceinline__ float SwigluOai(float g, float u, float alpha, float limit) {
  g = fminf(g, limit);
  u = fminf(fmaxf(u, -limit), limit);
  return (u + 1.0f) * g * Sigmoid(alpha * g);
}
// act(gate) * up for activation (kAct*), as act_and_mul computes it.
__device__ __forceinline__ float GatedAct(int activation, float g, float u, float alpha, float limit) {
  if (activation == kActSwigluOai) return SwigluOai(g, u, alpha, limit);
  return (activation == kActGelu ? Gelu(g) : Silu(g)) * u;
}

// e^x by the hardware's fast exp2 with denormal results flushed to zero (ex2.approx.ftz): __expf
// without its denormal fix-up, which changes nothing where the result is added to 1.
__device__ __forceinline__ float ExpFtz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
}

// GatedAct for a compile-time activation with the hardware's fast exp and divide (ExpFtz, __fdividef;
// a few ulp from the above): what GEMM1's epilogue runs per accumulator pair, where the code of
// every element is unrolled and must stay small (ffi/cutlass/gated_epilogue.cuh).
template <int kAct>
__device__ __forceinline__ float FastGatedAct(float g, float u, float alpha, float limit) {
  if constexpr (kAct == kActSwigluOai) {
    g = fminf(g, limit);
    u = fminf(fmaxf(u, -limit), limit);
    return __fdividef((u + 1.0f) * g, 1.0f + ExpFtz(-alpha * g));
  } else if constexpr (kAct == kActGelu) {
    return Gelu(g) * u;
  } else {
    return __fdividef(g, 1.0f + ExpFtz(-g)) * u;
  }
}

// amax -> dequantization scale, as amax_to_scale: amax * (float32(1) / float32(448)), at least FLT_MIN.
__device__ __forceinline__ float AmaxToScale(float amax) {
  const float rcp = 1.0f / kFp8Max;  // folded at compile time to the float32 nearest 1/448, as RCP_448
  return fmaxf(amax * rcp, kFp8MinScale);
}

// Number of valid rows: *valid_rows clamped to [0, rows].
__device__ __forceinline__ int64_t ValidRows(const int32_t* valid_rows, int64_t rows) {
  const int64_t v = *valid_rows;
  return v < 0 ? 0 : (v > rows ? rows : v);
}

// The expert of expert-sorted row r: the largest e in [0, num_experts) with offsets[e] <= r (offsets
// [E+1] nondecreasing, sort_by_expert's), so offsets[e] <= r < offsets[e+1] for every r < offsets[E];
// 0 where no offset is <= r. Binary search, log2(E) reads of offsets.
__device__ __forceinline__ int ExpertOfRow(const int32_t* offsets, int num_experts, int64_t r) {
  int lo = 0, hi = num_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The optional expert-bias operands of a row kernel: bias [E, cols] float32 and offsets [E+1] int32,
// both empty ([0]) for none. *experts gets E (0: no bias).
inline ffi::Error CheckBias(const std::string& name, ffi::Buffer<ffi::F32>& bias, ffi::Buffer<ffi::S32>& offsets,
                            int64_t cols, int64_t* experts) {
  *experts = 0;
  const int64_t nb = static_cast<int64_t>(bias.element_count()), no = static_cast<int64_t>(offsets.element_count());
  if (nb == 0 && no == 0) return ffi::Error::Success();
  const auto bd = bias.dimensions();
  if (bd.size() != 2 || bd[0] < 1 || bd[1] != cols)
    return InvalidArgument(name + ": bias must be [E, " + std::to_string(cols) + "] float32 (or [0]: none)");
  if (no != bd[0] + 1) return InvalidArgument(name + ": offsets must have E + 1 elements (E: bias rows)");
  if (bd[0] > (int64_t{1} << 30)) return InvalidArgument(name + ": more than 2^30 experts");
  *experts = bd[0];
  return ffi::Error::Success();
}

// Threads per row block: enough for one vector each (a multiple of 32), at most 256.
inline int RowThreads(int64_t vectors) {
  const int64_t t = ((vectors + 31) / 32) * 32;
  return static_cast<int>(t < 32 ? 32 : (t > 256 ? 256 : t));
}

inline bool Aligned(const void* p, int64_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// The vector width: 16 bytes of In, used when the row length and every row pointer allow it (else 1).
template <typename In>
constexpr int kVec = 16 / sizeof(In);

inline bool CanVectorize(int64_t cols, int vec, std::initializer_list<std::pair<const void*, int64_t>> ptrs) {
  if (cols % vec != 0) return false;
  for (auto& [p, elem_bytes] : ptrs)
    if (!Aligned(p, vec * elem_bytes)) return false;
  return true;
}

template <typename T>
struct Tag {
  using type = T;
};

// Calls f(Tag<T>{}) for the float element type T of dt (bf16, f16, f32).
template <typename F>
ffi::Error WithFloatType(ffi::DataType dt, const char* what, F&& f) {
  switch (dt) {
    case ffi::DataType::BF16:
      return f(Tag<__nv_bfloat16>{});
    case ffi::DataType::F16:
      return f(Tag<__half>{});
    case ffi::DataType::F32:
      return f(Tag<float>{});
    default:
      return InvalidArgument(std::string(what) + " must be bfloat16, float16 or float32");
  }
}

}  // namespace jax_moe
