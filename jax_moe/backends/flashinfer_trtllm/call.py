"""The call plumbing of ``backend="flashinfer_trtllm"``: the shape rules (:func:`kernel_sizes`,
:func:`input_shapes`, :func:`output_shapes`), the checks before lowering (:func:`check_call`), x
quantized for the scheme (:func:`quantize_input`) and the custom call (:func:`apply_prepared`),
each scheme's part from its module (:data:`~jax_moe.backends.flashinfer_trtllm.schemes.SCHEMES`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends.flashinfer_trtllm import native
from jax_moe.backends.flashinfer_trtllm.common import (
    ACTIVATION_CODES, MAX_TOP_K, NAME, TARGETS, TILE_NS, scheme_id,
)
from jax_moe.backends.flashinfer_trtllm.schemes import PREPARED_TYPES, SCHEMES, default_tile


def output_shapes(num_tokens: int, hidden: int, workspace_bytes: int):
    """The call's results: ``out`` bfloat16 [T, H] and the workspace uint8 [bytes] (the shape rule;
    ``hidden`` is the kernel's H: padded for MXFP4, :func:`kernel_sizes`)."""
    return (jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16),
            jax.ShapeDtypeStruct((max(1, workspace_bytes),), jnp.uint8))


def kernel_sizes(prepared) -> tuple[int, int, int, int]:
    """``(E, H, Hk, Ik)`` of a prepared layer: experts, the model's hidden size (x's width), and
    the hidden and intermediate sizes the kernel runs with (MXFP4: padded; else H, I or Ip)."""
    if not isinstance(prepared, PREPARED_TYPES):
        raise ValueError(f"prepared must be one of {NAME}'s {', '.join(c.__name__ for c in PREPARED_TYPES)} "
                         f"(from prepare()), got {type(prepared).__name__}")
    return SCHEMES[prepared.scheme].kernel_sizes(prepared)


def input_shapes(prepared, num_tokens: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The activation operands the call takes for ``num_tokens`` rows (:func:`quantize_input`'s
    results): ``fp8`` e4m3 [T, H]; ``fp8_block`` e4m3 [T, H] and float32 scales [H/128, T];
    ``nvfp4`` uint8 [T, H/2] and e4m3 block-16 scales [T, H/16]; ``mxfp4`` bf16 [T, Hp], or with
    act ``mxfp8`` e4m3 [T, Hp] and uint8 E8M0 scales [T, Hp/32] (scales in the linear layout)."""
    _, _, hk, _ = kernel_sizes(prepared)
    return SCHEMES[prepared.scheme].input_shapes(prepared, num_tokens, hk)


def quantize_input(x, prepared) -> tuple[jax.Array, ...]:
    """x [T, H] float -> the activation operands of :func:`input_shapes`: ``fp8`` static per-tensor
    FP8 (``a13_scale``); ``fp8_block`` FP8 per token per 128 columns, scales transposed to
    ``[H/128, T]``; ``nvfp4`` NVFP4 with the global scale ``a1_gscale``; ``mxfp4`` x zero-padded to
    Hp, as bf16 or MXFP8."""
    _, _, hk, _ = kernel_sizes(prepared)
    return SCHEMES[prepared.scheme].quantize_input(jnp.asarray(x), prepared, hk)


def check_call(x, prepared, topk_weights, topk_ids, tile_n=None):
    """ValueErrors naming the argument, before anything is lowered. Returns (T, H, Ip, E, k)
    with H, Ip the kernel's sizes (:func:`kernel_sizes`)."""
    if not isinstance(prepared, PREPARED_TYPES):
        raise ValueError(f"prepared must be a {NAME}.Prepared (from prepare()), got {type(prepared).__name__}")
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x must be [T, H], got shape {list(getattr(x, 'shape', ()))}")
    mod = SCHEMES[prepared.scheme]
    mod.check_x(prepared, x)
    t = x.shape[0]
    e, _, h, ip = mod.kernel_sizes(prepared)
    if getattr(topk_ids, "ndim", None) != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids must be [T={t}, k], got shape {list(getattr(topk_ids, 'shape', ()))}")
    if jnp.dtype(topk_ids.dtype) != jnp.int32:
        raise ValueError(f"topk_ids must be int32, got {jnp.dtype(topk_ids.dtype).name}")
    if getattr(topk_weights, "shape", None) != topk_ids.shape:
        raise ValueError(f"topk_weights must have topk_ids' shape {list(topk_ids.shape)}, "
                         f"got {list(getattr(topk_weights, 'shape', ()))}")
    k = topk_ids.shape[1]
    if not 1 <= k <= min(MAX_TOP_K, e):
        raise ValueError(f"topk_ids: top_k {k} must be in [1, min({MAX_TOP_K}, E={e})]")
    if tile_n is not None and tile_n not in TILE_NS:
        raise ValueError(f"tile_n must be one of {TILE_NS}, got {tile_n!r}")
    most = mod.max_tile_n(prepared)
    if tile_n is not None and most is not None and tile_n > most:
        raise ValueError(f"tile_n must be at most {most} for MXFP4 with bf16 activations, got {tile_n}")
    return t, h, ip, e, k


def apply_prepared(x, prepared, topk_weights, topk_ids, *, tile_n: int | None = None, config: int = -1):
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on the TRT-LLM gen runner.

    x [T, H] float, quantized here (:func:`quantize_input`: FP8 with ``prepared.a13_scale``; FP8
    per token per 128 columns; NVFP4 with ``a1_gscale``; for MXFP4 zero-padded to Hp, as bf16 or
    MXFP8); topk_weights [T, k] float; topk_ids [T, k] int32 in [0, E); ``prepared``: any of
    :data:`~jax_moe.backends.flashinfer_trtllm.schemes.PREPARED_TYPES`. ``tile_n``: tokens per CTA
    tile (default :func:`~jax_moe.backends.flashinfer_trtllm.schemes.default_tile`); ``config``: the
    runner's config index (-1: its default). -> bf16 [T, H].
    """
    t, h, ip, e, k = check_call(x, prepared, topk_weights, topk_ids, tile_n)
    tile_n = default_tile(prepared.scheme, t, k, e) if tile_n is None else tile_n
    sid = scheme_id(prepared.scheme, getattr(prepared, "act", None))
    native.register()
    ws = native.workspace_size(t, h, ip, e, k, prepared.activation, tile_n, config, sid)
    attrs = dict(activation=np.int64(ACTIVATION_CODES[prepared.activation]), tile_n=np.int64(tile_n),
                 config=np.int64(config), enable_pdl=True)
    xs = quantize_input(x, prepared)
    args = SCHEMES[prepared.scheme].operands(prepared, xs, topk_ids, topk_weights.astype(jnp.float32))
    out, _ = jax.ffi.ffi_call(TARGETS[prepared.scheme], output_shapes(t, h, ws), vmap_method="sequential")(*args, **attrs)
    hm = kernel_sizes(prepared)[1]
    return out if hm == h else out[:, :hm]  # MXFP4: the padded columns of Hp dropped
