"""Expert parallelism across the GPUs of one host (needs >= 2): equals one GPU's result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moe import fused_experts, select_experts
from jax_moe.parallel import ParallelConfig, parallel_fused_experts, shard_weights

pytestmark = pytest.mark.gpu


def gpus():
    try:
        return [d for d in jax.devices() if d.platform == "gpu"]
    except RuntimeError:
        return []


def skip_unless_available(backend):
    """Skip (with the backend's own reason) where ``backend``'s custom calls cannot run."""
    if backend == "xla":
        return
    from jax_moe import oracle

    ok, why = oracle.module(backend).available()
    if not ok:
        pytest.skip(why)


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
    t = t_local * len(devs)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    w, ids = select_experts(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k)
    ref = np.asarray(fused_experts(x, w13, w2, w, ids, backend="xla"), np.float64)
    pcfg = ParallelConfig(mesh, ep_axis="ep", strategy=strategy, ragged=ragged)
    p = shard_weights(w13, w2, pcfg)
    tok = NamedSharding(mesh, P("ep"))
    out = jax.jit(lambda x, w, ids: parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg, backend=backend))(
        jax.device_put(x, tok), jax.device_put(w, tok), jax.device_put(ids, tok))
    got = np.asarray(out, np.float64)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-2


@pytest.mark.skipif(len(gpus()) < 2, reason="needs at least 2 GPUs")
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
@pytest.mark.parametrize("strategy", ["naive", "all_to_all"])
def test_flashinfer_prepared_weights_over_expert_parallel_gpus(rng, scheme, strategy):
    """Load time: every GPU repacks only its own experts into the runner's layout
    (shard_prepared); run time: the runner on each GPU's experts, under both strategies; equals
    one GPU's xla result on the same (quantized) weights."""
    from jax_moe.backends import flashinfer_cutlass as fic
    from jax_moe.parallel import parallel_apply_prepared, shard_prepared
    from jax_moe.quant.scheme import quantize_weights

    skip_unless_available("flashinfer_cutlass")
    if scheme not in fic.compiled_schemes():
        pytest.skip(f"{scheme} not compiled")
    devs = gpus()
    mesh = Mesh(np.array(devs), ("ep",))
    e, k, h, i, t = 64, 8, 1024, 512, 96 * len(devs)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    quant = None
    if scheme == "fp8":
        w13, w2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a2_scale=0.02)
    w, ids = select_experts(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k)
    ref = np.asarray(fused_experts(x, w13, w2, w, ids, quant=quant, backend="xla"), np.float64)
    pcfg = ParallelConfig(mesh, ep_axis="ep", strategy=strategy)
    prep = shard_prepared(w13, w2, pcfg, quant=quant)
    assert prep.w13.addressable_shards[0].data.shape[0] == e // len(devs)
    tok = NamedSharding(mesh, P("ep"))
    f = jax.jit(lambda x, w, ids, p: parallel_apply_prepared(x, p, w, ids, pcfg))
    args = (jax.device_put(x, tok), jax.device_put(w, tok), jax.device_put(ids, tok), prep)
    out1, out2 = np.asarray(f(*args), np.float64), np.asarray(f(*args), np.float64)
    assert np.isfinite(out1).all()
    assert np.linalg.norm(out1 - ref) / np.linalg.norm(ref) < (2e-2 if scheme == "bf16" else 5e-2)
    np.testing.assert_array_equal(out1, out2)


def _tp_runs():
    """(mesh shape, axis names, ParallelConfig axes, strategy, I) over the GPUs there are: tp=2
    alone (also with I=200: 100 per GPU, padded to the runner's multiple), ep=1 x tp=2 under
    both EP strategies, and ep=2 x tp=2 where 4 GPUs exist."""
    tp, ep_tp = (("tp",), dict(tp_axis="tp")), (("ep", "tp"), dict(ep_axis="ep", tp_axis="tp"))
    runs = [((2,), *tp, "none", 512), ((2,), *tp, "none", 200)]
    runs += [((1, 2), *ep_tp, st, 512) for st in ("naive", "all_to_all")]
    if len(gpus()) >= 4:
        runs += [((2, 2), *ep_tp, st, 512) for st in ("naive", "all_to_all")]
    return [pytest.param(*r, id=f"{'x'.join(map(str, r[0]))}-{'-'.join(r[1])}-{r[3]}-I{r[4]}") for r in runs]


@pytest.mark.skipif(len(gpus()) < 2, reason="needs at least 2 GPUs")
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
@pytest.mark.parametrize("shape,names,axes,strategy,inter", _tp_runs())
def test_flashinfer_prepared_weights_over_tensor_parallel_gpus(rng, scheme, shape, names, axes, strategy, inter):
    """Tensor parallelism with the runner: every GPU repacks its own (ep, tp) block (I / tp of
    each of its experts, zero-padded to the runner's multiple where it falls short), runs it,
    and the partial outputs are summed over tp; equals one GPU's xla result on the same
    (quantized) weights."""
    from jax_moe.backends import flashinfer_cutlass as fic
    from jax_moe.parallel import parallel_apply_prepared, shard_prepared
    from jax_moe.quant.scheme import quantize_weights

    skip_unless_available("flashinfer_cutlass")
    if scheme not in fic.compiled_schemes():
        pytest.skip(f"{scheme} not compiled")
    n = int(np.prod(shape))
    mesh = Mesh(np.array(gpus()[:n]).reshape(shape), names)
    pcfg = ParallelConfig(mesh, strategy=strategy, **axes)
    e, k, h = 64, 8, 1024
    t = 96 * pcfg.size(pcfg.ep_axis)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * inter, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, inter)) / np.sqrt(inter), jnp.bfloat16)
    quant = None
    if scheme == "fp8":
        w13, w2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a2_scale=0.02)
    w, ids = select_experts(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k)
    ref = np.asarray(fused_experts(x, w13, w2, w, ids, quant=quant, backend="xla"), np.float64)
    prep = shard_prepared(w13, w2, pcfg, quant=quant)
    i_local = -(-(inter // 2) // fic.alignment(quant)) * fic.alignment(quant)
    assert prep.w13.addressable_shards[0].data.shape == (e // pcfg.size(pcfg.ep_axis), 2 * i_local, h)
    tok = NamedSharding(mesh, pcfg.token_spec)
    f = jax.jit(lambda x, w, ids, p: parallel_apply_prepared(x, p, w, ids, pcfg))
    out = np.asarray(f(jax.device_put(x, tok), jax.device_put(w, tok), jax.device_put(ids, tok), prep), np.float64)
    assert np.isfinite(out).all()
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < (2e-2 if scheme == "bf16" else 5e-2)
