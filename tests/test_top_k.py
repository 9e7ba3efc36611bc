"""jax_moe.top_k.top_k is jax.lax.top_k: on a GPU from the CUDA kernel (a warp per row), elsewhere
lax.top_k itself. The kernel is checked against a numpy definition of lax.top_k's order (float32's
total order, largest first, equal values to the lower index), on rows of every length class."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import ffi, routing
from jax_moe.top_k import top_k, uses_kernel
from helpers import need_native


def definition(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """numpy lax.top_k: order by float32's total order (a negative NaN < -inf < -0 < +0 < +inf <
    NaN), descending, equal values to the lower index first."""
    bits = np.asarray(x, np.float32).view(np.uint32).astype(np.int64)
    key = np.where(bits >= 2**31, (2**32 - 1) - bits, bits + 2**31)  # the order as an integer
    idx = np.argsort(-key, axis=-1, kind="stable")[..., :k].astype(np.int32)
    return np.take_along_axis(np.asarray(x, np.float32), idx, axis=-1), idx


def assert_same(got, want):
    np.testing.assert_array_equal(np.asarray(got[1]), want[1])
    np.testing.assert_array_equal(np.asarray(got[0], np.float32).view(np.uint32), want[0].view(np.uint32))


def special_rows(rng, rows: int, n: int) -> np.ndarray:
    """Rows with ties (few distinct values), +-0, +-inf and NaN of both signs mixed in."""
    x = rng.integers(-3, 4, (rows, n)).astype(np.float32)
    pick = rng.random((rows, n))
    x[pick < 0.1] = -0.0
    x[(pick >= 0.1) & (pick < 0.15)] = np.inf
    x[(pick >= 0.15) & (pick < 0.2)] = -np.inf
    x[(pick >= 0.2) & (pick < 0.23)] = np.nan
    x[(pick >= 0.23) & (pick < 0.25)] = -np.float32(np.nan)
    return x


def test_the_definition_is_lax_top_k_on_the_cpu(rng):
    x = special_rows(rng, 64, 40)
    want = jax.lax.top_k(jnp.asarray(x), 40)
    got = definition(x, 40)
    np.testing.assert_array_equal(np.asarray(want[1]), got[1])


def test_which_calls_take_the_kernel():
    x = jnp.ones((4, 128), jnp.float32)
    assert uses_kernel(x, 8) and uses_kernel(jnp.ones((2, 3, 1024), jnp.float32), 1024)
    assert not uses_kernel(x.astype(jnp.bfloat16), 8)  # float32 only
    assert not uses_kernel(jnp.ones((4, 1025), jnp.float32), 8)  # at most 1024 values per row
    assert not uses_kernel(x, 129) and not uses_kernel(x, 0)
    assert not uses_kernel(jnp.ones((0, 128), jnp.float32), 8)


def test_off_the_kernel_it_is_lax_top_k(rng):
    x = jnp.asarray(rng.standard_normal((6, 2000)), jnp.float32)
    for a in (x, x.astype(jnp.bfloat16)):
        got, want = top_k(a, 5), jax.lax.top_k(a, 5)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_it_lowers_to_the_custom_call_for_cuda(monkeypatch):
    """With the CUDA module taken as registered: one custom call, x [..., N] float32 -> indices
    [..., k] int32 with the attribute k (ffi/kernels/top_k.h)."""
    monkeypatch.setattr(ffi, "has_native", lambda kind: kind == "cuda")
    x = jnp.ones((3, 5, 64), jnp.float32)
    text = jax.jit(lambda x: top_k(x, 4)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    (line,) = [ln for ln in text.splitlines() if "stablehlo.custom_call @jax_moe_top_k" in ln]
    assert "k = 4 : i64" in line and "(tensor<3x5x64xf32>) -> tensor<3x5x4xi32>" in line


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 32, 33, 64, 100, 128, 256, 300, 512, 777, 1024])
def test_kernel_matches_the_definition(rng, n):
    need_native("cuda")
    x = rng.standard_normal((257, n)).astype(np.float32)
    for k in sorted({1, min(2, n), min(8, n), n}):
        fn = jax.jit(lambda x, k=k: top_k(x, k))
        assert "jax_moe_top_k" in fn.lower(x).as_text()
        assert_same(fn(x), definition(x, k))
    s = special_rows(rng, 300, n)
    assert_same(jax.jit(lambda x: top_k(x, min(8, n)))(s), definition(s, min(8, n)))


@pytest.mark.gpu
def test_kernel_takes_leading_axes_vmap_and_grad(rng):
    need_native("cuda")
    x = rng.standard_normal((5, 16, 8, 32)).astype(np.float32)
    assert_same(jax.jit(lambda x: top_k(x, 2))(x), definition(x, 2))
    got = jax.jit(jax.vmap(lambda x: top_k(x, 3)))(x)
    assert_same(got, definition(x, 3))
    w = rng.standard_normal((5, 16, 8, 2)).astype(np.float32)
    grad = jax.jit(jax.grad(lambda x: (top_k(x, 2)[0] * w).sum()))(x)
    want = jax.grad(lambda x: (jax.lax.top_k(x, 2)[0] * w).sum())(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(want))


@pytest.mark.gpu
def test_pure_jax_routing_on_the_gpu_takes_the_kernel_and_picks_lax_top_ks_experts(rng):
    """The pure-JAX router (what runs past the route kernel's limits): DeepSeek-V3's grouped routing
    (three top-k's) and a plain softmax top-8 on the GPU pick the experts and weights of the
    definition's top-k."""
    need_native("cuda")
    logits = jnp.asarray(rng.standard_normal((512, 256)), jnp.float32)
    bias = jnp.asarray(rng.standard_normal(256) / 10, jnp.float32)
    kw = dict(scoring="sigmoid", num_expert_group=8, topk_group=4, e_score_correction_bias=bias,
              routed_scaling_factor=2.5)
    fn = jax.jit(lambda lg: routing.select_experts_lax(lg, 8, **kw))
    assert fn.lower(logits).as_text().count("jax_moe_top_k") == 3
    w, ids = fn(logits)
    scores = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
    choice = (scores + np.asarray(bias, np.float64)).reshape(512, 8, 32)
    group = np.sort(choice, axis=-1)[..., -2:].sum(-1)
    keep = np.zeros((512, 8), bool)
    np.put_along_axis(keep, np.argsort(-group, axis=-1, kind="stable")[:, :4], True, axis=-1)
    masked = np.where(np.repeat(keep, 32, axis=1), choice.reshape(512, 256), -np.inf)
    want_ids = np.argsort(-masked, axis=-1, kind="stable")[:, :8]
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    sel = np.take_along_axis(scores, want_ids, axis=-1)
    np.testing.assert_allclose(np.asarray(w), 2.5 * sel / sel.sum(-1, keepdims=True), rtol=1e-5)
    w, ids = jax.jit(lambda lg: routing.select_experts_lax(lg, 8))(logits[:, :128])
    np.testing.assert_array_equal(np.asarray(ids), definition(np.asarray(logits[:, :128]), 8)[1])
