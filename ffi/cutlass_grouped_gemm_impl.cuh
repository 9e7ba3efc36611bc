// The CUTLASS side of jax_moe_cutlass_grouped_gemm (contract in cutlass_grouped_gemm.h): one SM90
// pointer-array grouped GEMM type per tile configuration, the device kernel that fills its per-group
// argument arrays from the expert offsets, and the host launch. Included by one small TU per tile
// (cutlass_grouped_gemm_tile*.cu) so that the tiles compile in parallel; the FFI handler
// (cutlass_grouped_gemm.cu) sees only GroupedGemmCall and the two functions declared at the end.
//
// Layouts, in CUTLASS's terms: A row-major [M_e, K]; B "column-major" (K, N), i.e. our [N, K] rows with
// K contiguous; D row-major [M_e, N]; no C operand (ElementC = void: D = acc, beta never read).
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "common.h"
#include "cutlass_grouped_gemm.h"

#ifdef JAX_MOE_CUTLASS_IMPL
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/kernel_hardware_info.h"
#endif

namespace jax_moe {

// One call's operands, decoded and checked by the handler.
struct GroupedGemmCall {
  cudaStream_t stream;
  const void* a;          // [m, k] bf16
  const void* b;          // [groups, n, k] bf16
  const int32_t* offsets; // [groups + 1] int32, device
  void* d;                // [m, n] bf16
  void* workspace;
  size_t workspace_bytes;
  int64_t groups, m, n, k;
  int device, sm_count;
};

namespace cutlass_gg {

constexpr size_t kArrayAlign = 256;  // every array of the workspace starts on this boundary

inline size_t RoundUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Bytes of the per-group arrays (shapes, 3 pointer arrays, 3 stride arrays), each rounded up.
inline size_t GroupArrayBytes(int64_t groups, size_t shape_bytes, size_t stride_bytes) {
  const size_t g = static_cast<size_t>(groups);
  return RoundUp(g * shape_bytes, kArrayAlign) + 3 * RoundUp(g * sizeof(void*), kArrayAlign) +
         3 * RoundUp(g * stride_bytes, kArrayAlign);
}

// Defined, one tile per TU, by JAX_MOE_INSTANTIATE_CUTLASS_TILE below.
template <int Tile>
size_t WorkspaceBytes(int64_t groups, int sm_count);
template <int Tile>
ffi::Error Run(const GroupedGemmCall& call);
template <>
size_t WorkspaceBytes<kTileCoop128x128>(int64_t groups, int sm_count);
template <>
size_t WorkspaceBytes<kTilePingpong64x128>(int64_t groups, int sm_count);
template <>
ffi::Error Run<kTileCoop128x128>(const GroupedGemmCall& call);
template <>
ffi::Error Run<kTilePingpong64x128>(const GroupedGemmCall& call);

#ifdef JAX_MOE_CUTLASS_IMPL
using namespace cute;

template <class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct GroupedGemmBf16 {
  using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  using Element = cutlass::bfloat16_t;
  using Acc = float;
  static constexpr int kAlign = 128 / cutlass::sizeof_bits<Element>::value;
  static_assert(kAlign == kCutlassAlign, "cutlass_grouped_gemm.h's alignment must match the TMA's");

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc,
      void, cutlass::layout::RowMajor*, kAlign,         // no C operand
      Element, cutlass::layout::RowMajor*, kAlign,      // D [M_e, N]
      EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<Element, Acc, void, Acc>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      Element, cutlass::layout::RowMajor*, kAlign,      // A [M_e, K]
      Element, cutlass::layout::ColumnMajor*, kAlign,   // B (K, N) = weights [N, K]
      Acc, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Shape3 = typename ProblemShape::UnderlyingProblemShape;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
  // Every operand is "rows of contiguous elements": one int64 leading dimension, static unit stride.
  static_assert(std::is_same_v<StrideA, Stride<int64_t, Int<1>, Int<0>>>);
  static_assert(std::is_same_v<StrideB, Stride<int64_t, Int<1>, Int<0>>>);
  static_assert(std::is_same_v<StrideD, Stride<int64_t, Int<1>, Int<0>>>);
  static_assert(sizeof(StrideA) == sizeof(int64_t));

  // The per-group arrays, carved out of the front of the XLA workspace.
  struct Arrays {
    Shape3* shapes;
    const Element** pa;
    const Element** pb;
    Element** pd;
    StrideA* sa;
    StrideB* sb;
    StrideD* sd;
    void* cutlass_workspace;
  };

  static Arrays Carve(void* base, int64_t groups) {
    char* p = static_cast<char*>(base);
    const size_t g = static_cast<size_t>(groups);
    auto take = [&](size_t bytes) {
      char* out = p;
      p += RoundUp(bytes, kArrayAlign);
      return out;
    };
    Arrays r;
    r.shapes = reinterpret_cast<Shape3*>(take(g * sizeof(Shape3)));
    r.pa = reinterpret_cast<const Element**>(take(g * sizeof(void*)));
    r.pb = reinterpret_cast<const Element**>(take(g * sizeof(void*)));
    r.pd = reinterpret_cast<Element**>(take(g * sizeof(void*)));
    r.sa = reinterpret_cast<StrideA*>(take(g * sizeof(StrideA)));
    r.sb = reinterpret_cast<StrideB*>(take(g * sizeof(StrideB)));
    r.sd = reinterpret_cast<StrideD*>(take(g * sizeof(StrideD)));
    r.cutlass_workspace = p;
    return r;
  }

  static typename Gemm::Arguments MakeArguments(const Arrays& arr, int64_t groups, int device, int sm_count) {
    cutlass::KernelHardwareInfo hw;
    hw.device_id = device;
    hw.sm_count = sm_count;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    // host problem shapes: none (they live on device only), so nothing here waits for the GPU
    args.problem_shape = ProblemShape{static_cast<int>(groups), arr.shapes, nullptr};
    args.mainloop.ptr_A = arr.pa;
    args.mainloop.dA = arr.sa;
    args.mainloop.ptr_B = arr.pb;
    args.mainloop.dB = arr.sb;
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    args.epilogue.ptr_C = nullptr;
    args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = arr.pd;
    args.epilogue.dD = arr.sd;
    args.hw_info = hw;
    return args;
  }

  static size_t WorkspaceBytes(int64_t groups, int sm_count) {
    const size_t front = GroupArrayBytes(groups, sizeof(Shape3), sizeof(StrideA));
    Arrays none{};
    return front + Gemm::get_workspace_size(MakeArguments(none, groups, 0, sm_count));
  }
};

// Thread g fills group g's entries: rows [lo, hi) of a and d, expert g's weights.
template <class G>
__global__ void FillGroupArrays(typename G::Arrays arr, const int32_t* offsets, int64_t groups, int64_t m, int n,
                                int k, const typename G::Element* a, const typename G::Element* b,
                                typename G::Element* d) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (g >= groups) return;
  int64_t lo = offsets[g], hi = offsets[g + 1];
  lo = lo < 0 ? 0 : (lo > m ? m : lo);
  hi = hi < lo ? lo : (hi > m ? m : hi);
  arr.shapes[g] = make_shape(static_cast<int>(hi - lo), n, k);
  arr.pa[g] = a + lo * k;
  arr.pb[g] = b + g * static_cast<int64_t>(n) * k;
  arr.pd[g] = d + lo * n;
  typename G::StrideA sa{};
  typename G::StrideB sb{};
  typename G::StrideD sd{};
  get<0>(sa) = k;
  get<0>(sb) = k;
  get<0>(sd) = n;
  arr.sa[g] = sa;
  arr.sb[g] = sb;
  arr.sd[g] = sd;
}

inline ffi::Error CutlassError(const char* what, cutlass::Status s) {
  return ffi::Error(ffi::ErrorCode::kInternal,
                    std::string("jax_moe: cutlass grouped gemm: ") + what + ": " + cutlassGetStatusString(s));
}

template <class G>
ffi::Error RunGemm(const GroupedGemmCall& c) {
  const size_t need = G::WorkspaceBytes(c.groups, c.sm_count);
  if (c.workspace_bytes < need)
    return InvalidArgument("cutlass_grouped_gemm: workspace has " + std::to_string(c.workspace_bytes) +
                           " bytes, this device needs " + std::to_string(need) +
                           " (sized for another GPU? see jax_moe.backends.cutlass.workspace_size)");
  const auto arr = G::Carve(c.workspace, c.groups);
  using E = typename G::Element;
  constexpr int kThreads = 128;
  FillGroupArrays<G><<<static_cast<unsigned>((c.groups + kThreads - 1) / kThreads), kThreads, 0, c.stream>>>(
      arr, c.offsets, c.groups, c.m, static_cast<int>(c.n), static_cast<int>(c.k), static_cast<const E*>(c.a),
      static_cast<const E*>(c.b), static_cast<E*>(c.d));
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());

