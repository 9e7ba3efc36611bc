"""backend="flashinfer_trtllm" (FlashInfer's TRT-LLM gen fused MoE, SM100): load-time layout against
loop definitions, the shape rule, ValueErrors before lowering, the oracle's refusal reasons with the
native module and its cubin query faked; the GPU test runs only on compute capability 10.x."""

import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import oracle
from jax_moe.backends import flashinfer_trtllm as trt
from jax_moe.config import MoEConfig
from jax_moe.device import DeviceInfo
from jax_moe.layouts import mxfp4_padded_sizes
from jax_moe.quant import fp4
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from helpers import random_moe, random_routing, random_weights, rel_err, scheme_only, sm100

H100, B200, B300, RTX5090 = (DeviceInfo("gpu", c) for c in ((9, 0), (10, 0), (10, 3), (12, 0)))
CFG = MoEConfig(128, 8, 2048, 768)
CUBINS = [("pack/batched_gemm-x/Bmm_E4m3_a.cubin", ""), ("pack/batched_gemm-x/Bmm_E4m3_b.cubin", "")]


def _fp8_quant(e=4, h=128, i=24, a13=0.02, a2=0.5, seed=0):
    rng = np.random.default_rng(seed)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32)
    return quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a2)


class FakeModule:
    """Stands in for jax_moe._jax_moe_trtllm: its scheme list, cubin list and workspace size; it
    records the arguments of its cubin and workspace queries."""

    def __init__(self, cubins=CUBINS, workspace=4096, schemes=("fp8", "nvfp4", "mxfp4", "fp8_block")):
        self._cubins, self._ws, self._schemes = cubins, workspace, list(schemes)
        self.calls = []

    def schemes(self):
        return list(self._schemes)

    def cubins(self, *args, **kwargs):
        self.calls.append(("cubins", args, kwargs))
        return list(self._cubins)

    def workspace_size(self, *args, **kwargs):
        self.calls.append(("workspace_size", args, kwargs))
        return self._ws

    def registrations(self):
        return {}


@pytest.fixture
def no_module(monkeypatch):
    monkeypatch.setitem(trt._state, "module", None)
    monkeypatch.setitem(trt._state, "error", "jax_moe._jax_moe_trtllm is not built (simulated)")


@pytest.fixture
def fake_module(monkeypatch, tmp_path):
    """The module present, cubins read from an empty tmp_path (JAX_MOE_TRTLLM_CUBIN_DIR)."""
    monkeypatch.setitem(trt._state, "module", FakeModule())
    monkeypatch.setitem(trt._state, "error", None)
    monkeypatch.setenv(trt.CUBIN_ENV, str(tmp_path))
    return tmp_path


def _write_cubins(root, cubins=CUBINS, data=b"cubin"):
    for rel, _ in cubins:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)


# ----------------------------------------------------------------------------- load-time layout


def _expected_w13(w13, ip):
    """The runner's w13 rows by loops: pad each half to ip, [gate; up] -> [up; gate], interleave
    (row 2j = up_j, 2j+1 = gate_j), then per 32-row block out[8b + a] = in[4a + b]."""
    e, n, h = w13.shape
    i = n // 2
    gate = np.zeros((e, ip, h), w13.dtype)
    up = np.zeros((e, ip, h), w13.dtype)
    gate[:, :i], up[:, :i] = w13[:, :i], w13[:, i:]
    inter = np.empty((e, 2 * ip, h), w13.dtype)
    for j in range(ip):
        inter[:, 2 * j], inter[:, 2 * j + 1] = up[:, j], gate[:, j]
    return _expected_shuffle(inter)


