"""Training on backend="cutlass": its backward's grouped GEMMs (dgrad: the input gradient against the
stored weights; wgrad: the weight gradient, a reduction over each expert's rows) follow their
definitions, and its custom VJP gives the gradients of the MoE definition: on CPU through the jnp
twins of its kernels, on an H100 through the CUTLASS kernels, under jit and command buffers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import random_moe, rel_err, skip_unless_available
from jax_moe import fused_experts, oracle
from jax_moe.autodiff import differentiable
from jax_moe.backends import cutlass, xla
from jax_moe.backends.cutlass_grad_gemm import (
    grouped_gemm_dgrad,
    grouped_gemm_dgrad_reference,
    grouped_gemm_dgrad_shape,
    grouped_gemm_wgrad,
    grouped_gemm_wgrad_reference,
    grouped_gemm_wgrad_shape,
)
from jax_moe.config import MoEConfig

BF16_GRAD_TOL = 2e-2  # norm-relative: bf16 rows and GEMM outputs on both sides


def _np_dgrad(a, b, offsets):
    """d[r] = a[r] @ b[e] for the rows of expert e (offsets clamped, a decreasing pair empty), float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    m = a.shape[0]
    off = np.maximum.accumulate(np.clip(np.asarray(offsets), 0, m))
    d = np.zeros((m, b.shape[2]))
    for e in range(b.shape[0]):
        d[off[e]:off[e + 1]] = a[off[e]:off[e + 1]] @ b[e]
    return d


def _np_wgrad(u, v, offsets):
    """d[e] = u[rows of e].T @ v[rows of e], zeros for an expert without rows, float64."""
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    off = np.maximum.accumulate(np.clip(np.asarray(offsets), 0, u.shape[0]))
    return np.stack([u[off[e]:off[e + 1]].T @ v[off[e]:off[e + 1]] for e in range(len(off) - 1)])


def _bf16(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)


OFFSETS = {  # M = 40 rows, E = 5 experts
    "all rows, one empty expert": [0, 9, 9, 20, 33, 40],
    "rows before and after the experts": [3, 3, 10, 10, 30, 35],
    "a decreasing pair is an empty expert": [0, 12, 8, 20, 40, 40],
}


@pytest.mark.parametrize("case", sorted(OFFSETS))
def test_the_jnp_twins_follow_the_definitions(rng, case):
    """dgrad: d[r] = a[r] @ b[e], rows outside the experts zero; wgrad: d[e] = u[rows].T @ v[rows],
    zeros for an expert without rows; float32 accumulation, bf16 results."""
    offsets = jnp.asarray(OFFSETS[case], jnp.int32)
    a, b = _bf16(rng, 40, 24), _bf16(rng, 5, 24, 16)
    assert rel_err(grouped_gemm_dgrad_reference(a, b, offsets), _np_dgrad(a, b, offsets)) < 1e-2
    u, v = _bf16(rng, 40, 16), _bf16(rng, 40, 32)
    d = grouped_gemm_wgrad_reference(u, v, offsets)
    want = _np_wgrad(u, v, offsets)
    assert rel_err(d, want) < 1e-2
    empty = np.flatnonzero(np.diff(np.maximum.accumulate(np.asarray(OFFSETS[case]))) == 0)
    assert np.all(np.asarray(d, np.float32)[empty] == 0)


def test_shape_rules_and_bad_operands():
    """The shape rules read no data; bad operands raise ValueError naming the argument."""
    a, b, off = jnp.zeros((40, 24), jnp.bfloat16), jnp.zeros((5, 24, 16), jnp.bfloat16), jnp.zeros((6,), jnp.int32)
    assert grouped_gemm_dgrad_shape(a, b, off).shape == (40, 16)
    assert grouped_gemm_wgrad_shape(a, jnp.zeros((40, 32), jnp.bfloat16), off).shape == (5, 24, 32)
    with pytest.raises(ValueError, match="b must be .E, K, N. with a's K"):
        grouped_gemm_dgrad(a, jnp.zeros((5, 16, 24), jnp.bfloat16), off)
    with pytest.raises(ValueError, match="a must be bfloat16"):
        grouped_gemm_dgrad(a.astype(jnp.float32), b, off)
    with pytest.raises(ValueError, match="offsets must have E \\+ 1 = 6"):
        grouped_gemm_dgrad(a, b, jnp.zeros((5,), jnp.int32))
    with pytest.raises(ValueError, match="v must be .M, Q. with u's M = 40"):
        grouped_gemm_wgrad(a, jnp.zeros((39, 32), jnp.bfloat16), off)
    with pytest.raises(ValueError, match="multiples of 8"):
        grouped_gemm_wgrad(a, jnp.zeros((40, 12), jnp.bfloat16), off)
    assert grouped_gemm_wgrad(a[:0], jnp.zeros((0, 32), jnp.bfloat16), off).shape == (5, 24, 32)


