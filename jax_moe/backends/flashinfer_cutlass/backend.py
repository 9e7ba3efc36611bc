"""FlashInfer's CUTLASS fused-MoE runner (TensorRT-LLM ``CutlassMoeFCRunner``) as XLA FFI custom
calls -- ``backend="flashinfer_cutlass"``.

Scope of this build: SM90 (Hopper, ``sm_90a``); activations ``silu`` (gated), ``gelu`` (gated,
erf form), ``swigluoai`` (GPT-OSS's, the runner's SwigluBias with per-expert alpha, beta = 1 and
limit) and ``relu2`` (not gated); optional biases on both GEMMs (``w13_bias [E, 2I]``,
``w2_bias [E, H]``, added before the router weight); router weight on the input for top-1
(applied to x before the call); expert-parallel shards (ids of -1 are skipped by the runner and
contribute nothing). Six schemes, each its own FFI target:

* ``bf16``: bf16 activations x bf16 weights -> bf16.
* ``f16``: float16 activations x float16 weights -> float16 (biases float16 too): ``bf16``'s
  kernels with half (``CutlassMoeFCRunner<half, half>``), chosen by the weights' dtype (no
  QuantConfig); the same layouts and activations as ``bf16``. Opt-in build
  (``JAX_MOE_FI_SCHEMES="...;f16"``); float16 mixed with bfloat16 is a ValueError.
* ``fp8`` (vLLM's FP8 per-tensor W8A8): activations quantized to float8_e4m3fn with one
  per-tensor scale (static ``a13_scale``, or dynamic ``amax(x) / 448`` per call) x float8_e4m3fn
  weights with per-tensor or per-expert scales -> bf16. GEMM1's accumulator is rescaled by
  ``g1_alphas[e] = w13_scale[e] * a13_scale``, the activation output re-quantized to FP8 with
  ``1 / a2_scale`` (static: the runner has no amax pass), GEMM2's accumulator rescaled by
  ``g2_alphas[e] = w2_scale[e] * a2_scale``. Per-expert activation scales use their max over
  experts, as vLLM does.
* ``mxfp4`` (W4A16, GPT-OSS; ``QuantConfig(scheme="mxfp4", act="bf16")``): bf16 activations x
  MXFP4 weights (E2M1 codes, one E8M0 scale per 32 along K) -> bf16, on the runner's SM90
  mixed-input grouped GEMMs (FlashInfer's ``isWFP4A16Quant`` runner,
  ``CutlassMoeFCRunner<bf16, Fp4Type>`` with ``QuantParams::GroupWise(32, ...)``): the kernel
  converts the 4-bit weights to bf16 in registers (CUTLASS's mixed-input mainloop, scale mode
  kPostMma) and multiplies bf16 x bf16. This is what serves weight-only MXFP4 on Hopper (vLLM's
  Marlin row is not built).
* ``fp8_block`` (DeepSeek-V3 FP8; ``QuantConfig(scheme="fp8_block")``, act ``fp8_per_group``):
  bf16 activations x float8_e4m3fn weights with one float32 scale per 128 x 128 block -> bf16,
  on TensorRT-LLM's block-scale grouped GEMM, which quantizes the activations itself per token
  per 128 columns (FlashInfer's ``use_deepseek_fp8_block_scale`` runner). Opt-in build; H and I
  multiples of 128; no tactics. Its own parts: :mod:`jax_moe.backends.flashinfer_cutlass_fp8_block`.
* ``w4a8`` (``QuantConfig(scheme="w4a8", act="fp8_per_tensor")`` with a static ``a2_scale``):
  signed int4 weights with a scale per 128 along K x FP8 E4M3 activations -> bf16, on the SM90
  mixed-input grouped GEMMs (FlashInfer's ``isW4AFp8Quant`` runner); the runner quantizes its
  bf16 input and the activation output with per-channel pre-quant scales. Opt-in build; H and I
  multiples of 128. Its definition and own parts: :mod:`jax_moe.backends.flashinfer_cutlass_w4a8`.

Routing happens before: the calls take top-k ids and weights.

Weight layout (:func:`prepare`, once, at load time). The runner reads GEMM1's output as
``[up | gate]``: rows ``[0, I)`` of each expert's ``w13`` are the linear ("up", w3) half and rows
``[I, 2I)`` the gate (w1) half, and computes ``act(gate) * up``. vLLM's ``w13`` is
``[gate; up]`` (w1 then w3), so the halves are swapped ("w31" order,
:func:`jax_moe.layouts.swap_w13_to_w31`). ``w2`` is used as is (``[E, H, I]``). The alphas above
are computed there too (:func:`jax_moe.layouts.fp8_alpha_scales`). ``w13_bias`` follows w13's rows
(swapped the same way); biases are bf16 in every scheme but ``f16``, where they are float16 (the
runner's ``ScaleBiasType``, its output type).
MXFP4 (:func:`prepare_mxfp4_weights`): the same row order on the packed weights and their
scales, I and H padded with zeros to :data:`jax_moe.layouts.MXFP4_PADDING`
``["flashinfer_cutlass"]`` (128: the mixed-input GEMM folds scales per 128 weights along K and
the runner asks H and I to be multiples of 128), then the mixed-input GEMM's byte order
(:mod:`jax_moe.layouts.mixed_gemm`). ``x`` is padded to the padded H per call and the runner
writes only the first H output columns (its unpadded hidden size).

The native parts are ``jax_moe._jax_moe_flashinfer`` (nanobind glue) and ``libjax_moe_fi.so`` (the
runner, its kernels and the FFI handlers), built by ``cmake/flashinfer_moe.cmake`` when
``JAX_MOE_WITH_FLASHINFER`` is on and FlashInfer's sources are found. The workspace comes from XLA
as a second (discarded) ``uint8`` result whose size the module computes at trace time.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.layouts import (
    FP8_BLOCK_SCALE,
    MIXED_GEMM_SCALE_K,
    fp8_alpha_scales,
    interleave_fp4_weights_for_sm90_mixed_gemm,
    interleave_scales_for_sm90_mixed_gemm,
    mixed_gemm_scale_shape,
    mxfp4_padded_sizes,
    mxfp4_padding,
    pad_axis,
    pad_intermediate_rows,
    round_up,
    swap_w13_to_w31,
    undo_reorder_rows_for_gated_act_gemm,
)
from jax_moe.ffi import register_module_targets
from jax_moe.quant import fp4, fp8

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
# the unquantized schemes: their activations', weights', biases' and output's dtype
FLOAT_SCHEMES = {"bf16": jnp.bfloat16, "f16": jnp.float16}
F16_NOT_BUILT = ("scheme 'f16' is not built (JAX_MOE_FI_SCHEMES): float16 weights need an opt-in build "
                 "with f16 in JAX_MOE_FI_SCHEMES")
# apply/prepare take biases (prepare(..., w13_bias=, w2_bias=)) and router weight on input; any dtype
FEATURES = frozenset({"bias", "router_weight_on_input"})

# jax_moe activation name -> TensorRT-LLM ActivationType value (cutlass_kernels/include/common.h)
ACTIVATION_CODES = {"silu": 3, "gelu": 4, "swigluoai": 5, "relu2": 6}  # Swiglu, Geglu, SwigluBias, Relu2
GATED = {"silu": True, "gelu": True, "swigluoai": True, "relu2": False}

_state = {"module": None, "error": None, "registered": False}


def _module():
    if _state["module"] is None and _state["error"] is None:
        try:
            from jax_moe import _jax_moe_flashinfer as mod  # noqa: PLC0415

            _state["module"] = mod
        except ImportError as e:  # not built, or built without FlashInfer sources
            _state["error"] = f"jax_moe._jax_moe_flashinfer is not importable: {e}"
    return _state["module"]


def compiled_schemes() -> tuple[str, ...]:
    """The schemes this build's native module serves (empty when it is not importable)."""
    mod = _module()
    if mod is None:
        return ()
    mask = mod.compiled_schemes() if hasattr(mod, "compiled_schemes") else 1
    return tuple(name for name, sid in SCHEME_IDS.items() if mask >> sid & 1)


