"""Layout constants (defined here once), zero padding, and the per-backend padding rules.

Every other module of :mod:`jax_moe.layouts` (and any FFI shape rule or C++ check that mirrors
a layout) reads its tile sizes from this file.

Constants
---------
``EPILOGUE_TILE_M = 128``
    The TRT-LLM-gen epilogue tile along M that vLLM passes to FlashInfer's ``shuffle_matrix_a``
    / ``shuffle_matrix_sf_a`` (seeds 000 and 002).
``SHUFFLE_ROW_GROUPS = 8``; ``SHUFFLE_BLOCK_ROWS_LARGE = 32``, ``SHUFFLE_BLOCK_ROWS_SMALL = 16``
    ``shuffle_matrix_a`` permutes rows inside blocks of 32 rows when the epilogue tile is a
    multiple of 128, else inside blocks of 16 rows (:func:`shuffle_block_rows`); a block is seen
    as 8 groups of ``block / 8`` rows (see :mod:`jax_moe.layouts.shuffle`).
``SF_TILE_M = 128``, ``SF_TILE_K = 4``, ``SF_TILE_OUTER_M = 32``, ``SF_TILE_INNER_M = 4``
    The "128x4" block-scale tile (NVFP4 ``block_scale_interleave``, vLLM's
    ``swizzle_mxfp4_scales``): 128 rows x 4 scale columns, rows split as 32 (outer, ``m % 32``)
    x 4 (inner, ``(m // 32) % 4``). See :mod:`jax_moe.layouts.scales`.
``MIXED_GEMM_ROW_GROUP = 16``, ``MIXED_GEMM_ROW_HALF = 8``, ``MIXED_GEMM_K_CHUNK = 64``
    The SM90 mixed-input grouped GEMM's 4-bit weight interleave (W4A16 MXFP4, W4A8 int4) works
    on pairs of rows ``(r, r + 8)`` inside groups of 16 rows and on chunks of 64 weights (32
    bytes) along K: N must be a multiple of 16 and K of 64 (see :mod:`jax_moe.layouts.mixed_gemm`).
``MIXED_GEMM_SCALE_ROWS = 64``, ``MIXED_GEMM_SCALE_K = 128``, ``MIXED_GEMM_SCALE_LINE_BYTES = 16``
    The same GEMM's weight scales are folded per block of 64 rows x 128 weights along K, stored
    as lines of 16 bytes; rows must be a multiple of 64 and K of 128.
``FP8_INTERMEDIATE_ALIGN = 16``
    FlashInfer FP8 MoE kernels need the intermediate size I to be a multiple of 16; vLLM pads
    I (per-tensor FP8, not block-quantized) before repacking (vLLM's FlashInfer FP8 path).
``FP8_BLOCK_EPILOGUE_TILE_M = 64``, ``BLOCK_MAJOR_K = 128``
    FlashInfer's TRT-LLM gen DeepSeek FP8 block-scale MoE takes its weights row-shuffled with
    epilogue tile 64 (so ``shuffle_matrix_a`` works on 16-row blocks) and then in the
    "BlockMajorK" layout, K cut into chunks of 128 bytes stored chunk-major (vLLM
    ``_shuffle_deepseek_fp8_moe_weights``; FlashInfer ``convert_to_block_layout``, ``blockK``).
``FP8_BLOCK_SCALE = 128``
    DeepSeek-V3 FP8 block scales (FlashInfer CUTLASS ``fp8_block``): one float32 weight scale per
    128 x 128 block and one activation scale per token per 128 columns; H and I must be
    multiples of it (see :mod:`jax_moe.layouts.blockscale`).
``MXFP4_PADDING``
    The MXFP4 (GPT-OSS) padding of I and H per backend (vLLM's GPT-OSS MXFP4 path, and later vLLM for the
    FlashInfer CUTLASS row): a table ``backend -> MxPadding(intermediate, hidden)``; backends
    not in it use ``MXFP4_PADDING_DEFAULT`` (I to 64, H unchanged).

Padding is always with zeros, appended at the end of an axis. A gated w13 ``[gate; up]`` is
padded half by half (:func:`pad_gate_up`) so that the halves stay aligned: ``[gate; 0; up; 0]``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# ---------------------------------------------------------------- constants (defined once)
EPILOGUE_TILE_M = 128
SHUFFLE_ROW_GROUPS = 8
SHUFFLE_BLOCK_ROWS_LARGE = 32
SHUFFLE_BLOCK_ROWS_SMALL = 16

SF_TILE_M = 128
SF_TILE_K = 4
SF_TILE_OUTER_M = 32
SF_TILE_INNER_M = SF_TILE_M // SF_TILE_OUTER_M  # 4

FP8_INTERMEDIATE_ALIGN = 16
FP8_BLOCK_SCALE = 128
FP8_BLOCK_EPILOGUE_TILE_M = 64
BLOCK_MAJOR_K = 128

MIXED_GEMM_ROW_GROUP = 16
MIXED_GEMM_ROW_HALF = MIXED_GEMM_ROW_GROUP // 2  # 8: row r is paired with row r + 8
MIXED_GEMM_K_CHUNK = 64
MIXED_GEMM_SCALE_ROWS = 64
MIXED_GEMM_SCALE_K = 128
MIXED_GEMM_SCALE_LINE_BYTES = 16


class MxPadding(NamedTuple):
    """Multiples to round the intermediate size I and the hidden size H up to (1 = unchanged)."""

    intermediate: int
    hidden: int


# MXFP4 (GPT-OSS) padding per backend (names as in jax_moe.oracle):
#   flashinfer_trtllm : I and H to 256 (vLLM's GPT-OSS MXFP4 path, "should_use_flashinfer_mxfp4": 2 * block 32
#                       for uneven shards, plus swizzling)
#   flashinfer_cutlass: I and H to 256, as vLLM's FlashInfer MXFP4 path: the SM90 mixed-input GEMM's
#                       256-deep K tiles read one scale tile past a K that is only a multiple of 128
#                       (the next expert's scales, or past the buffer for the last expert: NaN rows
#                       measured on an H100 at H = I = 128)
#   marlin            : I to 128, H to 256 (Marlin MoE needs n % 256 == 0 and k % 128 == 0)
#   anything else     : I to 64, H unchanged (Triton and the pure-JAX path)
MXFP4_PADDING: dict[str, MxPadding] = {
    "flashinfer_trtllm": MxPadding(256, 256),
    "flashinfer_cutlass": MxPadding(256, 256),
    "marlin": MxPadding(128, 256),
}
MXFP4_PADDING_DEFAULT = MxPadding(64, 1)

from jax_moe.config import GATE_UP_LAYOUTS  # noqa: E402  (defined once, with the weight orientation)

__all__ = [
    "EPILOGUE_TILE_M",
    "SHUFFLE_ROW_GROUPS",
    "SHUFFLE_BLOCK_ROWS_LARGE",
    "SHUFFLE_BLOCK_ROWS_SMALL",
    "SF_TILE_M",
    "SF_TILE_K",
    "SF_TILE_OUTER_M",
    "SF_TILE_INNER_M",
    "FP8_INTERMEDIATE_ALIGN",
    "FP8_BLOCK_SCALE",
    "FP8_BLOCK_EPILOGUE_TILE_M",
    "BLOCK_MAJOR_K",
    "MIXED_GEMM_ROW_GROUP",
    "MIXED_GEMM_ROW_HALF",
    "MIXED_GEMM_K_CHUNK",
    "MIXED_GEMM_SCALE_ROWS",
    "MIXED_GEMM_SCALE_K",
    "MIXED_GEMM_SCALE_LINE_BYTES",
    "MxPadding",
    "MXFP4_PADDING",
    "MXFP4_PADDING_DEFAULT",
    "round_up",
    "shuffle_block_rows",
    "mxfp4_padding",
    "mxfp4_padded_sizes",
    "fp8_padded_intermediate",
    "pad_axis",
    "pad_axis_to_multiple",
    "pad_gate_up",
    "pad_intermediate_rows",
    "unpad_gate_up",
]


# ---------------------------------------------------------------- small shared checks
def norm_axis(name: str, x, axis: int) -> int:
    """``axis`` as a non-negative int for ``x``; ValueError naming ``name`` if out of range."""
    ndim = len(getattr(x, "shape", ()))
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"{name}: axis {axis!r} is out of range for shape {list(getattr(x, 'shape', ()))}")
    return int(axis) % ndim


def check_min_ndim(name: str, x, ndim: int, what: str) -> None:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) < ndim:
        raise ValueError(f"{name} must have at least {ndim} dims ({what}), got shape {list(shape)}")


def check_positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def check_non_negative_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
        raise ValueError(f"{name} must be a non-negative int, got {v!r}")
    return int(v)


# ---------------------------------------------------------------- rules
def round_up(x: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``x`` (ints >= 0, multiple >= 1)."""
    x = check_non_negative_int("x", x)
    multiple = check_positive_int("multiple", multiple)
    return -(-x // multiple) * multiple


def shuffle_block_rows(epilogue_tile_m: int = EPILOGUE_TILE_M) -> int:
    """Rows per ``shuffle_matrix_a`` block: 32 if ``epilogue_tile_m`` is a multiple of 128, else 16
    (FlashInfer ``get_shuffle_block_size``)."""
    epilogue_tile_m = check_positive_int("epilogue_tile_m", epilogue_tile_m)
    return SHUFFLE_BLOCK_ROWS_LARGE if epilogue_tile_m % 128 == 0 else SHUFFLE_BLOCK_ROWS_SMALL


def mxfp4_padding(backend: str) -> MxPadding:
    """The MXFP4 padding rule of ``backend`` (:data:`MXFP4_PADDING`, else the default)."""
    if not isinstance(backend, str):
        raise ValueError(f"backend must be a str, got {backend!r}")
    return MXFP4_PADDING.get(backend, MXFP4_PADDING_DEFAULT)


def mxfp4_padded_sizes(backend: str, hidden_size: int, intermediate_size: int) -> tuple[int, int]:
    """``(H_padded, I_padded)`` that an MXFP4 layer gets under ``backend``'s rule."""
    rule = mxfp4_padding(backend)
    h = check_positive_int("hidden_size", hidden_size)
    i = check_positive_int("intermediate_size", intermediate_size)
    return round_up(h, rule.hidden), round_up(i, rule.intermediate)


def fp8_padded_intermediate(intermediate_size: int) -> int:
    """I rounded up to :data:`FP8_INTERMEDIATE_ALIGN` (FlashInfer FP8 per-tensor, as vLLM pads it)."""
    return round_up(check_positive_int("intermediate_size", intermediate_size), FP8_INTERMEDIATE_ALIGN)


# ---------------------------------------------------------------- padding
@functools.partial(jax.jit, static_argnames=("size", "axis"))
def pad_axis(x, size: int, axis: int = -1):
    """Append zeros along ``axis`` so that it has length ``size`` (>= its current length).

    Any dtype (float, bfloat16, float8, uint8 packed FP4 / E8M0 bytes); the zeros are the
    dtype's zero (all-zero bytes).
    """
    x = jnp.asarray(x)
    ax = norm_axis("x", x, axis)
    size = check_non_negative_int("size", size)
    n = x.shape[ax]
    if size < n:
        raise ValueError(f"size ({size}) must be >= x.shape[{axis}] ({n})")
    if size == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[ax] = (0, size - n)
    return jnp.pad(x, widths)


@functools.partial(jax.jit, static_argnames=("multiple", "axis"))
def pad_axis_to_multiple(x, multiple: int, axis: int = -1):
    """Append zeros along ``axis`` up to the next multiple of ``multiple``."""
    x = jnp.asarray(x)
    ax = norm_axis("x", x, axis)
    return pad_axis(x, round_up(x.shape[ax], multiple), ax)


def _gate_up_axis(name: str, w, axis: int, layout: str) -> tuple[int, int]:
    """(the normalized gate/up axis of ``w``, half its length), after checking ``layout`` and that
    the axis has an even length."""
    ax = norm_axis(name, w, axis)
    if layout not in GATE_UP_LAYOUTS:
        raise ValueError(f"layout must be one of {GATE_UP_LAYOUTS}, got {layout!r}")
    rows = w.shape[ax]
    if rows % 2:
        raise ValueError(f"{name}: axis {axis} must have even length 2I, got {rows}")
    return ax, rows // 2


@functools.partial(jax.jit, static_argnames=("intermediate_padded", "axis", "layout"))
def pad_gate_up(w13, intermediate_padded: int, axis: int = -2, layout: str = "concat"):
    """Pad a gated gate/up tensor from ``2I`` to ``2 * intermediate_padded`` entries along ``axis``.

    * ``layout="concat"`` (``[gate; up]`` or ``[up; gate]``, halves of I): each half gets its
      zeros at its own end: ``[h0 (I); 0 (Ip - I); h1 (I); 0 (Ip - I)]``, so that row ``Ip + i``
      is still the partner of row ``i``.
    * ``layout="interleaved"`` (pairs ``(2i, 2i+1)``): the ``Ip - I`` zero pairs go at the end.

    Works for weights ``[..., 2I, H]`` (packed or not), their block scales, and biases
    ``[..., 2I]`` (``axis=-1``). Inverse: :func:`unpad_gate_up`.
    """
    w13 = jnp.asarray(w13)
    ax, i = _gate_up_axis("w13", w13, axis, layout)
    ip = check_positive_int("intermediate_padded", intermediate_padded)
    if ip < i:
        raise ValueError(f"intermediate_padded ({ip}) must be >= I ({i})")
    if layout == "interleaved":
        return pad_axis(w13, 2 * ip, ax)
    # [..., 2, I, ...] -> pad the I axis -> [..., 2Ip, ...]
    halves = w13.reshape(w13.shape[:ax] + (2, i) + w13.shape[ax + 1:])
    halves = pad_axis(halves, ip, ax + 1)
    return halves.reshape(w13.shape[:ax] + (2 * ip,) + w13.shape[ax + 1:])


def pad_intermediate_rows(w13, intermediate_padded: int, gated: bool, axis: int = -2, layout: str = "concat"):
    """GEMM1's rows (w13 ``[..., 2I or I, H]``, its block scales, its bias ``[..., 2I]`` with
    ``axis=-1``) zero-padded to the intermediate size ``intermediate_padded``: half by half for a
    gated activation (:func:`pad_gate_up`), at the end otherwise (:func:`pad_axis`)."""
    if gated:
        return pad_gate_up(w13, intermediate_padded, axis=axis, layout=layout)
    return pad_axis(w13, intermediate_padded, axis)


@functools.partial(jax.jit, static_argnames=("intermediate", "axis", "layout"))
def unpad_gate_up(w13_padded, intermediate: int, axis: int = -2, layout: str = "concat"):
    """Inverse of :func:`pad_gate_up`: keep the first ``intermediate`` entries of each half
    (``concat``) or the first ``2 * intermediate`` entries (``interleaved``)."""
    w = jnp.asarray(w13_padded)
    ax, ip = _gate_up_axis("w13_padded", w, axis, layout)
    i = check_positive_int("intermediate", intermediate)
    if i > ip:
        raise ValueError(f"intermediate ({i}) must be <= half of w13_padded's axis {axis} ({ip})")
    if layout == "interleaved":
        return jax.lax.slice_in_dim(w, 0, 2 * i, axis=ax)
    halves = w.reshape(w.shape[:ax] + (2, ip) + w.shape[ax + 1:])
    halves = jax.lax.slice_in_dim(halves, 0, i, axis=ax + 1)
    return halves.reshape(w.shape[:ax] + (2 * i,) + w.shape[ax + 1:])
