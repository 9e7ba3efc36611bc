"""Cheap checks of what the ``flashinfer_cutedsl`` row needs on the host, without importing it.

Three things, each answered from package metadata and files on disk (``importlib.util.find_spec``
on top-level packages only, which does not execute them):

1. ``nvidia-cutlass-dsl`` (NVIDIA's CUTLASS Python DSL, which provides ``cutlass.cute``) is
   installed: ``pip install "jax_moe[cutedsl]"``.
2. Its JAX bridge is present: the ``cutlass.jax`` subpackage (``cutlass_call``, an XLA FFI custom
   call that runs a ``@cute.jit`` function; in 4.8.1 it lowers for CUDA only and registers the
   targets ``CuteDSLRT_NvJaxCutlassCall_v1``/``_v2`` from ``libcute_dsl_runtime.so``). It needs
   ``jax >= 0.6``.
3. FlashInfer's CuteDSL kernel source: the Python file that defines
   ``Sm100BlockScaledPersistentDenseGemmKernel`` (FlashInfer 0.7.x:
   ``flashinfer/gemm/kernels/grouped_gemm_masked_blackwell.py``; earlier releases:
   ``flashinfer/cute_dsl/blockscaled_gemm.py``), found under ``FLASHINFER_SRC_DIR`` (a directory
   laid out like the wheel's ``flashinfer/``) or the installed ``flashinfer-python``. Only that
   file is read; FlashInfer's package (which imports torch) is never imported
   (:mod:`jax_moe.backends.cutedsl_kernel`).

:func:`probe` returns ``(ok, reason)``; tests monkeypatch it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
from pathlib import Path

DIST = "nvidia-cutlass-dsl"
KERNEL_CLASS = "Sm100BlockScaledPersistentDenseGemmKernel"
# where FlashInfer keeps the masked grouped GEMM kernel class, newest layout first
KERNEL_FILES = ("gemm/kernels/grouped_gemm_masked_blackwell.py", "cute_dsl/blockscaled_gemm.py")
SRC_ENV = "FLASHINFER_SRC_DIR"
INSTALL_HINT = 'pip install "jax_moe[cutedsl]"'

__all__ = ["probe", "cutlass_dsl_version", "bridge_dir", "kernel_source", "DIST", "KERNEL_CLASS"]


def cutlass_dsl_version() -> str | None:
    """The installed ``nvidia-cutlass-dsl`` version, or None."""
    try:
        return importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def bridge_dir() -> Path | None:
    """The ``cutlass/jax`` directory of the installed DSL when it holds the bridge (``primitive.py``
    with ``cutlass_call``), else None."""
    try:
        spec = importlib.util.find_spec("cutlass")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or []) if spec else []:
        d = Path(root) / "jax"
        if (d / "primitive.py").is_file() and (d / "__init__.py").is_file():
            return d
    return None


def _flashinfer_dirs() -> list[Path]:
    dirs = []
    if os.environ.get(SRC_ENV):
        dirs.append(Path(os.environ[SRC_ENV]))
    try:
        spec = importlib.util.find_spec("flashinfer")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        dirs.extend(Path(p) for p in (spec.submodule_search_locations or []))
    return dirs


@functools.lru_cache(maxsize=None)
def _kernel_source(dirs: tuple[Path, ...]) -> Path | None:
    for d in dirs:
        for rel in KERNEL_FILES:
            f = d / rel
            if f.is_file() and f"class {KERNEL_CLASS}" in f.read_text(errors="replace"):
                return f
    return None


def kernel_source() -> Path | None:
    """The FlashInfer file that defines :data:`KERNEL_CLASS` (``FLASHINFER_SRC_DIR`` first, then
    the installed ``flashinfer-python``), or None."""
    return _kernel_source(tuple(_flashinfer_dirs()))


def probe() -> tuple[bool, str]:
    """``(True, what was found)`` when the DSL, its JAX bridge and FlashInfer's kernel source are
    all on this host, else ``(False, the first thing missing)``. Reads metadata and files only."""
    version = cutlass_dsl_version()
    if version is None:
        return False, f"nvidia-cutlass-dsl is not installed ({INSTALL_HINT})"
    if bridge_dir() is None:
        return False, (f"nvidia-cutlass-dsl {version} has no JAX bridge (cutlass.jax with cutlass_call; "
                       f"4.8.1 has it: {INSTALL_HINT})")
    src = kernel_source()
    if src is None:
        return False, (f"FlashInfer's CuteDSL kernels are not importable: no {KERNEL_CLASS} source under "
                       f"{SRC_ENV} or an installed flashinfer-python")
    return True, f"nvidia-cutlass-dsl {version} with cutlass.jax; FlashInfer kernel {src}"
