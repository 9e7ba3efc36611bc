"""FlashInfer CUTLASS fused-MoE with FP8 128x128 block scales (DeepSeek-V3's format): the prepared
layout from its definition, and the runner against the pure-JAX backend on the same quantized weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.backends import flashinfer_cutlass as fic
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import quantize_weights
from helpers import jit_call as _jit, rel_err
from helpers import skip_unless_fi_scheme
from flashinfer_cases import (
    FP8_REL_TOL, jit_twice_matches_xla, optional_operands_match_xla, prepared_matches_xla, problem, three_expert_ids,
)


# ----------------------------------------------------------------------------- FP8 block scale


def _fp8_block_problem(rng, t, e, k, h, i, activation="silu"):
    """bf16 tokens and DeepSeek-style FP8 block-quantized weights (block 128x128, act
    fp8_per_group). Returns x, q13, q2, tw, ids, quant."""
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i, activation)
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
    x, w13, w2, _, _ = problem(rng, 1, e, k, h, i)
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
    jit_twice_matches_xla(x, q13, q2, tw, ids, quant, FP8_REL_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_fp8_block_other_activations_and_empty_experts(rng, activation):
    """Prepared once, applied under jit: other activations, and tokens routed to 3 of 16
    experts only (13 experts get no rows)."""
    skip_unless_fi_scheme("fp8_block")
    t, e, k, h, i = 64, 16, 2, 512, 256
    x, q13, q2, tw, _, quant = _fp8_block_problem(rng, t, e, k, h, i, activation)
    prepared_matches_xla(x, q13, q2, tw, three_expert_ids(rng, t, k), quant, MoEConfig(e, k, h, i, activation),
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
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.bfloat16).astype(jnp.float32)
    b2 = jnp.asarray(0.3 * rng.standard_normal((e, h)), jnp.bfloat16).astype(jnp.float32)
    q13, q2, quant = quantize_weights("fp8_block", 4 * w13.astype(jnp.float32), w2)
    optional_operands_match_xla(rng, x, q13, q2, tw, ids, dict(activation="swigluoai", w13_bias=b13, w2_bias=b2),
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
