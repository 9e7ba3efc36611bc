"""fused_experts / fused_moe on the pure-JAX backend against the dense float32 reference: activations,
strategies, layouts and options beyond tests/test_conformance.py's specification."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import fused_experts, fused_moe, select_experts
from jax_moe.backends import xla
from jax_moe.config import MoEConfig
from jax_moe.reference import moe_reference
from helpers import BAD_VALUES, DTYPE_BOUND, poison_experts, random_biases, random_moe, rel_err


def make_moe(rng, t, e, k, h, i, activation="silu", dtype=jnp.float32, bias=False):
    """A random layer (helpers.random_moe) as (cfg, x, w13, w2, weights, ids, biases): biases a
    dict of fused_experts' keywords (empty without ``bias``)."""
    m = random_moe(rng, t, e, k, h, i, activation=activation, dtype=dtype)
    return (*m, random_biases(rng, m.cfg) if bias else {})


SHAPES = [  # (T, E, k, H, I)
    (1, 8, 2, 64, 32),
    (37, 16, 4, 32, 48),
    (200, 64, 8, 32, 16),
    (3, 8, 2, 32, 16),  # few slots: gathered weights
    (5, 256, 8, 16, 16),  # most experts receive no token
]


@pytest.mark.parametrize("shape", [s if s[0] == 37 else pytest.param(s, marks=pytest.mark.slow) for s in SHAPES],
                         ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai", "relu2"])
def test_every_activation_matches_reference_in_float32(rng, shape, activation):
    cfg, x, w13, w2, w, ids, _ = make_moe(rng, *shape, activation=activation)
    out = jax.jit(lambda *a: fused_experts(*a, activation=activation))(x, w13, w2, w, ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, moe_reference(x, w13, w2, w, ids, cfg)) < DTYPE_BOUND["float32"]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("strategy", [s if s == "ragged_dot" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in xla.STRATEGIES])
def test_half_precision_within_dtype_bound(rng, dtype, strategy):
    cfg, x, w13, w2, w, ids, _ = make_moe(rng, 64, 16, 4, 64, 32, dtype=getattr(jnp, dtype))
    out = jax.jit(lambda *a: xla.apply(*a, cfg, strategy=strategy))(x, w13, w2, w, ids)
    assert out.dtype == x.dtype
    assert rel_err(out, moe_reference(x, w13, w2, w, ids, cfg)) < DTYPE_BOUND[dtype]


@pytest.mark.parametrize("block_size,blocks_per_step", [pytest.param(16, 1, marks=pytest.mark.slow), (16, 4),
                                                         pytest.param(64, 2, marks=pytest.mark.slow),
                                                         pytest.param(1024, 1, marks=pytest.mark.slow)])
def test_blocking_does_not_change_the_result(rng, block_size, blocks_per_step):
    cfg, x, w13, w2, w, ids, _ = make_moe(rng, 100, 8, 2, 32, 16)
    out = xla.apply(x, w13, w2, w, ids, cfg, strategy="blocked", block_size=block_size,
                    blocks_per_step=blocks_per_step)
    assert rel_err(out, moe_reference(x, w13, w2, w, ids, cfg)) < DTYPE_BOUND["float32"]


@pytest.mark.parametrize("strategy", xla.STRATEGIES)
def test_every_strategy_matches_reference(rng, strategy):
    cfg, x, w13, w2, w, ids, bias = make_moe(rng, 23, 16, 3, 32, 16, activation="gelu", bias=True)
    out = xla.apply(x, w13, w2, w, ids, cfg, strategy=strategy, **bias)
    assert rel_err(out, moe_reference(x, w13, w2, w, ids, cfg, **bias)) < DTYPE_BOUND["float32"]


def test_gpt_oss_swiglu_with_interleaved_gate_up_and_biases(rng):
    cfg, x, w13, w2, w, ids, bias = make_moe(rng, 40, 32, 4, 32, 16, activation="swigluoai", bias=True)
    cfg = MoEConfig(32, 4, 32, 16, "swigluoai", "interleaved")
    out = fused_experts(x, w13, w2, w, ids, activation="swigluoai", gate_up_layout="interleaved", **bias)
    assert rel_err(out, moe_reference(x, w13, w2, w, ids, cfg, **bias)) < DTYPE_BOUND["float32"]
    # interleaved is a real permutation of the rows: the concat result differs
    concat = fused_experts(x, w13, w2, w, ids, activation="swigluoai", **bias)
    assert rel_err(concat, out) > 1e-2


def test_interleaved_equals_concat_after_row_permutation(rng):
    cfg, x, w13, w2, w, ids, _ = make_moe(rng, 16, 8, 2, 32, 16, activation="silu")
    i = cfg.intermediate_size
    order = np.stack([np.arange(i), np.arange(i) + i], 1).reshape(-1)  # gate0, up0, gate1, up1, ...
    a = fused_experts(x, w13, w2, w, ids)
    b = fused_experts(x, w13[:, order], w2, w, ids, gate_up_layout="interleaved")
    assert rel_err(b, a) < 1e-6


def test_router_weight_on_input_for_top1(rng):
    cfg, x, w13, w2, w, ids, _ = make_moe(rng, 30, 8, 1, 32, 16)
    out = fused_experts(x, w13, w2, w, ids, apply_router_weight_on_input=True)
    ref = moe_reference(x, w13, w2, w, ids, cfg, apply_router_weight_on_input=True)
    assert rel_err(out, ref) < DTYPE_BOUND["float32"]


def test_all_tokens_on_one_expert_and_top_k_equal_e(rng):
    cfg, x, w13, w2, _, _, _ = make_moe(rng, 50, 4, 4, 32, 16)
    ids = jnp.tile(jnp.arange(4, dtype=jnp.int32), (50, 1))
    w = jnp.asarray(rng.random((50, 4)), jnp.float32)
    out = fused_experts(x, w13, w2, w, ids)
    assert rel_err(out, moe_reference(x, w13, w2, w, ids, cfg)) < DTYPE_BOUND["float32"]
    ids1 = jnp.full((50, 1), 3, jnp.int32)
    out1 = fused_experts(x, w13, w2, w[:, :1], ids1)
    assert rel_err(out1, moe_reference(x, w13, w2, w[:, :1], ids1, cfg)) < DTYPE_BOUND["float32"]


def test_jit_twice_gives_identical_results_where_determinism_is_asked_for(rng, monkeypatch):
    """With the gathering finalize (JAX_MOE_CUTLASS_FINALIZE=gather, or XLA's determinism flags)
    two runs are bit-identical on every backend. By default the GPU's cutlass backend adds each
    token's rows into its output row with bf16 atomics in no fixed order: two runs then agree to
    bf16 rounding, not bit for bit."""
    cfg, x, w13, w2, w, ids, _ = make_moe(rng, 64, 16, 4, 32, 16, dtype=jnp.bfloat16)
    monkeypatch.setenv("JAX_MOE_CUTLASS_FINALIZE", "gather")  # read when the call is traced
    f = jax.jit(lambda *args: fused_experts(*args))
    np.testing.assert_array_equal(np.asarray(f(x, w13, w2, w, ids)), np.asarray(f(x, w13, w2, w, ids)))
    monkeypatch.delenv("JAX_MOE_CUTLASS_FINALIZE")
    g = jax.jit(lambda *args: fused_experts(*args))
    a, b = g(x, w13, w2, w, ids), g(x, w13, w2, w, ids)
    assert bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))) and rel_err(a, b) < DTYPE_BOUND["bfloat16"]


