"""FP8 E4M3 (``jnp.float8_e4m3fn``, finite max 448): quantize and dequantize in pure jnp.

Every scale here is a *dequantization* scale, float32: ``x ~= float32(q) * scale``. Over the
scale's group,

    scale = amax * RCP_448               (RCP_448 = float32(1) / float32(448))
    q     = float8_e4m3fn(clip(x * (1 / scale), -448, 448))

The cast rounds to nearest, ties to even; the clip comes first because float8_e4m3fn has no
infinity (XLA turns an out-of-range value into NaN). A group whose amax is 0 gets the smallest
normal float32 as its scale instead of 0, so ``x * (1 / scale)`` is ``0`` and never NaN.

Why multiplications by reciprocals, not divisions: XLA's algebraic simplifier rewrites
``a / broadcast(b)`` into ``a * broadcast(1 / b)`` (and ``a / constant`` likewise), so a written
division gives results that depend on how the operands happen to be broadcast. Writing the
reciprocal explicitly makes every bit reproducible (eager, jit, CPU, GPU); it is also what the
vLLM/FlashInfer quantization kernels do (they multiply by an inverted scale). ``amax * RCP_448``
is within one float32 ulp of ``amax / 448``.

Granularities (K, the GEMM reduction axis, is always the last axis):

======================  ===================  ============================================
function                x                    scale
======================  ===================  ============================================
per_tensor              [...]                [] float32
per_expert              [E, ...]             [E] float32
per_token (activations) [..., K]             [..., 1] float32
per_channel (weights)   [E, N, K]            [E, N, 1] float32
block (weights)         [E, N, K]            [E, ceil(N/bn), ceil(K/bk)] float32, (bn, bk) = (128, 128)
per_token_group         [T, K]               [T, ceil(K/g)] float32, g = 128 (DeepSeek FP8)
static                  [...]                given (vLLM's static input scales)
======================  ===================  ============================================

Blocks and groups that run past the end of N or K are partial: their scale is the amax of the
elements that exist.

Non-finite values (the rule of :mod:`jax_moe.quant`): every amax above is taken over the
*finite* elements only (:func:`finite_absmax`), so a NaN or an infinity never changes how the
other elements of its tensor, token or block are quantized; the non-finite element itself
becomes NaN (E4M3 has a NaN, 0x7F, but no infinity; an infinity is never saturated to 448).
A finite value beyond ``448 * scale`` (a static scale) still saturates to +-448.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.quant.rounding import upcast_kept

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
# The scale given to an all-zero group: positive and normal, so x / scale is 0, never NaN.
MIN_SCALE = float(np.finfo(np.float32).tiny)
RCP_448 = np.float32(1) / np.float32(FP8_MAX)

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_SCALE",
    "RCP_448",
    "reciprocal",
    "finite_absmax",
    "nonfinite_to_nan",
    "amax_to_scale",
    "cast_to_fp8",
    "expand_prefix",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_expert",
    "quantize_fp8_per_token",
    "quantize_fp8_per_channel",
    "quantize_fp8_block",
    "quantize_fp8_per_token_group",
    "quantize_fp8_static",
    "dequantize_fp8",
    "dequantize_fp8_block",
    "dequantize_fp8_per_token_group",
]


def amax_to_scale(amax, qmax: float = FP8_MAX):
    """``amax * (float32(1) / float32(qmax))`` as float32 (see the module note on reciprocals),
    with a zero (or subnormal-tiny) amax mapped to ``MIN_SCALE``."""
    amax = jnp.asarray(amax, jnp.float32)
    rcp = np.float32(1) / np.float32(qmax)
    return jnp.maximum(amax * rcp, jnp.float32(MIN_SCALE))


def reciprocal(scale):
    """``1 / scale`` in float32, computed on the scale's own shape (before any broadcast)."""
    return jnp.float32(1) / jnp.asarray(scale, jnp.float32)


def cast_to_fp8(v):
    """float32 ``v`` (already divided by its scale) -> float8_e4m3fn, saturating at +-448."""
    return jnp.clip(jnp.asarray(v, jnp.float32), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)


def expand_prefix(s, ndim: int):
    """Give a scale that indexes the *leading* axes of an ``ndim``-rank tensor ([] , [E], [T], ...)
    trailing singleton axes so it broadcasts against that tensor. A scale of rank ``ndim`` is
    returned as it is (it already broadcasts axis by axis)."""
    s = jnp.asarray(s, jnp.float32)
    if s.ndim > ndim:
        raise ValueError(f"scale of shape {list(s.shape)} has more axes than the tensor (rank {ndim})")
    return s.reshape(s.shape + (1,) * (ndim - s.ndim))


