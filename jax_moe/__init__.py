"""jax_moe: Mixture-of-Experts kernels for JAX.

The data path, top-down: ``select_experts`` (routing) -> ``fused_experts`` (prepare, experts,
finalize) -> ``[T, H]``. ``fused_moe`` does both; ``MoEBlock`` is the Flax NNX module.
"""

from jax_moe.config import ACTIVATIONS, MoEConfig
from jax_moe.routing import select_experts
from jax_moe.experts import fused_experts, fused_moe
from jax_moe.quant.scheme import QuantConfig, quantize_weights
from jax_moe.nn import MoEBlock

__all__ = [
    "ACTIVATIONS",
    "MoEConfig",
    "QuantConfig",
    "quantize_weights",
    "select_experts",
    "fused_experts",
    "fused_moe",
    "MoEBlock",
]

__version__ = "0.1.0"

