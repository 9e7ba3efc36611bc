"""Load-time weight repacks for the kernel families, in pure jnp (jit-able, exact).

Each transformation is documented in its module (shapes, dtypes, the permutation in words) and,
where it is a permutation, comes with its exact inverse. Layout constants (epilogue tile 128,
the 128x4 scale tile, pad sizes) live in :mod:`jax_moe.layouts.common` only.

* :mod:`~jax_moe.layouts.common` — constants, zero padding, per-backend padding rules
* :mod:`~jax_moe.layouts.gated`  — gate/up row orders: w13 <-> w31 swap, FlashInfer's gated-act
  row interleave, GPT-OSS pairwise row swap
* :mod:`~jax_moe.layouts.shuffle` — FlashInfer ``shuffle_matrix_a`` / ``shuffle_matrix_sf_a``
* :mod:`~jax_moe.layouts.scales` — the 128x4 block-scale swizzle (NVFP4 ``block_scale_interleave``,
  vLLM ``swizzle_mxfp4_scales``) and the FP8 / NVFP4 alpha scales
* :mod:`~jax_moe.layouts.mixed_gemm` — the SM90 mixed-input GEMM's 4-bit weight interleave and
  folded scales (FlashInfer CUTLASS W4A16 MXFP4)
* :mod:`~jax_moe.layouts.transposed` — the N-contiguous expert layout (``[E, N, K]`` <-> ``[E, K, N]``)
  that the cutlass backend prepares bf16 weights in
* :mod:`~jax_moe.layouts.blockscale` — the FP8 128x128 block-scale operands (FlashInfer CUTLASS
  ``fp8_block``, DeepSeek-V3): stored layout, gated halves swapped for weights and scales alike

Typical compositions (per expert axis carried along):

* FlashInfer TRT-LLM FP8 per-tensor (vLLM's FlashInfer FP8 path): ``w13 = pad_gate_up(w13, fp8_padded_intermediate(I))``,
  ``w2 = pad_axis(w2, Ip)``; ``w13 = shuffle_matrix_a(reorder_rows_for_gated_act_gemm(
  swap_w13_to_w31(w13)))``, ``w2 = shuffle_matrix_a(w2)``; scales from :func:`trtllm_fp8_output_scales`.
* FlashInfer TRT-LLM MXFP4 (vLLM's GPT-OSS MXFP4 path, GPT-OSS interleaved): ``swap_row_pairs`` on w13, its scales
  and bias (``axis=-1``) -- :func:`to_trtllm_gated_rows` -- then ``shuffle_matrix_a`` on weights and
  biases and ``shuffle_matrix_sf_a`` on the scales
  (:func:`jax_moe.backends.flashinfer_trtllm.prepare_mxfp4_weights`; NVFP4 likewise with e4m3
  block-16 scales and no padding: ``prepare_nvfp4_weights``).
* FlashInfer TRT-LLM DeepSeek FP8 block scale: ``swap_w13_to_w31`` on w13 and its block scales,
  then ``convert_to_block_layout(shuffle_matrix_a(w, FP8_BLOCK_EPILOGUE_TILE_M))`` on both weights
  (``prepare_fp8_block_weights``).
* FlashInfer CUTLASS MXFP4 W4A16 on SM90 (GPT-OSS): ``w31`` row order (as bf16) on w13, its
  scales and bias, I and H padded to :data:`MXFP4_PADDING` ``["flashinfer_cutlass"]`` (gate/up
  half by half), then ``interleave_fp4_weights_for_sm90_mixed_gemm`` on the packed weights and
  ``interleave_scales_for_sm90_mixed_gemm`` on the E8M0 scales
  (:func:`jax_moe.backends.flashinfer_cutlass.prepare_mxfp4_weights`).
"""

