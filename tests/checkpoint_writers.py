"""Synthetic Hugging Face MoE checkpoints and float64 references of their MoE layers (tests only).

Everything here is written from the checkpoint formats' own definitions: transformers'
``modeling_<family>.py`` / ``configuration_<family>.py`` (and ``integrations/mxfp4.py`` for
GPT-OSS's MXFP4 packing, ``integrations/finegrained_fp8.py`` for the FP8 128x128 block form) and
the tensor names of the released checkpoints. Nothing is taken from jax_moe: these are the
independent check of its loader.

A family builder (:func:`mixtral`, :func:`qwen3_moe`, :func:`qwen2_moe`, :func:`deepseek_v3`,
:func:`gpt_oss`, :func:`llama4`) returns a :class:`Checkpoint`: the ``config.json`` dict, every
tensor of a small model in its stored dtype (numpy; bf16 / float8_e4m3fn via ml_dtypes), the MoE
layer under test and its module prefix. Besides that layer the tensors hold a second MoE layer
(``layers.11``, whose prefix ``model.layers.1`` is a string prefix of), dense layers where the
family has them, attention / norm / embedding / lm_head tensors, so that a loader must select by
the exact prefix. :meth:`Checkpoint.write` saves it as one ``model.safetensors`` or as a sharded
``model.safetensors.index.json`` in which the layer's own tensors alternate between two shards.

:func:`reference` computes the family's MoE block in float64 numpy directly on the stored tensors
(dequantizing FP8 / MXFP4 here) and returns, per token, the routing margin: the gap between the
last chosen and the first unchosen score (and between kept and dropped expert groups), so that a
test can leave out the rare tokens whose choice a float32 router may legitimately flip.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

import ml_dtypes
import numpy as np

from helpers import np_sigmoid, np_silu, np_softmax

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
FP8_MAX = 448.0

FP8_QUANT_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
                    "fmt": "e4m3"}
MXFP4_QUANT_CONFIG = {"quant_method": "mxfp4",
                      "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                 "model.embed_tokens", "lm_head"]}

# FP4 E2M1 values indexed by the 4-bit code (integrations/mxfp4.py FP4_VALUES).
FP4_LUT = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])

DECOY_LAYER = 11  # a second MoE layer whose name starts with the string "model.layers.1"


# ----------------------------------------------------------------------------- small helpers


def f64(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


def bf16(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(BF16)


def bf16_exact(rng, shape, scale: float = 1.0) -> np.ndarray:
    """float32 values that bf16 represents exactly (the block may cast x to bf16 losslessly)."""
    return bf16(scale * rng.standard_normal(shape)).astype(np.float32)


def rand_bf16(rng, shape, fan_in: int, scale: float = 1.0) -> np.ndarray:
    return bf16(scale * rng.standard_normal(shape) / np.sqrt(fan_in))


def top(scores: np.ndarray, k: int):
    """ids of the k largest per row (descending) and the gap between the k-th and the (k+1)-th."""
    order = np.argsort(-scores, axis=-1, kind="stable")
    srt = np.take_along_axis(scores, order, -1)
    gap = srt[:, k - 1] - srt[:, k] if scores.shape[-1] > k else np.full(len(scores), np.inf)
    return order[:, :k], gap


# ----------------------------------------------------------------------------- FP8 block, MXFP4


def fp8_block_quantize(rng, w: np.ndarray, block=(128, 128)):
    """A weight [N, K] in the FP8 block form: (q float8_e4m3fn [N, K], scale_inv float32
    [ceil(N/bn), ceil(K/bk)]) with w ~= q * scale_inv[n // bn, k // bk]. Each block first gets its
    own random magnitude (2**U(-2, 2)), so that a scale applied to the wrong block shows."""
    bn, bk = block
    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    w = np.array(w, np.float64)
    q = np.empty((n, k), FP8)
    s = np.empty((rows, cols), np.float32)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] * 2.0 ** rng.uniform(-2, 2)
            s[i, j] = np.float32(np.abs(blk).max() / FP8_MAX)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = (blk / np.float64(s[i, j])).astype(FP8)
    assert np.isfinite(f64(q)).all()
    return q, s


def fp8_block_dequantize(q, scale_inv, block=(128, 128)) -> np.ndarray:
    """w[n, k] = q[n, k] * scale_inv[n // bn, k // bk] (partial last blocks included)."""
    bn, bk = block
    n, k = q.shape
    s = np.repeat(np.repeat(f64(scale_inv), bn, 0), bk, 1)[:n, :k]
    return f64(q) * s


def mxfp4_dequantize(blocks, scales) -> np.ndarray:
    """GPT-OSS MXFP4: blocks uint8 [..., G, 16] and E8M0 scales uint8 [..., G] -> [..., G * 32].

    Byte j of a 16-byte block holds elements 2j (low nibble) and 2j + 1 (high nibble), each an
    E2M1 code looked up in FP4_LUT; the block of 32 is scaled by 2**(scale - 127)."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    assert blocks.dtype == np.uint8 and scales.dtype == np.uint8
    lo, hi = FP4_LUT[blocks & 0x0F], FP4_LUT[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * np.exp2(scales.astype(np.int64) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], blocks.shape[-2] * 32)


def mxfp4_random(rng, lead: tuple, k: int, scale_range=(116, 124)):
    """Random MXFP4 packing of a [*lead, k] weight: random code bytes, scales in scale_range."""
    assert k % 32 == 0
    blocks = rng.integers(0, 256, size=(*lead, k // 32, 16), dtype=np.uint8)
    scales = rng.integers(scale_range[0], scale_range[1] + 1, size=(*lead, k // 32), dtype=np.uint8)
    return blocks, scales


def linear_weight(t: dict, name: str, block=(128, 128)) -> np.ndarray:
    """A ``*.weight`` [out, in] in float64: bf16 as stored, or FP8 times its ``*.weight_scale_inv``."""
    scale = t.get(name + "_scale_inv")
    return f64(t[name]) if scale is None else fp8_block_dequantize(t[name], scale, block)


# ----------------------------------------------------------------------------- checkpoints


@dataclasses.dataclass
class Checkpoint:
    config: dict
    tensors: dict  # name -> numpy array in its stored dtype
    layer: int  # the MoE layer under test
    prefix: str  # that layer's MoE module prefix, e.g. "model.layers.1.mlp."

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config)

    def moe_names(self) -> list[str]:
        return sorted(n for n in self.tensors if n.startswith(self.prefix))

    def write(self, path, *, sharded: bool = False) -> str:
        """Save as ``path/config.json`` + ``model.safetensors``, or, ``sharded``, three shards and
        ``model.safetensors.index.json``: the layer's MoE tensors alternate (sorted by name)
        between shards 1 and 2 (so an FP8 weight and its scale_inv land in different shards), the
        rest go to shard 3."""
        from safetensors.flax import save_file
        import jax.numpy as jnp

        path = str(path)
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.config, f, indent=2)
        if not sharded:
            save_file({k: jnp.asarray(v) for k, v in self.tensors.items()}, os.path.join(path, "model.safetensors"),
                      metadata={"format": "pt"})
            return path
        files = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
        weight_map = {}
        for i, name in enumerate(self.moe_names()):
            weight_map[name] = files[i % 2]
        for name in self.tensors:
            weight_map.setdefault(name, files[2])
        for fname in files:
            part = {k: jnp.asarray(v) for k, v in self.tensors.items() if weight_map[k] == fname}
            save_file(part, os.path.join(path, fname), metadata={"format": "pt"})
        total = int(sum(np.asarray(v).nbytes for v in self.tensors.values()))
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        return path


def _model_extras(rng, t: dict, h: int, num_layers: int, base: str = "model.", lm_head: str = "lm_head.weight",
                  vocab: int = 40) -> None:
    """Embedding, final norm, lm_head and, per layer, attention projections and norms."""
    t[base + "embed_tokens.weight"] = rand_bf16(rng, (vocab, h), 1)
    t[base + "norm.weight"] = bf16(1 + 0.1 * rng.standard_normal(h))
    t[lm_head] = rand_bf16(rng, (vocab, h), h)
    for L in range(num_layers):
        p = f"{base}layers.{L}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"{p}self_attn.{proj}.weight"] = rand_bf16(rng, (h, h), h)
        t[p + "input_layernorm.weight"] = bf16(1 + 0.1 * rng.standard_normal(h))
        t[p + "post_attention_layernorm.weight"] = bf16(1 + 0.1 * rng.standard_normal(h))


def _swiglu_tensors(rng, t: dict, p: str, h: int, i: int, names=("gate_proj", "up_proj", "down_proj"),
                    fp8=False) -> None:
    """One SwiGLU MLP ``p{gate}.weight [i, h]``, ``p{up}.weight [i, h]``, ``p{down}.weight [h, i]``."""
    g, u, d = names
    for name, shape in {g: (i, h), u: (i, h), d: (h, i)}.items():
        w = rng.standard_normal(shape) / np.sqrt(shape[1])
        if fp8:
            q, s = fp8_block_quantize(rng, w)
            t[f"{p}{name}.weight"], t[f"{p}{name}.weight_scale_inv"] = q, s
        else:
            t[f"{p}{name}.weight"] = bf16(w)


def _swiglu(t: dict, p: str, x: np.ndarray, names=("gate_proj", "up_proj", "down_proj")) -> np.ndarray:
    """down(silu(gate x) * (up x)) in float64 for x [T, H]."""
    g, u, d = (linear_weight(t, f"{p}{n}.weight") for n in names)
    return (np_silu(x @ g.T) * (x @ u.T)) @ d.T


def _routed(x, ids, weights, expert: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
    """sum_j weights[:, j] * expert(ids[:, j], x), token by token."""
    out = np.zeros_like(x)
    for n in range(len(x)):
        for e, w in zip(ids[n], weights[n]):
            out[n] += w * expert(int(e), x[n:n + 1])[0]
    return out


# ----------------------------------------------------------------------------- mixtral


def mixtral(rng, *, H=64, I=96, E=8, k=2, layer=1, num_layers=12) -> Checkpoint:
    """Mixtral: ``model.layers.{L}.block_sparse_moe.`` gate.weight [E, H], experts.{e}.w1 (gate) /
    w3 (up) [I, H], w2 [H, I], all bf16; every layer is MoE."""
    config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": H,
              "intermediate_size": I, "num_local_experts": E, "num_experts_per_tok": k, "hidden_act": "silu",
              "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 40, "rms_norm_eps": 1e-5, "router_aux_loss_coef": 0.02, "torch_dtype": "bfloat16"}
    t: dict = {}
    _model_extras(rng, t, H, num_layers)
    for L in (layer, DECOY_LAYER):
        p = f"model.layers.{L}.block_sparse_moe."
        t[p + "gate.weight"] = rand_bf16(rng, (E, H), H, 2.0)
        for e in range(E):
            _swiglu_tensors(rng, t, f"{p}experts.{e}.", H, I, names=("w1", "w3", "w2"))
    return Checkpoint(config, t, layer, f"model.layers.{layer}.block_sparse_moe.")


def mixtral_reference(cfg, t, p, x):
    """softmax over E, top-k, renormalized; expert w2(silu(w1 x) * (w3 x))."""
    k = cfg["num_experts_per_tok"]
    probs = np_softmax(x @ f64(t[p + "gate.weight"]).T)
    ids, margin = top(probs, k)
    w = np.take_along_axis(probs, ids, -1)
    w = w / w.sum(-1, keepdims=True)
    y = _routed(x, ids, w, lambda e, xe: _swiglu(t, f"{p}experts.{e}.", xe, ("w1", "w3", "w2")))
    return y, margin


# ----------------------------------------------------------------------------- qwen3_moe / qwen2_moe


def _qwen_is_moe(cfg, L) -> bool:
    # Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer
    return (L not in cfg.get("mlp_only_layers", [])) and cfg["num_experts"] > 0 and \
        (L + 1) % cfg.get("decoder_sparse_step", 1) == 0


def _qwen_layers(rng, t, cfg, layer, H, I, E, fp8, shared_i=None):
    dense_i = cfg["intermediate_size"]
    for L in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{L}.mlp."
        if not _qwen_is_moe(cfg, L):
            _swiglu_tensors(rng, t, p, H, dense_i, fp8=fp8)
        elif L in (layer, DECOY_LAYER):
            t[p + "gate.weight"] = rand_bf16(rng, (E, H), H, 2.0)
            for e in range(E):
                _swiglu_tensors(rng, t, f"{p}experts.{e}.", H, I, fp8=fp8)
            if shared_i is not None:
                _swiglu_tensors(rng, t, p + "shared_expert.", H, shared_i, fp8=fp8)
                t[p + "shared_expert_gate.weight"] = rand_bf16(rng, (1, H), H)


def qwen3_moe(rng, *, H=64, I=32, E=8, k=2, layer=1, num_layers=12, fp8=False, mlp_only_layers=(0,),
              decoder_sparse_step=1) -> Checkpoint:
    """Qwen3-MoE (bf16, or FP8 128x128 blocks like Qwen3-30B-A3B-FP8): ``model.layers.{L}.mlp.``
    gate.weight [E, H] bf16, experts.{e}.{gate,up}_proj.weight [I, H], down_proj.weight [H, I]
    (FP8: float8_e4m3fn + float32 ``weight_scale_inv``); layers in mlp_only_layers are dense."""
    config = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": H,
              "intermediate_size": 3 * I, "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": k,
              "norm_topk_prob": True, "decoder_sparse_step": decoder_sparse_step,
              "mlp_only_layers": list(mlp_only_layers), "hidden_act": "silu", "num_hidden_layers": num_layers,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": H // 4, "vocab_size": 40,
              "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
    if fp8:
        config["quantization_config"] = dict(FP8_QUANT_CONFIG)
    t: dict = {}
    _model_extras(rng, t, H, num_layers)
    _qwen_layers(rng, t, config, layer, H, I, E, fp8)
    assert _qwen_is_moe(config, layer)
    return Checkpoint(config, t, layer, f"model.layers.{layer}.mlp.")


def qwen2_moe(rng, *, H=64, I=32, shared_I=96, E=8, k=4, layer=1, num_layers=12, norm_topk_prob=False,
              decoder_sparse_step=1, mlp_only_layers=()) -> Checkpoint:
    """Qwen1.5-MoE / Qwen2-57B: qwen3_moe's tensors plus ``mlp.shared_expert.{gate,up,down}_proj``
    [Is, H] / [H, Is] and ``mlp.shared_expert_gate.weight`` [1, H]; norm_topk_prob false."""
    config = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "hidden_size": H,
              "intermediate_size": 3 * I, "moe_intermediate_size": I, "shared_expert_intermediate_size": shared_I,
              "num_experts": E, "num_experts_per_tok": k, "norm_topk_prob": norm_topk_prob,
              "decoder_sparse_step": decoder_sparse_step, "mlp_only_layers": list(mlp_only_layers),
              "hidden_act": "silu", "num_hidden_layers": num_layers, "num_attention_heads": 4,
              "num_key_value_heads": 4, "vocab_size": 40, "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16"}
    t: dict = {}
    _model_extras(rng, t, H, num_layers)
    _qwen_layers(rng, t, config, layer, H, I, E, False, shared_i=shared_I)
    assert _qwen_is_moe(config, layer)
    return Checkpoint(config, t, layer, f"model.layers.{layer}.mlp.")


def qwen_reference(cfg, t, p, x):
    """softmax over E, top-k, renormalized only if norm_topk_prob; qwen2_moe adds
    sigmoid(x @ shared_expert_gate^T) * shared_expert(x)."""
    k = cfg["num_experts_per_tok"]
    probs = np_softmax(x @ f64(t[p + "gate.weight"]).T)
    ids, margin = top(probs, k)
    w = np.take_along_axis(probs, ids, -1)
    if cfg.get("norm_topk_prob", False):
        w = w / w.sum(-1, keepdims=True)
    y = _routed(x, ids, w, lambda e, xe: _swiglu(t, f"{p}experts.{e}.", xe))
    if p + "shared_expert_gate.weight" in t:
        y = y + np_sigmoid(x @ f64(t[p + "shared_expert_gate.weight"]).T) * _swiglu(t, p + "shared_expert.", x)
    return y, margin


# ----------------------------------------------------------------------------- deepseek_v3 family

DEEPSEEK_LIKE = dict(model_type="deepseek_v3", E=64, k=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                     n_shared=2)
KIMI_LIKE = dict(model_type="kimi_k2", E=32, k=8, n_group=1, topk_group=1, routed_scaling_factor=2.827, n_shared=1)
GLM_LIKE = dict(model_type="glm4_moe", E=16, k=4, n_group=1, topk_group=1, routed_scaling_factor=2.5, n_shared=1)


def deepseek_v3(rng, *, model_type="deepseek_v3", H=64, I=32, E=64, k=8, n_group=8, topk_group=4,
                routed_scaling_factor=2.5, n_shared=1, first_k_dense_replace=1, layer=1, num_layers=12,
                fp8=False) -> Checkpoint:
    """DeepSeek-V3 / Kimi-K2 / GLM-4.5 (one tensor layout): ``model.layers.{L}.mlp.`` gate.weight
    [E, H] bf16, gate.e_score_correction_bias [E] float32 (nonnegative here), experts.{e}.*_proj,
    shared_experts.{gate,up}_proj [n_shared * I, H], down_proj [H, n_shared * I] (FP8 + scale_inv
    in the FP8 form). Layers < first_k_dense_replace are dense. The GLM config, like the GLM-4.5
    release, has no scoring_func / topk_method / moe_layer_freq keys."""
    config = {"model_type": model_type, "hidden_size": H, "intermediate_size": 3 * I, "moe_intermediate_size": I,
              "n_routed_experts": E, "num_experts_per_tok": k, "n_shared_experts": n_shared, "n_group": n_group,
              "topk_group": topk_group, "routed_scaling_factor": routed_scaling_factor, "norm_topk_prob": True,
              "first_k_dense_replace": first_k_dense_replace, "hidden_act": "silu",
              "num_hidden_layers": num_layers, "num_attention_heads": 4, "vocab_size": 40, "rms_norm_eps": 1e-6,
              "torch_dtype": "bfloat16"}
    if model_type != "glm4_moe":
        config.update(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1)
    config["architectures"] = [{"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
                                "glm4_moe": "Glm4MoeForCausalLM"}.get(model_type, "ForCausalLM")]
    if fp8:
        config["quantization_config"] = dict(FP8_QUANT_CONFIG)
    t: dict = {}
    _model_extras(rng, t, H, num_layers)
    for L in range(num_layers):
        p = f"model.layers.{L}.mlp."
        if L < first_k_dense_replace:
            _swiglu_tensors(rng, t, p, H, config["intermediate_size"], fp8=fp8)
        elif L in (layer, DECOY_LAYER):
            t[p + "gate.weight"] = rand_bf16(rng, (E, H), H, 2.0)
            t[p + "gate.e_score_correction_bias"] = (0.2 * rng.random(E)).astype(np.float32)
            for e in range(E):
                _swiglu_tensors(rng, t, f"{p}experts.{e}.", H, I, fp8=fp8)
            _swiglu_tensors(rng, t, p + "shared_experts.", H, n_shared * I, fp8=fp8)
    assert layer >= first_k_dense_replace
    return Checkpoint(config, t, layer, f"model.layers.{layer}.mlp.")


def deepseek_reference(cfg, t, p, x):
    """s = sigmoid(x gate^T); choice = s + bias; groups ranked by the sum of their top-2 choice
    scores, the topk_group best kept (others' scores set to 0, as DeepseekV3TopkRouter does);
    top-k of the kept choice scores; weights s at those ids, over their sum if norm_topk_prob,
    times routed_scaling_factor; plus the shared experts."""
    E, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    G, TG = cfg.get("n_group") or 1, cfg.get("topk_group") or 1
    s = np_sigmoid(x @ f64(t[p + "gate.weight"]).T)
    choice = s + f64(t[p + "gate.e_score_correction_bias"])
    margin = np.full(len(x), np.inf)
    if G > 1:
        gs = np.sort(choice.reshape(len(x), G, E // G), -1)[..., -2:].sum(-1)
        groups, margin = top(gs, TG)
        keep = np.zeros((len(x), G), bool)
        np.put_along_axis(keep, groups, True, -1)
        choice = np.where(np.repeat(keep, E // G, -1), choice, 0.0)
    ids, gap = top(choice, k)
    margin = np.minimum(margin, gap)
    w = np.take_along_axis(s, ids, -1)
    if cfg.get("norm_topk_prob", True):
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * cfg.get("routed_scaling_factor", 1.0)
    y = _routed(x, ids, w, lambda e, xe: _swiglu(t, f"{p}experts.{e}.", xe))
    return y + _swiglu(t, p + "shared_experts.", x), margin


# ----------------------------------------------------------------------------- gpt_oss


def gpt_oss(rng, *, H=96, I=64, E=8, k=4, layer=1, num_layers=12, mxfp4=True) -> Checkpoint:
    """GPT-OSS: ``model.layers.{L}.mlp.`` router.weight [E, H] / router.bias [E] bf16;
    MXFP4 form: experts.gate_up_proj_blocks uint8 [E, 2I, H/32, 16], _scales uint8 [E, 2I, H/32],
    down_proj_blocks [E, H, I/32, 16], _scales [E, H, I/32]; bf16 form: experts.gate_up_proj
    [E, H, 2I] (columns alternate gate / up), down_proj [E, I, H]; biases gate_up_proj_bias [E, 2I],
    down_proj_bias [E, H] bf16 in both. Three gate_up biases are shifted by 9 so that the
    swiglu limit clamps: gate row 0 (at 7), up row 3 (at 7), up row 5 (at -7)."""
    config = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H,
              "intermediate_size": I, "num_local_experts": E, "num_experts_per_tok": k, "experts_per_token": k,
              "swiglu_limit": 7.0, "num_hidden_layers": num_layers, "hidden_act": "silu",
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 40,
              "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16"}
    if mxfp4:
        config["quantization_config"] = dict(MXFP4_QUANT_CONFIG)
    t: dict = {}
    _model_extras(rng, t, H, num_layers)
    for L in (layer, DECOY_LAYER):
        p = f"model.layers.{L}.mlp."
        t[p + "router.weight"] = rand_bf16(rng, (E, H), H, 2.0)
        t[p + "router.bias"] = bf16(0.5 * rng.standard_normal(E))
        bias = 0.5 * rng.standard_normal((E, 2 * I))
        bias[:, 0] += 9.0  # gate of channel 0: clamped to 7
        bias[:, 3] += 9.0  # up of channel 1: clamped to 7
        bias[:, 5] -= 9.0  # up of channel 2: clamped to -7
        t[p + "experts.gate_up_proj_bias"] = bf16(bias)
        t[p + "experts.down_proj_bias"] = bf16(0.5 * rng.standard_normal((E, H)))
        if mxfp4:
            blocks, scales = mxfp4_random(rng, (E, 2 * I), H)
            t[p + "experts.gate_up_proj_blocks"], t[p + "experts.gate_up_proj_scales"] = blocks, scales
            t[p + "experts.down_proj_blocks"], t[p + "experts.down_proj_scales"] = mxfp4_random(rng, (E, H), I)
        else:
            t[p + "experts.gate_up_proj"] = rand_bf16(rng, (E, H, 2 * I), H)
            t[p + "experts.down_proj"] = rand_bf16(rng, (E, I, H), I)
    return Checkpoint(config, t, layer, f"model.layers.{layer}.mlp.")


def gpt_oss_weights(t, p):
    """(W_gate_up [E, 2I, H], b [E, 2I], W_down [E, H, I], b [E, H]) in float64, row r of W_gate_up
    being output r of gate_up_proj (even r gate, odd r up)."""
    if p + "experts.gate_up_proj_blocks" in t:
        wgu = mxfp4_dequantize(t[p + "experts.gate_up_proj_blocks"], t[p + "experts.gate_up_proj_scales"])
        wd = mxfp4_dequantize(t[p + "experts.down_proj_blocks"], t[p + "experts.down_proj_scales"])
    else:  # the bf16 layout is x @ W: gate_up_proj [E, H, 2I], down_proj [E, I, H]
        wgu = f64(t[p + "experts.gate_up_proj"]).transpose(0, 2, 1)
        wd = f64(t[p + "experts.down_proj"]).transpose(0, 2, 1)
    return wgu, f64(t[p + "experts.gate_up_proj_bias"]), wd, f64(t[p + "experts.down_proj_bias"])


def gpt_oss_reference(cfg, t, p, x):
    """logits = x router^T + bias; top-k of logits, softmax over the k; expert: gu = W x + b,
    gate = min(gu[even], limit), up = clip(gu[odd], -limit, limit),
    out = Wd ((up + 1) * gate * sigmoid(1.702 gate)) + bd."""
    k = cfg.get("num_experts_per_tok") or cfg["experts_per_token"]
    limit = cfg.get("swiglu_limit", 7.0)
    wgu, bgu, wd, bd = gpt_oss_weights(t, p)
    logits = x @ f64(t[p + "router.weight"]).T + f64(t[p + "router.bias"])
    ids, margin = top(logits, k)
    w = np_softmax(np.take_along_axis(logits, ids, -1))

    def expert(e, xe):
        gu = xe @ wgu[e].T + bgu[e]
        gate, up = np.minimum(gu[:, 0::2], limit), np.clip(gu[:, 1::2], -limit, limit)
        return ((up + 1) * gate * np_sigmoid(1.702 * gate)) @ wd[e].T + bd[e]

    return _routed(x, ids, w, expert), margin


# ----------------------------------------------------------------------------- llama4


def llama4(rng, *, H=64, I=32, I_mlp=96, E=8, k=1, step=2, layer=1, num_layers=12, multimodal=True) -> Checkpoint:
    """Llama 4. Multimodal release: config {"model_type": "llama4", "text_config": {...
    "model_type": "llama4_text"}}, tensors under ``language_model.model.layers.{L}.feed_forward.``;
    text-only: flat llama4_text config, ``model.layers.{L}.feed_forward.``. MoE layer: router.weight
    [E, H], experts.gate_up_proj [E, H, 2I] (gate half, then up half), experts.down_proj [E, I, H],
    shared_expert.{gate,up}_proj.weight [I, H], down_proj.weight [H, I]. MoE layers are
    range(step - 1, num_layers, step) (Llama4TextConfig.moe_layers); the others are dense MLPs of
    intermediate_size_mlp."""
    text = {"model_type": "llama4_text", "hidden_size": H, "intermediate_size": I, "intermediate_size_mlp": I_mlp,
            "num_local_experts": E, "num_experts_per_tok": k, "interleave_moe_layer_step": step,
            "num_hidden_layers": num_layers, "hidden_act": "silu", "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 40, "rms_norm_eps": 1e-5}
    moe_layers = list(range(step - 1, num_layers, step))
    assert layer in moe_layers and DECOY_LAYER in moe_layers
    base = "language_model.model." if multimodal else "model."
    t: dict = {}
    _model_extras(rng, t, H, num_layers, base=base, lm_head="language_model.lm_head.weight" if multimodal
                  else "lm_head.weight")
    if multimodal:
        config = {"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4", "text_config": text,
                  "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 32},
                  "torch_dtype": "bfloat16"}
        t["vision_model.patch_embedding.linear.weight"] = rand_bf16(rng, (32, 48), 48)
        t["multi_modal_projector.linear_1.weight"] = rand_bf16(rng, (H, 32), 32)
    else:
        config = {"architectures": ["Llama4ForCausalLM"], **text, "torch_dtype": "bfloat16"}
    for L in range(num_layers):
        p = f"{base}layers.{L}.feed_forward."
        if L not in moe_layers:
            _swiglu_tensors(rng, t, p, H, I_mlp)
        elif L in (layer, DECOY_LAYER):
            t[p + "router.weight"] = rand_bf16(rng, (E, H), H, 2.0)
            t[p + "experts.gate_up_proj"] = rand_bf16(rng, (E, H, 2 * I), H)
            t[p + "experts.down_proj"] = rand_bf16(rng, (E, I, H), I)
            _swiglu_tensors(rng, t, p + "shared_expert.", H, I)
    return Checkpoint(config, t, layer, f"{base}layers.{layer}.feed_forward.")


def llama4_reference(cfg, t, p, x):
    """top-k (1) of the router logits; score = sigmoid(logit) multiplies the expert's INPUT:
    routed = expert(x * score) with gate, up = (x gate_up_proj) split in halves and
    expert = (up * silu(gate)) down_proj; plus shared_expert(x)."""
    I = cfg["intermediate_size"]
    logits = x @ f64(t[p + "router.weight"]).T
    ids, margin = top(logits, cfg["num_experts_per_tok"])
    scores = np_sigmoid(np.take_along_axis(logits, ids, -1))
    wgu, wd = f64(t[p + "experts.gate_up_proj"]), f64(t[p + "experts.down_proj"])
    out = np.zeros_like(x)
    for n in range(len(x)):
        for e, sc in zip(ids[n], scores[n]):
            gu = (x[n] * sc) @ wgu[e]
            out[n] += (gu[I:] * np_silu(gu[:I])) @ wd[e]
    return out + _swiglu(t, p + "shared_expert.", x), margin


# ----------------------------------------------------------------------------- dispatch

REFERENCES: dict[str, Callable] = {
    "mixtral": mixtral_reference,
    "qwen3_moe": qwen_reference,
    "qwen2_moe": qwen_reference,
    "deepseek_v3": deepseek_reference,
    "kimi_k2": deepseek_reference,
    "glm4_moe": deepseek_reference,
    "gpt_oss": gpt_oss_reference,
    "llama4_text": llama4_reference,
}


def reference(config: dict, tensors: dict, prefix: str, x) -> tuple[np.ndarray, np.ndarray]:
    """The family's MoE block on x [T, H] in float64 -> (y [T, H], routing margin [T])."""
    cfg = config.get("text_config", config) if config["model_type"] == "llama4" else config
    return REFERENCES[cfg["model_type"]](cfg, tensors, prefix, f64(x))


def checkpoint_reference(ck: Checkpoint, x) -> tuple[np.ndarray, np.ndarray]:
    return reference(ck.config, ck.tensors, ck.prefix, x)