def available(device=None) -> tuple[bool, str]:
    """Whether the custom calls can run on ``device`` (default: JAX's default device), and why not."""
    from jax_moe.device import sm90_module_ready

    ok, why = sm90_module_ready(_module(), _state["error"], device)
    if not ok:
        return False, why
    return True, f"FlashInfer CUTLASS fused MoE (SM90; {', '.join(compiled_schemes())})"


def scheme_of(quant, dtype=None) -> str:
    """The scheme serving ``quant``; without one, by the weights' ``dtype``: ``f16`` for float16,
    else ``bf16`` (float32 weights are cast to bf16)."""
    if quant is not None:
        return quant.scheme
    return "f16" if dtype is not None and np.dtype(dtype) == np.dtype(jnp.float16) else "bf16"


def float_scheme(**arrays) -> str:
    """``f16`` if any of the named arrays (None: absent) is float16, else ``bf16``; float16 next
    to bfloat16 is a ValueError naming both groups (float32 goes with either)."""
    dts = {n: np.dtype(a.dtype) for n, a in arrays.items() if getattr(a, "dtype", None) is not None}
    names = {dt: [n for n, d in dts.items() if d == np.dtype(dt)] for dt in (jnp.float16, jnp.bfloat16)}
    f16, bf16 = names[jnp.float16], names[jnp.bfloat16]
    if f16 and bf16:
        raise ValueError(f"{NAME}: float16 and bfloat16 mixed ({', '.join(f16)} float16; {', '.join(bf16)} "
                         "bfloat16): scheme f16 takes float16 throughout, bf16 bfloat16")
    return "f16" if f16 else "bf16"


