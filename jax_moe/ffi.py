"""The compiled modules: loading them, registering their XLA FFI targets once, and the shape rules.

``_jax_moe_cpu`` (always built) holds CPU handlers; ``_jax_moe_cuda`` (built where a CUDA
compiler was found, see CMakeLists.txt) holds the CUDA ones. A module that is absent or fails
to load is recorded with its reason (``native_status()``), never raised at import.
"""

from __future__ import annotations

import importlib
import logging

import jax
import jax.numpy as jnp

from jax_moe.permute import ExpertSort
from jax_moe.quant.fp8 import FP8_MAX, MIN_SCALE

log = logging.getLogger("jax_moe")

_MODULES = {"cpu": "jax_moe._jax_moe_cpu", "cuda": "jax_moe._jax_moe_cuda"}
_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}
_loaded: dict[str, object] = {}
_errors: dict[str, str] = {}
_registered: set[str] = set()
SORT_CHUNK = 256  # slots per CUDA block of sort_by_expert (ffi/kernels/sort_by_expert.h: kSortChunk)
TOP_K_MAX_N = 1024  # values per row of the CUDA top_k and route (ffi/kernels/top_k.h: kTopKMaxN)
ROUTE_MAX_K = 32  # experts per token of the CUDA route (ffi/kernels/route.h: kRouteMaxK)
ROUTE_MAX_GROUPS = 32  # expert groups of the CUDA route (ffi/kernels/route.h: kRouteMaxGroups)


def gpu_backend() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def _load(kind: str):
    if kind in _loaded or kind in _errors:
        return _loaded.get(kind)
    try:
        _loaded[kind] = importlib.import_module(_MODULES[kind])
    except ImportError as err:
        _errors[kind] = f"{_MODULES[kind]} is not built or cannot load ({err})"
        # said once; loudly only where it matters (a GPU without the CUDA kernels)
        level = logging.WARNING if kind == "cuda" and gpu_backend() else logging.INFO
        log.log(level, "jax_moe: %s; the pure-JAX paths are used instead", _errors[kind])
    return _loaded.get(kind)


def _register(kind: str) -> bool:
    """Register ``kind``'s targets with XLA once; False (with the reason recorded) if unavailable."""
    if kind in _registered:
        return True
    mod = _load(kind)
    if mod is None:
        return False
    if kind == "cuda" and not gpu_backend():
        _errors.setdefault(kind, f"built for {mod.cuda_archs()}, but this JAX has no GPU backend")
        return False
    if kind == "cuda" and getattr(mod, "sort_chunk", SORT_CHUNK) != SORT_CHUNK:
        _errors[kind] = "the compiled module's sort chunk does not match jax_moe/ffi.py"
        return False
    if kind == "cuda" and (getattr(mod, "top_k_max_n", TOP_K_MAX_N), getattr(mod, "route_max_k", ROUTE_MAX_K),
                           getattr(mod, "route_max_groups", ROUTE_MAX_GROUPS)) != (
            TOP_K_MAX_N, ROUTE_MAX_K, ROUTE_MAX_GROUPS):
        _errors[kind] = "the compiled module's top_k and route limits do not match jax_moe/ffi.py"
        return False
    if kind == "cuda" and (getattr(mod, "fp8_max", FP8_MAX), getattr(mod, "fp8_min_scale", MIN_SCALE)) != (
            FP8_MAX, MIN_SCALE):
        _errors[kind] = "the compiled module's FP8 constants do not match jax_moe/quant/fp8.py"
        return False
    for name, capsule in mod.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=_PLATFORM[kind])
    _registered.add(kind)
    return True


def load_once(state: dict, load, why_not):
    """An extension module that only some builds have, imported once: ``load()`` (an import that
    raises ImportError where the module is absent), recorded in ``state`` (the module's
    ``{"module", "error", "registered"}`` record, which :func:`register_module_targets` reads);
    None, with ``why_not(err)`` recorded as the reason, when it does not import."""
    if state["module"] is None and state["error"] is None:
        try:
            state["module"] = load()
        except ImportError as err:
            state["error"] = why_not(err)
    return state["module"]


