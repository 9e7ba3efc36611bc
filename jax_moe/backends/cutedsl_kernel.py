"""FlashInfer's SM100 block-scaled masked grouped GEMM, driven from ``jax.jit`` through CUTLASS's
JAX bridge (``cutlass.jax.cutlass_call``). Imported only when the kernel is lowered.

Two jobs:

* :func:`kernel_class` loads ``Sm100BlockScaledPersistentDenseGemmKernel`` (a CuTe DSL kernel
  class) from FlashInfer's source file (:func:`jax_moe.backends.cutedsl_probe.kernel_source`)
  without torch: the file is executed as a private module whose ``import`` statements for
  ``torch``, ``cutlass.torch``, ``flashinfer...`` and relative imports get placeholder modules
  (those names serve FlashInfer's torch-side wrappers, which are never called here; calling one
  raises). ``sys.modules`` is not touched. Checked against FlashInfer 0.7.2.post1.
* :func:`launcher` is our ``@cute.jit`` entry point: it receives the XLA buffers (uint8 packed
  E2M1, float8_e4m3fn 128x4 scale tiles, int32 row counts, float32 alphas, bf16 output), views
  them with the layouts the kernel takes (A ``(m, k, l)`` K-major, B ``(n, k, l)`` K-major, C
  ``(m, n, l)`` N-major; the scale tiles are re-laid by the kernel from A's and B's shapes) and
  calls the kernel class on the stream XLA gives.

:func:`masked_gemm_call` wraps them in ``cutlass_call`` (the bridge's XLA FFI custom call;
CUDA-graph safe by default, ``allow_cuda_graph=True``). The bridge compiles the kernel when the
call is lowered for CUDA, for ``CUTE_DSL_ARCH`` if set (e.g. ``sm_100a``, which lets a host
without a GPU compile it: ``jax.export`` with ``platforms=["cuda"]``), else the visible GPU's.
"""

from __future__ import annotations

import builtins
import functools
import types

import jax

from jax_moe.backends import cutedsl_probe

SF_VEC_SIZE = 16  # NVFP4: one e4m3 scale per 16 elements along K
MMA_TILER_MN = (128, 128)  # 1-CTA MMA tile; (256, N) would need a cluster M of 2
CLUSTER_SHAPE_MN = (1, 1)
SM_VERSION = "sm_100"  # what the kernel class takes (sm_100 / sm_103 share the SM100 code path)
_STUBBED = ("torch", "cutlass.torch", "flashinfer")
_MODULE_NAME = "jax_moe_flashinfer_masked_gemm"

__all__ = ["kernel_class", "launcher", "masked_gemm_call", "SF_VEC_SIZE", "MMA_TILER_MN", "CLUSTER_SHAPE_MN"]


class _Placeholder(types.ModuleType):
    """Stands for a torch-side module in FlashInfer's kernel file; any attribute is a function that
    raises when called (module-level ``from x import y`` binds it; only torch wrappers call it)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{self.__name__}.{name} belongs to FlashInfer's torch wrapper and is not "
                               "loaded by jax_moe")

        unavailable.__name__ = name
        return unavailable


def _scoped_import(name, globals=None, locals=None, fromlist=(), level=0):
    if level > 0 or name in _STUBBED or name.startswith(tuple(f"{s}." for s in _STUBBED)):
        return _Placeholder("." * level + name)
    return builtins.__import__(name, globals, locals, fromlist, level)


@functools.lru_cache(maxsize=1)
def kernel_class():
    """FlashInfer's ``Sm100BlockScaledPersistentDenseGemmKernel``, loaded torch-free (see the module
    docstring). RuntimeError naming what is missing when the probe fails."""
    ok, why = cutedsl_probe.probe()
    if not ok:
        raise RuntimeError(why)
    path = cutedsl_probe.kernel_source()
    mod = types.ModuleType(_MODULE_NAME)
    mod.__file__ = str(path)
    scoped = dict(builtins.__dict__)
    scoped["__import__"] = _scoped_import
    mod.__dict__["__builtins__"] = scoped
    exec(compile(path.read_text(), str(path), "exec"), mod.__dict__)  # noqa: S102 (FlashInfer's kernel file)
    return getattr(mod, cutedsl_probe.KERNEL_CLASS)


@functools.lru_cache(maxsize=1)
def launcher():
    """The ``@cute.jit`` function ``(stream, a, a_sf, b, b_sf, masked_m, alpha, out, *, e, m, n, k,
    max_active_clusters)`` that ``cutlass_call`` runs (inputs, then the output, as the bridge
    passes them). ``e, m, n, k`` are the logical sizes (k in E2M1 elements) and compile-time."""
    import cutlass  # noqa: PLC0415
    import cutlass.cute as cute  # noqa: PLC0415

    gemm_cls = kernel_class()

    @cute.jit
    def run(stream, a, a_sf, b, b_sf, masked_m, alpha, out, *, e: cutlass.Constexpr, m: cutlass.Constexpr,
            n: cutlass.Constexpr, k: cutlass.Constexpr, max_active_clusters: cutlass.Constexpr):
        fp4 = cutlass.Float4E2M1FN
        # the uint8 buffers hold two E2M1 values a byte: re-type the pointers, K contiguous
        a4 = cute.make_tensor(cute.recast_ptr(a.iterator, dtype=fp4),
                              cute.make_ordered_layout((m, k, e), order=(1, 0, 2)))
        b4 = cute.make_tensor(cute.recast_ptr(b.iterator, dtype=fp4),
                              cute.make_ordered_layout((n, k, e), order=(1, 0, 2)))
        c = cute.make_tensor(out.iterator, cute.make_ordered_layout((m, n, e), order=(1, 0, 2)))
        rows = cute.make_tensor(masked_m.iterator, cute.make_layout((e,)))
        scale = cute.make_tensor(alpha.iterator, cute.make_layout((e,)))
        gemm = gemm_cls(sf_vec_size=SF_VEC_SIZE, mma_tiler_mn=MMA_TILER_MN, cluster_shape_mn=CLUSTER_SHAPE_MN,
                        sm_version=SM_VERSION)
        # no dst signals, no combine fusion (top-k weights, source indices, peer pointers, barriers)
        gemm(a4, b4, a_sf, b_sf, c, rows, None, scale, None, None, None, None, None, None,
             max_active_clusters, stream)

    return run


def masked_gemm_call(a, a_sf, b, b_sf, masked_m, alpha, *, out_shape: jax.ShapeDtypeStruct, k: int,
                     max_active_clusters: int):
    """The custom call (CUDA lowering only): operands as checked by
    :func:`jax_moe.backends.nvfp4_masked_gemm.masked_grouped_gemm_nvfp4`, ``out_shape`` [E, M, N]
    bfloat16, ``k`` the K in elements, ``max_active_clusters`` the persistent grid's size."""
    import cutlass.jax as cjax  # noqa: PLC0415

    e, m, n = out_shape.shape
    return cjax.cutlass_call(launcher(), output_shape_dtype=out_shape, e=e, m=m, n=n, k=k,
                             max_active_clusters=max_active_clusters)(a, a_sf, b, b_sf, masked_m, alpha)

