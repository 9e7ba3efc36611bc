"""Test-suite wiring: ``@pytest.mark.gpu`` tests run only where JAX sees an NVIDIA GPU; the CPU
platform gets 8 devices so that the parallel tests can build meshes anywhere."""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_collection_modifyitems(config, items):
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.devices() has none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh numpy Generator per test, seeded from the test's node id (reproducible, never zeros)."""
    import numpy as np
    import zlib

    def make(node_id: str):
        return np.random.default_rng(zlib.crc32(node_id.encode()))

    return make(request.node.nodeid)
