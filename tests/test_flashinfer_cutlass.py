"""FlashInfer CUTLASS fused-MoE custom calls (SM90) in bf16 and FP8 per-tensor: the prepared layouts,
against the float64 definition (helpers.np_moe; bf16) and the pure-JAX backend on the same quantized
weights (FP8). The other schemes: test_flashinfer_cutlass_fp8_block.py, _fp4.py (MXFP4, W4A8) and _f16.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.backends import flashinfer_cutlass as fic
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from helpers import jit_call as _jit, np_moe, rel_err, skip_unless_available
from flashinfer_cases import FP8_REL_TOL, REL_TOL, compiled_tactic_errors, gemm2_inputs, gpt_oss_problem, problem


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
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i)
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
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i, activation)
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
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i)
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
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i)
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

    x, w13, w2, tw, ids = problem(rng, t, e, k, 1024, 512)
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

    x, w13, w2, tw, ids, kw = gpt_oss_problem(rng, t, e, k, 1024, 512, scheme)
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
    x, w13, w2, _, ids = problem(rng, t, e, 1, h, i)
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
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i)
    ids = ids.at[:3].set(jnp.arange(8, 8 + k, dtype=jnp.int32))  # three tokens with none local
    local = jnp.where(ids < 8, ids, -1)
    prep = fic.prepare(w13[:8], w2[:8], MoEConfig(8, k, h, i, expert_shard=True))
    out = np.asarray(jax.jit(fic.apply_prepared)(x, prep, tw, local), np.float32)
    ref = np_moe(x, w13, w2, jnp.where(ids < 8, tw, 0.0), jnp.where(ids < 8, ids, 0))
    assert np.isfinite(out).all() and (out[:3] == 0).all()
    assert rel_err(out, ref) < REL_TOL


# ----------------------------------------------------------------------------- FP8 per-tensor


def _fp8_problem(rng, t, e, k, h, i, *, static_a13=True, activation="silu"):
    """Random bf16 tokens and fp8-quantized weights (per-expert scales) with a calibrated static
    a2_scale (and a13_scale unless ``static_a13`` is False)."""
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i, activation)
    a13 = calibrate_activation_scale("fp8_per_tensor", x) if static_a13 else None
    a2 = calibrate_activation_scale("fp8_per_tensor", gemm2_inputs(x, w13, i, activation))
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
    errors = compiled_tactic_errors(x, prep, tw, ids, ref)
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
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i))
    out = jax.jit(fic.apply_prepared)(x, prep, tw, ids)
    assert rel_err(out, np_moe(x, w13, w2, tw, ids)) < REL_TOL
    pick = tuning.cached("bf16", "silu", t, h, i, e, k)
    assert pick is not None and (tmp_path / "tactics.json").exists()
    compiled1 = {idx for idx, _, ok in fic.tactics(1) if ok}
    compiled2 = {idx for idx, _, ok in fic.tactics(2) if ok}
    assert pick[0] in compiled1 and pick[1] in compiled2
