"""Spec tests for jax_moe.layouts around the permutations: each under jit and over a leading expert
axis, the padding rules from a table, and the alpha scales on concrete numbers. The permutations
themselves: test_layouts.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import layouts as L
from layout_cases import assert_bits_equal, make, roundup


# ------------------------------------------------------------------ jit and a leading expert axis
def _cases():
    """(name, function of one expert's array, input shape per expert, dtype)."""
    return [
        ("swap_w13_to_w31", L.swap_w13_to_w31, (8, 4), "float8_e4m3fn"),
        ("swap_w31_to_w13", L.swap_w31_to_w13, (8, 4), "bfloat16"),
        ("reorder_rows_for_gated_act_gemm", L.reorder_rows_for_gated_act_gemm, (8, 4), "float8_e4m3fn"),
        ("undo_reorder_rows_for_gated_act_gemm", L.undo_reorder_rows_for_gated_act_gemm, (8, 4), "uint8"),
        ("swap_row_pairs", L.swap_row_pairs, (8, 4), "uint8"),
        ("shuffle_matrix_a", L.shuffle_matrix_a, (64, 4), "uint8"),
        ("unshuffle_matrix_a", functools.partial(L.unshuffle_matrix_a, epilogue_tile_m=64), (32, 4), "float8_e4m3fn"),
        ("shuffle_matrix_sf_a", L.shuffle_matrix_sf_a, (128, 6), "uint8"),
        ("unshuffle_matrix_sf_a", functools.partial(L.unshuffle_matrix_sf_a, rows=128, cols=6),
         (1, 2, 32, 4, 4), "uint8"),
        ("block_scale_interleave", L.block_scale_interleave, (130, 5), "float8_e4m3fn"),
        ("block_scale_deinterleave", functools.partial(L.block_scale_deinterleave, rows=130, cols=5),
         (2, 2, 32, 4, 4), "uint8"),
        ("swizzle_mxfp4_scales", L.swizzle_mxfp4_scales, (130, 5), "uint8"),
        ("unswizzle_mxfp4_scales", functools.partial(L.unswizzle_mxfp4_scales, n=130, k=160),
         (2, 2, 32, 4, 4), "uint8"),
        ("pad_axis", functools.partial(L.pad_axis, size=7, axis=-1), (3, 5), "float8_e4m3fn"),
        ("pad_axis_to_multiple", functools.partial(L.pad_axis_to_multiple, multiple=16, axis=-2), (5, 3), "uint8"),
        ("pad_gate_up", functools.partial(L.pad_gate_up, intermediate_padded=5), (6, 3), "bfloat16"),
        ("unpad_gate_up", functools.partial(L.unpad_gate_up, intermediate=3), (10, 3), "float32"),
        ("interleave_fp4_weights_for_sm90_mixed_gemm", L.interleave_fp4_weights_for_sm90_mixed_gemm,
         (32, 32), "uint8"),
        ("deinterleave_fp4_weights_for_sm90_mixed_gemm", L.deinterleave_fp4_weights_for_sm90_mixed_gemm,
         (16, 64), "uint8"),
        ("interleave_int4_weights_for_sm90_mixed_gemm", L.interleave_int4_weights_for_sm90_mixed_gemm,
         (32, 32), "uint8"),
        ("deinterleave_int4_weights_for_sm90_mixed_gemm", L.deinterleave_int4_weights_for_sm90_mixed_gemm,
         (16, 64), "uint8"),
        ("interleave_scales_for_sm90_mixed_gemm", L.interleave_scales_for_sm90_mixed_gemm, (64, 8), "uint8"),
        ("deinterleave_scales_for_sm90_mixed_gemm", L.deinterleave_scales_for_sm90_mixed_gemm,
         (1, 2, 16, 16), "uint8"),
    ]


@pytest.mark.parametrize("name,fn,shape,dtype", _cases(), ids=[c[0] for c in _cases()])
def test_jit_and_expert_axis(rng, name, fn, shape, dtype):
    e = 3
    x = make(rng, (e,) + shape, dtype)
    batched = jax.jit(fn)(x)
    single = [np.asarray(fn(x[j])) for j in range(e)]
    assert_bits_equal(batched, np.stack(single))


def test_alphas_under_jit(rng):
    w13s, w2s = make(rng, (4,)), make(rng, (4,))
    a1, a2 = jnp.float32(0.5), jnp.float32(0.25)
    for fn in (L.fp8_alpha_scales, L.trtllm_fp8_output_scales, L.nvfp4_alpha_scales):
        eager = fn(w13s, a1, w2s, a2)
        jitted = jax.jit(fn)(w13s, a1, w2s, a2)
        for u, v in zip(eager, jitted):
            assert u.dtype == jnp.float32
            assert_bits_equal(u, v)


# ------------------------------------------------------------------ padding rules
# backend -> (intermediate multiple, hidden multiple), as vLLM pads GPT-OSS MXFP4
MXFP4_RULES = {
    "flashinfer_trtllm": (256, 256),
    "flashinfer_cutlass": (256, 256),
    "marlin": (128, 256),
    "xla": (64, 1),
    "cutlass": (64, 1),
    "some_future_backend": (64, 1),
}


@pytest.mark.parametrize("backend", sorted(MXFP4_RULES))
def test_mxfp4_padding_table(backend):
    mi, mh = MXFP4_RULES[backend]
    assert tuple(L.mxfp4_padding(backend)) == (mi, mh)
    for h, i in [(2880, 2880), (2880, 360), (4096, 1440), (100, 90)]:
        assert L.mxfp4_padded_sizes(backend, h, i) == (roundup(h, mh), roundup(i, mi))


def test_mxfp4_padding_gpt_oss_numbers():
    # GPT-OSS: H = I = 2880
    assert L.mxfp4_padded_sizes("flashinfer_trtllm", 2880, 2880) == (3072, 3072)
    assert L.mxfp4_padded_sizes("flashinfer_cutlass", 2880, 2880) == (3072, 3072)
    assert L.mxfp4_padded_sizes("marlin", 2880, 2880) == (3072, 2944)
    assert L.mxfp4_padded_sizes("xla", 2880, 2880) == (2880, 2880)
    assert L.mxfp4_padded_sizes("xla", 2880, 720) == (2880, 768)


def test_fp8_padding_rule():
    assert L.FP8_INTERMEDIATE_ALIGN == 16
    for i, want in [(16, 16), (17, 32), (1, 16), (1408, 1408), (1400, 1408), (96, 96)]:
        assert L.fp8_padded_intermediate(i) == want


def test_constants():
    assert L.EPILOGUE_TILE_M == 128
    assert (L.SF_TILE_M, L.SF_TILE_K, L.SF_TILE_OUTER_M, L.SF_TILE_INNER_M) == (128, 4, 32, 4)
    assert (L.MIXED_GEMM_ROW_GROUP, L.MIXED_GEMM_ROW_HALF, L.MIXED_GEMM_K_CHUNK) == (16, 8, 64)
    assert (L.MIXED_GEMM_SCALE_ROWS, L.MIXED_GEMM_SCALE_K, L.MIXED_GEMM_SCALE_LINE_BYTES) == (64, 128, 16)


def test_round_up():
    assert [L.round_up(x, 16) for x in (0, 1, 16, 17, 31, 32)] == [0, 16, 16, 32, 32, 32]
    with pytest.raises(ValueError, match="multiple"):
        L.round_up(3, 0)


def test_pad_axis_and_multiple(rng):
    x = make(rng, (5, 3), "float8_e4m3fn")
    got = L.pad_axis_to_multiple(x, 4, axis=-2)
    want = np.concatenate([np.asarray(x), np.zeros((3, 3), np.asarray(x).dtype)])
    assert_bits_equal(got, want)
    assert_bits_equal(L.pad_axis(x, 3, axis=-1), x)  # already that long
    with pytest.raises(ValueError, match="size"):
        L.pad_axis(x, 4, axis=-2)
    with pytest.raises(ValueError, match=r"\bx\b"):
        L.pad_axis(x, 9, axis=5)


@pytest.mark.parametrize("dtype", ["float32", "uint8", "float8_e4m3fn"])
def test_pad_gate_up_concat(rng, dtype):
    i, ip, h = 3, 5, 4
    gate, up = np.asarray(make(rng, (i, h), dtype)), np.asarray(make(rng, (i, h), dtype))
    z = np.zeros((ip - i, h), gate.dtype)
    w13 = np.concatenate([gate, up])
    got = L.pad_gate_up(w13, ip)
    assert_bits_equal(got, np.concatenate([gate, z, up, z]))
    assert_bits_equal(L.unpad_gate_up(got, i), w13)
    # the halves stay aligned through the w31 swap: row Ip + r is still the partner of row r
    assert_bits_equal(L.swap_w13_to_w31(got), np.concatenate([up, z, gate, z]))


def test_pad_gate_up_interleaved_and_bias(rng):
    i, ip = 3, 4
    w = np.asarray(make(rng, (2, 2 * i, 5)))  # [E, 2I, H]
    got = L.pad_gate_up(w, ip, layout="interleaved")
    assert_bits_equal(got, np.concatenate([w, np.zeros((2, 2, 5), np.float32)], axis=1))
    assert_bits_equal(L.unpad_gate_up(got, i, layout="interleaved"), w)
    b = np.asarray(make(rng, (2, 2 * i)))  # bias [E, 2I]
    got_b = L.pad_gate_up(b, ip, axis=-1)
    zb = np.zeros((2, 1), np.float32)
    assert_bits_equal(got_b, np.concatenate([b[:, :i], zb, b[:, i:], zb], axis=1))
    assert_bits_equal(L.unpad_gate_up(got_b, i, axis=-1), b)


def test_pad_gate_up_errors(rng):
    with pytest.raises(ValueError, match="w13"):
        L.pad_gate_up(make(rng, (5, 2)), 4)
    with pytest.raises(ValueError, match="intermediate_padded"):
        L.pad_gate_up(make(rng, (6, 2)), 2)
    with pytest.raises(ValueError, match="layout"):
        L.pad_gate_up(make(rng, (6, 2)), 4, layout="zigzag")
    with pytest.raises(ValueError, match="intermediate"):
        L.unpad_gate_up(make(rng, (6, 2)), 4)


# ------------------------------------------------------------------ alpha scales on numbers
def test_fp8_alpha_scales_numbers():
    g1, g2 = L.fp8_alpha_scales(np.array([0.5, 2.0, 3.0], np.float32), np.float32(0.25),
                                np.array([4.0, 0.125, 1.5], np.float32), np.float32(2.0))
    np.testing.assert_array_equal(np.asarray(g1), [0.125, 0.5, 0.75])
    np.testing.assert_array_equal(np.asarray(g2), [8.0, 0.25, 3.0])
    # vLLM's [E, 1, 1] per-expert scales squeeze to [E]
    g1, _ = L.fp8_alpha_scales(np.full((2, 1, 1), 2.0, np.float32), 0.5, np.ones((2, 1, 1), np.float32), 1.0)
    assert g1.shape == (2,)
    with pytest.raises(ValueError, match="w13_scale"):
        L.fp8_alpha_scales(np.ones(3, np.float32), np.ones(2, np.float32), 1.0, 1.0)


def test_trtllm_fp8_output_scales_numbers():
    s = L.trtllm_fp8_output_scales(np.array([0.5, 2.0], np.float32), np.float32(0.25),
                                   np.array([4.0, 0.125], np.float32), np.float32(0.5))
    # g1 = [0.125, 0.5]; 1 / w2_input_scale = 2; g2 = [2, 0.0625]
    np.testing.assert_array_equal(np.asarray(s.output1_scales_gate_scalar), [0.125, 0.5])
    np.testing.assert_array_equal(np.asarray(s.output1_scales_scalar), [0.25, 1.0])
    np.testing.assert_array_equal(np.asarray(s.output2_scales_scalar), [2.0, 0.0625])


def test_nvfp4_alpha_scales_numbers():
    a = L.nvfp4_alpha_scales(np.array([0.001, 0.002], np.float32), np.float32(4.0),
                             np.array([0.5, 0.25], np.float32), np.float32(0.5))
    np.testing.assert_array_equal(np.asarray(a.g1_alphas), np.float32(4.0) * np.array([0.001, 0.002], np.float32))
    np.testing.assert_array_equal(np.asarray(a.g2_alphas), [0.25, 0.125])
    np.testing.assert_array_equal(np.asarray(a.a1_gscale), np.float32(0.25))
    np.testing.assert_array_equal(np.asarray(a.a2_gscale), np.float32(2.0))
    assert all(v.dtype == jnp.float32 for v in a)
