"""Gradients: the kernel backends' forward with the pure-JAX definition's backward
(jax_moe.autodiff), checked on CPU with the xla backend standing in for a kernel backend; the
xla path against float64 finite differences; inference-only weights refuse to differentiate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jax_moe import MoEBlock, fused_experts
from jax_moe.autodiff import differentiable
from jax_moe.backends import xla
from jax_moe.config import MoEConfig
from helpers import random_biases, random_moe, rel_err


def _layer(rng, t, e, k, h, i, activation="silu", bias=False, dtype=np.float32):
    """A random layer as numpy arrays of ``dtype`` (helpers.random_moe; expert e-1 receives no
    token): (x, w13, w2, topk_weights, topk_ids, w13_bias or None, w2_bias or None)."""
    m = random_moe(rng, t, e, k, h, i, activation=activation, experts=range(e - 1))
    x, w13, w2, tw = (np.asarray(a, dtype) for a in (m.x, m.w13, m.w2, m.topk_weights))
    b13 = b2 = None
    if bias:
        b13, b2 = (np.asarray(b, dtype) for b in random_biases(rng, m.cfg, scale=0.1).values())
    return x, w13, w2, tw, np.asarray(m.topk_ids), b13, b2


@pytest.mark.parametrize("t,e,k", [pytest.param(1, 4, 2, marks=pytest.mark.slow), (9, 8, 2),
                                   pytest.param(20, 6, 3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("activation,bias", [("silu", False), pytest.param("gelu", True, marks=pytest.mark.slow),
                                             ("swigluoai", True), pytest.param("relu2", False, marks=pytest.mark.slow)])
def test_the_custom_vjp_equals_the_gradient_of_the_definition(rng, t, e, k, activation, bias):
    """differentiable(apply): forward = apply, backward = jax.grad of xla.apply, for x, w13, w2,
    topk_weights and the biases (an expert with no tokens gets zero gradients)."""
    x, w13, w2, tw, ids, b13, b2 = _layer(rng, t, e, k, 16, 8, activation, bias)
    cfg = MoEConfig(e, k, 16, 8, activation)
    f = differentiable(xla, lambda: xla, cfg)
    cot = rng.standard_normal((t, 16)).astype(np.float32)

    def loss_custom(*a):
        return jnp.sum(f(a[0], a[1], a[2], a[3], ids, *a[4:]) * cot)

    def loss_ref(*a):
        return jnp.sum(xla.apply(a[0], a[1], a[2], a[3], ids, cfg, w13_bias=a[4], w2_bias=a[5]) * cot)

    args = (x, w13, w2, tw, b13, b2)
    argnums = (0, 1, 2, 3, 4, 5) if bias else (0, 1, 2, 3)
    got = jax.grad(loss_custom, argnums)(*args)
    want = jax.grad(loss_ref, argnums)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got[1])[e - 1] == 0)  # the empty expert


def test_the_definition_matches_float64_finite_differences(rng):
    """Central differences in float64 inputs (the definition accumulates in float32, hence eps 1e-3
    and a 2e-3 relative bound)."""
    jax.config.update("jax_enable_x64", True)
    try:
        x, w13, w2, tw, ids, _, _ = _layer(rng, 5, 4, 2, 6, 4, dtype=np.float64)
        cfg = MoEConfig(4, 2, 6, 4)
        cot = rng.standard_normal((5, 6))

        def loss(x, w13, w2, tw):
            return jnp.sum(xla.apply(x, w13, w2, tw, ids, cfg) * cot)

        grads = jax.grad(loss, (0, 1, 2, 3))(x, w13, w2, tw)
        eps = 1e-3
        for n, (arg, g) in enumerate(zip((x, w13, w2, tw), grads)):
            for _ in range(4):
                idx = tuple(rng.integers(0, s) for s in arg.shape)
                up, down = [np.array(a) for a in (x, w13, w2, tw)], [np.array(a) for a in (x, w13, w2, tw)]
                up[n][idx] += eps
                down[n][idx] -= eps
                fd = (float(loss(*up)) - float(loss(*down))) / (2 * eps)
                assert abs(fd - float(np.asarray(g)[idx])) <= 2e-3 * max(1.0, abs(fd)), (n, idx)
    finally:
        jax.config.update("jax_enable_x64", False)


def test_gradients_reach_the_router_through_select_experts(rng):
    block = MoEBlock(16, 8, 6, 2, rngs=nnx.Rngs(0), dtype=jnp.float32)
    x = jnp.asarray(rng.standard_normal((7, 16)), jnp.float32)
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(block)
    assert float(jnp.abs(grads.router.get_value()).sum()) > 0
    assert np.isfinite(np.asarray(grads.w13.get_value())).all()


def test_prepared_weights_refuse_to_differentiate_and_name_the_backends_that_train(rng, monkeypatch):
    import sys
    import types

    from jax_moe import oracle

    fake = types.ModuleType("fake_prepared_backend")
    fake.NAME, fake.FEATURES = "fake", frozenset()
    fake.supports = lambda cfg, quant=None, device=None, **kw: (True, "ok")
    fake.prepare = lambda w13, w2, cfg, quant=None, **kw: (w13, w2)
    fake.apply_prepared = lambda x, p, w, ids: fused_experts(x, p[0], p[1], w, ids, backend="xla")
    monkeypatch.setitem(sys.modules, "fake_prepared_backend", fake)
    monkeypatch.setitem(oracle.MODULES, "flashinfer_cutlass", "fake_prepared_backend")
    block = MoEBlock(16, 8, 4, 2, rngs=nnx.Rngs(0), dtype=jnp.float32)
    assert block.prepare(backend="flashinfer_cutlass") == "flashinfer_cutlass"
    x = jnp.asarray(rng.standard_normal((3, 16)), jnp.float32)
    block(x)  # inference works
    with pytest.raises(ValueError, match="for inference.*'cutlass' or 'xla'"):
        jax.grad(lambda v: jnp.sum(block(v)))(x)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (37, 8, 2), (1000, 128, 8)])
def test_gpu_cutlass_gradients_match_xla(rng, t, e, k):
    """bf16 on the default GPU path (cutlass on SM90): gradients for x, w13, w2 and the router
    logits (through select_experts) match backend="xla" within bf16 bounds, under jit."""
    from jax_moe import fused_moe, oracle

    h, i = 256, 128
    x, w13, w2, _, _, _, _ = _layer(rng, t, e, k, h, i)
    logits = rng.standard_normal((t, e)).astype(np.float32)
    logits[:, e - 1] = -30.0  # expert e-1 gets no tokens
    args = [jnp.asarray(a, jnp.bfloat16) for a in (x, w13, w2)] + [jnp.asarray(logits)]
    cot = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
    cfg = MoEConfig(e, k, h, i)
    assert oracle.select_backend(cfg).name == "cutlass"

    def loss(backend):
        return jax.jit(jax.grad(lambda x, w13, w2, lg: jnp.sum(
            fused_moe(x, w13, w2, lg, k, backend=backend).astype(jnp.float32) * cot), (0, 1, 2, 3)))

    got, want = loss(None)(*args), loss("xla")(*args)
    for name, g, w in zip(("x", "w13", "w2", "router_logits"), got, want):
        assert rel_err(g, w) < 2e-2, name
    assert float(jnp.abs(got[1][e - 1].astype(jnp.float32)).max()) == 0.0


@pytest.mark.gpu
def test_gpu_a_small_flax_model_trains_on_cutlass_as_on_xla(rng):
    """A MoEBlock inside a small Flax model, trained with optax for 200 steps: the loss falls on
    the default GPU backend as it does on xla."""
    import optax

    h = 128
    x = jnp.asarray(rng.standard_normal((256, h)), jnp.bfloat16)
    target = jnp.tanh(x.astype(jnp.float32) @ jnp.asarray(rng.standard_normal((h, h)) / np.sqrt(h), jnp.float32))

    def train(backend):
        block = MoEBlock(h, 128, 8, 2, rngs=nnx.Rngs(0), backend=backend)
        opt = nnx.Optimizer(block, optax.adam(1e-3), wrt=nnx.Param)

        @nnx.jit
        def step(m, o):
            loss, g = nnx.value_and_grad(lambda m: jnp.mean((m(x).astype(jnp.float32) - target) ** 2))(m)
            o.update(m, g)
            return loss

        return [float(step(block, opt)) for _ in range(200)]

    fast, ref = train(None), train("xla")
    assert fast[-1] < 0.5 * fast[0] and ref[-1] < 0.5 * ref[0]
    assert abs(fast[-1] - ref[-1]) < 0.1 * ref[0]