def test_fused_moe_is_routing_then_experts(rng):
    cfg, x, w13, w2, _, _, _ = make_moe(rng, 24, 16, 4, 32, 16)
    logits = jnp.asarray(rng.standard_normal((24, 16)), jnp.float32)
    w, ids = select_experts(logits, 4, scoring="sigmoid")
    out = jax.jit(lambda *a: fused_moe(*a, 4, scoring="sigmoid"))(x, w13, w2, logits)
    assert rel_err(out, moe_reference(x, w13, w2, w, ids, cfg)) < DTYPE_BOUND["float32"]


def test_shape_picks_the_strategy_and_block_size():
    deepseek = MoEConfig(256, 8, 7168, 2048)
    assert xla.pick_strategy(1, deepseek) == "gather"  # 8 slots: gather their weights
    assert xla.pick_strategy(4, deepseek) == "blocked"  # 32 of 256 experts touched
    assert xla.pick_strategy(64, deepseek) == "dense"  # most experts touched, weight-bound
    assert xla.pick_strategy(1024, deepseek) == "blocked"
    assert xla.pick_block_size(1, 8, 256) == 16
    assert xla.pick_block_size(1024, 8, 256) == 64  # ~32 rows per expert: one block each
    assert xla.pick_block_size(16384, 2, 8) == 1024
    assert xla.pick_blocks_per_step(deepseek) == 2  # 88 MB per expert
    assert xla.pick_blocks_per_step(MoEConfig(128, 8, 2048, 768)) == 16  # 9.4 MB per expert


