"""Quantized formats in pure jnp (jit-able, exact): FP8 E4M3 (per-tensor, per-expert, per-token,
per-channel, 128x128 block, 1x128 group, static), NVFP4, MXFP4, MXFP8, int4 groupwise, and
:class:`QuantConfig`, the contract between formats and backends (:mod:`jax_moe.quant.scheme`).

Scales along blocks always run along the last axis K (the GEMM reduction axis).
"""

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

__all__ = [
    "QuantConfig",
    "quantize_weights",
    "dequantize_weights",
    "dequantize_experts",
    "quantize_activation",
    "calibrate_activation_scale",
    "quantize_fp8_per_tensor",
    "quantize_fp8_per_expert",
    "quantize_fp8_per_token",
    "quantize_fp8_per_channel",
    "quantize_fp8_block",
    "quantize_fp8_per_token_group",
    "quantize_fp8_static",
    "dequantize_fp8",
    "dequantize_fp8_block",
    "dequantize_fp8_per_token_group",
    "e2m1_encode",
    "e2m1_decode",
    "pack_fp4",
    "unpack_fp4",
    "nvfp4_global_scale",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "quantize_mxfp4",
    "dequantize_mxfp4",
    "quantize_mxfp8",
    "dequantize_mxfp8",
    "quantize_int4",
    "dequantize_int4",
    "pack_int4",
    "unpack_int4",
]
