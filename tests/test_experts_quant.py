"""fused_experts with quantized weights (quant=QuantConfig) on the pure-JAX backend.

The backend must compute exactly what the dense float32 reference computes on the same
quantized weights (dequantized) with the same activation quantization; and the quantized
MoE must stay within each format's error of the unquantized one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import fused_experts, fused_moe, select_experts
from jax_moe.backends import xla
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from jax_moe.reference import moe_reference
from helpers import random_moe, rel_err

T, E, K, H, I = 40, 16, 4, 256, 128

# (scheme, options, bound of the quantized MoE vs the float one)
CASES = [
    ("fp8", dict(act="fp8_per_token"), 9e-2),
    ("fp8", dict(act="fp8_per_token", weight_scale="per_channel"), 9e-2),
    ("fp8", dict(act="bf16"), 9e-2),
    ("fp8", dict(act="fp8_per_tensor"), 9e-2),  # dynamic per-tensor scales
    ("fp8_block", dict(), 9e-2),
    ("nvfp4", dict(act="bf16"), 0.2),
    ("nvfp4", dict(), 0.3),
    ("mxfp4", dict(), 0.25),
    ("mxfp4", dict(act="mxfp8"), 0.3),
    ("w4a8", dict(act="fp8_per_token"), 0.3),
]


def _moe(rng, activation="silu"):
    """A fresh layer of this file's sizes (helpers.random_moe): (cfg, x, w13, w2, weights, ids)."""
    return random_moe(rng, T, E, K, H, I, activation=activation)


@pytest.mark.parametrize("scheme,opts,bound", [c if (not c[1] and c[0] != "mxfp4") or c[0] == "w4a8"
                                               else pytest.param(*c, marks=pytest.mark.slow) for c in CASES],
                         ids=lambda v: str(v))
def test_quantized_backend_equals_reference_on_the_same_quantized_weights(rng, scheme, opts, bound):
    cfg, x, w13, w2, w, ids = _moe(rng)
    q13, q2, quant = quantize_weights(scheme, w13, w2, **opts)
    out = jax.jit(lambda *a: fused_experts(*a, quant=quant, backend="xla"))(x, q13, q2, w, ids)
    assert out.dtype == x.dtype and out.shape == x.shape
    ref_q = moe_reference(x, q13, q2, w, ids, cfg, quant=quant)
    # Summation order differs, so a few activations round to the neighbouring code: one fp8
    # step is ~6%, one E2M1 step up to 33% of that element.
    assert rel_err(out, ref_q) < (1e-2 if quant.act == "nvfp4" else 1e-3)
    # and the quantized MoE approximates the float one within the format's error
    assert rel_err(out, moe_reference(x, w13, w2, w, ids, cfg)) < bound


@pytest.mark.parametrize("strategy", [pytest.param("gather", marks=pytest.mark.slow),
                                      pytest.param("blocked", marks=pytest.mark.slow),
                                      "dense"])
def test_every_strategy_serves_quantized_weights(rng, strategy):
    cfg, x, w13, w2, w, ids = _moe(rng)
    q13, q2, quant = quantize_weights("fp8_block", w13, w2)
    out = xla.apply(x, q13, q2, w, ids, cfg, quant=quant, strategy=strategy)
    assert rel_err(out, moe_reference(x, q13, q2, w, ids, cfg, quant=quant)) < 1e-3


def test_static_activation_scales(rng):
    cfg, x, w13, w2, w, ids = _moe(rng)
    a13 = calibrate_activation_scale("fp8_per_tensor", x)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=0.01)
    out = fused_experts(x, q13, q2, w, ids, quant=quant, backend="xla")  # a GPU's default: the FP8 kernels
    assert rel_err(out, moe_reference(x, q13, q2, w, ids, cfg, quant=quant)) < 1e-3


def _nvfp4_static(rng, per_expert=False):
    cfg, x, w13, w2, w, ids = _moe(rng)
    a13 = calibrate_activation_scale("nvfp4", x)
    if per_expert:  # [E]: one scale for all experts, their max
        a13 = a13 * jnp.linspace(0.5, 1.0, E, dtype=jnp.float32)
    q13, q2, quant = quantize_weights("nvfp4", w13, w2, a13_scale=a13, a2_scale=0.02)
    return cfg, x, q13, q2, w, ids, quant


@pytest.mark.parametrize("per_expert", [False, True], ids=["a13[]", "a13[E]"])
@pytest.mark.parametrize("strategy", [pytest.param("gather", marks=pytest.mark.slow),
                                      pytest.param("blocked", marks=pytest.mark.slow),
                                      "dense", pytest.param("ragged_dot", marks=pytest.mark.slow)])
