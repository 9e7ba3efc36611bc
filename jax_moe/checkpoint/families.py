"""What ``config.json`` says about one MoE layer of each model family: where its tensors sit,
its shapes, its expert function, its routing and its shared experts (:class:`LayerSpec`).

| model_type                          | MoE module prefix of layer L                  | routing                                   | shared experts |
| ----------------------------------- | --------------------------------------------- | ----------------------------------------- | -------------- |
| mixtral                             | ``model.layers.L.block_sparse_moe.``          | softmax, top-k, renormalized              | none |
| qwen3_moe                           | ``model.layers.L.mlp.``                       | softmax, top-k, ``norm_topk_prob``        | none |
| qwen2_moe                           | ``model.layers.L.mlp.``                       | softmax, top-k, ``norm_topk_prob``        | ``shared_expert`` behind ``sigmoid(shared_expert_gate)`` |
| deepseek_v3, kimi_k2, glm4_moe      | ``model.layers.L.mlp.``                       | sigmoid + score-correction bias, ``n_group``/``topk_group``, ``norm_topk_prob``, ``routed_scaling_factor`` | ``shared_experts`` (``n_shared_experts`` x I) |
| gpt_oss                             | ``model.layers.L.mlp.``                       | top-k of logits (+ bias), softmax over the chosen | none |
| llama4 (``text_config``), llama4_text | ``language_model.model.layers.L.feed_forward.`` / ``model.layers.L.feed_forward.`` | top-1, sigmoid weight applied to the input | ``shared_expert`` |

Dense layers: DeepSeek-style ``first_k_dense_replace`` / ``moe_layer_freq``, Qwen's
``mlp_only_layers`` / ``decoder_sparse_step``, Llama-4's ``moe_layers`` /
``interleave_moe_layer_step``. Asking for one raises ``ValueError``.

Quantized releases (``quantization_config``): ``quant_method: "fp8"`` with
``weight_block_size`` (DeepSeek-V3/R1, Kimi-K2, Qwen3-FP8: FP8 weights + ``weight_scale_inv``
block scales) and ``quant_method: "mxfp4"`` (GPT-OSS). Others raise.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "kimi_k2", "glm4_moe", "gpt_oss",
            "llama4", "llama4_text")
DEEPSEEK_LIKE = ("deepseek_v3", "kimi_k2", "glm4_moe")
QUANT_METHODS = ("fp8", "mxfp4")


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One MoE layer as ``config.json`` describes it (``None``: read from the tensors' shapes)."""

    family: str
    prefix: str = ""
    num_experts: int | None = None
    top_k: int | None = None
    hidden_size: int | None = None
    intermediate_size: int | None = None
    activation: str = "silu"
    routing: dict = dataclasses.field(default_factory=dict)
    apply_router_weight_on_input: bool = False
    shared_intermediate_size: int | None = None  # None: shared experts only if their tensors are there
    shared_gate: bool = False
    fp8_block: tuple[int, int] = (128, 128)
    quant_method: str | None = None
    swiglu_limit: float = 7.0


def _get(cfg: dict, key: str, default: Any = dataclasses.MISSING, *, where: str = "config.json"):
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if default is dataclasses.MISSING:
        raise ValueError(f"{where} has no {key!r}, which this model family needs")
    return default


def _int(cfg, key, default=dataclasses.MISSING):
    v = _get(cfg, key, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"config.json {key!r} must be an integer, got {v!r}")
    return v


def _activation(cfg: dict) -> str:
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"config.json hidden_act={act!r}: this family's experts are read as SiLU-gated; "
                         f"jax_moe has no reader for {act!r} experts")
    return "silu"


