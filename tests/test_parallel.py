"""Expert/tensor/data parallel execution equals the single-device MoE (8 CPU devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_moe import fused_experts, select_experts
from jax_moe.parallel import ParallelConfig, parallel_fused_experts, shard_weights, tp_row_order
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from helpers import cpu_mesh, rel_err
from parallel_cases import E, H, I, K, MESHES, moe, nvfp4_moe, parallel_out, run_parallel



@pytest.mark.parametrize("shape,names,axes", [pytest.param(*MESHES[0], marks=pytest.mark.slow), MESHES[1],
                                              pytest.param(*MESHES[2], marks=pytest.mark.slow)],
                         ids=["ep8", "ep4-tp2", "dp2-ep4"])
@pytest.mark.parametrize("strategy", ["naive", "all_to_all"])
def test_parallel_equals_single_device(rng, shape, names, axes, strategy):
    pcfg = ParallelConfig(cpu_mesh(shape, names), strategy=strategy, **axes)
    x, w13, w2, w, ids, b = moe(rng, 64, activation="swigluoai", bias=True)
    ref = fused_experts(x, w13, w2, w, ids, activation="swigluoai", **b)
    placed = shard_weights(w13, w2, pcfg, activation="swigluoai", **b)
    out = jax.jit(lambda x, w, ids, p: parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg,
                                                               w13_bias=p["w13_bias"], w2_bias=p["w2_bias"],
                                                               quant=p["quant"], activation="swigluoai"))(
        x, w, ids, placed)
    assert out.shape == x.shape
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("expert_format", ["standard", "batched"])
def test_the_backend_is_chosen_for_the_mesh_devices_not_the_default_device(rng, monkeypatch, expert_format):
    """A CPU mesh in a process whose default device is a GPU runs a CPU backend: every oracle
    choice inside the parallel call is made for the mesh's devices."""
    from jax_moe import oracle

    pcfg = ParallelConfig(cpu_mesh((2, 4), ("dp", "ep")), ep_axis="ep", dp_axis="dp", expert_format=expert_format)
    seen = []
    select = oracle.select_backend

    def recording(*a, device=None, **kw):
        seen.append(device)
        return select(*a, device=device, **kw)

    monkeypatch.setattr(oracle, "select_backend", recording)
    x, w13, w2, w, ids, _ = moe(rng, 16)
    parallel_out(pcfg, x, w13, w2, w, ids)
    assert seen and all(d in set(pcfg.mesh.devices.flat) for d in seen), seen


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["naive", "all_to_all"])
def test_tokens_whose_experts_all_live_on_one_device(rng, strategy):
    """Every token picks experts 0..3 (device 0 of ep=4): the other devices receive nothing."""
    pcfg = ParallelConfig(cpu_mesh((4,), ("ep",)), ep_axis="ep", strategy=strategy)
    x, w13, w2, _, _, _ = moe(rng, 32)
    ids = jnp.tile(jnp.arange(4, dtype=jnp.int32), (32, 1))
    w = jnp.asarray(rng.random((32, 4)), jnp.float32)
    p = shard_weights(w13, w2, pcfg)
    out = parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg)
    assert rel_err(out, fused_experts(x, w13, w2, w, ids)) < 1e-5


@pytest.mark.slow
def test_quantized_weights_under_expert_parallelism(rng):
    pcfg = ParallelConfig(cpu_mesh((4,), ("ep",)), ep_axis="ep")
    x, w13, w2, w, ids, _ = moe(rng, 32)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_token")
    p = shard_weights(q13, q2, pcfg, quant=quant)
    out = parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg, quant=p["quant"])
    assert rel_err(out, fused_experts(x, q13, q2, w, ids, quant=quant)) < 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("one_device", [False, True], ids=["routed", "all-on-device-0"])
