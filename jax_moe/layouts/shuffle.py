"""TRT-LLM-gen's row shuffle for "transposed MMA output" (FlashInfer ``shuffle_matrix_a``) and
its block-scale twin ``shuffle_matrix_sf_a``.

Row rule (``get_shuffle_matrix_a_row_indices`` in FlashInfer ``utils.py``)
-------------------------------------------------------------------------
Rows are permuted inside consecutive blocks of ``B`` rows, ``B = 32`` when the epilogue tile M
is a multiple of 128 (vLLM passes 128) and ``B = 16`` otherwise
(:func:`jax_moe.layouts.common.shuffle_block_rows`). Write a row's offset inside its block as
``j = (B/8) * a + b`` with ``a`` in ``0..7`` and ``b`` in ``0..B/8-1``; source row ``j`` goes to
block position ``8 * b + a``:

    out[blk*B + 8*b + a] = x[blk*B + (B/8)*a + b]

i.e. each block, seen as an ``[8, B/8]`` grid of rows, is transposed to ``[B/8, 8]``. For
``B = 32`` the destination of source offsets 0, 1, 2, 3, 4, ... is 0, 8, 16, 24, 1, ...
(FlashInfer's ``srcToDstBlk32RowMap``). The row count must be a multiple of ``B``.

Only whole rows move, so the same function serves FP8 ``[M, K]``, packed FP4 ``uint8 [M, K/2]``
(the low-nibble-first packing along K is untouched), block scales and biases (``axis=-1`` on
``[..., M]``, which is vLLM's ``bias.reshape(-1, 1)``).

``convert_to_block_layout`` (TRT-LLM gen's "BlockMajorK" weight layout, FlashInfer
``convert_to_block_layout`` in ``fused_moe/core.py``): a ``[..., M, K]`` matrix is cut along K
into ``K / bk`` chunks of ``bk`` columns, and the chunks are stored one after another, each
holding all M rows: ``out[..., c, m, j] = x[..., m, c * bk + j]``, shape ``[..., K/bk, M, bk]``.
FlashInfer counts ``bk`` in bytes (128); for one-byte dtypes (FP8) bytes and elements agree.
Inverse: :func:`convert_from_block_layout`.

``shuffle_matrix_sf_a`` = the same row shuffle of a row-major scale matrix (M a multiple of
128, as FlashInfer asserts) followed by :func:`jax_moe.layouts.scales.block_scale_interleave`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.layouts.common import (
    BLOCK_MAJOR_K,
    EPILOGUE_TILE_M,
    SF_TILE_M,
    SHUFFLE_ROW_GROUPS,
    check_min_ndim,
    check_positive_int,
    norm_axis,
    shuffle_block_rows,
)
from jax_moe.layouts.scales import block_scale_deinterleave, block_scale_interleave

__all__ = [
    "shuffle_matrix_a_row_indices",
    "shuffle_matrix_a",
    "unshuffle_matrix_a",
    "shuffle_matrix_sf_a",
    "unshuffle_matrix_sf_a",
    "convert_to_block_layout",
    "convert_from_block_layout",
]


def shuffle_matrix_a_row_indices(m: int, epilogue_tile_m: int = EPILOGUE_TILE_M) -> np.ndarray:
    """int64 ``[m]`` with ``idx[new_row] = old_row`` (so ``shuffle_matrix_a(x) == x[idx]``), as
    FlashInfer's ``get_shuffle_matrix_a_row_indices``; for composing with other row maps."""
    m = check_positive_int("m", m)
    blk = shuffle_block_rows(epilogue_tile_m)
    if m % blk:
        raise ValueError(f"m must be a multiple of {blk} (shuffle block for "
                         f"epilogue_tile_m={epilogue_tile_m}), got {m}")
    g = blk // SHUFFLE_ROW_GROUPS
    grid = np.arange(m, dtype=np.int64).reshape(m // blk, SHUFFLE_ROW_GROUPS, g)
    return np.swapaxes(grid, 1, 2).reshape(m)


def _blocks(name: str, x, epilogue_tile_m: int, axis: int):
    x = jnp.asarray(x)
    ax = norm_axis(name, x, axis)
    blk = shuffle_block_rows(epilogue_tile_m)
    m = x.shape[ax]
    if m % blk:
        raise ValueError(f"{name}: axis {axis} has length {m}, must be a multiple of {blk} "
                         f"(shuffle block for epilogue_tile_m={epilogue_tile_m})")
    return x, ax, m // blk, blk // SHUFFLE_ROW_GROUPS


@functools.partial(jax.jit, static_argnames=("epilogue_tile_m", "axis"))
def shuffle_matrix_a(x, epilogue_tile_m: int = EPILOGUE_TILE_M, axis: int = -2):
    """FlashInfer ``shuffle_matrix_a`` along ``axis``: per block of B rows, ``[8, B/8] -> [B/8, 8]``.
    Any dtype, leading axes carried. Inverse: :func:`unshuffle_matrix_a`."""
    x, ax, nblk, g = _blocks("x", x, epilogue_tile_m, axis)
    y = x.reshape(x.shape[:ax] + (nblk, SHUFFLE_ROW_GROUPS, g) + x.shape[ax + 1:])
    return jnp.swapaxes(y, ax + 1, ax + 2).reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("epilogue_tile_m", "axis"))
