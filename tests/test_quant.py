"""Specifications of the quantized formats (jax_moe.quant): FP8, E2M1, NVFP4, MXFP4/MXFP8 and int4.
CPU only; random data comes fresh from the per-test ``rng``. QuantConfig, the contract between the
formats and the backends, and the rule for NaN and infinities: test_quant_scheme.py.

Error bounds used below (norm-relative ``||dequant(quant(x)) - x|| / ||x||`` on standard normal
data, each derived from the format):

* FP8 E4M3 (3 mantissa bits): per element the rounding error is at most half an ulp,
  ``2**-4 * |v|`` for normal ``v = x / scale`` and ``2**-10`` in the subnormal range. With the
  mantissa spread over [1, 2) the RMS relative error is ``2**-3 / sqrt(12) / sqrt(7/3) ~ 0.024``
  -> bound 3e-2.
* NVFP4 (E2M1 + e4m3 block-16 scale): the block max maps to 6, the step is 0.5..2 units of
  ``amax/6``; for 16 normal samples (amax ~ 1.8 sigma) the RMS error is ~0.095 sigma -> 0.15.
* MXFP4 (power-of-two block-32 scale): the block max lands in [4, 8) units, so the effective
  step is up to 2x NVFP4's and values above 6 units saturate; measured ~0.115 -> 0.2.
* MXFP8: E4M3 elements under a power-of-two scale (the block max lands in [256, 512), values
  above 448 saturate, <= 12.5 %); measured ~0.030 -> 0.045.
* int4 g128: step ``amax/7``, uniform error of RMS ``step / sqrt(12)``; the max of 128 normal
  samples is ~2.8 sigma, so RMS ~ 2.8 / 7 / 3.46 = 0.116 sigma -> 0.13. (On uniform data the
  same derivation gives 0.071; normal data is harder.)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.quant import fp4, fp8, int4

from helpers import rel_err
from quant_cases import E2M1_MAGS, E4M3, e2m1_reference, f32, fp8_elementwise_ok, normal


# =========================================================================== FP8


def test_fp8_per_tensor_scale_is_amax_over_448_and_roundtrip_within_half_ulp(rng):
    x = normal(rng, 64, 96, scale=3.0)
    q, s = fp8.quantize_fp8_per_tensor(x)
    assert q.dtype == jnp.float8_e4m3fn and q.shape == x.shape and s.shape == () and s.dtype == jnp.float32
    assert float(s) == np.float32(np.abs(x).max()) * fp8.RCP_448
    deq = fp8.dequantize_fp8(q, s)
    assert fp8_elementwise_ok(x, deq, s)
    assert rel_err(deq, x) < 3e-2
    assert np.abs(f32(q)).max() == 448.0  # the amax element maps to the format's max exactly


def test_fp8_cast_is_round_to_nearest_even_like_ml_dtypes(rng):
    x = normal(rng, 32, 64)
    q, s = fp8.quantize_fp8_per_tensor(x)
    ref = np.clip(x * (np.float32(1) / np.float32(s)), -448, 448).astype(E4M3)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), ref.view(np.uint8))


def test_fp8_per_expert_scale_has_shape_E(rng):
    w = normal(rng, 3, 16, 48) * np.array([1.0, 10.0, 0.01], np.float32)[:, None, None]
    q, s = fp8.quantize_fp8_per_expert(w)
    assert s.shape == (3,)
    np.testing.assert_array_equal(np.asarray(s), np.abs(w).reshape(3, -1).max(1) * fp8.RCP_448)
    deq = fp8.dequantize_fp8(q, s)
    assert fp8_elementwise_ok(w, deq, np.asarray(s)[:, None, None])


def test_fp8_per_token_scales_each_row(rng):
    x = normal(rng, 10, 64) * np.logspace(-3, 3, 10, dtype=np.float32)[:, None]
    q, s = fp8.quantize_fp8_per_token(x)
    assert s.shape == (10, 1)
    np.testing.assert_array_equal(np.asarray(s)[:, 0], np.abs(x).max(1) * fp8.RCP_448)
    np.testing.assert_array_equal(np.abs(f32(q)).max(1), 448.0)  # every row uses the full range
    assert fp8_elementwise_ok(x, fp8.dequantize_fp8(q, s), s)


def test_fp8_per_channel_scale_has_shape_E_N_1(rng):
    w = normal(rng, 2, 24, 40)
    q, s = fp8.quantize_fp8_per_channel(w)
    assert s.shape == (2, 24, 1) and q.shape == w.shape
    np.testing.assert_array_equal(np.asarray(s)[..., 0], np.abs(w).max(-1) * fp8.RCP_448)
    assert rel_err(fp8.dequantize_fp8(q, s), w) < 3e-2


@pytest.mark.parametrize("n,k", [(256, 384), (200, 300), (130, 129)])
def test_fp8_block_128x128_scales_handle_partial_blocks(rng, n, k):
    w = normal(rng, 2, n, k)
    q, s = fp8.quantize_fp8_block(w)
    nb, kb = math.ceil(n / 128), math.ceil(k / 128)
    assert s.shape == (2, nb, kb) and q.shape == w.shape and q.dtype == jnp.float8_e4m3fn
    for e in range(2):
        for i in range(nb):
            for j in range(kb):
                blk = w[e, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                assert float(s[e, i, j]) == np.abs(blk).max() * fp8.RCP_448
    deq = fp8.dequantize_fp8_block(q, s)
    s_full = np.repeat(np.repeat(np.asarray(s), 128, 1), 128, 2)[:, :n, :k]
    assert fp8_elementwise_ok(w, deq, s_full)


def test_fp8_block_dequant_rejects_wrong_scale_shape(rng):
    q, s = fp8.quantize_fp8_block(normal(rng, 1, 200, 300))
    with pytest.raises(ValueError, match="scale"):
        fp8.dequantize_fp8_block(q, s[:, :1])


@pytest.mark.parametrize("k", [256, 320])
def test_fp8_per_token_group_1x128(rng, k):
    x = normal(rng, 6, k)
    q, s = fp8.quantize_fp8_per_token_group(x, 128)
    kb = math.ceil(k / 128)
    assert s.shape == (6, kb)
    for j in range(kb):
        np.testing.assert_array_equal(np.asarray(s)[:, j], np.abs(x[:, j * 128:(j + 1) * 128]).max(1) * fp8.RCP_448)
    deq = fp8.dequantize_fp8_per_token_group(q, s, 128)
    assert fp8_elementwise_ok(x, deq, np.repeat(np.asarray(s), 128, 1)[:, :k])


def test_fp8_zero_and_constant_inputs_never_make_nan(rng):
    c = np.float32(abs(rng.standard_normal()) + 0.1)
    const = np.full((2, 130, 140), c, np.float32)
    zeros = np.zeros((2, 130, 140), np.float32)
    for w in (zeros, const):
        outs = [
            fp8.dequantize_fp8(*fp8.quantize_fp8_per_tensor(w)),
            fp8.dequantize_fp8(*fp8.quantize_fp8_per_expert(w)),
            fp8.dequantize_fp8(*fp8.quantize_fp8_per_channel(w)),
            fp8.dequantize_fp8_block(*fp8.quantize_fp8_block(w)),
            fp8.dequantize_fp8_per_token_group(*fp8.quantize_fp8_per_token_group(w), 128),
        ]
        for out in outs:
            assert np.all(np.isfinite(out))
            np.testing.assert_allclose(out, w, rtol=1e-6, atol=0)
    _, s = fp8.quantize_fp8_per_tensor(zeros)
    assert float(s) > 0


def test_fp8_static_scale_saturates_finite_values_instead_of_nan(rng):
    scale = np.float32(0.01)  # representable range +-4.48
    x = np.concatenate([normal(rng, 16), np.array([5.0, -7.0, 1e30, -1e30], np.float32)])
    q = fp8.quantize_fp8_static(x, scale)
    qf = f32(q)
    assert not np.any(np.isnan(qf))
    np.testing.assert_array_equal(qf[-4:], [448.0, -448.0, 448.0, -448.0])
    inside = np.abs(x) < 4.4
    assert fp8_elementwise_ok(x[inside], qf[inside] * scale, scale)


def test_fp8_static_scale_makes_an_infinity_nan_not_448():
    """The NaN/Inf rule (jax_moe.quant): E4M3 holds no infinity, and saturating one would hide it."""
    qf = f32(fp8.quantize_fp8_static(np.array([np.inf, -np.inf, np.nan, 1.0], np.float32), np.float32(0.01)))
    assert np.isnan(qf[:3]).all() and qf[3] == 96.0  # 100 rounds to the E4M3 96


# =========================================================================== E2M1 codec


def test_e2m1_decodes_all_16_codes_exactly():
    want = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    got = np.asarray(fp4.e2m1_decode(jnp.arange(16, dtype=jnp.uint8)))
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    assert np.signbit(got[8])


def test_e2m1_encode_is_exact_on_all_16_codes():
    codes = jnp.arange(16, dtype=jnp.uint8)
    np.testing.assert_array_equal(np.asarray(fp4.e2m1_encode(fp4.e2m1_decode(codes))), np.arange(16))


def test_e2m1_rounding_matches_spec_reference_including_ties(rng):
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    near = np.concatenate([mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(10))])
    x = np.concatenate([near, -near, rng.uniform(-8, 8, 300).astype(np.float32), [0.0, -0.0, 6.0, 7.0]])
    x = x.astype(np.float32)
    np.testing.assert_array_equal(np.asarray(fp4.e2m1_encode(x)), e2m1_reference(x))
    # the ties, spelled out: nearest even code
    ties = np.asarray(fp4.e2m1_decode(fp4.e2m1_encode(mids)))
    np.testing.assert_array_equal(ties, [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])


def test_e2m1_saturates_at_six():
    x = np.array([6.5, -6.5, 1e6, -1e6, np.inf, -np.inf], np.float32)
    np.testing.assert_array_equal(np.asarray(fp4.e2m1_decode(fp4.e2m1_encode(x))), [6, -6, 6, -6, 6, -6])


def test_fp4_packing_low_nibble_is_the_even_element():
    codes = jnp.array([[0x1, 0x2, 0x3, 0xC]], jnp.uint8)  # 0xC = -2.0
    packed = fp4.pack_fp4(codes)
    np.testing.assert_array_equal(np.asarray(packed), [[0x21, 0xC3]])
    unpacked = fp4.unpack_fp4(jnp.array([0xA5, 0x0F], jnp.uint8))
    np.testing.assert_array_equal(np.asarray(unpacked), [0x5, 0xA, 0xF, 0x0])
    np.testing.assert_array_equal(np.asarray(fp4.e2m1_decode(unpacked)), [3.0, -1.0, -6.0, 0.0])


def test_fp4_pack_unpack_roundtrip(rng):
    codes = rng.integers(0, 16, (3, 5, 64)).astype(np.uint8)
    packed = fp4.pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(fp4.unpack_fp4(packed)), codes)


# =========================================================================== NVFP4


def test_nvfp4_scales_and_codes_follow_the_definition(rng):
    """Bit for bit, on the CPU device: there float32 division is correctly rounded, as numpy's is
    (a GPU's XLA division can land one ulp away, and the global scale is a division)."""
    with jax.default_device(jax.devices("cpu")[0]):
        _check_nvfp4_against_the_definition(rng)


def _check_nvfp4_against_the_definition(rng):
    w = normal(rng, 3, 8, 64) * np.array([1.0, 50.0, 0.02], np.float32)[:, None, None]
    g = fp4.nvfp4_global_scale(w, per_expert=True)
    packed, bs, g_out = fp4.quantize_nvfp4(w, g)
    assert packed.shape == (3, 8, 32) and packed.dtype == jnp.uint8
    assert bs.shape == (3, 8, 4) and bs.dtype == jnp.float8_e4m3fn and g_out.shape == (3,)
    g_ref = np.float32(448 * 6) / np.abs(w).reshape(3, -1).max(1)
    np.testing.assert_array_equal(np.asarray(g), g_ref)
    blocks = w.reshape(3, 8, 4, 16)
    bs_ref = (np.abs(blocks).max(-1) * fp4.RCP_6 * g_ref[:, None, None]).astype(E4M3)
    np.testing.assert_array_equal(np.asarray(bs).view(np.uint8), bs_ref.view(np.uint8))
    mult = g_ref[:, None, None] / bs_ref.astype(np.float32)
    codes_ref = e2m1_reference(blocks * mult[..., None]).reshape(3, 8, 64)
    np.testing.assert_array_equal(np.asarray(fp4.unpack_fp4(packed)), codes_ref)
    deq = fp4.dequantize_nvfp4(packed, bs, g)
    vals = E2M1_MAGS[codes_ref & 7] * np.where(codes_ref & 8, -1, 1)
    deq_ref = (vals.reshape(3, 8, 4, 16) * bs_ref.astype(np.float32)[..., None]).reshape(3, 8, 64).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(deq), deq_ref * (np.float32(1) / g_ref)[:, None, None])


