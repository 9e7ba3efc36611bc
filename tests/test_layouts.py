"""Spec tests for jax_moe.layouts' permutations: every layout against a reference written here from the
documented words (python loops over indices), and every permutation inverted bit-exactly. jit, a
leading expert axis, the padding rules and the alpha scales: test_layouts_rules.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import layouts as L
from jax_moe.quant.fp4 import pack_fp4
from layout_cases import DTYPES, assert_bits_equal, bits, interleave_ref, make, roundup, rows_ref, shuffle_ref


# ------------------------------------------------------------------ gated row orders
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_w13_to_w31_reference_and_inverse(rng, dtype):
    i = 6
    x = make(rng, (2 * i, 5), dtype)
    want = rows_ref(x, lambda r: (r + i) % (2 * i))
    got = L.swap_w13_to_w31(x)
    assert_bits_equal(got, want)
    assert_bits_equal(L.swap_w31_to_w13(got), x)
    assert_bits_equal(L.swap_w13_to_w31(got), x)  # self-inverse


@pytest.mark.parametrize("dtype", DTYPES)
def test_reorder_rows_for_gated_act_gemm_reference_and_inverse(rng, dtype):
    i = 5
    x = make(rng, (2 * i, 3), dtype)
    # out[2i] = x[i], out[2i+1] = x[I+i]
    want = rows_ref(x, lambda r: r // 2 + (i if r % 2 else 0))
    got = L.reorder_rows_for_gated_act_gemm(x)
    assert_bits_equal(got, want)
    assert_bits_equal(L.undo_reorder_rows_for_gated_act_gemm(got), x)
    assert_bits_equal(L.reorder_rows_for_gated_act_gemm(L.undo_reorder_rows_for_gated_act_gemm(x)), x)


def test_reorder_rows_literal_example():
    # FlashInfer docstring: [r0, r1, ..., rN/2, ..., r(N-1)] -> [r0, rN/2, r1, rN/2+1, ...]
    got = np.asarray(L.reorder_rows_for_gated_act_gemm(jnp.arange(1, 9), axis=-1))
    np.testing.assert_array_equal(got, [1, 5, 2, 6, 3, 7, 4, 8])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_row_pairs_reference_and_inverse(rng, dtype):
    x = make(rng, (8, 4), dtype)
    want = rows_ref(x, lambda r: r ^ 1)
    got = L.swap_row_pairs(x)
    assert_bits_equal(got, want)
    assert_bits_equal(L.swap_row_pairs(got), x)


def test_gptoss_pair_swap_matches_swap_then_reorder(rng):
    # GPT-OSS interleaved [g0, u0, g1, u1, ...] after the pair swap is what w13 [g; u] becomes
    # under swap_w13_to_w31 + reorder_rows_for_gated_act_gemm: [u0, g0, u1, g1, ...].
    i, h = 4, 3
    gate, up = np.asarray(make(rng, (i, h))), np.asarray(make(rng, (i, h)))
    concat = np.concatenate([gate, up])
    inter = np.empty((2 * i, h), np.float32)
    inter[0::2], inter[1::2] = gate, up
    want = np.empty((2 * i, h), np.float32)
    want[0::2], want[1::2] = up, gate
    assert_bits_equal(L.swap_row_pairs(inter), want)
    assert_bits_equal(L.reorder_rows_for_gated_act_gemm(L.swap_w13_to_w31(concat)), want)
    assert_bits_equal(L.reorder_rows_for_gated_act_gemm(concat), inter)  # concat -> interleaved


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_to_trtllm_gated_rows_reference_and_inverse(rng, layout):
    # out[2j] = up_j, out[2j+1] = gate_j from [gate; up] or [g0, u0, g1, u1, ...]; axis -1 for a bias
    i, h = 6, 3
    gate, up = np.asarray(make(rng, (2, i, h))), np.asarray(make(rng, (2, i, h)))
    stored = np.empty((2, 2 * i, h), np.float32)
    if layout == "concat":
        stored[:, :i], stored[:, i:] = gate, up
    else:
        stored[:, 0::2], stored[:, 1::2] = gate, up
    want = np.empty_like(stored)
    want[:, 0::2], want[:, 1::2] = up, gate
    got = L.to_trtllm_gated_rows(stored, layout)
    assert_bits_equal(got, want)
    assert_bits_equal(L.from_trtllm_gated_rows(got, layout), stored)
    assert_bits_equal(L.to_trtllm_gated_rows(stored[..., 0], layout, axis=-1), want[..., 0])
    with pytest.raises(ValueError, match="gate_up_layout must be"):
        L.to_trtllm_gated_rows(stored, "split")


def test_gated_bias_axis(rng):
    b = make(rng, (3, 8))  # [E, 2I]
    assert_bits_equal(L.swap_row_pairs(b, axis=-1), rows_ref(b, lambda r: r ^ 1, axis=-1))
    assert_bits_equal(L.swap_w13_to_w31(b, axis=-1), rows_ref(b, lambda r: (r + 4) % 8, axis=-1))


@pytest.mark.parametrize("fn", [L.swap_w13_to_w31, L.swap_w31_to_w13, L.reorder_rows_for_gated_act_gemm,
                                L.undo_reorder_rows_for_gated_act_gemm, L.swap_row_pairs])
def test_gated_shape_errors(rng, fn):
    with pytest.raises(ValueError, match=r"\bx\b"):
        fn(make(rng, (7, 2)))
    with pytest.raises(ValueError, match=r"\bx\b"):
        fn(make(rng, (4, 2)), axis=2)


# ------------------------------------------------------------------ shuffle_matrix_a
def test_transposed_layout_swaps_each_experts_axes_and_is_its_own_inverse(rng):
    w = jnp.asarray(rng.standard_normal((3, 8, 5)), jnp.bfloat16)  # [E, N, K]
    t = L.transpose_experts(w)
    assert t.shape == (3, 5, 8) and L.transposed_shape(w) == jax.ShapeDtypeStruct((3, 5, 8), jnp.bfloat16)
    for e in range(3):
        np.testing.assert_array_equal(np.asarray(t[e]), np.asarray(w[e]).T)
    np.testing.assert_array_equal(np.asarray(L.transpose_experts(t)), np.asarray(w))


def test_shuffle_block_table():
    # FlashInfer srcToDstBlk32RowMap / srcToDstBlk16RowMap: destination of each source offset
    blk32 = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
             4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31]
    blk16 = [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
    for tile, table in ((128, blk32), (256, blk32), (64, blk16)):
        n = len(table)
        src = jnp.arange(2 * n)
        out = np.asarray(L.shuffle_matrix_a(src, tile, axis=-1))
        for s in range(2 * n):
            assert out[(s // n) * n + table[s % n]] == s
    assert L.shuffle_block_rows(128) == 32 and L.shuffle_block_rows(64) == 16


@pytest.mark.parametrize("tile", [128, 64])
@pytest.mark.parametrize("dtype", DTYPES)
def test_shuffle_matrix_a_reference_and_inverse(rng, dtype, tile):
    x = make(rng, (96, 6), dtype)
    got = L.shuffle_matrix_a(x, tile)
    assert_bits_equal(got, shuffle_ref(x, tile))
    assert_bits_equal(L.unshuffle_matrix_a(got, tile), x)
    assert_bits_equal(L.shuffle_matrix_a(L.unshuffle_matrix_a(x, tile), tile), x)
    idx = L.shuffle_matrix_a_row_indices(96, tile)
    assert_bits_equal(got, np.asarray(x)[idx])


def test_shuffle_matrix_a_packed_fp4(rng):
    # real E2M1 codes packed two per byte: only rows move, the bytes of a row stay as they are
    codes = jnp.asarray(rng.integers(1, 16, size=(64, 32), dtype=np.uint8))
    packed = pack_fp4(codes)
    assert packed.dtype == jnp.uint8 and packed.shape == (64, 16)
    got = L.shuffle_matrix_a(packed)
    assert_bits_equal(got, shuffle_ref(packed))
    assert_bits_equal(L.unshuffle_matrix_a(got), packed)


def test_shuffle_matrix_a_bias_axis(rng):
    b = make(rng, (2, 64))  # [E, M]: vLLM shuffles bias.reshape(-1, 1)
    assert_bits_equal(L.shuffle_matrix_a(b, axis=-1), shuffle_ref(b, axis=-1))
    assert_bits_equal(L.shuffle_matrix_a(b, axis=-1)[0], L.shuffle_matrix_a(b[0][:, None])[:, 0])


def test_convert_to_block_layout_reference_and_inverse(rng):
    # out[..., c, m, j] = x[..., m, c * bk + j]: K cut into chunks of bk, stored chunk-major
    x = np.asarray(make(rng, (2, 5, 12)))
    got = np.asarray(L.convert_to_block_layout(x, 4))
    assert got.shape == (2, 3, 5, 4)
    for c in range(3):
        for m in range(5):
            for j in range(4):
                assert got[1, c, m, j] == x[1, m, 4 * c + j]
    assert_bits_equal(L.convert_from_block_layout(got), x)
    assert L.convert_to_block_layout(jnp.zeros((256, 384), jnp.float8_e4m3fn)).shape == (3, 256, 128)
    with pytest.raises(ValueError, match="multiple of block_k=128"):
        L.convert_to_block_layout(jnp.zeros((4, 200)))


def test_trtllm_nvfp4_output_scales_numbers():
    # (g1 / a2, g1, g2) with g1 = a13 * w13_scale_2, g2 = a2 * w2_scale_2
    s = L.trtllm_nvfp4_output_scales(np.array([0.5, 2.0], np.float32), np.float32(0.25),
                                     np.array([4.0, 8.0], np.float32), np.float32(0.5))
    np.testing.assert_allclose(s.output1_scales_gate_scalar, [0.125, 0.5])
    np.testing.assert_allclose(s.output1_scales_scalar, [0.25, 1.0])
    np.testing.assert_allclose(s.output2_scales_scalar, [2.0, 4.0])


def test_shuffle_matrix_a_errors(rng):
    with pytest.raises(ValueError, match=r"\bx\b"):
        L.shuffle_matrix_a(make(rng, (48, 4)))  # not a multiple of 32
    with pytest.raises(ValueError, match=r"\bx\b"):
        L.unshuffle_matrix_a(make(rng, (40, 4)), 64)  # not a multiple of 16
    with pytest.raises(ValueError, match="epilogue_tile_m"):
        L.shuffle_matrix_a(make(rng, (32, 4)), 0)
    with pytest.raises(ValueError, match=r"\bm\b"):
        L.shuffle_matrix_a_row_indices(33)


# ------------------------------------------------------------------ 128x4 block-scale interleave
@pytest.mark.parametrize("shape", [(128, 4), (130, 5)] + [pytest.param(s, marks=pytest.mark.slow)
                                                          for s in ((256, 12), (3, 2), (200, 9))])
@pytest.mark.parametrize("dtype", ["uint8", "float8_e4m3fn", "bfloat16"])
def test_block_scale_interleave_reference_and_inverse(rng, shape, dtype):
    sf = make(rng, shape, dtype)
    got = L.block_scale_interleave(sf)
    want = interleave_ref(sf)
    assert_bits_equal(got, want)
    m, k = shape
    mp, kp = roundup(m, 128), roundup(k, 4)
    flat2d = L.block_scale_interleave(sf, as_2d=True)
    assert flat2d.shape == (mp, kp)
    assert_bits_equal(np.asarray(flat2d).reshape(-1), want.reshape(-1))
    assert_bits_equal(L.block_scale_deinterleave(got, m, k), sf)
    assert_bits_equal(L.block_scale_deinterleave(flat2d, m, k, as_2d=True), sf)


def test_block_scale_interleave_tile_words(rng):
    # the 5-D index is [m // 128, k // 4, m % 32, (m // 32) % 4, k % 4]
    sf = make(rng, (256, 8), "uint8")
    t = np.asarray(L.block_scale_interleave(sf))
    for m in range(256):
        for k in range(8):
            assert t[m // 128, k // 4, m % 32, (m // 32) % 4, k % 4] == np.asarray(sf)[m, k]


def test_block_scale_interleave_padding_is_zero(rng):
    sf = make(rng, (130, 5), "uint8")
    flat = np.asarray(L.block_scale_interleave(sf)).reshape(-1)
    assert flat.size == 256 * 8
    assert np.count_nonzero(flat) == 130 * 5  # the data is never zero, the padding always


def test_block_scale_deinterleave_errors(rng):
    with pytest.raises(ValueError, match="tiled"):
        L.block_scale_deinterleave(make(rng, (1, 2, 32, 4, 4), "uint8"), 128, 9)  # 9 columns need 3 k-tiles
    with pytest.raises(ValueError, match="tiled"):
        L.block_scale_deinterleave(make(rng, (128, 8), "uint8"), 128, 8)  # 2-D without as_2d
    with pytest.raises(ValueError, match="sf"):
        L.block_scale_interleave(make(rng, (7,), "uint8"))


# ------------------------------------------------------------------ vLLM swizzle_mxfp4_scales
def test_swizzle_mxfp4_scales_reference_and_inverse(rng):
    n, k = 200, 352  # K in elements -> 11 scale columns
    sc = make(rng, (n, k // 32), "uint8")
    got = np.asarray(L.swizzle_mxfp4_scales(sc))
    assert got.shape == (roundup(n, 128) // 128, roundup(k, 128) // 128, 32, 4, 4)
    # vLLM's words: mTileIdx = m/128, outerMIdx = m%32, innerMIdx = (m/32)%4, kTileIdx = k/4,
    # innerKIdx = k%4 (k in scale columns); the rest is zero padding
    want = np.zeros_like(got)
    for m in range(n):
        for kk in range(k // 32):
            want[m // 128, kk // 4, m % 32, (m // 32) % 4, kk % 4] = np.asarray(sc)[m, kk]
    assert_bits_equal(got, want)
    assert_bits_equal(L.unswizzle_mxfp4_scales(got, n, k), sc)
    two_d = L.swizzle_mxfp4_scales(sc, as_2d=True)
    assert two_d.shape == (256, 12)
    assert_bits_equal(L.unswizzle_mxfp4_scales(two_d, n, k, as_2d=True), sc)


def test_swizzle_mxfp4_scales_errors(rng):
    with pytest.raises(ValueError, match="scales"):
        L.swizzle_mxfp4_scales(make(rng, (128, 4), "float8_e4m3fn"))
    t = L.swizzle_mxfp4_scales(make(rng, (128, 4), "uint8"))
    with pytest.raises(ValueError, match=r"\bk\b"):
        L.unswizzle_mxfp4_scales(t, 128, 100)
    with pytest.raises(ValueError, match="swizzled"):
        L.unswizzle_mxfp4_scales(t.astype(jnp.float32), 128, 128)


# ------------------------------------------------------------------ shuffle_matrix_sf_a
@pytest.mark.parametrize("dtype", ["uint8", "float8_e4m3fn"])
@pytest.mark.parametrize("k", [8, 6])
def test_shuffle_matrix_sf_a_reference_and_inverse(rng, dtype, k):
    sf = make(rng, (256, k), dtype)
    got = L.shuffle_matrix_sf_a(sf)
    assert_bits_equal(got, interleave_ref(shuffle_ref(sf)))
    assert_bits_equal(L.unshuffle_matrix_sf_a(got, 256, k), sf)
    two_d = L.shuffle_matrix_sf_a(sf, as_2d=True)
    assert two_d.shape == (256, roundup(k, 4))
    assert_bits_equal(L.unshuffle_matrix_sf_a(two_d, 256, k, as_2d=True), sf)


def test_shuffle_matrix_sf_a_errors(rng):
    with pytest.raises(ValueError, match=r"\bsf\b"):
        L.shuffle_matrix_sf_a(make(rng, (96, 4), "uint8"))
    with pytest.raises(ValueError, match="rows"):
        L.unshuffle_matrix_sf_a(L.block_scale_interleave(make(rng, (96, 4), "uint8")), 96, 4)


# ------------------------------------------------------------------ SM90 mixed-input GEMM (W4A16)
# D's bits from the layout table, word by word: D bit -> (source code index j, code bit). m_j keeps
# code bits 0-2 in order, s_j is code bit 3, x_j code bits 1-2, u_j code bit 0.
_D_TABLE = {}
for _lsb, (_j, _bits) in {0: (4, (0, 1, 2)), 3: (2, (0, 1, 2)), 6: (0, (0, 1, 2)), 9: (4, (3,)),
                          10: (6, (1, 2)), 12: (2, (3,)), 13: (6, (0,)), 14: (6, (3,)), 15: (0, (3,)),
                          16: (5, (0, 1, 2)), 19: (3, (0, 1, 2)), 22: (1, (0, 1, 2)), 25: (5, (3,)),
                          26: (7, (1, 2)), 28: (3, (3,)), 29: (7, (0,)), 30: (7, (3,)), 31: (1, (3,))}.items():
    for _o, _b in enumerate(_bits):
        _D_TABLE[_lsb + _o] = (_j, _b)


def mixed_weights_ref(w):
    """The weight interleave from its documented words, by python loops over (row pair, chunk,
    q, l): codes n0..n7 of a, b, d, e (lo then hi nibble), D bit by bit from the table, D's
    bytes at out[r + 8(q % 2), 32p + 16(q // 2) + 4l + 0..3]."""
    w = np.asarray(w)
    n, kb = w.shape
    out = np.zeros_like(w)
    for g in range(n // 16):
        for r in range(16 * g, 16 * g + 8):
            for p in range(kb // 32):
                for q in range(4):
                    for l in range(4):
                        c = 32 * p + 8 * q + l
                        src = [w[r, c], w[r + 8, c], w[r, c + 4], w[r + 8, c + 4]]
                        codes = [int(src[j // 2]) >> (4 * (j % 2)) & 0xF for j in range(8)]
                        dword = sum(((codes[j] >> b) & 1) << bit for bit, (j, b) in _D_TABLE.items())
                        row, col = r + 8 * (q % 2), 32 * p + 16 * (q // 2) + 4 * l
                        out[row, col:col + 4] = [(dword >> (8 * j)) & 0xFF for j in range(4)]
    return out


def mixed_scales_ref(s, group_size):
    """The scale folding from its documented words: c = 128/g columns, L = 16/itemsize per line,
    F = 64c/L lines; out[rb, kb, f, c*m + j] = s[64rb + F*m + f, c*kb + j]."""
    s = np.asarray(s)
    rows, kg = s.shape
    c, line = 128 // group_size, 16 // s.dtype.itemsize
    f_ = 64 * c // line
    out = np.zeros((rows // 64, kg // c, f_, line), s.dtype)
    for rb in range(rows // 64):
        for kb in range(kg // c):
            for f in range(f_):
                for m in range(line // c):
                    for j in range(c):
                        out[rb, kb, f, c * m + j] = s[64 * rb + f_ * m + f, c * kb + j]
    return out


def test_mixed_gemm_d_table_is_a_bit_permutation():
    assert sorted(_D_TABLE) == list(range(32))
    assert sorted(_D_TABLE.values()) == [(j, b) for j in range(8) for b in range(4)]
    # the module's field list says the same as the table
    fields = {dst + o: (src + o) for src, dst, width in L.FP4_WORD_FIELDS for o in range(width)}
    assert fields == {bit: 4 * j + b for bit, (j, b) in _D_TABLE.items()}


def test_mixed_gemm_weights_literal_example():
    """Code 0b1011 (sign 1, magnitude 3) as element 1 of row 8 (byte 0's high nibble): it is n3
    of the word for (r=0, p=0, q=0, l=0); m3 -> D bits 19-21 = 0b011, s3 -> D bit 28; D is
    stored at row 0, bytes 0..3: byte 2 = 0b00011000, byte 3 = 0b00010000."""
    w = np.zeros((16, 32), np.uint8)
    w[8, 0] = 0xB0
    out = np.asarray(L.interleave_fp4_weights_for_sm90_mixed_gemm(jnp.asarray(w)))
    want = np.zeros_like(w)
    want[0, 2], want[0, 3] = 0x18, 0x10
    np.testing.assert_array_equal(out, want)


def mixed_int4_weights_ref(w):
    """The int4 unit interleave from its documented words, by python loops: 2-byte unit
    l = 8m + 4h + t of row r + 8s (chunk p) goes to row r + 8h, unit 8m + 2t + s."""
    w = np.asarray(w)
    n, kb = w.shape
    units = w.reshape(n, kb // 2, 2)
    out = np.zeros_like(units)
    for g in range(n // 16):
        for r in range(16 * g, 16 * g + 8):
            for p in range(kb // 32):
                for m in range(2):
                    for h in range(2):
                        for t in range(4):
                            for s in range(2):
                                out[r + 8 * h, 16 * p + 8 * m + 2 * t + s] = units[r + 8 * s, 16 * p + 8 * m + 4 * h + t]
    return out.reshape(n, kb)


def _mixed_weight_layouts():
    """(code, interleave, deinterleave, loop reference of the documented words)."""
    return [("fp4", L.interleave_fp4_weights_for_sm90_mixed_gemm, L.deinterleave_fp4_weights_for_sm90_mixed_gemm,
             mixed_weights_ref),
            ("int4", L.interleave_int4_weights_for_sm90_mixed_gemm, L.deinterleave_int4_weights_for_sm90_mixed_gemm,
             mixed_int4_weights_ref)]


@pytest.mark.parametrize("shape", [(16, 32), (48, 64), (32, 96)])
@pytest.mark.parametrize("code,interleave,deinterleave,ref", _mixed_weight_layouts(), ids=["fp4", "int4"])
def test_mixed_gemm_weights_reference_and_inverse(rng, shape, code, interleave, deinterleave, ref):
    w = jnp.asarray(rng.integers(0, 256, size=shape, dtype=np.uint8))
    out = interleave(w)
    assert out.dtype == jnp.uint8 and out.shape == w.shape
    np.testing.assert_array_equal(np.asarray(out), ref(w))
    np.testing.assert_array_equal(np.asarray(deinterleave(out)), np.asarray(w))


def test_mixed_gemm_int4_weights_literal_example():
    """Row 8's unit 5 (bytes 10-11: l = 5 = 8*0 + 4*1 + 1, so h = 1, t = 1, s = 1) lands in row
    8 + 8h - 8 = 8, unit 2t + s = 3 (bytes 6-7); row 0's unit 1 (h = 0, t = 1, s = 0) in row 0,
    unit 2 (bytes 4-5). Codes inside a unit are untouched."""
    w = np.zeros((16, 32), np.uint8)
    w[8, 10], w[8, 11] = 0x21, 0x43
    w[0, 2], w[0, 3] = 0x65, 0x87
    out = np.asarray(L.interleave_int4_weights_for_sm90_mixed_gemm(jnp.asarray(w)))
    want = np.zeros_like(w)
    want[8, 6], want[8, 7] = 0x21, 0x43
    want[0, 4], want[0, 5] = 0x65, 0x87
    np.testing.assert_array_equal(out, want)


def test_mixed_gemm_int4_errors():
    with pytest.raises(ValueError, match="two int4 codes"):
        L.interleave_int4_weights_for_sm90_mixed_gemm(jnp.zeros((16, 32), jnp.int8))
    with pytest.raises(ValueError, match="multiple of 16"):
        L.deinterleave_int4_weights_for_sm90_mixed_gemm(jnp.zeros((8, 32), jnp.uint8))


@pytest.mark.parametrize("rows,kg,dtype,group", [(64, 4, "uint8", 32), (128, 12, "uint8", 32),
                                                 (64, 2, "bfloat16", 128), (192, 3, "bfloat16", 128)])
def test_mixed_gemm_scales_reference_and_inverse(rng, rows, kg, dtype, group):
    s = make(rng, (rows, kg), dtype)
    out = L.interleave_scales_for_sm90_mixed_gemm(s, group_size=group)
    assert out.shape == L.mixed_gemm_scale_shape(rows, kg * group, group, np.dtype(dtype).itemsize)
    assert_bits_equal(out, mixed_scales_ref(s, group))
    assert_bits_equal(L.deinterleave_scales_for_sm90_mixed_gemm(out, group_size=group), s)


def test_mixed_gemm_scales_mxfp4_shape_and_lines():
    """MXFP4: [R/64, K/128, 16, 16]; line f of a block = the 4 scales of rows f, f+16, f+32, f+48."""
    assert L.mixed_gemm_scale_shape(5888, 2944) == (92, 23, 16, 16)  # GPT-OSS w13 (2 x 2944 rows)
    s = np.arange(64 * 4, dtype=np.uint8).reshape(64, 4)  # s[r, j] = 4r + j
    out = np.asarray(L.interleave_scales_for_sm90_mixed_gemm(jnp.asarray(s)))
    for f in range(16):
        want = np.concatenate([s[f + 16 * m] for m in range(4)])
        np.testing.assert_array_equal(out[0, 0, f], want)


def test_mixed_gemm_errors(rng):
    with pytest.raises(ValueError, match="uint8"):
        L.interleave_fp4_weights_for_sm90_mixed_gemm(jnp.zeros((16, 32), jnp.float32))
    with pytest.raises(ValueError, match="multiple of 16"):
        L.interleave_fp4_weights_for_sm90_mixed_gemm(jnp.zeros((8, 32), jnp.uint8))
    with pytest.raises(ValueError, match="K of 64"):
        L.deinterleave_fp4_weights_for_sm90_mixed_gemm(jnp.zeros((16, 16), jnp.uint8))
    with pytest.raises(ValueError, match="multiple of 64"):
        L.interleave_scales_for_sm90_mixed_gemm(jnp.zeros((32, 4), jnp.uint8))
    with pytest.raises(ValueError, match="of 128"):
        L.interleave_scales_for_sm90_mixed_gemm(jnp.zeros((64, 2), jnp.uint8))
    with pytest.raises(ValueError, match="divide"):
        L.mixed_gemm_scale_shape(64, 128, group_size=48)
    with pytest.raises(ValueError, match="fold"):
        L.mixed_gemm_scale_shape(64, 128, group_size=32, itemsize=8)
    with pytest.raises(ValueError, match="must end in"):
        L.deinterleave_scales_for_sm90_mixed_gemm(jnp.zeros((1, 1, 8, 16), jnp.uint8))
