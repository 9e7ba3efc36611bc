"""The decode path of a gated MoE: few token slots, two launches, no sort.

At decode (a few tokens per step) the grouped-GEMM pipeline of :mod:`jax_moe.kernels` is a chain of
ten small launches around very little work: the sort, the permute and the group arrays cost as much
as the GEMMs save. :func:`decode_moe` is the same function for few slots as one custom call of two
kernels (``ffi/kernels/moe_decode.cu``): each slot reads its expert id directly and streams that
expert's weights through warps that each produce one output element::

    a[s, i]   = bf16(act(bf16(w13[e_s][gate(i)] . x[t]) + b13, bf16(w13[e_s][up(i)] . x[t]) + b13))
    out[t, h] = sum_j w[t, j] * (bf16(w2[e_j][h] . a[t*k + j]) + b2[e_j][h])

with s = t*k + j and e_s = topk_ids[t, j]; slots whose id is outside ``[0, E)`` contribute zero.
The roundings are the grouped path's (bf16 GEMM outputs, float32 activation and reduce), so both
paths compute one function. The weights are read in either layout, with no copy: as stored (K
contiguous: w13 [E, 2I, H], w2 [E, H, I]) or transposed at load time (N contiguous,
``transposed=True``: w13 [E, H, 2I], w2 [E, I, H]), where a CUDA block owns a chunk of output
columns and its warps split the rows; both give the same function. A slot re-reads its expert's
weights, so the path pays where slots rarely share an expert (:func:`serves`: at most
:data:`MAX_SLOTS` slots, at most one per two experts). Where no CUDA module runs,
:func:`decode_moe_reference` (jnp) computes the same.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import ffi
from jax_moe.activations import activate
from jax_moe.config import FLOAT_DTYPES, MoEConfig, check_dtype, check_rank
from jax_moe.kernels import ACTIVATIONS, LAYOUTS, _native
from jax_moe.layouts.transposed import transpose_experts
from jax_moe.quant.rounding import round_to

MAX_SLOTS = 16  # T*k at most this: the decode path (more slots: the grouped pipeline)


def serves(t: int, k: int, num_experts: int, cfg: MoEConfig) -> bool:
    """Whether a layer call of ``t`` tokens with top-``k`` over ``num_experts`` experts takes the
    decode path: a gated activation, at most :data:`MAX_SLOTS` slots and at most one slot per two
    experts (a slot streams its expert's weights itself, so shared experts would be read twice)."""
    slots = t * k
    return cfg.gated and 0 < slots <= MAX_SLOTS and 2 * slots <= num_experts


def check_layer(x, w13, w2, topk_weights, topk_ids, cfg: MoEConfig, transposed: bool = False) -> None:
    """ValueErrors naming what a decode call's arguments need: their ranks, the ids' and weights'
    dtypes, expert weights whose shapes agree with x, a gated activation."""
    check_rank("x", x, 2, "[T, H]")
    check_rank("topk_ids", topk_ids, 2, "[T, k]")
    check_dtype("topk_ids", topk_ids, ("int32",))
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
    check_rank("w13", w13, 3, "[E, H, 2I]" if transposed else "[E, 2I, H]")
    check_rank("w2", w2, 3, "[E, I, H]" if transposed else "[E, H, I]")
    t, h = x.shape
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk_weights {list(topk_weights.shape)} and topk_ids {list(topk_ids.shape)} must be [T, k] "
                         f"with x's T = {t}")
    e, n1 = w13.shape[0], w13.shape[2 if transposed else 1]
    if w13.shape[1 if transposed else 2] != h or n1 % 2:
        want = f"[E, H, 2I] = [{e}, {h}, 2I]" if transposed else f"[E, 2I, H] = [{e}, 2I, {h}]"
        raise ValueError(f"w13 must be {want} (x's H = {h}{', transposed' if transposed else ''}), "
                         f"got {list(w13.shape)}")
    want2 = (e, n1 // 2, h) if transposed else (e, h, n1 // 2)
    if w2.shape != want2:
        raise ValueError(f"w2 must be {'[E, I, H]' if transposed else '[E, H, I]'} = {list(want2)} (w13 "
                         f"{list(w13.shape)}{', transposed' if transposed else ''}), got {list(w2.shape)}")
    if not cfg.gated or cfg.activation not in ACTIVATIONS:
        raise ValueError(f"decode_moe takes gated activations {list(ACTIVATIONS)}, got {cfg.activation!r}")


def decode_moe_reference(x, w13, w2, topk_weights, topk_ids, cfg: MoEConfig, *, w13_bias=None, w2_bias=None,
                         out_dtype=None, transposed: bool = False) -> jax.Array:
    """jnp reference of :func:`decode_moe` (same arguments, both weight layouts, same result), written
    from the definition in the module note: each slot's expert weights gathered, bf16 products with
    float32 sums. Transposed weights are swapped back to the stored layout first."""
    check_layer(x, w13, w2, topk_weights, topk_ids, cfg, transposed)
    if transposed:
        w13, w2 = transpose_experts(w13), transpose_experts(w2)
    return _reference(x.astype(jnp.bfloat16), w13, w2, topk_weights.astype(jnp.float32), topk_ids, cfg,
                      w13_bias, w2_bias, jnp.dtype(out_dtype or x.dtype))


def _reference(x, w13, w2, w, ids, cfg, b13, b2, out_dt):
    e = w13.shape[0]
    ok = (ids >= 0) & (ids < e)
    ec = jnp.clip(ids, 0, e - 1)

    h1 = round_to(jnp.einsum("th,tknh->tkn", x, w13[ec], preferred_element_type=jnp.float32), jnp.bfloat16)
    if b13 is not None:
        h1 = h1 + b13.astype(jnp.float32)[ec]
    a = activate(h1, cfg).astype(jnp.bfloat16)
    y = round_to(jnp.einsum("tki,tkhi->tkh", a, w2[ec], preferred_element_type=jnp.float32), jnp.bfloat16)
    if b2 is not None:
        y = y + b2.astype(jnp.float32)[ec]
    y = jnp.where(ok[..., None], y, 0.0)
    return jnp.einsum("tkh,tk->th", y, w).astype(out_dt)


def decode_moe(x: jax.Array, w13: jax.Array, w2: jax.Array, topk_weights: jax.Array, topk_ids: jax.Array,
               cfg: MoEConfig, *, w13_bias=None, w2_bias=None, out_dtype=None, transposed: bool = False) -> jax.Array:
    """``out[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` for a gated MoE, in two
    kernels and no sort (see the module note).

    x [T, H] float (computed in bf16); w13 [E, 2I, H] bf16 (``cfg.gate_up_layout``: gate rows then
    up, or interleaved); w2 [E, H, I] bf16; topk_weights [T, k] float; topk_ids [T, k] int32 (ids
    outside [0, E) contribute zero); w13_bias [E, 2I] / w2_bias [E, H] float or None;
    ``cfg.activation`` silu, gelu or swigluoai (``cfg.swiglu_alpha``/``swiglu_limit``). With
    ``transposed`` the weights are in the N-contiguous load-time layout instead, read as they are:
    w13 [E, H, 2I] = swapaxes(w13, 1, 2) (the same gate/up order along its columns) and w2
    [E, I, H] = swapaxes(w2, 1, 2), both bf16; biases as above. Returns [T, H] in ``out_dtype``
    (default x's dtype). Any T works; :func:`serves` says where it is the faster path.
    """
    check_layer(x, w13, w2, topk_weights, topk_ids, cfg, transposed)
    t, h = x.shape
    k, i = topk_ids.shape[1], w2.shape[1 if transposed else 2]
    out_dt = jnp.dtype(out_dtype or x.dtype)
    xb, w = x.astype(jnp.bfloat16), topk_weights.astype(jnp.float32)
    b13 = None if w13_bias is None else jnp.asarray(w13_bias, jnp.float32)
    b2 = None if w2_bias is None else jnp.asarray(w2_bias, jnp.float32)

    def reference(xb, w, ids, w13, w2, b13, b2):
        return decode_moe_reference(xb, w13, w2, w, ids, cfg, w13_bias=b13, w2_bias=b2, out_dtype=out_dt,
                                    transposed=transposed)

    def cuda(xb, w, ids, w13, w2, b13, b2):
        none = jnp.zeros((0,), jnp.float32)
        outs = (jax.ShapeDtypeStruct((t, h), out_dt), jax.ShapeDtypeStruct((t * k, i), jnp.bfloat16))
        out, _ = jax.ffi.ffi_call("jax_moe_decode_moe", outs, vmap_method="sequential")(
            xb, ids, w, w13, w2, none if b13 is None else b13, none if b2 is None else b2,
            activation=ACTIVATIONS[cfg.activation], layout=LAYOUTS[cfg.gate_up_layout],
            alpha=np.float32(cfg.swiglu_alpha), limit=np.float32(cfg.swiglu_limit), transposed=np.int64(transposed))
        return out

    if t == 0:
        return jnp.zeros((0, h), out_dt)
    return _native(cuda, reference, xb, w, topk_ids, w13, w2, b13, b2)


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One of the decode path's two CUDA launches: ``kernel`` (its name, as a trace shows it, without
    template arguments) on a ``grid`` of (column blocks, slots or tokens) blocks of ``threads``
    threads. The column kernels (transposed weights) read chunks of ``vecs`` 16-byte vectors of each
    row with ``depth`` rows in flight per thread; the GEMV kernels give each warp
    ``outputs_per_warp`` outputs (0 where a field does not apply)."""

    kernel: str
    grid: tuple[int, int]
    threads: int
    vecs: int = 0
    depth: int = 0
    outputs_per_warp: int = 0

    @property
    def blocks(self) -> int:
        return self.grid[0] * self.grid[1]


def kernel_launches(t: int, k: int, h: int, i: int, *, sms: int, scheme: str = "bf16",
                    transposed: bool = False) -> tuple[KernelLaunch, KernelLaunch]:
    """(GEMM1, GEMM2): the launches the CUDA decode kernels make for ``t`` tokens of top-``k`` slots,
    hidden size ``h`` and intermediate size ``i`` on a GPU of ``sms`` SMs: :func:`decode_moe`
    (``scheme="bf16"``, weights as stored or ``transposed``) or :func:`jax_moe.decode_fp8.decode_moe_fp8`
    (``"fp8"``, as stored). The rules are the kernels' own (``ffi/kernels/decode_launch.h``), read
    from the CPU module, so this needs no GPU."""
    if scheme not in ("bf16", "fp8"):
        raise ValueError(f"scheme must be 'bf16' or 'fp8', got {scheme!r}")
    if scheme == "fp8" and transposed:
        raise ValueError("the FP8 decode kernels read the weights as stored: transposed must be False for 'fp8'")
    for name, v in (("t", t), ("k", k), ("h", h), ("i", i), ("sms", sms)):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    plan = ffi.native_module("cpu").decode_launches(t=int(t), k=int(k), h=int(h), i=int(i), fp8=scheme == "fp8",
                                                    transposed=bool(transposed), sms=int(sms))
    return tuple(KernelLaunch(**{**plan[g], "grid": tuple(plan[g]["grid"])}) for g in ("gemm1", "gemm2"))
