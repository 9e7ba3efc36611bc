"""The pure-JAX backend on the GPU: bf16 at realistic sizes against the float32 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import fused_experts, select_experts
from jax_moe.backends import xla
from jax_moe.config import MoEConfig
from jax_moe.reference import moe_reference

pytestmark = pytest.mark.gpu


def _reference_on_cpu(x, w13, w2, w, ids, cfg):
    """The float32 reference, computed on the host: it gathers [T, k, 2I, H] float32 weights
    (8 GB at T=1000, I=512), which GPU workers sharing one device need not hold."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        args = [jax.device_put(a, cpu) for a in (x, w13, w2, w, ids)]
        return np.asarray(moe_reference(*args, cfg), np.float64)


@pytest.mark.parametrize("t,e,k,h,i", [
    (1, 256, 8, 1024, 256),
    (77, 256, 8, 512, 256),
    (1000, 8, 2, 1024, 512),
    (513, 128, 4, 512, 384),
])
@pytest.mark.parametrize("strategy", ["auto", "gather", "blocked", "dense"])
def test_bf16_matches_float32_reference_on_gpu(rng, t, e, k, h, i, strategy):
    cfg = MoEConfig(e, k, h, i)
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    w, ids = select_experts(jnp.asarray(rng.standard_normal((t, e)), jnp.float32), k)
    fn = jax.jit(lambda *a: xla.apply(*a, cfg, strategy=None if strategy == "auto" else strategy))
    out = fn(x, w13, w2, w, ids)
    again = fn(x, w13, w2, w, ids)
    ref = _reference_on_cpu(x, w13, w2, w, ids, cfg)
    got = np.asarray(out, np.float64)
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1.5e-2
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))


def test_runs_on_the_gpu_device(rng):
    x = jnp.ones((4, 64), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((8, 64, 64)), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((8, 64, 32)), jnp.bfloat16)
    w, ids = select_experts(jnp.asarray(rng.standard_normal((4, 8)), jnp.float32), 2)
    out = fused_experts(x, w13, w2, w, ids)
    assert list(out.devices())[0].platform == "gpu"