def finite_absmax(x, axis=None, keepdims=False):
    """``max |x|`` over the finite elements of ``x`` (float32; 0 where there are none, an empty
    tensor included): the amax of every scale in :mod:`jax_moe.quant`, so that a NaN or an
    infinity never moves the scale its finite neighbours are quantized with."""
    a = jnp.abs(jnp.asarray(x, jnp.float32))
    return jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=axis, keepdims=keepdims, initial=0.0)


def nonfinite_to_nan(x):
    """float32 ``x`` with +-inf replaced by NaN (no format here holds an infinity, and saturating
    one would turn an overflow into a plausible finite value); NaN stays NaN."""
    x = jnp.asarray(x, jnp.float32)
    return jnp.where(jnp.isinf(x), jnp.float32(jnp.nan), x)


_absmax = finite_absmax


@jax.jit
def quantize_fp8_static(x, scale):
    """Quantize with a given scale (vLLM's static per-tensor input scale).

    x [...] float; scale [] float32, or any shape that indexes x's leading axes ([E] for
    x [E, ...], [T] for x [T, K]), or x's rank with singleton axes. Returns q, x's shape,
    float8_e4m3fn. Finite values beyond ``448 * scale`` saturate to +-448; NaN and +-inf give NaN.
    """
    x = nonfinite_to_nan(x)
    return cast_to_fp8(x * reciprocal(expand_prefix(scale, x.ndim)))


@jax.jit
def quantize_fp8_per_tensor(x):
    """One scale for the whole tensor. x [...] float -> (q [...] float8_e4m3fn, scale [] float32)."""
    scale = amax_to_scale(_absmax(x))
    return quantize_fp8_static(x, scale), scale


@jax.jit
def quantize_fp8_per_expert(w):
    """One scale per leading-axis slice (per expert for weights).

    w [E, ...] float -> (q [E, ...] float8_e4m3fn, scale [E] float32).
    """
    w = jnp.asarray(w, jnp.float32)
    scale = amax_to_scale(_absmax(w.reshape(w.shape[0], -1), axis=1))
    return quantize_fp8_static(w, scale), scale


@jax.jit
def quantize_fp8_per_token(x):
    """One scale per row (dynamic per-token activations).

    x [..., K] float -> (q [..., K] float8_e4m3fn, scale [..., 1] float32).
    """
    x = nonfinite_to_nan(x)
    scale = amax_to_scale(_absmax(x, axis=-1, keepdims=True))
    return cast_to_fp8(x * reciprocal(scale)), scale


def quantize_fp8_per_channel(w):
    """One scale per output channel (row N) of each expert.

    w [E, N, K] float -> (q [E, N, K] float8_e4m3fn, scale [E, N, 1] float32).
    """
    return quantize_fp8_per_token(w)


def _pad_to(x, axis: int, multiple: int):
    size = x.shape[axis]
    pad = (-size) % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _check_block(name: str, block) -> tuple[int, ...]:
    block = tuple(int(b) for b in block)
    if any(b < 1 for b in block):
        raise ValueError(f"{name} must be positive, got {block}")
    return block


def quantize_fp8_block(w, block_shape=(128, 128)):
    """2-D block scales over the last two axes (DeepSeek-V3 FP8 weights).

    w [..., N, K] float (typically [E, N, K]) -> (q [..., N, K] float8_e4m3fn,
    scale [..., ceil(N/bn), ceil(K/bk)] float32), ``(bn, bk) = block_shape``. Edge blocks are
    partial when bn does not divide N or bk does not divide K.
    """
    return _quantize_fp8_block(w, _check_block("block_shape", block_shape))


@functools.partial(jax.jit, static_argnames=("block_shape",))
def _quantize_fp8_block(w, block_shape):
    bn, bk = block_shape
    w = nonfinite_to_nan(w)
    if w.ndim < 2:
        raise ValueError(f"w must have rank >= 2 ([..., N, K]), got shape {list(w.shape)}")
    n, k = w.shape[-2:]
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    wp = _pad_to(_pad_to(w, -2, bn), -1, bk)  # zero padding never raises an amax
    blocks = wp.reshape(w.shape[:-2] + (nb, bn, kb, bk))
    scale = amax_to_scale(_absmax(blocks, axis=(-3, -1)))  # [..., nb, kb]
    q = cast_to_fp8(w * _expand_blocks(reciprocal(scale), (bn, bk), (n, k)))
    return q, scale


