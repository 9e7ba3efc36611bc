"""Block-scale tile layouts (the "128x4" swizzle) and the per-GEMM alpha scales.

The 128x4 layout
----------------
A row-major scale matrix ``sf [..., M, K]`` (``K`` = scale columns: ``H/16`` for NVFP4,
``H/32`` for MXFP4/MXFP8) is padded with zeros to ``Mp = roundup(M, 128)`` rows and
``Kp = roundup(K, 4)`` columns, then stored as

    out[..., m // 128, k // 4, m % 32, (m % 128) // 32, k % 4] = sf[..., m, k]

i.e. the shape ``[..., Mp/128, Kp/4, 32, 4, 4]``: 128x4 tiles, tiles in row-major order
(all K tiles of the first 128 rows, then the next 128 rows), and inside a tile the 512 bytes
ordered by (``m % 32`` outer, ``(m // 32) % 4`` next, ``k % 4`` inner). In a flat row-major
buffer, ``(m, k)`` lands at
``((m//128) * (Kp/4) + k//4) * 512 + (m%32) * 16 + ((m%128)//32) * 4 + k%4``.

This is FlashInfer's ``block_scale_interleave`` (a.k.a. ``nvfp4_block_scale_interleave``;
index function ``get_sf_out_offset_128x4`` in
``data/csrc/nv_internal/tensorrt_llm/kernels/quantization_utils.cuh``, kernel
``block_scale_interleave_kernel`` in ``data/csrc/nv_internal/cpp/kernels/quantization.cu``,
which writes 0 in the padding and treats a leading batch (expert) axis as independent padded
matrices) and equally vLLM's ``swizzle_mxfp4_scales`` for MXFP4 E8M0 scales (vLLM's CUTLASS MoE,
``[ceil(N/128), ceil(K/128), 32, 4, 4]`` with K in elements, i.e. ``ceil((K/32)/4)`` tiles) and
vLLM's NVFP4 ``swizzle_blockscale``. FlashInfer returns the flat buffer; vLLM reshapes it to
``[Mp, Kp]`` (``as_2d=True`` here) — all three views share one row-major byte order.

Alpha scales
------------
Small float32 helpers for the scalars that fold dequantization into the GEMM epilogues
(FP8 per-tensor and NVFP4, as vLLM computes them). All scales use vLLM's *dequantization-side*
convention (``real = stored * scale``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.layouts.common import (
    SF_TILE_INNER_M,
    SF_TILE_K,
    SF_TILE_M,
    SF_TILE_OUTER_M,
    check_min_ndim,
    check_positive_int,
    pad_axis,
    round_up,
)

MX_SCALE_BLOCK = 32  # elements per MXFP4 E8M0 scale (the k of swizzle_mxfp4_scales is in elements)

__all__ = [
    "block_scale_interleave",
    "block_scale_deinterleave",
    "swizzle_mxfp4_scales",
    "unswizzle_mxfp4_scales",
    "fp8_alpha_scales",
    "TrtllmFp8OutputScales",
    "trtllm_fp8_output_scales",
    "trtllm_nvfp4_output_scales",
    "Nvfp4Alphas",
    "nvfp4_alpha_scales",
]


# ---------------------------------------------------------------- 128x4 interleave
@functools.partial(jax.jit, static_argnames=("as_2d",))
def block_scale_interleave(sf, *, as_2d: bool = False):
    """Row-major scales ``[..., M, K]`` -> 128x4 tiles ``[..., Mp/128, Kp/4, 32, 4, 4]``.

    ``Mp = roundup(M, 128)``, ``Kp = roundup(K, 4)``; padding is zeros. Any dtype (uint8 E8M0,
    float8_e4m3fn, bfloat16, ...). ``as_2d=True`` returns the same bytes as ``[..., Mp, Kp]``.
    Inverse: :func:`block_scale_deinterleave`.
    """
    sf = jnp.asarray(sf)
    check_min_ndim("sf", sf, 2, "[..., M, K] scale matrix")
    lead = sf.shape[:-2]
    m, k = sf.shape[-2:]
    mp, kp = round_up(m, SF_TILE_M), round_up(k, SF_TILE_K)
    x = pad_axis(pad_axis(sf, mp, -2), kp, -1)
    n = len(lead)
    # rows m = 128*mt + 32*inner + outer ; cols k = 4*kt + kk
    x = x.reshape(lead + (mp // SF_TILE_M, SF_TILE_INNER_M, SF_TILE_OUTER_M, kp // SF_TILE_K, SF_TILE_K))
    x = jnp.transpose(x, tuple(range(n)) + (n, n + 3, n + 2, n + 1, n + 4))  # mt, kt, outer, inner, kk
    return x.reshape(lead + (mp, kp)) if as_2d else x


@functools.partial(jax.jit, static_argnames=("rows", "cols", "as_2d"))
def block_scale_deinterleave(tiled, rows: int, cols: int, *, as_2d: bool = False):
    """Inverse of :func:`block_scale_interleave`: tiles -> row-major ``[..., rows, cols]``.

    ``tiled`` is ``[..., Mp/128, Kp/4, 32, 4, 4]`` (or ``[..., Mp, Kp]`` with ``as_2d=True``)
    with ``Mp = roundup(rows, 128)``, ``Kp = roundup(cols, 4)``; ``cols`` counts scale columns.
    The padding is dropped.
    """
    tiled = jnp.asarray(tiled)
    rows = check_positive_int("rows", rows)
    cols = check_positive_int("cols", cols)
    mp, kp = round_up(rows, SF_TILE_M), round_up(cols, SF_TILE_K)
    tile_shape = (mp // SF_TILE_M, kp // SF_TILE_K, SF_TILE_OUTER_M, SF_TILE_INNER_M, SF_TILE_K)
    if as_2d:
        check_min_ndim("tiled", tiled, 2, "[..., Mp, Kp]")
        if tuple(tiled.shape[-2:]) != (mp, kp):
            raise ValueError(f"tiled must end in [{mp}, {kp}] for rows={rows}, cols={cols}, "
                             f"got shape {list(tiled.shape)}")
        tiled = tiled.reshape(tiled.shape[:-2] + tile_shape)
    else:
        check_min_ndim("tiled", tiled, 5, "[..., Mp/128, Kp/4, 32, 4, 4]")
        if tuple(tiled.shape[-5:]) != tile_shape:
            raise ValueError(f"tiled must end in {list(tile_shape)} for rows={rows}, cols={cols}, "
                             f"got shape {list(tiled.shape)}")
    lead = tiled.shape[:-5]
    n = len(lead)
    x = jnp.transpose(tiled, tuple(range(n)) + (n, n + 3, n + 2, n + 1, n + 4))  # mt, inner, outer, kt, kk
    x = x.reshape(lead + (mp, kp))
    return x[..., :rows, :cols]


# ---------------------------------------------------------------- MXFP4 (vLLM CUTLASS)
@functools.partial(jax.jit, static_argnames=("as_2d",))
def swizzle_mxfp4_scales(scales, *, as_2d: bool = False):
    """MXFP4 E8M0 scales ``uint8 [..., N, K/32]`` -> ``[..., ceil(N/128), ceil(K/128), 32, 4, 4]``.

    vLLM's ``swizzle_mxfp4_scales`` (vLLM's CUTLASS MoE): the 128x4 layout of this module with the scale
    column index ``k`` (block of 32 elements) as the tile column; padding is zero bytes.
    ``as_2d=True`` gives ``[..., Np, Kp]`` (vLLM's ``.reshape(padded_N, -1)``).
    Inverse: :func:`unswizzle_mxfp4_scales`.
    """
    scales = jnp.asarray(scales)
    if scales.dtype != jnp.uint8:
        raise ValueError(f"scales must be uint8 (E8M0 bytes), got {np.dtype(scales.dtype).name}")
    check_min_ndim("scales", scales, 2, "[..., N, K/32]")
    return block_scale_interleave(scales, as_2d=as_2d)


@functools.partial(jax.jit, static_argnames=("n", "k", "as_2d"))
def unswizzle_mxfp4_scales(swizzled, n: int, k: int, *, as_2d: bool = False):
    """Inverse of :func:`swizzle_mxfp4_scales`: -> ``uint8 [..., n, k/32]``.

    ``n`` rows, ``k`` = the weight's K in *elements* (a multiple of 32), as in vLLM's
    ``swizzle_mxfp4_scales(scales, N, K)``.
    """
    swizzled = jnp.asarray(swizzled)
    if swizzled.dtype != jnp.uint8:
        raise ValueError(f"swizzled must be uint8 (E8M0 bytes), got {np.dtype(swizzled.dtype).name}")
    k = check_positive_int("k", k)
    if k % MX_SCALE_BLOCK:
        raise ValueError(f"k must be a multiple of {MX_SCALE_BLOCK} (elements per E8M0 scale), got {k}")
    return block_scale_deinterleave(swizzled, n, k // MX_SCALE_BLOCK, as_2d=as_2d)


# ---------------------------------------------------------------- alpha scales
def _f32(name: str, x):
    try:
        return jnp.asarray(x, jnp.float32)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a float scalar or array: {e}") from None


def _per_expert(x):
    """Drop size-1 axes like vLLM's ``.squeeze()``, but keep a per-expert vector 1-D (``[E]``,
    ``[1]`` for one expert) and a scalar a scalar."""
    return x if x.ndim == 0 else x.reshape(-1)


def _check_broadcast(pairs):
    for (na, a), (nb, b) in pairs:
        try:
            np.broadcast_shapes(a.shape, b.shape)
        except ValueError:
            raise ValueError(f"{na} {list(a.shape)} and {nb} {list(b.shape)} do not broadcast") from None


def fp8_alpha_scales(w13_scale, w13_input_scale, w2_scale, w2_input_scale):
    """FP8 per-tensor GEMM alphas: ``(g1_alphas, g2_alphas)``, float32.

    ``g1_alphas = w13_scale * w13_input_scale``, ``g2_alphas = w2_scale * w2_input_scale``
    (vLLM ``make_fp8_moe_alpha_scales_for_fi``): the product of the weight's (per-expert ``[E]``)
    and the activation's (per-tensor) dequantization scales, which rescales the FP8 x FP8
    accumulator to real units. Size-1 axes are squeezed to a per-expert vector ``[E]``.
    """
    a, b = _f32("w13_scale", w13_scale), _f32("w13_input_scale", w13_input_scale)
    c, d = _f32("w2_scale", w2_scale), _f32("w2_input_scale", w2_input_scale)
    _check_broadcast([(("w13_scale", a), ("w13_input_scale", b)), (("w2_scale", c), ("w2_input_scale", d))])
    return _per_expert(a * b), _per_expert(c * d)


class TrtllmFp8OutputScales(NamedTuple):
    """The three per-expert scalars of FlashInfer's TRT-LLM FP8 per-tensor MoE."""

    output1_scales_scalar: jax.Array
    output1_scales_gate_scalar: jax.Array
    output2_scales_scalar: jax.Array


