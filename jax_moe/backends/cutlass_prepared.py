"""The cutlass backend's load-time layout: ``MoEBlock.prepare()`` (the oracle's ``prepared=True``).

Two repacks, both exact (a permutation of the weights, nothing rounded):

- **Transposed** (bf16, :func:`transposes`): w13 [E, 2I, H] -> [E, H, 2I] and w2 [E, H, I] ->
  [E, I, H], N contiguous (:mod:`jax_moe.layouts.transposed`). The grouped GEMMs read the same products
  from it (``b [E, K, N]``: :func:`~jax_moe.backends.cutlass_grad_gemm.grouped_gemm_dgrad`'s kernel,
  the act kind's ``transposed`` form, the decode path's column GEMVs), and on the H100 that weight
  stream is the faster one where the layer is weight-bound: neighbouring CTAs read neighbouring
  bytes of one row instead of short runs of many rows. FP8 keeps K contiguous (its tensor cores
  read only K-major operands).
- **Interleaved gate/up** (gated layers stored ``[gate; up]``, :func:`interleaves`): w13, its
  bias and its per-channel FP8 scales in the order of
  :func:`jax_moe.layouts.gated.reorder_rows_for_gated_act_gemm` (row ``2i`` gate ``i``, row
  ``2i + 1`` up ``i``). On it GEMM1 takes the activation into its epilogue where that pays
  (:func:`jax_moe.backends.cutlass_act_gemm.fuses_activation`: bf16 on the pingpong tiles and on
  ``coop_128x256``, FP8 with static activation scales on every tile) and writes ``act(gate) * up``
  without the ``[T*k, 2I]`` pre-activation; elsewhere the activation kernel reads the interleaved
  rows as fast as the concatenated ones. Layers already interleaved (GPT-OSS), ``relu2`` (not
  gated) and FP8 layers whose GEMM1 cannot take the activation (dynamic activation scales) keep
  their order. The interleave comes first, so a transposed gated layer's columns alternate gate
  and up.

:func:`apply_prepared` is :func:`jax_moe.backends.cutlass.apply` on the prepared weights; the
numbers differ from the stored layout's only where GEMM1 fuses (its output then reaches the
activation in float32 instead of bf16).

Prepared weights are for inference (:func:`jax_moe.autodiff.inference_only`); expert
parallelism runs the float weights (``parallel_fused_experts(..., backend="cutlass")``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jax_moe.backends.cutlass_act_gemm import fuses_activation
from jax_moe.config import ACTIVATIONS, MoEConfig
from jax_moe.layouts.gated import reorder_rows_for_gated_act_gemm
from jax_moe.layouts.transposed import BF16_ONLY, transpose_experts

if TYPE_CHECKING:
    from jax_moe.quant.scheme import QuantConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
    """Expert weights in the cutlass backend's load-time layout (a pytree; jit-able).

    w13 [E, 2I, H] (``cfg.gate_up_layout``'s row order; [E, I, H] for relu2) and w2 [E, H, I]:
    bfloat16, or float8_e4m3fn with ``quant`` its ``QuantConfig("fp8", ...)``; with ``transposed``
    (static; bf16) w13 [E, H, 2I] and w2 [E, I, H] instead, the same order along 2I. ``w13_bias``
    [E, 2I] in w13's order and ``w2_bias`` [E, H], float, or None. ``cfg`` (static) is the
    layer's :class:`~jax_moe.config.MoEConfig` with the gate/up layout the weights are in.
    """

    w13: jax.Array
    w2: jax.Array
    w13_bias: jax.Array | None = None
    w2_bias: jax.Array | None = None
    quant: QuantConfig | None = None
    cfg: MoEConfig = dataclasses.field(default=None, metadata=dict(static=True))
    transposed: bool = dataclasses.field(default=False, metadata=dict(static=True))


def transposes(cfg: MoEConfig, quant=None) -> bool:
    """Whether :func:`prepare` transposes ``cfg``'s weights by default: bf16 weights (FP8 stays K-major)."""
    return quant is None


def interleaves(cfg: MoEConfig, quant=None) -> bool:
    """Whether :func:`prepare` moves ``cfg``'s w13 to the interleaved order: a gated activation
    stored concatenated (``[gate; up]``), bf16 weights, or FP8 weights whose interleaved GEMM1
    takes the activation (:func:`~jax_moe.backends.cutlass_act_gemm.fuses_activation`)."""
    if not (ACTIVATIONS[cfg.activation] and cfg.gate_up_layout == "concat"):
        return False
    if quant is None:
        return True
    return fuses_activation(dataclasses.replace(cfg, gate_up_layout="interleaved"), quant)


def _interleave_scales(quant: QuantConfig):
    """An FP8 ``quant`` with per-channel w13 scales ([E, 2I, 1]) in the interleaved order; others as they are."""
    if jnp.ndim(quant.w13_scale) < 2:
        return quant
    return dataclasses.replace(quant, w13_scale=reorder_rows_for_gated_act_gemm(quant.w13_scale, axis=1))


def interleave_gate_up(w13, w13_bias, cfg: MoEConfig):
    """w13 [E, 2I, H] and its bias [E, 2I] (or None) from ``[gate; up]`` to the interleaved order
    -> (w13, w13_bias, cfg with ``gate_up_layout="interleaved"``). Any dtype: a row permutation."""
    return (*_interleave_rows(w13, w13_bias), dataclasses.replace(cfg, gate_up_layout="interleaved"))


def _interleave_rows(w13, w13_bias):
    return (reorder_rows_for_gated_act_gemm(w13),
            None if w13_bias is None else reorder_rows_for_gated_act_gemm(w13_bias, axis=-1))


def prepare(w13, w2, cfg: MoEConfig, quant=None, *, w13_bias=None, w2_bias=None,
            transpose: bool | None = None) -> Prepared:
    """vLLM-layout weights (w13 [E, 2I, H] in ``cfg.gate_up_layout``'s order, w2 [E, H, I]; FP8
    with ``quant``; biases [E, 2I] and [E, H] or None) -> :class:`Prepared`, interleaved where
    :func:`interleaves` says, then transposed where ``transpose`` says (None: :func:`transposes`;
    True with FP8 weights is a ValueError). Checks what :func:`jax_moe.backends.cutlass.apply`
    would, first."""
    from jax_moe.backends import cutlass

    cutlass.check_weights(w13, w2, cfg, quant, w13_bias, w2_bias)
    transpose = transposes(cfg, quant) if transpose is None else bool(transpose)
    if transpose and quant is not None:
        raise ValueError(f"cutlass.prepare: transpose=True is {BF16_ONLY}")
    interleave = interleaves(cfg, quant)
    if interleave:
        cfg = dataclasses.replace(cfg, gate_up_layout="interleaved")
        if quant is not None:
            quant = _interleave_scales(quant)
    if interleave or transpose:
        w13, w13_bias = _repack_w13(w13, w13_bias, interleave, transpose)
    if transpose:
        w2 = transpose_experts(w2)
    return Prepared(w13, w2, w13_bias, w2_bias, quant, cfg, transpose)


@functools.partial(jax.jit, static_argnums=(2, 3))
def _repack_w13(w13, w13_bias, interleave: bool, transpose: bool):
    """w13 (and its bias) interleaved and/or transposed in one program: one copy of w13 at a time
    besides the stored one, where two eager steps would hold three."""
    if interleave:
        w13, w13_bias = _interleave_rows(w13, w13_bias)
    return (transpose_experts(w13) if transpose else w13), w13_bias


def apply_prepared(x, prepared: Prepared, topk_weights, topk_ids, *, apply_router_weight_on_input: bool = False,
                   tile: str | None = "auto", finalize: str = "auto") -> jax.Array:
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on the prepared
    weights: x [T, H] float, topk_weights [T, k] float, topk_ids [T, k] int32 (outside [0, E):
    skipped). Returns [T, H] in x's dtype. As :func:`jax_moe.backends.cutlass.apply`, whose
    errors it raises."""
    from jax_moe.backends import cutlass

    if not isinstance(prepared, Prepared):
        raise TypeError(f"cutlass.apply_prepared: prepared must come from cutlass.prepare, got {type(prepared).__name__}")
    return cutlass.apply(x, prepared.w13, prepared.w2, topk_weights, topk_ids, prepared.cfg, quant=prepared.quant,
                         w13_bias=prepared.w13_bias, w2_bias=prepared.w2_bias,
                         apply_router_weight_on_input=apply_router_weight_on_input, tile=tile,
                         transposed=prepared.transposed, finalize=finalize)