def supports(cfg, quant=None, device=None, *, dtype=None) -> tuple[bool, str]:
    """Whether this backend serves ``cfg`` (a :class:`jax_moe.config.MoEConfig`) with ``quant``
    on ``device``, and why not. ``dtype``: the unquantized weights' dtype (float16: scheme
    ``f16``; the oracle passes it from the call's features)."""
    scheme = scheme_of(quant, dtype)
    if scheme not in TARGETS:
        return False, f"scheme {scheme!r} is not built yet (have {sorted(TARGETS)})"
    if scheme == "fp8":
        if quant.act != "fp8_per_tensor":
            return False, f"FP8 needs per-tensor activation scales (act='fp8_per_tensor'), not {quant.act!r}"
        for name in ("w13_scale", "w2_scale"):
            if getattr(quant, name).ndim > 1:
                return False, (f"{name} is per channel; the runner's FP8 path takes per-tensor or "
                               "per-expert weight scales")
        if quant.a2_scale is None:
            return False, ("FP8 needs a static a2_scale: the runner re-quantizes the activation "
                           "output with it (calibrate one with calibrate_activation_scale)")
    if scheme == "mxfp4" and quant.act != "bf16":
        return False, (f"MXFP4 runs with bf16 activations (W4A16) here, not {quant.act!r}: FlashInfer "
                       "0.7.2 has no SM90 MXFP4 x MXFP8 CUTLASS path")
    if scheme == "fp8_block":
        from jax_moe.backends import flashinfer_cutlass_fp8_block as fp8b

        why = fp8b.refusal(cfg, quant)
        if why:
            return False, why
    if scheme == "w4a8":
        from jax_moe.backends import flashinfer_cutlass_w4a8 as w4

        why = w4.refusal(cfg, quant)
        if why:
            return False, why
    ok, why = available(device)
    if not ok:
        return False, why
    if scheme == "f16" and scheme not in compiled_schemes():
        return False, F16_NOT_BUILT
    if scheme not in compiled_schemes():
        return False, f"scheme {scheme!r} is not compiled into this build (JAX_MOE_FI_SCHEMES)"
    if cfg.activation not in ACTIVATION_CODES:
        return False, f"activation {cfg.activation!r} is not wired up (have {sorted(ACTIVATION_CODES)})"
    align = alignment(quant)
    if scheme != "mxfp4" and (cfg.hidden_size % align or cfg.intermediate_size % align):
        return False, f"hidden and intermediate sizes must be multiples of {align} for {scheme}"
    return True, "ok"  # mxfp4: prepare pads H and I to multiples of ALIGN


def _register():
    register_module_targets(_state, _module())


# ----------------------------------------------------------------------------- load time


def check_stored_operands(operands, activation: str) -> None:
    """ValueError naming the argument unless each ``(name, array, dtype)`` of ``operands`` is a
    rank-3 array of that dtype, and unless the runner has ``activation`` (:data:`GATED`)."""
    for name, a, dt in operands:
        if a.ndim != 3 or a.dtype != dt:
            raise ValueError(f"{name} must be {np.dtype(dt).name} of rank 3, got "
                             f"{np.dtype(a.dtype).name} {list(a.shape)}")
    if activation not in GATED:
        raise ValueError(f"activation {activation!r} is not wired up (have {sorted(GATED)})")


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


def prepare_weights(w13, w2, activation: str = "silu", gate_up_layout: str = "concat", dtype=jnp.bfloat16):
    """bf16 scheme: ``(w13 [E, 2I, H] bf16 as [up; gate], w2 [E, H, I] bf16)`` (see
    :func:`runner_row_order`); f16 scheme: the same with ``dtype=jnp.float16``."""
    w13 = runner_row_order(w13, activation, gate_up_layout)
    return w13.astype(dtype), jnp.asarray(w2).astype(dtype)


