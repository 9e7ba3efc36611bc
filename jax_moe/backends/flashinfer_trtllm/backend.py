"""The backend's entry points (:mod:`jax_moe.backends.base`): ``supports``, ``prepare`` and
``apply`` (``apply_prepared`` is :mod:`.call`'s), each dispatching to the scheme's module through
:data:`~jax_moe.backends.flashinfer_trtllm.schemes.SCHEMES`.

:func:`supports` checks, in order: the device is SM100/SM103, the module is built, it has the
scheme's handler, the activation and shapes fit, and the cubins the call needs are present
(:func:`~jax_moe.backends.flashinfer_trtllm.cubins.missing_cubins`).
"""

from __future__ import annotations

from jax_moe.backends.flashinfer_trtllm import native
from jax_moe.backends.flashinfer_trtllm.call import apply_prepared
from jax_moe.backends.flashinfer_trtllm.common import (
    BIAS_SCHEMES, CONCAT_ONLY, HIDDEN_ALIGN, KERNELS, MAX_EXPERTS, MAX_TOP_K, MIN_EXPERTS_MULTIPLE, NAME,
    PADDED, SCHEME_ACTIVATIONS, SMS, TARGETS, scheme_of,
)
from jax_moe.backends.flashinfer_trtllm.cubins import cubin_refusal
from jax_moe.backends.flashinfer_trtllm.schemes import SCHEMES
from jax_moe.device import device_info


def scheme_refusal(cfg, quant) -> str | None:
    """What the scheme's contract refuses in (cfg, quant): its own (activation format, static
    scales, block shape, the alignment its layout needs), then the activation, the gate/up
    layout, H, top_k and the expert count (None: nothing)."""
    scheme = scheme_of(quant)
    h = cfg.hidden_size
    why = SCHEMES[scheme].refusal(cfg, quant)
    if why:
        return why
    if cfg.activation not in SCHEME_ACTIVATIONS[scheme]:
        return f"activation {cfg.activation!r} is not wired up (have {list(SCHEME_ACTIVATIONS[scheme])})"
    if getattr(cfg, "gate_up_layout", "concat") != "concat" and scheme in CONCAT_ONLY:
        return "gate_up_layout must be 'concat' ([gate; up] rows)"
    if scheme not in PADDED and h % HIDDEN_ALIGN:  # MXFP4 pads H (mxfp4_padded_sizes)
        return f"hidden size {h} must be a multiple of {HIDDEN_ALIGN}"
    if not 1 <= cfg.top_k <= min(MAX_TOP_K, cfg.num_experts):
        return f"top_k {cfg.top_k} must be in [1, min({MAX_TOP_K}, E)]"
    if cfg.num_experts > MAX_EXPERTS:
        return f"{cfg.num_experts} experts exceed the routing kernels' {MAX_EXPERTS}"
    mult = MIN_EXPERTS_MULTIPLE.get(scheme)
    if mult and cfg.num_experts % mult:
        return f"{cfg.num_experts} experts: {KERNELS[scheme]} needs a multiple of {mult}"
    return None


def config_refusal(cfg, quant) -> str | None:
    """What in (cfg, quant) this build cannot serve, whatever the device (None: nothing): an
    unknown scheme, then the scheme's contract (:func:`scheme_refusal`)."""
    scheme = scheme_of(quant)
    if scheme not in TARGETS:
        return f"does not serve scheme {scheme!r} (serves {', '.join(sorted(TARGETS))})"
    return scheme_refusal(cfg, quant)


def supports(cfg, quant=None, device=None, *, dtype=None) -> tuple[bool, str]:
    """Whether this backend serves ``cfg`` with ``quant`` on ``device``, and why not: the
    hardware, then what this build has (module, scheme, activation, shapes), then the cubins.
    ``dtype`` (the unquantized weights') does not matter: every scheme here is quantized."""
    dev = device_info(device)
    if dev.sm not in SMS:
        cc = "n/a" if dev.capability is None else f"{dev.capability[0]}.{dev.capability[1]}"
        return False, (f"needs SM100 (compute capability 10.x: B200/GB200/B300); this device is "
                       f"{dev.describe()} ({cc})")
    if native._module() is None:
        return False, native._state["error"]
    scheme = scheme_of(quant)
    if scheme not in TARGETS:
        return False, config_refusal(cfg, quant)
    have = native.compiled_schemes()
    if scheme not in have:
        return False, (f"scheme {scheme!r}: this build of jax_moe._jax_moe_trtllm has no {TARGETS[scheme]} "
                       f"handler (it serves {', '.join(have) or 'nothing'}); rebuild it")
    why = config_refusal(cfg, quant)
    if why:
        return False, why
    why = cubin_refusal(cfg, quant)
    if why:
        return False, why
    return True, f"FlashInfer TRT-LLM gen fused MoE (SM100; {', '.join(have)})"


def prepare(w13, w2, cfg, quant=None, *, w13_bias=None, w2_bias=None):
    """vLLM-layout experts (as ``fused_experts`` takes them) -> the runner's layout, once, at load
    time: the scheme module's prepared pytree (``fp8``: :class:`~.fp8.Prepared`; ``mxfp4``:
    :class:`~.mxfp4.Mxfp4Prepared`; ``nvfp4``: :class:`~.nvfp4.Nvfp4Prepared`; ``fp8_block``:
    :class:`~.fp8_block.Fp8BlockPrepared`). ValueError with the reason when the scheme's contract
    refuses (cfg, quant) (:func:`scheme_refusal`), whether or not this build's module has the
    scheme's handler. Biases: MXFP4 only (``w13_bias [E, 2I]``, ``w2_bias [E, H]``)."""
    scheme = scheme_of(quant)
    if scheme not in TARGETS:
        raise ValueError(f"{NAME}: {config_refusal(cfg, quant)}")
    if scheme not in BIAS_SCHEMES and (w13_bias is not None or w2_bias is not None):
        raise ValueError(f"{NAME}: expert biases (w13_bias/w2_bias) are not supported yet for scheme {scheme!r}")
    why = scheme_refusal(cfg, quant)
    if why:
        raise ValueError(f"{NAME}: {why}")
    biases = dict(w13_bias=w13_bias, w2_bias=w2_bias) if scheme in BIAS_SCHEMES else {}
    return SCHEMES[scheme].prepare(w13, w2, cfg, quant, **biases)


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input: bool = False):
    """The oracle's entry point (``fused_experts(..., backend="flashinfer_trtllm")``): repacks the
    weights on every call; prepare once (:func:`prepare`) and call :func:`apply_prepared` instead."""
    if apply_router_weight_on_input:
        raise ValueError(f"{NAME}: apply_router_weight_on_input is not supported yet")
    prepared = prepare(w13, w2, cfg, quant, w13_bias=w13_bias, w2_bias=w2_bias)
    return apply_prepared(x, prepared, topk_weights, topk_ids).astype(x.dtype)