def _expected_shuffle(x):
    out = np.empty_like(x)
    for blk in range(x.shape[1] // 32):
        for a in range(8):
            for b in range(4):
                out[:, blk * 32 + 8 * b + a] = x[:, blk * 32 + 4 * a + b]
    return out


def test_prepare_fp8_weights_match_loop_definition():
    q13, q2, _ = _fp8_quant(e=3, h=128, i=24)
    w13p, w2p = trt.prepare_fp8_weights(q13, q2)
    assert w13p.shape == (3, 64, 128) and w2p.shape == (3, 128, 32)  # I 24 -> 32
    assert w13p.dtype == jnp.float8_e4m3fn and w2p.dtype == jnp.float8_e4m3fn
    bits = lambda a: np.asarray(a).view(np.uint8)  # noqa: E731
    np.testing.assert_array_equal(bits(w13p), _expected_w13(bits(q13), 32))
    w2pad = np.zeros((3, 128, 32), np.uint8)
    w2pad[:, :, :24] = bits(q2)
    np.testing.assert_array_equal(bits(w2p), _expected_shuffle(w2pad))


def test_prepare_scales_follow_the_trtllm_epilogue():
    """out1 = w13_scale * a13 / a2 (dequantize GEMM1, requantize for GEMM2), gate = w13_scale * a13,
    out2 = w2_scale * a2; per-expert activation scales collapse to their max."""
    q13, q2, quant = _fp8_quant(e=4, a13=jnp.asarray([0.01, 0.04, 0.02, 0.03]), a2=0.5)
    cfg = MoEConfig(4, 2, 128, 24)
    p = trt.prepare(q13, q2, cfg, quant)
    w13s, w2s = np.asarray(quant.w13_scale), np.asarray(quant.w2_scale)
    np.testing.assert_allclose(p.out1_gate_scale, w13s * 0.04, rtol=1e-6)
    np.testing.assert_allclose(p.out1_scale, w13s * 0.04 / 0.5, rtol=1e-6)
    np.testing.assert_allclose(p.out2_scale, w2s * 0.5, rtol=1e-6)
    assert p.out1_scale.shape == (4,) and p.intermediate == 24 and float(p.a13_scale) == pytest.approx(0.04)


@pytest.mark.parametrize("bad,match", [
    (dict(w13_bias=jnp.zeros((4, 48))), "w13_bias/w2_bias"),
    (dict(cfg=MoEConfig(4, 2, 128, 24, "gelu")), "activation 'gelu'"),
    (dict(quant_change=dict(a2_scale=None)), "static a13_scale and a2_scale"),
    (dict(quant_change=dict(act="fp8_per_token")), "per-tensor activation scales"),
])
def test_prepare_refuses_with_a_value_error(bad, match):
    q13, q2, quant = _fp8_quant()
    if "quant_change" in bad:
        quant = quant.replace(**bad["quant_change"])
    with pytest.raises(ValueError, match=match):
        trt.prepare(q13, q2, bad.get("cfg", MoEConfig(4, 2, 128, 24)), quant, w13_bias=bad.get("w13_bias"))


def test_prepare_fp8_weights_checks_shapes():
    with pytest.raises(ValueError, match="w13 must have shape"):
        trt.prepare_fp8_weights(jnp.zeros((2, 30, 128)), jnp.zeros((2, 128, 16)))
    with pytest.raises(ValueError, match="multiple of 128"):
        trt.prepare_fp8_weights(jnp.zeros((2, 32, 96)), jnp.zeros((2, 96, 16)))


# ----------------------------------------------------------------------------- per call


@pytest.mark.parametrize("t,k,e,tile", [(1, 8, 128, 8), (64, 8, 128, 8), (300, 8, 128, 32),
                                        (1000, 2, 8, 128), (4096, 8, 16, 128)])
def test_default_tile_n(t, k, e, tile):
    assert trt.default_tile_n(t, k, e) == tile


def _prepared(e=4, h=128, i=24):
    q13, q2, quant = _fp8_quant(e=e, h=h, i=i)
    return trt.prepare(q13, q2, MoEConfig(e, 2, h, i), quant)


def test_shape_rule(monkeypatch, fake_module):
    """Under eval_shape: out bf16 [T, H]; the workspace size comes from the module's query."""
    monkeypatch.setattr(trt.native, "register", lambda: None)
    trt.workspace_size.cache_clear()
    prep = _prepared()
    x = jax.ShapeDtypeStruct((5, 128), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((5, 2), jnp.float32)
    ids = jax.ShapeDtypeStruct((5, 2), jnp.int32)
    out = jax.eval_shape(lambda *a: trt.apply_prepared(*a), x, prep, w, ids)
    assert out.shape == (5, 128) and out.dtype == jnp.bfloat16
    o, ws = trt.output_shapes(5, 128, 4096)
    assert (o.shape, o.dtype, ws.shape, ws.dtype) == ((5, 128), jnp.bfloat16, (4096,), jnp.uint8)
    trt.workspace_size.cache_clear()


@pytest.mark.parametrize("change,match", [
    (dict(x=jnp.zeros((5,))), "x must be"),
    (dict(x=jnp.zeros((5, 256))), "does not match prepared"),
    (dict(ids=np.zeros((5, 2), np.int16)), "int32"),
    (dict(ids=jnp.zeros((4, 2), jnp.int32)), "topk_ids must be"),
    (dict(w=jnp.zeros((5, 3))), "topk_weights must have"),
    (dict(ids=jnp.zeros((5, 5), jnp.int32), w=jnp.zeros((5, 5))), "top_k 5"),
    (dict(tile_n=12), "tile_n must be one of"),
    (dict(prepared="weights"), "prepared must be"),
])
def test_apply_prepared_value_errors_name_the_argument(change, match, no_module):
    """Checked before anything is lowered (the module is absent here, so nothing else could run)."""
    args = dict(x=jnp.zeros((5, 128)), prepared=_prepared(), w=jnp.zeros((5, 2)),
                ids=jnp.zeros((5, 2), jnp.int32), tile_n=None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        trt.apply_prepared(args["x"], args["prepared"], args["w"], args["ids"], tile_n=args["tile_n"])


# ----------------------------------------------------------------------------- oracle


@pytest.mark.parametrize("device,text", [
    (H100, "needs SM100 (compute capability 10.x: B200/GB200/B300); this device is SM90 (9.0)"),
    (RTX5090, "needs SM100 (compute capability 10.x: B200/GB200/B300); this device is SM120 (12.0)"),
    (DeviceInfo("cpu"), "needs SM100 (compute capability 10.x: B200/GB200/B300); this device is cpu (n/a)"),
])
def test_refuses_other_hardware(device, text, fake_module):
    _write_cubins(fake_module)
    ok, why = trt.supports(CFG, scheme_only("fp8"), device)
    assert not ok and why == text


def test_refuses_without_the_module(no_module):
    ok, why = trt.supports(CFG, scheme_only("fp8"), B200)
    assert not ok and "jax_moe._jax_moe_trtllm is not built" in why


def test_refuses_without_cubins_and_names_the_directory(fake_module):
    ok, why = trt.supports(CFG, scheme_only("fp8"), B200)
    assert not ok
    assert why.startswith(f"cubins not found in {fake_module} (2 of 2 missing, e.g. pack/batched_gemm-x/")


@pytest.mark.parametrize("device", [B200, B300], ids=["SM100", "SM103"])
def test_serves_fp8_with_module_and_cubins(device, fake_module):
    _write_cubins(fake_module)
    ok, why = trt.supports(CFG, scheme_only("fp8"), device)
    assert ok, why
    _, ok, _ = oracle.probe("flashinfer_trtllm", CFG, scheme_only("fp8"), device)
    assert ok
    # a row that can serve, but not in AUTO yet: chosen only when forced or prepared-and-listed
    assert oracle.select_backend(CFG, scheme_only("fp8"), device=device, backend="flashinfer_trtllm").name == NAME
    assert oracle.select_backend(CFG, scheme_only("fp8"), device=device).name == "xla"


NAME = "flashinfer_trtllm"


@pytest.mark.parametrize("cfg,scheme_name,start", [
    (CFG, "bf16", "does not serve scheme 'bf16' (serves fp8, fp8_block, mxfp4, nvfp4)"),
    (MoEConfig(128, 8, 2000, 768), "fp8", "hidden size 2000 must be a multiple of 128"),
    (MoEConfig(128, 8, 2048, 768, "relu2"), "fp8", "activation 'relu2' is not wired up"),
    (MoEConfig(1024, 8, 2048, 768), "fp8", "1024 experts exceed the routing kernels' 512"),
])
def test_refusal_reasons_for_config(cfg, scheme_name, start, fake_module):
    _write_cubins(fake_module)
    ok, why = trt.supports(cfg, scheme_only(scheme_name, cfg.num_experts), B200)
    assert not ok and why.startswith(start), why


def test_missing_cubins_checks_presence_and_sha256(tmp_path):
    _write_cubins(tmp_path, data=b"abc")
    good = hashlib.sha256(b"abc").hexdigest()
    cubins = [(CUBINS[0][0], good), (CUBINS[1][0], "0" * 64), ("pack/absent.cubin", "")]
    assert trt.missing_cubins(cubins, str(tmp_path)) == [os.path.join(str(tmp_path), "pack/absent.cubin")]
    assert trt.missing_cubins(cubins, str(tmp_path), verify=True) == [
        os.path.join(str(tmp_path), CUBINS[1][0]), os.path.join(str(tmp_path), "pack/absent.cubin")]


def test_cubin_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(trt.CUBIN_ENV, raising=False)
    monkeypatch.delenv("FLASHINFER_CUBIN_DIR", raising=False)
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", str(tmp_path))
    assert trt.cubin_root() == os.path.join(str(tmp_path), ".cache", "flashinfer", "cubins")
    monkeypatch.setenv("FLASHINFER_CUBIN_DIR", "/fi")
    assert trt.cubin_root() == "/fi"
    monkeypatch.setenv(trt.CUBIN_ENV, "/ours")
    assert trt.cubin_root() == "/ours"


# ----------------------------------------------------------------------------- TRT-LLM FP4 / FP8 block
# The references below follow the layouts as the docstrings state them in words (row orders,
# 32- or 16-row shuffle blocks, the 128x4 scale tile's flat offset, BlockMajorK chunks), by loops.


def _rng_weights(e, h, i, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float32),
            jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32))


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
    q13, q2, quant = quantize_weights("mxfp4", *_rng_weights(e, h, i))
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
    q13, q2, quant = quantize_weights("mxfp4", *_rng_weights(e, h, i, seed=3), act="mxfp8")
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
    q13, q2, quant = quantize_weights("nvfp4", *_rng_weights(e, h, i, seed=1), a13_scale=0.01, a2_scale=0.02)
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
    q13, q2, quant = quantize_weights("nvfp4", *_rng_weights(e, h, i, seed=2), a13_scale=a13, a2_scale=0.05)
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
    q13, q2, quant = quantize_weights("fp8_block", *_rng_weights(e, h, i, seed=5))
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
    q13, q2, quant = quantize_weights("mxfp4", *_rng_weights(e, h, i), act="mxfp8")
    mx = trt.prepare(q13, q2, MoEConfig(e, 2, h, i), quant)
    q13, q2, quant = quantize_weights("nvfp4", *_rng_weights(e, 128, 64), a13_scale=0.01, a2_scale=0.02)
    nv = trt.prepare(q13, q2, MoEConfig(e, 2, 128, 64), quant)
    q13, q2, quant = quantize_weights("fp8_block", *_rng_weights(e, 256, 128))
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
    _write_cubins(fake_module)
    ok, why = trt.supports(cfg, quant, B200)
    assert not ok and why.startswith(start), why


def test_mxfp4_pads_what_fp8_refuses(fake_module):
    """H = 2016 (63 blocks of 32) is padded to 2048 for MXFP4, so it is served; FP8 per tensor is
    not padded along H and refuses it."""
    _write_cubins(fake_module)
    cfg = MoEConfig(128, 8, 2016, 768)
    assert trt.supports(cfg, scheme_only("mxfp4"), B200)[0]
    assert trt.supports(cfg, scheme_only("fp8"), B200)[1] == "hidden size 2016 must be a multiple of 128"


def test_prepare_raises_the_scheme_reasons():
    q13, q2, quant = quantize_weights("nvfp4", *_rng_weights(2, 128, 64), act="bf16")
    with pytest.raises(ValueError, match="flashinfer_trtllm: NVFP4 needs NVFP4 activations"):
        trt.prepare(q13, q2, MoEConfig(2, 1, 128, 64), quant)
    with pytest.raises(ValueError, match="expert biases .* not supported yet for scheme 'nvfp4'"):
        trt.prepare(q13, q2, MoEConfig(2, 1, 128, 64), quant, w13_bias=jnp.zeros((2, 128)))


def test_prepared_pytrees_flatten_and_jit():
    q13, q2, quant = quantize_weights("nvfp4", *_rng_weights(2, 128, 64), a13_scale=0.01, a2_scale=0.02)
    p = trt.prepare(q13, q2, MoEConfig(2, 1, 128, 64), quant)
    leaves, tree = jax.tree.flatten(p)
    assert len(leaves) == 8 and jax.tree.unflatten(tree, leaves).intermediate == 64
    assert jax.jit(lambda q: q.out1_scale * 2)(p).shape == (2,)


# ----------------------------------------------------------------------------- FP4 block-scale handler
# jax_moe_trtllm_fp4_block_scale_moe: the operands apply_prepared hands the target (read off the
# jaxpr, nothing lowered), the workspace query, the argument checks and the refusals.


def _nvfp4_prepared(e=2, h=128, i=64):
    q13, q2, quant = quantize_weights("nvfp4", *_rng_weights(e, h, i, seed=11), a13_scale=0.01, a2_scale=0.02)
    return trt.prepare(q13, q2, MoEConfig(e, 2, h, i), quant)


def _mxfp4_prepared(act="bf16", activation="swigluoai", bias=True, e=2, h=96, i=160):
    q13, q2, quant = quantize_weights("mxfp4", *_rng_weights(e, h, i, seed=12), act=act)
    rng = np.random.default_rng(13)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.bfloat16) if bias else None
    b2 = jnp.asarray(rng.standard_normal((e, h)), jnp.bfloat16) if bias else None
    return trt.prepare(q13, q2, MoEConfig(e, 2, h, i, activation), quant, w13_bias=b13, w2_bias=b2)


