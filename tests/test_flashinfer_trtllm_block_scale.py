"""backend="flashinfer_trtllm" with block-scaled weights (NVFP4, MXFP4, FP8 128x128 blocks): the
load-time layouts against the layouts as documented in words, their shape rules and refusal reasons."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.backends import flashinfer_trtllm as trt
from jax_moe.config import MoEConfig
from jax_moe.layouts import mxfp4_padded_sizes
from jax_moe.quant import fp4
from jax_moe.quant.scheme import quantize_weights
from helpers import scheme_only
from trtllm_cases import B200, CFG, fake_module, rng_weights, write_cubins


# ----------------------------------------------------------------------------- TRT-LLM FP4 / FP8 block
# The references below follow the layouts as the docstrings state them in words (row orders,
# 32- or 16-row shuffle blocks, the 128x4 scale tile's flat offset, BlockMajorK chunks), by loops.


def _bytes(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _shuffled_rows(x, block=32):
    """Per block of ``block`` rows (axis 1): output row blk*B + 8c + a is input row blk*B + (B/8)a + c."""
    x = np.asarray(x)
    out = np.empty_like(x)
    g = block // 8
    for blk in range(x.shape[1] // block):
        for a in range(8):
            for c in range(g):
                out[:, blk * block + 8 * c + a] = x[:, blk * block + g * a + c]
    return out


def _tiled_128x4(sf):
    """[E, M, K] (M % 128 == 0, K % 4 == 0): scale (m, k) to flat offset
    ((m//128)*(K/4) + k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4, viewed as [E, M, K]."""
    sf = np.asarray(sf)
    e, m_, k_ = sf.shape
    out = np.zeros((e, m_ * k_), sf.dtype)
    for m in range(m_):
        for k in range(k_):
            off = ((m // 128) * (k_ // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
            out[:, off] = sf[:, m, k]
    return out.reshape(e, m_, k_)


def _runner_gate_up_rows(x, layout, rows_padded=None):
    """Row 2j = up row j, row 2j+1 = gate row j (axis 1); zero rows up to ``rows_padded``."""
    x = np.asarray(x)
    i = x.shape[1] // 2
    if layout == "concat":
        gate, up = x[:, :i], x[:, i:]
    else:
        gate, up = x[:, 0::2], x[:, 1::2]
    out = np.zeros((x.shape[0], rows_padded or 2 * i) + x.shape[2:], x.dtype)
    for j in range(i):
        out[:, 2 * j], out[:, 2 * j + 1] = up[:, j], gate[:, j]
    return out


def _zero_extend(x, size, axis):
    x = np.asarray(x)
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return np.pad(x, widths)


@pytest.mark.parametrize("layout", ["interleaved", "concat"])
def test_prepare_mxfp4_weights_match_the_documented_layout(layout):
    """GPT-OSS MXFP4 (vLLM's GPT-OSS MXFP4 path): H 96 -> 256 and I 160 -> 256; GEMM1 rows [up0, gate0, ...] with zero
    pairs, bytes/scale columns zero-extended, 32-row shuffle, scales 128x4-tiled, biases float32."""
    e, h, i = 2, 96, 160
    q13, q2, quant = quantize_weights("mxfp4", *rng_weights(e, h, i))
    rng = np.random.default_rng(7)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.bfloat16)
    b2 = jnp.asarray(rng.standard_normal((e, h)), jnp.bfloat16)
    w13p, s13p, b13p, w2p, s2p, b2p = trt.prepare_mxfp4_weights(q13, quant.w13_scale, q2, quant.w2_scale,
                                                                b13, b2, gate_up_layout=layout)
    assert mxfp4_padded_sizes(trt.NAME, h, i) == (256, 256)
    assert [(a.shape, a.dtype) for a in (w13p, s13p, b13p, w2p, s2p, b2p)] == [
        ((e, 512, 128), jnp.uint8), ((e, 512, 8), jnp.uint8), ((e, 512), jnp.float32),
        ((e, 256, 128), jnp.uint8), ((e, 256, 8), jnp.uint8), ((e, 256), jnp.float32)]
    rows = lambda a: _runner_gate_up_rows(a, layout, 512)  # noqa: E731
    np.testing.assert_array_equal(w13p, _shuffled_rows(_zero_extend(rows(q13), 128, 2)))
    np.testing.assert_array_equal(s13p, _tiled_128x4(_shuffled_rows(_zero_extend(rows(quant.w13_scale), 8, 2))))
    b13f = np.asarray(b13.astype(jnp.float32))
    np.testing.assert_array_equal(b13p, _shuffled_rows(rows(b13f[..., None]))[..., 0])
    np.testing.assert_array_equal(w2p, _shuffled_rows(_zero_extend(_zero_extend(q2, 256, 1), 128, 2)))
    np.testing.assert_array_equal(
        s2p, _tiled_128x4(_shuffled_rows(_zero_extend(_zero_extend(quant.w2_scale, 256, 1), 8, 2))))
    b2f = np.asarray(b2.astype(jnp.float32))
    np.testing.assert_array_equal(b2p, _shuffled_rows(_zero_extend(b2f, 256, 1)[..., None])[..., 0])


def test_mxfp4_prepared_restores_the_checkpoint_and_records_its_activation():
    """prepare() -> Mxfp4Prepared (swigluoai constants per expert, act recorded, unpadded sizes);
    restore_mxfp4_weights gives back exactly what was stored (biases as float32)."""
    e, h, i = 3, 64, 96
    q13, q2, quant = quantize_weights("mxfp4", *rng_weights(e, h, i, seed=3), act="mxfp8")
    b13 = jnp.asarray(np.random.default_rng(4).standard_normal((e, 2 * i)), jnp.bfloat16)
    cfg = MoEConfig(e, 2, h, i, "swigluoai", gate_up_layout="interleaved")
    p = trt.prepare(q13, q2, cfg, quant, w13_bias=b13)
    assert isinstance(p, trt.Mxfp4Prepared) and (p.act, p.hidden, p.intermediate) == ("mxfp8", h, i)
    for name, v in (("swiglu_alpha", 1.702), ("swiglu_beta", 1.0), ("swiglu_limit", 7.0)):
        np.testing.assert_allclose(getattr(p, name), np.full((e,), v, np.float32))
    w13, s13, bb13, w2, s2, bb2 = trt.restore_mxfp4_weights(p, "interleaved")
    for got, want in ((w13, q13), (s13, quant.w13_scale), (w2, q2), (s2, quant.w2_scale),
                      (bb13, b13.astype(jnp.float32))):
        np.testing.assert_array_equal(got, want)
    assert bb2 is None and p.w2_bias is None
    silu = trt.prepare(q13, q2, MoEConfig(e, 2, h, i), quant.replace(act="bf16"))
    assert silu.swiglu_alpha is None and silu.act == "bf16" and silu.activation == "silu"


@pytest.mark.parametrize("t,k,e,tile", [
    (0, 4, 32, 8),      # no tokens: power of two 1, clamped up to 8
    (50, 4, 32, 8),     # 6 per expert * 1.3 = 7 -> 8
    (64, 4, 32, 16),    # 8 * 1.3 = 10 -> 16
    (128, 4, 32, 32),   # 16 * 1.3 = 20 -> 32 (the imbalance factor moves it off 16)
    (200, 4, 32, 32),   # 25 * 1.3 = 32 -> 32
    (400, 4, 32, 64),   # 50 * 1.3 = 65 -> 128, clamped to 64
    (4096, 8, 128, 64),
])
def test_tile_tokens_dim_follows_seed_002(t, k, e, tile):
    assert trt.tile_tokens_dim(t, k, e) == tile


def test_tile_tokens_dim_rejects_bad_counts():
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        trt.tile_tokens_dim(10, 2, 0)


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
def test_prepare_nvfp4_weights_match_the_documented_layout(layout):
    """NVFP4: rows [up0, gate0, ...] for weights and e4m3 scales, 32-row shuffle, scales 128x4-tiled;
    w2 shuffled likewise; nothing padded (H 128, I 64); restore inverts it."""
    e, h, i = 2, 128, 64
    q13, q2, quant = quantize_weights("nvfp4", *rng_weights(e, h, i, seed=1), a13_scale=0.01, a2_scale=0.02)
    out = trt.prepare_nvfp4_weights(q13, quant.w13_scale, q2, quant.w2_scale, gate_up_layout=layout)
    w13p, s13p, w2p, s2p = out
    assert [(a.shape, a.dtype) for a in out] == [((e, 128, 64), jnp.uint8), ((e, 128, 8), jnp.float8_e4m3fn),
                                                 ((e, 128, 32), jnp.uint8), ((e, 128, 4), jnp.float8_e4m3fn)]
    np.testing.assert_array_equal(w13p, _shuffled_rows(_runner_gate_up_rows(q13, layout)))
    np.testing.assert_array_equal(_bytes(s13p), _tiled_128x4(_shuffled_rows(
        _runner_gate_up_rows(_bytes(quant.w13_scale), layout))))
    np.testing.assert_array_equal(w2p, _shuffled_rows(q2))
    np.testing.assert_array_equal(_bytes(s2p), _tiled_128x4(_shuffled_rows(_bytes(quant.w2_scale))))
    back = trt.restore_nvfp4_weights(*out, gate_up_layout=layout)
    for got, want in zip(back, (q13, quant.w13_scale, q2, quant.w2_scale)):
        np.testing.assert_array_equal(_bytes(got), _bytes(want))


def test_prepare_nvfp4_scalars_follow_vllm():
    """output1_scale_scalar = a13 * w13_scale_2 / a2, gate = a13 * w13_scale_2, output2 = a2 * w2_scale_2,
    with vLLM's weight_scale_2 = 1 / jax_moe's global scale; activation scales collapse to their max;
    x is quantized with 1 / a13."""
    e, h, i = 2, 128, 64
    a13 = jnp.asarray([0.01, 0.03], jnp.float32)
    q13, q2, quant = quantize_weights("nvfp4", *rng_weights(e, h, i, seed=2), a13_scale=a13, a2_scale=0.05)
    p = trt.prepare(q13, q2, MoEConfig(e, 2, h, i), quant)
    ws13 = 1.0 / np.asarray(quant.w13_global_scale)
    ws2 = 1.0 / np.asarray(quant.w2_global_scale)
    np.testing.assert_allclose(p.out1_gate_scale, 0.03 * ws13, rtol=1e-6)
    np.testing.assert_allclose(p.out1_scale, 0.03 * ws13 / 0.05, rtol=1e-6)
    np.testing.assert_allclose(p.out2_scale, 0.05 * ws2, rtol=1e-6)
    assert float(p.a1_gscale) == pytest.approx(1 / 0.03, rel=1e-6) and p.out1_scale.shape == (e,)


def _block_rows_reference(w):
    """[E, M, K] fp8 bytes: 16-row shuffle blocks, then out[e, q, r, j] = shuffled[e, r, 128q + j]."""
    sh = _shuffled_rows(w, block=16)
    e, m, k = sh.shape
    out = np.empty((e, k // 128, m, 128), sh.dtype)
    for q in range(k // 128):
        out[:, q] = sh[:, :, 128 * q:128 * (q + 1)]
    return out


def test_prepare_fp8_block_weights_match_the_documented_layout():
    """DeepSeek FP8 block scale: w13 rows [up; gate], 16-row shuffle (epilogue tile 64), BlockMajorK
    chunks of 128; scale row halves swapped, not shuffled; w2 shuffled and chunked; restore inverts."""
    e, h, i = 2, 256, 128
    q13, q2, quant = quantize_weights("fp8_block", *rng_weights(e, h, i, seed=5))
    out = trt.prepare_fp8_block_weights(q13, quant.w13_scale, q2, quant.w2_scale)
    w13p, s13p, w2p, s2p = out
    assert [(a.shape, a.dtype) for a in out] == [
        ((e, 2, 256, 128), jnp.float8_e4m3fn), ((e, 2, 2), jnp.float32),
        ((e, 1, 256, 128), jnp.float8_e4m3fn), ((e, 2, 1), jnp.float32)]
    b13 = _bytes(q13)
    np.testing.assert_array_equal(_bytes(w13p), _block_rows_reference(np.concatenate([b13[:, i:], b13[:, :i]], 1)))
    s13 = np.asarray(quant.w13_scale)
    np.testing.assert_array_equal(s13p, np.concatenate([s13[:, 1:], s13[:, :1]], 1))
    np.testing.assert_array_equal(_bytes(w2p), _block_rows_reference(_bytes(q2)))
    np.testing.assert_array_equal(s2p, quant.w2_scale)
    back = trt.restore_fp8_block_weights(*out)
    for got, want in zip(back, (q13, quant.w13_scale, q2, quant.w2_scale)):
        np.testing.assert_array_equal(_bytes(got), _bytes(want))
    p = trt.prepare(q13, q2, MoEConfig(4, 2, h, i), quant.replace())  # E = 4 in cfg: a multiple of 4
    assert isinstance(p, trt.Fp8BlockPrepared) and p.intermediate == i


def _u8(*shape):
    return jnp.asarray(np.random.default_rng(0).integers(0, 255, shape), jnp.uint8)


@pytest.mark.parametrize("call,match", [
    (lambda: trt.prepare_mxfp4_weights(_u8(2, 64, 32), _u8(2, 64, 2).astype(jnp.float32), _u8(2, 64, 16),
                                       _u8(2, 64, 1)), "w13_scale must be uint8"),
    (lambda: trt.prepare_mxfp4_weights(_u8(2, 60, 32), _u8(2, 64, 2), _u8(2, 64, 16), _u8(2, 64, 1)),
     r"w13 must be uint8 \[2, 64, 32\]"),
    (lambda: trt.prepare_mxfp4_weights(_u8(2, 64, 32), _u8(2, 64, 2), _u8(2, 64, 16), _u8(2, 64, 1),
                                       jnp.zeros((2, 32), jnp.bfloat16)), "w13_bias must be"),
    (lambda: trt.prepare_mxfp4_weights(_u8(2, 64, 32), _u8(2, 64, 2), _u8(2, 48, 16), _u8(2, 48, 1)),
     "w2: hidden size H = 48 must be a multiple of the scale block 32"),
    (lambda: trt.prepare_nvfp4_weights(_u8(2, 64, 64), _u8(2, 64, 8), _u8(2, 128, 16), _u8(2, 128, 2)),
     "w2: intermediate size 32 must be a multiple of 64"),
    (lambda: trt.prepare_nvfp4_weights(_u8(2, 128, 64), _u8(2, 128, 8), _u8(2, 128, 32),
                                       _u8(2, 128, 4).view(jnp.float8_e4m3fn)), "w13_scale must be float8_e4m3fn"),
    (lambda: trt.prepare_fp8_block_weights(jnp.zeros((2, 256, 192), jnp.float8_e4m3fn), jnp.ones((2, 2, 2)),
                                           jnp.zeros((2, 192, 128), jnp.float8_e4m3fn), jnp.ones((2, 2, 1))),
     r"w2: rows \(192\) must be a multiple of 128"),
    (lambda: trt.prepare_fp8_block_weights(jnp.zeros((2, 256, 256), jnp.float8_e4m3fn), jnp.ones((2, 2, 2)),
                                           jnp.zeros((2, 256, 128), jnp.bfloat16), jnp.ones((2, 2, 1))),
     "w2 must be float8_e4m3fn"),
])
def test_preparations_raise_value_errors_naming_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_shape_rules_of_the_prepared_schemes():
    """The activation operands each scheme's call takes (input_shapes) are what quantize_input makes;
    the result is bf16 [T, kernel H] (MXFP4: padded H) plus the workspace; check_call names x."""
    e, h, i, t = 2, 96, 160, 5
    q13, q2, quant = quantize_weights("mxfp4", *rng_weights(e, h, i), act="mxfp8")
    mx = trt.prepare(q13, q2, MoEConfig(e, 2, h, i), quant)
    q13, q2, quant = quantize_weights("nvfp4", *rng_weights(e, 128, 64), a13_scale=0.01, a2_scale=0.02)
    nv = trt.prepare(q13, q2, MoEConfig(e, 2, 128, 64), quant)
    q13, q2, quant = quantize_weights("fp8_block", *rng_weights(e, 256, 128))
    fb = trt.prepare_fp8_block(q13, q2, MoEConfig(e, 2, 256, 128), quant)
    sds = jax.ShapeDtypeStruct
    want = [(mx, (sds((t, 256), jnp.float8_e4m3fn), sds((t, 8), jnp.uint8))),
            (nv, (sds((t, 64), jnp.uint8), sds((t, 8), jnp.float8_e4m3fn))),
            (fb, (sds((t, 256), jnp.float8_e4m3fn), sds((2, t), jnp.float32)))]
    for prep, shapes in want:
        hm = trt.kernel_sizes(prep)[1]
        assert trt.input_shapes(prep, t) == shapes
        assert jax.eval_shape(trt.quantize_input, sds((t, hm), jnp.bfloat16), prep) == shapes
        out, _ = trt.output_shapes(t, trt.kernel_sizes(prep)[2], 64)
        assert out.dtype == jnp.bfloat16 and out.shape == (t, 256 if prep is mx else hm)
        assert trt.check_call(jnp.zeros((t, hm)), prep, jnp.zeros((t, 2)), jnp.zeros((t, 2), jnp.int32))[1] \
            == trt.kernel_sizes(prep)[2]
        with pytest.raises(ValueError, match=f"x \\[T, {hm + 32}\\] does not match prepared {prep.scheme}"):
            trt.check_call(jnp.zeros((t, hm + 32)), prep, jnp.zeros((t, 2)), jnp.zeros((t, 2), jnp.int32))
    x = jnp.asarray(np.random.default_rng(9).standard_normal((t, h)), jnp.float32)
    q, sf = trt.quantize_input(x, mx)  # MXFP8 of x zero-extended to Hp
    ref_q, ref_sf = fp4.quantize_mxfp8(jnp.pad(x, ((0, 0), (0, 256 - h))))
    np.testing.assert_array_equal(_bytes(q), _bytes(ref_q))
    np.testing.assert_array_equal(sf, ref_sf)


@pytest.mark.parametrize("cfg,quant,start", [
    (MoEConfig(128, 8, 2048, 96), scheme_only("nvfp4"),
     "intermediate size 96 must be a multiple of 64 (w13's 2I scale rows fill 128-row tiles; NVFP4 is not padded)"),
    (CFG, scheme_only("nvfp4", act="bf16"), "NVFP4 needs NVFP4 activations (act='nvfp4'), not 'bf16'"),
    (CFG, scheme_only("nvfp4", a2_scale=None), "NVFP4 needs static a13_scale and a2_scale"),
    (MoEConfig(128, 8, 2048, 768, "gelu"), scheme_only("nvfp4"), "activation 'gelu' is not wired up (have ['silu'])"),
    (MoEConfig(128, 8, 2000, 768), scheme_only("nvfp4"), "hidden size 2000 must be a multiple of 128"),
    (MoEConfig(130, 8, 2048, 768), scheme_only("fp8_block", 130),
     "130 experts: trtllm_fp8_block_scale_moe needs a multiple of 4"),
    (MoEConfig(128, 8, 2048, 704), scheme_only("fp8_block"), "intermediate size 704 must be a multiple of 128"),
    (CFG, scheme_only("fp8_block", act="bf16"), "FP8 block scale needs per-token-group FP8 activations"),
    (CFG, scheme_only("fp8_block", block_shape=(1, 128)), "FP8 block scale needs 128 x 128 blocks, not (1, 128)"),
    (MoEConfig(128, 8, 2048, 768, gate_up_layout="interleaved"), scheme_only("fp8_block"),
     "gate_up_layout must be 'concat'"),
    (MoEConfig(128, 8, 2000, 768), scheme_only("mxfp4"), "hidden size 2000 must be a multiple of the MXFP4 scale block 32"),
    (MoEConfig(128, 8, 2048, 768, "relu2"), scheme_only("mxfp4"),
     "activation 'relu2' is not wired up (have ['silu', 'swigluoai'])"),
    (MoEConfig(128, 40, 2048, 768), scheme_only("mxfp4"), "top_k 40 must be in [1, min(32, E)]"),
    (MoEConfig(1024, 8, 2048, 768), scheme_only("mxfp4", 1024), "1024 experts exceed the routing kernels' 512"),
])
def test_fp4_and_fp8_block_schemes_give_shape_reasons_first(cfg, quant, start, fake_module):
    write_cubins(fake_module)
    ok, why = trt.supports(cfg, quant, B200)
    assert not ok and why.startswith(start), why


def test_mxfp4_pads_what_fp8_refuses(fake_module):
    """H = 2016 (63 blocks of 32) is padded to 2048 for MXFP4, so it is served; FP8 per tensor is
    not padded along H and refuses it."""
    write_cubins(fake_module)
    cfg = MoEConfig(128, 8, 2016, 768)
    assert trt.supports(cfg, scheme_only("mxfp4"), B200)[0]
    assert trt.supports(cfg, scheme_only("fp8"), B200)[1] == "hidden size 2016 must be a multiple of 128"


def test_prepare_raises_the_scheme_reasons():
    q13, q2, quant = quantize_weights("nvfp4", *rng_weights(2, 128, 64), act="bf16")
    with pytest.raises(ValueError, match="flashinfer_trtllm: NVFP4 needs NVFP4 activations"):
        trt.prepare(q13, q2, MoEConfig(2, 1, 128, 64), quant)
    with pytest.raises(ValueError, match="expert biases .* not supported yet for scheme 'nvfp4'"):
        trt.prepare(q13, q2, MoEConfig(2, 1, 128, 64), quant, w13_bias=jnp.zeros((2, 128)))


def test_prepared_pytrees_flatten_and_jit():
    q13, q2, quant = quantize_weights("nvfp4", *rng_weights(2, 128, 64), a13_scale=0.01, a2_scale=0.02)
    p = trt.prepare(q13, q2, MoEConfig(2, 1, 128, 64), quant)
    leaves, tree = jax.tree.flatten(p)
    assert len(leaves) == 8 and jax.tree.unflatten(tree, leaves).intermediate == 64
    assert jax.jit(lambda q: q.out1_scale * 2)(p).shape == (2,)
