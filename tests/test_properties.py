"""Property tests (hypothesis) against float64 numpy references written from the definitions in
the docstrings, never from jax_moe's own code (``jax_moe.reference`` is not used here; the MoE's
and the activations' definitions are tests/helpers.py's).

What is drawn: shapes (T = 0 and T = 1 included), dtypes, routing modes (softmax / sigmoid,
renormalized or not, grouped with and without a correction bias, a scaling factor, explicit ids
with repeats, every token on one expert), activations, gate/up layouts, biases, the router
weight on the input, and the xla strategies; then NaN / inf / overflow placed in an expert no
token uses, in one token, or in one router row. A row whose float64 reference is finite must be
finite and within the dtype's bound; a row whose reference is not finite must not be finite.

Budget: the default profile runs in well under a minute on two cores (``derandomize``: the
same examples every run). ``JAX_MOE_HYPOTHESIS_PROFILE=slow`` runs many more examples, and
the tests marked ``slow`` (the meshes on 8 CPU devices) run in CI's slow pass.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jax_moe import fused_experts, fused_moe, select_experts
from jax_moe.backends import xla
from jax_moe.config import MoEConfig
from jax_moe.quant import fp4, fp8, int4
from helpers import cpu_mesh, np_e2m1_round, np_fp8_per_token, np_moe, np_sigmoid

settings.register_profile("jax_moe", max_examples=10, deadline=None, derandomize=True, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("slow", max_examples=200, deadline=None, derandomize=False, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("JAX_MOE_HYPOTHESIS_PROFILE", "jax_moe")
settings.load_profile(PROFILE)
SCALE = 1 if PROFILE == "jax_moe" else 10  # the slow profile multiplies every test's examples


def examples(n: int):
    return settings(max_examples=n * SCALE)


ACTS = ("silu", "gelu", "swigluoai", "relu2")
GATED = {"silu": True, "gelu": True, "swigluoai": True, "relu2": False}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# bound on |out - ref| relative to the magnitude sum_j |w| (|W2| |a| + |b2|) of each row
TOL = {"float32": 1e-5, "bfloat16": 1.6e-2, "float16": 4e-3}
STRATEGIES = (None,) + xla.STRATEGIES


# ----------------------------------------------------------------------------- float64 definitions


def np_log_sigmoid(v):
    return -np.logaddexp(0.0, -np.asarray(v, np.float64))


def np_log_softmax(v):
    v = np.asarray(v, np.float64)
    with np.errstate(invalid="ignore"):
        m = np.max(v, axis=-1, keepdims=True)
        return v - m - np.log(np.sum(np.exp(v - m), axis=-1, keepdims=True))


def check_rows(got, ref, mag, dtype_name):
    """Finite reference rows: finite and within the bound; non-finite reference rows: not finite."""
    got = np.asarray(got, np.float64)
    finite_ref = np.isfinite(ref).all(axis=1)
    assert not np.isfinite(got[~finite_ref]).all(axis=1).any(), "a non-finite row became finite"
    g, r, m = got[finite_ref], ref[finite_ref], mag[finite_ref]
    assert np.isfinite(g).all(), f"rows {np.nonzero(~np.isfinite(g).all(1))[0]} are not finite"
    err = np.abs(g - r) / (m + 1e-6)
    assert (err <= TOL[dtype_name]).all(), f"max error {err.max():.3g} > {TOL[dtype_name]}"


# ----------------------------------------------------------------------------- drawing a layer


@st.composite
def moe_cases(draw, bad_kinds=("none", "unused_expert", "token", "router_row")):
    dtype = draw(st.sampled_from(list(DTYPES)))
    activation = draw(st.sampled_from(ACTS))
    layout = draw(st.sampled_from(("concat", "interleaved"))) if GATED[activation] else "concat"
    t = draw(st.one_of(st.sampled_from([0, 1]), st.integers(2, 40)))
    e = draw(st.integers(2, 9))
    k = draw(st.integers(1, min(e - 1, 4)))  # at least one expert no token routes to is possible
    h = draw(st.sampled_from([8, 16, 24]))
    inter = draw(st.sampled_from([4, 8, 12]))
    bias = draw(st.booleans())
    mode = draw(st.sampled_from(["router", "ids", "one_expert"]))
    bad = draw(st.sampled_from(bad_kinds))
    if bad in ("token", "router_row") and t == 0:
        bad = "none"
    if bad == "router_row" and mode != "router":
        bad = "token"
    value = draw(st.sampled_from(["nan", "inf", "-inf"] + (["overflow"] if bad == "unused_expert" else [])))
    on_input = k == 1 and draw(st.booleans())
    routing = {}
    if mode == "router":
        routing = dict(scoring=draw(st.sampled_from(["softmax", "sigmoid"])), renormalize=draw(st.booleans()))
        if draw(st.booleans()):
            routing["routed_scaling_factor"] = draw(st.sampled_from([0.5, 2.5]))
    return dict(dtype=dtype, activation=activation, layout=layout, t=t, e=e, k=k, h=h, inter=inter, bias=bias,
                mode=mode, bad=bad, value=value, on_input=on_input, routing=routing,
                strategy=draw(st.sampled_from(STRATEGIES)), seed=draw(st.integers(0, 2**31 - 1)),
                swiglu=draw(st.sampled_from([(1.702, 7.0), (1.0, 2.5)])))


def build(c):
    """Arrays of a drawn case. Expert E-1 receives no token; the bad value goes where ``c["bad"]`` says."""
    rng = np.random.default_rng(c["seed"])
    t, e, k, h, inter = c["t"], c["e"], c["k"], c["h"], c["inter"]
    dt = DTYPES[c["dtype"]]
    rows = 2 * inter if GATED[c["activation"]] else inter
    x = np.array(jnp.asarray(rng.standard_normal((t, h)), dt))
    w13 = np.array(jnp.asarray(rng.standard_normal((e, rows, h)) / math.sqrt(h), dt))
    w2 = np.array(jnp.asarray(rng.standard_normal((e, h, inter)) / math.sqrt(inter), dt))
    b13 = (rng.standard_normal((e, rows)) * 0.5).astype(np.float32) if c["bias"] else None
    b2 = (rng.standard_normal((e, h)) * 0.5).astype(np.float32) if c["bias"] else None
    logits = ids = None
    if c["mode"] == "router":
        logits = rng.standard_normal((t, e)).astype(np.float32)
        logits[:, e - 1] = -1e4  # expert E-1: no token (k <= E-1)
    elif c["mode"] == "ids":
        ids = rng.integers(0, e - 1, (t, k)).astype(np.int32)  # repeats within a row allowed
    else:
        ids = np.full((t, k), rng.integers(0, e - 1), np.int32)  # every token on one expert
    bad = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}.get(c["value"])
    if c["bad"] == "unused_expert":
        target = [w13, w2][rng.integers(2)]
        if c["value"] == "overflow":
            target[e - 1] = (float(ml_dtypes.finfo(target.dtype).max) / 2 * np.sign(target[e - 1].astype(np.float32) + 1e-3)
                             ).astype(target.dtype)
        else:
            target[e - 1].flat[rng.integers(target[e - 1].size)] = bad
    elif c["bad"] == "token":
        x[rng.integers(t), rng.integers(h)] = bad
    elif c["bad"] == "router_row":
        logits[rng.integers(t), rng.integers(e - 1)] = bad
    return x, w13, w2, b13, b2, logits, ids


def run_case(c, x, w13, w2, b13, b2, logits, ids):
    """jax_moe on the case: routing then the experts (the public entry points for strategy None,
    else xla.apply with that strategy). Returns (out, weights, ids) as numpy."""
    alpha, limit = c["swiglu"]
    opts = dict(activation=c["activation"], gate_up_layout=c["layout"], w13_bias=b13, w2_bias=b2,
                apply_router_weight_on_input=c["on_input"], swiglu_alpha=alpha, swiglu_limit=limit)
    if logits is not None:
        w, ids = select_experts(logits, c["k"], **c["routing"])
    else:
        rng = np.random.default_rng(c["seed"] + 1)
        w = jnp.asarray(rng.random(ids.shape) + 0.1, jnp.float32)
    args = [jnp.asarray(a) for a in (x, w13, w2)]
    if c["strategy"] is None:
        if logits is not None and not c["on_input"]:
            out = fused_moe(*args, logits, c["k"], **c["routing"], **opts)
        else:
            out = fused_experts(*args, w, jnp.asarray(ids), **opts)
    else:
        cfg = MoEConfig(c["e"], c["k"], c["h"], c["inter"], c["activation"], c["layout"], alpha, limit)
        out = xla.apply(*args, w, jnp.asarray(ids), cfg, strategy=c["strategy"], w13_bias=b13, w2_bias=b2,
                        apply_router_weight_on_input=c["on_input"])
    return np.asarray(out, np.float64), np.asarray(w, np.float64), np.asarray(ids)


@pytest.mark.slow
@examples(25)
@given(moe_cases())
def test_moe_against_the_float64_definition(c):
    x, w13, w2, b13, b2, logits, ids = build(c)
    out, w, ids = run_case(c, x, w13, w2, b13, b2, logits, ids)
    assert out.shape == (c["t"], c["h"])
    alpha, limit = c["swiglu"]
    ref, mag = np_moe(x, w13, w2, w, ids, c["activation"], c["layout"], b13, b2, c["on_input"], alpha, limit,
                      dtype=np.dtype(DTYPES[c["dtype"]]), magnitude=True)
    check_rows(out, ref, mag, c["dtype"])
    if c["bad"] == "unused_expert":
        assert np.isfinite(out).all()


@pytest.mark.slow
@examples(5)
@given(moe_cases(bad_kinds=("unused_expert", "token")))
def test_every_strategy_agrees_and_a_bad_value_stays_put(c):
    """The same case on every strategy: finite rows agree, and they are exactly the rows of the
    case without the bad value (other than the bad token's own row)."""
    x, w13, w2, b13, b2, logits, ids = build(c)
    clean = build(dict(c, bad="none"))
    outs = {}
    for s in xla.STRATEGIES:
        got, _, _ = run_case(dict(c, strategy=s), x, w13, w2, b13, b2, logits, ids)
        want, _, _ = run_case(dict(c, strategy=s), *clean)
        keep = np.isfinite(got).all(axis=1)
        if c["bad"] == "unused_expert":
            assert keep.all()
        else:
            assert (~keep).sum() <= 1
        np.testing.assert_array_equal(got[keep], want[keep])
        outs[s] = got
    ref = outs["gather"]
    for s, got in outs.items():
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(ref))