def _grads(fn, moe, cot, argnums=(0, 1, 2, 3)):
    def loss(x, w13, w2, tw):
        return jnp.sum(fn(x, w13, w2, tw, moe.topk_ids).astype(jnp.float32) * cot)

    return jax.jit(jax.grad(loss, argnums))(moe.x, moe.w13, moe.w2, moe.topk_weights)


def _check_against_xla(moe, cot, tol=BF16_GRAD_TOL, **options):
    """cutlass's custom VJP (its own forward and backward) against jax.grad of the xla backend."""
    f = differentiable(cutlass, lambda: cutlass, moe.cfg, **options)
    got = _grads(lambda x, w13, w2, tw, ids: f(x, w13, w2, tw, ids, None, None), moe, cot)
    want = _grads(lambda x, w13, w2, tw, ids: xla.apply(x, w13, w2, tw, ids, moe.cfg), moe, cot)
    for name, g, w in zip(("x", "w13", "w2", "topk_weights"), got, want):
        assert g.dtype == w.dtype, name
        assert rel_err(g, w) < tol, name
    return got


@pytest.mark.parametrize("t,e,k,activation,residuals", [
    (1, 4, 2, "silu", "save"),
    (37, 8, 2, "gelu", "recompute"),
    pytest.param(64, 8, 4, "relu2", "save", marks=pytest.mark.slow),
    pytest.param(21, 16, 8, "silu", "recompute", marks=pytest.mark.slow),
])
def test_the_custom_vjp_gives_the_gradient_of_the_definition(rng, t, e, k, activation, residuals):
    """Gradients for x, w13, w2 and topk_weights (CPU: the kernels' jnp twins) match jax.grad of
    the xla backend; an expert that receives no token gets zero weight gradients."""
    moe = random_moe(rng, t, e, k, 32, 16, activation=activation, dtype=jnp.bfloat16, experts=range(e - 1))
    cot = jnp.asarray(rng.standard_normal((t, 32)), jnp.float32)
    _, d13, d2, _ = _check_against_xla(moe, cot, residuals=residuals)
    assert float(jnp.abs(d13[e - 1]).max()) == 0.0 and float(jnp.abs(d2[e - 1]).max()) == 0.0


def _gptoss_moe(rng, t, e, k, h, i, activation="swigluoai", minus_one=0.0, limit=None, x_scale=2.0):
    """(moe, biases) of a random bf16 GPT-OSS-style layer: swigluoai on interleaved gate/up (relu2:
    concat), alpha not the default, float32 biases; expert e - 1 receives no token. ``limit``
    (None: picked here) is swigluoai's clamp: min(gate, limit) and clip(up) have a jump in their
    derivative at +-limit, and cutlass rounds GEMM1's output to bf16 where xla keeps float32, so a
    pre-activation within a rounding step of +-limit would take the derivative of the other side
    on one backend. The limit picked is the candidate farthest from every pre-activation, with
    some of them beyond it (the clamps' zero derivative is tested too)."""
    from helpers import random_biases, random_routing

    moe = random_moe(rng, t, e, k, h, i, activation=activation, dtype=jnp.bfloat16, experts=range(e - 1))
    w, ids = random_routing(rng, t, e, k, experts=range(e - 1), minus_one=minus_one)
    x = moe.x * x_scale
    layout = "concat" if activation == "relu2" else "interleaved"
    probe = MoEConfig(e, k, h, i, activation=activation, gate_up_layout=layout, expert_shard=bool(minus_one))
    biases = random_biases(rng, probe)
    if limit is None:
        pre = np.einsum("th,tknh->tkn", np.asarray(x, np.float64), np.asarray(moe.w13, np.float64)[np.asarray(ids)])
        pre = np.abs(pre + np.asarray(biases["w13_bias"], np.float64)[np.asarray(ids)])[np.asarray(ids) >= 0]
        limit = max(np.arange(2.0, 4.0, 0.125), key=lambda v: np.abs(pre - v).min())
    cfg = MoEConfig(e, k, h, i, activation=activation, gate_up_layout=layout, swiglu_alpha=1.5,
                    swiglu_limit=float(limit), expert_shard=bool(minus_one))
    return moe._replace(cfg=cfg, x=x, topk_weights=w, topk_ids=ids), biases


