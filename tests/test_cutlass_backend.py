"""jax_moe's CUTLASS backend (backends/cutlass.py): shape rules, ValueErrors, the jnp references and
the oracle's choices on CPU (the whole FP8 pipeline too, on the references); the SM90 grouped GEMMs
(bf16, FP8 with row/column scales) and the whole MoE against references on a GPU."""

import importlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe import fused_experts, oracle
from jax_moe.backends import cutlass as cb
from jax_moe.backends import xla
from jax_moe.config import MoEConfig
from jax_moe.device import DeviceInfo
from jax_moe.quant.scheme import QuantConfig, calibrate_activation_scale, quantize_weights
import ml_dtypes

from helpers import (
    SCHEME_TOL,
    jit_call as _jit,
    np_moe,
    poison_memory,
    random_biases,
    random_moe,
    random_routing,
    rel_err,
    skip_unless_available,
)

H100, A100 = DeviceInfo("gpu", (9, 0)), DeviceInfo("gpu", (8, 0))
REL_TOL = SCHEME_TOL["bf16"]
FP8_GEMM_TOL = 1e-2  # exact FP8 products; only float32 accumulation order and d's bf16 rounding differ
FP8_REL_TOL = SCHEME_TOL["fp8"]  # the whole FP8 MoE against backend="xla" on the same quantized weights
F8 = jnp.float8_e4m3fn


def _offsets(counts) -> jax.Array:
    return jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)


def _gemm_problem(rng, counts, n, k):
    m, e = int(np.sum(counts)), len(counts)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((e, n, k)) / np.sqrt(k), jnp.bfloat16)
    return a, b, _offsets(counts)


def _loop_reference(a, b, offsets) -> np.ndarray:
    """float32 numpy, expert by expert."""
    a, b, off = np.asarray(a, np.float32), np.asarray(b, np.float32), np.asarray(offsets)
    d = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for e in range(b.shape[0]):
        d[off[e]:off[e + 1]] = a[off[e]:off[e + 1]] @ b[e].T
    return d


# ----------------------------------------------------------------------------- CPU


