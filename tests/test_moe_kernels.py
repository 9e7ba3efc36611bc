"""jax_moe.kernels: the jnp references against independent numpy definitions and the argument
checks (CPU, everywhere); the shape rules as lowered for CUDA (CPU); the CUDA kernels against
the references (``gpu``)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import ffi, kernels
from jax_moe.permute import sort_by_expert
from helpers import need_native, np_activation, np_fp8_per_token, np_moe, poison_memory, random_routing, rel_err

FP8 = jnp.float8_e4m3fn
TINY = np.float32(np.finfo(np.float32).tiny)

# (T, k, E, H, I): T=1, T not a multiple of anything, an odd number of rows (T*k = 3: the row kernels
# run four rows per block), E=256/k=8, H and I not multiples of 8 (scalar path), DeepSeek-V3-like rows
# (7168 columns: several vector batches per lane).
SHAPES = [(3, 1, 4, 128, 64), (1, 8, 256, 256, 128), (37, 2, 8, 203, 77), (300, 8, 256, 512, 256),
          (999, 4, 64, 1024, 384), (256, 8, 256, 7168, 512)]
MINUS_ONE = 0.2  # with minus_one: the fraction of ids set to -1 (slots of experts on other devices)
CPU_SHAPES = [pytest.param(1, 1, 4, 16, 8, marks=pytest.mark.slow), (1, 8, 256, 32, 16), (37, 2, 8, 24, 7),
              pytest.param(129, 8, 256, 64, 40, marks=pytest.mark.slow)]


# ---------------------------------------------------------------- data


def normal(rng, shape, dtype, scale=1.0):
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def poison_rows(a, start: int):
    """NaN in every row at or past ``start`` (what a GEMM may leave in rows it never wrote)."""
    return a.at[start:].set(jnp.nan)


# ---------------------------------------------------------------- numpy definitions


def np_fp8_static(v, scale):
    inv = np.float32(1) / np.float32(scale)
    return np.clip(np.asarray(v, np.float32) * inv, -448, 448).astype(FP8).astype(np.float32)


def np_permute(x, slots, k, valid):
    x, slots = np.asarray(x), np.asarray(slots)
    out = np.zeros((slots.shape[0], x.shape[1]), x.dtype)
    for r, s in enumerate(slots):
        if r < valid:
            out[r] = x[s // k]
    return out


def np_act(h, activation, valid, layout="concat", bias=None, offsets=None, alpha=1.702, limit=7.0):
    """act_and_mul's definition in float64: the gated activation of each row (plus the bias of the
    row's expert, the e with offsets[e] <= r < offsets[e+1]), rows at or past ``valid`` zero."""
    h = np.array(h, np.float64)
    if bias is not None:
        h = h + np.asarray(bias, np.float64)[np_expert_of_rows(offsets, h.shape[0])]
    a = np_activation(h, activation, layout, alpha, limit)
    a[valid:] = 0.0
    return a


def np_expert_of_rows(offsets, rows):
    """Row r's expert: the e with offsets[e] <= r < offsets[e+1] (a loop over the experts); rows
    outside every expert get expert 0 (their values are never used)."""
    offsets = np.asarray(offsets)
    out = np.zeros(rows, np.int64)
    for e in range(len(offsets) - 1):
        out[offsets[e]:offsets[e + 1]] = e
    return out


