"""Specifications of QuantConfig, the contract between the quantized formats and the backends:
its fields and pytree, quantize_weights / dequantize / validate, activation quantization and
calibration, and one rule for NaN and infinities across every format. CPU only; random data comes
fresh from the per-test ``rng``. The formats themselves: test_quant.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.quant import fp4, fp8, int4
from jax_moe.quant.scheme import (
    SCHEME_ACTS,
    SCHEMES,
    QuantConfig,
    calibrate_activation_scale,
    dequantize_experts,
    dequantize_weights,
    quantize_activation,
    quantize_weights,
)

from helpers import rel_err
from quant_cases import E4M3, f32, normal


# =========================================================================== QuantConfig


def make_weights(rng, e=3, h=128, i=128, gated=True):
    rows = 2 * i if gated else i
    return normal(rng, e, rows, h, scale=0.05), normal(rng, e, h, i, scale=0.05)


def test_quantconfig_defaults_and_bad_static_fields():
    s = jnp.ones((), jnp.float32)
    assert QuantConfig("fp8", s, s).act == "fp8_per_tensor" and QuantConfig("fp8", s, s).block_shape is None
    assert QuantConfig("fp8_block", s, s).block_shape == (128, 128)
    assert QuantConfig("fp8_block", s, s).act == "fp8_per_group"
    assert QuantConfig("nvfp4", s, s).act == "nvfp4" and QuantConfig("nvfp4", s, s).block_shape == (1, 16)
    assert QuantConfig("mxfp4", s, s).act == "bf16" and QuantConfig("mxfp4", s, s).block_shape == (1, 32)
    assert QuantConfig("w4a8", s, s).block_shape == (1, 128)
    with pytest.raises(ValueError, match="scheme"):
        QuantConfig("int3", s, s)
    with pytest.raises(ValueError, match="act"):
        QuantConfig("mxfp4", s, s, act="nvfp4")
    with pytest.raises(ValueError, match="block_shape"):
        QuantConfig("nvfp4", s, s, block_shape=(1, 32))


def test_quantconfig_is_a_pytree_that_survives_jit(rng):
    w13, w2 = make_weights(rng)
    q13, q2, cfg = quantize_weights("nvfp4", w13, w2, a13_scale=0.01, a2_scale=0.02)
    leaves, treedef = jax.tree_util.tree_flatten(cfg)
    assert len(leaves) == 6  # w13/w2 scale, w13/w2 global scale, a13, a2
    back = jax.tree_util.tree_unflatten(treedef, leaves)
    assert (back.scheme, back.act, back.block_shape) == ("nvfp4", "nvfp4", (1, 16))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(cfg)[0]]
    assert paths[0] == ".w13_scale"

    @jax.jit
    def run(c, a, b, x):
        c.validate(3, 128, 128, True, w13=a, w2=b)  # traced scales: shape/dtype checks only
        d13, d2 = dequantize_weights(c, a, b)
        return d13, d2, quantize_activation(c, x, 1)

    x = normal(rng, 5, 128)
    got = run(cfg, q13, q2, x)
    want = (*dequantize_weights(cfg, q13, q2), quantize_activation(cfg, x, 1))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("gated", [True, False])
def test_quantize_weights_output_validates_and_matches_the_format(rng, scheme, gated):
    w13, w2 = make_weights(rng, gated=gated)
    q13, q2, cfg = quantize_weights(scheme, w13, w2)
    cfg.validate(3, 128, 128, gated, w13=q13, w2=q2)
    d13, d2 = dequantize_weights(cfg, q13, q2)
    assert d13.shape == w13.shape and d2.shape == w2.shape and d13.dtype == jnp.float32
    direct = {
        "fp8": lambda w: fp8.dequantize_fp8(*fp8.quantize_fp8_per_expert(w)),
        "fp8_block": lambda w: fp8.dequantize_fp8_block(*fp8.quantize_fp8_block(w)),
        "nvfp4": lambda w: fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(w, fp4.nvfp4_global_scale(w, True))),
        "mxfp4": lambda w: fp4.dequantize_mxfp4(*fp4.quantize_mxfp4(w)),
        "w4a8": lambda w: int4.dequantize_int4(*int4.quantize_int4(w, 128), 128),
    }[scheme]
    np.testing.assert_array_equal(np.asarray(d13), np.asarray(direct(w13)))
    np.testing.assert_array_equal(np.asarray(d2), np.asarray(direct(w2)))
    bound = {"fp8": 3e-2, "fp8_block": 3e-2, "nvfp4": 0.15, "mxfp4": 0.2, "w4a8": 0.13}[scheme]
    assert rel_err(d13, w13) < bound and rel_err(d2, w2) < bound


@pytest.mark.parametrize("mode,shape13", [("per_tensor", ()), ("per_expert", (3,)), ("per_channel", (3, 256, 1))])
def test_fp8_weight_scale_modes(rng, mode, shape13):
    w13, w2 = make_weights(rng)
    q13, q2, cfg = quantize_weights("fp8", w13, w2, weight_scale=mode)
    assert cfg.w13_scale.shape == shape13
    cfg.validate(3, 128, 128, True, w13=q13, w2=q2)
    assert rel_err(dequantize_weights(cfg, q13, q2)[0], w13) < 3e-2


@pytest.mark.parametrize("scheme", SCHEMES)
def test_dequantize_experts_equals_gathered_dequantize_weights(rng, scheme):
    w13, w2 = make_weights(rng, e=4)
    q13, q2, cfg = quantize_weights(scheme, w13, w2)
    d13, d2 = dequantize_weights(cfg, q13, q2)
    ids = jnp.array([3, 0, 3], jnp.int32)
    sub = jax.jit(lambda c, w, i: dequantize_experts(c, "w2", w, i))(cfg, q2, ids)
    np.testing.assert_array_equal(np.asarray(sub), np.asarray(d2)[[3, 0, 3]])
    one = dequantize_experts(cfg, "w13", q13, jnp.array([2], jnp.int32), dtype=jnp.bfloat16)
    assert one.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(one[0]), np.asarray(d13[2].astype(jnp.bfloat16)))
    with pytest.raises(ValueError, match="which"):
        dequantize_experts(cfg, "w3", q13, ids)


def test_validate_names_a_wrong_shape_scale(rng):
    w13, w2 = make_weights(rng)
    for scheme in SCHEMES:
        q13, q2, cfg = quantize_weights(scheme, w13, w2)
        s2 = cfg.w2_scale
        wrong = jnp.concatenate([s2, s2], axis=-1) if s2.ndim == 3 else jnp.ones((5,), s2.dtype)
        bad = cfg.replace(w2_scale=wrong)
        with pytest.raises(ValueError, match="w2_scale.*shape"):
            bad.validate(3, 128, 128, True, w13=q13, w2=q2)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 0.0, -1.0])
def test_validate_names_a_nan_inf_or_nonpositive_scale(rng, bad):
    w13, w2 = make_weights(rng)
    q13, q2, cfg = quantize_weights("fp8", w13, w2)
    s = np.asarray(cfg.w13_scale).copy()
    s[1] = bad
    with pytest.raises(ValueError, match="w13_scale"):
        cfg.replace(w13_scale=jnp.asarray(s)).validate(3, 128, 128, True, w13=q13, w2=q2)
    with pytest.raises(ValueError, match="a13_scale"):
        cfg.replace(a13_scale=jnp.float32(bad)).validate(3, 128, 128, True)
    q13, q2, cfg = quantize_weights("nvfp4", w13, w2)
    g = np.asarray(cfg.w2_global_scale).copy()
    g[0] = bad
    with pytest.raises(ValueError, match="w2_global_scale"):
        cfg.replace(w2_global_scale=jnp.asarray(g)).validate(3, 128, 128, True)


def test_validate_names_a_nan_block_scale_and_e8m0_nan(rng):
    w13, w2 = make_weights(rng)
    _, _, cfg = quantize_weights("nvfp4", w13, w2)
    bs = np.asarray(cfg.w13_scale).copy()
    bs[0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="w13_scale.*NaN"):
        cfg.replace(w13_scale=jnp.asarray(bs)).validate(3, 128, 128, True)
    _, _, cfg = quantize_weights("mxfp4", w13, w2)
    with pytest.raises(ValueError, match="w2_scale.*E8M0"):
        cfg.replace(w2_scale=cfg.w2_scale.at[0, 0, 0].set(255)).validate(3, 128, 128, True)


def test_validate_names_a_wrong_dtype_or_shape_weight(rng):
    w13, w2 = make_weights(rng)
    q13, q2, cfg = quantize_weights("fp8", w13, w2)
    with pytest.raises(ValueError, match="w13.*dtype.*float8_e4m3fn"):
        cfg.validate(3, 128, 128, True, w13=jnp.asarray(w13, jnp.bfloat16), w2=q2)
    q13, q2, cfg = quantize_weights("mxfp4", w13, w2)
    with pytest.raises(ValueError, match="w2 must have shape"):
        cfg.validate(3, 128, 128, True, w13=q13, w2=q2[..., :16])
    with pytest.raises(ValueError, match="w13_scale.*dtype.*uint8"):
        cfg.replace(w13_scale=cfg.w13_scale.astype(jnp.float32)).validate(3, 128, 128, True)


def test_validate_rejects_static_scale_for_dynamic_act_and_misplaced_global_scale(rng):
    w13, w2 = make_weights(rng)
    _, _, cfg = quantize_weights("fp8", w13, w2, act="fp8_per_token")
    with pytest.raises(ValueError, match="a2_scale"):
        cfg.replace(a2_scale=jnp.float32(0.1)).validate(3, 128, 128, True)
    with pytest.raises(ValueError, match="w13_global_scale"):
        cfg.replace(w13_global_scale=jnp.ones((3,), jnp.float32)).validate(3, 128, 128, True)
    with pytest.raises(ValueError, match="weight_scale"):
        quantize_weights("nvfp4", w13, w2, weight_scale="per_tensor")


def test_quantize_activation_stage_picks_its_static_fp8_scale(rng):
    w13, w2 = make_weights(rng)
    _, _, cfg = quantize_weights("fp8", w13, w2, a13_scale=0.004, a2_scale=0.0005)
    x = normal(rng, 8, 128)
    for stage, s in ((1, np.float32(0.004)), (2, np.float32(0.0005))):
        got = np.asarray(quantize_activation(cfg, x, stage))
        want = f32(fp8.quantize_fp8_static(x, s)) * s
        np.testing.assert_array_equal(got, want)
    assert np.abs(np.asarray(quantize_activation(cfg, x, 2))).max() == np.float32(448) * np.float32(0.0005)
    with pytest.raises(ValueError, match="stage"):
        quantize_activation(cfg, x, 3)


@pytest.mark.parametrize("scheme,act", [(s, a) for s in SCHEMES for a in SCHEME_ACTS[s]])
def test_quantize_activation_matches_each_act_format(rng, scheme, act):
    x = normal(rng, 6, 256)
    cfg = QuantConfig(scheme, None, None, act=act)  # dynamic activations; weights unused here
    got = np.asarray(quantize_activation(cfg, x, 2))
    want = {
        "bf16": lambda: x,
        "fp8_per_tensor": lambda: fp8.dequantize_fp8(*fp8.quantize_fp8_per_tensor(x)),
        "fp8_per_token": lambda: fp8.dequantize_fp8(*fp8.quantize_fp8_per_token(x)),
        "fp8_per_group": lambda: fp8.dequantize_fp8_per_token_group(*fp8.quantize_fp8_per_token_group(x, 128), 128),
        "mxfp8": lambda: fp4.dequantize_mxfp8(*fp4.quantize_mxfp8(x)),
        "nvfp4": lambda: fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(x)),
    }[act]()
    np.testing.assert_array_equal(got, np.asarray(want))
    assert got.dtype == np.float32 and np.all(np.isfinite(got))


def test_quantize_activation_per_expert_static_scales(rng):
    w13, w2 = make_weights(rng)
    x = normal(rng, 4, 2, 64)  # [T, k, I] rows of stage 2, one expert each
    ids = jnp.array([[0, 1], [2, 0], [1, 2], [0, 2]], jnp.int32)
    a2 = np.array([0.01, 0.002, 0.004], np.float32)
    _, _, cfg = quantize_weights("nvfp4", w13, w2, a2_scale=a2)
    got = np.asarray(quantize_activation(cfg, x, 2, expert_ids=ids))
    for t in range(4):
        for j in range(2):
            g = np.float32(1) / a2[int(ids[t, j])]
            want = fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(x[t, j], g))
            np.testing.assert_array_equal(got[t, j], np.asarray(want))
    shared = np.asarray(quantize_activation(cfg, x, 2))  # no ids: the max over experts
    np.testing.assert_array_equal(shared, np.asarray(fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(x, 1 / a2.max()))))


def test_calibrated_static_scales_reproduce_dynamic_quantization(rng):
    x = normal(rng, 16, 128)
    for act, scheme in (("fp8_per_tensor", "fp8"), ("nvfp4", "nvfp4")):
        s = calibrate_activation_scale(act, x)
        static = QuantConfig(scheme, None, None, a13_scale=s)
        dynamic = QuantConfig(scheme, None, None)
        np.testing.assert_allclose(np.asarray(quantize_activation(static, x, 1)),
                                   np.asarray(quantize_activation(dynamic, x, 1)), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("scheme", [s if s in ("fp8_block", "nvfp4") else pytest.param(s, marks=pytest.mark.slow)
                                    for s in ("fp8", "fp8_block", "nvfp4", "mxfp4", "w4a8")])
def test_quantizing_a_few_experts_at_a_time_is_exact(rng, scheme, monkeypatch):
    """Large layers are quantized a few experts at a time (no whole float32 copy); the result
    is bit-identical to quantizing all experts at once."""
    import jax

    from jax_moe.quant import scheme as sc

    w13 = jnp.asarray(rng.standard_normal((5, 64, 256)), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((5, 256, 128)), jnp.bfloat16)
    whole = sc.quantize_weights(scheme, w13, w2)
    monkeypatch.setattr(sc, "_CHUNK_BYTES", 2 * 64 * 256 * 4)  # two experts of w13 at a time
    chunked = sc.quantize_weights(scheme, w13, w2)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(chunked), strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# =========================================================================== NaN / inf: one rule


def _with_bad(rng, shape, bad, where):
    x = normal(rng, *shape)
    x[where] = bad
    return x


BAD = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_nonfinite_rule_fp8_every_granularity(rng, bad):
    """E4M3 holds NaN: the element becomes NaN; the scale (over the finite values) and every other
    element are exactly what they are without it."""
    x = _with_bad(rng, (2, 4, 256), bad, (1, 2, 7))
    clean = x.copy()
    clean[1, 2, 7] = 0.0
    quantizers = {
        "per_tensor": (fp8.quantize_fp8_per_tensor, lambda q, s: fp8.dequantize_fp8(q, s)),
        "per_expert": (fp8.quantize_fp8_per_expert, lambda q, s: fp8.dequantize_fp8(q, s)),
        "per_token": (fp8.quantize_fp8_per_token, lambda q, s: fp8.dequantize_fp8(q, s)),
        "per_channel": (fp8.quantize_fp8_per_channel, lambda q, s: fp8.dequantize_fp8(q, s)),
        "block": (fp8.quantize_fp8_block, lambda q, s: fp8.dequantize_fp8_block(q, s)),
        "group": (fp8.quantize_fp8_per_token_group, lambda q, s: fp8.dequantize_fp8_per_token_group(q, s)),
        "static": (lambda v: (fp8.quantize_fp8_static(v, np.float32(0.01)), np.float32(0.01)),
                   lambda q, s: fp8.dequantize_fp8(q, s)),
    }
    for name, (quant, deq) in quantizers.items():
        q, s = quant(x)
        qc, sc = quant(clean)
        np.testing.assert_array_equal(np.asarray(s), np.asarray(sc), err_msg=name)
        d, dc = np.asarray(deq(q, s)), np.asarray(deq(qc, sc))
        assert np.isnan(d[1, 2, 7]), name
        mask = np.ones(d.shape, bool)
        mask[1, 2, 7] = False
        np.testing.assert_array_equal(d[mask], dc[mask], err_msg=name)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_nonfinite_rule_mxfp4_block_gets_the_e8m0_nan_byte(rng, bad):
    """The issue's repro: a block holding NaN gave 32 zeros (byte 253), an inf kept the inf and
    zeroed its 31 neighbours. Now the byte is 0xFF and the block is 32 NaNs; the other blocks are
    as without it."""
    x = _with_bad(rng, (3, 128), bad, (1, 40))
    clean = x.copy()
    clean[1, 40] = 0.0
    p, s = fp4.quantize_mxfp4(x)
    pc, sc = fp4.quantize_mxfp4(clean)
    s, sc = np.asarray(s), np.asarray(sc)
    assert s[1, 1] == 0xFF == fp4.E8M0_NAN
    s_others = np.ones(s.shape, bool)
    s_others[1, 1] = False
    np.testing.assert_array_equal(s[s_others], sc[s_others])
    d = np.asarray(fp4.dequantize_mxfp4(p, s))
    assert np.isnan(d[1, 32:64]).all()
    others = np.ones(d.shape, bool)
    others[1, 32:64] = False
    np.testing.assert_array_equal(d[others], np.asarray(fp4.dequantize_mxfp4(pc, sc))[others])
    # the exact block: ones with one NaN
    one = np.ones((1, 32), np.float32)
    one[0, 3] = bad
    p, s = fp4.quantize_mxfp4(one)
    assert int(np.asarray(s)[0, 0]) == 0xFF and np.isnan(np.asarray(fp4.dequantize_mxfp4(p, s))).all()


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_nonfinite_rule_mxfp8_element_is_nan_scale_from_finite_values(rng, bad):
    x = _with_bad(rng, (3, 128), bad, (1, 40))
    clean = x.copy()
    clean[1, 40] = 0.0
    q, s = fp4.quantize_mxfp8(x)
    qc, sc = fp4.quantize_mxfp8(clean)
    np.testing.assert_array_equal(np.asarray(s), np.asarray(sc))
    d, dc = np.array(fp4.dequantize_mxfp8(q, s)), np.array(fp4.dequantize_mxfp8(qc, sc))
    assert np.isnan(d[1, 40]) and np.isnan(d).sum() == 1
    d[1, 40] = dc[1, 40]
    np.testing.assert_array_equal(d, dc)


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_nonfinite_rule_nvfp4_block_scale_is_nan(rng, bad):
    x = _with_bad(rng, (3, 64), bad, (1, 20))
    clean = x.copy()
    clean[1, 20] = 0.0
    p, s, g = fp4.quantize_nvfp4(x)
    pc, sc, gc = fp4.quantize_nvfp4(clean)
    assert float(g) == float(gc)  # the global amax is over finite values
    s32, sc32 = f32(s).copy(), f32(sc)
    assert np.isnan(s32[1, 1]) and np.asarray(s).view(np.uint8)[1, 1] & 0x7F == 0x7F
    s32[1, 1] = sc32[1, 1]
    np.testing.assert_array_equal(s32, sc32)
    d = np.array(fp4.dequantize_nvfp4(p, s, g))
    assert np.isnan(d[1, 16:32]).all() and np.isnan(d).sum() == 16
    d[1, 16:32] = 0
    dc = np.array(fp4.dequantize_nvfp4(pc, sc, gc))
    dc[1, 16:32] = 0
    np.testing.assert_array_equal(d, dc)
    # per-expert global scales: only that expert's amax, over its finite values
    g_e = np.asarray(fp4.nvfp4_global_scale(x[:, None, :], per_expert=True))
    np.testing.assert_array_equal(g_e, np.asarray(fp4.nvfp4_global_scale(clean[:, None, :], per_expert=True)))


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
def test_nonfinite_rule_int4_group_scale_is_nan(rng, bad):
    x = _with_bad(rng, (3, 256), bad, (2, 200))
    clean = x.copy()
    clean[2, 200] = 0.0
    p, s = int4.quantize_int4(x, 128)
    pc, sc = int4.quantize_int4(clean, 128)
    s, sc = np.asarray(s), np.asarray(sc)
    assert np.isnan(s[2, 1]) and np.isfinite(np.delete(s.ravel(), 2 * 2 + 1)).all()
    d = np.asarray(int4.dequantize_int4(p, s, 128))
    assert np.isnan(d[2, 128:]).all() and np.isnan(d).sum() == 128
    np.testing.assert_array_equal(d[:2], np.asarray(int4.dequantize_int4(pc, sc, 128))[:2])


@pytest.mark.parametrize("act", ["fp8_per_tensor", "fp8_per_token", "fp8_per_group", "mxfp8", "nvfp4"])
def test_nonfinite_token_leaves_the_other_tokens_of_a_dynamic_activation_scale_alone(rng, act):
    """A NaN or inf in one token: that token is NaN (somewhere) after fake quantization, every
    other token bit-identical to the result without it, even with one scale for the tensor."""
    scheme = {"fp8_per_group": "fp8_block", "mxfp8": "mxfp4", "nvfp4": "nvfp4"}.get(act, "fp8")
    w13, w2 = make_weights(rng)
    _, _, cfg = quantize_weights(scheme, w13, w2, act=act)
    x = normal(rng, 6, 128)
    x[3, 5] = 0.0  # what the rule leaves out of every amax
    for bad in BAD:
        xb = x.copy()
        xb[3, 5] = bad
        got, want = np.asarray(quantize_activation(cfg, xb, 1)), np.asarray(quantize_activation(cfg, x, 1))
        assert np.isnan(got[3]).any()
        np.testing.assert_array_equal(np.delete(got, 3, 0), np.delete(want, 3, 0))


def test_nonfinite_weights_quantize_weights_and_validate(rng):
    """fp8 / fp8_block weights keep finite scales and carry the NaN in the element (accepted);
    the packed formats carry it in a block scale, which validate() refuses by name."""
    w13, w2 = make_weights(rng)
    w13 = np.array(w13)
    w13[2, 5, 9] = np.nan
    for scheme in ("fp8", "fp8_block"):
        q13, q2, cfg = quantize_weights(scheme, w13, w2)
        cfg.validate(3, 128, 128, True, w13=q13, w2=q2)
        deq, _ = dequantize_weights(cfg, q13, q2)
        assert np.isnan(np.asarray(deq)).sum() == 1 and np.isnan(np.asarray(deq)[2, 5, 9])
    for scheme, msg in (("nvfp4", "w13_scale holds NaN"), ("mxfp4", "w13_scale holds 0xFF"),
                        ("w4a8", "w13_scale holds NaN")):
        q13, q2, cfg = quantize_weights(scheme, w13, w2)
        with pytest.raises(ValueError, match=msg):
            cfg.validate(3, 128, 128, True, w13=q13, w2=q2)
        deq, _ = dequantize_weights(cfg, q13, q2)
        bad = np.isnan(np.asarray(deq))
        assert bad[2, 5, :].any() and not bad[:2].any() and not np.delete(bad[2], 5, 0).any()


def test_calibrated_scale_ignores_nonfinite_values(rng):
    x = normal(rng, 8, 64)
    xb = x.copy()
    xb[0, 0], xb[1, 1] = np.nan, np.inf
    for act in ("fp8_per_tensor", "nvfp4"):
        assert float(calibrate_activation_scale(act, xb)) == float(calibrate_activation_scale(act, np.where(np.isfinite(xb), xb, 0)))


def test_a_quantconfig_without_scales_points_at_the_constructor_helpers():
    with pytest.raises(ValueError, match=r"jax_moe\.quantize_weights\('fp8', w13, w2\)"):
        QuantConfig("fp8")
