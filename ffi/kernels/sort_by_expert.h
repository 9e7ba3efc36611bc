// sort_by_expert: stable sort of the T*k routing slots by expert id (see jax_moe/permute.py).
//
// Inputs:  topk_ids [T, k] int32.
// Outputs: sorted_slots [T*k] int32, inverse [T*k] int32, counts [E] int32, offsets [E+1] int32,
//          valid [1] int32 (= offsets[E], the rows of experts in [0, E), in a buffer of its own: the
//          kernels' valid_rows operand without a slice of offsets, which XLA would run as a copy),
//          and (CUDA only) workspace [ceil(T*k / kSortChunk) * (E+1) + 1] int32 (the chunks' histograms,
//          then one counter; scratch, its contents on entry do not matter).
// Attribute: num_experts (int64). Ids outside [0, E) sort last and are not counted.
#pragma once

#include "xla/ffi/api/api.h"

namespace jax_moe {
// Slots handled by one CUDA block; the Python shape rule sizes the workspace with it.
constexpr int kSortChunk = 256;
}  // namespace jax_moe

extern "C" XLA_FFI_Error* JaxMoeSortByExpertCpu(XLA_FFI_CallFrame* call_frame);
extern "C" XLA_FFI_Error* JaxMoeSortByExpertCuda(XLA_FFI_CallFrame* call_frame);
