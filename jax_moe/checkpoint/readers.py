"""Reading one MoE layer's tensors into jax_moe's orientation (:class:`LayerTensors`).

Routed experts become w13 [E, 2I, H] (gate rows then up rows, or alternating for GPT-OSS) and
w2 [E, H, I]; the router [E, H]; shared experts a one-expert :class:`ExpertWeights`. Quantized
checkpoints are read as stored, with their :class:`jax_moe.QuantConfig`:

* FP8 block (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8): per expert ``<proj>.weight`` [N, K]
  float8_e4m3fn and ``<proj>.weight_scale_inv`` [ceil(N/bn), ceil(K/bk)] float32, the
  dequantized weight being ``weight * weight_scale_inv`` broadcast over each (bn, bk) block ->
  ``QuantConfig("fp8_block")`` with the scales stacked the same way as the weights.
* MXFP4 (GPT-OSS): ``<proj>_blocks`` [E, N, K/32, 16] uint8 (two E2M1 codes a byte, the low
  nibble first along K) and ``<proj>_scales`` [E, N, K/32] uint8 (E8M0) ->
  ``QuantConfig("mxfp4")`` on [E, N, K/2] codes: the same bytes, the last two axes merged.

Host memory: each stacked array is allocated once and filled tensor by tensor.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jax_moe.checkpoint.families import LayerSpec
from jax_moe.checkpoint.source import TensorSource
from jax_moe.quant.scheme import QuantConfig

FLOATS = ("float32", "bfloat16", "float16", "float64")
FP8 = "float8_e4m3fn"
SCALES = ("float32", "bfloat16")


@dataclasses.dataclass
class ExpertWeights:
    """Stacked expert weights: w13 [E, 2I, H] and w2 [E, H, I], float or stored quantized
    (``quant``, a :class:`jax_moe.QuantConfig`), with optional biases w13_bias [E, 2I], w2_bias [E, H]."""

    w13: Any
    w2: Any
    quant: QuantConfig | None = None
    w13_bias: Any = None
    w2_bias: Any = None

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w2.shape[1])

    @property
    def intermediate_size(self) -> int:
        """I, from w2's last axis (K/2 stored for the packed 4-bit formats)."""
        k = int(self.w2.shape[2])
        return 2 * k if self.quant is not None and self.quant.packed() else k


@dataclasses.dataclass
class LayerTensors:
    """One MoE layer in jax_moe's orientation, with its routing (``select_experts`` options)."""

    experts: ExpertWeights
    router: Any  # [E, H]
    router_bias: Any = None  # [E]
    e_score_correction_bias: Any = None  # [E]
    shared: ExpertWeights | None = None  # E = 1: w13 [1, 2Is, H], w2 [1, H, Is]
    shared_gate: Any = None  # [1, H]: Qwen2-MoE's sigmoid gate on the shared expert
    activation: str = "silu"
    gate_up_layout: str = "concat"
    routing: dict = dataclasses.field(default_factory=dict)
    top_k: int | None = None
    apply_router_weight_on_input: bool = False
    swiglu_limit: float = 7.0


def read_layer_tensors(src: TensorSource, spec: LayerSpec) -> LayerTensors:
    """Read the MoE layer ``spec`` describes from ``src`` and check that nothing under its prefix
    was left unread. Raises ValueError naming any missing, misshaped or unconsumed tensor."""
    p = spec.prefix
    if spec.family == "gpt_oss":
        experts = _gpt_oss_experts(src, p, spec)
        router, router_bias = _router(src, p + "router.", experts.num_experts, experts.hidden_size, bias=True)
        gate_up_layout = "interleaved"
    elif spec.family == "llama4":
        experts = _llama4_experts(src, p, spec)
        router, router_bias = _router(src, p + "router.", experts.num_experts, experts.hidden_size)
        gate_up_layout = "concat"
    else:
        names = ("w1", "w3", "w2") if spec.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        experts = _per_expert(src, p + "experts.", names, spec)
        router, router_bias = _router(src, p + "gate.", experts.num_experts, experts.hidden_size)
        gate_up_layout = "concat"
    e, h = experts.num_experts, experts.hidden_size
    bias = None
    if spec.family in ("deepseek_v3", "kimi_k2", "glm4_moe"):
        bias = src.take(p + "gate.e_score_correction_bias", (e,), FLOATS)
    shared, shared_gate = _shared(src, p, spec, h)
    routing = dict(spec.routing)
    src.check_consumed(p)
    return LayerTensors(experts, router, router_bias, bias, shared, shared_gate, spec.activation, gate_up_layout,
                        routing, spec.top_k, spec.apply_router_weight_on_input, spec.swiglu_limit)


