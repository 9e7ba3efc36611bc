"""FlashInfer CuteDSL (SM100, NVFP4): the masked grouped GEMM's contract, the expert stage's
definition against ``xla``, the oracle row's reasons, the sm_100a compile without a GPU
(``cutedsl_compile``), and the GPU comparisons (``gpu``, compute capability 10.x only)."""

import os
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import fused_experts, oracle
from jax_moe.backends import cutedsl_probe
from jax_moe.backends import flashinfer_cutedsl as fc
from jax_moe.backends import nvfp4_masked_gemm as mg
from jax_moe.config import MoEConfig
from jax_moe.device import DeviceInfo
from jax_moe.quant import fp4
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from helpers import jit_call as _jit, random_routing, random_weights, rel_err, scheme_only, sm100

H100, B200 = DeviceInfo("gpu", (9, 0)), DeviceInfo("gpu", (10, 0))
CFG = MoEConfig(8, 2, 256, 128)
FOUND = (True, "simulated: nvidia-cutlass-dsl 4.8.1 with cutlass.jax; FlashInfer kernel found")


def _operands(rng, e=3, m=40, n=64, k=128):
    """Random NVFP4 operands of the masked GEMM (scales as 128x4 tiles)."""
    a = rng.standard_normal((e, m, k)).astype(np.float32)
    b = rng.standard_normal((e, n, k)).astype(np.float32)
    ga, gb = fp4.nvfp4_global_scale(a), fp4.nvfp4_global_scale(b, per_expert=True)
    aq, a_sf = mg.quantize_batched(a, ga)
    bq, b_sf, _ = fp4.quantize_nvfp4(b, gb)
    from jax_moe.layouts import block_scale_interleave

    masked = jnp.asarray(rng.integers(0, m + 1, e), jnp.int32)
    alpha = (1.0 / (ga * gb)).astype(jnp.float32)
    return aq, a_sf, bq, block_scale_interleave(b_sf), masked, alpha


# ------------------------------------------------------------------ the GEMM's contract


def test_shape_rule_is_e_m_n_bf16(rng):
    ops = _operands(rng, e=2, m=130, n=72, k=96)
    out = mg.masked_grouped_gemm_nvfp4_shape(*ops)
    assert out.shape == (2, 130, 72) and out.dtype == jnp.bfloat16
    assert jax.eval_shape(mg.masked_grouped_gemm_nvfp4, *ops).shape == (2, 130, 72)


def test_scale_tiles_cover_128_rows_and_4_scale_columns():
    assert mg.scale_tiles_shape(3, 130, 96) == (3, 2, 2, 32, 4, 4)  # 130 rows -> 2 tiles; 6 scales -> 2 tiles


BAD = [  # (argument index, replacement builder, message start)
    (0, lambda a: a.astype(jnp.int8), "a must be uint8"),
    (0, lambda a: a[..., :8], "a: K = 2 * 8 = 16 must be a multiple of 32"),
    (2, lambda b: b[:, :, :32], "b must be [E=3, N, K/2=64]"),
    (2, lambda b: b[:, :60], "b: N = 60 must be a positive multiple of 8"),
    (1, lambda s: s[:, :, :1], "a_sf must be the 128x4 tiles"),
    (3, lambda s: s.astype(jnp.float32), "b_sf must be float8_e4m3fn"),
    (4, lambda c: c[:2], "masked_m must be [E=3]"),
    (4, lambda c: c.astype(jnp.uint32), "masked_m must be int32"),
    (5, lambda al: al.astype(jnp.bfloat16), "alpha must be float32"),
    (5, lambda al: al[None], "alpha must have rank 1"),
]


@pytest.mark.parametrize("index,change,message", BAD, ids=[m for _, _, m in BAD])
def test_each_bad_argument_is_named_before_lowering(rng, index, change, message):
    ops = list(_operands(rng))
    ops[index] = change(ops[index])
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        mg.masked_grouped_gemm_nvfp4(*ops)


