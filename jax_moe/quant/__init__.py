"""Quantized formats in pure jnp (jit-able, exact): FP8 E4M3 (per-tensor, per-expert, per-token,
per-channel, 128x128 block, 1x128 group, static), NVFP4, MXFP4, MXFP8, int4 groupwise, and
:class:`QuantConfig`, the contract between formats and backends (:mod:`jax_moe.quant.scheme`).

Scales along blocks always run along the last axis K (the GEMM reduction axis).

NaN and infinity: one rule for every quantizer here (fp8 at every granularity, fp8_block,
NVFP4, MXFP4, MXFP8, int4, and the activations of :func:`quantize_activation`)
------------------------------------------------------------------------------------------
1. A non-finite input (NaN, +inf or -inf) is never quantized to a finite value: it becomes NaN
   in the smallest unit of the format that can hold a NaN. No format here holds an infinity, so
   an infinity becomes NaN too (it is not saturated to the format's maximum).

   * E4M3 elements (fp8 per tensor / expert / token / channel / static, fp8_block, 1 x 128
     groups, MXFP8): the element itself is the E4M3 NaN; its neighbours are untouched.
   * E2M1 elements (NVFP4, MXFP4) and int4 elements hold no NaN, so the *block scale* does:
     NVFP4's E4M3 block scale is NaN (0x7F), MXFP4's E8M0 byte is 0xFF (the E8M0 NaN), int4's
     float32 group scale is NaN. The whole block (16, 32 or g elements along K) dequantizes to
     NaN: never to zeros, never to an infinity among zeros.

2. Every amax (per-tensor, per-expert, per-token, per-block, NVFP4 global scales, dynamic
   activation scales, :func:`calibrate_activation_scale`) is taken over the *finite* elements
   only (:func:`jax_moe.quant.fp8.finite_absmax`). A NaN or an infinity therefore never moves the
   scale of the finite values around it: with a dynamic per-tensor activation scale, one token
   holding NaN leaves every other token quantized exactly as without it.

3. A finite value beyond the range a (static) scale allows saturates to the format's largest
   magnitude (+-448 for E4M3, +-6 for E2M1, [-8, 7] for int4), as before.

Dequantization propagates: a NaN element or a NaN scale gives NaN. The CUDA kernels of
``ffi/`` are held to this rule only on finite inputs.
"""

from types import ModuleType as _ModuleType

from jax_moe.quant.fp4 import (
    dequantize_mxfp4,
    dequantize_mxfp8,
    dequantize_nvfp4,
    e2m1_decode,
    e2m1_encode,
    nvfp4_global_scale,
    pack_fp4,
    quantize_mxfp4,
    quantize_mxfp8,
    quantize_nvfp4,
    unpack_fp4,
)
from jax_moe.quant.fp8 import (
    dequantize_fp8,
    dequantize_fp8_block,
    dequantize_fp8_per_token_group,
    quantize_fp8_block,
    quantize_fp8_per_channel,
    quantize_fp8_per_expert,
    quantize_fp8_per_tensor,
    quantize_fp8_per_token,
    quantize_fp8_per_token_group,
    quantize_fp8_static,
)
from jax_moe.quant.int4 import dequantize_int4, pack_int4, quantize_int4, unpack_int4
from jax_moe.quant.scheme import (
    QuantConfig,
    calibrate_activation_scale,
    dequantize_experts,
    dequantize_weights,
    quantize_activation,
    quantize_weights,
)

# everything imported above, and nothing else (the submodules stay reachable by attribute)
__all__ = sorted(n for n, v in globals().items() if not n.startswith("_") and not isinstance(v, _ModuleType))
