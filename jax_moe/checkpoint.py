"""Reading one MoE layer's tensors from the common checkpoint layouts (Hugging Face naming).

Each reader takes a mapping ``name -> array`` (numpy or jax, as safetensors gives them) and
the layer's prefix (e.g. ``"model.layers.3.mlp."``) and returns :class:`ExpertTensors` in
jax_moe's orientation: w13 [E, 2I, H] (gate rows then up rows, or alternating for GPT-OSS),
w2 [E, H, I], router [E, H]. Routing defaults of each family come with it.

| layout      | router                        | experts                                                   |
| ----------- | ----------------------------- | --------------------------------------------------------- |
| mixtral     | ``gate.weight`` [E, H]        | ``experts.{e}.w1`` (gate) / ``w3`` (up) [I, H], ``w2`` [H, I] |
| qwen3_moe   | ``gate.weight`` [E, H]        | ``experts.{e}.gate_proj`` / ``up_proj`` [I, H], ``down_proj`` [H, I] |
| deepseek_v3 | ``gate.weight`` [E, H], ``gate.e_score_correction_bias`` [E] | as qwen3_moe |
| gpt_oss     | ``router.weight`` [E, H], ``router.bias`` [E] | ``experts.gate_up_proj`` [E, H, 2I] (gate/up alternate along 2I), ``gate_up_proj_bias`` [E, 2I], ``down_proj`` [E, I, H], ``down_proj_bias`` [E, H] |

Mixtral's prefix is the ``block_sparse_moe.`` module; the others' is ``mlp.``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax.numpy as jnp

LAYOUTS = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")


@dataclasses.dataclass
class ExpertTensors:
    """One layer's weights in jax_moe orientation plus the routing options of its family."""

    w13: Any  # [E, 2I, H]
    w2: Any  # [E, H, I]
    router: Any  # [E, H]
    router_bias: Any = None  # [E]
    w13_bias: Any = None  # [E, 2I]
    w2_bias: Any = None  # [E, H]
    e_score_correction_bias: Any = None  # [E]
    activation: str = "silu"
    gate_up_layout: str = "concat"
    routing: dict = dataclasses.field(default_factory=dict)


def _get(tensors: Mapping[str, Any], name: str):
    if name not in tensors:
        raise ValueError(f"checkpoint tensor {name!r} is missing")
    return tensors[name]


def _num_experts(tensors: Mapping[str, Any], prefix: str, first: str) -> int:
    e = 0
    while f"{prefix}experts.{e}.{first}" in tensors:
        e += 1
    if e == 0:
        raise ValueError(f"no experts found under {prefix!r}experts.0.{first}")
    return e


def _stack(tensors, prefix, e_count, name):
    return jnp.stack([jnp.asarray(_get(tensors, f"{prefix}experts.{e}.{name}")) for e in range(e_count)])


def _per_expert(tensors, prefix, gate, up, down) -> tuple:
    e_count = _num_experts(tensors, prefix, gate)
    w_gate = _stack(tensors, prefix, e_count, gate)
    w_up = _stack(tensors, prefix, e_count, up)
    return jnp.concatenate([w_gate, w_up], axis=1), _stack(tensors, prefix, e_count, down)


def read_layer(layout: str, tensors: Mapping[str, Any], prefix: str = "") -> ExpertTensors:
    """Read one MoE layer in ``layout`` (one of :data:`LAYOUTS`) from ``tensors``."""
    if layout == "mixtral":
        w13, w2 = _per_expert(tensors, prefix, "w1.weight", "w3.weight", "w2.weight")
        return ExpertTensors(w13, w2, jnp.asarray(_get(tensors, prefix + "gate.weight")),
                             routing=dict(scoring="softmax", renormalize=True))
    if layout == "qwen3_moe":
        w13, w2 = _per_expert(tensors, prefix, "gate_proj.weight", "up_proj.weight", "down_proj.weight")
        return ExpertTensors(w13, w2, jnp.asarray(_get(tensors, prefix + "gate.weight")),
                             routing=dict(scoring="softmax", renormalize=True))
    if layout == "deepseek_v3":
        w13, w2 = _per_expert(tensors, prefix, "gate_proj.weight", "up_proj.weight", "down_proj.weight")
        e_count = w13.shape[0]
        groups = 8 if e_count % 8 == 0 else 1
        return ExpertTensors(
            w13, w2, jnp.asarray(_get(tensors, prefix + "gate.weight")),
            e_score_correction_bias=jnp.asarray(_get(tensors, prefix + "gate.e_score_correction_bias")),
            routing=dict(scoring="sigmoid", renormalize=True, num_expert_group=groups,
                         topk_group=max(1, groups // 2), routed_scaling_factor=2.5),
        )
    if layout == "gpt_oss":
        gate_up = jnp.asarray(_get(tensors, prefix + "experts.gate_up_proj"))  # [E, H, 2I]
        down = jnp.asarray(_get(tensors, prefix + "experts.down_proj"))  # [E, I, H]
        return ExpertTensors(
            jnp.swapaxes(gate_up, 1, 2), jnp.swapaxes(down, 1, 2),
            jnp.asarray(_get(tensors, prefix + "router.weight")),
            router_bias=jnp.asarray(_get(tensors, prefix + "router.bias")),
            w13_bias=jnp.asarray(_get(tensors, prefix + "experts.gate_up_proj_bias")),
            w2_bias=jnp.asarray(_get(tensors, prefix + "experts.down_proj_bias")),
            activation="swigluoai", gate_up_layout="interleaved",
            routing=dict(scoring="softmax", renormalize=True),
        )
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")

