"""FlashInfer CUTLASS fused-MoE in float16 (scheme f16): the prepared layout, the value errors of mixed
dtypes, and the runner against the pure-JAX backend on the same weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.backends import flashinfer_cutlass as fic
from jax_moe.config import MoEConfig
from helpers import jit_call as _jit, np_moe, rel_err
from helpers import skip_unless_fi_scheme
from flashinfer_cases import gpt_oss_problem, optional_operands_match_xla, problem, three_expert_ids


# ----------------------------------------------------------------------------- FP16 (scheme f16)


def _f16_problem(rng, t, e, k, h, i, activation="silu"):
    x, w13, w2, tw, ids = problem(rng, t, e, k, h, i, activation)
    return x.astype(jnp.float16), w13.astype(jnp.float16), w2.astype(jnp.float16), tw, ids


def _with_compiled(monkeypatch, schemes):
    """A simulated native module serving ``schemes`` (no GPU: the shape rule and refusals only)."""
    monkeypatch.setattr(fic.native, "available", lambda device=None: (True, "simulated"))
    monkeypatch.setattr(fic.native, "compiled_schemes", lambda: tuple(schemes))


def test_prepare_f16_keeps_float16_and_the_bf16_layout(rng):
    """float16 weights (no QuantConfig) -> scheme f16: bf16's row order (GPT-OSS's alternating
    rows -> [up; gate]), float16 weights and biases (the runner's bias type is its output type),
    the SwigluBias parameters; float32 weights still go to bf16."""
    e, i, h = 3, 8, 16
    cfg = MoEConfig(e, 2, h, i, "swigluoai", "interleaved")
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float16)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)), jnp.float16)
    b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.float32)
    b2 = jnp.asarray(rng.standard_normal((e, h)), jnp.float32)
    prep = _jit(fic.prepare, w13, w2, cfg=cfg, w13_bias=b13, w2_bias=b2)
    assert prep.scheme == "f16" and prep.activation == "swigluoai"
    for name in ("w13", "w2", "w13_bias", "w2_bias"):
        assert getattr(prep, name).dtype == jnp.float16, name
    np.testing.assert_array_equal(np.asarray(prep.w13[:, :i]), np.asarray(w13[:, 1::2]))  # up
    np.testing.assert_array_equal(np.asarray(prep.w13[:, i:]), np.asarray(w13[:, 0::2]))  # gate
    np.testing.assert_array_equal(np.asarray(prep.w2), np.asarray(w2))
    np.testing.assert_array_equal(np.asarray(prep.w13_bias[:, :i]), np.asarray(b13[:, 1::2].astype(jnp.float16)))
    np.testing.assert_array_equal(np.asarray(prep.w13_bias[:, i:]), np.asarray(b13[:, 0::2].astype(jnp.float16)))
    np.testing.assert_array_equal(np.asarray(prep.w2_bias), np.asarray(b2.astype(jnp.float16)))
    assert prep.swiglu.shape == (3, e)
    bf = _jit(fic.prepare, w13.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), cfg=cfg)
    np.testing.assert_array_equal(np.asarray(bf.w13, np.float32), np.asarray(prep.w13.astype(jnp.bfloat16), np.float32))
    assert fic.prepare(w13.astype(jnp.float32), w2.astype(jnp.float32), cfg).scheme == "bf16"
    relu = _jit(fic.prepare, w13[:, :i], w2, cfg=MoEConfig(e, 2, h, i, "relu2"))  # not gated: rows as they are
    assert relu.scheme == "f16"
    np.testing.assert_array_equal(np.asarray(relu.w13), np.asarray(w13[:, :i]))


def test_f16_and_bf16_mixed_are_value_errors_naming_the_arguments(rng, monkeypatch):
    e, k, h, i = 4, 2, 64, 32
    x, w13, w2, tw, ids = _f16_problem(rng, 3, e, k, h, i)
    cfg = MoEConfig(e, k, h, i)
    bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
    with pytest.raises(ValueError, match=r"float16 and bfloat16 mixed \(w13 float16; w2 bfloat16\)"):
        fic.prepare(w13, bf(w2), cfg)
    with pytest.raises(ValueError, match=r"\(w2 float16; w13 bfloat16\)"):
        fic.prepare(bf(w13), w2, cfg)
    with pytest.raises(ValueError, match=r"\(w13, w2 float16; w2_bias bfloat16\)"):
        fic.prepare(w13, w2, cfg, w2_bias=jnp.zeros((e, h), jnp.bfloat16))
    _with_compiled(monkeypatch, ("bf16", "f16"))
    prep16, prep_bf = fic.prepare(w13, w2, cfg), fic.prepare(bf(w13), bf(w2), cfg)
    with pytest.raises(ValueError, match=r"\(prepared.w13, prepared.w2 float16; x bfloat16\)"):
        fic.apply_prepared(bf(x), prep16, tw, ids)
    with pytest.raises(ValueError, match=r"\(x float16; prepared.w13, prepared.w2 bfloat16\)"):
        fic.apply_prepared(x, prep_bf, tw, ids)
    from jax_moe import fused_experts

    with pytest.raises(ValueError, match="w13 and w2 must have x's dtype"):  # the public API's own check
        fused_experts(bf(x), w13, w2, tw, ids, backend="xla")


def test_f16_apply_shape_rule_gives_float16(rng, monkeypatch):
    """apply_prepared's abstract evaluation (the custom call's shape rule) without a GPU: float16
    out [T, H] for float16 (and float32) x, biases and swigluoai included; bf16 stays bf16."""
    t, e, k, h, i = 5, 4, 2, 64, 32
    x, w13, w2, tw, ids = _f16_problem(rng, t, e, k, h, i)
    _with_compiled(monkeypatch, ("bf16", "f16"))
    monkeypatch.setattr(fic.native, "register", lambda: None)
    monkeypatch.setattr(fic.native, "workspace_size", lambda *a: 4096)
    from jax_moe.backends.flashinfer_cutlass import tuning as flashinfer_tuning

    monkeypatch.setattr(flashinfer_tuning, "choice", lambda *a: (-1, -1))  # no tuning cache lookup
    cfg = MoEConfig(e, k, h, i, "swigluoai")
    prep = fic.prepare(w13, w2, cfg, w13_bias=jnp.zeros((e, 2 * i)), w2_bias=jnp.zeros((e, h)))
    for xx in (x, x.astype(jnp.float32)):
        out = jax.eval_shape(lambda a: fic.apply_prepared(a, prep, tw, ids), xx)
        assert out.shape == (t, h) and out.dtype == jnp.float16
    out = jax.eval_shape(lambda a: fic.apply(a, w13, w2, tw, ids, cfg), x)
    assert out.shape == (t, h) and out.dtype == jnp.float16
    prep_bf = fic.prepare(w13.astype(jnp.bfloat16), w2.astype(jnp.bfloat16), MoEConfig(e, k, h, i))
    out = jax.eval_shape(lambda a: fic.apply_prepared(a, prep_bf, tw, ids), x.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16


def test_f16_refused_with_its_reason_when_not_built(rng, monkeypatch):
    """f16 is opt-in: a build without it refuses float16 weights (supports(), the oracle's forced
    and automatic choice, apply_prepared) with the reason; with it, the oracle picks it for
    prepared float16 weights. bfloat16 weights are unaffected either way."""
    from jax_moe import oracle
    from jax_moe.device import DeviceInfo

    h100 = DeviceInfo("gpu", (9, 0))
    cfg = MoEConfig(8, 2, 1024, 512)
    f16 = oracle.call_features(dtype=jnp.float16)
    _with_compiled(monkeypatch, ("bf16", "fp8", "mxfp4"))
    ok, why = fic.supports(cfg, None, h100, dtype=jnp.float16)
    assert not ok and why.startswith("scheme 'f16' is not built (JAX_MOE_FI_SCHEMES)"), why
    assert fic.supports(cfg, None, h100, dtype=jnp.bfloat16) == (True, "ok")
    assert fic.supports(cfg, None, h100) == (True, "ok")
    _, ok, why = oracle.probe("flashinfer_cutlass", cfg, None, h100, f16)
    assert not ok and "scheme 'f16' is not built (JAX_MOE_FI_SCHEMES)" in why
    with pytest.raises(ValueError, match=r"cannot serve this MoE: scheme 'f16' is not built \(JAX_MOE_FI_SCHEMES\)"):
        oracle.select_backend(cfg, None, backend="flashinfer_cutlass", device=h100, features=f16)
    sel = oracle.select_backend(cfg, None, device=h100, prepared=True, features=f16)
    assert sel.name != "flashinfer_cutlass"
    assert dict(sel.reasons)["flashinfer_cutlass"].startswith("scheme 'f16' is not built")
    x, w13, w2, tw, ids = _f16_problem(rng, 3, 8, 2, 64, 32)
    with pytest.raises(ValueError, match=r"scheme 'f16' is not built \(JAX_MOE_FI_SCHEMES\)"):
        fic.apply_prepared(x, fic.prepare(w13, w2, MoEConfig(8, 2, 64, 32)), tw, ids)
    _with_compiled(monkeypatch, ("bf16", "fp8", "mxfp4", "f16"))
    assert fic.supports(cfg, None, h100, dtype=jnp.float16) == (True, "ok")
    sel = oracle.select_backend(cfg, None, device=h100, prepared=True, features=f16)
    assert sel.name == "flashinfer_cutlass"


@pytest.mark.gpu
@pytest.mark.parametrize("e,k", [(8, 2), (256, 8)])
@pytest.mark.parametrize("t", [1, 37, 300])
def test_f16_matches_xla_on_the_same_weights(rng, t, e, k):
    """float16 weights and activations through fused_experts under jit, twice (bit-identical: no
    state leaks), against backend="xla" on the same float16 weights; float16 out."""
    skip_unless_fi_scheme("f16")
    from jax_moe import fused_experts

    x, w13, w2, tw, ids = _f16_problem(rng, t, e, k, 1024, 512)
    f = jax.jit(lambda *a: fused_experts(*a, backend="flashinfer_cutlass"))
    out1, out2 = f(x, w13, w2, tw, ids), f(x, w13, w2, tw, ids)
    ref = fused_experts(x, w13, w2, tw, ids, backend="xla")
    assert out1.shape == (t, 1024) and out1.dtype == jnp.float16
    assert np.isfinite(np.asarray(out1, np.float32)).all()
    assert rel_err(out1, ref) < 1e-2
    np.testing.assert_array_equal(np.asarray(out1), np.asarray(out2))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["silu", "gelu", "relu2"])
def test_f16_prepared_activations_and_empty_experts(rng, activation):
    """Prepared once, applied under jit twice: each activation, with tokens routed to 3 of 16
    experts only (13 experts get no rows); against the float32 reference and backend="xla"."""
    skip_unless_fi_scheme("f16")
    from jax_moe import fused_experts

    t, e, k, h, i = 64, 16, 2, 512, 256
    x, w13, w2, tw, _ = _f16_problem(rng, t, e, k, h, i, activation)
    ids = three_expert_ids(rng, t, k)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i, activation))
    assert prep.scheme == "f16"
    f = jax.jit(fic.apply_prepared)
    out, again = f(x, prep, tw, ids), f(x, prep, tw, ids)
    assert out.dtype == jnp.float16
    assert rel_err(out, np_moe(x, w13, w2, tw, ids, activation)) < 1e-2
    assert rel_err(out, fused_experts(x, w13, w2, tw, ids, activation=activation, backend="xla")) < 1e-2
    np.testing.assert_array_equal(np.asarray(out), np.asarray(again))


@pytest.mark.gpu
def test_f16_swigluoai_biases_and_router_weight_on_input(rng):
    """The runner's optional operands on the half path: GPT-OSS's swigluoai with float16 biases on
    both GEMMs and alternating gate/up rows, and Llama4's router weight on the input (top-1)."""
    skip_unless_fi_scheme("f16")
    t, e, k, h, i = 37, 8, 2, 512, 256
    x, w13, w2, tw, ids, kw = gpt_oss_problem(rng, t, e, k, h, i, "bf16")
    x, w13, w2 = (a.astype(jnp.float16) for a in (x, w13, w2))
    assert x.dtype == jnp.float16
    optional_operands_match_xla(rng, x, w13, w2, tw, ids, kw, 1e-2)


