"""Cases the layout test files share (test_layouts.py, test_layouts_rules.py): dtypes, random arrays
of each, and loop references of the permutations written from the documented words."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

DTYPES = ["float32", "bfloat16", "float8_e4m3fn", "uint8"]


# ------------------------------------------------------------------ helpers
def make(rng, shape, dtype="float32"):
    """Random, never-zero data of ``dtype`` (uint8 in 1..255; floats +-[0.5, 4))."""
    if dtype == "uint8":
        return jnp.asarray(rng.integers(1, 256, size=shape, dtype=np.uint8))
    v = rng.uniform(0.5, 4.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    return jnp.asarray(v.astype(np.float32)).astype(jnp.dtype(dtype))


def bits(a):
    """Raw bytes of an array (bitwise comparison for float8 / bf16 / uint8 alike)."""
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(np.uint8).reshape(a.shape + (-1,))


def assert_bits_equal(a, b):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    assert np.asarray(a).shape == np.asarray(b).shape
    np.testing.assert_array_equal(bits(a), bits(b))


def rows_ref(x, src_of_dst, axis=-2):
    """Reference row permutation by a python loop: out[r] = x[src_of_dst(r)] along ``axis``."""
    x = np.asarray(x)
    xm = np.moveaxis(x, axis, 0)
    out = np.empty_like(xm)
    for r in range(xm.shape[0]):
        out[r] = xm[src_of_dst(r)]
    return np.moveaxis(out, 0, axis)


def roundup(x, m):
    return -(-x // m) * m


def interleave_ref(sf):
    """The 128x4 layout from its documented words: pad to (128, 4) multiples with zeros, and place
    sf[m, k] at flat ((m//128)*(Kp/4) + k//4)*512 + (m%32)*16 + ((m%128)//32)*4 + k%4."""
    sf = np.asarray(sf)
    m_, k_ = sf.shape
    mp, kp = roundup(m_, 128), roundup(k_, 4)
    flat = np.zeros(mp * kp, sf.dtype)
    for m in range(m_):
        for k in range(k_):
            off = ((m // 128) * (kp // 4) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4
            flat[off] = sf[m, k]
    return flat.reshape(mp // 128, kp // 4, 32, 4, 4)


def shuffle_ref(x, tile=128, axis=-2):
    """shuffle_matrix_a from its documented words: blocks of B = 32 (tile % 128 == 0) else 16;
    source offset (B/8)*a + b goes to 8*b + a."""
    bsz = 32 if tile % 128 == 0 else 16
    g = bsz // 8
    dst_to_src = {}
    n = np.asarray(x).shape[axis]
    for blk in range(n // bsz):
        for a in range(8):
            for b in range(g):
                dst_to_src[blk * bsz + 8 * b + a] = blk * bsz + g * a + b
    return rows_ref(x, dst_to_src.__getitem__, axis)