def test_nvfp4_block_max_encodes_to_six(rng):
    x = normal(rng, 16, 128)
    packed, _, _ = fp4.quantize_nvfp4(x)
    codes = np.asarray(fp4.unpack_fp4(packed)).reshape(16, 8, 16)
    idx = np.abs(x.reshape(16, 8, 16)).argmax(-1)
    np.testing.assert_array_equal(np.take_along_axis(codes, idx[..., None], -1) & 7, 7)


def test_nvfp4_roundtrip_within_bound(rng):
    w = normal(rng, 4, 64, 256)
    packed, bs, g = fp4.quantize_nvfp4(w, fp4.nvfp4_global_scale(w, per_expert=True))
    assert rel_err(fp4.dequantize_nvfp4(packed, bs, g), w) < 0.15


def test_nvfp4_zero_blocks_and_zero_expert_never_make_nan(rng):
    w = normal(rng, 2, 4, 64)
    w[0, :, 16:32] = 0.0  # zero blocks
    w[1] = 0.0  # a whole zero expert
    g = fp4.nvfp4_global_scale(w, per_expert=True)
    assert np.all(np.isfinite(np.asarray(g)))
    deq = np.asarray(fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(w, g)))
    assert np.all(np.isfinite(deq))
    np.testing.assert_array_equal(deq[0, :, 16:32], 0.0)
    np.testing.assert_array_equal(deq[1], 0.0)


