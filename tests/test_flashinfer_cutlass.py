"""FlashInfer CUTLASS fused-MoE custom calls (SM90; bf16 and FP8 per-tensor) against the float64
definition (helpers.np_moe; bf16) and the pure-JAX backend on the same quantized weights (FP8)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.backends import flashinfer_cutlass as fic
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from helpers import SCHEME_TOL, jit_call as _jit, np_moe, random_moe, random_routing, rel_err, skip_unless_available
from helpers import skip_unless_fi_scheme

REL_TOL = SCHEME_TOL["bf16"]
FP8_REL_TOL = SCHEME_TOL["fp8"]


def _routing(rng, t, e, k):
    """(topk_weights summing to 1 per token, topk_ids of k distinct experts)."""
    return random_routing(rng, t, e, k, normalize=True)


def _problem(rng, t, e, k, h, i, activation="silu"):
    """(x, w13, w2, topk_weights, topk_ids) of a random bf16 layer, vLLM's layout (w13 = [gate; up])."""
    return random_moe(rng, t, e, k, h, i, activation=activation, dtype=jnp.bfloat16, normalize=True).args


def _jit_twice_matches_xla(x, q13, q2, tw, ids, quant, tol):
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


def _three_expert_ids(rng, t: int, k: int):
    """int32 [T, k] top-k ids drawn from experts 0, 1 and 2 only: every other expert gets no rows."""
    return jnp.asarray(np.stack([rng.permutation(3)[:k] for _ in range(t)]).astype(np.int32))


def _prepared_matches_xla(x, q13, q2, tw, ids, quant, cfg, tol):
    """Prepared once (fic.prepare), applied under jit: within ``tol`` of backend="xla" on the same
    QuantConfig."""
    from jax_moe import fused_experts

    out = jax.jit(fic.apply_prepared)(x, fic.prepare(q13, q2, cfg, quant), tw, ids)
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, activation=cfg.activation, backend="xla")
    assert rel_err(out, ref) < tol


def _optional_operands_match_xla(rng, x, w13, w2, tw, ids, swiglu: dict, tol: float, quant=None):
    """The runner's optional operands: the routed call with ``swiglu`` (swigluoai and its biases,
    as fused_experts keywords), then Llama4's router weight on the input with fresh top-1 routing.
    fused_experts on flashinfer_cutlass under jit: x's dtype, within ``tol`` of backend="xla"."""
    from jax_moe import fused_experts

    tw1, ids1 = _routing(rng, x.shape[0], w13.shape[0], 1)
    for args, kw in (((x, w13, w2, tw, ids), swiglu),
                     ((x, w13, w2, tw1, ids1), dict(apply_router_weight_on_input=True))):
        out = jax.jit(lambda *a: fused_experts(*a, quant=quant, backend="flashinfer_cutlass", **kw))(*args)
        ref = fused_experts(*args, quant=quant, backend="xla", **kw)
        assert out.dtype == x.dtype
        assert rel_err(out, ref) < tol, kw


def test_prepare_weights_swaps_gate_and_up():
    e, i, h = 2, 4, 8
    w13 = jnp.arange(e * 2 * i * h, dtype=jnp.float32).reshape(e, 2 * i, h)
    w2 = jnp.ones((e, h, i))
    p13, p2 = fic.prepare_weights(w13, w2)
    assert p13.dtype == jnp.bfloat16 and p2.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(p13[:, :i], np.float32), np.asarray(w13[:, i:]))
    np.testing.assert_array_equal(np.asarray(p13[:, i:], np.float32), np.asarray(w13[:, :i]))
    inter = jnp.stack([w13[:, :i], w13[:, i:]], axis=2).reshape(e, 2 * i, h)  # g0 u0 g1 u1 ...
    q13, _ = fic.prepare_weights(inter, w2, gate_up_layout="interleaved")
    np.testing.assert_array_equal(np.asarray(q13), np.asarray(p13))


@pytest.mark.gpu
@pytest.mark.parametrize("e,k", [(8, 2), (64, 6)])
@pytest.mark.parametrize("t", [1, 37, 256])
def test_matches_reference(rng, t, e, k):
    skip_unless_available(fic)
    h, i = 1024, 512
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i)
    ref = np_moe(x, w13, w2, tw, ids)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i))
    out = jax.jit(fic.apply_prepared)(x, prep, tw, ids)
    assert out.shape == (t, h) and out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert rel_err(out, ref) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_other_activations(rng, activation):
    skip_unless_available(fic)
    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i, activation)
    ref = np_moe(x, w13, w2, tw, ids, activation)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i, activation))
    out = fic.apply_prepared(x, prep, tw, ids)
    assert rel_err(out, ref) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("gemm_id", [1, 2])
def test_every_compiled_tactic(rng, gemm_id):
    """Each compiled GEMM1 (resp. GEMM2, incl. finalize-fused) tactic, the other one default."""
    skip_unless_available(fic)
    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i)
    ref = np_moe(x, w13, w2, tw, ids)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i))
    compiled = [(idx, desc) for idx, desc, ok in fic.tactics(gemm_id) if ok]
    assert compiled, "no compiled tactic"
    errors = {}
    for idx, desc in compiled:
        kw = {"gemm1_tactic": idx} if gemm_id == 1 else {"gemm2_tactic": idx}
        out = fic.apply_prepared(x, prep, tw, ids, **kw)
        errors[desc] = rel_err(out, ref, finite=False)
    bad = {d: err for d, err in errors.items() if not err < REL_TOL}
    assert not bad, bad


@pytest.mark.gpu
def test_not_compiled_tactic_is_an_error(rng):
    skip_unless_available(fic)
    missing = [idx for idx, _, ok in fic.tactics(1) if not ok]
    if not missing:
        pytest.skip("every tactic is compiled in this build")
    t, e, k, h, i = 4, 8, 2, 256, 128
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i))
    with pytest.raises(Exception, match="not compiled"):
        jax.block_until_ready(fic.apply_prepared(x, prep, tw, ids, gemm1_tactic=missing[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(1, 256, 8), (1000, 8, 2), (5, 256, 8)])
def test_fused_experts_forced_backend_equals_xla(rng, t, e, k):
    """Through the public API, against the pure-JAX backend on the same weights; T=5 with E=256
    leaves most experts without tokens; run twice under jit (no state leaks)."""
    skip_unless_available(fic)
    from jax_moe import fused_experts

    x, w13, w2, tw, ids = _problem(rng, t, e, k, 1024, 512)
    f = jax.jit(lambda *a: fused_experts(*a, backend="flashinfer_cutlass"))
    out1, out2 = f(x, w13, w2, tw, ids), f(x, w13, w2, tw, ids)
    ref = fused_experts(x, w13, w2, tw, ids, backend="xla")
    assert np.isfinite(np.asarray(out1, np.float32)).all()
    assert rel_err(out1, ref) < REL_TOL
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


# ------------------------------------------------------- GPT-OSS activation, biases, EP, Llama4


def test_prepare_biases_follow_w13_rows_and_carry_swiglu_parameters(rng):
    """Written from the layout: the runner's GEMM1 rows are [up_0..up_{I-1}; gate_0..gate_{I-1}];
    GPT-OSS stores gate_j at row 2j and up_j at row 2j+1 (weights and biases alike). The
    SwigluBias parameters are (alpha, beta = 1, limit) for every expert."""
    e, i, h = 3, 8, 16
    cfg = MoEConfig(e, 2, h, i, "swigluoai", "interleaved", swiglu_alpha=1.5, swiglu_limit=6.0)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.bfloat16)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.float32)
    b2 = jnp.asarray(rng.standard_normal((e, h)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)), jnp.bfloat16)
    prep = fic.prepare(w13, w2, cfg, w13_bias=b13, w2_bias=b2)
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    np.testing.assert_array_equal(f32(prep.w13[:, :i]), f32(w13[:, 1::2]))  # up
    np.testing.assert_array_equal(f32(prep.w13[:, i:]), f32(w13[:, 0::2]))  # gate
    assert prep.w13_bias.dtype == jnp.bfloat16 and prep.w2_bias.dtype == jnp.bfloat16
    np.testing.assert_array_equal(f32(prep.w13_bias[:, :i]), f32(b13[:, 1::2].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(f32(prep.w13_bias[:, i:]), f32(b13[:, 0::2].astype(jnp.bfloat16)))
    np.testing.assert_array_equal(f32(prep.w2_bias), f32(b2.astype(jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(prep.swiglu), np.array([[1.5] * e, [1.0] * e, [6.0] * e], np.float32))
    assert fic.prepare(w13, w2, MoEConfig(e, 2, h, i)).swiglu is None  # only for swigluoai


def _gpt_oss_problem(rng, t, e, k, h, i, scheme):
    """GPT-OSS-like layer: interleaved gate/up rows, biases on both GEMMs, pre-activations large
    enough that swigluoai's clamps (limit 7) bite. FP8: per-expert weight scales, static
    activation scales calibrated on the float layer."""
    from jax_moe.activations import activate

    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(4 * rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.bfloat16).astype(jnp.float32)
    b2 = jnp.asarray(0.3 * rng.standard_normal((e, h)), jnp.bfloat16).astype(jnp.float32)
    tw, ids = _routing(rng, t, e, k)
    cfg = MoEConfig(e, k, h, i, "swigluoai", "interleaved")
    kw = dict(activation="swigluoai", gate_up_layout="interleaved", w13_bias=b13, w2_bias=b2)
    if scheme == "bf16":
        return x, w13, w2, tw, ids, kw
    h1 = jnp.einsum("th,enh->ten", x.astype(jnp.float32), w13.astype(jnp.float32)) + b13[None]
    a13 = calibrate_activation_scale("fp8_per_tensor", x)
    a2 = calibrate_activation_scale("fp8_per_tensor", activate(h1, cfg))
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a2)
    return x, q13, q2, tw, ids, dict(kw, quant=quant)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
@pytest.mark.parametrize("t,e,k", [(1, 128, 4), (37, 8, 2), (300, 32, 4)])
def test_gpt_oss_swigluoai_with_biases_matches_xla(rng, scheme, t, e, k):
    """swigluoai (SwigluBias: alpha 1.702, beta 1, limit 7) with interleaved rows and both
    biases, through fused_experts under jit, twice, against backend="xla" on the same weights."""
    skip_unless_available(fic)
    if scheme not in fic.compiled_schemes():
        pytest.skip(f"{scheme} not compiled into this build")
    from jax_moe import fused_experts

    x, w13, w2, tw, ids, kw = _gpt_oss_problem(rng, t, e, k, 1024, 512, scheme)
    f = jax.jit(lambda *a: fused_experts(*a, backend="flashinfer_cutlass", **kw))
    out1, out2 = f(x, w13, w2, tw, ids), f(x, w13, w2, tw, ids)
    ref = fused_experts(x, w13, w2, tw, ids, backend="xla", **kw)
    assert np.isfinite(np.asarray(out1, np.float32)).all()
    assert rel_err(out1, ref) < (REL_TOL if scheme == "bf16" else FP8_REL_TOL)
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


@pytest.mark.gpu
def test_router_weight_on_input_top1(rng):
    """Llama4's top-1: expert(w * x) instead of w * expert(x) (different for a non-linear expert)."""
    skip_unless_available(fic)
    from jax_moe import fused_experts

    t, e, h, i = 37, 8, 1024, 512
    x, w13, w2, _, ids = _problem(rng, t, e, 1, h, i)
    tw = jnp.asarray(rng.random((t, 1)) * 2 + 0.2, jnp.float32)  # not renormalized to 1
    f = jax.jit(lambda *a: fused_experts(*a, apply_router_weight_on_input=True, backend="flashinfer_cutlass"))
    out = f(x, w13, w2, tw, ids)
    ref = fused_experts(x, w13, w2, tw, ids, apply_router_weight_on_input=True, backend="xla")
    other = fused_experts(x, w13, w2, tw, ids, backend="xla")
    assert rel_err(out, ref) < REL_TOL
    assert rel_err(other, ref) > 10 * REL_TOL  # the test can tell the two apart


@pytest.mark.gpu
def test_slots_of_experts_owned_elsewhere_are_skipped(rng):
    """An expert-parallel shard: this device owns experts [0, 8) of 16; slots naming the others
    come as -1 and add nothing; tokens with no local expert get exactly zero."""
    skip_unless_available(fic)
    t, e, k, h, i = 64, 16, 4, 1024, 512
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i)
    ids = ids.at[:3].set(jnp.arange(8, 8 + k, dtype=jnp.int32))  # three tokens with none local
    local = jnp.where(ids < 8, ids, -1)
    prep = fic.prepare(w13[:8], w2[:8], MoEConfig(8, k, h, i, expert_shard=True))
    out = np.asarray(jax.jit(fic.apply_prepared)(x, prep, tw, local), np.float32)
    ref = np_moe(x, w13, w2, jnp.where(ids < 8, tw, 0.0), jnp.where(ids < 8, ids, 0))
    assert np.isfinite(out).all() and (out[:3] == 0).all()
    assert rel_err(out, ref) < REL_TOL


# ----------------------------------------------------------------------------- FP8 per-tensor


def _gemm2_inputs(x, w13, i, activation):
    """float32 ``[T, E, I]``: every token's GEMM2 input through every expert (activation of
    x W13_e^T), what a static a2_scale is calibrated on."""
    h1 = jnp.einsum("th,enh->ten", x.astype(jnp.float32), w13.astype(jnp.float32))
    if fic.GATED[activation]:
        gate, up = h1[..., :i], h1[..., i:]
        return (jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=False)) * up
    return jnp.square(jnp.maximum(h1, 0.0))


def _fp8_problem(rng, t, e, k, h, i, *, static_a13=True, activation="silu"):
    """Random bf16 tokens and fp8-quantized weights (per-expert scales) with a calibrated static
    a2_scale (and a13_scale unless ``static_a13`` is False)."""
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i, activation)
    a13 = calibrate_activation_scale("fp8_per_tensor", x) if static_a13 else None
    a2 = calibrate_activation_scale("fp8_per_tensor", _gemm2_inputs(x, w13, i, activation))
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a2)
    return x, q13, q2, tw, ids, quant


