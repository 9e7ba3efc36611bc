"""FlashInfer's CUTLASS fused-MoE runner (TensorRT-LLM ``CutlassMoeFCRunner``) as an XLA FFI
custom call -- ``backend="flashinfer_cutlass"`` (draft).

Scope of this build: SM90 (Hopper, ``sm_90a``), bf16 activations x bf16 weights -> bf16 output,
activations ``silu`` (gated), ``gelu`` (gated, erf form) and ``relu2`` (not gated). Routing
happens before: the call takes top-k ids and weights.

Weight layout. The runner reads GEMM1's output as ``[up | gate]``: rows ``[0, I)`` of each
expert's ``w13`` are the linear ("up", w3) half and rows ``[I, 2I)`` the gate (w1) half, and
computes ``act(gate) * up``. vLLM's ``w13`` is ``[gate; up]`` (w1 then w3), so
:func:`prepare_weights` swaps the halves once at load time ("w31" order). ``w2`` is used as is
(``[E, H, I]``).

The native module is ``jax_moe._jax_moe_flashinfer`` (built by ``cmake/flashinfer_moe.cmake``
when ``JAX_MOE_WITH_FLASHINFER`` is on and FlashInfer's sources are found). Its workspace comes
from XLA as a second (discarded) ``uint8`` result whose size the module computes at trace time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.layouts import swap_w13_to_w31, undo_reorder_rows_for_gated_act_gemm

NAME = "flashinfer_cutlass"
TARGET = "jax_moe_flashinfer_cutlass_moe"

# jax_moe activation name -> TensorRT-LLM ActivationType value (cutlass_kernels/include/common.h)
ACTIVATION_CODES = {"silu": 3, "gelu": 4, "relu2": 6}  # Swiglu, Geglu, Relu2
GATED = {"silu": True, "gelu": True, "relu2": False}
ALIGN = 8  # H and I must be multiples of 8 bf16 elements (16-byte TMA alignment)

_state = {"module": None, "error": None, "registered": False}


def _module():
    if _state["module"] is None and _state["error"] is None:
        try:
            from jax_moe import _jax_moe_flashinfer as mod  # noqa: PLC0415

            _state["module"] = mod
        except ImportError as e:  # not built, or built without FlashInfer sources
            _state["error"] = f"jax_moe._jax_moe_flashinfer is not importable: {e}"
    return _state["module"]


def available(device=None) -> tuple[bool, str]:
    """Whether the custom call can run on ``device`` (default: JAX's default device), and why not."""
    from jax_moe.device import device_info

    dev = device_info(device)
    if dev.sm != 90:
        return False, f"needs SM90 (this build compiles sm_90a only); this device is {dev.describe()}"
    if _module() is None:
        return False, _state["error"]
    return True, "FlashInfer CUTLASS fused MoE (SM90, bf16)"


def supports(cfg, quant=None, device=None) -> tuple[bool, str]:
    """Whether this backend serves ``cfg`` (a :class:`jax_moe.config.MoEConfig`) on ``device``."""
    if quant is not None:
        return False, f"scheme {quant.scheme!r} is not built yet (bf16 only so far)"
    ok, why = available(device)
    if not ok:
        return False, why
    if cfg.expert_shard:
        return False, "expert-parallel shards (ids of -1) are not wired to the runner yet"
    if cfg.activation not in ACTIVATION_CODES:
        return False, f"activation {cfg.activation!r} is not wired up (have {sorted(ACTIVATION_CODES)})"
    if cfg.hidden_size % ALIGN or cfg.intermediate_size % ALIGN:
        return False, f"hidden and intermediate sizes must be multiples of {ALIGN}"
    return True, "ok"


def _register():
    if _state["registered"]:
        return
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    _state["registered"] = True


def prepare_weights(w13, w2, activation: str = "silu", gate_up_layout: str = "concat"):
    """vLLM-layout expert weights -> this backend's layout (run once, at load time).

    ``w13 [E, 2I, H]`` holding ``[gate; up]`` (``gate_up_layout="concat"``) or alternating
    gate/up rows (``"interleaved"``) becomes ``[up; gate]`` in bf16; ``w2 [E, H, I]`` is cast to
    bf16. Not-gated activations (``relu2``: ``w13 [E, I, H]``) are only cast.
    """
    w13 = jnp.asarray(w13)
    if GATED.get(activation, True):
        if gate_up_layout == "interleaved":
            w13 = undo_reorder_rows_for_gated_act_gemm(w13)  # -> [gate; up]
        elif gate_up_layout != "concat":
            raise ValueError(f"unknown gate_up_layout {gate_up_layout!r}")
        w13 = swap_w13_to_w31(w13)  # [gate; up] -> [up; gate]
    return w13.astype(jnp.bfloat16), jnp.asarray(w2).astype(jnp.bfloat16)


@functools.lru_cache(maxsize=None)
def workspace_size(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                   activation: str = "silu") -> int:
    """Bytes of scratch the custom call needs (asks the runner; needs a CUDA device)."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return int(mod.workspace_size(num_tokens, hidden, inter, num_experts, top_k,
                                  ACTIVATION_CODES[activation]))


def tactics(gemm_id: int):
    """The runner's tactic list for GEMM 1 or 2: ``[(index, description, compiled)]``."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return list(mod.tactics(gemm_id))


def apply_prepared(x, w13, w2, topk_weights, topk_ids, activation: str = "silu", *,
                   gemm1_tactic: int = -1, gemm2_tactic: int = -1):
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on the FlashInfer
    CUTLASS runner.

    x [T, H]; w13 [E, 2I, H] (or [E, I, H] for ``relu2``) **already in this backend's layout**
    (:func:`prepare_weights`); w2 [E, H, I]; topk_weights [T, k] (float32); topk_ids [T, k]
    (int32). Returns [T, H] bf16. ``gemm*_tactic`` index the runner's tactic lists
    (:func:`tactics`); -1 lets the handler pick (deterministic, cached per shape).
    """
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation {activation!r} not supported by {NAME}")
    _register()
    t, h = x.shape
    e, n1, h2 = w13.shape
    e2, h3, i = w2.shape
    k = topk_ids.shape[1]
    want_n1 = 2 * i if GATED[activation] else i
    if h2 != h or h3 != h or e2 != e or n1 != want_n1:
        raise ValueError(f"shape mismatch: x {x.shape}, w13 {w13.shape}, w2 {w2.shape} "
                         f"(w13 must be [E, {'2I' if GATED[activation] else 'I'}, H])")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk_weights {topk_weights.shape} / topk_ids {topk_ids.shape} must be [T, k]")
    ws = workspace_size(int(t), int(h), int(i), int(e), int(k), activation)
    call = jax.ffi.ffi_call(
        TARGET,
        (jax.ShapeDtypeStruct((t, h), jnp.bfloat16), jax.ShapeDtypeStruct((ws,), jnp.uint8)),
    )
    out, _ = call(
        x.astype(jnp.bfloat16),
        w13.astype(jnp.bfloat16),
        w2.astype(jnp.bfloat16),
        topk_ids.astype(jnp.int32),
        topk_weights.astype(jnp.float32),
        activation=np.int64(ACTIVATION_CODES[activation]),
        gemm1_tactic=np.int64(gemm1_tactic),
        gemm2_tactic=np.int64(gemm2_tactic),
    )
    return out


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input: bool = False):
    """The oracle's entry point (``fused_experts(..., backend="flashinfer_cutlass")``): w13/w2 in
    vLLM's layout, checked by ``fused_experts``.

    This convenience path repacks w13 on every call (one extra pass over the weights); load the
    weights once with :func:`prepare_weights` and call :func:`apply_prepared` for speed.
    """
    if quant is not None or w13_bias is not None or w2_bias is not None or apply_router_weight_on_input:
        raise ValueError(f"{NAME} serves unquantized weights without biases or router weight on input so far")
    w13p, w2p = prepare_weights(w13, w2, cfg.activation, cfg.gate_up_layout)
    out = apply_prepared(x, w13p, w2p, topk_weights, topk_ids, cfg.activation)
    return out.astype(x.dtype)
