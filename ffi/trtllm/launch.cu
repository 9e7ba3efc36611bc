// The launch of launch.h.
#include "launch.h"

#include <exception>
#include <stdexcept>
#include <string>

#include "../common/errors.h"
#include "workspace_plan.h"

namespace jax_moe_trtllm {
namespace {

using jax_moe::InvalidArgument;

// Routing from precomputed ids: no logits; the kernels build the permutation and CTA tables.
void RunRouting(Problem const& p, Plan const& plan, uint8_t* base, tmoe::MoE::MoERunnerArgs const& args,
                tmoe::MoE::MoEWorkspace const& ws, int32_t* topk_ids, cudaStream_t stream,
                bool enable_pdl) {
  auto i32 = [base](int64_t off) { return reinterpret_cast<int32_t*>(base + off); };
  tmoe::Routing::Runner routing(static_cast<int32_t>(p.tile_n));
  routing.run(/*routingLogits=*/nullptr, /*routingBias=*/nullptr, args.num_tokens,
              args.num_experts, args.top_k, /*numFusedSharedExpert=*/0, /*nGroups=*/0,
              /*topkGroups=*/0, args.local_expert_offset, args.local_num_experts,
              args.routed_scaling_factor, ws.routing_expert_indexes, i32(plan.histogram),
              ws.permuted_idx_size, ws.expanded_idx_to_permuted_idx,
              /*permutedIdxToExpandedIdx=*/nullptr, ws.permuted_idx_to_token_idx,
              /*expertIds=*/topk_ids, ws.expert_weights, i32(plan.tokens_per_expert),
              ws.cta_idx_xy_to_batch_idx, ws.cta_idx_xy_to_mn_limit, ws.num_non_exiting_ctas,
              args.mDtypeElt, btg::Dtype::Bfloat16, /*useRoutingScalesOnInput=*/false,
              args.mUseDeepSeekFp8, tmoe::Routing::RoutingMethodType::TopK, stream,
              btg::Dtype::Fp32, /*normTopkProb=*/false, /*routing_replay_out=*/nullptr, enable_pdl);
}

}  // namespace

ffi::Error Launch(char const* who, Problem const& p, tmoe::MoE::MoERunnerArgs args, MoeData const& data,
                  int64_t config, int device, cudaStream_t stream, bool enable_pdl,
                  ffi::Buffer<ffi::S32>& topk_ids, ffi::Buffer<ffi::F32>& topk_weights,
                  ffi::Result<ffi::Buffer<ffi::U8>>& workspace) {
  args.hidden_states = data.x;
  args.hidden_states_scale = data.x_scale;
  args.gemm1_weights = data.w13;
  args.gemm1_weights_scale = data.w13_scale;
  args.gemm2_weights = data.w2;
  args.gemm2_weights_scale = data.w2_scale;
  args.output = data.out;
  try {
    Plan const plan = MakePlan(p, config, device);
    if (static_cast<int64_t>(workspace->size_bytes()) < plan.total)
      return InvalidArgument(std::string(who) + ": workspace is " +
                             std::to_string(workspace->size_bytes()) + " bytes, the plan needs " +
                             std::to_string(plan.total));
    auto* base = static_cast<uint8_t*>(workspace->untyped_data());
    auto const ws = BindWorkspace(plan, p, base, topk_ids.typed_data(), topk_weights.typed_data());
    RunRouting(p, plan, base, args, ws, topk_ids.typed_data(), stream, enable_pdl);
    GetRunner(p.scheme, p.tile_n, p.activation, device)
        .run(args, ws, device, stream, plan.config, enable_pdl);
  } catch (std::invalid_argument const& ex) {
    return InvalidArgument(std::string(who) + ": " + ex.what());
  } catch (std::exception const& ex) {
    return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_moe: ") + who + ": " + ex.what());
  }
  JAX_MOE_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return ffi::Error::Success();
}

}  // namespace jax_moe_trtllm