def _expand_blocks(scale, block_shape, nk):
    """[..., nb, kb] block scales -> [..., N, K] (each repeated over its block, edges cut)."""
    bn, bk = block_shape
    n, k = nk
    s = jnp.repeat(jnp.repeat(scale, bn, axis=-2), bk, axis=-1)
    return s[..., :n, :k]


def quantize_fp8_per_token_group(x, group_size: int = 128):
    """1 x ``group_size`` groups along K (DeepSeek-V3 FP8 activations, dynamic).

    x [..., K] float (typically [T, K]) -> (q [..., K] float8_e4m3fn,
    scale [..., ceil(K/g)] float32). The last group is partial when g does not divide K.
    """
    (g,) = _check_block("group_size", (group_size,))
    return _quantize_fp8_per_token_group(x, g)


@functools.partial(jax.jit, static_argnames=("g",))
def _quantize_fp8_per_token_group(x, g):
    x = nonfinite_to_nan(x)
    k = x.shape[-1]
    kb = math.ceil(k / g)
    groups = _pad_to(x, -1, g).reshape(x.shape[:-1] + (kb, g))
    scale = amax_to_scale(_absmax(groups, axis=-1))
    q = cast_to_fp8(x * jnp.repeat(reciprocal(scale), g, axis=-1)[..., :k])
    return q, scale


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_fp8(q, scale, dtype=jnp.float32):
    """``float32(q) * scale`` for per-tensor, per-expert, per-token and per-channel scales.

    q [...] float8_e4m3fn; scale [] / [E] (indexes q's leading axes) / q's rank with
    singleton axes ([T, 1], [E, N, 1]). Returns q's shape in ``dtype``.
    """
    qf = upcast_kept(q)  # q may have been quantized in this program: keep its rounding
    return (qf * expand_prefix(scale, qf.ndim)).astype(dtype)


def dequantize_fp8_block(q, scale, block_shape=(128, 128), dtype=jnp.float32):
    """Inverse of :func:`quantize_fp8_block`: q [..., N, K] float8_e4m3fn,
    scale [..., ceil(N/bn), ceil(K/bk)] float32 -> [..., N, K] ``dtype``."""
    return _dequantize_fp8_block(q, scale, _check_block("block_shape", block_shape), dtype)


@functools.partial(jax.jit, static_argnames=("block_shape", "dtype"))
def _dequantize_fp8_block(q, scale, block_shape, dtype):
    bn, bk = block_shape
    qf = upcast_kept(q)  # q may have been quantized in this program: keep its rounding
    n, k = qf.shape[-2:]
    want = (math.ceil(n / bn), math.ceil(k / bk))
    if tuple(scale.shape[-2:]) != want:
        raise ValueError(
            f"scale must end in [ceil(N/{bn}), ceil(K/{bk})] = {list(want)} for q of shape "
            f"{list(qf.shape)}, got {list(scale.shape)}"
        )
    return (qf * _expand_blocks(jnp.asarray(scale, jnp.float32), (bn, bk), (n, k))).astype(dtype)


def dequantize_fp8_per_token_group(q, scale, group_size: int = 128, dtype=jnp.float32):
    """Inverse of :func:`quantize_fp8_per_token_group`: q [..., K] float8_e4m3fn,
    scale [..., ceil(K/g)] float32 -> [..., K] ``dtype``."""
    (g,) = _check_block("group_size", (group_size,))
    return _dequantize_fp8_per_token_group(q, scale, g, dtype)


@functools.partial(jax.jit, static_argnames=("g", "dtype"))
def _dequantize_fp8_per_token_group(q, scale, g, dtype):
    qf = upcast_kept(q)  # q may have been quantized in this program: keep its rounding
    k = qf.shape[-1]
    if scale.shape[-1] != math.ceil(k / g):
        raise ValueError(f"scale must end in ceil(K/{g}) = {math.ceil(k / g)}, got {list(scale.shape)}")
    s = jnp.repeat(jnp.asarray(scale, jnp.float32), g, axis=-1)[..., :k]
    return (qf * s).astype(dtype)
