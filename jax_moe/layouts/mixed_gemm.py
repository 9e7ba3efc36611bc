"""The SM90 mixed-input grouped GEMM's weight and scale layouts (FlashInfer CUTLASS MoE: W4A16
MXFP4, bf16 activations x E2M1 weights with E8M0 scales; W4A8, FP8 activations x int4 weights
with 2-byte group-128 scales).

The Hopper mixed-input MoE GEMM (TensorRT-LLM's, as FlashInfer 0.7.2 ships it:
``moe_gemm_tma_ws_mixed_input_launcher.inl``) converts the 4-bit weights to bf16 in registers
with a table lookup that expects each thread's eight codes in one 32-bit word, laid out for it;
and reads the weight scales in 16-byte lines. FlashInfer prepares both at load time with
``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")`` (a CUDA kernel,
``interleave_fp4_weights_for_sm90_mixed_gemm`` in ``moe_gemm_mixed_utils.cu``) and
``interleave_moe_scales_for_sm90_mixed_gemm`` (``fused_moe/prepare.py``). Both are byte/bit
permutations, written here in jnp, with their inverses. Leading axes (experts) are carried along.

Weights (:func:`interleave_fp4_weights_for_sm90_mixed_gemm`)
-------------------------------------------------------------
Input: packed E2M1 codes ``w [..., N, K/2]`` uint8, element ``2j`` of a row in the low nibble of
byte ``j`` and element ``2j + 1`` in the high nibble (:func:`jax_moe.quant.pack_fp4`); a code is
``s e1 e0 m`` (bit 3 the sign, bits 0-2 the magnitude: bits 1-2 exponent, bit 0 mantissa).
``N`` must be a multiple of 16 and ``K`` of 64. Output: the same shape and dtype.

Rows come in groups of 16; inside a group, row ``r`` (one of the first 8) is paired with row
``r + 8``. Bytes of a row come in chunks of 32 (64 codes); chunk ``p`` is bytes ``32p .. 32p+31``.
Each (row pair, chunk) is rewritten on its own. For ``q`` in 0..3 and ``l`` in 0..3, let
``c = 32p + 8q + l`` and take the four bytes

    a = w[r, c],   b = w[r + 8, c],   d = w[r, c + 4],   e = w[r + 8, c + 4]

as one little-endian 32-bit word ``S = a | b << 8 | d << 16 | e << 24``. Its eight codes are
``n0 .. n7`` (``n_j`` = bits ``4j .. 4j+3`` of ``S``): a.lo, a.hi, b.lo, b.hi, d.lo, d.hi,
e.lo, e.hi. The word ``D`` built from them is stored little-endian in the 4 bytes

    out[r + 8 * (q % 2), 32p + 16 * (q // 2) + 4l + 0 .. 3]

so source bytes ``8q .. 8q+7`` of both rows land in row ``r`` (``q`` even) or ``r + 8`` (``q``
odd), at bytes ``0 .. 15`` (``q`` < 2) or ``16 .. 31`` of the chunk. In ``D`` (bit 0 the least
significant) each code is split into its sign ``s_j``, its three magnitude bits ``m_j`` (kept
in order), or, for ``n6``/``n7``, its exponent bits ``x_j`` (code bits 1-2) and mantissa bit
``u_j`` (code bit 0):

    D bits  0-2   3-5   6-8   9     10-11  12    13    14    15
    holds   m4    m2    m0    s4    x6     s2    u6    s6    s0
    D bits  16-18 19-21 22-24 25    26-27  28    29    30    31
    holds   m5    m3    m1    s5    x7     s3    u7    s7    s1

(the low half holds the even codes, those of column ``2c`` / ``2c + 8``; the high half the odd
ones). Inverse: :func:`deinterleave_fp4_weights_for_sm90_mixed_gemm`.

int4 weights (:func:`interleave_int4_weights_for_sm90_mixed_gemm`, W4A8)
--------------------------------------------------------------------------
Input: packed int4 codes ``w [..., N, K/2]`` uint8 (two's-complement nibbles, element ``2j`` of
a row in the low nibble of byte ``j``: :func:`jax_moe.quant.int4.pack_int4`). ``N`` must be a
multiple of 16 and ``K`` of 64. Output: the same shape and dtype. No bit moves inside a 16-bit
unit: the int4 path converts codes without the FP4 table, so only whole units move.

Read each row as ``K/4`` units of 2 bytes (4 codes; unit ``u`` = bytes ``2u, 2u + 1``), in
chunks of 16 units (64 codes); rows pair up as for FP4, ``r`` with ``r + 8`` inside groups of
16. Number the units of a chunk ``l = 8m + 4h + t`` (``m``, ``h`` in {0, 1}, ``t`` in 0..3).
Unit ``l`` of row ``r + 8s`` (``s`` in {0, 1}) goes to row ``r + 8h``, unit ``8m + 2t + s`` of
the same chunk:

    out[r + 8h, chunk p, unit 8m + 2t + s] = w[r + 8s, chunk p, unit 8m + 4h + t]

so each destination row holds, unit by unit, the two rows' units side by side: row ``r`` gets
units ``t`` (h = 0) of both rows, row ``r + 8`` units ``4 + t`` (h = 1). Inverse:
:func:`deinterleave_int4_weights_for_sm90_mixed_gemm`.

Scales (:func:`interleave_scales_for_sm90_mixed_gemm`)
-------------------------------------------------------
Input: per-group weight scales ``s [..., R, K/g]`` (MXFP4: uint8 E8M0, ``g = 32``; W4A8: a
2-byte type, ``g = 128``). ``R`` must be a multiple of 64 and ``K`` of 128. With ``c = 128 / g``
scale columns per 128 weights and ``L = 16 / itemsize`` scale elements per 16-byte line, a block
of 64 rows x ``c`` columns is folded into ``F = 64 * c / L`` lines of ``L`` elements: line ``f``
holds rows ``f, f + F, f + 2F, ...`` (``L / c`` of them), each row's ``c`` scales in K order:

    out[..., R/64, K/128, F, L];  out[..., rb, kb, f, c * m + j] = s[..., 64 rb + F m + f, c kb + j]

Blocks are ordered row block first, then K block. MXFP4 (uint8, ``g = 32``): ``c = 4``,
``L = 16``, ``F = 16``: line ``f`` holds the 4 scales of rows ``f, f + 16, f + 32, f + 48``;
the result is ``[..., R/64, K/128, 16, 16]``. Inverse:
:func:`deinterleave_scales_for_sm90_mixed_gemm`; the folded shape: :func:`mixed_gemm_scale_shape`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.layouts.common import (
    MIXED_GEMM_K_CHUNK,
    MIXED_GEMM_ROW_GROUP,
    MIXED_GEMM_ROW_HALF,
    MIXED_GEMM_SCALE_K,
    MIXED_GEMM_SCALE_LINE_BYTES,
    MIXED_GEMM_SCALE_ROWS,
    check_min_ndim,
    check_positive_int,
)

__all__ = [
    "FP4_WORD_FIELDS",
    "interleave_fp4_weights_for_sm90_mixed_gemm",
    "deinterleave_fp4_weights_for_sm90_mixed_gemm",
    "interleave_int4_weights_for_sm90_mixed_gemm",
    "deinterleave_int4_weights_for_sm90_mixed_gemm",
    "mixed_gemm_scale_shape",
    "interleave_scales_for_sm90_mixed_gemm",
    "deinterleave_scales_for_sm90_mixed_gemm",
]

# The word permutation of the module docstring as bit fields (source lsb in S, destination lsb
# in D, width), code by code: n_j's magnitude is S bits 4j..4j+2, its sign S bit 4j+3.
FP4_WORD_FIELDS: tuple[tuple[int, int, int], ...] = (
    (0, 6, 3), (3, 15, 1),                 # n0: m0 -> 6-8, s0 -> 15
    (4, 22, 3), (7, 31, 1),                # n1: m1 -> 22-24, s1 -> 31
    (8, 3, 3), (11, 12, 1),                # n2: m2 -> 3-5, s2 -> 12
    (12, 19, 3), (15, 28, 1),              # n3: m3 -> 19-21, s3 -> 28
    (16, 0, 3), (19, 9, 1),                # n4: m4 -> 0-2, s4 -> 9
    (20, 16, 3), (23, 25, 1),              # n5: m5 -> 16-18, s5 -> 25
    (24, 13, 1), (25, 10, 2), (27, 14, 1),  # n6: u6 -> 13, x6 -> 10-11, s6 -> 14
    (28, 29, 1), (29, 26, 2), (31, 30, 1),  # n7: u7 -> 29, x7 -> 26-27, s7 -> 30
)


def _move_fields(words, fields):
    """uint32 words -> uint32 words with each (src lsb, dst lsb, width) field moved."""
    out = jnp.zeros_like(words)
    for src, dst, width in fields:
        field = words & np.uint32(((1 << width) - 1) << src)
        out = out | (field << np.uint32(dst - src) if dst >= src else field >> np.uint32(src - dst))
    return out


def _check_weight(name: str, w, code: str = "E2M1"):
    w = jnp.asarray(w)
    check_min_ndim(name, w, 2, f"[..., N, K/2] packed {code}")
    if w.dtype != jnp.uint8:
        raise ValueError(f"{name} must be uint8 (two {code} codes per byte), got {np.dtype(w.dtype).name}")
    n, kb = w.shape[-2:]
    if n % MIXED_GEMM_ROW_GROUP or (2 * kb) % MIXED_GEMM_K_CHUNK:
        raise ValueError(f"{name} [..., N, K/2] = {list(w.shape)}: N must be a multiple of "
                         f"{MIXED_GEMM_ROW_GROUP} and K of {MIXED_GEMM_K_CHUNK}")
    return w


# Axis names of a weight [..., N, K/2] split for the permutation:
#   source      (g, h, i, p, qh, ql, t, l): row 16g + 8h + i, byte 32p + 16qh + 8ql + 4t + l
#   destination (g, ql, i, p, qh, l, j):    row 16g + 8ql + i, byte 32p + 16qh + 4l + j
# (q = 2qh + ql; word byte j = h + 2t of S; byte j of D).
def _split_shape(lead, n, kb):
    chunk_bytes = MIXED_GEMM_K_CHUNK // 2
    return lead + (n // MIXED_GEMM_ROW_GROUP, 2, MIXED_GEMM_ROW_HALF, kb // chunk_bytes, 2, 2, 2, 4)


@jax.jit
def interleave_fp4_weights_for_sm90_mixed_gemm(w):
    """Packed E2M1 ``uint8 [..., N, K/2]`` -> the mixed-input GEMM's byte order, same shape
    (module docstring). Inverse: :func:`deinterleave_fp4_weights_for_sm90_mixed_gemm`."""
    w = _check_weight("w", w)
    lead, (n, kb) = w.shape[:-2], w.shape[-2:]
    nl = len(lead)
    x = w.reshape(_split_shape(lead, n, kb)).astype(jnp.uint32)
    pick = lambda h, t: jax.lax.index_in_dim(  # noqa: E731  -> (.., g, i, p, qh, ql, l)
        jax.lax.index_in_dim(x, t, nl + 6, keepdims=False), h, nl + 1, keepdims=False)
    s = pick(0, 0) | pick(1, 0) << 8 | pick(0, 1) << 16 | pick(1, 1) << 24
    d = _move_fields(s, FP4_WORD_FIELDS)
    out = jnp.stack([(d >> np.uint32(8 * j)) & np.uint32(0xFF) for j in range(4)], axis=-1)
    # (g, i, p, qh, ql, l, j) -> (g, ql, i, p, qh, l, j)
    out = jnp.transpose(out, tuple(range(nl)) + tuple(nl + a for a in (0, 4, 1, 2, 3, 5, 6)))
    return out.astype(jnp.uint8).reshape(w.shape)


@jax.jit
def deinterleave_fp4_weights_for_sm90_mixed_gemm(w):
    """Inverse of :func:`interleave_fp4_weights_for_sm90_mixed_gemm`: back to row-major packed
    E2M1 ``uint8 [..., N, K/2]``."""
    w = _check_weight("w", w)
    lead, (n, kb) = w.shape[:-2], w.shape[-2:]
    nl = len(lead)
    chunk_bytes = MIXED_GEMM_K_CHUNK // 2
    x = w.reshape(lead + (n // MIXED_GEMM_ROW_GROUP, 2, MIXED_GEMM_ROW_HALF, kb // chunk_bytes, 2, 4, 4))
    # (g, ql, i, p, qh, l, j) -> (g, i, p, qh, ql, l, j)
    x = jnp.transpose(x, tuple(range(nl)) + tuple(nl + a for a in (0, 2, 3, 4, 1, 5, 6))).astype(jnp.uint32)
    d = x[..., 0] | x[..., 1] << 8 | x[..., 2] << 16 | x[..., 3] << 24
    s = _move_fields(d, tuple((dst, src, width) for src, dst, width in FP4_WORD_FIELDS))
    sb = jnp.stack([(s >> np.uint32(8 * j)) & np.uint32(0xFF) for j in range(4)], axis=-1)
    sb = sb.reshape(sb.shape[:-1] + (2, 2))  # byte j = h + 2t -> (t, h)
    # (g, i, p, qh, ql, l, t, h) -> (g, h, i, p, qh, ql, t, l)
    sb = jnp.transpose(sb, tuple(range(nl)) + tuple(nl + a for a in (0, 7, 1, 2, 3, 4, 6, 5)))
    return sb.astype(jnp.uint8).reshape(w.shape)


# Axis names of an int4 weight [..., N, K/2] seen as 2-byte units:
#   source      (g, s, i, p, m, h, t, b): row 16g + 8s + i, unit 16p + 8m + 4h + t, byte b
#   destination (g, h, i, p, m, t, s, b): row 16g + 8h + i, unit 16p + 8m + 2t + s, byte b
_INT4_SRC_TO_DST = (0, 5, 2, 3, 4, 6, 1, 7)   # destination axis k takes source axis _[k]


def _int4_units_shape(lead, n, kb, order=tuple(range(8))):
    """The source split of the comment above, its axes taken in ``order``."""
    chunk_bytes = MIXED_GEMM_K_CHUNK // 2
    src = (n // MIXED_GEMM_ROW_GROUP, 2, MIXED_GEMM_ROW_HALF, kb // chunk_bytes, 2, 2, 4, 2)
    return lead + tuple(src[a] for a in order)


@jax.jit
def interleave_int4_weights_for_sm90_mixed_gemm(w):
    """Packed int4 ``uint8 [..., N, K/2]`` -> the mixed-input GEMM's unit order, same shape
    (module docstring, "int4 weights"). Inverse: :func:`deinterleave_int4_weights_for_sm90_mixed_gemm`."""
    w = _check_weight("w", w, "int4")
    lead, (n, kb) = w.shape[:-2], w.shape[-2:]
    nl = len(lead)
    x = w.reshape(_int4_units_shape(lead, n, kb))
    x = jnp.transpose(x, tuple(range(nl)) + tuple(nl + a for a in _INT4_SRC_TO_DST))
    return x.reshape(w.shape)


@jax.jit
def deinterleave_int4_weights_for_sm90_mixed_gemm(w):
    """Inverse of :func:`interleave_int4_weights_for_sm90_mixed_gemm`: back to row-major packed
    int4 ``uint8 [..., N, K/2]``."""
    w = _check_weight("w", w, "int4")
    lead, (n, kb) = w.shape[:-2], w.shape[-2:]
    nl = len(lead)
    x = w.reshape(_int4_units_shape(lead, n, kb, _INT4_SRC_TO_DST))  # destination axes
    back = tuple(int(a) for a in np.argsort(_INT4_SRC_TO_DST))
    x = jnp.transpose(x, tuple(range(nl)) + tuple(nl + a for a in back))
    return x.reshape(w.shape)


def mixed_gemm_scale_shape(rows: int, k: int, group_size: int = 32, itemsize: int = 1) -> tuple[int, ...]:
    """The folded scale block shape ``(R/64, K/128, F, L)`` for ``rows`` x ``k`` weights (K in
    weights) with one ``itemsize``-byte scale per ``group_size`` weights (module docstring)."""
    rows = check_positive_int("rows", rows)
    k = check_positive_int("k", k)
    group_size = check_positive_int("group_size", group_size)
    itemsize = check_positive_int("itemsize", itemsize)
    if MIXED_GEMM_SCALE_K % group_size:
        raise ValueError(f"group_size ({group_size}) must divide {MIXED_GEMM_SCALE_K}")
    cols = MIXED_GEMM_SCALE_K // group_size
    line = MIXED_GEMM_SCALE_LINE_BYTES // itemsize if MIXED_GEMM_SCALE_LINE_BYTES % itemsize == 0 else 0
    if line == 0 or line % cols or MIXED_GEMM_SCALE_ROWS % (line // cols):
        raise ValueError(f"{itemsize}-byte scales per {group_size} weights do not fold into "
                         f"{MIXED_GEMM_SCALE_LINE_BYTES}-byte lines")
    if rows % MIXED_GEMM_SCALE_ROWS or k % MIXED_GEMM_SCALE_K:
        raise ValueError(f"rows ({rows}) must be a multiple of {MIXED_GEMM_SCALE_ROWS} and K ({k}) "
                         f"of {MIXED_GEMM_SCALE_K}")
    return (rows // MIXED_GEMM_SCALE_ROWS, k // MIXED_GEMM_SCALE_K, MIXED_GEMM_SCALE_ROWS * cols // line, line)


@functools.partial(jax.jit, static_argnames=("group_size",))
def interleave_scales_for_sm90_mixed_gemm(scales, group_size: int = 32):
    """Row-major group scales ``[..., R, K/g]`` -> folded ``[..., R/64, K/128, F, L]`` (module
    docstring; MXFP4: uint8, ``g = 32``, ``[..., R/64, K/128, 16, 16]``). Any 1/2/4-byte dtype.
    Inverse: :func:`deinterleave_scales_for_sm90_mixed_gemm`."""
    scales = jnp.asarray(scales)
    check_min_ndim("scales", scales, 2, "[..., R, K/group_size]")
    lead, (rows, kg) = scales.shape[:-2], scales.shape[-2:]
    rb, kblocks, f, line = mixed_gemm_scale_shape(rows, kg * group_size, group_size, scales.dtype.itemsize)
    cols = MIXED_GEMM_SCALE_K // group_size
    nl = len(lead)
    x = scales.reshape(lead + (rb, line // cols, f, kblocks, cols))  # row 64rb + F m + f, col c kb + j
    x = jnp.transpose(x, tuple(range(nl)) + tuple(nl + a for a in (0, 3, 2, 1, 4)))  # rb, kb, f, m, j
    return x.reshape(lead + (rb, kblocks, f, line))


@functools.partial(jax.jit, static_argnames=("group_size",))
def deinterleave_scales_for_sm90_mixed_gemm(folded, group_size: int = 32):
    """Inverse of :func:`interleave_scales_for_sm90_mixed_gemm`: ``[..., R/64, K/128, F, L]``
    -> ``[..., R, K/g]``."""
    folded = jnp.asarray(folded)
    check_min_ndim("folded", folded, 4, "[..., R/64, K/128, F, L]")
    lead, (rb, kblocks, f, line) = folded.shape[:-4], folded.shape[-4:]
    rows, k = rb * MIXED_GEMM_SCALE_ROWS, kblocks * MIXED_GEMM_SCALE_K
    want = mixed_gemm_scale_shape(rows, k, group_size, folded.dtype.itemsize)
    if (rb, kblocks, f, line) != want:
        raise ValueError(f"folded must end in {list(want)} for {np.dtype(folded.dtype).name} scales "
                         f"per {group_size} weights, got shape {list(folded.shape)}")
    cols = MIXED_GEMM_SCALE_K // group_size
    nl = len(lead)
    x = folded.reshape(lead + (rb, kblocks, f, line // cols, cols))  # rb, kb, f, m, j
    x = jnp.transpose(x, tuple(range(nl)) + tuple(nl + a for a in (0, 3, 2, 1, 4)))  # rb, m, f, kb, j
    return x.reshape(lead + (rows, k // group_size))
