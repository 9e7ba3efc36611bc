"""The native parts of ``backend="flashinfer_cutlass"``: loading them, what they were built with,
registering their FFI targets, and the custom call each scheme makes.

``jax_moe._jax_moe_flashinfer`` (nanobind glue) and ``libjax_moe_fi.so`` (the runner, its kernels
and the FFI handlers) are built by ``cmake/flashinfer_moe.cmake`` when ``JAX_MOE_WITH_FLASHINFER``
is on and FlashInfer's sources are found. The workspace comes from XLA as a second (discarded)
``uint8`` result whose size the module computes at trace time (:func:`workspace_size`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_moe.backends.flashinfer_cutlass.common import (
    ACTIVATION_CODES, FLOAT_SCHEMES, NO_TACTICS, SCHEME_IDS, TARGETS, problem_sizes,
)
from jax_moe.device import sm90_module_ready
from jax_moe.ffi import load_once, register_module_targets

_state = {"module": None, "error": None, "registered": False}


def _import():
    from jax_moe import _jax_moe_flashinfer  # noqa: PLC0415  (not built, or built without FlashInfer's sources)

    return _jax_moe_flashinfer


def _module():
    """``jax_moe._jax_moe_flashinfer`` or None (the reason recorded in ``_state``)."""
    return load_once(_state, _import, lambda err: f"jax_moe._jax_moe_flashinfer is not importable: {err}")


def compiled_schemes() -> tuple[str, ...]:
    """The schemes this build's native module serves (empty when it is not importable)."""
    mod = _module()
    if mod is None:
        return ()
    mask = mod.compiled_schemes() if hasattr(mod, "compiled_schemes") else 1
    return tuple(name for name, sid in SCHEME_IDS.items() if mask >> sid & 1)


def served() -> str:
    """The schemes this build serves, in words: ``"bf16, fp8, mxfp4"``, or ``"nothing: "`` and why."""
    have = compiled_schemes()
    return ", ".join(have) if have else f"nothing: {_state['error'] or 'the module compiles no scheme'}"


def available(device=None) -> tuple[bool, str]:
    """Whether the custom calls can run on ``device`` (default: JAX's default device), and why not."""
    ok, why = sm90_module_ready(_module(), _state["error"], device)
    if not ok:
        return False, why
    return True, f"FlashInfer CUTLASS fused MoE (SM90; {', '.join(compiled_schemes())})"


def register() -> None:
    """Register the module's FFI targets once (RuntimeError with the reason when it did not load)."""
    register_module_targets(_state, _module())


@functools.lru_cache(maxsize=None)
def workspace_size(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                   activation: str = "silu", scheme: str = "bf16") -> int:
    """Bytes of scratch the custom call needs (asks the runner; needs a CUDA device)."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return int(mod.workspace_size(num_tokens, hidden, inter, num_experts, top_k,
                                  ACTIVATION_CODES[activation], SCHEME_IDS[scheme]))


def tactics(gemm_id: int, scheme: str = "bf16"):
    """The runner's tactic list for GEMM 1 or 2: ``[(index, description, compiled)]`` (empty for
    ``fp8_block``: its block-scale GEMM is one kernel)."""
    if scheme in NO_TACTICS:
        return []
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return list(mod.tactics(gemm_id, SCHEME_IDS[scheme]))


def custom_call(prepared, num_tokens: int, hidden: int, top_k: int):
    """``prepared.scheme``'s FFI call for ``num_tokens`` rows of width ``hidden`` (the layer's,
    unpadded) and ``top_k`` slots each. Its results (the shape rule): ``out [T, H]`` bfloat16
    (``f16``: float16) and the workspace ``[W]`` uint8, W asked of the runner at trace time for the
    prepared problem (:func:`jax_moe.backends.flashinfer_cutlass.common.problem_sizes`)."""
    e, hw, i = problem_sizes(prepared)
    ws = workspace_size(int(num_tokens), int(hw), int(i), int(e), int(top_k), prepared.activation,
                        prepared.scheme)
    out = jax.ShapeDtypeStruct((num_tokens, hidden), FLOAT_SCHEMES.get(prepared.scheme, jnp.bfloat16))
    return jax.ffi.ffi_call(TARGETS[prepared.scheme], (out, jax.ShapeDtypeStruct((ws,), jnp.uint8)),
                            vmap_method="sequential")