# ----------------------------------------------------------------------------- pieces


def _router(src, p, e, h, bias=False):
    w = src.take(p + "weight", (e, h), FLOATS)
    b = src.take(p + "bias", (e,), FLOATS) if bias else None
    return w, b


def _count_experts(src: TensorSource, p: str, first: str) -> int:
    """Experts numbered 0..E-1 under ``p`` (``p{e}.{first}`` present); a gap names the missing tensor."""
    ids = set()
    for n in src.names_under(p):
        head = n[len(p):].split(".", 1)[0]
        if head.isdigit():
            ids.add(int(head))
    if not ids:
        raise ValueError(f"no experts found under {p!r} (expected {p}0.{first})")
    for e in range(max(ids) + 1):
        if f"{p}{e}.{first}" not in src:
            raise ValueError(f"checkpoint tensor {p}{e}.{first!r} is missing (experts 0..{max(ids)} are present)")
    return max(ids) + 1


def _per_expert(src: TensorSource, p: str, names: tuple[str, str, str], spec: LayerSpec) -> ExpertWeights:
    """Routed experts stored one tensor per expert and projection (Mixtral, Qwen, DeepSeek)."""
    gate, up, down = (f"{n}.weight" for n in names)
    e = spec.num_experts if spec.num_experts is not None else _count_experts(src, p, gate)
    shape, dt = src.meta(f"{p}0.{gate}")
    inter = spec.intermediate_size if spec.intermediate_size is not None else shape[0]
    h = spec.hidden_size if spec.hidden_size is not None else shape[-1]
    return _stack_mlps(src, [f"{p}{i}." for i in range(e)], (gate, up, down), inter, h, spec, dt)