# ---------------------------------------------------------------- bad options (bad arrays: test_conformance.py)


def _args(rng):
    _, x, w13, w2, w, ids, _ = make_moe(rng, 8, 4, 2, 32, 16)
    return dict(x=x, w13=w13, w2=w2, topk_weights=w, topk_ids=ids)


def test_bad_options_raise(rng):
    a = _args(rng)
    with pytest.raises(ValueError, match="activation must be one of"):
        fused_experts(*a.values(), activation="tanh")
    with pytest.raises(ValueError, match="apply_router_weight_on_input needs top_k == 1"):
        fused_experts(*a.values(), apply_router_weight_on_input=True)
    with pytest.raises(ValueError, match="w13_bias must have shape \\[4, 32\\]"):
        fused_experts(*a.values(), w13_bias=jnp.zeros((4, 16)))
    with pytest.raises(ValueError, match="backend must be one of"):
        fused_experts(*a.values(), backend="magic")
    with pytest.raises(ValueError, match="router_logits has 5 experts but w13 has E=4"):
        fused_moe(a["x"], a["w13"], a["w2"], jnp.zeros((8, 5)), 2)


@pytest.mark.parametrize("strategy", [s if s == "ragged_dot" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in xla.STRATEGIES])
def test_a_token_may_pick_the_same_expert_twice(rng, strategy):
    cfg, x, w13, w2, w, _, _ = make_moe(rng, 12, 8, 3, 32, 16)
    ids = jnp.asarray(rng.integers(0, 3, (12, 3)), jnp.int32)  # repeats within a row
    out = xla.apply(x, w13, w2, w, ids, cfg, strategy=strategy)
    assert rel_err(out, moe_reference(x, w13, w2, w, ids, cfg)) < DTYPE_BOUND["float32"]


# ----------------------------------------------------------------------------- the batched format


def _batched_definition(x, counts, w13, w2, cfg, quant=None, **bias):
    """y[e, r] = expert_e(x[e, r]) for r < clamp(counts[e], 0, C), zero elsewhere: the float32
    definition (moe_reference, top-1 with weight 1, on the flattened rows; the padding zeroed
    first so that a dynamic scale sees the used rows only)."""
    e, c, h = x.shape
    used = np.arange(c)[None, :] < np.clip(np.asarray(counts), 0, c)[:, None]
    xf = jnp.where(jnp.asarray(used)[..., None], x, 0).reshape(e * c, h)
    ids = jnp.repeat(jnp.arange(e, dtype=jnp.int32), c)[:, None]
    y = moe_reference(xf, w13, w2, jnp.ones((e * c, 1), jnp.float32), ids, cfg, quant=quant, **bias)
    return np.where(used[..., None], np.asarray(y, np.float64).reshape(e, c, h), 0.0)