def test_prepare_fp8_layout_and_alphas(rng):
    """w13 halves swapped (still fp8, bit-exact), g1 = w13_scale * a13, g2 = w2_scale * a2,
    a2_gscale = 1 / a2; per-expert activation scales collapse to their max."""
    e, i, h = 3, 16, 32
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32)
    a13 = jnp.asarray([0.01, 0.03, 0.02], jnp.float32)
    q13, q2, quant = quantize_weights("fp8", w13, w2, a13_scale=a13, a2_scale=0.5)
    prep = _jit(fic.prepare, q13, q2, cfg=MoEConfig(e, 2, h, i), quant=quant)
    assert prep.scheme == "fp8" and prep.w13.dtype == jnp.float8_e4m3fn and prep.w2.dtype == jnp.float8_e4m3fn
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(bits(prep.w13[:, :i]), bits(q13[:, i:]))
    np.testing.assert_array_equal(bits(prep.w13[:, i:]), bits(q13[:, :i]))
    np.testing.assert_array_equal(bits(prep.w2), bits(q2))
    np.testing.assert_allclose(prep.g1_alphas, np.asarray(quant.w13_scale) * 0.03, rtol=1e-6)
    np.testing.assert_allclose(prep.g2_alphas, np.asarray(quant.w2_scale) * 0.5, rtol=1e-6)
    np.testing.assert_allclose(prep.a2_gscale, 2.0, rtol=1e-6)
    dyn = _jit(fic.prepare, q13, q2, cfg=MoEConfig(e, 2, h, i), quant=quant.replace(a13_scale=None))
    assert dyn.a13_scale is None and dyn.g1_alphas is None and dyn.w13_scale.shape == (e,)


@pytest.mark.parametrize("change,reason", [
    (dict(act="fp8_per_token"), "per-tensor activation scales"),
    (dict(a2_scale=None), "static a2_scale"),
])
def test_fp8_refusals_name_the_reason(rng, change, reason):
    e, i, h = 2, 16, 32
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32)
    opts = dict(act="fp8_per_tensor", a2_scale=0.5)
    opts.update(change)
    if opts["act"] != "fp8_per_tensor":
        opts.pop("a2_scale")
    _, _, quant = quantize_weights("fp8", w13, w2, **opts)
    ok, why = fic.supports(MoEConfig(e, 2, h, i), quant)
    assert not ok and reason in why


def test_fp8_per_channel_weight_scales_are_refused(rng):
    e, i, h = 2, 16, 32
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32)
    _, _, quant = quantize_weights("fp8", w13, w2, weight_scale="per_channel", a2_scale=0.5)
    ok, why = fic.supports(MoEConfig(e, 2, h, i), quant)
    assert not ok and "per channel" in why


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(1, 256, 8), (37, 8, 2), (5, 256, 8), (1000, 64, 6)])
def test_fp8_matches_xla_on_the_same_quantized_weights(rng, t, e, k):
    """FP8 per-tensor (static scales) against backend="xla" with the same QuantConfig; T=5 with
    E=256 leaves most experts without tokens; jit, twice (no state leaks)."""
    skip_unless_available(fic)
    if "fp8" not in fic.compiled_schemes():
        pytest.skip("fp8 not compiled into this build")
    from jax_moe import fused_experts

    x, q13, q2, tw, ids, quant = _fp8_problem(rng, t, e, k, 1024, 512)
    prep = fic.prepare(q13, q2, MoEConfig(e, k, 1024, 512), quant)
    f = jax.jit(fic.apply_prepared)
    out1 = f(x, prep, tw, ids)
    out2 = f(x, prep, tw, ids)
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, backend="xla")
    assert np.isfinite(np.asarray(out1, np.float32)).all()
    assert rel_err(out1, ref) < FP8_REL_TOL
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_fp8_dynamic_input_scale_and_other_activations(rng, activation):
    skip_unless_available(fic)
    if "fp8" not in fic.compiled_schemes():
        pytest.skip("fp8 not compiled into this build")
    from jax_moe import fused_experts

    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, q13, q2, tw, ids, quant = _fp8_problem(rng, t, e, k, h, i, static_a13=False, activation=activation)
    out = jax.jit(lambda *a: fused_experts(*a, activation=activation, quant=quant,
                                           backend="flashinfer_cutlass"))(x, q13, q2, tw, ids)
    ref = fused_experts(x, q13, q2, tw, ids, activation=activation, quant=quant, backend="xla")
    assert rel_err(out, ref) < FP8_REL_TOL


def _compiled_tactic_errors(x, prep, tw, ids, ref) -> dict:
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


@pytest.mark.gpu
def test_fp8_every_compiled_tactic(rng):
    skip_unless_available(fic)
    if "fp8" not in fic.compiled_schemes():
        pytest.skip("fp8 not compiled into this build")
    from jax_moe import fused_experts

    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, q13, q2, tw, ids, quant = _fp8_problem(rng, t, e, k, h, i)
    prep = fic.prepare(q13, q2, MoEConfig(e, k, h, i), quant)
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, backend="xla")
    errors = _compiled_tactic_errors(x, prep, tw, ids, ref)
    assert errors
    bad = {d: err for d, err in errors.items() if not err < FP8_REL_TOL}
    assert not bad, bad


@pytest.mark.gpu
def test_under_command_buffers(command_buffer_check):
    """Every handler declares command-buffer compatibility: run each compiled scheme (mxfp4 as
    GPT-OSS's swigluoai with interleaved rows and a bias) with XLA's command buffers forced on,
    fresh inputs each round, against the xla backend."""
    skip_unless_available(fic)
    command_buffer_check("flashinfer_cutlass", """
        from jax_moe.backends import flashinfer_cutlass as fic
        t, e, k, h, i = 77, 16, 4, 512, 256
        w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
        q13, q2, quant = quantize_weights("fp8", w13, w2, a2_scale=0.01)
        m13, m2, mquant = quantize_weights("mxfp4", w13, w2)
        b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.float32)
        mxfp4 = dict(quant=mquant, activation="swigluoai", gate_up_layout="interleaved", w13_bias=b13)
        have = fic.compiled_schemes()
        cases = [(t, k, w13, w2, None)] + ([(t, k, q13, q2, quant)] if "fp8" in have else []) \
            + ([(t, k, m13, m2, mxfp4)] if "mxfp4" in have else [])
    """, 5e-2)


