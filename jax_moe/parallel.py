"""Expert, tensor and data parallelism on JAX's own engine: a ``Mesh``, ``shard_map`` and XLA's
collectives. No communication layer of our own.

Layout on a mesh with (some of) the axes ``dp``, ``ep``, ``tp``:

- tokens (x [T, H], router logits, top-k ids/weights) are split over ``(dp, ep)``: every
  device of the expert-parallel group brings its own tokens, as in vLLM's DP+EP;
- experts are split over ``ep``: device r of the group owns global experts
  ``[r * E/ep, (r + 1) * E/ep)`` (vLLM's expert map: global id -> local id or -1);
- the intermediate size is split over ``tp``: w13 column-parallel, w2 row-parallel, the output
  summed over ``tp`` (after the combine, on each device's own tokens; a w2 bias counted once).
  :func:`shard_weights` reorders w13's rows once, at load time, so that a contiguous split of
  its 2I rows gives every device its own gate rows then its own up rows. Quantized weights
  split over ``tp`` only where that changes no scale (per-tensor or per-expert weight scales,
  a static scale at GEMM2's input).

Weights in a backend's own layout (``flashinfer_cutlass``): :func:`shard_prepared` lets every
device repack only its own (ep, tp) block; :func:`parallel_apply_prepared` runs them.

Prepare/finalize strategies (``ParallelConfig.strategy``):

- ``"none"``: no expert parallelism (``ep`` absent); experts replicated over ``dp``.
- ``"naive"`` (vLLM's naive EP): all-gather tokens, ids and weights over ``ep``; each device runs
  its local experts on every token; a reduce-scatter brings each token's sum home.
- ``"all_to_all"``: each token goes only to the devices owning one of its experts. By default
  a fixed ``[ep, T_local, H]`` all-to-all carries those rows, zero-padded; with
  ``ragged=True``, ``jax.lax.ragged_all_to_all`` moves just the rows (fewer bytes, but XLA's
  GPU implementation measured 44 ms for 16 MB/device where the padded all-to-all took 0.9 ms:
  2 x H200, jax 0.11.2, bench/ep_parts.py; not on CPU). The reverse exchange brings the
  partial outputs back, summed in float32.

The local experts' input after the dispatch (``ParallelConfig.expert_format``):

- ``"standard"``: the received rows [M, H] with their local ids [M, k] (-1 for experts owned
  elsewhere) go to the backend's ``apply``, which routes and reduces them itself;
- ``"batched"`` (vLLM's batched format): the received token copies are laid out by local expert
  as [E_local, C, H] with counts [E_local] (:func:`jax_moe.permute.batched_layout`), the
  backend's ``apply_batched`` runs on them (``cutlass``, ``xla``: the oracle feature
  ``"batched"``; others are refused with the reason), and each slot's row is gathered back and
  reduced over k with its routing weight (float32) before the combine. The capacity is
  ``C = M``, the rows the device received (``ep * T_local`` under ``naive`` and ``all_to_all``):
  a row brings at most one copy to each expert (slots of one row naming the same expert share
  it), so C is always enough and nothing is dropped; the price is [E_local, M, H] of memory,
  E_local times the standard format's. Quantization happens where it does in the standard
  format: an NVFP4 payload quantized before the dispatch is laid out row by row with its block
  scales; FP8 activations are quantized by the expert stage on the receiving device (per-token
  scales as on one device; a dynamic per-tensor scale over the rows received, in both formats).
  Not for :func:`parallel_apply_prepared`.

Quantization before the dispatch (vLLM's order): with FP8 prepared weights and with NVFP4
activations (``act="nvfp4"``, for a backend listing it in ``PREQUANTIZED_INPUT``) every device
quantizes its own tokens and the quantized bytes travel (NVFP4: packed E2M1 and the linear
block scales, swizzled to 128x4 tiles after the exchange for a backend that reads those). A
dynamic scale is the max over every device's tokens, so each token is quantized as on one device.

Non-finite isolation (as on one device, :mod:`jax_moe.backends.xla`): a NaN, an infinity or an
overflow in an expert no token routes to, or in one token, reaches no other token under any
strategy, expert format or mesh. Every exchange moves rows selected with ``where`` (never rows
multiplied by a zero mask), each device's backend isolates its own experts, slots of experts
owned elsewhere (-1) contribute exact zeros, and a dynamic scale taken before the dispatch is a
max over finite values.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_moe import oracle
from jax_moe.config import as_jax
from jax_moe.experts import moe_config_from_arrays, run_experts, run_experts_batched
from jax_moe.layouts.scales import block_scale_interleave
from jax_moe.permute import batched_finalize, batched_layout, to_batched
from jax_moe.quant import fp4, fp8
from jax_moe.quant.scheme import nvfp4_activation_global_scale
from jax_moe.routing import select_experts

STRATEGIES = ("none", "naive", "all_to_all")
EXPERT_FORMATS = ("standard", "batched")


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Which mesh axes split tokens (``dp_axis``, and ``ep_axis``), experts (``ep_axis``) and the
    intermediate size (``tp_axis``); ``None`` for an axis not used."""

    mesh: Mesh
    ep_axis: str | None = None
    tp_axis: str | None = None
    dp_axis: str | None = None
    strategy: str = "naive"
    ragged: bool = False  # all_to_all: the ragged_all_to_all exchange (see above)
    expert_format: str = "standard"  # the local experts' input after the dispatch (see above)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {self.expert_format!r}")
        for name in ("ep_axis", "tp_axis", "dp_axis"):
            axis = getattr(self, name)
            if axis is not None and axis not in self.mesh.axis_names:
                raise ValueError(f"{name}={axis!r} is not an axis of the mesh {self.mesh.axis_names}")
        if (self.strategy == "none") != (self.ep_axis is None):
            raise ValueError("strategy 'none' is for meshes without ep_axis; 'naive' and 'all_to_all' need ep_axis")

    def size(self, axis: str | None) -> int:
        return 1 if axis is None else self.mesh.shape[axis]

    @property
    def token_axes(self) -> tuple[str, ...]:
        return tuple(a for a in (self.dp_axis, self.ep_axis) if a is not None)

    @property
    def token_spec(self) -> P:
        axes = self.token_axes
        return P(axes if axes else None)