def register_module_targets(state: dict, module) -> None:
    """Register an extension module's CUDA FFI targets (``module.registrations()``: name ->
    capsule) once per backend ``state`` (its ``{"module", "error", "registered"}`` record);
    RuntimeError with the recorded reason when the module did not load."""
    if state["registered"]:
        return
    if module is None:
        raise RuntimeError(state["error"])
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    state["registered"] = True


def has_native(kind: str) -> bool:
    """Whether the ``"cpu"`` or ``"cuda"`` handlers are built and registered."""
    return _register(kind)


def native_module(kind: str):
    """The loaded native module of ``kind`` (``"cpu"`` or ``"cuda"``); a RuntimeError saying why where
    it is not built or cannot load."""
    mod = _load(kind)
    if mod is None:
        raise RuntimeError(f"jax_moe: {_errors.get(kind, f'{_MODULES[kind]} is unavailable')}")
    return mod


def native_status() -> dict[str, str]:
    """What loaded and what did not, with reasons (for ``python -m jax_moe.info``)."""
    out = {}
    for kind in _MODULES:
        if _register(kind):
            extra = ""
            if kind == "cuda":
                extra = f", archs {_loaded[kind].cuda_archs()}"
            out[kind] = f"loaded{extra}"
        else:
            out[kind] = f"unavailable: {_errors.get(kind, 'unknown reason')}"
    return out


def sort_by_expert(topk_ids: jax.Array, num_experts: int) -> ExpertSort:
    """The compiled twin of :func:`jax_moe.permute.sort_by_expert` (same four arrays).

    topk_ids [T, k] int32. Runs the CPU or CUDA handler, whichever platform it is lowered for.
    """
    return sort_by_expert_valid(topk_ids, num_experts)[0]


def sort_by_expert_valid(topk_ids: jax.Array, num_experts: int) -> tuple[ExpertSort, jax.Array]:
    """:func:`sort_by_expert` and ``valid`` [1] int32, equal to ``offsets[E:]`` (the rows of
    experts in ``[0, E)``) but a buffer the custom call writes itself: pass it as the kernels'
    ``valid_rows``. A slice ``offsets[E:]`` is an XLA op of its own (on GPU a device-to-device copy,
    one more launch per forward); this is the same value without it.
    """
    if getattr(topk_ids, "ndim", None) != 2:
        raise ValueError(f"topk_ids must have rank 2 [T, k], got shape {list(getattr(topk_ids, 'shape', ()))}")
    if jnp.dtype(topk_ids.dtype) != jnp.int32:
        raise ValueError(f"topk_ids must have dtype int32, got {jnp.dtype(topk_ids.dtype).name}")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    n = topk_ids.shape[0] * topk_ids.shape[1]
    i32 = jnp.int32
    outs = [jax.ShapeDtypeStruct((n,), i32), jax.ShapeDtypeStruct((n,), i32),
            jax.ShapeDtypeStruct((num_experts,), i32), jax.ShapeDtypeStruct((num_experts + 1,), i32),
            jax.ShapeDtypeStruct((1,), i32)]
    # the chunks' histograms, then one counter (ffi/kernels/sort_by_expert.h)
    workspace = jax.ShapeDtypeStruct((-(-n // SORT_CHUNK) * (num_experts + 1) + 1,), i32)
    have_cpu, have_cuda = has_native("cpu"), has_native("cuda")
    if not (have_cpu or have_cuda):
        raise RuntimeError(f"jax_moe native module unavailable: {native_status()}")

    def cpu(ids):
        call = jax.ffi.ffi_call("jax_moe_sort_by_expert", outs, vmap_method="sequential")
        return tuple(call(ids, num_experts=num_experts))

    def cuda(ids):
        call = jax.ffi.ffi_call("jax_moe_sort_by_expert", outs + [workspace], vmap_method="sequential")
        return tuple(call(ids, num_experts=num_experts))[:5]

    branches = {}
    if have_cpu:
        branches["cpu"] = cpu
    if have_cuda:
        branches["cuda"] = cuda
    sorted_slots, inverse, counts, offsets, valid = jax.lax.platform_dependent(topk_ids, **branches)
    return ExpertSort(sorted_slots, inverse, counts, offsets), valid
