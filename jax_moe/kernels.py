"""The small kernels around a grouped-GEMM MoE, as jittable functions: CUDA custom calls
(``ffi/kernels/moe_prepare.cu``, ``ffi/kernels/moe_finalize.cu``) where the CUDA module is registered and the
computation runs on a GPU, else their jnp references (``*_reference``, which the CUDA kernels
are tested against).

One forward of a grouped-GEMM backend, rows in expert-sorted order (:mod:`jax_moe.permute`)::

    sort = sort_by_expert(topk_ids, E)                       # jax_moe.ffi (or jax_moe.permute)
    valid = sort.offsets[-1]                                 # rows of local experts (EP: ids of -1 sort last)
    ps1, ps2 = problem_sizes(sort.counts, H, I)              # [E, 3] int32 each
    a1, s1 = permute_rows(x, sort.sorted_slots, k, valid_rows=valid, quant="fp8_per_token",
                          inverse=sort.inverse)              # slot order: x read once, not k times
    h = grouped_gemm(a1, w13, ps1)                           # [T*k, 2I]
    a2, s2 = act_and_mul(h, "silu", valid_rows=valid, quant="fp8_per_token")
    y = grouped_gemm(a2, w2, ps2)                            # [T*k, H]
    out = unpermute_reduce(y, sort.inverse, topk_weights, valid_rows=valid)   # [T, H]

``valid_rows`` (an int32 scalar, normally ``sort.offsets[-1]``; None: all rows) is the same
convention everywhere: rows at or past it belong to slots whose expert is not on this rank.
``permute_rows`` and ``act_and_mul`` write those rows as zeros (per-token scale: the smallest
normal float32, as for any all-zero row), so that their outputs are fully defined whatever
GEMM1 left in its padding rows; ``unpermute_reduce`` skips those slots (they contribute zero,
whatever the rows hold, NaN included).

Expert biases (GPT-OSS): ``act_and_mul`` and ``unpermute_reduce`` take an optional ``bias``
([E, 2I] / [E, H] float32) with the sort's ``offsets`` [E+1] int32; row r belongs to the expert e
with ``offsets[e] <= r < offsets[e+1]`` (:func:`expert_of_row`), whose bias is added to GEMM1's
row before the activation, or to GEMM2's row before its routing weight.

FP8 is E4M3 (``float8_e4m3fn``) with :mod:`jax_moe.quant.fp8`'s arithmetic: per token,
``scale = max(amax * (1/448), FLT_MIN)``; ``q = e4m3(clip(v * (1 / scale), -448, 448))``;
``"fp8_static"`` takes a given per-tensor scale instead.

Non-finite values: the references and the CUDA kernels follow :mod:`jax_moe.quant`'s rule (the
amax over finite values; a NaN or an infinity becomes a NaN element, a finite overflow +-448) and
keep a bad row to itself: every row is gathered, activated and reduced on its own, and rows past
``valid_rows`` are selected away with ``where``.

Transformations: every custom call declares ``vmap_method="sequential"`` (a batch runs one
element at a time); the references batch natively. Arguments may be numpy arrays.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe import ffi
from jax_moe.activations import activate
from jax_moe.config import FLOAT_DTYPES, MoEConfig, check_dtype, check_positive_finite, check_rank
from jax_moe.permute import finalize
from jax_moe.quant.fp8 import quantize_fp8_per_token, quantize_fp8_static

QUANT_MODES = {None: 0, "fp8_per_token": 1, "fp8_static": 2}  # ffi/kernels/moe_prepare_finalize.h: QuantMode
ACTIVATIONS = {"silu": 0, "gelu": 1, "swigluoai": 2}  # ffi/kernels/moe_prepare_finalize.h: Activation
LAYOUTS = {"concat": 0, "interleaved": 1}  # ffi/kernels/moe_prepare_finalize.h: GateUpLayout


# ---------------------------------------------------------------- argument checks


def _check_int(name: str, v, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
    return int(v)


def _valid_rows(valid_rows, rows: int) -> jax.Array:
    """``valid_rows`` (None, an int, or an int32 array of one element) as an int32 [1] array."""
    if valid_rows is None:
        return jnp.full((1,), rows, jnp.int32)
    if isinstance(valid_rows, (int, np.integer)) and not isinstance(valid_rows, bool):
        return jnp.full((1,), int(valid_rows), jnp.int32)
    if not hasattr(valid_rows, "dtype") or np.dtype(valid_rows.dtype) != np.int32 or np.size(valid_rows) != 1:
        raise ValueError(
            "valid_rows must be None, an int, or an int32 array of one element (e.g. sort.offsets[-1]), "
            f"got {getattr(valid_rows, 'dtype', type(valid_rows).__name__)} of shape "
            f"{list(getattr(valid_rows, 'shape', ()))}"
        )
    return jnp.reshape(valid_rows, (1,))


def _quant_args(quant, scale) -> tuple[int, jax.Array | None]:
    """The quant mode's number and the static scale as a float32 [] array (or None)."""
    if quant not in QUANT_MODES:
        raise ValueError(f"quant must be one of {list(QUANT_MODES)}, got {quant!r}")
    if quant == "fp8_static":
        if scale is None:
            raise ValueError("scale is required with quant='fp8_static'")
        if np.size(scale) != 1:
            raise ValueError(f"scale must have one element (per-tensor), got shape {list(np.shape(scale))}")
        return QUANT_MODES[quant], jnp.reshape(jnp.asarray(scale, jnp.float32), ())
    if scale is not None:
        raise ValueError(f"scale is only taken with quant='fp8_static', not quant={quant!r}")
    return QUANT_MODES[quant], None


