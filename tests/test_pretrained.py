"""Specification of ``MoEBlock.from_pretrained`` (and ``MoEBlock.from_checkpoint``) on Hugging
Face MoE checkpoints.

What is specified, per family (Mixtral, Qwen3-MoE bf16 and FP8 block, Qwen2-MoE, DeepSeek-V3 /
Kimi-K2 / GLM-4.5 bf16 and FP8 block, GPT-OSS MXFP4 and bf16, Llama 4 multimodal and text-only):

* ``from_pretrained(model_dir, layer)`` reads ``config.json`` and the safetensors (one
  ``model.safetensors``, or shards through ``model.safetensors.index.json`` with the layer's
  tensors split over two shards), takes exactly that layer's MoE tensors among the model's others
  (attention, norms, embeddings, other layers, among them ``layers.11`` whose name starts with
  ``layers.1``), and the block's output on random x matches a float64 numpy reference of the
  family's MoE block computed on the stored tensors (tests/checkpoint_writers.py, written from
  transformers' modeling code). Output shape and dtype are x's.
* ``quant="native"`` keeps FP8 block checkpoints quantized (``scheme == "fp8_block"``) and
  GPT-OSS MXFP4 quantized (``"mxfp4"``); ``quant=None`` dequantizes them (``block.quant is None``);
  bf16 checkpoints give ``block.quant is None`` either way.
* ``ValueError`` at load time, naming what is wrong: a missing tensor, an extra tensor under the
  layer's MoE prefix, a tensor of the wrong shape or dtype (FP8 scales and MXFP4 scales included),
  a dense layer ("dense"), an unknown model_type.
* ``from_checkpoint(layout, tensors, prefix, config=...)`` reads an in-memory mapping the same way.
* On a GPU (``@pytest.mark.gpu``): the default backend (and, for FP8 block / MXFP4, the block
  after ``prepare()``) matches the same checkpoint loaded with ``backend="xla"``.

Tolerances (relative L2 over tokens): 1e-3 with ``dtype=jnp.float32`` (the reference uses the
same stored bf16 / dequantized values), 2e-2 for bf16 compute and MXFP4, 6e-2 for FP8 block with
``quant="native"`` (activations quantized per 128-group to FP8). x holds bf16-exact values; the
few tokens whose expert choice is within 1e-4 of a tie (in the router's score units) are left out
of the comparison, since a float32 router may legitimately pick either.
"""

from __future__ import annotations

import re
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint_writers as cw
from helpers import rel_err

T = 24
ROUTING_MARGIN = 1e-4
TOL_F32, TOL_BF16, TOL_MXFP4, TOL_FP8 = 1e-3, 2e-2, 2e-2, 6e-2


def _moe_block():
    from jax_moe import MoEBlock

    return MoEBlock


def load(path, layer, **kw):
    return _moe_block().from_pretrained(str(path), layer, **kw)


def write_and_load(tmp_path, ck: cw.Checkpoint, *, sharded=False, **kw):
    return load(ck.write(tmp_path / "ckpt", sharded=sharded), ck.layer, **kw)


def assert_matches_reference(block, ck: cw.Checkpoint, x: np.ndarray, tol: float) -> float:
    """block(x) has x's shape and dtype, is finite, and matches the float64 reference within
    relative L2 ``tol`` over the tokens whose routing is not within ROUTING_MARGIN of a tie."""
    y = block(jnp.asarray(x))
    assert y.shape == x.shape and y.dtype == x.dtype, (y.shape, y.dtype, x.shape, x.dtype)
    h = x.shape[-1]
    y = np.asarray(y).astype(np.float64).reshape(-1, h)
    assert np.isfinite(y).all(), "non-finite output"
    ref, margin = cw.checkpoint_reference(ck, np.asarray(x).astype(np.float64).reshape(-1, h))
    keep = margin > ROUTING_MARGIN
    assert keep.mean() >= 0.75, "test data: too many near-tied routing choices"
    err = rel_err(y[keep], ref[keep])
    assert err < tol, f"relative L2 error {err:.3g} >= {tol}"
    return err


def scheme(block):
    return None if block.quant is None else block.quant.get_value().scheme


