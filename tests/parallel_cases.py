"""The parallel specs' shared layer (tests/test_parallel.py, tests/test_parallel_batched.py): a
small random MoE, the meshes of 8 CPU devices they run on, and an NVFP4 layer run under a mesh."""

import jax
from jax_moe.parallel import parallel_fused_experts, shard_weights
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights
from helpers import random_biases, random_moe

E, K, H, I = 16, 4, 32, 32


def moe(rng, t, activation="silu", bias=False):
    """(x, w13, w2, topk_weights, topk_ids, biases) of a random float32 layer of these
    sizes; biases a dict of fused_experts' keywords (empty without ``bias``)."""
    m = random_moe(rng, t, E, K, H, I, activation=activation)
    return (*m.args, random_biases(rng, m.cfg) if bias else {})


MESHES = [((8,), ("ep",), dict(ep_axis="ep")),
          ((4, 2), ("ep", "tp"), dict(ep_axis="ep", tp_axis="tp")),
          ((2, 4), ("dp", "ep"), dict(ep_axis="ep", dp_axis="dp"))]


def nvfp4_moe(rng, t, dynamic=False):
    """(x, NVFP4 w13, w2, topk_weights, topk_ids, quant) of moe()'s layer, activations NVFP4 (a static
    scale, or ``dynamic``)."""
    x, w13, w2, w, ids, _ = moe(rng, t)
    a13 = None if dynamic else calibrate_activation_scale("nvfp4", x)
    q13, q2, quant = quantize_weights("nvfp4", w13, w2, act="nvfp4", a13_scale=a13, a2_scale=0.02)
    return x, q13, q2, w, ids, quant


def run_parallel(pcfg, x, q13, q2, w, ids, quant, **opts):
    """parallel_fused_experts jitted on weights placed by shard_weights: (its output, its jaxpr as text)."""
    p = shard_weights(q13, q2, pcfg, quant=quant)
    f = jax.jit(lambda x, w, ids, p: parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg, quant=p["quant"],
                                                             **opts))
    return f(x, w, ids, p), str(jax.make_jaxpr(f)(x, w, ids, p))


def parallel_out(pcfg, x, w13, w2, w, ids, b=None, **opts):
    """parallel_fused_experts under jit on weights placed by shard_weights (biases in b)."""
    b = b or {}
    p = shard_weights(w13, w2, pcfg, activation=opts.get("activation", "silu"), **b)
    return jax.jit(lambda x, w, ids, p: parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg,
                                                               w13_bias=p["w13_bias"], w2_bias=p["w2_bias"],
                                                               quant=p["quant"], **opts))(x, w, ids, p)