def _ffi_eqn(fn, *args):
    """The ffi_call equation of ``fn``'s jaxpr: (target name, operand avals, result avals, attributes)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    eqns = [q for q in jaxpr.eqns if q.primitive.name == "ffi_call"]
    assert len(eqns) == 1, jaxpr
    q = eqns[0]
    return (q.params["target_name"], [v.aval for v in q.invars], [v.aval for v in q.outvars],
            dict(q.params["attributes"]))


def _sig(avals):
    return [(tuple(a.shape), jnp.dtype(a.dtype).name) for a in avals]


def _fp4_call(prep, t=5, tile_n=None):
    hm = trt.kernel_sizes(prep)[1]
    x = jax.ShapeDtypeStruct((t, hm), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((t, 2), jnp.float32)
    ids = jax.ShapeDtypeStruct((t, 2), jnp.int32)
    fn = lambda *a: trt.apply_prepared(*a, tile_n=tile_n)  # noqa: E731
    return jax.eval_shape(fn, x, prep, w, ids), _ffi_eqn(fn, x, prep, w, ids)


@pytest.fixture
def fp4_module(monkeypatch, fake_module):
    monkeypatch.setattr(trt.native, "register", lambda: None)
    trt.workspace_size.cache_clear()
    yield trt._state["module"]
    trt.workspace_size.cache_clear()


def test_nvfp4_call_operands_and_shape_rule(fp4_module):
    """NVFP4: x as E2M1 pairs [T, H/2] with e4m3 scales [T, H/16], weights and scales as prepared,
    biases and swiglu constants absent (zero-element), the three epilogue scalars; out bf16 [T, H]
    plus the workspace the module sized for scheme id 1 with the kernel's H and I."""
    prep = _nvfp4_prepared()
    out, (target, ins, outs, params) = _fp4_call(prep)
    assert (out.shape, out.dtype) == ((5, 128), jnp.bfloat16)
    assert target == "jax_moe_trtllm_fp4_block_scale_moe" == trt.TARGETS["nvfp4"]
    none = ((0,), "float32")
    assert _sig(ins) == [((5, 64), "uint8"), ((5, 8), "float8_e4m3fn"), ((5, 2), "int32"), ((5, 2), "float32"),
                         ((2, 128, 64), "uint8"), ((2, 128, 8), "float8_e4m3fn"), none, none, none, none,
                         ((2, 128, 32), "uint8"), ((2, 128, 4), "float8_e4m3fn"), none,
                         ((2,), "float32"), ((2,), "float32"), ((2,), "float32")]
    assert _sig(outs) == [((5, 128), "bfloat16"), ((4096,), "uint8")]
    tile = trt.tile_tokens_dim(5, 2, 2)
    assert (params["activation"], params["tile_n"], params["config"]) == (3, tile, -1)
    _, args, kwargs = [c for c in fp4_module.calls if c[0] == "workspace_size"][-1]
    assert args == (5, 128, 64, 2, 2, 3, tile, -1) and kwargs == {"scheme": trt.SCHEME_IDS["nvfp4"]} == {"scheme": 1}