def x_for(rng, ck: cw.Checkpoint, lead=(T,)):
    return cw.bf16_exact(rng, (*lead, ck.text_config["hidden_size"]))


# ----------------------------------------------------------------------------- Mixtral


def test_mixtral_block_matches_reference_on_leading_dims(rng, tmp_path):
    ck = cw.mixtral(rng)
    block = write_and_load(tmp_path, ck, dtype=jnp.float32)
    assert block.quant is None  # bf16 checkpoint, quant="native"
    assert_matches_reference(block, ck, x_for(rng, ck, lead=(2, 12)), TOL_F32)


def test_default_bf16_compute_returns_x_dtype_and_bf16_checkpoint_ignores_quant_none(rng, tmp_path):
    ck = cw.mixtral(rng)
    block = write_and_load(tmp_path, ck, quant=None)
    assert block.quant is None
    assert_matches_reference(block, ck, x_for(rng, ck).astype(cw.BF16), TOL_BF16)


# ----------------------------------------------------------------------------- Qwen3-MoE


def test_qwen3_moe_from_sharded_index_with_the_layer_split_over_two_shards(rng, tmp_path):
    ck = cw.qwen3_moe(rng)
    block = write_and_load(tmp_path, ck, sharded=True, dtype=jnp.float32)
    assert block.quant is None
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


def test_qwen3_moe_fp8_block_checkpoint_stays_fp8_block(rng, tmp_path):
    ck = cw.qwen3_moe(rng, H=256, I=128, fp8=True)
    block = write_and_load(tmp_path, ck)
    assert scheme(block) == "fp8_block"
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_FP8)


def test_qwen3_moe_fp8_block_checkpoint_dequantized_with_quant_none(rng, tmp_path):
    ck = cw.qwen3_moe(rng, H=256, I=128, fp8=True)
    block = write_and_load(tmp_path, ck, quant=None, dtype=jnp.float32)
    assert block.quant is None
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


def test_fp8_block_scales_cover_partial_blocks(rng, tmp_path):
    # H = 192 and I = 96: scale_inv is [ceil(N/128), ceil(K/128)], the last block partial.
    ck = cw.qwen3_moe(rng, H=192, I=96, fp8=True)
    assert ck.tensors[ck.prefix + "experts.0.down_proj.weight_scale_inv"].shape == (2, 1)
    block = write_and_load(tmp_path, ck, quant=None, dtype=jnp.float32)
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


# ----------------------------------------------------------------------------- Qwen2-MoE


def test_qwen2_moe_gated_shared_expert_and_unrenormalized_weights(rng, tmp_path):
    ck = cw.qwen2_moe(rng)
    assert ck.config["norm_topk_prob"] is False
    block = write_and_load(tmp_path, ck, dtype=jnp.float32)
    assert block.quant is None
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


# ----------------------------------------------------------------------------- DeepSeek-V3 family


@pytest.mark.parametrize("preset", ["DEEPSEEK_LIKE", "KIMI_LIKE", "GLM_LIKE"])
def test_deepseek_v3_family_grouped_sigmoid_routing_and_shared_experts(rng, tmp_path, preset):
    ck = cw.deepseek_v3(rng, **getattr(cw, preset))
    block = write_and_load(tmp_path, ck, dtype=jnp.float32)
    assert block.quant is None
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


def test_deepseek_v3_fp8_block_from_shards_stays_fp8_block(rng, tmp_path):
    # Sharded: each FP8 weight and its weight_scale_inv land in different shards.
    ck = cw.deepseek_v3(rng, H=256, I=128, fp8=True, **cw.DEEPSEEK_LIKE)
    block = write_and_load(tmp_path, ck, sharded=True)
    assert scheme(block) == "fp8_block"
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_FP8)


def test_kimi_k2_fp8_block_dequantized_with_quant_none(rng, tmp_path):
    ck = cw.deepseek_v3(rng, H=256, I=128, fp8=True, **cw.KIMI_LIKE)
    block = write_and_load(tmp_path, ck, quant=None, dtype=jnp.float32)
    assert block.quant is None
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


# ----------------------------------------------------------------------------- GPT-OSS