# ------------------------------------------------------------------------- load time


def tp_row_order(rows: int, tp: int, gate_up_layout: str, gated: bool) -> np.ndarray:
    """Row order of w13 such that shard s of a contiguous ``tp``-way split holds, in concat
    layout, gate rows ``[s*I/tp, (s+1)*I/tp)`` then the same up rows. Identity when not gated
    or interleaved (pairs stay together in a contiguous split)."""
    if not gated or gate_up_layout == "interleaved" or tp == 1:
        return np.arange(rows)
    inter = rows // 2
    part = inter // tp
    order = [np.r_[s * part:(s + 1) * part, inter + s * part:inter + (s + 1) * part] for s in range(tp)]
    return np.concatenate(order)


def shard_weights(w13, w2, pcfg: ParallelConfig, *, activation: str = "silu", gate_up_layout: str = "concat",
                  w13_bias=None, w2_bias=None, quant=None) -> dict:
    """Place the expert weights on the mesh once, at load time: experts over ``ep``, the
    intermediate size over ``tp`` (w13's rows reordered by :func:`tp_row_order`).

    Returns a dict with w13, w2, w13_bias, w2_bias, quant ready for :func:`parallel_fused_experts`.
    """
    from jax_moe.config import ACTIVATIONS

    gated = ACTIVATIONS[activation]
    e, rows = w13.shape[:2]
    ep, tp = pcfg.size(pcfg.ep_axis), pcfg.size(pcfg.tp_axis)
    if e % ep:
        raise ValueError(f"the number of experts E={e} must be a multiple of the ep size {ep}")
    inter = rows // 2 if gated else rows
    if inter % tp:
        raise ValueError(f"the intermediate size I={inter} must be a multiple of the tp size {tp}")
    if quant is not None and tp > 1:
        why = _tp_quant_refusal(quant)
        if why:
            raise ValueError(f"tensor parallelism over these quantized weights is not supported yet: {why}")
    order = tp_row_order(rows, tp, gate_up_layout, gated)
    arrays = dict(w13=w13[:, order], w2=w2, w13_bias=None if w13_bias is None else w13_bias[:, order],
                  w2_bias=w2_bias, quant=quant)
    specs = _weight_specs(pcfg, quant, e)
    return {k: None if a is None else jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(pcfg.mesh, s)),
                                                   a, specs[k])
            for k, a in arrays.items()}


