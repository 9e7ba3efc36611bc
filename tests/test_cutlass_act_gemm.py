"""GEMM1 with the gated activation in its epilogue (jax_moe.backends.cutlass_act_gemm): the
definition in float64, the argument errors, when the cutlass forward takes it, and on the GPU the
kernel against the definition and the fused forward against the unfused one and the xla backend."""

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe.backends import cutlass as cb
from jax_moe.backends import xla
from jax_moe.backends.cutlass_act_gemm import (
    FUSED_ACT_ENV,
    fuses_activation,
    gemm1_tile,
    grouped_gemm_act,
    grouped_gemm_act_reference,
    grouped_gemm_act_shape,
)
from jax_moe.layouts.gated import reorder_rows_for_gated_act_gemm
from jax_moe.quant.scheme import QuantConfig

from cutlass_cases import F8, FP8_REL_TOL, REL_TOL, fp8_gemm_problem, gemm_problem, gptoss_problem, small_cfg
from cutlass_cases import each_scale_form, fp8_problem_in_form, scale_broadcasts, spread_counts
from helpers import poison_memory, rel_err, skip_unless_available

ALPHA, LIMIT = 1.5, 4.0  # swigluoai's constants, not the defaults


def act64(g, u, activation):
    """act(gate) * up in float64, from the activations' definitions."""
    from math import erf

    if activation == "silu":
        return g / (1 + np.exp(-g)) * u
    if activation == "gelu":
        return 0.5 * g * (1 + np.vectorize(erf, otypes=[np.float64])(g / np.sqrt(2))) * u
    g, u = np.minimum(g, LIMIT), np.clip(u, -LIMIT, LIMIT)
    return (u + 1) * g / (1 + np.exp(-ALPHA * g))


