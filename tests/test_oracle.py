"""The oracle: which backend serves a (device, scheme, shape), and the reason every other one gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import fused_experts, oracle
from jax_moe.config import MoEConfig
from jax_moe.device import DeviceInfo
from helpers import scheme_only

CFG = MoEConfig(128, 8, 2048, 768)
A100, H100, B200, RTX5090 = (DeviceInfo("gpu", c) for c in ((8, 0), (9, 0), (10, 0), (12, 0)))
CPU = DeviceInfo("cpu")


@pytest.fixture(autouse=True)
def _without_the_cutlass_module(monkeypatch):
    """The tables here are those of a build without jax_moe's CUTLASS module (what CI has), whatever
    this checkout built: on a simulated SM90 device a locally built module would otherwise serve
    bf16 and fp8. tests/test_cutlass_backend.py and test_cutlass_fp8.py simulate the module's presence."""
    from jax_moe.backends import cutlass as cb
    from jax_moe.backends import flashinfer_trtllm as trt

    monkeypatch.setitem(cb._state, "module", None)
    monkeypatch.setitem(cb._state, "error", "simulated: jax_moe._jax_moe_cutlass is not built")
    monkeypatch.setitem(trt._state, "module", None)
    monkeypatch.setitem(trt._state, "error", "simulated: jax_moe._jax_moe_trtllm is not built")


@pytest.fixture(autouse=True)
def _without_the_cutedsl_extra(monkeypatch):
    """Likewise without the ``cutedsl`` extra (CI's install); tests/test_flashinfer_cutedsl.py
    simulates each of its probe's answers."""
    from jax_moe.backends import cutedsl_probe

    monkeypatch.setattr(cutedsl_probe, "probe", lambda: (False, "nvidia-cutlass-dsl is not installed (simulated)"))


# (device, scheme, backend) -> the start of the reason it gives
REASONS = [
    (H100, "nvfp4", "flashinfer_trtllm", "needs SM100 (compute capability 10.x: B200/GB200/B300); this device is SM90 (9.0)"),
    (H100, "nvfp4", "flashinfer_cutedsl", "needs SM100/SM103; this device is SM90"),
    (H100, "nvfp4", "marlin", "not provided: on SM90, weight-only MXFP4 (W4A16) is served by flashinfer_cutlass"),
    (B200, "fp8_block", "flashinfer_cutlass", "needs SM90 (this build compiles sm_90a only); this device is SM100"),
    (H100, "nvfp4", "flashinfer_cutlass", "scheme 'nvfp4' is not built yet"),
    (H100, "w4a8", "cutlass", "scheme 'w4a8' is not built yet (have bf16, fp8)"),
    (H100, "fp8", "cutlass", "simulated: jax_moe._jax_moe_cutlass is not built"),
    (B200, "nvfp4", "flashinfer_trtllm", "simulated: jax_moe._jax_moe_trtllm is not built"),
    (B200, "fp8_block", "flashinfer_trtllm", "simulated: jax_moe._jax_moe_trtllm is not built"),
    (B200, "mxfp4", "flashinfer_trtllm", "simulated: jax_moe._jax_moe_trtllm is not built"),
    (B200, "fp8", "flashinfer_trtllm", "simulated: jax_moe._jax_moe_trtllm is not built"),
    (B200, "nvfp4", "flashinfer_cutedsl", "nvidia-cutlass-dsl is not installed"),
    (B200, "fp8", "flashinfer_cutedsl", "does not serve scheme 'fp8' (serves nvfp4)"),  # asked directly
    (B200, "bf16", "flashinfer_cutlass", "needs SM90 (this build compiles sm_90a only); this device is SM100"),
    (B200, "mxfp4", "marlin", "needs SM80/SM86/SM89/SM90; this device is SM100"),
    (RTX5090, "nvfp4", "flashinfer_trtllm", "needs SM100 (compute capability 10.x: B200/GB200/B300); this device is SM120"),
    (A100, "w4a8", "cutlass", "needs SM90 (this build compiles sm_90a only); this device is SM80"),
    (A100, "mxfp4", "marlin", "not provided"),
    (CPU, "bf16", "flashinfer_cutlass", "needs an NVIDIA SM90 GPU (Hopper); this device is cpu"),
]


@pytest.mark.parametrize("device,scheme_name,backend,reason", REASONS,
                         ids=[f"{d.describe()}-{s}-{b}" for d, s, b, _ in REASONS])
