"""jax_moe's CUTLASS backend (backends/cutlass.py): shape rules, ValueErrors, the jnp reference and
the oracle's refusals on CPU; the SM90 grouped GEMM and the whole MoE against references on a GPU."""

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

H100, A100 = DeviceInfo("gpu", (9, 0)), DeviceInfo("gpu", (8, 0))
REL_TOL = 2e-2


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all(), "NaN/inf in the output"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


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
    (dict(b=((4, 128, 64), jnp.float16)), "b must be bfloat16"),
    (dict(offsets=((5,), np.int64)), "offsets must be int32"),
    (dict(offsets=((4,), jnp.int32)), "offsets must have E \\+ 1 = 5"),
    (dict(b=((4, 128, 32), jnp.bfloat16)), "b must be \\[E, N, K\\] with a's K"),
    (dict(a=((8, 60), jnp.bfloat16), b=((4, 128, 60), jnp.bfloat16)), "multiples of 8"),
    (dict(b=((4, 12, 64), jnp.bfloat16)), "multiples of 8"),
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
    assert _rel_err(ref, _loop_reference(a, b, off)) < 1e-2
    # rows past offsets[E] (EP slots) are zero; offsets past M are clamped
    a2 = jnp.concatenate([a, jnp.ones((4, 32), jnp.bfloat16)])
    out = np.asarray(cb.grouped_gemm_reference(a2, b, off), np.float32)
    assert (out[9:] == 0).all()
    big = off.at[-1].set(1000)
    out = np.asarray(cb.grouped_gemm_reference(a2, b, big), np.float32)
    assert np.abs(out[9:]).sum() > 0 and out.shape == (13, 16)


def test_pick_tile(monkeypatch):
    monkeypatch.delenv(cb.TILE_ENV, raising=False)
    assert cb.pick_tile(8, 256) == "pingpong_64x128"
    assert cb.pick_tile(8 * 8192, 256) == "coop_128x128"
    monkeypatch.setenv(cb.TILE_ENV, "coop_128x128")
    assert cb.pick_tile(1, 256) == "coop_128x128"
    monkeypatch.setenv(cb.TILE_ENV, "nope")
    with pytest.raises(ValueError, match=cb.TILE_ENV):
        cb.pick_tile(1, 8)


def _cfg(e=8, k=2, h=64, i=32, activation="silu", **kw):
    return MoEConfig(e, k, h, i, activation=activation, **kw)


def _moe_problem(rng, t, e, k, h, i, gated=True):
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i if gated else i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    ids = jnp.asarray(np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k], jnp.int32)
    tw = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
    return x, w13, w2, tw, ids


@pytest.mark.parametrize("kwargs,match", [
    (dict(w13_bias=jnp.zeros((8, 64))), "biases are not supported"),
    (dict(w2_bias=jnp.zeros((8, 64))), "biases are not supported"),
    (dict(apply_router_weight_on_input=True), "top_k == 1"),
    (dict(tile="huge"), "tile must be"),
])
def test_apply_value_errors(rng, kwargs, match):
    x, w13, w2, tw, ids = _moe_problem(rng, 4, 8, 2, 64, 32)
    with pytest.raises(ValueError, match=match):
        cb.apply(x, w13, w2, tw, ids, _cfg(), **kwargs)


def test_apply_refuses_other_dtypes_activations_and_quant(rng):
    x, w13, w2, tw, ids = _moe_problem(rng, 4, 8, 2, 64, 32)
    with pytest.raises(ValueError, match="w13 must be bfloat16"):
        cb.apply(x, w13.astype(jnp.float32), w2, tw, ids, _cfg())
    with pytest.raises(ValueError, match="swigluoai"):
        cb.apply(x, w13, w2, tw, ids, _cfg(activation="swigluoai"))

    class Q:
        scheme = "fp8"

    with pytest.raises(ValueError, match="scheme 'fp8' is not built yet"):
        cb.apply(x, w13, w2, tw, ids, _cfg(), quant=Q())


def test_supports_reasons(monkeypatch):
    assert cb.supports(_cfg(), None, A100)[1].startswith("needs SM90")
    assert cb.supports(_cfg(), None, DeviceInfo("cpu"))[1].endswith("this device is cpu")

    class Q:
        scheme = "fp8"

    assert cb.supports(_cfg(), Q(), H100) == (False, "scheme 'fp8' is not built yet (have bf16)")
    monkeypatch.setitem(cb._state, "module", object())
    monkeypatch.setitem(cb._state, "error", None)
    assert cb.supports(_cfg(), None, H100) == (True, "ok")
    assert "swigluoai" in cb.supports(_cfg(activation="swigluoai"), None, H100)[1]
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
    (dict(w13_bias=np.zeros((8, 64), np.float32)), "does not take expert biases"),
    (dict(dtype=np.float32), "takes bfloat16 weights, not float32"),
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


# ----------------------------------------------------------------------------- GPU


def _skip_unless_available():
    ok, why = cb.available()
    if not ok:
        pytest.skip(why)


