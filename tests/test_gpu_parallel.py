"""Expert parallelism across the GPUs of one host (needs >= 2): equals one GPU's result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moe import fused_experts
from jax_moe.parallel import ParallelConfig, parallel_fused_experts, shard_weights
from helpers import SCHEME_TOL, random_moe, rel_err, skip_unless_available

pytestmark = pytest.mark.gpu


def gpus():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


@pytest.mark.skipif(len(gpus()) < 2, reason="needs at least 2 GPUs")
@pytest.mark.parametrize("backend", ["xla", "flashinfer_cutlass", "cutlass"])
@pytest.mark.parametrize("strategy,ragged", [("naive", None), ("all_to_all", True), ("all_to_all", False)])
@pytest.mark.parametrize("t_local", [1, 100])
def test_expert_parallel_on_gpus_equals_one_gpu(rng, strategy, ragged, t_local, backend):
    """Each device runs its own experts (ids of other devices' experts are -1 there) with
    ``backend``; the sum over devices equals one GPU's xla result. (``cutlass`` skips slots
    whose id is outside [0, E_local): the -1 of experts owned elsewhere.)"""
    skip_unless_available(backend)
    devs = gpus()
    mesh = Mesh(np.array(devs), ("ep",))
    e, k, h, i = 64, 8, 512, 256
    _, x, w13, w2, w, ids = random_moe(rng, t_local * len(devs), e, k, h, i, dtype=jnp.bfloat16)
    ref = fused_experts(x, w13, w2, w, ids, backend="xla")
    pcfg = ParallelConfig(mesh, ep_axis="ep", strategy=strategy, ragged=ragged)
    p = shard_weights(w13, w2, pcfg)
    tok = NamedSharding(mesh, P("ep"))
    out = jax.jit(lambda x, w, ids: parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg, backend=backend))(
        jax.device_put(x, tok), jax.device_put(w, tok), jax.device_put(ids, tok))
    assert rel_err(out, ref) < 1e-2


def _prepared_runs():
    """(mesh shape, axis names, ParallelConfig axes, strategy, I) over the GPUs there are: ep
    over all of them; tp=2 alone (also with I=200: 100 per GPU, padded to the runner's
    multiple); ep=1 x tp=2 under both EP strategies; ep=2 x tp=2 where 4 GPUs exist."""
    n = max(2, len(gpus()))
    ep, tp, ep_tp = (("ep",), dict(ep_axis="ep")), (("tp",), dict(tp_axis="tp")), \
        (("ep", "tp"), dict(ep_axis="ep", tp_axis="tp"))
    runs = [((n,), *ep, st, 512) for st in ("naive", "all_to_all")]
    runs += [((2,), *tp, "none", 512), ((2,), *tp, "none", 200)]
    runs += [((1, 2), *ep_tp, st, 512) for st in ("naive", "all_to_all")]
    if len(gpus()) >= 4:
        runs += [((2, 2), *ep_tp, st, 512) for st in ("naive", "all_to_all")]
    return [pytest.param(*r, id=f"{'x'.join(map(str, r[0]))}-{'-'.join(r[1])}-{r[3]}-I{r[4]}") for r in runs]


@pytest.mark.skipif(len(gpus()) < 2, reason="needs at least 2 GPUs")
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
@pytest.mark.parametrize("shape,names,axes,strategy,inter", _prepared_runs())
def test_flashinfer_prepared_weights_over_gpus(rng, scheme, shape, names, axes, strategy, inter):
    """Load time: every GPU repacks only its own (ep, tp) block into the runner's layout
    (shard_prepared: its experts, I / tp of each, zero-padded to the runner's multiple where it
    falls short). Run time: the runner on each GPU's block under the strategy, the partial
    outputs summed over tp. Equals one GPU's xla result on the same (quantized) weights, and
    is deterministic."""
    from jax_moe.backends import flashinfer_cutlass as fic
    from jax_moe.parallel import parallel_apply_prepared, shard_prepared
    from jax_moe.quant.scheme import quantize_weights

    skip_unless_available("flashinfer_cutlass")
    if scheme not in fic.compiled_schemes():
        pytest.skip(f"{scheme} not compiled")
    mesh = Mesh(np.array(gpus()[:int(np.prod(shape))]).reshape(shape), names)
    pcfg = ParallelConfig(mesh, strategy=strategy, **axes)
    ep, tp = pcfg.size(pcfg.ep_axis), pcfg.size(pcfg.tp_axis)
    e, k, h = 64, 8, 1024
    _, x, w13, w2, w, ids = random_moe(rng, 96 * ep, e, k, h, inter, dtype=jnp.bfloat16)
    quant = None
    if scheme == "fp8":
        w13, w2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a2_scale=0.02)
    ref = fused_experts(x, w13, w2, w, ids, quant=quant, backend="xla")
    prep = shard_prepared(w13, w2, pcfg, quant=quant)
    i_local = -(-(inter // tp) // fic.alignment(quant)) * fic.alignment(quant)
    assert prep.w13.addressable_shards[0].data.shape == (e // ep, 2 * i_local, h)
    tok = NamedSharding(mesh, pcfg.token_spec)
    f = jax.jit(lambda x, w, ids, p: parallel_apply_prepared(x, p, w, ids, pcfg))
    args = (jax.device_put(x, tok), jax.device_put(w, tok), jax.device_put(ids, tok), prep)
    out1, out2 = np.asarray(f(*args), np.float64), np.asarray(f(*args), np.float64)
    assert rel_err(out1, ref) < SCHEME_TOL[scheme]
    np.testing.assert_array_equal(out1, out2)


@pytest.mark.skipif(len(gpus()) < 2, reason="needs at least 2 GPUs")
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
@pytest.mark.parametrize("strategy,ragged", [("all_to_all", False), ("all_to_all", True), ("naive", None)])
@pytest.mark.parametrize("t_local,routing", [(1, "routed"), (100, "routed"), (100, "all-on-gpu-0")])
def test_cutlass_batched_format_on_gpus(rng, scheme, strategy, ragged, t_local, routing, monkeypatch):
    """expert_format="batched" with backend="cutlass": each GPU lays its received token copies
    out as [E_local, ep * T_local, H] and runs cutlass.apply_batched (the batched grouped GEMMs);
    equals one GPU's xla result and the standard format on the same inputs (FP8: per-token
    activation scales, taken on the receiving GPU in both formats), also when every token's
    experts live on GPU 0 and the others run empty experts; deterministic."""
    from jax_moe.backends import cutlass
    from jax_moe.quant.scheme import quantize_weights

    skip_unless_available("cutlass")
    stage = []
    monkeypatch.setattr(cutlass, "apply_batched", lambda x, *a, _real=cutlass.apply_batched, **k: stage.append(
        x.shape) or _real(x, *a, **k))
    devs = gpus()
    ep = len(devs)
    mesh = Mesh(np.array(devs), ("ep",))
    e, k, h, i = 64, 8, 512, 256
    t = t_local * ep
    _, x, w13, w2, w, ids = random_moe(rng, t, e, k, h, i, dtype=jnp.bfloat16)
    quant = None
    if scheme == "fp8":
        w13, w2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_token")
    if routing == "all-on-gpu-0":
        ids = jnp.tile(jnp.arange(k, dtype=jnp.int32) % (e // ep), (t, 1))
    ref = np.asarray(fused_experts(x, w13, w2, w, ids, quant=quant, backend="xla"), np.float64)
    tok = NamedSharding(mesh, P("ep"))
    args = (jax.device_put(x, tok), jax.device_put(w, tok), jax.device_put(ids, tok))
    outs = {}
    for fmt in ("batched", "standard"):
        pcfg = ParallelConfig(mesh, ep_axis="ep", strategy=strategy, ragged=ragged, expert_format=fmt)
        p = shard_weights(w13, w2, pcfg, quant=quant)
        f = jax.jit(lambda x, w, ids, p=p, pcfg=pcfg: parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg,
                                                                             quant=p["quant"], backend="cutlass"))
        outs[fmt] = np.asarray(f(*args), np.float64)
        if fmt == "batched":
            np.testing.assert_array_equal(outs[fmt], np.asarray(f(*args), np.float64))
    assert stage == [(e // ep, ep * t_local, h)]
    assert rel_err(outs["batched"], ref) < SCHEME_TOL[scheme]
    assert rel_err(outs["batched"], outs["standard"]) < SCHEME_TOL[scheme]