def test_each_refusal_gives_its_reason(device, scheme_name, backend, reason):
    _, ok, why = oracle.probe(backend, CFG, scheme_only(scheme_name), device)
    assert not ok
    assert why.startswith(reason), why


class _FlashinferModuleStandIn:
    """What the oracle asks of jax_moe._jax_moe_flashinfer: the bit mask of compiled schemes."""

    def __init__(self, mask: int):
        self.mask = mask

    def compiled_schemes(self) -> int:
        return self.mask


def _assert_served_only_where_compiled(monkeypatch, schemes, name):
    """With a stand-in FlashInfer module compiled for ``schemes`` on SM90: scheme ``name`` is
    served for prepared weights (the oracle selects flashinfer_cutlass) when compiled, else
    refused with "scheme '<name>' is not compiled into this build (JAX_MOE_FI_SCHEMES)"."""
    from jax_moe.backends import flashinfer_cutlass as fic

    mask = sum(1 << fic.SCHEME_IDS[s] for s in schemes)
    monkeypatch.setitem(fic._state, "module", _FlashinferModuleStandIn(mask))
    monkeypatch.setitem(fic._state, "error", None)
    _, ok, why = oracle.probe("flashinfer_cutlass", CFG, scheme_only(name), H100)
    if name in schemes:
        assert ok, why
        assert oracle.select_backend(CFG, scheme_only(name), device=H100, prepared=True).name == "flashinfer_cutlass"
    else:
        assert not ok and why.startswith(f"scheme '{name}' is not compiled into this build (JAX_MOE_FI_SCHEMES)"), why


@pytest.mark.parametrize("schemes", [("bf16", "fp8", "mxfp4"), ("bf16", "fp8", "mxfp4", "fp8_block")])
def test_flashinfer_cutlass_fp8_block_is_served_only_where_compiled(monkeypatch, schemes):
    """fp8_block is opt-in (JAX_MOE_FI_SCHEMES): on SM90 a build without it says so; a build
    with it serves DeepSeek-style FP8 block weights for prepared weights (the oracle's
    AUTO_PREPARED), and still refuses activations other than per-group FP8 with its reason."""
    _assert_served_only_where_compiled(monkeypatch, schemes, "fp8_block")
    _, ok, why = oracle.probe("flashinfer_cutlass", CFG, scheme_only("fp8_block", act="bf16"), H100)
    assert not ok and "act='fp8_per_group'" in why, why


@pytest.mark.parametrize("schemes", [("bf16", "fp8", "mxfp4"), ("bf16", "fp8", "mxfp4", "w4a8")])
def test_flashinfer_cutlass_w4a8_is_served_only_where_compiled(monkeypatch, schemes):
    """w4a8 is opt-in (JAX_MOE_FI_SCHEMES): on SM90 a build without it says so; a build with it
    serves int4 x FP8 weights for prepared weights, and still refuses per-token activations and
    a missing static a2_scale with their reasons."""
    _assert_served_only_where_compiled(monkeypatch, schemes, "w4a8")
    _, ok, why = oracle.probe("flashinfer_cutlass", CFG, scheme_only("w4a8", act="fp8_per_token"), H100)
    assert not ok and "act='fp8_per_tensor'" in why, why
    _, ok, why = oracle.probe("flashinfer_cutlass", CFG, scheme_only("w4a8", a2_scale=None), H100)
    assert not ok and "static a2_scale" in why, why


@pytest.mark.parametrize("device", [A100, H100, B200, RTX5090, CPU], ids=lambda d: d.describe())
@pytest.mark.parametrize("scheme_name", sorted(oracle.SCHEME_ORDER))
def test_every_device_and_scheme_falls_back_to_xla_with_reasons_in_order(device, scheme_name):
    sel = oracle.select_backend(CFG, scheme_only(scheme_name), device=device)
    assert sel.name == "xla"
    assert [name for name, _ in sel.reasons] == list(oracle.order_for(scheme_only(scheme_name)))[:-1]
    assert all(reason for _, reason in sel.reasons)


def test_orders_follow_vllm():
    assert oracle.SCHEME_ORDER["nvfp4"][:5] == ("flashinfer_trtllm", "flashinfer_cutedsl", "flashinfer_cutlass",
                                                "cutlass", "marlin")
    assert all(order[-1] == "xla" for order in oracle.SCHEME_ORDER.values())


@pytest.mark.parametrize("pref,first", [("throughput", "flashinfer_cutlass"), ("latency", "flashinfer_trtllm"),
                                        ("masked_gemm", "flashinfer_cutedsl")])
