"""On a GPU, select_experts runs as one CUDA kernel (ffi/kernels/route.cu): a warp per token takes
the scores, DeepSeek-V3's group mask, the top-k and the weights in registers. Every routing mode is
checked against the float64 definition (helpers.np_select_experts), on fresh random logits; its
gradient against the softmax's, written out; past the kernel's limits the pure-JAX path runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import ffi, routing
from jax_moe.routing import select_experts, select_experts_lax
from helpers import need_native, np_select_experts

ROUTERS = {  # name: (E, k, select_experts options)
    "qwen3": (128, 8, {}),
    "gptoss": (128, 4, {}),
    "mixtral": (8, 2, {}),
    "deepseek_v3": (256, 8, dict(scoring="sigmoid", num_expert_group=8, topk_group=4, biased=True,
                                 routed_scaling_factor=2.5)),
    "llama4": (16, 1, dict(scoring="sigmoid", renormalize=False)),
    "softmax_unnormalized": (64, 6, dict(renormalize=False)),
    "biased_softmax": (96, 5, dict(biased=True)),
    "sigmoid_grouped_by_max": (160, 6, dict(scoring="sigmoid", num_expert_group=8, topk_group=3)),
    "unaligned_biased_groups": (96, 4, dict(num_expert_group=3, topk_group=2, biased=True)),
    "one_expert_per_group": (32, 3, dict(num_expert_group=32, topk_group=5)),
    "odd_width": (1000, 7, dict(scoring="sigmoid")),
    "widest": (1024, 32, {}),
    "single_expert": (1, 1, {}),
}


def options(rng, e: int, opts: dict) -> dict:
    opts = dict(opts)
    if opts.pop("biased", False):
        opts["e_score_correction_bias"] = (rng.standard_normal(e) / 10).astype(np.float32)
    return opts


def definition(logits, k: int, opts: dict):
    return np_select_experts(
        np.asarray(logits, np.float32), k, opts.get("scoring", "softmax"), opts.get("renormalize", True),
        opts.get("num_expert_group"), opts.get("topk_group"), opts.get("e_score_correction_bias"),
        opts.get("routed_scaling_factor", 1.0))


def assert_routes_as_defined(got, logits, k: int, opts: dict) -> None:
    """ids: the definition's, except where float32 rounding reorders choice scores within 1e-6 of
    each other; weights: the definition's for the ids chosen, to 1e-5."""
    w, ids = np.asarray(got[0]), np.asarray(got[1])
    assert w.dtype == np.float32 and ids.dtype == np.int32 and ids.shape == w.shape == (len(logits), k)
    assert np.isfinite(w).all()
    want_w, want_ids, ranked = definition(logits, k, opts)
    differ = (ids != want_ids).any(-1)
    assert differ.mean() < 0.01, f"{differ.sum()} of {len(ids)} tokens chose other experts"
    for row in np.flatnonzero(differ):
        assert len(set(ids[row])) == k
        np.testing.assert_allclose(np.take(ranked[row], ids[row]), np.take(ranked[row], want_ids[row]), atol=1e-6)
    np.testing.assert_allclose(w[~differ], want_w[~differ], rtol=1e-5, atol=1e-7)


def test_which_routers_take_the_kernel():
    route = routing.Route(8, "softmax", True, None, None, False, 1.0)
    assert routing.uses_kernel(128, route) and routing.uses_kernel(ffi.TOP_K_MAX_N, route._replace(top_k=32))
    assert not routing.uses_kernel(ffi.TOP_K_MAX_N + 1, route)  # at most 1024 experts
    assert not routing.uses_kernel(128, route._replace(top_k=33))  # at most 32 chosen
    assert routing.uses_kernel(64, route._replace(num_expert_group=32, topk_group=4))
    assert not routing.uses_kernel(128, route._replace(num_expert_group=64, topk_group=4))  # at most 32 groups


def test_it_lowers_to_one_custom_call_for_cuda(monkeypatch):
    """With the CUDA module taken as registered: logits [T, E] float32 and bias [E] float32 ->
    weights [T, k] float32 and ids [T, k] int32, the router's settings as attributes (route.h)."""
    monkeypatch.setattr(ffi, "has_native", lambda kind: kind == "cuda")
    bias = jnp.zeros(256, jnp.float32)
    fn = jax.jit(lambda lg: select_experts(lg, 8, scoring="sigmoid", num_expert_group=8, topk_group=4,
                                           e_score_correction_bias=bias, routed_scaling_factor=2.5))
    text = fn.trace(jnp.ones((5, 256), jnp.bfloat16)).lower(lowering_platforms=("cuda",)).as_text()
    (line,) = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_moe_route" in ln]
    assert "(tensor<5x256xf32>, tensor<256xf32>) -> (tensor<5x8xf32>, tensor<5x8xi32>)" in line
    for attr in ("k = 8 : i64", "groups = 8 : i64", "topk_group = 4 : i64", "sigmoid = true", "biased = true",
                 "renormalize = true", "scale = 2.500000e+00 : f32"):
        assert attr in line
    assert "jax_moe_top_k" not in text
    text = jax.jit(lambda lg: select_experts(lg, 4)).trace(jnp.ones((5, 128))).lower(
        lowering_platforms=("cuda",)).as_text()
    (line,) = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_moe_route" in ln]
    assert "tensor<0xf32>" in line and "biased = false" in line  # no bias: an empty one, unread