def _quant(cfg: dict) -> tuple[str | None, tuple[int, int]]:
    q = cfg.get("quantization_config")
    if not q:
        return None, (128, 128)
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise ValueError(f"config.json quantization_config.quant_method={method!r} is not read by jax_moe "
                         f"(it reads {list(QUANT_METHODS)}: FP8 128x128 block scales and MXFP4)")
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is None:
            raise ValueError("config.json quantization_config: FP8 without weight_block_size (per-tensor FP8 "
                             "checkpoints) is not read by jax_moe; it reads FP8 block-scale checkpoints")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"config.json quantization_config.activation_scheme="
                             f"{q.get('activation_scheme')!r}: FP8 block checkpoints are read with dynamic "
                             f"activation scales only")
        return "fp8", (int(block[0]), int(block[1]))
    return "mxfp4", (128, 128)


def _check_layer(layer: int, num_layers: int | None) -> None:
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"layer must be a non-negative int, got {layer!r}")
    if num_layers is not None and layer >= num_layers:
        raise ValueError(f"layer={layer} is out of range: config.json has num_hidden_layers={num_layers}")


def _dense(layer: int, why: str):
    raise ValueError(f"layer {layer} is a dense MLP layer, not an MoE layer ({why})")


def spec_from_config(config: dict, layer: int) -> LayerSpec:
    """The :class:`LayerSpec` of MoE layer ``layer`` of a model with this ``config.json``."""
    model_type = config.get("model_type")
    if model_type == "llama4":
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise ValueError("config.json of model_type 'llama4' has no 'text_config' object")
        return _llama4(text, layer, "language_model.model.layers.")
    if model_type == "llama4_text":
        return _llama4(config, layer, "model.layers.")
    if model_type not in FAMILIES:
        raise ValueError(f"config.json model_type={model_type!r} is not a family jax_moe reads; "
                         f"it reads {list(FAMILIES)}")
    _check_layer(layer, config.get("num_hidden_layers"))
    method, block = _quant(config)
    h = _int(config, "hidden_size")
    common = dict(family=model_type, hidden_size=h, quant_method=method, fp8_block=block)
    if model_type == "mixtral":
        return LayerSpec(prefix=f"model.layers.{layer}.block_sparse_moe.", num_experts=_int(config, "num_local_experts"),
                         top_k=_int(config, "num_experts_per_tok"), intermediate_size=_int(config, "intermediate_size"),
                         activation=_activation(config), routing=dict(scoring="softmax", renormalize=True), **common)
    if model_type in ("qwen2_moe", "qwen3_moe"):
        if layer in (config.get("mlp_only_layers") or []):
            _dense(layer, "listed in config.json mlp_only_layers")
        step = _int(config, "decoder_sparse_step", 1)
        if step < 1 or (layer + 1) % step:
            _dense(layer, f"config.json decoder_sparse_step={step}: MoE layers are those with (layer + 1) % {step} == 0")
        shared = _int(config, "shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        return LayerSpec(prefix=f"model.layers.{layer}.mlp.", num_experts=_int(config, "num_experts"),
                         top_k=_int(config, "num_experts_per_tok"), intermediate_size=_int(config, "moe_intermediate_size"),
                         activation=_activation(config),
                         routing=dict(scoring="softmax", renormalize=bool(config.get("norm_topk_prob", False))),
                         shared_intermediate_size=shared or 0, shared_gate=bool(shared), **common)
    if model_type in DEEPSEEK_LIKE:
        return _deepseek_like(config, layer, common)
    # gpt_oss
    return LayerSpec(prefix=f"model.layers.{layer}.mlp.", num_experts=_int(config, "num_local_experts"),
                     top_k=_int(config, "num_experts_per_tok", config.get("experts_per_token")),
                     intermediate_size=_int(config, "intermediate_size"), activation="swigluoai",
                     routing=dict(scoring="softmax", renormalize=True), shared_intermediate_size=0,
                     swiglu_limit=float(config.get("swiglu_limit", 7.0)), **common)