def test_shape_rule():
    a = jax.ShapeDtypeStruct((37, 64), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((4, 128, 64), jnp.bfloat16)
    off = jax.ShapeDtypeStruct((5,), jnp.int32)
    assert cb.grouped_gemm_shape(a, b, off) == jax.ShapeDtypeStruct((37, 128), jnp.bfloat16)
    out = jax.eval_shape(lambda a, b, o: cb.grouped_gemm(a, b, o, tile="coop_128x128"), a, b, off)
    assert out.shape == (37, 128) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("change,match", [
    (dict(a=((8, 64), jnp.float32)), "a must be bfloat16"),
    (dict(b=((4, 128, 64), jnp.float16)), "b must have a's dtype bfloat16, got float16"),
    (dict(offsets=((5,), np.int64)), "offsets must be int32"),
    (dict(offsets=((4,), jnp.int32)), "offsets must have E \\+ 1 = 5"),
    (dict(b=((4, 128, 32), jnp.bfloat16)), "b must be \\[E, N, K\\] with a's K"),
    (dict(a=((8, 60), jnp.bfloat16), b=((4, 128, 60), jnp.bfloat16)), "K must be a positive multiple of 8"),
    (dict(b=((4, 12, 64), jnp.bfloat16)), "N of 8"),
    (dict(a=((8,), jnp.bfloat16)), "a must have rank 2"),
    (dict(tile="huge"), "tile must be"),
])
def test_grouped_gemm_value_errors(change, match):
    shapes = dict(a=((8, 64), jnp.bfloat16), b=((4, 128, 64), jnp.bfloat16), offsets=((5,), jnp.int32))
    tile = change.pop("tile", "auto")
    shapes.update(change)
    args = [np.zeros(s, d) for s, d in shapes.values()]  # numpy: int64 stays int64
    with pytest.raises(ValueError, match=match):
        cb.grouped_gemm(*args, tile=tile)


def test_reference_matches_loop_with_empty_experts_and_unowned_rows(rng):
    counts = [3, 0, 5, 0, 1]
    a, b, off = _gemm_problem(rng, counts, 16, 32)
    ref = cb.grouped_gemm_reference(a, b, off)
    assert rel_err(ref, _loop_reference(a, b, off)) < 1e-2
    # rows past offsets[E] (EP slots) are zero; offsets past M are clamped
    a2 = jnp.concatenate([a, jnp.ones((4, 32), jnp.bfloat16)])
    out = np.asarray(cb.grouped_gemm_reference(a2, b, off), np.float32)
    assert (out[9:] == 0).all()
    big = off.at[-1].set(1000)
    out = np.asarray(cb.grouped_gemm_reference(a2, b, big), np.float32)
    assert np.abs(out[9:]).sum() > 0 and out.shape == (13, 16)


def test_pick_tile(monkeypatch):
    monkeypatch.delenv(cb.TILE_ENV, raising=False)
    assert cb.pick_tile(8, 256) == "pingpong_64x128"        # decode: few rows per expert
    assert cb.pick_tile(100 * 256, 256) == "coop_128x128"   # between
    assert cb.pick_tile(8 * 8192, 256) == "coop_128x256"    # >= 128 rows per expert: the wide tile
    monkeypatch.setenv(cb.TILE_ENV, "coop_128x128")
    assert cb.pick_tile(1, 256) == "coop_128x128"
    monkeypatch.setenv(cb.TILE_ENV, "nope")
    with pytest.raises(ValueError, match=cb.TILE_ENV):
        cb.pick_tile(1, 8)


def _cfg(e=8, k=2, h=64, i=32, activation="silu", **kw):
    return MoEConfig(e, k, h, i, activation=activation, **kw)


def _moe_problem(rng, t, e, k, h, i, gated=True):
    """(x, w13, w2, topk_weights, topk_ids) of a random bf16 layer (silu, or relu2 if not ``gated``)."""
    return random_moe(rng, t, e, k, h, i, activation="silu" if gated else "relu2", dtype=jnp.bfloat16).args


@pytest.mark.parametrize("kwargs,match", [
    (dict(w13_bias=jnp.zeros((8, 63))), r"w13_bias must have shape \[8, 64\] \(\[E, 2I\]"),
    (dict(w13_bias=jnp.zeros((7, 64))), r"w13_bias must have shape \[8, 64\]"),
    (dict(w13_bias=jnp.zeros((8, 64), jnp.int32)), "w13_bias must have dtype"),
    (dict(w2_bias=jnp.zeros((8, 32))), r"w2_bias must have shape \[8, 64\] \(\[E, H\]"),
    (dict(w2_bias=jnp.zeros((8 * 64,))), "w2_bias must have rank 2"),
    (dict(apply_router_weight_on_input=True), "top_k == 1"),
    (dict(tile="huge"), "tile must be"),
])
def test_apply_value_errors(rng, kwargs, match):
    x, w13, w2, tw, ids = _moe_problem(rng, 4, 8, 2, 64, 32)
    with pytest.raises(ValueError, match=match):
        cb.apply(x, w13, w2, tw, ids, _cfg(), **kwargs)


def test_apply_refuses_other_dtypes_and_activations(rng):
    x, w13, w2, tw, ids = _moe_problem(rng, 4, 8, 2, 64, 32)
    with pytest.raises(ValueError, match="w13 must be bfloat16"):
        cb.apply(x, w13.astype(jnp.float32), w2, tw, ids, _cfg())
    with pytest.raises(ValueError, match="w13 must be bfloat16"):  # GPT-OSS's layer: the same dtype rule
        cb.apply(x, w13.astype(jnp.float16), w2, tw, ids, _cfg(activation="swigluoai", gate_up_layout="interleaved"))


def test_supports_reasons(monkeypatch):
    assert cb.supports(_cfg(), None, A100)[1].startswith("needs SM90")
    assert cb.supports(_cfg(), None, DeviceInfo("cpu"))[1].endswith("this device is cpu")
    w4a8 = QuantConfig("w4a8", np.ones((8, 64, 1), np.float32), np.ones((8, 64, 1), np.float32))
    assert cb.supports(_cfg(), w4a8, H100) == (False, "scheme 'w4a8' is not built yet (have bf16, fp8)")
    monkeypatch.setitem(cb._state, "module", object())
    monkeypatch.setitem(cb._state, "error", None)
    assert cb.supports(_cfg(), None, H100) == (True, "ok")
    assert cb.supports(_cfg(activation="swigluoai", gate_up_layout="interleaved"), None, H100) == (True, "ok")
    assert cb.supports(_cfg(activation="gelu", gate_up_layout="interleaved"), None, H100) == (True, "ok")
    assert "multiples of 8" in cb.supports(_cfg(h=60), None, H100)[1]
    assert cb.supports(_cfg(activation="relu2"), None, H100)[0]


def test_oracle_refusal_without_the_module(monkeypatch):
    """Where jax_moe._jax_moe_cutlass is not built, the oracle's cutlass row says why (once logged)."""
    monkeypatch.setitem(cb._state, "module", None)
    monkeypatch.setitem(cb._state, "error", None)
    import builtins

    real_import = builtins.__import__

    def no_cutlass(name, globals=None, locals=None, fromlist=(), level=0):
        if fromlist and "_jax_moe_cutlass" in fromlist:
            raise ImportError("No module named 'jax_moe._jax_moe_cutlass'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.setattr(builtins, "__import__", no_cutlass)
    _, ok, why = oracle.probe("cutlass", _cfg(), None, H100)
    assert not ok and why.startswith("jax_moe._jax_moe_cutlass is not built or cannot load"), why
    assert "CUTLASS headers" in why
    with pytest.raises(ValueError, match="backend 'cutlass' cannot serve this MoE: jax_moe._jax_moe_cutlass"):
        oracle.select_backend(_cfg(), backend="cutlass", device=H100)
    assert oracle.select_backend(_cfg(), device=H100).name == "xla"


def test_oracle_module_row_and_order():
    assert oracle.MODULES["cutlass"] == "jax_moe.backends.cutlass"
    assert oracle.SCHEME_ORDER["bf16"] == ("flashinfer_cutlass", "cutlass", "xla")
    assert "cutlass" in oracle.AUTO  # its GPU tests pass on H100/H200, and it needs no repack


@pytest.mark.parametrize("call,reason", [
    (dict(dtype=np.float32), "takes bfloat16 weights, not float32"),
    (dict(dtype=np.float32, w13_bias=np.zeros((8, 64), np.float32)), "takes bfloat16 weights, not float32"),
])
def test_oracle_passes_over_cutlass_for_what_it_does_not_take(call, reason, monkeypatch):
    """What the call needs beyond the config (biases, the weights' dtype) is part of the choice:
    the oracle refuses cutlass with the reason and falls back, instead of failing at apply."""
    monkeypatch.setattr(cb, "supports", lambda *a, **k: (True, "ok"))
    monkeypatch.setattr(oracle, "module", lambda name: importlib.import_module(oracle.MODULES[name]))
    feats = oracle.call_features(**call)
    sel = oracle.select_backend(_cfg(), device=H100, features=feats)
    assert sel.name == "xla" and any(n == "cutlass" and reason in r for n, r in sel.reasons), sel.reasons
    assert oracle.select_backend(_cfg(), device=H100, features=oracle.call_features(dtype=np.dtype("bfloat16"))
                                 ).name in ("cutlass", "flashinfer_cutlass")


def test_oracle_picks_cutlass_for_gptoss_layers_with_biases(monkeypatch):
    """A GPT-OSS layer (swigluoai, interleaved gate/up) with both biases, bf16 weights, plain or
    differentiated: cutlass takes it (its FEATURES list "bias" and "grad")."""
    monkeypatch.setattr(cb, "supports", lambda *a, **k: (True, "ok"))
    monkeypatch.setattr(oracle, "module", lambda name: importlib.import_module(oracle.MODULES[name]))
    cfg = _cfg(activation="swigluoai", gate_up_layout="interleaved")
    feats = oracle.call_features(dtype=np.dtype("bfloat16"), w13_bias=np.zeros((8, 64), np.float32),
                                 w2_bias=np.zeros((8, 64), np.float32))
    assert oracle.select_backend(cfg, backend="cutlass", device=H100, features=feats).name == "cutlass"
    assert oracle.select_backend(cfg, backend="cutlass", device=H100, features=feats | {"grad"}).name == "cutlass"
    assert oracle.select_backend(cfg, backend="cutlass", device=H100,
                                 features=feats | {"batched"}).name == "cutlass"


# GPT-OSS-style layers: swigluoai on interleaved gate/up rows, both expert biases (float32), random data
GPTOSS_CASES = [(t, e, k) for t in (1, 37) for e, k in ((8, 2), (16, 4))]


def _gptoss_problem(rng, t, e, k, h, i, activation="swigluoai", minus_one=0.0):
    """(cfg, x, w13, w2, topk_weights, topk_ids, biases) of a random bf16 GPT-OSS-style layer
    (alpha and limit not the defaults, some gate/up values past the limit); ``minus_one``: that
    fraction of the ids -1 (experts on other devices)."""
    layout = "interleaved" if activation != "relu2" else "concat"
    cfg = MoEConfig(e, k, h, i, activation=activation, gate_up_layout=layout, swiglu_alpha=1.5, swiglu_limit=4.0,
                    expert_shard=bool(minus_one))
    x = jnp.asarray(rng.standard_normal((t, h)) * 2, jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((e, cfg.w13_rows, h)) * 2 / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    tw, ids = random_routing(rng, t, e, k, minus_one=minus_one)
    return cfg, x, w13, w2, tw, ids, random_biases(rng, cfg)


def _np_definition(cfg, x, w13, w2, tw, ids, w13_bias=None, w2_bias=None, **kw):
    """helpers.np_moe (float64) on the layer's config."""
    return np_moe(x, w13, w2, tw, ids, cfg.activation, cfg.gate_up_layout, w13_bias, w2_bias,
                  alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, **kw)


@pytest.mark.parametrize("t,e,k", GPTOSS_CASES)
def test_gptoss_layer_matches_the_float64_definition_on_cpu(rng, t, e, k):
    """cutlass.apply on a GPT-OSS-style layer (the kernels' jnp references here) is
    ``sum_j w_j (W2[e] act(W13[e] x + b13[e]) + b2[e])`` with swigluoai on interleaved rows."""
    cfg, x, w13, w2, tw, ids, b = _gptoss_problem(rng, t, e, k, 64, 32)
    out = _jit(cb.apply, x, w13, w2, tw, ids, cfg=cfg, **b)
    assert out.dtype == x.dtype and out.shape == (t, 64)
    assert rel_err(out, _np_definition(cfg, x, w13, w2, tw, ids, **b)) < REL_TOL


@pytest.mark.parametrize("case", ["ids of -1", "one bias", "relu2 with biases", "router weight on input"])
def test_gptoss_layer_variants_on_cpu(rng, case):
    """Slots of ids -1 add nothing (not even their bias); either bias alone; relu2 (not gated:
    its GEMM1 bias [E, I] added in jnp); the router weight on the input (top-1: the biases are not
    weighted)."""
    t, e, k = 23, 8, 2
    activation = "relu2" if case.startswith("relu2") else "swigluoai"
    cfg, x, w13, w2, tw, ids, b = _gptoss_problem(rng, t, e, k, 64, 32, activation,
                                                  minus_one=0.3 if case == "ids of -1" else 0.0)
    kw = {}
    if case == "one bias":
        b = dict(w2_bias=b["w2_bias"])
    if case == "router weight on input":
        cfg = MoEConfig(e, 1, 64, 32, activation="swigluoai", gate_up_layout="interleaved")
        tw, ids = tw[:, :1], ids[:, :1]
        kw = dict(apply_router_weight_on_input=True)
    out = _jit(cb.apply, x, w13, w2, tw, ids, cfg=cfg, **b, **kw)
    want = _np_definition(cfg, x, w13, w2, tw, ids, on_input=bool(kw), dtype=ml_dtypes.bfloat16, **b)
    assert rel_err(out, want) < REL_TOL
    if case == "ids of -1":  # a token whose every slot is elsewhere: exactly zero
        gone = np.flatnonzero((np.asarray(ids) < 0).all(axis=1))
        assert (np.asarray(out, np.float32)[gone] == 0).all()


def test_bias_value_errors_name_the_argument(rng):
    """cutlass.apply and apply_batched are public: a bias of the wrong shape or dtype is a
    ValueError naming it, before any kernel; fused_experts says the same first."""
    from jax_moe import fused_experts

    cfg, x, w13, w2, tw, ids, b = _gptoss_problem(rng, 4, 8, 2, 64, 32)
    with pytest.raises(ValueError, match=r"w13_bias must have shape \[8, 64\]"):
        cb.apply(x, w13, w2, tw, ids, cfg, w13_bias=b["w13_bias"][:, :32])
    with pytest.raises(ValueError, match=r"w2_bias must have shape \[8, 64\]"):
        cb.apply(x, w13, w2, tw, ids, cfg, w2_bias=b["w2_bias"][:4])
    with pytest.raises(ValueError, match=r"w2_bias must have shape \[8, 64\]"):
        cb.apply_batched(jnp.zeros((8, 2, 64), jnp.bfloat16), jnp.ones(8, jnp.int32), w13, w2, cfg,
                         w2_bias=b["w2_bias"][:, :32])
    with pytest.raises(ValueError, match="w13_bias must have dtype"):
        cb.apply_batched(jnp.zeros((8, 2, 64), jnp.bfloat16), jnp.ones(8, jnp.int32), w13, w2, cfg,
                         w13_bias=b["w13_bias"].astype(jnp.int32))
    with pytest.raises(ValueError, match="w13_bias must have shape"):
        fused_experts(x, w13, w2, tw, ids, activation="swigluoai", gate_up_layout="interleaved", backend="cutlass",
                      w13_bias=b["w13_bias"][:, :32])


# ----------------------------------------------------------------------------- FP8 on CPU


def _fp8_gemm_problem(rng, counts, n, k):
    """FP8 rows and weights (values of a standard normal, exactly representable after the cast),
    per-row and per-channel dequantization scales."""
    m, e = int(np.sum(counts)), len(counts)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(F8)
    b = jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32).astype(F8)
    row = jnp.asarray(rng.uniform(0.5, 2.0, m) / 64, jnp.float32)
    col = jnp.asarray(rng.uniform(0.5, 2.0, (e, n)) / np.sqrt(k), jnp.float32)
    return a, b, _offsets(counts), row, col


def _fp8_loop_reference(a, b, offsets, row, col) -> np.ndarray:
    """The definition, in float64 numpy, expert by expert: d[r, n] = (a[r] @ b[e].T)[n] * row[r] * col[e, n];
    rows outside the offsets zero."""
    a, b = np.asarray(a.astype(jnp.float32), np.float64), np.asarray(b.astype(jnp.float32), np.float64)
    row, col, off = np.asarray(row, np.float64), np.asarray(col, np.float64), np.asarray(offsets)
    d = np.zeros((a.shape[0], b.shape[1]), np.float64)
    for e in range(b.shape[0]):
        r = slice(off[e], off[e + 1])
        d[r] = (a[r] @ b[e].T) * col[e][None, :] * row[r, None]
    return d


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
    # grouped_gemm itself, here lowered for the CPU: the same reference
    np.testing.assert_array_equal(np.asarray(cb.grouped_gemm(a, b, off, a_scale=row, b_scale=col), np.float32),
                                  np.asarray(got, np.float32))
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
    and alignments are backends/cutlass.py's, and the fp8 workspace holds two more per-group
    pointer arrays (the scale vectors) than the bf16 one, each rounded up to 256 bytes."""
    mod = pytest.importorskip("jax_moe._jax_moe_cutlass")
    assert cb._constants_match(mod)
    for tile in cb.TILES.values():
        for e in (1, 8, 256):
            bf16, f8 = (mod.workspace_size(e, tile, sm_count=132, kind=cb.KINDS[kind][0]) for kind in ("bf16", "fp8"))
            assert f8 - bf16 == 2 * (-(-8 * e // 256) * 256)
    for bad in (dict(tile=len(cb.TILES), kind=0), dict(tile=0, kind=len(cb.KINDS) + len(cb.GRAD_KINDS))):
        with pytest.raises(ValueError, match="unknown tile or kind"):
            mod.workspace_size(8, bad["tile"], sm_count=132, kind=bad["kind"])


def _fp8_moe_problem(rng, t, e, k, h, i, mode, activation="silu"):
    """Random bf16 tokens and routing, float weights quantized to FP8 as ``mode`` says:
    ``"static"``: per-tensor activation scales calibrated on this batch (a2 on the float intermediate
    of every expert), per-expert weight scales; ``"dynamic"``: per-tensor activations without static
    scales, one weight scale per tensor; ``"per_token"``: per-token activations, per-channel weights."""
    gated = activation != "relu2"
    x, w13, w2, tw, ids = _moe_problem(rng, t, e, k, h, i, gated=gated)
    opts = {"static": dict(act="fp8_per_tensor", weight_scale="per_expert"),
            "dynamic": dict(act="fp8_per_tensor", weight_scale="per_tensor"),
            "per_token": dict(act="fp8_per_token", weight_scale="per_channel")}[mode]
    if mode == "static":
        cfg = MoEConfig(e, k, h, i, activation=activation)
        h1 = jnp.einsum("th,enh->ten", x.astype(jnp.float32), w13.astype(jnp.float32))
        from jax_moe.activations import activate

        opts.update(a13_scale=calibrate_activation_scale("fp8_per_tensor", x),
                    a2_scale=calibrate_activation_scale("fp8_per_tensor", activate(h1, cfg)))
    q13, q2, quant = quantize_weights("fp8", w13, w2, **opts)
    return x, q13, q2, tw, ids, quant


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


def _fp8_quantize(x, w13, w2, cfg, mode, w13_bias):
    """``quantize_weights("fp8", ...)`` of float weights as :func:`_fp8_moe_problem`'s ``mode`` says
    (static scales calibrated on this batch, GEMM1's bias in the activation's calibration)."""
    opts = {"static": dict(act="fp8_per_tensor", weight_scale="per_expert"),
            "dynamic": dict(act="fp8_per_tensor", weight_scale="per_tensor"),
            "per_token": dict(act="fp8_per_token", weight_scale="per_channel")}[mode]
    if mode == "static":
        from jax_moe.activations import activate

        h1 = jnp.einsum("th,enh->ten", x.astype(jnp.float32), w13.astype(jnp.float32)) + w13_bias[None]
        opts.update(a13_scale=calibrate_activation_scale("fp8_per_tensor", x),
                    a2_scale=calibrate_activation_scale("fp8_per_tensor", activate(h1, cfg)))
    return quantize_weights("fp8", w13, w2, **opts)


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
    cb.apply(x, q13, q2, tw, ids, MoEConfig(e, k, h, i, expert_shard=True), quant=quant)
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


def _simulate_module(monkeypatch):
    monkeypatch.setitem(cb._state, "module", object())
    monkeypatch.setitem(cb._state, "error", None)


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


def test_moe_bench_gptoss_native_runs_cutlass_and_xla_on_the_real_layer(monkeypatch, capsys):
    """bench/moe_bench.py's gptoss-native model (GPT-OSS-120B's layer: swigluoai, interleaved,
    biases): cutlass and xla take it and agree (here at a tiny size, cutlass on its jnp
    references); the silu-only baselines and peers are skipped with the reason printed."""
    import dataclasses
    import os

    monkeypatch.syspath_prepend(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench import moe_bench

    _simulate_module(monkeypatch)
    real = cb.supports
    monkeypatch.setattr(cb, "supports", lambda cfg, quant=None, device=None, **kw: real(cfg, quant, H100, **kw))
    native = moe_bench.MODELS["gptoss-native"]
    assert (native.e, native.h, native.i, native.k) == (128, 2880, 2880, 4) and native.biases
    assert (native.cfg.activation, native.cfg.gate_up_layout) == ("swigluoai", "interleaved")
    m = dataclasses.replace(native, e=8, h=64, i=32, k=2)
    biases = moe_bench.random_biases(m)
    impls = moe_bench.implementations(m.cfg, None, jnp.bfloat16, None, biases)
    out = capsys.readouterr().out
    assert {"xla", "cutlass"} <= set(impls) and not {"ragged_dot", "dense", "tokamax"} & set(impls)
    assert "# ragged_dot: not run (computes a silu MoE" in out and "# dense: not run" in out
    w13, w2 = moe_bench.random_experts(m)
    x, w, ids = moe_bench.routed_inputs(m, 5, sets=1)[0]
    outs = {name: jax.jit(fn)(x, prep(w13, w2), w, ids) for name, (_, prep, fn) in impls.items()}
    want = np_moe(x, w13, w2, w, ids, "swigluoai", "interleaved", *biases)
    for name, o in outs.items():
        assert rel_err(o, want) < REL_TOL, name


def test_fp8_supports_reasons(rng, monkeypatch):
    _simulate_module(monkeypatch)
    _, _, _, _, _, quant = _fp8_moe_problem(rng, 4, 8, 2, 64, 32, "per_token")
    ok, why = cb.supports(_cfg(), quant.replace(act="bf16"), H100)
    assert not ok and why.startswith("act 'bf16' on FP8 weights is not built (have fp8_per_tensor, fp8_per_token")
    ok, why = cb.supports(_cfg(h=72, i=24), quant, H100)
    assert not ok and why == "FP8 needs hidden and intermediate sizes that are multiples of 16 (16-byte rows)"
    assert cb.supports(_cfg(activation="relu2"), quant, H100) == (True, "ok")
    assert not cb.supports(_cfg(), quant, A100)[0]


# ----------------------------------------------------------------------------- GPU


GEMM_CASES = [  # (counts per expert, N, K); fp8 rounds K up to its alignment (16)
    ([1], 128, 64),                                   # M_total = 1
    ([5, 0, 17, 0, 0, 3, 64, 1], 256, 128),           # empty experts
    ([0, 0, 0, 2], 64, 64),                           # leading empty experts; below fp8's K tile
    ([129, 300, 7, 0], 384, 512),                     # more rows than a tile, several K tiles
    ([1, 2, 3, 4, 5, 6, 7, 8], 200, 136),             # N, K not multiples of the tile (fp8: K=144)
]
GEMM_TOL = {"bf16": REL_TOL, "fp8": FP8_GEMM_TOL}


def _kind_problem(rng, kind, counts, n, k):
    """(a, b, offsets, scale arguments, the definition) of a grouped GEMM of ``kind``."""
    if kind == "bf16":
        a, b, off = _gemm_problem(rng, counts, n, k)
        return a, b, off, {}, _loop_reference(a, b, off)
    a, b, off, row, col = _fp8_gemm_problem(rng, counts, n, k)
    return a, b, off, dict(a_scale=row, b_scale=col), _fp8_loop_reference(a, b, off, row, col)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", sorted(cb.KINDS))
@pytest.mark.parametrize("tile", sorted(cb.TILES))
@pytest.mark.parametrize("case", range(len(GEMM_CASES)))
def test_grouped_gemm_vs_definition(rng, kind, tile, case):
    """Each kernel against its definition (bf16: float32 loop; fp8: float64 loop with the per-row
    and per-channel scales of the epilogue) and against its jnp reference."""
    skip_unless_available(cb)
    counts, n, k = GEMM_CASES[case]
    k = -(-k // cb.ALIGN_K[kind]) * cb.ALIGN_K[kind]
    a, b, off, scales, want = _kind_problem(rng, kind, counts, n, k)
    out = jax.jit(lambda a, b, o, s: cb.grouped_gemm(a, b, o, tile=tile, **s))(a, b, off, scales)
    assert out.dtype == jnp.bfloat16 and out.shape == (a.shape[0], n)
    assert rel_err(out, want) < GEMM_TOL[kind]
    assert rel_err(out, cb.grouped_gemm_reference(a, b, off, **scales)) < GEMM_TOL[kind]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_grouped_gemm_256_experts_mostly_empty_and_unowned_rows(rng, tile):
    skip_unless_available(cb)
    counts = np.zeros(256, np.int64)
    counts[rng.choice(256, 10, replace=False)] = rng.integers(1, 40, 10)
    a, b, off = _gemm_problem(rng, counts, 256, 128)
    pad = jnp.asarray(rng.standard_normal((11, 128)), jnp.bfloat16)  # EP rows past offsets[E]
    a2 = jnp.concatenate([a, pad])
    out = np.asarray(jax.jit(lambda a, b, o: cb.grouped_gemm(a, b, o, tile=tile))(a2, b, off), np.float32)
    m = a.shape[0]
    assert rel_err(out[:m], _loop_reference(a, b, off)) < REL_TOL
    assert (out[m:] == 0).all()


MOE_CASES = [(t, e, k) for t in (1, 37, 1000) for e, k in ((8, 2), (256, 8))] + [(5, 256, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", MOE_CASES)
def test_backend_vs_xla(rng, t, e, k):
    skip_unless_available(cb)
    h, i = 512, 256
    x, w13, w2, tw, ids = _moe_problem(rng, t, e, k, h, i)
    f = jax.jit(lambda x, tw, ids: fused_experts(x, w13, w2, tw, ids, backend="cutlass"))
    ref = fused_experts(x, w13, w2, tw, ids, backend="xla")
    for _ in range(2):  # cached executable, second call
        out = f(x, tw, ids)
        assert out.dtype == x.dtype and out.shape == (t, h)
        assert rel_err(out, ref) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_backend_activations_tiles_and_ep_ids(rng, activation):
    skip_unless_available(cb)
    t, e, k, h, i = 61, 16, 4, 256, 128
    gated = activation != "relu2"
    x, w13, w2, tw, ids = _moe_problem(rng, t, e, k, h, i, gated=gated)
    ids = ids.at[::3, 0].set(-1)  # expert-parallel slots owned elsewhere
    cfg = MoEConfig(e, k, h, i, activation=activation, expert_shard=True)
    ref = xla.apply(x, w13, w2, tw, ids, cfg)
    for tile in cb.TILES:
        out = jax.jit(lambda x, tw, ids: cb.apply(x, w13, w2, tw, ids, cfg, tile=tile))(x, tw, ids)
        assert rel_err(out, ref) < REL_TOL


CUTLASS_COMMAND_BUFFER_CASES = {  # scheme -> (cases_code for the conftest fixture, tolerance)
    "bf16": ("""
        def weights(e, h, i):
            return (jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16),
                    jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16))
        cases = [(77, 4, *weights(16, 512, 256), None), (3, 8, *weights(64, 256, 128), None)]
    """, REL_TOL),
    "fp8": ("""
        def weights(e, h, i):
            return (jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.float32),
                    jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.float32))
        cases = [(t, k, *quantize_weights("fp8", *weights(e, h, i), **opts)) for t, e, k, h, i, opts in (
            (77, 16, 4, 512, 256, dict(a13_scale=0.01, a2_scale=0.005)),              # static per tensor
            (3, 64, 8, 256, 128, dict(weight_scale="per_tensor")),                      # dynamic per tensor
            (40, 32, 2, 256, 128, dict(act="fp8_per_token", weight_scale="per_channel")))]
    """, FP8_REL_TOL),
}


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", sorted(CUTLASS_COMMAND_BUFFER_CASES))
def test_under_command_buffers(scheme, command_buffer_check):
    """Both grouped GEMMs declare command-buffer compatibility: the backend (bf16; FP8 with static,
    dynamic and per-token scales) with XLA's command buffers forced on, fresh inputs each round,
    against the xla backend."""
    skip_unless_available(cb)
    cases_code, tol = CUTLASS_COMMAND_BUFFER_CASES[scheme]
    assert command_buffer_check("cutlass", cases_code, tol) == (2 if scheme == "bf16" else 3)


@pytest.mark.gpu
def test_fused_experts_picks_cutlass_on_hopper_with_and_without_biases(rng):
    """On SM90 with the module built, bf16 fused_experts runs on cutlass without being forced
    (the oracle says so), matches xla, and so does a call with biases (cutlass takes them)."""
    skip_unless_available(cb)
    e, h = 16, 1024
    cfg, x, w13, w2, w, ids = random_moe(rng, 77, e, 4, h, 512, dtype=jnp.bfloat16)
    assert oracle.select_backend(cfg, features=oracle.call_features(dtype=w13.dtype)).name == "cutlass"
    out = jax.jit(fused_experts)(x, w13, w2, w, ids)
    assert rel_err(out, fused_experts(x, w13, w2, w, ids, backend="xla")) < REL_TOL
    b2 = jnp.asarray(rng.standard_normal((e, h)), jnp.float32)
    feats = oracle.call_features(dtype=w13.dtype, w2_bias=b2)
    assert oracle.select_backend(cfg, features=feats).name == "cutlass"
    biased = jax.jit(lambda x, b: fused_experts(x, w13, w2, w, ids, w2_bias=b))(x, b2)
    assert rel_err(biased, np_moe(x, w13, w2, w, ids, b2=b2)) < REL_TOL


GPTOSS_GPU_CASES = [(t, e, k) for t in (1, 37, 1000) for e, k in ((8, 2), (16, 4), (128, 4))]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", GPTOSS_GPU_CASES)
def test_gptoss_layer_vs_definition_on_gpu(rng, t, e, k):
    """The CUTLASS pipeline on GPT-OSS-style layers (swigluoai, interleaved, both biases; some ids
    -1) against the float64 definition, with every tile, jitted, twice; NaN-poisoned memory."""
    skip_unless_available(cb)
    cfg, x, w13, w2, tw, ids, b = _gptoss_problem(rng, t, e, k, 512, 256, minus_one=0.1)
    want = _np_definition(cfg, x, w13, w2, tw, ids, **b)
    for tile in cb.TILES:
        f = jax.jit(lambda x, tw, ids, b: cb.apply(x, w13, w2, tw, ids, cfg, tile=tile, **b))
        for _ in range(2):
            poison_memory(jax.ShapeDtypeStruct((t * k, 2 * 512), jnp.float32))
            out = f(x, tw, ids, b)
            assert out.dtype == x.dtype and out.shape == (t, 512)
            assert rel_err(out, want) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["gpt-oss sizes", "relu2 with biases", "router weight on input", "one bias"])
def test_gptoss_layer_variants_on_gpu(rng, case):
    """GPT-OSS-120B's H = I = 2880 (E = 8 here, for the float64 definition's memory); relu2 with
    its [E, I] GEMM1 bias; top-1 with the router weight on the input; the GEMM2 bias alone."""
    skip_unless_available(cb)
    t, e, k, h, i = 37, 8, 2, 512, 256
    activation, kw = "swigluoai", {}
    if case == "gpt-oss sizes":
        h = i = 2880
    if case.startswith("relu2"):
        activation = "relu2"
    cfg, x, w13, w2, tw, ids, b = _gptoss_problem(rng, t, e, k, h, i, activation)
    if case == "one bias":
        b = dict(w2_bias=b["w2_bias"])
    if case == "router weight on input":
        cfg = MoEConfig(e, 1, h, i, activation="swigluoai", gate_up_layout="interleaved")
        tw, ids, kw = tw[:, :1], ids[:, :1], dict(apply_router_weight_on_input=True)
    out = jax.jit(lambda x, tw, ids, b: cb.apply(x, w13, w2, tw, ids, cfg, **b, **kw))(x, tw, ids, b)
    want = _np_definition(cfg, x, w13, w2, tw, ids, on_input=bool(kw), dtype=ml_dtypes.bfloat16, **b)
    assert rel_err(out, want) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["static", "dynamic", "per_token"])
def test_fp8_gptoss_layer_vs_xla_on_gpu(rng, mode):
    skip_unless_available(cb)
    t, e, k, h, i = 77, 16, 4, 512, 256
    cfg, x, w13, w2, tw, ids, b = _gptoss_problem(rng, t, e, k, h, i, minus_one=0.1)
    q13, q2, quant = _fp8_quantize(x, w13, w2, cfg, mode, b["w13_bias"])
    out = jax.jit(lambda x, b: cb.apply(x, q13, q2, tw, ids, cfg, quant=quant, **b))(x, b)
    assert rel_err(out, xla.apply(x, q13, q2, tw, ids, cfg, quant=quant, **b)) < FP8_REL_TOL


# ----------------------------------------------------------------------------- FP8 on a GPU


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
    f = jax.jit(lambda x, tw, ids, q: fused_experts(x, q13, q2, tw, ids, quant=q, backend="cutlass"))
    ref = fused_experts(x, q13, q2, tw, ids, quant=quant, backend="xla")
    for _ in range(2):  # cached executable, second call
        out = f(x, tw, ids, quant)
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
        out = jax.jit(lambda x, tw, ids: cb.apply(x, q13, q2, tw, ids, cfg, quant=quant, tile=tile))(x, tw, ids)
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
    np.testing.assert_array_equal(np.asarray(jax.jit(cb.grouped_gemm_batched)(a, b, counts, **scales), np.float32),
                                  got)


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
