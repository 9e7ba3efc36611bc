"""4-bit float (E2M1) and the block-scaled formats built on it: NVFP4, MXFP4, and MXFP8.

E2M1 codec
----------
A code is 4 bits ``s e1 e0 m``. Magnitude codes 0..7 are the values
``0, 0.5, 1, 1.5, 2, 3, 4, 6``; bit 3 is the sign (code 8 is -0). Encoding rounds ``|x|`` to the
nearest representable magnitude; a tie between two neighbours goes to the *even* code (the one
whose mantissa bit ``m`` is 0), which is IEEE round-half-to-even on this format:
0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. Magnitudes above 6
saturate to 6 (there is no inf or NaN). The sign bit is the sign of ``x``, so a small negative
``x`` becomes code 8 (-0), which decodes to 0.

Packing: two codes per uint8 along the last axis K; element ``2i`` in the LOW nibble (bits 0-3),
element ``2i+1`` in the HIGH nibble (bits 4-7). ``[..., K]`` codes -> ``[..., K/2]`` uint8.

NVFP4 (block 16 along K)
------------------------
* global scale, float32: ``g = 448 * 6 / amax(tensor)`` (per expert for weights, [E]); a
  *quantization-side* scale (vLLM's checkpoint ``weight_scale_2`` / ``input_scale`` is ``1 / g``).
* block scale, stored float8_e4m3fn: ``s = e4m3((amax(block) * RCP_6) * g)`` (saturating at
  448), ``RCP_6 = float32(1) / float32(6)``.
* elements: ``e2m1(x * (g / float(s)))`` (one IEEE division per block); a block whose stored
  ``s`` is 0 encodes zeros.
* a block holding a NaN or an infinity (E2M1 has neither) gets the E4M3 NaN (0x7F) as its
  stored ``s``, so all 16 of its elements dequantize to NaN; the global scale's amax and the
  other blocks' amaxes are taken over finite values only (the :mod:`jax_moe.quant` rule).
* dequant: ``(e2m1 * float(s)) * (1 / g)``  (``e2m1 * float(s)`` is exact in float32).

Reciprocals are written out instead of divisions by a broadcast operand (XLA would rewrite
those into reciprocal multiplications anyway; see :mod:`jax_moe.quant.fp8`), so each result
is within an ulp of the textbook formula and bit-reproducible.

MXFP4 (OCP MX, block 32 along K)
--------------------------------
* shared exponent ``e = clamp(floor(log2(amax(block))) - 2, -127, 127)`` (2 is E2M1's emax),
  stored as an E8M0 byte ``e + 127`` (uint8; value ``2**(byte - 127)``). An all-zero block gets
  ``e = -127`` (byte 0).
* a block holding a NaN or an infinity (E2M1 has neither) gets the byte 0xFF, the E8M0 NaN, so
  all 32 of its elements dequantize to NaN (never zeros, never an Inf among zeros); its element
  codes are those of the finite values (the non-finite ones encode 0).
* elements: ``e2m1(x / 2**e)`` with saturation to +-6; dequant ``e2m1 * 2**e``.

MXFP8 (OCP MX, block 32 along K; activations)
---------------------------------------------
As MXFP4 with E4M3 elements (emax 8): ``e = clamp(floor(log2(amax)) - 8, -127, 127)``, elements
``float8_e4m3fn(clip(x / 2**e, -448, 448))``. E4M3 elements hold NaN: a NaN or an infinity becomes a NaN
element, and the block's scale comes from its finite values (the byte is never 0xFF).

K must be a multiple of the block (16 or 32); a ValueError names the argument otherwise.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.quant.fp8 import FP8_DTYPE, FP8_MAX, cast_to_fp8, expand_prefix, finite_absmax, nonfinite_to_nan, reciprocal
from jax_moe.quant.rounding import upcast_kept

E2M1_MAX = 6.0
RCP_6 = np.float32(1) / np.float32(E2M1_MAX)
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)  # indexed by code
NVFP4_BLOCK = 16
MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF  # the E8M0 NaN: the scale of an MXFP4 block that held NaN or inf
E2M1_EMAX = 2
E4M3_EMAX = 8
# Smallest amax used for a global scale, so 448 * 6 / amax stays finite.
_MIN_GLOBAL_AMAX = 1e-30

# Midpoints between consecutive magnitudes, and whether a tie there rounds up (the upper code
# is the even one) or stays down.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E8M0_NAN",
    "NVFP4_BLOCK",
    "MX_BLOCK",
    "e2m1_encode",
    "e2m1_decode",
    "pack_fp4",
    "unpack_fp4",
    "nvfp4_global_scale",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "e8m0_exponent",
    "e8m0_to_float",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "quantize_mxfp8",
    "dequantize_mxfp8",
]


def _check_k(name: str, x, block: int, what: str) -> None:
    k = x.shape[-1] if getattr(x, "ndim", 0) else None
    if k is None or k % block:
        raise ValueError(f"{name}: the last axis K={k} must be a multiple of the {what} block {block} "
                         f"(shape {list(getattr(x, 'shape', ()))})")


# ----------------------------------------------------------------------------- E2M1 codec


@jax.jit
def e2m1_encode(x):
    """float [...] -> E2M1 codes [...] uint8 in [0, 16): nearest value, ties to the even code,
    saturating at +-6, sign bit from ``x``'s sign (a NaN encodes as a zero)."""
    x = jnp.asarray(x, jnp.float32)
    mag = jnp.abs(x)
    code = jnp.zeros(x.shape, jnp.uint8)
    for mid, tie_up in _MIDPOINTS:
        past = mag >= mid if tie_up else mag > mid
        code = code + past.astype(jnp.uint8)
    sign = jnp.signbit(x).astype(jnp.uint8) << 3
    return code | sign