def test_nvfp4_input_quantized_beforehand_gives_the_same_result(rng, strategy, per_expert):
    """xla.apply takes x already quantized to NVFP4 (packed E2M1 + linear e4m3 block scales,
    global scale 1 / a13_scale), as expert parallelism sends it: the same result, bit for bit,
    as quantizing the float x inside."""
    from jax_moe.quant import quantize_nvfp4
    from jax_moe.quant.scheme import nvfp4_activation_global_scale

    assert xla.PREQUANTIZED_INPUT["nvfp4"] == "linear"
    cfg, x, q13, q2, w, ids, quant = _nvfp4_static(rng, per_expert)
    packed, sf, _ = quantize_nvfp4(x, nvfp4_activation_global_scale(quant, 1))
    assert packed.shape == (T, H // 2) and sf.shape == (T, H // 16)
    got = xla.apply(packed, q13, q2, w, ids, cfg, quant=quant, x_scale=sf, strategy=strategy)
    want = xla.apply(x, q13, q2, w, ids, cfg, quant=quant, strategy=strategy)
    assert got.dtype == jnp.float32 and got.shape == x.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_nvfp4_input_quantized_beforehand_is_checked(rng):
    from jax_moe.quant import quantize_nvfp4

    cfg, x, q13, q2, w, ids, quant = _nvfp4_static(rng)
    packed, sf, _ = quantize_nvfp4(x, 1.0 / quant.a13_scale)
    with pytest.raises(ValueError, match="needs quant.a13_scale"):
        xla.apply(packed, q13, q2, w, ids, cfg, quant=quant.replace(a13_scale=None), x_scale=sf)
    with pytest.raises(ValueError, match=r"x_scale must be \[T, H/16\]"):
        xla.apply(packed, q13, q2, w, ids, cfg, quant=quant, x_scale=sf.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"must be \[T, H/2\]"):
        xla.apply(x, q13, q2, w, ids, cfg, quant=quant, x_scale=sf)
    with pytest.raises(ValueError, match="act in"):
        xla.apply(packed, q13, q2, w, ids, cfg, quant=quant.replace(act="bf16"), x_scale=sf)
    with pytest.raises(ValueError, match="apply_router_weight_on_input needs a float x"):
        xla.apply(packed, q13, q2, w, ids, cfg, quant=quant, x_scale=sf, apply_router_weight_on_input=True)


def test_quantized_weights_as_a_jit_argument(rng):
    cfg, x, w13, w2, w, ids = _moe(rng)
    q13, q2, quant = quantize_weights("mxfp4", w13, w2)
    f = jax.jit(lambda x, q13, q2, quant: fused_experts(x, q13, q2, w, ids, quant=quant))
    np.testing.assert_array_equal(np.asarray(f(x, q13, q2, quant)), np.asarray(f(x, q13, q2, quant)))


def test_nan_scale_is_rejected_before_running(rng):
    cfg, x, w13, w2, w, ids = _moe(rng)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_token")
    bad = quant.replace(w13_scale=quant.w13_scale.at[0].set(jnp.nan))
    with pytest.raises(ValueError, match="w13_scale"):
        fused_experts(x, q13, q2, w, ids, quant=bad)


def test_unquantized_weights_with_quant_are_rejected(rng):
    cfg, x, w13, w2, w, ids = _moe(rng)
    _, _, quant = quantize_weights("fp8", w13, w2)
    with pytest.raises(ValueError, match="w13"):
        fused_experts(x, w13, w2, w, ids, quant=quant)


# ----------------------------------------------------------------------------- robustness


def _nan_in_unused_expert(rng, scheme, t, **opts):
    """A layer whose expert E-1 receives no token and holds one NaN weight (before quantization:
    fp8 keeps it as a NaN byte, the packed formats in a block scale)."""
    cfg, x, w13, w2, _, _ = _moe(rng)
    x = x[:1].repeat(t, 0) + jnp.asarray(rng.standard_normal((t, H)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((t, E)), jnp.float32).at[:, E - 1].set(-1e4)
    w, ids = select_experts(logits, K)
    bad13 = np.array(w13)
    bad13[E - 1, 0, 0] = np.nan
    clean = quantize_weights(scheme, w13, w2, **opts)
    bad = quantize_weights(scheme, bad13, w2, **opts)
    return cfg, x, w, ids, clean, bad


@pytest.mark.parametrize("t", [pytest.param(1, marks=pytest.mark.slow), 40, pytest.param(300, marks=pytest.mark.slow)])
def test_issue_repro_nan_byte_in_an_unused_fp8_expert_on_the_default_path(rng, t):
    """Regression: one NaN byte in an unused expert made 300/300 tokens NaN on the default
    FP8 path (dynamic fp8_per_tensor, served by ragged_dot)."""
    cfg, x, w, ids, (c13, c2, cq), (b13, b2, bq) = _nan_in_unused_expert(rng, "fp8", t)
    assert np.isnan(np.asarray(b13[E - 1].astype(jnp.float32))).sum() == 1  # a NaN byte, finite scales
    out = jax.jit(lambda *a: fused_experts(*a[:5], quant=a[5]))(x, b13, b2, w, ids, bq)
    want = fused_experts(x, c13, c2, w, ids, quant=cq)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("act", ["fp8_per_tensor", pytest.param("fp8_per_token", marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", [s if s == "ragged_dot" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in xla.STRATEGIES])
def test_nan_in_an_unused_fp8_expert_on_every_strategy(rng, strategy, act):
    cfg, x, w, ids, (c13, c2, cq), (b13, b2, bq) = _nan_in_unused_expert(rng, "fp8", 40, act=act)
    out = xla.apply(x, b13, b2, w, ids, cfg, quant=bq, strategy=strategy)
    want = xla.apply(x, c13, c2, w, ids, cfg, quant=cq, strategy=strategy)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("scheme,opts", [("fp8", dict(act="fp8_per_tensor")), ("nvfp4", dict())],
                         ids=["fp8_per_tensor", "nvfp4"])
@pytest.mark.parametrize("strategy", [s if s == "blocked" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in xla.STRATEGIES])
def test_a_nan_token_leaves_a_dynamic_tensor_wide_scale_alone(rng, strategy, scheme, opts):
    """A dynamic per-tensor scale (GEMM1's and GEMM2's inputs) is taken over finite values: one
    NaN token leaves every other token exactly as without it."""
    cfg, x, w13, w2, w, ids = _moe(rng)
    x = x.at[5].multiply(1e-3)  # token 5 never holds a max: with its NaN left out, the scales are the same
    q13, q2, quant = quantize_weights(scheme, w13, w2, **opts)
    want = np.asarray(xla.apply(x, q13, q2, w, ids, cfg, quant=quant, strategy=strategy))
    out = np.asarray(xla.apply(x.at[5, 7].set(jnp.nan), q13, q2, w, ids, cfg, quant=quant, strategy=strategy))
    assert np.isnan(out[5]).all()
    np.testing.assert_array_equal(np.delete(out, 5, 0), np.delete(want, 5, 0))


@pytest.mark.parametrize("strategy", [s if s == "blocked" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in xla.STRATEGIES])
def test_every_strategy_takes_one_dynamic_gemm2_scale_over_the_routed_rows(rng, strategy):
    """fp8_per_tensor without a2_scale: the scale at GEMM2's input is the max over every routed row
    (blocked takes it in two passes), as the reference takes it."""
    cfg, x, w13, w2, w, ids = _moe(rng)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor")
    out = xla.apply(x, q13, q2, w, ids, cfg, quant=quant, strategy=strategy, block_size=16)
    assert rel_err(out, moe_reference(x, q13, q2, w, ids, cfg, quant=quant)) < 1e-3


@pytest.mark.slow
def test_issue_repro_vmap_over_the_default_fp8_path(rng):
    """Regression: NotImplementedError (ragged_dot vmap over any dim but 0)."""
    cfg, x, w13, w2, _, _ = _moe(rng)
    q13, q2, qc = quantize_weights("fp8", w13, w2)
    xs = jnp.asarray(rng.standard_normal((2, 10, H)), jnp.float32)
    lgs = jnp.asarray(rng.standard_normal((2, 10, E)), jnp.float32)
    got = jax.vmap(lambda x, lg: fused_moe(x, q13, q2, lg, 2, quant=qc))(xs, lgs)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(fused_moe(xs[b], q13, q2, lgs[b], 2, quant=qc)),
                                   rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy", [s if s == "ragged_dot" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in xla.STRATEGIES])
def test_vmap_over_quantized_weights_on_every_strategy(rng, strategy):
    cfg, x, w13, w2, w, ids = _moe(rng)
    q13, q2, quant = quantize_weights("mxfp4", w13, w2, act="mxfp8")
    f = lambda x: xla.apply(x, q13, q2, w[:10], ids[:10], cfg, quant=quant, strategy=strategy)  # noqa: E731
    xs = jnp.stack([x[:10], x[10:20]])
    got = jax.vmap(f)(xs)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(f(xs[b])), rtol=1e-6, atol=1e-6)


def test_numpy_quantized_weights_and_scales(rng):
    cfg, x, w13, w2, w, ids = _moe(rng)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_token")
    np_quant = jax.tree.map(np.asarray, quant)
    for t in (3, T):
        want = fused_experts(x[:t], q13, q2, w[:t], ids[:t], quant=quant)
        got = fused_experts(np.asarray(x[:t]), np.asarray(q13), np.asarray(q2), np.asarray(w[:t]),
                            np.asarray(ids[:t]), quant=np_quant)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
