"""Cases the jax_moe.kernels test files share (test_moe_kernels.py, test_moe_kernels_gpu.py): shapes,
random data, and independent numpy definitions of the row kernels."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import ffi, kernels
from jax_moe.permute import sort_by_expert
from helpers import np_activation, random_routing

FP8 = jnp.float8_e4m3fn
TINY = np.float32(np.finfo(np.float32).tiny)

# (T, k, E, H, I): T=1, T not a multiple of anything, an odd number of rows (T*k = 3: the row kernels
# run four rows per block), E=256/k=8, H and I not multiples of 8 (scalar path), DeepSeek-V3-like rows
# (7168 columns: several vector batches per lane).
SHAPES = [(3, 1, 4, 128, 64), (1, 8, 256, 256, 128), (37, 2, 8, 203, 77), (300, 8, 256, 512, 256),
          (999, 4, 64, 1024, 384), (256, 8, 256, 7168, 512)]
MINUS_ONE = 0.2  # with minus_one: the fraction of ids set to -1 (slots of experts on other devices)
CPU_SHAPES = [pytest.param(1, 1, 4, 16, 8, marks=pytest.mark.slow), (1, 8, 256, 32, 16), (37, 2, 8, 24, 7),
              pytest.param(129, 8, 256, 64, 40, marks=pytest.mark.slow)]


# ---------------------------------------------------------------- data


def normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def poison_rows(a, start: int):
    """NaN in every row at or past ``start`` (what a GEMM may leave in rows it never wrote)."""
    return a.at[start:].set(jnp.nan)


# ---------------------------------------------------------------- numpy definitions


def np_fp8_static(v, scale):
    inv = np.float32(1) / np.float32(scale)
    return np.clip(np.asarray(v, np.float32) * inv, -448, 448).astype(FP8).astype(np.float32)


def np_permute(x, slots, k, valid):
    x, slots = np.asarray(x), np.asarray(slots)
    out = np.zeros((slots.shape[0], x.shape[1]), x.dtype)
    for r, s in enumerate(slots):
        if r < valid:
            out[r] = x[s // k]
    return out


def np_act(h, activation, valid, layout="concat", bias=None, offsets=None, alpha=1.702, limit=7.0):
    """act_and_mul's definition in float64: the gated activation of each row (plus the bias of the
    row's expert, the e with offsets[e] <= r < offsets[e+1]), rows at or past ``valid`` zero."""
    h = np.array(h, np.float64)
    if bias is not None:
        h = h + np.asarray(bias, np.float64)[np_expert_of_rows(offsets, h.shape[0])]
    a = np_activation(h, activation, layout, alpha, limit)
    a[valid:] = 0.0
    return a


def np_expert_of_rows(offsets, rows):
    """Row r's expert: the e with offsets[e] <= r < offsets[e+1] (a loop over the experts); rows
    outside every expert get expert 0 (their values are never used)."""
    offsets = np.asarray(offsets)
    out = np.zeros(rows, np.int64)
    for e in range(len(offsets) - 1):
        out[offsets[e]:offsets[e + 1]] = e
    return out


def np_unpermute(y, inverse, w, valid, plain, bias=None, offsets=None):
    y, inverse, w = np.asarray(y, np.float64), np.asarray(inverse), np.asarray(w, np.float64)
    t, k = w.shape
    expert = None if bias is None else np_expert_of_rows(offsets, y.shape[0])
    out = np.zeros((t, y.shape[1]))
    for s in range(t * k):
        row = inverse[s]
        if 0 <= row < valid:
            b = 0.0 if bias is None else np.asarray(bias, np.float64)[expert[row]]
            out[s // k] += (1.0 if plain else w[s // k, s % k]) * (y[row] + b)
    return out


def dequant(q, s):
    """float32 values of FP8 rows with per-row (or one) scales (jnp: traceable under vmap/jit)."""
    s = jnp.asarray(s, jnp.float32)
    return jnp.asarray(q).astype(jnp.float32) * (s[:, None] if s.ndim else s)


def permute_three_ways(permute, x, sorted_slots, k, valid, **slot_order):
    """permute_rows (or its reference) without quantization, with FP8 per token and FP8 static
    (scale 0.004): [rows, (q, scales), (q, scale)]."""
    args = (x, sorted_slots, k)
    return [permute(*args, valid_rows=valid, **slot_order),
            permute(*args, valid_rows=valid, quant="fp8_per_token", **slot_order),
            permute(*args, valid_rows=valid, quant="fp8_static", scale=0.004, **slot_order)]


def assert_same_bytes(got, want):
    """Equal pytrees of arrays, compared byte for byte (a NaN equals nothing, not even a NaN)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.atleast_1d(np.asarray(g)), np.atleast_1d(np.asarray(w))
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


def grouped_gemm(rows, w, offsets):
    """rows [M, K] @ w[expert of row].T in float32; rows past offsets[E] get expert 0 (unused)."""
    e = w.shape[0]
    expert = jnp.clip(jnp.searchsorted(offsets, jnp.arange(rows.shape[0]), side="right") - 1, 0, e - 1)
    return jnp.einsum("mk,mnk->mn", rows.astype(jnp.float32), w[expert].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def pipeline(x, w13, w2, w, ids, activation, quant=None, layout="concat", b13=None, b2=None):
    """The kernels chained with a jnp grouped GEMM, as a CUTLASS backend will chain them (with
    ``b13``/``b2``: the expert biases through act_and_mul and unpermute_reduce)."""
    t, k = ids.shape
    sort = ffi_or_jnp_sort(ids, w13.shape[0])
    valid = sort.offsets[-1]
    a1 = kernels.permute_rows(x, sort.sorted_slots, k, valid_rows=valid, quant=quant)
    a1 = dequant(*a1) if quant else a1
    h1 = grouped_gemm(jnp.asarray(a1), w13, sort.offsets)
    bias13 = {} if b13 is None else dict(bias=b13, offsets=sort.offsets)
    a2 = kernels.act_and_mul(h1, activation, valid_rows=valid, quant=quant, layout=layout, **bias13)
    a2 = dequant(*a2) if quant else a2
    y = grouped_gemm(jnp.asarray(a2), w2, sort.offsets).astype(x.dtype)
    bias2 = {} if b2 is None else dict(bias=b2, offsets=sort.offsets)
    return kernels.unpermute_reduce(y, sort.inverse, w, valid_rows=valid, **bias2)


def ffi_or_jnp_sort(ids, e):
    return ffi.sort_by_expert(ids, e) if ffi.has_native("cuda") else sort_by_expert(ids, e)


def gptoss_case(rng, t=29, k=4, e=8, h=32, i=16):
    w, ids = random_routing(rng, t, e, k, experts=range(1, e), minus_one=MINUS_ONE)
    x = normal(rng, (t, h), jnp.float32)
    w13 = normal(rng, (e, 2 * i, h), jnp.float32, 1 / math.sqrt(h))
    w2 = normal(rng, (e, h, i), jnp.float32, 1 / math.sqrt(i))
    return x, w13, w2, w, ids, normal(rng, (e, 2 * i), jnp.float32), normal(rng, (e, h), jnp.float32)
