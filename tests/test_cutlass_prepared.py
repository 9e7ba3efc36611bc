"""The cutlass backend's load-time layout: ``cutlass.prepare`` / ``cutlass.apply_prepared`` and
``MoEBlock.prepare()`` on Hopper.

A gated layer stored ``[gate; up]`` is prepared with its gate and up rows interleaved where
GEMM1 can take the activation into its epilogue (bf16, and FP8 with static activation scales,
per-channel weight scales reordered with their rows); everything else keeps its order. bf16
weights are then transposed, N contiguous (the faster weight stream); FP8 weights stay K contiguous.
The prepared layer computes the same function as the stored one: checked against the float64
definition on the stored weights (the kernels' jnp references on CPU, the kernels on the GPU).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp
from flax import nnx

from jax_moe import MoEBlock
from jax_moe.backends import cutlass as cb
from jax_moe.quant.scheme import QuantConfig

from cutlass_cases import FP8_REL_TOL, H100, REL_TOL, moe_problem, simulate_module, small_cfg
from helpers import np_moe, poison_memory, random_biases, rel_err, skip_unless_available


def _layer(rng, t, e=8, k=2, h=64, i=32):
    """(cfg, x, w13, w2, topk_weights, topk_ids, biases): a random bf16 silu layer, [gate; up]."""
    cfg = small_cfg(e, k, h, i)
    x, w13, w2, tw, ids = moe_problem(rng, t, e, k, h, i)
    return cfg, x, w13, w2, tw, ids, random_biases(rng, cfg, scale=0.5)


def test_prepare_interleaves_a_concatenated_gated_bf16_layer_and_its_bias(rng):
    cfg, _, w13, w2, _, _, b = _layer(rng, 1)
    p = cb.prepare(w13, w2, cfg, **b, transpose=False)
    assert isinstance(p, cb.Prepared) and not p.transposed
    assert p.cfg == dataclasses.replace(cfg, gate_up_layout="interleaved")
    i = cfg.intermediate_size
    np.testing.assert_array_equal(np.asarray(p.w13[:, 0::2]), np.asarray(w13[:, :i]))  # row 2i: gate i
    np.testing.assert_array_equal(np.asarray(p.w13[:, 1::2]), np.asarray(w13[:, i:]))  # row 2i + 1: up i
    np.testing.assert_array_equal(np.asarray(p.w13_bias[:, 0::2]), np.asarray(b["w13_bias"][:, :i]))
    np.testing.assert_array_equal(np.asarray(p.w13_bias[:, 1::2]), np.asarray(b["w13_bias"][:, i:]))
    assert p.w2 is w2 and p.w2_bias is b["w2_bias"] and p.quant is None


def test_prepare_transposes_bf16_weights_after_the_interleave(rng):
    """By default bf16 weights end N contiguous: w13 [E, H, 2I] with gate and up columns
    alternating, w2 [E, I, H]; the biases keep their shapes."""
    cfg, _, w13, w2, _, _, b = _layer(rng, 1)
    p = cb.prepare(w13, w2, cfg, **b)
    il = cb.prepare(w13, w2, cfg, **b, transpose=False)
    assert p.transposed and p.cfg == il.cfg
    np.testing.assert_array_equal(np.asarray(p.w13), np.asarray(jnp.swapaxes(il.w13, 1, 2)))
    np.testing.assert_array_equal(np.asarray(p.w2), np.asarray(jnp.swapaxes(w2, 1, 2)))
    np.testing.assert_array_equal(np.asarray(p.w13_bias), np.asarray(il.w13_bias))
    assert p.w2_bias is b["w2_bias"]


def test_fp8_weights_stay_k_contiguous(rng):
    cfg, _, w13, w2, _, _, _ = _layer(rng, 1)
    quant = QuantConfig("fp8", w13_scale=0.5, w2_scale=0.25, act="fp8_per_tensor", a13_scale=1.0, a2_scale=1.0)
    w13, w2 = w13.astype(jnp.float8_e4m3fn), w2.astype(jnp.float8_e4m3fn)
    assert not cb.prepare(w13, w2, cfg, quant).transposed
    with pytest.raises(ValueError, match="transpose=True is bf16 only"):
        cb.prepare(w13, w2, cfg, quant, transpose=True)


def _fp8_layer(rng, t, e=8, k=2, h=64, i=32, per_channel=True):
    """(cfg, x, q13, q2, topk_weights, topk_ids, quant): a silu layer stored ``[gate; up]`` in FP8,
    per-channel ([E, N, 1]) or per-expert weight scales, static activation scales."""
    from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights

    cfg = small_cfg(e, k, h, i)
    x, w13, w2, tw, ids = moe_problem(rng, t, e, k, h, i)
    a13 = calibrate_activation_scale("fp8_per_tensor", x.astype(jnp.float32))
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a13 / 4,
                                      weight_scale="per_channel" if per_channel else "per_expert")
    assert jnp.ndim(quant.w13_scale) == (3 if per_channel else 1)
    return cfg, x, q13, q2, tw, ids, quant


def test_prepare_interleaves_a_static_fp8_layer_and_its_per_channel_scales(rng):
    cfg, _, q13, q2, _, _, quant = _fp8_layer(rng, 1)
    p = cb.prepare(q13, q2, cfg, quant)
    assert not p.transposed and p.cfg == dataclasses.replace(cfg, gate_up_layout="interleaved")
    i = cfg.intermediate_size
    for got, stored in ((p.w13, q13), (p.quant.w13_scale, quant.w13_scale)):
        got, stored = np.asarray(got.astype(jnp.float32)), np.asarray(stored.astype(jnp.float32))
        np.testing.assert_array_equal(got[:, 0::2], stored[:, :i])  # row 2i: gate i
        np.testing.assert_array_equal(got[:, 1::2], stored[:, i:])  # row 2i + 1: up i
    assert p.w2 is q2 and p.quant.w2_scale is quant.w2_scale and p.quant.a2_scale is quant.a2_scale


@pytest.mark.parametrize("case", ["already interleaved", "relu2", "fp8 per-token"])
def test_prepare_keeps_the_order_where_the_epilogue_does_not_take_the_activation(rng, case):
    cfg, _, w13, w2, _, _, _ = _layer(rng, 1)
    quant = None
    if case == "already interleaved":
        cfg = dataclasses.replace(cfg, gate_up_layout="interleaved")
    elif case == "relu2":
        cfg = small_cfg(activation="relu2")
        w13 = w13[:, : cfg.intermediate_size]
    else:  # dynamic activation scales: GEMM1's output is quantized per row, after the activation
        quant = QuantConfig("fp8", w13_scale=0.5, w2_scale=0.25, act="fp8_per_token")
        w13, w2 = w13.astype(jnp.float8_e4m3fn), w2.astype(jnp.float8_e4m3fn)
    p = cb.prepare(w13, w2, cfg, quant, transpose=False)
    assert p.w13 is w13 and p.w2 is w2 and p.cfg == cfg and p.quant is quant


def test_prepared_weights_are_a_pytree_that_jit_takes(rng):
    cfg, x, w13, w2, tw, ids, b = _layer(rng, 3)
    p = cb.prepare(w13, w2, cfg, **b)
    leaves, tree = jax.tree.flatten(p)
    assert len(leaves) == 4  # w13, w2 and the two biases; the config and the layout are static
    assert jax.tree.unflatten(tree, leaves).cfg == p.cfg and jax.tree.unflatten(tree, leaves).transposed
    jax.jit(cb.apply_prepared)(x, p, tw, ids).block_until_ready()


@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("t", [1, 37])
def test_apply_prepared_is_the_stored_layers_function_on_cpu(rng, t, transpose):
    """``sum_j w_j (W2[e] silu-and-mul(W13[e] x + b13[e]) + b2[e])`` in float64 on the stored
    ``[gate; up]`` weights; the kernels' jnp references run here."""
    cfg, x, w13, w2, tw, ids, b = _layer(rng, t)
    out = jax.jit(cb.apply_prepared)(x, cb.prepare(w13, w2, cfg, **b, transpose=transpose), tw, ids)
    assert out.dtype == x.dtype and out.shape == x.shape
    want = np_moe(x, w13, w2, tw, ids, "silu", "concat", b["w13_bias"], b["w2_bias"])
    assert rel_err(out, want) < REL_TOL


