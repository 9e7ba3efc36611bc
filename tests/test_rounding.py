"""Roundings to a narrower float type hold under jit on every platform (a GPU's XLA folds a
chain of converts ``float32 -> narrow -> float32`` away unless told not to)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_moe.quant import fp8
from jax_moe.quant.rounding import round_to, upcast_kept


def _values(rng, n=4096):
    """float32 values over many binades, ties included (odd multiples of half a bf16 step)."""
    v = rng.standard_normal(n).astype(np.float32) * np.exp2(rng.integers(-30, 30, n)).astype(np.float32)
    ties = (np.float32(1) + (2 * np.arange(64, dtype=np.float32) + 1) * np.float32(2.0 ** -8))
    return np.concatenate([v, ties, -ties]).astype(np.float32)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_round_to_under_jit_is_the_narrow_types_nearest_value(rng, dtype):
    v = _values(rng)
    got = np.asarray(jax.jit(lambda a: round_to(a, dtype))(v))
    assert got.dtype == np.float32
    with np.errstate(over="ignore"):  # float16's range ends at 65504: beyond it, inf, as the cast gives
        want = v.astype(jnp.dtype(dtype)).astype(np.float32)
    np.testing.assert_array_equal(got, want)


def test_a_quantize_then_dequantize_under_jit_rounds_to_fp8(rng):
    """quantize_fp8_static then dequantize_fp8 in one jitted program (the pure-JAX backend's
    activation path): float8_e4m3fn's nearest values (ml_dtypes' cast of the clipped input)."""
    v = np.clip(_values(rng) * np.float32(1e-6), -500, 500).astype(np.float32)
    one = jnp.float32(1.0)
    got = np.asarray(jax.jit(lambda a: fp8.dequantize_fp8(fp8.quantize_fp8_static(a, one), one))(v))
    want = np.clip(v, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    np.testing.assert_array_equal(got, want)
    assert (got != v).any()


def test_upcast_kept_batches_and_differentiates(rng):
    v = jnp.asarray(_values(rng, 30)[:30].reshape(5, 6))
    got = jax.vmap(lambda a: upcast_kept(a.astype(jnp.bfloat16)))(v)
    assert got.dtype == jnp.float32 and got.shape == (5, 6)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(v.astype(jnp.bfloat16), np.float32))
    g = jax.grad(lambda a: jnp.sum(upcast_kept(a.astype(jnp.bfloat16))))(v)
    np.testing.assert_array_equal(np.asarray(g), np.ones((5, 6), np.float32))


# ----------------------------------------------------------------------------- no foldable chain

_NARROW = {jnp.dtype(t) for t in (jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2)}


def _foldable_chains(fn, *args) -> list[str]:
    """The ``convert(convert(v, narrow), wide)`` pairs of ``fn``'s program (through nested jits),
    ``v`` wider than ``narrow``: what a GPU's XLA folds to ``v`` by default."""
    from jax.extend import core as jex_core

    made = {}  # var made by a convert to a narrow float -> the wider dtype it was converted from
    found = []

    def walk(jaxpr, sub):
        for eqn in jaxpr.eqns:
            ins = [v if isinstance(v, jex_core.Literal) else sub.get(v, v) for v in eqn.invars]
            inner = eqn.params.get("jaxpr")
            if inner is not None and hasattr(inner, "jaxpr") and eqn.primitive.name in ("pjit", "jit", "closed_call"):
                s = dict(zip(inner.jaxpr.invars, ins))
                walk(inner.jaxpr, s)
                for o, i in zip(eqn.outvars, inner.jaxpr.outvars):
                    sub[o] = s.get(i, i)
                continue
            if eqn.primitive.name != "convert_element_type":
                continue
            src, out = ins[0], eqn.outvars[0]
            if isinstance(src, jex_core.Literal):
                continue
            src_t, out_t = jnp.dtype(src.aval.dtype), jnp.dtype(out.aval.dtype)
            if not (jnp.issubdtype(src_t, jnp.floating) and jnp.issubdtype(out_t, jnp.floating)):
                continue
            if out_t in _NARROW and src_t.itemsize > out_t.itemsize:
                made[out] = src_t
            elif src in made and out_t.itemsize > src_t.itemsize:
                found.append(f"{made[src].name} -> {src_t.name} -> {out_t.name} {tuple(out.aval.shape)}")

    walk(jax.make_jaxpr(fn)(*args).jaxpr, {})
    return found


def test_the_chain_finder_sees_a_plain_quantize_dequantize():
    v = jnp.ones((4, 8), jnp.float32)
    assert _foldable_chains(lambda a: a.astype(jnp.float8_e4m3fn).astype(jnp.float32), v)
    assert _foldable_chains(jax.jit(lambda a: jax.jit(lambda b: b.astype(jnp.bfloat16))(a).astype(jnp.float32)), v)
    assert not _foldable_chains(lambda a: upcast_kept(a.astype(jnp.float8_e4m3fn)), v)


@pytest.mark.parametrize("scheme,opts", [
    ("fp8", dict(act="fp8_per_token")), ("fp8", dict(act="fp8_per_tensor")), ("fp8_block", {}),
    ("w4a8", dict(act="fp8_per_token")), ("nvfp4", {}), ("mxfp4", dict(act="mxfp8"))])
def test_the_pure_jax_backend_and_the_reference_leave_no_chain_to_fold(rng, scheme, opts):
    """Every activation quantization of backend="xla" and of moe_reference holds on a GPU: no
    quantize-dequantize pair that a GPU's XLA would fold away (CPU-checkable form of that bug)."""
    from helpers import random_moe

    from jax_moe import fused_experts
    from jax_moe.quant.scheme import quantize_weights
    from jax_moe.reference import moe_reference

    m = random_moe(rng, 8, 4, 2, 256, 128)
    x, w13, w2, w, ids = m.args
    q13, q2, quant = quantize_weights(scheme, w13, w2, **opts)
    assert not _foldable_chains(lambda *a: fused_experts(*a, quant=quant, backend="xla"), x, q13, q2, w, ids)
    assert not _foldable_chains(lambda *a: moe_reference(*a, m.cfg, quant=quant), x, q13, q2, w, ids)
    xb = x.astype(jnp.bfloat16)
    assert not _foldable_chains(lambda *a: moe_reference(*a, m.cfg), xb, w13.astype(jnp.bfloat16),
                                w2.astype(jnp.bfloat16), w, ids)


def test_w4a8_alpha_is_one_over_the_stored_pre_quant_scale():
    from jax_moe.backends.flashinfer_cutlass import w4a8

    assert not _foldable_chains(w4a8.act_prequant_scale, jnp.float32(0.03))