def trtllm_fp8_output_scales(w13_scale, w13_input_scale, w2_scale, w2_input_scale) -> TrtllmFp8OutputScales:
    """TRT-LLM FP8 per-tensor epilogue scales (vLLM ``register_scales_for_trtllm_fp8_per_tensor_moe``).

    With ``g1_alphas, g2_alphas`` from :func:`fp8_alpha_scales`:

    * ``output1_scales_gate_scalar = g1_alphas`` — dequantizes the gate half of GEMM1;
    * ``output1_scales_scalar = g1_alphas * (1 / w2_input_scale)`` — dequantizes GEMM1 and
      re-quantizes the activation output to FP8 for GEMM2 in one multiply;
    * ``output2_scales_scalar = g2_alphas`` — dequantizes GEMM2.
    """
    g1, g2 = fp8_alpha_scales(w13_scale, w13_input_scale, w2_scale, w2_input_scale)
    return _trtllm_output_scales(g1, g2, _f32("w2_input_scale", w2_input_scale))


def _trtllm_output_scales(g1, g2, a2) -> TrtllmFp8OutputScales:
    """The TRT-LLM gen epilogue triple from the two GEMM alphas and GEMM2's input scale ``a2``:
    (``g1 / a2``, ``g1``, ``g2``), each squeezed to a per-expert vector."""
    inv = jnp.float32(1.0) / a2
    return TrtllmFp8OutputScales(
        output1_scales_scalar=_per_expert(g1 * inv),
        output1_scales_gate_scalar=_per_expert(g1),
        output2_scales_scalar=_per_expert(g2),
    )


