"""FP8 (float8_e4m3fn weights and activations, per-tensor / per-token / per-channel scales) on jax_moe's
CUTLASS backend: shape rules, ValueErrors, the jnp references, the whole pipeline against backend="xla" and
the oracle's choices on CPU; the FP8 grouped GEMMs and the whole FP8 MoE (GPT-OSS-style layers too) on a GPU."""

import importlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe import fused_experts, oracle
from jax_moe.backends import cutlass as cb
from jax_moe.backends import xla
from jax_moe.backends.cutlass_gemm import full_scales, kernel_scales
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import QuantConfig

from cutlass_cases import (
    A100,
    F8,
    FP8_GEMM_TOL,
    FP8_REL_TOL,
    H100,
    SCALE_FORMS,
    fp8_gemm_problem as _fp8_gemm_problem,
    fp8_loop_reference as _fp8_loop_reference,
    fp8_moe_problem as _fp8_moe_problem,
    fp8_quantize as _fp8_quantize,
    gptoss_problem as _gptoss_problem,
    scales_in_form,
    simulate_module as _simulate_module,
    small_cfg as _cfg,
)
from helpers import jit_call as _jit, rel_err, skip_unless_available


# ----------------------------------------------------------------------------- FP8 on CPU

@pytest.mark.parametrize("form", sorted(SCALE_FORMS))
def test_the_fused_kernels_take_one_scale_forms_as_one_scale(rng, form):
    """The act and scatter GEMMs' scale operands: a per-tensor a_scale stays one scale ([1]), a
    per-expert b_scale one per expert ([E, 1]), a per-tensor one [1, 1]; vectors stay vectors
    ([M], [E, N]). Broadcast whole, they are the scales of every row and column."""
    m, e, n = 37, 4, 64
    a_scale, b_scale, row, col = scales_in_form(rng, form, m, e, n, 128)
    k_row, k_col = kernel_scales(a_scale, b_scale, (m,), e, n)
    per_row, per_expert = a_scale.size > 1, b_scale.ndim == 1
    assert k_row.shape == ((m,) if per_row else (1,))
    assert k_col.shape == ((e, n) if b_scale.ndim >= 2 else (e, 1) if per_expert else (1, 1))
    full_row, full_col = full_scales(k_row, k_col, (m,), e, n)
    np.testing.assert_array_equal(full_row, row)
    np.testing.assert_array_equal(full_col, col)


def test_fp8_shape_rule_for_every_scale_form():
    a = jax.ShapeDtypeStruct((37, 128), F8)
    b = jax.ShapeDtypeStruct((4, 64, 128), F8)
    off = jax.ShapeDtypeStruct((5,), jnp.int32)
    want = jax.ShapeDtypeStruct((37, 64), jnp.bfloat16)
    for sa in ((), (1,), (37,)):
        for sb in ((), (4,), (4, 64), (4, 64, 1)):
            scales = dict(a_scale=jax.ShapeDtypeStruct(sa, jnp.float32), b_scale=jax.ShapeDtypeStruct(sb, jnp.float32))
            assert cb.grouped_gemm_shape(a, b, off, **scales) == want
            out = jax.eval_shape(lambda a, b, o, s, t: cb.grouped_gemm(a, b, o, a_scale=s, b_scale=t),
                                 a, b, off, scales["a_scale"], scales["b_scale"])
            assert (out.shape, out.dtype) == (want.shape, want.dtype)


