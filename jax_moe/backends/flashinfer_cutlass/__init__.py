"""FlashInfer's CUTLASS fused-MoE runner (TensorRT-LLM ``CutlassMoeFCRunner``, SM90) as XLA FFI
custom calls -- ``backend="flashinfer_cutlass"``.

:mod:`.common` (the scheme registry, row order, :class:`Prepared`), :mod:`.native` (the built
module, its FFI targets), one module per scheme (:mod:`.unquantized` for bf16/f16, :mod:`.fp8`,
:mod:`.mxfp4`, :mod:`.fp8_block`, :mod:`.w4a8`) in the table of :mod:`.schemes`, :mod:`.tuning`
(tactic autotuning) and :mod:`.backend` (``supports``, ``prepare``, ``apply_prepared``, ``apply``).
"""

from jax_moe.backends.flashinfer_cutlass.backend import apply, apply_prepared, prepare, supports
from jax_moe.backends.flashinfer_cutlass.common import (
    ACTIVATION_CODES, ALIGN, F16_NOT_BUILT, FEATURES, FLOAT_SCHEMES, GATED, NAME, PACK, SCHEME_IDS, TARGETS,
    Prepared, alignment, check_stored_operands, partition_specs, problem_sizes, runner_row_order, scheme_of,
)
from jax_moe.backends.flashinfer_cutlass.fp8 import input_scale, quantize_input
from jax_moe.backends.flashinfer_cutlass.fp8_block import prepare_fp8_block_weights
from jax_moe.backends.flashinfer_cutlass.mxfp4 import prepare_mxfp4_weights
from jax_moe.backends.flashinfer_cutlass.native import (
    _module, _state, available, compiled_schemes, tactics, workspace_size,
)
from jax_moe.backends.flashinfer_cutlass.unquantized import float_scheme, prepare_weights
from jax_moe.backends.flashinfer_cutlass.w4a8 import prepare_w4a8_weights