@functools.partial(jax.jit, static_argnames=("dtype",))
def e2m1_decode(codes, dtype=jnp.float32):
    """E2M1 codes [...] (any int dtype, values in [0, 16)) -> values [...] ``dtype``."""
    table = jnp.asarray(E2M1_VALUES)
    return table[jnp.asarray(codes).astype(jnp.int32) & 0xF].astype(dtype)


@jax.jit
def pack_fp4(codes):
    """Codes [..., K] (uint8, < 16) -> [..., K/2] uint8: element 2i low nibble, 2i+1 high nibble."""
    codes = jnp.asarray(codes).astype(jnp.uint8)
    if codes.ndim == 0 or codes.shape[-1] % 2:
        raise ValueError(f"codes: the last axis must have even length to pack, got shape {list(codes.shape)}")
    lo = codes[..., 0::2] & 0xF
    hi = codes[..., 1::2] & 0xF
    return lo | (hi << 4)


@jax.jit
def unpack_fp4(packed):
    """[..., K/2] uint8 -> codes [..., K] uint8 (inverse of :func:`pack_fp4`)."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise ValueError(f"packed must be uint8, got {np.dtype(packed.dtype).name}")
    lo = packed & 0xF
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[:-1] + (2 * packed.shape[-1],))


# ----------------------------------------------------------------------------- NVFP4


@functools.partial(jax.jit, static_argnames=("per_expert",))
def nvfp4_global_scale(x, per_expert: bool = False):
    """``448 * 6 / amax`` as float32: x [...] -> [] (per tensor) or x [E, ...] -> [E] (per expert).
    An all-zero tensor gets a large finite scale (amax is floored at 1e-30); non-finite elements
    are left out of the amax."""
    x = jnp.asarray(x, jnp.float32)
    if per_expert:
        amax = finite_absmax(x.reshape(x.shape[0], -1), axis=1)
    else:
        amax = finite_absmax(x)
    return jnp.float32(FP8_MAX * E2M1_MAX) / jnp.maximum(amax, jnp.float32(_MIN_GLOBAL_AMAX))


@jax.jit
def quantize_nvfp4(x, global_scale=None):
    """NVFP4: E2M1 elements, float8_e4m3fn scales per 16 along K, a float32 global scale.

    x [..., K] float, K % 16 == 0. ``global_scale``: float32 of shape [] or indexing x's leading
    axes ([E] for weights [E, N, K]; [T] for per-row activation scales); None computes one for
    the whole tensor with :func:`nvfp4_global_scale`.
    Returns (packed [..., K/2] uint8, block_scale [..., K/16] float8_e4m3fn, global_scale float32).
    A block holding NaN or inf gets a NaN block scale (all 16 elements dequantize to NaN).
    """
    x = jnp.asarray(x, jnp.float32)
    _check_k("x", x, NVFP4_BLOCK, "NVFP4")
    if global_scale is None:
        global_scale = nvfp4_global_scale(x)
    global_scale = jnp.asarray(global_scale, jnp.float32)
    g = expand_prefix(global_scale, x.ndim)  # broadcasts against [..., K/16]
    kb = x.shape[-1] // NVFP4_BLOCK
    blocks = x.reshape(x.shape[:-1] + (kb, NVFP4_BLOCK))
    bad = ~jnp.all(jnp.isfinite(blocks), axis=-1)  # [..., K/16]: the block holds NaN or inf
    blocks = jnp.where(jnp.isfinite(blocks), blocks, 0.0)
    amax = jnp.max(jnp.abs(blocks), axis=-1)  # [..., K/16]
    s = cast_to_fp8((amax * RCP_6) * g)
    sf = upcast_kept(s)  # the stored scale's value (module jax_moe.quant.rounding)
    mult = jnp.where(sf > 0, g / jnp.where(sf > 0, sf, 1.0), 0.0)
    codes = e2m1_encode(blocks * mult[..., None]).reshape(x.shape)
    s = jnp.where(bad, jnp.asarray(jnp.nan, FP8_DTYPE), s)  # E4M3 NaN: the block dequantizes to NaN
    return pack_fp4(codes), s, global_scale


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_nvfp4(packed, block_scale, global_scale, dtype=jnp.float32):
    """Inverse of :func:`quantize_nvfp4`: packed [..., K/2] uint8, block_scale [..., K/16]
    float8_e4m3fn, global_scale [] or indexing the leading axes -> [..., K] ``dtype``,
    ``(e2m1 * float(block_scale)) * (1 / global_scale)``."""
    v = e2m1_decode(unpack_fp4(packed))
    k = v.shape[-1]
    _check_k("packed (unpacked)", v, NVFP4_BLOCK, "NVFP4")
    if block_scale.shape[-1] != k // NVFP4_BLOCK:
        raise ValueError(f"block_scale must end in K/16 = {k // NVFP4_BLOCK}, got {list(block_scale.shape)}")
    sf = upcast_kept(block_scale)
    g = expand_prefix(global_scale, v.ndim)
    out = v.reshape(v.shape[:-1] + (k // NVFP4_BLOCK, NVFP4_BLOCK)) * sf[..., None]
    return (out.reshape(v.shape) * reciprocal(g)).astype(dtype)


# ----------------------------------------------------------------------------- MX (E8M0 scales)


def _pow2(n):
    """2**n as float32 for integer n in [-126, 127], built from the exponent bits (exact)."""
    n = jnp.asarray(n, jnp.int32)
    return jax.lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


def e8m0_exponent(amax, emax: int):
    """Shared exponent of a block: ``clamp(floor(log2(amax)) - emax, -127, 127)`` (int32).
    floor(log2) is read from the float32 exponent bits; zero and subnormal amax give -127."""
    bits = jax.lax.bitcast_convert_type(jnp.asarray(amax, jnp.float32), jnp.int32)
    field = (bits >> 23) & 0xFF
    floor_log2 = jnp.where(field == 0, -127 - 64, field - 127)  # subnormal/zero: below the clamp
    return jnp.clip(floor_log2 - emax, -127, 127)


@jax.jit
def e8m0_to_float(scale):
    """E8M0 bytes [...] uint8 -> 2**(byte - 127) float32 (0xFF, the NaN encoding, -> NaN).
    Byte 0 is 2**-127, a float32 subnormal: devices that flush subnormals (XLA on CPU) give 0,
    which only matters for blocks whose amax is below 2**-125 anyway."""
    b = jnp.asarray(scale).astype(jnp.int32)
    e = b - E8M0_BIAS
    half = e // 2  # two normal factors, so 2**-127 is formed without a subnormal operand
    val = _pow2(jnp.clip(half, -126, 127)) * _pow2(jnp.clip(e - half, -126, 127))
    return jnp.where(b == 255, jnp.float32(jnp.nan), val)


def _mx_blocks(x, emax, nan_scale: bool):
    """Blocks of 32 along K: (x scaled by 2**-e, the E8M0 bytes). The exponent comes from the finite
    values; a non-finite value scales to NaN. ``nan_scale`` (E2M1 elements, which hold no NaN):
    a block holding NaN or inf gets the byte 0xFF and its non-finite values scale to 0."""
    kb = x.shape[-1] // MX_BLOCK
    blocks = nonfinite_to_nan(x.reshape(x.shape[:-1] + (kb, MX_BLOCK)))
    e = e8m0_exponent(finite_absmax(blocks, axis=-1), emax)
    scaled = blocks * _pow2(-e)[..., None]  # -e in [-127, 127]; -127 only for e = 127 (never: amax < 2**128)
    byte = (e + E8M0_BIAS).astype(jnp.uint8)
    if nan_scale:
        bad = jnp.any(jnp.isnan(blocks), axis=-1)
        scaled = jnp.where(jnp.isnan(scaled), 0.0, scaled)
        byte = jnp.where(bad, jnp.uint8(E8M0_NAN), byte)
    return scaled, byte


def _mx_apply(v, scale):
    k = v.shape[-1]
    if scale.shape[-1] != k // MX_BLOCK:
        raise ValueError(f"scale must end in K/32 = {k // MX_BLOCK}, got {list(scale.shape)}")
    s = e8m0_to_float(scale)
    return (v.reshape(v.shape[:-1] + (k // MX_BLOCK, MX_BLOCK)) * s[..., None]).reshape(v.shape)


@jax.jit
def quantize_mxfp4(x):
    """MXFP4: x [..., K] float, K % 32 == 0 -> (packed [..., K/2] uint8, scale [..., K/32] uint8 E8M0).
    A block holding NaN or inf gets the scale byte 0xFF (E8M0 NaN): it dequantizes to 32 NaNs."""
    x = jnp.asarray(x, jnp.float32)
    _check_k("x", x, MX_BLOCK, "MXFP4")
    scaled, scale = _mx_blocks(x, E2M1_EMAX, nan_scale=True)
    return pack_fp4(e2m1_encode(scaled).reshape(x.shape)), scale


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_mxfp4(packed, scale, dtype=jnp.float32):
    """Inverse of :func:`quantize_mxfp4`: packed [..., K/2] uint8, scale [..., K/32] uint8 -> [..., K]."""
    v = e2m1_decode(unpack_fp4(packed))
    _check_k("packed (unpacked)", v, MX_BLOCK, "MXFP4")
    return _mx_apply(v, scale).astype(dtype)


@jax.jit
def quantize_mxfp8(x):
    """MXFP8: x [..., K] float, K % 32 == 0 -> (q [..., K] float8_e4m3fn, scale [..., K/32] uint8 E8M0).
    NaN and inf become NaN elements; the scale is taken over the block's finite values."""
    x = jnp.asarray(x, jnp.float32)
    _check_k("x", x, MX_BLOCK, "MXFP8")
    scaled, scale = _mx_blocks(x, E4M3_EMAX, nan_scale=False)
    return cast_to_fp8(scaled).reshape(x.shape).astype(FP8_DTYPE), scale


@functools.partial(jax.jit, static_argnames=("dtype",))
def dequantize_mxfp8(q, scale, dtype=jnp.float32):
    """Inverse of :func:`quantize_mxfp8`: q [..., K] float8_e4m3fn, scale [..., K/32] uint8 -> [..., K]."""
    v = upcast_kept(q)
    _check_k("q", v, MX_BLOCK, "MXFP8")
    return _mx_apply(v, scale).astype(dtype)
