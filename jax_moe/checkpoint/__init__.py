"""Reading one MoE layer from a checkpoint: a Hugging Face model directory (``config.json`` and
safetensors shards, :func:`load_pretrained`) or an in-memory mapping of tensors
(:func:`read_layer`). Both give :class:`LayerTensors` in jax_moe's orientation, every tensor
under the layer's prefix consumed or an error naming it.

Families (``config.json`` ``model_type``): see :mod:`jax_moe.checkpoint.families`; stored forms
(float, FP8 128x128 block, MXFP4): see :mod:`jax_moe.checkpoint.readers`.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Mapping

import jax.numpy as jnp

from jax_moe.checkpoint.convert import QUANT_MODES, check_quant_mode, convert_layer
from jax_moe.checkpoint.families import FAMILIES, LayerSpec, default_spec, spec_from_config
from jax_moe.checkpoint.readers import ExpertWeights, LayerTensors, read_layer_tensors
from jax_moe.checkpoint.source import MappingSource, SafetensorsDir, read_config

LAYOUTS = FAMILIES

__all__ = ["LAYOUTS", "FAMILIES", "QUANT_MODES", "LayerSpec", "LayerTensors", "ExpertWeights",
           "load_pretrained", "read_layer", "read_config", "spec_from_config"]


def load_pretrained(model_dir: str | os.PathLike, layer: int, *, quant="native",
                    dtype=jnp.bfloat16) -> tuple[LayerSpec, LayerTensors]:
    """Layer ``layer``'s MoE tensors of the checkpoint in ``model_dir`` (only those are read).

    ``quant``: ``"native"`` keeps FP8 block / MXFP4 weights as stored, ``None`` dequantizes to
    ``dtype``, a scheme name quantizes to it. Returns (the layer's spec, its tensors)."""
    check_quant_mode(quant)
    spec = spec_from_config(read_config(model_dir), layer)
    with SafetensorsDir(model_dir) as src:
        tensors = read_layer_tensors(src, spec)
    return spec, convert_layer(tensors, quant, dtype)


def read_layer(layout: str, tensors: Mapping[str, Any], prefix: str = "", *, config: dict | None = None,
               layer: int | None = None, quant="native", dtype=jnp.bfloat16) -> LayerTensors:
    """One MoE layer from a mapping ``name -> array``.

    ``layout`` is a family (:data:`FAMILIES`); ``prefix`` the MoE module's prefix (e.g.
    ``"model.layers.3.mlp."``). With ``config`` (the model's ``config.json`` as a dict) shapes,
    routing and shared experts come from it, for layer ``layer`` (default: read from ``prefix``'s
    ``layers.N.``); without it, shapes come from the tensors, shared experts are read when
    present, and routing takes the family's defaults."""
    check_quant_mode(quant)
    if config is None:
        spec = default_spec(layout, prefix)
        t = read_layer_tensors(MappingSource(tensors), spec)
        groups, e = t.routing.get("num_expert_group"), t.experts.num_experts
        if groups and (e % groups or e // groups < 2):  # the default grouping is DeepSeek-V3's (256 experts)
            t.routing = {k: v for k, v in t.routing.items() if k not in ("num_expert_group", "topk_group")}
        return convert_layer(t, quant, dtype)
    else:
        if config.get("model_type") not in (layout, None) and not (layout.startswith("llama4")
                                                                   and config.get("model_type", "").startswith("llama4")):
            raise ValueError(f"layout {layout!r} does not match config.json model_type {config.get('model_type')!r}")
        if layer is None:
            m = re.search(r"layers\.(\d+)\.", prefix)
            if m is None:
                raise ValueError(f"layer is needed with config= when prefix {prefix!r} names no 'layers.N.'")
            layer = int(m.group(1))
        spec = dataclasses.replace(spec_from_config(config, layer), prefix=prefix)
    return convert_layer(read_layer_tensors(MappingSource(tensors), spec), quant, dtype)
