"""Timers for choosing between implementations on this device: medians after warm-up.

:func:`median_ms` times blocked calls, the host's dispatch included. :func:`repeated_ms` runs
many calls inside one jitted loop, so the dispatch (most of a figure below a millisecond) is left
out and what is compared is device time per call. The autotuner (:mod:`jax_moe.autotune`) ranks
tiles with the second; the bench (``bench/``) reports both.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

Timer = Callable[[Callable, Sequence[tuple]], float]


def median_ms(fn: Callable, inputs: Sequence[tuple], min_iters: int = 5, max_iters: int = 50,
              budget_s: float = 0.6) -> float:
    """Median wall time (ms) of ``fn(*inputs[n % len(inputs)])`` after warm-up; blocks on each call.
    As many calls as fit in about ``budget_s``, between ``min_iters`` and ``max_iters``."""
    jax.block_until_ready(fn(*inputs[0]))  # compile + warm-up
    jax.block_until_ready(fn(*inputs[-1]))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*inputs[0]))
    first = time.perf_counter() - t0
    iters = int(min(max_iters, max(min_iters, budget_s / max(first, 1e-6))))
    times = []
    for n in range(iters):
        args = inputs[n % len(inputs)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def repeated_ms(fn: Callable, inputs: Sequence[tuple], vary: int, reps: int, timeit: Timer = median_ms) -> float:
    """Median device time (ms) of one call of ``fn``, with the host's dispatch left out: ``reps``
    calls in one jitted ``fori_loop``, timed by ``timeit`` and divided by ``reps``.

    ``inputs`` are argument sets; call ``n`` of the loop takes the first set's arguments, except
    argument ``vary`` (an array or a pytree of arrays: e.g. a routing), which it takes from set
    ``n % len(inputs)``, so no call is loop-invariant. Each call's first output element is added
    to the loop's carry, so no call is dead. Both cost a tiny kernel per call, and the loop has a
    cost of its own per iteration (about 11 us on an H100 around a one-element op), the same for
    every ``fn`` compared: a fair ranking, not a kernel's time alone."""
    sets = jax.tree.map(lambda *leaves: jnp.stack(leaves), *[args[vary] for args in inputs])
    fixed = list(inputs[0])

    def run(stacked, *args):
        def body(n, acc):
            call = list(args)
            call[vary] = jax.tree.map(
                lambda s: jax.lax.dynamic_index_in_dim(s, n % len(inputs), keepdims=False), stacked)
            first = jax.tree.leaves(fn(*call))[0]
            return acc + first.reshape(-1)[0].astype(jnp.float32)

        return jax.lax.fori_loop(0, reps, body, jnp.float32(0))

    return timeit(jax.jit(run), [(sets, *fixed)]) / reps


def loop_ms(fn: Callable, inputs: Sequence[tuple], vary: int, target_ms: float = 4.0, max_reps: int = 64) -> float:
    """:func:`repeated_ms` with as many calls per loop as fill about ``target_ms`` (2 to
    ``max_reps``), sized from a few blocked calls (an upper bound: they include the dispatch)."""
    probe = median_ms(fn, inputs, min_iters=3, max_iters=3)
    reps = max(2, min(max_reps, round(target_ms / max(probe, 1e-6))))
    return repeated_ms(fn, inputs, vary, reps)