def test_flashinfer_preference_moves_its_row_first(monkeypatch, pref, first):
    monkeypatch.setenv(oracle.FLASHINFER_ENV, pref)
    assert oracle.order_for(scheme_only("nvfp4"))[0] == first


def test_bad_flashinfer_preference_raises(monkeypatch):
    monkeypatch.setenv(oracle.FLASHINFER_ENV, "fastest")
    with pytest.raises(ValueError, match="JAX_MOE_FLASHINFER_MOE_BACKEND must be one of"):
        oracle.order_for(None)


def _small():
    x = jnp.ones((4, 16), jnp.float32) * 0.5
    w13 = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16, 16)), jnp.float32)
    w2 = jnp.asarray(np.random.default_rng(1).standard_normal((4, 16, 8)), jnp.float32)
    return x, w13, w2, jnp.full((4, 2), 0.5, jnp.float32), jnp.tile(jnp.array([[0, 3]], jnp.int32), (4, 1))


def test_forced_unsupported_backend_raises_before_tracing():
    with pytest.raises(ValueError, match="backend 'flashinfer_trtllm' cannot serve this MoE: needs SM100"):
        fused_experts(*_small(), backend="flashinfer_trtllm")


def test_environment_forces_a_backend(monkeypatch):
    monkeypatch.setenv(oracle.ENV, "marlin")
    with pytest.raises(ValueError, match="backend 'marlin' cannot serve this MoE"):
        fused_experts(*_small())
    monkeypatch.setenv(oracle.ENV, "xla")
    assert fused_experts(*_small()).shape == (4, 16)


# With the FlashInfer module present on an SM90 device (simulated here; the real thing runs in the
# GPU tests): which backend fused_experts gets, and which MoEBlock.prepare() gets.
PREPARED_CASES = [
    # scheme, changes, fused_experts' choice, prepare()'s choice, reason flashinfer_cutlass gives
    ("bf16", {}, "xla", "flashinfer_cutlass", "can serve this, but repacks the weights on every call"),
    ("fp8", {}, "xla", "flashinfer_cutlass", "can serve this, but repacks the weights on every call"),
    ("fp8", {"act": "fp8_per_token", "a13_scale": None, "a2_scale": None}, "xla", "xla",
     "FP8 needs per-tensor activation scales"),
    ("fp8", {"a2_scale": None}, "xla", "xla", "FP8 needs a static a2_scale"),
    ("fp8", {"w13_scale": np.ones((128, 1536, 1), np.float32)}, "xla", "xla", "w13_scale is per channel"),
    ("mxfp4", {}, "xla", "flashinfer_cutlass", "can serve this, but repacks the weights on every call"),
    ("mxfp4", {"act": "mxfp8"}, "xla", "xla", "MXFP4 runs with bf16 activations (W4A16) here"),
    ("nvfp4", {}, "xla", "xla", "scheme 'nvfp4' is not built yet"),
]


@pytest.mark.parametrize("scheme_name,changes,plain,prepared,reason", PREPARED_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(PREPARED_CASES)])
def test_flashinfer_cutlass_is_picked_for_prepared_weights(monkeypatch, scheme_name, changes, plain,
                                                          prepared, reason):
    from jax_moe.backends import flashinfer_cutlass as fic

    monkeypatch.setattr(fic.native, "available", lambda device=None: (True, "simulated"))
    monkeypatch.setattr(fic.native, "compiled_schemes", lambda: ("bf16", "fp8", "mxfp4"))
    q = scheme_only(scheme_name, **changes)
    sel = oracle.select_backend(CFG, q, device=H100)
    assert sel.name == plain
    assert dict(sel.reasons)["flashinfer_cutlass"].startswith(reason)
    assert oracle.select_backend(CFG, q, device=H100, prepared=True).name == prepared


def test_flashinfer_cutlass_scheme_left_out_of_the_build(monkeypatch):
    from jax_moe.backends import flashinfer_cutlass as fic

    monkeypatch.setattr(fic.native, "available", lambda device=None: (True, "simulated"))
    monkeypatch.setattr(fic.native, "compiled_schemes", lambda: ("bf16", "fp8"))
    sel = oracle.select_backend(CFG, scheme_only("mxfp4"), device=H100, prepared=True)
    assert sel.name == "xla"
    assert dict(sel.reasons)["flashinfer_cutlass"] == ("scheme 'mxfp4' is not compiled into this build "
                                                      "(JAX_MOE_FI_SCHEMES)")


