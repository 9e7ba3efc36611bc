"""Scheme ``fp8`` of ``backend="flashinfer_trtllm"``: vLLM's FP8 per-tensor W8A8
(FlashInfer's ``trtllm_fp8_per_tensor_scale_moe``).

Activations quantized to float8_e4m3fn with the static per-tensor ``a13_scale``; FP8 weights with
per-tensor or per-expert scales; GEMM1 with the gated activation (``silu``) fused and the result
re-quantized to FP8 with ``1 / a2_scale``; GEMM2; the weighted top-k reduce -> bfloat16. Compiles
and links for sm_100a against a stand-in cubin pack; never run on an SM100 GPU.

Weight layout (:func:`prepare`, once, at load time; vLLM's FlashInfer FP8 per-tensor path,
:mod:`jax_moe.layouts`): I is zero-padded to :data:`jax_moe.layouts.FP8_INTERMEDIATE_ALIGN` (each
gate/up half at its own end, :func:`~jax_moe.layouts.pad_gate_up`; w2's columns likewise); w13
``[gate; up]`` -> ``[up; gate]`` (:func:`~jax_moe.layouts.swap_w13_to_w31`) -> rows interleaved
(:func:`~jax_moe.layouts.reorder_rows_for_gated_act_gemm`) -> ``shuffle_matrix_a`` (epilogue tile
128); w2 -> ``shuffle_matrix_a``. The three per-expert epilogue scales come from
:func:`~jax_moe.layouts.trtllm_fp8_output_scales`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends.flashinfer_trtllm.common import HIDDEN_ALIGN, default_tile_n, no_tile_limit
from jax_moe.layouts import (
    fp8_padded_intermediate, pad_axis, pad_gate_up, reorder_rows_for_gated_act_gemm, shuffle_matrix_a,
    swap_w13_to_w31, trtllm_fp8_output_scales,
)
from jax_moe.quant import fp8 as fp8_format


def refusal(cfg, quant) -> str | None:
    """What this scheme's contract refuses in ``quant`` (None: nothing)."""
    if quant.act != "fp8_per_tensor":
        return f"FP8 needs per-tensor activation scales (act='fp8_per_tensor'), not {quant.act!r}"
    if quant.a13_scale is None or quant.a2_scale is None:
        return "FP8 needs static a13_scale and a2_scale (the runner re-quantizes with them)"
    for name in ("w13_scale", "w2_scale"):
        if np.ndim(getattr(quant, name)) > 1:
            return f"{name} is per channel; the runner takes per-tensor or per-expert weight scales"
    return None


def kernel_dims(cfg) -> tuple[int, int]:
    """(H, I) the kernel runs with: I padded (:func:`jax_moe.layouts.fp8_padded_intermediate`)."""
    return cfg.hidden_size, fp8_padded_intermediate(cfg.intermediate_size)


default_tile = default_tile_n


