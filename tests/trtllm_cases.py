"""Cases the TRT-LLM gen test files share (test_flashinfer_trtllm*.py): devices, a faked native module
(its scheme and cubin lists and workspace query) and the fixtures that install it or take it away."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe.backends import flashinfer_trtllm as trt
from jax_moe.config import MoEConfig
from jax_moe.device import DeviceInfo
from jax_moe.quant.scheme import quantize_weights

H100, B200, B300, RTX5090 = (DeviceInfo("gpu", c) for c in ((9, 0), (10, 0), (10, 3), (12, 0)))
CFG = MoEConfig(128, 8, 2048, 768)
CUBINS = [("pack/batched_gemm-x/Bmm_E4m3_a.cubin", ""), ("pack/batched_gemm-x/Bmm_E4m3_b.cubin", "")]


def fp8_quant(e=4, h=128, i=24, a13=0.02, a2=0.5, seed=0):
    rng = np.random.default_rng(seed)
    w13 = jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32)
    return quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a2)


class FakeModule:
    """Stands in for jax_moe._jax_moe_trtllm: its scheme list, cubin list and workspace size; it
    records the arguments of its cubin and workspace queries."""

    def __init__(self, cubins=CUBINS, workspace=4096, schemes=("fp8", "nvfp4", "mxfp4", "fp8_block")):
        self._cubins, self._ws, self._schemes = cubins, workspace, list(schemes)
        self.calls = []

    def schemes(self):
        return list(self._schemes)

    def cubins(self, *args, **kwargs):
        self.calls.append(("cubins", args, kwargs))
        return list(self._cubins)

    def workspace_size(self, *args, **kwargs):
        self.calls.append(("workspace_size", args, kwargs))
        return self._ws

    def registrations(self):
        return {}


@pytest.fixture
def no_module(monkeypatch):
    monkeypatch.setitem(trt._state, "module", None)
    monkeypatch.setitem(trt._state, "error", "jax_moe._jax_moe_trtllm is not built (simulated)")


@pytest.fixture
def fake_module(monkeypatch, tmp_path):
    """The module present, cubins read from an empty tmp_path (JAX_MOE_TRTLLM_CUBIN_DIR)."""
    monkeypatch.setitem(trt._state, "module", FakeModule())
    monkeypatch.setitem(trt._state, "error", None)
    monkeypatch.setenv(trt.CUBIN_ENV, str(tmp_path))
    return tmp_path


def write_cubins(root, cubins=CUBINS, data=b"cubin"):
    for rel, _ in cubins:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        with open(os.path.join(root, rel), "wb") as f:
            f.write(data)


NAME = "flashinfer_trtllm"


def rng_weights(e, h, i, seed=0):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((e, 2 * i, h)), jnp.float32),
            jnp.asarray(rng.standard_normal((e, h, i)), jnp.float32))