@pytest.mark.parametrize("act,sid", [("bf16", 2), ("mxfp8", 3)])
def test_mxfp4_call_operands_and_shape_rule(act, sid, fp4_module):
    """MXFP4 (H 96 -> Hp 256, I 160 -> Ip 256): x bf16 [T, Hp] and no scale, or MXFP8 [T, Hp] with
    E8M0 scales [T, Hp/32]; biases and swigluoai alpha/beta/limit given; no epilogue scalars. The
    kernel's out [T, Hp] is sliced back to [T, H]; the workspace is sized for scheme id 2 or 3."""
    prep = _mxfp4_prepared(act)
    out, (target, ins, outs, params) = _fp4_call(prep)
    assert (out.shape, out.dtype) == ((5, 96), jnp.bfloat16)
    assert target == trt.TARGETS["mxfp4"] == trt.TARGETS["nvfp4"]
    none, e_f32 = ((0,), "float32"), ((2,), "float32")
    xs = [((5, 256), "bfloat16"), ((0,), "uint8")] if act == "bf16" else [((5, 256), "float8_e4m3fn"),
                                                                         ((5, 8), "uint8")]
    assert _sig(ins) == xs + [((5, 2), "int32"), ((5, 2), "float32"), ((2, 512, 128), "uint8"),
                              ((2, 512, 8), "uint8"), ((2, 512), "float32"), e_f32, e_f32, e_f32,
                              ((2, 256, 128), "uint8"), ((2, 256, 8), "uint8"), ((2, 256), "float32"),
                              none, none, none]
    assert _sig(outs) == [((5, 256), "bfloat16"), ((4096,), "uint8")]
    _, args, kwargs = [c for c in fp4_module.calls if c[0] == "workspace_size"][-1]
    assert args[:5] == (5, 256, 256, 2, 2) and kwargs == {"scheme": sid} and trt.scheme_id("mxfp4", act) == sid


