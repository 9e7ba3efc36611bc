"""The CUTLASS grouped GEMMs' setup launch (ffi/cutlass/grouped_gemm_impl.cuh, FillGroupArrays): besides
the per-group arrays it zeroes the rows of d no group writes. Rows before offsets[0] and rows at or
past offsets[E] (more of them than one block per SM, so the blocks stride), offsets past M (clamped),
and the batched format's rows past each expert's count: every such row is exactly zero, on memory
filled with NaN beforehand, and every owned row is the expert's product (a float32 NumPy loop).

On CPU the same checks run on the jnp references (the definitions the kernels are tested against
elsewhere); the ``gpu`` tests run the kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.backends import cutlass_gemm as cg
from jax_moe.backends.cutlass_grad_gemm import grouped_gemm_dgrad, grouped_gemm_wgrad
from helpers import poison_memory, rel_err, skip_unless_available

TOL = 2e-2  # bf16 products against float32: d's rounding and the accumulation order
F8 = jnp.float8_e4m3fn

# (lead rows before offsets[0], counts per expert, tail rows at or past offsets[E])
LAYOUTS = {
    "lead-and-tail": (5, [3, 0, 17, 1, 0, 9, 2, 4], 11),
    "more-unowned-rows-than-sms": (200, [30, 0, 41, 7] * 4, 300),
    "all-unowned": (40, [0] * 8, 24),
}


def _layout(name):
    lead, counts, tail = LAYOUTS[name]
    offsets = lead + np.concatenate([[0], np.cumsum(counts)])
    return offsets.astype(np.int32), int(offsets[-1] + tail)


def _rows(offsets, e, m):
    """Group e's rows, clamped to [0, m] as the kernels clamp them."""
    lo = min(max(int(offsets[e]), 0), m)
    return lo, min(max(int(offsets[e + 1]), lo), m)


