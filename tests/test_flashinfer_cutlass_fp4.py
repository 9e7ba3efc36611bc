"""FlashInfer CUTLASS fused-MoE with 4-bit weights: MXFP4 W4A16 (GPT-OSS's format) and W4A8 (int4 x FP8):
the prepared layouts decoded back to the checkpoint, an emulated runner, and the runner against the
pure-JAX backend on the same quantized weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.backends import flashinfer_cutlass as fic
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from helpers import jit_call as _jit, np_moe, rel_err
from helpers import skip_unless_fi_scheme
from flashinfer_cases import (
    FP8_REL_TOL, REL_TOL, compiled_tactic_errors, gemm2_inputs, gpt_oss_problem, jit_twice_matches_xla,
    optional_operands_match_xla, prepared_matches_xla, problem, routing, three_expert_ids,
)


# ----------------------------------------------------------------------------- MXFP4 W4A16


def _mxfp4_problem(rng, t, e, k, h, i, activation="silu", *, gpt_oss=False):
    """bf16 tokens and MXFP4-quantized weights (act bf16). ``gpt_oss``: swigluoai with
    interleaved gate/up rows, biases on both GEMMs and pre-activations large enough that its
    clamps bite (as :func:`gpt_oss_problem`). Returns x, q13, q2, tw, ids and fused_experts'
    keyword arguments (quant included)."""
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    n1 = 2 * i if fic.GATED[activation] else i
    w13 = jnp.asarray((4 if gpt_oss else 1) * rng.standard_normal((e, n1, h)) / np.sqrt(h), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.float32)
    q13, q2, quant = quantize_weights("mxfp4", w13, w2)
    tw, ids = routing(rng, t, e, k)
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
    errors = compiled_tactic_errors(x, prep, tw, ids, ref)
    assert errors
    bad = {d: err for d, err in errors.items() if not err < REL_TOL}
    assert not bad, bad


# ----------------------------------------------------------------------------- W4A8 (int4 x FP8)


def _w4a8_problem(rng, t, e, k, h, i, activation="silu", *, static_a13=True):
    """bf16 tokens and int4 group-128 weights (QuantConfig("w4a8", act="fp8_per_tensor")) with
    calibrated static activation scales (a13 None with ``static_a13=False``: dynamic). Returns
    x, q13, q2, tw, ids, quant."""
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i, activation)
    a13 = calibrate_activation_scale("fp8_per_tensor", x) if static_a13 else None
    inter = jnp.take_along_axis(gemm2_inputs(x, w13, i, activation), ids[:, :, None], axis=1)  # routed [T, k, I]
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
    x, w13, w2, _, _ = problem(rng, 1, e, k, h, i)
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
    out1 = jit_twice_matches_xla(x, q13, q2, tw, ids, quant, FP8_REL_TOL)
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
    prepared_matches_xla(x, q13, q2, tw, three_expert_ids(rng, t, k), quant, MoEConfig(e, k, h, i, activation),
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
    optional_operands_match_xla(rng, x, q13, q2, tw, ids, dict(activation="swigluoai", w13_bias=b13, w2_bias=b2),
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
    errors = compiled_tactic_errors(x, prep, tw, ids, ref)
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
