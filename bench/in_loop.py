"""Device time per MoE layer, with Python dispatch left out: N layers inside one jitted loop.

A per-call timing (``moe_bench.timeit``: one jitted call, ``block_until_ready`` on each) counts the
host's dispatch of every call, which at T=1..16 is a large part of the figure. Here N layers run
in ONE jitted ``jax.lax.fori_loop``: layer ``n`` takes the previous layer's output as its tokens
and its own routing (``topk_weights[n]``, ``topk_ids[n]``: a fresh random routing per layer, so
consecutive layers touch different experts as a model's do, and a small model's experts do not sit
in L2 from one layer to the next; or, with ``routing="balanced"``, every expert the same rows), the
same weights every layer (N sets of DeepSeek-V3's experts would not fit). The time of one loop over
N is the per-layer device time, launch gaps between the kernels included, the host's dispatch
excluded. Each layer also reads its routing from the
stacked ``[N, T, k]`` arrays (a dynamic slice of a few bytes, one tiny kernel at most).
The loop has costs of its own. Per iteration there is a short gap after the loop's test (about
3 us on an H100 with jax 0.11, traced around a Qwen3-30B-A3B layer; about 11 us around a
one-element op). Per call, the timer also counts the loop's dispatch, its copies in and the wait,
spread over the N layers: traced, about 49 us per layer at N=8 for that layer, so a quarter of that
at N=32. Per-layer figures are therefore upper bounds, the closer the more layers; a profiler
trace of the same loop gives the kernels alone (``bench/stage_breakdown.py --loop N``).

The outputs are rescaled (the routing weights are multiplied once, before timing, by
``1 / rms`` of one layer's output) so that the tokens keep a magnitude near 1 through the N
layers instead of shrinking towards denormals (nothing is timed on zeros or near-zeros).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from jax_moe import timing

Layer = Callable[[jax.Array, object, jax.Array, jax.Array], jax.Array]


def stacked_routing(num_tokens: int, num_experts: int, top_k: int, layers: int, seed: int = 1000,
                    routing: str = "random") -> tuple[jax.Array, jax.Array]:
    """``layers`` routings: (topk_weights [N, T, k] float32, topk_ids [N, T, k] int32). ``random``:
    independent softmax top-k of Gaussian logits (jax_moe's ``select_experts``); ``balanced``:
    :func:`bench.routings.balanced_routing`, rotated by one expert per layer."""
    from bench.routings import ROUTINGS, balanced_routing  # noqa: PLC0415
    from jax_moe.routing import select_experts  # noqa: PLC0415

    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    if routing == "balanced":
        per_layer = [balanced_routing(num_tokens, num_experts, top_k, shift=n) for n in range(layers)]
        return jnp.stack([w for w, _ in per_layer]), jnp.stack([ids for _, ids in per_layer])
    logits = jax.random.normal(jax.random.key(seed), (layers, num_tokens, num_experts), jnp.float32)
    return jax.vmap(lambda lg: select_experts(lg, top_k))(logits)


def output_scale(fn: Layer, x: jax.Array, weights, topk_weights: jax.Array, topk_ids: jax.Array) -> float:
    """``1 / rms(fn(x, ...))`` of one layer (1.0 if that is zero or not finite)."""
    y = jax.jit(fn)(x, weights, topk_weights, topk_ids).astype(jnp.float32)
    rms = float(jnp.sqrt(jnp.mean(y * y)))
    return 1.0 / rms if rms > 0 and rms == rms and rms != float("inf") else 1.0


def layer_loop(fn: Layer, layers: int) -> Callable:
    """A jitted ``(x, weights, topk_weights [N, T, k], topk_ids [N, T, k]) -> x`` that runs ``fn``
    ``layers`` times in one ``fori_loop``, each layer's output the next layer's input."""
    def run(x, weights, tw, ids):
        def body(n, h):
            return fn(h, weights, tw[n], ids[n]).astype(h.dtype)

        return jax.lax.fori_loop(0, layers, body, x)

    return jax.jit(run)


def scaled_loop(fn: Layer, x: jax.Array, weights, num_experts: int, top_k: int, layers: int,
                routing: str = "random") -> tuple[Callable, tuple]:
    """(:func:`layer_loop` of ``fn`` over ``layers`` layers, its arguments): the routing is
    :func:`stacked_routing`'s (``routing``: random or balanced), scaled by :func:`output_scale`."""
    tw, ids = stacked_routing(x.shape[0], num_experts, top_k, layers, routing=routing)
    tw = tw * output_scale(fn, x, weights, tw[0], ids[0])
    return layer_loop(fn, layers), (x, weights, tw, ids)


def per_layer_ms(fn: Layer, x: jax.Array, weights, num_experts: int, top_k: int, layers: int,
                 timeit: Callable) -> float:
    """Median device time (ms) of one layer of ``fn`` inside a jitted loop of ``layers`` layers
    (:func:`scaled_loop`). ``timeit(f, inputs) -> ms`` is the bench's timer (median of blocked
    calls after warm-up)."""
    loop, args = scaled_loop(fn, x, weights, num_experts, top_k, layers)
    return timeit(loop, [args]) / layers


def repeated_ms(fn: Callable, inputs: list[tuple], vary: int, reps: int, timeit: Callable) -> float:
    """Median device time (ms) of one call of ``fn``: ``reps`` calls in one jitted loop, argument
    ``vary`` cycled over the sets of ``inputs`` (:func:`jax_moe.timing.repeated_ms`)."""
    return timing.repeated_ms(fn, inputs, vary, reps, timeit)