@pytest.mark.parametrize("strategy", ["naive", "all_to_all"])
def test_cutlass_backend_skips_the_ids_of_other_devices_experts(rng, strategy, one_device, monkeypatch):
    """backend='cutlass' under EP: each device gets -1 for slots whose expert lives elsewhere
    (every slot, on devices whose experts no token picked) and skips them. The custom calls'
    jnp references run here (cutlass.supports is told yes on CPU); tests/test_gpu_parallel.py
    runs the kernels."""
    from jax_moe.backends import cutlass

    monkeypatch.setattr(cutlass, "supports", lambda *a, **k: (True, "ok"))
    pcfg = ParallelConfig(cpu_mesh((4,), ("ep",)), ep_axis="ep", strategy=strategy)
    x, w13, w2, w, ids, _ = moe(rng, 32)
    x, w13, w2 = (a.astype(jnp.bfloat16) for a in (x, w13, w2))
    if one_device:  # experts 0..3: device 0's
        ids = jnp.tile(jnp.arange(K, dtype=jnp.int32), (32, 1))
    ref = fused_experts(x, w13, w2, w, ids, backend="xla")
    p = shard_weights(w13, w2, pcfg)
    out = parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg, backend="cutlass")
    assert rel_err(out, ref) < 2e-2


@pytest.mark.slow
def test_per_expert_activation_scales_stay_whole_under_expert_parallelism(rng):
    """Static [E] activation scales mean one scale for all experts (their max): every device must
    see all E of them, not only its own experts' (shard_weights replicates a13/a2 scales)."""
    pcfg = ParallelConfig(cpu_mesh((4,), ("ep",)), ep_axis="ep")
    x, w13, w2, w, ids, _ = moe(rng, 32)
    a13 = jnp.asarray(np.linspace(1e-3, 2e-2, E), jnp.float32)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13,
                                      a2_scale=jnp.full((E,), 0.01, jnp.float32))
    p = shard_weights(q13, q2, pcfg, quant=quant)
    assert p["quant"].a13_scale.sharding.spec == P() and p["quant"].w13_scale.sharding.spec == P("ep")
    out = parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg, quant=p["quant"])
    assert rel_err(out, fused_experts(x, q13, q2, w, ids, quant=quant)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["naive", "all_to_all"])
def test_fp8_weights_split_over_tensor_parallelism(rng, strategy):
    """Per-expert FP8 weight scales and static activation scales: splitting I over tp changes
    nothing in the quantization, so (ep=4, tp=2) equals one device on the same quantized weights.
    (A dynamic a13_scale would be the max over the rows each device receives.)"""
    pcfg = ParallelConfig(cpu_mesh((4, 2), ("ep", "tp")), ep_axis="ep", tp_axis="tp", strategy=strategy)
    x, w13, w2, w, ids, _ = moe(rng, 32)
    a13 = calibrate_activation_scale("fp8_per_tensor", x)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=0.01)
    p = shard_weights(q13, q2, pcfg, quant=quant)
    out = parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg, quant=p["quant"])
    assert rel_err(out, fused_experts(x, q13, q2, w, ids, quant=quant)) < 1e-5


@pytest.mark.parametrize("scheme,opts,match", [
    ("fp8", dict(act="fp8_per_tensor"), "act='fp8_per_tensor' quantizes GEMM2's input"),
    ("fp8", dict(act="fp8_per_token"), "act='fp8_per_token'"),
    ("fp8", dict(weight_scale="per_channel", act="bf16"), r"w13_scale has shape \[16, 64, 1\]"),
    ("nvfp4", dict(act="bf16"), "scales along N or K"),
])
def test_tensor_parallelism_refuses_quantization_it_would_change(rng, scheme, opts, match):
    pcfg = ParallelConfig(cpu_mesh((4, 2), ("ep", "tp")), ep_axis="ep", tp_axis="tp")
    _, w13, w2, _, _, _ = moe(rng, 8)
    q13, q2, quant = quantize_weights(scheme, w13, w2, **opts)
    with pytest.raises(ValueError, match=match):
        shard_weights(q13, q2, pcfg, quant=quant)


