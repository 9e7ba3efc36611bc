"""Signed int4, symmetric, groupwise along K (the W4A8 weight format: group 128).

Per group of ``g`` consecutive elements of the last axis K:

    scale = amax(group) * (float32(1) / float32(7))   float32 (an all-zero group gets the
                                                      smallest normal float32)
    q     = clip(round_half_to_even(x * (1 / scale)), -8, 7)   int4

(reciprocals written out, as in :mod:`jax_moe.quant.fp8`, for bit-reproducible results).
int4 holds no NaN: a group holding a NaN or an infinity gets a NaN scale (its elements are
stored as 0), so the whole group dequantizes to NaN; the amax is otherwise taken over finite
values (the :mod:`jax_moe.quant` rule).
``|x / scale| <= 7`` up to rounding, so -8 appears only with a caller-supplied smaller scale.
Packing: two's-complement nibbles, two per uint8 along K; element ``2i`` in the LOW nibble,
element ``2i+1`` in the HIGH nibble. ``[..., K]`` -> ``[..., K/2]`` uint8.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.quant.fp8 import amax_to_scale, finite_absmax, reciprocal

INT4_MIN = -8
INT4_MAX = 7
INT4_GROUP = 128

__all__ = [
    "INT4_MIN",
    "INT4_MAX",
    "INT4_GROUP",
    "pack_int4",
    "unpack_int4",
    "quantize_int4",
    "dequantize_int4",
]


@jax.jit
def pack_int4(q):
    """int values [..., K] in [-8, 7] (any int dtype) -> [..., K/2] uint8, two's-complement nibbles,
    element 2i low, 2i+1 high."""
    q = jnp.asarray(q)
    if q.ndim == 0 or q.shape[-1] % 2:
        raise ValueError(f"q: the last axis must have even length to pack, got shape {list(q.shape)}")
    nib = (q.astype(jnp.int32) & 0xF).astype(jnp.uint8)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


@jax.jit
def unpack_int4(packed):
    """[..., K/2] uint8 -> [..., K] int8 in [-8, 7] (inverse of :func:`pack_int4`)."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed must be uint8, got {np.dtype(packed.dtype).name}")
    nib = jnp.stack([packed & 0xF, packed >> 4], axis=-1).astype(jnp.int8)
    signed = jnp.where(nib >= 8, nib - 16, nib).astype(jnp.int8)
    return signed.reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


def _check_group(name: str, k, group_size: int) -> None:
    if group_size < 1 or group_size % 2:
        raise ValueError(f"group_size must be a positive even int, got {group_size}")
    if k % group_size:
        raise ValueError(f"{name}: the last axis K={k} must be a multiple of group_size={group_size}")


@functools.partial(jax.jit, static_argnames=("group_size",))
def quantize_int4(w, group_size: int = INT4_GROUP):
    """w [..., K] float, K % group_size == 0 -> (packed [..., K/2] uint8, scale [..., K/g] float32).
    A group holding NaN or inf gets a NaN scale (it dequantizes to NaN)."""
    w = jnp.asarray(w, jnp.float32)
    k = w.shape[-1] if w.ndim else 0
    _check_group("w", k, group_size)
    groups = w.reshape(w.shape[:-1] + (k // group_size, group_size))
    finite = jnp.isfinite(groups)
    scale = amax_to_scale(finite_absmax(groups, axis=-1), float(INT4_MAX))
    q = jnp.clip(jnp.round(groups * reciprocal(scale)[..., None]), INT4_MIN, INT4_MAX)  # jnp.round: half to even
    q = jnp.where(finite, q, 0.0)
    scale = jnp.where(jnp.all(finite, axis=-1), scale, jnp.float32(jnp.nan))
    return pack_int4(q.astype(jnp.int8).reshape(w.shape)), scale


@functools.partial(jax.jit, static_argnames=("group_size", "dtype"))
def dequantize_int4(packed, scale, group_size: int = INT4_GROUP, dtype=jnp.float32):
    """Inverse of :func:`quantize_int4`: packed [..., K/2] uint8, scale [..., K/g] float32 -> [..., K]."""
    q = unpack_int4(packed).astype(jnp.float32)
    k = q.shape[-1]
    _check_group("packed (unpacked)", k, group_size)
    if scale.shape[-1] != k // group_size:
        raise ValueError(f"scale must end in K/{group_size} = {k // group_size}, got {list(scale.shape)}")
    s = jnp.asarray(scale, jnp.float32)
    out = q.reshape(q.shape[:-1] + (k // group_size, group_size)) * s[..., None]
    return out.reshape(q.shape).astype(dtype)
