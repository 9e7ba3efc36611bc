// XLA FFI handlers of jax_moe_cutlass_grouped_gemm, _fp8, _act and _scatter (contract in
// grouped_gemm.h): decode and check the buffers on the host from their static shapes (CUTLASS's
// can_implement cannot see the per-group sizes, which live on the device) and hand the call to the
// (kind, tile)'s instantiation, two launches: the setup kernel (the group arrays, and the zeroing of
// the rows no expert owns (standard format), of the rows past each expert's count (batched format), or
// of a scatter call's whole d; grouped_gemm_impl.cuh), then CUTLASS's kernel. No allocation, no host
// sync, no device-to-host copy: safe inside a CUDA graph. Also the launch helper the backward's
// handlers share (grouped_gemm_grad.cu): RunKind.
#include <cstdint>
#include <optional>
#include <string>

#include <cuda_runtime.h>

#include "../common/binding.h"
#include "../common/col_scale.h"
#include "../common/errors.h"
#include "../common/sm_count.h"
#include "../kernels/moe_prepare_finalize.h"
#include "grouped_gemm.h"
#include "grouped_gemm_impl.cuh"

namespace jax_moe {
namespace {

using RunFn = ffi::Error (*)(const GroupedGemmCall&);
using BytesFn = size_t (*)(int64_t, int);
#define JAX_MOE_CUTLASS_TILES(FN, KIND) \
  {cutlass_gg::FN<KIND, kTileCoop128x128>, cutlass_gg::FN<KIND, kTilePingpong64x128>,     \
   cutlass_gg::FN<KIND, kTileCoop128x256>, cutlass_gg::FN<KIND, kTilePingpong64x256>,     \
   cutlass_gg::FN<KIND, kTilePingpong64x128K2>, cutlass_gg::FN<KIND, kTileCoop128x256C1>, \
   cutlass_gg::FN<KIND, kTileCoop192x256>, cutlass_gg::FN<KIND, kTilePingpong192x128>}
constexpr RunFn kRun[kNumCutlassGemmKinds][kNumCutlassTiles] = {
    JAX_MOE_CUTLASS_TILES(Run, kGemmBf16),      JAX_MOE_CUTLASS_TILES(Run, kGemmFp8),
    JAX_MOE_CUTLASS_TILES(Run, kGemmBf16Dgrad), JAX_MOE_CUTLASS_TILES(Run, kGemmBf16Wgrad),
    JAX_MOE_CUTLASS_TILES(Run, kGemmBf16Act),   JAX_MOE_CUTLASS_TILES(Run, kGemmFp8Act),
    JAX_MOE_CUTLASS_TILES(Run, kGemmBf16ActKN), JAX_MOE_CUTLASS_TILES(Run, kGemmBf16KNScatter),
    JAX_MOE_CUTLASS_TILES(Run, kGemmFp8Scatter),    JAX_MOE_CUTLASS_TILES(Run, kGemmBf16Scatter)};
constexpr BytesFn kBytes[kNumCutlassGemmKinds][kNumCutlassTiles] = {
    JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmBf16),      JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmFp8),
    JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmBf16Dgrad), JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmBf16Wgrad),
    JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmBf16Act),   JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmFp8Act),
    JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmBf16ActKN), JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmBf16KNScatter),
    JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmFp8Scatter), JAX_MOE_CUTLASS_TILES(WorkspaceBytes, kGemmBf16Scatter)};
#undef JAX_MOE_CUTLASS_TILES
static_assert(kNumCutlassGemmKinds == 10 && kNumCutlassTiles == 8, "one row per kind, one column per tile above");

std::string Name(int kind) {
  return IsActKind(kind)       ? "cutlass_grouped_gemm_act: "
         : IsScatterKind(kind) ? "cutlass_grouped_gemm_scatter: "
         : kind == kGemmFp8    ? "cutlass_grouped_gemm_fp8: "
                               : "cutlass_grouped_gemm: ";
}