@pytest.mark.gpu
def test_f16_every_compiled_tactic(rng):
    """Each compiled f16 GEMM1 and GEMM2 tactic (finalize-fused included), the other default."""
    skip_unless_fi_scheme("f16")
    t, e, k, h, i = 37, 8, 2, 1024, 512
    x, w13, w2, tw, ids = _f16_problem(rng, t, e, k, h, i)
    ref = np_moe(x, w13, w2, tw, ids)
    prep = fic.prepare(w13, w2, MoEConfig(e, k, h, i))
    errors = {}
    for gemm_id in (1, 2):
        compiled = [(idx, desc) for idx, desc, ok in fic.tactics(gemm_id, "f16") if ok]
        assert compiled, f"no compiled f16 GEMM{gemm_id} tactic"
        for idx, desc in compiled:
            kw = {"gemm1_tactic": idx} if gemm_id == 1 else {"gemm2_tactic": idx}
            out = fic.apply_prepared(x, prep, tw, ids, **kw)
            errors[f"gemm{gemm_id} {desc}"] = rel_err(out, ref, finite=False)
    bad = {d: err for d, err in errors.items() if not err < 1e-2}
    assert not bad, bad


_F16_COMMAND_BUFFER_SCRIPT = """
import numpy as np, jax, jax.numpy as jnp
from jax_moe import fused_experts
rng = np.random.default_rng({seed})
{cases_code}
for t, k, w13, w2, kw in cases:
    e, h = w2.shape[0], w2.shape[1]
    f = jax.jit(lambda x, tw, ids: fused_experts(x, w13, w2, tw, ids, backend="flashinfer_cutlass", **kw))
    for _ in range(3):
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.float16)
        ids = jnp.asarray(np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k], jnp.int32)
        tw = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
        out = f(x, tw, ids)
        assert out.dtype == jnp.float16
        out = np.asarray(out, np.float32)
        ref = np.asarray(fused_experts(x, w13, w2, tw, ids, backend="xla", **kw), np.float32)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert np.isfinite(out).all() and err < {tol}, err
print("OK", len(cases))
"""


@pytest.mark.gpu
def test_f16_under_command_buffers(command_buffer_check):
    """The f16 handler declares command-buffer compatibility: float16 inputs with XLA's command
    buffers forced on, fresh inputs each round (T = 77 and 1; swigluoai with biases), against xla."""
    skip_unless_fi_scheme("f16")
    n = command_buffer_check("flashinfer_cutlass", """
        t, e, k, h, i = 77, 16, 4, 512, 256
        w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.float16)
        w2 = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.float16)
        b13 = jnp.asarray(rng.standard_normal((e, 2 * i)), jnp.float16)
        oai = dict(activation="swigluoai", gate_up_layout="interleaved", w13_bias=b13)
        cases = [(t, k, w13, w2, {}), (1, k, w13, w2, {}), (t, k, w13, w2, oai)]
    """, 1e-2, script=_F16_COMMAND_BUFFER_SCRIPT)
    assert n == 3