def prepare_fp8_weights(w13, w2):
    """FP8 weights ``w13 [E, 2I, H]`` (vLLM's ``[gate; up]``) and ``w2 [E, H, I]`` (float8_e4m3fn, or
    any float dtype, cast) -> the runner's ``(w13 [E, 2Ip, H], w2 [E, H, Ip])`` float8_e4m3fn,
    ``Ip = fp8_padded_intermediate(I)``: I zero-padded (gate/up halves each), w13 rows
    ``[up; gate]`` then interleaved then ``shuffle_matrix_a``; w2 ``shuffle_matrix_a``."""
    w13, w2 = jnp.asarray(w13), jnp.asarray(w2)
    if w13.ndim != 3 or w2.ndim != 3:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {list(w13.shape)} and {list(w2.shape)}")
    e, h, i = w2.shape
    if w13.shape != (e, 2 * i, h):
        raise ValueError(f"w13 must have shape {[e, 2 * i, h]} for w2 {list(w2.shape)}, got {list(w13.shape)}")
    if h % HIDDEN_ALIGN:
        raise ValueError(f"w2: hidden size {h} must be a multiple of {HIDDEN_ALIGN}")
    ip = fp8_padded_intermediate(i)
    w13 = pad_gate_up(w13.astype(jnp.float8_e4m3fn), ip)
    w2 = pad_axis(w2.astype(jnp.float8_e4m3fn), ip, -1)
    w13 = shuffle_matrix_a(reorder_rows_for_gated_act_gemm(swap_w13_to_w31(w13)))
    return w13, shuffle_matrix_a(w2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
    """FP8 per-tensor weights in the runner's layout (a pytree; from :func:`prepare`).

    w13 float8_e4m3fn [E, 2Ip, H], w2 float8_e4m3fn [E, H, Ip] (:func:`prepare_fp8_weights`);
    float32 ``out1_scale [E]`` (``output1_scales_scalar``), ``out1_gate_scale [E]``,
    ``out2_scale [E]`` (:func:`jax_moe.layouts.trtllm_fp8_output_scales`); ``a13_scale []`` the
    static input scale x is quantized with; ``intermediate`` the unpadded I (static)."""

    w13: jax.Array
    w2: jax.Array
    out1_scale: jax.Array
    out1_gate_scale: jax.Array
    out2_scale: jax.Array
    a13_scale: jax.Array
    intermediate: int = dataclasses.field(default=0, metadata=dict(static=True))
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))
    scheme: str = dataclasses.field(default="fp8", metadata=dict(static=True))


PREPARED = Prepared


def prepare(w13, w2, cfg, quant) -> Prepared:
    """Stored FP8 experts (per-tensor or per-expert weight scales, static activation scales) ->
    :class:`Prepared`."""
    e = jnp.shape(w13)[0]
    w13_scale = jnp.broadcast_to(jnp.asarray(quant.w13_scale, jnp.float32), (e,))
    w2_scale = jnp.broadcast_to(jnp.asarray(quant.w2_scale, jnp.float32), (e,))
    a13 = jnp.max(jnp.asarray(quant.a13_scale, jnp.float32))
    a2 = jnp.max(jnp.asarray(quant.a2_scale, jnp.float32))
    scales = trtllm_fp8_output_scales(w13_scale, a13, w2_scale, a2)
    w13p, w2p = prepare_fp8_weights(w13, w2)
    return Prepared(w13p, w2p, jnp.broadcast_to(scales.output1_scales_scalar, (e,)),
                    jnp.broadcast_to(scales.output1_scales_gate_scalar, (e,)),
                    jnp.broadcast_to(scales.output2_scales_scalar, (e,)), a13,
                    intermediate=int(jnp.shape(w2)[2]), activation=cfg.activation)


def kernel_sizes(prepared: Prepared) -> tuple[int, int, int, int]:
    return prepared.w13.shape[0], prepared.w13.shape[2], prepared.w13.shape[2], prepared.w2.shape[2]


def check_x(prepared: Prepared, x) -> None:
    """x [T, H] against the weights' H (and the weights against each other)."""
    h = x.shape[1]
    e, n1, hw = prepared.w13.shape
    ip = prepared.w2.shape[2]
    if hw != h or prepared.w2.shape[:2] != (e, h) or n1 != 2 * ip:
        raise ValueError(f"x [T, {h}] does not match prepared w13 {list(prepared.w13.shape)} / "
                         f"w2 {list(prepared.w2.shape)}")


max_tile_n = no_tile_limit


def input_shapes(prepared: Prepared, num_tokens: int, hk: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((num_tokens, hk), jnp.float8_e4m3fn),)


def quantize_input(x, prepared: Prepared, hk: int) -> tuple[jax.Array, ...]:
    return (fp8_format.quantize_fp8_static(x.astype(jnp.float32), prepared.a13_scale),)


def operands(prepared: Prepared, xs, ids, w) -> tuple:
    """The custom call's operands after x's (``xs``) and the routing (ids, w)."""
    return (xs[0], ids, w, prepared.w13, prepared.w2, prepared.out1_scale, prepared.out1_gate_scale,
            prepared.out2_scale)