// Checks what both targets share (a, b, offsets or counts, d, workspace, tile) and fills call's shapes and
// pointers; a's rank says the format (2: standard, 3: batched).
std::optional<ffi::Error> CheckOperands(int kind, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> offsets,
                                        ffi::Result<ffi::AnyBuffer>& d, ffi::Result<ffi::AnyBuffer>& workspace,
                                        int64_t tile, GroupedGemmCall& call) {
  const std::string n_ = Name(kind);
  if (tile < 0 || tile >= kNumCutlassTiles)
    return InvalidArgument(n_ + "tile must be in [0, " + std::to_string(kNumCutlassTiles) + "), got " +
                           std::to_string(tile));
  const auto ab = IsFp8Kind(kind) ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16;
  if (a.element_type() != ab || b.element_type() != ab)
    return InvalidArgument(n_ + (IsFp8Kind(kind) ? "a and b must be float8_e4m3fn" : "a and b must be bfloat16"));
  const bool d_fp8 = kind == kGemmFp8Act;
  if (d->element_type() != (d_fp8 ? ffi::DataType::F8E4M3FN : ffi::DataType::BF16))
    return InvalidArgument(n_ + (d_fp8 ? "d must be float8_e4m3fn" : "d must be bfloat16"));
  if (workspace->element_type() != ffi::DataType::U8) return InvalidArgument(n_ + "workspace must be uint8");
  const auto ad = a.dimensions(), bd = b.dimensions(), dd = d->dimensions();
  if (ad.size() != 2 && ad.size() != 3)
    return InvalidArgument(n_ + "a must have rank 2 [M, K] (standard) or 3 [E, C, K] (batched)");
  const bool kn = IsNContiguousB(kind);  // b [E, K, N]
  const char* b_shape = kn ? "[E, K, N]" : "[E, N, K]";
  if (bd.size() != 3) return InvalidArgument(n_ + "b must have rank 3 " + b_shape);
  const bool batched = ad.size() == 3;
  const int64_t groups = bd[0], n = bd[kn ? 2 : 1], k = ad[ad.size() - 1];
  const int64_t d_cols = IsActKind(kind) ? n / 2 : n;  // the act kinds write act(gate) * up: N / 2 columns
  const int64_t capacity = batched ? ad[1] : 0;
  const int64_t m = batched ? ad[0] * capacity : ad[0];
  if (bd[kn ? 1 : 2] != k) return InvalidArgument(n_ + "b must be " + b_shape + " with a's K");
  if (groups < 1) return InvalidArgument(n_ + "b must have at least one expert");
  if (batched && IsScatterKind(kind)) return InvalidArgument(n_ + "a must have rank 2 [M, K] (standard format only)");
  if (batched) {
    if (ad[0] != groups) return InvalidArgument(n_ + "batched a must be [E, C, K] with b's E");
    if (offsets.dimensions().size() != 1 || offsets.dimensions()[0] != groups)
      return InvalidArgument(n_ + "counts must be [E] int32 (batched a)");
    if (dd.size() != 3 || dd[0] != groups || dd[1] != capacity || dd[2] != d_cols)
      return InvalidArgument(n_ + (IsActKind(kind) ? "d must be [E, C, N/2] (batched a)" : "d must be [E, C, N] (batched a)"));
  } else {
    if (offsets.dimensions().size() != 1 || offsets.dimensions()[0] != groups + 1)
      return InvalidArgument(n_ + "offsets must be [E + 1] int32");
    if (IsScatterKind(kind)) {  // d [T, N]: any T (the tokens)
      if (dd.size() != 2 || dd[1] != d_cols) return InvalidArgument(n_ + "d must be [T, N]");
    } else if (dd.size() != 2 || dd[0] != m || dd[1] != d_cols) {
      return InvalidArgument(n_ + (IsActKind(kind) ? "d must be [M, N/2]" : "d must be [M, N]"));
    }
  }
  const int64_t align_k = CutlassAlignK(kind);
  if (k < align_k || k % align_k || n < kCutlassAlignN || n % kCutlassAlignN)
    return InvalidArgument(n_ + "K must be a positive multiple of " + std::to_string(align_k) + " and N of " +
                           std::to_string(kCutlassAlignN) + " (16-byte rows for TMA), got K=" + std::to_string(k) +
                           ", N=" + std::to_string(n));
  const int64_t align_n = kind == kGemmFp8Act ? 32 : IsActKind(kind) ? 16 : kCutlassAlignN;  // 16-byte rows of d
  if (n % align_n)
    return InvalidArgument(n_ + "N must be a multiple of " + std::to_string(align_n) + " (16-byte rows of d), got N=" +
                           std::to_string(n));
  if (m > INT32_MAX || n > INT32_MAX || k > INT32_MAX || groups > INT32_MAX)
    return InvalidArgument(n_ + "dimensions must fit in int32");
  call.a = a.untyped_data();
  call.b = b.untyped_data();
  call.batched = batched;
  call.capacity = capacity;
  SetCommon(call, offsets.typed_data(), d->untyped_data(), workspace->untyped_data(), workspace->size_bytes(), groups,
            m, n, k);
  call.d_cols = d_cols;
  return std::nullopt;
}