def np_unpermute(y, inverse, w, valid, plain, bias=None, offsets=None):
    y, inverse, w = np.asarray(y, np.float64), np.asarray(inverse), np.asarray(w, np.float64)
    t, k = w.shape
    expert = None if bias is None else np_expert_of_rows(offsets, y.shape[0])
    out = np.zeros((t, y.shape[1]))
    for s in range(t * k):
        row = inverse[s]
        if 0 <= row < valid:
            b = 0.0 if bias is None else np.asarray(bias, np.float64)[expert[row]]
            out[s // k] += (1.0 if plain else w[s // k, s % k]) * (y[row] + b)
    return out


def dequant(q, s):
    """float32 values of FP8 rows with per-row (or one) scales (jnp: traceable under vmap/jit)."""
    s = jnp.asarray(s, jnp.float32)
    return jnp.asarray(q).astype(jnp.float32) * (s[:, None] if s.ndim else s)


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


def permute_three_ways(permute, x, sorted_slots, k, valid, **slot_order):
    """permute_rows (or its reference) without quantization, with FP8 per token and FP8 static
    (scale 0.004): [rows, (q, scales), (q, scale)]."""
    args = (x, sorted_slots, k)
    return [permute(*args, valid_rows=valid, **slot_order),
            permute(*args, valid_rows=valid, quant="fp8_per_token", **slot_order),
            permute(*args, valid_rows=valid, quant="fp8_static", scale=0.004, **slot_order)]


def assert_same_bytes(got, want):
    """Equal pytrees of arrays, compared byte for byte (a NaN equals nothing, not even a NaN)."""
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.atleast_1d(np.asarray(g)), np.atleast_1d(np.asarray(w))
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))


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
        reference = kernels.act_and_mul_reference(h, activation, **args)
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


def _grouped_gemm(rows, w, offsets):
    """rows [M, K] @ w[expert of row].T in float32; rows past offsets[E] get expert 0 (unused)."""
    e = w.shape[0]
    expert = jnp.clip(jnp.searchsorted(offsets, jnp.arange(rows.shape[0]), side="right") - 1, 0, e - 1)
    return jnp.einsum("mk,mnk->mn", rows.astype(jnp.float32), w[expert].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def _pipeline(x, w13, w2, w, ids, activation, quant=None, layout="concat", b13=None, b2=None):
    """The kernels chained with a jnp grouped GEMM, as a CUTLASS backend will chain them (with
    ``b13``/``b2``: the expert biases through act_and_mul and unpermute_reduce)."""
    t, k = ids.shape
    sort = ffi_or_jnp_sort(ids, w13.shape[0])
    valid = sort.offsets[-1]
    a1 = kernels.permute_rows(x, sort.sorted_slots, k, valid_rows=valid, quant=quant)
    a1 = dequant(*a1) if quant else a1
    h1 = _grouped_gemm(jnp.asarray(a1), w13, sort.offsets)
    bias13 = {} if b13 is None else dict(bias=b13, offsets=sort.offsets)
    a2 = kernels.act_and_mul(h1, activation, valid_rows=valid, quant=quant, layout=layout, **bias13)
    a2 = dequant(*a2) if quant else a2
    y = _grouped_gemm(jnp.asarray(a2), w2, sort.offsets).astype(x.dtype)
    bias2 = {} if b2 is None else dict(bias=b2, offsets=sort.offsets)
    return kernels.unpermute_reduce(y, sort.inverse, w, valid_rows=valid, **bias2)


def ffi_or_jnp_sort(ids, e):
    return ffi.sort_by_expert(ids, e) if ffi.has_native("cuda") else sort_by_expert(ids, e)


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
    assert rel_err(jax.jit(_pipeline, static_argnums=5)(x, w13, w2, w, ids, activation), want) < 1e-5
    got = _pipeline(x, w13, w2, w, ids, activation, "fp8_per_token")
    assert rel_err(got, want) < 5e-2


def _gptoss_case(rng, t=29, k=4, e=8, h=32, i=16):
    w, ids = random_routing(rng, t, e, k, experts=range(1, e), minus_one=MINUS_ONE)
    x = normal(rng, (t, h), jnp.float32)
    w13 = normal(rng, (e, 2 * i, h), jnp.float32, 1 / math.sqrt(h))
    w2 = normal(rng, (e, h, i), jnp.float32, 1 / math.sqrt(i))
    return x, w13, w2, w, ids, normal(rng, (e, 2 * i), jnp.float32), normal(rng, (e, h), jnp.float32)


@pytest.mark.parametrize("quant", [None, "fp8_per_token"])
def test_kernels_chain_to_the_gptoss_moe(rng, quant):
    """swigluoai on interleaved gate/up with both expert biases, through the kernels: the MoE's
    definition ``sum_j w_j * (W2[e] act(W13[e] x + b13[e]) + b2[e])``, ids of -1 skipped."""
    x, w13, w2, w, ids, b13, b2 = _gptoss_case(rng)
    want = np_moe(x, w13, w2, w, ids, "swigluoai", "interleaved", b13, b2)
    got = jax.jit(lambda *a: _pipeline(*a[:5], "swigluoai", quant, "interleaved", *a[5:]))(x, w13, w2, w, ids, b13, b2)
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
    got = jax.vmap(lambda *a: _pipeline(*a, "silu", quant))(*stacked)
    for b, case in enumerate(cases):
        want = _pipeline(*case, "silu", quant)
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(want), rtol=1e-6, atol=1e-6)
        np_case = [np.asarray(a) for a in case]
        np.testing.assert_array_equal(np.asarray(_pipeline(*np_case, "silu", quant)), np.asarray(want))