def test_mxfp4_silu_without_bias_passes_absent_operands(fp4_module):
    prep = _mxfp4_prepared("bf16", activation="silu", bias=False)
    _, (_, ins, _, params) = _fp4_call(prep, tile_n=64)
    assert _sig(ins)[6:10] == [((0,), "float32")] * 4 and _sig(ins)[12] == ((0,), "float32")
    assert params["tile_n"] == 64


@pytest.mark.parametrize("make,change,match", [
    (_nvfp4_prepared, dict(x=jnp.zeros((5, 256))), r"x \[T, 256\] does not match prepared nvfp4"),
    (_nvfp4_prepared, dict(ids=jnp.zeros((5, 2), jnp.int16)), "topk_ids must be int32"),
    (_nvfp4_prepared, dict(w=jnp.zeros((5, 3))), "topk_weights must have"),
    (_nvfp4_prepared, dict(tile_n=24), "tile_n must be one of"),
    (_mxfp4_prepared, dict(x=jnp.zeros((5, 256))), r"x \[T, 256\] does not match prepared mxfp4"),
    (_mxfp4_prepared, dict(tile_n=128), "tile_n must be at most 64 for MXFP4 with bf16 activations"),
    (_mxfp4_prepared, dict(ids=jnp.zeros((5, 3), jnp.int32), w=jnp.zeros((5, 3))), r"top_k 3 must be in \[1, min"),
])
def test_fp4_apply_prepared_value_errors_name_the_argument(make, change, match, no_module):
    """Checked before anything is lowered (the module is absent: nothing else could run)."""
    prep = make()
    hm = trt.kernel_sizes(prep)[1]
    args = dict(x=jnp.zeros((5, hm)), w=jnp.zeros((5, 2)), ids=jnp.zeros((5, 2), jnp.int32), tile_n=None)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        trt.apply_prepared(args["x"], prep, args["w"], args["ids"], tile_n=args["tile_n"])