# ----------------------------------------------------------------------------- routing


@st.composite
def routing_cases(draw):
    e = draw(st.sampled_from([4, 6, 8, 12, 16]))
    groups = draw(st.sampled_from([None] + [g for g in (2, 3, 4) if e % g == 0]))
    bias = draw(st.booleans()) and (groups is None or e // groups >= 2)
    topk_group = draw(st.integers(1, groups)) if groups else None
    max_k = e if groups is None else topk_group * (e // groups)
    return dict(t=draw(st.sampled_from([0, 1, 5, 17])), e=e, k=draw(st.integers(1, min(max_k, 6))),
                scoring=draw(st.sampled_from(["softmax", "sigmoid"])), renormalize=draw(st.booleans()),
                groups=groups, topk_group=topk_group, bias=bias,
                scale=draw(st.sampled_from([1.0, 2.5])), spread=draw(st.sampled_from([1.0, 30.0, 300.0])),
                offset=draw(st.sampled_from([0.0, -90.0, -1000.0, 50.0])), seed=draw(st.integers(0, 2**31 - 1)),
                bad=draw(st.sampled_from([None, np.nan, np.inf, -np.inf])))


def np_route_weights(logits, ids, scoring, renormalize, scale):
    """The weights of the chosen ids from the definitions, in log space (float64)."""
    chosen = np.take_along_axis(np.asarray(logits, np.float64), ids, axis=1)
    if scoring == "softmax":
        w = np.exp(np_log_softmax(chosen)) if renormalize else np.exp(np.take_along_axis(np_log_softmax(logits), ids, 1))
    else:
        w = np.exp(np_log_softmax(np_log_sigmoid(chosen))) if renormalize else np_sigmoid(chosen)
    return w * scale


@pytest.mark.slow
@examples(40)
@given(routing_cases())
def test_routing_against_the_float64_definition(c):
    rng = np.random.default_rng(c["seed"])
    t, e, k = c["t"], c["e"], c["k"]
    logits = (rng.standard_normal((t, e)) * c["spread"] + c["offset"]).astype(np.float32)
    bad_row = None
    if c["bad"] is not None and t:
        bad_row = int(rng.integers(t))
        logits[bad_row, rng.integers(e)] = c["bad"]
    bias = (rng.standard_normal(e) * 0.1).astype(np.float32) if c["bias"] else None
    kw = dict(scoring=c["scoring"], renormalize=c["renormalize"], routed_scaling_factor=c["scale"],
              e_score_correction_bias=bias)
    if c["groups"]:
        kw.update(num_expert_group=c["groups"], topk_group=c["topk_group"])
    w, ids = jax.jit(lambda lg: select_experts(lg, k, **kw))(logits)
    w, ids = np.asarray(w, np.float64), np.asarray(ids)
    assert w.shape == ids.shape == (t, k) and ((ids >= 0) & (ids < e)).all()
    lg64 = logits.astype(np.float64)
    scores = np.exp(np_log_softmax(lg64)) if c["scoring"] == "softmax" else np_sigmoid(lg64)
    # the order the choice follows: the logits (= the scores' order) without bias, scores + bias with it
    choice = scores + bias.astype(np.float64) if bias is not None else lg64
    tol = 1e-6 if bias is not None else 0.0
    for row in range(t):
        if row == bad_row:
            continue
        chosen = ids[row]
        assert len(set(chosen.tolist())) == k
        allowed = np.ones(e, bool)
        if c["groups"]:
            per = e // c["groups"]
            member = choice[row].reshape(c["groups"], per)
            gscore = np.sort(member, axis=1)[:, -2:].sum(1) if bias is not None else member.max(1)
            order = np.argsort(-gscore, kind="stable")
            cut = gscore[order[c["topk_group"] - 1]]
            if c["topk_group"] < c["groups"] and cut - gscore[order[c["topk_group"]]] <= 1e-5:
                continue  # a near-tie between groups: either choice is right
            allowed = np.repeat(np.isin(np.arange(c["groups"]), order[:c["topk_group"]]), per)
        assert allowed[chosen].all()
        rest = np.setdiff1d(np.nonzero(allowed)[0], chosen)
        if len(rest):
            assert choice[row, chosen].min() >= choice[row, rest].max() - tol
        want = np_route_weights(lg64[row:row + 1], chosen[None], c["scoring"], c["renormalize"], c["scale"])[0]
        # float32: a weight exp(d) carries d's rounding (an ulp of |d|, relative), and flushes below ~1e-38
        with np.errstate(divide="ignore"):
            rtol = 2e-6 + 2e-7 * np.abs(np.log(np.maximum(want, 1e-300)) / np.log(2.0))
        assert (np.abs(w[row] - want) <= rtol * want + 1e-37).all(), (w[row], want)


# ----------------------------------------------------------------------------- quantizers: the NaN rule


def np_mxfp4(x):
    """MXFP4 of finite x [..., K] from its definition (dequantized values)."""
    blocks = x.reshape(x.shape[:-1] + (-1, 32)).astype(np.float64)
    amax = np.abs(blocks).max(-1)
    _, ex = np.frexp(amax)
    e = np.clip(np.where(amax > 0, ex - 1, -127) - 2, -127, 127)
    scale = np.exp2(e)[..., None]
    return (np_e2m1_round(blocks / scale) * scale).reshape(x.shape)


FORMATS = {  # name -> (quantize+dequantize, NaN unit along K: 1 = the element, else the block)
    "fp8_per_tensor": (lambda x: fp8.dequantize_fp8(*fp8.quantize_fp8_per_tensor(x)), 1),
    "fp8_per_token": (lambda x: fp8.dequantize_fp8(*fp8.quantize_fp8_per_token(x)), 1),
    "fp8_block": (lambda x: fp8.dequantize_fp8_block(*fp8.quantize_fp8_block(x[None], (2, 32)), (2, 32))[0], 1),
    "fp8_group": (lambda x: fp8.dequantize_fp8_per_token_group(*fp8.quantize_fp8_per_token_group(x, 32), 32), 1),
    "mxfp8": (lambda x: fp4.dequantize_mxfp8(*fp4.quantize_mxfp8(x)), 1),
    "nvfp4": (lambda x: fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(x)), 16),
    "mxfp4": (lambda x: fp4.dequantize_mxfp4(*fp4.quantize_mxfp4(x)), 32),
    "int4": (lambda x: int4.dequantize_int4(*int4.quantize_int4(x, 32), 32), 32),
}


@pytest.mark.slow
@examples(40)
@given(fmt=st.sampled_from(sorted(FORMATS)), rows=st.integers(1, 4), kb=st.integers(1, 3),
       n_bad=st.integers(0, 3), value=st.sampled_from([np.nan, np.inf, -np.inf]), spread=st.sampled_from([1e-3, 1.0, 1e4]),
       seed=st.integers(0, 2**31 - 1))
def test_every_quantizer_follows_the_nan_rule(fmt, rows, kb, n_bad, value, spread, seed):
    """jax_moe.quant's rule: the dequantized result is NaN exactly on the non-finite inputs' units
    (the element for E4M3, the block for E2M1 / int4) and, everywhere else, exactly what quantizing
    the input with those values replaced by 0 gives (they never enter an amax)."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, 32 * kb)) * spread).astype(np.float32)
    pos = [(int(rng.integers(rows)), int(rng.integers(32 * kb))) for _ in range(n_bad)]
    clean = x.copy()
    for r, col in pos:
        x[r, col], clean[r, col] = value, 0.0
    quant, unit = FORMATS[fmt]
    got, want = np.asarray(quant(x)), np.asarray(quant(clean))
    expect_nan = np.zeros(x.shape, bool)
    for r, col in pos:
        expect_nan[r, (col // unit) * unit:(col // unit + 1) * unit] = True
    np.testing.assert_array_equal(np.isnan(got), expect_nan)
    np.testing.assert_array_equal(got[~expect_nan], want[~expect_nan])
    # and on finite data, the definitions (bit for bit where one is written out here)
    if fmt == "mxfp4":
        np.testing.assert_array_equal(want, np_mxfp4(clean).astype(np.float32))
    if fmt == "fp8_per_token":
        q, scale = np_fp8_per_token(clean)
        np.testing.assert_array_equal(want, q * scale[:, None])


# ----------------------------------------------------------------------------- meshes (8 CPU devices)


MESHES = {"ep8": ((8,), ("ep",), dict(ep_axis="ep")), "ep4-tp2": ((4, 2), ("ep", "tp"), dict(ep_axis="ep", tp_axis="tp")),
          "dp2-ep4": ((2, 4), ("dp", "ep"), dict(ep_axis="ep", dp_axis="dp"))}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", sorted(MESHES))  # three tests, which pytest-xdist's workers share out
@examples(4)
@given(strategy=st.sampled_from(["naive", "all_to_all"]),
       fmt=st.sampled_from(["standard", "batched"]), activation=st.sampled_from(ACTS),
       bad=st.sampled_from(["none", "unused_expert", "token"]), seed=st.integers(0, 2**31 - 1))
def test_meshes_against_the_float64_definition(mesh, strategy, fmt, activation, bad, seed):
    from jax_moe.parallel import ParallelConfig, parallel_fused_experts, shard_weights

    shape, names, axes = MESHES[mesh]
    pcfg = ParallelConfig(cpu_mesh(shape, names), strategy=strategy, expert_format=fmt, **axes)
    c = dict(dtype="float32", activation=activation, layout="concat", t=16, e=16, k=3, h=16, inter=8, bias=True,
             mode="router", bad=bad, value="nan", on_input=False, routing={}, strategy=None, seed=seed,
             swiglu=(1.702, 7.0))
    x, w13, w2, b13, b2, logits, _ = build(c)
    w, ids = select_experts(logits, 3)
    p = shard_weights(jnp.asarray(w13), jnp.asarray(w2), pcfg, activation=activation, w13_bias=jnp.asarray(b13),
                      w2_bias=jnp.asarray(b2))
    out = parallel_fused_experts(jnp.asarray(x), p["w13"], p["w2"], w, ids, pcfg, w13_bias=p["w13_bias"],
                                 w2_bias=p["w2_bias"], activation=activation)
    ref, mag = np_moe(x, w13, w2, np.asarray(w), np.asarray(ids), activation, "concat", b13, b2, magnitude=True)
    check_rows(out, ref, mag, "float32")
