"""The schemes of ``backend="flashinfer_trtllm"``: ``{scheme: module}``, what ``supports``,
``prepare``, the cubin lists and ``apply_prepared`` dispatch through.

Every scheme module has the same parts:

* ``refusal(cfg, quant) -> str | None``: what the scheme's contract refuses in (cfg, quant),
  known without weights or a device (activation format, static scales, block shapes, sizes);
* ``kernel_dims(cfg) -> (H, I)``: the sizes the kernel runs with (padded where the layout pads);
* ``default_tile(num_tokens, top_k, num_experts) -> int``: tokens per CTA tile when the caller
  gives none;
* ``prepare(w13, w2, cfg, quant)``: vLLM-layout weights -> the scheme's prepared pytree
  (``PREPARED``), once, at load time (and ``w13_bias=``, ``w2_bias=`` in the schemes of
  :data:`~jax_moe.backends.flashinfer_trtllm.common.BIAS_SCHEMES`);
* ``kernel_sizes(prepared) -> (E, H, Hk, Ik)``: experts, x's width, the kernel's hidden and
  intermediate sizes;
* ``check_x(prepared, x)``: ValueError when x [T, H] does not match the prepared weights;
  ``max_tile_n(prepared) -> int | None``: the largest tile the runner has kernels for, if below
  the largest of ``TILE_NS``;
* ``input_shapes(prepared, T, Hk)``, ``quantize_input(x, prepared, Hk)``: the activation
  operands the call takes (the shape rule) and x quantized to them;
* ``operands(prepared, xs, ids, w) -> tuple``: every operand of the custom call, in order.
"""

from __future__ import annotations

from jax_moe.backends.flashinfer_trtllm import fp8, fp8_block, mxfp4, nvfp4

SCHEMES = {"fp8": fp8, "nvfp4": nvfp4, "mxfp4": mxfp4, "fp8_block": fp8_block}
PREPARED_TYPES = tuple(mod.PREPARED for mod in SCHEMES.values())


def default_tile(scheme: str, num_tokens: int, top_k: int, num_experts: int) -> int:
    """Tokens per CTA tile when the caller gives none: for the FP4 schemes
    :func:`~jax_moe.backends.flashinfer_trtllm.common.tile_tokens_dim` (vLLM's GPT-OSS MXFP4 rule
    for ``trtllm_fp4_block_scale_moe``, within [8, 64]), else
    :func:`~jax_moe.backends.flashinfer_trtllm.common.default_tile_n`."""
    return SCHEMES[scheme].default_tile(num_tokens, top_k, num_experts)
