"""What every scheme of ``backend="flashinfer_cutlass"`` shares: the scheme registry of the native
module, the runner's row order, the :class:`Prepared` operands and their sharding.

Scope of this build: SM90 (Hopper, ``sm_90a``); activations ``silu`` (gated), ``gelu`` (gated,
erf form), ``swigluoai`` (GPT-OSS's, the runner's SwigluBias with per-expert alpha, beta = 1 and
limit) and ``relu2`` (not gated); optional biases on both GEMMs (``w13_bias [E, 2I]``,
``w2_bias [E, H]``, added before the router weight); router weight on the input for top-1
(applied to x before the call); expert-parallel shards (ids of -1 are skipped by the runner and
contribute nothing). Routing happens before: the calls take top-k ids and weights. Six schemes,
each its own FFI target (:data:`TARGETS`) and module of this package: ``bf16`` and ``f16``
(:mod:`.unquantized`), ``fp8`` (:mod:`.fp8`), ``mxfp4`` (:mod:`.mxfp4`), ``fp8_block``
(:mod:`.fp8_block`), ``w4a8`` (:mod:`.w4a8`).

Weight layout (``prepare``, once, at load time). The runner reads GEMM1's output as
``[up | gate]``: rows ``[0, I)`` of each expert's ``w13`` are the linear ("up", w3) half and rows
``[I, 2I)`` the gate (w1) half, and computes ``act(gate) * up``. vLLM's ``w13`` is
``[gate; up]`` (w1 then w3), so the halves are swapped ("w31" order,
:func:`jax_moe.layouts.swap_w13_to_w31`; :func:`runner_row_order`). ``w2`` is used as is
(``[E, H, I]``). ``w13_bias`` follows w13's rows (swapped the same way); biases are bf16 in every
scheme but ``f16``, where they are float16 (the runner's ``ScaleBiasType``, its output type)
(:func:`extras`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.layouts import (
    FP8_BLOCK_SCALE, MIXED_GEMM_SCALE_K, mxfp4_padding, pad_axis, pad_intermediate_rows, round_up,
    swap_w13_to_w31, undo_reorder_rows_for_gated_act_gemm,
)

NAME = "flashinfer_cutlass"
# scheme -> FFI target, scheme id in the native module, H/I alignment in weights (16 bytes; MXFP4:
# the mixed-input GEMM's 128-weight scale blocks), weights per stored element along K
TARGETS = {"bf16": "jax_moe_flashinfer_cutlass_moe", "fp8": "jax_moe_flashinfer_cutlass_moe_fp8",
           "mxfp4": "jax_moe_flashinfer_cutlass_moe_mxfp4",
           "fp8_block": "jax_moe_flashinfer_cutlass_moe_fp8_block", "f16": "jax_moe_flashinfer_cutlass_moe_f16",
           "w4a8": "jax_moe_flashinfer_cutlass_moe_w4a8"}
SCHEME_IDS = {"bf16": 0, "fp8": 1, "mxfp4": 2, "fp8_block": 3, "f16": 4, "w4a8": 5}
ALIGN = {"bf16": 8, "fp8": 16, "mxfp4": MIXED_GEMM_SCALE_K, "fp8_block": FP8_BLOCK_SCALE, "f16": 8,
         "w4a8": MIXED_GEMM_SCALE_K}
PACK = {"bf16": 1, "fp8": 1, "mxfp4": 2, "fp8_block": 1, "f16": 1, "w4a8": 2}
# the unquantized schemes: their activations', weights', biases' and output's dtype (the others: bf16 out)
FLOAT_SCHEMES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
PADDED = frozenset({"mxfp4"})  # prepare pads H and I (jax_moe.layouts.mxfp4_padding); x is padded per call
NO_TACTICS = frozenset({"fp8_block"})  # one GEMM kernel: no tactic list, no tuning
PREQUANTIZED = "fp8"  # the scheme that also takes x quantized before the call (with its x_scale)
F16_NOT_BUILT = ("scheme 'f16' is not built (JAX_MOE_FI_SCHEMES): float16 weights need an opt-in build "
                 "with f16 in JAX_MOE_FI_SCHEMES")
# apply/prepare take biases (prepare(..., w13_bias=, w2_bias=)) and router weight on input; the float
# dtypes (float16: scheme f16, else bf16: supports() is told the call's dtype)
FEATURES = frozenset({"bias", "router_weight_on_input", "dtype:bfloat16", "dtype:float16", "dtype:float32"})

# jax_moe activation name -> TensorRT-LLM ActivationType value (cutlass_kernels/include/common.h)
ACTIVATION_CODES = {"silu": 3, "gelu": 4, "swigluoai": 5, "relu2": 6}  # Swiglu, Geglu, SwigluBias, Relu2
GATED = {"silu": True, "gelu": True, "swigluoai": True, "relu2": False}


def scheme_of(quant, dtype=None) -> str:
    """The scheme serving ``quant``; without one, by the weights' ``dtype``: ``f16`` for float16,
    else ``bf16`` (float32 weights are cast to bf16)."""
    if quant is not None:
        return quant.scheme
    return "f16" if dtype is not None and np.dtype(dtype) == np.dtype(jnp.float16) else "bf16"


def not_compiled(scheme: str) -> str:
    """Why ``scheme`` cannot run with this build's native module (``f16`` is an opt-in build)."""
    if scheme == "f16":
        return F16_NOT_BUILT
    return f"scheme {scheme!r} is not compiled into this build (JAX_MOE_FI_SCHEMES)"