@pytest.mark.parametrize("quant", [None, "fp8_per_token"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_token_stays_in_its_own_rows(rng, quant, bad):
    x, w13, w2, w, ids = _chain_case(rng)
    ids = ids.at[4].set(jnp.array([1, 2], jnp.int32))
    want = np.asarray(_pipeline(x, w13, w2, w, ids, "silu", quant))
    got = np.asarray(_pipeline(x.at[4, 3].set(bad), w13, w2, w, ids, "silu", quant))
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


# ---------------------------------------------------------------- GPU: CUDA kernels vs references


def run_twice(fn, *args, target: str):
    """jit(fn)(*args) twice on poisoned memory; checks that the CUDA custom call is what runs and
    that both runs agree."""
    f = jax.jit(fn)
    assert f"@{target}" in f.lower(*args).as_text(), f"{target} is not in the lowered module"
    shapes = jax.eval_shape(f, *args)
    poison_memory(shapes)
    first = f(*args)
    poison_memory(shapes)
    second = f(*args)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    return first


def gpu_case(rng, t, k, e, minus_one):
    # experts 0 and 1: no tokens
    w, ids = random_routing(rng, t, e, k, experts=range(min(2, e - k), e), minus_one=MINUS_ONE * minus_one)
    sort = ffi.sort_by_expert(ids, e)
    return sort, w, int(sort.offsets[-1])


def check_fp8(q, s, ref_q, ref_s, valid, scale_rtol=1e-6):
    """FP8 rows and scales against the reference's: dequantized within 5e-2, rows past ``valid``
    zero with the smallest scale. Returns the fraction of FP8 values equal to the reference's."""
    q32, ref32 = np.asarray(q, np.float32), np.asarray(ref_q, np.float32)
    assert np.isfinite(q32).all() and np.isfinite(np.asarray(s)).all()
    assert rel_err(dequant(q, s), dequant(ref_q, ref_s)) < 5e-2
    if np.ndim(s):
        np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), rtol=scale_rtol)
        assert (np.asarray(s)[valid:] == TINY).all()
    assert (q32[valid:] == 0).all()
    return float(np.mean(q32 == ref32))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_permute_rows(rng, t, k, e, h, i, minus_one, dtype):
    need_native("cuda")
    sort, _, valid = gpu_case(rng, t, k, e, minus_one)
    x = normal(rng, (t, h), dtype, 3.0)
    v = sort.offsets[-1]
    rows = run_twice(lambda x, s, v: kernels.permute_rows(x, s, k, valid_rows=v), x, sort.sorted_slots, v,
                     target="jax_moe_permute_rows")
    ref = kernels.permute_rows_reference(x, sort.sorted_slots, k, valid_rows=v)
    assert rows.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(ref, np.float32))
    q, s = run_twice(lambda x, s, v: kernels.permute_rows(x, s, k, valid_rows=v, quant="fp8_per_token"),
                     x, sort.sorted_slots, v, target="jax_moe_permute_rows")
    same = check_fp8(q, s, *kernels.permute_rows_reference(x, sort.sorted_slots, k, valid_rows=v,
                                                           quant="fp8_per_token"), valid)
    assert same > 0.999, f"only {same:.4f} of the FP8 bytes equal the reference's"
    scale = jnp.float32(0.01)
    q, s = run_twice(lambda x, s: kernels.permute_rows(x, s, k, quant="fp8_static", scale=scale),
                     x, sort.sorted_slots, target="jax_moe_permute_rows")
    check_fp8(q, s, *kernels.permute_rows_reference(x, sort.sorted_slots, k, quant="fp8_static", scale=scale),
              t * k)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h", [(1, 1, 4, 128), (257, 1, 8, 203), (37, 7, 16, 256), (4096, 8, 128, 2048)],
                         ids=["rows-1", "rows-257-scalar", "rows-259", "qwen3-rows-32768"])
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_permute_rows_in_slot_order(rng, t, k, e, h, minus_one, dtype):
    """With the sort's inverse the kernel runs one warp per slot, in slot order: its rows and scales
    are the gather-order kernel's, byte for byte, on freshly poisoned outputs, and the reference's."""
    need_native("cuda")
    sort, _, valid = gpu_case(rng, t, k, e, minus_one)
    x = normal(rng, (t, h), dtype, 3.0)
    v = sort.offsets[-1]

    def permute(x, slots, v, inverse):
        return permute_three_ways(kernels.permute_rows, x, slots, k, v, inverse=inverse)

    slot_order = run_twice(permute, x, sort.sorted_slots, v, sort.inverse, target="jax_moe_permute_rows")
    gather_order = run_twice(lambda x, s, v: permute(x, s, v, None), x, sort.sorted_slots, v,
                             target="jax_moe_permute_rows")
    assert_same_bytes(slot_order, gather_order)
    rows, (q, s), (qs, ss) = slot_order
    ref_rows, ref_tok, ref_static = permute_three_ways(kernels.permute_rows_reference, x, sort.sorted_slots, k, v,
                                                       inverse=sort.inverse)
    assert_same_bytes(rows, ref_rows)
    same = check_fp8(q, s, *ref_tok, valid)
    assert same > 0.999, f"only {same:.4f} of the FP8 bytes equal the reference's"
    check_fp8(qs, ss, *ref_static, valid)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e30])
