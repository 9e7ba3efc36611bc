"""The decode path of a gated MoE on FP8 weights (W8A8 with per-tensor activation scales).

:mod:`jax_moe.decode` on ``float8_e4m3fn`` weights: two kernels (``ffi/kernels/moe_decode_fp8.cu``)
where the grouped FP8 pipeline runs seven launches around very little work, and the weights stream at
one byte each. Per slot s = t*k + j with expert e = topk_ids[t, j]::

    xq        = fp8(x[t] / s1)
    h[s]      = (w13[e] . xq) * s1 * c13[e] + b13[e]                  float32
    a[s]      = fp8(act(h[s]) / s2)
    out[t, h] = sum_j w[t, j] * (bf16((w2[e_j][h] . a[s]) * s2 * c2[e_j, h]) + b2[e_j][h])

s1 and s2 are the per-tensor activation scales (``a13_scale``, ``a2_scale``), c13 and c2 the weight
scales per tensor, per expert or per channel; FP8 values multiply exactly in float32 and the sums are
float32. This is the grouped FP8 path's arithmetic (:func:`jax_moe.backends.cutlass.apply`: GEMM1's
epilogue computes the activation on float32 and quantizes it with s2; GEMM2's rows are rounded to
bf16 before the bias and the weighted sum), up to the order of the sums. Slots whose id is outside
``[0, E)`` contribute zero. Where no CUDA module runs, :func:`decode_moe_fp8_reference` (jnp)
computes the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.activations import activate
from jax_moe.backends.cutlass_gemm import kernel_scales
from jax_moe.config import MoEConfig, check_dtype
from jax_moe.decode import check_layer
from jax_moe.kernels import ACTIVATIONS, LAYOUTS, _native
from jax_moe.quant.fp8 import quantize_fp8_static
from jax_moe.quant.rounding import round_to

ALIGN = 16  # H and I: 16-byte rows of FP8
MAX_SHARED = 48 * 1024  # bytes: x's quantized row (H) and a token's activations (k * I) live in shared memory


def serves(quant, h: int, i: int, k: int) -> bool:
    """Whether an FP8 layer's ``quant`` (a :class:`~jax_moe.quant.scheme.QuantConfig`) and sizes take
    this path: FP8 weights scaled per tensor, expert or channel, per-tensor activations with a static
    GEMM2 input scale (``a2_scale``; ``a13_scale`` static or dynamic), H and I multiples of 16, H and
    k * I at most :data:`MAX_SHARED`."""
    return (quant is not None and quant.scheme == "fp8" and quant.act == "fp8_per_tensor"
            and quant.a2_scale is not None and _fits(h, i, k))


def _fits(h: int, i: int, k: int) -> bool:
    return h % ALIGN == 0 and i % ALIGN == 0 and h <= MAX_SHARED and k * i <= MAX_SHARED


def _check(x, w13, w2, topk_weights, topk_ids, cfg: MoEConfig, a13_scale, a2_scale, w13_scale, w2_scale) -> None:
    check_layer(x, w13, w2, topk_weights, topk_ids, cfg)
    check_dtype("w13", w13, ("float8_e4m3fn",))
    check_dtype("w2", w2, ("float8_e4m3fn",))
    e, h, i, k = w13.shape[0], x.shape[1], w2.shape[2], topk_ids.shape[1]
    if not _fits(h, i, k):
        raise ValueError(f"decode_moe_fp8 needs H and I multiples of {ALIGN}, H and k * I at most {MAX_SHARED}; "
                         f"got H = {h}, I = {i}, k = {k}")
    for name, s in (("a13_scale", a13_scale), ("a2_scale", a2_scale)):
        if s is None or jnp.size(s) != 1:
            raise ValueError(f"{name} must be one float32 scale (per tensor), got "
                             f"{None if s is None else list(jnp.shape(s))}")
    for name, s, n in (("w13_scale", w13_scale, 2 * i), ("w2_scale", w2_scale, h)):
        shape = tuple(jnp.shape(s))
        if shape not in ((), (e,), (e, n), (e, n, 1)):
            raise ValueError(f"{name} must be [] (per tensor), [E] = [{e}] (per expert) or [E, N] = [{e}, {n}] "
                             f"(per channel, or [E, N, 1]), got {list(shape)}")


def _scales(a13_scale, a2_scale, w13_scale, w2_scale, e: int, h: int, i: int):
    """The kernel's scale operands: s1 [1], s2 [1], c13 [E, 2I] / [E, 1] / [1, 1], c2 [E, H] / [E, 1] /
    [1, 1], float32 (:func:`~jax_moe.backends.cutlass_gemm.kernel_scales`' column forms)."""
    s1, c13 = kernel_scales(jnp.asarray(a13_scale, jnp.float32), jnp.asarray(w13_scale, jnp.float32), (1,), e, 2 * i)
    s2, c2 = kernel_scales(jnp.asarray(a2_scale, jnp.float32), jnp.asarray(w2_scale, jnp.float32), (1,), e, h)
    return s1, s2, c13, c2


def decode_moe_fp8_reference(x, w13, w2, topk_weights, topk_ids, cfg: MoEConfig, *, a13_scale, a2_scale,
                             w13_scale, w2_scale, w13_bias=None, w2_bias=None, out_dtype=None) -> jax.Array:
    """jnp reference of :func:`decode_moe_fp8` (same arguments, same result), written from the
    definition in the module note: FP8 values as float32, float32 products and sums."""
    _check(x, w13, w2, topk_weights, topk_ids, cfg, a13_scale, a2_scale, w13_scale, w2_scale)
    e, h, i = w13.shape[0], x.shape[1], w2.shape[2]
    s1, s2, c13, c2 = _scales(a13_scale, a2_scale, w13_scale, w2_scale, e, h, i)
    return _reference(x, w13, w2, topk_weights.astype(jnp.float32), topk_ids, cfg, s1, s2, c13, c2, w13_bias, w2_bias,
                      jnp.dtype(out_dtype or x.dtype))


def _reference(x, w13, w2, w, ids, cfg, s1, s2, c13, c2, b13, b2, out_dt):
    """The definition on the kernel's operands (scales in :func:`_scales`' forms)."""
    e, h, i = w13.shape[0], x.shape[1], w2.shape[2]
    s1, s2 = s1.reshape(()), s2.reshape(())
    c13, c2 = jnp.broadcast_to(c13, (e, 2 * i)), jnp.broadcast_to(c2, (e, h))
    ok = (ids >= 0) & (ids < e)
    ec = jnp.clip(ids, 0, e - 1)
    hi = jax.lax.Precision.HIGHEST
    xq = quantize_fp8_static(x.astype(jnp.float32), s1).astype(jnp.float32)
    h1 = jnp.einsum("th,tknh->tkn", xq, w13[ec].astype(jnp.float32), precision=hi) * (s1 * c13[ec])
    if b13 is not None:
        h1 = h1 + jnp.asarray(b13, jnp.float32)[ec]
    aq = quantize_fp8_static(activate(h1, cfg), s2).astype(jnp.float32)
    y = round_to(jnp.einsum("tki,tkhi->tkh", aq, w2[ec].astype(jnp.float32), precision=hi) * (s2 * c2[ec]),
                 jnp.bfloat16)
    if b2 is not None:
        y = y + jnp.asarray(b2, jnp.float32)[ec]
    y = jnp.where(ok[..., None], y, 0.0)
    return jnp.einsum("tkh,tk->th", y, w, precision=hi).astype(out_dt)


def decode_moe_fp8(x: jax.Array, w13: jax.Array, w2: jax.Array, topk_weights: jax.Array, topk_ids: jax.Array,
                   cfg: MoEConfig, *, a13_scale, a2_scale, w13_scale, w2_scale, w13_bias=None, w2_bias=None,
                   out_dtype=None) -> jax.Array:
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for a gated MoE on FP8
    weights, in two kernels and no sort (see the module note).

    x [T, H] float (bf16, f16 or f32, quantized from its own dtype); w13 [E, 2I, H] float8_e4m3fn
    (``cfg.gate_up_layout``); w2 [E, H, I] float8_e4m3fn; topk_weights [T, k] float; topk_ids [T, k]
    int32 (ids outside [0, E) contribute zero); ``a13_scale``, ``a2_scale``: the per-tensor
    activation scales, [] or [1] float32; ``w13_scale``, ``w2_scale``: the weights' dequantization
    scales, [] (per tensor), [E] (per expert) or [E, N] / [E, N, 1] (per channel, N = 2I and H);
    w13_bias [E, 2I] / w2_bias [E, H] float or None; ``cfg.activation`` silu, gelu or swigluoai.
    H and I multiples of 16, H and k * I at most 49152. Returns [T, H] in ``out_dtype`` (default x's dtype).
    """
    _check(x, w13, w2, topk_weights, topk_ids, cfg, a13_scale, a2_scale, w13_scale, w2_scale)
    t, h = x.shape
    e, k, i = w13.shape[0], topk_ids.shape[1], w2.shape[2]
    out_dt = jnp.dtype(out_dtype or x.dtype)
    if t == 0:
        return jnp.zeros((0, h), out_dt)
    s1, s2, c13, c2 = _scales(a13_scale, a2_scale, w13_scale, w2_scale, e, h, i)
    w = topk_weights.astype(jnp.float32)
    b13 = None if w13_bias is None else jnp.asarray(w13_bias, jnp.float32)
    b2 = None if w2_bias is None else jnp.asarray(w2_bias, jnp.float32)

    def reference(x, w, ids, w13, w2, s1, s2, c13, c2, b13, b2):
        return _reference(x, w13, w2, w, ids, cfg, s1, s2, c13, c2, b13, b2, out_dt)

    def cuda(x, w, ids, w13, w2, s1, s2, c13, c2, b13, b2):
        none = jnp.zeros((0,), jnp.float32)
        outs = (jax.ShapeDtypeStruct((t, h), out_dt), jax.ShapeDtypeStruct((t * k, i), jnp.float8_e4m3fn))
        out, _ = jax.ffi.ffi_call("jax_moe_decode_moe_fp8", outs, vmap_method="sequential")(
            x, ids, w, w13, w2, s1, s2, c13, c2, none if b13 is None else b13, none if b2 is None else b2,
            activation=ACTIVATIONS[cfg.activation], layout=LAYOUTS[cfg.gate_up_layout],
            alpha=np.float32(cfg.swiglu_alpha), limit=np.float32(cfg.swiglu_limit))
        return out

    return _native(cuda, reference, x, w, topk_ids, w13, w2, s1, s2, c13, c2, b13, b2)
