// route: a router's whole selection in one kernel, per row of logits [..., E] float32: the choice
// scores, DeepSeek-V3's group mask, the top-k and the weights, as jax_moe/routing.py defines them
// (select_experts: its pure-JAX path is the reference).
//
// Inputs:  logits [..., E] float32, 1 <= E <= kTopKMaxN;
//          bias [..., E] float32, whose leading axes are a prefix of logits' (if biased; else any
//          shape, unread: [0]).
// Outputs: weights [..., k] float32, ids [..., k] int32.
// Attributes: k (int64, 1 <= k <= min(E, kRouteMaxK)); sigmoid (bool: sigmoid scores, else softmax);
//             renormalize (bool); groups (int64: 0 for no groups, else 1 <= groups <= kRouteMaxGroups
//             dividing E); topk_group (int64, 1 <= topk_group <= groups); biased (bool: choose on
//             scores + bias); scale (float32: the routed scaling factor).
#pragma once

#include "top_k.h"
#include "xla/ffi/api/api.h"

namespace jax_moe {
// Experts per token the kernel picks: one per lane of the row's warp.
constexpr int kRouteMaxK = 32;
// Expert groups the kernel takes: one group score per lane.
constexpr int kRouteMaxGroups = 32;
}  // namespace jax_moe

extern "C" XLA_FFI_Error* JaxMoeRouteCuda(XLA_FFI_CallFrame* call_frame);