// Checks the FP8 kinds' dequantization scales against a checked call (CheckOperands) and sets them:
// row_scale [M] float32 ([E, C] batched), one per row of a; col_scale [E, N] float32, one per output
// channel of each expert. With compact (the act and scatter kinds), also the one-scale forms of
// grouped_gemm.h: row_scale [1], col_scale [E, 1] or [1, 1].
std::optional<ffi::Error> CheckScales(int kind, ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::F32> col_scale,
                                      GroupedGemmCall& call, bool compact = false) {
  const auto rd = row_scale.dimensions(), cd = col_scale.dimensions();
  const bool per_row = call.batched ? rd.size() == 2 && rd[0] == call.groups && rd[1] == call.capacity
                                    : rd.size() == 1 && rd[0] == call.m;
  const bool one_row = compact && rd.size() == 1 && rd[0] == 1;
  if (!per_row && !one_row)
    return InvalidArgument(Name(kind) + "row_scale must be " + (call.batched ? "[E, C]" : "[M]") +
                           " float32 (one scale per row of a)" + (compact ? " or [1] (one for every row)" : ""));
  const ColScaleForm form = ColScaleFormOf(cd, call.groups, call.n);
  if (form == ColScaleForm::kNone || (!compact && form != ColScaleForm::kPerChannel))
    return InvalidArgument(Name(kind) + "col_scale must be [E, N] float32 (one scale per output channel)" +
                           (compact ? ", [E, 1] (one per expert) or [1, 1] (one for every expert)" : ""));
  call.row_scale = row_scale.typed_data();
  call.col_scale = col_scale.typed_data();
  call.row_scale_step = per_row ? 1 : 0;
  call.per_channel_cols = form == ColScaleForm::kPerChannel;
  call.col_scale_group_step = ColScaleExpertStep(form, call.n);
  return std::nullopt;
}

// Runs the (kind, tile) instantiation on a checked call, its setup launch zeroing the unowned rows.
ffi::Error Launch(int kind, GroupedGemmCall& call, int64_t tile) {
  if (call.m == 0) return ffi::Error::Success();
  call.zero_unowned = true;
  return RunKind(kind, tile, call);
}

// The kind a fused handler (act, scatter) runs for a's dtype and its `transposed` attribute: fp8_kind
// for FP8 a, bf16_kn_kind for bf16 a with b [E, K, N] (transposed = 1), bf16_kind for bf16 a with
// b [E, N, K]. An error where `transposed` is not 0 or 1, or is 1 with FP8 a.
std::optional<ffi::Error> PickFusedKind(ffi::AnyBuffer a, int64_t transposed, int fp8_kind, int bf16_kind,
                                        int bf16_kn_kind, int& kind) {
  const bool fp8 = a.element_type() == ffi::DataType::F8E4M3FN;
  kind = fp8 ? fp8_kind : transposed ? bf16_kn_kind : bf16_kind;
  if (transposed != 0 && transposed != 1) return InvalidArgument(Name(kind) + "transposed must be 0 or 1");
  if (fp8 && transposed)
    return InvalidArgument(Name(kind) + "transposed b [E, K, N] is bf16 only (FP8 MMAs read K-major b)");
  return std::nullopt;
}