def _stack_mlps(src, prefixes, names, inter, h, spec, dtype) -> ExpertWeights:
    """Gated MLPs under each prefix -> ExpertWeights with len(prefixes) experts (float or FP8 block).

    FP8 block weights whose I is not a multiple of the block's rows are zero-padded to the next
    multiple (gate, up rows and down columns of zeros add nothing to the output), so that the
    gate and up scale blocks stack; the block scales keep their stored shapes."""
    gate, up, down = names
    e = len(prefixes)
    if dtype not in FLOATS + (FP8,):
        raise ValueError(f"checkpoint tensor {prefixes[0] + gate!r} has dtype {dtype}; expert weights are read "
                         f"as {list(FLOATS)} or {FP8} with block scales")
    bn, bk = spec.fp8_block
    ip = -(-inter // bn) * bn if dtype == FP8 else inter
    if dtype == FP8 and -(-ip // bk) != -(-inter // bk):
        raise ValueError(f"{prefixes[0]}: intermediate size {inter} is not a multiple of the FP8 weight block "
                         f"{spec.fp8_block}, and padding it would change the scale grid; load with quant=None")
    alloc = np.zeros if ip != inter else np.empty
    w13 = alloc((e, 2 * ip, h), _np_dtype(dtype))
    w2 = alloc((e, h, ip), _np_dtype(dtype))
    for i, p in enumerate(prefixes):
        w13[i, :inter] = src.take(p + gate, (inter, h), [dtype])
        w13[i, ip:ip + inter] = src.take(p + up, (inter, h), [dtype])
        w2[i, :, :inter] = src.take(p + down, (h, inter), [dtype])
    if dtype != FP8:
        return ExpertWeights(w13, w2)
    half, kb = ip // bn, -(-h // bk)
    s13 = np.empty((e, 2 * half, kb), np.float32)
    s2 = np.empty((e, -(-h // bn), -(-inter // bk)), np.float32)
    for i, p in enumerate(prefixes):
        s13[i, :half] = src.take(p + gate + "_scale_inv", (half, kb), SCALES)
        s13[i, half:] = src.take(p + up + "_scale_inv", (half, kb), SCALES)
        s2[i] = src.take(p + down + "_scale_inv", s2.shape[1:], SCALES)
    return ExpertWeights(w13, w2, QuantConfig("fp8_block", s13, s2, block_shape=(bn, bk)))


def _shared(src: TensorSource, p: str, spec: LayerSpec, h: int):
    """Shared experts (None when the family has none), and Qwen2-MoE's gate [1, H]."""
    sp = p + ("shared_experts." if spec.family in ("deepseek_v3", "kimi_k2", "glm4_moe") else "shared_expert.")
    names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    if spec.shared_intermediate_size == 0 or (spec.shared_intermediate_size is None and sp + names[0] not in src):
        return None, None
    shape, dt = src.meta(sp + names[0])
    inter = spec.shared_intermediate_size or shape[0]
    shared = _stack_mlps(src, [sp], names, inter, h, spec, dt)
    gate = None
    if spec.shared_gate or (spec.shared_intermediate_size is None and p + "shared_expert_gate.weight" in src):
        gate = src.take(p + "shared_expert_gate.weight", (1, h), FLOATS)
    return shared, gate


def _gpt_oss_experts(src: TensorSource, p: str, spec: LayerSpec) -> ExpertWeights:
    e, h, inter = spec.num_experts, spec.hidden_size, spec.intermediate_size
    x = p + "experts."
    if x + "gate_up_proj_blocks" in src:
        if e is None or h is None or inter is None:
            e, rows = src.meta(x + "gate_up_proj_blocks")[0][:2]
            h, inter = src.meta(x + "down_proj_blocks")[0][1], rows // 2
        b13 = src.take(x + "gate_up_proj_blocks", (e, 2 * inter, h // 32, 16), ["uint8"])
        s13 = src.take(x + "gate_up_proj_scales", (e, 2 * inter, h // 32), ["uint8"])
        b2 = src.take(x + "down_proj_blocks", (e, h, inter // 32, 16), ["uint8"])
        s2 = src.take(x + "down_proj_scales", (e, h, inter // 32), ["uint8"])
        w13, w2 = b13.reshape(e, 2 * inter, h // 2), b2.reshape(e, h, inter // 2)
        quant = QuantConfig("mxfp4", np.asarray(s13), np.asarray(s2))
    else:
        if e is None or h is None or inter is None:
            e, h, rows = src.meta(x + "gate_up_proj")[0]
            inter = rows // 2
        w13 = np.ascontiguousarray(np.swapaxes(src.take(x + "gate_up_proj", (e, h, 2 * inter), FLOATS), 1, 2))
        w2 = np.ascontiguousarray(np.swapaxes(src.take(x + "down_proj", (e, inter, h), FLOATS), 1, 2))
        quant = None
    return ExpertWeights(w13, w2, quant, src.take(x + "gate_up_proj_bias", (e, 2 * inter), FLOATS),
                         src.take(x + "down_proj_bias", (e, h), FLOATS))


def _llama4_experts(src: TensorSource, p: str, spec: LayerSpec) -> ExpertWeights:
    e, h, inter = spec.num_experts, spec.hidden_size, spec.intermediate_size
    x = p + "experts."
    if e is None or h is None or inter is None:
        e, h, rows = src.meta(x + "gate_up_proj")[0]
        inter = rows // 2
    gate_up = src.take(x + "gate_up_proj", (e, h, 2 * inter), FLOATS)  # gate half, then up half
    down = src.take(x + "down_proj", (e, inter, h), FLOATS)
    return ExpertWeights(np.ascontiguousarray(np.swapaxes(gate_up, 1, 2)),
                         np.ascontiguousarray(np.swapaxes(down, 1, 2)))


def _np_dtype(name: str):
    import ml_dtypes

    return {"bfloat16": ml_dtypes.bfloat16, FP8: ml_dtypes.float8_e4m3fn}.get(name, np.dtype(name))