BATCHED_CASES = [("silu", None, False), ("swigluoai", None, True), ("relu2", None, False),
                 ("silu", "fp8_per_token", False), ("silu", "fp8_per_tensor", False)]


@pytest.mark.parametrize("activation,act,bias", [
    c if c not in (("relu2", None, False), ("silu", "fp8_per_tensor", False))
    else pytest.param(*c, marks=pytest.mark.slow) for c in BATCHED_CASES])
def test_apply_batched_is_each_expert_on_its_rows(rng, activation, act, bias):
    """xla.apply_batched (cutlass.apply_batched's contract): each used row through its expert,
    biases and quantized activations as fused_experts does them (a dynamic scale over the used
    rows only), rows past the counts zero; counts are clamped to [0, C] and NaN padding is never read."""
    from jax_moe.quant.scheme import quantize_weights

    e, c, h, i = 6, 5, 32, 16
    cfg, _, w13, w2, _, _, b = make_moe(rng, 1, e, 1, h, i, activation, bias=bias)
    quant = None
    if act is not None:
        w13, w2, quant = quantize_weights("fp8", w13, w2, act=act)
    counts = np.array([3, 0, 5, 7, -1, 1], np.int32)
    used = np.arange(c)[None, :] < np.clip(counts, 0, c)[:, None]
    x = jnp.asarray(np.where(used[..., None], rng.standard_normal((e, c, h)), np.nan), jnp.float32)
    out = jax.jit(lambda x, n: xla.apply_batched(x, n, w13, w2, cfg, quant=quant, **b))(x, jnp.asarray(counts))
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, _batched_definition(x, counts, w13, w2, cfg, quant, **b)) < DTYPE_BOUND["float32"]
    assert (np.asarray(out)[~used] == 0).all()


