"""Helpers the test files share (importable as ``helpers``: pytest puts tests/ on sys.path).

* calling: :func:`jit_call`;
* errors and bounds: :func:`rel_err`, :data:`DTYPE_BOUND`, :data:`SCHEME_TOL`;
* fresh random layers (never zeros): :func:`random_weights`, :func:`random_routing`,
  :func:`random_moe`, :func:`random_biases`; a scheme without weights: :func:`scheme_only`;
* float64 numpy definitions, written from the documented formulas and never from jax_moe's code:
  :func:`np_sigmoid`, :func:`np_silu`, :func:`np_softmax`, :func:`np_top_k`, :func:`np_select_experts`,
  :func:`np_activation`,
  :func:`np_moe`, :func:`np_e2m1_round`, :func:`np_e4m3_round`, :func:`np_fp8_per_token`;
* non-finite values: :data:`BAD_VALUES`, :func:`poison_experts`, :func:`poison_memory`;
* skips: :func:`skip_unless_available`, :func:`skip_unless_fi_scheme`, :func:`need_native`,
  :func:`has_sm100`, :data:`sm100`, :func:`cpu_mesh`.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_moe.config import MoEConfig

# ----------------------------------------------------------------------------- calling


def jit_call(fn, *args, **kw):
    """``fn(*args, **kw)`` under jax.jit with every array (and QuantConfig) an argument; strings,
    numbers and MoEConfigs stay static. On CPU an eager call runs op by op and arrays closed over by
    the jitted function are constant-folded: both cost seconds per call."""
    static = {k: v for k, v in kw.items() if v is None or isinstance(v, (str, bool, int, float, MoEConfig))}
    arrays = {k: v for k, v in kw.items() if k not in static}
    return jax.jit(lambda a, d: fn(*a, **d, **static))(args, arrays)


# ----------------------------------------------------------------------------- errors and bounds

# Norm-relative bound of the xla backend against the float32 definition on the same inputs, per
# x dtype (the definition rounds GEMM2's input to x's dtype as the kernels do).
DTYPE_BOUND = {"float32": 1e-5, "bfloat16": 1.5e-2, "float16": 5e-3}
# Norm-relative bound of a kernel backend against backend="xla" on the same (quantized) weights,
# per scheme: bf16 rounding of intermediate results; FP8/MXFP4 activations landing one step apart.
SCHEME_TOL = {"bf16": 2e-2, "fp8": 5e-2, "mxfp4": 5e-2}


def rel_err(got, want, *, finite: bool = True) -> float:
    """``||got - want|| / ||want||`` in float64 (where ``want`` is all zeros: the largest
    ``|got|``). With ``finite`` (the default) a NaN or inf in ``got`` fails the test here, so
    that no bound is ever checked against a non-finite output."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if finite:
        bad = ~np.isfinite(got)
        assert not bad.any(), f"{int(bad.sum())} of {got.size} values are not finite"
    den = np.linalg.norm(want)
    return float(np.linalg.norm(got - want) / den) if den > 0 else float(np.abs(got).max(initial=0.0))


# ----------------------------------------------------------------------------- random layers


class Moe(NamedTuple):
    """One random MoE call: its config and the arguments of ``fused_experts``."""

    cfg: MoEConfig
    x: jax.Array
    w13: jax.Array
    w2: jax.Array
    topk_weights: jax.Array
    topk_ids: jax.Array

    @property
    def args(self) -> tuple:
        """``(x, w13, w2, topk_weights, topk_ids)``, as fused_experts takes them."""
        return self.x, self.w13, self.w2, self.topk_weights, self.topk_ids


def random_weights(rng: np.random.Generator, e: int, h: int, i: int, *, gated: bool = True,
                   dtype=jnp.float32, scale: float | None = None) -> tuple[jax.Array, jax.Array]:
    """Expert weights in vLLM's orientation: w13 [E, 2I, H] ([E, I, H] when not ``gated``) and
    w2 [E, H, I], standard normal divided by the square root of the fan-in (or times ``scale``)."""
    rows = 2 * i if gated else i
    s13, s2 = (1 / math.sqrt(h), 1 / math.sqrt(i)) if scale is None else (scale, scale)
    return (jnp.asarray(rng.standard_normal((e, rows, h)) * s13, dtype),
            jnp.asarray(rng.standard_normal((e, h, i)) * s2, dtype))


