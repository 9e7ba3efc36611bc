"""The conformance suite: the specification of ``fused_experts`` that every backend meets.

A backend joins by adding one :class:`Entry` to :data:`BACKENDS`: its name (``backend=`` of
``fused_experts``), the schemes it is run with, whether it needs a GPU (``gpu``-marked: skipped
without one, see conftest.py), the multiple its kernels need H and I to be, and whether it is
reached through ``prepare()`` + ``apply_prepared()`` (weights repacked once at load time, as
``MoEBlock.prepare()`` does) instead of ``fused_experts``. On a GPU machine a case the backend's
own ``supports()`` refuses (another GPU generation, a scheme this build lacks) is skipped with that
reason; a CPU backend must serve every case it lists.

Each backend and scheme then gets the specifications below. The expected output comes from
:func:`helpers.np_moe`, the MoE written from its definition in float64 numpy,
``out[t] = sum_j w[t, j] * W2[e] @ (silu(gate) * up)`` with ``[gate; up] = W13[e] @ x[t]`` (gate
rows, then up rows) and ``e = topk_ids[t, j]``, on the weights as the scheme stores them and the
activations as the scheme's format quantizes them, both written out here in numpy from the
formats' documentation (jax_moe/quant/scheme.py, fp8.py, fp4.py). The bound of each scheme covers
the rounding of x's dtype and what a kernel's own arithmetic moves across a rounding boundary.
Every output is checked finite after the device memory of its size was filled with NaN bytes (a
kernel that leaves rows unwritten shows up); every array is fresh random data.

On this suite's findings: T = 0 is a valid batch (an empty [0, H] output); ids outside [0, E)
are not validated: -1 (an expert on another device) contributes nothing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import fused_experts, oracle
from jax_moe.config import MoEConfig
from jax_moe.device import DeviceInfo
from jax_moe.quant.scheme import QuantConfig, calibrate_activation_scale, quantize_weights
from helpers import (
    E2M1_VALUES,
    Moe,
    np_activation,
    np_e2m1_round,
    np_e4m3_round,
    np_moe,
    poison_experts,
    poison_memory,
    random_moe,
    rel_err,
)

# ----------------------------------------------------------------------------- the backends


def cutlass_stand_in(monkeypatch) -> bool:
    """Where jax_moe's CUTLASS kernels cannot run (no SM90 GPU, or no module), ``backend="cutlass"``
    runs its own pipeline (expert sort, row permutation, activation, un-permute and reduce) on the
    jnp references of its kernels (jax_moe/backends/cutlass_gemm.py, jax_moe/kernels.py): the
    oracle is told the device is an SM90 with the module loaded. Returns whether it stands in."""
    from jax_moe.backends import cutlass

    if cutlass.available()[0]:
        return False
    monkeypatch.setitem(cutlass._state, "module", object())
    monkeypatch.setitem(cutlass._state, "error", None)
    supports = cutlass.supports

    def on_an_h100(cfg, quant=None, device=None, **kw):
        return supports(cfg, quant, DeviceInfo("gpu", (9, 0)), **kw)

    monkeypatch.setattr(cutlass, "supports", on_an_h100)
    return True


@dataclasses.dataclass(frozen=True)
class Entry:
    """One backend of the suite.

    ``schemes`` run in the everyday set, ``slow_schemes`` in the slow one; ``gpu``: needs a GPU;
    ``align``: H and I are rounded up to a multiple of it; ``prepared``: reached through the
    module's ``prepare`` and ``apply_prepared``; ``stand_in(monkeypatch)``: makes the backend
    runnable where its kernels are absent, returning whether it did; ``stand_in_xfail``: test name
    -> why the stand-in (not the kernels) is known to fail it (a strict xfail)."""

    name: str
    schemes: tuple[str, ...]
    gpu: bool = False
    align: int = 1
    prepared: bool = False
    slow_schemes: tuple[str, ...] = ()
    stand_in: Callable | None = None
    stand_in_xfail: dict = dataclasses.field(default_factory=dict)

    @property
    def module(self):
        return oracle.module(self.name)


BACKENDS = [
    Entry("xla", ("bf16", "fp8"), slow_schemes=("f32", "fp8_block", "mxfp4", "nvfp4")),
    Entry("cutlass", ("bf16", "fp8"), align=16, stand_in=cutlass_stand_in),
    Entry("flashinfer_cutlass", ("bf16", "fp8", "mxfp4"), gpu=True, align=128, prepared=True),
    Entry("flashinfer_trtllm", ("fp8", "fp8_block", "nvfp4", "mxfp4"), gpu=True, align=128),
    Entry("flashinfer_cutedsl", ("nvfp4",), gpu=True, align=128),
]


# ----------------------------------------------------------------------------- the schemes


def _np_dequantize(quant: QuantConfig | None, w, scale, global_scale) -> np.ndarray:
    """A stored weight [E, N, K (packed)] as float64, from the scheme's documented encoding
    (jax_moe/quant/scheme.py's table): FP8 times its scale ([], [E] or [E, N, 1]); FP8 blocks times
    the scale of their (bn, bk) block; MXFP4 E2M1 pairs (element 2i in the low nibble) times
    2**(byte - 127) per 32 along K; NVFP4 E2M1 times its e4m3 block-16 scale, over the expert's
    global scale."""
    if quant is None:
        return np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    if quant.scheme in ("fp8", "fp8_block"):
        v = np.asarray(jnp.asarray(w).astype(jnp.float32), np.float64)
        s = np.asarray(scale, np.float64)
        if quant.scheme == "fp8_block":
            bn, bk = quant.block_shape
            s = np.repeat(np.repeat(s, bn, axis=-2), bk, axis=-1)[..., :v.shape[-2], :v.shape[-1]]
        elif s.ndim == 1:
            s = s[:, None, None]
        return v * s
    p = np.asarray(w, np.uint8)
    codes = np.stack([E2M1_VALUES[p & 0xF], E2M1_VALUES[p >> 4]], axis=-1).reshape(p.shape[:-1] + (-1,))
    if quant.scheme == "mxfp4":
        return codes * np.repeat(np.exp2(np.asarray(scale, np.float64) - 127.0), 32, axis=-1)
    assert quant.scheme == "nvfp4", quant.scheme
    s = np.asarray(jnp.asarray(scale).astype(jnp.float32), np.float64)
    return codes * np.repeat(s, 16, axis=-1) / np.asarray(global_scale, np.float64)[:, None, None]


def dequantized(quant: QuantConfig | None, w13, w2) -> tuple[np.ndarray, np.ndarray]:
    """The stored weights of a call as float64 numpy (:func:`_np_dequantize`)."""
    if quant is None:
        return _np_dequantize(None, w13, None, None), _np_dequantize(None, w2, None, None)
    return (_np_dequantize(quant, w13, quant.w13_scale, quant.w13_global_scale),
            _np_dequantize(quant, w2, quant.w2_scale, quant.w2_global_scale))


# The activation formats below follow jax_moe/quant's documented float32 arithmetic step by step
# (float64 would round the rare product within an ulp of a tie the other way, a whole step).
F32 = np.float32


def _static_scale(quant: QuantConfig, stage: int) -> np.float32:
    """A static activation scale ([] or [E]: one for all experts, their max)."""
    return F32(np.max(np.asarray(quant.a13_scale if stage == 1 else quant.a2_scale, np.float32)))


def _np_fp8(v, scale) -> np.ndarray:
    """``e4m3(v * (1 / scale)) * scale``, saturating at 448, the product in float32."""
    scale = np.asarray(scale, np.float32)
    return np_e4m3_round(np.asarray(v, np.float32) * (F32(1) / scale)) * scale.astype(np.float64)


def np_fp8_static(v: np.ndarray, stage: int, quant: QuantConfig) -> np.ndarray:
    """fp8_per_tensor with a static scale."""
    return _np_fp8(v, _static_scale(quant, stage))


def np_fp8_groups(v: np.ndarray, stage: int, quant: QuantConfig) -> np.ndarray:
    """fp8_per_group: groups of block_shape[1] along K, each scaled by its own amax / 448 (at
    least the smallest normal float32)."""
    g = quant.block_shape[1]
    out = np.empty(v.shape)
    for lo in range(0, v.shape[-1], g):
        part = np.asarray(v[lo:lo + g], np.float32)
        out[lo:lo + g] = _np_fp8(part, max(np.abs(part).max() * (F32(1) / F32(448)), np.finfo(np.float32).tiny))
    return out


def np_nvfp4_static(v: np.ndarray, stage: int, quant: QuantConfig) -> np.ndarray:
    """nvfp4 with a static scale a: global scale g = 1 / a; per block of 16 along K the e4m3 scale
    s = e4m3(amax(block) * (1 / 6) * g) and the codes e2m1(v * (g / s)) (zeros where s = 0); the
    values (e2m1 * s) * (1 / g)."""
    g = F32(1) / _static_scale(quant, stage)
    blocks = np.asarray(v, np.float32).reshape(-1, 16)
    s = np_e4m3_round(np.abs(blocks).max(-1, keepdims=True) * (F32(1) / F32(6)) * g).astype(np.float32)
    ratio = np.where(s > 0, g / np.where(s > 0, s, F32(1)), F32(0)).astype(np.float32)
    codes = np_e2m1_round(blocks * ratio)
    return (codes * s * (F32(1) / g)).reshape(v.shape).astype(np.float64)


def _static_scales(act: str, moe: Moe) -> dict:
    """Static activation scales as a checkpoint carries them, calibrated on this batch (a13 over x,
    a2 over the activation of every token through every expert) and 1.37 % larger, as from other
    data: a scale from bf16 values alone would put many products exactly on a rounding tie, which
    the backends' float32 arithmetic (XLA reassociates products) may round either way."""
    x = np.asarray(moe.x.astype(jnp.float32), np.float64)
    a = np_activation(np.einsum("th,enh->ten", x, np.asarray(moe.w13, np.float64)), moe.cfg.activation)
    if not a.size:  # no tokens to calibrate on
        return dict(a13_scale=jnp.float32(0.01), a2_scale=jnp.float32(0.01))
    return dict(a13_scale=calibrate_activation_scale(act, moe.x.astype(jnp.float32)) * 1.0137,
                a2_scale=calibrate_activation_scale(act, jnp.asarray(a, jnp.float32)) * 1.0137)


@dataclasses.dataclass(frozen=True)
class Scheme:
    """How a case's weights are stored and its activations quantized.

    ``quantize(moe)`` -> (w13, w2, quant or None) from the float32 layer; ``activations(row, stage,
    quant)``: the values the scheme's activation format gives a GEMM's input row (None: x's float
    dtype); ``tol``: the norm-relative bound against the float64 definition; ``align``: what H and
    I must be multiples of; ``nan_storable``: a NaN weight stays a NaN element (float and FP8; the
    4-bit formats turn it into a NaN block scale, which QuantConfig.validate refuses)."""

    dtype: str
    tol: float
    quantize: Callable[[Moe], tuple]
    activations: Callable[[np.ndarray, int, QuantConfig], np.ndarray] | None = None
    align: int = 1
    nan_storable: bool = True


def _float(moe: Moe) -> tuple:
    return moe.w13, moe.w2, None


SCHEMES = {
    "bf16": Scheme("bfloat16", 1e-2, _float),
    "f32": Scheme("float32", 1e-5, _float),
    # FP8 per-tensor activations with static scales (what every FP8 backend takes), per-expert weights
    "fp8": Scheme("bfloat16", 5e-2, lambda m: quantize_weights("fp8", m.w13, m.w2, act="fp8_per_tensor",
                                                               **_static_scales("fp8_per_tensor", m)),
                  np_fp8_static),
    "fp8_block": Scheme("bfloat16", 5e-2, lambda m: quantize_weights("fp8_block", m.w13, m.w2), np_fp8_groups),
    # W4A16: bf16 activations
    "mxfp4": Scheme("bfloat16", 2e-2, lambda m: quantize_weights("mxfp4", m.w13, m.w2), align=32,
                    nan_storable=False),
    # W4A4: a kernel's own arithmetic may move an E2M1 value across a tie, a whole step
    "nvfp4": Scheme("bfloat16", 0.1, lambda m: quantize_weights("nvfp4", m.w13, m.w2, **_static_scales("nvfp4", m)),
                    np_nvfp4_static, align=16, nan_storable=False),
}


def _runs(only: Callable[[str], bool] = lambda s: True) -> list:
    """(entry, scheme) parameters: ``gpu`` on GPU backends, ``slow`` on an entry's slow schemes."""
    out = []
    for entry in BACKENDS:
        for scheme in entry.schemes + entry.slow_schemes:
            if not only(scheme):
                continue
            marks = [pytest.mark.gpu] if entry.gpu else []
            if scheme in entry.slow_schemes:
                marks.append(pytest.mark.slow)
            out.append(pytest.param(entry, scheme, id=f"{entry.name}-{scheme}", marks=marks))
    return out


RUNS = _runs()

# ----------------------------------------------------------------------------- running a case


@dataclasses.dataclass
class Case:
    """A backend, a scheme and a random layer stored in that scheme."""

    entry: Entry
    scheme: Scheme
    moe: Moe  # float32 weights; x in the scheme's dtype
    w13: jax.Array  # as stored
    w2: jax.Array
    quant: QuantConfig | None

    @property
    def cfg(self) -> MoEConfig:
        return self.moe.cfg

    def call(self, x, topk_weights, topk_ids, w13=None, w2=None) -> jax.Array:
        """The backend on this case's weights (or ``w13``/``w2`` stored alike), jitted, with the
        device memory of the output's size filled with NaN bytes first."""
        w13 = self.w13 if w13 is None else w13
        w2 = self.w2 if w2 is None else w2
        name = self.entry.name
        if self.entry.prepared:
            mod = self.entry.module
            fn = jax.jit(mod.apply_prepared)
            args = (x, mod.prepare(w13, w2, self.cfg, self.quant), topk_weights, topk_ids)
        else:
            fn = jax.jit(lambda x, w13, w2, tw, ids, q: fused_experts(x, w13, w2, tw, ids, quant=q, backend=name))
            args = (x, w13, w2, topk_weights, topk_ids, self.quant)
        poison_memory(jax.eval_shape(fn, *args))
        return fn(*args)

    def expected(self, x, topk_weights, topk_ids) -> np.ndarray:
        """The float64 definition on the stored weights, the activations as the scheme quantizes them."""
        w13, w2 = dequantized(self.quant, self.w13, self.w2)
        act = self.scheme.activations
        return np_moe(np.asarray(jnp.asarray(x, jnp.float32)), w13, w2, topk_weights, topk_ids, self.cfg.activation,
                      quantize=None if act is None else (lambda v, stage: act(v, stage, self.quant)))

    def check(self, out, x, topk_weights, topk_ids) -> None:
        """out is [T, H] in x's dtype, finite, and within the scheme's bound of the definition."""
        assert (out.shape, out.dtype) == (x.shape, x.dtype)
        err = rel_err(out, self.expected(x, topk_weights, topk_ids))
        assert err < self.scheme.tol, f"relative error {err:.3g} >= {self.scheme.tol}"


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


@pytest.fixture
def case(rng, monkeypatch, request):
    """``case(entry, scheme, T, H, I, E, k, experts=None)``: a fresh random layer of H and I
    rounded up to the backend's and the scheme's alignment, stored in the scheme, routed to
    ``experts`` (default: all). Where the backend does not serve it: a GPU backend skips with its
    own reason, a CPU backend fails."""

    def make(entry: Entry, scheme_name: str, t: int, h: int, i: int, e: int, k: int, experts=None) -> Case:
        if entry.stand_in is not None and entry.stand_in(monkeypatch):
            why = entry.stand_in_xfail.get(request.node.originalname)
            if why:
                request.applymarker(pytest.mark.xfail(strict=True, reason=why))
        scheme = SCHEMES[scheme_name]
        align = math.lcm(entry.align, scheme.align)
        h, i = _aligned(h, align), _aligned(i, align)
        moe = random_moe(rng, t, e, k, h, i, x_dtype=getattr(jnp, scheme.dtype), experts=experts)
        w13, w2, quant = scheme.quantize(moe)
        if quant is None:
            w13, w2 = w13.astype(scheme.dtype), w2.astype(scheme.dtype)
        features = oracle.call_features(dtype=w13.dtype if quant is None else None)
        _, ok, why = oracle.probe(entry.name, moe.cfg, quant, features=features)
        if not ok:
            what = f"{entry.name} does not serve {scheme_name} at H={h}, I={i}, E={e}, k={k}: {why}"
            if entry.gpu:
                pytest.skip(what)
            pytest.fail(what)
        return Case(entry, scheme, moe, w13, w2, quant)

    return make


# (T, H, I, E, k) before alignment
SHAPES = [
    (1, 128, 128, 16, 4),  # one token (a decode step)
    (37, 64, 48, 16, 4),  # T a multiple of nothing
    (64, 128, 64, 64, 6),  # many experts, a few rows each
    (5, 64, 64, 256, 8),  # most experts receive no token
]
SHAPE_IDS = ["T{}-H{}-I{}-E{}-k{}".format(*s) for s in SHAPES]


# ----------------------------------------------------------------------------- the specifications


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("entry,scheme", RUNS)
def test_output_is_t_by_h_in_x_dtype(case, entry, scheme, shape):
    """The output has x's shape [T, H] and x's dtype, for every (T, H, I, E, k) (by abstract
    evaluation: nothing is compiled)."""
    c = case(entry, scheme, *shape)
    m = c.moe
    if entry.prepared:
        prepared = entry.module.prepare(c.w13, c.w2, c.cfg, c.quant)
        out = jax.eval_shape(entry.module.apply_prepared, m.x, prepared, m.topk_weights, m.topk_ids)
    else:
        out = jax.eval_shape(lambda *a: fused_experts(*a, quant=c.quant, backend=entry.name),
                             m.x, c.w13, c.w2, m.topk_weights, m.topk_ids)
    assert (out.shape, out.dtype) == (m.x.shape, m.x.dtype)


@pytest.mark.parametrize("shape", [SHAPES[1]] + [pytest.param(s, marks=pytest.mark.slow) for s in SHAPES[2:]],
                         ids=SHAPE_IDS[1:])
@pytest.mark.parametrize("entry,scheme", RUNS)
def test_output_is_the_weighted_sum_of_each_tokens_experts(case, entry, scheme, shape):
    """``out[t] = sum_j w[t, j] * W2[e] @ (silu(gate) * up)``, ``[gate; up] = W13[e] @ x[t]``,
    ``e = topk_ids[t, j]``: within the scheme's bound of the float64 definition, finite, [T, H]
    in x's dtype."""
    c = case(entry, scheme, *shape)
    m = c.moe
    c.check(c.call(m.x, m.topk_weights, m.topk_ids), m.x, m.topk_weights, m.topk_ids)


@pytest.mark.parametrize("entry,scheme", RUNS)
def test_a_single_token_is_the_weighted_sum_of_its_experts(case, entry, scheme):
    """T = 1 (a decode step): the token's k experts, weighted, as defined."""
    c = case(entry, scheme, *SHAPES[0])
    m = c.moe
    c.check(c.call(m.x, m.topk_weights, m.topk_ids), m.x, m.topk_weights, m.topk_ids)


@pytest.mark.parametrize("entry,scheme", RUNS)
def test_zero_tokens_give_an_empty_output(case, entry, scheme):
    """T = 0 is a valid batch, not an error: the output is [0, H] in x's dtype."""
    c = case(entry, scheme, 0, 64, 32, 8, 2)
    m = c.moe
    out = c.call(m.x, m.topk_weights, m.topk_ids)
    assert (out.shape, out.dtype) == ((0, m.x.shape[1]), m.x.dtype)


@pytest.mark.parametrize("entry,scheme", RUNS)
def test_experts_without_tokens_leave_every_row_as_defined(case, entry, scheme):
    """Tokens routed to 4 of 32 experts: the 28 experts without tokens add nothing, and every
    output row (written over NaN-filled memory) is finite and as defined."""
    c = case(entry, scheme, 24, 64, 32, 32, 2, experts=range(4))
    m = c.moe
    c.check(c.call(m.x, m.topk_weights, m.topk_ids), m.x, m.topk_weights, m.topk_ids)


@pytest.mark.parametrize("entry,scheme", RUNS)
def test_ids_of_minus_one_contribute_nothing(case, entry, scheme):
    """A slot whose id is -1 (its expert lives on another device, under expert parallelism) adds
    nothing to its token; a token whose slots are all -1 gets a zero row."""
    c = case(entry, scheme, 24, 64, 32, 8, 2)
    m = c.moe
    ids = np.array(m.topk_ids)
    ids[::3, 1] = -1
    ids[5] = -1
    out = c.call(m.x, m.topk_weights, jnp.asarray(ids))
    c.check(out, m.x, m.topk_weights, ids)
    assert not np.asarray(out[5], np.float32).any()


@pytest.mark.parametrize("entry,scheme", _runs(only=lambda s: SCHEMES[s].nan_storable))
def test_nan_in_an_expert_without_tokens_never_reaches_the_output(case, entry, scheme):
    """NaN (and, where the format holds one, inf) in the first, a middle and the last weight of
    both GEMMs of the experts no token routes to: every output row stays finite and as defined
    with clean weights."""
    c = case(entry, scheme, 24, 64, 32, 8, 2, experts=range(6))
    m = c.moe

    def bad(w, value):
        return jnp.asarray(poison_experts(np.asarray(w.astype(jnp.float32)), (6, 7), value), w.dtype)

    w13, w2 = bad(c.w13, np.nan), bad(c.w2, np.inf if c.quant is None else np.nan)  # E4M3 holds no inf
    c.check(c.call(m.x, m.topk_weights, m.topk_ids, w13=w13, w2=w2), m.x, m.topk_weights, m.topk_ids)


# ----------------------------------------------------------------------------- bad inputs


class KernelRan(Exception):
    """Raised by a backend whose entry point was replaced to show that it was reached."""


def _reached(*args, **kwargs):
    raise KernelRan


BAD_INPUTS = [  # (what, change to the arguments of a valid call, the argument the error names)
    ("x of rank 1", lambda a: a.update(x=a["x"][0]), r"\bx must have rank 2"),
    ("x of rank 3", lambda a: a.update(x=a["x"][None]), r"\bx must have rank 2"),
    ("w13 of rank 2", lambda a: a.update(w13=a["w13"][0]), r"w13 must have rank 3"),
    ("w2 of rank 2", lambda a: a.update(w2=a["w2"][0]), r"w2 must have rank 3"),
    ("topk_ids of rank 1", lambda a: a.update(topk_ids=a["topk_ids"][:, 0]), r"topk_ids must have rank 2"),
    ("x with another H", lambda a: a.update(x=jnp.concatenate([a["x"], a["x"][:, :16]], 1)),
     r"(w13|w2) must have shape|x \[T, H\] and w2 \[E, H, \.\.\.\] must have the same H"),
    ("w2 with another H", lambda a: a.update(w2=jnp.concatenate([a["w2"], a["w2"][:, :16]], 1)),
     r"w2 must have shape|x \[T, H\] and w2 \[E, H, \.\.\.\] must have the same H"),
    ("w2 with another I", lambda a: a.update(w2=a["w2"][:, :, :a["w2"].shape[2] // 2]), r"w2 must have shape"),
    ("w13 with an odd number of rows", lambda a: a.update(w13=a["w13"][:, 1:]), r"w13 must have an even number"),
    ("integer x", lambda a: a.update(x=a["x"].astype(jnp.int32)), r"\bx must have dtype"),
    ("w2 in another dtype", lambda a: a.update(w2=a["w2"].astype(jnp.float16)),
     r"w13 and w2 must have x's dtype|w2 must have dtype"),
    ("float topk_ids", lambda a: a.update(topk_ids=a["topk_ids"].astype(jnp.float32)), r"topk_ids must have dtype"),
    ("integer topk_weights", lambda a: a.update(topk_weights=a["topk_ids"]), r"topk_weights must have dtype"),
    ("topk_weights not [T, k]", lambda a: a.update(topk_weights=a["topk_weights"][:, :1]),
     r"topk_weights must have shape"),
    ("topk_ids of other tokens", lambda a: a.update(topk_ids=a["topk_ids"][:3], topk_weights=a["topk_weights"][:3]),
     r"topk_ids must have shape"),
    ("top_k > E", lambda a: a.update(topk_ids=jnp.zeros((a["x"].shape[0], 9), jnp.int32),
                                     topk_weights=jnp.ones((a["x"].shape[0], 9), jnp.float32)),
     r"top_k=9 must be <= num_experts=8"),
]


@pytest.mark.parametrize("what,change,names", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("entry,scheme", RUNS)
def test_bad_inputs_raise_naming_the_argument_before_any_kernel_runs(case, monkeypatch, entry, scheme, what, change,
                                                                     names):
    """A malformed call raises ValueError (or TypeError) naming the argument, before the backend
    is reached (its entry points are replaced by one that raises KernelRan: the valid call
    reaches it)."""
    c = case(entry, scheme, 6, 64, 32, 8, 2)
    for fn in ("apply", "prepare", "apply_prepared"):
        if hasattr(entry.module, fn):
            monkeypatch.setattr(entry.module, fn, _reached)
    args = dict(x=c.moe.x, w13=c.w13, w2=c.w2, topk_weights=c.moe.topk_weights, topk_ids=c.moe.topk_ids)

    def call(a):
        return fused_experts(a["x"], a["w13"], a["w2"], a["topk_weights"], a["topk_ids"], quant=c.quant,
                             backend=entry.name)

    with pytest.raises(KernelRan):
        call(args)
    change(args)
    with pytest.raises((ValueError, TypeError), match=names):
        call(args)