def test_cuda_fp8_rows_quantize_a_nonfinite_value_as_the_reference(rng, bad):
    """FP8 rows as jax_moe.quant.fp8 defines them: a NaN or an infinity becomes NaN (never a
    plausible +-448), a finite overflow saturates to +-448, and per token the scale is the amax of
    the finite values, so the bad value's neighbours keep theirs."""
    need_native("cuda")
    t, k, e, h = 16, 2, 8, 256
    sort, _, _ = gpu_case(rng, t, k, e, False)
    x = normal(rng, (t, h), "bfloat16", 3.0).at[5, 17].set(bad)
    h2 = normal(rng, (t * k, 2 * h), "bfloat16", 2.0).at[3, h + 9].set(bad)  # an up value
    cases = [(kernels.permute_rows, kernels.permute_rows_reference, (x, sort.sorted_slots, k), "jax_moe_permute_rows"),
             (kernels.act_and_mul, kernels.act_and_mul_reference, (h2, "silu"), "jax_moe_act_and_mul")]
    for quant, scale in (("fp8_static", jnp.float32(0.01)), ("fp8_per_token", None)):
        for fn, ref_fn, (a, *rest), target in cases:
            q, s = run_twice(lambda a: fn(a, *rest, quant=quant, scale=scale), a, target=target)
            ref_q, ref_s = ref_fn(a, *rest, quant=quant, scale=scale)
            q32, ref32 = np.asarray(q, np.float32), np.asarray(ref_q, np.float32)
            np.testing.assert_array_equal(np.isnan(q32), np.isnan(ref32))
            assert np.isnan(q32).any() == bool(np.isnan(bad) or np.isinf(bad))
            assert np.mean(q32[~np.isnan(q32)] == ref32[~np.isnan(ref32)]) > 0.99
            np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), rtol=1e-6)
            if quant == "fp8_static" and bad == 1e30:
                assert np.abs(q32).max() == 448.0