def alignment(quant=None) -> int:
    """H and I must be multiples of this for ``quant``'s scheme (16-byte rows)."""
    return ALIGN[scheme_of(quant)]


def weights_hidden(scheme: str, hidden: int) -> int:
    """The hidden size of ``scheme``'s prepared weights for a layer of hidden size ``hidden``
    (padded in the :data:`PADDED` schemes)."""
    return round_up(hidden, mxfp4_padding(NAME).hidden) if scheme in PADDED else hidden


def check_stored_operands(operands, activation: str) -> None:
    """ValueError naming the argument unless each ``(name, array, dtype)`` of ``operands`` is a
    rank-3 array of that dtype, and unless the runner has ``activation`` (:data:`GATED`)."""
    for name, a, dt in operands:
        if a.ndim != 3 or a.dtype != dt:
            raise ValueError(f"{name} must be {np.dtype(dt).name} of rank 3, got "
                             f"{np.dtype(a.dtype).name} {list(a.shape)}")
    if activation not in GATED:
        raise ValueError(f"activation {activation!r} is not wired up (have {sorted(GATED)})")


def stored_operands(w13, w13_scale, w2, w2_scale, weight_dtype, activation: str):
    """``(w13, w13_scale, w2, w2_scale)`` as arrays, checked (:func:`check_stored_operands`): the
    weights rank 3 of ``weight_dtype``, the scales rank 3 float32."""
    w13, w2 = jnp.asarray(w13), jnp.asarray(w2)
    s13, s2 = jnp.asarray(w13_scale), jnp.asarray(w2_scale)
    check_stored_operands((("w13", w13, weight_dtype), ("w2", w2, weight_dtype),
                           ("w13_scale", s13, jnp.float32), ("w2_scale", s2, jnp.float32)), activation)
    return w13, s13, w2, s2


def runner_row_order(w13, activation: str = "silu", gate_up_layout: str = "concat", axis: int = -2):
    """w13 [E, 2I, H] (or its bias [E, 2I] with ``axis=-1``) in vLLM's ``[gate; up]``
    (``"concat"``) or alternating (``"interleaved"``) rows -> ``[up; gate]``, any dtype.
    Not-gated activations (``relu2``, w13 [E, I, H]) unchanged."""
    w13 = jnp.asarray(w13)
    if not GATED.get(activation, True):
        return w13
    if gate_up_layout == "interleaved":
        w13 = undo_reorder_rows_for_gated_act_gemm(w13, axis=axis)  # -> [gate; up]
    elif gate_up_layout != "concat":
        raise ValueError(f"unknown gate_up_layout {gate_up_layout!r}")
    return swap_w13_to_w31(w13, axis=axis)  # [gate; up] -> [up; gate]


