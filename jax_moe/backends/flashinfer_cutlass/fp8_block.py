"""Scheme ``fp8_block`` of ``backend="flashinfer_cutlass"``: DeepSeek-V3 FP8 block scales on
FlashInfer's CUTLASS fused-MoE runner (SM90), the parts that are this scheme's own.

What runs: ``CutlassMoeFCRunner<bf16, fp8>`` with ``use_deepseek_fp8_block_scale`` (FlashInfer's
``cutlass_fused_moe(..., use_deepseek_fp8_block_scale=True)``). Both GEMMs are TensorRT-LLM's FP8
block-scale grouped GEMM: it quantizes its bf16 input itself -- per token, per 128 columns along
K, dynamic ``amax / 448`` (``QuantConfig(scheme="fp8_block", act="fp8_per_group")``, the xla
backend's ``fp8_per_group``) -- and multiplies FP8 x FP8, applying the 1 x 128 activation and
128 x 128 weight scales per K block. GEMM1's output goes through the activation in bf16, GEMM2's
through the weighted top-k reduce. One kernel (no tactic list, no autotuning).

Weights (:func:`prepare_fp8_block_weights`, once, at load time) are the stored block-quantized
ones (:mod:`jax_moe.quant.fp8`, block (128, 128)) in the layout of
:mod:`jax_moe.layouts.blockscale`: w13's rows and their scales' rows as ``[up; gate]``.
Requirements: H and I multiples of 128, w13 in ``[gate; up]`` (concat) order for a gated
activation (alternating rows cannot keep whole 128-row scale blocks), scales finite and positive.
The handler is ``jax_moe_flashinfer_cutlass_moe_fp8_block`` (ffi/flashinfer/fp8_block_handler.cu).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_moe.backends.flashinfer_cutlass import native
from jax_moe.backends.flashinfer_cutlass.common import (
    GATED, NAME, Prepared, extras, runner_row_order, stored_operands,
)
from jax_moe.layouts import FP8_BLOCK_SCALE, fp8_block_scale_shape, swap_w13_to_w31_block_scales
from jax_moe.quant.scheme import check_finite_positive

SCHEME = "fp8_block"
BLOCK = (FP8_BLOCK_SCALE, FP8_BLOCK_SCALE)  # the only weight block the kernel reads


def refusal(cfg, quant) -> str | None:
    """Why the runner cannot serve this layer with ``quant`` (a fp8_block QuantConfig), or None.
    Checks what is known without weights: activation format, block shape, sizes, row order."""
    if quant.act != "fp8_per_group":
        return (f"FP8 block scale runs with activations quantized per token per 128 columns "
                f"(act='fp8_per_group'), not {quant.act!r}")
    block = tuple(getattr(quant, "block_shape", None) or BLOCK)  # info's stand-in has none: the default
    if block != BLOCK:
        return f"FP8 block scale needs block_shape {BLOCK} (the kernel's), not {block}"
    if cfg.hidden_size % FP8_BLOCK_SCALE or cfg.intermediate_size % FP8_BLOCK_SCALE:
        return (f"FP8 block scale needs H and I multiples of {FP8_BLOCK_SCALE}, got H={cfg.hidden_size} "
                f"I={cfg.intermediate_size}")
    if cfg.gated and cfg.gate_up_layout != "concat":
        return ("FP8 block scale needs w13 as [gate; up] (gate_up_layout='concat'): alternating rows "
                "do not keep whole 128-row scale blocks")
    return None


def prepare_fp8_block_weights(w13, w13_scale, w2, w2_scale, activation: str = "silu"):
    """Stored DeepSeek-V3 FP8 experts -> the runner's operands, once, at load time.

    In: ``w13 [E, N1, H]`` float8_e4m3fn (``N1 = 2I`` rows ``[gate; up]`` for a gated
    activation, ``I`` for ``relu2``), ``w13_scale [E, N1/128, H/128]`` float32, ``w2 [E, H, I]``
    float8_e4m3fn, ``w2_scale [E, H/128, I/128]`` float32 (dequantization scales of 128 x 128
    blocks, :func:`jax_moe.quant.fp8.quantize_fp8_block`).
    Out: ``(w13, w13_scale, w2, w2_scale)``, same shapes and dtypes, in the layout of
    :mod:`jax_moe.layouts.blockscale`: gated w13 rows ``[up; gate]``
    (:func:`jax_moe.layouts.swap_w13_to_w31`) and its scale rows likewise
    (:func:`jax_moe.layouts.swap_w13_to_w31_block_scales`); w2 and its scales unchanged.
    Raises ValueError naming the argument for a wrong dtype or shape, H or I not a multiple of
    128, or (when concrete) a NaN, infinite or non-positive scale.
    """
    w13, s13, w2, s2 = stored_operands(w13, w13_scale, w2, w2_scale, jnp.float8_e4m3fn, activation)
    e, h, i = w2.shape
    n1 = 2 * i if GATED[activation] else i
    if w13.shape != (e, n1, h):
        raise ValueError(f"w13 must have shape {[e, n1, h]} for w2 {list(w2.shape)} and activation "
                         f"{activation!r}, got {list(w13.shape)}")
    want = {"w13_scale": (s13, (e,) + fp8_block_scale_shape(n1, h, "w13")),
            "w2_scale": (s2, (e,) + fp8_block_scale_shape(h, i, "w2"))}
    for name, (a, shape) in want.items():
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {list(shape)} (E, rows/128, K/128), got {list(a.shape)}")
        check_finite_positive(name, a)
    if GATED[activation]:
        w13 = runner_row_order(w13, activation)
        s13 = swap_w13_to_w31_block_scales(s13, i)
    return w13, s13, w2, s2


def prepare(w13, w2, cfg, quant, *, w13_bias=None, w2_bias=None) -> Prepared:
    """A ``Prepared`` with the operands of :func:`prepare_fp8_block_weights` (scales in
    ``w13_block_scale`` / ``w2_block_scale``) and the optional operands (biases, SwigluBias
    parameters) in the runner's layout."""
    extra = extras(cfg, w13_bias, w2_bias)
    why = refusal(cfg, quant)
    if why:
        raise ValueError(f"{NAME}: {why}")
    w13p, s13, w2p, s2 = prepare_fp8_block_weights(w13, quant.w13_scale, w2, quant.w2_scale, cfg.activation)
    return Prepared(w13p, w2p, w13_block_scale=s13, w2_block_scale=s2, scheme=SCHEME,
                    activation=cfg.activation, **extra)


