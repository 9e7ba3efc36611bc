"""Row orders of the gated GEMM1 weight (w13 ``[..., 2I, H]``) that the kernel families expect.

All functions move whole entries along one axis (``axis``, default -2: the rows of a weight
``[..., 2I, H]``, its block scales ``[..., 2I, H/b]``, or packed FP4 bytes ``[..., 2I, H/2]``;
use ``axis=-1`` for a bias ``[..., 2I]``). Leading axes (experts) are carried along. Each is a
pure permutation, any dtype, exact; the inverse is given. Axis length ``2I`` must be even.

Orders (row ``r`` of the output, ``I`` = half the axis length):

* :func:`swap_w13_to_w31` — ``[gate; up] -> [up; gate]``: ``out[r] = x[(r + I) mod 2I]``.
  Its own inverse (:func:`swap_w31_to_w13` is the same map). vLLM's ``swap_w13_to_w31``:
  FlashInfer's CUTLASS and TRT-LLM MoE want the "w3" (up) half first.
* :func:`reorder_rows_for_gated_act_gemm` — interleave the two halves row by row:
  ``out[2i] = x[i]``, ``out[2i + 1] = x[I + i]`` (``[r0, r_I, r1, r_{I+1}, ...]``). FlashInfer's
  ``reorder_rows_for_gated_act_gemm`` (``fused_moe/core.py``, row indices from
  ``get_reorder_rows_for_gated_act_gemm_row_indices``), applied by vLLM to ``[up; gate]`` for the
  TRT-LLM FP8 per-tensor kernel, giving ``[up0, gate0, up1, gate1, ...]``. Applied to
  ``[gate; up]`` it is the concat -> interleaved conversion of :mod:`jax_moe.config`.
  Inverse: :func:`undo_reorder_rows_for_gated_act_gemm` (``out[i] = x[2i]``,
  ``out[I + i] = x[2i + 1]``).
* :func:`swap_row_pairs` — swap rows ``2i`` and ``2i + 1``: ``out[r] = x[r ^ 1]``. Its own inverse.
  vLLM's GPT-OSS MXFP4 path (vLLM's GPT-OSS MXFP4 path, ``swap_every_two_rows``): the checkpoint's interleaved
  ``[gate0, up0, gate1, up1, ...]`` becomes ``[up0, gate0, ...]`` — the same order that
  swap + reorder produce from ``[gate; up]``.
* :func:`to_trtllm_gated_rows` — the row order of FlashInfer's TRT-LLM gen gated GEMM1 from
  either stored layout: ``out[2i] = up_i``, ``out[2i + 1] = gate_i``. From ``"concat"``
  (``[gate; up]``) it is the swap followed by the interleave (vLLM's FlashInfer FP8 path; vLLM's NVFP4 TRT-LLM
  preparation does the same: ``reorder_w1w3_to_w3w1`` then FlashInfer's gated-act row indices);
  from ``"interleaved"`` (``[gate0, up0, ...]``, GPT-OSS) it is the pairwise swap (vLLM's GPT-OSS MXFP4 path).
  Inverse: :func:`from_trtllm_gated_rows`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_moe.layouts.common import norm_axis

__all__ = [
    "swap_w13_to_w31",
    "swap_w31_to_w13",
    "reorder_rows_for_gated_act_gemm",
    "undo_reorder_rows_for_gated_act_gemm",
    "swap_row_pairs",
    "to_trtllm_gated_rows",
    "from_trtllm_gated_rows",
]


def _split(name: str, x, axis: int):
    x = jnp.asarray(x)
    ax = norm_axis(name, x, axis)
    n = x.shape[ax]
    if n % 2:
        raise ValueError(f"{name}: axis {axis} must have even length (2I), got {n}")
    return x, ax, n // 2


@functools.partial(jax.jit, static_argnames=("axis",))
def swap_w13_to_w31(x, axis: int = -2):
    """``[gate; up] -> [up; gate]`` along ``axis`` (halves of I). Self-inverse."""
    x, ax, i = _split("x", x, axis)
    halves = x.reshape(x.shape[:ax] + (2, i) + x.shape[ax + 1:])
    return jnp.flip(halves, axis=ax).reshape(x.shape)


@functools.partial(jax.jit, static_argnames=("axis",))
def swap_w31_to_w13(x, axis: int = -2):
    """``[up; gate] -> [gate; up]``: the inverse of :func:`swap_w13_to_w31` (the same map)."""
    return swap_w13_to_w31(x, axis)


@functools.partial(jax.jit, static_argnames=("axis",))
def reorder_rows_for_gated_act_gemm(x, axis: int = -2):
    """Interleave the halves of ``axis``: ``out[2i] = x[i]``, ``out[2i+1] = x[I+i]``."""
    x, ax, i = _split("x", x, axis)
    halves = x.reshape(x.shape[:ax] + (2, i) + x.shape[ax + 1:])  # [.., h, i, ..]
    return jnp.swapaxes(halves, ax, ax + 1).reshape(x.shape)  # row 2i + h


@functools.partial(jax.jit, static_argnames=("axis",))
def undo_reorder_rows_for_gated_act_gemm(x, axis: int = -2):
    """Inverse of :func:`reorder_rows_for_gated_act_gemm`: ``out[i] = x[2i]``, ``out[I+i] = x[2i+1]``."""
    x, ax, i = _split("x", x, axis)
    pairs = x.reshape(x.shape[:ax] + (i, 2) + x.shape[ax + 1:])  # [.., i, h, ..]
    return jnp.swapaxes(pairs, ax, ax + 1).reshape(x.shape)  # row h*I + i


@functools.partial(jax.jit, static_argnames=("axis",))
def swap_row_pairs(x, axis: int = -2):
    """Swap entries ``2i`` and ``2i+1`` along ``axis`` (``out[r] = x[r ^ 1]``). Self-inverse."""
    x, ax, i = _split("x", x, axis)
    pairs = x.reshape(x.shape[:ax] + (i, 2) + x.shape[ax + 1:])
    return jnp.flip(pairs, axis=ax + 1).reshape(x.shape)


def to_trtllm_gated_rows(x, gate_up_layout: str = "concat", axis: int = -2):
    """Stored gate/up entries along ``axis`` (``"concat"``: ``[gate; up]``; ``"interleaved"``:
    ``[gate0, up0, gate1, up1, ...]``) -> ``[up0, gate0, up1, gate1, ...]``. Any dtype, exact.
    Inverse: :func:`from_trtllm_gated_rows`."""
    if gate_up_layout == "concat":
        return reorder_rows_for_gated_act_gemm(swap_w13_to_w31(x, axis), axis)
    if gate_up_layout == "interleaved":
        return swap_row_pairs(x, axis)
    raise ValueError(f"gate_up_layout must be 'concat' or 'interleaved', got {gate_up_layout!r}")


def from_trtllm_gated_rows(x, gate_up_layout: str = "concat", axis: int = -2):
    """Inverse of :func:`to_trtllm_gated_rows`: ``[up0, gate0, ...]`` -> the stored layout."""
    if gate_up_layout == "concat":
        return swap_w31_to_w13(undo_reorder_rows_for_gated_act_gemm(x, axis), axis)
    if gate_up_layout == "interleaved":
        return swap_row_pairs(x, axis)
    raise ValueError(f"gate_up_layout must be 'concat' or 'interleaved', got {gate_up_layout!r}")
