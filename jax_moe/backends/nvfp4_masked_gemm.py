"""NVFP4 masked grouped GEMM on the batched format (FlashInfer CuteDSL's ``grouped_gemm_nt_masked``).

For each expert ``e`` and row ``r < masked_m[e]``::

    out[e, r, :] = alpha[e] * (dq(a)[e, r, :] @ dq(b)[e].T)        # float32 accumulation, bf16 out

``dq`` multiplies each E2M1 value by its e4m3 block scale (16 along K); the global scales live in
``alpha`` (``1 / (g_a * g_w)`` with quantization-side globals, i.e. vLLM's
``a_scale * w_scale_2``). Rows at or past ``masked_m[e]`` are zero; those rows of ``a`` are never
read by the kernel.

Operands (K in elements, a multiple of 32; N a multiple of 8):

=========  ==================================================  ========================
name       shape                                               dtype
=========  ==================================================  ========================
a          [E, M, K/2]   (two E2M1 a byte, low nibble first)   uint8
a_sf       [E, ceil(M/128), ceil(K/64), 32, 4, 4]              float8_e4m3fn
b          [E, N, K/2]                                         uint8
b_sf       [E, ceil(N/128), ceil(K/64), 32, 4, 4]              float8_e4m3fn
masked_m   [E]  rows used per expert (clamped to [0, M])       int32
alpha      [E]                                                 float32
out        [E, M, N]                                           bfloat16
=========  ==================================================  ========================

The scale operands are :func:`jax_moe.layouts.block_scale_interleave` of the row-major
``[E, rows, K/16]`` scales (the 128x4 tiles; FlashInfer's "physical ``(l, rm, rk, 32, 4, 4)``").
:func:`quantize_batched` makes ``a`` and ``a_sf`` from bf16 rows.

Where it runs: lowered for CUDA with the ``cutedsl`` extra present (:mod:`cutedsl_probe`) and an
SM100/SM103 target (the visible GPU, or ``CUTE_DSL_ARCH=sm_100a``/``sm_103a`` when compiling
without one), the custom call of :mod:`jax_moe.backends.cutedsl_kernel`; everywhere else the jnp
definition :func:`masked_grouped_gemm_nvfp4_reference`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.backends import cutedsl_probe
from jax_moe.layouts.common import SF_TILE_K, SF_TILE_M, round_up
from jax_moe.layouts.scales import block_scale_deinterleave, block_scale_interleave
from jax_moe.quant import fp4

ALIGN_K = 32  # elements: 16-byte rows of packed E2M1 (the kernel's TMA alignment)
ALIGN_N = 8  # 16-byte bf16 output rows
DEFAULT_SM_COUNT = 148  # B200; the persistent grid's size when no GPU is visible (export)
ARCH_ENV = "CUTE_DSL_ARCH"
SM100_ARCHS = ("sm_100a", "sm_103a", "sm_100f", "sm_103f")

__all__ = ["masked_grouped_gemm_nvfp4", "masked_grouped_gemm_nvfp4_shape",
           "masked_grouped_gemm_nvfp4_reference", "scale_tiles_shape", "quantize_batched", "kernel_target"]


def scale_tiles_shape(e: int, rows: int, k: int) -> tuple[int, ...]:
    """Shape of the 128x4 scale tiles of ``[e, rows, k/16]`` block scales."""
    return (e, round_up(rows, SF_TILE_M) // SF_TILE_M, round_up(k // fp4.NVFP4_BLOCK, SF_TILE_K) // SF_TILE_K,
            32, 4, 4)


def _dtype(x) -> str:
    return np.dtype(x.dtype).name


def _check(a, a_sf, b, b_sf, masked_m, alpha) -> tuple[int, int, int, int]:
    """ValueError naming the first argument that is off; returns (E, M, N, K)."""
    for name, x, rank in (("a", a, 3), ("b", b, 3), ("a_sf", a_sf, 6), ("b_sf", b_sf, 6),
                          ("masked_m", masked_m, 1), ("alpha", alpha, 1)):
        if getattr(x, "ndim", None) != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {list(getattr(x, 'shape', ()))}")
    for name, x, dt in (("a", a, "uint8"), ("b", b, "uint8"), ("a_sf", a_sf, "float8_e4m3fn"),
                        ("b_sf", b_sf, "float8_e4m3fn"), ("masked_m", masked_m, "int32"), ("alpha", alpha, "float32")):
        if _dtype(x) != dt:
            raise ValueError(f"{name} must be {dt}, got {_dtype(x)}")
    e, m, kh = a.shape
    k = 2 * kh
    if e < 1:
        raise ValueError(f"a must have at least one expert, got shape {list(a.shape)}")
    if k % ALIGN_K:
        raise ValueError(f"a: K = 2 * {kh} = {k} must be a multiple of {ALIGN_K} (16-byte rows of packed E2M1)")
    if b.shape[0] != e or b.shape[2] != kh:
        raise ValueError(f"b must be [E={e}, N, K/2={kh}], got {list(b.shape)}")
    n = b.shape[1]
    if n % ALIGN_N or n == 0:
        raise ValueError(f"b: N = {n} must be a positive multiple of {ALIGN_N} (16-byte bf16 output rows)")
    for name, x, rows in (("a_sf", a_sf, m), ("b_sf", b_sf, n)):
        want = scale_tiles_shape(e, rows, k)
        if tuple(x.shape) != want:
            raise ValueError(f"{name} must be the 128x4 tiles {list(want)} of [{e}, {rows}, {k // fp4.NVFP4_BLOCK}] "
                             f"scales (layouts.block_scale_interleave), got {list(x.shape)}")
    for name, x in (("masked_m", masked_m), ("alpha", alpha)):
        if x.shape[0] != e:
            raise ValueError(f"{name} must be [E={e}], got {list(x.shape)}")
    return e, m, n, k


def masked_grouped_gemm_nvfp4_shape(a, a_sf, b, b_sf, masked_m, alpha) -> jax.ShapeDtypeStruct:
    """The shape rule: ``[E, M, N] bfloat16`` from a [E, M, K/2] and b [E, N, K/2] (all operands
    checked; ValueError names the first one that is off)."""
    e, m, n, _ = _check(a, a_sf, b, b_sf, masked_m, alpha)
    return jax.ShapeDtypeStruct((e, m, n), jnp.bfloat16)


def _dequantize(packed, tiles, rows: int, k: int):
    sf = block_scale_deinterleave(tiles, rows, k // fp4.NVFP4_BLOCK).astype(jnp.float32)
    v = fp4.e2m1_decode(fp4.unpack_fp4(packed))
    e = v.shape[0]
    return (v.reshape(e, rows, k // fp4.NVFP4_BLOCK, fp4.NVFP4_BLOCK) * sf[..., None]).reshape(e, rows, k)


def _rows_used(masked_m, m: int):
    return jnp.arange(m, dtype=jnp.int32)[None, :] < jnp.clip(masked_m, 0, m)[:, None]


def masked_grouped_gemm_nvfp4_reference(a, a_sf, b, b_sf, masked_m, alpha) -> jax.Array:
    """The jnp definition (same arguments and result as :func:`masked_grouped_gemm_nvfp4`)."""
    e, m, n, k = _check(a, a_sf, b, b_sf, masked_m, alpha)
    used = _rows_used(masked_m, m)[..., None]
    da = jnp.where(used, _dequantize(a, a_sf, m, k), 0.0)
    db = _dequantize(b, b_sf, n, k)
    d = jnp.einsum("emk,enk->emn", da, db, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    return jnp.where(used, d * alpha[:, None, None], 0.0).astype(jnp.bfloat16)


def kernel_target() -> tuple[bool, str]:
    """Whether a CUDA lowering here gets the CuteDSL kernel: the extra is present and the target
    is SM100/SM103 (a visible GPU of compute capability 10.0/10.3, or ``CUTE_DSL_ARCH`` naming one
    when no GPU is visible), and why not."""
    ok, why = cutedsl_probe.probe()
    if not ok:
        return False, why
    from jax_moe.device import device_info  # noqa: PLC0415
    from jax_moe.ffi import gpu_backend  # noqa: PLC0415

    if gpu_backend():
        dev = device_info(jax.devices("gpu")[0])
        return (dev.sm in (100, 103)), f"the GPU is {dev.describe()}"
    arch = os.environ.get(ARCH_ENV, "")
    if arch in SM100_ARCHS:
        return True, f"{ARCH_ENV}={arch}"
    return False, f"no GPU is visible and {ARCH_ENV} does not name an SM100 target ({', '.join(SM100_ARCHS)})"


def _sm_count(sm_count: int | None) -> int:
    if sm_count is not None:
        return int(sm_count)
    from jax_moe.ffi import gpu_backend  # noqa: PLC0415

    if gpu_backend():
        return int(getattr(jax.devices("gpu")[0], "core_count", DEFAULT_SM_COUNT) or DEFAULT_SM_COUNT)
    return DEFAULT_SM_COUNT


def masked_grouped_gemm_nvfp4(a, a_sf, b, b_sf, masked_m, alpha, *, sm_count: int | None = None) -> jax.Array:
    """NVFP4 x NVFP4 -> bf16 grouped GEMM on the batched format (see the module docstring for the
    operands). Jittable; no host sync. ``sm_count``: the persistent grid's size (default: the
    visible GPU's SM count, else :data:`DEFAULT_SM_COUNT`). Rows past ``masked_m`` are zeros."""
    shape = masked_grouped_gemm_nvfp4_shape(a, a_sf, b, b_sf, masked_m, alpha)
    e, m, n = shape.shape
    if m == 0:
        return jnp.zeros(shape.shape, shape.dtype)
    k = 2 * a.shape[2]
    masked_m = jnp.clip(masked_m, 0, m)
    ok, _ = kernel_target()
    if not ok:
        return masked_grouped_gemm_nvfp4_reference(a, a_sf, b, b_sf, masked_m, alpha)

    def cuda(a, a_sf, b, b_sf, masked_m, alpha):
        from jax_moe.backends import cutedsl_kernel  # noqa: PLC0415

        out = cutedsl_kernel.masked_gemm_call(a, a_sf, b, b_sf, masked_m, alpha, out_shape=shape, k=k,
                                              max_active_clusters=_sm_count(sm_count))
        return jnp.where(_rows_used(masked_m, m)[..., None], out, jnp.zeros((), out.dtype))

    return jax.lax.platform_dependent(a, a_sf, b, b_sf, masked_m, alpha, cuda=cuda,
                                      default=masked_grouped_gemm_nvfp4_reference)


def quantize_batched(x, global_scale, masked_m=None):
    """bf16/float rows [E, M, K] -> (a [E, M, K/2] uint8, a_sf tiles float8_e4m3fn) for
    :func:`masked_grouped_gemm_nvfp4`, NVFP4 with the quantization-side ``global_scale`` ([] or
    [E]); rows at or past ``masked_m`` (if given) quantize as zeros. K % 32 == 0."""
    x = jnp.asarray(x, jnp.float32)
    if x.ndim != 3:
        raise ValueError(f"x must be [E, M, K], got shape {list(x.shape)}")
    if x.shape[2] % ALIGN_K:
        raise ValueError(f"x: K = {x.shape[2]} must be a multiple of {ALIGN_K}")
    if masked_m is not None:
        x = jnp.where(_rows_used(masked_m, x.shape[1])[..., None], x, 0.0)
    g = jnp.asarray(global_scale, jnp.float32)
    g = g[:, None] if g.ndim == 1 else g  # [E] -> [E, 1]: one global per expert, every row
    q, sf, _ = fp4.quantize_nvfp4(x, jnp.broadcast_to(g, x.shape[:2]))
    return q, block_scale_interleave(sf)