def random_routing(rng: np.random.Generator, t: int, e: int, k: int, *, experts: Sequence[int] | None = None,
                   minus_one: float = 0.0, normalize: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(topk_weights [T, k] float32, topk_ids [T, k] int32)``: k distinct experts per token drawn
    from ``experts`` (default: all E; the others receive no token), weights in [0.1, 1.1) (rows
    summing to 1 with ``normalize``); with ``minus_one`` that fraction of the ids is -1 (a slot
    whose expert lives on another device)."""
    pool = np.arange(e) if experts is None else np.asarray(experts)
    ids = pool[np.argsort(rng.random((t, len(pool))), axis=1)[:, :k]].astype(np.int32)
    if minus_one:
        ids[rng.random(ids.shape) < minus_one] = -1
    w = rng.random((t, k)).astype(np.float32) + np.float32(0.1)
    if normalize:
        w /= w.sum(axis=1, keepdims=True)
    return jnp.asarray(w), jnp.asarray(ids)


def random_biases(rng: np.random.Generator, cfg: MoEConfig, *, scale: float = 1.0, dtype=jnp.float32) -> dict:
    """``dict(w13_bias [E, N1], w2_bias [E, H])``, standard normal times ``scale``, as
    fused_experts' keywords."""
    e, h = cfg.num_experts, cfg.hidden_size
    return dict(w13_bias=jnp.asarray(scale * rng.standard_normal((e, cfg.w13_rows)), dtype),
                w2_bias=jnp.asarray(scale * rng.standard_normal((e, h)), dtype))


def random_moe(rng: np.random.Generator, t: int, e: int, k: int, h: int, i: int, *, activation: str = "silu",
               dtype=jnp.float32, x_dtype=None, experts: Sequence[int] | None = None,
               normalize: bool = False) -> Moe:
    """A random layer and routed batch: x [T, H] standard normal in ``x_dtype`` (default ``dtype``),
    weights from :func:`random_weights` in ``dtype``, routing from :func:`random_routing`."""
    cfg = MoEConfig(e, k, h, i, activation)
    x = jnp.asarray(rng.standard_normal((t, h)), dtype if x_dtype is None else x_dtype)
    w13, w2 = random_weights(rng, e, h, i, gated=cfg.gated, dtype=dtype)
    w, ids = random_routing(rng, t, e, k, experts=experts, normalize=normalize)
    return Moe(cfg, x, w13, w2, w, ids)


def scheme_only(name: str, num_experts: int = 128, **changes):
    """A scheme's most common serving form without weights (jax_moe.info's SchemeOnly: what the
    oracle and the backends' ``supports`` read of a QuantConfig), with ``changes``; None for
    ``"bf16"`` (unquantized)."""
    if name == "bf16":
        return None
    from jax_moe.info import SchemeOnly

    q = SchemeOnly(name, num_experts)
    q.__dict__.update(changes)
    return q


# ----------------------------------------------------------------------------- float64 definitions


def np_sigmoid(v) -> np.ndarray:
    """1 / (1 + exp(-v)) in float64, without overflow warnings for large |v|."""
    v = np.asarray(v, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(v >= 0, 1.0 / (1.0 + np.exp(-v)), np.exp(v) / (1.0 + np.exp(v)))


def np_silu(v) -> np.ndarray:
    """v * sigmoid(v) in float64."""
    return np.asarray(v, np.float64) * np_sigmoid(v)


def np_softmax(v, axis: int = -1) -> np.ndarray:
    """softmax along ``axis`` in float64."""
    v = np.asarray(v, np.float64)
    e = np.exp(v - v.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def np_top_k(scores, k: int) -> np.ndarray:
    """Indices of the k largest scores along the last axis, largest first (ties: the lower index)."""
    return np.argsort(-np.asarray(scores, np.float64), axis=-1, kind="stable")[..., :k]


def np_select_experts(logits, k: int, scoring: str = "softmax", renormalize: bool = True, groups=None,
                      topk_group=None, bias=None, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A router's choice per token, in float64: (weights [T, k] float32, ids [T, k] int32, the
    choice scores [T, E] float64 that ranked them, -inf outside the kept groups)."""
    t, e = logits.shape
    weights, ids = np.zeros((t, k), np.float32), np.zeros((t, k), np.int32)
    ranked = np.zeros((t, e), np.float64)
    for row in range(t):
        scores = (np_softmax if scoring == "softmax" else np_sigmoid)(np.asarray(logits[row], np.float64))
        choice = scores + (np.asarray(bias, np.float64) if bias is not None else 0.0)
        allowed = np.ones(e, bool)
        if groups:
            per = e // groups
            gscore = []
            for g in range(groups):
                member = choice[g * per:(g + 1) * per]
                gscore.append(np.sort(member)[-2:].sum() if bias is not None else member.max())
            allowed[:] = False
            for g in np_top_k(gscore, topk_group):
                allowed[g * per:(g + 1) * per] = True
        ranked[row] = np.where(allowed, choice, -np.inf)
        sel = np_top_k(list(ranked[row]), k)
        w = scores[sel]
        if renormalize:
            w = w / w.sum()
        weights[row], ids[row] = w * scale, sel
    return weights, ids, ranked


_erf = np.vectorize(math.erf, otypes=[np.float64])

# FP4 E2M1 values indexed by the 4-bit code (bit 3 the sign)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def np_e2m1_round(v) -> np.ndarray:
    """Nearest E2M1 value of |v| <= 6 (ties to the even code; larger magnitudes saturate to 6),
    with v's sign."""
    mags = E2M1_VALUES[:8]
    a = np.minimum(np.abs(v), 6.0)[..., None]
    d = np.abs(mags - a)
    best = d.min(-1, keepdims=True)
    cand = np.isclose(d, best, rtol=0, atol=0)
    even = cand & (np.arange(8) % 2 == 0)
    idx = np.where(even.any(-1), even.argmax(-1), cand.argmax(-1))
    return np.copysign(mags[idx], v)


def np_fp8_per_token(v) -> tuple[np.ndarray, np.ndarray]:
    """fp8_per_token of rows v [M, C] in jax_moe/quant/fp8.py's float32 arithmetic: the scale
    ``max(amax * (1 / 448), tiny)`` per row, the values ``e4m3(v * (1 / scale))``. Returns
    (q as float32 values [M, C], scales [M] float32)."""
    v = np.asarray(v, np.float32)
    scale = np.maximum(np.abs(v).max(axis=1) * (np.float32(1) / np.float32(448)),
                       np.finfo(np.float32).tiny).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)
    q = np.clip(v * inv[:, None], -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return q, scale


def np_e4m3_round(v) -> np.ndarray:
    """float64 values of float8_e4m3fn rounding (nearest, ties to even) of v clipped to +-448."""
    return np.clip(np.asarray(v, np.float64), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def np_activation(h, activation: str, layout: str = "concat", alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """The activation on GEMM1's output rows h [..., rows] (float64), from the definitions in
    jax_moe's config.py docstring: gate/up halves (``concat``: gate rows then up rows;
    ``interleaved``: row 2i gate, 2i+1 up); silu(g) * u, gelu_erf(g) * u, GPT-OSS swigluoai
    ((clip(u) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit))), relu(h)^2 (not gated)."""
    h = np.asarray(h, np.float64)
    with np.errstate(all="ignore"):
        if activation == "relu2":
            r = np.maximum(h, 0.0)
            return r * r
        n = h.shape[-1] // 2
        g, u = (h[..., :n], h[..., n:]) if layout == "concat" else (h[..., 0::2], h[..., 1::2])
        if activation == "silu":
            return g * np_sigmoid(g) * u
        if activation == "gelu":
            return 0.5 * g * (1.0 + _erf(g / math.sqrt(2.0))) * u
        g = np.minimum(g, limit)
        u = np.clip(u, -limit, limit)
        return (u + 1.0) * g * np_sigmoid(alpha * g)


def np_moe(x, w13, w2, weights, ids, activation: str = "silu", layout: str = "concat", b13=None, b2=None,
           on_input: bool = False, alpha: float = 1.702, limit: float = 7.0, dtype=np.float32,
           magnitude: bool = False, quantize: Callable[[np.ndarray, int], np.ndarray] | None = None):
    """``out[t] = sum_j w[t, j] * (W2[e] @ act(W13[e] @ x[t] + b13[e]) + b2[e])``, ``e = ids[t, j]``
    in [0, E) (other ids contribute nothing), in float64; with ``on_input`` (top-1) x[t] * w[t, 0]
    is rounded to ``dtype`` (x's) and the sum is unweighted. ``quantize(row, stage)``: the values
    a row-wise activation format gives each GEMM's input (stage 1: x[t], stage 2: act(...)).
    Returns out [T, H]; with ``magnitude`` also ``sum_j |w| (|W2[e]| |a| + |b2[e]|)`` per element
    (the scale of its rounding error)."""
    x, w13, w2, weights = (np.asarray(a, np.float64) for a in (x, w13, w2, weights))
    ids = np.asarray(ids)
    t = ids.shape[0]
    h = w2.shape[1]
    b13 = None if b13 is None else np.asarray(b13, np.float64)
    b2 = None if b2 is None else np.asarray(b2, np.float64)
    out, mag = np.zeros((t, h)), np.zeros((t, h))
    with np.errstate(all="ignore"):
        if on_input:
            x = (x * weights[:, :1]).astype(dtype).astype(np.float64)
            weights = np.ones_like(weights)
        if quantize is not None and t:
            x = np.stack([quantize(row, 1) for row in x])
        for e in range(w2.shape[0]):  # each expert on its slots (rows never mix: NaN stays in its row)
            tt, jj = np.nonzero(ids == e)
            if not len(tt):
                continue
            hh = x[tt] @ w13[e].T + (0.0 if b13 is None else b13[e])
            a = np_activation(hh, activation, layout, alpha, limit)
            if quantize is not None:
                a = np.stack([quantize(row, 2) for row in a])
            y = a @ w2[e].T + (0.0 if b2 is None else b2[e])
            wj = weights[tt, jj][:, None]
            np.add.at(out, tt, wj * y)
            if magnitude:
                ab2 = 0.0 if b2 is None else np.abs(b2[e])
                np.add.at(mag, tt, np.abs(wj) * (np.abs(a) @ np.abs(w2[e]).T + ab2))
    return (out, mag) if magnitude else out


# ----------------------------------------------------------------------------- non-finite values

BAD_VALUES = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "overflow": "overflow"}


def poison_experts(w, experts: Sequence[int], bad, *, dtype=None) -> np.ndarray:
    """A numpy copy of ``w`` (experts on the first axis: weights [E, N, K] or biases [E, N]) with
    ``experts`` made bad. ``bad`` a float (NaN, inf, -inf): that value in the first, a middle and
    the last element of each (every tile edge; an infinity alternates its sign);
    ``"overflow"``: every value of those experts at a quarter of the largest finite value of
    ``dtype`` (default: w's; the dtype the weights will be cast to), with the original signs
    (their GEMMs overflow)."""
    w = np.array(w)
    if isinstance(bad, str):
        assert bad == "overflow", bad
        big = float(ml_dtypes.finfo(w.dtype if dtype is None else dtype).max) / 4
        for e in experts:
            w[e] = np.where(w[e] + 1e-3 >= 0, big, -big)
        return w
    for e in experts:
        shape = w[e].shape
        places = [tuple(0 for _ in shape), tuple((n // 2 + 3 + 2 * d) % n for d, n in enumerate(shape)),
                  tuple(n - 1 for n in shape)]
        for p in places:
            w[e][p] = -bad if (bad == np.inf and sum(p) % 2) else bad
    return w


def poison_memory(shapes) -> None:
    """Fill and free device buffers of the outputs' sizes (``shapes``: a pytree of
    ShapeDtypeStructs) with 0xFF bytes (NaN in bf16, f16, f32 and float8_e4m3fn), so that the
    allocator likely hands that memory to the next outputs: a kernel that leaves part of its
    output unwritten then shows NaN."""
    bufs = [jnp.full((max(1, s.size * s.dtype.itemsize),), 0xFF, jnp.uint8) for s in jax.tree.leaves(shapes)]
    jax.block_until_ready(bufs)
    for b in bufs:
        b.delete()


# ----------------------------------------------------------------------------- skips


def skip_unless_available(backend) -> None:
    """Skip (with the backend's own reason) where ``backend``'s custom calls cannot run here:
    ``backend`` a name of :data:`jax_moe.oracle.MODULES` or its module; ``xla`` always runs."""
    if backend == "xla":
        return
    if isinstance(backend, str):
        from jax_moe import oracle

        backend = oracle.module(backend)
    ok, why = backend.available()
    if not ok:
        pytest.skip(why)


def skip_unless_fi_scheme(name: str) -> None:
    """Skip unless FlashInfer's CUTLASS runner is usable here and scheme ``name`` is compiled into
    this build (the opt-in ones: JAX_MOE_FI_SCHEMES=...;name)."""
    from jax_moe.backends import flashinfer_cutlass as fic

    skip_unless_available(fic)
    if name not in fic.compiled_schemes():
        pytest.skip(f"{name} not compiled into this build (JAX_MOE_FI_SCHEMES=...;{name})")


def need_native(kind: str) -> None:
    """Skip unless jax_moe's own ``"cpu"`` or ``"cuda"`` FFI module is built and registered."""
    from jax_moe import ffi

    if not ffi.has_native(kind):
        pytest.skip(f"jax_moe {kind} module not available: {ffi.native_status()[kind]}")


def has_sm100() -> bool:
    """Whether JAX sees an SM100/SM103 GPU (compute capability 10.x)."""
    try:
        return any(d.platform == "gpu" and str(getattr(d, "compute_capability", "")).startswith("10.")
                   for d in jax.devices())
    except RuntimeError:
        return False


sm100 = pytest.mark.skipif(not has_sm100(), reason="needs an SM100/SM103 GPU (compute capability 10.x)")


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """A Mesh of the first prod(shape) CPU devices (conftest.py asks XLA for 8); skips if fewer."""
    from jax.sharding import Mesh

    devs = jax.devices("cpu")
    n = int(np.prod(shape))
    if len(devs) < n:
        pytest.skip(f"needs {n} CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(devs[:n]).reshape(shape), names)