@pytest.mark.parametrize("change, match", [
    (dict(w13=lambda w: w.astype(jnp.float32)), "w13 must be bfloat16"),
    (dict(w13=lambda w: w[0]), "w13 must have rank 3"),
    (dict(w2=lambda w: w[:, :, :16]), r"w2 must have shape \[8, 64, 32\]"),
    (dict(w13=lambda w: w[:, :48]), r"w13 must have shape \[8, 64, 64\]"),
    (dict(w13_bias=lambda b: b[:, :10]), "w13_bias must have shape"),
])
def test_prepare_names_the_argument_it_cannot_take(rng, change, match):
    cfg, _, w13, w2, _, _, b = _layer(rng, 1)
    args = dict(w13=w13, w2=w2, **b)
    for name, f in change.items():
        args[name] = f(args[name])
    with pytest.raises(ValueError, match=match):
        cb.prepare(args.pop("w13"), args.pop("w2"), cfg, **args)


def test_apply_names_transposed_weights_it_cannot_take(rng):
    cfg, x, w13, w2, tw, ids, _ = _layer(rng, 2)
    w13t, w2t = jnp.swapaxes(w13, 1, 2), jnp.swapaxes(w2, 1, 2)
    with pytest.raises(ValueError, match=r"transposed w13 must be \[E, H, 2I\] and w2 \[E, I, H\]"):
        cb.apply(x, w13t, w2, tw, ids, cfg, transposed=True)
    with pytest.raises(ValueError, match="shape mismatch"):
        cb.apply(x[:, :32], w13t, w2t, tw, ids, cfg, transposed=True)
    quant = QuantConfig("fp8", w13_scale=0.5, w2_scale=0.25, act="fp8_per_tensor", a13_scale=1.0, a2_scale=1.0)
    with pytest.raises(ValueError, match="transposed weights are bf16 only"):
        cb.apply(x, w13t.astype(jnp.float8_e4m3fn), w2t.astype(jnp.float8_e4m3fn), tw, ids, cfg, quant=quant,
                 transposed=True)


