"""jax_moe's CUTLASS backend (backends/cutlass.py) with bf16 weights: shape rules, ValueErrors, the jnp
references, the oracle's choices and GPT-OSS-style layers (swigluoai, interleaved, biases) on CPU; on a GPU the
SM90 grouped GEMMs (bf16 and FP8), the whole bf16 MoE and GPT-OSS-style layers, command buffers (FP8 too).
FP8 itself: test_cutlass_fp8.py; the batched format: test_cutlass_batched.py."""

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
from jax_moe.quant.scheme import QuantConfig
import ml_dtypes

from cutlass_cases import (
    A100,
    FP8_REL_TOL,
    GEMM_TOL,
    H100,
    REL_TOL,
    fp8_gemm_problem as _fp8_gemm_problem,
    fp8_loop_reference as _fp8_loop_reference,
    gemm_problem as _gemm_problem,
    gptoss_problem as _gptoss_problem,
    moe_problem as _moe_problem,
    simulate_module as _simulate_module,
    small_cfg as _cfg,
)
from helpers import (
    jit_call as _jit,
    np_moe,
    poison_memory,
    random_moe,
    rel_err,
    skip_unless_available,
)


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
    from jax_moe.backends import cutlass_tiles

    monkeypatch.delenv(cb.TILE_ENV, raising=False)
    monkeypatch.setattr(cutlass_tiles, "device_kind", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert cb.pick_tile(8, 256) == "pingpong_64x128"        # decode: few rows per expert
    assert cb.pick_tile(100 * 256, 256) == "coop_128x128"   # between
    assert cb.pick_tile(8 * 8192, 256) == "coop_128x256"    # >= 128 rows per expert: the wide tile
    monkeypatch.setenv(cb.TILE_ENV, "coop_128x128")
    assert cb.pick_tile(1, 256) == "coop_128x128"
    monkeypatch.setenv(cb.TILE_ENV, "nope")
    with pytest.raises(ValueError, match=cb.TILE_ENV):
        cb.pick_tile(1, 8)


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


# ----------------------------------------------------------------------------- GPU


GEMM_CASES = [  # (counts per expert, N, K); fp8 rounds K up to its alignment (16)
    ([1], 128, 64),                                   # M_total = 1
    ([5, 0, 17, 0, 0, 3, 64, 1], 256, 128),           # empty experts
    ([0, 0, 0, 2], 64, 64),                           # leading empty experts; below fp8's K tile
    ([129, 300, 7, 0], 384, 512),                     # more rows than a tile, several K tiles
    ([1, 2, 3, 4, 5, 6, 7, 8], 200, 136),             # N, K not multiples of the tile (fp8: K=144)
    # several hundred tiles on every tile shape: each persistent CTA runs several, in the scheduler's order
    (np.random.default_rng(64).integers(0, 300, 64).tolist(), 1024, 128),
]


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
    # weights as arguments: captured, they would be constants folded into each compile
    f = jax.jit(lambda x, w13, w2, tw, ids: fused_experts(x, w13, w2, tw, ids, backend="cutlass"))
    ref = fused_experts(x, w13, w2, tw, ids, backend="xla")
    for _ in range(2):  # cached executable, second call
        out = f(x, w13, w2, tw, ids)
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
        out = jax.jit(lambda x, w13, w2, tw, ids: cb.apply(x, w13, w2, tw, ids, cfg, tile=tile))(x, w13, w2, tw, ids)
        assert rel_err(out, ref) < REL_TOL


CUTLASS_COMMAND_BUFFER_CASES = {  # scheme -> (cases_code for the conftest fixture, tolerance)
    "bf16": ("""
        cases = [(77, 4, *weights(16, 512, 256, jnp.bfloat16), None),
                 (3, 8, *weights(64, 256, 128, jnp.bfloat16), None)]
    """, REL_TOL),
    "fp8": ("""
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
        f = jax.jit(lambda x, w13, w2, tw, ids, b: cb.apply(x, w13, w2, tw, ids, cfg, tile=tile, **b))
        for _ in range(2):
            poison_memory(jax.ShapeDtypeStruct((t * k, 2 * 512), jnp.float32))
            out = f(x, w13, w2, tw, ids, b)
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
    out = jax.jit(lambda x, w13, w2, tw, ids, b: cb.apply(x, w13, w2, tw, ids, cfg, **b, **kw))(x, w13, w2, tw, ids, b)
    want = _np_definition(cfg, x, w13, w2, tw, ids, on_input=bool(kw), dtype=ml_dtypes.bfloat16, **b)
    assert rel_err(out, want) < REL_TOL
