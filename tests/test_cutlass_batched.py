"""The batched activation format of jax_moe's CUTLASS backend (a [E, C, K] with counts [E], as after an
all-to-all dispatch; bf16 and FP8): grouped_gemm_batched and apply_batched against float64 and standard-format
definitions on CPU (the jnp references) and on a GPU."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe.backends import cutlass as cb
from jax_moe.backends import xla
from jax_moe.config import MoEConfig

from cutlass_cases import (
    F8,
    FP8_REL_TOL,
    GEMM_TOL,
    REL_TOL,
    fp8_moe_problem as _fp8_moe_problem,
    fp8_quantize as _fp8_quantize,
    gemm_problem as _gemm_problem,
    gptoss_problem as _gptoss_problem,
    moe_problem as _moe_problem,
)
from helpers import jit_call as _jit, rel_err, skip_unless_available


# ----------------------------------------------------------------------------- batched format
# a [E, C, K] (C rows of capacity per expert, as after an all-to-all dispatch), counts [E] int32
# (rows used, clamped to [0, C]) -> d [E, C, N], rows past counts zero and never read.

BATCHED_COUNTS = [0, 3, 6, 9, -2]  # capacity 6: an empty expert, a partial one, a full one, 9 -> 6, -2 -> 0
BATCHED_C = 6


def _batched_problem(rng, kind, counts, c, n, k):
    """(a [E, C, K] with NaN in every row past the clamped counts, b, counts, scale arguments)."""
    e = len(counts)
    pad = ~(np.arange(c)[None, :] < np.clip(counts, 0, c)[:, None])
    a = rng.standard_normal((e, c, k))
    a[pad] = np.nan  # never read: any value there must not reach d
    counts = jnp.asarray(counts, jnp.int32)
    if kind == "bf16":
        b = jnp.asarray(rng.standard_normal((e, n, k)) / np.sqrt(k), jnp.bfloat16)
        return jnp.asarray(a, jnp.bfloat16), b, counts, {}
    b = jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32).astype(F8)
    row = rng.uniform(0.5, 2.0, (e, c)) / 64
    row[pad] = np.nan
    col = jnp.asarray(rng.uniform(0.5, 2.0, (e, n)) / np.sqrt(k), jnp.float32)
    return (jnp.asarray(a, jnp.float32).astype(F8), b, counts,
            dict(a_scale=jnp.asarray(row, jnp.float32), b_scale=col))


def _batched_definition(a, b, counts, a_scale=None, b_scale=None) -> np.ndarray:
    """The definition in float64 numpy, expert by expert: d[e, r] = a[e, r] @ b[e].T (fp8: times
    a_scale[e, r] * b_scale[e, n]) for r < clamp(counts[e], 0, C); every other row zero."""
    a, b = np.asarray(a.astype(jnp.float32), np.float64), np.asarray(b.astype(jnp.float32), np.float64)
    e, c, _ = a.shape
    d = np.zeros((e, c, b.shape[1]), np.float64)
    for g in range(e):
        r = min(max(int(counts[g]), 0), c)
        d[g, :r] = a[g, :r] @ b[g].T
        if a_scale is not None:
            d[g, :r] *= np.asarray(b_scale, np.float64)[g][None, :] * np.asarray(a_scale, np.float64)[g, :r, None]
    return d


def test_batched_shape_rule():
    b = jax.ShapeDtypeStruct((4, 128, 64), jnp.bfloat16)
    a = jax.ShapeDtypeStruct((4, 37, 64), jnp.bfloat16)
    counts = jax.ShapeDtypeStruct((4,), jnp.int32)
    assert cb.grouped_gemm_batched_shape(a, b, counts) == jax.ShapeDtypeStruct((4, 37, 128), jnp.bfloat16)
    out = jax.eval_shape(lambda a, b, c: cb.grouped_gemm_batched(a, b, c, tile="coop_128x128"), a, b, counts)
    assert (out.shape, out.dtype) == ((4, 37, 128), jnp.bfloat16)
    a8, b8 = jax.ShapeDtypeStruct((4, 37, 64), F8), jax.ShapeDtypeStruct((4, 128, 64), F8)
    for sa in ((), (1,), (4, 37)):
        for sb in ((), (4,), (4, 128), (4, 128, 1)):
            scales = dict(a_scale=jax.ShapeDtypeStruct(sa, jnp.float32), b_scale=jax.ShapeDtypeStruct(sb, jnp.float32))
            assert cb.grouped_gemm_batched_shape(a8, b8, counts, **scales).shape == (4, 37, 128)
    assert cb.grouped_gemm_batched(np.zeros((4, 0, 64), jnp.bfloat16), np.zeros((4, 128, 64), jnp.bfloat16),
                                   np.zeros(4, np.int32)).shape == (4, 0, 128)


BATCHED_ERRORS = [  # changes to a valid call (a [4, 8, 64], b [4, 128, 64], counts [4]) -> message
    (dict(a=((32, 64), jnp.bfloat16)), r"a must have rank 3 \[E, C, K\]"),
    (dict(counts=((4, 1), jnp.int32)), r"counts must have rank 1 \[E\]"),
    (dict(counts=((4,), np.int64)), "counts must be int32, got int64"),
    (dict(counts=((5,), jnp.int32)), "counts must have E = 4 elements"),
    (dict(a=((3, 8, 64), jnp.bfloat16), counts=((3,), jnp.int32)), "b must be .* with a's E = 3 experts"),
    (dict(b=((4, 128, 32), jnp.bfloat16)), "b must be \\[E, N, K\\] with a's K = 64"),
    (dict(a=((4, 8, 64), jnp.float32)), "a must be bfloat16, or float8_e4m3fn"),
    (dict(b=((4, 128, 64), jnp.float16)), "b must have a's dtype bfloat16"),
    (dict(a=((4, 8, 60), jnp.bfloat16), b=((4, 128, 60), jnp.bfloat16)), "K must be a positive multiple of 8"),
    (dict(b=((4, 12, 64), jnp.bfloat16)), "N of 8"),
    (dict(a_scale=((32,), jnp.float32)), "a_scale is only taken with float8_e4m3fn"),
    (dict(tile="huge"), "tile must be"),
]
BATCHED_FP8_ERRORS = [  # changes to a valid fp8 call (a [4, 8, 64], scales [4, 8] and [4, 128]) -> message
    (dict(a_scale=((32,), jnp.float32)), r"a_scale must have shape .*\[4, 8\] \(per row \[E, C\]\); got \[32\]"),
    (dict(a_scale=None), "a_scale is required"),
    (dict(b_scale=((4, 136), jnp.float32)), r"b_scale must have shape .* got \[4, 136\]"),
    (dict(a=((4, 8, 24), F8), b=((4, 128, 24), F8)), "fp8: K must be a positive multiple of 16"),
]


def _call_with(shapes, change):
    tile = change.pop("tile", "auto")
    shapes.update(change)
    args = {name: None if sd is None else np.ones(sd[0], sd[1]) for name, sd in shapes.items()}  # numpy: int64 stays
    return cb.grouped_gemm_batched(args.pop("a"), args.pop("b"), args.pop("counts"), tile=tile, **args)


@pytest.mark.parametrize("change,match", BATCHED_ERRORS, ids=[m[:40] for _, m in BATCHED_ERRORS])
def test_batched_value_errors(change, match):
    with pytest.raises(ValueError, match=match):
        _call_with(dict(a=((4, 8, 64), jnp.bfloat16), b=((4, 128, 64), jnp.bfloat16), counts=((4,), jnp.int32)),
                   dict(change))


@pytest.mark.parametrize("change,match", BATCHED_FP8_ERRORS, ids=[m[:40] for _, m in BATCHED_FP8_ERRORS])
def test_batched_fp8_value_errors(change, match):
    with pytest.raises(ValueError, match=match):
        _call_with(dict(a=((4, 8, 64), F8), b=((4, 128, 64), F8), counts=((4,), jnp.int32),
                        a_scale=((4, 8), jnp.float32), b_scale=((4, 128), jnp.float32)), dict(change))


@pytest.mark.parametrize("kind", sorted(cb.KINDS))
def test_batched_reference_matches_the_float64_definition(rng, kind):
    """Empty experts, a full one, counts past C (clamped to C) and below 0 (clamped to 0); NaN in
    every unused row of a (and of a_scale) reaches nothing; grouped_gemm_batched lowered for the
    CPU is that reference."""
    a, b, counts, scales = _batched_problem(rng, kind, BATCHED_COUNTS, BATCHED_C, 32, 48)
    want = _batched_definition(a, b, BATCHED_COUNTS, **scales)
    got = cb.grouped_gemm_batched_reference(a, b, counts, **scales)
    assert got.dtype == jnp.bfloat16 and got.shape == (5, BATCHED_C, 32)
    assert rel_err(got, want) < 4e-3  # d's bf16 rounding only
    got = np.asarray(got, np.float32)
    assert (got[0] == 0).all() and (got[1, 3:] == 0).all() and (got[4] == 0).all()
    assert (got[3] != 0).any()  # 9 > C: all C rows
    with jax.default_device(jax.devices("cpu")[0]):  # lowered for the CPU (a GPU runs the kernel)
        on_cpu = jax.jit(cb.grouped_gemm_batched)(a, b, counts, **scales)
    np.testing.assert_array_equal(np.asarray(on_cpu, np.float32), got)


def test_batched_is_the_standard_format_with_a_gap_after_each_expert(rng):
    """Expert e's rows at e*C + [0, counts[e]) of the flattened rows: the standard format's
    result on the same rows, zeros in the gaps."""
    counts, c = [2, 0, 5, 1], 5
    a, b, off = _gemm_problem(rng, counts, 16, 32)
    std = np.asarray(cb.grouped_gemm_reference(a, b, off), np.float32)
    packed = np.zeros((4, c, 32), np.float32)
    for e in range(4):
        packed[e, :counts[e]] = np.asarray(a[int(off[e]):int(off[e + 1])], np.float32)
    out = np.asarray(cb.grouped_gemm_batched(jnp.asarray(packed, jnp.bfloat16), b, jnp.asarray(counts, jnp.int32)),
                     np.float32)
    for e in range(4):
        np.testing.assert_allclose(out[e, :counts[e]], std[int(off[e]):int(off[e + 1])], rtol=1e-2, atol=1e-2)
        assert (out[e, counts[e]:] == 0).all()


def _batched_moe_problem(rng, e, c, h, i, counts, quant_mode=None, activation="silu"):
    """x [E, C, H] bf16 with NaN padding rows past the clamped counts, the weights (bf16, or FP8 as
    _fp8_moe_problem's ``quant_mode``), the config and quant."""
    if quant_mode is None:
        _, w13, w2, _, _ = _moe_problem(rng, 1, e, 1, h, i, gated=activation != "relu2")
        quant = None
    else:
        _, w13, w2, _, _, quant = _fp8_moe_problem(rng, 4, e, 1, h, i, quant_mode, activation)
    x = rng.standard_normal((e, c, h))
    x[~(np.arange(c)[None, :] < np.clip(counts, 0, c)[:, None])] = np.nan
    return jnp.asarray(x, jnp.bfloat16), w13, w2, MoEConfig(e, 1, h, i, activation=activation), quant


def _batched_expert_definition(x, counts, w13, w2, cfg, quant, **biases):
    """y[e, r] = expert_e(x[e, r]) on the used rows, zero elsewhere: backend="xla" with top-1 and
    weight 1 on the flattened rows (the padding zeroed first, so dynamic scales see what
    apply_batched's do); ``biases``: w13_bias / w2_bias."""
    e, c, h = x.shape
    used = np.arange(c)[None, :] < np.clip(np.asarray(counts), 0, c)[:, None]
    xf = jnp.where(jnp.asarray(used)[..., None], x, 0).reshape(e * c, h)
    ids = jnp.repeat(jnp.arange(e, dtype=jnp.int32), c)[:, None]
    y = _jit(xla.apply, xf, w13, w2, jnp.ones((e * c, 1), jnp.float32), ids, cfg=cfg, quant=quant,
             **biases).reshape(e, c, h)
    return np.where(used[..., None], np.asarray(y, np.float32), 0.0)


def _batched_gptoss_problem(rng, e, c, h, i, counts, quant_mode):
    """A GPT-OSS-style layer (swigluoai, interleaved, both biases) on the batched format: x [E, C, H]
    with NaN padding, the weights (bf16, or FP8 as _fp8_quantize's ``quant_mode``), cfg, quant, biases."""
    cfg, _, w13, w2, _, _, b = _gptoss_problem(rng, 4, e, 1, h, i)
    x = rng.standard_normal((e, c, h))
    x[~(np.arange(c)[None, :] < np.clip(counts, 0, c)[:, None])] = np.nan
    x = jnp.asarray(x, jnp.bfloat16)
    quant = None
    if quant_mode is not None:
        w13, w2, quant = _fp8_quantize(jnp.nan_to_num(x.reshape(e * c, h)), w13, w2, cfg, quant_mode, b["w13_bias"])
    return x, w13, w2, cfg, quant, b


@pytest.mark.parametrize("quant_mode", [None, "dynamic", "per_token"])
def test_apply_batched_with_gptoss_biases_on_cpu(rng, quant_mode):
    """The batched expert stage on a GPT-OSS-style layer: each used row's expert bias (GEMM1's
    inside the activation, GEMM2's on the output), unused rows zero (their activations, non-zero
    with a bias, never read and never in a dynamic scale), NaN padding never read."""
    counts = [3, 0, 6, 8, 1, -1, 2, 6]
    x, w13, w2, cfg, quant, b = _batched_gptoss_problem(rng, 8, 6, 64, 32, counts, quant_mode)
    out = _jit(cb.apply_batched, x, jnp.asarray(counts, jnp.int32), w13, w2, cfg=cfg, quant=quant, **b)
    want = _batched_expert_definition(x, counts, w13, w2, cfg, quant, **b)
    assert rel_err(out, want) < (REL_TOL if quant is None else FP8_REL_TOL)
    out = np.asarray(out, np.float32)
    assert (out[1] == 0).all() and (out[0, 3:] == 0).all() and (out[5] == 0).all()


BATCHED_MOE_CASES = [(None, "silu"), (None, "relu2"), ("static", "gelu"), ("dynamic", "silu"),
                     ("per_token", "silu"), ("per_token", "relu2")]


@pytest.mark.parametrize("quant_mode,activation", [c if c not in ((None, "relu2"), ("per_token", "silu"))
                                                    else pytest.param(*c, marks=pytest.mark.slow)
                                                    for c in BATCHED_MOE_CASES])
def test_apply_batched_is_each_expert_on_its_rows_on_cpu(rng, quant_mode, activation):
    """apply_batched's semantics on the jnp references of every stage: each used row through its
    expert (backend="xla" as the definition), unused rows zero, NaN padding never read."""
    counts = [3, 0, 6, 8, 1, -1, 2, 6]
    x, w13, w2, cfg, quant = _batched_moe_problem(rng, 8, 6, 64, 32, counts, quant_mode, activation)
    out = _jit(cb.apply_batched, x, jnp.asarray(counts, jnp.int32), w13, w2, cfg=cfg, quant=quant)
    assert out.dtype == x.dtype and out.shape == x.shape
    want = _batched_expert_definition(x, counts, w13, w2, cfg, quant)
    assert rel_err(out, want) < (REL_TOL if quant is None else FP8_REL_TOL)
    out = np.asarray(out, np.float32)
    assert (out[1] == 0).all() and (out[0, 3:] == 0).all() and (out[5] == 0).all()


def test_apply_batched_value_errors(rng):
    x, w13, w2, cfg, _ = _batched_moe_problem(rng, 8, 4, 64, 32, [1] * 8)
    counts = jnp.ones(8, jnp.int32)
    with pytest.raises(ValueError, match=r"x must have rank 3 \[E, C, H\]"):
        cb.apply_batched(x.reshape(32, 64), counts, w13, w2, cfg)
    with pytest.raises(ValueError, match="counts must be int32"):
        cb.apply_batched(x, np.ones(8, np.int64), w13, w2, cfg)
    with pytest.raises(ValueError, match="must have the weights' E = 8 experts"):
        cb.apply_batched(x[:4], counts[:4], w13, w2, cfg)
    with pytest.raises(ValueError, match="shape mismatch"):
        cb.apply_batched(x[..., :32], counts, w13, w2, cfg)
    with pytest.raises(ValueError, match="w13 must be bfloat16"):
        cb.apply_batched(x, counts, w13.astype(jnp.float32), w2, cfg)
    with pytest.raises(ValueError, match="tile must be"):
        cb.apply_batched(x, counts, w13, w2, cfg, tile="huge")
    assert cb.apply_batched(x[:, :0], counts, w13, w2, cfg).shape == (8, 0, 64)


# ----------------------------------------------------------------------------- batched format on a GPU


BATCHED_GEMM_CASES = [  # (counts, C, N, K)
    ([1], 1, 128, 64),                                 # one row
    ([0, 5, 64, 70, -3, 17, 0, 1], 64, 256, 128),      # empty, full, clamped above and below
    ([129, 300, 7, 0], 300, 384, 512),                 # more rows than a tile, several K tiles
    ([1, 2, 3, 4, 5, 6, 7, 8], 8, 200, 144),           # N not a multiple of the tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(cb.KINDS))
@pytest.mark.parametrize("tile", sorted(cb.TILES))
@pytest.mark.parametrize("case", range(len(BATCHED_GEMM_CASES)))
def test_batched_grouped_gemm_vs_definition(rng, kind, tile, case):
    """The kernels on the batched format against the float64 definition (NaN padding never read,
    rows past the counts zero) and the jnp reference, jitted, twice."""
    skip_unless_available(cb)
    counts, c, n, k = BATCHED_GEMM_CASES[case]
    a, b, cnt, scales = _batched_problem(rng, kind, counts, c, n, k)
    want = _batched_definition(a, b, counts, **scales)
    f = jax.jit(lambda a, b, o, s: cb.grouped_gemm_batched(a, b, o, tile=tile, **s))
    for _ in range(2):
        out = f(a, b, cnt, scales)
        assert out.dtype == jnp.bfloat16 and out.shape == (len(counts), c, n)
        assert rel_err(out, want) < GEMM_TOL[kind]
        assert (np.asarray(out, np.float32)[want == 0] == 0).all()
    assert rel_err(out, cb.grouped_gemm_batched_reference(a, b, cnt, **scales)) < GEMM_TOL[kind]


@pytest.mark.gpu
@pytest.mark.parametrize("quant_mode,activation", BATCHED_MOE_CASES)
def test_apply_batched_vs_definition_on_gpu(rng, quant_mode, activation):
    skip_unless_available(cb)
    counts = [3, 0, 40, 64, 1, -1, 17, 99]
    x, w13, w2, cfg, quant = _batched_moe_problem(rng, 8, 64, 512, 256, counts, quant_mode, activation)
    want = _batched_expert_definition(x, counts, w13, w2, cfg, quant)
    f = jax.jit(lambda x, c: cb.apply_batched(x, c, w13, w2, cfg, quant=quant))
    for _ in range(2):
        out = f(x, jnp.asarray(counts, jnp.int32))
        assert rel_err(out, want) < (REL_TOL if quant is None else FP8_REL_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("quant_mode", [None, "dynamic", "per_token"])
def test_apply_batched_with_gptoss_biases_on_gpu(rng, quant_mode):
    skip_unless_available(cb)
    counts = [3, 0, 40, 64, 1, -1, 17, 99]
    x, w13, w2, cfg, quant, b = _batched_gptoss_problem(rng, 8, 64, 512, 256, counts, quant_mode)
    want = _batched_expert_definition(x, counts, w13, w2, cfg, quant, **b)
    f = jax.jit(lambda x, c, b: cb.apply_batched(x, c, w13, w2, cfg, quant=quant, **b))
    for _ in range(2):
        out = f(x, jnp.asarray(counts, jnp.int32), b)
        assert rel_err(out, want) < (REL_TOL if quant is None else FP8_REL_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("quant_mode", [None, "static", "per_token"])
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_apply_batched_vs_standard_apply_on_the_same_tokens(rng, quant_mode, tile):
    """The same tokens two ways: the standard apply (top-1, weight 1: each token through its
    expert) and apply_batched on those tokens packed per expert into [E, C, H]."""
    skip_unless_available(cb)
    t, e, h, i = 200, 16, 256, 128
    if quant_mode is None:
        x, w13, w2, _, ids = _moe_problem(rng, t, e, 1, h, i)
        quant = None
    else:
        x, w13, w2, _, ids, quant = _fp8_moe_problem(rng, t, e, 1, h, i, quant_mode)
    ids = np.asarray(ids)[:, 0]
    cfg = MoEConfig(e, 1, h, i)
    counts = np.bincount(ids, minlength=e)
    c = int(counts.max())
    rank = np.array([np.sum(ids[:j] == ids[j]) for j in range(t)])  # each token's row in its expert
    packed = jnp.zeros((e, c, h), x.dtype).at[ids, rank].set(x)
    std = jax.jit(lambda x: cb.apply(x, w13, w2, jnp.ones((t, 1), jnp.float32), jnp.asarray(ids[:, None]), cfg,
                                     quant=quant, tile=tile))(x)
    out = jax.jit(lambda p, n: cb.apply_batched(p, n, w13, w2, cfg, quant=quant, tile=tile))(
        packed, jnp.asarray(counts, jnp.int32))
    assert rel_err(np.asarray(out, np.float32)[ids, rank], std) < (REL_TOL if quant is None else FP8_REL_TOL)


_BATCHED_COMMAND_BUFFER_SCRIPT = """
import numpy as np, jax, jax.numpy as jnp
from jax_moe.backends import cutlass as cb, xla
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import quantize_weights
rng = np.random.default_rng({seed})
e, c, h, i = 16, 48, 256, 128
w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.float32)
w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.float32)
cases = [(w13.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), None),
         quantize_weights("fp8", w13, w2, act="fp8_per_token", weight_scale="per_channel")]
cfg = MoEConfig(e, 1, h, i)
for q13, q2, quant in cases:
    f = jax.jit(lambda x, n: cb.apply_batched(x, n, q13, q2, cfg, quant=quant))
    for _ in range(3):  # fresh inputs, fresh counts (0, partial, > C)
        counts = rng.integers(-2, c + 10, e).astype(np.int32)
        used = np.arange(c)[None, :] < np.clip(counts, 0, c)[:, None]
        x = jnp.asarray(np.where(used[..., None], rng.standard_normal((e, c, h)), 0.0), jnp.bfloat16)
        out = np.asarray(f(x, jnp.asarray(counts)), np.float32)
        ids = jnp.repeat(jnp.arange(e, dtype=jnp.int32), c)[:, None]
        ref = xla.apply(x.reshape(e * c, h), q13, q2, jnp.ones((e * c, 1), jnp.float32), ids, cfg, quant=quant)
        ref = np.where(used[..., None], np.asarray(ref, np.float32).reshape(e, c, h), 0.0)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert np.isfinite(out).all() and err < {tol} and (out[~used] == 0).all(), err
print("OK", len(cases))
"""


@pytest.mark.gpu
def test_apply_batched_under_command_buffers(command_buffer_check):
    """The batched format declares nothing new: the same targets, still no host sync; bf16 and
    FP8 (per token) apply_batched with XLA's command buffers forced on, fresh counts each round."""
    skip_unless_available(cb)
    assert command_buffer_check("cutlass", "", FP8_REL_TOL, script=_BATCHED_COMMAND_BUFFER_SCRIPT) == 2
