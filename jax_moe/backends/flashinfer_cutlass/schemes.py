"""The schemes of ``backend="flashinfer_cutlass"``: ``{scheme: module}``, what ``supports``,
``prepare``, ``apply_prepared`` and the tactic tuner dispatch through.

Every scheme module has the same parts:

* ``refusal(cfg, quant) -> str | None``: what the scheme's contract refuses, known without
  weights or a device (activation format, static scales, block shapes, sizes);
* ``prepare(w13, w2, cfg, quant, *, w13_bias=None, w2_bias=None) -> Prepared``: vLLM-layout
  weights (as ``fused_experts`` takes them) -> the runner's operands, once, at load time;
* ``check_prepared(prepared, x)``: ValueError for operands of the wrong shape or dtype, before
  anything is lowered (the shapes every scheme shares are checked by the caller);
* ``call(x, prepared, ids, tw, extra_operands, attrs, x_scale=None) -> [T, H]``: the custom call
  (ids [T, k] int32, tw [T, k] float32, ``extra_operands`` the (w13_bias, w2_bias, swiglu)
  operands, ``attrs`` the activation and tactics);
* ``random_operands(scheme, keys, E, N1, H, I) -> dict``: stand-in operands for timing tactics
  (not in the schemes without tactics, :data:`~jax_moe.backends.flashinfer_cutlass.common.NO_TACTICS`).
"""

from __future__ import annotations

from jax_moe.backends.flashinfer_cutlass import fp8, fp8_block, mxfp4, unquantized, w4a8

SCHEMES = {"bf16": unquantized, "f16": unquantized, "fp8": fp8, "mxfp4": mxfp4, "fp8_block": fp8_block,
           "w4a8": w4a8}