def unshuffle_matrix_a(x, epilogue_tile_m: int = EPILOGUE_TILE_M, axis: int = -2):
    """Inverse of :func:`shuffle_matrix_a`: per block, ``[B/8, 8] -> [8, B/8]``."""
    x, ax, nblk, g = _blocks("x", x, epilogue_tile_m, axis)
    y = x.reshape(x.shape[:ax] + (nblk, g, SHUFFLE_ROW_GROUPS) + x.shape[ax + 1:])
    return jnp.swapaxes(y, ax + 1, ax + 2).reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("epilogue_tile_m", "as_2d"))
def shuffle_matrix_sf_a(sf, epilogue_tile_m: int = EPILOGUE_TILE_M, *, as_2d: bool = False):
    """FlashInfer ``shuffle_matrix_sf_a`` for a row-major (linear) scale matrix ``[..., M, K]``.

    ``M`` must be a multiple of 128. Rows are shuffled as :func:`shuffle_matrix_a` (axis -2),
    then tiled by :func:`block_scale_interleave` -> ``[..., M/128, Kp/4, 32, 4, 4]``
    (``Kp = roundup(K, 4)``, zero padding), or ``[..., M, Kp]`` with ``as_2d=True`` (vLLM's
    reshape of the flat buffer back to ``[E, M, K]`` when ``K % 4 == 0``).
    Inverse: :func:`unshuffle_matrix_sf_a`.
    """
    sf = jnp.asarray(sf)
    check_min_ndim("sf", sf, 2, "[..., M, K] scale matrix")
    if sf.shape[-2] % SF_TILE_M:
        raise ValueError(f"sf: M (axis -2) must be a multiple of {SF_TILE_M}, got shape {list(sf.shape)}")
    return block_scale_interleave(shuffle_matrix_a(sf, epilogue_tile_m, -2), as_2d=as_2d)


@functools.partial(jax.jit, static_argnames=("rows", "cols", "epilogue_tile_m", "as_2d"))
def unshuffle_matrix_sf_a(tiled, rows: int, cols: int, epilogue_tile_m: int = EPILOGUE_TILE_M, *,
                          as_2d: bool = False):
    """Inverse of :func:`shuffle_matrix_sf_a`: tiles -> row-major ``[..., rows, cols]``."""
    rows = check_positive_int("rows", rows)
    if rows % SF_TILE_M:
        raise ValueError(f"rows must be a multiple of {SF_TILE_M}, got {rows}")
    return unshuffle_matrix_a(block_scale_deinterleave(tiled, rows, cols, as_2d=as_2d), epilogue_tile_m, -2)


@functools.partial(jax.jit, static_argnames=("block_k",))
def convert_to_block_layout(x, block_k: int = BLOCK_MAJOR_K):
    """``[..., M, K] -> [..., K/block_k, M, block_k]``: ``out[..., c, m, j] = x[..., m, c*block_k + j]``
    (TRT-LLM gen BlockMajorK). Any dtype; K must be a multiple of ``block_k``.
    Inverse: :func:`convert_from_block_layout`."""
    x = jnp.asarray(x)
    check_min_ndim("x", x, 2, "[..., M, K] matrix")
    block_k = check_positive_int("block_k", block_k)
    m, k = x.shape[-2:]
    if k % block_k:
        raise ValueError(f"x: K (axis -1) = {k} must be a multiple of block_k={block_k}")
    y = x.reshape(x.shape[:-1] + (k // block_k, block_k))
    return jnp.swapaxes(y, -3, -2)


@jax.jit
def convert_from_block_layout(x):
    """Inverse of :func:`convert_to_block_layout`: ``[..., K/bk, M, bk] -> [..., M, K]``."""
    x = jnp.asarray(x)
    check_min_ndim("x", x, 3, "[..., K/bk, M, bk] blocks")
    y = jnp.swapaxes(x, -3, -2)
    return y.reshape(y.shape[:-2] + (y.shape[-2] * y.shape[-1],))