def _out_dtype(out_dtype, default, quant) -> jnp.dtype:
    if out_dtype is None:
        return jnp.dtype(jnp.float8_e4m3fn) if quant else jnp.dtype(default)
    if quant:
        raise ValueError(f"out_dtype is float8_e4m3fn with quant={quant!r}; do not pass out_dtype")
    if jnp.dtype(out_dtype).name not in FLOAT_DTYPES:
        raise ValueError(f"out_dtype must be one of {list(FLOAT_DTYPES)}, got {jnp.dtype(out_dtype).name}")
    return jnp.dtype(out_dtype)


def _native(cuda, reference, *args):
    """``cuda(*args)`` where lowered for a GPU with the CUDA module registered, else ``reference``."""
    if ffi.has_native("cuda"):
        return jax.lax.platform_dependent(*args, cuda=cuda, default=reference)
    return reference(*args)


def _row_mask(n: int, valid: jax.Array) -> jax.Array:
    return jnp.arange(n, dtype=jnp.int32) < valid[0]


def _quantize_rows(v: jax.Array, mode: int, scale):
    """float32 rows [M, C] -> (q [M, C] float8_e4m3fn, scales [M] or the static [] float32)."""
    if mode == QUANT_MODES["fp8_per_token"]:
        q, s = quantize_fp8_per_token(v)
        return q, s[:, 0]
    return quantize_fp8_static(v, scale), scale


def _check_bias(bias, offsets, cols: int, what: str):
    """The optional expert bias: (bias [E, cols] float32, offsets [E+1] int32) or (None, None).
    ``what`` names bias's shape in the messages (``"[E, 2I]"``, ``"[E, H]"``)."""
    if bias is None and offsets is None:
        return None, None
    if bias is None:
        raise ValueError("offsets is only taken with bias (the rows' experts for the bias)")
    if offsets is None:
        raise ValueError("offsets is required with bias: the sort's offsets [E+1] int32 give each row's expert")
    check_rank("bias", bias, 2, what)
    check_dtype("bias", bias, ("float32",))
    check_rank("offsets", offsets, 1, "[E+1]")
    check_dtype("offsets", offsets, ("int32",))
    e = bias.shape[0]
    if e < 1 or bias.shape[1] != cols:
        raise ValueError(f"bias must have shape {what} = [E, {cols}] with E >= 1, got {list(bias.shape)}")
    if offsets.shape[0] != e + 1:
        raise ValueError(f"offsets must have E + 1 = {e + 1} elements (E: bias rows), got {offsets.shape[0]}")
    return jnp.asarray(bias), jnp.asarray(offsets)