@pytest.mark.gpu
def test_autotuned_tactics_are_compiled_cached_and_correct(rng, tmp_path, monkeypatch):
    """JAX_MOE_FI_AUTOTUNE=1 tunes a shape at trace time (under jit), writes the choice to the
    cache file, and the tuned call still matches the reference."""
    skip_unless_available(fic)
    from jax_moe.backends.flashinfer_cutlass import tuning

    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "tactics.json"))
    monkeypatch.setenv(tuning.AUTOTUNE_ENV, "1")
    t, e, k, h, i = 300, 16, 4, 1024, 512
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i))
    out = jax.jit(fic.apply_prepared)(x, prep, tw, ids)
    assert rel_err(out, np_moe(x, w13, w2, tw, ids)) < REL_TOL
    pick = tuning.cached("bf16", "silu", t, h, i, e, k)
    assert pick is not None and (tmp_path / "tactics.json").exists()
    compiled1 = {idx for idx, _, ok in fic.tactics(1) if ok}
    compiled2 = {idx for idx, _, ok in fic.tactics(2) if ok}
    assert pick[0] in compiled1 and pick[1] in compiled2


# ----------------------------------------------------------------------------- MXFP4 W4A16


def _mxfp4_problem(rng, t, e, k, h, i, activation="silu", *, gpt_oss=False):
    """bf16 tokens and MXFP4-quantized weights (act bf16). ``gpt_oss``: swigluoai with
    interleaved gate/up rows, biases on both GEMMs and pre-activations large enough that its
    clamps bite (as :func:`_gpt_oss_problem`). Returns x, q13, q2, tw, ids and fused_experts'
    keyword arguments (quant included)."""
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    n1 = 2 * i if fic.GATED[activation] else i
    w13 = jnp.asarray((4 if gpt_oss else 1) * rng.standard_normal((e, n1, h)) / np.sqrt(h), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.float32)
    q13, q2, quant = quantize_weights("mxfp4", w13, w2)
    tw, ids = _routing(rng, t, e, k)
    kw = dict(activation=activation, quant=quant)
    if gpt_oss:
        kw.update(activation="swigluoai", gate_up_layout="interleaved",
                  w13_bias=jnp.asarray(rng.standard_normal((e, n1)), jnp.bfloat16).astype(jnp.float32),
                  w2_bias=jnp.asarray(0.3 * rng.standard_normal((e, h)), jnp.bfloat16).astype(jnp.float32))
    return x, q13, q2, tw, ids, kw


def _mxfp4_cfg(e, k, h, i, kw):
    return MoEConfig(e, k, h, i, kw["activation"], kw.get("gate_up_layout", "concat"))


def _decode_prepared_mxfp4(prep):
    """The runner's operands back as float32 matrices, through the inverse layouts:
    (w13 [E, 2Ip, Hp], w2 [E, Hp, Ip])."""
    from jax_moe import layouts as L
    from jax_moe.quant.fp4 import dequantize_mxfp4

    out = []
    for w, s in ((prep.w13, prep.w13_block_scale), (prep.w2, prep.w2_block_scale)):
        out.append(np.asarray(dequantize_mxfp4(L.deinterleave_fp4_weights_for_sm90_mixed_gemm(w),
                                               L.deinterleave_scales_for_sm90_mixed_gemm(s))))
    return out


