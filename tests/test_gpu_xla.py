"""The pure-JAX backend on the GPU: bf16 at realistic sizes against the float32 reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import fused_experts
from jax_moe.backends import xla
from jax_moe.reference import moe_reference
from helpers import DTYPE_BOUND, random_moe, rel_err

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
    cfg, x, w13, w2, w, ids = random_moe(rng, t, e, k, h, i, dtype=jnp.bfloat16)
    fn = jax.jit(lambda *a: xla.apply(*a, cfg, strategy=None if strategy == "auto" else strategy))
    out = fn(x, w13, w2, w, ids)
    again = fn(x, w13, w2, w, ids)
    assert rel_err(out, _reference_on_cpu(x, w13, w2, w, ids, cfg)) < DTYPE_BOUND["bfloat16"]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))


def test_runs_on_the_gpu_device(rng):
    _, x, w13, w2, w, ids = random_moe(rng, 4, 8, 2, 64, 32, dtype=jnp.bfloat16)
    out = fused_experts(x, w13, w2, w, ids)
    assert list(out.devices())[0].platform == "gpu"
