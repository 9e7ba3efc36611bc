"""GEMM2 with the weighted un-permute in its epilogue (jax_moe.backends.cutlass_scatter_gemm): the
definition in float64, the argument errors, when the cutlass forward takes it, and on the GPU the
kernel against the definition and the scattering forward against the gathering one and the
xla backend."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe.backends import cutlass as cb
from jax_moe.backends import xla
from jax_moe.backends.cutlass_scatter_gemm import (
    FINALIZE_ENV,
    auto_finalize,
    deterministic_requested,
    grouped_gemm_scatter,
    grouped_gemm_scatter_reference,
    grouped_gemm_scatter_shape,
    scatters,
)

from cutlass_cases import FP8_REL_TOL, REL_TOL, fp8_gemm_problem, gemm_problem, gptoss_problem, moe_problem, small_cfg
from cutlass_cases import each_scale_form, fp8_problem_in_form, scale_broadcasts, spread_counts
from helpers import np_moe, poison_memory, rel_err, skip_unless_available

T = 37  # tokens


def definition(a, b, offsets, slots, weights, bias=None, row=None, col=None):
    """d[t] = sum over rows r of expert e with slots[r] = t * k + j of weights[t, j] * (a[r] @ b[e].T
    (* row[r] * col[e]) + bias[e]), in float64; b [E, N, K]; rows outside the offsets and slots
    outside [0, T * k) add nothing."""
    a, b = np.asarray(a.astype(jnp.float32), np.float64), np.asarray(b.astype(jnp.float32), np.float64)
    off, slots, weights = np.asarray(offsets), np.asarray(slots), np.asarray(weights, np.float64)
    t, k = weights.shape
    d = np.zeros((t, b.shape[1]))
    for e in range(b.shape[0]):
        for r in range(off[e], off[e + 1]):
            if not 0 <= slots[r] < t * k:
                continue
            v = a[r] @ b[e].T
            if row is not None:
                v = v * np.asarray(col, np.float64)[e] * float(row[r])
            if bias is not None:
                v = v + np.asarray(bias, np.float64)[e]
            d[slots[r] // k] += weights.reshape(-1)[slots[r]] * v
    return d


def routing_rows(rng, m, t=T):
    """slots [M] int32 (each row's slot t * k + j, k = ceil(M / t) so every token has several rows;
    a few -1 and T * k: dropped) and weights [T, k] float32 in (0.05, 1)."""
    k = -(-m // t)
    slots = rng.permutation(t * k)[:m]
    slots[rng.random(m) < 0.05] = -1
    slots[rng.random(m) < 0.05] = t * k
    return jnp.asarray(slots, jnp.int32), jnp.asarray(rng.uniform(0.05, 1.0, (t, k)), jnp.float32)


def bf16_case(rng, counts, n=200, k=64, pad=9):
    """bf16 rows, with ``pad`` unowned rows before and after the experts', and weights [E, K, N]."""
    a, b, off = gemm_problem(rng, counts, n, k)
    p = jnp.asarray(rng.standard_normal((pad, k)), jnp.bfloat16)
    return jnp.concatenate([p, a, p]), b, off + pad


# ----------------------------------------------------------------------------- the definition (CPU)


@pytest.mark.parametrize("transposed", [False, True])
def test_the_reference_is_the_definition_bf16(rng, transposed):
    """bf16 weights as stored, b [E, N, K], or transposed, b [E, K, N]: the same function."""
    a, b, off = bf16_case(rng, [5, 0, 17, 30])
    slots, w = routing_rows(rng, a.shape[0])
    bias = jnp.asarray(rng.standard_normal((4, 200)), jnp.float32)
    bb = jnp.swapaxes(b, 1, 2) if transposed else b
    got = grouped_gemm_scatter_reference(a, bb, off, slots, w, bias=bias, transposed=transposed)
    assert got.shape == (T, 200) and got.dtype == jnp.bfloat16
    assert rel_err(got, definition(a, b, off, slots, w, bias)) < REL_TOL


