"""FlashInfer CuteDSL MoE (SM100, NVFP4) -- ``backend="flashinfer_cutedsl"``.

vLLM's ``FlashInferCuteDSLExperts`` on the batched activation format (``[E, C, H]`` rows grouped
per expert, ``counts [E]`` used), every GEMM FlashInfer's block-scaled masked grouped GEMM
(:func:`jax_moe.backends.nvfp4_masked_gemm.masked_grouped_gemm_nvfp4`)::

    a1, a1_sf = quantize_batched(x, g_a1, counts)                # NVFP4 rows, 128x4 scale tiles
    h = gemm(a1, a1_sf, w13, w13_sf, counts, 1 / (g_a1 * g_w13))  # [E, C, 2I] bf16
    a2, a2_sf = quantize_batched(silu(gate) * up, g_a2, counts)  # float32 activation, requantized
    y = gemm(a2, a2_sf, w2, w2_sf, counts, 1 / (g_a2 * g_w2))     # [E, C, H] bf16

``g_*`` are quantization-side global scales: the weights' ``w*_global_scale [E]``, the
activations' from :func:`jax_moe.quant.scheme.nvfp4_activation_global_scale` (static ``1 /
a_scale``, the max over experts when given per expert, as the ``xla`` backend; or dynamic, over
the used rows). The activation and the requantization run in jnp between the two custom calls.
Weights: the stored NVFP4 format of :class:`jax_moe.QuantConfig` (w13 gate rows then up rows, no
swap); :func:`prepare_weights` swizzles the block scales to 128x4 tiles once, and
:func:`apply_batched_prepared` runs the expert stage on them (the batched format; not the
``prepare``/``apply_prepared`` pair of :class:`jax_moe.backends.base.PreparedBackend`, whose
calls take tokens and routing).

:func:`apply` (the standard format, for ``fused_experts``) packs the routed tokens into
``[E, T, H]`` in jnp, runs :func:`apply_batched`, and reduces with the routing weights: a
convenience, not the native path (``E * T * H`` memory).

Status: the launch path is written and compiles for ``sm_100a`` without a GPU
(``tests/test_flashinfer_cutedsl.py``, marker ``cutedsl_compile``); it has not run on an SM100
GPU. The oracle therefore serves it only when forced (``backend=`` or ``JAX_MOE_BACKEND``; it is
not in ``oracle.AUTO``, so ``JAX_MOE_FLASHINFER_MOE_BACKEND=masked_gemm`` only moves its reason first).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_moe.backends import cutedsl_probe
from jax_moe.backends.nvfp4_masked_gemm import ALIGN_K, masked_grouped_gemm_nvfp4, quantize_batched
from jax_moe.layouts.scales import block_scale_interleave
from jax_moe.quant.scheme import nvfp4_activation_global_scale

NAME = "flashinfer_cutedsl"
FEATURES = frozenset()  # no biases, no router weight on input; NVFP4 weights only
SMS = (100, 103)
ACTIVATIONS = ("silu",)

__all__ = ["supports", "prepare_weights", "apply_batched_prepared", "apply_batched", "apply", "CuteDslWeights"]


class CuteDslWeights(NamedTuple):
    """NVFP4 weights as the masked GEMM takes them: packed E2M1 ``w13 [E, 2I, H/2]``,
    ``w2 [E, H, I/2]`` uint8; their block scales as 128x4 tiles (float8_e4m3fn); the
    quantization-side global scales ``[E]`` float32."""

    w13: jax.Array
    w13_sf: jax.Array
    w13_global_scale: jax.Array
    w2: jax.Array
    w2_sf: jax.Array
    w2_global_scale: jax.Array


def _config_refusal(activation: str, gated: bool, gate_up_layout: str, h: int, i: int, quant) -> str | None:
    """Why this backend cannot run a layer (None when it can)."""
    if quant is None or quant.scheme != "nvfp4":
        return f"does not serve scheme {'bf16' if quant is None else quant.scheme!r} (serves nvfp4)"
    if quant.act != "nvfp4":
        return f"runs NVFP4 activations (W4A4), not act={quant.act!r}"
    if activation not in ACTIVATIONS or not gated:
        return f"activation {activation!r} is not wired up (have {', '.join(ACTIVATIONS)}, gated)"
    if gate_up_layout != "concat":
        return f"gate_up_layout {gate_up_layout!r} is not wired up (have 'concat': gate rows, then up)"
    if h % ALIGN_K or i % ALIGN_K:
        return f"hidden and intermediate sizes (H={h}, I={i}) must be multiples of {ALIGN_K} (16-byte E2M1 rows)"
    return None


def supports(cfg, quant=None, device=None, *, dtype=None) -> tuple[bool, str]:
    """Hardware first, then the scheme, then what this host has (:func:`cutedsl_probe.probe`),
    then the layer's shape and activation. ``dtype`` does not matter (NVFP4 weights only)."""
    from jax_moe.device import device_info  # noqa: PLC0415

    dev = device_info(device)
    if dev.sm not in SMS:
        return False, f"needs SM100/SM103; this device is {dev.describe()}"
    if quant is None or quant.scheme != "nvfp4":
        return False, f"does not serve scheme {'bf16' if quant is None else quant.scheme!r} (serves nvfp4)"
    ok, why = cutedsl_probe.probe()
    if not ok:
        return False, why
    refusal = _config_refusal(cfg.activation, cfg.gated, cfg.gate_up_layout, cfg.hidden_size,
                              cfg.intermediate_size, quant)
    if refusal:
        return False, refusal
    return True, "ok"


