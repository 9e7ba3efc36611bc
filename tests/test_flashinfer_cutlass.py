"""FlashInfer CUTLASS fused-MoE custom call (SM90, bf16) against a float32 jnp reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.backends import flashinfer_cutlass as fic

REL_TOL = 2e-2


def _routing(rng, t, e, k):
    scores = rng.standard_normal((t, e))
    ids = np.argsort(-scores, axis=1)[:, :k].astype(np.int32)  # k distinct experts per token
    w = rng.random((t, k)).astype(np.float32) + 0.1
    w /= w.sum(axis=1, keepdims=True)
    return jnp.asarray(w), jnp.asarray(ids)


def _problem(rng, t, e, k, h, i, activation="silu"):
    n1 = 2 * i if fic.GATED[activation] else i
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((e, n1, h)) / np.sqrt(h), jnp.bfloat16)  # [gate; up]
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    tw, ids = _routing(rng, t, e, k)
    return x, w13, w2, tw, ids


def _reference(x, w13, w2, tw, ids, activation="silu"):
    """float32: out[t] = sum_j w[t,j] * act(x W13_e^T) W2_e^T, vLLM layout (w13 = [gate; up])."""
    x = x.astype(jnp.float32)
    w13 = w13.astype(jnp.float32)[ids]  # [T, k, N1, H]
    w2 = w2.astype(jnp.float32)[ids]  # [T, k, H, I]
    h1 = jnp.einsum("th,tknh->tkn", x, w13, precision="highest")
    if fic.GATED[activation]:
        i = h1.shape[-1] // 2
        gate, up = h1[..., :i], h1[..., i:]
        act = jax.nn.silu(gate) if activation == "silu" else jax.nn.gelu(gate, approximate=False)
        a = act * up
    else:
        a = jnp.square(jnp.maximum(h1, 0.0))
    y = jnp.einsum("tki,tkhi->tkh", a, w2, precision="highest")
    return jnp.einsum("tk,tkh->th", tw.astype(jnp.float32), y)


def _rel_err(out, ref):
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _skip_unless_available():
    ok, why = fic.available()
    if not ok:
        pytest.skip(why)


def test_prepare_weights_swaps_gate_and_up():
    e, i, h = 2, 4, 8
    w13 = jnp.arange(e * 2 * i * h, dtype=jnp.float32).reshape(e, 2 * i, h)
    w2 = jnp.ones((e, h, i))
    p13, p2 = fic.prepare_weights(w13, w2)
    assert p13.dtype == jnp.bfloat16 and p2.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(p13[:, :i], np.float32), np.asarray(w13[:, i:]))
    np.testing.assert_array_equal(np.asarray(p13[:, i:], np.float32), np.asarray(w13[:, :i]))
    inter = jnp.stack([w13[:, :i], w13[:, i:]], axis=2).reshape(e, 2 * i, h)  # g0 u0 g1 u1 ...
    q13, _ = fic.prepare_weights(inter, w2, gate_up_layout="interleaved")
    np.testing.assert_array_equal(np.asarray(q13), np.asarray(p13))


@pytest.mark.gpu
@pytest.mark.parametrize("e,k", [(8, 2), (64, 6)])
@pytest.mark.parametrize("t", [1, 37, 256])
def test_matches_reference(rng, t, e, k):
    _skip_unless_available()
    h, i = 1024, 512
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i)
    ref = _reference(x, w13, w2, tw, ids)
    p13, p2 = fic.prepare_weights(w13, w2)
    out = jax.jit(fic.apply_prepared)(x, p13, p2, tw, ids)
    assert out.shape == (t, h) and out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, ref) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_other_activations(rng, activation):
    _skip_unless_available()
    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i, activation)
    ref = _reference(x, w13, w2, tw, ids, activation)
    p13, p2 = fic.prepare_weights(w13, w2, activation=activation)
    out = fic.apply_prepared(x, p13, p2, tw, ids, activation=activation)
    assert _rel_err(out, ref) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("gemm_id", [1, 2])
def test_every_compiled_tactic(rng, gemm_id):
    """Each compiled GEMM1 (resp. GEMM2, incl. finalize-fused) tactic, the other one default."""
    _skip_unless_available()
    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i)
    ref = _reference(x, w13, w2, tw, ids)
    p13, p2 = fic.prepare_weights(w13, w2)
    compiled = [(idx, desc) for idx, desc, ok in fic.tactics(gemm_id) if ok]
    assert compiled, "no compiled tactic"
    errors = {}
    for idx, desc in compiled:
        kw = {"gemm1_tactic": idx} if gemm_id == 1 else {"gemm2_tactic": idx}
        out = fic.apply_prepared(x, p13, p2, tw, ids, **kw)
        errors[desc] = _rel_err(out, ref)
    bad = {d: err for d, err in errors.items() if not err < REL_TOL}
    assert not bad, bad


@pytest.mark.gpu
def test_not_compiled_tactic_is_an_error(rng):
    _skip_unless_available()
    missing = [idx for idx, _, ok in fic.tactics(1) if not ok]
    if not missing:
        pytest.skip("every tactic is compiled in this build")
    t, e, k, h, i = 4, 8, 2, 256, 128
    x, w13, w2, tw, ids = _problem(rng, t, e, k, h, i)
    p13, p2 = fic.prepare_weights(w13, w2)
    with pytest.raises(Exception, match="not compiled"):
        jax.block_until_ready(fic.apply_prepared(x, p13, p2, tw, ids, gemm1_tactic=missing[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", [(1, 256, 8), (1000, 8, 2), (5, 256, 8)])
def test_fused_experts_forced_backend_equals_xla(rng, t, e, k):
    """Through the public API, against the pure-JAX backend on the same weights; T=5 with E=256
    leaves most experts without tokens; run twice under jit (no state leaks)."""
    _skip_unless_available()
    from jax_moe import fused_experts

    x, w13, w2, tw, ids = _problem(rng, t, e, k, 1024, 512)
    f = jax.jit(lambda *a: fused_experts(*a, backend="flashinfer_cutlass"))
    out1, out2 = f(x, w13, w2, tw, ids), f(x, w13, w2, tw, ids)
    ref = fused_experts(x, w13, w2, tw, ids, backend="xla")
    assert np.isfinite(np.asarray(out1, np.float32)).all()
    assert _rel_err(out1, ref) < REL_TOL
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))
