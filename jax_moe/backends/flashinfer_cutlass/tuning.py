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
there, at trace time (GPU work outside the traced function, once per shape and process).
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
    from jax_moe.backends import flashinfer_cutlass as fic

    lists = "|".join(d for g in (1, 2) for _, d, _ in fic.tactics(g, scheme))
    build = hashlib.sha1(lists.encode()).hexdigest()[:10]
    return f"{jax.devices()[0].device_kind}/{build}/{scheme}/{activation}/T{t}/H{h}/I{i}/E{e}/k{k}"


def cached(scheme, activation, t, h, i, e, k) -> tuple[int, int] | None:
    _load()
    return _memory.get(key(scheme, activation, t, h, i, e, k))


def choice(prepared, t: int, k: int) -> tuple[int, int]:
    """(gemm1, gemm2) tactics for ``prepared`` at T=t, top_k=k: cached, tuned now (with
    ``JAX_MOE_FI_AUTOTUNE=1``), or (-1, -1) for the handler's built-in rule."""
    from jax_moe.backends import flashinfer_cutlass as fic

    e, h, i = fic.problem_sizes(prepared)
    shape = (prepared.scheme, prepared.activation, int(t), h, i, e, int(k))
    hit = cached(*shape)
    if hit is not None:
        return hit
    if os.environ.get(AUTOTUNE_ENV, "0") not in ("", "0") and t > 0:
        # In a thread of its own: JAX's trace state is per thread, so the timing runs eagerly
        # even when the caller is being traced under jit.
        result = {}
        worker = threading.Thread(target=lambda: result.update(pick=tune_shape(*shape)))
        worker.start()
        worker.join()
        if "pick" not in result:
            raise RuntimeError(f"jax_moe: tuning the FlashInfer CUTLASS tactics for {shape} failed")
        return result["pick"]
    return -1, -1


def _random_prepared(scheme: str, activation: str, h: int, i: int, e: int):
    from jax_moe.backends import flashinfer_cutlass as fic

    kw, k2 = jax.random.split(jax.random.key(1234))
    n1 = 2 * i if fic.GATED[activation] else i
    # swigluoai needs its per-expert (alpha, beta, limit) operand; GPT-OSS's values
    extra = dict(scheme=scheme, activation=activation)
    if activation == "swigluoai":
        extra["swiglu"] = jnp.asarray(np.array([1.702, 1.0, 7.0], np.float32)[:, None].repeat(e, 1))
    if scheme == "mxfp4":  # random codes, scales 2**-4: the speed does not depend on the values
        from jax_moe.layouts import mixed_gemm_scale_shape

        w13 = jax.random.randint(kw, (e, n1, h // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        w2 = jax.random.randint(k2, (e, h, i // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        s13 = jnp.full((e,) + mixed_gemm_scale_shape(n1, h), 123, jnp.uint8)
        s2 = jnp.full((e,) + mixed_gemm_scale_shape(h, i), 123, jnp.uint8)
        return fic.Prepared(w13, w2, w13_block_scale=s13, w2_block_scale=s2, **extra)
    if scheme == "w4a8":  # random int4 codes, bf16 scales 2**-4, unit activation scales
        from jax_moe.layouts import mixed_gemm_scale_shape

        w13 = jax.random.randint(kw, (e, n1, h // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        w2 = jax.random.randint(k2, (e, h, i // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        s13 = jnp.full((e,) + mixed_gemm_scale_shape(n1, h, 128, 2), 2.0 ** -4, jnp.bfloat16)
        s2 = jnp.full((e,) + mixed_gemm_scale_shape(h, i, 128, 2), 2.0 ** -4, jnp.bfloat16)
        ones = jnp.ones((e,), jnp.float32)
        return fic.Prepared(w13, w2, w13_block_scale=s13, w2_block_scale=s2,
                            fc1_act_scale=jnp.ones((h,), jnp.bfloat16), g1_alphas=ones,
                            fc2_act_scale=jnp.ones((i,), jnp.bfloat16), g2_alphas=ones, **extra)
    dtype = jnp.float8_e4m3fn if scheme == "fp8" else fic.FLOAT_SCHEMES.get(scheme, jnp.bfloat16)
    w13 = (jax.random.normal(kw, (e, n1, h), jnp.float32) * h ** -0.5).astype(dtype)
    w2 = (jax.random.normal(k2, (e, h, i), jnp.float32) * i ** -0.5).astype(dtype)
    if scheme in fic.FLOAT_SCHEMES:
        return fic.Prepared(w13, w2, **extra)
    ones = jnp.ones((e,), jnp.float32)
    return fic.Prepared(w13, w2, w13_scale=ones, a13_scale=jnp.float32(1.0), g1_alphas=ones,
                        a2_gscale=jnp.float32(1.0), g2_alphas=ones, **extra)


def _median_ms(fn, args, iters: int) -> float:
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def tune(prepared, t: int, k: int, *, iters: int = 7, verbose: bool = False) -> tuple[int, int]:
    """Measure and cache the fastest (gemm1, gemm2) tactic pair for ``prepared``'s shape at T=t."""
    from jax_moe.backends import flashinfer_cutlass as fic

    e, h, i = fic.problem_sizes(prepared)
    return tune_shape(prepared.scheme, prepared.activation, int(t), h, i, e, int(k), iters=iters,
                      verbose=verbose)


def tune_shape(scheme, activation, t, h, i, e, k, *, iters: int = 7, verbose: bool = False) -> tuple[int, int]:
    from jax_moe.backends import flashinfer_cutlass as fic

    prep = _random_prepared(scheme, activation, h, i, e)
    kx, kr = jax.random.split(jax.random.key(t))
    x = jax.random.normal(kx, (t, h), fic.FLOAT_SCHEMES.get(scheme, jnp.bfloat16))
    ids = jnp.argsort(jax.random.uniform(kr, (t, e)), axis=1)[:, :k].astype(jnp.int32)
    tw = jnp.full((t, k), 1.0 / k, jnp.float32)

    def timed(g1, g2):
        fn = jax.jit(lambda x_, p_, w_, i_: fic.apply_prepared(x_, p_, w_, i_, gemm1_tactic=g1, gemm2_tactic=g2))
        try:
            return _median_ms(fn, (x, prep, tw, ids), iters)
        except Exception:  # a tactic that cannot run this shape (e.g. an alignment rule)
            return float("inf")

    d1, d2 = fic._module().default_tactics(t, h, i, e, k, fic.ACTIVATION_CODES[activation], fic.SCHEME_IDS[scheme])
    rows = t * k / e  # mean rows per expert: swapping A/B pays with few, never with many
    def candidates(gemm_id):
        out = []
        for idx, desc, ok in fic.tactics(gemm_id, scheme):
            swap = "swap_ab=1" in desc
            if ok and not (swap and rows >= 256) and not (not swap and rows <= 8):
                out.append(idx)
        return out or [idx for idx, _, ok in fic.tactics(gemm_id, scheme) if ok]

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
