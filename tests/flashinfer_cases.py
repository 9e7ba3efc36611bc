"""Cases the FlashInfer CUTLASS test files share (test_flashinfer_cutlass*.py): tolerances, random
layers and routings, and the checks against backend="xla" that several schemes run."""

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends import flashinfer_cutlass as fic
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from helpers import SCHEME_TOL, random_moe, random_routing, rel_err

REL_TOL = SCHEME_TOL["bf16"]
FP8_REL_TOL = SCHEME_TOL["fp8"]


def routing(rng, t, e, k):
    """(topk_weights summing to 1 per token, topk_ids of k distinct experts)."""
    return random_routing(rng, t, e, k, normalize=True)


def problem(rng, t, e, k, h, i, activation="silu"):
    """(x, w13, w2, topk_weights, topk_ids) of a random bf16 layer, vLLM's layout (w13 = [gate; up])."""
    return random_moe(rng, t, e, k, h, i, activation=activation, dtype=jnp.bfloat16, normalize=True).args


def jit_twice_matches_xla(x, q13, q2, tw, ids, quant, tol):
    """fused_experts on flashinfer_cutlass under jit, twice: [T, H] in x's dtype, finite, within
    ``tol`` of backend="xla" on the same QuantConfig, and bit-identical (no state leaks between
    calls). Returns the first output."""
    from jax_moe import fused_experts

    f = jax.jit(lambda *a: fused_experts(*a, quant=quant, backend="flashinfer_cutlass"))
    out1, out2 = f(x, q13, q2, tw, ids), f(x, q13, q2, tw, ids)
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, backend="xla")
    assert out1.shape == x.shape and out1.dtype == x.dtype and np.isfinite(np.asarray(out1, np.float32)).all()
    assert rel_err(out1, ref) < tol
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))
    return out1


def three_expert_ids(rng, t: int, k: int):
    """int32 [T, k] top-k ids drawn from experts 0, 1 and 2 only: every other expert gets no rows."""
    return jnp.asarray(np.stack([rng.permutation(3)[:k] for _ in range(t)]).astype(np.int32))


def prepared_matches_xla(x, q13, q2, tw, ids, quant, cfg, tol):
    """Prepared once (fic.prepare), applied under jit: within ``tol`` of backend="xla" on the same
    QuantConfig."""
    from jax_moe import fused_experts

    out = jax.jit(fic.apply_prepared)(x, fic.prepare(q13, q2, cfg, quant), tw, ids)
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, activation=cfg.activation, backend="xla")
    assert rel_err(out, ref) < tol


def optional_operands_match_xla(rng, x, w13, w2, tw, ids, swiglu: dict, tol: float, quant=None):
    """The runner's optional operands: the routed call with ``swiglu`` (swigluoai and its biases,
    as fused_experts keywords), then Llama4's router weight on the input with fresh top-1 routing.
    fused_experts on flashinfer_cutlass under jit: x's dtype, within ``tol`` of backend="xla"."""
    from jax_moe import fused_experts

    tw1, ids1 = routing(rng, x.shape[0], w13.shape[0], 1)
    for args, kw in (((x, w13, w2, tw, ids), swiglu),
                     ((x, w13, w2, tw1, ids1), dict(apply_router_weight_on_input=True))):
        out = jax.jit(lambda *a: fused_experts(*a, quant=quant, backend="flashinfer_cutlass", **kw))(*args)
        ref = fused_experts(*args, quant=quant, backend="xla", **kw)
        assert out.dtype == x.dtype
        assert rel_err(out, ref) < tol, kw


def gpt_oss_problem(rng, t, e, k, h, i, scheme):
    """GPT-OSS-like layer: interleaved gate/up rows, biases on both GEMMs, pre-activations large
    enough that swigluoai's clamps (limit 7) bite. FP8: per-expert weight scales, static
    activation scales calibrated on the float layer."""
    from jax_moe.activations import activate

    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(4 * rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.bfloat16).astype(jnp.float32)
    b2 = jnp.asarray(0.3 * rng.standard_normal((e, h)), jnp.bfloat16).astype(jnp.float32)
    tw, ids = routing(rng, t, e, k)
    cfg = MoEConfig(e, k, h, i, "swigluoai", "interleaved")
    kw = dict(activation="swigluoai", gate_up_layout="interleaved", w13_bias=b13, w2_bias=b2)
    if scheme == "bf16":
        return x, w13, w2, tw, ids, kw
    h1 = jnp.einsum("th,enh->ten", x.astype(jnp.float32), w13.astype(jnp.float32)) + b13[None]
    a13 = calibrate_activation_scale("fp8_per_tensor", x)
    a2 = calibrate_activation_scale("fp8_per_tensor", activate(h1, cfg))
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a2)
    return x, q13, q2, tw, ids, dict(kw, quant=quant)


def gemm2_inputs(x, w13, i, activation):
    """float32 ``[T, E, I]``: every token's GEMM2 input through every expert (activation of
    x W13_e^T), what a static a2_scale is calibrated on."""
    h1 = jnp.einsum("th,enh->ten", x.astype(jnp.float32), w13.astype(jnp.float32))
    if fic.GATED[activation]:
        gate, up = h1[..., :i], h1[..., i:]
        return (jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=False)) * up
    return jnp.square(jnp.maximum(h1, 0.0))


def compiled_tactic_errors(x, prep, tw, ids, ref) -> dict:
    """{"gemm<id> <tactic>": relative error vs ``ref``} for each compiled tactic of ``prep``'s
    scheme, GEMM1's with GEMM2 on the built-in choice and the other way round."""
    errors = {}
    for gemm_id in (1, 2):
        for idx, desc, ok in fic.tactics(gemm_id, prep.scheme):
            if ok:
                kw = {"gemm1_tactic": idx} if gemm_id == 1 else {"gemm2_tactic": idx}
                out = fic.apply_prepared(x, prep, tw, ids, **kw)
                errors[f"gemm{gemm_id} {desc}"] = rel_err(out, ref, finite=False)
    return errors
