"""Backend selection: which kernel family serves a given layer on a given device, and why not the others.

Order tried (first that supports the config wins): the compiled backends fastest-first, then
``xla``, which supports everything. ``backend=`` or the environment variable ``JAX_MOE_BACKEND``
forces one; a forced backend that cannot serve the config raises with its reason.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os

from jax_moe.config import MoEConfig

log = logging.getLogger("jax_moe")

# name -> module implementing supports(cfg, quant, device) and apply(...)
BACKENDS: dict[str, str] = {
    "flashinfer_cutlass": "jax_moe.backends.flashinfer_cutlass",
    "xla": "jax_moe.backends.xla",
}
# Tried in this order without an override. A backend joins ORDER only once its GPU tests pass
# on hardware; until then it runs only when forced (backend= or JAX_MOE_BACKEND).
ORDER = ("xla",)
ENV = "JAX_MOE_BACKEND"


@dataclasses.dataclass(frozen=True)
class Selection:
    """The chosen backend and, for each backend tried before it, why it was refused."""

    name: str
    module: object
    reasons: tuple[tuple[str, str], ...]


def _load(name: str):
    try:
        return importlib.import_module(BACKENDS[name]), ""
    except ImportError as err:  # a backend whose Python side is absent in this build
        return None, f"not available in this build ({err})"


def probe(name: str, cfg: MoEConfig, quant=None, device=None) -> tuple[object, bool, str]:
    """(module or None, supported, reason) of backend ``name`` for this config."""
    mod, why = _load(name)
    if mod is None:
        return None, False, why
    if not hasattr(mod, "supports"):
        return None, False, "backend module has no supports() yet"
    ok, reason = mod.supports(cfg, quant, device)
    return mod, ok, reason


_logged: set = set()


def select_backend(cfg: MoEConfig, quant=None, *, backend: str | None = None, device=None) -> Selection:
    """Pick a backend for ``cfg`` (and ``quant``) on ``device`` (default: JAX's default device)."""
    forced = backend or os.environ.get(ENV) or None
    if forced is not None:
        if forced not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {forced!r}")
        mod, ok, reason = probe(forced, cfg, quant, device)
        if not ok:
            raise ValueError(f"backend {forced!r} cannot serve this MoE: {reason}")
        return Selection(forced, mod, ())
    refused = []
    for name in ORDER:
        mod, ok, reason = probe(name, cfg, quant, device)
        if ok:
            for r in refused:
                if r not in _logged:
                    _logged.add(r)
                    log.info("jax_moe: backend %s refused: %s", *r)
            return Selection(name, mod, tuple(refused))
        refused.append((name, reason))
    raise AssertionError("the xla backend supports every config")  # pragma: no cover