def trtllm_nvfp4_output_scales(w13_scale_2, a13_scale, w2_scale_2, a2_scale) -> TrtllmFp8OutputScales:
    """TRT-LLM gen NVFP4 epilogue scales (``trtllm_fp4_block_scale_moe``'s ``output1_scale_scalar``,
    ``output1_scale_gate_scalar``, ``output2_scale_scalar``), float32.

    With ``g1_alphas, g2_alphas`` of :func:`nvfp4_alpha_scales` (``a13_scale * w13_scale_2``,
    ``a2_scale * w2_scale_2``), the same triple as FP8 (:func:`trtllm_fp8_output_scales`):
    ``(g1_alphas / a2_scale, g1_alphas, g2_alphas)`` -- vLLM's ``g1_scale_c``, ``g1_alphas``,
    ``g2_alphas`` (``prepare_nvfp4_moe_layer_for_fi_or_cutlass``, FLASHINFER_TRTLLM branch).
    ``w*_scale_2`` are vLLM's dequantization-side weight global scales (``1 / g`` of
    :func:`jax_moe.quant.fp4.nvfp4_global_scale`).
    """
    al = nvfp4_alpha_scales(w13_scale_2, a13_scale, w2_scale_2, a2_scale)
    return _trtllm_output_scales(al.g1_alphas, al.g2_alphas, _f32("a2_scale", a2_scale))


