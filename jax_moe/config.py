"""The static description of one MoE layer, and the argument checks every entry point shares.

Weight orientation (vLLM's, used throughout jax_moe):
    w13 [E, 2I, H]  gate rows then up rows (``gate_up_layout="concat"``), or gate/up rows
                    alternating (``"interleaved"``: row 2i is gate i, row 2i+1 is up i, as
                    GPT-OSS checkpoints store them). Non-gated activations: w13 is [E, I, H].
    w2  [E, H, I]
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

# activation name -> gated (GEMM1 produces gate and up halves)
ACTIVATIONS: dict[str, bool] = {"silu": True, "gelu": True, "swigluoai": True, "relu2": False}
GATE_UP_LAYOUTS = ("concat", "interleaved")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Shapes and the expert function of one MoE layer.

    num_experts (E), top_k (k), hidden_size (H), intermediate_size (I, per expert, after the
    gate/up split): ints (numpy ints accepted, bools refused), >= 1. ``swiglu_alpha``/``swiglu_limit``
    are GPT-OSS's ``swigluoai`` constants: finite and > 0 (checked for every activation).
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: str = "silu"
    gate_up_layout: str = "concat"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # One expert-parallel shard's view: num_experts is the local count, top_k may exceed it,
    # and ids of experts owned elsewhere are -1.
    expert_shard: bool = False

    def __post_init__(self):
        # ints (numpy ints too, never bools) stored as Python ints; the swiglu constants finite and > 0
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size"):
            object.__setattr__(self, name, check_int(name, getattr(self, name)))
        for name in ("swiglu_alpha", "swiglu_limit"):
            object.__setattr__(self, name, check_positive_finite(name, getattr(self, name)))
        if self.top_k > self.num_experts and not self.expert_shard:
            raise ValueError(
                f"top_k={self.top_k} must be <= num_experts={self.num_experts}"
            )
        if self.activation not in ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}"
            )
        if self.gate_up_layout not in GATE_UP_LAYOUTS:
            raise ValueError(
                f"gate_up_layout must be one of {GATE_UP_LAYOUTS}, got {self.gate_up_layout!r}"
            )
        if self.gate_up_layout == "interleaved" and not self.gated:
            raise ValueError(f"gate_up_layout='interleaved' needs a gated activation, not {self.activation!r}")

    @property
    def gated(self) -> bool:
        return ACTIVATIONS[self.activation]

    @property
    def w13_rows(self) -> int:
        """Rows of w13 per expert: 2I for gated activations, I otherwise."""
        return 2 * self.intermediate_size if self.gated else self.intermediate_size


def as_jax(*arrays):
    """numpy arrays (and numpy leaves inside pytrees such as a QuantConfig) as jax arrays, the rest
    as it is (jax arrays, committed or not, sharded or not; None; Python scalars). A numpy weight
    indexed by a traced expert id inside a strategy's loop raises TracerArrayConversionError;
    converting once at the entry points lets every strategy, at every T, take numpy."""
    import jax

    def conv(a):
        return jax.numpy.asarray(a) if isinstance(a, (np.ndarray, np.generic)) else a

    out = tuple(jax.tree.map(conv, a) for a in arrays)
    return out if len(out) != 1 else out[0]


def check_int(name: str, v, minimum: int = 1) -> int:
    """``v`` as a Python int if it is an integer (Python or numpy, not a bool) ``>= minimum``, else
    ValueError naming ``name``."""
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {v!r} ({type(v).__name__})")
    if v < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {what}, got {v!r}")
    return int(v)


def check_positive_finite(name: str, v) -> float:
    """``v`` as a Python float if it is a real number (Python, numpy, or a concrete 0-d array; not
    a bool), finite and > 0, else ValueError naming ``name``."""
    import numbers

    is_real = isinstance(v, numbers.Real) or (hasattr(v, "dtype") and np.dtype(v.dtype).kind in "fiu")
    if isinstance(v, (bool, np.bool_)) or not is_real:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r} ({type(v).__name__})")
    try:
        f = float(v)
    except Exception:  # an array of several elements, a tracer
        raise ValueError(f"{name} must be a finite number > 0 (a concrete scalar), got {v!r}") from None
    if not np.isfinite(f) or f <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return f


def check_shape(name: str, x, shape: Sequence[int | None], what: str = "") -> None:
    """Raise ValueError unless ``x.shape`` matches ``shape`` (None matches any size)."""
    got = tuple(getattr(x, "shape", ()))
    ok = len(got) == len(shape) and all(s is None or s == g for s, g in zip(shape, got))
    if not ok:
        want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
        extra = f" ({what})" if what else ""
        raise ValueError(f"{name} must have shape {want}{extra}, got {list(got)}")


def check_rank(name: str, x, rank: int, what: str) -> None:
    """Raise ValueError unless ``x`` has rank ``rank`` (``what`` names the expected shape); a value
    that is not an array (a list, a scalar) is named as such."""
    if not hasattr(x, "ndim") or not hasattr(x, "shape"):
        raise ValueError(f"{name} must be an array of rank {rank} {what} (jax or numpy), got {type(x).__name__}")
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank} {what}, got shape {list(getattr(x, 'shape', ()))}")


def check_dtype(name: str, x, allowed: Sequence[str]) -> None:
    """Raise ValueError unless ``x.dtype`` is one of ``allowed`` (dtype names)."""
    dt = np.dtype(x.dtype).name
    if dt not in allowed:
        raise ValueError(f"{name} must have dtype in {list(allowed)}, got {dt}")
