"""Tactic autotuning for the FlashInfer CUTLASS runner: time the compiled GEMM tactics of a
shape, keep the fastest pair.

The handler's built-in choice (tactic ``-1``) is a fixed rule: swap A/B with the narrowest N tile
when experts get few rows, else a 128x128 tile. :func:`tune` measures instead: every compiled
GEMM1 tactic (GEMM2 on its built-in choice), then every compiled GEMM2 tactic with the best GEMM1
(swapped-operand tactics only where experts get at most 256 rows on average, plain ones only
above 8),
each on random tokens and random weights of the shape (speed does not depend on the values),
median of a few runs after warm-up. Choices are kept in memory and in a JSON file
(``JAX_MOE_FI_TUNING_CACHE``, default ``~/.cache/jax_moe/flashinfer_tactics.json``), keyed by
device kind, the build's tactic list, scheme, activation and (T, H, I, E, k).

:func:`jax_moe.backends.flashinfer_cutlass.apply_prepared` asks :func:`choice` for its default
tactics: a cached pair if there is one; with ``JAX_MOE_FI_AUTOTUNE=1`` a missing shape is tuned
there, at trace time (GPU work outside the traced function, once per shape and process). What is
timed is the ``run`` handed in (``apply_prepared`` itself, with explicit tactics), on stand-in
operands of the scheme (its module's ``random_operands``).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends.flashinfer_cutlass import native
from jax_moe.backends.flashinfer_cutlass.common import (
    ACTIVATION_CODES, FLOAT_SCHEMES, GATED, NO_TACTICS, SCHEME_IDS, Prepared, problem_sizes,
)
from jax_moe.backends.flashinfer_cutlass.schemes import SCHEMES

AUTOTUNE_ENV = "JAX_MOE_FI_AUTOTUNE"
CACHE_ENV = "JAX_MOE_FI_TUNING_CACHE"

_memory: dict[str, tuple[int, int]] = {}
_loaded = {"path": None}


def cache_path() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "jax_moe",
                                                     "flashinfer_tactics.json")


def _load() -> None:
    path = cache_path()
    if _loaded["path"] == path:
        return
    _loaded["path"] = path
    try:
        with open(path) as f:
            _memory.update({k: tuple(v) for k, v in json.load(f).items()})
    except (OSError, ValueError):
        pass


def _save() -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({k: list(v) for k, v in sorted(_memory.items())}, f, indent=0)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the in-memory cache still works


def key(scheme: str, activation: str, t: int, h: int, i: int, e: int, k: int) -> str:
    """Cache key: device kind, a digest of this build's tactic lists, the problem."""
    lists = "|".join(d for g in (1, 2) for _, d, _ in native.tactics(g, scheme))
    build = hashlib.sha1(lists.encode()).hexdigest()[:10]
    return f"{jax.devices()[0].device_kind}/{build}/{scheme}/{activation}/T{t}/H{h}/I{i}/E{e}/k{k}"


def cached(scheme, activation, t, h, i, e, k) -> tuple[int, int] | None:
    _load()
    return _memory.get(key(scheme, activation, t, h, i, e, k))


def choice(prepared, t: int, k: int, run) -> tuple[int, int]:
    """(gemm1, gemm2) tactics for ``prepared`` at T=t, top_k=k: cached, tuned now (with
    ``JAX_MOE_FI_AUTOTUNE=1``, timing ``run``: :func:`tune`), or (-1, -1) for the handler's
    built-in rule."""
    if prepared.scheme in NO_TACTICS:
        return -1, -1
    e, h, i = problem_sizes(prepared)
    shape = (prepared.scheme, prepared.activation, int(t), h, i, e, int(k))
    hit = cached(*shape)
    if hit is not None:
        return hit
    if os.environ.get(AUTOTUNE_ENV, "0") not in ("", "0") and t > 0:
        # In a thread of its own: JAX's trace state is per thread, so the timing runs eagerly
        # even when the caller is being traced under jit.
        result = {}
        worker = threading.Thread(target=lambda: result.update(pick=tune_shape(*shape, run)))
        worker.start()
        worker.join()
        if "pick" not in result:
            raise RuntimeError(f"jax_moe: tuning the FlashInfer CUTLASS tactics for {shape} failed")
        return result["pick"]
    return -1, -1


