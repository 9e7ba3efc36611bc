"""The pure-JAX backend (``backend="xla"``): runs anywhere JAX runs, and is the reference
every other backend is tested against.

Data path (prepare -> experts -> finalize), with the experts strategy picked by shape at
trace time (:func:`pick_strategy`):

- ``"gather"``: for a handful of slots (decode), each slot's expert weights are gathered and
  applied in one batched matmul: one launch per GEMM, weights read about twice.
- ``"blocked"`` (the general case): sort the ``T*k`` slots by expert (:mod:`jax_moe.permute`)
  and lay each expert's rows out in blocks of ``B`` rows, so that every block belongs to
  exactly one expert; the number of blocks has a static bound, ``ceil(T*k / B) + min(E, T*k)``.
  A ``lax.scan`` takes ``G`` blocks per step, gathers their rows and their experts' weights,
  runs GEMM1 -> activation -> GEMM2 as batched matmuls, and skips steps with no rows. Nothing
  of size ``[T*k, E, ...]`` or ``[E, T, H]`` is built: memory is ``O(T*k*H + blocks*B*H)``
  whatever E is. A dynamic tensor-wide scale at GEMM2's input (the default FP8 path:
  ``fp8_per_tensor`` without ``a2_scale``) takes two scans: GEMM1 and the activation over every
  block, the scale over all routed rows, then GEMM2 (``blocks*B*I`` more floats).
- ``"dense"``: every expert on every token as two batched matmuls over E, combined with the
  router weights. It reads each expert's weights exactly once, which is the floor when the
  batch is small (weight-bound) yet touches most experts; picked only then, and only when its
  ``[E, T, max(2I, H)]`` temporaries stay under :data:`DENSE_TEMP_BYTES`.
- ``"ragged_dot"``: the sorted rows through ``jax.lax.ragged_dot`` (what JAX users write
  today; kept for comparison, never picked automatically).

finalize: each slot's output row is gathered and reduced over k with the router weights, in
float32.

Non-finite isolation: a NaN, an infinity or an overflow in an expert no token routes to, or in
one token, never reaches another token, on every strategy. ``gather`` and ``blocked`` compute
only the (token, expert) pairs that were routed (padding rows and skipped slots are dropped by
index, never multiplied in); ``dense`` computes every pair but selects the routed ones with
``where`` after GEMM1 and after GEMM2, before the router weights multiply anything;
``ragged_dot`` feeds ``jax.lax.ragged_dot`` weights whose non-finite entries are zeroed (its
lowering multiplies every row by every expert's weights, with zeros for the other experts'
rows, and ``0 * nan`` is NaN) and recomputes exactly the rows of any routed expert whose weights
are not finite. A dynamic activation scale taken over a whole tensor (``fp8_per_tensor``,
``nvfp4`` without a static scale) is taken over the routed rows only, and over finite values
only (:mod:`jax_moe.quant`), so one bad token does not move it either.

Inputs and transformations: numpy or jax arrays at every T; ``jax.vmap`` works on every
strategy (``ragged_dot`` batches itself sequentially: ``jax.lax.ragged_dot`` has no batching
rule).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jax_moe.activations import activate
from jax_moe.config import MoEConfig, as_jax, check_dtype, check_rank
from jax_moe.permute import batched_rows_used, finalize, sort_by_expert
from jax_moe.quant import fp4
from jax_moe.quant.rounding import round_to
from jax_moe.quant.scheme import (
    dequantize_experts,
    dequantize_weights,
    nvfp4_activation_global_scale,
    quantize_activation,
)

STRATEGIES = ("gather", "blocked", "dense", "ragged_dot")
NAME = "xla"
FEATURES = frozenset({"bias", "router_weight_on_input", "batched", "grad"})  # every dtype (oracle.call_features)
# act -> layout of the block scales :func:`apply` takes with an x quantized beforehand
# ("linear": row-major [T, H/16]; a backend reading FlashInfer's 128x4 tiles would say "128x4",
# jax_moe.layouts.block_scale_interleave). jax_moe.parallel quantizes x before the dispatch for these.
PREQUANTIZED_INPUT = {"nvfp4": "linear"}
STEP_WEIGHT_BYTES = 256 << 20
GATHER_WEIGHT_BYTES = 2 << 30
GATHER_MAX_SLOTS = 64
DENSE_TEMP_BYTES = 2 << 30
DENSE_MAX_TOKENS = 128  # above this the dense strategy's E/k extra FLOPs stop being free


def supports(cfg: MoEConfig, quant=None, device=None, *, dtype=None) -> tuple[bool, str]:
    """The pure-JAX backend serves every config on every device."""
    return True, "pure JAX: runs on any device"


def needs_whole_gemm2_input(quant) -> bool:
    """Dynamic tensor-wide activation scales at GEMM2's input (``fp8_per_tensor`` or ``nvfp4``
    without ``a2_scale``) are a max over every routed row: ``blocked`` then runs GEMM1 over every
    block first, takes the scale, then GEMM2 (``gather``, ``dense`` and ``ragged_dot`` see all
    rows at once anyway)."""
    return quant is not None and quant.act in ("fp8_per_tensor", "nvfp4") and quant.a2_scale is None


def _rows_per_touched_expert(num_tokens: int, top_k: int, num_experts: int) -> float:
    touched = num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)
    return num_tokens * top_k / max(touched, 1.0)


def pick_block_size(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Rows per block, a power of two in [16, 1024].

    Few rows per expert (weight-bound): twice the expected rows per touched expert, so that
    most experts fit one block and their weights are read once. Many rows (compute-bound):
    about the expected rows, so that padding wastes little arithmetic."""
    rows = _rows_per_touched_expert(num_tokens, top_k, num_experts)
    target = 2 * rows if rows < 128 else rows
    return int(min(1024, max(16, 2 ** math.ceil(math.log2(max(target, 1.0)) - 0.05))))