@pytest.mark.gpu
def test_cuda_permute_rows_rejects_an_inverse_of_the_wrong_size():
    """The handler's own check (before any launch): inverse has T*k elements or none."""
    need_native("cuda")
    x, slots = jnp.ones((4, 8), jnp.bfloat16), jnp.arange(8, dtype=jnp.int32)
    call = jax.ffi.ffi_call("jax_moe_permute_rows", [jax.ShapeDtypeStruct((8, 8), jnp.bfloat16),
                                                     jax.ShapeDtypeStruct((0,), jnp.float32)])
    with pytest.raises(Exception, match=r"permute_rows: inverse must have T\*k elements"):
        jax.block_until_ready(call(x, slots, slots[:7], jnp.full((1,), 8, jnp.int32), jnp.zeros((0,), jnp.float32),
                                   top_k=2, quant=0))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_act_and_mul(rng, t, k, e, h, i, minus_one, activation, dtype):
    need_native("cuda")
    sort, _, valid = gpu_case(rng, t, k, e, minus_one)
    v = sort.offsets[-1]
    hin = poison_rows(normal(rng, (t * k, 2 * i), dtype, 2.0), valid)
    for out_dtype in (None, jnp.float32, jnp.bfloat16):
        out = run_twice(lambda h, v: kernels.act_and_mul(h, activation, valid_rows=v, out_dtype=out_dtype), hin, v,
                        target="jax_moe_act_and_mul")
        ref = kernels.act_and_mul_reference(hin, activation, valid_rows=v, out_dtype=out_dtype)
        assert out.dtype == ref.dtype
        # XLA's exp/erf and CUDA's expf/erff differ in the last bits
        assert rel_err(out, ref) < (1e-2 if ref.dtype == jnp.bfloat16 else 1e-4)
        assert (np.asarray(out, np.float32)[valid:] == 0).all()
    q, s = run_twice(lambda h, v: kernels.act_and_mul(h, activation, valid_rows=v, quant="fp8_per_token"), hin, v,
                     target="jax_moe_act_and_mul")
    check_fp8(q, s, *kernels.act_and_mul_reference(hin, activation, valid_rows=v, quant="fp8_per_token"), valid,
              scale_rtol=1e-4)
    scale = jnp.float32(0.02)
    q, s = run_twice(lambda h, v: kernels.act_and_mul(h, activation, valid_rows=v, quant="fp8_static", scale=scale),
                     hin, v, target="jax_moe_act_and_mul")
    check_fp8(q, s, *kernels.act_and_mul_reference(hin, activation, valid_rows=v, quant="fp8_static", scale=scale),
              valid)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("plain", [False, True], ids=["weighted", "weight-on-input"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_unpermute_reduce(rng, t, k, e, h, i, minus_one, plain, dtype):
    need_native("cuda")
    sort, w, valid = gpu_case(rng, t, k, e, minus_one)
    v = sort.offsets[-1]
    y = poison_rows(normal(rng, (t * k, h), dtype), valid)
    for out_dtype in (None, jnp.float32, jnp.bfloat16):
        out = run_twice(lambda y, i, w, v: kernels.unpermute_reduce(y, i, w, valid_rows=v, out_dtype=out_dtype,
                                                                    apply_router_weight_on_input=plain),
                        y, sort.inverse, w, v, target="jax_moe_unpermute_reduce")
        ref = kernels.unpermute_reduce_reference(y, sort.inverse, w, valid_rows=v, out_dtype=out_dtype,
                                                 apply_router_weight_on_input=plain)
        assert out.dtype == ref.dtype and out.shape == (t, h)
        # float32: the reference's reduce is an einsum, which may run in TF32 on the GPU
        assert rel_err(out, ref) < (2e-3 if ref.dtype == jnp.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_act_and_mul_layouts_biases_and_swigluoai(rng, t, k, e, h, i, layout, activation, dtype):
    """GPT-OSS's activation on the CUDA kernel: each row's expert bias (binary search over the
    offsets; experts 0 and 1 empty), both layouts, swigluoai with non-default constants and
    values past its limit, every output mode; NaN rows past valid_rows stay zero."""
    need_native("cuda")
    sort, _, valid = gpu_case(rng, t, k, e, True)
    v, off = sort.offsets[-1], sort.offsets
    hin = poison_rows(normal(rng, (t * k, 2 * i), dtype, 4.0), valid)
    bias = normal(rng, (e, 2 * i), jnp.float32)
    kw = dict(layout=layout, alpha=1.5, limit=5.0)
    want = np_act(np.asarray(hin, np.float32), activation, valid, layout, bias, off, alpha=1.5, limit=5.0)
    for out_dtype in (None, jnp.float32):
        out = run_twice(lambda h, v, b, o: kernels.act_and_mul(h, activation, valid_rows=v, out_dtype=out_dtype,
                                                               bias=b, offsets=o, **kw),
                        hin, v, bias, off, target="jax_moe_act_and_mul")
        ref = kernels.act_and_mul_reference(hin, activation, valid_rows=v, out_dtype=out_dtype, bias=bias,
                                            offsets=off, **kw)
        assert out.dtype == ref.dtype
        assert rel_err(out, ref) < (1e-2 if ref.dtype == jnp.bfloat16 else 1e-4)
        assert rel_err(out, want) < (1e-2 if ref.dtype == jnp.bfloat16 else 1e-4)
        assert (np.asarray(out, np.float32)[valid:] == 0).all()
    out = run_twice(lambda h, v: kernels.act_and_mul(h, activation, valid_rows=v, **kw), hin, v,
                    target="jax_moe_act_and_mul")  # no bias
    assert rel_err(out, kernels.act_and_mul_reference(hin, activation, valid_rows=v, **kw)) < 1e-2
    for quant, scale in (("fp8_per_token", None), ("fp8_static", jnp.float32(0.05))):
        args = dict(valid_rows=v, quant=quant, scale=scale, bias=bias, offsets=off, **kw)
        q, s = run_twice(lambda h: kernels.act_and_mul(h, activation, **args), hin, target="jax_moe_act_and_mul")
        check_fp8(q, s, *kernels.act_and_mul_reference(hin, activation, **args), valid, scale_rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("plain", [False, True], ids=["weighted", "weight-on-input"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_unpermute_reduce_with_bias(rng, t, k, e, h, i, plain, dtype):
    """The GEMM2 bias of each slot's expert added to its row before the weight; slots of ids -1
    (NaN rows) skipped, bias included."""
    need_native("cuda")
    sort, w, valid = gpu_case(rng, t, k, e, True)
    v, off = sort.offsets[-1], sort.offsets
    y = poison_rows(normal(rng, (t * k, h), dtype), valid)
    bias = normal(rng, (e, h), jnp.float32)
    want = np_unpermute(np.asarray(y, np.float32), sort.inverse, w, valid, plain, bias, off)
    for out_dtype in (None, jnp.float32):
        out = run_twice(lambda y, i, w, v, b, o: kernels.unpermute_reduce(
            y, i, w, valid_rows=v, out_dtype=out_dtype, apply_router_weight_on_input=plain, bias=b, offsets=o),
            y, sort.inverse, w, v, bias, off, target="jax_moe_unpermute_reduce")
        ref = kernels.unpermute_reduce_reference(y, sort.inverse, w, valid_rows=v, out_dtype=out_dtype,
                                                 apply_router_weight_on_input=plain, bias=bias, offsets=off)
        assert out.dtype == ref.dtype and out.shape == (t, h)
        tol = 2e-3 if ref.dtype == jnp.float32 else 1e-2
        assert rel_err(out, ref) < tol and rel_err(out, want) < tol


@pytest.mark.gpu
def test_cuda_kernels_chain_to_the_gptoss_moe(rng):
    need_native("cuda")
    x, w13, w2, w, ids, b13, b2 = _gptoss_case(rng, t=77, k=4, e=16, h=256, i=128)
    want = np_moe(x, w13, w2, w, ids, "swigluoai", "interleaved", b13, b2)
    f = jax.jit(lambda *a: _pipeline(*a[:5], "swigluoai", None, "interleaved", *a[5:]))
    assert rel_err(f(x, w13, w2, w, ids, b13, b2), want) < 1e-4
    assert rel_err(f(x.astype(jnp.bfloat16), w13, w2, w, ids, b13, b2), want) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
def test_cuda_kernels_chain_to_the_moe(rng, minus_one):
    need_native("cuda")
    t, k, e, h, i = 77, 4, 16, 256, 128
    w, ids = random_routing(rng, t, e, k, experts=range(1, e), minus_one=MINUS_ONE * minus_one)
    x = normal(rng, (t, h), jnp.float32)
    w13 = normal(rng, (e, 2 * i, h), jnp.float32, 1 / math.sqrt(h))
    w2 = normal(rng, (e, h, i), jnp.float32, 1 / math.sqrt(i))
    want = np_moe(x, w13, w2, w, ids, "silu")
    assert rel_err(jax.jit(_pipeline, static_argnums=5)(x, w13, w2, w, ids, "silu"), want) < 1e-4
    assert rel_err(_pipeline(x.astype(jnp.bfloat16), w13, w2, w, ids, "silu"), want) < 2e-2
    assert rel_err(_pipeline(x, w13, w2, w, ids, "gelu", "fp8_per_token"), np_moe(x, w13, w2, w, ids, "gelu")) < 5e-2


@pytest.mark.gpu
def test_cuda_kernels_under_command_buffers():
    """The handlers declare command-buffer compatibility: run them with XLA's command buffers forced
    on, fresh inputs each round, against the references."""
    need_native("cuda")
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp
        from jax_moe import ffi, kernels as K
        rng = np.random.default_rng(7)
        t, k, e, h, i = 333, 8, 64, 512, 192

        def step(x, ids, w, hin, y, suffix=""):  # suffix "_reference": the jnp references
            permute, act, unpermute = (getattr(K, n + suffix) for n in ("permute_rows", "act_and_mul",
                                                                        "unpermute_reduce"))
            s = ffi.sort_by_expert(ids, e)
            v = s.offsets[-1]
            return (permute(x, s.sorted_slots, k, valid_rows=v, quant="fp8_per_token"),
                    act(hin, "silu", valid_rows=v), unpermute(y, s.inverse, w, valid_rows=v))

        f = jax.jit(step)
        for _ in range(3):
            ids = np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k].astype(np.int32)
            ids[rng.random(ids.shape) < 0.1] = -1
            args = (jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16), jnp.asarray(ids),
                    jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32),
                    jnp.asarray(rng.standard_normal((t * k, 2 * i)), jnp.bfloat16),
                    jnp.asarray(rng.standard_normal((t * k, h)), jnp.bfloat16))
            (q, s), a, out = f(*args)
            (rq, rs), ra, rout = step(*args, suffix="_reference")
            deq = lambda q, s: np.asarray(q, np.float32) * np.asarray(s)[:, None]
            for got, want, tol in ((deq(q, s), deq(rq, rs), 5e-2), (a, ra, 1e-2), (out, rout, 1e-2)):
                got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
                err = np.linalg.norm(got - want) / np.linalg.norm(want)
                assert np.isfinite(got).all() and err < tol, err
        print("OK")
    """)
    env = dict(__import__("os").environ,
               XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