def expert_of_row(offsets: jax.Array, rows: int) -> jax.Array:
    """The expert of each expert-sorted row: ``e`` with ``offsets[e] <= r < offsets[e+1]`` (the
    largest such e, clamped to [0, E); rows at or past ``offsets[E]`` get E - 1). offsets [E+1]
    int32 (``sort_by_expert``'s) -> [rows] int32."""
    e = offsets.shape[0] - 1
    r = jnp.arange(rows, dtype=offsets.dtype)
    return jnp.clip(jnp.searchsorted(offsets, r, side="right").astype(jnp.int32) - 1, 0, max(e - 1, 0))


def _no_bias() -> tuple[jax.Array, jax.Array]:
    """The custom calls' empty bias and offsets operands ([0] each: no bias)."""
    return jnp.zeros((0,), jnp.float32), jnp.zeros((0,), jnp.int32)


# ---------------------------------------------------------------- problem_sizes


def problem_sizes(counts: jax.Array, hidden_size: int, intermediate_size: int, *, gated: bool = True
                  ) -> tuple[jax.Array, jax.Array]:
    """Grouped-GEMM problem sizes (M, N, K) per expert, from ``sort_by_expert``'s counts.

    counts [E] int32 -> (gemm1 [E, 3] int32 = (counts, 2I or I, H), gemm2 [E, 3] int32 =
    (counts, H, I)). Pure jnp (XLA fuses it into one tiny elementwise kernel; a custom call
    would only stop that fusion). ``gated``: GEMM1 produces gate and up (N = 2I).
    """
    check_rank("counts", counts, 1, "[E]")
    check_dtype("counts", counts, ("int32",))
    h = _check_int("hidden_size", hidden_size)
    i = _check_int("intermediate_size", intermediate_size)
    n1 = 2 * i if gated else i

    def sizes(n: int, k: int) -> jax.Array:
        const = jnp.broadcast_to(jnp.asarray([n, k], jnp.int32), (counts.shape[0], 2))
        return jnp.concatenate([counts[:, None], const], axis=1)

    return sizes(n1, h), sizes(h, i)


# ---------------------------------------------------------------- permute_rows


def permute_rows_reference(x, sorted_slots, top_k: int, *, valid_rows=None, quant=None, scale=None, inverse=None):
    """jnp reference of :func:`permute_rows` (same arguments and results); with ``inverse`` the rows
    are scattered to their slots' rows, as the CUDA kernel writes them."""
    n = _check_permute(x, sorted_slots, top_k, inverse)
    mode, scale = _quant_args(quant, scale)
    return _permute_ref(x, sorted_slots, inverse, _valid_rows(valid_rows, n), top_k, mode, scale)