def pick_strategy(num_tokens: int, cfg: MoEConfig) -> str:
    """``"gather"`` for a handful of slots, ``"dense"`` for small batches that touch most
    experts, else ``"blocked"``."""
    e, k = cfg.num_experts, cfg.top_k
    expert_bytes = 2 * (cfg.w13_rows * cfg.hidden_size + cfg.hidden_size * cfg.intermediate_size)
    slots = num_tokens * k
    if slots <= GATHER_MAX_SLOTS and slots * expert_bytes <= GATHER_WEIGHT_BYTES:
        return "gather"
    touched = 1.0 - (1.0 - k / e) ** num_tokens
    temp = 4 * e * num_tokens * max(cfg.w13_rows, cfg.hidden_size)
    if num_tokens <= DENSE_MAX_TOKENS and touched >= 0.5 and temp <= DENSE_TEMP_BYTES:
        return "dense"
    return "blocked"


def _gathered_weights(w, quant, which: str, experts, dtype):
    """The weights of ``experts [G]``: ``w[experts]`` as ``dtype``, dequantized when quantized."""
    if quant is None:
        return w[experts]
    return dequantize_experts(quant, which, w, experts, dtype=dtype)


def _compute_dtype(x, quant):
    return jnp.float32 if quant is not None else x.dtype


def _precision(quant, x):
    # Quantized weights are dequantized to float32: keep every bit of the product.
    return jax.lax.Precision.HIGHEST if quant is not None or x.dtype == jnp.float32 else None


def _batched_dot_t(a, w, precision):
    """``a [G, M, K] @ w[G, N, K]^T -> [G, M, N]`` float32."""
    return jax.lax.dot_general(
        a, w, (((2,), (2,)), ((0,), (0,))), precision=precision, preferred_element_type=jnp.float32
    )


def _gemm1_act(xb, experts, w13, cfg, quant, w13_bias, used=None):
    """GEMM1 (+ bias) -> activation for row groups ``xb [G, M, H]``, group g on expert
    ``experts[g]``: ``[G, M, I]`` float32. ``used`` [G, M] bool (optional): the other rows are
    zeroed after GEMM1 (with ``where``: whatever GEMM1 gave there, NaN included), so that a
    dynamic scale at GEMM2's input is taken over the used rows only (every activation maps 0 to 0)."""
    cdt = _compute_dtype(xb, quant)
    h = _batched_dot_t(xb.astype(cdt), _gathered_weights(w13, quant, "w13", experts, cdt), _precision(quant, xb))
    if w13_bias is not None:
        h = h + w13_bias[experts][:, None, :].astype(jnp.float32)
    if used is not None:
        h = jnp.where(used[..., None], h, 0.0)
    return activate(h, cfg)


