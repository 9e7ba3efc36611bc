"""Cases the quantization test files share (test_quant.py, test_quant_scheme.py): random data, E4M3
and E2M1 facts, the half-ulp FP8 bound, and an E2M1 encoder written from the spec."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E2M1_MAGS = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def f32(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def fp8_elementwise_ok(x, deq, scale):
    """|deq - x| <= max(2**-4 |x|, 2**-10 * scale) (half an E4M3 ulp), with float32 slack."""
    x, deq, scale = np.asarray(x, np.float64), np.asarray(deq, np.float64), np.asarray(scale, np.float64)
    bound = np.maximum(2.0**-4 * np.abs(x), 2.0**-10 * scale) * (1 + 1e-6) + 1e-30
    return bool(np.all(np.abs(deq - x) <= bound))


def e2m1_reference(x):
    """Independent E2M1 encoder from the spec: nearest magnitude, ties to the even code,
    saturate at 6, sign bit from the sign of x."""
    x = np.asarray(x, np.float64).ravel()
    out = np.empty(x.shape, np.uint8)
    for i, v in enumerate(x):
        mag = min(abs(v), 6.0)
        d = np.abs(E2M1_MAGS - mag)
        best = np.flatnonzero(d == d.min())
        code = best[0] if len(best) == 1 else [c for c in best if c % 2 == 0][0]
        out[i] = code | (8 if np.signbit(v) else 0)
    return out