def definition(a, b, offsets, activation, bias=None, row=None, col=None):
    """d[r, i] = act(h[2i], h[2i+1]), h = a[r] @ b[e].T (* row[r] * col[e]) + bias[e], expert by
    expert in float64; rows outside the offsets zero."""
    a, b = np.asarray(a.astype(jnp.float32), np.float64), np.asarray(b.astype(jnp.float32), np.float64)
    off = np.asarray(offsets)
    d = np.zeros((a.shape[0], b.shape[1] // 2))
    for e in range(b.shape[0]):
        r = slice(off[e], off[e + 1])
        h = a[r] @ b[e].T
        if row is not None:
            h = h * np.asarray(col, np.float64)[e][None, :] * np.asarray(row, np.float64)[r, None]
        if bias is not None:
            h = h + np.asarray(bias, np.float64)[e][None, :]
        d[r] = act64(h[:, 0::2], h[:, 1::2], activation)
    return d


def bf16_case(rng, counts, n=128, k=64, bias=True):
    a, b, off = gemm_problem(rng, counts, n, k)
    b = (b * 2).astype(jnp.bfloat16)  # gate/up values past swigluoai's limit
    bias_v = jnp.asarray(rng.standard_normal((len(counts), n)), jnp.float32) if bias else None
    return a, b, off, bias_v


def fp8_case(rng, counts, n=128, k=128):
    """FP8 rows and weights with per-row and per-channel scales (the FP8 GEMM tests' problem)."""
    return fp8_gemm_problem(rng, counts, n, k)


def fp8_silu_act(tile: str):
    """GEMM1 with silu on FP8 operands on ``tile``, jitted: (a, b, offsets, row scales, column
    scales, the static output scale) -> FP8 d."""
    return jax.jit(lambda a, b, o, r, c, s: grouped_gemm_act(a, b, o, "silu", a_scale=r, b_scale=c, out_scale=s,
                                                             tile=tile))


def calibrated(values) -> jax.Array:
    """A static FP8 scale for ``values``: amax / 448, as a calibration would set it."""
    return jnp.float32(np.abs(values).max() / 448)


def assert_fp8_silu_act_is_the_definition(tile, a, b, off, a_scale, b_scale, row, col):
    """:func:`fp8_silu_act` on ``tile``, over poisoned memory, with the scales in the form given
    (``a_scale``, ``b_scale``), against the definition with them per row and per column (``row``,
    ``col``) and a calibrated output scale. Returns the jitted GEMM and that scale."""
    want = definition(a, b, off, "silu", row=row, col=col)
    out_scale = calibrated(want)
    fn = fp8_silu_act(tile)
    poison_memory(jax.eval_shape(fn, a, b, off, a_scale, b_scale, out_scale))
    got = fn(a, b, off, a_scale, b_scale, out_scale)
    assert rel_err(fp8_value(got, out_scale), want) < FP8_REL_TOL
    return fn, out_scale


def assert_bf16_act_is_the_definition(tile, a, b, off, bias, activation, transposed=False):
    """The bf16 kernel on ``tile`` (swigluoai's constants ALPHA and LIMIT, which the other activations
    ignore; b given as [E, 2I, H], run as [E, H, 2I] where ``transposed``) over poisoned output, against
    the float64 definition."""
    bb = jnp.swapaxes(b, 1, 2) if transposed else b
    fn = jax.jit(lambda a, bb, o, bias: grouped_gemm_act(a, bb, o, activation, alpha=ALPHA, limit=LIMIT, bias=bias,
                                                         tile=tile, transposed=transposed))
    poison_memory(jax.eval_shape(fn, a, bb, off, bias))
    got = np.asarray(fn(a, bb, off, bias), np.float32)
    assert rel_err(got, definition(a, b, off, activation, bias)) < REL_TOL


def fp8_value(q, scale):
    return np.asarray(q.astype(jnp.float32), np.float64) * float(scale)


# ----------------------------------------------------------------------------- the definition (CPU)


@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
def test_reference_is_the_gated_activation_of_the_grouped_gemm_with_bias(rng, activation):
    """The jnp reference against the float64 definition: pairs (2i, 2i+1), the bias before the
    activation, an expert without rows, rows past offsets[E] zero."""
    a, b, off, bias = bf16_case(rng, [5, 0, 9, 3])
    pad = jnp.concatenate([a, jnp.asarray(rng.standard_normal((4, a.shape[1])), jnp.bfloat16)])
    got = grouped_gemm_act_reference(pad, b, off, activation, alpha=ALPHA, limit=LIMIT, bias=bias)
    assert got.shape == (pad.shape[0], b.shape[1] // 2) and got.dtype == jnp.bfloat16
    want = definition(a, b, off, activation, bias)
    assert rel_err(got[: a.shape[0]], want) < REL_TOL
    assert (np.asarray(got[a.shape[0]:], np.float32) == 0).all()


def test_fp8_reference_applies_the_scales_then_quantizes_with_the_static_scale(rng):
    a, b, off, row, col = fp8_case(rng, [7, 2, 0, 11])
    want = definition(a, b, off, "silu", row=row, col=col)
    out_scale = calibrated(want)
    got = grouped_gemm_act_reference(a, b, off, "silu", a_scale=row, b_scale=col, out_scale=out_scale)
    assert got.dtype == F8
    assert rel_err(fp8_value(got, out_scale), want) < FP8_REL_TOL


def test_the_reference_equals_the_unfused_pipeline_on_interleaved_weights(rng):
    """grouped_gemm then act_and_mul (layout interleaved) computes the same rows, up to the bf16
    rounding of the pre-activation that the fused epilogue does not do."""
    from jax_moe import kernels

    a, b, off, bias = bf16_case(rng, [6, 4, 8])
    h = cb.grouped_gemm_reference(a, b, off)
    unfused = kernels.act_and_mul_reference(h, "silu", layout="interleaved", bias=bias, offsets=off)
    fused = grouped_gemm_act_reference(a, b, off, "silu", bias=bias)
    assert rel_err(fused, np.asarray(unfused, np.float32)) < REL_TOL


def test_transposed_weights_give_the_same_rows(rng):
    """``transposed=True`` takes b [E, K, 2I] (N contiguous, the prepared layout): the same d."""
    a, b, off, bias = bf16_case(rng, [5, 0, 9, 3])
    got = grouped_gemm_act_reference(a, jnp.swapaxes(b, 1, 2), off, "swigluoai", alpha=ALPHA, limit=LIMIT,
                                      bias=bias, transposed=True)
    assert rel_err(got, definition(a, b, off, "swigluoai", bias)) < REL_TOL
    assert grouped_gemm_act_shape(a, jnp.swapaxes(b, 1, 2), off, transposed=True) == \
        jax.ShapeDtypeStruct((a.shape[0], b.shape[1] // 2), jnp.bfloat16)


def test_shape_rule(rng):
    a, b, off, _ = bf16_case(rng, [3, 3])
    assert grouped_gemm_act_shape(a, b, off) == jax.ShapeDtypeStruct((6, 64), jnp.bfloat16)
    a8, b8, off8, row, col = fp8_case(rng, [3, 3])
    s = grouped_gemm_act_shape(a8, b8, off8, a_scale=row, b_scale=col, out_scale=jnp.float32(1))
    assert s == jax.ShapeDtypeStruct((6, 64), F8)


def _errors(rng):
    a, b, off, bias = bf16_case(rng, [3, 3])
    a8, b8, off8, row, col = fp8_case(rng, [3, 3])
    one = jnp.float32(1)
    return [
        (lambda: grouped_gemm_act(a, b, off, "relu2"), "activation must be one of"),
        (lambda: grouped_gemm_act(a, b[:, :120], off), "N = 2I must be a multiple of 16"),
        (lambda: grouped_gemm_act(a8, b8[:, :112], off8, a_scale=row, b_scale=col[:, :112], out_scale=one),
         "N = 2I must be a multiple of 32"),
        (lambda: grouped_gemm_act(a, b, off, bias=bias[:, :64]), "bias must have shape"),
        (lambda: grouped_gemm_act(a, b, off, out_scale=one), "out_scale is only taken"),
        (lambda: grouped_gemm_act(a8, b8, off8, a_scale=row, b_scale=col), "out_scale .* is required"),
        (lambda: grouped_gemm_act(a, b, off, tile="huge"), "tile must be"),
        (lambda: grouped_gemm_act(a, b, off, transposed=True), r"transposed b must be \[E, K, 2I\] with a's K"),
        (lambda: grouped_gemm_act(a8, jnp.swapaxes(b8, 1, 2), off8, a_scale=row, b_scale=col, out_scale=one,
                                  transposed=True), "transposed b .* is bf16 only"),
    ]


@pytest.mark.parametrize("case", range(9))
def test_value_errors_name_the_argument(rng, case):
    fn, match = _errors(rng)[case]
    with pytest.raises(ValueError, match=match):
        fn()


def test_the_forward_fuses_gated_interleaved_bf16_and_static_fp8_on_the_pingpong_tiles(monkeypatch):
    inter = small_cfg(gate_up_layout="interleaved")
    static = QuantConfig("fp8", w13_scale=1.0, w2_scale=1.0, act="fp8_per_tensor", a13_scale=1.0, a2_scale=1.0)
    assert fuses_activation(inter)
    assert fuses_activation(small_cfg(activation="swigluoai", gate_up_layout="interleaved"))
    assert fuses_activation(inter, static)
    assert not fuses_activation(small_cfg())  # concat: gate and up in different tiles
    assert not fuses_activation(small_cfg(activation="relu2"))
    assert not fuses_activation(inter, dataclasses.replace(static, a2_scale=None))  # dynamic: needs the whole row
    assert not fuses_activation(inter, dataclasses.replace(static, act="fp8_per_token"))
    assert not fuses_activation(small_cfg(i=36, gate_up_layout="interleaved"))  # 2I = 72: d rows of 72 bytes
    for pingpong in ("pingpong_64x128", "pingpong_64x128_k256", "pingpong_64x256"):
        assert fuses_activation(inter, None, pingpong)  # one warpgroup's epilogue under the other's mainloop
    assert fuses_activation(inter, None, "coop_128x256")  # a short epilogue against a long 128x256 mainloop
    assert not fuses_activation(inter, None, "coop_128x128")  # its epilogue is not hidden under a mainloop
    for tile in sorted(cb.TILES):  # FP8 static: on every tile (half the bytes out, and no second pass)
        assert fuses_activation(inter, static, tile)
    monkeypatch.setenv(FUSED_ACT_ENV, "all")
    assert fuses_activation(inter, None, "coop_128x128")
    monkeypatch.setenv(FUSED_ACT_ENV, "0")
    assert not fuses_activation(inter)
    assert not fuses_activation(inter, None, "pingpong_64x128")


def test_the_forward_picks_gemm1s_tile_together_with_its_activation(monkeypatch):
    """Where the layer may fuse, GEMM1's tile comes from the table's GEMM1-with-activation rows;
    a layer that cannot fuse (concatenated gate/up) takes the GEMM's own pick."""
    from jax_moe.backends import cutlass_tiles as ct
    from jax_moe.backends.cutlass_act_gemm import forward_gemm1

    e, h, i, rows = 16, 512, 128, 16 * 4
    monkeypatch.setitem(ct.MEASURED, ("bf16_kn", e, 2 * i, h), ((4.0, "coop_128x128"),))
    monkeypatch.setitem(ct.MEASURED, ("bf16_kn_act", e, 2 * i, h), ((4.0, "pingpong_64x256"),))
    a1 = jax.ShapeDtypeStruct((rows, h), jnp.bfloat16)
    w13t = jax.ShapeDtypeStruct((e, h, 2 * i), jnp.bfloat16)
    cfg = dataclasses.replace(small_cfg(e, 2, h, i), gate_up_layout="interleaved")
    assert forward_gemm1(cfg, None, "auto", a1, w13t, transposed=True) == ("pingpong_64x256", True)
    concat = dataclasses.replace(cfg, gate_up_layout="concat")
    assert forward_gemm1(concat, None, "auto", a1, w13t, transposed=True) == ("coop_128x128", False)
    assert forward_gemm1(cfg, None, "coop_128x128", a1, w13t, transposed=True) == ("coop_128x128", False)
    # FP8 with a static GEMM2 input scale fuses, so it reads the fp8_act rows; per-token scales do not
    monkeypatch.setitem(ct.MEASURED, ("fp8", e, 2 * i, h), ((4.0, "coop_128x128"),))
    monkeypatch.setitem(ct.MEASURED, ("fp8_act", e, 2 * i, h), ((4.0, "pingpong_64x128_k256"),))
    static = QuantConfig("fp8", w13_scale=1.0, w2_scale=1.0, act="fp8_per_tensor", a13_scale=1.0, a2_scale=1.0)
    a8 = jax.ShapeDtypeStruct((rows, h), jnp.float8_e4m3fn)
    w8 = jax.ShapeDtypeStruct((e, 2 * i, h), jnp.float8_e4m3fn)
    assert forward_gemm1(cfg, static, "auto", a8, w8) == ("pingpong_64x128_k256", True)
    per_token = QuantConfig("fp8", w13_scale=1.0, w2_scale=1.0, act="fp8_per_token")
    assert forward_gemm1(cfg, per_token, "auto", a8, w8) == ("coop_128x128", False)


def test_gemm1_tile_is_the_grouped_gemms_pick_or_the_forced_one():
    from jax_moe.backends.cutlass_gemm import pick_tile

    w13 = jax.ShapeDtypeStruct((128, 1536, 2048), jnp.bfloat16)
    for rows in (8, 8 * 1024, 8 * 16384):
        assert gemm1_tile("auto", rows, w13, "bf16") == pick_tile(rows, 128, n=1536, k=2048, kind="bf16")
    assert gemm1_tile("coop_128x128", 8, w13, "bf16") == "coop_128x128"


# ----------------------------------------------------------------------------- the kernel (GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
@pytest.mark.parametrize("activation", ["silu", "gelu", "swigluoai"])
def test_kernel_matches_the_definition(rng, tile, activation):
    """bf16, with a bias, 16 experts of 0..300 rows (empty experts, partial tiles) and 13 unowned
    rows at each end, which come back as zeros."""
    skip_unless_available(cb)
    counts = rng.integers(0, 300, 16)
    counts[3] = 0
    a, b, off, bias = bf16_case(rng, counts, n=512, k=256)
    pad = jnp.asarray(rng.standard_normal((13, 256)), jnp.bfloat16)
    a_all = jnp.concatenate([pad, a, pad])
    fn = jax.jit(lambda a, b, o, bias: grouped_gemm_act(a, b, o, activation, alpha=ALPHA, limit=LIMIT, bias=bias,
                                                        tile=tile))
    got = np.asarray(fn(a_all, b, off + 13, bias), np.float32)
    m = a.shape[0]
    assert rel_err(got[13: 13 + m], definition(a, b, off, activation, bias)) < REL_TOL
    assert (got[:13] == 0).all() and (got[13 + m:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_kernel_matches_the_definition_where_each_cta_runs_many_tiles(rng, tile):
    """64 experts of 0..300 rows and 2I = 1024: several hundred tiles on every tile shape, so each
    persistent CTA runs several of them in the scheduler's order, partly filled row tiles among them;
    output poisoned."""
    skip_unless_available(cb)
    counts = rng.integers(0, 300, 64)
    a, b, off, bias = bf16_case(rng, counts, n=1024, k=128)
    assert_bf16_act_is_the_definition(tile, a, b, off, bias, "silu")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_kernel_keeps_each_experts_weights_and_bias_when_its_groups_are_spread(rng, tile):
    """128 experts of uneven rows, visited in the spread order: each expert's rows still meet its own
    weights and its own bias row (swigluoai, 2I = 256); output poisoned."""
    skip_unless_available(cb)
    a, b, off, bias = bf16_case(rng, spread_counts(rng), n=256, k=128)
    assert_bf16_act_is_the_definition(tile, a, b, off, bias, "swigluoai")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_fp8_kernel_keeps_each_experts_scales_when_its_groups_are_spread(rng, tile):
    """FP8 with per-row and per-channel scales on 128 experts of uneven rows, in the spread order:
    each expert's column scales stay its own."""
    skip_unless_available(cb)
    a, b, off, row, col = fp8_case(rng, spread_counts(rng), n=256, k=128)
    assert_fp8_silu_act_is_the_definition(tile, a, b, off, row, col, row, col)


# experts whose last row tile holds 1, 63, 64 or 65 of a 128-row tile's rows, and whole tiles
HALF_TILE_COUNTS = [1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 0, 320]


@pytest.mark.gpu
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_kernel_matches_the_definition_on_rows_about_a_tiles_half(rng, tile, transposed):
    """Experts of 1 to 320 rows around a 128-row tile's half and whole, 2I = 480 (a partial last
    column block, whose second half is partly past N), a bias; b [E, 2I, H] or [E, H, 2I]; output
    poisoned."""
    skip_unless_available(cb)
    a, b, off, bias = bf16_case(rng, np.array(HALF_TILE_COUNTS), n=480, k=192)
    assert_bf16_act_is_the_definition(tile, a, b, off, bias, "swigluoai", transposed)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_fp8_kernel_matches_the_definition_on_rows_about_a_tiles_half(rng, tile):
    skip_unless_available(cb)
    a, b, off, row, col = fp8_case(rng, HALF_TILE_COUNTS, n=480, k=256)
    assert_fp8_silu_act_is_the_definition(tile, a, b, off, row, col, row, col)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_kernel_matches_the_definition_where_n_ends_halfway_through_a_256_column_tile(rng, tile, scheme):
    """2I = 640, as GPT-OSS-120B's 5760: on 256-column tiles the last holds 128 columns, all in its
    first half, and a tile whose warpgroups split its columns gives its second warpgroup only
    columns past N; experts of 1 to 320 rows; output poisoned."""
    skip_unless_available(cb)
    if scheme == "bf16":
        a, b, off, bias = bf16_case(rng, np.array(HALF_TILE_COUNTS), n=640, k=192)
        assert_bf16_act_is_the_definition(tile, a, b, off, bias, "swigluoai")
    else:
        a, b, off, row, col = fp8_case(rng, HALF_TILE_COUNTS, n=640, k=256)
        assert_fp8_silu_act_is_the_definition(tile, a, b, off, row, col, row, col)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_kernel_on_transposed_weights_matches_the_definition(rng, tile):
    """The act kind on b [E, K, 2I]: bf16 with a bias, empty experts, unowned rows zero, and
    2I = 480, so every tile's last column block is partial."""
    skip_unless_available(cb)
    counts = rng.integers(0, 300, 16)
    counts[5] = 0
    a, b, off, bias = bf16_case(rng, counts, n=480, k=256)
    a_all = jnp.concatenate([a, jnp.asarray(rng.standard_normal((7, 256)), jnp.bfloat16)])
    fn = jax.jit(lambda a, bt, o, bias: grouped_gemm_act(a, bt, o, "swigluoai", alpha=ALPHA, limit=LIMIT, bias=bias,
                                                         tile=tile, transposed=True))
    got = np.asarray(fn(a_all, jnp.swapaxes(b, 1, 2), off, bias), np.float32)
    m = a.shape[0]
    assert rel_err(got[:m], definition(a, b, off, "swigluoai", bias)) < REL_TOL
    assert (got[m:] == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_fp8_kernel_matches_the_definition(rng, tile):
    """FP8 rows and weights with per-row and per-channel scales, 24 experts of 0..200 rows, and
    2I = 480: every tile's last column block is partial."""
    skip_unless_available(cb)
    counts = rng.integers(0, 200, 24)
    a, b, off, row, col = fp8_case(rng, counts, n=480, k=256)
    want = definition(a, b, off, "silu", row=row, col=col)
    out_scale = calibrated(want)
    fn = fp8_silu_act(tile)
    got = fn(a, b, off, row, col, out_scale)
    assert got.dtype == F8
    assert rel_err(fp8_value(got, out_scale), want) < FP8_REL_TOL


@pytest.mark.gpu
@each_scale_form
def test_fp8_kernel_takes_each_scale_in_its_own_form(rng, tile, form):
    """GEMM1 with its activation on the scales as given: a per-tensor or per-expert scale reaches
    the kernel as one scale, never broadcast to a vector first; the FP8 output is the definition's."""
    skip_unless_available(cb)
    a, b, off, a_scale, b_scale, row, col = fp8_problem_in_form(rng, form, n=480, k=256)
    fn, out_scale = assert_fp8_silu_act_is_the_definition(tile, a, b, off, a_scale, b_scale, row, col)
    assert scale_broadcasts(fn, a, b, off, a_scale, b_scale, out_scale) == []


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_fp8_kernel_turns_an_overflowed_activation_into_nan(rng, tile):
    """An activation past float32's range is NaN in the FP8 output, as quantize_fp8_static makes it,
    never a plausible +-448; the other rows are the reference's. A row scale of 1e25 takes gate * up
    of row 3 past float32's range while gate and up stay within it, in either order of the scales."""
    skip_unless_available(cb)
    a, b, off, row, col = fp8_case(rng, [7, 2, 0, 11], n=480, k=256)
    row = row.at[3].set(1e25)
    out_scale = jnp.float32(0.05)
    fn = fp8_silu_act(tile)
    got = np.asarray(fn(a, b, off, row, col, out_scale), np.float32)
    want = np.asarray(grouped_gemm_act_reference(a, b, off, "silu", a_scale=row, b_scale=col, out_scale=out_scale),
                      np.float32)
    assert np.isnan(want[3]).any() and not np.isnan(np.delete(want, 3, 0)).any()
    # Row 3: silu(gate) * up overflows where gate > 0, and is 0 where gate < 0 (silu of a hugely
    # negative value). A gate that cancels to near 0 may take either sign in FP8's accumulation, so
    # the kernel may overflow where the reference did not, never the other way round.
    assert np.isnan(got[3][np.isnan(want[3])]).all()
    assert (np.isnan(got[3]) | (got[3] == 0)).all()
    assert not np.isnan(np.delete(got, 3, 0)).any()
    assert rel_err(np.delete(got, 3, 0), np.delete(want, 3, 0)) < FP8_REL_TOL


def _interleaved(cfg, w13):
    return dataclasses.replace(cfg, gate_up_layout="interleaved"), reorder_rows_for_gated_act_gemm(w13)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [40, 1000])
def test_fused_forward_equals_the_unfused_one_and_xla(rng, t, monkeypatch):
    """Qwen3-style silu weights interleaved at load time: the forward with the activation in
    GEMM1's epilogue (forced on every tile) matches the unfused forward and the xla backend on the
    concat weights."""
    skip_unless_available(cb)
    monkeypatch.setenv(FUSED_ACT_ENV, "all")
    from cutlass_cases import moe_problem

    e, k, h, i = 32, 4, 256, 128
    x, w13, w2, tw, ids = moe_problem(rng, t, e, k, h, i)
    cfg = small_cfg(e, k, h, i)
    cfg_il, w13_il = _interleaved(cfg, w13)
    assert fuses_activation(cfg_il)
    run = lambda c: jax.jit(lambda x, a, b, w, d: cb.apply(x, a, b, w, d, c))  # noqa: E731
    fused = run(cfg_il)(x, w13_il, w2, tw, ids)
    monkeypatch.setenv(FUSED_ACT_ENV, "0")
    unfused = run(cfg_il)(x, w13_il, w2, tw, ids)
    want = xla.apply(x, w13, w2, tw, ids, cfg)
    assert rel_err(fused, want) < REL_TOL
    assert rel_err(fused, unfused) < REL_TOL


@pytest.mark.gpu
def test_fused_gptoss_layer_with_biases_and_absent_experts_matches_xla(rng, monkeypatch):
    skip_unless_available(cb)
    monkeypatch.setenv(FUSED_ACT_ENV, "all")
    cfg, x, w13, w2, tw, ids, b = gptoss_problem(rng, 300, 16, 4, 256, 128, minus_one=0.1)
    assert fuses_activation(cfg)
    out = jax.jit(lambda x, w13, w2, b: cb.apply(x, w13, w2, tw, ids, cfg, **b))(x, w13, w2, b)
    assert rel_err(out, xla.apply(x, w13, w2, tw, ids, cfg, **b)) < REL_TOL


@pytest.mark.gpu
def test_fused_fp8_static_forward_matches_xla(rng, monkeypatch):
    skip_unless_available(cb)
    monkeypatch.setenv(FUSED_ACT_ENV, "all")
    from cutlass_cases import moe_problem
    from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights

    e, k, h, i, t = 16, 4, 256, 128, 500
    x, w13, w2, tw, ids = moe_problem(rng, t, e, k, h, i)
    cfg, w13_il = _interleaved(small_cfg(e, k, h, i), w13)
    a13 = calibrate_activation_scale("fp8_per_tensor", x.astype(jnp.float32))
    q13, q2, quant = quantize_weights("fp8", w13_il, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a13 / 4)
    assert fuses_activation(cfg, quant)
    out = jax.jit(lambda x, q13, q2: cb.apply(x, q13, q2, tw, ids, cfg, quant=quant))(x, q13, q2)
    assert rel_err(out, xla.apply(x, q13, q2, tw, ids, cfg, quant=quant)) < FP8_REL_TOL
