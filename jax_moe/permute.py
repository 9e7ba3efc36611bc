"""Token-to-expert permutation and its inverse: the "prepare" and "finalize" steps every
grouped-GEMM backend needs.

A routed batch has ``T * k`` *slots*: slot ``s = t * k + j`` is token ``t``'s ``j``-th choice,
expert ``topk_ids[t, j]``. Sorting the slots by expert (stably, so that within one expert the
slots keep their original order) gives each expert a contiguous run of rows.

This module defines that permutation once, in jnp, and :func:`finalize`, the weighted top-k
reduce that brings the sorted rows back. The FFI kernel ``jax_moe.ffi.sort_by_expert``
computes exactly the same arrays and is tested against :func:`sort_by_expert`.

The batched expert format (``[E, C, H]`` rows with ``counts [E]``, as after an all-to-all
dispatch; vLLM's batched format) is defined here too: :func:`batched_rows_used` says which rows
of it an expert owns, :func:`batched_layout` lays routed rows out in it and
:func:`batched_finalize` brings each slot's output row back and reduces over k.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class ExpertSort(NamedTuple):
    """Slots sorted by expert.

    sorted_slots: [T*k] int32, the slot stored at each sorted position (stable by expert id).
    inverse:      [T*k] int32, the sorted position of each slot (``sorted_slots[inverse[s]] == s``).
    counts:       [E] int32, how many slots chose each expert.
    offsets:      [E+1] int32, exclusive prefix sum of ``counts`` (``offsets[E] == T*k``).
    """

    sorted_slots: jax.Array
    inverse: jax.Array
    counts: jax.Array
    offsets: jax.Array


def sort_by_expert(topk_ids: jax.Array, num_experts: int) -> ExpertSort:
    """Stable sort of the slots of ``topk_ids [T, k] int32`` by expert id in ``[0, num_experts)``.

    Ids outside ``[0, num_experts)`` (for instance ``-1`` for experts owned by another
    expert-parallel rank) are sorted after every valid slot and are not counted.
    """
    flat = topk_ids.reshape(-1).astype(jnp.int32)
    n = flat.shape[0]
    valid = (flat >= 0) & (flat < num_experts)
    key = jnp.where(valid, flat, num_experts)
    sorted_slots = jnp.argsort(key, stable=True).astype(jnp.int32)
    inverse = jnp.zeros((n,), jnp.int32).at[sorted_slots].set(jnp.arange(n, dtype=jnp.int32))
    counts = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts, dtype=jnp.int32)])
    return ExpertSort(sorted_slots, inverse, counts, offsets)


# ----------------------------------------------------------------------------- the batched format


def batched_rows_used(counts: jax.Array, capacity: int) -> jax.Array:
    """[E, C] bool: row r of expert e is used iff ``r < clamp(counts[e], 0, C)`` (the batched
    format's rule; the cutlass kernels' GroupRows reads the counts the same way)."""
    return jnp.arange(capacity, dtype=jnp.int32)[None, :] < jnp.clip(counts, 0, capacity)[:, None]


class BatchedLayout(NamedTuple):
    """Routed rows laid out per expert, for a stage on ``[E, C, ...]`` rows with ``C = M``.

    src:    [E, C] int32, the routed row held at each (expert, position); ``M`` where unused
            (gather from the rows with one zero row appended).
    pos:    [M, k] int32, each slot's position in its expert's rows; -1 for ids outside [0, E).
    counts: [E] int32, rows each expert holds (positions ``0 .. counts[e]-1``).
    """

    src: jax.Array
    pos: jax.Array
    counts: jax.Array


def batched_layout(topk_ids: jax.Array, num_experts: int) -> BatchedLayout:
    """Lay the rows of ``topk_ids [M, k] int32`` out by expert: expert e holds, in row order,
    every row with a slot on e. Ids outside ``[0, num_experts)`` (EP's -1) are skipped.

    Capacity ``C = M``, which is always enough, so nothing is ever dropped: a row brings at most
    one copy to each expert, since a row naming one expert in several slots (duplicate ids) has
    those slots share one copy (they would compute the same output; :func:`batched_finalize`
    weights each slot)."""
    m, k = topk_ids.shape
    e = num_experts
    ids = topk_ids.astype(jnp.int32)
    valid = (ids >= 0) & (ids < e)
    rows = jnp.arange(m, dtype=jnp.int32)
    hit = jnp.zeros((m, e + 1), jnp.bool_).at[rows[:, None], jnp.where(valid, ids, e)].set(True)[:, :e]
    rank = jnp.cumsum(hit, axis=0, dtype=jnp.int32) - 1  # [M, E]: row's position in each expert
    experts = jnp.where(hit, jnp.arange(e, dtype=jnp.int32)[None, :], e)  # e: dropped by the scatter
    src = jnp.full((e, m), m, jnp.int32).at[experts, rank].set(jnp.broadcast_to(rows[:, None], (m, e)),
                                                               mode="drop")
    pos = jnp.where(valid, jnp.take_along_axis(rank, jnp.where(valid, ids, 0), axis=1), -1)
    return BatchedLayout(src, pos, hit.sum(0, dtype=jnp.int32))


def to_batched(rows: jax.Array, layout: BatchedLayout) -> jax.Array:
    """rows [M, ...] -> [E, C, ...] per ``layout`` (zero where unused), in rows' dtype."""
    padded = jnp.concatenate([rows, jnp.zeros((1,) + rows.shape[1:], rows.dtype)], axis=0)
    return padded[layout.src]


def finalize(y_rows: jax.Array, row_of_slot: jax.Array, topk_weights: jax.Array, out_dtype) -> jax.Array:
    """Weighted top-k reduce: ``out[t] = sum_j w[t, j] * y_rows[row_of_slot[t*k + j]]`` in float32.

    y_rows [T*k, H] (the experts' outputs in sorted order), row_of_slot [T*k] int32 (slot ->
    row, :func:`sort_by_expert`), topk_weights [T, k] float -> [T, H] ``out_dtype``."""
    t, k = topk_weights.shape
    gathered = y_rows[row_of_slot].reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", gathered, topk_weights.astype(jnp.float32)).astype(out_dtype)


def batched_finalize(y: jax.Array, layout: BatchedLayout, topk_ids: jax.Array, topk_weights: jax.Array) -> jax.Array:
    """The weighted top-k reduce from the batched format: ``out[m] = sum_j w[m, j] *
    y[ids[m, j], pos[m, j]]`` over the slots with ids in ``[0, E)``, in float32.

    y [E, C, H]; topk_ids / topk_weights [M, k] (the ones :func:`batched_layout` saw). Returns
    [M, H] float32 (zero rows for rows without a slot in [0, E))."""
    e = y.shape[0]
    valid = layout.pos >= 0
    picked = y[jnp.clip(topk_ids, 0, e - 1), jnp.maximum(layout.pos, 0)].astype(jnp.float32)  # [M, k, H]
    picked = jnp.where(valid[..., None], picked, 0.0)
    return jnp.einsum("mkh,mk->mh", picked, topk_weights.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