FP8_ERRORS = [  # changes to a valid fp8 call (a [8, 64], b [4, 128, 64], scales [8] and [4, 128]) -> message
    (dict(b=((4, 128, 64), jnp.bfloat16)), "b must have a's dtype float8_e4m3fn, got bfloat16"),
    (dict(a=((8, 64), jnp.float8_e5m2), b=((4, 128, 64), jnp.float8_e5m2)),
     "a must be bfloat16, or float8_e4m3fn .* got float8_e5m2"),
    (dict(a_scale=None), "a_scale is required with float8_e4m3fn a and b"),
    (dict(b_scale=None), "b_scale is required with float8_e4m3fn a and b"),
    (dict(a_scale=((8,), jnp.float16)), "a_scale must be float32, got float16"),
    (dict(b_scale=((4, 128), jnp.bfloat16)), "b_scale must be float32, got bfloat16"),
    (dict(a_scale=((9,), jnp.float32)), r"a_scale must have shape .*\[8\] \(per row \[M\]\); got \[9\]"),
    (dict(a_scale=((8, 1), jnp.float32)), r"a_scale must have shape .* got \[8, 1\]"),
    (dict(b_scale=((4, 136), jnp.float32)), r"b_scale must have shape .*\[4, 128\] \(per channel \[E, N\]\).* got \[4, 136\]"),
    (dict(b_scale=((8,), jnp.float32)), r"b_scale must have shape .*\[4\] \(per expert \[E\]\).* got \[8\]"),
    (dict(a=((8, 24), F8), b=((4, 128, 24), F8)), "fp8: K must be a positive multiple of 16 and N of 8 .* K=24"),
    (dict(b=((4, 12, 64), F8), b_scale=((4, 12), jnp.float32)), "N of 8 .* N=12"),
    (dict(tile="huge"), "tile must be"),
]


@pytest.mark.parametrize("change,match", FP8_ERRORS, ids=[m[:40] for _, m in FP8_ERRORS])
def test_fp8_grouped_gemm_value_errors(change, match):
    shapes = dict(a=((8, 64), F8), b=((4, 128, 64), F8), offsets=((5,), jnp.int32),
                  a_scale=((8,), jnp.float32), b_scale=((4, 128), jnp.float32))
    tile = change.pop("tile", "auto")
    shapes.update(change)
    args = {name: None if sd is None else np.ones(sd[0], sd[1]) for name, sd in shapes.items()}
    with pytest.raises(ValueError, match=match):
        cb.grouped_gemm(args["a"], args["b"], args["offsets"], a_scale=args["a_scale"], b_scale=args["b_scale"],
                        tile=tile)


def test_scales_are_refused_for_bf16_and_must_be_arrays():
    a, b, off = np.zeros((8, 64), jnp.bfloat16), np.zeros((4, 128, 64), jnp.bfloat16), np.zeros(5, np.int32)
    with pytest.raises(ValueError, match="a_scale is only taken with float8_e4m3fn a and b"):
        cb.grouped_gemm(a, b, off, a_scale=np.ones(8, np.float32))
    with pytest.raises(ValueError, match="a_scale must be a float32 array, got float"):
        cb.grouped_gemm(a.astype(F8), b.astype(F8), off, a_scale=0.5, b_scale=np.ones((), np.float32))


def test_fp8_reference_matches_the_float64_definition_with_empty_experts_and_unowned_rows(rng):
    counts = [3, 0, 5, 0, 1, 7]
    a, b, off, row, col = _fp8_gemm_problem(rng, counts, 32, 48)
    want = _fp8_loop_reference(a, b, off, row, col)
    got = cb.grouped_gemm_reference(a, b, off, a_scale=row, b_scale=col)
    assert got.dtype == jnp.bfloat16 and rel_err(got, want) < 4e-3  # bf16 rounding of d only
    # grouped_gemm itself, lowered for the CPU (a GPU runs the kernel): the same reference
    with jax.default_device(jax.devices("cpu")[0]):
        on_cpu = cb.grouped_gemm(a, b, off, a_scale=row, b_scale=col)
    np.testing.assert_array_equal(np.asarray(on_cpu, np.float32), np.asarray(got, np.float32))
    # rows past offsets[E] (expert-parallel slots) are zero, whatever their scale
    pad = jnp.asarray(rng.standard_normal((4, 48)), jnp.float32).astype(F8)
    row2 = jnp.concatenate([row, jnp.full((4,), 3.0, jnp.float32)])
    out = np.asarray(cb.grouped_gemm_reference(jnp.concatenate([a, pad]), b, off, a_scale=row2, b_scale=col),
                     np.float32)
    assert (out[16:] == 0).all() and rel_err(out[:16], want) < 4e-3


