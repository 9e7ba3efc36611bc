"""MoEBlock inside a jitted Flax model, and loading each checkpoint layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_moe import MoEBlock
from helpers import SCHEME_TOL, np_silu, np_softmax, np_top_k, rel_err, skip_unless_available, skip_unless_fi_scheme


class TinyModel(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(32, 32, rngs=rngs)
        self.moe = MoEBlock(32, 16, 8, 2, rngs=rngs, dtype=jnp.float32)

    def __call__(self, x):
        return x + self.moe(self.proj(x))


def test_moeblock_runs_in_a_jitted_flax_model_with_leading_dims(rng):
    model = TinyModel(nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((2, 5, 32)), jnp.float32)
    y = nnx.jit(lambda m, x: m(x))(model, x)
    assert y.shape == (2, 5, 32) and np.isfinite(np.asarray(y)).all()
    # the same as calling the block eagerly
    np.testing.assert_allclose(np.asarray(y), np.asarray(model(x)), rtol=1e-5, atol=1e-5)


def test_moeblock_gradients_flow_to_experts_and_router(rng):
    block = MoEBlock(16, 8, 4, 2, rngs=nnx.Rngs(1), dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((6, 16)), jnp.float32)
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(block)  # jitted: eager op-by-op costs seconds
    assert float(jnp.abs(grads.w13.get_value()).sum()) > 0
    assert float(jnp.abs(grads.router.get_value()).sum()) > 0


def test_moeblock_rejects_wrong_hidden_size():
    block = MoEBlock(16, 8, 4, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="x must have shape \\[..., H=16\\]"):
        block(jnp.ones((3, 15)))


def _call(block, x):
    """block(x) under nnx.jit (an eager call runs op by op: seconds on a CPU)."""
    return nnx.jit(lambda m, v: m(v))(block, x)


def _call_float32(block, x):
    """:func:`_call` with float32 matmuls in float32 (a GPU's default for them is TF32, whose 10-bit
    mantissa the float32 tolerances of the checkpoint tests below do not allow)."""
    with jax.default_matmul_precision("highest"):
        return _call(block, x)


# ------------------------------------------------------------------ checkpoint layouts
# Each reference below is written from the model family's own definition of its MoE layer,
# directly on the checkpoint tensors, without jax_moe's orientation.

E, K, H, I, T = 8, 2, 32, 16, 12


def _per_expert_tensors(rng, prefix, gate, up, down):
    t = {}
    for e in range(E):
        t[f"{prefix}experts.{e}.{gate}.weight"] = rng.standard_normal((I, H)) / np.sqrt(H)
        t[f"{prefix}experts.{e}.{up}.weight"] = rng.standard_normal((I, H)) / np.sqrt(H)
        t[f"{prefix}experts.{e}.{down}.weight"] = rng.standard_normal((H, I)) / np.sqrt(I)
    return {k: v.astype(np.float32) for k, v in t.items()}


def _softmax_topk_reference(t, prefix, x, gate, up, down):
    probs = np_softmax(x @ t[prefix + "gate.weight"].T)
    out = np.zeros_like(x)
    for n in range(len(x)):
        sel = np_top_k(probs[n], K)
        w = probs[n, sel] / probs[n, sel].sum()
        for wj, e in zip(w, sel):
            g = x[n] @ t[f"{prefix}experts.{e}.{gate}.weight"].T
            u = x[n] @ t[f"{prefix}experts.{e}.{up}.weight"].T
            out[n] += wj * (np_silu(g) * u) @ t[f"{prefix}experts.{e}.{down}.weight"].T
    return out


@pytest.mark.parametrize("layout,prefix,names", [
    ("mixtral", "model.layers.0.block_sparse_moe.", ("w1", "w3", "w2")),
    ("qwen3_moe", "model.layers.3.mlp.", ("gate_proj", "up_proj", "down_proj")),
])
def test_load_softmax_topk_layouts(rng, layout, prefix, names):
    t = _per_expert_tensors(rng, prefix, *names)
    t[prefix + "gate.weight"] = rng.standard_normal((E, H)).astype(np.float32)
    x = rng.standard_normal((T, H)).astype(np.float32)
    block = MoEBlock.from_checkpoint(layout, t, prefix, top_k=K, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(_call_float32(block, jnp.asarray(x))),
                               _softmax_topk_reference(t, prefix, x, *names), rtol=2e-4, atol=2e-5)


def test_load_deepseek_v3(rng):
    prefix = "model.layers.5.mlp."
    e, groups = 16, 8
    t = {}
    for n in range(e):
        t[f"{prefix}experts.{n}.gate_proj.weight"] = rng.standard_normal((I, H)) / np.sqrt(H)
        t[f"{prefix}experts.{n}.up_proj.weight"] = rng.standard_normal((I, H)) / np.sqrt(H)
        t[f"{prefix}experts.{n}.down_proj.weight"] = rng.standard_normal((H, I)) / np.sqrt(I)
    t[prefix + "gate.weight"] = rng.standard_normal((e, H))
    t[prefix + "gate.e_score_correction_bias"] = 0.1 * rng.standard_normal(e)
    t = {k: v.astype(np.float32) for k, v in t.items()}
    x = rng.standard_normal((T, H)).astype(np.float32)

    # DeepSeek-V3: sigmoid scores; biased scores pick 4 of 8 groups (sum of top-2) then top-k;
    # weights are unbiased scores, renormalized, times 2.5.
    scores = 1 / (1 + np.exp(-(x @ t[prefix + "gate.weight"].T)))
    biased = scores + t[prefix + "gate.e_score_correction_bias"]
    ref = np.zeros_like(x)
    for n in range(T):
        per = e // groups
        gs = [np.sort(biased[n, g * per:(g + 1) * per])[-2:].sum() for g in range(groups)]
        keep = np.zeros(e, bool)
        for g in np_top_k(np.array(gs), groups // 2):
            keep[g * per:(g + 1) * per] = True
        sel = np_top_k(np.where(keep, biased[n], -np.inf), K)
        w = scores[n, sel] / scores[n, sel].sum() * 2.5
        for wj, m in zip(w, sel):
            g = x[n] @ t[f"{prefix}experts.{m}.gate_proj.weight"].T
            u = x[n] @ t[f"{prefix}experts.{m}.up_proj.weight"].T
            ref[n] += wj * (np_silu(g) * u) @ t[f"{prefix}experts.{m}.down_proj.weight"].T
    block = MoEBlock.from_checkpoint("deepseek_v3", t, prefix, top_k=K, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(_call_float32(block, jnp.asarray(x))), ref, rtol=2e-4, atol=2e-5)


def test_load_gpt_oss(rng):
    prefix = "model.layers.1.mlp."
    t = {
        prefix + "router.weight": rng.standard_normal((E, H)),
        prefix + "router.bias": rng.standard_normal(E),
        prefix + "experts.gate_up_proj": rng.standard_normal((E, H, 2 * I)) / np.sqrt(H),
        prefix + "experts.gate_up_proj_bias": rng.standard_normal((E, 2 * I)),
        prefix + "experts.down_proj": rng.standard_normal((E, I, H)) / np.sqrt(I),
        prefix + "experts.down_proj_bias": rng.standard_normal((E, H)),
    }
    t = {k: v.astype(np.float32) for k, v in t.items()}
    x = rng.standard_normal((T, H)).astype(np.float32)

    # GPT-OSS: top-k of router logits, softmax over the chosen; gate/up alternate along the last
    # axis of gate_up_proj; swiglu with alpha 1.702, clamp 7, (up + 1) * glu.
    logits = x @ t[prefix + "router.weight"].T + t[prefix + "router.bias"]
    ref = np.zeros_like(x)
    for n in range(T):
        sel = np_top_k(logits[n], K)
        w = np_softmax(logits[n, sel])
        for wj, e in zip(w, sel):
            gu = x[n] @ t[prefix + "experts.gate_up_proj"][e] + t[prefix + "experts.gate_up_proj_bias"][e]
            gate, up = np.minimum(gu[::2], 7.0), np.clip(gu[1::2], -7.0, 7.0)
            act = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
            ref[n] += wj * (act @ t[prefix + "experts.down_proj"][e] + t[prefix + "experts.down_proj_bias"][e])
    block = MoEBlock.from_checkpoint("gpt_oss", t, prefix, top_k=K, dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(_call_float32(block, jnp.asarray(x))), ref, rtol=2e-4, atol=2e-5)


def test_unknown_layout_and_missing_tensor_raise(rng):
    with pytest.raises(ValueError, match="layout must be one of"):
        MoEBlock.from_checkpoint("llama", {}, top_k=2)
    with pytest.raises(ValueError, match="no experts found"):
        MoEBlock.from_checkpoint("mixtral", {}, "p.", top_k=2)
    with pytest.raises(ValueError, match="checkpoint tensor 'p.gate.weight' is missing"):
        MoEBlock.from_checkpoint("mixtral", _per_expert_tensors(rng, "p.", "w1", "w3", "w2"), "p.", top_k=2)


# ----------------------------------------------------------------------------- prepare()


class _DoublingBackend:
    """A stand-in backend whose layout stores w13 doubled; apply_prepared undoes it (CPU-testable
    plumbing of MoEBlock.prepare(); the real one is flashinfer_cutlass, tested on the GPU)."""

    calls = 0

    @staticmethod
    def supports(cfg, quant=None, device=None):
        return True, "ok"

    @staticmethod
    def prepare(w13, w2, cfg, quant=None):
        _DoublingBackend.calls += 1
        return {"w13": w13 * 2, "w2": w2}

    @staticmethod
    def apply_prepared(x, prepared, topk_weights, topk_ids):
        from jax_moe import fused_experts

        return fused_experts(x, prepared["w13"] / 2, prepared["w2"], topk_weights, topk_ids, backend="xla")


def test_prepare_repacks_once_and_calls_stay_equal(rng, monkeypatch):
    import sys
    import types

    from jax_moe import oracle

    mod = types.ModuleType("jax_moe_test_doubling")
    for name in ("supports", "prepare", "apply_prepared"):
        setattr(mod, name, getattr(_DoublingBackend, name))
    monkeypatch.setitem(sys.modules, "jax_moe_test_doubling", mod)
    monkeypatch.setitem(oracle.MODULES, "flashinfer_cutlass", "jax_moe_test_doubling")
    block = MoEBlock(64, 32, 8, 2, rngs=nnx.Rngs(0), dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 5, 64)), jnp.float32)
    before = _call(block, x)
    assert block.prepare() == "flashinfer_cutlass"  # picked without being forced
    assert _DoublingBackend.calls == 1 and block.w13 is None and block.w2 is None
    after = nnx.jit(lambda m, v: m(v))(block, x)
    np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)
    assert _DoublingBackend.calls == 1  # not per call
    with pytest.raises(ValueError, match="already prepared"):
        block.prepare()


def test_prepare_hands_expert_biases_to_backends_that_take_them(rng, monkeypatch):
    import sys
    import types

    from jax_moe import oracle

    seen = {}

    def prepare(w13, w2, cfg, quant=None, *, w13_bias=None, w2_bias=None):
        seen.update(w13_bias=w13_bias, w2_bias=w2_bias)
        return {"w13": w13, "w2": w2, "b13": w13_bias, "b2": w2_bias}

    def apply_prepared(x, p, topk_weights, topk_ids):
        from jax_moe import fused_experts

        return fused_experts(x, p["w13"], p["w2"], topk_weights, topk_ids, w13_bias=p["b13"],
                             w2_bias=p["b2"], backend="xla")

    mod = types.ModuleType("jax_moe_test_biased")
    mod.supports, mod.prepare, mod.apply_prepared = _DoublingBackend.supports, prepare, apply_prepared
    monkeypatch.setitem(sys.modules, "jax_moe_test_biased", mod)
    monkeypatch.setitem(oracle.MODULES, "flashinfer_cutlass", "jax_moe_test_biased")
    block = MoEBlock(64, 32, 8, 2, rngs=nnx.Rngs(0), dtype=jnp.float32, expert_bias=True)
    block.w13_bias = nnx.Param(jnp.asarray(rng.standard_normal((8, 64)), jnp.float32))
    block.w2_bias = nnx.Param(jnp.asarray(rng.standard_normal((8, 64)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    before = _call(block, x)
    assert block.prepare() == "xla"  # this stand-in does not say it takes biases
    mod.FEATURES = frozenset({"bias"})
    block2 = MoEBlock(64, 32, 8, 2, rngs=nnx.Rngs(0), dtype=jnp.float32, expert_bias=True)
    block2.w13_bias, block2.w2_bias = block.w13_bias, block.w2_bias
    assert block2.prepare() == "flashinfer_cutlass"
    assert seen["w13_bias"] is not None and seen["w2_bias"] is not None
    np.testing.assert_allclose(nnx.jit(lambda m, v: m(v))(block2, x), before, rtol=1e-5, atol=1e-5)


def test_quantized_block_runs_jitted_and_stays_close(rng):
    block = MoEBlock(64, 32, 8, 2, rngs=nnx.Rngs(0), dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    before = np.asarray(_call(block, x))
    block.quantize("fp8", act="fp8_per_token")
    after = np.asarray(nnx.jit(lambda m, v: m(v))(block, x))
    # FP8 weights and activations against the unquantized block (not the dequantized reference):
    # e4m3's 3 mantissa bits, twice, on a small layer.
    assert rel_err(after, before) < 1e-1
    with pytest.raises(ValueError, match="already quantized"):
        block.quantize("fp8")


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="on a CPU: a GPU's prepare() picks a kernel backend")
def test_prepare_on_cpu_keeps_the_xla_backend(rng):
    block = MoEBlock(64, 32, 8, 2, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.bfloat16)
    before = _call(block, x)
    assert block.prepare() == "xla"
    assert block.w13 is not None and block.prepared is None
    np.testing.assert_array_equal(np.asarray(_call(block, x), np.float32), np.asarray(before, np.float32))


def test_forced_backend_that_cannot_serve_raises_at_prepare():
    block = MoEBlock(64, 32, 8, 2, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="flashinfer_trtllm.*cannot serve"):
        block.prepare(backend="flashinfer_trtllm")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", [None, "fp8"])
def test_prepare_on_hopper_picks_flashinfer_cutlass(rng, scheme):
    """On an H100/H200 with the FlashInfer module built, prepare() moves the block to the
    FlashInfer CUTLASS runner and its output stays that of the xla backend."""
    if scheme is None:
        skip_unless_available("flashinfer_cutlass")
    else:
        skip_unless_fi_scheme(scheme)
    block = MoEBlock(1024, 512, 16, 4, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal((77, 1024)), jnp.bfloat16)
    if scheme is not None:
        block.quantize(scheme, a2_scale=0.05)
    before = np.asarray(block(x), np.float32)
    assert block.prepare() == "flashinfer_cutlass"
    after = nnx.jit(lambda m, v: m(v))(block, x)
    assert rel_err(after, before) < SCHEME_TOL[scheme or "bf16"]


@pytest.mark.gpu
def test_gpt_oss_block_with_biases_prepares_for_flashinfer_cutlass(rng):
    """A GPT-OSS-style block (swigluoai, interleaved gate/up, biases on both GEMMs) moves to
    the FlashInfer runner with its biases and keeps its output."""
    skip_unless_available("flashinfer_cutlass")
    block = MoEBlock(1024, 512, 16, 4, rngs=nnx.Rngs(0), activation="swigluoai",
                     gate_up_layout="interleaved", expert_bias=True, router_bias=True)
    block.w13_bias = nnx.Param(jnp.asarray(rng.standard_normal((16, 1024)), jnp.float32))
    block.w2_bias = nnx.Param(jnp.asarray(0.3 * rng.standard_normal((16, 1024)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((77, 1024)), jnp.bfloat16)
    before = np.asarray(block(x), np.float32)
    assert block.prepare() == "flashinfer_cutlass"
    assert rel_err(nnx.jit(lambda m, v: m(v))(block, x), before) < SCHEME_TOL["bf16"]


def test_a_small_deepseek_layout_without_config_routes_without_groups(rng):
    """DeepSeek-V3's default 8 groups need >= 2 experts per group: with E=8 and no config.json the
    reader routes over all experts instead of failing."""
    prefix = "model.layers.5.mlp."
    t = _per_expert_tensors(rng, prefix, "gate_proj", "up_proj", "down_proj")
    t[prefix + "gate.weight"] = rng.standard_normal((E, H)).astype(np.float32)
    t[prefix + "gate.e_score_correction_bias"] = rng.random(E).astype(np.float32)
    block = MoEBlock.from_checkpoint("deepseek_v3", t, prefix, top_k=K, dtype=jnp.float32)
    assert block.routing["num_expert_group"] is None
    assert np.isfinite(np.asarray(block(jnp.asarray(rng.standard_normal((3, H)), jnp.float32)))).all()