def test_apply_batched_refuses_what_is_not_the_format(rng):
    cfg, _, w13, w2, _, _, _ = make_moe(rng, 1, 4, 1, 32, 16)
    x, counts = jnp.zeros((4, 3, 32)), jnp.ones((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"x must have rank 3 \[E, C, H\]"):
        xla.apply_batched(x[0], counts, w13, w2, cfg)
    with pytest.raises(ValueError, match="must have the weights' E = 4 experts"):
        xla.apply_batched(x[:2], counts[:2], w13, w2, cfg)
    with pytest.raises(ValueError, match=r"counts must have dtype in \[.int32.\], got float32"):
        xla.apply_batched(x, counts.astype(jnp.float32), w13, w2, cfg)


def test_batched_layout_puts_each_rows_copies_with_their_experts():
    """Rows go to their experts in row order; ids outside [0, E) are skipped; a row naming one
    expert twice brings it one copy (both slots read it); the capacity is the number of rows."""
    from jax_moe.permute import batched_layout

    ids = jnp.asarray([[2, 0], [-1, 2], [1, 1], [-1, -1]], jnp.int32)  # M = 4 rows, E = 3
    lay = batched_layout(ids, 3)
    np.testing.assert_array_equal(lay.counts, [1, 1, 2])
    np.testing.assert_array_equal(lay.src, [[0, 4, 4, 4], [2, 4, 4, 4], [0, 1, 4, 4]])  # 4 = M: empty
    np.testing.assert_array_equal(lay.pos, [[0, 0], [-1, 1], [0, 0], [-1, -1]])


def test_batched_layout_and_finalize_equal_the_standard_format(rng):
    """Rows laid out per expert, xla.apply_batched, and the weighted top-k reduce from the
    batched rows equal xla.apply on the rows (duplicate ids and -1 included)."""
    from jax_moe.permute import batched_finalize, batched_layout, to_batched

    cfg, x, w13, w2, w, _, _ = make_moe(rng, 24, 8, 3, 32, 16)
    ids = jnp.asarray(rng.integers(-1, 8, (24, 3)), jnp.int32)
    lay = batched_layout(ids, 8)
    y = xla.apply_batched(to_batched(x, lay), lay.counts, w13, w2, cfg)
    assert y.shape == (8, 24, 32)
    out = batched_finalize(y, lay, ids, w)
    assert rel_err(out, xla.apply(x, w13, w2, w, ids, cfg)) < DTYPE_BOUND["float32"]


def test_the_batched_stage_is_chosen_by_the_batched_feature(rng, monkeypatch):
    """run_experts_batched asks the oracle for a backend with the "batched" feature: a forced
    backend without it is refused with that reason."""
    from jax_moe.backends import flashinfer_cutlass
    from jax_moe.experts import run_experts_batched

    cfg, _, w13, w2, _, _, _ = make_moe(rng, 1, 4, 1, 32, 16)
    x, counts = jnp.ones((4, 2, 32)), jnp.asarray([2, 0, 1, 2], jnp.int32)
    ref = _batched_definition(x, counts, w13, w2, cfg)
    assert rel_err(run_experts_batched(x, counts, w13, w2, cfg), ref) < DTYPE_BOUND["float32"]
    monkeypatch.setattr(flashinfer_cutlass, "supports", lambda *a, **k: (True, "ok"))
    with pytest.raises(ValueError, match="does not take the batched expert format"):
        run_experts_batched(x, counts, w13, w2, cfg, backend="flashinfer_cutlass")


# ----------------------------------------------------------------------------- robustness

def _poison(w, expert, bad):
    """w with one expert's weights made bad (helpers.poison_experts), as a jax array."""
    return jnp.asarray(poison_experts(w, [expert], bad))


def test_issue_repro_overflow_in_an_unused_expert_leaves_every_token_finite():
    """Regression: all 40 rows were NaN (the dense strategy, picked automatically)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
    w13 = rng.standard_normal((8, 8, 16)).astype(np.float32)
    clean = jnp.asarray(w13)
    w13[7] *= 1e20
    w2 = jnp.asarray(rng.standard_normal((8, 16, 8)), jnp.float32)
    ids = jnp.tile(jnp.array([[0, 1]], jnp.int32), (40, 1))
    out = fused_experts(x, jnp.asarray(w13), w2, jnp.full((40, 2), .5), ids, activation="relu2")
    want = fused_experts(x, clean, w2, jnp.full((40, 2), .5), ids, activation="relu2")
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("where,bad", [(w, b) if (w, b) in (("w13", "nan"), ("w2", "overflow"))
                                       else pytest.param(w, b, marks=pytest.mark.slow)
                                       for w in ("w13", "w2", "w13_bias", "w2_bias") for b in BAD_VALUES
                                       if not (b == "overflow" and w.endswith("bias"))])
@pytest.mark.parametrize("strategy", [s if s == "ragged_dot" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in xla.STRATEGIES])
def test_a_bad_unused_expert_never_reaches_a_token(rng, strategy, where, bad):
    """Experts 5..7 receive no token; one of them holds a NaN/inf or overflows (relu2 squares a
    GEMM1 output of ~1e30). Every strategy gives exactly what it gives with clean weights."""
    cfg, x, w13, w2, w, _, biases = make_moe(rng, 30, 8, 2, 32, 16, activation="relu2" if bad == "overflow"
                                             else "silu", bias=True)
    ids = jnp.asarray(rng.integers(0, 5, (30, 2)), jnp.int32)
    args = dict(w13=w13, w2=w2, **biases)
    want = xla.apply(x, args["w13"], args["w2"], w, ids, cfg, strategy=strategy, w13_bias=args["w13_bias"],
                     w2_bias=args["w2_bias"])
    args[where] = _poison(args[where], 6, BAD_VALUES[bad])
    out = xla.apply(x, args["w13"], args["w2"], w, ids, cfg, strategy=strategy, w13_bias=args["w13_bias"],
                    w2_bias=args["w2_bias"])
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


@pytest.mark.parametrize("strategy", [s if s in ("blocked", "ragged_dot") else pytest.param(s, marks=pytest.mark.slow)
                                      for s in xla.STRATEGIES])
def test_a_bad_used_expert_stays_in_the_tokens_routed_to_it(rng, strategy):
    cfg, x, w13, w2, w, _, _ = make_moe(rng, 30, 8, 2, 32, 16)
    ids = np.asarray(rng.integers(0, 8, (30, 2)), np.int32)
    ids[ids == 3] = 4
    ids[:5, 0] = 3  # tokens 0..4 use expert 3
    ids = jnp.asarray(ids)
    want = np.asarray(xla.apply(x, w13, w2, w, ids, cfg, strategy=strategy))
    out = np.asarray(xla.apply(x, _poison(w13, 3, np.nan), w2, w, ids, cfg, strategy=strategy))
    assert np.isnan(out[:5]).all()
    np.testing.assert_array_equal(out[5:], want[5:])


@pytest.mark.parametrize("bad", ["nan", "inf"])
@pytest.mark.parametrize("strategy", [s if s == "blocked" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in xla.STRATEGIES])
def test_a_bad_token_stays_in_its_own_row(rng, strategy, bad):
    cfg, x, w13, w2, w, ids, _ = make_moe(rng, 30, 8, 2, 32, 16)
    want = np.asarray(xla.apply(x, w13, w2, w, ids, cfg, strategy=strategy))
    out = np.asarray(xla.apply(x.at[7, 3].set(BAD_VALUES[bad]), w13, w2, w, ids, cfg, strategy=strategy))
    assert not np.isfinite(out[7]).all()
    np.testing.assert_array_equal(np.delete(out, 7, 0), np.delete(want, 7, 0))


@pytest.mark.parametrize("t", [pytest.param(t, marks=pytest.mark.slow) for t in (1, 10, 60)] + [200])
@pytest.mark.parametrize("strategy", [s if s is None else pytest.param(s, marks=pytest.mark.slow)
                                      for s in (None, *xla.STRATEGIES)])  # None picks blocked at T=200
def test_numpy_arrays_are_taken_at_every_t_and_strategy(rng, t, strategy):
    """Regression: numpy weights raised TracerArrayConversionError at T=200 (blocked)."""
    cfg, x, w13, w2, w, ids, bias = make_moe(rng, t, 8, 2, 32, 16, bias=True)
    np_args = [np.asarray(a) for a in (x, w13, w2, w, ids)]
    np_bias = {k: np.asarray(v) for k, v in bias.items()}
    want = xla.apply(x, w13, w2, w, ids, cfg, strategy=strategy, **bias)
    got = xla.apply(*np_args, cfg, strategy=strategy, **np_bias)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if strategy is None:
        logits = np.asarray(rng.standard_normal((t, 8)), np.float32)
        got = fused_moe(np_args[0], np_args[1], np_args[2], logits, np.int64(2), **np_bias)
        want = fused_moe(x, w13, w2, jnp.asarray(logits), 2, **bias)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        got = fused_experts(*np_args, **np_bias)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(fused_experts(x, w13, w2, w, ids, **bias)))


@pytest.mark.parametrize("strategy", [s if s == "ragged_dot" else pytest.param(s, marks=pytest.mark.slow)
                                      for s in (None, *xla.STRATEGIES)])
def test_vmap_over_every_strategy(rng, strategy):
    cfg, x, w13, w2, _, _, _ = make_moe(rng, 24, 8, 2, 32, 16)
    xs = jnp.asarray(rng.standard_normal((3, 24, 32)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((3, 24, 8)), jnp.float32)

    def one(x, lg):
        w, ids = select_experts(lg, 2)
        return xla.apply(x, w13, w2, w, ids, cfg, strategy=strategy)

    got = jax.jit(jax.vmap(one))(xs, logits)
    for b in range(3):
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(one(xs[b], logits[b])), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_ragged_dot_under_nested_vmap_and_with_batched_weights(rng):
    cfg, x, w13, w2, w, ids, _ = make_moe(rng, 12, 4, 2, 16, 8)
    w13s = jnp.stack([w13, 2 * w13])
    f = lambda w13, x: xla.apply(x, w13, w2, w, ids, cfg, strategy="ragged_dot")  # noqa: E731
    got = jax.vmap(jax.vmap(f, in_axes=(None, 0)), in_axes=(0, None))(w13s, jnp.stack([x, -x]))
    for i, ww in enumerate((w13, 2 * w13)):
        for j, xx in enumerate((x, -x)):
            np.testing.assert_allclose(np.asarray(got[i, j]), np.asarray(f(ww, xx)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(top_k=True), "top_k must be an int, got True"),
        (dict(top_k=2.0), "top_k must be an int"),
        (dict(num_experts=np.bool_(True)), "num_experts must be an int"),
        (dict(swiglu_limit=float("nan")), "swiglu_limit must be a finite number > 0"),
        (dict(swiglu_limit=-7.0), "swiglu_limit must be a finite number > 0"),
        (dict(swiglu_limit=float("inf")), "swiglu_limit must be a finite number > 0"),
        (dict(swiglu_alpha=0.0), "swiglu_alpha must be a finite number > 0"),
        (dict(swiglu_alpha=float("nan")), "swiglu_alpha must be a finite number > 0"),
        (dict(swiglu_alpha=None), "swiglu_alpha must be a finite number > 0"),
    ],
)
def test_moe_config_checks_ints_and_swiglu_constants(kwargs, match):
    base = dict(num_experts=8, top_k=2, hidden_size=32, intermediate_size=16, activation="swigluoai")
    with pytest.raises(ValueError, match=match):
        MoEConfig(**{**base, **kwargs})


def test_moe_config_takes_numpy_ints_as_python_ints():
    cfg = MoEConfig(np.int64(8), np.int32(2), np.int64(32), np.uint16(16), swiglu_limit=np.float32(6.0))
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (8, 2, 32, 16)
    assert all(type(v) is int for v in (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size))
    assert type(cfg.swiglu_limit) is float and cfg == MoEConfig(8, 2, 32, 16, swiglu_limit=6.0)


def test_fused_moe_and_fused_experts_check_top_k_and_scalars(rng):
    a = _args(rng)
    logits = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    out = fused_moe(a["x"], a["w13"], a["w2"], logits, np.int64(2))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(fused_moe(a["x"], a["w13"], a["w2"], logits, 2)))
    with pytest.raises(ValueError, match="top_k must be an int, got True"):
        fused_moe(a["x"], a["w13"], a["w2"], logits, True)
    for bad in (float("nan"), -1.0, 0.0, float("inf")):
        with pytest.raises(ValueError, match="routed_scaling_factor"):
            fused_moe(a["x"], a["w13"], a["w2"], logits, 2, routed_scaling_factor=bad)
        with pytest.raises(ValueError, match="swiglu_limit"):
            fused_experts(*a.values(), activation="swigluoai", swiglu_limit=bad)
        with pytest.raises(ValueError, match="swiglu_alpha"):
            fused_moe(a["x"], a["w13"], a["w2"], logits, 2, activation="swigluoai", swiglu_alpha=bad)


def test_arguments_that_are_not_arrays_are_named(rng):
    """A Python list where an array belongs is refused with the argument's name and its type."""
    m = random_moe(rng, 3, 4, 2, 16, 8)
    with pytest.raises(ValueError, match=r"x must be an array of rank 2 \[T, H\].*got list"):
        fused_experts(np.asarray(m.x).tolist(), *m.args[1:])


def test_quantized_weights_name_x_and_w2_when_their_hidden_sizes_differ(rng):
    """With quant=, an x whose H is not the weights' names both x and w2 and both sizes."""
    from jax_moe import quantize_weights

    m = random_moe(rng, 3, 4, 2, 32, 16)
    q13, q2, quant = quantize_weights("fp8", m.w13, m.w2)
    with pytest.raises(ValueError, match=r"x \[T, H\] and w2 .* same H: x has H=16 .*w2 has H=32"):
        fused_experts(m.x[:, :16], q13, q2, m.topk_weights, m.topk_ids, quant=quant)