def test_gpt_oss_mxfp4_checkpoint_stays_mxfp4(rng, tmp_path):
    ck = cw.gpt_oss(rng)
    block = write_and_load(tmp_path, ck)
    assert scheme(block) == "mxfp4"
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_MXFP4)


def test_gpt_oss_mxfp4_checkpoint_dequantized_with_quant_none(rng, tmp_path):
    ck = cw.gpt_oss(rng)
    block = write_and_load(tmp_path, ck, quant=None, dtype=jnp.float32)
    assert block.quant is None
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


def test_gpt_oss_bf16_layout_interleaved_gate_up_and_biases(rng, tmp_path):
    ck = cw.gpt_oss(rng, mxfp4=False)
    block = write_and_load(tmp_path, ck, dtype=jnp.float32)
    assert block.quant is None
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


def test_gpt_oss_top_k_from_experts_per_token_alone(rng, tmp_path):
    ck = cw.gpt_oss(rng, H=64, I=32, E=4, k=2, mxfp4=False)
    del ck.config["num_experts_per_tok"]
    assert ck.config["experts_per_token"] == 2
    block = write_and_load(tmp_path, ck, dtype=jnp.float32)
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


# ----------------------------------------------------------------------------- Llama 4


def test_llama4_multimodal_release_interleaved_moe_layer(rng, tmp_path):
    ck = cw.llama4(rng, step=2, layer=1, multimodal=True)
    assert ck.prefix == "language_model.model.layers.1.feed_forward."
    block = write_and_load(tmp_path, ck, dtype=jnp.float32)
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


def test_llama4_text_only_checkpoint(rng, tmp_path):
    ck = cw.llama4(rng, step=1, layer=0, multimodal=False)
    block = write_and_load(tmp_path, ck, dtype=jnp.float32)
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


# ----------------------------------------------------------------------------- from_checkpoint


def test_from_checkpoint_reads_an_in_memory_mapping(rng):
    ck = cw.deepseek_v3(rng, **cw.GLM_LIKE)
    tensors = {k: v for k, v in ck.tensors.items() if k.startswith(ck.prefix)}
    block = _moe_block().from_checkpoint("glm4_moe", tensors, ck.prefix, config=ck.config, dtype=jnp.float32)
    assert_matches_reference(block, ck, x_for(rng, ck), TOL_F32)


# ----------------------------------------------------------------------------- errors


def _raises_naming(tmp_path, ck: cw.Checkpoint, text: str, layer=None):
    path = ck.write(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=re.escape(text)):
        load(path, ck.layer if layer is None else layer)


def _transposed(a, shape=None):
    """a.T (contiguous), after checking that a has ``shape`` where given."""
    assert shape is None or a.shape == shape, a.shape
    return np.ascontiguousarray(a.T)


BAD_TENSORS = [  # (what, checkpoint builder, the tensor (after the layer prefix), change: None deletes it)
    ("missing expert tensor", lambda r: cw.qwen3_moe(r), "experts.3.down_proj.weight", None),
    ("extra tensor under the MoE prefix", lambda r: cw.qwen3_moe(r), "experts.0.extra.weight",
     lambda a, r: cw.rand_bf16(r, (8, 64), 64)),
    ("misshaped tensor ([H, I] for [I, H])", lambda r: cw.qwen3_moe(r), "experts.2.up_proj.weight",
     lambda a, r: _transposed(a)),
    ("integer tensor", lambda r: cw.mixtral(r), "experts.1.w1.weight",
     lambda a, r: r.integers(-8, 8, a.shape).astype(np.int32)),
    ("misshaped FP8 block scale ([1, 2] for [2, 1])", lambda r: cw.qwen3_moe(r, H=256, I=128, fp8=True),
     "experts.0.down_proj.weight_scale_inv", lambda a, r: _transposed(a, (2, 1))),
    ("missing MXFP4 scales", lambda r: cw.gpt_oss(r), "experts.gate_up_proj_scales", None),
    ("int8 MXFP4 blocks", lambda r: cw.gpt_oss(r), "experts.down_proj_blocks", lambda a, r: a.astype(np.int8)),
]


