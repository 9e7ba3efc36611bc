"""backend="flashinfer_trtllm"'s block-scale custom calls: the operands apply_prepared hands each
target, the argument checks and the refusals (native module faked); on compute capability 10.x, the
runner against the pure-JAX backend (``gpu``)."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import oracle
from jax_moe.backends import flashinfer_trtllm as trt
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from helpers import random_moe, random_routing, random_weights, rel_err, scheme_only, sm100
from trtllm_cases import B200, B300, CFG, NAME, fake_module, FakeModule, no_module, rng_weights, write_cubins


# ----------------------------------------------------------------------------- FP4 block-scale handler
# jax_moe_trtllm_fp4_block_scale_moe: the operands apply_prepared hands the target (read off the
# jaxpr, nothing lowered), the workspace query, the argument checks and the refusals.


def _nvfp4_prepared(e=2, h=128, i=64):
    q13, q2, quant = quantize_weights("nvfp4", *rng_weights(e, h, i, seed=11), a13_scale=0.01, a2_scale=0.02)
    return trt.prepare(q13, q2, MoEConfig(e, 2, h, i), quant)


def _mxfp4_prepared(act="bf16", activation="swigluoai", bias=True, e=2, h=96, i=160):
    q13, q2, quant = quantize_weights("mxfp4", *rng_weights(e, h, i, seed=12), act=act)
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
    write_cubins(fake_module)
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
    write_cubins(tmp_path)
    ok, why = trt.supports(CFG, scheme_only(name), B200)
    assert not ok and why == (f"scheme '{name}': this build of jax_moe._jax_moe_trtllm has no "
                              f"{trt.TARGETS[name]} handler (it serves fp8); rebuild it")


def test_refuses_mxfp4_with_another_activation_format(fake_module):
    write_cubins(fake_module)
    ok, why = trt.supports(CFG, scheme_only("mxfp4", act="nvfp4"), B200)
    assert not ok and why == "MXFP4 takes bf16 or MXFP8 activations (act in ['bf16', 'mxfp8']), not 'nvfp4'"


def test_scheme_id_names_the_runner():
    assert [trt.scheme_id(*a) for a in (("fp8",), ("nvfp4", "nvfp4"), ("mxfp4", "bf16"), ("mxfp4", "mxfp8"),
                                        ("fp8_block", "fp8_per_group"))] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="no handler for scheme 'w4a8'"):
        trt.scheme_id("w4a8")


# ----------------------------------------------------------------------------- FP8 block-scale handler


def _fp8_block_prepared(e=4, h=256, i=128):
    q13, q2, quant = quantize_weights("fp8_block", *rng_weights(e, h, i, seed=14))
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
    write_cubins(fake_module)
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