def _permute_ref(x, slots, inverse, valid, top_k, mode, scale):
    n = slots.shape[0]
    zero = jnp.zeros((), x.dtype)
    if inverse is None:  # row r gathers slot sorted_slots[r]
        ok = _row_mask(n, valid) & (slots >= 0) & (slots < n)
        rows = jnp.where(ok[:, None], x[jnp.clip(slots, 0, max(n - 1, 0)) // top_k], zero)
    else:  # slot s scatters x[s // k] to row inverse[s] (positions outside [0, n) dropped)
        dest = jnp.where((inverse >= 0) & (inverse < n), inverse, n)
        rows = jnp.zeros((n, x.shape[1]), x.dtype).at[dest].set(jnp.repeat(x, top_k, axis=0), mode="drop")
        rows = jnp.where(_row_mask(n, valid)[:, None], rows, zero)
    if mode == 0:
        return rows
    return _quantize_rows(rows.astype(jnp.float32), mode, scale)


def _check_permute(x, sorted_slots, top_k, inverse=None) -> int:
    check_rank("x", x, 2, "[T, H]")
    check_dtype("x", x, FLOAT_DTYPES)
    k = _check_int("top_k", top_k)
    check_rank("sorted_slots", sorted_slots, 1, "[T*k]")
    check_dtype("sorted_slots", sorted_slots, ("int32",))
    n = x.shape[0] * k
    if sorted_slots.shape[0] != n:
        raise ValueError(f"sorted_slots must have T*k = {n} elements, got {sorted_slots.shape[0]}")
    if inverse is not None:
        check_rank("inverse", inverse, 1, "[T*k]")
        check_dtype("inverse", inverse, ("int32",))
        if inverse.shape[0] != n:
            raise ValueError(f"inverse must have T*k = {n} elements, got {inverse.shape[0]}")
    return n


def permute_rows(x: jax.Array, sorted_slots: jax.Array, top_k: int, *, valid_rows=None, quant: str | None = None,
                 scale=None, inverse=None):
    """Gather the tokens into expert-sorted rows: row r = ``x[sorted_slots[r] // top_k]``.

    x [T, H] bfloat16/float16/float32; sorted_slots [T*k] int32 (``sort_by_expert``); rows at or
    past ``valid_rows`` are zero. ``quant``: None -> rows [T*k, H] in x's dtype;
    ``"fp8_per_token"`` -> (rows [T*k, H] float8_e4m3fn, scales [T*k] float32);
    ``"fp8_static"`` with ``scale`` ([] float32, dequantization scale) -> (rows, scale).

    ``inverse`` ([T*k] int32, the same sort's: ``sorted_slots[inverse[s]] == s``; None: gather
    order): the CUDA kernel writes ``x[s // top_k]`` to row ``inverse[s]`` in slot order, so that
    the k slots of a token read its row once from DRAM instead of k times; from 1024 tokens on it
    runs a warp per token, which reads ``x[t]`` (and, for per-token FP8, its amax) once and writes
    it to its k slots' rows. Same result as without it;
    ``sorted_slots`` is then not read. It must be the
    sort's own (a permutation of [0, T*k)): the kernel skips a position outside [0, T*k), and a
    row that no slot maps to is left unwritten.
    """
    n = _check_permute(x, sorted_slots, top_k, inverse)
    mode, scale = _quant_args(quant, scale)
    valid = _valid_rows(valid_rows, n)
    k, h = int(top_k), x.shape[1]
    out_dt = _out_dtype(None, x.dtype, quant)
    inv = None if inverse is None else jnp.asarray(inverse)

    def reference(x, slots, inv, valid, scale):
        return _permute_ref(x, slots, inv, valid, k, mode, scale)

    def cuda(x, slots, inv, valid, scale):
        outs = [jax.ShapeDtypeStruct((n, h), out_dt), jax.ShapeDtypeStruct((n if mode == 1 else 0,), jnp.float32)]
        s_in = jnp.reshape(scale, (1,)) if mode == 2 else jnp.zeros((0,), jnp.float32)
        inv_in = jnp.zeros((0,), jnp.int32) if inv is None else inv  # [0]: gather order
        rows, scales = jax.ffi.ffi_call("jax_moe_permute_rows", outs, vmap_method="sequential")(
            x, slots, inv_in, valid, s_in, top_k=k, quant=mode)
        return rows if mode == 0 else (rows, scales if mode == 1 else scale)

    if n == 0:
        return reference(x, sorted_slots, inv, valid, scale)
    return _native(cuda, reference, x, sorted_slots, inv, valid, scale)


# ---------------------------------------------------------------- act_and_mul


def act_and_mul_reference(h, activation: str = "silu", *, valid_rows=None, quant=None, scale=None, out_dtype=None,
                          layout: str = "concat", alpha: float = 1.702, limit: float = 7.0, bias=None, offsets=None):
    """jnp reference of :func:`act_and_mul` (same arguments and results)."""
    alpha, limit = _check_act(h, activation, layout, alpha, limit)
    bias, offsets = _check_bias(bias, offsets, h.shape[1], "[E, 2I]")
    mode, scale = _quant_args(quant, scale)
    out_dt = _out_dtype(out_dtype, h.dtype, quant)
    cfg = _act_cfg(h, activation, layout, alpha, limit)
    return _act_ref(h, _valid_rows(valid_rows, h.shape[0]), cfg, bias, offsets, mode, scale, out_dt)


def _act_cfg(h, activation, layout, alpha, limit) -> MoEConfig:
    return MoEConfig(num_experts=1, top_k=1, hidden_size=1, intermediate_size=h.shape[1] // 2, activation=activation,
                     gate_up_layout=layout, swiglu_alpha=alpha, swiglu_limit=limit)


def _act_ref(h, valid, cfg, bias, offsets, mode, scale, out_dt):
    hf = h.astype(jnp.float32)
    if bias is not None:
        hf = hf + bias[expert_of_row(offsets, h.shape[0])]
    a = jnp.where(_row_mask(h.shape[0], valid)[:, None], activate(hf, cfg), 0.0)
    if mode == 0:
        return a.astype(out_dt)
    return _quantize_rows(a, mode, scale)


def _check_act(h, activation, layout, alpha, limit) -> tuple[float, float]:
    check_rank("h", h, 2, "[M, 2I]")
    check_dtype("h", h, FLOAT_DTYPES)
    if h.shape[1] < 2 or h.shape[1] % 2:
        raise ValueError(f"h must have an even, positive number of columns [M, 2I], got shape {list(h.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {list(LAYOUTS)}, got {layout!r}")
    return check_positive_finite("alpha", alpha), check_positive_finite("limit", limit)


def act_and_mul(h: jax.Array, activation: str = "silu", *, valid_rows=None, quant: str | None = None, scale=None,
                out_dtype=None, layout: str = "concat", alpha: float = 1.702, limit: float = 7.0, bias=None,
                offsets=None):
    """Gated activation of GEMM1's output: ``act(gate) * up`` of each row (plus its expert's bias), in float32.

    h [M, 2I] bfloat16/float16/float32; ``layout`` ``"concat"`` (gate columns [0, I), then up:
    vLLM's w13) or ``"interleaved"`` (gate 2i, up 2i+1: GPT-OSS); activation ``"silu"``,
    ``"gelu"`` (erf form) or ``"swigluoai"`` (GPT-OSS: gate <- min(gate, limit), up <- clip(up,
    -limit, limit), ``(up + 1) * gate * sigmoid(alpha * gate)``), as
    :func:`jax_moe.activations.activate`. ``bias`` [E, 2I] float32 (h's column order) with
    ``offsets`` [E+1] int32 (the sort's): row r's expert e (``offsets[e] <= r < offsets[e+1]``)
    adds ``bias[e]`` to h[r] before the activation. Rows at or past ``valid_rows`` are zero.
    ``quant``: None -> out [M, I] in ``out_dtype`` (default h's dtype);
    ``"fp8_per_token"`` -> (out [M, I] float8_e4m3fn, scales [M] float32);
    ``"fp8_static"`` with ``scale`` ([] float32) -> (out, scale).
    """
    alpha, limit = _check_act(h, activation, layout, alpha, limit)
    bias, offsets = _check_bias(bias, offsets, h.shape[1], "[E, 2I]")
    mode, scale = _quant_args(quant, scale)
    out_dt = _out_dtype(out_dtype, h.dtype, quant)
    m, i = h.shape[0], h.shape[1] // 2
    valid = _valid_rows(valid_rows, m)
    cfg = _act_cfg(h, activation, layout, alpha, limit)
    attrs = dict(activation=ACTIVATIONS[activation], quant=mode, layout=LAYOUTS[layout], alpha=np.float32(alpha),
                 limit=np.float32(limit))

    def reference(h, valid, scale, bias, offsets):
        return _act_ref(h, valid, cfg, bias, offsets, mode, scale, out_dt)

    def cuda(h, valid, scale, bias, offsets):
        outs = [jax.ShapeDtypeStruct((m, i), out_dt), jax.ShapeDtypeStruct((m if mode == 1 else 0,), jnp.float32)]
        s_in = jnp.reshape(scale, (1,)) if mode == 2 else jnp.zeros((0,), jnp.float32)
        b_in, o_in = _no_bias() if bias is None else (bias, offsets)
        out, scales = jax.ffi.ffi_call("jax_moe_act_and_mul", outs, vmap_method="sequential")(
            h, valid, s_in, b_in, o_in, **attrs)
        return out if mode == 0 else (out, scales if mode == 1 else scale)

    if m == 0:
        return reference(h, valid, scale, bias, offsets)
    return _native(cuda, reference, h, valid, scale, bias, offsets)


# ---------------------------------------------------------------- unpermute_reduce


def unpermute_reduce_reference(y, inverse, topk_weights, *, valid_rows=None, apply_router_weight_on_input=False,
                               out_dtype=None, bias=None, offsets=None):
    """jnp reference of :func:`unpermute_reduce` (same arguments and result); the reduce is
    :func:`jax_moe.permute.finalize`."""
    _check_unpermute(y, inverse, topk_weights)
    bias, offsets = _check_bias(bias, offsets, y.shape[1], "[E, H]")
    out_dt = _out_dtype(out_dtype, y.dtype, None)
    return _unpermute_ref(y, inverse, topk_weights.astype(jnp.float32), _valid_rows(valid_rows, y.shape[0]),
                          bool(apply_router_weight_on_input), out_dt, bias, offsets)


def _unpermute_ref(y, inverse, weights, valid, plain_sum, out_dt, bias=None, offsets=None):
    m = y.shape[0]
    if weights.shape[0] == 0:
        return jnp.zeros((0, y.shape[1]), out_dt)
    ok = (inverse >= 0) & (inverse < jnp.minimum(valid[0], m))
    row_of_slot = jnp.where(ok, inverse, m)  # row m: a zero row appended below
    if bias is not None:
        y = y.astype(jnp.float32) + bias[expert_of_row(offsets, m)]
    y_pad = jnp.concatenate([y, jnp.zeros((1, y.shape[1]), y.dtype)], axis=0)
    return finalize(y_pad, row_of_slot, jnp.ones_like(weights) if plain_sum else weights, out_dt)


def _check_unpermute(y, inverse, topk_weights) -> None:
    check_rank("y", y, 2, "[M, H]")
    check_dtype("y", y, FLOAT_DTYPES)
    check_rank("topk_weights", topk_weights, 2, "[T, k]")
    check_dtype("topk_weights", topk_weights, FLOAT_DTYPES)
    check_rank("inverse", inverse, 1, "[T*k]")
    check_dtype("inverse", inverse, ("int32",))
    t, k = topk_weights.shape
    if inverse.shape[0] != t * k:
        raise ValueError(f"inverse must have T*k = {t * k} elements, got {inverse.shape[0]}")
    if not 1 <= k <= 1024:
        raise ValueError(f"topk_weights must have k in [1, 1024] columns, got shape {list(topk_weights.shape)}")


def unpermute_reduce(y: jax.Array, inverse: jax.Array, topk_weights: jax.Array, *, valid_rows=None,
                     apply_router_weight_on_input: bool = False, out_dtype=None, bias=None, offsets=None) -> jax.Array:
    """The weighted top-k reduce back to token order, accumulated in float32:
    ``out[t] = sum_j topk_weights[t, j] * (y[row] + bias[e(row)])``, ``row = inverse[t*k + j]``,
    over the slots whose row is below ``valid_rows`` (the others, expert ids of -1, contribute zero).

    y [M, H] bfloat16/float16/float32 (GEMM2's expert-sorted rows, M normally T*k); inverse
    [T*k] int32 (``sort_by_expert``); topk_weights [T, k] float (taken as float32). ``bias``
    [E, H] float32 with ``offsets`` [E+1] int32 (the sort's): the GEMM2 bias of the row's expert
    e(row) (``offsets[e] <= row < offsets[e+1]``); None: no bias.
    ``apply_router_weight_on_input``: the weights were applied before GEMM1, so a plain sum.
    Returns out [T, H] in ``out_dtype`` (default y's dtype).
    """
    _check_unpermute(y, inverse, topk_weights)
    bias, offsets = _check_bias(bias, offsets, y.shape[1], "[E, H]")
    out_dt = _out_dtype(out_dtype, y.dtype, None)
    t, h = topk_weights.shape[0], y.shape[1]
    valid = _valid_rows(valid_rows, y.shape[0])
    plain = bool(apply_router_weight_on_input)
    weights = topk_weights.astype(jnp.float32)

    def reference(y, inverse, weights, valid, bias, offsets):
        return _unpermute_ref(y, inverse, weights, valid, plain, out_dt, bias, offsets)

    def cuda(y, inverse, weights, valid, bias, offsets):
        out = jax.ShapeDtypeStruct((t, h), out_dt)
        b_in, o_in = _no_bias() if bias is None else (bias, offsets)
        return jax.ffi.ffi_call("jax_moe_unpermute_reduce", out, vmap_method="sequential")(
            y, inverse, weights, valid, b_in, o_in, weighted=int(not plain))

    if t == 0 or h == 0:
        return reference(y, inverse, weights, valid, bias, offsets)
    return _native(cuda, reference, y, inverse, weights, valid, bias, offsets)