  typename G::Gemm gemm;
  const auto args = G::MakeArguments(arr, c.groups, c.device, c.sm_count);
  if (auto s = gemm.can_implement(args); s != cutlass::Status::kSuccess) return CutlassError("can_implement", s);
  if (auto s = gemm.initialize(args, arr.cutlass_workspace, c.stream); s != cutlass::Status::kSuccess)
    return CutlassError("initialize", s);
  if (auto s = gemm.run(c.stream); s != cutlass::Status::kSuccess) return CutlassError("run", s);
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

// The tile configurations of cutlass_grouped_gemm.h.
template <int Tile>
struct TileConfig;
template <>
struct TileConfig<kTileCoop128x128> {
  using type = GroupedGemmBf16<Shape<_128, _128, _64>, Shape<_1, _1, _1>,
                               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                               cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>;
};
template <>
struct TileConfig<kTilePingpong64x128> {
  using type = GroupedGemmBf16<Shape<_64, _128, _64>, Shape<_1, _1, _1>,
                               cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                               cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;
};

#define JAX_MOE_INSTANTIATE_CUTLASS_TILE(TILE)                                          \
  template <>                                                                           \
  size_t WorkspaceBytes<TILE>(int64_t groups, int sm_count) {                           \
    return TileConfig<TILE>::type::WorkspaceBytes(groups, sm_count);                    \
  }                                                                                     \
  template <>                                                                           \
  ffi::Error Run<TILE>(const GroupedGemmCall& call) {                                   \
    return RunGemm<TileConfig<TILE>::type>(call);                                       \
  }
#endif  // JAX_MOE_CUTLASS_IMPL

}  // namespace cutlass_gg
}  // namespace jax_moe