// Checks an optional bias against a checked call and sets it: [0] (none) or [E, N] float32, `what`
// naming it in the error.
std::optional<ffi::Error> CheckBias(int kind, ffi::Buffer<ffi::F32> bias, const char* what, GroupedGemmCall& call) {
  if (bias.element_count() == 0) return std::nullopt;
  const auto bd = bias.dimensions();
  if (bd.size() != 2 || bd[0] != call.groups || bd[1] != call.n)
    return InvalidArgument(Name(kind) + "bias must be [E, N] float32 (" + what + ") or [0]");
  call.bias = bias.typed_data();
  return std::nullopt;
}

ffi::Error GroupedGemmCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> offsets,
                           ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, int64_t tile) {
  GroupedGemmCall call{};
  call.stream = stream;
  if (auto err = CheckOperands(kGemmBf16, a, b, offsets, d, workspace, tile, call)) return std::move(*err);
  return Launch(kGemmBf16, call, tile);
}

ffi::Error GroupedGemmFp8Cuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> offsets,
                              ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::F32> col_scale,
                              ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, int64_t tile) {
  GroupedGemmCall call{};
  call.stream = stream;
  if (auto err = CheckOperands(kGemmFp8, a, b, offsets, d, workspace, tile, call)) return std::move(*err);
  if (auto err = CheckScales(kGemmFp8, row_scale, col_scale, call)) return std::move(*err);
  return Launch(kGemmFp8, call, tile);
}

// The act kinds (kGemmBf16Act for bf16 a and b, kGemmBf16ActKN for bf16 with transposed b, kGemmFp8Act for
// FP8): scales only with FP8, an optional bias, FP8's static output scale.
ffi::Error GroupedGemmActCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b, ffi::Buffer<ffi::S32> offsets,
                              ffi::Buffer<ffi::F32> row_scale, ffi::Buffer<ffi::F32> col_scale,
                              ffi::Buffer<ffi::F32> bias, ffi::Buffer<ffi::F32> out_scale,
                              ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, int64_t tile,
                              int64_t activation, float alpha, float limit, int64_t transposed) {
  int kind;
  if (auto err = PickFusedKind(a, transposed, kGemmFp8Act, kGemmBf16Act, kGemmBf16ActKN, kind)) return std::move(*err);
  const std::string n_ = Name(kind);
  GroupedGemmCall call{};
  call.stream = stream;
  if (auto err = CheckOperands(kind, a, b, offsets, d, workspace, tile, call)) return std::move(*err);
  if (activation != kActSilu && activation != kActGelu && activation != kActSwigluOai)
    return InvalidArgument(n_ + "activation must be 0 (silu), 1 (gelu) or 2 (swigluoai)");
  if (IsFp8Kind(kind)) {
    if (auto err = CheckScales(kind, row_scale, col_scale, call, true)) return std::move(*err);
    if (out_scale.element_count() != 1)
      return InvalidArgument(n_ + "out_scale must have 1 element (d's static FP8 scale) with FP8 a");
    call.out_scale = out_scale.typed_data();
  } else if (row_scale.element_count() != 0 || col_scale.element_count() != 0 || out_scale.element_count() != 0) {
    return InvalidArgument(n_ + "row_scale, col_scale and out_scale must be [0] with bf16 a (no scales)");
  }
  if (auto err = CheckBias(kind, bias, "b's experts and rows", call)) return std::move(*err);
  call.activation = static_cast<int>(activation);
  call.alpha = alpha;
  call.limit = limit;
  return Launch(kind, call, tile);
}