def _random_prepared(scheme: str, activation: str, h: int, i: int, e: int) -> Prepared:
    """Stand-in operands of the shape (the scheme module's ``random_operands``)."""
    keys = jax.random.split(jax.random.key(1234))
    n1 = 2 * i if GATED[activation] else i
    extra = dict(scheme=scheme, activation=activation)
    if activation == "swigluoai":  # its per-expert (alpha, beta, limit) operand; GPT-OSS's values
        extra["swiglu"] = jnp.asarray(np.array([1.702, 1.0, 7.0], np.float32)[:, None].repeat(e, 1))
    return Prepared(**SCHEMES[scheme].random_operands(scheme, keys, e, n1, h, i), **extra)


def _median_ms(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def tune(prepared, t: int, k: int, run, *, iters: int = 7, verbose: bool = False) -> tuple[int, int]:
    """Measure and cache the fastest (gemm1, gemm2) tactic pair for ``prepared``'s shape at T=t:
    ``run(x, prepared, topk_weights, topk_ids, gemm1_tactic=, gemm2_tactic=)`` (``apply_prepared``)
    timed under jit."""
    e, h, i = problem_sizes(prepared)
    return tune_shape(prepared.scheme, prepared.activation, int(t), h, i, e, int(k), run, iters=iters,
                      verbose=verbose)


def tune_shape(scheme, activation, t, h, i, e, k, run, *, iters: int = 7, verbose: bool = False) -> tuple[int, int]:
    prep = _random_prepared(scheme, activation, h, i, e)
    kx, kr = jax.random.split(jax.random.key(t))
    x = jax.random.normal(kx, (t, h), FLOAT_SCHEMES.get(scheme, jnp.bfloat16))
    ids = jnp.argsort(jax.random.uniform(kr, (t, e)), axis=1)[:, :k].astype(jnp.int32)
    tw = jnp.full((t, k), 1.0 / k, jnp.float32)

    def timed(g1, g2):
        fn = jax.jit(lambda x_, p_, w_, i_: run(x_, p_, w_, i_, gemm1_tactic=g1, gemm2_tactic=g2))
        try:
            return _median_ms(fn, (x, prep, tw, ids), iters)
        except Exception:  # a tactic that cannot run this shape (e.g. an alignment rule)
            return float("inf")

    d1, d2 = native._module().default_tactics(t, h, i, e, k, ACTIVATION_CODES[activation], SCHEME_IDS[scheme])
    rows = t * k / e  # mean rows per expert: swapping A/B pays with few, never with many
    def candidates(gemm_id):
        out = []
        for idx, desc, ok in native.tactics(gemm_id, scheme):
            swap = "swap_ab=1" in desc
            if ok and not (swap and rows >= 256) and not (not swap and rows <= 8):
                out.append(idx)
        return out or [idx for idx, _, ok in native.tactics(gemm_id, scheme) if ok]

    g1s, g2s = candidates(1), candidates(2)
    t1 = {g1: timed(g1, d2) for g1 in g1s}
    best1 = min(t1, key=t1.get)
    t2 = {g2: timed(best1, g2) for g2 in g2s}
    best2 = min(t2, key=t2.get)
    default = timed(d1, d2)
    pick = (best1, best2) if t2[best2] < default else (d1, d2)
    if verbose:
        print(f"# tuned {scheme} {activation} T={t} H={h} I={i} E={e} k={k}: {pick} "
              f"{min(t2[best2], default):.3f} ms (built-in {d1, d2}: {default:.3f} ms)")
    _load()
    _memory[key(scheme, activation, t, h, i, e, k)] = tuple(int(v) for v in pick)
    _save()
    return pick
