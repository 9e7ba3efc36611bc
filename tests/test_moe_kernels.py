"""jax_moe.kernels: the jnp references against independent numpy definitions (kernel_cases.py) and the
argument checks (CPU, everywhere); the shape rules as lowered for CUDA (CPU). The CUDA kernels against
the references: test_moe_kernels_gpu.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import ffi, kernels
from jax_moe.permute import sort_by_expert
from helpers import need_native, np_fp8_per_token, np_moe, random_routing, rel_err
from kernel_cases import (
    CPU_SHAPES, FP8, MINUS_ONE, TINY, assert_same_bytes, dequant, gptoss_case, normal, np_act, np_fp8_static,
    np_permute, np_unpermute, permute_three_ways, pipeline, poison_rows,
)


# ---------------------------------------------------------------- CPU: references vs numpy


@pytest.mark.parametrize("t,k,e,h,i", CPU_SHAPES)
def test_problem_sizes(rng, t, k, e, h, i):
    _, ids = random_routing(rng, t, e, k, experts=range(1, e), minus_one=MINUS_ONE)
    counts = sort_by_expert(ids, e).counts
    c = np.asarray(counts)
    g1, g2 = kernels.problem_sizes(counts, h, i)
    np.testing.assert_array_equal(np.asarray(g1), np.stack([c, np.full(e, 2 * i), np.full(e, h)], 1))
    np.testing.assert_array_equal(np.asarray(g2), np.stack([c, np.full(e, h), np.full(e, i)], 1))
    g1, _ = jax.jit(lambda c: kernels.problem_sizes(c, h, i, gated=False))(counts)
    assert g1.dtype == jnp.int32 and np.asarray(g1)[:, 1].tolist() == [i] * e


@pytest.mark.parametrize("t,k,e,h,i", CPU_SHAPES)
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.slow)])
def test_permute_rows_reference(rng, t, k, e, h, i, minus_one, dtype):
    _, ids = random_routing(rng, t, e, k, minus_one=MINUS_ONE * minus_one)
    sort = sort_by_expert(ids, e)
    valid = int(sort.offsets[-1])
    x = normal(rng, (t, h), dtype)
    want = np_permute(x, sort.sorted_slots, k, valid)
    rows = kernels.permute_rows_reference(x, sort.sorted_slots, k, valid_rows=sort.offsets[-1])
    assert rows.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(rows), want)
    q, s = kernels.permute_rows_reference(x, sort.sorted_slots, k, valid_rows=sort.offsets[-1], quant="fp8_per_token")
    wq, ws = np_fp8_per_token(want.astype(np.float32))
    assert q.dtype == FP8 and s.shape == (t * k,) and s.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(s), ws)
    np.testing.assert_array_equal(np.asarray(q, np.float32), wq)
    assert (np.asarray(s)[valid:] == TINY).all()
    q, s = kernels.permute_rows_reference(x, sort.sorted_slots, k, quant="fp8_static", scale=0.004)
    np.testing.assert_array_equal(np.asarray(q, np.float32),
                                  np_fp8_static(np_permute(x, sort.sorted_slots, k, t * k), 0.004))
    assert float(s) == np.float32(0.004)


@pytest.mark.parametrize("t,k,e,h,i", CPU_SHAPES)
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
def test_permute_rows_reference_in_slot_order_is_the_gather(rng, t, k, e, h, i, minus_one):
    """With the sort's inverse, the rows scattered in slot order (row inverse[s] = x[s // k]) are the
    gathered rows, quantized or not; ids of -1 sort last, at or past valid_rows, and stay zero."""
    _, ids = random_routing(rng, t, e, k, minus_one=MINUS_ONE * minus_one)
    sort = sort_by_expert(ids, e)
    x = normal(rng, (t, h), jnp.bfloat16)
    gathered = permute_three_ways(kernels.permute_rows_reference, x, sort.sorted_slots, k, sort.offsets[-1])
    scattered = permute_three_ways(kernels.permute_rows_reference, x, sort.sorted_slots, k, sort.offsets[-1],
                                   inverse=sort.inverse)
    assert_same_bytes(scattered, gathered)
    assert_same_bytes(permute_three_ways(kernels.permute_rows, x, sort.sorted_slots, k, sort.offsets[-1],
                                         inverse=sort.inverse),
                      gathered)


def test_permute_rows_in_slot_order_by_hand():
    """T=2, k=2: slot s writes x[s // 2] to row inverse[s]; rows at or past valid_rows are zero; a
    position outside [0, T*k) is dropped (-1 does not wrap to the last row)."""
    x = jnp.asarray([[1.0, 2.0], [3.0, 4.0]], jnp.float32)
    slots = jnp.asarray([1, 3, 2, 0], jnp.int32)  # sorted_slots[inverse[s]] == s
    inverse = jnp.asarray([3, 0, 2, 1], jnp.int32)
    rows = kernels.permute_rows_reference(x, slots, 2, valid_rows=3, inverse=inverse)
    np.testing.assert_array_equal(np.asarray(rows), [[1, 2], [3, 4], [3, 4], [0, 0]])
    rows = kernels.permute_rows_reference(x, slots, 2, inverse=jnp.asarray([5, 0, -1, 1], jnp.int32))
    np.testing.assert_array_equal(np.asarray(rows), [[1, 2], [3, 4], [0, 0], [0, 0]])


@pytest.mark.parametrize("m,i", [pytest.param(1, 8, marks=pytest.mark.slow), (37, 7),
                                 pytest.param(300, 64, marks=pytest.mark.slow)])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
def test_act_and_mul_reference(rng, m, i, activation):
    h = normal(rng, (m, 2 * i), jnp.float32, 2.0)
    valid = max(m - 5, 0)
    want = np_act(h, activation, valid)
    got = kernels.act_and_mul_reference(h, activation, valid_rows=jnp.int32(valid))
    assert got.shape == (m, i) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    got = kernels.act_and_mul_reference(h.astype(jnp.bfloat16), activation, valid_rows=valid)
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) < 1e-2
    q, s = kernels.act_and_mul_reference(h, activation, valid_rows=valid, quant="fp8_per_token")
    assert q.dtype == FP8 and s.shape == (m,)
    np.testing.assert_allclose(np.asarray(s), np_fp8_per_token(want.astype(np.float32))[1], rtol=1e-5)
    assert rel_err(dequant(q, s), want) < 5e-2 and (np.asarray(s)[valid:] == TINY).all()
    q, s = kernels.act_and_mul_reference(h, activation, quant="fp8_static", scale=jnp.float32(0.02))
    assert rel_err(dequant(q, s), np.clip(np_act(h, activation, m), -448 * 0.02, 448 * 0.02)) < 5e-2


@pytest.mark.parametrize("t,k,e,h,i", CPU_SHAPES)
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("plain", [False, True], ids=["weighted", "weight-on-input"])
def test_unpermute_reduce_reference(rng, t, k, e, h, i, minus_one, plain):
    w, ids = random_routing(rng, t, e, k, minus_one=MINUS_ONE * minus_one)
    sort = sort_by_expert(ids, e)
    valid = int(sort.offsets[-1])
    y = poison_rows(normal(rng, (t * k, h), jnp.float32), valid)
    got = kernels.unpermute_reduce_reference(y, sort.inverse, w, valid_rows=sort.offsets[-1],
                                             apply_router_weight_on_input=plain)
    want = np_unpermute(y, sort.inverse, w, valid, plain)
    assert got.shape == (t, h) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got = kernels.unpermute_reduce_reference(y.astype(jnp.bfloat16), sort.inverse, w, valid_rows=valid,
                                             apply_router_weight_on_input=plain)
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) < 1e-2


def _gptoss_rows(rng, m, i, e, dtype=jnp.float32):
    """GEMM1-like rows [m, 2I] (some beyond the swigluoai limit), float32 biases [E, 2I] and
    offsets [E+1] with empty experts (first, middle, last), the last expert's rows ending at
    ``valid = offsets[E] < m``."""
    cuts = np.sort(rng.integers(0, m - 2, e - 1))
    offsets = np.concatenate([[0], cuts, [m - 2]]).astype(np.int32)
    offsets[1] = 0  # expert 0 empty
    offsets[e // 2 + 1] = offsets[e // 2]  # a middle expert empty
    offsets = np.maximum.accumulate(offsets)
    h = normal(rng, (m, 2 * i), dtype, 4.0)
    bias = normal(rng, (e, 2 * i), jnp.float32)
    return h, bias, jnp.asarray(offsets), int(offsets[-1])


@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("activation", ["swigluoai", "silu", pytest.param("gelu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_act_and_mul_reference_layouts_biases_and_swigluoai(rng, layout, activation, with_bias):
    """GPT-OSS's expert activation: gate/up split per layout, the row's expert bias added before
    the activation, swigluoai's clamps with other constants than the defaults; FP8 outputs of the
    same values."""
    m, i, e = 41, 12, 6
    h, bias, offsets, valid = _gptoss_rows(rng, m, i, e)
    kw = dict(bias=bias, offsets=offsets) if with_bias else {}
    want = np_act(h, activation, valid, layout, alpha=1.5, limit=3.0, **kw)
    args = dict(valid_rows=jnp.int32(valid), layout=layout, alpha=1.5, limit=3.0, **kw)
    got = kernels.act_and_mul_reference(h, activation, **args)
    assert got.shape == (m, i) and got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with jax.default_device(jax.devices("cpu")[0]):  # act_and_mul lowered for the CPU is the reference
        on_cpu = jax.jit(lambda h: kernels.act_and_mul(h, activation, **args))(h)
        # compiled alike: XLA:CPU's fused erf and its op-by-op erf may differ in the last bit
        reference = jax.jit(lambda h: kernels.act_and_mul_reference(h, activation, **args))(h)
        np.testing.assert_array_equal(np.asarray(on_cpu), np.asarray(reference))
    q, s = kernels.act_and_mul_reference(h, activation, quant="fp8_per_token", **args)
    np.testing.assert_allclose(np.asarray(s), np_fp8_per_token(want.astype(np.float32))[1], rtol=1e-5)
    assert rel_err(dequant(q, s), want) < 5e-2 and (np.asarray(s)[valid:] == TINY).all()
    q, s = kernels.act_and_mul_reference(h, activation, quant="fp8_static", scale=jnp.float32(0.05), **args)
    assert rel_err(dequant(q, s), np.clip(want, -448 * 0.05, 448 * 0.05)) < 5e-2


def test_swigluoai_clamps_and_the_interleaved_order_by_hand():
    """Two rows written out: gate 2i / up 2i+1 when interleaved; gate clamped above only, up both
    ways; the bias added before the clamps."""
    h = jnp.asarray([[10.0, -10.0, 1.0, 2.0], [0.5, 9.0, -8.0, 0.0]], jnp.float32)
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    got = np.asarray(kernels.act_and_mul_reference(h, "swigluoai", layout="interleaved", alpha=1.702, limit=7.0))
    want = [[(-7 + 1) * 7 * sig(1.702 * 7), (2 + 1) * 1 * sig(1.702)],
            [(7 + 1) * 0.5 * sig(1.702 * 0.5), (0 + 1) * -8 * sig(1.702 * -8)]]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    bias = jnp.asarray([[0.0, 0.0, 0.0, 0.0], [-1.0, 1.0, 0.0, 0.0]], jnp.float32)
    got = np.asarray(kernels.act_and_mul_reference(h, "swigluoai", layout="interleaved", bias=bias,
                                                   offsets=jnp.asarray([0, 1, 2], jnp.int32)))
    np.testing.assert_allclose(got[1], [(7 + 1) * -0.5 * sig(1.702 * -0.5), want[1][1]], rtol=1e-6)


@pytest.mark.parametrize("plain", [False, True], ids=["weighted", "weight-on-input"])
def test_unpermute_reduce_reference_with_bias(rng, plain):
    """Each slot's row plus the bias of the row's expert, weighted (or summed); slots of ids -1 and
    the NaN in their rows contribute nothing, bias included."""
    t, k, e, h = 37, 4, 16, 24
    w, ids = random_routing(rng, t, e, k, experts=range(1, e - 1), minus_one=MINUS_ONE)
    sort = sort_by_expert(ids, e)
    valid = int(sort.offsets[-1])
    y = poison_rows(normal(rng, (t * k, h), jnp.float32), valid)
    bias = normal(rng, (e, h), jnp.float32)
    args = dict(valid_rows=sort.offsets[-1], apply_router_weight_on_input=plain, bias=bias, offsets=sort.offsets)
    got = kernels.unpermute_reduce_reference(y, sort.inverse, w, **args)
    want = np_unpermute(y, sort.inverse, w, valid, plain, bias, sort.offsets)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    got = jax.jit(lambda y: kernels.unpermute_reduce(y.astype(jnp.bfloat16), sort.inverse, w, **args))(y)
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) < 1e-2


@pytest.mark.parametrize("minus_one", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("activation", ["silu", pytest.param("gelu", marks=pytest.mark.slow)])
def test_kernels_chain_to_the_moe(rng, minus_one, activation):
    """permute -> GEMM1 -> act_and_mul -> GEMM2 -> unpermute_reduce is the MoE (layout conventions)."""
    t, k, e, h, i = 23, 3, 8, 32, 16
    w, ids = random_routing(rng, t, e, k, experts=range(1, e), minus_one=MINUS_ONE * minus_one)
    x = normal(rng, (t, h), jnp.float32)
    w13 = normal(rng, (e, 2 * i, h), jnp.float32, 1 / math.sqrt(h))
    w2 = normal(rng, (e, h, i), jnp.float32, 1 / math.sqrt(i))
    want = np_moe(x, w13, w2, w, ids, activation)
    assert rel_err(jax.jit(pipeline, static_argnums=5)(x, w13, w2, w, ids, activation), want) < 1e-5
    got = pipeline(x, w13, w2, w, ids, activation, "fp8_per_token")
    assert rel_err(got, want) < 5e-2


@pytest.mark.parametrize("quant", [None, "fp8_per_token"])
def test_kernels_chain_to_the_gptoss_moe(rng, quant):
    """swigluoai on interleaved gate/up with both expert biases, through the kernels: the MoE's
    definition ``sum_j w_j * (W2[e] act(W13[e] x + b13[e]) + b2[e])``, ids of -1 skipped."""
    x, w13, w2, w, ids, b13, b2 = gptoss_case(rng)
    want = np_moe(x, w13, w2, w, ids, "swigluoai", "interleaved", b13, b2)
    got = jax.jit(lambda *a: pipeline(*a[:5], "swigluoai", quant, "interleaved", *a[5:]))(x, w13, w2, w, ids, b13, b2)
    assert rel_err(got, want) < (1e-5 if quant is None else 5e-2)


# ---------------------------------------------------------------- numpy, vmap, non-finite rows


def _chain_case(rng, t=12, k=2, e=4, h=16, i=8):
    w, ids = random_routing(rng, t, e, k, minus_one=MINUS_ONE)
    return (normal(rng, (t, h), jnp.float32), normal(rng, (e, 2 * i, h), jnp.float32, 0.25),
            normal(rng, (e, h, i), jnp.float32, 0.3), w, ids)


@pytest.mark.parametrize("quant", [None, pytest.param("fp8_per_token", marks=pytest.mark.slow)])
def test_kernels_take_numpy_and_batch_under_vmap(rng, quant):
    """Every kernel (the CUDA custom calls declare ``vmap_method="sequential"``; their references
    batch natively) under jax.vmap, and on numpy arrays."""
    cases = [_chain_case(rng) for _ in range(3)]
    stacked = [jnp.stack(parts) for parts in zip(*cases)]
    got = jax.vmap(lambda *a: pipeline(*a, "silu", quant))(*stacked)
    for b, case in enumerate(cases):
        want = pipeline(*case, "silu", quant)
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(want), rtol=1e-6, atol=1e-6)
        np_case = [np.asarray(a) for a in case]
        np.testing.assert_array_equal(np.asarray(pipeline(*np_case, "silu", quant)), np.asarray(want))


@pytest.mark.parametrize("quant", [None, "fp8_per_token"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_token_stays_in_its_own_rows(rng, quant, bad):
    x, w13, w2, w, ids = _chain_case(rng)
    ids = ids.at[4].set(jnp.array([1, 2], jnp.int32))
    want = np.asarray(pipeline(x, w13, w2, w, ids, "silu", quant))
    got = np.asarray(pipeline(x.at[4, 3].set(bad), w13, w2, w, ids, "silu", quant))
    assert not np.isfinite(got[4]).all()
    np.testing.assert_array_equal(np.delete(got, 4, 0), np.delete(want, 4, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "fp8_per_token"])
def test_cuda_kernels_under_vmap(rng, quant):
    need_native("cuda")
    ids = jnp.stack([random_routing(rng, 40, 16, 4, minus_one=MINUS_ONE)[1] for _ in range(2)])
    x = jnp.stack([normal(rng, (40, 256), jnp.bfloat16) for _ in range(2)])

    def step(x, ids):  # jax_moe.permute's sort: ffi.sort_by_expert declares no vmap_method
        s = sort_by_expert(ids, 16)
        return kernels.permute_rows(x, s.sorted_slots, 4, valid_rows=s.offsets[-1], quant=quant)

    got = jax.jit(jax.vmap(step))(x, ids)
    for b in range(2):
        want = jax.jit(step)(x[b], ids[b])
        for g, wnt in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(g[b], np.float32), np.asarray(wnt, np.float32))


# ---------------------------------------------------------------- CPU: argument checks


def test_bad_arguments_raise_before_lowering():
    x, slots = jnp.zeros((4, 8), jnp.bfloat16), jnp.zeros((8,), jnp.int32)
    h, y = jnp.zeros((8, 6), jnp.bfloat16), jnp.zeros((8, 8), jnp.bfloat16)
    w, inv = jnp.zeros((4, 2), jnp.float32), jnp.zeros((8,), jnp.int32)
    b6, b8, off = jnp.zeros((3, 6), jnp.float32), jnp.zeros((3, 8), jnp.float32), jnp.asarray([0, 2, 5, 8], jnp.int32)
    cases = [
        (lambda: kernels.problem_sizes(jnp.zeros((4,), jnp.float32), 8, 4), "counts must have dtype"),
        (lambda: kernels.problem_sizes(jnp.zeros((4, 1), jnp.int32), 8, 4), "counts must have rank 1"),
        (lambda: kernels.problem_sizes(jnp.zeros((4,), jnp.int32), 0, 4), "hidden_size must be an int"),
        (lambda: kernels.problem_sizes(jnp.zeros((4,), jnp.int32), 8, 2.0), "intermediate_size must be an int"),
        (lambda: kernels.permute_rows(x[0], slots, 2), "x must have rank 2"),
        (lambda: kernels.permute_rows(x.astype(jnp.int32), slots, 2), "x must have dtype"),
        (lambda: kernels.permute_rows(x, slots.astype(jnp.float32), 2), "sorted_slots must have dtype"),
        (lambda: kernels.permute_rows(x, slots, 3), "sorted_slots must have T\\*k = 12"),
        (lambda: kernels.permute_rows(x, slots, 0), "top_k must be an int >= 1"),
        (lambda: kernels.permute_rows(x, slots, 2, quant="fp8"), "quant must be one of"),
        (lambda: kernels.permute_rows(x, slots, 2, quant="fp8_static"), "scale is required"),
        (lambda: kernels.permute_rows(x, slots, 2, quant="fp8_static", scale=jnp.ones(3)), "scale must have one"),
        (lambda: kernels.permute_rows(x, slots, 2, scale=1.0), "scale is only taken"),
        (lambda: kernels.permute_rows(x, slots, 2, valid_rows=jnp.zeros((2,), jnp.int32)), "valid_rows must be"),
        (lambda: kernels.permute_rows(x, slots, 2, valid_rows=jnp.float32(3)), "valid_rows must be"),
        (lambda: kernels.permute_rows(x, slots, 2, inverse=inv[:7]), "inverse must have T\\*k = 8 elements, got 7"),
        (lambda: kernels.permute_rows(x, slots, 2, inverse=inv[None]), "inverse must have rank 1"),
        (lambda: kernels.permute_rows(x, slots, 2, inverse=inv.astype(jnp.uint32)), "inverse must have dtype"),
        (lambda: kernels.permute_rows(x, slots, 2, inverse=[0] * 8), "inverse must be an array"),
        (lambda: kernels.permute_rows_reference(x, slots, 2, inverse=inv[:7]), "inverse must have T\\*k = 8"),
        (lambda: kernels.act_and_mul(h[:, :5], "silu"), "h must have an even"),
        (lambda: kernels.act_and_mul(h[0], "silu"), "h must have rank 2"),
        (lambda: kernels.act_and_mul(h, "relu2"), "activation must be one of"),
        (lambda: kernels.act_and_mul(h, "silu", out_dtype=jnp.int8), "out_dtype must be one of"),
        (lambda: kernels.act_and_mul(h, "silu", quant="fp8_per_token", out_dtype=jnp.bfloat16), "do not pass"),
        (lambda: kernels.unpermute_reduce(y[0], inv, w), "y must have rank 2"),
        (lambda: kernels.unpermute_reduce(y, inv[:7], w), "inverse must have T\\*k = 8"),
        (lambda: kernels.unpermute_reduce(y, inv, w.astype(jnp.int32)), "topk_weights must have dtype"),
        (lambda: kernels.unpermute_reduce(y, inv.astype(jnp.uint32), w), "inverse must have dtype"),
        (lambda: kernels.unpermute_reduce(y, inv, w[:, :, None]), "topk_weights must have rank 2"),
        (lambda: kernels.unpermute_reduce(y, inv, w, out_dtype=jnp.float8_e4m3fn), "out_dtype must be one of"),
        (lambda: kernels.act_and_mul(h, "silu", layout="alternate"), "layout must be one of"),
        (lambda: kernels.act_and_mul(h, "swigluoai", alpha=0.0), "alpha must be a finite number > 0"),
        (lambda: kernels.act_and_mul(h, "swigluoai", limit=float("nan")), "limit must be a finite number > 0"),
        (lambda: kernels.act_and_mul(h, "silu", bias=b6), "offsets is required with bias"),
        (lambda: kernels.act_and_mul(h, "silu", offsets=off), "offsets is only taken with bias"),
        (lambda: kernels.act_and_mul(h, "silu", bias=b6[:, :4], offsets=off), r"bias must have shape \[E, 2I\] = \[E, 6\]"),
        (lambda: kernels.act_and_mul(h, "silu", bias=b6.astype(jnp.bfloat16), offsets=off), "bias must have dtype"),
        (lambda: kernels.act_and_mul(h, "silu", bias=b6[0], offsets=off), "bias must have rank 2"),
        (lambda: kernels.act_and_mul(h, "silu", bias=b6, offsets=off[:3]), "offsets must have E \\+ 1 = 4"),
        (lambda: kernels.act_and_mul(h, "silu", bias=b6, offsets=off.astype(jnp.float32)), "offsets must have dtype"),
        (lambda: kernels.unpermute_reduce(y, inv, w, bias=b8), "offsets is required with bias"),
        (lambda: kernels.unpermute_reduce(y, inv, w, bias=b8[:, :6], offsets=off), r"bias must have shape \[E, H\]"),
        (lambda: kernels.unpermute_reduce(y, inv, w, bias=b8.astype(jnp.float16), offsets=off), "bias must have dtype"),
        (lambda: kernels.unpermute_reduce(y, inv, w, bias=b8, offsets=off[None]), "offsets must have rank 1"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match):
            call()


def test_empty_batch():
    x, slots = jnp.zeros((0, 8), jnp.bfloat16), jnp.zeros((0,), jnp.int32)
    assert kernels.permute_rows(x, slots, 2).shape == (0, 8)
    q, s = kernels.permute_rows(x, slots, 2, quant="fp8_per_token")
    assert q.shape == (0, 8) and s.shape == (0,)
    q, s = kernels.permute_rows(x, slots, 2, quant="fp8_per_token", inverse=slots)
    assert q.shape == (0, 8) and s.shape == (0,)
    assert kernels.act_and_mul(jnp.zeros((0, 8), jnp.float32), "gelu").shape == (0, 4)
    out = kernels.unpermute_reduce(jnp.zeros((0, 8), jnp.bfloat16), slots, jnp.zeros((0, 2), jnp.float32))
    assert out.shape == (0, 8) and out.dtype == jnp.bfloat16


# ---------------------------------------------------------------- CPU: shape rules as lowered for CUDA


def _custom_calls(fn, *args) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in text.splitlines() if "stablehlo.custom_call @jax_moe_" in line]


def test_shape_rules_lower_for_cuda(monkeypatch):
    """With the CUDA module taken as registered, each wrapper lowers to its custom call with the
    operand and result types the handlers check (ffi/kernels/moe_prepare_finalize.h)."""
    monkeypatch.setattr(ffi, "has_native", lambda kind: kind == "cuda")
    x, slots, v = jnp.ones((5, 16), jnp.bfloat16), jnp.arange(10, dtype=jnp.int32), jnp.int32(7)
    (line,) = _custom_calls(lambda x, s, v: kernels.permute_rows(x, s, 2, valid_rows=v, quant="fp8_per_token"),
                            x, slots, v)
    assert "@jax_moe_permute_rows" in line and "quant = 1 : i64, top_k = 2 : i64" in line
    assert ("(tensor<5x16xbf16>, tensor<10xi32>, tensor<0xi32>, tensor<1xi32>, tensor<0xf32>) -> "
            "(tensor<10x16xf8E4M3FN>, tensor<10xf32>)") in line  # no inverse: an empty one (gather order)
    (line,) = _custom_calls(lambda x, s, v: kernels.permute_rows(x, s, 2, valid_rows=v, inverse=s), x, slots, v)
    assert "(tensor<5x16xbf16>, tensor<10xi32>, tensor<10xi32>, tensor<1xi32>, tensor<0xf32>) -> " in line
    (line,) = _custom_calls(lambda x, s: kernels.permute_rows(x, s, 2, quant="fp8_static", scale=0.5), x, slots)
    assert "tensor<0xf32>) ->" not in line and "tensor<1xf32>) -> (tensor<10x16xf8E4M3FN>, tensor<0xf32>)" in line
    (line,) = _custom_calls(lambda x, s: kernels.permute_rows(x, s, 2), x, slots)
    assert "-> (tensor<10x16xbf16>, tensor<0xf32>)" in line
    h = jnp.ones((10, 12), jnp.float32)
    (line,) = _custom_calls(lambda h: kernels.act_and_mul(h, "gelu", out_dtype=jnp.bfloat16), h)
    assert "@jax_moe_act_and_mul" in line and "activation = 1 : i64, alpha = 1.702000e+00 : f32, layout = 0 : i64" in line
    assert ("(tensor<10x12xf32>, tensor<1xi32>, tensor<0xf32>, tensor<0xf32>, tensor<0xi32>) -> "
            "(tensor<10x6xbf16>, tensor<0xf32>)") in line  # no bias: empty bias and offsets
    (line,) = _custom_calls(lambda h: kernels.act_and_mul(h, "silu", quant="fp8_per_token"), h)
    assert "-> (tensor<10x6xf8E4M3FN>, tensor<10xf32>)" in line
    b13, off = jnp.ones((3, 12), jnp.float32), jnp.asarray([0, 4, 4, 10], jnp.int32)
    (line,) = _custom_calls(lambda h, b, o: kernels.act_and_mul(h, "swigluoai", layout="interleaved", alpha=1.5,
                                                               limit=3.0, bias=b, offsets=o), h, b13, off)
    assert ("activation = 2 : i64, alpha = 1.500000e+00 : f32, layout = 1 : i64, limit = 3.000000e+00 : f32, "
            "quant = 0 : i64") in line
    assert ("(tensor<10x12xf32>, tensor<1xi32>, tensor<0xf32>, tensor<3x12xf32>, tensor<4xi32>) -> "
            "(tensor<10x6xf32>, tensor<0xf32>)") in line
    y, w = jnp.ones((10, 16), jnp.bfloat16), jnp.ones((5, 2), jnp.bfloat16)
    (line,) = _custom_calls(lambda y, i, w: kernels.unpermute_reduce(y, i, w, apply_router_weight_on_input=True,
                                                                     out_dtype=jnp.float32), y, slots, w)
    assert "@jax_moe_unpermute_reduce" in line and "weighted = 0 : i64" in line
    assert ("(tensor<10x16xbf16>, tensor<10xi32>, tensor<5x2xf32>, tensor<1xi32>, tensor<0xf32>, tensor<0xi32>) "
            "-> tensor<5x16xf32>") in line
    b2 = jnp.ones((3, 16), jnp.float32)
    (line,) = _custom_calls(lambda y, i, w, b, o: kernels.unpermute_reduce(y, i, w, bias=b, offsets=o),
                            y, slots, w, b2, off)
    assert "tensor<1xi32>, tensor<3x16xf32>, tensor<4xi32>) -> tensor<5x16xbf16>" in line