def _gemm2(a, experts, w2, quant, w2_bias, x_dtype):
    """GEMM2 (+ bias) of activations ``a [G, M, I]`` (already quantized when ``quant`` says so), in
    x's compute dtype: ``[G, M, H]`` in x's dtype (float32 when quantized)."""
    cdt = jnp.float32 if quant is not None else x_dtype
    prec = jax.lax.Precision.HIGHEST if quant is not None or x_dtype == jnp.float32 else None
    y = _batched_dot_t(a.astype(cdt), _gathered_weights(w2, quant, "w2", experts, cdt), prec)
    if w2_bias is not None:
        y = y + w2_bias[experts][:, None, :].astype(jnp.float32)
    return y.astype(x_dtype if quant is None else jnp.float32)


def _experts_mlp(xb, experts, w13, w2, cfg, quant, w13_bias, w2_bias, used=None):
    """GEMM1 -> activation -> GEMM2 for row groups ``xb [G, M, H]``, group g on expert
    ``experts[g]``. Returns ``[G, M, H]`` in x's dtype (float32 when quantized). ``used``: as
    :func:`_gemm1_act`."""
    a = _gemm1_act(xb, experts, w13, cfg, quant, w13_bias, used)
    if quant is not None:
        a = quantize_activation(quant, a, 2)
    return _gemm2(a, experts, w2, quant, w2_bias, xb.dtype)