def test_fp8_scale_forms_broadcast_to_rows_and_channels(rng):
    """Per-tensor a_scale ([] or [1]) is the same as that value on every row; b_scale [] / [E] /
    [E, N, 1] the same as the [E, N] table they broadcast to."""
    a, b, off, row, col = _fp8_gemm_problem(rng, [4, 0, 6], 16, 32)
    m, (e, n) = a.shape[0], col.shape

    def run(sa, sb):
        return np.asarray(cb.grouped_gemm_reference(a, b, off, a_scale=sa, b_scale=sb), np.float32)

    s, per_e = jnp.float32(0.03), jnp.asarray(rng.uniform(0.5, 2, e), jnp.float32)
    full = run(jnp.full((m,), s), col)
    np.testing.assert_array_equal(run(s, col), full)
    np.testing.assert_array_equal(run(jnp.reshape(s, (1,)), col), full)
    np.testing.assert_array_equal(run(row, col[:, :, None]), run(row, col))
    np.testing.assert_array_equal(run(row, per_e), run(row, jnp.broadcast_to(per_e[:, None], (e, n))))
    np.testing.assert_array_equal(run(row, jnp.float32(0.5)), run(row, jnp.full((e, n), 0.5, jnp.float32)))


def test_compiled_module_matches_this_file():
    """Where this checkout built jax_moe._jax_moe_cutlass (no GPU needed): its tile and kind counts
    and alignments are backends/cutlass.py's, the fp8 workspace holds two more per-group pointer
    arrays (the scale vectors) than the bf16 one, and each scatter kind one more (each group's first
    row) than the act kind of its operands (the other epilogue without TMA descriptors), each array
    rounded up to 256 bytes, and every kind two TMA descriptors per group."""
    from jax_moe.backends.cutlass_gemm import ACT_KINDS, SCATTER_KINDS

    mod = pytest.importorskip("jax_moe._jax_moe_cutlass")
    assert cb._constants_match(mod)
    for tile in cb.TILES.values():
        for e in (1, 8, 256):
            array = -(-8 * e // 256) * 256
            bf16, f8 = (mod.workspace_size(e, tile, sm_count=132, kind=cb.KINDS[kind][0]) for kind in ("bf16", "fp8"))
            assert f8 - bf16 == 2 * array
            for scatter, act in (("bf16_kn_scatter", "bf16_act_kn"), ("fp8_scatter", "fp8_act"),
                                 ("bf16_scatter", "bf16_act")):
                sizes = [mod.workspace_size(e, tile, sm_count=132, kind=k[0]) for k in (SCATTER_KINDS[scatter],
                                                                                       ACT_KINDS[act])]
                assert sizes[0] - sizes[1] == array, (scatter, e, tile)
    # Each group's two 128-byte TMA descriptors (A and B), built by the setup launch: from one group to
    # two, that array alone crosses a 256-byte boundary.
    kinds = (*cb.KINDS.values(), *cb.GRAD_KINDS.values(), *ACT_KINDS.values(), *SCATTER_KINDS.values())
    for tile in cb.TILES.values():
        for kind in kinds:
            one, two = (mod.workspace_size(e, tile, sm_count=132, kind=kind[0]) for e in (1, 2))
            assert two - one == 256, (kind, tile)
    for bad in (dict(tile=len(cb.TILES), kind=0), dict(tile=0, kind=len(kinds))):
        with pytest.raises(ValueError, match="unknown tile or kind"):
            mod.workspace_size(8, bad["tile"], sm_count=132, kind=bad["kind"])


FP8_MODES = ("static", "dynamic", "per_token")


@pytest.mark.parametrize("activation,mode", [
    (a, m) if (a, m) in (("silu", "static"), ("silu", "per_token"), ("relu2", "dynamic"))
    else pytest.param(a, m, marks=pytest.mark.slow) for a in ("silu", "relu2") for m in FP8_MODES])
def test_fp8_pipeline_matches_xla_on_cpu(rng, mode, activation):
    """The FP8 pipeline's semantics (which scales, over which rows), on the jnp references of every
    stage: against backend="xla" on the same QuantConfig, with expert-parallel ids of -1 and
    empty experts."""
    t, e, k, h, i = 29, 16, 4, 64, 48
    x, q13, q2, tw, ids, quant = _fp8_moe_problem(rng, t, e, k, h, i, mode, activation)
    ids = ids.at[::5, 1].set(-1)
    cfg = MoEConfig(e, k, h, i, activation=activation, expert_shard=True)
    out = _jit(cb.apply, x, q13, q2, tw, ids, cfg=cfg, quant=quant)  # traced weights and scales
    ref = _jit(xla.apply, x, q13, q2, tw, ids, cfg=cfg, quant=quant)
    assert out.dtype == x.dtype and out.shape == (t, h)
    assert rel_err(out, ref) < FP8_REL_TOL


def test_fp8_router_weight_on_input_and_float32_x_match_xla_on_cpu(rng):
    t, e, h, i = 21, 8, 64, 32
    x, q13, q2, tw, ids, quant = _fp8_moe_problem(rng, t, e, 1, h, i, "dynamic")
    x = x.astype(jnp.float32)
    cfg = MoEConfig(e, 1, h, i)
    out = _jit(cb.apply, x, q13, q2, tw, ids, cfg=cfg, quant=quant, apply_router_weight_on_input=True)
    ref = _jit(xla.apply, x, q13, q2, tw, ids, cfg=cfg, quant=quant, apply_router_weight_on_input=True)
    assert out.dtype == jnp.float32 and rel_err(out, ref) < FP8_REL_TOL


@pytest.mark.parametrize("mode", FP8_MODES)
def test_fp8_gptoss_layer_matches_xla_on_cpu(rng, mode):
    """FP8 weights on a GPT-OSS-style layer: the same fused activation (bias, layout, swigluoai)
    with each activation format, against backend="xla" on the same QuantConfig."""
    t, e, k, h, i = 29, 8, 2, 64, 32
    cfg, x, w13, w2, tw, ids, b = _gptoss_problem(rng, t, e, k, h, i)
    q13, q2, quant = _fp8_quantize(x, w13, w2, cfg, mode, b["w13_bias"])
    out = _jit(cb.apply, x, q13, q2, tw, ids, cfg=cfg, quant=quant, **b)
    ref = _jit(xla.apply, x, q13, q2, tw, ids, cfg=cfg, quant=quant, **b)
    assert rel_err(out, ref) < FP8_REL_TOL


def test_fp8_dynamic_per_tensor_scales_are_over_the_tensor_handed_over(rng, monkeypatch):
    """Dynamic per-tensor: GEMM1's scale is amax(x) / 448 over all of x (tokens of skipped slots
    included, as xla quantizes x before routing); GEMM2's is amax over every routed row of the
    activation."""
    t, e, k, h, i = 9, 4, 2, 32, 16
    x, q13, q2, tw, ids, quant = _fp8_moe_problem(rng, t, e, k, h, i, "dynamic")
    ids = ids.at[0].set(-1)  # token 0 reaches no local expert
    x = x.at[0, 3].set(100.0)  # and holds the largest value
    seen = []
    real = cb.grouped_gemm
    monkeypatch.setattr(cb, "grouped_gemm", lambda *a, **kw: seen.append(kw["a_scale"]) or real(*a, **kw))
    # gather: GEMM2 is then a grouped_gemm call too (the scattering one takes the same a_scale)
    cb.apply(x, q13, q2, tw, ids, MoEConfig(e, k, h, i, expert_shard=True), quant=quant, finalize="gather")
    assert float(seen[0]) == pytest.approx(100.0 / 448, rel=1e-6)
    assert seen[1].shape == ()


def test_fp8_apply_value_errors(rng):
    x, q13, q2, tw, ids, quant = _fp8_moe_problem(rng, 4, 8, 2, 64, 32, "static")
    cfg = _cfg()
    with pytest.raises(ValueError, match="w13 must be float8_e4m3fn .*FP8 weights with quant=.*got bfloat16"):
        cb.apply(x, q13.astype(jnp.bfloat16), q2, tw, ids, cfg, quant=quant)
    with pytest.raises(ValueError, match="act 'bf16' on FP8 weights is not built"):
        cb.apply(x, q13, q2, tw, ids, cfg, quant=quant.replace(act="bf16", a13_scale=None, a2_scale=None))
    w4a8 = QuantConfig("w4a8", np.ones((8, 64, 1), np.float32), np.ones((8, 64, 1), np.float32))
    with pytest.raises(ValueError, match="scheme 'w4a8' is not built yet"):
        cb.apply(x, q13, q2, tw, ids, cfg, quant=w4a8)
    x, q13, q2, tw, ids, quant = _fp8_moe_problem(rng, 4, 8, 2, 72, 24, "per_token")
    with pytest.raises(ValueError, match="multiples of 16"):
        cb.apply(x, q13, q2, tw, ids, _cfg(h=72, i=24), quant=quant)


@pytest.mark.parametrize("mode", FP8_MODES)
def test_oracle_picks_cutlass_for_fp8_on_hopper(rng, mode, monkeypatch):
    """With the module (simulated) on an SM90 device, fused_experts' FP8 calls go to cutlass for
    every activation format it serves; the call carries no dtype feature (the scheme decides)."""
    _simulate_module(monkeypatch)
    monkeypatch.setattr(oracle, "module", lambda name: importlib.import_module(oracle.MODULES[name]))
    _, _, _, _, _, quant = _fp8_moe_problem(rng, 4, 8, 2, 64, 32, mode)
    assert cb.supports(_cfg(), quant, H100) == (True, "ok")
    assert oracle.call_features(dtype=None) == frozenset()
    assert oracle.select_backend(_cfg(), quant, device=H100).name == "cutlass"


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_moe_bench_has_a_cutlass_column_for_bf16_and_fp8(scheme, monkeypatch):
    """bench/moe_bench.py times every backend the oracle finds for the scheme: cutlass on a
    (simulated) Hopper with the module, on the stored weights (no prepare)."""
    import os

    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import moe_bench

    _simulate_module(monkeypatch)
    real = cb.supports
    monkeypatch.setattr(cb, "supports", lambda cfg, quant=None, device=None, **kw: real(cfg, quant, H100, **kw))
    m = moe_bench.MODELS["tiny"]
    w13 = jnp.ones((m.e, 2 * m.i, m.h), jnp.bfloat16) * 0.01
    w2 = jnp.ones((m.e, m.h, m.i), jnp.bfloat16) * 0.01
    _, _, quant = moe_bench.quantized(scheme, w13, w2, m)
    impls = moe_bench.implementations(MoEConfig(m.e, m.k, m.h, m.i), quant)
    assert "cutlass" in impls and impls["cutlass"][0]  # runs on the scheme's weights


def test_fp8_supports_reasons(rng, monkeypatch):
    _simulate_module(monkeypatch)
    _, _, _, _, _, quant = _fp8_moe_problem(rng, 4, 8, 2, 64, 32, "per_token")
    ok, why = cb.supports(_cfg(), quant.replace(act="bf16"), H100)
    assert not ok and why.startswith("act 'bf16' on FP8 weights is not built (have fp8_per_tensor, fp8_per_token")
    ok, why = cb.supports(_cfg(h=72, i=24), quant, H100)
    assert not ok and why == "FP8 needs hidden and intermediate sizes that are multiples of 16 (16-byte rows)"
    assert cb.supports(_cfg(activation="relu2"), quant, H100) == (True, "ok")
    assert not cb.supports(_cfg(), quant, A100)[0]


# ----------------------------------------------------------------------------- FP8 on a GPU


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["static", "dynamic", "per_token"])
def test_fp8_gptoss_layer_vs_xla_on_gpu(rng, mode):
    skip_unless_available(cb)
    t, e, k, h, i = 77, 16, 4, 512, 256
    cfg, x, w13, w2, tw, ids, b = _gptoss_problem(rng, t, e, k, h, i, minus_one=0.1)
    q13, q2, quant = _fp8_quantize(x, w13, w2, cfg, mode, b["w13_bias"])
    out = jax.jit(lambda x, q13, q2, b: cb.apply(x, q13, q2, tw, ids, cfg, quant=quant, **b))(x, q13, q2, b)
    assert rel_err(out, xla.apply(x, q13, q2, tw, ids, cfg, quant=quant, **b)) < FP8_REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_fp8_grouped_gemm_scale_forms_256_experts_mostly_empty_and_unowned_rows(rng, tile):
    """Per-tensor a_scale and per-expert b_scale (broadcast in jnp) on 256 experts, 10 with rows;
    the rows past offsets[E] come back as zeros."""
    skip_unless_available(cb)
    counts = np.zeros(256, np.int64)
    counts[rng.choice(256, 10, replace=False)] = rng.integers(1, 40, 10)
    a, b, off, _, _ = _fp8_gemm_problem(rng, counts, 256, 128)
    pad = jnp.asarray(rng.standard_normal((11, 128)), jnp.float32).astype(F8)
    a2 = jnp.concatenate([a, pad])
    s, per_e = jnp.float32(0.02), jnp.asarray(rng.uniform(0.5, 2, 256) / 16, jnp.float32)
    out = jax.jit(lambda a, b, o, s, t: cb.grouped_gemm(a, b, o, a_scale=s, b_scale=t, tile=tile))(a2, b, off, s, per_e)
    out = np.asarray(out, np.float32)
    m = a.shape[0]
    want = _fp8_loop_reference(a, b, off, jnp.full((m,), s), jnp.broadcast_to(per_e[:, None], (256, 256)))
    assert rel_err(out[:m], want) < FP8_GEMM_TOL
    assert (out[m:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("col_shape,compact", [((1, 64), True), ((4, 1), False), ((1, 1), False), ((4, 32), True)],
                         ids=["one-row-of-channels", "per-expert-to-plain", "one-to-plain", "half-the-channels"])
def test_the_handlers_refuse_a_column_scale_form_they_do_not_take(col_shape, compact):
    """The FFI handlers' own check, before any launch: the plain FP8 GEMM takes [E, N] column scales
    only; the fused ones also [E, 1] and [1, 1], never one row of channels shared by several experts."""
    skip_unless_available(cb)
    from jax_moe.backends import cutlass_gemm
    assert cutlass_gemm._register(), "the FFI targets are registered where the module loads"
    m, e, n, k = 8, 4, 64, 128
    a, b = jnp.ones((m, k), F8), jnp.ones((e, n, k), F8)
    off = jnp.asarray([0, 2, 4, 6, 8], jnp.int32)
    row, col = jnp.ones((m,), jnp.float32), jnp.ones(col_shape, jnp.float32)
    kind = "fp8_scatter" if compact else "fp8"
    ws = jax.ShapeDtypeStruct((cb.workspace_size(e, "coop_128x128", kind),), jnp.uint8)
    if compact:
        target, outs = "jax_moe_cutlass_grouped_gemm_scatter", (jax.ShapeDtypeStruct((m // 2, n), jnp.bfloat16), ws)
        args = (a, b, off, jnp.arange(m, dtype=jnp.int32), jnp.ones((m // 2, 2), jnp.float32), row, col,
                jnp.zeros((0,), jnp.float32))
        attrs = dict(transposed=np.int64(0))
    else:
        target, outs = "jax_moe_cutlass_grouped_gemm_fp8", (jax.ShapeDtypeStruct((m, n), jnp.bfloat16), ws)
        args, attrs = (a, b, off, row, col), {}
    call = jax.ffi.ffi_call(target, outs)
    with pytest.raises(Exception, match=r"col_scale must be \[E, N\] float32"):
        jax.block_until_ready(call(*args, tile=np.int64(cb.TILES["coop_128x128"]), **attrs))


FP8_MOE_CASES = [(t, e, k, mode) for mode in FP8_MODES for t in (1, 37, 1000) for e, k in ((8, 2), (256, 8))]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k,mode", FP8_MOE_CASES)
def test_fp8_backend_vs_xla(rng, t, e, k, mode):
    """FP8 per-tensor (static and dynamic scales) and per-token x per-channel against backend="xla"
    on the same quantized weights and QuantConfig; T=1 and E=256 leave most experts without rows;
    jitted, called twice."""
    skip_unless_available(cb)
    h, i = 512, 256
    x, q13, q2, tw, ids, quant = _fp8_moe_problem(rng, t, e, k, h, i, mode)
    f = jax.jit(lambda x, q13, q2, tw, ids, q: fused_experts(x, q13, q2, tw, ids, quant=q, backend="cutlass"))
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, backend="xla")
    for _ in range(2):  # cached executable, second call
        out = f(x, q13, q2, tw, ids, quant)
        assert out.dtype == x.dtype and out.shape == (t, h)
        assert rel_err(out, ref) < FP8_REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("activation,mode", [("gelu", "static"), ("relu2", "dynamic"), ("silu", "per_token")])
def test_fp8_backend_activations_tiles_and_ep_ids(rng, activation, mode):
    skip_unless_available(cb)
    t, e, k, h, i = 61, 16, 4, 256, 128
    x, q13, q2, tw, ids, quant = _fp8_moe_problem(rng, t, e, k, h, i, mode, activation)
    ids = ids.at[::3, 0].set(-1)  # expert-parallel slots owned elsewhere
    cfg = MoEConfig(e, k, h, i, activation=activation, expert_shard=True)
    ref = xla.apply(x, q13, q2, tw, ids, cfg, quant=quant)
    for tile in cb.TILES:
        out = jax.jit(lambda x, q13, q2, tw, ids: cb.apply(x, q13, q2, tw, ids, cfg, quant=quant, tile=tile))(
            x, q13, q2, tw, ids)
        assert rel_err(out, ref) < FP8_REL_TOL


@pytest.mark.gpu
def test_fp8_router_weight_on_input(rng):
    skip_unless_available(cb)
    t, e, h, i = 33, 8, 256, 128
    x, q13, q2, tw, ids, quant = _fp8_moe_problem(rng, t, e, 1, h, i, "per_token")
    cfg = MoEConfig(e, 1, h, i)
    out = jax.jit(lambda x: cb.apply(x, q13, q2, tw, ids, cfg, quant=quant, apply_router_weight_on_input=True))(x)
    ref = xla.apply(x, q13, q2, tw, ids, cfg, quant=quant, apply_router_weight_on_input=True)
    assert rel_err(out, ref) < FP8_REL_TOL


@pytest.mark.gpu
def test_fused_experts_picks_cutlass_for_fp8_on_hopper(rng):
    """On SM90 with the module built, FP8 fused_experts (per-token x per-channel, which the FlashInfer
    runner does not take) runs on cutlass without being forced, and matches xla."""
    skip_unless_available(cb)
    t, e, k, h, i = 77, 16, 4, 1024, 512
    x, q13, q2, tw, ids, quant = _fp8_moe_problem(rng, t, e, k, h, i, "per_token")
    assert oracle.select_backend(MoEConfig(e, k, h, i), quant).name == "cutlass"
    out = jax.jit(lambda x, tw, ids: fused_experts(x, q13, q2, tw, ids, quant=quant))(x, tw, ids)
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, backend="xla")
    assert rel_err(out, ref) < FP8_REL_TOL
