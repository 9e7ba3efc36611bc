"""The TRT-LLM gen cubins ``backend="flashinfer_trtllm"`` runs: where they are read from, which a
call needs, which are missing.

The kernels themselves are FlashInfer's cubins, read at run time from a directory
(:func:`cubin_root`: ``JAX_MOE_TRTLLM_CUBIN_DIR``, else ``FLASHINFER_CUBIN_DIR``, else FlashInfer's
cache ``~/.cache/flashinfer/cubins``); the native module lists the ones a runner may load.
"""

from __future__ import annotations

import hashlib
import os

from jax_moe.backends.flashinfer_trtllm import native
from jax_moe.backends.flashinfer_trtllm.common import ACTIVATION_CODES, scheme_id
from jax_moe.backends.flashinfer_trtllm.schemes import SCHEMES, default_tile

CUBIN_ENV = "JAX_MOE_TRTLLM_CUBIN_DIR"


def cubin_root() -> str:
    """The directory cubins are read from: ``JAX_MOE_TRTLLM_CUBIN_DIR``, else
    ``FLASHINFER_CUBIN_DIR``, else ``${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/cubins``
    (the rule of ``ffi/trtllm/cubin_dir.cc``)."""
    for var in (CUBIN_ENV, "FLASHINFER_CUBIN_DIR"):
        if os.environ.get(var):
            return os.environ[var]
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
    return os.path.join(base, ".cache", "flashinfer", "cubins")


def required_cubins(cfg=None, num_tokens: int = 0, scheme: str = "fp8", device: int = 0,
                    act: str | None = None):
    """``[(relative path, sha256)]`` of the cubins the runner of ``scheme`` (``act``: the
    activation format, for ``mxfp4``) may load: for ``num_tokens > 0`` the two kernels of that
    call's default tile and tactic, else every kernel of the scheme and activation."""
    mod = native._module()
    if mod is None:
        raise RuntimeError(native._state["error"])
    sid = scheme_id(scheme, act)
    code = ACTIVATION_CODES[getattr(cfg, "activation", "silu")]
    if num_tokens > 0:
        h, i = SCHEMES[scheme].kernel_dims(cfg)
        e, k = cfg.num_experts, cfg.top_k
        tile = default_tile(scheme, num_tokens, k, e)
        return list(mod.cubins(sid, code, tile, -1, num_tokens, h, i, e, k, device))
    return list(mod.cubins(sid, code, device=device))


def missing_cubins(cubins, root: str | None = None, verify: bool = False) -> list[str]:
    """The entries of ``cubins`` (``[(relative path, sha256)]``) absent under ``root`` (default
    :func:`cubin_root`), or with ``verify`` whose sha256 differs; full paths."""
    root = cubin_root() if root is None else root
    out = []
    for rel, sha in cubins:
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            out.append(path)
        elif verify and sha:
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != sha:
                    out.append(path)
    return out


def cubin_refusal(cfg=None, quant=None) -> str | None:
    """Why the cubins are not usable (None: every kernel of the runner of ``quant``'s scheme and
    ``cfg``'s activation is present; default: FP8, silu)."""
    scheme = "fp8" if quant is None else quant.scheme
    try:
        needed = required_cubins(cfg, scheme=scheme, act=getattr(quant, "act", None))
    except (RuntimeError, ValueError) as e:  # the runner throws when it has no kernel at all
        return f"cannot list the TRT-LLM gen cubins: {e}"
    missing = missing_cubins(needed)
    if missing:
        return (f"cubins not found in {cubin_root()} ({len(missing)} of {len(needed)} missing, e.g. "
                f"{os.path.relpath(missing[0], cubin_root())}; set {CUBIN_ENV}, or let FlashInfer fill its cache)")
    return None