def _weight_specs(pcfg: ParallelConfig, quant, num_experts: int) -> dict:
    """How :func:`shard_weights` splits each weight: experts over ``ep``, I over ``tp``."""
    ep_ax, tp_ax = pcfg.ep_axis, pcfg.tp_axis
    return dict(w13=P(ep_ax, tp_ax, None), w2=P(ep_ax, None, tp_ax), w13_bias=P(ep_ax, tp_ax), w2_bias=P(ep_ax, None),
                quant=None if quant is None else _quant_specs(quant, num_experts, ep_ax))


def _tp_quant_refusal(quant) -> str | None:
    """Why ``quant`` cannot be split over ``tp`` (None: it can). Splitting I is exact when no
    scale runs along N or K (per-tensor or per-expert weight scales) and GEMM2's input is
    quantized without looking at its whole row (a static scale, or not quantized)."""
    from jax_moe.quant.scheme import STATIC_ACTS

    for name in ("w13_scale", "w2_scale"):
        a = getattr(quant, name)
        if jnp.ndim(a) > 1:
            return (f"{name} has shape {list(jnp.shape(a))}: scales along N or K would have to be split "
                    "with the weights (only per-tensor or per-expert weight scales are)")
    if quant.act != "bf16" and not (quant.act in STATIC_ACTS and quant.a2_scale is not None):
        return (f"act={quant.act!r} quantizes GEMM2's input with a scale over its whole row or tensor, "
                "which tp splits; give a static a2_scale (fp8_per_tensor, nvfp4) or use act='bf16'")
    return None


# activation scales are one scale for all experts (their max, jax_moe.quant.scheme): never split
_ACTIVATION_SCALES = ("a13_scale", "a2_scale")


def _quant_specs(quant, num_experts: int, ep_axis):
    """A QuantConfig of PartitionSpecs: weight scales with a leading expert axis are split like
    the experts; activation scales (a13/a2, [] or [E]) and scalars are replicated."""

    def spec(path, a):
        if path[-1].name in _ACTIVATION_SCALES or getattr(a, "ndim", 0) < 1 or a.shape[0] != num_experts:
            return P()
        return P(ep_axis, *([None] * (a.ndim - 1)))

    return jax.tree_util.tree_map_with_path(spec, quant)


# ------------------------------------------------------------------------- run time


def _local_ids(ids, e_local: int, rank):
    """Global ids -> this device's local ids, -1 for experts owned elsewhere."""
    local = ids - rank * e_local
    return jnp.where((local >= 0) & (local < e_local), local, -1).astype(jnp.int32)


def _once_over_tp(bias, tp_axis):
    """A bias added by every ``tp`` shard's partial output, kept on shard 0 only (the outputs
    are summed over ``tp``)."""
    if tp_axis is None or bias is None:
        return bias
    return jnp.where(jax.lax.axis_index(tp_axis) == 0, bias, jnp.zeros((), bias.dtype))


def _experts(x, w13, w2, w, ids, opts, w2_bias, tp_axis):
    """Local experts on local rows (this device's ``tp`` part of I; summed by the caller)."""
    opts = dict(opts)
    cfg = opts.pop("cfg")
    y = run_experts(x, w13, w2, w, ids, cfg, w2_bias=_once_over_tp(w2_bias, tp_axis), **opts)
    return y.astype(jnp.float32)


def _experts_batched(x, w13, w2, w, ids, opts, w2_bias, tp_axis):
    """Local experts on the batched format: the rows this device holds (x [M, ...], and a
    pre-quantized x's ``opts["x_scale"]`` [M, ...], linear) laid out per local expert as
    [E_local, M, ...] (:func:`jax_moe.permute.batched_layout` of ids [M, k]), the backend's
    ``apply_batched``, then each slot's row weighted by w [M, k] and summed: [M, H] float32."""
    opts = dict(opts)
    cfg = opts.pop("cfg")
    layout = batched_layout(ids, cfg.num_experts)
    if opts.get("x_scale") is not None:
        opts["x_scale"] = to_batched(opts["x_scale"], layout)
    y = run_experts_batched(to_batched(x, layout), layout.counts, w13, w2, cfg,
                            w2_bias=_once_over_tp(w2_bias, tp_axis), **opts)
    return batched_finalize(y, layout, ids, w)