def test_the_reference_is_the_definition_fp8(rng):
    a, b, off, row, col = fp8_gemm_problem(rng, [12, 3, 0, 40, 8], 96, 64)
    slots, w = routing_rows(rng, a.shape[0])
    got = grouped_gemm_scatter_reference(a, b, off, slots, w, a_scale=row, b_scale=col)
    assert rel_err(got, definition(a, b, off, slots, w, row=row, col=col)) < REL_TOL


def test_off_the_gpu_the_call_is_its_reference(rng):
    a, b, off = bf16_case(rng, [6, 9])
    slots, w = routing_rows(rng, a.shape[0])
    bt = jnp.swapaxes(b, 1, 2)
    with jax.default_device(jax.devices("cpu")[0]):
        got = jax.jit(lambda *x: grouped_gemm_scatter(*x, transposed=True))(a, bt, off, slots, w)
    np.testing.assert_array_equal(np.asarray(got, np.float32),
                                  np.asarray(grouped_gemm_scatter_reference(a, bt, off, slots, w, transposed=True),
                                             np.float32))


def test_no_tokens_and_no_rows(rng):
    """No tokens: an empty d. No rows: d is zeros, over poisoned memory."""
    a, b, off = bf16_case(rng, [3, 4])
    slots, w = routing_rows(rng, a.shape[0])
    bt = jnp.swapaxes(b, 1, 2)
    assert grouped_gemm_scatter(a, bt, off, slots, w[:0], transposed=True).shape == (0, 200)
    poison_memory(jax.ShapeDtypeStruct((5, 200), jnp.bfloat16))
    empty = grouped_gemm_scatter(a[:0], bt, jnp.zeros(3, jnp.int32), slots[:0], w[:5], transposed=True)
    assert empty.shape == (5, 200) and not np.asarray(empty, np.float32).any()


