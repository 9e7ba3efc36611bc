"""Cases the CUTLASS backend's test files share (test_cutlass_backend.py, test_cutlass_fp8.py,
test_cutlass_batched.py): devices, tolerances, and the random grouped-GEMM and MoE problems of each kind."""

import re

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe.backends import cutlass as cb
from jax_moe.config import MoEConfig
from jax_moe.device import DeviceInfo
from jax_moe.ffi import gpu_backend
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights

from helpers import SCHEME_TOL, random_biases, random_moe, random_routing

H100, A100 = DeviceInfo("gpu", (9, 0)), DeviceInfo("gpu", (8, 0))
REL_TOL = SCHEME_TOL["bf16"]
FP8_GEMM_TOL = 1e-2  # exact FP8 products; only float32 accumulation order and d's bf16 rounding differ
FP8_REL_TOL = SCHEME_TOL["fp8"]  # the whole FP8 MoE against backend="xla" on the same quantized weights
F8 = jnp.float8_e4m3fn
GEMM_TOL = {"bf16": REL_TOL, "fp8": FP8_GEMM_TOL}


def group_offsets(counts) -> jax.Array:
    """offsets [E + 1] int32 of rows grouped by expert, ``counts`` rows each."""
    return jnp.asarray(np.concatenate([[0], np.cumsum(counts)]), jnp.int32)


def gemm_problem(rng, counts, n, k):
    """(a [M, K], b [E, N, K], offsets) of a random bf16 grouped GEMM, ``counts`` rows per expert."""
    m, e = int(np.sum(counts)), len(counts)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    b = jnp.asarray(rng.standard_normal((e, n, k)) / np.sqrt(k), jnp.bfloat16)
    return a, b, group_offsets(counts)


def spread_counts(rng, experts: int = 128) -> np.ndarray:
    """Rows of ``experts`` experts for the spread order (from 64 experts of 96 to 192 mean rows the
    setup launch lays the groups out by their rows, heavy and light mixed): uneven rows (0..260,
    about 130 on average), ties and empty experts, so that nearly every expert's group moves from
    its index."""
    counts = rng.integers(0, 260, experts)
    counts[[5, 40, 77]] = 0
    counts[[9, 10, 90]] = 150  # ties keep expert order
    return counts


def fp8_gemm_problem(rng, counts, n, k):
    """FP8 rows and weights (values of a standard normal, exactly representable after the cast),
    per-row and per-channel dequantization scales."""
    m, e = int(np.sum(counts)), len(counts)
    a = jnp.asarray(rng.standard_normal((m, k)), jnp.float32).astype(F8)
    b = jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32).astype(F8)
    row = jnp.asarray(rng.uniform(0.5, 2.0, m) / 64, jnp.float32)
    col = jnp.asarray(rng.uniform(0.5, 2.0, (e, n)) / np.sqrt(k), jnp.float32)
    return a, b, group_offsets(counts), row, col


# The FP8 scale forms the fused GEMMs take as they are (no broadcast before the kernel): a_scale's
# and b_scale's shapes, M rows, E experts, N output columns.
SCALE_FORMS = {
    "per tensor, per expert": lambda m, e, n: ((), (e,)),
    "per tensor, per tensor": lambda m, e, n: ((1,), ()),
    "per row, per expert": lambda m, e, n: ((m,), (e,)),
    "per tensor, per channel": lambda m, e, n: ((), (e, n, 1)),
}


# Every scale form, on one cooperative and one pingpong tile: the fused kernels' scale-form tests.
each_scale_form = pytest.mark.parametrize(
    "tile, form", [(tile, form) for tile in ("coop_128x256", "pingpong_64x128") for form in sorted(SCALE_FORMS)])


def fp8_problem_in_form(rng, form: str, n: int, k: int, e: int = 24):
    """fp8_gemm_problem's a, b and offsets for ``e`` experts of 0..200 rows, then scales_in_form's
    four scales of ``form``."""
    a, b, off, _, _ = fp8_gemm_problem(rng, rng.integers(0, 200, e), n, k)
    return (a, b, off, *scales_in_form(rng, form, a.shape[0], e, n, k))


