"""The decode path on FP8 weights (jax_moe.decode_fp8): a W8A8 layer with per-tensor activation scales
for a few token slots, in two kernels and no sort. Its reference against the xla backend's FP8 MoE,
which calls take it, the errors it names on CPU; the CUDA kernels against the reference and the xla
backend on a GPU."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_moe import decode, decode_fp8
from jax_moe.activations import activate
from jax_moe.backends import cutlass as cb
from jax_moe.backends import xla
from jax_moe.config import MoEConfig
from jax_moe.quant.scheme import QuantConfig, calibrate_activation_scale, quantize_weights

from helpers import SCHEME_TOL, need_native, poison_memory, random_biases, random_routing, random_weights, rel_err

FP8_TOL = SCHEME_TOL["fp8"]
KERNEL_TOL = 1e-2  # the kernels against the reference: the same function, float32 sums in another order

LAYERS = {  # name -> (E, k, H, I, activation, layout, biases)
    "qwen3-like silu": (128, 8, 256, 128, "silu", "concat", False),
    "gelu": (16, 2, 128, 64, "gelu", "concat", False),
    "gpt-oss-like": (32, 4, 192, 96, "swigluoai", "interleaved", True),
}
WEIGHT_SCALES = ["per_tensor", "per_expert", "per_channel"]


def _layer(rng, name, t, weight_scale, *, minus_one=0.0, x_dtype=jnp.bfloat16, static_a13=True, sizes=None):
    """(cfg, x, q13, q2, topk_weights, topk_ids, biases, quant): float weights quantized to FP8 with
    ``weight_scale``, per-tensor activation scales calibrated on this batch (a13 static, or dynamic
    with ``static_a13=False``; a2 always static)."""
    e, k, h, i, act, layout, biases = LAYERS[name] if sizes is None else sizes
    cfg = MoEConfig(e, k, h, i, act, layout, swiglu_alpha=1.5, swiglu_limit=4.0)
    w13, w2 = random_weights(rng, e, h, i, dtype=jnp.float32)
    w, ids = random_routing(rng, t, e, k, minus_one=minus_one)
    x = jnp.asarray(rng.standard_normal((t, h)) * 2, x_dtype)
    b = random_biases(rng, cfg, scale=0.5) if biases else {}
    h1 = jnp.einsum("th,enh->ten", x.astype(jnp.float32), w13) + b.get("w13_bias", jnp.zeros((e, 2 * i)))[None]
    opts = dict(act="fp8_per_tensor", weight_scale=weight_scale,
                a2_scale=calibrate_activation_scale("fp8_per_tensor", activate(h1, cfg)))
    if static_a13:
        opts["a13_scale"] = calibrate_activation_scale("fp8_per_tensor", x)
    q13, q2, quant = quantize_weights("fp8", w13, w2, **opts)
    return cfg, x, q13, q2, w, ids, b, quant


def _scales(quant, x):
    a13 = quant.a13_scale if quant.a13_scale is not None else jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0
    return dict(a13_scale=jnp.max(jnp.asarray(a13, jnp.float32)), a2_scale=jnp.max(jnp.asarray(quant.a2_scale)),
                w13_scale=quant.w13_scale, w2_scale=quant.w2_scale)


# ----------------------------------------------------------------------------- CPU


@pytest.mark.parametrize("weight_scale", WEIGHT_SCALES)
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("t", [1, 2])
def test_reference_is_the_xla_backends_fp8_moe(rng, name, t, weight_scale):
    """The same quantized layer through the xla backend (dequantize, then the float MoE, with the
    activations quantized as the scheme says): within the FP8 tolerance, some slots on other ranks."""
    cfg, x, q13, q2, w, ids, b, quant = _layer(rng, name, t, weight_scale, minus_one=0.2)
    got = decode_fp8.decode_moe_fp8_reference(x, q13, q2, w, ids, cfg, **_scales(quant, x), **b)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert rel_err(got, xla.apply(x, q13, q2, w, ids, cfg, quant=quant, **b)) < FP8_TOL


def test_slots_of_other_ranks_contribute_nothing(rng):
    cfg, x, q13, q2, w, ids, b, quant = _layer(rng, "qwen3-like silu", 1, "per_expert")
    none = jnp.full_like(ids, -1)
    out = decode_fp8.decode_moe_fp8_reference(x, q13, q2, w, none, cfg, **_scales(quant, x))
    assert np.all(np.asarray(out) == 0)


@pytest.mark.parametrize("act, a2, h, i, k, serves", [
    ("fp8_per_tensor", 0.1, 256, 128, 8, True),
    ("fp8_per_tensor", None, 256, 128, 8, False),   # a dynamic GEMM2 input scale needs the whole activation first
    ("fp8_per_token", None, 256, 128, 8, False),
    ("fp8_per_tensor", 0.1, 200, 128, 8, False),    # H not a multiple of 16
    ("fp8_per_tensor", 0.1, 256, 120, 8, False),    # I neither
    ("fp8_per_tensor", 0.1, 65536, 128, 8, False),  # x's row past the shared memory
    ("fp8_per_tensor", 0.1, 256, 4096, 16, False),  # a token's activations past it
])
def test_which_fp8_layers_take_it(act, a2, h, i, k, serves):
    quant = QuantConfig("fp8", jnp.float32(1), jnp.float32(1), act=act, a2_scale=a2)
    assert decode_fp8.serves(quant, h, i, k) == serves
    assert not decode_fp8.serves(None, h, i, k)


@pytest.mark.parametrize("t, takes", [(1, True), (2, True), (64, False)])
def test_cutlass_takes_it_for_few_slots_and_matches_its_grouped_path(rng, monkeypatch, t, takes):
    """cutlass.apply on FP8 weights with per-tensor activations: the decode path for few slots (at most
    16, at most one per two experts), the grouped pipeline otherwise; both the same function."""
    cfg, x, q13, q2, w, ids, b, quant = _layer(rng, "gpt-oss-like", t, "per_channel")
    calls = []
    real = decode_fp8.decode_moe_fp8
    monkeypatch.setattr(decode_fp8, "decode_moe_fp8", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    got = cb.apply(x, q13, q2, w, ids, cfg, quant=quant, **b)
    assert bool(calls) == takes
    assert rel_err(got, xla.apply(x, q13, q2, w, ids, cfg, quant=quant, **b)) < FP8_TOL
    calls.clear()
    cb.apply(x, q13, q2, w, ids, cfg, quant=quant, tile="coop_128x128", **b)
    assert not calls, "a forced tile asks for the grouped GEMMs"


def test_bad_arguments_are_named(rng):
    cfg, x, q13, q2, w, ids, b, quant = _layer(rng, "gelu", 1, "per_expert")
    s = _scales(quant, x)
    f = decode_fp8.decode_moe_fp8
    with pytest.raises(ValueError, match=r"w13 must have dtype in \['float8_e4m3fn'\], got bfloat16"):
        f(x, q13.astype(jnp.bfloat16), q2, w, ids, cfg, **s)
    with pytest.raises(ValueError, match=r"a2_scale must be one float32 scale \(per tensor\), got \[16\]"):
        f(x, q13, q2, w, ids, cfg, **{**s, "a2_scale": jnp.ones((16,))})
    with pytest.raises(ValueError, match=r"w13_scale must be \[\] \(per tensor\), \[E\] = \[16\] .* got \[16, 64\]"):
        f(x, q13, q2, w, ids, cfg, **{**s, "w13_scale": jnp.ones((16, 64))})
    with pytest.raises(ValueError, match=r"w2_scale must be .* \[E, N\] = \[16, 128\] .* got \[3\]"):
        f(x, q13, q2, w, ids, cfg, **{**s, "w2_scale": jnp.ones((3,))})


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("weight_scale", WEIGHT_SCALES)
@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("t", [1, 2, 5])
def test_cuda_kernels_are_the_reference(rng, name, t, weight_scale):
    """The two kernels on poisoned memory against the reference and the xla backend, some slots on
    other ranks; x in bf16 (t = 1, 2) and float32 (t = 5, out float32 too), a13 dynamic at t = 2."""
    need_native("cuda")
    x_dtype = jnp.float32 if t == 5 else jnp.bfloat16
    cfg, x, q13, q2, w, ids, b, quant = _layer(rng, name, t, weight_scale, minus_one=0.15, x_dtype=x_dtype,
                                               static_a13=t != 2)
    s = _scales(quant, x)
    f = jax.jit(lambda *a: decode_fp8.decode_moe_fp8(*a, cfg, **s, **b))
    poison_memory(jax.eval_shape(f, x, q13, q2, w, ids))
    got = f(x, q13, q2, w, ids)
    assert got.dtype == x_dtype
    assert rel_err(got, decode_fp8.decode_moe_fp8_reference(x, q13, q2, w, ids, cfg, **s, **b)) < KERNEL_TOL
    assert rel_err(got, xla.apply(x, q13, q2, w, ids, cfg, quant=quant, **b)) < FP8_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [(128, 8, 2048, 768, "silu", "concat", False),
                                   (16, 8, 7168, 2048, "silu", "concat", False),
                                   (32, 4, 2880, 2880, "swigluoai", "interleaved", True)],
                         ids=["qwen3-30b", "deepseek-v3-width", "gpt-oss-120b-width"])
def test_cuda_kernels_at_model_sizes(rng, sizes):
    """Qwen3-30B-A3B's layer, and DeepSeek-V3's and GPT-OSS-120B's widths on fewer experts, at the T
    of 1 and 2 where cutlass.apply takes the decode path (at most one slot per two experts), against
    the xla backend and the reference. (DeepSeek's width on 16 experts at T = 2 takes the grouped FP8
    GEMMs instead, which their own tests bound: they sit 1-2% from this reference.)"""
    need_native("cuda")
    e, k = sizes[:2]
    ts = [t for t in (1, 2) if decode.serves(t, k, e, MoEConfig(*sizes[:6]))]
    assert ts, "no T of this layer takes the decode path"
    for t in ts:
        cfg, x, q13, q2, w, ids, b, quant = _layer(rng, None, t, "per_expert", sizes=sizes)
        f = jax.jit(lambda *a: cb.apply(*a, cfg, quant=quant, **b))
        poison_memory(jax.eval_shape(f, x, q13, q2, w, ids))
        got = f(x, q13, q2, w, ids)
        assert rel_err(got, xla.apply(x, q13, q2, w, ids, cfg, quant=quant, **b)) < FP8_TOL
        s = _scales(quant, x)
        assert rel_err(got, decode_fp8.decode_moe_fp8_reference(x, q13, q2, w, ids, cfg, **s, **b)) < KERNEL_TOL


@pytest.mark.gpu
def test_warps_stream_several_outputs(rng):
    """Where a GEMM's outputs outnumber one wave of warps, each warp streams several outputs' rows as
    one pipeline. 5 tokens of 8 slots, I = 1040 and H = 2064: on a GPU of 132 SMs, GEMM1's warps take
    22 outputs each (20 in a slot's last block) and GEMM2's 5 columns (3 in a token's last block).
    H = 2064 makes each of GEMM1's rows two batches of loads, the second one vector long.
    Per-channel scales and biases, whose loads run ahead with the next output's weights; slots on
    other ranks; poisoned memory."""
    need_native("cuda")
    sizes = (32, 8, 2064, 1040, "gelu", "interleaved", True)
    cfg, x, q13, q2, w, ids, b, quant = _layer(rng, None, 5, "per_channel", minus_one=0.2, sizes=sizes)
    s = _scales(quant, x)
    f = jax.jit(lambda *a: decode_fp8.decode_moe_fp8(*a, cfg, **s, **b))
    poison_memory(jax.eval_shape(f, x, q13, q2, w, ids))
    got = f(x, q13, q2, w, ids)
    assert rel_err(got, decode_fp8.decode_moe_fp8_reference(x, q13, q2, w, ids, cfg, **s, **b)) < KERNEL_TOL
    assert rel_err(got, xla.apply(x, q13, q2, w, ids, cfg, quant=quant, **b)) < FP8_TOL


@pytest.mark.gpu
def test_under_command_buffers(command_buffer_check):
    """The two launches inside a CUDA graph: with XLA's command buffers forced on (custom calls
    included), fresh inputs each round, the decode path at T = 1 and 2 matches the xla backend."""
    need_native("cuda")
    assert command_buffer_check("cutlass", """
        cases = [(t, 8, *quantize_weights("fp8", *weights(128, 256, 128), a13_scale=0.01, a2_scale=0.005))
                 for t in (1, 2)]
    """, FP8_TOL) == 2