def pad_rows(x, activation: str, intermediate_padded: int, axis: int = -2):
    """GEMM1 rows (w13, its scales, its bias with ``axis=-1``) in the runner's order (gate/up
    halves), I padded with zeros."""
    return pad_intermediate_rows(x, intermediate_padded, GATED[activation], axis=axis)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
    """Expert weights in the runner's layout, from ``prepare`` (a pytree; jit-able).

    w13 [E, 2I, H] (``[up; gate]``) and w2 [E, H, I]: bfloat16 (scheme ``bf16``), float16
    (``f16``) or float8_e4m3fn (``fp8``, ``fp8_block``); ``mxfp4``: uint8 w13 [E, 2Ip, Hp/2], w2 [E, Hp, Ip/2]
    with H, I padded and their folded E8M0 scales ``w13_block_scale``, ``w2_block_scale``
    (:func:`jax_moe.backends.flashinfer_cutlass.mxfp4.prepare_mxfp4_weights`); ``fp8_block``:
    ``w13_block_scale [E, 2I/128, H/128]`` and
    ``w2_block_scale [E, H/128, I/128]`` float32, the 128 x 128 block scales in w13's and w2's row
    order (:mod:`jax_moe.layouts.blockscale`); ``w4a8``: uint8 w13 [E, 2I, H/2], w2 [E, H, I/2]
    (int4 codes in the mixed-input GEMM's unit order) and their folded bf16 group scales
    ``w13_block_scale [E, 2I/64, H/128, 8, 8]``, ``w2_block_scale [E, H/64, I/128, 8, 8]``, the
    FP8 quantizers' pre-quant scales ``fc1_act_scale [H]`` (None: dynamic a13) and
    ``fc2_act_scale [I]`` bf16 with ``g1_alphas``/``g2_alphas [E]`` float32
    (:mod:`jax_moe.backends.flashinfer_cutlass.w4a8`); None in the other schemes. FP8 only (None otherwise), float32:
    ``w13_scale [E]``; ``a13_scale []`` static input scale (None: dynamic per call);
    ``g1_alphas [E] = w13_scale * a13_scale`` (None when a13_scale is dynamic);
    ``a2_gscale [] = 1 / a2_scale``; ``g2_alphas [E] = w2_scale * a2_scale``.
    Optional (None: absent): ``w13_bias [E, 2I]`` bf16 (``f16``: float16) in w13's row order,
    ``w2_bias [E, H]`` likewise (mxfp4: padded like the weights, ``[E, 2Ip]``, ``[E, Hp]``); ``swiglu [3, E]`` float32
    (alpha, beta, limit per expert) for ``swigluoai``.
    Each array field's ``expert_axis`` metadata names its expert axis (None: no expert axis),
    which :func:`partition_specs` splits over expert parallelism, and ``tp_axis`` (absent: none)
    the axis that runs along the intermediate size I, split over tensor parallelism: then every
    device holds a whole :class:`Prepared` of its own I slice (w13 ``[up_s; gate_s]``, w2's
    columns of that slice), and the global array is the concatenation of those blocks.
    """

    w13: jax.Array = dataclasses.field(metadata=dict(expert_axis=0, tp_axis=1))
    w2: jax.Array = dataclasses.field(metadata=dict(expert_axis=0, tp_axis=2))
    w13_scale: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=0))
    a13_scale: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=None))
    g1_alphas: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=0))
    a2_gscale: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=None))
    g2_alphas: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=0))
    w13_bias: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=0, tp_axis=1))
    w2_bias: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=0))
    swiglu: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=1))
    w13_block_scale: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=0))
    w2_block_scale: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=0))
    fc1_act_scale: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=None))
    fc2_act_scale: jax.Array | None = dataclasses.field(default=None, metadata=dict(expert_axis=None, tp_axis=0))
    scheme: str = dataclasses.field(default="bf16", metadata=dict(static=True))
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))