def test_prepare_mxfp4_rows_padding_and_biases(rng):
    """Written from prepare_mxfp4_weights' words: decoded, w13 is [up (I); 0; gate (I); 0] along
    2Ip rows and zero past H; w2 is the checkpoint's, zero past H rows and I columns; the biases
    follow the rows and are zero in the padding; (H, I) = (160, 96) pad to (256, 256)."""
    from jax_moe.quant.scheme import dequantize_weights

    e, h, i = 3, 160, 96
    hp, ip = 256, 256
    _, q13, q2, _, _, kw = _mxfp4_problem(rng, 1, e, 2, h, i, gpt_oss=True)
    prep = _jit(fic.prepare, q13, q2, cfg=_mxfp4_cfg(e, 2, h, i, kw), quant=kw["quant"],
                w13_bias=kw["w13_bias"], w2_bias=kw["w2_bias"])
    assert prep.scheme == "mxfp4" and prep.w13.dtype == jnp.uint8
    assert prep.w13.shape == (e, 2 * ip, hp // 2) and prep.w2.shape == (e, hp, ip // 2)
    assert prep.w13_block_scale.shape == (e, 2 * ip // 64, hp // 128, 16, 16)
    assert prep.w2_block_scale.shape == (e, hp // 64, ip // 128, 16, 16)
    assert fic.problem_sizes(prep) == (e, hp, ip)
    p13, p2 = _decode_prepared_mxfp4(prep)
    d13, d2 = (np.asarray(a) for a in dequantize_weights(kw["quant"], q13, q2))
    gate, up = d13[:, 0::2], d13[:, 1::2]  # GPT-OSS rows: gate_j at 2j, up_j at 2j + 1
    want13 = np.zeros((e, 2 * ip, hp), np.float32)
    want13[:, :i, :h], want13[:, ip:ip + i, :h] = up, gate
    np.testing.assert_array_equal(p13, want13)
    want2 = np.zeros((e, hp, ip), np.float32)
    want2[:, :h, :i] = d2
    np.testing.assert_array_equal(p2, want2)
    b13, b2 = np.asarray(kw["w13_bias"]), np.asarray(kw["w2_bias"])
    want_b13 = np.zeros((e, 2 * ip), np.float32)
    want_b13[:, :i], want_b13[:, ip:ip + i] = b13[:, 1::2], b13[:, 0::2]
    np.testing.assert_array_equal(np.asarray(prep.w13_bias, np.float32), want_b13)
    want_b2 = np.zeros((e, hp), np.float32)
    want_b2[:, :h] = b2
    np.testing.assert_array_equal(np.asarray(prep.w2_bias, np.float32), want_b2)


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_prepare_mxfp4_concat_and_not_gated(rng, activation):
    """[gate; up] rows swap to [up; gate]; relu2's single block of I rows is padded at its end."""
    from jax_moe.quant.scheme import dequantize_weights

    e, h, i = 2, 128, 96
    _, q13, q2, _, _, kw = _mxfp4_problem(rng, 1, e, 2, h, i, activation)
    prep = _jit(fic.prepare, q13, q2, cfg=_mxfp4_cfg(e, 2, h, i, kw), quant=kw["quant"])
    p13, _ = _decode_prepared_mxfp4(prep)
    d13 = np.asarray(dequantize_weights(kw["quant"], q13, q2)[0])
    ip = 256  # I and H padded to the mixed-input GEMM's deepest K tile
    assert p13.shape[-1] == 256 and not p13[..., h:].any()
    p13 = p13[..., :h]
    if activation == "silu":
        np.testing.assert_array_equal(p13[:, :i], d13[:, i:])  # up
        np.testing.assert_array_equal(p13[:, ip:ip + i], d13[:, :i])  # gate
        assert not p13[:, i:ip].any() and not p13[:, ip + i:].any()
    else:
        assert p13.shape == (e, ip, h)
        np.testing.assert_array_equal(p13[:, :i], d13)
        assert not p13[:, i:].any()


def test_prepare_mxfp4_emulated_runner_matches_xla(rng):
    """The runner's arithmetic on the decoded operands (GEMM1 rows [up; gate] + bias, SwigluBias
    min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + beta), GEMM2 + bias,
    weighted sum, first H columns of x padded with zeros) equals the xla backend."""
    from jax_moe import fused_experts

    t, e, k, h, i = 9, 4, 2, 160, 96
    x, q13, q2, tw, ids, kw = _mxfp4_problem(rng, t, e, k, h, i, gpt_oss=True)
    prep = _jit(fic.prepare, q13, q2, cfg=_mxfp4_cfg(e, k, h, i, kw), quant=kw["quant"],
                w13_bias=kw["w13_bias"], w2_bias=kw["w2_bias"])
    p13, p2 = _decode_prepared_mxfp4(prep)
    _, hp, ip = fic.problem_sizes(prep)
    alpha, beta, limit = np.asarray(prep.swiglu)
    xp = np.zeros((t, hp), np.float32)
    xp[:, :h] = np.asarray(x, np.float32)
    out = np.zeros((t, hp), np.float64)
    b13, b2 = np.asarray(prep.w13_bias, np.float32), np.asarray(prep.w2_bias, np.float32)
    for tt in range(t):
        for j in range(k):
            ex = int(ids[tt, j])
            g1 = p13[ex] @ xp[tt] + b13[ex]
            u, g = g1[:ip], g1[ip:]
            g = np.minimum(g, limit[ex])
            a = g / (1 + np.exp(-alpha[ex] * g)) * (np.clip(u, -limit[ex], limit[ex]) + beta[ex])
            out[tt] += float(tw[tt, j]) * (p2[ex] @ a + b2[ex])
    ref = _jit(fused_experts, x.astype(jnp.float32), q13, q2, tw, ids, backend="xla", **kw)
    assert rel_err(out[:, :h], ref) < 1e-5


def test_mxfp4_refusals_and_shape_checks(rng):
    e, h, i = 2, 512, 128
    x, q13, q2, tw, ids, kw = _mxfp4_problem(rng, 3, e, 2, h, i)
    cfg = _mxfp4_cfg(e, 2, h, i, kw)
    ok, why = fic.supports(cfg, kw["quant"].replace(act="mxfp8"))
    assert not ok and "bf16 activations" in why
    with pytest.raises(ValueError, match="act='bf16'"):
        fic.prepare(q13, q2, cfg, kw["quant"].replace(act="mxfp8"))
    prep = fic.prepare(q13, q2, cfg, kw["quant"])
    with pytest.raises(ValueError, match="shape mismatch"):  # x's H must pad to the weights' H
        fic.apply_prepared(x[:, :256], prep, tw, ids)
    import dataclasses

    bad = dataclasses.replace(prep, w2_block_scale=prep.w2_block_scale[..., :8])
    with pytest.raises(ValueError, match="w2_block_scale"):
        fic.apply_prepared(x, bad, tw, ids)
    with pytest.raises(ValueError, match="uint8"):
        fic.prepare_mxfp4_weights(q13.astype(jnp.int8), kw["quant"].w13_scale, q2, kw["quant"].w2_scale)


@pytest.mark.gpu
@pytest.mark.parametrize("gpt_oss", [False, True], ids=["silu", "gpt_oss"])
@pytest.mark.parametrize("e,k", [(8, 2), (128, 4)])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_mxfp4_matches_xla_on_the_same_quantized_weights(rng, t, e, k, gpt_oss):
    """W4A16 against backend="xla" with the same QuantConfig (the dequantized reference): silu
    with [gate; up] rows, and GPT-OSS's swigluoai with biases and interleaved rows; through
    fused_experts under jit, twice (no state leaks)."""
    skip_unless_fi_scheme("mxfp4")
    from jax_moe import fused_experts

    x, q13, q2, tw, ids, kw = _mxfp4_problem(rng, t, e, k, 1024, 512, gpt_oss=gpt_oss)
    f = jax.jit(lambda *a: fused_experts(*a, backend="flashinfer_cutlass", **kw))
    out1, out2 = f(x, q13, q2, tw, ids), f(x, q13, q2, tw, ids)
    ref = fused_experts(x, q13, q2, tw, ids, backend="xla", **kw)
    assert out1.shape == (t, 1024) and np.isfinite(np.asarray(out1, np.float32)).all()
    assert rel_err(out1, ref) < REL_TOL
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


@pytest.mark.gpu
def test_mxfp4_gpt_oss_shape_pads_h_and_i(rng):
    """GPT-OSS's H = I = 2880 (not multiples of 256: padded to 3072, output [T, 2880]),
    prepared once and applied under jit."""
    skip_unless_fi_scheme("mxfp4")
    from jax_moe import fused_experts

    t, e, k, h, i = 37, 16, 4, 2880, 2880
    x, q13, q2, tw, ids, kw = _mxfp4_problem(rng, t, e, k, h, i, gpt_oss=True)
    prep = fic.prepare(q13, q2, _mxfp4_cfg(e, k, h, i, kw), kw["quant"], w13_bias=kw["w13_bias"],
                       w2_bias=kw["w2_bias"])
    assert fic.problem_sizes(prep) == (e, 3072, 3072)
    out = jax.jit(fic.apply_prepared)(x, prep, tw, ids)
    ref = fused_experts(x, q13, q2, tw, ids, backend="xla", **kw)
    assert out.shape == (t, h)
    assert rel_err(out, ref) < REL_TOL


@pytest.mark.gpu
def test_mxfp4_every_compiled_tactic(rng):
    """Each compiled mixed-input GEMM1 (resp. GEMM2) tactic, the other on the built-in choice."""
    skip_unless_fi_scheme("mxfp4")
    from jax_moe import fused_experts

    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, q13, q2, tw, ids, kw = _mxfp4_problem(rng, t, e, k, h, i)
    prep = fic.prepare(q13, q2, _mxfp4_cfg(e, k, h, i, kw), kw["quant"])
    ref = fused_experts(x, q13, q2, tw, ids, backend="xla", **kw)
    for gemm_id in (1, 2):  # the mixed-input GEMM: swap_ab only, never finalize-fused
        assert all("swap_ab=1" in d and "fusion=none" in d for _, d, _ in fic.tactics(gemm_id, "mxfp4"))
    errors = _compiled_tactic_errors(x, prep, tw, ids, ref)
    assert errors
    bad = {d: err for d, err in errors.items() if not err < REL_TOL}
    assert not bad, bad


# ----------------------------------------------------------------------------- FP8 block scale


def _fp8_block_problem(rng, t, e, k, h, i, activation="silu"):
    """bf16 tokens and DeepSeek-style FP8 block-quantized weights (block 128x128, act
    fp8_per_group). Returns x, q13, q2, tw, ids, quant."""
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i, activation)
    q13, q2, quant = quantize_weights("fp8_block", w13, w2)
    return x, q13, q2, tw, ids, quant


def _block_dequant(q, s):
    """The layout's definition, in numpy: ``w[e, r, c] = float(q[e, r, c]) * s[e, r // 128, c // 128]``."""
    q = np.asarray(jnp.asarray(q).astype(jnp.float32), np.float64)
    s = np.asarray(s, np.float64)
    return q * np.repeat(np.repeat(s, 128, axis=1), 128, axis=2)


@pytest.mark.parametrize("activation", ["silu", "relu2"])
def test_prepare_fp8_block_layout_follows_its_definition(rng, activation):
    """Written from jax_moe.layouts.blockscale's table: the prepared w13 with its scales decodes
    (w = q * s[r // 128, c // 128]) to [up; gate] of the stored [gate; up] weights (gated), or to
    them unchanged (relu2); w2 and its scales are the stored ones."""
    e, k, h, i = 3, 2, 256, 384
    _, q13, q2, _, _, quant = _fp8_block_problem(rng, 1, e, k, h, i, activation)
    prep = _jit(fic.prepare, q13, q2, cfg=MoEConfig(e, k, h, i, activation), quant=quant)
    n1 = 2 * i if fic.GATED[activation] else i
    assert prep.scheme == "fp8_block" and prep.w13.dtype == jnp.float8_e4m3fn and prep.w2.dtype == jnp.float8_e4m3fn
    assert prep.w13.shape == (e, n1, h) and prep.w13_block_scale.shape == (e, n1 // 128, h // 128)
    assert prep.w2_block_scale.shape == (e, h // 128, i // 128) and prep.w13_block_scale.dtype == jnp.float32
    stored = _block_dequant(q13, quant.w13_scale)
    want = np.concatenate([stored[:, i:], stored[:, :i]], axis=1) if fic.GATED[activation] else stored
    np.testing.assert_array_equal(_block_dequant(prep.w13, prep.w13_block_scale), want)
    np.testing.assert_array_equal(_block_dequant(prep.w2, prep.w2_block_scale), _block_dequant(q2, quant.w2_scale))


def test_fp8_block_scale_swap_is_its_own_inverse_and_a_permutation(rng):
    from jax_moe import layouts as L

    i = 256
    s = jnp.asarray(rng.random((2, 2 * i // 128, 3)) + 0.5, jnp.float32)
    fwd = L.swap_w13_to_w31_block_scales(s, i)
    np.testing.assert_array_equal(np.asarray(L.swap_w31_to_w13_block_scales(fwd, i)), np.asarray(s))
    np.testing.assert_array_equal(np.sort(np.asarray(fwd).ravel()), np.sort(np.asarray(s).ravel()))
    # row r of the result is row (r + I/128) mod (2I/128) of the input
    np.testing.assert_array_equal(np.asarray(fwd)[:, 0], np.asarray(s)[:, 2])
    with pytest.raises(ValueError, match="multiple of 128"):
        L.swap_w13_to_w31_block_scales(s, 192)
    with pytest.raises(ValueError, match="2I/128"):
        L.swap_w13_to_w31_block_scales(s, 128)
    assert L.fp8_block_scale_shape(384, 256) == (3, 2)
    with pytest.raises(ValueError, match="w2: K"):
        L.fp8_block_scale_shape(128, 200, "w2")


def test_prepare_fp8_block_emulated_runner_matches_xla(rng):
    """What the runner computes, written from the module's words on the prepared operands
    (decode by the layout's definition; GEMM1's input and GEMM2's input quantized per token per
    128 columns; act(gate) * up with rows [up; gate]), against backend="xla" on the stored weights."""
    from jax_moe import fused_experts
    from jax_moe.quant import fp8

    t, e, k, h, i = 9, 4, 2, 256, 256
    x, q13, q2, tw, ids, quant = _fp8_block_problem(rng, t, e, k, h, i)
    prep = _jit(fic.prepare, q13, q2, cfg=MoEConfig(e, k, h, i), quant=quant)
    w13 = jnp.asarray(_block_dequant(prep.w13, prep.w13_block_scale), jnp.float32)
    w2 = jnp.asarray(_block_dequant(prep.w2, prep.w2_block_scale), jnp.float32)

    def group_q(a):
        return fp8.dequantize_fp8_per_token_group(*fp8.quantize_fp8_per_token_group(a, 128), 128)

    xq = group_q(x.astype(jnp.float32))
    h1 = jnp.einsum("th,tknh->tkn", xq, w13[ids], precision="highest")
    a = jax.nn.silu(h1[..., i:]) * h1[..., :i]  # rows [up (I); gate (I)]
    y = jnp.einsum("tki,tkhi->tkh", group_q(a), w2[ids], precision="highest")
    emulated = jnp.einsum("tk,tkh->th", tw, y)
    ref = _jit(fused_experts, x, q13, q2, tw, ids, quant=quant, backend="xla")
    assert rel_err(emulated, ref) < 1e-2


def test_fp8_block_refusals_name_the_reason(rng):
    """supports() says why (and prepare() raises it): activations not per-group quantized, a
    block other than 128x128, H or I not multiples of 128, alternating gate/up rows."""
    e, k, h, i = 4, 2, 256, 256
    x, w13, w2, _, _ = _problem(rng, 1, e, k, h, i)
    q13, q2, quant = quantize_weights("fp8_block", w13, w2)
    cases = [(MoEConfig(e, k, h, i), quant.replace(act="bf16"), q13, q2, "fp8_per_group"),
             (MoEConfig(e, k, h, i), quantize_weights("fp8_block", w13, w2, block_shape=(64, 128))[2], q13, q2,
              "block_shape"),
             (MoEConfig(e, k, h, i, "silu", gate_up_layout="interleaved"), quant, q13, q2, "concat")]
    w13s, w2s = w13[:, :, :192], w2[:, :192]  # H = 192
    q13s, q2s, quants = quantize_weights("fp8_block", w13s, w2s)
    cases.append((MoEConfig(e, k, 192, i), quants, q13s, q2s, "multiples of 128"))
    for cfg, qc, a, b, reason in cases:
        ok, why = fic.supports(cfg, qc)
        assert not ok and reason in why, (reason, why)
        with pytest.raises(ValueError, match=reason):
            fic.prepare(a, b, cfg, qc)


def test_prepare_fp8_block_weights_value_errors(rng):
    """Every argument is checked before anything is traced, and the error names it."""
    e, k, h, i = 2, 2, 256, 128
    _, q13, q2, _, _, quant = _fp8_block_problem(rng, 1, e, k, h, i)
    s13, s2 = quant.w13_scale, quant.w2_scale
    from jax_moe.backends.flashinfer_cutlass.fp8_block import prepare_fp8_block_weights as prep

    nan13 = s13.at[0, 0, 0].set(jnp.nan)
    cases = [((q13.astype(jnp.bfloat16), s13, q2, s2), "w13 must be float8_e4m3fn"),
             ((q13, s13.astype(jnp.bfloat16), q2, s2), "w13_scale must be float32"),
             ((q13, s13[:, :1], q2, s2), r"w13_scale must have shape \[2, 2, 2\]"),
             ((q13, s13, q2, s2[:, :, :0]), "w2_scale must have shape"),
             ((q13[:, :128], s13, q2, s2), "w13 must have shape"),
             ((q13, nan13, q2, s2), "w13_scale holds NaN"),
             ((q13, s13, q2, -s2), "w2_scale must be positive")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            prep(*args)


def test_fp8_block_apply_checks_and_shape_rule(rng, monkeypatch):
    """apply_prepared raises ValueErrors on a bad Prepared before lowering; its abstract
    evaluation (the custom call's shape rule) gives out [T, H] bf16 without a GPU."""
    import dataclasses

    t, e, k, h, i = 5, 4, 2, 256, 128
    x, q13, q2, tw, ids, quant = _fp8_block_problem(rng, t, e, k, h, i)
    prep = fic.prepare(q13, q2, MoEConfig(e, k, h, i), quant)
    bad = dataclasses.replace(prep, w2_block_scale=prep.w2_block_scale.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="w2_block_scale must be float32"):
        fic.apply_prepared(x, bad, tw, ids)
    with pytest.raises(ValueError, match="w13_block_scale must be float32"):
        fic.apply_prepared(x, dataclasses.replace(prep, w13_block_scale=None), tw, ids)
    with pytest.raises(ValueError, match="no tactics"):
        fic.apply_prepared(x, prep, tw, ids, gemm1_tactic=0)
    monkeypatch.setattr(fic.native, "register", lambda: None)
    monkeypatch.setattr(fic.native, "workspace_size", lambda *a: 4096)
    out = jax.eval_shape(lambda xx: fic.apply_prepared(xx, prep, tw, ids), x)
    assert out.shape == (t, h) and out.dtype == jnp.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("e,k", [(8, 2), (256, 8)])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_fp8_block_matches_xla_on_the_same_quantized_weights(rng, t, e, k):
    """DeepSeek-style FP8 block scales against backend="xla" with the same QuantConfig (weights
    dequantized, activations fake-quantized per token per 128 columns), through fused_experts
    under jit, twice (bit-identical: no state leaks between calls)."""
    skip_unless_fi_scheme("fp8_block")
    h, i = 1024, 512
    x, q13, q2, tw, ids, quant = _fp8_block_problem(rng, t, e, k, h, i)
    _jit_twice_matches_xla(x, q13, q2, tw, ids, quant, FP8_REL_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_fp8_block_other_activations_and_empty_experts(rng, activation):
    """Prepared once, applied under jit: other activations, and tokens routed to 3 of 16
    experts only (13 experts get no rows)."""
    skip_unless_fi_scheme("fp8_block")
    t, e, k, h, i = 64, 16, 2, 512, 256
    x, q13, q2, tw, _, quant = _fp8_block_problem(rng, t, e, k, h, i, activation)
    _prepared_matches_xla(x, q13, q2, tw, _three_expert_ids(rng, t, k), quant, MoEConfig(e, k, h, i, activation),
                          FP8_REL_TOL)


@pytest.mark.gpu
def test_fp8_block_shapes_in_any_order(rng):
    """The block-scale GEMM lays its workspace out by the largest row count its runner was sized
    for, so each shape has its own runner: a small T traced after a large one (and run again
    after it) still fits the workspace XLA allocated and matches the reference."""
    skip_unless_fi_scheme("fp8_block")
    from jax_moe import fused_experts

    e, k, h, i = 8, 2, 512, 256
    x, q13, q2, tw, ids, quant = _fp8_block_problem(rng, 300, e, k, h, i)
    prep = fic.prepare(q13, q2, MoEConfig(e, k, h, i), quant)
    f = jax.jit(fic.apply_prepared)
    for t in (300, 3, 300, 3):
        out = f(x[:t], prep, tw[:t], ids[:t])
        ref = fused_experts(x[:t], q13, q2, tw[:t], ids[:t], quant=quant, backend="xla")
        assert rel_err(out, ref) < FP8_REL_TOL, t


@pytest.mark.gpu
def test_fp8_block_swigluoai_biases_and_router_weight_on_input(rng):
    """The runner's optional operands on the block-scale path: swigluoai (SwigluBias) with both
    biases and clamps that bite, and Llama4's router weight on the input (top-1)."""
    skip_unless_fi_scheme("fp8_block")
    t, e, k, h, i = 37, 8, 2, 512, 256
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.bfloat16).astype(jnp.float32)
    b2 = jnp.asarray(0.3 * rng.standard_normal((e, h)), jnp.bfloat16).astype(jnp.float32)
    q13, q2, quant = quantize_weights("fp8_block", 4 * w13.astype(jnp.float32), w2)
    _optional_operands_match_xla(rng, x, q13, q2, tw, ids, dict(activation="swigluoai", w13_bias=b13, w2_bias=b2),
                                 FP8_REL_TOL, quant)


@pytest.mark.gpu
def test_fp8_block_deepseek_v3_hidden_and_intermediate(rng):
    """DeepSeek-V3's H = 7168 and I = 2048 with k = 8 (16 experts instead of 256, to keep the
    random weights and the float32 reference's dequantized weights small)."""
    skip_unless_fi_scheme("fp8_block")
    from jax_moe import fused_experts

    t, e, k, h, i = 37, 16, 8, 7168, 2048
    x, q13, q2, tw, ids, quant = _fp8_block_problem(rng, t, e, k, h, i)
    out = jax.jit(lambda *a: fused_experts(*a, quant=quant, backend="flashinfer_cutlass"))(x, q13, q2, tw, ids)
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, backend="xla")
    assert rel_err(out, ref) < FP8_REL_TOL


@pytest.mark.gpu
def test_fp8_block_under_command_buffers(command_buffer_check):
    """The fp8_block handler declares command-buffer compatibility: with XLA's command buffers
    forced on, fresh inputs each round, against the xla backend."""
    skip_unless_fi_scheme("fp8_block")
    command_buffer_check("flashinfer_cutlass", """
        t, e, k, h, i = 77, 16, 4, 512, 256
        w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
        q13, q2, quant = quantize_weights("fp8_block", w13, w2)
        cases = [(t, k, q13, q2, quant), (1, k, q13, q2, quant)]
    """, 5e-2)


# ----------------------------------------------------------------------------- FP16 (scheme f16)


def _f16_problem(rng, t, e, k, h, i, activation="silu"):
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i, activation)
    return x.astype(jnp.float16), w13.astype(jnp.float16), w2.astype(jnp.float16), tw, ids


def _with_compiled(monkeypatch, schemes):
    """A simulated native module serving ``schemes`` (no GPU: the shape rule and refusals only)."""
    monkeypatch.setattr(fic.native, "available", lambda device=None: (True, "simulated"))
    monkeypatch.setattr(fic.native, "compiled_schemes", lambda: tuple(schemes))


def test_prepare_f16_keeps_float16_and_the_bf16_layout(rng):
    """float16 weights (no QuantConfig) -> scheme f16: bf16's row order (GPT-OSS's alternating
    rows -> [up; gate]), float16 weights and biases (the runner's bias type is its output type),
    the SwigluBias parameters; float32 weights still go to bf16."""
    e, i, h = 3, 8, 16
    cfg = MoEConfig(e, 2, h, i, "swigluoai", "interleaved")
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)), jnp.float16)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.float32)
    b2 = jnp.asarray(rng.standard_normal((e, h)), jnp.float32)
    prep = _jit(fic.prepare, w13, w2, cfg=cfg, w13_bias=b13, w2_bias=b2)
    assert prep.scheme == "f16" and prep.activation == "swigluoai"
    for name in ("w13", "w2", "w13_bias", "w2_bias"):
        assert getattr(prep, name).dtype == jnp.float16, name
    np.testing.assert_array_equal(np.asarray(prep.w13[:, :i]), np.asarray(w13[:, 1::2]))  # up
    np.testing.assert_array_equal(np.asarray(prep.w13[:, i:]), np.asarray(w13[:, 0::2]))  # gate
    np.testing.assert_array_equal(np.asarray(prep.w2), np.asarray(w2))
    np.testing.assert_array_equal(np.asarray(prep.w13_bias[:, :i]), np.asarray(b13[:, 1::2].astype(jnp.float16)))
    np.testing.assert_array_equal(np.asarray(prep.w13_bias[:, i:]), np.asarray(b13[:, 0::2].astype(jnp.float16)))
    np.testing.assert_array_equal(np.asarray(prep.w2_bias), np.asarray(b2.astype(jnp.float16)))
    assert prep.swiglu.shape == (3, e)
    bf = _jit(fic.prepare, w13.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), cfg=cfg)
    np.testing.assert_array_equal(np.asarray(bf.w13, np.float32), np.asarray(prep.w13.astype(jnp.bfloat16), np.float32))
    assert fic.prepare(w13.astype(jnp.float32), w2.astype(jnp.float32), cfg).scheme == "bf16"
    relu = _jit(fic.prepare, w13[:, :i], w2, cfg=MoEConfig(e, 2, h, i, "relu2"))  # not gated: rows as they are
    assert relu.scheme == "f16"
    np.testing.assert_array_equal(np.asarray(relu.w13), np.asarray(w13[:, :i]))


def test_f16_and_bf16_mixed_are_value_errors_naming_the_arguments(rng, monkeypatch):
    e, k, h, i = 4, 2, 64, 32
    x, w13, w2, tw, ids = _f16_problem(rng, 3, e, k, h, i)
    cfg = MoEConfig(e, k, h, i)
    bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
    with pytest.raises(ValueError, match=r"float16 and bfloat16 mixed \(w13 float16; w2 bfloat16\)"):
        fic.prepare(w13, bf(w2), cfg)
    with pytest.raises(ValueError, match=r"\(w2 float16; w13 bfloat16\)"):
        fic.prepare(bf(w13), w2, cfg)
    with pytest.raises(ValueError, match=r"\(w13, w2 float16; w2_bias bfloat16\)"):
        fic.prepare(w13, w2, cfg, w2_bias=jnp.zeros((e, h), jnp.bfloat16))
    _with_compiled(monkeypatch, ("bf16", "f16"))
    prep16, prep_bf = fic.prepare(w13, w2, cfg), fic.prepare(bf(w13), bf(w2), cfg)
    with pytest.raises(ValueError, match=r"\(prepared.w13, prepared.w2 float16; x bfloat16\)"):
        fic.apply_prepared(bf(x), prep16, tw, ids)
    with pytest.raises(ValueError, match=r"\(x float16; prepared.w13, prepared.w2 bfloat16\)"):
        fic.apply_prepared(x, prep_bf, tw, ids)
    from jax_moe import fused_experts

    with pytest.raises(ValueError, match="w13 and w2 must have x's dtype"):  # the public API's own check
        fused_experts(bf(x), w13, w2, tw, ids, backend="xla")


def test_f16_apply_shape_rule_gives_float16(rng, monkeypatch):
    """apply_prepared's abstract evaluation (the custom call's shape rule) without a GPU: float16
    out [T, H] for float16 (and float32) x, biases and swigluoai included; bf16 stays bf16."""
    t, e, k, h, i = 5, 4, 2, 64, 32
    x, w13, w2, tw, ids = _f16_problem(rng, t, e, k, h, i)
    _with_compiled(monkeypatch, ("bf16", "f16"))
    monkeypatch.setattr(fic.native, "register", lambda: None)
    monkeypatch.setattr(fic.native, "workspace_size", lambda *a: 4096)
    from jax_moe.backends.flashinfer_cutlass import tuning as flashinfer_tuning

    monkeypatch.setattr(flashinfer_tuning, "choice", lambda *a: (-1, -1))  # no tuning cache lookup
    cfg = MoEConfig(e, k, h, i, "swigluoai")
    prep = fic.prepare(w13, w2, cfg, w13_bias=jnp.zeros((e, 2 * i)), w2_bias=jnp.zeros((e, h)))
    for xx in (x, x.astype(jnp.float32)):
        out = jax.eval_shape(lambda a: fic.apply_prepared(a, prep, tw, ids), xx)
        assert out.shape == (t, h) and out.dtype == jnp.float16
    out = jax.eval_shape(lambda a: fic.apply(a, w13, w2, tw, ids, cfg), x)
    assert out.shape == (t, h) and out.dtype == jnp.float16
    prep_bf = fic.prepare(w13.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), MoEConfig(e, k, h, i))
    out = jax.eval_shape(lambda a: fic.apply_prepared(a, prep_bf, tw, ids), x.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16


def test_f16_refused_with_its_reason_when_not_built(rng, monkeypatch):
    """f16 is opt-in: a build without it refuses float16 weights (supports(), the oracle's forced
    and automatic choice, apply_prepared) with the reason; with it, the oracle picks it for
    prepared float16 weights. bfloat16 weights are unaffected either way."""
    from jax_moe import oracle
    from jax_moe.device import DeviceInfo

    h100 = DeviceInfo("gpu", (9, 0))
    cfg = MoEConfig(8, 2, 1024, 512)
    f16 = oracle.call_features(dtype=jnp.float16)
    _with_compiled(monkeypatch, ("bf16", "fp8", "mxfp4"))
    ok, why = fic.supports(cfg, None, h100, dtype=jnp.float16)
    assert not ok and why.startswith("scheme 'f16' is not built (JAX_MOE_FI_SCHEMES)"), why
    assert fic.supports(cfg, None, h100, dtype=jnp.bfloat16) == (True, "ok")
    assert fic.supports(cfg, None, h100) == (True, "ok")
    _, ok, why = oracle.probe("flashinfer_cutlass", cfg, None, h100, f16)
    assert not ok and "scheme 'f16' is not built (JAX_MOE_FI_SCHEMES)" in why
    with pytest.raises(ValueError, match=r"cannot serve this MoE: scheme 'f16' is not built \(JAX_MOE_FI_SCHEMES\)"):
        oracle.select_backend(cfg, None, backend="flashinfer_cutlass", device=h100, features=f16)
    sel = oracle.select_backend(cfg, None, device=h100, prepared=True, features=f16)
    assert sel.name != "flashinfer_cutlass"
    assert dict(sel.reasons)["flashinfer_cutlass"].startswith("scheme 'f16' is not built")
    x, w13, w2, tw, ids = _f16_problem(rng, 3, 8, 2, 64, 32)
    with pytest.raises(ValueError, match=r"scheme 'f16' is not built \(JAX_MOE_FI_SCHEMES\)"):
        fic.apply_prepared(x, fic.prepare(w13, w2, MoEConfig(8, 2, 64, 32)), tw, ids)
    _with_compiled(monkeypatch, ("bf16", "fp8", "mxfp4", "f16"))
    assert fic.supports(cfg, None, h100, dtype=jnp.float16) == (True, "ok")
    sel = oracle.select_backend(cfg, None, device=h100, prepared=True, features=f16)
    assert sel.name == "flashinfer_cutlass"


@pytest.mark.gpu
@pytest.mark.parametrize("e,k", [(8, 2), (256, 8)])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_f16_matches_xla_on_the_same_weights(rng, t, e, k):
    """float16 weights and activations through fused_experts under jit, twice (bit-identical: no
    state leaks), against backend="xla" on the same float16 weights; float16 out."""
    skip_unless_fi_scheme("f16")
    from jax_moe import fused_experts

    x, w13, w2, tw, ids = _f16_problem(rng, t, e, k, 1024, 512)
    f = jax.jit(lambda *a: fused_experts(*a, backend="flashinfer_cutlass"))
    out1, out2 = f(x, w13, w2, tw, ids), f(x, w13, w2, tw, ids)
    ref = fused_experts(x, w13, w2, tw, ids, backend="xla")
    assert out1.shape == (t, 1024) and out1.dtype == jnp.float16
    assert np.isfinite(np.asarray(out1, np.float32)).all()
    assert rel_err(out1, ref) < 1e-2
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu2"])
def test_f16_prepared_activations_and_empty_experts(rng, activation):
    """Prepared once, applied under jit twice: each activation, with tokens routed to 3 of 16
    experts only (13 experts get no rows); against the float32 reference and backend="xla"."""
    skip_unless_fi_scheme("f16")
    from jax_moe import fused_experts

    t, e, k, h, i = 64, 16, 2, 512, 256
    x, w13, w2, tw, _ = _f16_problem(rng, t, e, k, h, i, activation)
    ids = _three_expert_ids(rng, t, k)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i, activation))
    assert prep.scheme == "f16"
    f = jax.jit(fic.apply_prepared)
    out, again = f(x, prep, tw, ids), f(x, prep, tw, ids)
    assert out.dtype == jnp.float16
    assert rel_err(out, np_moe(x, w13, w2, tw, ids, activation)) < 1e-2
    assert rel_err(out, fused_experts(x, w13, w2, tw, ids, activation=activation, backend="xla")) < 1e-2
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))


