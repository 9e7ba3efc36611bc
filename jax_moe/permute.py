"""Token-to-expert permutation (the "prepare" step every grouped-GEMM backend needs).

A routed batch has ``T * k`` *slots*: slot ``s = t * k + j`` is token ``t``'s ``j``-th choice,
expert ``topk_ids[t, j]``. Sorting the slots by expert (stably, so that within one expert the
slots keep their original order) gives each expert a contiguous run of rows.

This module defines that permutation once, in jnp. The FFI kernel ``jax_moe.ffi.sort_by_expert``
computes exactly the same arrays and is tested against :func:`sort_by_expert`.
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
