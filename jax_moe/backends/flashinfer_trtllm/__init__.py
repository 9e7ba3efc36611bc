"""FlashInfer's TRT-LLM gen fused MoE (SM100: tcgen05 batched GEMMs from prebuilt cubins) as XLA
FFI custom calls -- ``backend="flashinfer_trtllm"``.

:mod:`.common` (handlers, limits, tile rules), :mod:`.native` (the built module), :mod:`.cubins`
(where the kernels are read from), one module per scheme's weight preparation (:mod:`.fp8`,
:mod:`.mxfp4`, :mod:`.nvfp4`, :mod:`.fp8_block`) in the table of :mod:`.schemes`, :mod:`.call`
(shape rules, checks, the custom call) and :mod:`.backend` (``supports``, ``prepare``, ``apply``).
"""

from jax_moe.backends.flashinfer_trtllm.backend import apply, config_refusal, prepare, scheme_refusal, supports
from jax_moe.backends.flashinfer_trtllm.call import (
    apply_prepared, check_call, input_shapes, kernel_sizes, output_shapes, quantize_input,
)
from jax_moe.backends.flashinfer_trtllm.common import (
    ACTIVATION_CODES, FEATURES, HIDDEN_ALIGN, MAX_EXPERTS, MAX_TOP_K, NAME, SCHEME_IDS, SMS, TARGETS, TILE_NS,
    default_tile_n, scheme_id, scheme_of, tile_tokens_dim,
)
from jax_moe.backends.flashinfer_trtllm.cubins import CUBIN_ENV, cubin_root, missing_cubins, required_cubins
from jax_moe.backends.flashinfer_trtllm.fp8 import Prepared, prepare_fp8_weights
from jax_moe.backends.flashinfer_trtllm.fp8_block import (
    Fp8BlockPrepared, prepare_fp8_block, prepare_fp8_block_weights, restore_fp8_block_weights,
)
from jax_moe.backends.flashinfer_trtllm.mxfp4 import (
    Mxfp4Prepared, prepare_mxfp4, prepare_mxfp4_weights, restore_mxfp4_weights,
)
from jax_moe.backends.flashinfer_trtllm.native import _module, _state, compiled_schemes, workspace_size
from jax_moe.backends.flashinfer_trtllm.nvfp4 import (
    Nvfp4Prepared, prepare_nvfp4, prepare_nvfp4_weights, restore_nvfp4_weights,
)
from jax_moe.backends.flashinfer_trtllm.schemes import PREPARED_TYPES, default_tile