def test_mxfp4_mxfp8_takes_tile_128(fp4_module):
    _, (_, _, _, params) = _fp4_call(_mxfp4_prepared("mxfp8"), tile_n=128)
    assert params["tile_n"] == 128


@pytest.mark.parametrize("quant,sid", [(scheme_only("nvfp4"), 1), (scheme_only("mxfp4"), 2),
                                       (scheme_only("mxfp4", act="mxfp8"), 3)])
@pytest.mark.parametrize("device", [B200, B300], ids=["SM100", "SM103"])
def test_serves_fp4_with_module_and_cubins(quant, sid, device, fake_module):
    """With the FP4 target in the module and the cubins of that scheme's runner present: served,
    and the cubin query names the runner (scheme id) the call will build."""
    _write_cubins(fake_module)
    ok, why = trt.supports(CFG, quant, device)
    assert ok, why
    _, args, _ = [c for c in trt._state["module"].calls if c[0] == "cubins"][-1]
    assert args[0] == sid
    assert oracle.select_backend(CFG, quant, device=device, backend="flashinfer_trtllm").name == NAME


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "fp8_block"])
def test_refuses_fp4_when_the_module_predates_its_target(name, monkeypatch, tmp_path):
    """A module built before the FP4 / FP8-block handlers (schemes() == ["fp8"]) is refused with
    what it lacks."""
    monkeypatch.setitem(trt._state, "module", FakeModule(schemes=("fp8",)))
    monkeypatch.setitem(trt._state, "error", None)
    monkeypatch.setenv(trt.CUBIN_ENV, str(tmp_path))
    _write_cubins(tmp_path)
    ok, why = trt.supports(CFG, scheme_only(name), B200)
    assert not ok and why == (f"scheme '{name}': this build of jax_moe._jax_moe_trtllm has no "
                              f"{trt.TARGETS[name]} handler (it serves fp8); rebuild it")