# Each strategy takes ``run(x_rows, weights_rows, local_ids) -> y_rows float32``: the local
# experts (local ids, -1 for experts owned elsewhere) on the rows this device holds. ``x`` is
# one [T, ...] array or a tuple of them (a quantized payload and its scales): every array
# travels with its token.


def _rows(mask, a):
    """``mask`` [..., T] broadcast against ``a`` [..., T, ...]."""
    return mask.reshape(mask.shape + (1,) * (a.ndim - mask.ndim))


def _naive(x, w, ids, run, pcfg: ParallelConfig, e_local: int):
    ep = pcfg.ep_axis
    xa = jax.tree.map(lambda a: jax.lax.all_gather(a, ep, tiled=True), x)
    wa = jax.lax.all_gather(w, ep, tiled=True)
    ida = _local_ids(jax.lax.all_gather(ids, ep, tiled=True), e_local, jax.lax.axis_index(ep))
    y = run(xa, wa, ida)
    return jax.lax.psum_scatter(y, ep, scatter_dimension=0, tiled=True)


def _dispatch_masks(ids, e_local: int, ep_size: int):
    """owner [T, k] (device of each slot) and send [ep, T] (token t goes to device d)."""
    owner = ids // e_local
    send = (owner[None, :, :] == jnp.arange(ep_size)[:, None, None]).any(-1)
    return owner, send


def _all_to_all_dense(x, w, ids, run, pcfg: ParallelConfig, e_local: int):
    ep, n = pcfg.ep_axis, pcfg.size(pcfg.ep_axis)
    t = ids.shape[0]
    owner, send = _dispatch_masks(ids, e_local, n)
    dest = jnp.arange(n)[:, None, None]

    def exchange(a):  # [ep, T, ...] -> rows from every source, [ep * T, ...]
        return jax.lax.all_to_all(a, ep, 0, 0, tiled=True).reshape((n * t,) + a.shape[2:])

    x_recv = jax.tree.map(lambda a: exchange(jnp.where(_rows(send, a[None]), a[None], 0).astype(a.dtype)), x)
    id_send = jnp.where(owner[None] == dest, ids[None] - dest * e_local, -1).astype(jnp.int32)
    y = run(x_recv, exchange(jnp.broadcast_to(w[None], (n,) + w.shape)), exchange(id_send))
    back = jax.lax.all_to_all(y.reshape(n, t, y.shape[-1]), ep, 0, 0, tiled=True)
    return back.sum(0)


def _all_to_all_ragged(x, w, ids, run, pcfg: ParallelConfig, e_local: int):
    """Only the rows a device needs travel. Sender packs its rows by destination; receiver
    keeps a fixed slot of T rows per source (zero rows where nothing arrived)."""
    ep, n = pcfg.ep_axis, pcfg.size(pcfg.ep_axis)
    t = ids.shape[0]
    me = jax.lax.axis_index(ep)
    owner, send = _dispatch_masks(ids, e_local, n)
    counts = send.sum(1).astype(jnp.int32)  # rows for each destination
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)[:-1].astype(jnp.int32)])
    cap = t * min(n, ids.shape[1])
    # packed row r -> (destination, token): stable order by destination then token
    flat = send.reshape(-1)
    order = jnp.argsort(~flat, stable=True)[:cap]
    valid = jnp.arange(cap) < counts.sum()
    dest, tok = order // t, order % t
    id_pack = jnp.where(valid[:, None] & (owner[tok] == dest[:, None]), ids[tok] - dest[:, None] * e_local, -1)

    recv_counts = jax.lax.all_to_all(counts, ep, 0, 0, tiled=True)  # rows each source sends me
    out_offsets = jnp.full((n,), me * t, jnp.int32)  # my rows land in slot `me` of every receiver

    def exchange(a, fill=0):
        buf = jnp.full((n * t,) + a.shape[1:], fill, a.dtype)
        return jax.lax.ragged_all_to_all(a, buf, starts, counts, out_offsets, recv_counts, axis_name=ep)

    x_recv = jax.tree.map(lambda a: exchange(jnp.where(_rows(valid, a[tok]), a[tok], 0).astype(a.dtype)), x)
    y = run(x_recv, exchange(w[tok]), exchange(id_pack.astype(jnp.int32), -1))
    h = y.shape[-1]
    # reverse: slot s of my buffer goes back to source s, at the offsets it sent from
    src_starts = jax.lax.all_to_all(starts, ep, 0, 0, tiled=True)
    back = jax.lax.ragged_all_to_all(y, jnp.zeros((cap, h), y.dtype), jnp.arange(n, dtype=jnp.int32) * t,
                                     recv_counts, src_starts, counts, axis_name=ep)
    back = jnp.where(valid[:, None], back, 0.0)
    return jnp.zeros((t, h), jnp.float32).at[tok].add(back)