def test_block_formats_reject_k_not_multiple_of_block(rng):
    x = normal(rng, 4, 40)
    with pytest.raises(ValueError, match="x.*K=40.*16"):
        fp4.quantize_nvfp4(normal(rng, 4, 40))
    with pytest.raises(ValueError, match="x.*K=48.*32"):
        fp4.quantize_mxfp4(normal(rng, 4, 48))
    with pytest.raises(ValueError, match="x.*K=48.*32"):
        fp4.quantize_mxfp8(normal(rng, 4, 48))
    with pytest.raises(ValueError, match="w.*K=40.*group_size=128"):
        int4.quantize_int4(x)


# =========================================================================== MXFP4 / MXFP8


@pytest.mark.parametrize(
    "amax,byte",
    [(1.0, 125), (6.0, 127), (7.99, 127), (8.0, 128), (0.3, 123), (2.0**-125, 0), (0.0, 0), (3e38, 252)],
)
def test_mxfp4_e8m0_byte_is_floor_log2_amax_minus_2(rng, amax, byte):
    block = (rng.uniform(-1, 1, 32) * amax * 0.5).astype(np.float32)
    block[int(rng.integers(32))] = -amax if rng.integers(2) else amax
    _, scale = fp4.quantize_mxfp4(block[None])
    assert scale.dtype == jnp.uint8 and scale.shape == (1, 1)
    assert int(scale[0, 0]) == byte