def extras(cfg, w13_bias, w2_bias, padded=None, bias_dtype=jnp.bfloat16) -> dict:
    """The optional operands in the runner's layout: biases (``bias_dtype``, bf16 but in scheme
    ``f16``; ``padded=(Hp, Ip)``: zero-padded as the weights) and SwigluBias parameters."""
    e = cfg.num_experts
    b13 = b2 = None
    if w13_bias is not None:
        b13 = runner_row_order(w13_bias, cfg.activation, cfg.gate_up_layout, axis=-1)
        b13 = (b13 if padded is None else pad_rows(b13, cfg.activation, padded[1], axis=-1)).astype(bias_dtype)
    if w2_bias is not None:
        b2 = jnp.asarray(w2_bias)
        b2 = (b2 if padded is None else pad_axis(b2, padded[0], -1)).astype(bias_dtype)
    out = dict(w13_bias=b13, w2_bias=b2, swiglu=None)
    if cfg.activation == "swigluoai":  # GPT-OSS: (clamp(up) + 1) * g * sigmoid(alpha * g)
        out["swiglu"] = jnp.asarray(
            np.array([cfg.swiglu_alpha, 1.0, cfg.swiglu_limit], np.float32)[:, None].repeat(e, 1))
    return out


def partition_specs(prepared: Prepared, ep_axis, num_experts: int, tp_axis=None) -> Prepared:
    """A :class:`Prepared` of ``PartitionSpec`` s splitting every expert axis over ``ep_axis``
    and every intermediate-size axis over ``tp_axis`` (scalars replicated), for
    ``shard_map``/``jit`` shardings. ``prepared`` may hold ``ShapeDtypeStruct`` s; a scale of
    shape ``[E]`` that is per tensor in another build is still split, since its axis is the
    expert axis."""
    from jax.sharding import PartitionSpec as P

    specs = {}
    for f in dataclasses.fields(Prepared):
        if f.metadata.get("static"):
            continue
        a, ax, tp_ax = getattr(prepared, f.name), f.metadata["expert_axis"], f.metadata.get("tp_axis")
        if a is None:
            specs[f.name] = None
            continue
        names = [None] * a.ndim
        if ax is not None and a.ndim > ax and a.shape[ax] == num_experts:
            names[ax] = ep_axis
        if tp_ax is not None and tp_axis is not None:
            names[tp_ax] = tp_axis
        specs[f.name] = P(*names)
    return dataclasses.replace(prepared, **specs)


def problem_sizes(prepared: Prepared) -> tuple[int, int, int]:
    """``(E, H, I)`` of the runner's problem for ``prepared``, in weights along K (mxfp4: the
    padded sizes; w13's and w2's last axes hold ``PACK`` weights per element)."""
    pack = PACK[prepared.scheme]
    return int(prepared.w13.shape[0]), int(prepared.w13.shape[2]) * pack, int(prepared.w2.shape[2]) * pack


def random_weights(keys, num_experts: int, n1: int, hidden: int, inter: int, dtype):
    """Stand-in ``(w13 [E, N1, H], w2 [E, H, I])`` for timing tactics (speed does not depend on the
    values): normal with a 1/sqrt(K) scale in ``dtype``; for uint8 (two 4-bit codes a byte,
    ``[E, N1, H/2]``, ``[E, H, I/2]``), random bytes."""
    if dtype == jnp.uint8:
        return (jax.random.randint(keys[0], (num_experts, n1, hidden // 2), 0, 256, jnp.int32).astype(jnp.uint8),
                jax.random.randint(keys[1], (num_experts, hidden, inter // 2), 0, 256, jnp.int32).astype(jnp.uint8))
    return ((jax.random.normal(keys[0], (num_experts, n1, hidden), jnp.float32) * hidden ** -0.5).astype(dtype),
            (jax.random.normal(keys[1], (num_experts, hidden, inter), jnp.float32) * inter ** -0.5).astype(dtype))
