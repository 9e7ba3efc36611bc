"""The batched expert format after the dispatch (8 CPU devices): each device lays the token copies it
receives out per expert, [E_local, C, H], and runs a backend's batched stage; it equals one device
and the standard format, never drops a copy, and moves NVFP4 rows with their scales."""

import jax.numpy as jnp
import pytest

from jax_moe import fused_experts
from jax_moe.parallel import ParallelConfig, parallel_fused_experts, shard_weights
from jax_moe.quant.scheme import quantize_weights
from helpers import cpu_mesh, rel_err
from parallel_cases import E, H, MESHES, moe, nvfp4_moe, parallel_out, run_parallel


@pytest.mark.parametrize("shape,names,axes", [pytest.param(*MESHES[0], marks=pytest.mark.slow), MESHES[1],
                                              pytest.param(*MESHES[2], marks=pytest.mark.slow)],
                         ids=["ep8", "ep4-tp2", "dp2-ep4"])
def test_batched_expert_format_equals_single_device_and_the_standard_format(rng, shape, names, axes, monkeypatch):
    """expert_format="batched": after the all-to-all each device lays its received token copies
    out as [E_local, C, H] and runs xla.apply_batched (I split over tp: the partial outputs
    summed after the combine, w2's bias once). Equals one device, and the standard format on
    the same inputs."""
    from jax_moe.backends import xla

    mesh = cpu_mesh(shape, names)
    x, w13, w2, w, ids, b = moe(rng, 32, activation="swigluoai", bias=True)
    ref = fused_experts(x, w13, w2, w, ids, activation="swigluoai", **b)
    stage = []
    monkeypatch.setattr(xla, "apply_batched", lambda x, *a, _real=xla.apply_batched, **k: stage.append(x.shape)
                        or _real(x, *a, **k))
    run = {fmt: parallel_out(ParallelConfig(mesh, strategy="all_to_all", expert_format=fmt, **axes),
                              x, w13, w2, w, ids, b, activation="swigluoai") for fmt in ("batched", "standard")}
    ep, dp = mesh.shape["ep"], mesh.shape.get("dp", 1)
    assert stage == [(E // ep, ep * 32 // (dp * ep), H)]  # [E_local, C = ep * T_local, H]
    assert rel_err(run["batched"], ref) < 1e-5
    assert rel_err(run["batched"], run["standard"]) < 1e-5


@pytest.mark.parametrize("routing", ["all-on-device-0", "repeated-ids"])
@pytest.mark.parametrize("strategy", [pytest.param("naive", marks=pytest.mark.slow), "all_to_all"])
def test_batched_format_never_drops_a_token_copy(rng, strategy, routing):
    """The capacity is the rows a device holds, so no routing overflows it: every token on
    device 0's experts 0..3 (each of them holds all 32 rows device 0 receives: counts = C;
    devices 1..3 receive nothing and run empty experts), or tokens naming one expert in two
    slots (the slots share one copy, each weighted)."""
    pcfg = ParallelConfig(cpu_mesh((4,), ("ep",)), ep_axis="ep", strategy=strategy, expert_format="batched")
    x, w13, w2, w, ids, _ = moe(rng, 32)
    if routing == "all-on-device-0":
        ids = jnp.tile(jnp.arange(4, dtype=jnp.int32), (32, 1))
    else:
        ids = ids.at[:, 1].set(ids[:, 0])
    assert rel_err(parallel_out(pcfg, x, w13, w2, w, ids), fused_experts(x, w13, w2, w, ids)) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("act", ["fp8_per_token", None])
def test_cutlass_runs_the_batched_stage_under_expert_parallelism(rng, act, monkeypatch):
    """backend='cutlass' with expert_format='batched': cutlass.apply_batched is the stage each
    device runs (bf16, and FP8 weights with per-token activation scales taken on the receiving
    device as in the standard format), equal to one device's xla result. The custom calls' jnp
    references run here; tests/test_gpu_parallel.py runs the kernels."""
    from jax_moe.backends import cutlass

    monkeypatch.setattr(cutlass, "supports", lambda *a, **k: (True, "ok"))
    calls = []
    real = cutlass.apply_batched
    monkeypatch.setattr(cutlass, "apply_batched", lambda x, counts, *a, **k: calls.append(x.shape) or real(
        x, counts, *a, **k))
    pcfg = ParallelConfig(cpu_mesh((4,), ("ep",)), ep_axis="ep", strategy="all_to_all", expert_format="batched")
    x, w13, w2, w, ids, _ = moe(rng, 32)
    x, w13, w2 = (a.astype(jnp.bfloat16) for a in (x, w13, w2))
    quant = None
    if act is not None:
        w13, w2, quant = quantize_weights("fp8", w13, w2, act=act)
    ref = fused_experts(x, w13, w2, w, ids, quant=quant, backend="xla")
    p = shard_weights(w13, w2, pcfg, quant=quant)
    out = parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg, quant=p["quant"], backend="cutlass")
    assert calls == [(E // 4, 4 * 8, H)]  # [E_local, C = ep * T_local, H]
    assert rel_err(out, ref) < (2e-2 if act is None else 5e-2)


@pytest.mark.slow
def test_batched_format_moves_nvfp4_tokens_with_their_scales(rng):
    """NVFP4 activations are quantized before the dispatch as in the standard format; the packed
    rows and their block scales are laid out per expert together, and the xla batched stage
    dequantizes them: one device's result."""
    pcfg = ParallelConfig(cpu_mesh((8,), ("ep",)), ep_axis="ep", strategy="all_to_all", expert_format="batched")
    x, q13, q2, w, ids, quant = nvfp4_moe(rng, 32)
    ref = fused_experts(x, q13, q2, w, ids, quant=quant, backend="xla")
    out, moved = run_parallel(pcfg, x, q13, q2, w, ids, quant)
    assert rel_err(out, ref) < 1e-5
    sent = [ln.split("=")[0] for ln in moved.splitlines() if "all_to_all" in ln]
    assert any("u8[" in ln and f",{H // 2}]" in ln for ln in sent), "the packed E2M1 rows travel"
    assert any("u8[" in ln and f",{H // 16}]" in ln for ln in sent), "their block scales travel"


def test_batched_format_refusals(rng):
    from jax_moe.parallel import parallel_apply_prepared

    mesh = cpu_mesh((4,), ("ep",))
    with pytest.raises(ValueError, match="expert_format must be one of .'standard', 'batched'., got 'auto'"):
        ParallelConfig(mesh, ep_axis="ep", expert_format="auto")
    pcfg = ParallelConfig(mesh, ep_axis="ep", strategy="all_to_all", expert_format="batched")
    x, _, _, w, ids, _ = moe(rng, 8)
    with pytest.raises(ValueError, match="parallel_apply_prepared runs the standard expert format only"):
        parallel_apply_prepared(x, None, w, ids, pcfg)