def _np_forward(a, b, offsets, row_scale=None, col_scale=None):
    """float32 loop: d[r] = a[r] @ b[e].T (times the scales) for the rows of e, zeros elsewhere."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    m = a.shape[0]
    d = np.zeros((m, b.shape[1]), np.float32)
    for e in range(b.shape[0]):
        lo, hi = _rows(offsets, e, m)
        d[lo:hi] = a[lo:hi] @ b[e].T
        if row_scale is not None:
            d[lo:hi] *= np.asarray(row_scale)[lo:hi, None] * np.asarray(col_scale)[e][None, :]
    return d


def _owned(offsets, m):
    lo, hi = _rows(offsets, 0, m)[0], _rows(offsets, len(offsets) - 2, m)[1]
    mask = np.zeros(m, bool)
    mask[lo:hi] = True
    return mask


def _run(f, *args):
    """f jitted, on device memory filled with NaN beforehand (unwritten rows would show)."""
    jf = jax.jit(f)
    poison_memory(jax.eval_shape(jf, *args))
    return np.asarray(jf(*args), np.float32)


def _check(got, want, owned):
    assert (got[~owned] == 0).all(), f"{int((got[~owned] != 0).sum())} values of unowned rows are not zero"
    if owned.any():
        assert rel_err(got[owned], want[owned]) < TOL


def _bf16_problem(rng, offsets, m, n, k):
    e = len(offsets) - 1
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((e, n, k)) / np.sqrt(k), jnp.bfloat16)
    return a, b, jnp.asarray(offsets)


def _forward_case(rng, layout, tile):
    offsets, m = _layout(layout)
    a, b, off = _bf16_problem(rng, offsets, m, 256, 128)
    got = _run(lambda a, b, o: cg.grouped_gemm(a, b, o, tile=tile), a, b, off)
    _check(got, _np_forward(a, b, offsets), _owned(offsets, m))


def _fp8_case(rng, layout, tile):
    offsets, m = _layout(layout)
    e, n, k = len(offsets) - 1, 128, 128
    a = jnp.asarray(rng.standard_normal((m, k)), F8)
    b = jnp.asarray(rng.standard_normal((e, n, k)) / 4, F8)
    rs = jnp.asarray(rng.uniform(0.5, 2.0, m), jnp.float32)
    cs = jnp.asarray(rng.uniform(0.5, 2.0, (e, n)), jnp.float32)
    got = _run(lambda a, b, o, r, c: cg.grouped_gemm(a, b, o, a_scale=r, b_scale=c, tile=tile),
               a, b, jnp.asarray(offsets), rs, cs)
    _check(got, _np_forward(a, b, offsets, rs, cs), _owned(offsets, m))


def _dgrad_case(rng, layout, tile):
    offsets, m = _layout(layout)
    e, n, k = len(offsets) - 1, 192, 128
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), jnp.bfloat16)  # [E, K, N]
    got = _run(lambda a, b, o: grouped_gemm_dgrad(a, b, o, tile=tile), a, b, jnp.asarray(offsets))
    want = _np_forward(a, jnp.swapaxes(b, 1, 2), offsets)
    _check(got, want, _owned(offsets, m))


def _wgrad_case(rng, layout):
    offsets, m = _layout(layout)
    e, p, q = len(offsets) - 1, 64, 128
    u = jnp.asarray(rng.standard_normal((m, p)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((m, q)), jnp.bfloat16)
    got = _run(lambda u, v, o: grouped_gemm_wgrad(u, v, o), u, v, jnp.asarray(offsets))
    uf, vf = np.asarray(u, np.float32), np.asarray(v, np.float32)
    for g in range(e):
        lo, hi = _rows(offsets, g, m)
        want = uf[lo:hi].T @ vf[lo:hi]
        if hi == lo:
            assert (got[g] == 0).all(), f"expert {g} has no rows: its gradient must be zero"
        else:
            assert rel_err(got[g], want) < TOL


BATCHED_COUNTS = [0, 5, 70, -3, 200, 1, 64, 33]  # clamped to [0, C]: -3 -> 0, 200 -> C


def _batched_case(rng, tile, c=64):
    e, n, k = len(BATCHED_COUNTS), 128, 64
    a = jnp.asarray(rng.standard_normal((e, c, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((e, n, k)) / np.sqrt(k), jnp.bfloat16)
    counts = jnp.asarray(BATCHED_COUNTS, jnp.int32)
    got = _run(lambda a, b, cnt: cg.grouped_gemm_batched(a, b, cnt, tile=tile), a, b, counts)
    af, bf = np.asarray(a, np.float32), np.asarray(b, np.float32)
    for g, cnt in enumerate(BATCHED_COUNTS):
        used = min(max(cnt, 0), c)
        assert (got[g, used:] == 0).all(), f"expert {g}: rows past its count {used} are not zero"
        if used:
            assert rel_err(got[g, :used], af[g, :used] @ bf[g].T) < TOL


def test_offsets_past_m_are_clamped_on_the_reference(rng):
    """offsets beyond M: every row unowned (the clamp the kernels apply), on CPU's reference."""
    offsets = np.array([100, 120, 150], np.int32)
    a, b, off = _bf16_problem(rng, offsets, 64, 128, 64)
    got = np.asarray(jax.jit(lambda a, b, o: cg.grouped_gemm(a, b, o, tile="coop_128x128"))(a, b, off), np.float32)
    assert (got == 0).all()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_definitions_on_the_references(rng, layout):
    """The checks below, on the jnp references (CPU): the NumPy loops are the right definitions."""
    with jax.default_device(jax.devices("cpu")[0]):
        _forward_case(rng, layout, "coop_128x128")
        _fp8_case(rng, layout, "coop_128x128")
        _dgrad_case(rng, layout, "coop_128x128")
        _wgrad_case(rng, layout)
        _batched_case(rng, "pingpong_64x128")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("tile", sorted(cg.TILES))
def test_forward_zeroes_rows_outside_the_offsets(rng, layout, tile):
    skip_unless_available(cg)
    _forward_case(rng, layout, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("tile", sorted(cg.TILES))
def test_fp8_zeroes_rows_outside_the_offsets(rng, layout, tile):
    skip_unless_available(cg)
    _fp8_case(rng, layout, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("tile", sorted(cg.TILES))
def test_dgrad_zeroes_rows_outside_the_offsets(rng, layout, tile):
    skip_unless_available(cg)
    _dgrad_case(rng, layout, tile)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_wgrad_with_rows_outside_the_offsets(rng, layout):
    skip_unless_available(cg)
    _wgrad_case(rng, layout)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cg.TILES))
def test_batched_zeroes_rows_past_the_counts(rng, tile):
    skip_unless_available(cg)
    _batched_case(rng, tile)
    _batched_case(rng, tile, c=160)  # more rows than SMs: the zeroing blocks stride


@pytest.mark.gpu
def test_offsets_past_m_are_clamped(rng):
    skip_unless_available(cg)
    offsets = np.array([100, 120, 150], np.int32)
    a, b, off = _bf16_problem(rng, offsets, 64, 128, 64)
    for tile in sorted(cg.TILES):
        got = _run(lambda a, b, o: cg.grouped_gemm(a, b, o, tile=tile), a, b, off)
        assert (got == 0).all(), tile