def test_mxfp4_is_exact_on_representable_blocks(rng):
    k = int(rng.integers(-20, 20))
    vals = rng.choice(np.concatenate([E2M1_MAGS, -E2M1_MAGS]), (4, 64)).astype(np.float32)
    vals[:, 0], vals[:, 32] = 6.0, -6.0  # each block's amax is 6 * 2**k, so its exponent is k
    x = vals * np.float32(2.0**k)
    packed, scale = fp4.quantize_mxfp4(x)
    np.testing.assert_array_equal(np.asarray(scale), k + 127)
    np.testing.assert_array_equal(np.asarray(fp4.dequantize_mxfp4(packed, scale)), x)


def test_mxfp4_saturates_values_above_six_units():
    x = np.zeros((1, 32), np.float32)
    x[0, :3] = [7.9, -7.0, 1.0]  # amax 7.9: exponent 0, so 7.9 and -7 exceed E2M1's 6
    deq = np.asarray(fp4.dequantize_mxfp4(*fp4.quantize_mxfp4(x)))
    np.testing.assert_array_equal(deq[0, :3], [6.0, -6.0, 1.0])


def test_mxfp4_roundtrip_within_bound_and_zero_blocks_finite(rng):
    w = normal(rng, 4, 64, 256)
    w[0, 0, :32] = 0.0
    packed, scale = fp4.quantize_mxfp4(w)
    assert packed.shape == (4, 64, 128) and scale.shape == (4, 64, 8)
    deq = np.asarray(fp4.dequantize_mxfp4(packed, scale))
    assert np.all(np.isfinite(deq)) and np.all(deq[0, 0, :32] == 0)
    assert rel_err(deq, w) < 0.2


