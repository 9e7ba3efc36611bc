"""Test-suite wiring:

* ``@pytest.mark.gpu`` tests run only where JAX sees an NVIDIA GPU; ``@pytest.mark.slow`` tests
  are left out of the everyday command (``-m "not slow"``) and run in CI;
* the CPU platform gets 8 devices so that the parallel tests can build meshes anywhere;
* on CPU-only machines programs compile with cheaper XLA:CPU settings (the suite is compile-bound);
* the long modules (:data:`LONG_MODULES_FIRST`) start first, so that xdist's workers end together;
* compiled programs go to JAX's persistent compilation cache in ``JAX_MOE_TEST_CACHE`` (default
  ``<repo>/.jax_cache``; ``JAX_MOE_TEST_CACHE=off`` disables it), so a second run compiles
  almost nothing;
* under pytest-xdist (``-n auto``) each worker allocates GPU memory on demand instead of XLA's
  75% preallocation, and ``-n auto`` starts at most :data:`GPU_WORKERS` workers on a GPU machine
  (compilation is what the workers share out; the GPU is shared).
"""

import os
import shutil
from importlib import metadata


def _jaxlib_minor() -> tuple[int, ...]:
    """The installed jaxlib's (major, minor), read without initializing any XLA backend."""
    try:
        return tuple(int(p) for p in metadata.version("jaxlib").split(".")[:2])
    except (metadata.PackageNotFoundError, ValueError):
        return ()


if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    # CPU-only machines: the suite is compile-bound (thousands of small programs); cheaper LLVM
    # passes cut its CPU time by about a quarter and change no result the tests check.
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    # XLA:CPU's elemental fusion emitters compile a small program in about two thirds of the time
    # its MLIR fusion emitters take (test_experts, test_experts_quant, test_moe_kernels and
    # test_cutlass_grad: 88 s against 129 s on two cores). Set only on the jaxlib minor release it
    # was measured on, as XLA stops at a flag it does not know.
    if _jaxlib_minor() == (0, 10):
        os.environ["XLA_FLAGS"] += " --xla_cpu_use_fusion_emitters=false"
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import pytest

GPU_WORKERS = 4
_CACHE = os.environ.get("JAX_MOE_TEST_CACHE",
                        os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache"))
if _CACHE != "off":
    jax.config.update("jax_compilation_cache_dir", _CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


HAS_GPU = _has_gpu()


def pytest_runtest_logreport(report):
    """With ``JAX_MOE_TEST_TIMES=<file>``, append ``<seconds> <outcome> <test id>`` per test phase
    as it ends (so a run cut off by a time limit still says where the time went)."""
    path = os.environ.get("JAX_MOE_TEST_TIMES")
    if path and not os.environ.get("PYTEST_XDIST_WORKER") and (report.when == "call" or report.outcome != "passed"):
        with open(path, "a") as f:
            f.write(f"{report.duration:.2f} {report.outcome} {report.nodeid}\n")


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core on CPU, at most GPU_WORKERS where a GPU is shared."""
    cores = os.cpu_count() or 1
    return min(cores, GPU_WORKERS) if HAS_GPU else cores


# Modules whose tests take tens of seconds each on two CPU cores (hypothesis on meshes of 8 devices,
# a second process): they start first, so that under pytest-xdist no worker is still on one of them
# after the others have run out of tests.
LONG_MODULES_FIRST = ("test_properties.py", "test_multiprocess.py", "test_parallel.py", "test_train_bench.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONG_MODULES_FIRST)  # stable: the rest keep their order
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


_COMMAND_BUFFER_SCRIPT = """
import numpy as np, jax, jax.numpy as jnp
from jax_moe import fused_experts
from jax_moe.quant.scheme import quantize_weights
rng = np.random.default_rng({seed})


def weights(e, h, i, dtype=jnp.float32):  # fresh [E, 2I, H] and [E, H, I] weights, unit-scale outputs
    return (jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), dtype),
            jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), dtype))


{cases_code}
for t, k, w13, w2, opt in cases:
    kw = opt if isinstance(opt, dict) else dict(quant=opt)
    e, h = w2.shape[0], w2.shape[1]
    f = jax.jit(lambda x, tw, ids: fused_experts(x, w13, w2, tw, ids, backend={backend!r}, **kw))
    for _ in range(3):
        x = jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16)
        ids = jnp.asarray(np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k], jnp.int32)
        tw = jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32)
        out = np.asarray(f(x, tw, ids), np.float32)
        ref = np.asarray(fused_experts(x, w13, w2, tw, ids, backend="xla", **kw), np.float32)
        err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
        assert np.isfinite(out).all() and err < {tol}, err
print("OK", len(cases))
"""


@pytest.fixture
def command_buffer_check():
    """``check(backend, cases_code, tol)``: in a fresh process with XLA's command buffers forced on
    (custom calls included), ``fused_experts(..., backend=backend)`` under ``jax.jit`` on fresh
    inputs, three rounds per case, against ``backend="xla"`` within relative error ``tol``.
    ``cases_code`` is Python that defines ``cases``, a list of ``(T, k, w13, w2, quant)``, where
    ``quant`` may also be a dict of ``fused_experts`` keyword arguments (it may use
    ``rng``, ``np``, ``jnp``, ``quantize_weights`` and ``weights(e, h, i, dtype=jnp.float32)``, fresh
    ``[E, 2I, H]`` and ``[E, H, I]`` weights). Returns the number of cases run."""
    import subprocess
    import sys
    import textwrap

    def check(backend: str, cases_code: str, tol: float, seed: int = 5, script: str | None = None) -> int:
        """``script`` (optional): Python run instead of the fused_experts loop; it may use ``{seed}``,
        ``{cases_code}`` and ``{tol}`` and must print ``OK <cases run>``."""
        script = (script or _COMMAND_BUFFER_SCRIPT).format(seed=seed, cases_code=textwrap.dedent(cases_code),
                                                           backend=backend, tol=tol)
        # This process already holds most of the GPU (XLA preallocates): the child allocates on demand.
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
                   XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
        return int(out.stdout.split("OK")[-1].split()[0])

    return check
