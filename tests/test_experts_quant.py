"""fused_experts with quantized weights (quant=QuantConfig) on the pure-JAX backend.

The backend must compute exactly what the dense float32 reference computes on the same
quantized weights (dequantized) with the same activation quantization; and the quantized
MoE must stay within each format's error of the unquantized one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import fused_experts, select_experts
from jax_moe.backends import xla
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from jax_moe.reference import moe_reference

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
    cfg = MoEConfig(E, K, H, I, activation)
    x = jnp.asarray(rng.standard_normal((T, H)), jnp.float32)
    w13 = jnp.asarray(rng.standard_normal((E, cfg.w13_rows, H)) / np.sqrt(H), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((E, H, I)) / np.sqrt(I), jnp.float32)
    w, ids = select_experts(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), K)
    return cfg, x, w13, w2, w, ids


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all(), "NaN/inf in output"
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("scheme,opts,bound", CASES, ids=lambda v: str(v))
def test_quantized_backend_equals_reference_on_the_same_quantized_weights(rng, scheme, opts, bound):
    cfg, x, w13, w2, w, ids = _moe(rng)
    q13, q2, quant = quantize_weights(scheme, w13, w2, **opts)
    out = jax.jit(lambda *a: fused_experts(*a, quant=quant))(x, q13, q2, w, ids)
    assert out.dtype == x.dtype and out.shape == x.shape
    ref_q = moe_reference(x, q13, q2, w, ids, cfg, quant=quant)
    # Summation order differs, so a few activations round to the neighbouring code: one fp8
    # step is ~6%, one E2M1 step up to 33% of that element.
    assert rel(out, ref_q) < (1e-2 if quant.act == "nvfp4" else 1e-3)
    # and the quantized MoE approximates the float one within the format's error
    assert rel(out, moe_reference(x, w13, w2, w, ids, cfg)) < bound


@pytest.mark.parametrize("strategy", ["gather", "blocked", "dense"])
def test_every_strategy_serves_quantized_weights(rng, strategy):
    cfg, x, w13, w2, w, ids = _moe(rng)
    q13, q2, quant = quantize_weights("fp8_block", w13, w2)
    out = xla.apply(x, q13, q2, w, ids, cfg, quant=quant, strategy=strategy)
    assert rel(out, moe_reference(x, q13, q2, w, ids, cfg, quant=quant)) < 1e-3


def test_static_activation_scales(rng):
    cfg, x, w13, w2, w, ids = _moe(rng)
    a13 = calibrate_activation_scale("fp8_per_tensor", x)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=0.01)
    out = fused_experts(x, q13, q2, w, ids, quant=quant)
    assert rel(out, moe_reference(x, q13, q2, w, ids, cfg, quant=quant)) < 1e-3


def _nvfp4_static(rng, per_expert=False):
    cfg, x, w13, w2, w, ids = _moe(rng)
    a13 = calibrate_activation_scale("nvfp4", x)
    if per_expert:  # [E]: one scale for all experts, their max
        a13 = a13 * jnp.linspace(0.5, 1.0, E, dtype=jnp.float32)
    q13, q2, quant = quantize_weights("nvfp4", w13, w2, a13_scale=a13, a2_scale=0.02)
    return cfg, x, q13, q2, w, ids, quant


@pytest.mark.parametrize("per_expert", [False, True], ids=["a13[]", "a13[E]"])
@pytest.mark.parametrize("strategy", ["gather", "blocked", "dense", "ragged_dot"])
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