def test_mxfp8_scale_byte_and_roundtrip(rng):
    x = normal(rng, 16, 128)
    x[0, :32] /= np.abs(x[0, :32]).max()  # first block amax exactly 1 -> exponent -8 -> byte 119
    q, scale = fp4.quantize_mxfp8(x)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == (16, 4) and int(scale[0, 0]) == 119
    amax = np.abs(x.reshape(16, 4, 32)).max(-1)
    np.testing.assert_array_equal(np.asarray(scale), np.floor(np.log2(amax)).astype(int) - 8 + 127)
    assert rel_err(fp4.dequantize_mxfp8(q, scale), x) < 0.045


# =========================================================================== int4


def test_int4_packing_twos_complement_low_nibble_first():
    packed = int4.pack_int4(jnp.array([1, -1, -8, 7], jnp.int8))
    np.testing.assert_array_equal(np.asarray(packed), [0xF1, 0x78])
    np.testing.assert_array_equal(np.asarray(int4.unpack_int4(jnp.array([0x8F, 0x70], jnp.uint8))), [-1, -8, 0, 7])


def test_int4_scale_and_round_half_to_even():
    g = np.zeros((1, 128), np.float32)
    g[0, :8] = [7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49]  # amax 7 -> scale exactly 1
    packed, s = int4.quantize_int4(g)
    assert s.shape == (1, 1) and float(s[0, 0]) == 1.0
    np.testing.assert_array_equal(np.asarray(int4.unpack_int4(packed))[0, :8], [7, 0, 2, 2, 0, -2, -2, 3])


def test_int4_g128_roundtrip_within_bound(rng):
    w = normal(rng, 4, 32, 512)
    packed, s = int4.quantize_int4(w, 128)
    assert packed.shape == (4, 32, 256) and s.shape == (4, 32, 4) and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s), np.abs(w.reshape(4, 32, 4, 128)).max(-1) * (np.float32(1) / np.float32(7)))
    deq = np.asarray(int4.dequantize_int4(packed, s, 128))
    step = np.repeat(np.asarray(s), 128, -1)
    assert np.all(np.abs(deq - w) <= step / 2 * (1 + 1e-6))
    assert rel_err(deq, w) < 0.13


def test_int4_zero_group_never_makes_nan(rng):
    w = normal(rng, 2, 256)
    w[1, 128:] = 0.0
    packed, s = int4.quantize_int4(w)
    assert float(s[1, 1]) > 0
    deq = np.asarray(int4.dequantize_int4(packed, s))
    assert np.all(np.isfinite(deq)) and np.all(deq[1, 128:] == 0)