class Nvfp4Alphas(NamedTuple):
    """NVFP4 GEMM alphas and activation global scales (vLLM ``nvfp4_moe_quant_config``)."""

    g1_alphas: jax.Array
    g2_alphas: jax.Array
    a1_gscale: jax.Array
    a2_gscale: jax.Array


def nvfp4_alpha_scales(w13_scale_2, a13_scale, w2_scale_2, a2_scale) -> Nvfp4Alphas:
    """NVFP4 alphas (vLLM's NVFP4 oracle, ``make_nvfp4_moe_quant_config`` for the FlashInfer / CUTLASS rows).

    * ``g1_alphas = a13_scale * w13_scale_2``, ``g2_alphas = a2_scale * w2_scale_2`` — the
      product of the activation's and the weight's global dequantization scales;
    * ``a1_gscale = 1 / a13_scale``, ``a2_gscale = 1 / a2_scale`` — the *quantization-side*
      global scales the kernel multiplies activations by before FP4 rounding.

    ``*_scale_2`` are vLLM's per-expert weight global scales ``[E]``; ``a*_scale`` per-tensor or
    ``[E]``. (The Marlin row uses ``g*_alphas = w*_scale_2`` alone and no activation scales.)
    """
    w1, a1 = _f32("w13_scale_2", w13_scale_2), _f32("a13_scale", a13_scale)
    w2, a2 = _f32("w2_scale_2", w2_scale_2), _f32("a2_scale", a2_scale)
    _check_broadcast([(("a13_scale", a1), ("w13_scale_2", w1)), (("a2_scale", a2), ("w2_scale_2", w2))])
    one = jnp.float32(1.0)
    return Nvfp4Alphas(
        g1_alphas=a1 * w1,
        g2_alphas=a2 * w2,
        a1_gscale=one / a1,
        a2_gscale=one / a2,
    )