def _bias_grads(fn, moe, biases, cot):
    """Gradients of <fn(...), cot> for x, w13, w2, topk_weights, w13_bias, w2_bias."""
    def loss(x, w13, w2, tw, b13, b2):
        return jnp.sum(fn(x, w13, w2, tw, moe.topk_ids, b13, b2).astype(jnp.float32) * cot)

    return jax.jit(jax.grad(loss, tuple(range(6))))(moe.x, moe.w13, moe.w2, moe.topk_weights,
                                                   biases["w13_bias"], biases["w2_bias"])


GRAD_NAMES = ("x", "w13", "w2", "topk_weights", "w13_bias", "w2_bias")


def _check_biased_against_xla(moe, biases, cot, tol=BF16_GRAD_TOL, residuals="save", **options):
    """cutlass's custom VJP with biases against jax.grad of the xla backend (every gradient)."""
    f = differentiable(cutlass, lambda: cutlass, moe.cfg, residuals=residuals, **options)
    got = _bias_grads(f, moe, biases, cot)
    want = _bias_grads(lambda x, w13, w2, tw, ids, b13, b2: xla.apply(x, w13, w2, tw, ids, moe.cfg, w13_bias=b13,
                                                                      w2_bias=b2, **options), moe, biases, cot)
    for name, g, w in zip(GRAD_NAMES, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert rel_err(g, w) < tol, name
    return got


@pytest.mark.parametrize("t,e,k,activation,residuals", [
    (1, 4, 2, "swigluoai", "save"),
    (37, 8, 2, "swigluoai", "recompute"),
    (29, 16, 4, "swigluoai", "save"),
    pytest.param(37, 8, 2, "relu2", "save", marks=pytest.mark.slow),
])
def test_gptoss_gradients_with_biases_match_xla(rng, t, e, k, activation, residuals):
    """swigluoai on interleaved gate/up with both biases: gradients for x, w13, w2, topk_weights,
    w13_bias and w2_bias (CPU: the kernels' jnp twins) match jax.grad of the xla backend; an
    expert without tokens gets zero bias gradients."""
    moe, biases = _gptoss_moe(rng, t, e, k, 32, 16, activation)
    cot = jnp.asarray(rng.standard_normal((t, 32)), jnp.float32)
    got = _check_biased_against_xla(moe, biases, cot, residuals=residuals)
    db13, db2 = got[4], got[5]
    assert float(jnp.abs(db13[e - 1]).max()) == 0.0 and float(jnp.abs(db2[e - 1]).max()) == 0.0


def test_gptoss_gradients_with_ids_of_minus_one_and_router_weight_on_input(rng):
    """Slots of experts on other devices carry no gradient (bias gradients included); top-1 with the
    router weight on the input: dtopk_weights through the product, the biases unweighted."""
    moe, biases = _gptoss_moe(rng, 19, 8, 2, 32, 16, minus_one=0.3)
    got = _check_biased_against_xla(moe, biases, jnp.asarray(rng.standard_normal((19, 32)), jnp.float32))
    ids = np.asarray(moe.topk_ids)
    assert np.all(np.asarray(got[3])[ids < 0] == 0)
    moe, biases = _gptoss_moe(rng, 13, 4, 1, 32, 16)
    _check_biased_against_xla(moe, biases, jnp.asarray(rng.standard_normal((13, 32)), jnp.float32),
                              apply_router_weight_on_input=True)


def test_fused_experts_under_grad_trains_biases_on_cutlass(rng, monkeypatch):
    """The public path: jax.grad through fused_experts with biases, the oracle on cutlass (its
    support forced here, on CPU: its jnp twins): cutlass's vjp runs (not xla's) and gives xla's
    gradients, the biases' included."""
    monkeypatch.setattr(cutlass, "supports", lambda cfg, quant=None, device=None, **kw: (True, "ok"))
    calls = []
    real = cutlass.vjp_bwd
    monkeypatch.setattr(cutlass, "vjp_bwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    moe, biases = _gptoss_moe(rng, 11, 8, 2, 32, 16)
    cot = jnp.asarray(rng.standard_normal((11, 32)), jnp.float32)
    opts = dict(activation="swigluoai", gate_up_layout="interleaved", swiglu_alpha=1.5,
                swiglu_limit=moe.cfg.swiglu_limit)

    def grads(backend):
        return jax.grad(lambda x, w13, w2, tw, b13, b2: jnp.sum(fused_experts(
            x, w13, w2, tw, moe.topk_ids, w13_bias=b13, w2_bias=b2, backend=backend, **opts).astype(jnp.float32)
            * cot), tuple(range(6)))(moe.x, moe.w13, moe.w2, moe.topk_weights, biases["w13_bias"], biases["w2_bias"])

    got = grads("cutlass")
    assert calls, "cutlass.vjp_bwd did not run"
    for name, g, w in zip(GRAD_NAMES, got, grads("xla")):
        assert rel_err(g, w) < BF16_GRAD_TOL, name


def test_fused_moe_under_grad_runs_the_cutlass_vjp(rng, monkeypatch):
    """The public path: jax.grad through fused_moe with the oracle on cutlass (its support forced
    here, on CPU: its jnp twins) gives the xla backend's gradients, the router logits' included."""
    from jax_moe import fused_moe

    monkeypatch.setattr(cutlass, "supports", lambda cfg, quant=None, device=None, **kw: (True, "ok"))
    moe = random_moe(rng, 11, 8, 2, 32, 16, dtype=jnp.bfloat16)
    logits = jnp.asarray(rng.standard_normal((11, 8)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((11, 32)), jnp.float32)

    def grads(backend):
        return jax.jit(jax.grad(lambda x, w13, w2, lg: jnp.sum(
            fused_moe(x, w13, w2, lg, 2, backend=backend).astype(jnp.float32) * cot), (0, 1, 2, 3)))(
            moe.x, moe.w13, moe.w2, logits)

    for g, w in zip(grads("cutlass"), grads("xla")):
        assert rel_err(g, w) < BF16_GRAD_TOL


@pytest.mark.parametrize("strategy", ["naive", "all_to_all"])
def test_gradients_through_the_expert_parallel_strategies(rng, strategy, monkeypatch):
    """jax.grad through parallel_fused_experts on backend="cutlass" (its jnp twins on 4 CPU devices):
    the collectives' transposes come from JAX, the experts' backward from cutlass's VJP, and the
    gradients for x, the sharded w13 and w2, and topk_weights are those of the single-device xla
    backend."""
    from helpers import cpu_mesh
    from jax_moe.parallel import ParallelConfig, parallel_fused_experts, shard_weights

    monkeypatch.setattr(cutlass, "supports", lambda cfg, quant=None, device=None, **kw: (True, "ok"))
    pcfg = ParallelConfig(cpu_mesh((4,), ("ep",)), ep_axis="ep", strategy=strategy)
    moe = random_moe(rng, 16, 8, 2, 32, 16, dtype=jnp.bfloat16)
    cot = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    placed = shard_weights(moe.w13, moe.w2, pcfg)

    def loss_parallel(x, w13, w2, tw):
        out = parallel_fused_experts(x, w13, w2, tw, moe.topk_ids, pcfg, backend="cutlass")
        return jnp.sum(out.astype(jnp.float32) * cot)

    def loss_xla(x, w13, w2, tw):
        return jnp.sum(fused_experts(x, w13, w2, tw, moe.topk_ids, backend="xla").astype(jnp.float32) * cot)

    got = jax.jit(jax.grad(loss_parallel, (0, 1, 2, 3)))(moe.x, placed["w13"], placed["w2"], moe.topk_weights)
    want = jax.grad(loss_xla, (0, 1, 2, 3))(moe.x, moe.w13, moe.w2, moe.topk_weights)
    for name, g, w in zip(("x", "w13", "w2", "topk_weights"), got, want):
        assert rel_err(g, w) < BF16_GRAD_TOL, name


def test_slots_of_experts_on_other_devices_carry_no_gradient(rng):
    """Ids of -1 (expert parallelism): those slots contribute nothing, so their routing weights get
    zero gradient, as on the xla backend."""
    moe = random_moe(rng, 19, 8, 2, 32, 16, dtype=jnp.bfloat16)
    ids = np.asarray(moe.topk_ids).copy()
    ids[::3, 0] = -1
    moe = moe._replace(topk_ids=jnp.asarray(ids), cfg=MoEConfig(8, 2, 32, 16, expert_shard=True))
    _, _, _, dtw = _check_against_xla(moe, jnp.asarray(rng.standard_normal((19, 32)), jnp.float32))
    assert np.all(np.asarray(dtw)[::3, 0] == 0)


def test_router_weight_on_input(rng):
    """Top-1 with the weight applied to x before GEMM1: dx and dtopk_weights through the product."""
    moe = random_moe(rng, 13, 4, 1, 32, 16, dtype=jnp.bfloat16)
    cot = jnp.asarray(rng.standard_normal((13, 32)), jnp.float32)
    f = differentiable(cutlass, lambda: cutlass, moe.cfg, apply_router_weight_on_input=True)
    got = _grads(lambda *a: f(*a, None, None), moe, cot)
    want = _grads(lambda *a: xla.apply(*a, moe.cfg, apply_router_weight_on_input=True), moe, cot)
    for g, w in zip(got, want):
        assert rel_err(g, w) < BF16_GRAD_TOL


def test_remat_policies_see_the_named_residuals(rng):
    """Under jax.checkpoint the gradients are unchanged, whether every residual is recomputed or
    the named ones (moe_a1, moe_h1, moe_y) are saved."""
    moe = random_moe(rng, 9, 4, 2, 32, 16, dtype=jnp.bfloat16)
    cot = jnp.asarray(rng.standard_normal((9, 32)), jnp.float32)
    f = differentiable(cutlass, lambda: cutlass, moe.cfg)
    plain = _grads(lambda *a: f(*a, None, None), moe, cot)
    policy = jax.checkpoint_policies.save_only_these_names("moe_a1", "moe_h1", "moe_y")
    for remat in (jax.checkpoint(lambda *a: f(*a, None, None)),
                  jax.checkpoint(lambda *a: f(*a, None, None), policy=policy)):
        for g, w in zip(_grads(remat, moe, cot), plain):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_a_forced_backend_that_does_not_train_refuses_only_when_differentiated(rng, monkeypatch):
    """backend= forcing an inference-only backend: the forward runs, jax.grad raises a ValueError
    that names the backends that train."""
    import sys
    import types

    fake = types.ModuleType("fake_inference_backend")
    fake.NAME, fake.FEATURES = "flashinfer_cutlass", frozenset({"dtype:float32"})
    fake.supports = lambda cfg, quant=None, device=None, **kw: (True, "ok")
    fake.apply = xla.apply
    monkeypatch.setitem(sys.modules, "fake_inference_backend", fake)
    monkeypatch.setitem(oracle.MODULES, "flashinfer_cutlass", "fake_inference_backend")
    moe = random_moe(rng, 5, 4, 2, 16, 8)
    fused_experts(*moe.args, backend="flashinfer_cutlass")
    with pytest.raises(ValueError, match="does not differentiate.*'cutlass', 'xla'"):
        jax.grad(lambda x: jnp.sum(fused_experts(x, *moe.args[1:], backend="flashinfer_cutlass")))(moe.x)


def test_residuals_must_be_save_or_recompute(rng):
    moe = random_moe(rng, 3, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="residuals must be 'save' or 'recompute'"):
        fused_experts(*moe.args, residuals="keep")


# ----------------------------------------------------------------------------- on the H100


@pytest.mark.gpu
@pytest.mark.parametrize("m,e,p,q", [(1, 8, 256, 512), (1000, 128, 256, 128), (4096, 8, 1024, 512)])
def test_gpu_kernels_follow_the_definitions(rng, m, e, p, q):
    """The CUTLASS dgrad and wgrad against float64 definitions: random offsets with empty experts and
    unowned rows at both ends; no NaN; empty experts exactly zero."""
    skip_unless_available("cutlass")
    cuts = np.sort(rng.integers(0, m + 1, e + 1))
    cuts[1:-1][rng.random(e - 1) < 0.25] = cuts[0]  # some experts without rows ...
    offsets = jnp.asarray(np.maximum.accumulate(cuts), jnp.int32)
    a, b = _bf16(rng, m, p), _bf16(rng, e, p, q)
    assert rel_err(jax.jit(grouped_gemm_dgrad)(a, b, offsets), _np_dgrad(a, b, offsets)) < 1e-2
    v = _bf16(rng, m, q)
    d = jax.jit(grouped_gemm_wgrad)(a, v, offsets)
    assert rel_err(d, _np_wgrad(a, v, offsets)) < 1e-2
    empty = np.flatnonzero(np.diff(np.asarray(offsets)) == 0)
    assert np.all(np.asarray(d[empty], np.float32) == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("activation,residuals", [("silu", "recompute"), ("gelu", "save"), ("relu2", "save")])
def test_gpu_the_cutlass_backward_matches_xla(rng, activation, residuals):
    """On the CUTLASS kernels: gradients for x, w13, w2, topk_weights match jax.grad of xla."""
    skip_unless_available("cutlass")
    moe = random_moe(rng, 300, 16, 4, 512, 256, activation=activation, dtype=jnp.bfloat16, experts=range(15))
    _check_against_xla(moe, jnp.asarray(rng.standard_normal((300, 512)), jnp.float32), residuals=residuals)


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k,residuals", [(300, 16, 4, "save"), (37, 128, 4, "recompute"), (1, 8, 2, "save")])
def test_gpu_gptoss_gradients_with_biases_match_xla(rng, t, e, k, residuals):
    """On the CUTLASS kernels: swigluoai, interleaved gate/up, both biases: every gradient, the
    biases' included, matches jax.grad of xla."""
    skip_unless_available("cutlass")
    # std ~1.4 pre-activations: none within a rounding step of +-7 (see _gptoss_moe)
    moe, biases = _gptoss_moe(rng, t, e, k, 512, 256, limit=7.0, x_scale=1.0)
    _check_biased_against_xla(moe, biases, jnp.asarray(rng.standard_normal((t, 512)), jnp.float32),
                              residuals=residuals)


_GRAD_COMMAND_BUFFER_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from jax_moe import fused_moe
rng = np.random.default_rng({seed})
cases = [(77, 16, 4, 512, 256), (5, 64, 8, 256, 128)]
for t, e, k, h, i in cases:
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    def grads(backend):
        return jax.jit(jax.grad(lambda x, w13, w2, lg, c: jnp.sum(
            fused_moe(x, w13, w2, lg, k, backend=backend).astype(jnp.float32) * c), (0, 1, 2, 3)))
    fast, ref = grads("{backend}"), grads("xla")
    for _ in range(3):
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
        lg = jnp.asarray(rng.standard_normal((t, e)), jnp.float32)
        c = jnp.asarray(rng.standard_normal((t, h)), jnp.float32)
        for g, w in zip(fast(x, w13, w2, lg, c), ref(x, w13, w2, lg, c)):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            err = np.linalg.norm(g - w) / np.linalg.norm(w)
            assert np.isfinite(g).all() and err < {tol}, err
print("OK", len(cases))
"""


@pytest.mark.gpu
def test_gpu_gradients_under_command_buffers(command_buffer_check):
    """The backward's custom calls declare command-buffer compatibility: jax.grad through fused_moe
    on cutlass, with XLA's command buffers forced on, fresh inputs each round, against xla."""
    skip_unless_available("cutlass")
    assert command_buffer_check("cutlass", "", BF16_GRAD_TOL, script=_GRAD_COMMAND_BUFFER_SCRIPT) == 2
