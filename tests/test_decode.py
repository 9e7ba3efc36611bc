"""The decode path (jax_moe/decode.py): a gated MoE for few token slots in two kernels with no sort.
It computes the MoE's definition (float64 here) for every gated activation, both gate/up layouts,
biases and ids of -1, on the weights as stored and on the same weights transposed (N contiguous:
w13 [E, H, 2I], w2 [E, I, H]); the cutlass backend takes it for few slots and only then."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe import decode
from jax_moe.backends import cutlass as cb
from jax_moe.config import MoEConfig

from helpers import (SCHEME_TOL, need_native, np_moe, poison_memory, random_biases, random_routing, random_weights,
                     rel_err)

LAYERS = {  # name -> (E, k, H, I, activation, layout, biases)
    "qwen3-like silu": (128, 8, 256, 128, "silu", "concat", False),
    "gelu": (16, 2, 128, 64, "gelu", "concat", False),
    "gpt-oss-like": (32, 4, 192, 96, "swigluoai", "interleaved", True),
}


def _layer(rng, name, t, *, minus_one=0.0, dtype=jnp.bfloat16):
    e, k, h, i, act, layout, biases = LAYERS[name]
    cfg = MoEConfig(e, k, h, i, act, layout)
    w13, w2 = random_weights(rng, e, h, i, dtype=dtype)
    w, ids = random_routing(rng, t, e, k, minus_one=minus_one)
    x = jnp.asarray(rng.standard_normal((t, h)), dtype)
    b = random_biases(rng, cfg, scale=0.5) if biases else {}
    return cfg, x, w13, w2, w, ids, b


def _transposed(w13, w2):
    """The load-time layout of the same weights: w13 [E, H, 2I] and w2 [E, I, H], N contiguous."""
    return jnp.swapaxes(w13, 1, 2), jnp.swapaxes(w2, 1, 2)


def _definition(cfg, x, w13, w2, w, ids, b):
    return np_moe(x.astype(jnp.float32), w13.astype(jnp.float32), w2.astype(jnp.float32), w, ids,
                  cfg.activation, cfg.gate_up_layout, b.get("w13_bias"), b.get("w2_bias"),
                  alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)


# ----------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("t", [1, 2])
def test_reference_is_the_moe_definition(rng, name, t):
    cfg, x, w13, w2, w, ids, b = _layer(rng, name, t, minus_one=0.2)
    got = decode.decode_moe_reference(x, w13, w2, w, ids, cfg, **b)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, _definition(cfg, x, w13, w2, w, ids, b)) < SCHEME_TOL["bf16"]


def test_slots_of_other_ranks_contribute_nothing(rng):
    cfg, x, w13, w2, w, ids, b = _layer(rng, "qwen3-like silu", 1)
    none = jnp.full_like(ids, -1)
    assert np.all(np.asarray(decode.decode_moe_reference(x, w13, w2, w, none, cfg)) == 0)


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("t", [1, 2])
def test_reference_on_transposed_weights_is_the_moe_definition(rng, name, t):
    cfg, x, w13, w2, w, ids, b = _layer(rng, name, t, minus_one=0.2)
    w13t, w2t = _transposed(w13, w2)
    got = decode.decode_moe_reference(x, w13t, w2t, w, ids, cfg, **b, transposed=True)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, _definition(cfg, x, w13, w2, w, ids, b)) < SCHEME_TOL["bf16"]
    # one function in both layouts: the same roundings on the same products
    stored = decode.decode_moe_reference(x, w13, w2, w, ids, cfg, **b)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(stored))


@pytest.mark.parametrize("t, k, e, gated, serves", [
    (1, 8, 128, True, True), (2, 8, 128, True, True), (3, 8, 128, True, False),  # 24 slots > 16
    (1, 2, 8, True, True), (2, 2, 8, True, True), (3, 2, 8, True, False),        # 6 slots > 8 / 2
    (1, 8, 128, False, False), (0, 8, 128, True, False)])
def test_which_calls_take_the_decode_path(t, k, e, gated, serves):
    cfg = MoEConfig(e, k, 64, 32, "silu" if gated else "relu2")
    assert decode.serves(t, k, e, cfg) is serves


def test_cutlass_takes_it_for_few_slots_only(rng, monkeypatch):
    calls = []
    real = decode.decode_moe
    monkeypatch.setattr(decode, "decode_moe", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    cfg, x, w13, w2, _, _, _ = _layer(rng, "qwen3-like silu", 4)
    for t in (1, 2, 4):
        w, ids = random_routing(rng, t, cfg.num_experts, cfg.top_k)
        out = cb.apply(x[:t], w13, w2, w, ids, cfg)
        assert rel_err(out, _definition(cfg, x[:t], w13, w2, w, ids, {})) < SCHEME_TOL["bf16"]
    cb.apply(x[:1], w13, w2, w[:1], ids[:1], cfg, tile="pingpong_64x128")  # a forced tile: the grouped GEMMs
    assert calls == [1, 2]


def test_bad_arguments_are_named(rng):
    cfg, x, w13, w2, w, ids, _ = _layer(rng, "gelu", 1)
    with pytest.raises(ValueError, match="topk_ids"):
        decode.decode_moe(x, w13, w2, w, ids.astype(jnp.float32), cfg)
    with pytest.raises(ValueError, match="w13"):
        decode.decode_moe(x, w13[:, :, :-8], w2, w, ids, cfg)
    with pytest.raises(ValueError, match="gated"):
        decode.decode_moe(x, w13, w2, w, ids, MoEConfig(16, 2, 128, 64, "relu2"))


def test_bad_transposed_weights_are_named_with_the_shape_they_need(rng):
    cfg, x, w13, w2, w, ids, _ = _layer(rng, "gelu", 1)  # E = 16, H = 128, I = 64
    w13t, w2t = _transposed(w13, w2)
    with pytest.raises(ValueError, match=r"w2 must be \[E, I, H\] = \[16, 64, 128\]"):
        decode.decode_moe(x, w13t, w2, w, ids, cfg, transposed=True)  # w2 as stored
    with pytest.raises(ValueError, match=r"w13 must be \[E, H, 2I\] = \[16, 128, 2I\]"):
        decode.decode_moe(x, w13t[:, :-8], w2t, w, ids, cfg, transposed=True)  # H of 120
    with pytest.raises(ValueError, match=r"w13 must be \[E, H, 2I\] = \[16, 128, 2I\]"):
        decode.decode_moe(x, w13t[:, :, :-1], w2t, w, ids, cfg, transposed=True)  # 127 columns: no 2I
    with pytest.raises(ValueError, match=r"w2 must have rank 3 \[E, I, H\]"):
        decode.decode_moe_reference(x, w13t, w2t[0], w, ids, cfg, transposed=True)
    with pytest.raises(ValueError, match=r"w2 must be \[E, H, I\] = \[16, 128, 64\]"):
        decode.decode_moe(x, w13, w2t, w, ids, cfg)  # transposed weights without transposed=True


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("t", [1, 2, 5])
def test_cuda_kernels_are_the_definition(rng, name, t):
    need_native("cuda")
    cfg, x, w13, w2, w, ids, b = _layer(rng, name, t, minus_one=0.15)
    got = jax.jit(lambda *a: decode.decode_moe(*a, cfg, **b))(x, w13, w2, w, ids)
    want = _definition(cfg, x, w13, w2, w, ids, b)
    assert rel_err(got, want) < SCHEME_TOL["bf16"]
    # the same roundings as the jnp reference: agreement far inside bf16's bound
    assert rel_err(got, decode.decode_moe_reference(x, w13, w2, w, ids, cfg, **b)) < 3e-3


@pytest.mark.gpu
def test_cuda_kernels_at_gpt_oss_size_with_float32_output(rng):
    need_native("cuda")
    e, k, h, i = 128, 4, 2880, 2880
    cfg = MoEConfig(e, k, h, i, "swigluoai", "interleaved")
    # drawn on the device: 3.2 G normal samples in NumPy took a minute of the suite
    k13, k2 = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    w13 = jax.random.normal(k13, (e, 2 * i, h), jnp.bfloat16) / jnp.bfloat16(np.sqrt(h))
    w2 = jax.random.normal(k2, (e, h, i), jnp.bfloat16) / jnp.bfloat16(np.sqrt(i))
    w, ids = random_routing(rng, 1, e, k)
    x = jnp.asarray(rng.standard_normal((1, h)), jnp.float32)
    b = random_biases(rng, cfg, scale=0.5)
    got = jax.jit(lambda *a: decode.decode_moe(*a, cfg, **b))(x, w13, w2, w, ids)
    assert got.dtype == jnp.float32
    used = np.asarray(ids)[0]  # the definition on the k experts used (float64 copies of all 128 would be 17 GB)
    local = {name: v[used] for name, v in b.items()}
    want = _definition(cfg, x.astype(jnp.bfloat16), w13[used], w2[used], w, jnp.arange(k, dtype=jnp.int32)[None],
                       local)
    assert rel_err(got, want) < SCHEME_TOL["bf16"]


@pytest.mark.gpu
def test_cutlass_decode_matches_its_grouped_path(rng):
    """The cutlass backend at T=1 (decode path) against the same call with a forced tile (the
    grouped GEMMs): one function, so they agree to bf16 rounding."""
    need_native("cuda")
    cfg, x, w13, w2, w, ids, b = _layer(rng, "gpt-oss-like", 2)
    fast = jax.jit(lambda *a: cb.apply(*a, cfg, **b))(x, w13, w2, w, ids)
    grouped = jax.jit(lambda *a: cb.apply(*a, cfg, tile="coop_128x128", **b))(x, w13, w2, w, ids)
    assert rel_err(fast, grouped) < 1e-2


@pytest.mark.gpu
def test_under_command_buffers(command_buffer_check):
    need_native("cuda")
    assert command_buffer_check("cutlass", """
        cases = [(1, 8, *(jnp.asarray(rng.standard_normal(s) * 0.05, jnp.bfloat16)
                          for s in ((128, 256, 256), (128, 256, 128))), None)]
    """, 2e-2) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("t", [1, 2])
def test_cuda_kernels_on_transposed_weights_are_the_definition(rng, name, t):
    need_native("cuda")
    cfg, x, w13, w2, w, ids, b = _layer(rng, name, t, minus_one=0.15)
    w13t, w2t = _transposed(w13, w2)
    f = jax.jit(lambda *a: decode.decode_moe(*a, cfg, **b, transposed=True))
    poison_memory(jax.eval_shape(f, x, w13t, w2t, w, ids))
    got = f(x, w13t, w2t, w, ids)
    assert rel_err(got, _definition(cfg, x, w13, w2, w, ids, b)) < SCHEME_TOL["bf16"]
    # the same function as the kernels on the stored layout: only the order of float32 sums differs
    stored = jax.jit(lambda *a: decode.decode_moe(*a, cfg, **b))(x, w13, w2, w, ids)
    assert rel_err(got, stored) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("act, layout", [("silu", "concat"), ("swigluoai", "interleaved")])
@pytest.mark.parametrize("h, i, t", [
    (2048, 768, 1), (2048, 768, 2), (2048, 768, 3),  # GEMM2 in chunks of 16, 32 and 64 columns
    (2048, 768, 5),                                   # GEMM2 in 160 blocks of 64 columns
    (2056, 776, 1),                                   # the last chunk of both cut short by the end of H and I
    (2056, 776, 2),                                   # GEMM1 in chunks of 64 outputs, the last one of 8
    (2048, 2056, 1),                                  # GEMM2's threads 65 rows long: 8 in flight, the last cut short
    (200, 40, 2)])                                    # the narrowest chunks: 8 outputs, 8 columns
def test_cuda_kernels_on_transposed_weights_at_qwen3_size(rng, act, layout, h, i, t):
    """Qwen3-30B's H and I: GEMM1 in 24 chunks of 32 outputs per slot, each chunk's 2048 rows split over
    64 row groups of 32 rows; float32 output; ids of -1 among the slots. On 132 SMs, GEMM2 keeps eight
    rows in flight per thread where its grid has no more blocks than SMs and each thread streams 64 rows
    or more (T = 3, I = 776 at T = 2, and I = 2056), four in the other cases. GEMM1 reads 256 bytes a row,
    in 64-output chunks, where 32-output ones would launch more than two blocks per SM and 64-output ones
    still fill every SM (T = 2, and I = 2056)."""
    need_native("cuda")
    e, k = 16, 8
    cfg = MoEConfig(e, k, h, i, act, layout)
    k13, k2 = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    w13t = jax.random.normal(k13, (e, h, 2 * i), jnp.bfloat16) / jnp.bfloat16(np.sqrt(h))
    w2t = jax.random.normal(k2, (e, i, h), jnp.bfloat16) / jnp.bfloat16(np.sqrt(i))
    w, ids = random_routing(rng, t, e, k, minus_one=0.15)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    b = random_biases(rng, cfg, scale=0.5) if act == "swigluoai" else {}
    f = jax.jit(lambda *a: decode.decode_moe(*a, cfg, **b, transposed=True))
    poison_memory(jax.eval_shape(f, x, w13t, w2t, w, ids))
    got = f(x, w13t, w2t, w, ids)
    assert got.dtype == jnp.float32
    w13, w2 = jnp.swapaxes(w13t, 1, 2), jnp.swapaxes(w2t, 1, 2)
    assert rel_err(got, _definition(cfg, x.astype(jnp.bfloat16), w13, w2, w, ids, b)) < SCHEME_TOL["bf16"]
    stored = jax.jit(lambda *a: decode.decode_moe(*a, cfg, **b))(x, w13, w2, w, ids)
    assert rel_err(got, stored) < 3e-3


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 5, 24])
def test_cuda_kernels_on_transposed_weights_for_any_top_k(rng, k):
    """GEMM2 sums up to 16 slots at a time, one team of warps each: k = 5 leaves a warp idle, k = 24
    takes two passes."""
    need_native("cuda")
    e, h, i, t = 64, 256, 128, 2
    cfg = MoEConfig(e, k, h, i, "silu", "concat")
    w13, w2 = random_weights(rng, e, h, i, dtype=jnp.bfloat16)
    w, ids = random_routing(rng, t, e, k, minus_one=0.15)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13t, w2t = _transposed(w13, w2)
    f = jax.jit(lambda *a: decode.decode_moe(*a, cfg, transposed=True))
    poison_memory(jax.eval_shape(f, x, w13t, w2t, w, ids))
    got = f(x, w13t, w2t, w, ids)
    assert rel_err(got, _definition(cfg, x, w13, w2, w, ids, {})) < SCHEME_TOL["bf16"]