# ----------------------------------------------------------------------------- the backend interface


@pytest.mark.parametrize("name", sorted(oracle.MODULES))
def test_every_backend_module_declares_the_interface(name):
    """Every row with a module has jax_moe.backends.base's interface: NAME (its row's name),
    FEATURES (a frozenset of the known features), supports(cfg, quant, device, *, dtype=None)
    answering (bool, str) on a CPU, apply(); prepare and apply_prepared together, with the
    prepared contract's parameters; apply_batched where FEATURES says "batched"."""
    import inspect

    from jax_moe.backends import base

    mod = oracle.module(name)
    assert isinstance(mod, base.Backend), name
    assert mod.NAME == name
    assert isinstance(mod.FEATURES, frozenset)
    assert all(f in base.FEATURE_NAMES or f.startswith("dtype:") for f in mod.FEATURES), mod.FEATURES
    assert "batched" not in mod.FEATURES or isinstance(mod, base.BatchedBackend)
    assert hasattr(mod, "prepare") == hasattr(mod, "apply_prepared")
    if isinstance(mod, base.PreparedBackend):
        assert list(inspect.signature(mod.prepare).parameters)[:4] == ["w13", "w2", "cfg", "quant"]
        assert list(inspect.signature(mod.apply_prepared).parameters)[:4] == ["x", "prepared", "topk_weights",
                                                                             "topk_ids"]
    params = inspect.signature(mod.supports).parameters
    assert list(params)[:3] == ["cfg", "quant", "device"]
    assert "dtype" in params and params["dtype"].kind is inspect.Parameter.KEYWORD_ONLY
    ok, why = mod.supports(CFG, None, CPU, dtype="bfloat16")
    assert isinstance(ok, bool) and isinstance(why, str) and why


def test_the_oracle_reads_the_interface_without_inspect():
    import inspect

    assert "import inspect" not in inspect.getsource(oracle)


# ----------------------------------------------------------------------------- python -m jax_moe.info


@pytest.mark.parametrize("model", ["8,64,32", "8,64,x,2", "8,64,32,0", "8,64,32,9"])
def test_info_rejects_a_bad_model_with_a_usage_error(model, capsys):
    """--model takes E,H,I,k: three numbers, a word, a zero or k > E end in argparse's error
    (exit status 2, the usage line and what is wrong), not a traceback."""
    from jax_moe import info

    with pytest.raises(SystemExit) as exc:
        info.main(["--model", model])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m jax_moe.info" in err and "--model" in err and "Traceback" not in err


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="on a CPU: a GPU's rows name its build")
def test_info_on_a_cpu_names_the_device_not_the_build(capsys):
    """On a CPU the SM90 rows say that they need an SM90 GPU and what this device is, not what
    the build compiles (a build without CUDA compiles no sm_90a)."""
    from jax_moe import info

    info.main(["--model", "8,64,32,2", "--scheme", "fp8"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    sm90 = [line for line in rows if line.split()[0] in ("flashinfer_cutlass", "cutlass")]
    assert len(sm90) == 2
    for line in sm90:
        assert "needs an NVIDIA SM90 GPU (Hopper); this device is cpu" in line, line
        assert "sm_90a only" not in line, line


def test_info_without_flashinfer_lists_no_flashinfer_scheme_as_present(monkeypatch, capsys):
    """A build without the FlashInfer modules (simulated): info says so, and no row lists the
    runner's schemes as what this build has."""
    from jax_moe import info
    from jax_moe.backends import flashinfer_cutlass as fic

    monkeypatch.setitem(fic._state, "module", None)
    monkeypatch.setitem(fic._state, "error", "simulated: jax_moe._jax_moe_flashinfer is not built")
    for scheme_name in ("bf16", "nvfp4", "mxfp4"):
        info.main(["--scheme", scheme_name])
        out = capsys.readouterr().out
        assert "native flashinfer_cutlass: unavailable: simulated" in out
        assert "native trtllm: unavailable: simulated" in out
        for line in out.splitlines():
            if line.startswith("  flashinfer_"):
                assert not any(s in line for s in ("bf16,", "'bf16'", "fp8,", "(serves")), line
    _, ok, why = oracle.probe("flashinfer_cutlass", CFG, scheme_only("nvfp4"), H100)
    assert not ok and why == ("scheme 'nvfp4' is not built yet (this build serves nothing: simulated: "
                              "jax_moe._jax_moe_flashinfer is not built)")