def _run_strategy(x, w, ids, run, pcfg: ParallelConfig, e_local: int):
    """Prepare (dispatch), the local experts, finalize (combine), and the sum over ``tp`` of the
    devices' parts of I (after the combine: T_local rows, not the dispatched ones): [T_local, H]
    float32."""
    if pcfg.strategy == "none":
        y = run(x, w, ids)
    elif pcfg.strategy == "naive":
        y = _naive(x, w, ids, run, pcfg, e_local)
    elif pcfg.ragged:
        y = _all_to_all_ragged(x, w, ids, run, pcfg, e_local)
    else:
        y = _all_to_all_dense(x, w, ids, run, pcfg, e_local)
    return y if pcfg.tp_axis is None else jax.lax.psum(y, pcfg.tp_axis)


def _token_shards(x, pcfg: ParallelConfig, e: int) -> None:
    ep = pcfg.size(pcfg.ep_axis)
    shards = int(np.prod([pcfg.size(a) for a in pcfg.token_axes])) if pcfg.token_axes else 1
    if x.shape[0] % shards:
        raise ValueError(f"x has T={x.shape[0]} tokens, which must be a multiple of the {shards} token shards")
    if e % ep:
        raise ValueError(f"the number of experts E={e} must be a multiple of the ep size {ep}")