// The scatter kinds (kGemmBf16KNScatter for bf16 a and transposed b [E, K, N], kGemmBf16Scatter for bf16
// a and b [E, N, K], kGemmFp8Scatter for FP8 a and b [E, N, K]): d [T, N] zeroed (by the setup launch,
// so the call is two launches), then each row of a, times its slot's weight, added into d[slot / k].
ffi::Error GroupedGemmScatterCuda(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                                  ffi::Buffer<ffi::S32> offsets, ffi::Buffer<ffi::S32> slots,
                                  ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::F32> row_scale,
                                  ffi::Buffer<ffi::F32> col_scale, ffi::Buffer<ffi::F32> bias,
                                  ffi::Result<ffi::AnyBuffer> d, ffi::Result<ffi::AnyBuffer> workspace, int64_t tile,
                                  int64_t transposed) {
  int kind;
  if (auto err = PickFusedKind(a, transposed, kGemmFp8Scatter, kGemmBf16Scatter, kGemmBf16KNScatter, kind))
    return std::move(*err);
  const std::string n_ = Name(kind);
  GroupedGemmCall call{};
  call.stream = stream;
  if (auto err = CheckOperands(kind, a, b, offsets, d, workspace, tile, call)) return std::move(*err);
  if (slots.dimensions().size() != 1 || slots.dimensions()[0] != call.m)
    return InvalidArgument(n_ + "slots must be [M] int32 (each row's top-k slot)");
  const auto wd = weights.dimensions();
  if (wd.size() != 2 || wd[0] != d->dimensions()[0] || wd[1] < 1)
    return InvalidArgument(n_ + "weights must be [T, k] float32 with d's T rows (each slot's routing weight)");
  if (IsFp8Kind(kind)) {
    if (auto err = CheckScales(kind, row_scale, col_scale, call, true)) return std::move(*err);
  } else if (row_scale.element_count() != 0 || col_scale.element_count() != 0) {
    return InvalidArgument(n_ + "row_scale and col_scale must be [0] with bf16 a (no scales)");
  }
  if (auto err = CheckBias(kind, bias, "each expert's GEMM2 bias", call)) return std::move(*err);
  call.slots = slots.typed_data();
  call.weights = weights.typed_data();
  call.topk = wd[1];
  call.num_tokens = d->dimensions()[0];
  if (call.num_tokens == 0) return ffi::Error::Success();
  if (call.m == 0) {  // no GEMM to run: d is only zeroed (which the setup launch does otherwise)
    JAX_MOE_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(d->untyped_data(), 0, d->size_bytes(), stream));
    return ffi::Error::Success();
  }
  return RunKind(kind, tile, call);
}

}  // namespace

ffi::Error RunKind(int kind, int64_t tile, const GroupedGemmCall& call) {
  GroupedGemmCall c = call;
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetDevice(&c.device));
  c.sm_count = SmCount(c.device);
  if (c.sm_count <= 0) return ffi::Error(ffi::ErrorCode::kInternal, "jax_moe: cannot read the SM count");
  return kRun[kind][tile](c);
}

size_t CutlassGroupedGemmWorkspaceBytes(int64_t num_groups, int tile, int sm_count, int kind) {
  if (tile < 0 || tile >= kNumCutlassTiles || kind < 0 || kind >= kNumCutlassGemmKinds) return 0;
  return kBytes[kind][tile](num_groups, sm_count);
}

int CutlassCurrentSmCount() { return CurrentSmCount(); }

}  // namespace jax_moe

JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeCutlassGroupedGemm, jax_moe::GroupedGemmCuda, "tile");
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeCutlassGroupedGemmFp8, jax_moe::GroupedGemmFp8Cuda, "tile");
// a, b, offsets, row_scale, col_scale, bias, out_scale -> d, workspace; attrs tile, activation, alpha, limit,
// transposed.
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeCutlassGroupedGemmAct, jax_moe::GroupedGemmActCuda, "tile", "activation", "alpha",
                            "limit", "transposed");
// a, b, offsets, slots, weights, row_scale, col_scale, bias -> d, workspace; attrs tile, transposed.
JAX_MOE_DEFINE_CUDA_HANDLER(JaxMoeCutlassGroupedGemmScatter, jax_moe::GroupedGemmScatterCuda, "tile", "transposed");