@pytest.mark.gpu
def test_f16_swigluoai_biases_and_router_weight_on_input(rng):
    """The runner's optional operands on the half path: GPT-OSS's swigluoai with float16 biases on
    both GEMMs and alternating gate/up rows, and Llama4's router weight on the input (top-1)."""
    skip_unless_fi_scheme("f16")
    t, e, k, h, i = 37, 8, 2, 512, 256
    x, w13, w2, tw, ids, kw = _gpt_oss_problem(rng, t, e, k, h, i, "bf16")
    x, w13, w2 = (a.astype(jnp.float16) for a in (x, w13, w2))
    assert x.dtype == jnp.float16
    _optional_operands_match_xla(rng, x, w13, w2, tw, ids, kw, 1e-2)


@pytest.mark.gpu
def test_f16_every_compiled_tactic(rng):
    """Each compiled f16 GEMM1 and GEMM2 tactic (finalize-fused included), the other default."""
    skip_unless_fi_scheme("f16")
    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, w13, w2, tw, ids = _f16_problem(rng, t, e, k, h, i)
    ref = np_moe(x, w13, w2, tw, ids)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i))
    errors = {}
    for gemm_id in (1, 2):
        compiled = [(idx, desc) for idx, desc, ok in fic.tactics(gemm_id, "f16") if ok]
        assert compiled, f"no compiled f16 GEMM{gemm_id} tactic"
        for idx, desc in compiled:
            kw = {"gemm1_tactic": idx} if gemm_id == 1 else {"gemm2_tactic": idx}
            out = fic.apply_prepared(x, prep, tw, ids, **kw)
            errors[f"gemm{gemm_id} {desc}"] = rel_err(out, ref, finite=False)
    bad = {d: err for d, err in errors.items() if not err < 1e-2}
    assert not bad, bad