def _pad_rows(x, activation: str, intermediate_padded: int, axis: int = -2):
    """GEMM1 rows (w13, its scales, its bias with ``axis=-1``) in the runner's order (gate/up
    halves), I padded with zeros."""
    return pad_intermediate_rows(x, intermediate_padded, GATED[activation], axis=axis)


def prepare_mxfp4_weights(w13, w13_scale, w2, w2_scale, activation: str = "silu",
                          gate_up_layout: str = "concat"):
    """mxfp4 scheme: stored MXFP4 experts -> the runner's W4A16 operands, once, at load time.

    In: ``w13 [E, 2I, H/2]`` uint8 (two E2M1 codes per byte, :mod:`jax_moe.quant.fp4`; rows
    ``[gate; up]`` or alternating per ``gate_up_layout``; ``[E, I, H/2]`` for ``relu2``),
    ``w13_scale [E, 2I, H/32]`` uint8 E8M0, ``w2 [E, H, I/2]``, ``w2_scale [E, H, I/32]``.
    Out: ``(w13, w13_scale, w2, w2_scale)`` with ``(Hp, Ip) = mxfp4_padded_sizes(NAME, H, I)``:

    * ``w13 [E, 2Ip, Hp/2]`` uint8: rows as ``[up (I); 0 (Ip - I); gate (I); 0]``
      (:func:`runner_row_order`, then each half zero-padded), bytes zero-padded to ``Hp/2``,
      then in the mixed-input GEMM's byte order
      (:func:`jax_moe.layouts.interleave_fp4_weights_for_sm90_mixed_gemm`);
    * ``w13_scale [E, 2Ip/64, Hp/128, 16, 16]`` uint8: the scales through the same rows and
      padding (zero bytes), folded (:func:`jax_moe.layouts.interleave_scales_for_sm90_mixed_gemm`);
    * ``w2 [E, Hp, Ip/2]`` and ``w2_scale [E, Hp/64, Ip/128, 16, 16]`` likewise (rows H, K I).

    Zero codes in the padding make padded GEMM1 rows 0 (and so the activation's output there:
    every activation here maps a zero gate to 0) and padded GEMM2 rows 0.
    """
    w13, s13 = jnp.asarray(w13), jnp.asarray(w13_scale)
    w2, s2 = jnp.asarray(w2), jnp.asarray(w2_scale)
    for name, a in (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2)):
        if a.ndim != 3 or a.dtype != jnp.uint8:
            raise ValueError(f"{name} must be uint8 [E, N, K/2] (weights) or [E, N, K/32] (scales), "
                             f"got {np.dtype(a.dtype).name} {list(a.shape)}")
    e, h, i2 = w2.shape
    i = 2 * i2
    n1 = 2 * i if GATED[activation] else i
    want = {"w13": (w13, (e, n1, h // 2)), "w13_scale": (s13, (e, n1, h // fp4.MX_BLOCK)),
            "w2_scale": (s2, (e, h, i // fp4.MX_BLOCK))}
    for name, (a, shape) in want.items():
        if a.shape != shape:
            raise ValueError(f"{name} must have shape {list(shape)} for w2 {list(w2.shape)}, got {list(a.shape)}")
    hp, ip = mxfp4_padded_sizes(NAME, h, i)
    rows = lambda a: _pad_rows(runner_row_order(a, activation, gate_up_layout), activation, ip)  # noqa: E731
    w13 = pad_axis(rows(w13), hp // 2, -1)
    s13 = pad_axis(rows(s13), hp // fp4.MX_BLOCK, -1)
    w2 = pad_axis(pad_axis(w2, hp, -2), ip // 2, -1)
    s2 = pad_axis(pad_axis(s2, hp, -2), ip // fp4.MX_BLOCK, -1)
    return (interleave_fp4_weights_for_sm90_mixed_gemm(w13), interleave_scales_for_sm90_mixed_gemm(s13),
            interleave_fp4_weights_for_sm90_mixed_gemm(w2), interleave_scales_for_sm90_mixed_gemm(s2))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
    """Expert weights in the runner's layout, from :func:`prepare` (a pytree; jit-able).

    w13 [E, 2I, H] (``[up; gate]``) and w2 [E, H, I]: bfloat16 (scheme ``bf16``), float16
    (``f16``) or float8_e4m3fn (``fp8``, ``fp8_block``); ``mxfp4``: uint8 w13 [E, 2Ip, Hp/2], w2 [E, Hp, Ip/2]
    with H, I padded and their folded E8M0 scales ``w13_block_scale``, ``w2_block_scale``
    (:func:`prepare_mxfp4_weights`); ``fp8_block``: ``w13_block_scale [E, 2I/128, H/128]`` and
    ``w2_block_scale [E, H/128, I/128]`` float32, the 128 x 128 block scales in w13's and w2's row
    order (:mod:`jax_moe.layouts.blockscale`); ``w4a8``: uint8 w13 [E, 2I, H/2], w2 [E, H, I/2]
    (int4 codes in the mixed-input GEMM's unit order) and their folded bf16 group scales
    ``w13_block_scale [E, 2I/64, H/128, 8, 8]``, ``w2_block_scale [E, H/64, I/128, 8, 8]``, the
    FP8 quantizers' pre-quant scales ``fc1_act_scale [H]`` (None: dynamic a13) and
    ``fc2_act_scale [I]`` bf16 with ``g1_alphas``/``g2_alphas [E]`` float32
    (:mod:`jax_moe.backends.flashinfer_cutlass_w4a8`); None in the other schemes. FP8 only (None otherwise), float32:
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


def _extras(cfg, w13_bias, w2_bias, padded=None, bias_dtype=jnp.bfloat16) -> dict:
    """The optional operands in the runner's layout: biases (``bias_dtype``, bf16 but in scheme
    ``f16``; ``padded=(Hp, Ip)``: zero-padded as the weights) and SwigluBias parameters."""
    e = cfg.num_experts
    b13 = b2 = None
    if w13_bias is not None:
        b13 = runner_row_order(w13_bias, cfg.activation, cfg.gate_up_layout, axis=-1)
        b13 = (b13 if padded is None else _pad_rows(b13, cfg.activation, padded[1], axis=-1)).astype(bias_dtype)
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


def alignment(quant=None) -> int:
    """H and I must be multiples of this for ``quant``'s scheme (16-byte rows)."""
    return ALIGN[scheme_of(quant)]


def prepare(w13, w2, cfg, quant=None, *, w13_bias=None, w2_bias=None) -> Prepared:
    """vLLM-layout expert weights (as ``fused_experts`` takes them) -> :class:`Prepared`, once,
    at load time. ``cfg`` is the layer's :class:`jax_moe.config.MoEConfig`; ``quant`` None (bf16,
    or f16 for float16 weights: :func:`float_scheme`) or a :class:`jax_moe.QuantConfig` (fp8, mxfp4, fp8_block,
    w4a8) that :func:`supports` accepts; biases ``w13_bias [E, 2I]`` (vLLM's row order, like w13) and
    ``w2_bias [E, H]`` or None."""
    if quant is None:  # float16 next to bfloat16 is an error before anything is traced
        scheme = float_scheme(w13=w13, w2=w2, w13_bias=w13_bias, w2_bias=w2_bias)
    else:
        scheme = scheme_of(quant)
    if scheme == "mxfp4":
        if quant.act != "bf16":
            raise ValueError(f"{NAME}: MXFP4 needs act='bf16' (W4A16), got {quant.act!r}")
        w13p, s13, w2p, s2 = prepare_mxfp4_weights(w13, quant.w13_scale, w2, quant.w2_scale,
                                                   cfg.activation, cfg.gate_up_layout)
        extras = _extras(cfg, w13_bias, w2_bias, mxfp4_padded_sizes(NAME, cfg.hidden_size, cfg.intermediate_size))
        return Prepared(w13p, w2p, w13_block_scale=s13, w2_block_scale=s2, scheme="mxfp4",
                        activation=cfg.activation, **extras)
    if scheme in FLOAT_SCHEMES:
        dt = FLOAT_SCHEMES[scheme]
        w13p, w2p = prepare_weights(w13, w2, cfg.activation, cfg.gate_up_layout, dtype=dt)
        return Prepared(w13p, w2p, scheme=scheme, activation=cfg.activation,
                        **_extras(cfg, w13_bias, w2_bias, bias_dtype=dt))
    extras = _extras(cfg, w13_bias, w2_bias)
    if scheme == "fp8_block":
        from jax_moe.backends import flashinfer_cutlass_fp8_block as fp8b

        return fp8b.prepare(w13, w2, cfg, quant, extras)
    if scheme == "w4a8":
        from jax_moe.backends import flashinfer_cutlass_w4a8 as w4

        return w4.prepare(w13, w2, cfg, quant, extras)
    if scheme != "fp8":
        raise ValueError(f"{NAME}: scheme {scheme!r} is not built yet (have {sorted(TARGETS)})")
    if quant.act != "fp8_per_tensor" or quant.a2_scale is None:
        raise ValueError(f"{NAME}: FP8 needs act='fp8_per_tensor' and a static a2_scale")
    e = jnp.shape(w13)[0]
    w13_scale = jnp.broadcast_to(jnp.asarray(quant.w13_scale, jnp.float32), (e,))
    w2_scale = jnp.broadcast_to(jnp.asarray(quant.w2_scale, jnp.float32), (e,))
    a2 = jnp.max(jnp.asarray(quant.a2_scale, jnp.float32))  # one scale for all experts, as vLLM
    a13 = None if quant.a13_scale is None else jnp.max(jnp.asarray(quant.a13_scale, jnp.float32))
    g1, g2 = fp8_alpha_scales(w13_scale, 1.0 if a13 is None else a13, w2_scale, a2)
    return Prepared(
        w13=runner_row_order(w13, cfg.activation, cfg.gate_up_layout).astype(jnp.float8_e4m3fn),
        w2=jnp.asarray(w2).astype(jnp.float8_e4m3fn),
        w13_scale=w13_scale, a13_scale=a13, g1_alphas=None if a13 is None else g1,
        a2_gscale=jnp.float32(1.0) / a2, g2_alphas=g2, scheme="fp8", activation=cfg.activation,
        **extras,
    )


# ----------------------------------------------------------------------------- per call


@functools.lru_cache(maxsize=None)
def workspace_size(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                   activation: str = "silu", scheme: str = "bf16") -> int:
    """Bytes of scratch the custom call needs (asks the runner; needs a CUDA device)."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return int(mod.workspace_size(num_tokens, hidden, inter, num_experts, top_k,
                                  ACTIVATION_CODES[activation], SCHEME_IDS[scheme]))


def tactics(gemm_id: int, scheme: str = "bf16"):
    """The runner's tactic list for GEMM 1 or 2: ``[(index, description, compiled)]`` (empty for
    ``fp8_block``: its block-scale GEMM is one kernel)."""
    if scheme == "fp8_block":
        return []
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return list(mod.tactics(gemm_id, SCHEME_IDS[scheme]))


def problem_sizes(prepared: Prepared) -> tuple[int, int, int]:
    """``(E, H, I)`` of the runner's problem for ``prepared``, in weights along K (mxfp4: the
    padded sizes; w13's and w2's last axes hold ``PACK`` weights per element)."""
    pack = PACK[prepared.scheme]
    return int(prepared.w13.shape[0]), int(prepared.w13.shape[2]) * pack, int(prepared.w2.shape[2]) * pack


def input_scale(x, prepared: Prepared, amax=None):
    """The per-tensor FP8 scale the ``fp8`` scheme quantizes ``x [T, H]`` with: the static
    ``a13_scale``, else ``amax / 448`` of ``amax`` (default ``max |x|``; expert parallelism
    passes the max over every device's tokens). float32 []."""
    if prepared.a13_scale is not None:
        return prepared.a13_scale
    if amax is None:
        amax = jnp.max(jnp.abs(x.astype(jnp.float32)))
    return fp8.amax_to_scale(amax)


def quantize_input(x, scale):
    """x [T, H] float -> float8_e4m3fn with ``scale`` (:func:`input_scale`): what the ``fp8``
    scheme feeds GEMM1. Expert parallelism quantizes before dispatch with it and hands the
    result to :func:`apply_prepared` with ``x_scale=scale``."""
    return fp8.quantize_fp8_static(x.astype(jnp.float32), scale)


def apply_prepared(x, prepared: Prepared, topk_weights, topk_ids, *, gemm1_tactic: int = -1,
                   gemm2_tactic: int = -1, apply_router_weight_on_input: bool = False, x_scale=None):
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on the FlashInfer
    CUTLASS runner.

    x [T, H] float; ``prepared`` from :func:`prepare`; topk_weights [T, k] float; topk_ids [T, k]
    int32 in [0, E), or -1 for a slot whose expert lives elsewhere (skipped). With
    ``apply_router_weight_on_input`` (top-1 only) ``y[t] = expert(topk_weights[t] * x[t])``.
    Scheme ``fp8`` also takes x already quantized (float8_e4m3fn, :func:`quantize_input`) with
    its per-tensor ``x_scale`` []; a float x with ``x_scale`` is quantized with that scale.
    Scheme ``mxfp4`` takes x [T, H] with H the layer's unpadded hidden size (``prepared`` holds
    H padded, :func:`prepare_mxfp4_weights`): x is zero-padded, the output is [T, H].
    Scheme ``f16`` takes x float16 (or float32) and returns float16; x bfloat16 with float16
    weights (or float16 with ``bf16``'s) is a ValueError.
    Returns [T, H] bf16 (``f16``: float16). ``gemm*_tactic`` index the runner's tactic lists
    (:func:`tactics`); with both at -1, a tuned pair for this shape is used if one is cached
    (:mod:`jax_moe.backends.flashinfer_tuning`, ``JAX_MOE_FI_AUTOTUNE=1`` tunes missing shapes),
    else the handler's built-in rule.
    """
    activation, scheme = prepared.activation, prepared.scheme
    if activation not in ACTIVATION_CODES:
        raise ValueError(f"activation {activation!r} not supported by {NAME}")
    if scheme not in TARGETS:
        raise ValueError(f"prepared.scheme must be one of {sorted(TARGETS)}, got {scheme!r}")
    w13, w2 = prepared.w13, prepared.w2
    t, h = x.shape
    e, hw, i = problem_sizes(prepared)  # hw: the weights' H (mxfp4: padded)
    n1, (e2, h3) = w13.shape[1], w2.shape[:2]
    k = topk_ids.shape[1]
    want_n1 = 2 * i if GATED[activation] else i
    hp = round_up(h, mxfp4_padding(NAME).hidden) if scheme == "mxfp4" else h
    if hw != hp or h3 != hp or e2 != e or n1 != want_n1:
        packed = "" if PACK[scheme] == 1 else f"/{PACK[scheme]}"
        raise ValueError(f"shape mismatch: x {x.shape}, w13 {w13.shape}, w2 {w2.shape} (w13 must be "
                         f"[E, {'2I' if GATED[activation] else 'I'}, H{packed}], w2 [E, H, I{packed}]"
                         f"{', H padded to ' + str(hp) if hp != h else ''})")
    if scheme == "mxfp4":
        for name, rows, kk in (("w13_block_scale", n1, hw), ("w2_block_scale", hw, i)):
            sc = getattr(prepared, name)
            want = (e,) + mixed_gemm_scale_shape(rows, kk)
            if sc is None or tuple(sc.shape) != want or sc.dtype != jnp.uint8:
                raise ValueError(f"prepared.{name} must be uint8 {list(want)} (use prepare())")
    if scheme == "fp8_block":
        from jax_moe.backends import flashinfer_cutlass_fp8_block as fp8b

        fp8b.check_prepared(prepared)
    if scheme in FLOAT_SCHEMES:
        float_scheme(x=x, **{"prepared.w13": w13, "prepared.w2": w2, "prepared.w13_bias": prepared.w13_bias,
                             "prepared.w2_bias": prepared.w2_bias})
    if scheme == "w4a8":
        from jax_moe.backends import flashinfer_cutlass_w4a8 as w4

        w4.check_prepared(prepared)
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != t:
        raise ValueError(f"topk_weights {topk_weights.shape} / topk_ids {topk_ids.shape} must be [T, k]")
    if apply_router_weight_on_input and k != 1:
        raise ValueError(f"apply_router_weight_on_input needs top_k == 1, got top_k={k}")
    pre_quantized = x.dtype == jnp.float8_e4m3fn
    if pre_quantized and (scheme != "fp8" or x_scale is None):
        raise ValueError("x is float8_e4m3fn: only scheme 'fp8' takes a pre-quantized x, with its x_scale")
    if pre_quantized and apply_router_weight_on_input:
        raise ValueError("apply_router_weight_on_input needs a float x (the weight scales x before quantization)")
    if x_scale is not None and scheme != "fp8":
        raise ValueError(f"x_scale is for scheme 'fp8', not {scheme!r}")
    if prepared.w13_bias is not None and prepared.w13_bias.shape != (e, n1):
        raise ValueError(f"prepared.w13_bias must be [E, {n1}], got {prepared.w13_bias.shape}")
    if prepared.w2_bias is not None and prepared.w2_bias.shape != (e, hw):
        raise ValueError(f"prepared.w2_bias must be [E, H] = [{e}, {hw}], got {prepared.w2_bias.shape}")
    if activation == "swigluoai" and (prepared.swiglu is None or prepared.swiglu.shape != (3, e)):
        raise ValueError("prepared.swiglu must be [3, E] float32 for swigluoai (use prepare())")
    align = ALIGN[scheme]
    if hw % align or i % align:
        raise ValueError(f"H={hw} and I={i} must be multiples of {align} for scheme {scheme!r}")
    if scheme == "fp8_block" and (gemm1_tactic != -1 or gemm2_tactic != -1):
        raise ValueError("scheme 'fp8_block' has no tactics (one block-scale GEMM kernel): leave "
                         "gemm1_tactic and gemm2_tactic at -1")
    if scheme == "f16" and scheme not in compiled_schemes():
        raise ValueError(F16_NOT_BUILT)
    _register()
    ids, tw = topk_ids.astype(jnp.int32), topk_weights.astype(jnp.float32)
    if apply_router_weight_on_input:  # Llama4 top-1: the weight scales the input, not the output
        x = (x.astype(jnp.float32) * tw).astype(x.dtype)
        tw = jnp.ones_like(tw)
    empty = jnp.zeros((0,), FLOAT_SCHEMES.get(scheme, jnp.bfloat16))
    extras = (empty if prepared.w13_bias is None else prepared.w13_bias,
              empty if prepared.w2_bias is None else prepared.w2_bias,
              jnp.zeros((0,), jnp.float32) if prepared.swiglu is None else prepared.swiglu)
    if scheme == "fp8_block":
        from jax_moe.backends import flashinfer_cutlass_fp8_block as fp8b

        return fp8b.call(x, prepared, ids, tw, extras, ACTIVATION_CODES[activation])
    ws = workspace_size(int(t), int(hw), int(i), int(e), int(k), activation, scheme)
    call = jax.ffi.ffi_call(
        TARGETS[scheme],
        (jax.ShapeDtypeStruct((t, h), FLOAT_SCHEMES.get(scheme, jnp.bfloat16)), jax.ShapeDtypeStruct((ws,), jnp.uint8)),
    )
    if gemm1_tactic == -1 and gemm2_tactic == -1:  # a tuned pair for this shape, if any
        from jax_moe.backends import flashinfer_tuning

        gemm1_tactic, gemm2_tactic = flashinfer_tuning.choice(prepared, int(t), int(k))
    attrs = dict(activation=np.int64(ACTIVATION_CODES[activation]),
                 gemm1_tactic=np.int64(gemm1_tactic), gemm2_tactic=np.int64(gemm2_tactic))
    if scheme in FLOAT_SCHEMES:
        dt = FLOAT_SCHEMES[scheme]
        out, _ = call(x.astype(dt), w13.astype(dt), w2.astype(dt), ids, tw, *extras, **attrs)
        return out
    if scheme == "w4a8":
        from jax_moe.backends import flashinfer_cutlass_w4a8 as w4

        return w4.call(x, prepared, ids, tw, extras, attrs)
    if scheme == "mxfp4":
        xp = pad_axis(x.astype(jnp.bfloat16), hw, -1)  # the runner writes only the first h columns
        out, _ = call(xp, w13, w2, ids, tw, prepared.w13_block_scale, prepared.w2_block_scale,
                      *extras, **attrs)
        return out
    a13 = input_scale(x, prepared) if x_scale is None else jnp.asarray(x_scale, jnp.float32)
    g1 = prepared.g1_alphas if prepared.a13_scale is not None and x_scale is None else prepared.w13_scale * a13
    xq = x if pre_quantized else quantize_input(x, a13)
    out, _ = call(xq, w13, w2, ids, tw, g1.astype(jnp.float32), prepared.a2_gscale,
                  prepared.g2_alphas, *extras, **attrs)
    return out


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input: bool = False):
    """The oracle's entry point (``fused_experts(..., backend="flashinfer_cutlass")``): w13/w2 in
    vLLM's layout, checked by ``fused_experts``.

    This convenience path repacks w13 on every call (one extra pass over the weights); prepare
    the weights once (:func:`prepare`, or ``MoEBlock.prepare()``) and call :func:`apply_prepared`
    for speed.
    """
    prepared = prepare(w13, w2, cfg, quant, w13_bias=w13_bias, w2_bias=w2_bias)
    out = apply_prepared(x, prepared, topk_weights, topk_ids,
                         apply_router_weight_on_input=apply_router_weight_on_input)
    return out.astype(x.dtype)
