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


@pytest.mark.skipif(len(gpus()) < 2, reason="needs at least 2 GPUs")
@pytest.mark.parametrize("backend", ["xla", "flashinfer_cutlass"])
@pytest.mark.parametrize("strategy,ragged", [("naive", None), ("all_to_all", True), ("all_to_all", False)])
@pytest.mark.parametrize("t_local", [1, 100])
def test_expert_parallel_on_gpus_equals_one_gpu(rng, strategy, ragged, t_local, backend):
    """Each device runs its own experts (ids of other devices' experts are -1 there) with
    ``backend``; the sum over devices equals one GPU's xla result."""
    if backend == "flashinfer_cutlass":
        from jax_moe.backends import flashinfer_cutlass as fic

        ok, why = fic.available()
        if not ok:
            pytest.skip(why)
    devs = gpus()
    mesh = Mesh(np.array(devs), ("ep",))
    e, k, h, i = 64, 8, 512, 256
    t = t_local * len(devs)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    w, ids = select_experts(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k)
    ref = np.asarray(fused_experts(x, w13, w2, w, ids), np.float64)
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

    ok, why = fic.available()
    if not ok:
        pytest.skip(why)
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