def test_refuses_mxfp4_with_another_activation_format(fake_module):
    _write_cubins(fake_module)
    ok, why = trt.supports(CFG, scheme_only("mxfp4", act="nvfp4"), B200)
    assert not ok and why == "MXFP4 takes bf16 or MXFP8 activations (act in ['bf16', 'mxfp8']), not 'nvfp4'"


def test_scheme_id_names_the_runner():
    assert [trt.scheme_id(*a) for a in (("fp8",), ("nvfp4", "nvfp4"), ("mxfp4", "bf16"), ("mxfp4", "mxfp8"),
                                        ("fp8_block", "fp8_per_group"))] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="no handler for scheme 'w4a8'"):
        trt.scheme_id("w4a8")


# ----------------------------------------------------------------------------- FP8 block-scale handler


def _fp8_block_prepared(e=4, h=256, i=128):
    q13, q2, quant = quantize_weights("fp8_block", *_rng_weights(e, h, i, seed=14))
    return trt.prepare(q13, q2, MoEConfig(e, 2, h, i), quant)


def test_fp8_block_call_operands_and_shape_rule(fp4_module):
    """DeepSeek FP8: x e4m3 [T, H] with float32 scales [H/128, T], BlockMajorK weights and their
    block scales; out bf16 [T, H]; workspace sized for scheme id 4 with default_tile_n."""
    prep = _fp8_block_prepared()
    out, (target, ins, outs, params) = _fp4_call(prep)
    assert (out.shape, out.dtype) == ((5, 256), jnp.bfloat16)
    assert target == "jax_moe_trtllm_fp8_block_scale_moe"
    assert _sig(ins) == [((5, 256), "float8_e4m3fn"), ((2, 5), "float32"), ((5, 2), "int32"), ((5, 2), "float32"),
                         ((4, 2, 256, 128), "float8_e4m3fn"), ((4, 2, 2), "float32"),
                         ((4, 1, 256, 128), "float8_e4m3fn"), ((4, 2, 1), "float32")]
    assert _sig(outs) == [((5, 256), "bfloat16"), ((4096,), "uint8")]
    assert params["tile_n"] == trt.default_tile_n(5, 2, 4)
    _, args, kwargs = [c for c in fp4_module.calls if c[0] == "workspace_size"][-1]
    assert args[:5] == (5, 256, 128, 4, 2) and kwargs == {"scheme": 4}


def test_fp8_block_value_errors_name_the_argument(no_module):
    prep = _fp8_block_prepared()
    with pytest.raises(ValueError, match=r"x \[T, 128\] does not match prepared fp8_block"):
        trt.apply_prepared(jnp.zeros((5, 128)), prep, jnp.zeros((5, 2)), jnp.zeros((5, 2), jnp.int32))
    with pytest.raises(ValueError, match="topk_ids must be int32"):
        trt.apply_prepared(jnp.zeros((5, 256)), prep, jnp.zeros((5, 2)), jnp.zeros((5, 2), jnp.uint32))