_F16_COMMAND_BUFFER_SCRIPT = """
import numpy as np, jax, jax.numpy as jnp
from jax_moe import fused_experts
rng = np.random.default_rng({seed})
{cases_code}
for t, k, w13, w2, kw in cases:
    e, h = w2.shape[0], w2.shape[1]
    f = jax.jit(lambda x, tw, ids: fused_experts(x, w13, w2, tw, ids, backend="flashinfer_cutlass", **kw))
    for _ in range(3):
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.float16)
        ids = jnp.asarray(np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k], jnp.int32)
        tw = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
        out = f(x, tw, ids)
        assert out.dtype == jnp.float16
        out = np.asarray(out, np.float32)
        ref = np.asarray(fused_experts(x, w13, w2, tw, ids, backend="xla", **kw), np.float32)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert np.isfinite(out).all() and err < {tol}, err
print("OK", len(cases))
"""


@pytest.mark.gpu
def test_f16_under_command_buffers(command_buffer_check):
    """The f16 handler declares command-buffer compatibility: float16 inputs with XLA's command
    buffers forced on, fresh inputs each round (T = 77 and 1; swigluoai with biases), against xla."""
    skip_unless_fi_scheme("f16")
    n = command_buffer_check("flashinfer_cutlass", """
        t, e, k, h, i = 77, 16, 4, 512, 256
        w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.float16)
        w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.float16)
        b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.float16)
        oai = dict(activation="swigluoai", gate_up_layout="interleaved", w13_bias=b13)
        cases = [(t, k, w13, w2, {}), (1, k, w13, w2, {}), (t, k, w13, w2, oai)]
    """, 1e-2, script=_F16_COMMAND_BUFFER_SCRIPT)
    assert n == 3


