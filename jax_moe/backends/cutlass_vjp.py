"""``backend="cutlass"``'s bf16 pipeline, forward and backward, on jax_moe's own kernels.

Forward (:func:`forward`), rows in expert-sorted order (:mod:`jax_moe.kernels`)::

    sort = sort_by_expert(topk_ids, E)                         # jax_moe.ffi
    a1 = permute_rows(x, sort.sorted_slots, k, inverse)        # [R, H]   R = T*k, written in slot order
    h1 = grouped_gemm(a1, w13, sort.offsets)                   # [R, 2I]  (I for relu2)
    a2 = act_and_mul(h1, bias=b13, offsets)                    # [R, I]   act(h1 + b13[e(row)])
    y = grouped_gemm(a2, w2, sort.offsets)                     # [R, H]
    out = unpermute_reduce(y, sort.inverse, topk_weights, bias=b2, offsets)   # [T, H]

or, with ``finalize`` scattering where nothing is saved for a backward (``residuals="recompute"``),
GEMM2 adds each row times its weight into its token's output row in its epilogue
(:mod:`jax_moe.backends.cutlass_scatter_gemm`)::

    out = grouped_gemm_scatter(a2, w2, sort.offsets, sort.sorted_slots, topk_weights, bias=b2)   # [T, H]

Where nothing is saved for a backward (``residuals="recompute"``), the gate/up rows are
interleaved and GEMM1 runs a tile that fuses it (:data:`~jax_moe.backends.cutlass_act_gemm.FUSED_TILES`),
GEMM1 and the activation are one kernel (:mod:`jax_moe.backends.cutlass_act_gemm`),
``a2 = grouped_gemm_act(a1, w13, sort.offsets, activation, bias=b13)``, and h1 is never written.
On transposed weights (``transposed=True``: w13 [E, H, 2I], w2 [E, I, H], N contiguous, the
inference layout of :mod:`jax_moe.backends.cutlass_prepared`) both GEMMs read ``b [E, K, N]``
(:func:`~jax_moe.backends.cutlass_grad_gemm.grouped_gemm_dgrad`'s kernel, and the act kind's
``transposed`` form); nothing else changes.

The activation follows ``cfg`` (silu, gelu, swigluoai with its alpha and limit; gate/up
concatenated or interleaved; relu2 in jnp); the expert biases b13 [E, 2I] and b2 [E, H] are
optional, each row's expert being the e with ``offsets[e] <= row < offsets[e+1]``.

Backward (:func:`backward`, the cotangent g [T, H]), the same rows and offsets::

    dy = permute_rows(g) * topk_weights[slot]                  # [R, H]
    dtw[t, j] = <g[t], y[row(t, j)] + b2[e]>                   # [T, k]  (the router learns)
    da2 = grouped_gemm_dgrad(dy, w2, offsets)                  # [R, I]   dy @ w2[e]
    dw2 = grouped_gemm_wgrad(dy, a2, offsets)                  # [E, H, I]
    db2[e] = sum of dy over e's rows                           # [E, H]
    dh1 = vjp(act)(h1 + b13[e], da2)                           # [R, 2I]  (jnp, float32)
    db13[e] = sum of dh1 over e's rows                         # [E, 2I]
    da1 = grouped_gemm_dgrad(dh1, w13, offsets)                # [R, H]   dh1 @ w13[e]
    dw13 = grouped_gemm_wgrad(dh1, a1, offsets)                # [E, 2I, H]
    dx = unpermute_reduce(da1, inverse, ones)                  # [T, H]

The activation's VJP is ``jax.vjp`` of its jnp definition (:func:`jax_moe.activations.activate`,
on the pre-activation ``h1 + b13[e]``), which XLA fuses into one elementwise pass; the bias
gradients are ``jax.ops.segment_sum`` over the rows' experts. Residuals (:func:`forward`'s second result): with
``residuals="save"`` the permuted rows ``a1``, GEMM1's pre-activation ``h1`` and GEMM2's rows
``y`` (named ``"moe_a1"``, ``"moe_h1"``, ``"moe_y"`` with ``jax.ad_checkpoint.checkpoint_name``,
so remat policies can pick them), plus the sort; with ``"recompute"`` only the inputs, and the
backward runs the forward again. Rows of slots whose expert is outside ``[0, E)`` (ids of -1)
sort last and carry no gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jax_moe import ffi, kernels
from jax_moe.activations import activate
from jax_moe.backends.cutlass_act_gemm import forward_gemm1, gemm1_with_activation
from jax_moe.backends.cutlass_gemm import grouped_gemm
from jax_moe.backends.cutlass_grad_gemm import grouped_gemm_dgrad, grouped_gemm_wgrad
from jax_moe.backends.cutlass_scatter_gemm import scattered_gemm2, scatters
from jax_moe.config import MoEConfig

RESIDUALS = ("save", "recompute")


def relu2_rows(h, valid, dtype, bias=None, offsets=None):
    """relu(h + bias[e(row)])^2 in float32, rows at or past ``valid[0]`` zero (act_and_mul's
    convention); ``bias`` [E, I] float32 with ``offsets`` [E+1] (the rows' experts), or None."""
    rows = jnp.arange(h.shape[0], dtype=jnp.int32) < valid[0]
    hf = h.astype(jnp.float32)
    if bias is not None:
        hf = hf + bias[kernels.expert_of_row(offsets, h.shape[0])]
    r = jnp.maximum(hf, 0.0)
    return jnp.where(rows[:, None], r * r, 0.0).astype(dtype)


def act_options(cfg: MoEConfig) -> dict:
    """:func:`jax_moe.kernels.act_and_mul`'s keywords for ``cfg``: the gate/up layout and swigluoai's constants."""
    return dict(layout=cfg.gate_up_layout, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)


def bias_options(bias, offsets) -> dict:
    """The kernels' ``bias``/``offsets`` keywords: a float32 bias with the sort's offsets, or nothing."""
    return {} if bias is None else dict(bias=bias.astype(jnp.float32), offsets=offsets)


def activation(h1, cfg: MoEConfig, valid, offsets, b13, dtype=jnp.bfloat16):
    """GEMM2's input from GEMM1's rows: the fused act_and_mul (gated) or relu(h)^2 in jnp, the
    rows' expert bias ``b13`` [E, w13 rows] (or None) added first; rows at or past ``valid[0]`` zero."""
    if cfg.gated:
        return kernels.act_and_mul(h1, cfg.activation, valid_rows=valid, out_dtype=dtype, **act_options(cfg),
                                   **bias_options(b13, offsets))
    return relu2_rows(h1, valid, dtype, None if b13 is None else b13.astype(jnp.float32), offsets)


def forward(x, w13, w2, topk_weights, topk_ids, cfg: MoEConfig, *, w13_bias=None, w2_bias=None,
            apply_router_weight_on_input: bool = False, tile: str = "auto", residuals: str = "save",
            transposed: bool = False, finalize: str = "gather"):
    """The bf16 forward on checked arguments -> (out [T, H] in x's dtype, residuals).

    x [T, H] float (computed in bf16); w13 [E, 2I, H] bf16; w2 [E, H, I] bf16; topk_weights
    [T, k] float; topk_ids [T, k] int32; w13_bias [E, 2I] / w2_bias [E, H] float (added in
    float32) or None. ``tile``: both GEMMs' (``"auto"``: each GEMM picks its own,
    :mod:`jax_moe.backends.cutlass_tiles`).
    ``residuals``: what the backward gets (see the module note); :func:`backward` takes them.
    ``transposed``: w13 [E, H, 2I] and w2 [E, I, H] (N contiguous), ``residuals="recompute"`` only.
    ``finalize``: how a token's k rows are summed (:func:`~jax_moe.backends.cutlass_scatter_gemm.scatters`);
    the scatter form (GEMM2's epilogue adds them into the output) only with ``residuals="recompute"``
    (the backward's own forward keeps GEMM2's rows: the router weights' gradient reads them).
    """
    if residuals not in RESIDUALS:
        raise ValueError(f"residuals must be one of {RESIDUALS}, got {residuals!r}")
    if transposed and residuals != "recompute":
        raise ValueError("transposed weights are an inference layout: forward(..., residuals='recompute') only")
    gemm = grouped_gemm_dgrad if transposed else grouped_gemm
    e, k = w13.shape[0], topk_ids.shape[1]
    tw = topk_weights.astype(jnp.float32)
    sort, valid = ffi.sort_by_expert_valid(topk_ids.astype(jnp.int32), e)  # valid [1]: rows of experts in [0, E)
    xin = x.astype(jnp.float32) * tw if apply_router_weight_on_input else x
    a1 = kernels.permute_rows(xin.astype(jnp.bfloat16), sort.sorted_slots, k, valid_rows=valid, inverse=sort.inverse)
    tile1, fused = forward_gemm1(cfg, None, tile, a1, w13, transposed) if residuals == "recompute" else (tile, False)
    if fused:  # no h1 to keep
        a2 = gemm1_with_activation(a1, w13, sort.offsets, cfg, w13_bias=w13_bias, tile=tile1, transposed=transposed)
    else:
        h1 = gemm(a1, w13, sort.offsets, tile=tile1)
        a2 = activation(h1, cfg, valid, sort.offsets, w13_bias)
    res = {"x": x, "topk_weights": topk_weights, "topk_ids": topk_ids, "w13": w13, "w2": w2,
           "w13_bias": w13_bias, "w2_bias": w2_bias}
    if residuals == "recompute" and scatters(finalize, bf16_out=jnp.dtype(x.dtype) == jnp.bfloat16):
        out = scattered_gemm2(a2, w2, sort, topk_weights, w2_bias=w2_bias, tile=tile, transposed=transposed,
                              apply_router_weight_on_input=apply_router_weight_on_input)
        return out.astype(x.dtype), res
    y = gemm(a2, w2, sort.offsets, tile=tile)
    out = kernels.unpermute_reduce(y, sort.inverse, tw, valid_rows=valid, out_dtype=x.dtype,
                                   apply_router_weight_on_input=apply_router_weight_on_input,
                                   **bias_options(w2_bias, sort.offsets))
    if residuals == "save":
        res.update(sort=sort, valid=valid, a1=checkpoint_name(a1, "moe_a1"), h1=checkpoint_name(h1, "moe_h1"),
                   y=checkpoint_name(y, "moe_y"))
    return out, res


def backward(res: dict, g: jax.Array, cfg: MoEConfig, *, apply_router_weight_on_input: bool = False,
             tile: str = "auto", residuals: str = "save"):
    """The VJP of :func:`forward` at its residuals for the cotangent g [T, H] ->
    (dx [T, H], dw13 [E, 2I, H], dw2 [E, H, I], dtopk_weights [T, k], dw13_bias [E, 2I] or None,
    dw2_bias [E, H] or None), each in its input's dtype."""
    x, topk_weights, w13, w2 = res["x"], res["topk_weights"], res["w13"], res["w2"]
    b13, b2 = res["w13_bias"], res["w2_bias"]
    if residuals == "recompute":
        _, res = forward(x, w13, w2, topk_weights, res["topk_ids"], cfg, w13_bias=b13, w2_bias=b2, tile=tile,
                         residuals="save", apply_router_weight_on_input=apply_router_weight_on_input)
    sort, a1, h1, y = res["sort"], res["a1"], res["h1"], res["y"]
    t, k = topk_weights.shape
    e = w13.shape[0]
    valid = res["valid"]
    tw = topk_weights.astype(jnp.float32)
    slot_ok = (sort.inverse < valid[0]).reshape(t, k)  # slots whose expert is on this rank
    row_expert = kernels.expert_of_row(sort.offsets, h1.shape[0])

    # out[t] = sum_j w[t, j] * (y[row(t, j)] + b2[e])  (router weight on input: a plain sum)
    g_rows = kernels.permute_rows(g.astype(jnp.bfloat16), sort.sorted_slots, k, valid_rows=valid,
                                  inverse=sort.inverse)
    if apply_router_weight_on_input:
        dy_f32 = g_rows.astype(jnp.float32)
    else:
        w_rows = tw.reshape(-1)[sort.sorted_slots]
        dy_f32 = g_rows.astype(jnp.float32) * w_rows[:, None]
        y_slots = jnp.take(y, sort.inverse, axis=0, mode="fill", fill_value=0).reshape(t, k, -1)
        dtw = jnp.einsum("th,tkh->tk", g.astype(jnp.float32), y_slots.astype(jnp.float32))
        if b2 is not None:  # <g[t], b2[e]> for e = topk_ids[t, j]
            gb = g.astype(jnp.float32) @ b2.astype(jnp.float32).T  # [T, E]
            dtw = dtw + jnp.take_along_axis(gb, jnp.clip(res["topk_ids"], 0, e - 1).astype(jnp.int32), axis=1)
        dtw = jnp.where(slot_ok, dtw, 0.0)
    dy = dy_f32.astype(jnp.bfloat16)
    db2 = None if b2 is None else jax.ops.segment_sum(dy_f32, row_expert, num_segments=e).astype(b2.dtype)

    # y = a2 @ w2[e].T ; a2 = act(h1 + b13[e])
    a2, act_vjp = jax.vjp(lambda h: _masked_act(h, cfg, valid, row_expert, b13), h1.astype(jnp.float32))
    da2 = grouped_gemm_dgrad(dy, w2, sort.offsets, tile=tile)
    dw2 = grouped_gemm_wgrad(dy, a2.astype(jnp.bfloat16), sort.offsets)
    (dh1_f32,) = act_vjp(da2.astype(jnp.float32))
    dh1 = dh1_f32.astype(jnp.bfloat16)
    db13 = None if b13 is None else jax.ops.segment_sum(dh1_f32, row_expert, num_segments=e).astype(b13.dtype)

    # h1 = a1 @ w13[e].T ; a1 = xin[slot // k]
    da1 = grouped_gemm_dgrad(dh1, w13, sort.offsets, tile=tile)
    dw13 = grouped_gemm_wgrad(dh1, a1, sort.offsets)
    dxin = kernels.unpermute_reduce(da1, sort.inverse, jnp.ones_like(tw), valid_rows=valid, out_dtype=jnp.float32)
    if apply_router_weight_on_input:  # xin = x * w (top-1)
        dx = dxin * tw
        dtw = jnp.sum(dxin * x.astype(jnp.float32), axis=1, keepdims=True)
        dtw = jnp.where(slot_ok, dtw, 0.0)
    else:
        dx = dxin
    return (dx.astype(x.dtype), dw13.astype(w13.dtype), dw2.astype(w2.dtype), dtw.astype(topk_weights.dtype),
            db13, db2)


def _masked_act(h, cfg: MoEConfig, valid, row_expert, b13):
    """The activation's jnp definition on float32 rows plus their expert's bias, rows at or past
    ``valid[0]`` zero."""
    rows = jnp.arange(h.shape[0], dtype=jnp.int32) < valid[0]
    if b13 is not None:
        h = h + b13.astype(jnp.float32)[row_expert]
    return jnp.where(rows[:, None], activate(h, cfg), 0.0)