def test_serves_fp8_block_with_module_and_cubins(fake_module):
    _write_cubins(fake_module)
    ok, why = trt.supports(CFG, scheme_only("fp8_block"), B200)
    assert ok, why
    _, args, _ = [c for c in trt._state["module"].calls if c[0] == "cubins"][-1]
    assert args[0] == 4


# ----------------------------------------------------------------------------- GPU (SM100 only)


def _layer(rng, t, e, k, h, i, scale):
    """(x, w13, w2, topk_weights, topk_ids): bf16 tokens, float32 weights of standard deviation
    ``scale``, top-k routing."""
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    return x, *random_weights(rng, e, h, i, scale=scale), *random_routing(rng, t, e, k)


GPU_SCHEMES = {  # scheme -> (I, weights' scale, quantize_weights options from x, bound against xla)
    "fp8": (128, 0.05, lambda x: dict(act="fp8_per_tensor", a13_scale=calibrate_activation_scale("fp8_per_tensor", x),
                                      a2_scale=0.05), 0.05),
    # two 4-bit operands, activations re-quantized between the GEMMs
    "nvfp4": (128, 0.1, lambda x: dict(a13_scale=calibrate_activation_scale("nvfp4", x),
                                       a2_scale=jnp.float32(0.5 / 2688)), 0.1),
    "fp8_block": (256, 0.05, lambda x: {}, 0.05),  # DeepSeek FP8 128x128 block scales
}


@pytest.mark.gpu
@sm100
@pytest.mark.parametrize("t", [1, 37, 300])
@pytest.mark.parametrize("scheme", sorted(GPU_SCHEMES))
def test_gpu_matches_xla(rng, scheme, t):
    """fused_experts on flashinfer_trtllm (its runner for the scheme: FP8 per tensor with static
    scales, NVFP4 x NVFP4, FP8 128x128 blocks) against the xla backend on the same quantized
    weights, as a checkpoint has them (static activation scales)."""
    from jax_moe import fused_experts

    i, scale, opts, tol = GPU_SCHEMES[scheme]
    e, k, h = 8, 2, 256
    x, w13, w2, w, ids = _layer(rng, t, e, k, h, i, scale)
    q13, q2, quant = quantize_weights(scheme, w13, w2, **opts(x))
    ok, why = trt.supports(MoEConfig(e, k, h, i), quant)
    if not ok:
        pytest.skip(why)
    got = fused_experts(x, q13, q2, w, ids, quant=quant, backend="flashinfer_trtllm")
    ref = fused_experts(x, q13, q2, w, ids, quant=quant, backend="xla")
    assert rel_err(got, ref) < tol


@pytest.mark.gpu
@sm100
@pytest.mark.parametrize("act", ["bf16", "mxfp8"])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_gpu_mxfp4_gpt_oss_matches_xla(rng, act, t):
    """GPT-OSS MXFP4 (swigluoai, interleaved gate/up, biases on both GEMMs, H and I padded to 256)
    through prepare() + apply_prepared, against the xla backend on the same weights."""
    from jax_moe import fused_experts

    e, k, h, i = 8, 2, 160, 96
    _, x, w13, w2, w, ids = random_moe(rng, t, e, k, h, i, activation="swigluoai", x_dtype=jnp.bfloat16)
    q13, q2, quant = quantize_weights("mxfp4", w13, w2, act=act)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.bfloat16).astype(jnp.float32)
    b2 = jnp.asarray(0.3 * rng.standard_normal((e, h)), jnp.bfloat16).astype(jnp.float32)
    cfg = MoEConfig(e, k, h, i, "swigluoai", gate_up_layout="interleaved")
    ok, why = trt.supports(cfg, quant)
    if not ok:
        pytest.skip(why)
    prep = trt.prepare(q13, q2, cfg, quant, w13_bias=b13, w2_bias=b2)
    got = jax.jit(trt.apply_prepared)(x, prep, w, ids)
    ref = fused_experts(x, q13, q2, w, ids, quant=quant, activation="swigluoai", gate_up_layout="interleaved",
                        w13_bias=b13, w2_bias=b2, backend="xla")
    assert got.shape == (t, h) and rel_err(got, ref) < 0.1