def parallel_fused_experts(x, w13, w2, topk_weights, topk_ids, pcfg: ParallelConfig, *, w13_bias=None,
                           w2_bias=None, quant=None, **opts):
    """:func:`jax_moe.fused_experts` over ``pcfg.mesh``. Weights as placed by :func:`shard_weights`
    (global shapes; w13's rows in :func:`tp_row_order`); x [T, H] with T a multiple of the
    number of token shards. Returns [T, H] in x's dtype, split like x.

    NVFP4 activations (``quant.act == "nvfp4"``) under ``naive``/``all_to_all`` with a backend
    that takes them quantized (its ``PREQUANTIZED_INPUT``) are quantized before the dispatch, as
    vLLM's prepare does: packed E2M1 (H/2 bytes) and linear e4m3 block scales (H/16 bytes) travel
    instead of the float row, and the scales are swizzled after the exchange for a backend that
    reads 128x4 tiles. The global scale is the static ``a13_scale``, or, when None, ``amax / (448 * 6)``
    of every device's tokens; either way each token's quantization is what one device does.

    ``pcfg.expert_format="batched"``: after the dispatch each device lays its received token
    copies out as [E_local, M, H] and runs the backend's batched stage (module note)."""
    x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, quant = as_jax(
        x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, quant)
    e = w13.shape[0]
    ep, tp = pcfg.size(pcfg.ep_axis), pcfg.size(pcfg.tp_axis)
    _token_shards(x, pcfg, e)
    if opts.get("apply_router_weight_on_input"):
        raise ValueError("apply_router_weight_on_input is not supported under parallel execution yet")
    # full shape checks on the global arrays, before anything is traced
    cfg = moe_config_from_arrays(x, w13, w2, topk_ids, activation=opts.pop("activation", "silu"),
                                 gate_up_layout=opts.pop("gate_up_layout", "concat"), quant=quant,
                                 swiglu_alpha=opts.pop("swiglu_alpha", 1.702), swiglu_limit=opts.pop("swiglu_limit", 7.0))
    e_local = e // ep
    local_cfg = dataclasses.replace(cfg, num_experts=e_local, intermediate_size=cfg.intermediate_size // tp,
                                    expert_shard=ep > 1)
    ep_ax, tp_ax = pcfg.ep_axis, pcfg.tp_axis
    tok = pcfg.token_spec
    batched = pcfg.expert_format == "batched"
    experts = _experts_batched if batched else _experts
    device = pcfg.mesh.devices.flat[0]  # the backend serves the mesh's devices, not JAX's default one
    scale_layout = None
    if quant is not None and quant.act == "nvfp4" and pcfg.strategy != "none":
        features = oracle.call_features(dtype=None, w13_bias=w13_bias, w2_bias=w2_bias, batched=batched, **opts)
        chosen = oracle.select_backend(local_cfg, quant, backend=opts.get("backend"), device=device,
                                       features=features)
        scale_layout = getattr(chosen.module, "PREQUANTIZED_INPUT", {}).get(quant.act)
        if batched and scale_layout not in (None, "linear"):
            raise ValueError(f"expert_format='batched': {chosen.name} reads NVFP4 block scales in {scale_layout!r} "
                             "tiles, which the batched layout does not build (linear scales only)")
        opts["backend"] = chosen.name  # the backend whose input format the dispatch produces

    def body(x, w13, w2, w, ids, w13_bias, w2_bias, quant):
        o = dict(opts, w13_bias=w13_bias, quant=quant, cfg=local_cfg, device=device)
        if scale_layout is None:
            def run(xr, wr, idr):
                return experts(xr, w13, w2, wr, idr, o, w2_bias, tp_ax)

            return _run_strategy(x, w, ids, run, pcfg, e_local).astype(x.dtype)
        o["quant"], payload = _quantize_nvfp4_before_dispatch(x, quant, pcfg)

        def run_q(xr, wr, idr):
            packed, sf = xr
            sf = jax.lax.bitcast_convert_type(sf, jnp.float8_e4m3fn)
            if scale_layout == "128x4":
                sf = block_scale_interleave(sf)
            return experts(packed, w13, w2, wr, idr, dict(o, x_scale=sf), w2_bias, tp_ax)

        return _run_strategy(payload, w, ids, run_q, pcfg, e_local).astype(x.dtype)

    ws = _weight_specs(pcfg, quant, e)
    in_specs = (tok, ws["w13"], ws["w2"], tok, tok, None if w13_bias is None else ws["w13_bias"],
                None if w2_bias is None else ws["w2_bias"], ws["quant"])
    fn = jax.shard_map(body, mesh=pcfg.mesh, in_specs=in_specs, out_specs=tok, check_vma=False)
    return fn(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias, quant)


def _quantize_nvfp4_before_dispatch(x, quant, pcfg: ParallelConfig):
    """This device's tokens x [T, H] -> (quant with the stage-1 scale fixed, (packed [T, H/2]
    uint8, block scales [T, H/16] as uint8, linear)). A dynamic scale (``a13_scale`` None) is
    taken over every device's tokens, as one device takes it over all of them."""
    x = x.astype(jnp.float32)
    if quant.a13_scale is None:
        amax = jax.lax.pmax(fp8.finite_absmax(x), pcfg.token_axes)  # over finite values (jax_moe.quant)
        quant = quant.replace(a13_scale=fp8.amax_to_scale(amax, fp8.FP8_MAX * fp4.E2M1_MAX))
    packed, sf, _ = fp4.quantize_nvfp4(x, nvfp4_activation_global_scale(quant, 1))
    return quant, (packed, jax.lax.bitcast_convert_type(sf, jnp.uint8))