def test_apply_prepared_takes_only_its_own_prepared_weights(rng):
    _, x, w13, w2, tw, ids, _ = _layer(rng, 2)
    with pytest.raises(TypeError, match="prepared must come from cutlass.prepare"):
        cb.apply_prepared(x, {"w13": w13, "w2": w2}, tw, ids)


def test_moe_block_prepare_picks_cutlass_on_hopper_and_keeps_the_blocks_function(rng, monkeypatch):
    """On an H100 with the CUTLASS module (simulated here; the kernels' references run on CPU)
    ``MoEBlock.prepare()`` repacks for ``cutlass`` once, and the block computes what it did."""
    simulate_module(monkeypatch)
    block = MoEBlock(64, 32, 8, 2, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.bfloat16)
    before = nnx.jit(lambda m, v: m(v))(block, x)
    assert block.prepare(device=H100) == "cutlass"
    prepared = block.prepared.get_value()
    assert block.w13 is None and prepared.cfg.gate_up_layout == "interleaved" and prepared.transposed
    after = nnx.jit(lambda m, v: m(v))(block, x)
    assert rel_err(after, before) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("transpose", [True, False])
@pytest.mark.parametrize("t, e, k", [(1, 128, 8), (16, 128, 8), (64, 128, 8), (1000, 16, 4)])
def test_apply_prepared_on_the_gpu_is_the_stored_layers_function(rng, t, e, k, transpose):
    """On the kernels: one token (the decode path), a few rows per expert (GEMM1 on a pingpong
    tile, the activation in its epilogue) and many (the activation kernel on interleaved rows),
    on both layouts, outputs poisoned first."""
    skip_unless_available(cb)
    cfg, x, w13, w2, tw, ids, b = _layer(rng, t, e, k, 256, 128)
    p = cb.prepare(w13, w2, cfg, **b, transpose=transpose)
    f = jax.jit(cb.apply_prepared)
    poison_memory(jax.eval_shape(f, x, p, tw, ids))
    out = f(x, p, tw, ids)
    want = np_moe(x, w13, w2, tw, ids, "silu", "concat", b["w13_bias"], b["w2_bias"])
    assert rel_err(out, want) < REL_TOL
    stored = jax.jit(lambda *a: cb.apply(*a, cfg, **b))(x, w13, w2, tw, ids)
    assert rel_err(out, stored) < REL_TOL


@pytest.mark.parametrize("per_channel", [True, False])
def test_a_prepared_static_fp8_layer_is_the_stored_layers_function_on_cpu(rng, per_channel):
    """The xla backend's dequantized forward on the stored FP8 weights; the kernels' jnp references run here."""
    from jax_moe.backends import xla

    cfg, x, q13, q2, tw, ids, quant = _fp8_layer(rng, 37, per_channel=per_channel)
    out = jax.jit(cb.apply_prepared)(x, cb.prepare(q13, q2, cfg, quant), tw, ids)
    assert rel_err(out, xla.apply(x, q13, q2, tw, ids, cfg, quant=quant)) < FP8_REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("t, e, k", [(16, 128, 8), (1000, 16, 4)])
def test_a_prepared_static_fp8_layer_on_the_gpu_is_the_stored_layers_function(rng, t, e, k, per_channel):
    """GEMM1 with the activation and the output quantization in its epilogue, on every tile the
    pick reaches here, against the xla backend's dequantized forward on the stored weights;
    outputs poisoned first."""
    from jax_moe.backends import xla
    from jax_moe.backends.cutlass_act_gemm import fuses_activation

    skip_unless_available(cb)
    cfg, x, q13, q2, tw, ids, quant = _fp8_layer(rng, t, e, k, 256, 128, per_channel=per_channel)
    p = cb.prepare(q13, q2, cfg, quant)
    assert fuses_activation(p.cfg, p.quant)
    f = jax.jit(cb.apply_prepared)
    poison_memory(jax.eval_shape(f, x, p, tw, ids))
    out = f(x, p, tw, ids)
    assert not np.isnan(np.asarray(out.astype(jnp.float32))).any()
    assert rel_err(out, xla.apply(x, q13, q2, tw, ids, cfg, quant=quant)) < FP8_REL_TOL