# ----------------------------------------------------------------------------- W4A8 (int4 x FP8)


def _w4a8_problem(rng, t, e, k, h, i, activation="silu", *, static_a13=True):
    """bf16 tokens and int4 group-128 weights (QuantConfig("w4a8", act="fp8_per_tensor")) with
    calibrated static activation scales (a13 None with ``static_a13=False``: dynamic). Returns
    x, q13, q2, tw, ids, quant."""
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i, activation)
    a13 = calibrate_activation_scale("fp8_per_tensor", x) if static_a13 else None
    inter = jnp.take_along_axis(_gemm2_inputs(x, w13, i, activation), ids[:, :, None], axis=1)  # routed [T, k, I]
    a2 = calibrate_activation_scale("fp8_per_tensor", inter)
    q13, q2, quant = quantize_weights("w4a8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a2)
    return x, q13, q2, tw, ids, quant


def _decode_prepared_w4a8(prep):
    """The prepared weight operands back through the inverse layouts: (codes13 int8 [E, N1, H],
    scales13 float32 [E, N1, H/128], codes2 [E, H, I], scales2 [E, H, I/128])."""
    from jax_moe import layouts as L
    from jax_moe.quant.int4 import unpack_int4

    out = []
    for w, s in ((prep.w13, prep.w13_block_scale), (prep.w2, prep.w2_block_scale)):
        out.append(np.asarray(unpack_int4(L.deinterleave_int4_weights_for_sm90_mixed_gemm(w))))
        out.append(np.asarray(L.deinterleave_scales_for_sm90_mixed_gemm(s, 128).astype(jnp.float32)))
    return out


def _bf(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32))


def _f8(a):
    """float -> float8_e4m3fn (nearest even, saturating at +-448) -> float32, as the runner's
    conversions (satfinite)."""
    a = jnp.clip(jnp.asarray(a, jnp.float32), -448.0, 448.0)
    return np.asarray(a.astype(jnp.float8_e4m3fn).astype(jnp.float32))


def _emulate_w4a8_runner(x, prep, tw, ids):
    """What the handler computes, step by step from the definition in
    jax_moe.backends.flashinfer_cutlass.w4a8 (its module docstring), on the prepared operands
    decoded through the inverse layouts. numpy float64 sums over float32 terms."""
    from jax_moe.backends.flashinfer_cutlass import w4a8 as w4

    c13, s13, c2, s2 = _decode_prepared_w4a8(prep)
    pq1, al1 = (np.asarray(a, np.float32) for a in w4.input_operands(jnp.asarray(x), prep))
    pq2, al2 = np.asarray(prep.fc2_act_scale, np.float32), np.asarray(prep.g2_alphas, np.float32)
    e, n1, h = c13.shape
    i = c2.shape[2]
    b13 = np.zeros((e, n1), np.float32) if prep.w13_bias is None else np.asarray(prep.w13_bias, np.float32)
    b2 = np.zeros((e, h), np.float32) if prep.w2_bias is None else np.asarray(prep.w2_bias, np.float32)

    def gemm(aq, codes, scales, alpha):  # per group of 128: partial sums, then * scale, * alpha
        part = (aq.reshape(-1, 128)[None] * codes.reshape(codes.shape[0], -1, 128)).sum(-1, dtype=np.float64)
        return _bf(alpha * (part * scales).sum(-1))

    xb = _bf(np.asarray(x, np.float32))
    out = np.zeros((x.shape[0], h), np.float64)
    for t in range(x.shape[0]):
        xq = _f8(_bf(xb[t] * pq1))
        for j in range(ids.shape[1]):
            ex = int(ids[t, j])
            g1 = gemm(xq, c13[ex].astype(np.float32), s13[ex], al1[ex]) + b13[ex]
            if fic.GATED[prep.activation]:
                up, gate = g1[:i], g1[i:]
                act = jax.nn.silu(gate) if prep.activation == "silu" else jax.nn.gelu(gate, approximate=False)
                a = _bf(np.asarray(act) * up)
            else:
                a = _bf(np.square(np.maximum(g1, 0.0)))
            y = gemm(_f8(_bf(a * pq2)), c2[ex].astype(np.float32), s2[ex], al2[ex])
            out[t] += float(tw[t, j]) * (y + b2[ex])
    return out


@pytest.mark.parametrize("activation,layout", [("silu", "concat"), ("silu", "interleaved"),
                                               pytest.param("relu2", "concat", marks=pytest.mark.slow)])
