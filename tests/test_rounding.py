"""Roundings to a narrower float type hold under jit on every platform (a GPU's XLA folds a
chain of converts ``float32 -> narrow -> float32`` away unless told not to)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_moe.quant.fp8 import cast_to_fp8
from jax_moe.quant.rounding import cast_kept, round_to


def _values(rng, n=4096):
    """float32 values over many binades, ties included (odd multiples of half a bf16 step)."""
    v = rng.standard_normal(n).astype(np.float32) * np.exp2(rng.integers(-30, 30, n)).astype(np.float32)
    ties = (np.float32(1) + (2 * np.arange(64, dtype=np.float32) + 1) * np.float32(2.0 ** -8))
    return np.concatenate([v, ties, -ties]).astype(np.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_round_to_under_jit_is_the_narrow_types_nearest_value(rng, dtype):
    v = _values(rng)
    got = np.asarray(jax.jit(lambda a: round_to(a, dtype))(v))
    assert got.dtype == np.float32
    with np.errstate(over="ignore"):  # float16's range ends at 65504: beyond it, inf, as the cast gives
        want = v.astype(jnp.dtype(dtype)).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_a_quantize_then_dequantize_under_jit_rounds_to_fp8(rng):
    """cast_to_fp8 then astype(float32) in one jitted program: float8_e4m3fn's nearest values
    (ml_dtypes' cast of the clipped input), not the input."""
    v = np.clip(_values(rng) * np.float32(1e-6), -500, 500).astype(np.float32)
    got = np.asarray(jax.jit(lambda a: cast_to_fp8(a).astype(jnp.float32))(v))
    want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert (got != v).any()


def test_cast_kept_is_a_cast_that_batches_and_differentiates(rng):
    v = jnp.asarray(_values(rng, 30)[:30].reshape(5, 6))
    got = jax.vmap(lambda a: cast_kept(a, jnp.bfloat16))(v)
    assert got.dtype == jnp.bfloat16 and got.shape == (5, 6)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(v.astype(jnp.bfloat16), np.float32))
    g = jax.grad(lambda a: jnp.sum(cast_kept(a, jnp.bfloat16).astype(jnp.float32)))(v)
    np.testing.assert_array_equal(np.asarray(g), np.ones((5, 6), np.float32))