@pytest.mark.slow
def test_no_ep_with_tensor_and_data_parallelism(rng):
    pcfg = ParallelConfig(cpu_mesh((2, 4), ("dp", "tp")), tp_axis="tp", dp_axis="dp", strategy="none")
    x, w13, w2, w, ids, _ = moe(rng, 16)
    p = shard_weights(w13, w2, pcfg)
    out = parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg)
    assert rel_err(out, fused_experts(x, w13, w2, w, ids)) < 1e-5


def test_tp_row_order_keeps_gate_and_up_together():
    # I=4, tp=2: shard 0 = gate 0,1 + up 0,1 (rows 0,1,4,5); shard 1 = rows 2,3,6,7
    np.testing.assert_array_equal(tp_row_order(8, 2, "concat", True), [0, 1, 4, 5, 2, 3, 6, 7])
    np.testing.assert_array_equal(tp_row_order(8, 2, "interleaved", True), np.arange(8))


def test_bad_parallel_configs_raise(rng):
    mesh = cpu_mesh((4,), ("ep",))
    with pytest.raises(ValueError, match="ep_axis='x' is not an axis"):
        ParallelConfig(mesh, ep_axis="x")
    with pytest.raises(ValueError, match="strategy 'none' is for meshes without ep_axis"):
        ParallelConfig(mesh, ep_axis="ep", strategy="none")
    pcfg = ParallelConfig(mesh, ep_axis="ep")
    x, w13, w2, w, ids, _ = moe(rng, 6)
    with pytest.raises(ValueError, match="E=6 must be a multiple of the ep size 4"):
        shard_weights(w13[:6], w2[:6], pcfg)
    with pytest.raises(ValueError, match="T=6 tokens, which must be a multiple of the 4 token shards"):
        parallel_fused_experts(x, w13, w2, w, ids, pcfg)


# ------------------------------------------------- prepared weights (a backend's own layout)


def _layout_backend():
    """flashinfer_cutlass's real load-time layout (prepare, partition_specs: pure jnp) with an
    apply_prepared that undoes the layout and runs the xla backend: the sharded-prepare plumbing,
    testable on CPU devices. The runner itself is tested on GPUs (tests/test_gpu_parallel.py)."""
    import types

    from jax_moe.backends import flashinfer_cutlass as fic
    from jax_moe.backends import xla
    from jax_moe.config import MoEConfig

    def apply_prepared(x, p, topk_weights, topk_ids):
        e, h, i = p.w2.shape
        cfg = MoEConfig(e, topk_ids.shape[1], h, i, p.activation, expert_shard=True)
        w13 = fic.runner_row_order(p.w13.astype(jnp.float32))  # [up; gate] -> [gate; up]
        b13 = None if p.w13_bias is None else fic.runner_row_order(p.w13_bias.astype(jnp.float32), axis=-1)
        b2 = None if p.w2_bias is None else p.w2_bias.astype(jnp.float32)
        if p.activation == "swigluoai":
            assert p.swiglu.shape == (3, e)  # split with the experts
        return xla.apply(x.astype(jnp.float32), w13, p.w2.astype(jnp.float32), topk_weights, topk_ids, cfg,
                         w13_bias=b13, w2_bias=b2)

    return types.SimpleNamespace(prepare=fic.prepare, partition_specs=fic.partition_specs,
                                 alignment=fic.alignment, apply_prepared=apply_prepared,
                                 supports=lambda *a, **k: (False, "layout stand-in: never selected"))


PREPARED_MESHES = [((8,), ("ep",), dict(ep_axis="ep")),
                   ((4, 2), ("ep", "tp"), dict(ep_axis="ep", tp_axis="tp")),
                   ((2,), ("tp",), dict(tp_axis="tp"))]
PREPARED_IDS = ["ep8", "ep4-tp2", "tp2"]
PREPARED_RUNS = [pytest.param(*m, st, id=f"{i}-{st}",
                              marks=[pytest.mark.slow] if i == "ep8" or st == "all_to_all" else [])
                 for m, i in zip(PREPARED_MESHES, PREPARED_IDS)
                 for st in (("naive", "all_to_all") if "ep_axis" in m[2] else ("none",))]


