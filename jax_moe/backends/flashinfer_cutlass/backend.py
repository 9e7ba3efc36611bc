"""The backend's entry points (:mod:`jax_moe.backends.base`): ``supports``, ``prepare``,
``apply_prepared`` and ``apply``, each dispatching to the scheme's module through
:data:`~jax_moe.backends.flashinfer_cutlass.schemes.SCHEMES`."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_moe.backends.flashinfer_cutlass import native, tuning
from jax_moe.backends.flashinfer_cutlass.common import (
    ACTIVATION_CODES, ALIGN, FLOAT_SCHEMES, GATED, NAME, NO_TACTICS, PACK, PADDED, PREQUANTIZED, TARGETS,
    Prepared, not_compiled, problem_sizes, scheme_of, weights_hidden,
)
from jax_moe.backends.flashinfer_cutlass.schemes import SCHEMES


def supports(cfg, quant=None, device=None, *, dtype=None) -> tuple[bool, str]:
    """Whether this backend serves ``cfg`` (a :class:`jax_moe.config.MoEConfig`) with ``quant``
    on ``device``, and why not. ``dtype``: the unquantized weights' dtype (float16: scheme
    ``f16``; the oracle passes it from the call's features). In order: the scheme's own contract,
    the device and build, the activation, the sizes."""
    scheme = scheme_of(quant, dtype)
    if scheme not in SCHEMES:
        return False, f"scheme {scheme!r} is not built yet (this build serves {native.served()})"
    why = SCHEMES[scheme].refusal(cfg, quant)
    if why:
        return False, why
    ok, why = native.available(device)
    if not ok:
        return False, why
    if scheme not in native.compiled_schemes():
        return False, not_compiled(scheme)
    if cfg.activation not in ACTIVATION_CODES:
        return False, f"activation {cfg.activation!r} is not wired up (have {sorted(ACTIVATION_CODES)})"
    align = ALIGN[scheme]
    if scheme not in PADDED and (cfg.hidden_size % align or cfg.intermediate_size % align):
        return False, f"hidden and intermediate sizes must be multiples of {align} for {scheme}"
    return True, "ok"  # PADDED: prepare pads H and I to multiples of ALIGN


def prepare(w13, w2, cfg, quant=None, *, w13_bias=None, w2_bias=None) -> Prepared:
    """vLLM-layout expert weights (as ``fused_experts`` takes them) -> :class:`Prepared`, once,
    at load time. ``cfg`` is the layer's :class:`jax_moe.config.MoEConfig`; ``quant`` None (bf16,
    or f16 for float16 weights: :func:`~jax_moe.backends.flashinfer_cutlass.unquantized.float_scheme`)
    or a :class:`jax_moe.QuantConfig` (fp8, mxfp4, fp8_block, w4a8) that :func:`supports` accepts;
    biases ``w13_bias [E, 2I]`` (vLLM's row order, like w13) and ``w2_bias [E, H]`` or None."""
    scheme = scheme_of(quant)
    if scheme not in SCHEMES:
        raise ValueError(f"{NAME}: scheme {scheme!r} is not built yet (have {sorted(TARGETS)})")
    return SCHEMES[scheme].prepare(w13, w2, cfg, quant, w13_bias=w13_bias, w2_bias=w2_bias)


def _check_call(x, prepared: Prepared, topk_weights, topk_ids, gemm1_tactic: int, gemm2_tactic: int,
                apply_router_weight_on_input: bool, x_scale) -> None:
    """ValueErrors naming the argument, before anything is lowered: what every scheme checks,
    and the scheme's own (its ``check_prepared``)."""
    activation, scheme = prepared.activation, prepared.scheme
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation {activation!r} not supported by {NAME}")
    if scheme not in SCHEMES:
        raise ValueError(f"prepared.scheme must be one of {sorted(TARGETS)}, got {scheme!r}")
    w13, w2 = prepared.w13, prepared.w2
    t, h = x.shape
    e, hw, i = problem_sizes(prepared)  # hw: the weights' H (PADDED schemes: padded)
    n1, (e2, h3) = w13.shape[1], w2.shape[:2]
    k = topk_ids.shape[1]
    want_n1 = 2 * i if GATED[activation] else i
    hp = weights_hidden(scheme, h)
    if hw != hp or h3 != hp or e2 != e or n1 != want_n1:
        packed = "" if PACK[scheme] == 1 else f"/{PACK[scheme]}"
        raise ValueError(f"shape mismatch: x {x.shape}, w13 {w13.shape}, w2 {w2.shape} (w13 must be "
                         f"[E, {'2I' if GATED[activation] else 'I'}, H{packed}], w2 [E, H, I{packed}]"
                         f"{', H padded to ' + str(hp) if hp != h else ''})")
    SCHEMES[scheme].check_prepared(prepared, x)
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk_weights {topk_weights.shape} / topk_ids {topk_ids.shape} must be [T, k]")
    if apply_router_weight_on_input and k != 1:
        raise ValueError(f"apply_router_weight_on_input needs top_k == 1, got top_k={k}")
    pre_quantized = x.dtype == jnp.float8_e4m3fn
    if pre_quantized and (scheme != PREQUANTIZED or x_scale is None):
        raise ValueError(f"x is float8_e4m3fn: only scheme {PREQUANTIZED!r} takes a pre-quantized x, "
                         "with its x_scale")
    if pre_quantized and apply_router_weight_on_input:
        raise ValueError("apply_router_weight_on_input needs a float x (the weight scales x before quantization)")
    if x_scale is not None and scheme != PREQUANTIZED:
        raise ValueError(f"x_scale is for scheme {PREQUANTIZED!r}, not {scheme!r}")
    if prepared.w13_bias is not None and prepared.w13_bias.shape != (e, n1):
        raise ValueError(f"prepared.w13_bias must be [E, {n1}], got {prepared.w13_bias.shape}")
    if prepared.w2_bias is not None and prepared.w2_bias.shape != (e, hw):
        raise ValueError(f"prepared.w2_bias must be [E, H] = [{e}, {hw}], got {prepared.w2_bias.shape}")
    if activation == "swigluoai" and (prepared.swiglu is None or prepared.swiglu.shape != (3, e)):
        raise ValueError("prepared.swiglu must be [3, E] float32 for swigluoai (use prepare())")
    align = ALIGN[scheme]
    if hw % align or i % align:
        raise ValueError(f"H={hw} and I={i} must be multiples of {align} for scheme {scheme!r}")
    if scheme in NO_TACTICS and (gemm1_tactic != -1 or gemm2_tactic != -1):
        raise ValueError(f"scheme {scheme!r} has no tactics (one block-scale GEMM kernel): leave "
                         "gemm1_tactic and gemm2_tactic at -1")


def apply_prepared(x, prepared: Prepared, topk_weights, topk_ids, *, gemm1_tactic: int = -1,
                   gemm2_tactic: int = -1, apply_router_weight_on_input: bool = False, x_scale=None):
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on the FlashInfer
    CUTLASS runner.

    x [T, H] float; ``prepared`` from :func:`prepare`; topk_weights [T, k] float; topk_ids [T, k]
    int32 in [0, E), or -1 for a slot whose expert lives elsewhere (skipped). With
    ``apply_router_weight_on_input`` (top-1 only) ``y[t] = expert(topk_weights[t] * x[t])``.
    Scheme ``fp8`` also takes x already quantized (float8_e4m3fn,
    :func:`~jax_moe.backends.flashinfer_cutlass.fp8.quantize_input`) with its per-tensor
    ``x_scale`` []; a float x with ``x_scale`` is quantized with that scale.
    Scheme ``mxfp4`` takes x [T, H] with H the layer's unpadded hidden size (``prepared`` holds
    H padded, :func:`~jax_moe.backends.flashinfer_cutlass.mxfp4.prepare_mxfp4_weights`): x is
    zero-padded, the output is [T, H].
    Scheme ``f16`` takes x float16 (or float32) and returns float16; x bfloat16 with float16
    weights (or float16 with ``bf16``'s) is a ValueError.
    Returns [T, H] bf16 (``f16``: float16). ``gemm*_tactic`` index the runner's tactic lists
    (:func:`~jax_moe.backends.flashinfer_cutlass.native.tactics`); with both at -1, a tuned pair
    for this shape is used if one is cached (:mod:`jax_moe.backends.flashinfer_cutlass.tuning`,
    ``JAX_MOE_FI_AUTOTUNE=1`` tunes missing shapes), else the handler's built-in rule.
    """
    _check_call(x, prepared, topk_weights, topk_ids, gemm1_tactic, gemm2_tactic,
                apply_router_weight_on_input, x_scale)
    native.register()
    activation, scheme = prepared.activation, prepared.scheme
    t, k = x.shape[0], topk_ids.shape[1]
    ids, tw = topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32)
    if apply_router_weight_on_input:  # Llama4 top-1: the weight scales the input, not the output
        x = (x.astype(jnp.float32) * tw).astype(x.dtype)
        tw = jnp.ones_like(tw)
    empty = jnp.zeros((0,), FLOAT_SCHEMES.get(scheme, jnp.bfloat16))
    extra_operands = (empty if prepared.w13_bias is None else prepared.w13_bias,
                      empty if prepared.w2_bias is None else prepared.w2_bias,
                      jnp.zeros((0,), jnp.float32) if prepared.swiglu is None else prepared.swiglu)
    if gemm1_tactic == -1 and gemm2_tactic == -1:  # a tuned pair for this shape, if any
        gemm1_tactic, gemm2_tactic = tuning.choice(prepared, int(t), int(k), apply_prepared)
    attrs = dict(activation=np.int64(ACTIVATION_CODES[activation]),
                 gemm1_tactic=np.int64(gemm1_tactic), gemm2_tactic=np.int64(gemm2_tactic))
    return SCHEMES[scheme].call(x, prepared, ids, tw, extra_operands, attrs, x_scale)


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input: bool = False):
    """The oracle's entry point (``fused_experts(..., backend="flashinfer_cutlass")``): w13/w2 in
    vLLM's layout, checked by ``fused_experts``.

    This convenience path repacks w13 on every call (one extra pass over the weights); prepare
    the weights once (:func:`prepare`, or ``MoEBlock.prepare()``) and call :func:`apply_prepared`
    for speed.
    """
    prepared = prepare(w13, w2, cfg, quant, w13_bias=w13_bias, w2_bias=w2_bias)
    out = apply_prepared(x, prepared, topk_weights, topk_ids,
                         apply_router_weight_on_input=apply_router_weight_on_input)
    return out.astype(x.dtype)