def scales_in_form(rng, form: str, m: int, e: int, n: int, k: int):
    """(a_scale, b_scale) of ``form`` (a key of SCALE_FORMS; random positive values, none equal), and
    the same scales whole: row [M], col [E, N] float32 (for the definitions)."""
    a_shape, b_shape = SCALE_FORMS[form](m, e, n)
    a_scale = jnp.asarray(rng.uniform(0.5, 2.0, a_shape) / 64, jnp.float32)
    b_scale = jnp.asarray(rng.uniform(0.5, 2.0, b_shape) / np.sqrt(k), jnp.float32)
    row = jnp.broadcast_to(jnp.reshape(a_scale, (-1,)), (m,))
    col = jnp.reshape(b_scale, (e, n)) if len(b_shape) >= 2 else jnp.broadcast_to(jnp.reshape(b_scale, (-1, 1)), (e, n))
    return a_scale, b_scale, row, col


def scale_broadcasts(fn, *args) -> list[str]:
    """The float32 broadcasts of more than one element in ``fn``'s compiled HLO for ``args`` (a
    scale broadcast to a vector before the kernel would be one)."""
    found = []
    for line in fn.lower(*args).compile().as_text().splitlines():
        m = re.search(r"= f32\[([0-9,]*)\]\S* broadcast\(", line)
        if m and int(np.prod([int(d) for d in m.group(1).split(",") if d] or [1])) > 1:
            found.append(line.strip())
    return found


def fp8_loop_reference(a, b, offsets, row, col) -> np.ndarray:
    """The definition, in float64 numpy, expert by expert: d[r, n] = (a[r] @ b[e].T)[n] * row[r] * col[e, n];
    rows outside the offsets zero."""
    a, b = np.asarray(a.astype(jnp.float32), np.float64), np.asarray(b.astype(jnp.float32), np.float64)
    row, col, off = np.asarray(row, np.float64), np.asarray(col, np.float64), np.asarray(offsets)
    d = np.zeros((a.shape[0], b.shape[1]), np.float64)
    for e in range(b.shape[0]):
        r = slice(off[e], off[e + 1])
        d[r] = (a[r] @ b[e].T) * col[e][None, :] * row[r, None]
    return d


def small_cfg(e=8, k=2, h=64, i=32, activation="silu", **kw):
    """A small MoEConfig (E = 8, k = 2, H = 64, I = 32, silu unless changed)."""
    return MoEConfig(e, k, h, i, activation=activation, **kw)


def moe_problem(rng, t, e, k, h, i, gated=True):
    """(x, w13, w2, topk_weights, topk_ids) of a random bf16 layer (silu, or relu2 if not ``gated``)."""
    return random_moe(rng, t, e, k, h, i, activation="silu" if gated else "relu2", dtype=jnp.bfloat16).args


def gptoss_problem(rng, t, e, k, h, i, activation="swigluoai", minus_one=0.0):
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


def fp8_moe_problem(rng, t, e, k, h, i, mode, activation="silu"):
    """Random bf16 tokens and routing, float weights quantized to FP8 as ``mode`` says:
    ``"static"``: per-tensor activation scales calibrated on this batch (a2 on the float intermediate
    of every expert), per-expert weight scales; ``"dynamic"``: per-tensor activations without static
    scales, one weight scale per tensor; ``"per_token"``: per-token activations, per-channel weights."""
    gated = activation != "relu2"
    x, w13, w2, tw, ids = moe_problem(rng, t, e, k, h, i, gated=gated)
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


def fp8_quantize(x, w13, w2, cfg, mode, w13_bias):
    """``quantize_weights("fp8", ...)`` of float weights as :func:`fp8_moe_problem`'s ``mode`` says
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


def simulate_module(monkeypatch):
    """As if jax_moe._jax_moe_cutlass were built and loaded (for the oracle's and supports' choices);
    where it is built and a GPU runs it, the real module stays."""
    if cb._module() is not None and gpu_backend():
        return
    monkeypatch.setitem(cb._state, "module", object())
    monkeypatch.setitem(cb._state, "error", None)
