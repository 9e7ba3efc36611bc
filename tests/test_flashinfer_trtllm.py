"""backend="flashinfer_trtllm" (FlashInfer's TRT-LLM gen fused MoE, SM100), FP8 per-tensor: load-time
layout against loop definitions, the shape rule, ValueErrors before lowering, and the oracle's refusal
reasons with the native module and its cubin query faked. The block-scale schemes:
test_flashinfer_trtllm_block_scale.py (their layouts) and test_flashinfer_trtllm_handlers.py (their
calls, and the GPU tests, which run only on compute capability 10.x)."""

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
from helpers import scheme_only
from trtllm_cases import B200, B300, CFG, CUBINS, H100, NAME, RTX5090, fake_module, fp8_quant, no_module, write_cubins


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
    q13, q2, _ = fp8_quant(e=3, h=128, i=24)
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
    q13, q2, quant = fp8_quant(e=4, a13=jnp.asarray([0.01, 0.04, 0.02, 0.03]), a2=0.5)
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
    q13, q2, quant = fp8_quant()
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
    q13, q2, quant = fp8_quant(e=e, h=h, i=i)
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
    write_cubins(fake_module)
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
    write_cubins(fake_module)
    ok, why = trt.supports(CFG, scheme_only("fp8"), device)
    assert ok, why
    _, ok, _ = oracle.probe("flashinfer_trtllm", CFG, scheme_only("fp8"), device)
    assert ok
    # a row that can serve, but not in AUTO yet: chosen only when forced or prepared-and-listed
    assert oracle.select_backend(CFG, scheme_only("fp8"), device=device, backend="flashinfer_trtllm").name == NAME
    assert oracle.select_backend(CFG, scheme_only("fp8"), device=device).name == "xla"


@pytest.mark.parametrize("cfg,scheme_name,start", [
    (CFG, "bf16", "does not serve scheme 'bf16' (serves fp8, fp8_block, mxfp4, nvfp4)"),
    (MoEConfig(128, 8, 2000, 768), "fp8", "hidden size 2000 must be a multiple of 128"),
    (MoEConfig(128, 8, 2048, 768, "relu2"), "fp8", "activation 'relu2' is not wired up"),
    (MoEConfig(1024, 8, 2048, 768), "fp8", "1024 experts exceed the routing kernels' 512"),
])
def test_refusal_reasons_for_config(cfg, scheme_name, start, fake_module):
    write_cubins(fake_module)
    ok, why = trt.supports(cfg, scheme_only(scheme_name, cfg.num_experts), B200)
    assert not ok and why.startswith(start), why


def test_missing_cubins_checks_presence_and_sha256(tmp_path):
    write_cubins(tmp_path, data=b"abc")
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