def test_the_shape_rule():
    a = jax.ShapeDtypeStruct((50, 64), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((4, 64, 200), jnp.bfloat16)
    off = jax.ShapeDtypeStruct((5,), jnp.int32)
    slots, w = jax.ShapeDtypeStruct((50,), jnp.int32), jax.ShapeDtypeStruct((11, 5), jnp.float32)
    s = grouped_gemm_scatter_shape(a, b, off, slots, w, transposed=True)
    assert (s.shape, s.dtype) == ((11, 200), jnp.bfloat16)


# ----------------------------------------------------------------------------- argument errors


def _args(rng):
    a, b, off = bf16_case(rng, [4, 6], n=64, k=32)
    slots, w = routing_rows(rng, a.shape[0])
    return a, jnp.swapaxes(b, 1, 2), off, slots, w


@pytest.mark.parametrize("change, match", [
    (dict(transposed=False), r"b must be \[E, N, K\] with a's K"),  # [E, K, N] read as [E, N, K]
    (dict(slots="float"), "slots must be"),
    (dict(slots="short"), "slots must be"),
    (dict(weights="flat"), "weights must have rank 2"),
    (dict(weights="bf16"), "weights must be"),
    (dict(bias="wrong"), "bias must have shape"),
    (dict(a_scale=True), "a_scale is only taken with float8_e4m3fn"),
    (dict(tile="huge"), "tile must be 'auto' or one of"),
])
def test_bad_arguments_name_the_argument(rng, change, match):
    a, bt, off, slots, w = _args(rng)
    kw = dict(transposed=True)
    if change.get("slots") == "float":
        slots = slots.astype(jnp.float32)
    if change.get("slots") == "short":
        slots = slots[1:]
    if change.get("weights") == "flat":
        w = w.reshape(-1)
    if change.get("weights") == "bf16":
        w = w.astype(jnp.bfloat16)
    if "bias" in change:
        kw["bias"] = jnp.zeros((2, 32), jnp.float32)
    if "a_scale" in change:
        kw["a_scale"] = jnp.float32(1)
    for key in ("transposed", "tile"):
        if key in change:
            kw[key] = change[key]
    with pytest.raises(ValueError, match=match):
        grouped_gemm_scatter(a, bt, off, slots, w, **kw)


def test_fp8_weights_must_be_k_major(rng):
    a, b, off, row, col = fp8_gemm_problem(rng, [4, 4], 64, 32)
    slots, w = routing_rows(rng, 8)
    with pytest.raises(ValueError, match="FP8 b must be"):
        grouped_gemm_scatter(a, b, off, slots, w, a_scale=row, b_scale=col, transposed=True)


# ----------------------------------------------------------------------------- when the forward scatters


def test_scatters_where_asked_or_by_default_for_a_bf16_output(monkeypatch):
    monkeypatch.delenv(FINALIZE_ENV, raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert scatters("scatter", bf16_out=True) and scatters("scatter", bf16_out=False)
    assert not scatters("gather", bf16_out=True)
    # "auto" scatters wherever the output is bf16 (a kernel takes every layout of the weights)
    assert scatters("auto", bf16_out=True)
    assert not scatters("auto", bf16_out=False)  # a float32 output keeps its float32 sum
    monkeypatch.setenv(FINALIZE_ENV, "gather")
    assert not scatters("auto", bf16_out=True)
    assert scatters("scatter", bf16_out=True)  # the argument outranks the variable


@pytest.mark.parametrize("xla_flags", ["--xla_gpu_deterministic_ops=true", "--xla_gpu_deterministic_ops",
                                       "--xla_dump_to=/tmp/d --xla_gpu_exclude_nondeterministic_ops=1"])
def test_auto_gathers_where_xla_is_asked_for_deterministic_ops(monkeypatch, xla_flags):
    monkeypatch.delenv(FINALIZE_ENV, raising=False)
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    assert auto_finalize()[0] == "gather" and "deterministic" in auto_finalize()[1]
    assert not scatters("auto", bf16_out=True)
    monkeypatch.setenv(FINALIZE_ENV, "scatter")  # the variable outranks the flags
    assert scatters("auto", bf16_out=True)


@pytest.mark.parametrize("xla_flags, deterministic", [
    ("", False),
    ("--xla_gpu_deterministic_ops=false", False),
    ("--xla_gpu_deterministic_ops=0 --xla_gpu_autotune_level=0", False),
    ("--xla_gpu_deterministic_ops_extra=true", False),
    ("--xla_gpu_deterministic_ops=TRUE", True),
    ("--xla_gpu_exclude_nondeterministic_ops", True),
])
def test_deterministic_requested_reads_xla_flags_as_xla_does(xla_flags, deterministic):
    assert deterministic_requested(xla_flags) is deterministic


def test_unknown_finalize_forms_are_errors(monkeypatch, rng):
    with pytest.raises(ValueError, match="finalize must be one of"):
        scatters("atomic", bf16_out=True)
    cfg = small_cfg()
    x, w13, w2, tw, ids = moe_problem(rng, 5, 8, 2, 64, 32)
    with pytest.raises(ValueError, match="finalize must be one of"):
        cb.apply(x, w13, w2, tw, ids, cfg, finalize="atomic")
    monkeypatch.setenv(FINALIZE_ENV, "fast")
    with pytest.raises(ValueError, match=FINALIZE_ENV):
        scatters("auto", bf16_out=True)


@pytest.mark.parametrize("weights", ["bf16 as stored", "bf16 prepared", "fp8"])
def test_the_scattering_gemm2_picks_its_tile_under_its_own_key(rng, weights):
    """So that the autotuner (run with JAX_MOE_CUTLASS_FINALIZE=scatter) tunes it apart from the
    gathering GEMM2, whose best tile differs."""
    from jax_moe.backends import cutlass_tiles as ct

    if weights == "fp8":
        cfg, x, w13, w2, tw, ids, quant = _fp8_layer(rng, 40)
        fn, args, want = cb.apply_prepared, (cb.prepare(w13, w2, cfg, quant),), "fp8_scatter/8/64/32"
    else:
        cfg = small_cfg()
        x, w13, w2, tw, ids = moe_problem(rng, 40, 8, 2, 64, 32)
        if weights == "bf16 prepared":
            fn, args, want = cb.apply_prepared, (cb.prepare(w13, w2, cfg),), "bf16_kn_scatter/8/64/32"
        else:
            fn, args, want = lambda x, w13, w2, *a, **kw: cb.apply(x, w13, w2, *a, cfg, **kw), (w13, w2), \
                "bf16_scatter/8/64/32"
    with ct.tuning() as trial:
        jax.eval_shape(lambda x, *a: fn(x, *a, finalize="scatter"), x, *args, tw, ids)
    keys = [key for key, _, _ in trial.picks]
    # GEMM2 is [E=8, N=H=64, K=I=32]: picked under the scatter's key, never the gathering one's
    assert keys[-1] == want and not {"bf16_kn/8/64/32", "bf16/8/64/32", "fp8/8/64/32"} & set(keys)


def test_info_says_how_the_forward_sums_its_rows(monkeypatch):
    from jax_moe.info import finalize_status

    monkeypatch.delenv(FINALIZE_ENV, raising=False)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert finalize_status().startswith("scatter") and "not bit-reproducible" in finalize_status()
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")
    assert finalize_status().startswith("gather") and "XLA_FLAGS" in finalize_status()
    monkeypatch.setenv(FINALIZE_ENV, "gather")
    assert finalize_status().startswith("gather") and FINALIZE_ENV in finalize_status()
    monkeypatch.setenv(FINALIZE_ENV, "atomic")
    assert finalize_status().startswith("unusable") and FINALIZE_ENV in finalize_status()


def _fp8_layer(rng, t, e=8, k=2, h=64, i=32):
    from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights

    cfg = small_cfg(e, k, h, i)
    x, w13, w2, tw, ids = moe_problem(rng, t, e, k, h, i)
    a13 = calibrate_activation_scale("fp8_per_tensor", x.astype(jnp.float32))
    q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a13 / 4,
                                      weight_scale="per_channel")
    return cfg, x, q13, q2, tw, ids, quant


def _bf16_forwards(cfg, w13, w2, b, prepared: bool):
    """(gathering, scattering) jitted forwards (x, tw, ids) -> [T, H] on the weights as stored or prepared."""
    if prepared:
        p = cb.prepare(w13, w2, cfg, **b)
        return tuple(jax.jit(lambda x, tw, ids, f=f: cb.apply_prepared(x, p, tw, ids, finalize=f))
                     for f in ("gather", "scatter"))
    return tuple(jax.jit(lambda x, tw, ids, f=f: cb.apply(x, w13, w2, tw, ids, cfg, finalize=f, **b))
                 for f in ("gather", "scatter"))


@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("minus_one", [0.0, 0.2])
def test_a_scattering_bf16_layer_is_the_gathering_one_on_cpu(rng, minus_one, prepared):
    """GPT-OSS-style (swigluoai, interleaved, both biases), some ids -1, weights as stored or
    prepared: the kernels' jnp references."""
    cfg, x, w13, w2, tw, ids, b = gptoss_problem(rng, 45, 8, 4, 64, 32, minus_one=minus_one)
    gather_fn, scatter_fn = _bf16_forwards(cfg, w13, w2, b, prepared)
    gather, scatter = gather_fn(x, tw, ids), scatter_fn(x, tw, ids)
    assert rel_err(scatter, gather) < REL_TOL
    want = np_moe(x, w13, w2, tw, ids, "swigluoai", "interleaved", b["w13_bias"], b["w2_bias"], alpha=1.5, limit=4.0)
    assert rel_err(scatter, want) < REL_TOL


def test_a_scattering_fp8_layer_is_the_gathering_one_on_cpu(rng):
    cfg, x, q13, q2, tw, ids, quant = _fp8_layer(rng, 40)
    p = cb.prepare(q13, q2, cfg, quant)
    scatter = jax.jit(lambda *a: cb.apply_prepared(*a, finalize="scatter"))(x, p, tw, ids)
    assert rel_err(scatter, xla.apply(x, q13, q2, tw, ids, cfg, quant=quant)) < FP8_REL_TOL


def test_the_router_weight_on_the_input_is_not_applied_twice(rng):
    cfg = small_cfg(k=1)
    x, w13, w2, tw, ids = moe_problem(rng, 30, 8, 1, 64, 32)
    p = cb.prepare(w13, w2, cfg)
    got = cb.apply_prepared(x, p, tw, ids, apply_router_weight_on_input=True, finalize="scatter")
    want = cb.apply_prepared(x, p, tw, ids, apply_router_weight_on_input=True, finalize="gather")
    assert rel_err(got, want) < REL_TOL


# ----------------------------------------------------------------------------- on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_bf16_kernel_matches_the_definition(rng, tile, transposed):
    """16 experts of 0..300 rows (empty ones, partial tiles), unowned rows at both ends, N = 200
    (a partial column block on every tile), a bias, slots of -1 and T * k dropped; b [E, N, K] or
    transposed [E, K, N]; output poisoned."""
    skip_unless_available(cb)
    counts = rng.integers(0, 300, 16)
    counts[3] = 0
    assert_bf16_scatter_with_bias_is_the_definition(rng, counts, n=200, k=256, t=600, tile=tile,
                                                    transposed=transposed)


def assert_bf16_scatter_with_bias_is_the_definition(rng, counts, n, k, t, tile, transposed):
    """The bf16 scatter GEMM with a bias on experts of ``counts`` rows (unowned rows at both ends),
    ``t`` tokens, b [E, N, K] or transposed [E, K, N], over poisoned memory, against the definition."""
    a, b, off = bf16_case(rng, counts, n=n, k=k)
    slots, w = routing_rows(rng, a.shape[0], t=t)
    bias = jnp.asarray(rng.standard_normal((len(counts), n)), jnp.float32)
    fn = jax.jit(lambda a, bb, o, s, w, bias: grouped_gemm_scatter(a, bb, o, s, w, bias=bias, tile=tile,
                                                                   transposed=transposed))
    bb = jnp.swapaxes(b, 1, 2) if transposed else b
    poison_memory(jax.eval_shape(fn, a, bb, off, slots, w, bias))
    got = fn(a, bb, off, slots, w, bias)
    assert rel_err(got, definition(a, b, off, slots, w, bias)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_bf16_kernel_matches_the_definition_where_each_cta_runs_many_tiles(rng, tile):
    """64 experts of 0..300 rows and N = 1024: several hundred tiles on every tile shape, so each
    persistent CTA runs several of them in the scheduler's order; output poisoned."""
    skip_unless_available(cb)
    counts = rng.integers(0, 300, 64)
    a, b, off = bf16_case(rng, counts, n=1024, k=128)
    slots, w = routing_rows(rng, a.shape[0], t=3000)
    fn = jax.jit(lambda a, b, o, s, w: grouped_gemm_scatter(a, b, o, s, w, tile=tile))
    poison_memory(jax.eval_shape(fn, a, b, off, slots, w))
    got = fn(a, b, off, slots, w)
    assert rel_err(got, definition(a, b, off, slots, w)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_bf16_kernel_keeps_each_experts_weights_and_bias_when_its_groups_are_spread(rng, tile, transposed):
    """128 experts of uneven rows (about 130 on average, ties, empty ones), visited in the spread
    order: each expert's rows still meet its own weights and its own bias row; output poisoned."""
    skip_unless_available(cb)
    assert_bf16_scatter_with_bias_is_the_definition(rng, spread_counts(rng), n=256, k=128, t=4000, tile=tile,
                                                    transposed=transposed)


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
def test_tokens_no_row_reaches_are_zero(rng, transposed):
    """5000 tokens and 40 rows: nearly every output row is reached by no row, and the call zeroes
    them all, over poisoned memory (2 MB of d: more than one pass of the zeroing blocks, rows of
    25 16-byte vectors that do not fill a block)."""
    skip_unless_available(cb)
    a, b, off = bf16_case(rng, np.array([15, 0, 25]), n=200, k=64, pad=3)
    slots, w = routing_rows(rng, a.shape[0], t=5000)
    bb = jnp.swapaxes(b, 1, 2) if transposed else b
    fn = jax.jit(lambda a, bb, o, s, w: grouped_gemm_scatter(a, bb, o, s, w, transposed=transposed))
    poison_memory(jax.eval_shape(fn, a, bb, off, slots, w))
    got = np.asarray(fn(a, bb, off, slots, w), np.float32)
    want = definition(a, b, off, slots, w)
    assert np.isfinite(got).all()
    assert not got[~want.any(axis=1)].any()
    assert rel_err(got, want) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_fp8_kernel_matches_the_definition(rng, tile):
    skip_unless_available(cb)
    counts = rng.integers(0, 200, 24)
    a, b, off, row, col = fp8_gemm_problem(rng, counts, 200, 256)
    slots, w = routing_rows(rng, a.shape[0], t=500)
    fn = jax.jit(lambda a, b, o, s, w, r, c: grouped_gemm_scatter(a, b, o, s, w, a_scale=r, b_scale=c, tile=tile))
    poison_memory(jax.eval_shape(fn, a, b, off, slots, w, row, col))
    got = fn(a, b, off, slots, w, row, col)
    assert rel_err(got, definition(a, b, off, slots, w, row=row, col=col)) < REL_TOL


@pytest.mark.gpu
@each_scale_form
def test_fp8_kernel_takes_each_scale_in_its_own_form(rng, tile, form):
    """GEMM2 with its scatter on the scales as given: a per-tensor or per-expert scale reaches the
    kernel as one scale, never broadcast to a vector first; the sums are the definition's."""
    skip_unless_available(cb)
    a, b, off, a_scale, b_scale, row, col = fp8_problem_in_form(rng, form, n=200, k=256)
    slots, w = routing_rows(rng, a.shape[0], t=500)
    fn = jax.jit(lambda a, b, o, s, w, r, c: grouped_gemm_scatter(a, b, o, s, w, a_scale=r, b_scale=c, tile=tile))
    poison_memory(jax.eval_shape(fn, a, b, off, slots, w, a_scale, b_scale))
    got = fn(a, b, off, slots, w, a_scale, b_scale)
    assert rel_err(got, definition(a, b, off, slots, w, row=row, col=col)) < REL_TOL
    assert scale_broadcasts(fn, a, b, off, slots, w, a_scale, b_scale) == []


@pytest.mark.gpu
@pytest.mark.parametrize("prepared", [False, True])
@pytest.mark.parametrize("t, e, k", [(16, 128, 8), (300, 16, 4), (2000, 64, 6)])
def test_a_scattering_bf16_layer_on_the_gpu(rng, t, e, k, prepared):
    """GPT-OSS-style with both biases and ids of -1, weights as stored or prepared: against the
    gathering forward and the float64 definition, twice (a jitted function's second call), outputs
    poisoned."""
    skip_unless_available(cb)
    cfg, x, w13, w2, tw, ids, b = gptoss_problem(rng, t, e, k, 256, 128, minus_one=0.1)
    gather_fn, f = _bf16_forwards(cfg, w13, w2, b, prepared)
    want = np_moe(x, w13, w2, tw, ids, "swigluoai", "interleaved", b["w13_bias"], b["w2_bias"], alpha=1.5, limit=4.0)
    for _ in range(2):
        poison_memory(jax.eval_shape(f, x, tw, ids))
        got = f(x, tw, ids)
        assert rel_err(got, want) < REL_TOL
    assert rel_err(got, gather_fn(x, tw, ids)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("t, e, k", [(16, 128, 8), (1000, 16, 4)])
def test_a_scattering_fp8_layer_on_the_gpu(rng, t, e, k):
    skip_unless_available(cb)
    cfg, x, q13, q2, tw, ids, quant = _fp8_layer(rng, t, e, k, 256, 128)
    p = cb.prepare(q13, q2, cfg, quant)
    f = jax.jit(lambda *a: cb.apply_prepared(*a, finalize="scatter"))
    poison_memory(jax.eval_shape(f, x, p, tw, ids))
    got = f(x, p, tw, ids)
    assert rel_err(got, xla.apply(x, q13, q2, tw, ids, cfg, quant=quant)) < FP8_REL_TOL