def pick_blocks_per_step(cfg: MoEConfig) -> int:
    """Blocks (each on its own expert) per scan step: as many as keep the gathered weights of
    one step under :data:`STEP_WEIGHT_BYTES`, a power of two in [1, 16]."""
    expert_bytes = 2 * (cfg.w13_rows * cfg.hidden_size + cfg.hidden_size * cfg.intermediate_size)
    g = max(1, min(16, STEP_WEIGHT_BYTES // expert_bytes))
    return 1 << (int(g).bit_length() - 1)


def _blocked_experts(xq, sort, cfg, w13, w2, quant, w13_bias, w2_bias, block_size, blocks_per_step):
    """Run the experts block by block. Returns (y [NB*B + 1, H], row_of_slot [T*k] int32).

    With a dynamic tensor-wide scale at GEMM2's input (:func:`needs_whole_gemm2_input`) it takes
    two passes: GEMM1 and the activation over every block (padding rows zeroed), the scale over
    all of them, then GEMM2 block by block."""
    n_slots = sort.sorted_slots.shape[0]
    e_count, k, h = cfg.num_experts, cfg.top_k, cfg.hidden_size
    t = xq.shape[0]
    b, g = block_size, blocks_per_step
    nb = -(-n_slots // b) + min(e_count, n_slots)
    nb = -(-nb // g) * g
    padded = ((sort.counts + b - 1) // b) * b
    pad_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(padded, dtype=jnp.int32)])
    blocks_used = pad_start[-1] // b

    # Slot -> padded row: expert start + rank inside the expert. Slots whose id is not a
    # local expert (EP's -1) sort last and point at row nb*b, a zero row appended below.
    pos = jnp.arange(n_slots, dtype=jnp.int32)
    sorted_expert = jnp.clip(jnp.searchsorted(sort.offsets, pos, side="right") - 1, 0, e_count - 1)
    sorted_row = pad_start[sorted_expert] + (pos - sort.offsets[sorted_expert])
    sorted_row = jnp.where(pos < sort.offsets[-1], sorted_row, nb * b)
    row_of_slot = sorted_row[sort.inverse]
    # Padded row -> token (T for padding rows, which gather zeros).
    token_of_row = (
        jnp.full((nb * b,), t, jnp.int32).at[sorted_row].set(sort.sorted_slots // k, mode="drop")
    )
    block_expert = jnp.searchsorted(pad_start, jnp.arange(nb, dtype=jnp.int32) * b, side="right") - 1
    block_expert = jnp.clip(block_expert, 0, e_count - 1)
    x_pad = jnp.concatenate([xq, jnp.zeros((1, h), xq.dtype)], axis=0)
    out_dtype = xq.dtype if quant is None else jnp.float32
    steps = nb // g
    firsts = jnp.arange(steps, dtype=jnp.int32) * g
    toks_s, experts_s = token_of_row.reshape(steps, g, b), block_expert.reshape(steps, g)

    def skip_or(run, zeros):
        def step(_, blk):
            first = blk[0]
            return None, jax.lax.cond(first < blocks_used, run, lambda _: zeros, blk)
        return step

    if needs_whole_gemm2_input(quant):
        inter = cfg.intermediate_size

        def act(blk):
            _, toks, experts = blk
            return _gemm1_act(x_pad[toks], experts, w13, cfg, quant, w13_bias, used=toks < t)

        _, a = jax.lax.scan(skip_or(act, jnp.zeros((g, b, inter), jnp.float32)), None, (firsts, toks_s, experts_s))
        a = quantize_activation(quant, a, 2)  # one scale over every routed row (padding rows are 0)

        def second(blk):
            _, a_blk, experts = blk
            return _gemm2(a_blk, experts, w2, quant, w2_bias, xq.dtype)

        _, ys = jax.lax.scan(skip_or(second, jnp.zeros((g, b, h), out_dtype)), None, (firsts, a, experts_s))
    else:
        def run(blk):
            _, toks, experts = blk
            return _experts_mlp(x_pad[toks], experts, w13, w2, cfg, quant, w13_bias, w2_bias)

        _, ys = jax.lax.scan(skip_or(run, jnp.zeros((g, b, h), out_dtype)), None, (firsts, toks_s, experts_s))
    ys = jnp.concatenate([ys.reshape(nb * b, h), jnp.zeros((1, h), out_dtype)], axis=0)
    return ys, row_of_slot


def _gather_experts(xq, topk_ids, cfg, w13, w2, quant, w13_bias, w2_bias):
    """Each slot against its own gathered expert weights. Returns (y [T*k + 1, H], row_of_slot)."""
    n = topk_ids.size
    flat = topk_ids.reshape(-1)
    valid = (flat >= 0) & (flat < cfg.num_experts)
    # a slot of another rank's expert (-1) runs on expert 0 and is dropped by index below; its
    # GEMM1 output is zeroed so that it takes no part in a dynamic scale at GEMM2's input
    y = _experts_mlp(xq[jnp.arange(n) // cfg.top_k][:, None, :], jnp.clip(flat, 0, cfg.num_experts - 1),
                     w13, w2, cfg, quant, w13_bias, w2_bias, used=valid[:, None])[:, 0, :]
    y = jnp.concatenate([y, jnp.zeros((1, y.shape[1]), y.dtype)], axis=0)
    return y, jnp.where(valid, jnp.arange(n, dtype=jnp.int32), n)


def _ragged_dot_impl(rows, w, counts, precision):
    """``rows [M, K]`` against ``w [E, N, K]``, rows in runs of ``counts [E]`` per expert (rows past
    ``sum(counts)`` give 0): ``[M, N]`` float32, with non-finite weights kept to their own rows.

    ``jax.lax.ragged_dot`` lowers (CPU, GPU) to every row times every expert's weights, the other
    experts' rows selected to zero: one NaN or inf weight would reach every row. It gets the
    weights with non-finite entries zeroed, which is exact for the rows of every expert whose
    weights are finite; the rows of a routed expert with non-finite weights are recomputed
    against its own weights (a rare path, skipped by ``cond`` when there is none)."""
    finite = jnp.isfinite(w)
    safe = jnp.where(finite, w, jnp.zeros((), w.dtype))
    out = jax.lax.ragged_dot(rows, jnp.swapaxes(safe, 1, 2), counts, precision=precision,
                             preferred_element_type=jnp.float32)
    bad = ~jnp.all(finite, axis=(1, 2)) & (counts > 0)
    offsets = jnp.concatenate([jnp.zeros((1,), counts.dtype), jnp.cumsum(counts)])
    row = jnp.arange(rows.shape[0], dtype=counts.dtype)

    def exact(e, out):
        def redo(out):
            mine = (row >= offsets[e]) & (row < offsets[e + 1])
            full = jax.lax.dot_general(rows, w[e], (((1,), (1,)), ((), ())), precision=precision,
                                       preferred_element_type=jnp.float32)
            return jnp.where(mine[:, None], full, out)

        return jax.lax.cond(bad[e], redo, lambda o: o, out)

    return jax.lax.cond(jnp.any(bad), lambda o: jax.lax.fori_loop(0, w.shape[0], exact, o), lambda o: o, out)


@functools.lru_cache(maxsize=None)
def _ragged_dot_fn(precision):
    """:func:`_ragged_dot_impl` as a function ``jax.vmap`` can batch: ``jax.lax.ragged_dot`` has no
    batching rule here, so a batch runs one element at a time (``jax.lax.map``)."""

    @jax.custom_batching.custom_vmap
    def f(rows, w, counts):
        return _ragged_dot_impl(rows, w, counts, precision)

    @f.def_vmap
    def _batched(axis_size, in_batched, *args):
        batched = tuple(a for a, b in zip(args, in_batched) if b)

        def one(parts):
            it = iter(parts)
            return f(*(next(it) if b else a for a, b in zip(args, in_batched)))

        return jax.lax.map(one, batched), True

    return f


def _ragged_experts(xq, sort, cfg, w13, w2, quant, w13_bias, w2_bias):
    """Sorted rows through ``jax.lax.ragged_dot`` (:func:`_ragged_dot_impl`). Returns
    (y [T*k, H], row_of_slot [T*k])."""
    k = cfg.top_k
    cdt = _compute_dtype(xq, quant)
    dot = _ragged_dot_fn(_precision(quant, xq))
    if quant is not None:
        w13, w2 = dequantize_weights(quant, w13, w2, dtype=cdt)
    rows = xq[sort.sorted_slots // k].astype(cdt)
    sorted_expert = jnp.searchsorted(sort.offsets, jnp.arange(rows.shape[0]), side="right") - 1
    sorted_expert = jnp.clip(sorted_expert, 0, cfg.num_experts - 1)
    valid = jnp.arange(rows.shape[0]) < sort.offsets[-1]  # rows of local experts (EP: -1 ids sort last)
    h1 = dot(rows, w13.astype(cdt), sort.counts)
    if w13_bias is not None:
        h1 = h1 + w13_bias[sorted_expert].astype(jnp.float32)
    h1 = jnp.where(valid[:, None], h1, 0.0)  # no part in a dynamic scale at GEMM2's input
    a = activate(h1, cfg)
    if quant is not None:
        a = quantize_activation(quant, a, 2)
    y = dot(a.astype(cdt), w2.astype(cdt), sort.counts)
    if w2_bias is not None:
        y = y + w2_bias[sorted_expert].astype(jnp.float32)
    y = jnp.where(valid[:, None], y, 0.0)
    return y.astype(xq.dtype if quant is None else jnp.float32), sort.inverse


def _dense_experts(xq, topk_weights, topk_ids, cfg, w13, w2, quant, w13_bias, w2_bias):
    """Every expert on every token, the routed (expert, token) pairs selected with ``where`` after
    GEMM1 and after GEMM2, before the router weights multiply anything: a non-finite value (or an
    overflow) of an expert a token does not route to never reaches that token. Returns the
    weighted sum [T, H] float32 directly."""
    cdt = _compute_dtype(xq, quant)
    prec = _precision(quant, xq)
    if quant is not None:
        w13, w2 = dequantize_weights(quant, w13, w2, dtype=cdt)
    # hit[e, t]: token t routes to expert e (ids outside [0, E) hit nothing)
    onehot = jax.nn.one_hot(topk_ids, cfg.num_experts, dtype=jnp.float32)  # [T, k, E]
    hit = jnp.any(onehot > 0, axis=1).T[:, :, None]
    h1 = jnp.einsum("th,enh->etn", xq.astype(cdt), w13, precision=prec, preferred_element_type=jnp.float32)
    if w13_bias is not None:
        h1 = h1 + w13_bias.astype(jnp.float32)[:, None, :]
    h1 = jnp.where(hit, h1, 0.0)  # routed pairs only, also for a dynamic scale at GEMM2's input
    a = activate(h1, cfg)
    if quant is not None:
        a = quantize_activation(quant, a, 2)
    y = jnp.einsum("eti,ehi->eth", a.astype(cdt), w2, precision=prec, preferred_element_type=jnp.float32)
    if w2_bias is not None:
        y = y + w2_bias.astype(jnp.float32)[:, None, :]
    y = round_to(y, xq.dtype if quant is None else jnp.float32)
    y = jnp.where(hit, y, 0.0)
    # combine[t, e] = sum_j w[t, j] * [ids[t, j] == e]
    combine = jnp.einsum("tk,tke->te", topk_weights, onehot)
    return jnp.einsum("eth,te->th", y, combine, precision=jax.lax.Precision.HIGHEST)


def _prequantized_input(x, x_scale, cfg: MoEConfig, quant, apply_router_weight_on_input: bool):
    """NVFP4 x [T, H/2] uint8 + block scales [T, H/16] -> the float32 x GEMM1 sees: exactly
    ``quantize_activation(quant, x_float, 1)`` of the x they were quantized from."""
    h = cfg.hidden_size
    if quant is None or quant.act not in PREQUANTIZED_INPUT:
        raise ValueError(f"x_scale is for a pre-quantized x with act in {sorted(PREQUANTIZED_INPUT)}, got "
                         f"quant={'None' if quant is None else repr(quant.act)}")
    if quant.a13_scale is None:
        raise ValueError("a pre-quantized NVFP4 x needs quant.a13_scale (its global scale is 1 / a13_scale)")
    if apply_router_weight_on_input:
        raise ValueError("apply_router_weight_on_input needs a float x (the weight scales x before quantization)")
    t = x.shape[0]
    if x.dtype != jnp.uint8 or x.shape != (t, h // 2):
        raise ValueError(f"a pre-quantized NVFP4 x must be [T, H/2] = [{t}, {h // 2}] uint8 (packed E2M1), "
                         f"got {list(x.shape)} {jnp.dtype(x.dtype).name}")
    if x_scale.dtype != jnp.float8_e4m3fn or x_scale.shape != (t, h // fp4.NVFP4_BLOCK):
        raise ValueError(f"x_scale must be [T, H/16] = [{t}, {h // fp4.NVFP4_BLOCK}] float8_e4m3fn (linear "
                         f"layout), got {list(x_scale.shape)} {jnp.dtype(x_scale.dtype).name}")
    return fp4.dequantize_nvfp4(x, x_scale, nvfp4_activation_global_scale(quant, 1))


def apply(
    x: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    topk_weights: jax.Array,
    topk_ids: jax.Array,
    cfg: MoEConfig,
    *,
    quant=None,
    w13_bias: jax.Array | None = None,
    w2_bias: jax.Array | None = None,
    apply_router_weight_on_input: bool = False,
    strategy: str | None = None,
    block_size: int | None = None,
    blocks_per_step: int | None = None,
    x_scale: jax.Array | None = None,
) -> jax.Array:
    """Experts + finalize for already-routed tokens. Arguments as :func:`jax_moe.fused_experts`
    (validated there). Returns ``[T, H]`` in ``x.dtype``.

    ``x_scale``: x arrives quantized (:data:`PREQUANTIZED_INPUT`; expert parallelism quantizes
    before the dispatch): with ``quant.act == "nvfp4"``, x [T, H/2] uint8 (packed E2M1) and
    x_scale [T, H/16] float8_e4m3fn (linear layout), :func:`jax_moe.quant.quantize_nvfp4` of the
    float x with the global scale ``1 / quant.a13_scale``
    (:func:`jax_moe.quant.scheme.nvfp4_activation_global_scale`). They are dequantized, which
    gives exactly what quantizing the float x here would; the result is then float32."""
    x, w13, w2, topk_weights, topk_ids, quant, w13_bias, w2_bias, x_scale = as_jax(
        x, w13, w2, topk_weights, topk_ids, quant, w13_bias, w2_bias, x_scale)
    t, k = topk_ids.shape
    out_dtype = x.dtype if x_scale is None else jnp.float32
    if t == 0:
        return jnp.zeros((0, cfg.hidden_size), out_dtype)
    if strategy is None:
        strategy = pick_strategy(t, cfg)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    weights = topk_weights.astype(jnp.float32)
    if x_scale is not None:
        xin = _prequantized_input(x, x_scale, cfg, quant, apply_router_weight_on_input)
    else:
        xin = x
        if apply_router_weight_on_input:
            xin = (x.astype(jnp.float32) * weights[:, :1]).astype(x.dtype)
            weights = jnp.ones_like(weights)
        if quant is not None:
            xin = quantize_activation(quant, xin.astype(jnp.float32), 1)

    if strategy == "gather":
        y, row_of_slot = _gather_experts(xin, topk_ids, cfg, w13, w2, quant, w13_bias, w2_bias)
        return finalize(y, row_of_slot, weights, out_dtype)
    if strategy == "dense":
        out = _dense_experts(xin, weights, topk_ids, cfg, w13, w2, quant, w13_bias, w2_bias)
        return out.astype(out_dtype)
    sort = sort_by_expert(topk_ids, cfg.num_experts)
    if strategy == "ragged_dot":
        y, row_of_slot = _ragged_experts(xin, sort, cfg, w13, w2, quant, w13_bias, w2_bias)
    else:
        b = block_size or pick_block_size(t, k, cfg.num_experts)
        g = blocks_per_step or pick_blocks_per_step(cfg)
        y, row_of_slot = _blocked_experts(xin, sort, cfg, w13, w2, quant, w13_bias, w2_bias, b, g)
    return finalize(y, row_of_slot, weights, out_dtype)


def apply_batched(
    x: jax.Array,
    counts: jax.Array,
    w13: jax.Array,
    w2: jax.Array,
    cfg: MoEConfig,
    *,
    quant=None,
    w13_bias: jax.Array | None = None,
    w2_bias: jax.Array | None = None,
    x_scale: jax.Array | None = None,
) -> jax.Array:
    """The expert stage on the batched format (the contract of ``cutlass.apply_batched``, the
    reference it is tested against): ``y[e, r] = expert_e(x[e, r])`` for ``r < counts[e]``.

    x [E, C, H] float (rows at or past ``counts[e]`` are padding, never read: NaN there does not
    leak); counts [E] int32, clamped to [0, C] (:func:`jax_moe.permute.batched_rows_used`);
    weights, biases and ``quant`` as :func:`apply` takes them (E: the experts this call owns).
    No routing weights: the weighted top-k reduce belongs to the combine. Quantized activations
    as :func:`apply` on the used rows (a dynamic scale is taken over them only). ``x_scale``:
    x arrives NVFP4-quantized as :func:`apply` takes it, x [E, C, H/2] uint8 and x_scale
    [E, C, H/16] float8_e4m3fn (linear). Returns y [E, C, H] in x's dtype (float32 for a
    quantized x), rows at or past ``counts[e]`` zero.

    Every row of the capacity is computed (two batched matmuls over E): a reference and a
    CPU path, not a fast one for a capacity far above the counts."""
    x, counts, w13, w2, quant, w13_bias, w2_bias, x_scale = as_jax(
        x, counts, w13, w2, quant, w13_bias, w2_bias, x_scale)
    check_rank("x", x, 3, "[E, C, H]")
    check_rank("counts", counts, 1, "[E]")
    e, c = x.shape[:2]
    check_dtype("counts", counts, ("int32",))
    if counts.shape[0] != e or w13.shape[0] != e:
        raise ValueError(f"x [E, C, H] and counts [E] must have the weights' E = {w13.shape[0]} experts, got "
                         f"x {list(x.shape)}, counts {list(counts.shape)}")
    used = batched_rows_used(counts, c)
    if x_scale is None:
        out_dtype, xin = x.dtype, x
    else:
        out_dtype = jnp.float32
        xin = _prequantized_input(x.reshape(e * c, -1), x_scale.reshape(e * c, -1), cfg, quant, False)
        xin = xin.reshape(e, c, -1)
    xin = jnp.where(used[..., None], xin, jnp.zeros((), xin.dtype))
    if quant is not None and x_scale is None:
        xin = quantize_activation(quant, xin.astype(jnp.float32), 1)
    y = _experts_mlp(xin, jnp.arange(e, dtype=jnp.int32), w13, w2, cfg, quant, w13_bias, w2_bias, used=used)
    return jnp.where(used[..., None], y, 0.0).astype(out_dtype)