def test_prepare_w4a8_decodes_to_the_checkpoint(rng, activation, layout):
    """Written from flashinfer_cutlass.w4a8's words: decoded through the inverse layouts, the
    prepared codes are the checkpoint's with rows [up; gate] (from [gate; up], or alternating
    rows), the scales the checkpoint's rounded to bf16 in the same rows; w2 unchanged; the
    pre-quant scales are bf(1 / a) broadcast and the alphas their float32 reciprocals (per-expert
    a collapses to its max)."""
    from jax_moe.layouts import reorder_rows_for_gated_act_gemm
    from jax_moe.quant.int4 import unpack_int4

    e, h, i = 3, 256, 128
    _, q13, q2, _, _, quant = _w4a8_problem(rng, 1, e, 2, h, i, activation)
    quant = quant.replace(a13_scale=jnp.asarray([0.01, 0.03, 0.02], jnp.float32))
    n1 = 2 * i if fic.GATED[activation] else i
    s13, codes13 = np.asarray(quant.w13_scale), np.asarray(unpack_int4(q13))  # [gate; up] rows
    if layout == "interleaved":  # the same experts stored with alternating gate/up rows
        q13 = reorder_rows_for_gated_act_gemm(q13)
        quant = quant.replace(w13_scale=reorder_rows_for_gated_act_gemm(quant.w13_scale))
    cfg = MoEConfig(e, 2, h, i, activation, layout)
    prep = _jit(fic.prepare, q13, q2, cfg=cfg, quant=quant)
    assert prep.scheme == "w4a8" and prep.w13.dtype == jnp.uint8 and prep.w13.shape == (e, n1, h // 2)
    assert prep.w13_block_scale.shape == (e, n1 // 64, h // 128, 8, 8) and prep.w13_block_scale.dtype == jnp.bfloat16
    assert prep.w2_block_scale.shape == (e, h // 64, i // 128, 8, 8)
    assert fic.problem_sizes(prep) == (e, h, i)
    c13, p13, c2, p2 = _decode_prepared_w4a8(prep)
    if fic.GATED[activation]:
        want_c13 = np.concatenate([codes13[:, i:], codes13[:, :i]], axis=1)
        want_s13 = np.concatenate([s13[:, i:], s13[:, :i]], axis=1)
    else:
        want_c13, want_s13 = codes13, s13
    np.testing.assert_array_equal(c13, want_c13)
    np.testing.assert_array_equal(p13, _bf(want_s13))
    np.testing.assert_array_equal(c2, np.asarray(unpack_int4(q2)))
    np.testing.assert_array_equal(p2, _bf(quant.w2_scale))
    assert np.abs(p13 / want_s13 - 1).max() <= 2.0 ** -8
    for pq, al, a, n in ((prep.fc1_act_scale, prep.g1_alphas, 0.03, h),
                         (prep.fc2_act_scale, prep.g2_alphas, float(quant.a2_scale), i)):
        assert pq.shape == (n,) and pq.dtype == jnp.bfloat16 and al.shape == (e,) and al.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(pq, np.float32), _bf(np.float32(1) / np.float32(a)))
        np.testing.assert_allclose(np.asarray(al) * np.asarray(pq, np.float32)[0], 1.0, rtol=1e-7)
        assert abs(float(al[0]) / a - 1) <= 2.0 ** -8
    dyn = _jit(fic.prepare, q13, q2, cfg=cfg, quant=quant.replace(a13_scale=None))
    assert dyn.fc1_act_scale is None and dyn.g1_alphas is None and dyn.a13_scale is None


@pytest.mark.parametrize("static_a13", [True, False], ids=["static", "dynamic"])
def test_prepare_w4a8_emulated_runner_matches_xla(rng, static_a13):
    """The runner's arithmetic as the definition writes it (bf16 pre-quant multiply then FP8,
    int4 x FP8 per group of 128 times the bf16 group scale, alpha, bf16 GEMM outputs, activation
    in bf16, GEMM2 likewise, weighted sum), on the decoded operands, equals the xla backend on
    the same quantized checkpoint within 5e-2; static and dynamic a13."""
    from jax_moe import fused_experts

    t, e, k, h, i = 9, 4, 2, 256, 128
    x, q13, q2, tw, ids, quant = _w4a8_problem(rng, t, e, k, h, i, static_a13=static_a13)
    prep = _jit(fic.prepare, q13, q2, cfg=MoEConfig(e, k, h, i), quant=quant)
    out = _emulate_w4a8_runner(x, prep, tw, ids)
    ref = _jit(fused_experts, x, q13, q2, tw, ids, quant=quant, backend="xla")
    assert rel_err(out, ref) < FP8_REL_TOL
    # and the float64 definition on the dequantized weights is not far either (sanity of the test)
    assert rel_err(out, np_moe(x, *(jnp.asarray(a) for a in
                                         _dequant_w4a8(q13, q2, quant)), tw, ids)) < 0.15


def _dequant_w4a8(q13, q2, quant):
    from jax_moe.quant.scheme import dequantize_weights

    return dequantize_weights(quant, q13, q2)


def test_prepare_w4a8_emulated_runner_with_biases_and_swigluoai(rng):
    """The same emulation with GPT-OSS's swigluoai (SwigluBias), interleaved rows and both
    biases, against xla."""
    from jax_moe import fused_experts

    t, e, k, h, i = 7, 4, 2, 256, 128
    x, q13, q2, tw, ids, quant = _w4a8_problem(rng, t, e, k, h, i)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.bfloat16).astype(jnp.float32)
    b2 = jnp.asarray(0.3 * rng.standard_normal((e, h)), jnp.bfloat16).astype(jnp.float32)
    kw = dict(activation="swigluoai", gate_up_layout="interleaved", w13_bias=b13, w2_bias=b2)
    cfg = MoEConfig(e, k, h, i, "swigluoai", "interleaved")
    prep = _jit(fic.prepare, q13, q2, cfg=cfg, quant=quant, w13_bias=b13, w2_bias=b2)
    # the emulation's activation step for SwigluBias, as in the mxfp4 emulation
    c13, s13, c2, s2 = _decode_prepared_w4a8(prep)
    alpha, beta, limit = np.asarray(prep.swiglu)
    pq1, al1 = np.asarray(prep.fc1_act_scale, np.float32), np.asarray(prep.g1_alphas)
    pq2, al2 = np.asarray(prep.fc2_act_scale, np.float32), np.asarray(prep.g2_alphas)
    bb13, bb2 = np.asarray(prep.w13_bias, np.float32), np.asarray(prep.w2_bias, np.float32)

    def gemm(aq, codes, scales, al):
        part = (aq.reshape(-1, 128)[None] * codes.reshape(codes.shape[0], -1, 128)).sum(-1, dtype=np.float64)
        return _bf(al * (part * scales).sum(-1))

    out = np.zeros((t, h), np.float64)
    for tt in range(t):
        xq = _f8(_bf(_bf(np.asarray(x[tt], np.float32)) * pq1))
        for j in range(k):
            ex = int(ids[tt, j])
            g1 = gemm(xq, c13[ex].astype(np.float32), s13[ex], al1[ex]) + bb13[ex]
            u, g = g1[:i], np.minimum(g1[i:], limit[ex])
            a = _bf(g / (1 + np.exp(-alpha[ex] * g)) * (np.clip(u, -limit[ex], limit[ex]) + beta[ex]))
            y = gemm(_f8(_bf(a * pq2)), c2[ex].astype(np.float32), s2[ex], al2[ex])
            out[tt] += float(tw[tt, j]) * (y + bb2[ex])
    ref = _jit(fused_experts, x, q13, q2, tw, ids, quant=quant, backend="xla", **kw)
    assert rel_err(out, ref) < FP8_REL_TOL


def test_w4a8_refusals_name_the_reason(rng):
    """supports() says why (and prepare() raises it): per-token activations, no static a2, a
    group other than 128, H or I not multiples of 128."""
    e, k, h, i = 4, 2, 256, 128
    _, q13, q2, _, _, quant = _w4a8_problem(rng, 1, e, k, h, i)
    x, w13, w2, _, _ = _problem(rng, 1, e, k, h, i)
    g64 = quantize_weights("w4a8", w13, w2, group_size=64, a2_scale=0.1)
    cases = [(MoEConfig(e, k, h, i), quant.replace(act="fp8_per_token"), q13, q2, "act='fp8_per_tensor'"),
             (MoEConfig(e, k, h, i), quant.replace(a2_scale=None), q13, q2, "static a2_scale"),
             (MoEConfig(e, k, h, i), g64[2], g64[0], g64[1], "groups of 128")]
    # H = 192 (a layer the group-128 checkpoint format cannot even hold: supports() alone)
    ok, why = fic.supports(MoEConfig(e, k, 192, i), quant)
    assert not ok and "multiples of 128" in why, why
    for cfg, qc, a, b, reason in cases:
        ok, why = fic.supports(cfg, qc)
        assert not ok and reason in why, (reason, why)
        with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            fic.prepare(a, b, cfg, qc)


def test_prepare_w4a8_weights_value_errors(rng):
    """Every argument is checked before anything is traced, and the error names it."""
    from jax_moe.backends.flashinfer_cutlass.w4a8 import prepare_w4a8_weights as prep

    e, k, h, i = 2, 2, 256, 128
    _, q13, q2, _, _, quant = _w4a8_problem(rng, 1, e, k, h, i)
    s13, s2 = quant.w13_scale, quant.w2_scale
    cases = [((q13.astype(jnp.int8), s13, q2, s2), "w13 must be uint8"),
             ((q13, s13.astype(jnp.bfloat16), q2, s2), "w13_scale must be float32"),
             ((q13, s13[:, :, :1], q2, s2), r"w13_scale must have shape \[2, 256, 2\]"),
             ((q13[:, :128], s13, q2, s2), "w13 must have shape"),
             ((q13, s13, q2[:, :, :32], s2), "multiples of 128"),
             ((q13, s13.at[0, 0, 0].set(jnp.nan), q2, s2), "w13_scale holds NaN"),
             ((q13, s13, q2, -s2), "w2_scale must be positive")]
    for args, msg in cases:
        with pytest.raises(ValueError, match=msg):
            prep(*args)


def test_w4a8_apply_checks_and_shape_rule(rng, monkeypatch):
    """apply_prepared raises ValueErrors on a bad Prepared before lowering; its abstract
    evaluation (the custom call's shape rule) gives out [T, H] bf16 without a GPU, static and
    dynamic a13."""
    import dataclasses

    t, e, k, h, i = 5, 4, 2, 256, 128
    x, q13, q2, tw, ids, quant = _w4a8_problem(rng, t, e, k, h, i)
    prep = fic.prepare(q13, q2, MoEConfig(e, k, h, i), quant)
    bad = [(dict(w2_block_scale=prep.w2_block_scale.astype(jnp.float32)), "w2_block_scale must be bfloat16"),
           (dict(w13_block_scale=None), "w13_block_scale must be bfloat16"),
           (dict(fc2_act_scale=prep.fc2_act_scale[:64]), "fc2_act_scale must be bfloat16"),
           (dict(g1_alphas=None), "both be set"),
           (dict(w13=prep.w13.view(jnp.int8)), "w13 must be uint8")]
    for change, msg in bad:
        with pytest.raises(ValueError, match=msg):
            fic.apply_prepared(x, dataclasses.replace(prep, **change), tw, ids)
    with pytest.raises(ValueError, match="x_scale"):
        fic.apply_prepared(x, prep, tw, ids, x_scale=jnp.float32(1.0))
    monkeypatch.setattr(fic.native, "register", lambda: None)
    monkeypatch.setattr(fic.native, "workspace_size", lambda *a: 4096)
    from jax_moe.backends.flashinfer_cutlass import tuning as flashinfer_tuning

    monkeypatch.setattr(flashinfer_tuning, "choice", lambda *a: (-1, -1))  # no tactic cache without a GPU
    for p in (prep, fic.prepare(q13, q2, MoEConfig(e, k, h, i), quant.replace(a13_scale=None))):
        out = jax.eval_shape(lambda xx, p=p: fic.apply_prepared(xx, p, tw, ids), x)
        assert out.shape == (t, h) and out.dtype == jnp.bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("e,k", [(8, 2), (128, 8)])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_w4a8_matches_xla_on_the_same_quantized_weights(rng, t, e, k):
    """W4A8 against backend="xla" with the same QuantConfig (int4 weights dequantized, activations
    fake-quantized per tensor with the static scales), through fused_experts under jit, twice
    (bit-identical: no state leaks), and against the CPU emulation of the definition."""
    skip_unless_fi_scheme("w4a8")
    h, i = 1024, 512
    x, q13, q2, tw, ids, quant = _w4a8_problem(rng, t, e, k, h, i)
    out1 = _jit_twice_matches_xla(x, q13, q2, tw, ids, quant, FP8_REL_TOL)
    if t <= 37 and e == 8:  # the emulation is slow (numpy per slot)
        prep = fic.prepare(q13, q2, MoEConfig(e, k, h, i), quant)
        assert rel_err(out1, _emulate_w4a8_runner(x, prep, tw, ids)) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_w4a8_other_activations_dynamic_a13_and_empty_experts(rng, activation):
    """Prepared once, applied under jit: other activations, a dynamic a13 (amax / 448 per call),
    and tokens routed to 3 of 16 experts only (13 experts get no rows)."""
    skip_unless_fi_scheme("w4a8")
    t, e, k, h, i = 64, 16, 2, 512, 256
    x, q13, q2, tw, _, quant = _w4a8_problem(rng, t, e, k, h, i, activation, static_a13=False)
    _prepared_matches_xla(x, q13, q2, tw, _three_expert_ids(rng, t, k), quant, MoEConfig(e, k, h, i, activation),
                          FP8_REL_TOL)


@pytest.mark.gpu
def test_w4a8_swigluoai_biases_and_router_weight_on_input(rng):
    """The runner's optional operands on the W4A8 path: swigluoai (SwigluBias) with both biases
    and interleaved rows, and Llama4's router weight on the input (top-1)."""
    skip_unless_fi_scheme("w4a8")
    t, e, k, h, i = 37, 8, 2, 512, 256
    x, q13, q2, tw, ids, quant = _w4a8_problem(rng, t, e, k, h, i)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.bfloat16).astype(jnp.float32)
    b2 = jnp.asarray(0.3 * rng.standard_normal((e, h)), jnp.bfloat16).astype(jnp.float32)
    _optional_operands_match_xla(rng, x, q13, q2, tw, ids, dict(activation="swigluoai", w13_bias=b13, w2_bias=b2),
                                 FP8_REL_TOL, quant)


@pytest.mark.gpu
def test_w4a8_every_compiled_tactic(rng):
    """Each compiled mixed-input GEMM1 (resp. GEMM2) tactic, the other on the built-in choice
    (H = 1024, I = 512: every K tile divides both)."""
    skip_unless_fi_scheme("w4a8")
    from jax_moe import fused_experts

    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, q13, q2, tw, ids, quant = _w4a8_problem(rng, t, e, k, h, i)
    prep = fic.prepare(q13, q2, MoEConfig(e, k, h, i), quant)
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, backend="xla")
    for gemm_id in (1, 2):
        assert all("swap_ab=1" in d and "fusion=none" in d for _, d, _ in fic.tactics(gemm_id, "w4a8"))
    errors = _compiled_tactic_errors(x, prep, tw, ids, ref)
    assert errors
    bad = {d: err for d, err in errors.items() if not err < FP8_REL_TOL}
    assert not bad, bad


@pytest.mark.gpu
def test_w4a8_under_command_buffers(command_buffer_check):
    """The w4a8 handler declares command-buffer compatibility: with XLA's command buffers forced
    on, fresh inputs each round, against the xla backend (static scales)."""
    skip_unless_fi_scheme("w4a8")
    command_buffer_check("flashinfer_cutlass", """
        t, e, k, h, i = 77, 16, 4, 512, 256
        w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
        w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
        q13, q2, quant = quantize_weights("w4a8", w13, w2, a13_scale=4.5 / 448, a2_scale=0.02)
        cases = [(t, k, q13, q2, quant), (1, k, q13, q2, quant)]
    """, 5e-2)