GEMM_CASES = [  # (counts per expert, N, K)
    ([1], 128, 64),                                   # M_total = 1
    ([5, 0, 17, 0, 0, 3, 64, 1], 256, 128),           # empty experts
    ([0, 0, 0, 2], 64, 64),                           # leading empty experts
    ([129, 300, 7, 0], 384, 512),                     # more rows than a tile
    ([1, 2, 3, 4, 5, 6, 7, 8], 200, 136),             # N, K multiples of 8, not of the tile
]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
@pytest.mark.parametrize("case", range(len(GEMM_CASES)))
def test_grouped_gemm_vs_reference(rng, tile, case):
    _skip_unless_available()
    counts, n, k = GEMM_CASES[case]
    a, b, off = _gemm_problem(rng, counts, n, k)
    out = jax.jit(lambda a, b, o: cb.grouped_gemm(a, b, o, tile=tile))(a, b, off)
    assert _rel_err(out, _loop_reference(a, b, off)) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("tile", sorted(cb.TILES))
def test_grouped_gemm_256_experts_mostly_empty_and_unowned_rows(rng, tile):
    _skip_unless_available()
    counts = np.zeros(256, np.int64)
    counts[rng.choice(256, 10, replace=False)] = rng.integers(1, 40, 10)
    a, b, off = _gemm_problem(rng, counts, 256, 128)
    pad = jnp.asarray(rng.standard_normal((11, 128)), jnp.bfloat16)  # EP rows past offsets[E]
    a2 = jnp.concatenate([a, pad])
    out = np.asarray(jax.jit(lambda a, b, o: cb.grouped_gemm(a, b, o, tile=tile))(a2, b, off), np.float32)
    m = a.shape[0]
    assert _rel_err(out[:m], _loop_reference(a, b, off)) < REL_TOL
    assert (out[m:] == 0).all()


MOE_CASES = [(t, e, k) for t in (1, 37, 1000) for e, k in ((8, 2), (256, 8))] + [(5, 256, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("t,e,k", MOE_CASES)
def test_backend_vs_xla(rng, t, e, k):
    _skip_unless_available()
    h, i = 512, 256
    x, w13, w2, tw, ids = _moe_problem(rng, t, e, k, h, i)
    f = jax.jit(lambda x, tw, ids: fused_experts(x, w13, w2, tw, ids, backend="cutlass"))
    ref = fused_experts(x, w13, w2, tw, ids, backend="xla")
    for _ in range(2):  # cached executable, second call
        out = f(x, tw, ids)
        assert out.dtype == x.dtype and out.shape == (t, h)
        assert _rel_err(out, ref) < REL_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["gelu", "relu2"])
def test_backend_activations_tiles_and_ep_ids(rng, activation):
    _skip_unless_available()
    t, e, k, h, i = 61, 16, 4, 256, 128
    gated = activation != "relu2"
    x, w13, w2, tw, ids = _moe_problem(rng, t, e, k, h, i, gated=gated)
    ids = ids.at[::3, 0].set(-1)  # expert-parallel slots owned elsewhere
    cfg = MoEConfig(e, k, h, i, activation=activation, expert_shard=True)
    ref = xla.apply(x, w13, w2, tw, ids, cfg)
    for tile in cb.TILES:
        out = jax.jit(lambda x, tw, ids: cb.apply(x, w13, w2, tw, ids, cfg, tile=tile))(x, tw, ids)
        assert _rel_err(out, ref) < REL_TOL


@pytest.mark.gpu
def test_under_command_buffers():
    """The grouped GEMM declares command-buffer compatibility: run the backend with XLA's command
    buffers forced on, fresh inputs each round, against the xla backend."""
    _skip_unless_available()
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp
        from jax_moe import fused_experts
        rng = np.random.default_rng(5)
        for t, e, k, h, i in ((77, 16, 4, 512, 256), (3, 64, 8, 256, 128)):
            w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
            w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
            f = jax.jit(lambda x, tw, ids: fused_experts(x, w13, w2, tw, ids, backend="cutlass"))
            for _ in range(3):
                x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
                ids = jnp.asarray(np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k], jnp.int32)
                tw = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
                out = np.asarray(f(x, tw, ids), np.float32)
                ref = np.asarray(fused_experts(x, w13, w2, tw, ids, backend="xla"), np.float32)
                err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
                assert np.isfinite(out).all() and err < 2e-2, err
        print("OK")
    """)
    env = dict(__import__("os").environ,
               XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.gpu
def test_fused_experts_picks_cutlass_on_hopper_and_falls_back_for_biases(rng):
    """On SM90 with the module built, bf16 fused_experts runs on cutlass without being forced
    (the oracle says so), matches xla, and a call with biases goes to a backend that takes them."""
    _skip_unless_available()
    t, e, k, h, i = 77, 16, 4, 1024, 512
    x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    w = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
    ids = jnp.asarray(np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k], jnp.int32)
    cfg = MoEConfig(e, k, h, i)
    assert oracle.select_backend(cfg, features=oracle.call_features(dtype=w13.dtype)).name == "cutlass"
    out = jax.jit(fused_experts)(x, w13, w2, w, ids)
    ref = fused_experts(x, w13, w2, w, ids, backend="xla")
    got, want = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(got).all() and np.linalg.norm(got - want) / np.linalg.norm(want) < 2e-2
    b2 = jnp.asarray(rng.standard_normal((e, h)), jnp.float32)
    biased = fused_experts(x, w13, w2, w, ids, w2_bias=b2)  # no ValueError: not on cutlass
    assert np.isfinite(np.asarray(biased, np.float32)).all()