def test_past_its_limits_the_pure_jax_path_lowers(monkeypatch):
    monkeypatch.setattr(ffi, "has_native", lambda kind: kind == "cuda")
    text = jax.jit(lambda lg: select_experts(lg, 40)).trace(jnp.ones((5, 128))).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "jax_moe_route" not in text and "jax_moe_top_k" in text


def test_off_the_gpu_it_is_the_pure_jax_path(rng):
    logits = rng.standard_normal((33, 256)).astype(np.float32)
    opts = options(rng, 256, ROUTERS["deepseek_v3"][2])
    with jax.default_device(jax.devices("cpu")[0]):
        got, want = select_experts(logits, 8, **opts), select_experts_lax(logits, 8, **opts)
    for a, b in zip(got, want):
        assert a.devices() == {jax.devices("cpu")[0]}
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(ROUTERS))
def test_kernel_routes_as_defined(rng, name):
    need_native("cuda")
    e, k, opts = ROUTERS[name]
    opts = options(rng, e, opts)
    fn = jax.jit(lambda lg: select_experts(lg, k, **opts))
    for t in (1, 37, 1000):
        logits = (2 * rng.standard_normal((t, e))).astype(np.float32)
        text = fn.lower(logits).as_text()
        assert text.count("jax_moe_route") == 1 and "jax_moe_top_k" not in text
        assert_routes_as_defined(fn(logits), logits, k, opts)


@pytest.mark.gpu
def test_deepseek_v3_routing_at_a_prefill_batch(rng):
    need_native("cuda")
    e, k, opts = ROUTERS["deepseek_v3"]
    opts = options(rng, e, opts)
    logits = rng.standard_normal((4096, e)).astype(np.float32)
    assert_routes_as_defined(jax.jit(lambda lg: select_experts(lg, k, **opts))(logits), logits, k, opts)


@pytest.mark.gpu
def test_kernel_takes_bf16_logits_vmap_and_no_tokens(rng):
    need_native("cuda")
    e, k, opts = ROUTERS["deepseek_v3"]
    opts = options(rng, e, opts)
    logits = rng.standard_normal((3, 40, e)).astype(np.float32)
    w, ids = jax.jit(jax.vmap(lambda lg: select_experts(lg, k, **opts)))(logits)
    for b in range(3):
        assert_routes_as_defined((w[b], ids[b]), logits[b], k, opts)
    half = jnp.asarray(logits[0], jnp.bfloat16)
    assert_routes_as_defined(jax.jit(lambda lg: select_experts(lg, k, **opts))(half),
                             np.asarray(half, np.float32), k, opts)
    w, ids = jax.jit(lambda lg: select_experts(lg, 2))(jnp.zeros((0, 8), jnp.float32))
    assert w.shape == ids.shape == (0, 2)


@pytest.mark.gpu
def test_kernel_gradient_is_the_softmax_over_the_chosen(rng):
    """d(sum_j g_j w_j)/d logit_i = s w_i (g_i - sum_j g_j w_j / s) for a chosen i, 0 otherwise, where
    w = s softmax(chosen logits); the bias moves only the choice, so its gradient is 0."""
    need_native("cuda")
    t, e, k, s = 50, 128, 8, 2.5
    logits = rng.standard_normal((t, e)).astype(np.float32)
    bias = (rng.standard_normal(e) / 10).astype(np.float32)
    g = rng.standard_normal((t, k)).astype(np.float32)

    def loss(lg, b):
        w, _ = select_experts(lg, k, e_score_correction_bias=b, routed_scaling_factor=s)
        return (w * g).sum()

    grad_l, grad_b = jax.jit(jax.grad(loss, argnums=(0, 1)))(logits, bias)
    w, ids = jax.jit(lambda lg: select_experts(lg, k, e_score_correction_bias=bias, routed_scaling_factor=s))(logits)
    w, ids = np.asarray(w, np.float64), np.asarray(ids)
    want = np.zeros((t, e))
    np.put_along_axis(want, ids, w * (g - (g * w).sum(-1, keepdims=True) / s), axis=-1)
    np.testing.assert_allclose(np.asarray(grad_l), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(grad_b), np.zeros(e, np.float32))


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nonfinite_logit_stays_in_its_token_on_the_kernel(rng, bad):
    need_native("cuda")
    e, k, opts = ROUTERS["deepseek_v3"]
    opts = options(rng, e, opts)
    logits = rng.standard_normal((6, e)).astype(np.float32)
    fn = jax.jit(lambda lg: select_experts(lg, k, **opts))
    clean_w, clean_ids = (np.asarray(a) for a in fn(logits))
    logits[3, 5] = bad
    w, ids = (np.asarray(a) for a in fn(logits))
    assert ((ids >= 0) & (ids < e)).all() and len(set(ids[3])) == k
    others = np.arange(6) != 3
    np.testing.assert_array_equal(w[others], clean_w[others])
    np.testing.assert_array_equal(ids[others], clean_ids[others])