from jax_moe.layouts.blockscale import (
    fp8_block_scale_shape,
    swap_w13_to_w31_block_scales,
    swap_w31_to_w13_block_scales,
)
from jax_moe.layouts.common import (
    BLOCK_MAJOR_K,
    EPILOGUE_TILE_M,
    FP8_BLOCK_EPILOGUE_TILE_M,
    FP8_BLOCK_SCALE,
    FP8_INTERMEDIATE_ALIGN,
    MIXED_GEMM_K_CHUNK,
    MIXED_GEMM_ROW_GROUP,
    MIXED_GEMM_ROW_HALF,
    MIXED_GEMM_SCALE_K,
    MIXED_GEMM_SCALE_LINE_BYTES,
    MIXED_GEMM_SCALE_ROWS,
    MXFP4_PADDING,
    MXFP4_PADDING_DEFAULT,
    SF_TILE_INNER_M,
    SF_TILE_K,
    SF_TILE_M,
    SF_TILE_OUTER_M,
    SHUFFLE_BLOCK_ROWS_LARGE,
    SHUFFLE_BLOCK_ROWS_SMALL,
    SHUFFLE_ROW_GROUPS,
    MxPadding,
    fp8_padded_intermediate,
    mxfp4_padded_sizes,
    mxfp4_padding,
    pad_axis,
    pad_axis_to_multiple,
    pad_gate_up,
    pad_intermediate_rows,
    round_up,
    shuffle_block_rows,
    unpad_gate_up,
)
from jax_moe.layouts.gated import (
    reorder_rows_for_gated_act_gemm,
    swap_row_pairs,
    swap_w13_to_w31,
    swap_w31_to_w13,
    to_trtllm_gated_rows,
    from_trtllm_gated_rows,
    undo_reorder_rows_for_gated_act_gemm,
)
from jax_moe.layouts.mixed_gemm import (
    FP4_WORD_FIELDS,
    deinterleave_fp4_weights_for_sm90_mixed_gemm,
    deinterleave_int4_weights_for_sm90_mixed_gemm,
    deinterleave_scales_for_sm90_mixed_gemm,
    interleave_fp4_weights_for_sm90_mixed_gemm,
    interleave_int4_weights_for_sm90_mixed_gemm,
    interleave_scales_for_sm90_mixed_gemm,
    mixed_gemm_scale_shape,
)
from jax_moe.layouts.scales import (
    Nvfp4Alphas,
    TrtllmFp8OutputScales,
    block_scale_deinterleave,
    block_scale_interleave,
    fp8_alpha_scales,
    nvfp4_alpha_scales,
    swizzle_mxfp4_scales,
    trtllm_fp8_output_scales,
    trtllm_nvfp4_output_scales,
    unswizzle_mxfp4_scales,
)
from jax_moe.layouts.shuffle import (
    convert_from_block_layout,
    convert_to_block_layout,
    shuffle_matrix_a,
    shuffle_matrix_a_row_indices,
    shuffle_matrix_sf_a,
    unshuffle_matrix_a,
    unshuffle_matrix_sf_a,
)
from jax_moe.layouts.transposed import transpose_experts, transposed_shape

__all__ = [
    "BLOCK_MAJOR_K",
    "EPILOGUE_TILE_M",
    "FP8_BLOCK_EPILOGUE_TILE_M",
    "FP4_WORD_FIELDS",
    "FP8_BLOCK_SCALE",
    "FP8_INTERMEDIATE_ALIGN",
    "MIXED_GEMM_K_CHUNK",
    "MIXED_GEMM_ROW_GROUP",
    "MIXED_GEMM_ROW_HALF",
    "MIXED_GEMM_SCALE_K",
    "MIXED_GEMM_SCALE_LINE_BYTES",
    "MIXED_GEMM_SCALE_ROWS",
    "MXFP4_PADDING",
    "MXFP4_PADDING_DEFAULT",
    "SF_TILE_INNER_M",
    "SF_TILE_K",
    "SF_TILE_M",
    "SF_TILE_OUTER_M",
    "SHUFFLE_BLOCK_ROWS_LARGE",
    "SHUFFLE_BLOCK_ROWS_SMALL",
    "SHUFFLE_ROW_GROUPS",
    "MxPadding",
    "Nvfp4Alphas",
    "TrtllmFp8OutputScales",
    "block_scale_deinterleave",
    "block_scale_interleave",
    "convert_from_block_layout",
    "convert_to_block_layout",
    "deinterleave_fp4_weights_for_sm90_mixed_gemm",
    "deinterleave_int4_weights_for_sm90_mixed_gemm",
    "deinterleave_scales_for_sm90_mixed_gemm",
    "fp8_alpha_scales",
    "fp8_block_scale_shape",
    "fp8_padded_intermediate",
    "from_trtllm_gated_rows",
    "interleave_fp4_weights_for_sm90_mixed_gemm",
    "interleave_int4_weights_for_sm90_mixed_gemm",
    "interleave_scales_for_sm90_mixed_gemm",
    "mixed_gemm_scale_shape",
    "mxfp4_padded_sizes",
    "mxfp4_padding",
    "nvfp4_alpha_scales",
    "pad_axis",
    "pad_axis_to_multiple",
    "pad_gate_up",
    "pad_intermediate_rows",
    "reorder_rows_for_gated_act_gemm",
    "round_up",
    "shuffle_block_rows",
    "shuffle_matrix_a",
    "shuffle_matrix_a_row_indices",
    "shuffle_matrix_sf_a",
    "swap_row_pairs",
    "swap_w13_to_w31",
    "swap_w13_to_w31_block_scales",
    "swap_w31_to_w13",
    "swap_w31_to_w13_block_scales",
    "swizzle_mxfp4_scales",
    "to_trtllm_gated_rows",
    "transpose_experts",
    "transposed_shape",
    "trtllm_fp8_output_scales",
    "trtllm_nvfp4_output_scales",
    "undo_reorder_rows_for_gated_act_gemm",
    "unpad_gate_up",
    "unshuffle_matrix_a",
    "unshuffle_matrix_sf_a",
    "unswizzle_mxfp4_scales",
]