def _pad_intermediate(w13, w2, w13_bias, inter_padded: int, gated: bool, gate_up_layout: str):
    """Zero-pad one device's block from its I to ``inter_padded``: w13's gate and up halves
    each (or its rows, not gated), w2's columns, the w13 bias like w13. The padded units add
    ``act(0) * 0 = 0`` through zero w2 columns: the result is unchanged."""
    from jax_moe.layouts.common import pad_axis, pad_intermediate_rows

    if inter_padded == w2.shape[-1]:
        return w13, w2, w13_bias
    return (pad_intermediate_rows(w13, inter_padded, gated, -2, gate_up_layout), pad_axis(w2, inter_padded, -1),
            None if w13_bias is None else pad_intermediate_rows(w13_bias, inter_padded, gated, -1, gate_up_layout))


def _sharded_prepared_module(fn: str, backend: str):
    """``backend``'s module if its prepared weights split over a mesh (``partition_specs``), else
    a ValueError from ``fn`` that points at its float weights."""
    mod = oracle.module(backend)
    if not hasattr(mod, "partition_specs"):
        raise ValueError(f"{fn}: {backend}'s prepared weights are not laid out for a mesh; run its float "
                         f"weights with parallel_fused_experts(..., backend={backend!r})")
    return mod


def shard_prepared(w13, w2, pcfg: ParallelConfig, *, backend: str = "flashinfer_cutlass", activation: str = "silu",
                   gate_up_layout: str = "concat", w13_bias=None, w2_bias=None, quant=None, **cfg_opts):
    """Load time, for a backend with its own weight layout (``flashinfer_cutlass``): place the
    vLLM-layout weights over ``ep`` and ``tp`` (:func:`shard_weights`: w13's rows in
    :func:`tp_row_order`, so a device's block is its gate rows then its up rows; w2 split along
    I), then let every device repack only its own block (``backend.prepare`` per device under
    ``shard_map``). A device's I (``I / tp``) is zero-padded to ``backend.alignment(quant)``
    where it falls short (the padded units contribute exactly zero).

    Returns the backend's prepared weights for :func:`parallel_apply_prepared`: global arrays
    split over ``ep`` along their expert axes and over ``tp`` along their I axes (the fields'
    ``tp_axis`` metadata); with ``tp`` > 1 a global array is the concatenation of the devices'
    blocks, meaningful only split that way."""
    from jax_moe.config import ACTIVATIONS
    from jax_moe.layouts.common import round_up

    mod = _sharded_prepared_module("shard_prepared", backend)
    if quant is not None and quant.packed():
        raise ValueError(f"shard_prepared: packed 4-bit weights (scheme {quant.scheme!r}) are not wired up for "
                         "parallel prepared weights yet (their block scales have no tp split, and K is packed)")
    e, rows, h = w13.shape
    ep, tp = pcfg.size(pcfg.ep_axis), pcfg.size(pcfg.tp_axis)
    placed = shard_weights(w13, w2, pcfg, activation=activation, gate_up_layout=gate_up_layout,
                           w13_bias=w13_bias, w2_bias=w2_bias, quant=quant)
    x_like = jax.ShapeDtypeStruct((1, h), jnp.bfloat16 if quant is not None else w13.dtype)
    ids_like = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    cfg = moe_config_from_arrays(x_like, placed["w13"], placed["w2"], ids_like, activation=activation,
                                 gate_up_layout=gate_up_layout, quant=placed["quant"],
                                 swiglu_alpha=cfg_opts.get("swiglu_alpha", 1.702),
                                 swiglu_limit=cfg_opts.get("swiglu_limit", 7.0))
    align = mod.alignment(quant)
    if h % align:
        raise ValueError(f"shard_prepared: {backend} needs H={h} to be a multiple of {align} "
                         f"({'bf16' if quant is None else quant.scheme}); H is not split, so it cannot be padded here")
    gated = ACTIVATIONS[activation]
    inter_padded = round_up(cfg.intermediate_size // tp, align)
    local_cfg = dataclasses.replace(cfg, num_experts=e // ep, intermediate_size=inter_padded)
    with_bias = w13_bias is not None or w2_bias is not None

    def prepare(w13, w2, w13_bias, w2_bias, quant):
        w13, w2, w13_bias = _pad_intermediate(w13, w2, w13_bias, inter_padded, gated, gate_up_layout)
        bias = dict(w13_bias=w13_bias, w2_bias=w2_bias) if with_bias else {}
        return mod.prepare(w13, w2, local_cfg, quant, **bias)

    names = ("w13", "w2", "w13_bias", "w2_bias", "quant")
    args = tuple(placed[k] for k in names)
    ws = _weight_specs(pcfg, quant, e)
    in_specs = tuple(None if placed[k] is None else ws[k] for k in names)
    local = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(NamedSharding(pcfg.mesh, s).shard_shape(a.shape), a.dtype),
                         args, in_specs)
    out_specs = mod.partition_specs(jax.eval_shape(prepare, *local), pcfg.ep_axis, e // ep, pcfg.tp_axis)
    fn = jax.shard_map(prepare, mesh=pcfg.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(fn)(*args)


def parallel_apply_prepared(x, prepared, topk_weights, topk_ids, pcfg: ParallelConfig, *,
                            backend: str = "flashinfer_cutlass", **apply_opts):
    """``backend.apply_prepared`` over ``pcfg.mesh`` with the same prepare/finalize strategies as
    :func:`parallel_fused_experts`. ``prepared`` from :func:`shard_prepared`; x [T, H] split
    like the tokens. Every device runs its own (ep, tp) block; the partial outputs are summed
    over ``tp`` (a w2 bias counted once). With FP8 prepared weights the tokens are quantized
    before the dispatch (one byte per value on the wire; the per-tensor scale is shared by all
    devices). Returns [T, H] in x's dtype, split like x."""
    mod = _sharded_prepared_module("parallel_apply_prepared", backend)
    if pcfg.expert_format != "standard":
        raise ValueError(f"parallel_apply_prepared runs the standard expert format only, got expert_format="
                         f"{pcfg.expert_format!r} (no backend with prepared weights has a batched stage yet)")
    e = prepared.w13.shape[0]
    _token_shards(x, pcfg, e)
    e_local = e // pcfg.size(pcfg.ep_axis)
    tok = pcfg.token_spec
    specs = mod.partition_specs(prepared, pcfg.ep_axis, e, pcfg.tp_axis)

    # FP8 input: quantize before dispatch (vLLM's order), so that 1-byte rows travel; the
    # dynamic scale is the max over every device's tokens, as on one device.
    quantize_first = (pcfg.strategy != "none" and getattr(prepared, "scheme", None) == "fp8"
                      and hasattr(mod, "quantize_input") and not apply_opts.get("apply_router_weight_on_input"))

    def body(x, w, ids, prep):
        prep = dataclasses.replace(prep, w2_bias=_once_over_tp(prep.w2_bias, pcfg.tp_axis))
        if not quantize_first:
            def run(xr, wr, idr):
                return mod.apply_prepared(xr, prep, wr, idr, **apply_opts).astype(jnp.float32)

            return _run_strategy(x, w, ids, run, pcfg, e_local).astype(x.dtype)
        amax = jax.lax.pmax(fp8.finite_absmax(x), pcfg.token_axes)  # over finite values (jax_moe.quant)
        scale = mod.input_scale(x, prep, amax)
        payload = jax.lax.bitcast_convert_type(mod.quantize_input(x, scale), jnp.uint8)

        def run_q(xr, wr, idr):
            xq = jax.lax.bitcast_convert_type(xr, jnp.float8_e4m3fn)
            return mod.apply_prepared(xq, prep, wr, idr, x_scale=scale, **apply_opts).astype(jnp.float32)

        return _run_strategy(payload, w, ids, run_q, pcfg, e_local).astype(x.dtype)

    fn = jax.shard_map(body, mesh=pcfg.mesh, in_specs=(tok, tok, tok, specs), out_specs=tok, check_vma=False)
    return fn(x, topk_weights, topk_ids, prepared)


def parallel_fused_moe(x, w13, w2, router_logits, top_k: int, pcfg: ParallelConfig, *, routing=None, **opts):
    """Routing (token-parallel, no communication) then :func:`parallel_fused_experts`."""
    weights, ids = select_experts(router_logits, top_k, **(routing or {}))
    return parallel_fused_experts(x, w13, w2, weights, ids, pcfg, **opts)