def check_prepared(prepared, x) -> None:
    """ValueError unless ``prepared`` holds this scheme's operands in the layout's shapes and
    dtypes (the handler checks them again)."""
    e, n1, h = prepared.w13.shape
    i = prepared.w2.shape[2]
    for name, a, dt in (("w13", prepared.w13, jnp.float8_e4m3fn), ("w2", prepared.w2, jnp.float8_e4m3fn)):
        if a.dtype != dt:
            raise ValueError(f"prepared.{name} must be float8_e4m3fn, got {np.dtype(a.dtype).name} (use prepare())")
    for name, rows, k in (("w13_block_scale", n1, h), ("w2_block_scale", h, i)):
        sc = getattr(prepared, name)
        want = (e,) + fp8_block_scale_shape(rows, k, name)
        if sc is None or tuple(sc.shape) != want or sc.dtype != jnp.float32:
            raise ValueError(f"prepared.{name} must be float32 {list(want)} (use prepare())")


def call(x, prepared, ids, tw, extra_operands, attrs: dict, x_scale=None):
    """The custom call: x [T, H] (cast to bf16), ``prepared`` (checked by the caller), ids [T, k]
    int32, tw [T, k] float32, ``extra_operands`` the (w13_bias, w2_bias, swiglu) operands (empty
    arrays: none), ``attrs``: only the activation is read (no tactics). Returns y [T, H] bf16."""
    t, h = x.shape
    out, _ = native.custom_call(prepared, t, h, ids.shape[1])(
        x.astype(jnp.bfloat16), prepared.w13, prepared.w2, ids, tw, prepared.w13_block_scale,
        prepared.w2_block_scale, *extra_operands, activation=attrs["activation"])
    return out
