"""Roundings to a narrower float type that every XLA platform keeps.

With its default ``--xla_allow_excess_precision=true``, XLA's GPU compiler simplifies a chain of
floating-point converts to its two ends: ``float32 -> bfloat16 -> float32`` and
``float32 -> float8_e4m3fn -> float32`` become the identity. A quantize-then-dequantize written
as two ``astype`` therefore rounds on the CPU and does not round on a GPU: the pure-JAX backend
would skip its activation quantization there, and a scale derived from a rounded one would
not match the rounded value that is stored. The two functions below round on every platform:

- :func:`upcast_kept`: a narrow array's values in a wider type, read through an
  ``optimization_barrier`` so that the convert which produced them (a quantization) is kept.
  Dequantizations use it; a quantization that feeds a kernel stays a plain, fusible cast.
- :func:`round_to`: the float32 values of ``v`` rounded to ``dtype``'s (nearest, ties to even).
  For bfloat16 that is ``lax.reduce_precision``, which no simplifier removes and which fuses;
  for another narrower type, a cast and :func:`upcast_kept`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["round_to", "upcast_kept"]


def upcast_kept(q, dtype=jnp.float32) -> jax.Array:
    """``q.astype(dtype)`` (same shape) that keeps the rounding which produced ``q``."""
    return jax.lax.optimization_barrier(jnp.asarray(q)).astype(dtype)


def round_to(v, dtype) -> jax.Array:
    """float32 ``v`` [...] rounded to ``dtype``'s values: [...] float32 (``v`` itself for float32;
    bfloat16 has float32's 8 exponent bits and 7 of its 23 mantissa bits)."""
    v = jnp.asarray(v, jnp.float32)
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32:
        return v
    if dtype == jnp.bfloat16:
        return jax.lax.reduce_precision(v, exponent_bits=8, mantissa_bits=7)
    return upcast_kept(v.astype(dtype))