def prepare_weights(w13, w2, quant) -> CuteDslWeights:
    """Stored NVFP4 weights (:class:`jax_moe.QuantConfig` ``scheme="nvfp4"``) -> the kernel's
    format: the block scales swizzled to 128x4 tiles (:func:`jax_moe.layouts.block_scale_interleave`)."""
    if quant is None or quant.scheme != "nvfp4":
        raise ValueError(f"{NAME}: quant must be a QuantConfig with scheme 'nvfp4'")
    return CuteDslWeights(jnp.asarray(w13), block_scale_interleave(quant.w13_scale),
                          jnp.asarray(quant.w13_global_scale, jnp.float32),
                          jnp.asarray(w2), block_scale_interleave(quant.w2_scale),
                          jnp.asarray(quant.w2_global_scale, jnp.float32))


def _used(counts, c: int):
    return (jnp.arange(c, dtype=jnp.int32)[None, :] < jnp.clip(counts, 0, c)[:, None])[..., None]


def _act_global_scale(quant, stage: int, rows, used):
    """The activation's quantization-side global scale: static, or dynamic over the used rows."""
    static = quant.a13_scale if stage == 1 else quant.a2_scale
    return nvfp4_activation_global_scale(quant, stage, None if static is not None else jnp.where(used, rows, 0.0))


def _check_batched(x, counts, w: CuteDslWeights, cfg) -> None:
    if getattr(x, "ndim", None) != 3:
        raise ValueError(f"x must be [E, C, H], got shape {list(getattr(x, 'shape', ()))}")
    e, _, h = x.shape
    if w.w13.shape != (e, 2 * cfg.intermediate_size, h // 2):
        raise ValueError(f"w13 must be [E={e}, 2I={2 * cfg.intermediate_size}, H/2={h // 2}] uint8, "
                         f"got {list(w.w13.shape)}")
    if getattr(counts, "shape", None) != (e,) or jnp.dtype(counts.dtype) != jnp.int32:
        raise ValueError(f"counts must be [E={e}] int32, got {list(getattr(counts, 'shape', ()))}")


def apply_batched_prepared(x, counts, weights: CuteDslWeights, cfg, *, quant) -> jax.Array:
    """The expert stage on the batched format: x [E, C, H] float, counts [E] int32 (rows used,
    clamped to [0, C]), ``weights`` from :func:`prepare_weights`, ``quant`` for the activation scales.
    Returns y [E, C, H] in x's dtype, rows at or past ``counts[e]`` zero. No routing weights."""
    refusal = _config_refusal(cfg.activation, cfg.gated, cfg.gate_up_layout, cfg.hidden_size,
                              cfg.intermediate_size, quant)
    if refusal:
        raise ValueError(f"{NAME}: {refusal}")
    _check_batched(x, counts, weights, cfg)
    e, c, _ = x.shape
    i = cfg.intermediate_size
    used = _used(counts, c)
    xf = x.astype(jnp.float32)
    g1 = _act_global_scale(quant, 1, xf, used)
    a1, a1_sf = quantize_batched(xf, g1, counts)
    alpha1 = 1.0 / (g1 * weights.w13_global_scale)
    h = masked_grouped_gemm_nvfp4(a1, a1_sf, weights.w13, weights.w13_sf, counts, alpha1).astype(jnp.float32)
    act = jax.nn.silu(h[..., :i]) * h[..., i:]
    g2 = _act_global_scale(quant, 2, act, used)
    a2, a2_sf = quantize_batched(act, g2, counts)
    alpha2 = 1.0 / (g2 * weights.w2_global_scale)
    y = masked_grouped_gemm_nvfp4(a2, a2_sf, weights.w2, weights.w2_sf, counts, alpha2)
    return y.astype(x.dtype)


def apply_batched(x, counts, w13, w2, cfg, *, quant) -> jax.Array:
    """:func:`apply_batched_prepared` on stored NVFP4 weights (the scales swizzled on every call)."""
    return apply_batched_prepared(x, counts, prepare_weights(w13, w2, quant), cfg, quant=quant)


def _dispatch(x, topk_ids, e: int):
    """Tokens -> the batched format: (xb [E, T, H], counts [E], slot position [T, k]); ids outside
    [0, E) are dropped (their position is T, out of range)."""
    t, k = topk_ids.shape
    ids = topk_ids.reshape(-1)
    valid = (ids >= 0) & (ids < e)
    onehot = jax.nn.one_hot(jnp.where(valid, ids, e), e, dtype=jnp.int32)  # [T*k, E]
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - 1) * onehot, axis=1)
    pos = jnp.where(valid, pos, t)
    src = jnp.repeat(jnp.arange(t), k)
    xb = jnp.zeros((e, t, x.shape[1]), x.dtype).at[jnp.where(valid, ids, 0), pos].set(x[src], mode="drop")
    return xb, jnp.minimum(jnp.sum(onehot, axis=0), t).astype(jnp.int32), pos.reshape(t, k)


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input=False, **_):
    """``fused_experts``' entry (standard format x [T, H]): dispatch to ``[E, T, H]`` in jnp,
    :func:`apply_batched`, weighted top-k reduce. No biases, no router weight on input."""
    if w13_bias is not None or w2_bias is not None or apply_router_weight_on_input:
        raise ValueError(f"{NAME}: biases and apply_router_weight_on_input are not supported")
    e = cfg.num_experts
    xb, counts, pos = _dispatch(x, topk_ids, e)
    yb = apply_batched(xb, counts, w13, w2, cfg, quant=quant)
    ids = jnp.clip(topk_ids, 0, e - 1)
    y = yb.at[ids, pos].get(mode="fill", fill_value=0).astype(jnp.float32)  # [T, k, H]
    valid = ((topk_ids >= 0) & (topk_ids < e))[..., None]
    out = jnp.sum(jnp.where(valid, y, 0.0) * topk_weights[..., None].astype(jnp.float32), axis=1)
    return out.astype(x.dtype)
