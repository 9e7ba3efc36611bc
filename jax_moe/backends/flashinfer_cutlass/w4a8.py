"""Scheme ``w4a8`` of ``backend="flashinfer_cutlass"``: signed int4 weights (one scale per 128
along K) x FP8 E4M3 activations on FlashInfer's CUTLASS fused-MoE runner (SM90), the parts that
are this scheme's own. Opt-in build (``JAX_MOE_FI_SCHEMES=...;w4a8``).

What runs
---------
``CutlassMoeFCRunner<__nv_fp8_e4m3, cutlass::uint4b_t, bf16 out, bf16 in>`` -- FlashInfer's
``isW4AFp8Quant`` runner with ``use_w4_group_scaling`` on bf16 activations -- with
``QuantParams::GroupWise(128, w13_scale, w2_scale, fc1_act_scale, fc2_act_scale, zeros = none,
fc1_alpha, fc2_alpha)``. Both GEMMs are the SM90 mixed-input grouped GEMMs (the int4 weights are
the A operand after swap_ab; scale mode kPostMma). Read from FlashInfer 0.7.2.post1's
``cutlass_fused_moe_kernels.cuh`` (``use_w4afp8``, ``expandInputRowsKernel``'s ``PRE_QUANT_AWQ``
branch, ``applyPrequantScale``, ``gemm1``/``gemm2``), ``preQuantScaleKernel.cu`` and the
mixed-input mainloop (``apply_groupwise_scale``). With ``bf(v)`` rounding to bfloat16 (nearest
even) and ``f8(v)`` the conversion to float8_e4m3fn (nearest even, saturating at +-448), the
handler computes, for each token ``t`` and each of its ``k`` slots ``(e, w) = (ids[t, j],
topk_weights[t, j])``:

1. GEMM1's input, quantized by the expand kernel (AWQ's pre-quant multiply, bf16 arithmetic):
   ``xq[c] = f8(bf(x[t, c] * fc1_act_scale[c]))``, ``fc1_act_scale [H]`` bf16, shared by the
   experts. (Without ``fc1_act_scale`` the runner would take the MXFP8 quantizer and fail its
   check; without ``fc2_act_scale`` it would hand GEMM1's bf16 output to GEMM2 as FP8 bytes:
   both are always given.)
2. GEMM1, row ``n`` of ``w13[e]`` (rows ``[up; gate]`` as in every scheme of this backend):
   ``h[n] = bf(fc1_alpha[e] * sum_g s13[e, n, g] * sum_{c in group g} xq[c] * q13[e, n, c])``,
   ``q13`` the int4 codes as integers in [-8, 7] (converted to FP8 exactly; FP8 x FP8 products
   accumulated in float32 per group of 128), ``s13`` the bf16 group scale (as float32), the
   group sums accumulated in float32 (``accum += partial * scale``), ``fc1_alpha [E]`` float32.
3. Bias (bf16, ``w13_bias``) and the activation in float32 on ``h``, rounded to bf16:
   ``a = bf(act(h_gate + b_gate) * (h_up + b_up))`` (or ``act(h + b)`` for ``relu2``).
4. GEMM2's input, quantized by AWQ's ``apply_per_channel_scale`` (bf16 multiply, then FP8):
   ``aq[c] = f8(bf(a[c] * fc2_act_scale[c]))``, ``fc2_act_scale [I]`` bf16.
5. GEMM2 as step 2 with ``w2[e]``, ``s2``, ``fc2_alpha[e]``: ``y = bf(fc2_alpha[e] * ...)``;
   then the finalize kernel: ``out[t] = bf(sum_j w * (y_j + w2_bias[e_j]))`` (float32 sum).

So ``x ~= xq / fc1_act_scale`` and the dequantized product is recovered when
``fc1_alpha * fc1_act_scale == 1``; likewise for GEMM2.

From a ``QuantConfig("w4a8", act="fp8_per_tensor")`` checkpoint (:func:`prepare_w4a8_weights`,
:func:`act_prequant_scale`; once, at load time, pure jnp)
-----------------------------------------------------------------------------------------------
Stored: ``w13 [E, N1, H/2]`` uint8 (int4 codes, :mod:`jax_moe.quant.int4` packing, rows
``[gate; up]`` or alternating per ``gate_up_layout``; N1 = 2I, or I for ``relu2``),
``w13_scale [E, N1, H/128]`` float32 (``w = q * s``), ``w2 [E, H, I/2]``, ``w2_scale
[E, H, I/128]``; static per-tensor activation scales ``a13_scale``, ``a2_scale`` ([] or [E]:
the max over experts, as the xla backend; ``x ~= q * a``). Prepared:

* weights: rows in the runner's order (:func:`jax_moe.backends.flashinfer_cutlass.common.runner_row_order`),
  then the mixed-input GEMM's unit order
  (:func:`jax_moe.layouts.interleave_int4_weights_for_sm90_mixed_gemm`; FlashInfer's
  ``interleave_moe_weights_for_sm90_mixed_gemm(w, "int4")``);
* group scales: the same rows, rounded to bf16 (the kernel's scale type; a relative change of at
  most 2**-8), folded (:func:`jax_moe.layouts.interleave_scales_for_sm90_mixed_gemm` with
  ``group_size=128``: ``[E, R/64, K/128, 8, 8]``; FlashInfer's
  ``interleave_moe_scales_for_sm90_mixed_gemm(s, 128)``);
* ``fc1_act_scale = bf(1 / a13)`` broadcast to [H], ``fc1_alpha = 1 / float32(bf(1 / a13))``
  broadcast to [E] (so ``alpha * pre-quant scale`` is 1 up to float32 rounding: the effective
  activation scale is ``1 / bf(1 / a13)``, within 2**-8 of ``a13``); GEMM2's from ``a2`` alike.
  ``a13_scale = None`` (dynamic): ``a13 = amax(x) / 448`` over the x handed over, per call (as the
  xla backend's dynamic per-tensor scale), the two operands computed in the graph. ``a2_scale``
  must be static: the runner has no amax pass for GEMM2's input.

Requirements: ``act='fp8_per_tensor'`` with a static ``a2_scale``, groups of 128 along K, H and
I multiples of 128, finite positive scales. The handler is
``jax_moe_flashinfer_cutlass_moe_w4a8`` (ffi/flashinfer/moe_handlers.cu, scheme id 5); the
runner's tactic list is the mixed-input one (swap_ab only, never finalize-fused), and the
handler's built-in choice takes only tiles whose K divides the GEMM's K.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_moe.backends.flashinfer_cutlass import native
from jax_moe.backends.flashinfer_cutlass.common import (
    GATED, NAME, Prepared, extras, random_weights, runner_row_order, stored_operands,
)
from jax_moe.layouts import (
    MIXED_GEMM_SCALE_K, interleave_int4_weights_for_sm90_mixed_gemm, interleave_scales_for_sm90_mixed_gemm,
    mixed_gemm_scale_shape,
)
from jax_moe.quant import fp8, int4
from jax_moe.quant.rounding import upcast_kept
from jax_moe.quant.scheme import check_finite_positive

SCHEME = "w4a8"
GROUP = int4.INT4_GROUP  # the only group size the kernel reads (INT4GroupwiseParams::int4_group_size)
SCALE_DTYPE = jnp.bfloat16  # INT4GroupwiseParams::SFA
ALIGN = MIXED_GEMM_SCALE_K  # H and I multiples of 128


def refusal(cfg, quant) -> str | None:
    """Why the runner cannot serve this layer with ``quant`` (a w4a8 QuantConfig), or None.
    Checks what is known without weights: activation format, static a2, group size, sizes."""
    if quant.act != "fp8_per_tensor":
        return (f"W4A8 here quantizes activations to FP8 per tensor (act='fp8_per_tensor'): the "
                f"runner's FP8 quantizers take one static scale per channel, not {quant.act!r}")
    if quant.a2_scale is None:
        return ("W4A8 needs a static a2_scale: the runner quantizes the activation output with a "
                "fixed pre-quant scale (calibrate one with calibrate_activation_scale)")
    block = tuple(getattr(quant, "block_shape", None) or (1, GROUP))
    if block != (1, GROUP):
        return f"W4A8 needs int4 groups of {GROUP} along K (block_shape (1, {GROUP})), the kernel's; got {block}"
    if cfg.hidden_size % ALIGN or cfg.intermediate_size % ALIGN:
        return (f"W4A8 needs H and I multiples of {ALIGN} (the folded scale blocks), got "
                f"H={cfg.hidden_size} I={cfg.intermediate_size}")
    return None


def act_prequant_scale(a_scale):
    """A per-tensor FP8 dequantization scale ``a`` ([] or [E]: the max over experts) -> the
    runner's ``(pre-quant scale bf(1 / a) [] bfloat16, alpha 1 / float32(bf(1 / a)) [] float32)``
    (module docstring). Broadcast by the caller to [H] or [I] and [E]."""
    a = jnp.max(jnp.asarray(a_scale, jnp.float32))
    pq = (jnp.float32(1.0) / a).astype(SCALE_DTYPE)
    return pq, jnp.float32(1.0) / upcast_kept(pq)  # 1 / the rounded value, on a GPU too


def prepare_w4a8_weights(w13, w13_scale, w2, w2_scale, activation: str = "silu",
                         gate_up_layout: str = "concat"):
    """Stored W4A8 experts -> the runner's weight operands, once, at load time.

    In: ``w13 [E, N1, H/2]`` uint8 (two int4 codes per byte), ``w13_scale [E, N1, H/128]``
    float32, ``w2 [E, H, I/2]`` uint8, ``w2_scale [E, H, I/128]`` float32 (module docstring).
    Out: ``(w13, w13_scale, w2, w2_scale)``: the weights uint8, same shapes, rows ``[up; gate]``
    for a gated activation, in the mixed-input GEMM's unit order; the scales bfloat16, same rows,
    folded: ``[E, N1/64, H/128, 8, 8]`` and ``[E, H/64, I/128, 8, 8]``.
    Raises ValueError naming the argument for a wrong dtype or shape, H or I not a multiple of
    128, or (when concrete) a NaN, infinite or non-positive scale.
    """
    w13, s13, w2, s2 = stored_operands(w13, w13_scale, w2, w2_scale, jnp.uint8, activation)
    e, h, i2 = w2.shape
    i = 2 * i2
    if h % ALIGN or i % ALIGN:
        raise ValueError(f"W4A8 needs H and I multiples of {ALIGN}, got H={h} I={i} (from w2 {list(w2.shape)})")
    n1 = 2 * i if GATED[activation] else i
    want = {"w13": (w13, (e, n1, h // 2)), "w13_scale": (s13, (e, n1, h // GROUP)),
            "w2_scale": (s2, (e, h, i // GROUP))}
    for name, (a, shape) in want.items():
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {list(shape)} for w2 {list(w2.shape)} and "
                             f"activation {activation!r}, got {list(a.shape)}")
    check_finite_positive("w13_scale", s13)
    check_finite_positive("w2_scale", s2)
    w13 = runner_row_order(w13, activation, gate_up_layout)
    s13 = runner_row_order(s13, activation, gate_up_layout)
    fold = lambda s: interleave_scales_for_sm90_mixed_gemm(s.astype(SCALE_DTYPE), group_size=GROUP)  # noqa: E731
    return (interleave_int4_weights_for_sm90_mixed_gemm(w13), fold(s13),
            interleave_int4_weights_for_sm90_mixed_gemm(w2), fold(s2))


def prepare(w13, w2, cfg, quant, *, w13_bias=None, w2_bias=None) -> Prepared:
    """A ``Prepared`` with the operands of :func:`prepare_w4a8_weights` (scales in
    ``w13_block_scale`` / ``w2_block_scale``), the activation operands (``fc1_act_scale [H]``,
    ``g1_alphas [E]``, ``a13_scale []``: None when a13 is dynamic; ``fc2_act_scale [I]``,
    ``g2_alphas [E]``) and the optional operands (biases, SwigluBias parameters) in the runner's
    layout."""
    extra = extras(cfg, w13_bias, w2_bias)
    why = refusal(cfg, quant)
    if why:
        raise ValueError(f"{NAME}: {why}")
    w13p, s13, w2p, s2 = prepare_w4a8_weights(w13, quant.w13_scale, w2, quant.w2_scale,
                                               cfg.activation, cfg.gate_up_layout)
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    for name in ("a13_scale", "a2_scale"):
        if getattr(quant, name) is not None:
            check_finite_positive(name, getattr(quant, name))
    pq2, al2 = act_prequant_scale(quant.a2_scale)
    act = dict(fc2_act_scale=jnp.broadcast_to(pq2, (i,)), g2_alphas=jnp.broadcast_to(al2, (e,)))
    if quant.a13_scale is not None:
        pq1, al1 = act_prequant_scale(quant.a13_scale)
        act.update(a13_scale=jnp.max(jnp.asarray(quant.a13_scale, jnp.float32)),
                   fc1_act_scale=jnp.broadcast_to(pq1, (h,)), g1_alphas=jnp.broadcast_to(al1, (e,)))
    return Prepared(w13p, w2p, w13_block_scale=s13, w2_block_scale=s2, scheme=SCHEME,
                    activation=cfg.activation, **act, **extra)


def input_operands(x, prepared):
    """GEMM1's quantizer operands for ``x [T, H]``: ``(fc1_act_scale [H] bf16, fc1_alpha [E]
    float32)``, the prepared ones for a static a13, else from ``amax(x) / 448`` (dynamic)."""
    if prepared.fc1_act_scale is not None:
        return prepared.fc1_act_scale, prepared.g1_alphas
    e, h = prepared.w13.shape[0], x.shape[1]
    pq, al = act_prequant_scale(fp8.amax_to_scale(jnp.max(jnp.abs(x.astype(jnp.float32)))))
    return jnp.broadcast_to(pq, (h,)), jnp.broadcast_to(al, (e,))


def check_prepared(prepared, x) -> None:
    """ValueError unless ``prepared`` holds this scheme's operands in their shapes and dtypes
    (the handler checks them again)."""
    w13, w2 = prepared.w13, prepared.w2
    for name, a in (("w13", w13), ("w2", w2)):
        if a.dtype != jnp.uint8:
            raise ValueError(f"prepared.{name} must be uint8 (two int4 codes per byte), got "
                             f"{np.dtype(a.dtype).name} (use prepare())")
    e, n1, h = w13.shape[0], w13.shape[1], 2 * w13.shape[2]
    i = 2 * w2.shape[2]
    for name, rows, k in (("w13_block_scale", n1, h), ("w2_block_scale", h, i)):
        sc = getattr(prepared, name)
        want = (e,) + mixed_gemm_scale_shape(rows, k, GROUP, 2)
        if sc is None or tuple(sc.shape) != want or sc.dtype != SCALE_DTYPE:
            raise ValueError(f"prepared.{name} must be bfloat16 {list(want)} (use prepare())")
    vecs = [("fc2_act_scale", (i,), SCALE_DTYPE), ("g2_alphas", (e,), jnp.float32)]
    if (prepared.fc1_act_scale is None) != (prepared.g1_alphas is None):
        raise ValueError("prepared.fc1_act_scale and prepared.g1_alphas must both be set (static "
                         "a13) or both None (dynamic) (use prepare())")
    if prepared.fc1_act_scale is not None:
        vecs += [("fc1_act_scale", (h,), SCALE_DTYPE), ("g1_alphas", (e,), jnp.float32)]
    for name, shape, dt in vecs:
        a = getattr(prepared, name)
        if a is None or tuple(a.shape) != shape or a.dtype != dt:
            raise ValueError(f"prepared.{name} must be {np.dtype(dt).name} {list(shape)} (use prepare())")


def call(x, prepared, ids, tw, extra_operands, attrs: dict, x_scale=None):
    """The custom call: x [T, H] (cast to bf16), ``prepared`` (checked by the caller), ids
    [T, k] int32, tw [T, k] float32, ``extra_operands`` the (w13_bias, w2_bias, swiglu) operands
    (empty arrays: none), ``attrs`` (activation, gemm1_tactic, gemm2_tactic). Returns y [T, H] bf16."""
    t, h = x.shape
    pq1, al1 = input_operands(x, prepared)
    out, _ = native.custom_call(prepared, t, h, ids.shape[1])(
        x.astype(jnp.bfloat16), prepared.w13, prepared.w2, ids, tw, prepared.w13_block_scale,
        prepared.w2_block_scale, pq1, prepared.fc2_act_scale, al1.astype(jnp.float32),
        prepared.g2_alphas, *extra_operands, **attrs)
    return out


def random_operands(scheme: str, keys, num_experts: int, n1: int, hidden: int, inter: int) -> dict:
    """Stand-in int4 codes, bf16 group scales 2**-4 and unit activation scales for timing tactics."""
    w13, w2 = random_weights(keys, num_experts, n1, hidden, inter, jnp.uint8)
    ones = jnp.ones((num_experts,), jnp.float32)
    return dict(w13=w13, w2=w2,
                w13_block_scale=jnp.full((num_experts,) + mixed_gemm_scale_shape(n1, hidden, GROUP, 2), 2.0 ** -4,
                                         SCALE_DTYPE),
                w2_block_scale=jnp.full((num_experts,) + mixed_gemm_scale_shape(hidden, inter, GROUP, 2), 2.0 ** -4,
                                        SCALE_DTYPE),
                fc1_act_scale=jnp.ones((hidden,), SCALE_DTYPE), g1_alphas=ones,
                fc2_act_scale=jnp.ones((inter,), SCALE_DTYPE), g2_alphas=ones)