def _deepseek_like(config: dict, layer: int, common: dict) -> LayerSpec:
    first_dense = _int(config, "first_k_dense_replace", 0)
    freq = _int(config, "moe_layer_freq", 1)
    if layer < first_dense:
        _dense(layer, f"config.json first_k_dense_replace={first_dense}: layers below it are dense")
    if freq < 1 or layer % freq:
        _dense(layer, f"config.json moe_layer_freq={freq}")
    scoring = config.get("scoring_func", "sigmoid")
    method = config.get("topk_method", "noaux_tc")
    if scoring != "sigmoid" or method != "noaux_tc":
        raise ValueError(f"config.json scoring_func={scoring!r}, topk_method={method!r}: jax_moe reads the "
                         f"DeepSeek-V3 router (sigmoid, noaux_tc); DeepSeek-V2's softmax routers are not read")
    e = _int(config, "n_routed_experts")
    n_group, topk_group = _int(config, "n_group", 1), _int(config, "topk_group", 1)
    routing = dict(scoring="sigmoid", renormalize=bool(config.get("norm_topk_prob", True)),
                   routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))
    if n_group > 1:
        routing.update(num_expert_group=n_group, topk_group=topk_group)
    inter = _int(config, "moe_intermediate_size")
    return LayerSpec(prefix=f"model.layers.{layer}.mlp.", num_experts=e, top_k=_int(config, "num_experts_per_tok"),
                     intermediate_size=inter, activation=_activation(config), routing=routing,
                     shared_intermediate_size=inter * _int(config, "n_shared_experts", 0), **common)


def _llama4(text: dict, layer: int, layers_prefix: str) -> LayerSpec:
    _check_layer(layer, text.get("num_hidden_layers"))
    step = _int(text, "interleave_moe_layer_step", 1)
    n_layers = text.get("num_hidden_layers")
    moe_layers = text.get("moe_layers")
    if moe_layers is None:
        if n_layers is None:
            raise ValueError("config.json text_config needs num_hidden_layers or moe_layers")
        moe_layers = list(range(step - 1, n_layers, step))
    if layer not in moe_layers:
        _dense(layer, f"Llama-4's MoE layers are {moe_layers[:4]}... (interleave_moe_layer_step={step})")
    method, block = _quant(text)
    k = _int(text, "num_experts_per_tok", 1)
    if k != 1:
        raise ValueError(f"config.json num_experts_per_tok={k}: Llama-4's router weight is applied to the "
                         f"input, which jax_moe supports for top-1 only")
    inter = _int(text, "intermediate_size")
    return LayerSpec(family="llama4", prefix=f"{layers_prefix}{layer}.feed_forward.",
                     num_experts=_int(text, "num_local_experts"), top_k=1, hidden_size=_int(text, "hidden_size"),
                     intermediate_size=inter, activation=_activation(text),
                     routing=dict(scoring="sigmoid", renormalize=False), apply_router_weight_on_input=True,
                     shared_intermediate_size=inter, quant_method=method, fp8_block=block)


def default_spec(layout: str, prefix: str) -> LayerSpec:
    """A family's spec without ``config.json`` (shapes from the tensors, shared experts read when
    present, routing from the family's best-known release)."""
    if layout not in FAMILIES:
        raise ValueError(f"layout must be one of {list(FAMILIES)}, got {layout!r}")
    family = "llama4" if layout == "llama4_text" else layout
    routing = {
        "mixtral": dict(scoring="softmax", renormalize=True),
        "qwen3_moe": dict(scoring="softmax", renormalize=True),
        "qwen2_moe": dict(scoring="softmax", renormalize=False),
        "gpt_oss": dict(scoring="softmax", renormalize=True),
        "llama4": dict(scoring="sigmoid", renormalize=False),
    }.get(family, dict(scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4,
                       routed_scaling_factor=2.5))
    return LayerSpec(family=family, prefix=prefix, routing=routing,
                     activation="swigluoai" if family == "gpt_oss" else "silu",
                     apply_router_weight_on_input=family == "llama4", top_k=1 if family == "llama4" else None,
                     shared_gate=family == "qwen2_moe")