@pytest.mark.parametrize("what,make,tensor,change", BAD_TENSORS, ids=[b[0] for b in BAD_TENSORS])
def test_a_bad_tensor_is_named(rng, tmp_path, what, make, tensor, change):
    """A missing, extra, misshaped or wrongly typed tensor of the layer: the ValueError names it."""
    ck = make(rng)
    name = ck.prefix + tensor
    if change is None:
        del ck.tensors[name]
    else:
        ck.tensors[name] = change(ck.tensors.get(name), rng)
    _raises_naming(tmp_path, ck, name)


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe_mlp_only", "qwen2_moe_sparse_step", "llama4"])
def test_dense_layer_is_refused(rng, tmp_path, family):
    ck, dense_layer = {
        "deepseek_v3": lambda: (cw.deepseek_v3(rng, E=16, k=4, n_group=4, topk_group=2, first_k_dense_replace=1), 0),
        "qwen3_moe_mlp_only": lambda: (cw.qwen3_moe(rng, mlp_only_layers=(0, 2)), 2),
        "qwen2_moe_sparse_step": lambda: (cw.qwen2_moe(rng, decoder_sparse_step=2), 0),
        "llama4": lambda: (cw.llama4(rng, step=2, layer=1), 0),
    }[family]()
    _raises_naming(tmp_path, ck, "dense", layer=dense_layer)


def test_unknown_model_type_is_named(rng, tmp_path):
    ck = cw.mixtral(rng)
    ck.config["model_type"] = "not_a_moe_family"
    _raises_naming(tmp_path, ck, "not_a_moe_family")


# ----------------------------------------------------------------------------- GPU

GPU_T = 64
GPU_CASES = {  # H and I multiples of 128 for the GPU kernels
    "mixtral": lambda r: cw.mixtral(r, H=256, I=128, E=8, k=2),
    "qwen3_moe": lambda r: cw.qwen3_moe(r, H=256, I=128, E=16, k=4),
    "qwen3_moe_fp8": lambda r: cw.qwen3_moe(r, H=256, I=128, E=16, k=4, fp8=True),
    "qwen2_moe": lambda r: cw.qwen2_moe(r, H=256, I=128, shared_I=256, E=16, k=4),
    "deepseek_v3_fp8": lambda r: cw.deepseek_v3(r, H=256, I=128, fp8=True, **cw.DEEPSEEK_LIKE),
    "glm4_moe": lambda r: cw.deepseek_v3(r, H=256, I=128, **cw.GLM_LIKE),
    "gpt_oss_mxfp4": lambda r: cw.gpt_oss(r, H=256, I=128, E=8, k=4),
    "gpt_oss_bf16": lambda r: cw.gpt_oss(r, H=256, I=128, E=8, k=4, mxfp4=False),
    "llama4": lambda r: cw.llama4(r, H=256, I=128, I_mlp=256, E=8, step=2, layer=1),
}


@pytest.fixture(scope="module")
def gpu_checkpoints(tmp_path_factory):
    out = {}
    for name, make in GPU_CASES.items():
        ck = make(np.random.default_rng(zlib.crc32(name.encode())))
        out[name] = (ck, ck.write(tmp_path_factory.mktemp(name)))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_default_backend_matches_xla(gpu_checkpoints, name):
    ck, path = gpu_checkpoints[name]
    rng = np.random.default_rng(zlib.crc32(b"x" + name.encode()))
    x = jnp.asarray(x_for(rng, ck, lead=(GPU_T,)), jnp.bfloat16)
    xla = load(path, ck.layer, backend="xla")
    block = load(path, ck.layer)
    want = scheme(xla)
    assert scheme(block) == want
    tol = {None: TOL_BF16, "fp8_block": TOL_FP8, "mxfp4": 3e-2}[want]
    y_xla = np.asarray(xla(x), np.float64)
    assert_matches_reference(xla, ck, np.asarray(x), tol)
    outputs = {"default": np.asarray(block(x), np.float64)}
    backend = block.prepare()  # FP8 block / MXFP4 natively, bf16 too: the oracle's prepared backend
    outputs[f"prepared for {backend}"] = np.asarray(block(x), np.float64)
    for what, y in outputs.items():
        err = rel_err(y, y_xla)
        assert err < tol, f"{what}: relative L2 error {err:.3g} against xla >= {tol}"