def test_reference_is_the_dequantized_product_with_rows_past_masked_m_zero(rng):
    ops = _operands(rng)
    aq, a_sf, bq, b_sf, masked, alpha = ops
    out = np.asarray(_jit(mg.masked_grouped_gemm_nvfp4, *ops), np.float32)  # no SM100 here: the reference
    e, m, k = aq.shape[0], aq.shape[1], 2 * aq.shape[2]
    from jax_moe.layouts import block_scale_deinterleave

    def dq(q, tiles, rows):
        sf = np.asarray(block_scale_deinterleave(tiles, rows, k // 16), np.float64)
        v = np.asarray(fp4.e2m1_decode(fp4.unpack_fp4(q)), np.float64)
        return (v.reshape(e, rows, k // 16, 16) * sf[..., None]).reshape(e, rows, k)

    want = np.einsum("emk,enk->emn", dq(aq, a_sf, m), dq(bq, b_sf, bq.shape[1])) * np.asarray(alpha)[:, None, None]
    for x in range(e):
        r = int(masked[x])
        np.testing.assert_allclose(out[x, :r], want[x, :r], rtol=1e-2, atol=1e-2 * np.abs(want).max())
        assert not out[x, r:].any()


def test_masked_m_is_clamped_to_the_rows_there_are(rng):
    aq, a_sf, bq, b_sf, _, alpha = _operands(rng, e=2, m=16)
    full = _jit(mg.masked_grouped_gemm_nvfp4, aq, a_sf, bq, b_sf, jnp.array([16, 0], jnp.int32), alpha)
    over = _jit(mg.masked_grouped_gemm_nvfp4, aq, a_sf, bq, b_sf, jnp.array([99, -5], jnp.int32), alpha)
    np.testing.assert_array_equal(np.asarray(full, np.float32), np.asarray(over, np.float32))
    assert not np.asarray(over[1], np.float32).any()


def test_quantized_product_is_close_to_the_float_product(rng):
    e, m, n, k = 2, 32, 64, 256
    a = rng.standard_normal((e, m, k)).astype(np.float32)
    b = rng.standard_normal((e, n, k)).astype(np.float32)
    ga, gb = fp4.nvfp4_global_scale(a), fp4.nvfp4_global_scale(b, per_expert=True)
    aq, a_sf = mg.quantize_batched(a, ga)
    bq, b_sf, _ = fp4.quantize_nvfp4(b, gb)
    from jax_moe.layouts import block_scale_interleave

    out = _jit(mg.masked_grouped_gemm_nvfp4, aq, a_sf, bq, block_scale_interleave(b_sf), jnp.full((e,), m, jnp.int32),
               (1.0 / (ga * gb)).astype(jnp.float32))
    assert rel_err(out, np.einsum("emk,enk->emn", a, b)) < 0.2  # two 4-bit operands


# ------------------------------------------------------------------ the expert stage


def _nvfp4_layer(rng, e=8, h=256, i=128, t=24, k=2):
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13, w2 = random_weights(rng, e, h, i, scale=0.1)
    q13, q2, quant = quantize_weights("nvfp4", w13, w2, a13_scale=calibrate_activation_scale("nvfp4", x),
                                      a2_scale=jnp.float32(0.5 / 2688))  # static scales, as a checkpoint has
    w, ids = random_routing(rng, t, e, k)
    return x, q13, q2, w, ids, quant, MoEConfig(e, k, h, i)


def test_expert_stage_matches_xla_on_the_same_nvfp4_weights(rng):
    """On CPU the GEMMs are the jnp definition: this checks dispatch, quantization, alphas, the
    activation and the reduce; the GPU test below checks the kernel in their place."""
    x, q13, q2, w, ids, quant, cfg = _nvfp4_layer(rng)
    out = _jit(fc.apply, x, q13, q2, w, ids, cfg=cfg, quant=quant)
    assert rel_err(out, _jit(fused_experts, x, q13, q2, w, ids, quant=quant, backend="xla")) < 0.05


def test_batched_rows_past_counts_are_zero(rng):
    x, q13, q2, _, _, quant, cfg = _nvfp4_layer(rng)
    xb = jnp.asarray(rng.standard_normal((cfg.num_experts, 16, cfg.hidden_size)), jnp.bfloat16)
    counts = jnp.asarray(rng.integers(0, 17, cfg.num_experts), jnp.int32)
    y = np.asarray(_jit(fc.apply_batched, xb, counts, q13, q2, cfg=cfg, quant=quant), np.float32)
    for e, c in enumerate(np.asarray(counts)):
        assert not y[e, c:].any()
        assert y[e, :c].any() or c == 0


def test_apply_refuses_what_it_does_not_run(rng):
    x, q13, q2, w, ids, quant, cfg = _nvfp4_layer(rng)
    with pytest.raises(ValueError, match="biases and apply_router_weight_on_input are not supported"):
        fc.apply(x, q13, q2, w, ids, cfg, quant=quant, w13_bias=jnp.zeros((8, 256)))
    bf16_act = quantize_weights("nvfp4", jnp.ones((8, 256, 256)), jnp.ones((8, 256, 128)), act="bf16")[2]
    with pytest.raises(ValueError, match="runs NVFP4 activations"):
        fc.apply(x, q13, q2, w, ids, cfg, quant=bf16_act)


# ------------------------------------------------------------------ the oracle row and the probe


@pytest.fixture
def probe(monkeypatch):
    """``probe(result)``: what cutedsl_probe.probe answers for the rest of the test."""
    def set_(result):
        monkeypatch.setattr(cutedsl_probe, "probe", lambda: result)
    return set_


ROW_REASONS = [
    # (device, probe result, scheme changes, reason start)
    (H100, FOUND, {}, "needs SM100/SM103; this device is SM90"),
    (B200, (False, "nvidia-cutlass-dsl is not installed"), {}, "nvidia-cutlass-dsl is not installed"),
    (B200, (False, "nvidia-cutlass-dsl 4.0.0 has no JAX bridge"), {}, "nvidia-cutlass-dsl 4.0.0 has no JAX bridge"),
    (B200, (False, "FlashInfer's CuteDSL kernels are not importable"), {}, "FlashInfer's CuteDSL kernels are not"),
    (B200, FOUND, {"act": "bf16"}, "runs NVFP4 activations (W4A4), not act='bf16'"),
    (B200, FOUND, {}, "ok"),
]


@pytest.mark.parametrize("device,found,changes,reason", ROW_REASONS, ids=[r[3][:30] for r in ROW_REASONS])
def test_the_row_refuses_with_its_reason(probe, device, found, changes, reason):
    probe(found)
    _, ok, why = oracle.probe("flashinfer_cutedsl", CFG, scheme_only("nvfp4", CFG.num_experts, **changes), device)
    assert ok == (reason == "ok")
    assert why.startswith(reason), why


def test_a_servable_row_is_used_only_when_forced(probe):
    probe(FOUND)
    sel = oracle.select_backend(CFG, scheme_only("nvfp4", CFG.num_experts), device=B200)
    assert sel.name == "xla"
    assert dict(sel.reasons)["flashinfer_cutedsl"].startswith("can serve this, but repacks")
    assert oracle.select_backend(CFG, scheme_only("nvfp4", CFG.num_experts), device=B200, backend="flashinfer_cutedsl").name == \
        "flashinfer_cutedsl"


@pytest.mark.parametrize("missing,reason", [
    ("cutlass_dsl_version", "nvidia-cutlass-dsl is not installed (pip install \"jax_moe[cutedsl]\")"),
    ("bridge_dir", "nvidia-cutlass-dsl 4.8.1 has no JAX bridge (cutlass.jax"),
    ("kernel_source", "FlashInfer's CuteDSL kernels are not importable: no Sm100BlockScaledPersistentDenseGemmKernel"),
])
def test_probe_names_the_first_thing_missing(monkeypatch, missing, reason):
    monkeypatch.setattr(cutedsl_probe, "cutlass_dsl_version", lambda: "4.8.1")
    monkeypatch.setattr(cutedsl_probe, "bridge_dir", lambda: "/somewhere/cutlass/jax")
    monkeypatch.setattr(cutedsl_probe, "kernel_source", lambda: "/somewhere/kernel.py")
    monkeypatch.setattr(cutedsl_probe, missing, lambda: None)
    ok, why = cutedsl_probe.probe()
    assert not ok and why.startswith(reason), why


def test_probe_finds_the_kernel_source_under_flashinfer_src_dir(monkeypatch, tmp_path):
    f = tmp_path / "gemm" / "kernels" / "grouped_gemm_masked_blackwell.py"
    f.parent.mkdir(parents=True)
    f.write_text("class Sm100BlockScaledPersistentDenseGemmKernel:\n    pass\n")
    monkeypatch.setenv("FLASHINFER_SRC_DIR", str(tmp_path))
    assert cutedsl_probe.kernel_source() == f


def test_without_a_gpu_or_cute_dsl_arch_the_gemm_is_the_reference(probe, monkeypatch):
    probe(FOUND)
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    monkeypatch.setattr("jax_moe.ffi.gpu_backend", lambda: False)
    ok, why = mg.kernel_target()
    assert not ok and "CUTE_DSL_ARCH does not name an SM100 target" in why
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert mg.kernel_target() == (True, "CUTE_DSL_ARCH=sm_100a")


# ------------------------------------------------------------------ compiled for sm_100a, no GPU needed

_COMPILE_SCRIPT = """
import jax, jax.numpy as jnp
import cutlass.jax as cj
from jax_moe.backends import nvfp4_masked_gemm as mg
E, M, N, K = 4, 100, 256, 256
S = jax.ShapeDtypeStruct
args = (S((E, M, K // 2), jnp.uint8), S(mg.scale_tiles_shape(E, M, K), jnp.float8_e4m3fn),
        S((E, N, K // 2), jnp.uint8), S(mg.scale_tiles_shape(E, N, K), jnp.float8_e4m3fn),
        S((E,), jnp.int32), S((E,), jnp.float32))
assert mg.kernel_target()[0], mg.kernel_target()
exp = jax.export.export(jax.jit(mg.masked_grouped_gemm_nvfp4), platforms=["cuda"],
                        disabled_checks=cj.get_export_disabled_safety_checks())(*args)
text = exp.mlir_module()
assert "stablehlo.custom_call @CuteDSLRT_NvJaxCutlassCall" in text
from cutlass.jax import compile as cjc
blobs = [r.module for r in cjc._CUTLASS_COMPILE_CACHE.values()]
assert len(blobs) == 1 and blobs[0].count(b"\\x7fELF") >= 2 and b"sm_100a" in blobs[0]
assert b"Sm100BlockScaledPersistentDenseGemmKernel" in blobs[0]
print("OK", len(blobs[0]))
"""


@pytest.mark.cutedsl_compile
def test_the_kernel_compiles_for_sm_100a_without_a_gpu():
    """``jax.export`` for CUDA lowers the custom call, which makes the bridge compile FlashInfer's
    kernel through our launcher for ``CUTE_DSL_ARCH=sm_100a``: a host object embedding an sm_100a
    cubin. Skipped where the cutedsl extra or FlashInfer's kernel source is absent."""
    ok, why = cutedsl_probe.probe()
    if not ok:
        pytest.skip(why)
    env = dict(os.environ, CUTE_DSL_ARCH="sm_100a", JAX_PLATFORMS="cpu")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(_COMPILE_SCRIPT)], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr[-4000:]


# ------------------------------------------------------------------ on an SM100 GPU


@pytest.mark.gpu
@sm100
@pytest.mark.parametrize("e,m,n,k", [(3, 40, 64, 128), (8, 130, 256, 512), (2, 1, 8, 32)])
def test_gpu_kernel_matches_its_definition(rng, e, m, n, k):
    ops = _operands(rng, e, m, n, k)
    assert mg.kernel_target()[0], mg.kernel_target()
    out = np.asarray(jax.jit(mg.masked_grouped_gemm_nvfp4)(*ops), np.float32)
    ref = np.asarray(mg.masked_grouped_gemm_nvfp4_reference(*ops), np.float32)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())


@pytest.mark.gpu
@sm100
def test_gpu_backend_matches_xla_on_the_same_nvfp4_weights(rng):
    x, q13, q2, w, ids, quant, cfg = _nvfp4_layer(rng)
    f = jax.jit(lambda x, w, ids: fused_experts(x, q13, q2, w, ids, quant=quant, backend="flashinfer_cutedsl"))
    assert rel_err(f(x, w, ids), fused_experts(x, q13, q2, w, ids, quant=quant, backend="xla")) < 0.05