def _pcfg(shape, names, axes, strategy):
    return ParallelConfig(cpu_mesh(shape, names), strategy=strategy, **axes)


def _with_layout_backend(monkeypatch, backend):
    from jax_moe import oracle

    real = oracle.module
    monkeypatch.setattr(oracle, "module", lambda name: backend if name == "flashinfer_cutlass" else real(name))


@pytest.mark.parametrize("inter", [pytest.param(I, marks=pytest.mark.slow), 24], ids=["I32", "I24-padded"])
@pytest.mark.parametrize("shape,names,axes,strategy", PREPARED_RUNS)
def test_prepared_weights_repacked_per_device_equal_single_device(rng, strategy, shape, names, axes, inter,
                                                                  monkeypatch):
    """Every device repacks its own (ep, tp) block and runs it; the partial outputs summed over
    tp (w2's bias once) equal one device. I=24 over tp=2 gives 12 per device, zero-padded to the
    runner's multiple of 8: the padded units add nothing."""
    from jax_moe.parallel import parallel_apply_prepared, shard_prepared

    _with_layout_backend(monkeypatch, _layout_backend())
    pcfg = _pcfg(shape, names, axes, strategy)
    x, w13, w2, w, ids, b = moe(rng, 64, activation="swigluoai", bias=True)
    w13 = jnp.concatenate([w13[:, :inter], w13[:, I:I + inter]], 1)  # gate rows, up rows
    w2, b["w13_bias"] = w2[..., :inter], jnp.concatenate([b["w13_bias"][:, :inter], b["w13_bias"][:, I:I + inter]], 1)
    b = {k: v.astype(jnp.bfloat16).astype(jnp.float32) for k, v in b.items()}  # the layout keeps biases in bf16
    ref = fused_experts(x, w13, w2, w, ids, activation="swigluoai", **b)
    prep = shard_prepared(w13, w2, pcfg, activation="swigluoai", **b)
    ep, tp = pcfg.size(pcfg.ep_axis), pcfg.size(pcfg.tp_axis)
    assert _spec(prep.w13) == (pcfg.ep_axis, pcfg.tp_axis, None)
    assert _spec(prep.w2) == (pcfg.ep_axis, None, pcfg.tp_axis)
    assert _spec(prep.swiglu) == (None, pcfg.ep_axis)
    i_local = -(-(inter // tp) // 8) * 8
    assert prep.w13.addressable_shards[0].data.shape == (E // ep, 2 * i_local, H)
    out = jax.jit(lambda x, w, ids, p: parallel_apply_prepared(x, p, w, ids, pcfg))(x, w, ids, prep)
    # w13/w2 are bf16 in the runner's layout: bf16 bounds against the float32 single-device MoE
    assert rel_err(out, ref) < 2e-2


def _spec(arr):
    """arr's PartitionSpec with one entry per axis."""
    spec = tuple(arr.sharding.spec)
    return spec + (None,) * (arr.ndim - len(spec))


def _device_block(arr, device):
    """The block of ``arr`` that ``device`` holds."""
    return next(np.asarray(s.data.astype(jnp.float32)) for s in arr.addressable_shards if s.device == device)


@pytest.mark.parametrize("scheme", [pytest.param("bf16", marks=pytest.mark.slow), "fp8"])
@pytest.mark.parametrize("shape,names,axes",
                         [PREPARED_MESHES[1], pytest.param(*PREPARED_MESHES[2], marks=pytest.mark.slow)],
                         ids=PREPARED_IDS[1:])
def test_each_device_holds_the_prepare_of_its_own_slice(rng, scheme, shape, names, axes):
    """Device (r, s) of an (ep, tp) mesh holds exactly ``prepare`` of experts
    [r*E/ep, (r+1)*E/ep), gate and up rows [s*I/tp, (s+1)*I/tp) of w13 and the same columns of w2,
    with its experts' weight scales and every expert's activation scales."""
    from jax_moe.backends import flashinfer_cutlass as fic
    from jax_moe.config import MoEConfig
    from jax_moe.parallel import shard_prepared

    pcfg = _pcfg(shape, names, axes, "naive" if "ep_axis" in axes else "none")
    _, w13, w2, _, _, b = moe(rng, 8, activation="swigluoai", bias=True)
    quant = None
    if scheme == "fp8":
        a13 = jnp.asarray(np.linspace(0.01, 0.02, E), jnp.float32)
        w13, w2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=0.05)
    prep = shard_prepared(w13, w2, pcfg, activation="swigluoai", quant=quant, **b)
    ep, tp = pcfg.size(pcfg.ep_axis), pcfg.size(pcfg.tp_axis)
    el, il = E // ep, I // tp
    mesh = pcfg.mesh
    for pos, device in np.ndenumerate(mesh.devices):
        coord = dict(zip(mesh.axis_names, pos))
        r, s = coord.get("ep", 0), coord.get("tp", 0)
        experts, cols = slice(r * el, (r + 1) * el), np.r_[s * il:(s + 1) * il]
        rows = np.r_[cols, I + cols]
        local_quant = None if quant is None else quant.replace(w13_scale=quant.w13_scale[experts],
                                                               w2_scale=quant.w2_scale[experts])
        want = fic.prepare(w13[experts][:, rows], w2[experts][..., cols], MoEConfig(el, 1, H, il, "swigluoai"),
                           local_quant, w13_bias=b["w13_bias"][experts][:, rows], w2_bias=b["w2_bias"][experts])
        for name in ("w13", "w2", "w13_scale", "a13_scale", "g1_alphas", "a2_gscale", "g2_alphas", "w13_bias",
                     "w2_bias", "swiglu"):
            got, ref = getattr(prep, name), getattr(want, name)
            assert (got is None) == (ref is None), name
            if ref is not None:
                np.testing.assert_array_equal(_device_block(got, device), np.asarray(ref.astype(jnp.float32)),
                                              err_msg=f"{name} on device {coord}")


def test_prepared_weights_refuse_what_cannot_be_split(rng):
    from jax_moe.parallel import shard_prepared

    pcfg = ParallelConfig(cpu_mesh((4, 2), ("ep", "tp")), ep_axis="ep", tp_axis="tp")
    _, w13, w2, _, _, _ = moe(rng, 8)
    with pytest.raises(ValueError, match="I=31 must be a multiple of the tp size 2"):
        shard_prepared(jnp.concatenate([w13[:, :31], w13[:, I:I + 31]], 1), w2[..., :31], pcfg)
    with pytest.raises(ValueError, match="needs H=36 to be a multiple of 8"):
        shard_prepared(jnp.pad(w13, ((0, 0), (0, 0), (0, 4))), jnp.pad(w2, ((0, 0), (0, 4), (0, 0))), pcfg)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor")
    with pytest.raises(ValueError, match="give a static a2_scale"):
        shard_prepared(q13, q2, pcfg, quant=quant)
    m13, m2, mquant = quantize_weights("mxfp4", w13, w2)
    with pytest.raises(ValueError, match="packed 4-bit weights .scheme 'mxfp4'. are not wired up"):
        shard_prepared(m13, m2, pcfg, quant=mquant)
    with pytest.raises(ValueError, match=r"cutlass's prepared weights are not laid out for a mesh; run its float "
                                         r"weights with parallel_fused_experts\(..., backend='cutlass'\)"):
        shard_prepared(w13, w2, pcfg, backend="cutlass")


@pytest.mark.parametrize("shape,names,axes",
                         [pytest.param(*PREPARED_MESHES[0], marks=pytest.mark.slow), PREPARED_MESHES[1]],
                         ids=PREPARED_IDS[:2])
@pytest.mark.parametrize("strategy", ["naive", "all_to_all"])
def test_fp8_tokens_are_quantized_before_dispatch(rng, strategy, shape, names, axes, monkeypatch):
    """FP8 prepared weights: every device quantizes its own tokens with the scale of all tokens
    (max over devices, as one device would compute it), one-byte rows travel, and the result
    equals the single-device xla MoE on the same quantized weights (also with I split over tp)."""
    import types

    from jax_moe.backends import flashinfer_cutlass as fic
    from jax_moe.backends import xla
    from jax_moe.config import MoEConfig
    from jax_moe.parallel import parallel_apply_prepared, shard_prepared

    x, w13, w2, w, ids, _ = moe(rng, 64)
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a2_scale=0.05)
    seen = []

    def apply_prepared(xq, p, topk_weights, topk_ids, x_scale=None):
        seen.append(xq.dtype)
        assert xq.dtype == jnp.float8_e4m3fn and x_scale is not None
        e, h, i = p.w2.shape
        cfg = MoEConfig(e, topk_ids.shape[1], h, i, expert_shard=True)
        local = quant.replace(w13_scale=p.w13_scale, w2_scale=p.g2_alphas * p.a2_gscale, a13_scale=x_scale)
        return xla.apply(xq.astype(jnp.float32) * x_scale, fic.runner_row_order(p.w13), p.w2, topk_weights,
                         topk_ids, cfg, quant=local)

    fake = types.SimpleNamespace(prepare=fic.prepare, partition_specs=fic.partition_specs, alignment=fic.alignment,
                                 input_scale=fic.input_scale, quantize_input=fic.quantize_input,
                                 apply_prepared=apply_prepared,
                                 supports=lambda *a, **k: (False, "layout stand-in: never selected"))
    _with_layout_backend(monkeypatch, fake)
    pcfg = _pcfg(shape, names, axes, strategy)
    ref = fused_experts(x, q13, q2, w, ids, quant=quant, backend="xla")
    prep = shard_prepared(q13, q2, pcfg, quant=quant)
    f = jax.jit(lambda x, w, ids, p: parallel_apply_prepared(x, p, w, ids, pcfg))
    out = f(x, w, ids, prep)
    assert seen and rel_err(out, ref) < 1e-4
    moved = str(jax.make_jaxpr(f)(x, w, ids, prep))
    assert ("all_gather" in moved or "all_to_all" in moved) and "u8[" in moved


# ------------------------------------------------- NVFP4 activations quantized before the dispatch


NVFP4_MESHES = [MESHES[0], MESHES[2]]  # tp is refused for NVFP4 weights (scales along K)


@pytest.mark.parametrize("one_device", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["routed", "all-on-device-0"])
@pytest.mark.parametrize("shape,names,axes", [pytest.param(*NVFP4_MESHES[0], marks=pytest.mark.slow), NVFP4_MESHES[1]],
                         ids=["ep8", "dp2-ep4"])
@pytest.mark.parametrize("strategy", ["naive", "all_to_all"])
def test_nvfp4_tokens_are_quantized_before_dispatch(rng, strategy, shape, names, axes, one_device):
    """NVFP4 activations with a static global scale: each device quantizes its own tokens
    (packed E2M1 + linear e4m3 block scales, uint8 on the wire, as vLLM's naive EP prepare does)
    and the xla backend dequantizes what arrives. Per-token block quantization with a fixed
    global scale commutes with the exchange, so the result is one device's, also when every
    token's experts live on device 0 and the other devices receive nothing."""
    pcfg = ParallelConfig(cpu_mesh(shape, names), strategy=strategy, **axes)
    x, q13, q2, w, ids, quant = nvfp4_moe(rng, 64)
    if one_device:  # experts 0..1 (device 0 of ep=8) or 0..3 (ep=4)
        ids = jnp.tile(jnp.arange(K, dtype=jnp.int32) % (E // pcfg.size("ep")), (64, 1))
    ref = fused_experts(x, q13, q2, w, ids, quant=quant, backend="xla")
    out, moved = run_parallel(pcfg, x, q13, q2, w, ids, quant)
    assert out.dtype == x.dtype
    assert rel_err(out, ref) < 1e-5
    exchange = "all_gather" if strategy == "naive" else "all_to_all"
    sent = [ln.split("=")[0] for ln in moved.splitlines() if exchange in ln]  # the exchanges' results
    assert any("u8[" in ln and f",{H // 2}]" in ln for ln in sent), "the packed E2M1 rows travel"
    assert any("u8[" in ln and f",{H // 16}]" in ln for ln in sent), "their block scales travel"
    float_rows = [ln for ln in sent if "f32[" in ln and f",{H}]" in ln]
    assert len(float_rows) == (0 if strategy == "naive" else 1), "only the combine moves float rows"


@pytest.mark.parametrize("strategy", [pytest.param("naive", marks=pytest.mark.slow), "all_to_all"])
def test_nvfp4_dynamic_scale_is_taken_over_every_devices_tokens(rng, strategy):
    """Without a13_scale the global scale comes from the amax of all tokens (a pmax before the
    dispatch), as one device computes it over its whole batch (up to an ulp of the scale)."""
    pcfg = ParallelConfig(cpu_mesh((2, 4), ("dp", "ep")), dp_axis="dp", ep_axis="ep", strategy=strategy)
    x, q13, q2, w, ids, quant = nvfp4_moe(rng, 64, dynamic=True)
    x = x.at[3].multiply(8.0)  # one device's token sets the scale for all
    ref = fused_experts(x, q13, q2, w, ids, quant=quant, backend="xla")
    out, _ = run_parallel(pcfg, x, q13, q2, w, ids, quant)
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("strategy", [pytest.param("naive", marks=pytest.mark.slow), "all_to_all"])
def test_nvfp4_scales_swizzled_after_the_exchange_for_a_backend_that_reads_tiles(rng, strategy, monkeypatch):
    """A backend whose PREQUANTIZED_INPUT says "128x4" gets the received rows' block scales in
    FlashInfer's 128x4 tiles (block_scale_interleave after the exchange; the linear scales are
    what travels)."""
    import types

    from jax_moe import oracle
    from jax_moe.backends import xla
    from jax_moe.layouts.scales import block_scale_deinterleave

    seen = []

    def apply(x, w13, w2, w, ids, cfg, *, x_scale=None, **kw):
        rows = x.shape[0]
        seen.append(x_scale.shape)
        assert x.dtype == jnp.uint8 and x_scale.shape == (-(-rows // 128), -(-(H // 16) // 4), 32, 4, 4)
        return xla.apply(x, w13, w2, w, ids, cfg, x_scale=block_scale_deinterleave(x_scale, rows, H // 16), **kw)

    tiles = types.SimpleNamespace(PREQUANTIZED_INPUT={"nvfp4": "128x4"}, FEATURES=xla.FEATURES, apply=apply,
                                  supports=lambda *a, **k: (True, "ok"))
    real = oracle.module
    monkeypatch.setattr(oracle, "module", lambda name: tiles if name == "cutlass" else real(name))
    pcfg = ParallelConfig(cpu_mesh((8,), ("ep",)), ep_axis="ep", strategy=strategy)
    x, q13, q2, w, ids, quant = nvfp4_moe(rng, 64)
    ref = fused_experts(x, q13, q2, w, ids, quant=quant, backend="xla")
    out, _ = run_parallel(pcfg, x, q13, q2, w, ids, quant, backend="cutlass")
    assert seen and rel_err(out, ref) < 1e-5


# ------------------------------------------------- non-finite isolation on 8 CPU devices

# (ragged_all_to_all has no XLA:CPU implementation: tests/test_gpu_parallel.py runs it)
ISOLATION_RUNS = [(m, s, f) for m in range(len(MESHES)) for s in ("naive", "all_to_all")
                  for f in ("standard", "batched")]


def _isolation_ids(run):
    m, s, f = run
    return "-".join([["ep8", "ep4-tp2", "dp2-ep4"][m], s, f])


@pytest.mark.parametrize("run", [r if r == (1, "naive", "standard")
                                 else pytest.param(r, marks=pytest.mark.slow) for r in ISOLATION_RUNS],
                         ids=_isolation_ids)
def test_a_bad_unused_expert_or_token_stays_put_under_every_parallel_strategy(rng, run):
    """Regression: a NaN in an unused expert turned every token into NaN under ep4 x tp2 and
    dp2 x ep4. Expert 13 (device 6 of ep8, 3 of ep4) holds a NaN, expert 14 an inf, expert 15
    overflows; no token routes to them. Token 5 holds a NaN: only its row is NaN."""
    m, strategy, fmt = run
    shape, names, axes = MESHES[m]
    pcfg = ParallelConfig(cpu_mesh(shape, names), strategy=strategy, expert_format=fmt, **axes)
    x, w13, w2, _, _, b = moe(rng, 32, activation="relu2", bias=True)
    w, ids = select_experts(jnp.asarray(rng.standard_normal((32, E)), jnp.float32).at[:, 13:].set(-1e4), K)
    want = np.asarray(parallel_out(pcfg, x, w13, w2, w, ids, b, activation="relu2"))
    bad13, bad2 = np.array(w13), np.array(w2)
    bad13[13, 0, 0], bad2[14, 1, 1] = np.nan, np.inf
    bad13[15] *= np.float32(1e30)
    x = x.at[5, 3].set(jnp.nan)
    out = np.asarray(parallel_out(pcfg, x, jnp.asarray(bad13), jnp.asarray(bad2), w, ids, b, activation="relu2"))
    assert np.isnan(out[5]).all()
    assert np.isfinite(np.delete(out, 5, 0)).all()
    np.testing.assert_array_equal(np.delete(out, 5, 0), np.delete(want, 5, 0))


@pytest.mark.parametrize("scheme,act", [("fp8", "fp8_per_tensor"),
                                        pytest.param("nvfp4", "nvfp4", marks=pytest.mark.slow)])
@pytest.mark.parametrize("strategy", [pytest.param("naive", marks=pytest.mark.slow), "all_to_all"])
def test_dynamic_scales_ignore_a_nan_token_and_a_nan_byte_in_an_unused_expert(rng, strategy, scheme, act):
    """The default FP8 path (dynamic per-tensor scales) and NVFP4 (quantized before the dispatch
    with the max over every device's tokens): a NaN token and a NaN weight byte of an unused
    expert stay in place."""
    pcfg = ParallelConfig(cpu_mesh((2, 4), ("dp", "ep")), ep_axis="ep", dp_axis="dp", strategy=strategy)
    x, w13, w2, _, _, _ = moe(rng, 32)
    x = x.at[9].multiply(1e-3)  # token 9 never holds a max: with its NaN left out, the scales are the same
    w, ids = select_experts(jnp.asarray(rng.standard_normal((32, E)), jnp.float32).at[:, 15].set(-1e4), K)
    q13, q2, quant = quantize_weights(scheme, w13, w2, act=act)
    want = np.asarray(run_parallel(pcfg, x, q13, q2, w, ids, quant)[0])
    if scheme == "fp8":
        q13 = q13.at[15, 0, 0].set(jnp.nan)  # one NaN byte in the unused expert
    out = np.asarray(run_parallel(pcfg, x.at[9, 2].set(jnp.nan), q13, q2, w, ids, quant)[0])
    assert np.isnan(out[9]).all()
    np.testing.assert_array_equal(np.delete(out, 9, 0), np.delete(want, 9, 0))


def test_numpy_arrays_under_expert_parallelism(rng):
    pcfg = ParallelConfig(cpu_mesh((4,), ("ep",)), ep_axis="ep")
    x, w13, w2, w, ids, _ = moe(rng, 32)
    p = shard_weights(np.asarray(w13), np.asarray(w2), pcfg)
    out = parallel_fused_experts(np.asarray(x), p["w13"], p["w2"], np.asarray(w), np.asarray(ids), pcfg)
    assert rel_err(out, fused_experts(x, w13, w2, w, ids)) < 1e-5
