"""jax_moe's own CUTLASS MoE for Hopper -- ``backend="cutlass"`` (SM90).

One forward, every stage a custom call on the expert-sorted rows (:mod:`jax_moe.kernels`)::

    sort = sort_by_expert(topk_ids, E)                              # jax_moe.ffi
    a1 = permute_rows(x, sort.sorted_slots, k, valid_rows=valid, inverse=sort.inverse)  # [T*k, H] bf16
    h = grouped_gemm(a1, w13, sort.offsets)                         # [T*k, 2I] (I for relu2)
    a2 = act_and_mul(h, activation, valid_rows=valid, layout=..., bias=w13_bias, offsets=sort.offsets)
    y = grouped_gemm(a2, w2, sort.offsets)                          # [T*k, H]
    out = unpermute_reduce(y, sort.inverse, topk_weights, valid_rows=valid,
                           bias=w2_bias, offsets=sort.offsets)      # [T, H]

Decode (at most :data:`jax_moe.decode.MAX_SLOTS` slots, at most one per two experts, a gated
activation, the tile left to the pick): :func:`jax_moe.decode.decode_moe` instead on bf16 weights,
:func:`jax_moe.decode_fp8.decode_moe_fp8` on FP8 ones with per-tensor activation scales
(:func:`jax_moe.decode_fp8.serves`), the same function in two launches with no sort.

Interleaved gate/up rows (``gate_up_layout="interleaved"``: GPT-OSS as stored, or any gated layer
whose w13 was interleaved at load: :func:`prepare`, as ``MoEBlock.prepare()`` calls it,
:mod:`jax_moe.backends.cutlass_prepared`)
let GEMM1 take the activation into its epilogue (:mod:`jax_moe.backends.cutlass_act_gemm`): GEMM1
then writes ``a2 [T*k, I]`` directly and ``act_and_mul`` is not launched, in bf16 and in FP8 with a
static GEMM2 input scale, where it pays: bf16 where GEMM1 runs a pingpong tile or ``coop_128x256`` (the
128x128 cooperative tile is as fast with the separate kernel), FP8 on every tile
(:func:`~jax_moe.backends.cutlass_act_gemm.fuses_activation`, ``JAX_MOE_CUTLASS_FUSED_ACT=all`` to
fuse everywhere, ``=0`` nowhere).

``finalize="scatter"`` (what ``"auto"`` means unless ``JAX_MOE_CUTLASS_FINALIZE=gather`` or XLA's
determinism flags say otherwise; a bf16 output) replaces the last two lines, on every layout of
the weights: GEMM2's epilogue adds each row, times its routing weight (and after its GEMM2 bias), into
its token's output row with bf16 atomics (:mod:`jax_moe.backends.cutlass_scatter_gemm`), so ``y``
is never written nor read back; the order of the adds is free, so the last bits may differ run to
run, as with XLA's own scatter-adds. ``"gather"`` keeps the bit-reproducible float32 sum.

``valid = sort.offsets[E]``: slots whose expert id is outside ``[0, E)`` (expert-parallel ids of
-1) sort last and are skipped. The weights are used as vLLM stores them (``w13 [E, 2I, H]`` gate
rows then up rows, or alternating with ``gate_up_layout="interleaved"``; ``w2 [E, H, I]``, K
contiguous): no repack, no per-call weight pass. ``MoEBlock.prepare()`` (:func:`prepare`)
transposes bf16 weights once at load time (``transposed=True``: w13 [E, H, 2I], w2 [E, I, H], N
contiguous, the faster weight stream on the H100), the same pipeline on the transposed GEMM
kinds. GPT-OSS layers (``swigluoai``, interleaved gate/up, expert biases) run as they are stored:
the activation kernel splits gate and up per the layout and adds each row's GEMM1 bias (its
expert found from the offsets) before the activation, and the un-permute adds each row's GEMM2
bias before the routing weight.

FP8 (``quant=QuantConfig("fp8", ...)``: float8_e4m3fn weights with per-tensor ``[]``, per-expert
``[E]`` or per-channel ``[E, N, 1]`` scales) runs the same pipeline on FP8 rows, each GEMM's
dequantization in its epilogue (``d = acc * a_scale[row] * b_scale[expert, col]``)::

    a1, s1 = permute_rows(x, ..., quant="fp8_per_token" | "fp8_static", scale=a13)   # fused quantization
    h = grouped_gemm(a1, w13, sort.offsets, a_scale=s1, b_scale=w13_scale)          # bf16
    a2, s2 = act_and_mul(h, activation, ..., quant="fp8_per_token" | "fp8_static", scale=a2)
    y = grouped_gemm(a2, w2, sort.offsets, a_scale=s2, b_scale=w2_scale)

Activation scales mean what they mean on the ``xla`` backend (:func:`jax_moe.quant.quantize_activation`):
``fp8_per_token`` is one dynamic scale per row; ``fp8_per_tensor`` takes the static ``a13_scale`` /
``a2_scale`` (the max over experts when given per expert), or, when None, the dynamic
``amax / 448`` of the tensor handed over: all of ``x`` for GEMM1 (as xla quantizes x before routing),
and all routed rows of the activation for GEMM2 (an extra float32 pass over the activation, then a
jnp quantization; the fused path serves static and per-token scales). ``relu2`` quantizes in jnp.
What differs from ``xla``: GEMM1's output is rounded to bf16 before the activation (xla keeps
float32), so a few FP8 values of the GEMM2 input land one step apart; the tests bound the effect.

The GEMMs are :mod:`jax_moe.backends.cutlass_gemm`'s (the custom calls, their shape rules and
jnp references, the tile choice). Here: what this build refuses (:func:`supports`), the pipeline
above (:func:`apply`) and the expert stage on the batched format (:func:`apply_batched`: GEMM1 ->
act_and_mul over all E*C rows -> GEMM2; no routing weights, those belong to the combine), what
:mod:`jax_moe.parallel` runs between dispatch and combine with
``ParallelConfig(expert_format="batched")`` (the oracle feature ``"batched"``); under expert
parallelism CPU-tested on the jnp references, its multi-GPU tests written.

Scope of this build: bf16, and FP8 W8A8 (``act`` ``fp8_per_tensor`` static or dynamic, or
``fp8_per_token``; not ``bf16`` activations on FP8 weights); activations ``silu``, ``gelu`` and
``swigluoai`` (gated; gate/up rows concatenated or interleaved) and ``relu2`` (not gated: its
GEMM1 bias added in jnp); expert biases ``w13_bias`` [E, 2I] / ``w2_bias`` [E, H] on every path
(bf16, FP8, the batched format, training, where the backward returns their gradients); SM90
(``sm_90a``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_moe import decode, decode_fp8, ffi, kernels
from jax_moe.backends import cutlass_vjp
from jax_moe.backends.cutlass_act_gemm import forward_gemm1, gemm1_with_activation
from jax_moe.backends.cutlass_prepared import Prepared, apply_prepared, prepare  # noqa: F401  (MoEBlock.prepare())
from jax_moe.backends.cutlass_scatter_gemm import scattered_gemm2, scatters
from jax_moe.backends.cutlass_vjp import activation as _activation
from jax_moe.backends.cutlass_vjp import act_options, bias_options
from jax_moe.backends.cutlass_gemm import (  # noqa: F401  (the GEMM layer's names, re-exported)
    ALIGN_K,
    ALIGN_N,
    DECODE_ROWS_PER_EXPERT,
    GRAD_KINDS,
    KINDS,
    TILE_ENV,
    TILES,
    _constants_match,
    _module,
    _state,
    available,
    dtype_name,
    grouped_gemm,
    grouped_gemm_batched,
    grouped_gemm_batched_reference,
    grouped_gemm_batched_shape,
    grouped_gemm_reference,
    grouped_gemm_shape,
    pick_tile,
    workspace_size,
)
from jax_moe.config import FLOAT_DTYPES, check_dtype, check_rank, check_shape
from jax_moe.device import sm90_refusal
from jax_moe.layouts.transposed import BF16_ONLY, transposed_shape
from jax_moe.permute import batched_rows_used
from jax_moe.quant import fp8

NAME = "cutlass"
# oracle.call_features: "dtype:" names the unquantized weights' dtype (bf16 here); with quant= the
# call carries no dtype feature and supports() decides from the QuantConfig (scheme "fp8").
# "batched": apply_batched, the expert stage on the batched format.
# "grad": vjp_fwd/vjp_bwd, the backward on this backend's own kernels (bf16 weights).
# "bias": w13_bias [E, 2I] and w2_bias [E, H], in every path (the fused kernels add them).
FEATURES = frozenset({"bias", "router_weight_on_input", "batched", "grad", "dtype:bfloat16"})
ACTIVATIONS = ("silu", "gelu", "swigluoai", "relu2")
FP8_ACTS = ("fp8_per_tensor", "fp8_per_token")  # QuantConfig.act values the FP8 path serves


def _quant_refusal(quant, h: int, i: int) -> str | None:
    """Why this build cannot serve ``quant`` (None when it can): scheme, activation format, K alignment."""
    if quant is None:
        return None
    if quant.scheme != "fp8":
        return f"scheme {quant.scheme!r} is not built yet (have bf16, fp8)"
    if quant.act not in FP8_ACTS:
        return (f"act {quant.act!r} on FP8 weights is not built (have {', '.join(FP8_ACTS)}: "
                "the grouped GEMM is FP8 x FP8)")
    if h % ALIGN_K["fp8"] or i % ALIGN_K["fp8"]:
        return f"FP8 needs hidden and intermediate sizes that are multiples of {ALIGN_K['fp8']} (16-byte rows)"
    return None


def supports(cfg, quant=None, device=None, *, dtype=None) -> tuple[bool, str]:
    """Whether this backend serves ``cfg`` (a :class:`jax_moe.config.MoEConfig`) with ``quant``
    on ``device``, and why not: hardware first, then the scheme, then this build, then shapes.
    ``dtype`` (the unquantized weights'): the oracle refuses other than bfloat16 from ``FEATURES``."""
    why = sm90_refusal(device)
    if why:
        return False, why
    if quant is not None and quant.scheme != "fp8":
        return False, _quant_refusal(quant, cfg.hidden_size, cfg.intermediate_size)
    ok, why = available(device)
    if not ok:
        return False, why
    refusal = _config_refusal(cfg.activation, cfg.gate_up_layout, cfg.hidden_size, cfg.intermediate_size, quant)
    if refusal:
        return False, refusal
    return True, "ok"


def _config_refusal(activation: str, gate_up_layout: str, h: int, i: int, quant) -> str | None:
    """Why this build cannot run a layer (None when it can): the activation, the gate/up layout,
    16-byte rows, the quant scheme. :func:`supports` returns it; the apply functions raise it."""
    if activation not in ACTIVATIONS:
        return f"activation {activation!r} is not wired up (have {', '.join(ACTIVATIONS)})"
    if gate_up_layout not in ("concat", "interleaved"):
        return f"gate_up_layout {gate_up_layout!r} is not wired up (have 'concat', 'interleaved')"
    if h % ALIGN_N or i % ALIGN_N:
        return f"hidden and intermediate sizes (H={h}, I={i}) must be multiples of {ALIGN_N} (16-byte rows)"
    return _quant_refusal(quant, h, i)


def _per_tensor_scale(static, x):
    """``fp8_per_tensor``'s scale for x: the static one (max over experts when [E], as the xla
    backend without expert ids), or the dynamic ``amax(x) / 448``."""
    if static is not None:
        return jnp.max(jnp.asarray(static, jnp.float32))
    return fp8.amax_to_scale(jnp.max(jnp.abs(x.astype(jnp.float32))))


def _quantize_rows(v, act: str, static):
    """float32 rows [M, C] -> (q float8_e4m3fn, a_scale [M] or []) in jnp, as the kernels do."""
    if act == "fp8_per_token":
        q, s = fp8.quantize_fp8_per_token(v)
        return q, s[:, 0]
    s = _per_tensor_scale(static, v)
    return fp8.quantize_fp8_static(v, s), s


def _fp8_gemm1_input(xin, sort, k, valid, quant):
    """GEMM1's FP8 rows and scales: quantization fused into the gather (the scale of a dynamic
    per-tensor act is taken over all of xin first, as the xla backend does)."""
    if quant.act == "fp8_per_token":
        return kernels.permute_rows(xin, sort.sorted_slots, k, valid_rows=valid, quant="fp8_per_token",
                                    inverse=sort.inverse)
    return kernels.permute_rows(xin, sort.sorted_slots, k, valid_rows=valid, quant="fp8_static", inverse=sort.inverse,
                                scale=_per_tensor_scale(quant.a13_scale, xin))


def _fp8_gemm2_input(h1, cfg, valid, quant, offsets=None, b13=None, rows_used=None):
    """GEMM2's FP8 rows and scales: fused into act_and_mul for per-token and static scales; a
    dynamic per-tensor scale needs the whole activation first (float32 pass, jnp quantization),
    over the rows below ``valid`` (and in ``rows_used`` [M] bool where given: the batched format's).
    ``b13`` [E, w13 rows] or None: the rows' expert bias (their experts from ``offsets``)."""
    fused = quant.act == "fp8_per_token" or quant.a2_scale is not None
    if cfg.gated and fused:
        mode = "fp8_per_token" if quant.act == "fp8_per_token" else "fp8_static"
        scale = None if mode == "fp8_per_token" else _per_tensor_scale(quant.a2_scale, None)
        return kernels.act_and_mul(h1, cfg.activation, valid_rows=valid, quant=mode, scale=scale, **act_options(cfg),
                                   **bias_options(b13, offsets))
    a = _activation(h1, cfg, valid, offsets, b13, jnp.float32)
    if rows_used is not None:
        a = jnp.where(rows_used[:, None], a, 0.0)
    return _quantize_rows(a, quant.act, quant.a2_scale)


def _check_biases(w13_bias, w2_bias, w13, w2) -> None:
    """ValueError naming the bias whose shape is not the weights' (w13_bias [E, 2I] ([E, I] for
    relu2: w13's rows), w2_bias [E, H]) or whose dtype is not a float."""
    e, n1, h = w13.shape[0], w13.shape[1], w2.shape[1]
    for name, b, shape, what in (("w13_bias", w13_bias, (e, n1), "[E, 2I]: w13's experts and rows"),
                                 ("w2_bias", w2_bias, (e, h), "[E, H]: w2's experts and rows")):
        if b is None:
            continue
        check_rank(name, b, 2, what)
        check_shape(name, b, shape, what)
        check_dtype(name, b, FLOAT_DTYPES)


def _check_apply(x, w13, w2, topk_weights, topk_ids, cfg, quant, w13_bias, w2_bias,
                 apply_router_weight_on_input, tile) -> None:
    """ValueError for what this build does not take (quant schemes, activations, dtypes, shapes,
    bias shapes)."""
    _check_experts(x, w13, w2, cfg, quant, tile)
    _check_biases(w13_bias, w2_bias, w13, w2)
    t = x.shape[0]
    k = topk_ids.shape[1]
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != t:
        raise ValueError(f"{NAME}: topk_weights {topk_weights.shape} / topk_ids {topk_ids.shape} must be [T, k]")
    if apply_router_weight_on_input and k != 1:
        raise ValueError(f"{NAME}: apply_router_weight_on_input needs top_k == 1, got top_k={k}")


def _stored_views(w13, w2, transposed: bool, quant):
    """(w13, w2) as the checks read them, ``[E, 2I, H]`` and ``[E, H, I]``: the weights themselves,
    or for ``transposed`` ones (w13 [E, H, 2I], w2 [E, I, H]: checked here, bf16 only) their
    swapped shapes and dtypes."""
    if not transposed:
        return w13, w2
    if quant is not None:
        raise ValueError(f"{NAME}: transposed weights are {BF16_ONLY}")
    check_rank("w13", w13, 3, "[E, H, 2I] (transposed)")
    check_rank("w2", w2, 3, "[E, I, H] (transposed)")
    if w2.shape[2] != w13.shape[1] or w2.shape[0] != w13.shape[0]:
        raise ValueError(f"{NAME}: transposed w13 must be [E, H, 2I] and w2 [E, I, H] with one E and H, "
                         f"got w13 {list(w13.shape)}, w2 {list(w2.shape)}")
    return transposed_shape(w13), transposed_shape(w2)


def check_weights(w13, w2, cfg, quant=None, w13_bias=None, w2_bias=None) -> None:
    """ValueError for expert weights this build does not take, as :func:`apply` checks them (x
    aside), and for weights whose shapes are not ``cfg``'s (E, H, I)."""
    check_rank("w13", w13, 3, "[E, 2I, H] ([E, I, H] for relu2)")
    check_rank("w2", w2, 3, "[E, H, I]")
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    check_shape("w2", w2, (e, h, i), "[E, H, I] of the layer's config")
    check_shape("w13", w13, (e, cfg.w13_rows, h), "[E, 2I, H] ([E, I, H] for relu2) of the layer's config")
    _check_experts(jax.ShapeDtypeStruct((1, h), jnp.bfloat16), w13, w2, cfg, quant, None)
    _check_biases(w13_bias, w2_bias, w13, w2)


def _check_experts(x, w13, w2, cfg, quant, tile) -> None:
    """What both formats check of the experts: activation, layout, weight dtypes, shapes against
    x's hidden size (x [..., H]), 16-byte rows, the quant scheme, the tile."""
    want = "bfloat16" if quant is None else "float8_e4m3fn"
    for name, w in (("w13", w13), ("w2", w2)):
        if dtype_name(w) != want:
            raise ValueError(f"{NAME}: {name} must be {want} "
                             f"({'bf16 weights' if quant is None else 'FP8 weights with quant='}), "
                             f"got {dtype_name(w)}")
    h = x.shape[-1]
    e, n1, h2 = w13.shape
    e2, h3, i = w2.shape
    want_n1 = 2 * i if cfg.gated else i
    if h2 != h or h3 != h or e2 != e or n1 != want_n1:
        raise ValueError(f"{NAME}: shape mismatch: x {x.shape}, w13 {w13.shape}, w2 {w2.shape}")
    refusal = _config_refusal(cfg.activation, cfg.gate_up_layout, h, i, quant)
    if refusal:
        raise ValueError(f"{NAME}: {refusal}")
    if tile not in (None, "auto") and tile not in TILES:
        raise ValueError(f"{NAME}: tile must be 'auto' or one of {sorted(TILES)}, got {tile!r}")


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input: bool = False, tile: str | None = "auto", transposed: bool = False,
          finalize: str = "auto") -> jax.Array:
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on jax_moe's CUTLASS
    grouped GEMMs (the oracle's entry point; ``fused_experts`` checks the shapes first).

    x [T, H] float; w13 [E, 2I, H] (gate rows, then up, or alternating per
    ``cfg.gate_up_layout``; [E, I, H] for relu2); w2 [E, H, I]: bfloat16 (x computed in bf16),
    or float8_e4m3fn with ``quant`` a ``QuantConfig("fp8", ...)`` (x quantized from its own
    dtype; see the module note for the scales). topk_weights [T, k] float; topk_ids [T, k] int32
    in [0, E), or outside it (-1: an expert on another rank) for a skipped slot. ``w13_bias``
    [E, 2I] ([E, I] for relu2) and ``w2_bias`` [E, H] float, or None: each expert's
    ``W2[e] act(W13[e] x + b13[e]) + b2[e]``, biases added in float32. With
    ``apply_router_weight_on_input`` (top-1) the weight scales x and the experts' outputs are
    summed. ``tile``: both GEMMs' tile (``"auto"``: each GEMM picks its own from its shape and rows per
    expert, :mod:`jax_moe.backends.cutlass_tiles`). ``transposed``: bf16 w13 [E, H, 2I] and w2
    [E, I, H] (N contiguous; :func:`prepare`'s layout, the faster weight stream), the same
    function. ``finalize``: how each token's k expert rows are summed: ``"gather"`` (the
    un-permute kernel, a float32 sum, bit-reproducible), ``"scatter"`` (GEMM2's epilogue adds each
    weighted row into its token's row with bf16 atomics: no ``[T*k, H]`` round trip, the order of
    the adds free), ``"auto"`` (the scatter where the output is bf16,
    unless the environment asks for determinism: :func:`~jax_moe.backends.cutlass_scatter_gemm.scatters`).
    Returns [T, H] in x's dtype.
    Raises ValueError for what this build does not take: other schemes or activation formats,
    other activations, other weight dtypes, biases of other shapes.
    """
    w13s, w2s = _stored_views(w13, w2, transposed, quant)
    _check_apply(x, w13s, w2s, topk_weights, topk_ids, cfg, quant, w13_bias, w2_bias,
                 apply_router_weight_on_input, tile)
    scatters(finalize, bf16_out=True)  # ValueError: an unknown form
    t, h = x.shape
    e, k = w13.shape[0], topk_ids.shape[1]
    if t == 0:
        return jnp.zeros((0, h), x.dtype)
    decoding = tile in (None, "auto") and not apply_router_weight_on_input and decode.serves(t, k, e, cfg)
    if decoding and quant is None:
        return decode.decode_moe(x, w13, w2, topk_weights, topk_ids.astype(jnp.int32), cfg, w13_bias=w13_bias,
                                 w2_bias=w2_bias, out_dtype=x.dtype, transposed=transposed)
    if decoding and decode_fp8.serves(quant, h, w2.shape[2], k):
        return decode_fp8.decode_moe_fp8(x, w13, w2, topk_weights, topk_ids.astype(jnp.int32), cfg,
                                         a13_scale=_per_tensor_scale(quant.a13_scale, x),
                                         a2_scale=_per_tensor_scale(quant.a2_scale, None), w13_scale=quant.w13_scale,
                                         w2_scale=quant.w2_scale, w13_bias=w13_bias, w2_bias=w2_bias,
                                         out_dtype=x.dtype)
    if quant is None:
        return cutlass_vjp.forward(x, w13, w2, topk_weights, topk_ids, cfg, tile=tile, residuals="recompute",
                                   w13_bias=w13_bias, w2_bias=w2_bias, transposed=transposed,
                                   apply_router_weight_on_input=apply_router_weight_on_input, finalize=finalize)[0]
    tw = topk_weights.astype(jnp.float32)
    sort, valid = ffi.sort_by_expert_valid(topk_ids.astype(jnp.int32), e)  # valid [1]: rows of experts in [0, E)
    # as the xla backend: the router weight scales x in x's dtype, then x is quantized
    xin = (x.astype(jnp.float32) * tw).astype(x.dtype) if apply_router_weight_on_input else x
    a1, s1 = _fp8_gemm1_input(xin, sort, k, valid, quant)
    s13 = jnp.asarray(quant.w13_scale, jnp.float32)
    # where it pays, GEMM1's epilogue takes the scales, the bias, the activation and GEMM2's static quantization
    tile1, fused = forward_gemm1(cfg, quant, tile, a1, w13)
    if fused:
        s2 = _per_tensor_scale(quant.a2_scale, None)
        a2 = gemm1_with_activation(a1, w13, sort.offsets, cfg, w13_bias=w13_bias, tile=tile1, a_scale=s1, b_scale=s13,
                                   out_scale=s2)
    else:
        h1 = grouped_gemm(a1, w13, sort.offsets, a_scale=s1, b_scale=s13, tile=tile1)
        a2, s2 = _fp8_gemm2_input(h1, cfg, valid, quant, sort.offsets, w13_bias)
    s22 = jnp.asarray(quant.w2_scale, jnp.float32)
    if scatters(finalize, bf16_out=jnp.dtype(x.dtype) == jnp.bfloat16):
        return scattered_gemm2(a2, w2, sort, topk_weights, w2_bias=w2_bias, tile=tile, a_scale=s2, b_scale=s22,
                               apply_router_weight_on_input=apply_router_weight_on_input).astype(x.dtype)
    y = grouped_gemm(a2, w2, sort.offsets, a_scale=s2, b_scale=s22, tile=tile)
    return kernels.unpermute_reduce(y, sort.inverse, tw, valid_rows=valid, out_dtype=x.dtype,
                                    apply_router_weight_on_input=apply_router_weight_on_input,
                                    **bias_options(w2_bias, sort.offsets))


def vjp_fwd(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
            apply_router_weight_on_input: bool = False, tile: str | None = "auto", residuals: str = "save"):
    """:func:`apply` on bf16 weights for a differentiated call -> (out [T, H], residuals): the same
    kernels, and what :func:`vjp_bwd` needs (:mod:`jax_moe.backends.cutlass_vjp`; ``residuals``
    ``"save"`` keeps the permuted rows, GEMM1's pre-activation and GEMM2's rows, ``"recompute"``
    only the inputs). ``quant`` must be None (quantized layers are for inference)."""
    if quant is not None:
        raise ValueError(f"{NAME}: a quantized layer is for inference; differentiate float weights")
    _check_apply(x, w13, w2, topk_weights, topk_ids, cfg, None, w13_bias, w2_bias,
                 apply_router_weight_on_input, tile)
    return cutlass_vjp.forward(x, w13, w2, topk_weights, topk_ids, cfg, residuals=residuals,
                               tile=tile, w13_bias=w13_bias, w2_bias=w2_bias,
                               apply_router_weight_on_input=apply_router_weight_on_input)


def vjp_bwd(res, g, cfg, *, quant=None, w13_bias=None, w2_bias=None, apply_router_weight_on_input: bool = False,
            tile: str | None = "auto", residuals: str = "save"):
    """The backward of :func:`vjp_fwd` for the cotangent g [T, H] -> (dx, dw13, dw2, dtopk_weights,
    dw13_bias, dw2_bias) on jax_moe's grouped GEMMs (input gradients against the stored weights,
    weight gradients as a reduction over each expert's rows; a bias's gradient is the sum of its
    expert's rows of the pre-activation / output gradient, None where the call had no bias).
    The biases come from the residuals (``w13_bias``/``w2_bias`` here are not read)."""
    return cutlass_vjp.backward(
        res, g, cfg, residuals=residuals, tile=tile,
        apply_router_weight_on_input=apply_router_weight_on_input)


# ----------------------------------------------------------------------------- the batched expert stage


def _check_apply_batched(x, counts, w13, w2, cfg, quant, w13_bias, w2_bias, tile) -> None:
    check_rank("x", x, 3, "[E, C, H]")
    check_rank("counts", counts, 1, "[E]")
    if jnp.dtype(counts.dtype) != jnp.int32:
        raise ValueError(f"{NAME}: counts must be int32, got {dtype_name(counts)}")
    _check_experts(x, w13, w2, cfg, quant, tile)
    e = w13.shape[0]
    if x.shape[0] != e or counts.shape[0] != e:
        raise ValueError(f"{NAME}: x [E, C, H] and counts [E] must have the weights' E = {e} experts, "
                         f"got x {list(x.shape)}, counts {list(counts.shape)}")
    _check_biases(w13_bias, w2_bias, w13, w2)


def apply_batched(x: jax.Array, counts: jax.Array, w13: jax.Array, w2: jax.Array, cfg, *, quant=None,
                  w13_bias=None, w2_bias=None, tile: str | None = "auto") -> jax.Array:
    """The expert stage on the batched format: ``y[e, r] = expert_e(x[e, r])`` for ``r < counts[e]``.

    What an all-to-all expert-parallel path runs between dispatch and combine, once each device
    holds its tokens grouped per local expert: x [E, C, H] (C a static capacity; rows at or past
    ``counts[e]`` are padding, never read), counts [E] int32 (clamped to [0, C] on the device), the
    weights as :func:`apply` takes them (E here is the experts this call owns: E_local under EP).
    No routing weights: the weighted top-k reduce belongs to the combine. ``w13_bias`` /
    ``w2_bias`` as for :func:`apply`. Returns y [E, C, H] in x's dtype, rows at or past
    ``counts[e]`` zero.

    Pipeline, on E*C rows (row e*C + r is expert e's: offsets ``C * arange(E + 1)``)::

        h = grouped_gemm_batched(x, w13, counts)                      # [E, C, 2I]
        a = act_and_mul(h.reshape(E*C, 2I), activation, bias=b13)    # [E*C, I] (relu2: jnp)
        y = grouped_gemm_batched(a.reshape(E, C, I), w2, counts)     # [E, C, H]
        y = y + b2[e] on the used rows                                # jnp

    act_and_mul runs over every row: the unused rows of h are zeros (GEMM1 writes them so), act(0)
    * 0 = 0 (with a bias not zero, but GEMM2 never reads them, and a dynamic GEMM2 scale is taken
    over the used rows only). FP8 (``quant`` as for :func:`apply`): x is quantized in
    jnp (per-token scales [E, C], or per tensor: the static ``a13_scale``, or the dynamic amax over
    the used rows only); GEMM2's input as in :func:`apply` (fused into act_and_mul for per-token
    and static scales). ``tile``: both GEMMs' (``"auto"``: each GEMM's own pick for E*C rows).

    Where it plugs in: :mod:`jax_moe.parallel` with ``expert_format="batched"`` lays each
    device's received token copies out per local expert (:func:`jax_moe.permute.batched_layout`,
    C = the rows received), calls this, and gathers each slot's row back for the weighted
    reduce before the combine.
    """
    _check_apply_batched(x, counts, w13, w2, cfg, quant, w13_bias, w2_bias, tile)
    e, c, h = x.shape
    i = w2.shape[2]
    if c == 0:
        return jnp.zeros((e, 0, h), x.dtype)
    rows = e * c
    valid = jnp.full((1,), rows, jnp.int32)  # every row: the unused ones are zeros from GEMM1
    offsets = c * jnp.arange(e + 1, dtype=jnp.int32)  # row e*C + r: expert e
    used = batched_rows_used(counts, c)  # [E, C]
    if quant is None:
        h1 = grouped_gemm_batched(x.astype(jnp.bfloat16), w13, counts, tile=tile).reshape(rows, -1)
        a2 = _activation(h1, cfg, valid, offsets, w13_bias)
        y = grouped_gemm_batched(a2.reshape(e, c, i), w2, counts, tile=tile)
    else:
        xf = x.astype(jnp.float32)
        if quant.act == "fp8_per_tensor" and quant.a13_scale is None:  # dynamic: amax over the used rows
            xf = jnp.where(used[..., None], xf, 0.0)
        a1, s1 = _quantize_rows(xf.reshape(rows, h), quant.act, quant.a13_scale)
        h1 = grouped_gemm_batched(a1.reshape(e, c, h), w13, counts, a_scale=_batched_scale(s1, e, c),
                                  b_scale=jnp.asarray(quant.w13_scale, jnp.float32), tile=tile)
        a2, s2 = _fp8_gemm2_input(h1.reshape(rows, -1), cfg, valid, quant, offsets, w13_bias, used.reshape(rows))
        y = grouped_gemm_batched(a2.reshape(e, c, i), w2, counts, a_scale=_batched_scale(s2, e, c),
                                 b_scale=jnp.asarray(quant.w2_scale, jnp.float32), tile=tile)
    if w2_bias is not None:
        y = jnp.where(used[..., None], y.astype(jnp.float32) + w2_bias.astype(jnp.float32)[:, None, :], 0.0)
    return y.astype(x.dtype)


def _batched_scale(s, e: int, c: int):
    """A row scale of the E*C flattened rows ([E*C]) as the batched GEMM takes it ([E, C]); a per
    tensor scale ([]) as it is."""
    return s if s.ndim == 0 else s.reshape(e, c)
