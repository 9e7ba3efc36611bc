"""The contract between quantized formats and backends: :class:`QuantConfig`.

``fused_experts(x, w13, w2, ..., quant=QuantConfig(...))`` receives w13 [E, 2I, H] and
w2 [E, H, I] in their STORED form (I instead of 2I for non-gated activations; K = H for w13 and
K = I for w2 is always the last axis):

==========  =========================  ==================================  ========================  ==============
scheme      w13 / w2 stored            w*_scale                            w*_global_scale           act (default first)
==========  =========================  ==================================  ========================  ==============
fp8         [E, N, K] float8_e4m3fn    [] or [E] (per tensor / expert),    -                         fp8_per_tensor,
                                       or [E, N, 1] (per channel) float32                            fp8_per_token, bf16
fp8_block   [E, N, K] float8_e4m3fn    [E, ceil(N/bn), ceil(K/bk)] f32     -                         fp8_per_group, bf16
nvfp4       [E, N, K/2] uint8 (E2M1)   [E, N, K/16] float8_e4m3fn          [E] float32 (448*6/amax)  nvfp4, bf16
mxfp4       [E, N, K/2] uint8 (E2M1)   [E, N, K/32] uint8 (E8M0)           -                         bf16, mxfp8
w4a8        [E, N, K/2] uint8 (int4)   [E, N, K/g] float32 (g = 128)       -                         fp8_per_tensor,
                                                                                                     fp8_per_token
==========  =========================  ==================================  ========================  ==============

``block_shape`` is the weight block (rows along N, columns along K): (128, 128) for fp8_block
(configurable), (1, 16) nvfp4, (1, 32) mxfp4, (1, g) w4a8 with g = 128 by default, None for fp8.

Activations (``act``), as the kernels quantize the input of GEMM1 (stage 1) and of GEMM2
(stage 2, after the activation function); every ``a*_scale`` is a dequantization-side scale:

* ``bf16``: not quantized (the GEMM runs in the input's float dtype).
* ``fp8_per_tensor``: static ``a13_scale``/``a2_scale`` (``x ~= q * a_scale``), or, when None,
  dynamic: ``amax(x) * (1 / 448)`` over the tensor handed over.
* ``fp8_per_token``: dynamic, one scale per row.
* ``fp8_per_group``: dynamic 1 x ``block_shape[1]`` groups along K (DeepSeek FP8).
* ``mxfp8``: dynamic E4M3 elements with E8M0 scales per 32 along K.
* ``nvfp4``: E2M1 elements with e4m3 block-16 scales and global scale ``1 / a_scale`` (vLLM's
  ``input_scale`` convention, ``a_scale = amax / (448 * 6)``); when None, dynamic
  ``448 * 6 / amax(x)`` over the tensor handed over.

Static activation scales are [] or [E] float32. vLLM's FP8 and FlashInfer paths use one scale
for all experts (the max over experts); :func:`quantize_activation` does the same unless it is
given ``expert_ids`` to pick each row's expert's scale. "Dynamic per tensor" depends on which
rows are quantized together: the whole tensor passed in.

Non-finite values follow the rule of :mod:`jax_moe.quant`. Stored weights whose scales encode a
NaN (an NVFP4 block scale 0x7F, an MXFP4 byte 0xFF, a NaN w4a8 group scale: what quantizing
non-finite weights gives) are refused by :meth:`QuantConfig.validate` wherever the scales are
concrete, with a ValueError naming the scale; FP8 weights keep finite scales and carry a NaN
element instead, which reaches only the tokens routed to that expert.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.quant import fp4, fp8, int4

SCHEMES = ("fp8", "fp8_block", "nvfp4", "mxfp4", "w4a8")
ACTS = ("bf16", "fp8_per_tensor", "fp8_per_token", "fp8_per_group", "mxfp8", "nvfp4")
# allowed activation formats per scheme; the first is the default
SCHEME_ACTS: dict[str, tuple[str, ...]] = {
    "fp8": ("fp8_per_tensor", "fp8_per_token", "bf16"),
    "fp8_block": ("fp8_per_group", "bf16"),
    "nvfp4": ("nvfp4", "bf16"),
    "mxfp4": ("bf16", "mxfp8"),
    "w4a8": ("fp8_per_tensor", "fp8_per_token"),
}
DEFAULT_BLOCK_SHAPE: dict[str, tuple[int, int] | None] = {
    "fp8": None,
    "fp8_block": (128, 128),
    "nvfp4": (1, fp4.NVFP4_BLOCK),
    "mxfp4": (1, fp4.MX_BLOCK),
    "w4a8": (1, int4.INT4_GROUP),
}
# acts that may carry a static scale
STATIC_ACTS = ("fp8_per_tensor", "nvfp4")
_LEAVES = ("w13_scale", "w2_scale", "w13_global_scale", "w2_global_scale", "a13_scale", "a2_scale")

__all__ = [
    "SCHEMES",
    "ACTS",
    "SCHEME_ACTS",
    "DEFAULT_BLOCK_SHAPE",
    "QuantConfig",
    "dequantize_weights",
    "dequantize_experts",
    "quantize_activation",
    "nvfp4_activation_global_scale",
    "quantize_weights",
    "calibrate_activation_scale",
]


_NOT_GIVEN = type("NotGiven", (), {"__repr__": lambda self: "<not given>"})()  # scales left out of QuantConfig(...)


@dataclasses.dataclass(frozen=True, eq=False)
class QuantConfig:
    """How a backend reads quantized expert weights, and how it quantizes activations.

    A JAX pytree: the six scale arrays are leaves (None ones are empty subtrees); ``scheme``,
    ``act`` and ``block_shape`` are static aux data, so a QuantConfig can be passed to a jitted
    function as an argument. Shapes and dtypes per scheme: see :mod:`jax_moe.quant.scheme`.
    ``act=None`` / ``block_shape=None`` take the scheme's defaults.
    """

    scheme: str
    w13_scale: Any = dataclasses.field(default_factory=lambda: _NOT_GIVEN)
    w2_scale: Any = dataclasses.field(default_factory=lambda: _NOT_GIVEN)
    w13_global_scale: Any = None
    w2_global_scale: Any = None
    a13_scale: Any = None
    a2_scale: Any = None
    act: str | None = None
    block_shape: tuple[int, int] | None = None

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {self.scheme!r}")
        if self.w13_scale is _NOT_GIVEN or self.w2_scale is _NOT_GIVEN:
            raise ValueError(
                f"QuantConfig({self.scheme!r}) describes weights already quantized and needs their scales "
                f"(w13_scale, w2_scale). To quantize float weights use jax_moe.quantize_weights({self.scheme!r}, "
                f"w13, w2) -> (w13_q, w2_q, quant), or MoEBlock.quantize({self.scheme!r}); to load a quantized "
                f"checkpoint, MoEBlock.from_pretrained")
        allowed = SCHEME_ACTS[self.scheme]
        act = allowed[0] if self.act is None else self.act
        if act not in allowed:
            raise ValueError(f"act must be one of {list(allowed)} for scheme {self.scheme!r}, got {act!r}")
        object.__setattr__(self, "act", act)
        object.__setattr__(self, "block_shape", _resolve_block_shape(self.scheme, self.block_shape))

    # ---- pytree
    def _flatten_with_keys(self):
        children = tuple((jax.tree_util.GetAttrKey(n), getattr(self, n)) for n in _LEAVES)
        return children, (self.scheme, self.act, self.block_shape)

    @classmethod
    def _unflatten(cls, aux, children):
        obj = object.__new__(cls)  # no __post_init__: leaves may be tracers or placeholders
        for name, value in zip(_LEAVES, children):
            object.__setattr__(obj, name, value)
        for name, value in zip(("scheme", "act", "block_shape"), aux):
            object.__setattr__(obj, name, value)
        return obj

    def _flatten(self):
        return tuple(getattr(self, n) for n in _LEAVES), (self.scheme, self.act, self.block_shape)

    # ---- derived
    @property
    def group_size(self) -> int | None:
        """Elements per scale along K for the 1-row block formats (nvfp4, mxfp4, w4a8)."""
        if self.block_shape is None or self.scheme == "fp8_block":
            return None
        return self.block_shape[1]

    @property
    def weight_dtype(self):
        """dtype of the stored w13 / w2."""
        return jnp.float8_e4m3fn if self.scheme in ("fp8", "fp8_block") else jnp.uint8

    def packed(self) -> bool:
        """True when two 4-bit values share a byte along K (stored last axis is K/2)."""
        return self.scheme in ("nvfp4", "mxfp4", "w4a8")

    def replace(self, **changes) -> "QuantConfig":
        return dataclasses.replace(self, **changes)

    # ---- validation
    def validate(self, E: int, H: int, I: int, gated: bool, *, w13=None, w2=None) -> None:
        """Check every field (and the stored weights, when given) against a layer of E experts,
        hidden size H, intermediate size I. Raises ValueError naming the offending field.
        NaN/inf/non-positive scales are looked for only when the scales are concrete (not traced,
        and held by this process).
        """
        rows = 2 * I if gated else I
        for which, n, k in (("w13", rows, H), ("w2", H, I)):
            self._validate_weight(which, E, n, k, w13 if which == "w13" else w2)
        for name in ("a13_scale", "a2_scale"):
            s = getattr(self, name)
            if s is None:
                continue
            if self.act not in STATIC_ACTS:
                raise ValueError(f"{name} must be None for act={self.act!r} (dynamic only); "
                                 f"static scales exist for {list(STATIC_ACTS)}")
            _check_array(name, s, [(), (E,)], ("float32",), positive=True)
        if self.act == "mxfp8":
            for dim, k in (("H", H), ("I", I)):
                if k % fp4.MX_BLOCK:
                    raise ValueError(f"act='mxfp8' needs {dim}={k} to be a multiple of {fp4.MX_BLOCK}")
        if self.act == "nvfp4":
            for dim, k in (("H", H), ("I", I)):
                if k % fp4.NVFP4_BLOCK:
                    raise ValueError(f"act='nvfp4' needs {dim}={k} to be a multiple of {fp4.NVFP4_BLOCK}")

    def _validate_weight(self, which: str, E: int, n: int, k: int, w) -> None:
        scheme = self.scheme
        scale_name, gname = f"{which}_scale", f"{which}_global_scale"
        scale, gscale = getattr(self, scale_name), getattr(self, gname)
        kdim = "H" if which == "w13" else "I"
        if scheme in ("nvfp4", "mxfp4", "w4a8"):
            g = self.block_shape[1]
            if k % g:
                raise ValueError(f"{which}: scheme {scheme!r} needs K ({kdim}={k}) to be a multiple of "
                                 f"its block {g}")
        if scheme != "nvfp4" and gscale is not None:
            raise ValueError(f"{gname} must be None for scheme {scheme!r} (nvfp4 only)")
        if scale is None:
            raise ValueError(f"{scale_name} is required for scheme {scheme!r}")
        if scheme == "fp8":
            _check_array(scale_name, scale, [(), (E,), (E, n, 1)], ("float32",), positive=True)
            wshape, wdt = (E, n, k), "float8_e4m3fn"
        elif scheme == "fp8_block":
            bn, bk = self.block_shape
            _check_array(scale_name, scale, [(E, math.ceil(n / bn), math.ceil(k / bk))], ("float32",),
                         positive=True)
            wshape, wdt = (E, n, k), "float8_e4m3fn"
        elif scheme == "nvfp4":
            _check_array(scale_name, scale, [(E, n, k // fp4.NVFP4_BLOCK)], ("float8_e4m3fn",),
                         nonnegative=True)
            if gscale is None:
                raise ValueError(f"{gname} is required for scheme 'nvfp4' ([E] float32, 448*6/amax)")
            _check_array(gname, gscale, [(), (E,)], ("float32",), positive=True)
            wshape, wdt = (E, n, k // 2), "uint8"
        elif scheme == "mxfp4":
            _check_array(scale_name, scale, [(E, n, k // fp4.MX_BLOCK)], ("uint8",), e8m0=True)
            wshape, wdt = (E, n, k // 2), "uint8"
        else:  # w4a8
            g = self.block_shape[1]
            _check_array(scale_name, scale, [(E, n, k // g)], ("float32",), positive=True)
            wshape, wdt = (E, n, k // 2), "uint8"
        if w is not None:
            _check_array(which, w, [wshape], (wdt,))


def _resolve_block_shape(scheme: str, block_shape):
    default = DEFAULT_BLOCK_SHAPE[scheme]
    if block_shape is None:
        return default
    try:
        bs = tuple(int(b) for b in block_shape)
    except TypeError:
        raise ValueError(f"block_shape must be a (rows, cols) tuple of ints, got {block_shape!r}") from None
    if scheme == "fp8":
        raise ValueError(f"block_shape must be None for scheme 'fp8' (use 'fp8_block'), got {bs}")
    if len(bs) != 2 or any(b < 1 for b in bs):
        raise ValueError(f"block_shape must be two positive ints, got {bs}")
    if scheme in ("nvfp4", "mxfp4") and bs != default:
        raise ValueError(f"block_shape for scheme {scheme!r} is fixed at {default}, got {bs}")
    if scheme == "w4a8" and (bs[0] != 1 or bs[1] % 2):
        raise ValueError(f"block_shape for scheme 'w4a8' must be (1, g) with g even, got {bs}")
    return bs


jax.tree_util.register_pytree_with_keys(
    QuantConfig, QuantConfig._flatten_with_keys, QuantConfig._unflatten, QuantConfig._flatten
)


def _concrete(x):
    """x as a numpy array, or None when it cannot be inspected here: traced (abstract), or a
    global array with parts in other processes (multi-host; each process checks what it loads)."""
    if isinstance(x, jax.core.Tracer) or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return None
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check_array(name, x, shapes, dtypes, *, positive=False, nonnegative=False, e8m0=False) -> None:
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        x = np.float32(x)  # a Python number is a float32 scalar scale
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    shape = tuple(x.shape)
    if shape not in [tuple(s) for s in shapes]:
        want = " or ".join("[" + ", ".join(str(d) for d in s) + "]" for s in shapes)
        raise ValueError(f"{name} must have shape {want}, got {list(shape)}")
    dt = np.dtype(x.dtype).name
    if dt not in dtypes:
        raise ValueError(f"{name} must have dtype {' or '.join(dtypes)}, got {dt}")
    if not (positive or nonnegative or e8m0):
        return
    v = _concrete(x)
    if v is None:
        return
    if e8m0:
        if np.any(v == 255):
            raise ValueError(f"{name} holds 0xFF, the E8M0 NaN encoding")
        return
    _check_values(name, v.astype(np.float32), positive=positive, nonnegative=nonnegative)


def _check_values(name, v, *, positive=False, nonnegative=False) -> None:
    if not np.all(np.isfinite(v)):
        raise ValueError(f"{name} holds NaN or inf")
    if positive and not np.all(v > 0):
        raise ValueError(f"{name} must be positive, got a minimum of {v.min()}")
    if nonnegative and not np.all(v >= 0):
        raise ValueError(f"{name} must be >= 0, got a minimum of {v.min()}")


def check_finite_positive(name: str, s) -> None:
    """ValueError naming ``name`` if a concrete scale holds NaN, inf or a value <= 0 (a traced
    one is not checked here: it is checked where it was made)."""
    v = _concrete(s)
    if v is not None:
        _check_values(name, v.astype(np.float32), positive=True)


# ----------------------------------------------------------------------------- weights


def _dequant(quant: QuantConfig, w, scale, gscale, dtype):
    s = quant.scheme
    if s == "fp8":
        return fp8.dequantize_fp8(w, scale, dtype)
    if s == "fp8_block":
        return fp8.dequantize_fp8_block(w, scale, quant.block_shape, dtype)
    if s == "nvfp4":
        return fp4.dequantize_nvfp4(w, scale, gscale, dtype)
    if s == "mxfp4":
        return fp4.dequantize_mxfp4(w, scale, dtype)
    return int4.dequantize_int4(w, scale, quant.block_shape[1], dtype)


def dequantize_weights(quant: QuantConfig, w13, w2, dtype=jnp.float32):
    """Stored w13, w2 -> (w13 [E, 2I, H], w2 [E, H, I]) in ``dtype`` (rows I for non-gated)."""
    return (
        _dequant(quant, w13, quant.w13_scale, quant.w13_global_scale, dtype),
        _dequant(quant, w2, quant.w2_scale, quant.w2_global_scale, dtype),
    )


def dequantize_experts(quant: QuantConfig, which: str, w, expert_ids, dtype=jnp.float32):
    """Dequantize only some experts of one stored weight.

    which: "w13" or "w2"; w: that stored weight [E, N, K(packed)]; expert_ids: int array of any
    shape S (may be traced). Returns ``dequant(w)[expert_ids]``, shape S + [N, K], ``dtype``.
    """
    if which not in ("w13", "w2"):
        raise ValueError(f"which must be 'w13' or 'w2', got {which!r}")
    ids = jnp.asarray(expert_ids, jnp.int32)

    def take(a):
        if a is None or jnp.ndim(a) == 0:
            return a
        return jnp.asarray(a)[ids]

    scale = take(getattr(quant, f"{which}_scale"))
    gscale = take(getattr(quant, f"{which}_global_scale"))
    return _dequant(quant, jnp.asarray(w)[ids], scale, gscale, dtype)


# ----------------------------------------------------------------------------- activations


def _static_scale(s, x, expert_ids):
    """The static dequant scale for each row of x (indexes x's leading axes), or None."""
    if s is None:
        return None
    s = jnp.asarray(s, jnp.float32)
    if s.ndim == 0:
        return s
    if expert_ids is None:
        return jnp.max(s)  # one scale for all experts, as vLLM's FP8 / FlashInfer paths do
    ids = jnp.asarray(expert_ids, jnp.int32)
    if tuple(ids.shape) != tuple(x.shape[: ids.ndim]) or ids.ndim >= x.ndim:
        raise ValueError(f"expert_ids must have shape x.shape[:-1] or a prefix of it "
                         f"({list(x.shape[:-1])}), got {list(ids.shape)}")
    return s[ids]


def quantize_activation(quant: QuantConfig, x, stage: int, *, expert_ids=None):
    """Fake-quantize an activation as the kernel does: quantize, then dequantize, in float32.

    x [..., K] float (K = H for stage 1, the input of GEMM1, scaled by ``a13_scale``; K = I for
    stage 2, the input of GEMM2 after the activation function, scaled by ``a2_scale``).
    ``expert_ids`` (int, shape a prefix of x.shape[:-1]) picks each row's expert for [E] static
    scales; without it the max over experts is used. Returns [..., K] float32. ``act='bf16'``
    returns x unchanged (as float32).
    """
    if stage not in (1, 2):
        raise ValueError(f"stage must be 1 (GEMM1 input) or 2 (GEMM2 input), got {stage!r}")
    x = jnp.asarray(x, jnp.float32)
    act = quant.act
    if act == "bf16":
        return x
    static = _static_scale(quant.a13_scale if stage == 1 else quant.a2_scale, x, expert_ids)
    if act == "fp8_per_tensor":
        s = fp8.amax_to_scale(fp8.finite_absmax(x)) if static is None else static
        return fp8.dequantize_fp8(fp8.quantize_fp8_static(x, s), s)
    if act == "fp8_per_token":
        q, s = fp8.quantize_fp8_per_token(x)
        return fp8.dequantize_fp8(q, s)
    if act == "fp8_per_group":
        g = quant.block_shape[1]
        q, s = fp8.quantize_fp8_per_token_group(x, g)
        return fp8.dequantize_fp8_per_token_group(q, s, g)
    if act == "mxfp8":
        return fp4.dequantize_mxfp8(*fp4.quantize_mxfp8(x))
    if act == "nvfp4":
        gs = nvfp4_activation_global_scale(quant, stage, x, expert_ids=expert_ids)
        return fp4.dequantize_nvfp4(*fp4.quantize_nvfp4(x, gs))
    raise ValueError(f"act {act!r} is not known")  # unreachable: __post_init__ checks act


def nvfp4_activation_global_scale(quant: QuantConfig, stage: int, x=None, *, expert_ids=None):
    """The quantization-side global scale of NVFP4 activations (``act='nvfp4'``) at ``stage``
    (1: GEMM1's input, 2: GEMM2's): ``1 / a_scale`` for a static scale (an [E] scale's max over
    experts, or each row's expert's with ``expert_ids``, as :func:`quantize_activation`), else
    ``448 * 6 / amax(x)`` over the x handed over. float32 [] (or ``expert_ids``' shape)."""
    static = _static_scale(quant.a13_scale if stage == 1 else quant.a2_scale, x, expert_ids)
    if static is not None:
        return 1.0 / static
    if x is None:
        raise ValueError(f"stage {stage} has no static scale: the dynamic NVFP4 global scale needs x")
    return fp4.nvfp4_global_scale(x)


def calibrate_activation_scale(act: str, x, per_expert: bool = False):
    """A static (dequant-side) activation scale from a calibration batch: ``amax * (1 / 448)``
    for ``fp8_per_tensor``, ``amax * (1 / (448 * 6))`` for ``nvfp4`` (vLLM's ``input_scale``),
    the amax over finite values. x [...] -> [] float32, or x [E, ...] -> [E] with ``per_expert``."""
    x = jnp.asarray(x, jnp.float32)
    amax = fp8.finite_absmax(x.reshape(x.shape[0], -1), axis=1) if per_expert else fp8.finite_absmax(x)
    if act == "fp8_per_tensor":
        return fp8.amax_to_scale(amax)
    if act == "nvfp4":
        return fp8.amax_to_scale(amax, fp8.FP8_MAX * fp4.E2M1_MAX)
    raise ValueError(f"act must be 'fp8_per_tensor' or 'nvfp4' (the formats with static scales), got {act!r}")


# ----------------------------------------------------------------------------- building


def _opt_scale(name, v):
    if v is None:
        return None
    a = jnp.asarray(v, jnp.float32)
    if a.ndim > 1:
        raise ValueError(f"{name} must be a scalar or [E], got shape {list(a.shape)}")
    return a


def quantize_weights(scheme: str, w13, w2, **opts):
    """Quantize float weights w13 [E, 2I, H] and w2 [E, H, I] (gated, or [E, I, H] non-gated)
    into ``scheme``'s stored form. Returns (w13_q, w2_q, QuantConfig).

    Options: ``act``, ``a13_scale``, ``a2_scale`` (static activation scales, see
    :func:`calibrate_activation_scale`) for every scheme; ``weight_scale`` in
    {"per_expert" (default, [E]), "per_tensor" ([]), "per_channel" ([E, N, 1])} for fp8;
    ``block_shape`` (default (128, 128)) for fp8_block; ``group_size`` (default 128) for w4a8.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {list(SCHEMES)}, got {scheme!r}")
    opts = dict(opts)
    act = opts.pop("act", None)
    a13 = _opt_scale("a13_scale", opts.pop("a13_scale", None))
    a2 = _opt_scale("a2_scale", opts.pop("a2_scale", None))
    block_shape = None
    w13, w2 = jnp.asarray(w13), jnp.asarray(w2)  # float32 only a few experts at a time
    for name, w in (("w13", w13), ("w2", w2)):
        if w.ndim != 3:
            raise ValueError(f"{name} must have rank 3 [E, N, K], got shape {list(w.shape)}")
    g13 = g2 = None
    if scheme == "fp8":
        mode = opts.pop("weight_scale", "per_expert")
        fns = {"per_expert": fp8.quantize_fp8_per_expert, "per_tensor": fp8.quantize_fp8_per_tensor,
               "per_channel": fp8.quantize_fp8_per_channel}
        if mode not in fns:
            raise ValueError(f"weight_scale must be one of {list(fns)}, got {mode!r}")
        if mode == "per_tensor":  # one amax over every expert
            (q13, s13), (q2, s2) = fns[mode](w13.astype(jnp.float32)), fns[mode](w2.astype(jnp.float32))
        else:
            (q13, s13), (q2, s2) = _by_expert(fns[mode], w13), _by_expert(fns[mode], w2)
    elif scheme == "fp8_block":
        block_shape = tuple(opts.pop("block_shape", (128, 128)))
        fn = lambda w: fp8.quantize_fp8_block(w, block_shape)  # noqa: E731
        (q13, s13), (q2, s2) = _by_expert(fn, w13), _by_expert(fn, w2)
    elif scheme == "nvfp4":
        _check_k_all(scheme, w13, w2, fp4.NVFP4_BLOCK)

        def fn(w):
            g = fp4.nvfp4_global_scale(w, per_expert=True)
            q, sf, _ = fp4.quantize_nvfp4(w, g)
            return q, sf, g

        (q13, s13, g13), (q2, s2, g2) = _by_expert(fn, w13), _by_expert(fn, w2)
    elif scheme == "mxfp4":
        _check_k_all(scheme, w13, w2, fp4.MX_BLOCK)
        (q13, s13), (q2, s2) = _by_expert(fp4.quantize_mxfp4, w13), _by_expert(fp4.quantize_mxfp4, w2)
    else:  # w4a8
        g = int(opts.pop("group_size", int4.INT4_GROUP))
        block_shape = (1, g)
        _check_k_all(scheme, w13, w2, g)
        fn = lambda w: int4.quantize_int4(w, g)  # noqa: E731
        (q13, s13), (q2, s2) = _by_expert(fn, w13), _by_expert(fn, w2)
    if opts:
        raise ValueError(f"unknown option(s) for scheme {scheme!r}: {sorted(opts)}")
    cfg = QuantConfig(scheme, s13, s2, w13_global_scale=g13, w2_global_scale=g2, a13_scale=a13, a2_scale=a2,
                      act=act, block_shape=block_shape)
    return q13, q2, cfg


_CHUNK_BYTES = 1 << 30  # float32 bytes of weights quantized at once


def _by_expert(fn, w):
    """``fn`` (a per-expert quantizer: every output has a leading E axis) over slices of a few
    experts of ``w [E, N, K]``, each cast to float32 on its own, so that a large layer (DeepSeek-V3's
    w13 is 15 GB in bf16) never needs a whole float32 copy; outputs concatenated along E."""
    e = w.shape[0]
    per = max(1, _CHUNK_BYTES // max(1, 4 * (w.size // max(e, 1))))
    if per >= e:
        return fn(w.astype(jnp.float32))
    parts = [fn(w[s:s + per].astype(jnp.float32)) for s in range(0, e, per)]
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, 0), *parts)


def _check_k_all(scheme, w13, w2, block):
    for name, w, dim in (("w13", w13, "H"), ("w2", w2, "I")):
        if w.shape[-1] % block:
            raise ValueError(f"{name}: scheme {scheme!r} needs K ({dim}={w.shape[-1]}) to be a multiple of {block}")
