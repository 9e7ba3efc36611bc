"""The native part of ``backend="flashinfer_trtllm"``: ``jax_moe._jax_moe_trtllm``, loading it,
what it serves, registering its FFI targets, the workspace it asks for.

Built (``cmake/flashinfer_trtllm.cmake``) only when an SM100-family arch (``100a``, ``100f``,
``103a``) is among ``JAX_MOE_CUDA_ARCHS`` and FlashInfer's sources and its TRT-LLM gen cubin pack
headers are found. The workspace (routing tables, permuted activations, GEMM outputs, the GEMMs'
own scratch) is a second ``uint8`` result of the call whose size the module computes at trace time
(:func:`workspace_size`); nothing is allocated inside the handler.
"""

from __future__ import annotations

import functools

from jax_moe.backends.flashinfer_trtllm.common import ACTIVATION_CODES
from jax_moe.ffi import load_once, register_module_targets

_state = {"module": None, "error": None, "registered": False}


def _import():
    from jax_moe import _jax_moe_trtllm  # noqa: PLC0415

    return _jax_moe_trtllm


def _not_built(err) -> str:
    return (f"jax_moe._jax_moe_trtllm is not built (needs JAX_MOE_CUDA_ARCHS with 100a, FlashInfer's sources "
            f"and its TRT-LLM gen cubin pack headers: cmake/flashinfer_trtllm.cmake): {err}")


def _module():
    """``jax_moe._jax_moe_trtllm`` or None (the reason recorded in ``_state``)."""
    return load_once(_state, _import, _not_built)


def compiled_schemes() -> tuple[str, ...]:
    """The schemes the native module serves (empty when it is not importable)."""
    mod = _module()
    return () if mod is None else tuple(mod.schemes())


def register() -> None:
    """Register the module's FFI targets once (RuntimeError with the reason when it did not load)."""
    register_module_targets(_state, _module())


@functools.lru_cache(maxsize=None)
def workspace_size(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                   activation: str = "silu", tile_n: int = 8, config: int = -1, scheme: int = 0) -> int:
    """Bytes of the uint8 workspace result (asks the module; needs an SM100 device). ``hidden``,
    ``inter``: the kernel's sizes (:func:`jax_moe.backends.flashinfer_trtllm.call.kernel_sizes`); ``scheme``:
    :func:`jax_moe.backends.flashinfer_trtllm.common.scheme_id`."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return int(mod.workspace_size(num_tokens, hidden, inter, num_experts, top_k,
                                  ACTIVATION_CODES[activation], tile_n, config, scheme=scheme))
