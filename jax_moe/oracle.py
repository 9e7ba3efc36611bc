"""Backend selection: which kernel family serves a layer on a device, and why not the others.

For each quant scheme the backends are tried in vLLM's order (:data:`SCHEME_ORDER`); each row
is a module with the interface of :mod:`jax_moe.backends.base` and answers
``supports(cfg, quant, device) -> (ok, reason)`` from the device's compute capability, what this
build contains, and the shapes. The first that can serve *and* is in :data:`AUTO`
wins; ``xla`` serves everything and ends every list. A row joins AUTO once its GPU tests pass on
hardware and it needs no per-call repacking through ``fused_experts``. Rows whose weights must be
repacked are picked automatically only for weights prepared once at load time
(``select_backend(..., prepared=True)``, as ``MoEBlock.prepare()`` asks): :data:`AUTO_PREPARED`.

Overrides: ``backend=`` or ``JAX_MOE_BACKEND`` forces one backend (raising with its reason if it
cannot serve); ``JAX_MOE_FLASHINFER_MOE_BACKEND`` = ``throughput`` (CUTLASS), ``latency``
(TRT-LLM) or ``masked_gemm`` (CuteDSL) moves that FlashInfer row first, as vLLM's variable does.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os

from jax_moe.config import MoEConfig

log = logging.getLogger("jax_moe")

# backends with a Python module of their own (jax_moe.backends.base.Backend: NAME, FEATURES,
# supports, apply; optionally prepare/apply_prepared, apply_batched)
MODULES: dict[str, str] = {
    "flashinfer_trtllm": "jax_moe.backends.flashinfer_trtllm",
    "flashinfer_cutlass": "jax_moe.backends.flashinfer_cutlass",
    "flashinfer_cutedsl": "jax_moe.backends.flashinfer_cutedsl",
    "cutlass": "jax_moe.backends.cutlass",
    "xla": "jax_moe.backends.xla",
}
# every backend name the oracle knows; those without a module answer from this one's refusal()
UNAVAILABLE = "jax_moe.backends.unavailable"
BACKENDS: tuple[str, ...] = ("flashinfer_trtllm", "flashinfer_cutedsl", "flashinfer_cutlass", "cutlass",
                             "marlin", "xla")
# vLLM's order per scheme ("bf16" = unquantized)
SCHEME_ORDER: dict[str, tuple[str, ...]] = {
    "bf16": ("flashinfer_cutlass", "cutlass", "xla"),
    "fp8": ("flashinfer_trtllm", "flashinfer_cutlass", "cutlass", "xla"),
    "fp8_block": ("flashinfer_trtllm", "flashinfer_cutlass", "xla"),
    "nvfp4": ("flashinfer_trtllm", "flashinfer_cutedsl", "flashinfer_cutlass", "cutlass", "marlin", "xla"),
    "mxfp4": ("flashinfer_trtllm", "flashinfer_cutlass", "marlin", "xla"),
    "w4a8": ("flashinfer_cutlass", "cutlass", "xla"),
}
AUTO: frozenset[str] = frozenset({"cutlass", "xla"})
AUTO_PREPARED: frozenset[str] = AUTO | {"flashinfer_cutlass"}
ENV = "JAX_MOE_BACKEND"
FLASHINFER_ENV = "JAX_MOE_FLASHINFER_MOE_BACKEND"
FLASHINFER_CHOICES = {"throughput": "flashinfer_cutlass", "latency": "flashinfer_trtllm",
                      "masked_gemm": "flashinfer_cutedsl"}


def scheme_of(quant) -> str:
    return "bf16" if quant is None else quant.scheme


def order_for(quant) -> tuple[str, ...]:
    """The backends tried for ``quant``'s scheme, with the FlashInfer preference applied."""
    order = list(SCHEME_ORDER[scheme_of(quant)])
    pref = os.environ.get(FLASHINFER_ENV)
    if pref:
        if pref not in FLASHINFER_CHOICES:
            raise ValueError(f"{FLASHINFER_ENV} must be one of {sorted(FLASHINFER_CHOICES)}, got {pref!r}")
        first = FLASHINFER_CHOICES[pref]
        if first in order:
            order.remove(first)
            order.insert(0, first)
    return tuple(order)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The chosen backend and, for each backend tried before it, why it was refused."""

    name: str
    module: object
    reasons: tuple[tuple[str, str], ...]


# What a call may need beyond its MoEConfig and QuantConfig; a backend module lists what it takes
# in ``FEATURES`` (jax_moe.backends.base.Backend; none listed: no biases, no router weight on input;
# no "dtype:" entry: any dtype). "batched": the module is a jax_moe.backends.base.BatchedBackend,
# the expert stage on the batched format (jax_moe.permute).
FEATURE_TEXT = {"grad": "differentiation (jax.grad)",
                "bias": "expert biases (w13_bias/w2_bias)",
                "router_weight_on_input": "apply_router_weight_on_input",
                "batched": "the batched expert format ([E, C, H] rows with counts [E]: apply_batched)"}


def call_features(*, dtype=None, w13_bias=None, w2_bias=None, apply_router_weight_on_input=False,
                  batched: bool = False, grad: bool = False, **_) -> frozenset:
    """The features one call needs: ``"bias"``, ``"router_weight_on_input"``, ``"batched"`` (the
    expert stage on the batched format), ``"grad"`` (the call is differentiated: the backend's
    FEATURES must list it), ``"dtype:<name>"`` (the unquantized weights' dtype)."""
    need = {"batched"} if batched else set()
    if grad:
        need.add("grad")
    if w13_bias is not None or w2_bias is not None:
        need.add("bias")
    if apply_router_weight_on_input:
        need.add("router_weight_on_input")
    if dtype is not None:
        import numpy as np

        need.add(f"dtype:{np.dtype(dtype).name}")
    return frozenset(need)


def _dtypes(mod) -> list[str]:
    """The unquantized weights' dtypes a backend names in FEATURES (empty: any)."""
    return sorted(f[6:] for f in getattr(mod, "FEATURES", ()) if f.startswith("dtype:"))


def training_backends() -> tuple[str, ...]:
    """The backends whose FEATURES list ``"grad"``: those a differentiated call may land on."""
    return tuple(n for n in MODULES if "grad" in getattr(module(n), "FEATURES", ()))


def _missing_feature(mod, features) -> str | None:
    have = frozenset(getattr(mod, "FEATURES", ()))
    dts = _dtypes(mod)
    for f in sorted(features):
        if f in have or (f.startswith("dtype:") and not dts):
            continue
        if f.startswith("dtype:"):
            return f"takes {', '.join(dts)} weights, not {f[6:]}"
        if f == "grad":
            return (f"does not differentiate (jax.grad): its kernels are for inference; the backends that "
                    f"train: {', '.join(map(repr, training_backends()))}")
        return f"does not take {FEATURE_TEXT.get(f, f)} yet"
    return None


def probe(name: str, cfg: MoEConfig, quant=None, device=None, features=frozenset()) -> tuple[object, bool, str]:
    """(module or None, supported, reason) of backend ``name`` for this config on ``device``, for a
    call needing ``features`` (:func:`call_features`)."""
    if name not in MODULES:
        return (None, *importlib.import_module(UNAVAILABLE).refusal(name, cfg, quant, device))
    mod = module(name)
    dtype = next((f[6:] for f in features if f.startswith("dtype:")), None)
    if dtype is not None and _dtypes(mod):  # a backend that names the dtypes it takes is told the call's
        ok, reason = mod.supports(cfg, quant, device, dtype=dtype)  # (flashinfer_cutlass: float16 -> f16)
    else:
        ok, reason = mod.supports(cfg, quant, device)
    if ok:
        missing = _missing_feature(mod, features)
        if missing:
            ok, reason = False, missing
    return mod, ok, reason


_logged: set = set()


def module(name: str):
    """The Python module of backend ``name`` (only those in :data:`MODULES` have one)."""
    return importlib.import_module(MODULES[name])


def select_backend(cfg: MoEConfig, quant=None, *, backend: str | None = None, device=None,
                   prepared: bool = False, features=frozenset()) -> Selection:
    """Pick a backend for ``cfg`` (and ``quant``) on ``device`` (default: JAX's default device).

    ``prepared``: the caller repacks the weights once for the chosen backend (its ``prepare``),
    so backends that need a repack are eligible without being forced (:data:`AUTO_PREPARED`).
    ``features``: what the call needs beyond the configs (:func:`call_features`)."""
    forced = backend or os.environ.get(ENV) or None
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {forced!r}")
        mod, ok, reason = probe(forced, cfg, quant, device, features)
        if not ok:
            raise ValueError(f"backend {forced!r} cannot serve this MoE: {reason}")
        return Selection(forced, mod, ())
    refused = []
    for name in order_for(quant):
        mod, ok, reason = probe(name, cfg, quant, device, features)
        if ok and name not in (AUTO_PREPARED if prepared else AUTO):
            ok, reason = False, ("can serve this, but repacks the weights on every call through "
                                 "fused_experts: used when forced (backend=) or for weights prepared "
                                 "at load time (MoEBlock.prepare())")
        if ok:
            for r in refused:
                if r not in _logged:
                    _logged.add(r)
                    log.info("jax_moe: backend %s refused: %s", *r)
            return Selection(name, mod, tuple(refused))
        refused.append((name, reason))
    raise AssertionError("the xla backend supports every config")  # pragma: no cover
