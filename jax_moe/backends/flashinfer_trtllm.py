"""FlashInfer's TRT-LLM gen fused MoE (SM100: tcgen05 batched GEMMs from prebuilt cubins) as an XLA
FFI custom call -- ``backend="flashinfer_trtllm"``.

Built (``cmake/flashinfer_trtllm.cmake``) only when an SM100-family arch (``100a``, ``100f``,
``103a``) is among ``JAX_MOE_CUDA_ARCHS`` and FlashInfer's sources and its TRT-LLM gen cubin pack
headers are found; the kernels themselves are FlashInfer's cubins, read at run time from a
directory (:func:`cubin_root`: ``JAX_MOE_TRTLLM_CUBIN_DIR``, else ``FLASHINFER_CUBIN_DIR``, else
FlashInfer's cache ``~/.cache/flashinfer/cubins``). :func:`supports` checks, in order: the device
is SM100/SM103, the scheme is built, the module is compiled, the activation and shapes fit, and the
cubins the call needs are present (:func:`missing_cubins`).

Schemes with a handler (:data:`TARGETS`; ``ffi/flashinfer_trtllm_moe.cu``), routing done before
the call in both:

* ``fp8`` (vLLM's FP8 per-tensor W8A8, FlashInfer's ``trtllm_fp8_per_tensor_scale_moe``):
  activations quantized to float8_e4m3fn with the static per-tensor ``a13_scale``; FP8 weights
  with per-tensor or per-expert scales; GEMM1 with the gated activation (``silu``) fused and the
  result re-quantized to FP8 with ``1 / a2_scale``; GEMM2; the weighted top-k reduce -> bfloat16.
  Compiles and links for sm_100a against a stand-in cubin pack; never run on an SM100 GPU.
* ``mxfp4`` (GPT-OSS, seed 002) and ``nvfp4``: one target, ``jax_moe_trtllm_fp4_block_scale_moe``
  (FlashInfer's ``trtllm_fp4_block_scale_moe``), which tells NVFP4 x NVFP4, MXFP4 x BF16 and
  MXFP4 x MXFP8 apart by the operands' dtypes. The FP4 handler compiles for sm_100a against the
  stand-in pack (see the README for what was built and linked); it has never run.

  - ``mxfp4``: H and I padded to 256, w13 rows ``[up0, gate0, ...]``, ``shuffle_matrix_a`` on
    weights and biases, ``shuffle_matrix_sf_a`` on the E8M0 scales, float32 biases, swigluoai
    alpha/beta/limit per expert, BF16 or MXFP8 activations (:func:`prepare_mxfp4_weights`,
    :class:`Mxfp4Prepared`, :func:`tile_tokens_dim`); the result is sliced back to H.
  - ``nvfp4``: the same rows and shuffles with e4m3 block-16 scales, not padded; the epilogue
    scalars ``g1_alphas / a2``, ``g1_alphas``, ``g2_alphas`` (:func:`prepare_nvfp4_weights`,
    :class:`Nvfp4Prepared`); x quantized to NVFP4 with linear-layout scales.

* ``fp8_block`` (DeepSeek-V3; ``jax_moe_trtllm_fp8_block_scale_moe``, FlashInfer's
  ``trtllm_fp8_block_scale_moe`` with DeepSeek FP8 quantization): w13 ``[up; gate]``, weights
  row-shuffled with epilogue tile 64 and stored BlockMajorK, block scales only swapped
  (:func:`prepare_fp8_block_weights`, :class:`Fp8BlockPrepared`); x quantized to FP8 per token
  per 128 columns, scales handed over ``[H/128, T]``. Compiles for sm_100a against the stand-in
  pack; never run.

Every scheme's weight preparation is pure jnp, CPU-tested against the layouts as documented in
words; the shape rules are :func:`kernel_sizes`, :func:`input_shapes`, :func:`quantize_input`,
:func:`check_call`.

Weight layout (:func:`prepare`, once, at load time; seed 000, :mod:`jax_moe.layouts`): I is
zero-padded to :data:`jax_moe.layouts.FP8_INTERMEDIATE_ALIGN` (each gate/up half at its own end,
:func:`~jax_moe.layouts.pad_gate_up`; w2's columns likewise); w13 ``[gate; up]`` ->
``[up; gate]`` (:func:`~jax_moe.layouts.swap_w13_to_w31`) -> rows interleaved
(:func:`~jax_moe.layouts.reorder_rows_for_gated_act_gemm`) -> ``shuffle_matrix_a`` (epilogue tile
128); w2 -> ``shuffle_matrix_a``. The three per-expert epilogue scales come from
:func:`~jax_moe.layouts.trtllm_fp8_output_scales`.

The workspace (routing tables, permuted activations, GEMM outputs, the GEMMs' own scratch) is a
second ``uint8`` result of the call whose size the module computes at trace time
(:func:`workspace_size`); nothing is allocated inside the handler.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_moe.device import device_info
from jax_moe.ffi import register_module_targets
from jax_moe.layouts import (
    FP8_BLOCK_EPILOGUE_TILE_M,
    FP8_BLOCK_SCALE,
    SF_TILE_M,
    convert_from_block_layout,
    convert_to_block_layout,
    fp8_block_scale_shape,
    fp8_padded_intermediate,
    from_trtllm_gated_rows,
    mxfp4_padded_sizes,
    pad_axis,
    pad_gate_up,
    reorder_rows_for_gated_act_gemm,
    shuffle_matrix_a,
    shuffle_matrix_sf_a,
    swap_w13_to_w31,
    swap_w13_to_w31_block_scales,
    to_trtllm_gated_rows,
    trtllm_fp8_output_scales,
    trtllm_nvfp4_output_scales,
    unshuffle_matrix_a,
    unshuffle_matrix_sf_a,
)
from jax_moe.quant import fp4, fp8

NAME = "flashinfer_trtllm"
SMS = (100, 103)                      # compute capabilities the cubins run on (10.0, 10.3)
TARGETS = {"fp8": "jax_moe_trtllm_fp8_per_tensor_moe",
           "nvfp4": "jax_moe_trtllm_fp4_block_scale_moe",
           "mxfp4": "jax_moe_trtllm_fp4_block_scale_moe",
           "fp8_block": "jax_moe_trtllm_fp8_block_scale_moe"}
# the runner a (scheme, activation format) builds: ffi/trtllm_module.h's kScheme* (scheme_id())
SCHEME_IDS = {"fp8": 0, "nvfp4": 1, "mxfp4": 2, "mxfp4_mxfp8": 3, "fp8_block": 4}
# the FlashInfer entry point each scheme's handler wraps
KERNELS = {"fp8": "trtllm_fp8_per_tensor_scale_moe", "fp8_block": "trtllm_fp8_block_scale_moe",
           "nvfp4": "trtllm_fp4_block_scale_moe", "mxfp4": "trtllm_fp4_block_scale_moe"}
# jax_moe activation -> the runner's ActivationType (flashinfer/trtllm/fused_moe/runner.h)
ACTIVATION_CODES = {"silu": 3,        # Swiglu: silu(gate) * up, fused into GEMM1
                    "swigluoai": 3}   # the same Swiglu with per-expert alpha/beta/limit tensors (seed 002)
# the activations each scheme's preparation is written for (vLLM: silu; GPT-OSS MXFP4: swigluoai)
SCHEME_ACTIVATIONS = {"fp8": ("silu",), "fp8_block": ("silu",), "nvfp4": ("silu",),
                      "mxfp4": ("silu", "swigluoai")}
HIDDEN_ALIGN = 128                    # H: GEMM1's K tile and shuffle_matrix_a on w2's rows
# NVFP4 is not padded (vLLM's prepare_static_weights_for_trtllm_fp4_moe): w13's 2I scale rows
# must fill whole 128-row scale tiles (shuffle_matrix_sf_a), so I is a multiple of 64
NVFP4_INTERMEDIATE_ALIGN = SF_TILE_M // 2
MIN_EXPERTS_MULTIPLE = {"fp8_block": 4}  # vLLM's TrtLlmFp8Experts asserts E % 4 == 0 (block scale)
TILE_TOKENS_IMBALANCE = 1.3           # seed 002's _get_tile_tokens_dim
TILE_TOKENS_RANGE = (8, 64)
TILE_NS = (8, 16, 32, 64, 128)        # tokens per CTA tile the runner has kernels for
MAX_TILE_N_BF16_ACT = 64              # FP4 weights x bf16 activations: no tile-128 kernels
MXFP4_ACTS = ("bf16", "mxfp8")        # the activation formats trtllm_fp4_block_scale_moe takes for MXFP4
MAX_TOP_K = 32                        # the routing kernels' MaxSupportedTopExperts
MAX_EXPERTS = 512                     # the routing kernels' largest expert count (one block)
FEATURES = frozenset()                # no router weight on input; biases: MXFP4 only (prepare())
CUBIN_ENV = "JAX_MOE_TRTLLM_CUBIN_DIR"

_state = {"module": None, "error": None, "registered": False}


def _module():
    if _state["module"] is None and _state["error"] is None:
        try:
            from jax_moe import _jax_moe_trtllm as mod  # noqa: PLC0415

            _state["module"] = mod
        except ImportError as e:
            _state["error"] = (f"jax_moe._jax_moe_trtllm is not built (needs JAX_MOE_CUDA_ARCHS with 100a, "
                               f"FlashInfer's sources and its TRT-LLM gen cubin pack headers: "
                               f"cmake/flashinfer_trtllm.cmake): {e}")
    return _state["module"]


def compiled_schemes() -> tuple[str, ...]:
    """The schemes the native module serves (empty when it is not importable)."""
    mod = _module()
    return () if mod is None else tuple(mod.schemes())


def cubin_root() -> str:
    """The directory cubins are read from: ``JAX_MOE_TRTLLM_CUBIN_DIR``, else
    ``FLASHINFER_CUBIN_DIR``, else ``${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/cubins``
    (the rule of ``ffi/trtllm_cubin_dir.cc``)."""
    for var in (CUBIN_ENV, "FLASHINFER_CUBIN_DIR"):
        if os.environ.get(var):
            return os.environ[var]
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
    return os.path.join(base, ".cache", "flashinfer", "cubins")


def scheme_id(scheme: str, act: str | None = None) -> int:
    """The module's scheme id (:data:`SCHEME_IDS`) of a jax_moe scheme and its activation format:
    ``mxfp4`` names two runners, BF16 activations (act ``bf16``) and MXFP8 (act ``mxfp8``)."""
    if scheme == "mxfp4" and act == "mxfp8":
        return SCHEME_IDS["mxfp4_mxfp8"]
    if scheme not in TARGETS:
        raise ValueError(f"{NAME}: no handler for scheme {scheme!r} (have {', '.join(sorted(TARGETS))})")
    return SCHEME_IDS[scheme]


def _kernel_dims(cfg, scheme: str) -> tuple[int, int]:
    """(H, I) the kernel runs with for ``cfg`` (:func:`kernel_sizes` of the prepared layer)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    if scheme == "mxfp4":
        return mxfp4_padded_sizes(NAME, h, i)
    if scheme in ("nvfp4", "fp8_block"):
        return h, i
    return h, fp8_padded_intermediate(i)


def default_tile(scheme: str, num_tokens: int, top_k: int, num_experts: int) -> int:
    """Tokens per CTA tile when the caller gives none: :func:`tile_tokens_dim` (seed 002's rule for
    ``trtllm_fp4_block_scale_moe``, within [8, 64]) for the FP4 schemes, else
    :func:`default_tile_n`."""
    if scheme in ("nvfp4", "mxfp4"):
        return tile_tokens_dim(num_tokens, top_k, num_experts)
    return default_tile_n(num_tokens, top_k, num_experts)


def required_cubins(cfg=None, num_tokens: int = 0, scheme: str = "fp8", device: int = 0,
                    act: str | None = None):
    """``[(relative path, sha256)]`` of the cubins the runner of ``scheme`` (``act``: the
    activation format, for ``mxfp4``) may load: for ``num_tokens > 0`` the two kernels of that
    call's default tile and tactic, else every kernel of the scheme and activation."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    sid = scheme_id(scheme, act)
    code = ACTIVATION_CODES[getattr(cfg, "activation", "silu")]
    if num_tokens > 0:
        h, i = _kernel_dims(cfg, scheme)
        e, k = cfg.num_experts, cfg.top_k
        tile = default_tile(scheme, num_tokens, k, e)
        return list(mod.cubins(sid, code, tile, -1, num_tokens, h, i, e, k, device))
    return list(mod.cubins(sid, code, device=device))


def missing_cubins(cubins, root: str | None = None, verify: bool = False) -> list[str]:
    """The entries of ``cubins`` (``[(relative path, sha256)]``) absent under ``root`` (default
    :func:`cubin_root`), or with ``verify`` whose sha256 differs; full paths."""
    root = cubin_root() if root is None else root
    out = []
    for rel, sha in cubins:
        path = os.path.join(root, rel)
        if not os.path.isfile(path):
            out.append(path)
        elif verify and sha:
            with open(path, "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != sha:
                    out.append(path)
    return out


def _cubin_refusal(cfg=None, quant=None) -> str | None:
    """Why the cubins are not usable (None: every kernel of the runner of ``quant``'s scheme and
    ``cfg``'s activation is present; default: FP8, silu)."""
    scheme = "fp8" if quant is None else quant.scheme
    try:
        needed = required_cubins(cfg, scheme=scheme, act=getattr(quant, "act", None))
    except (RuntimeError, ValueError) as e:  # the runner throws when it has no kernel at all
        return f"cannot list the TRT-LLM gen cubins: {e}"
    missing = missing_cubins(needed)
    if missing:
        return (f"cubins not found in {cubin_root()} ({len(missing)} of {len(needed)} missing, e.g. "
                f"{os.path.relpath(missing[0], cubin_root())}; set {CUBIN_ENV}, or let FlashInfer fill its cache)")
    return None


def scheme_of(quant) -> str:
    return "bf16" if quant is None else quant.scheme


def _scheme_refusal(cfg, quant) -> str | None:
    """What the scheme's own contract refuses in (cfg, quant): activation format, static scales,
    block shape, the alignment its layout needs (None: nothing)."""
    scheme = scheme_of(quant)
    h, i = cfg.hidden_size, cfg.intermediate_size
    if scheme == "fp8":
        if quant.act != "fp8_per_tensor":
            return f"FP8 needs per-tensor activation scales (act='fp8_per_tensor'), not {quant.act!r}"
        if quant.a13_scale is None or quant.a2_scale is None:
            return "FP8 needs static a13_scale and a2_scale (the runner re-quantizes with them)"
        for name in ("w13_scale", "w2_scale"):
            if np.ndim(getattr(quant, name)) > 1:
                return f"{name} is per channel; the runner takes per-tensor or per-expert weight scales"
    elif scheme == "nvfp4":
        if quant.act != "nvfp4":
            return f"NVFP4 needs NVFP4 activations (act='nvfp4'), not {quant.act!r}"
        if quant.a13_scale is None or quant.a2_scale is None:
            return ("NVFP4 needs static a13_scale and a2_scale (output1_scale_scalar = "
                    "a13_scale * w13_scale_2 / a2_scale)")
        if i % NVFP4_INTERMEDIATE_ALIGN:
            return (f"intermediate size {i} must be a multiple of {NVFP4_INTERMEDIATE_ALIGN} (w13's 2I "
                    f"scale rows fill {SF_TILE_M}-row tiles; NVFP4 is not padded)")
    elif scheme == "mxfp4":
        if quant.act not in MXFP4_ACTS:
            return f"MXFP4 takes bf16 or MXFP8 activations (act in {list(MXFP4_ACTS)}), not {quant.act!r}"
        for dim, v in (("hidden", h), ("intermediate", i)):
            if v % fp4.MX_BLOCK:
                return f"{dim} size {v} must be a multiple of the MXFP4 scale block {fp4.MX_BLOCK}"
    elif scheme == "fp8_block":
        if quant.act != "fp8_per_group":
            return f"FP8 block scale needs per-token-group FP8 activations (act='fp8_per_group'), not {quant.act!r}"
        bs = tuple(getattr(quant, "block_shape", None) or (FP8_BLOCK_SCALE, FP8_BLOCK_SCALE))
        if bs != (FP8_BLOCK_SCALE, FP8_BLOCK_SCALE):
            return f"FP8 block scale needs {FP8_BLOCK_SCALE} x {FP8_BLOCK_SCALE} blocks, not {bs}"
        if i % FP8_BLOCK_SCALE:
            return f"intermediate size {i} must be a multiple of {FP8_BLOCK_SCALE} (FP8 block scales)"
    if cfg.activation not in SCHEME_ACTIVATIONS[scheme]:
        return f"activation {cfg.activation!r} is not wired up (have {list(SCHEME_ACTIVATIONS[scheme])})"
    if getattr(cfg, "gate_up_layout", "concat") != "concat" and scheme in ("fp8", "fp8_block"):
        return "gate_up_layout must be 'concat' ([gate; up] rows)"
    if scheme != "mxfp4" and h % HIDDEN_ALIGN:  # MXFP4 pads H (mxfp4_padded_sizes)
        return f"hidden size {h} must be a multiple of {HIDDEN_ALIGN}"
    if not 1 <= cfg.top_k <= min(MAX_TOP_K, cfg.num_experts):
        return f"top_k {cfg.top_k} must be in [1, min({MAX_TOP_K}, E)]"
    if cfg.num_experts > MAX_EXPERTS:
        return f"{cfg.num_experts} experts exceed the routing kernels' {MAX_EXPERTS}"
    mult = MIN_EXPERTS_MULTIPLE.get(scheme)
    if mult and cfg.num_experts % mult:
        return f"{cfg.num_experts} experts: {KERNELS[scheme]} needs a multiple of {mult}"
    return None


def _config_refusal(cfg, quant) -> str | None:
    """What in (cfg, quant) this build cannot serve, whatever the device (None: nothing): an
    unknown scheme, then the scheme's contract (:func:`_scheme_refusal`)."""
    scheme = scheme_of(quant)
    if scheme not in TARGETS:
        return f"does not serve scheme {scheme!r} (serves {', '.join(sorted(TARGETS))})"
    return _scheme_refusal(cfg, quant)


def supports(cfg, quant=None, device=None) -> tuple[bool, str]:
    """Whether this backend serves ``cfg`` with ``quant`` on ``device``, and why not: the
    hardware, then what this build has (scheme, module, activation, shapes), then the cubins."""
    dev = device_info(device)
    if dev.sm not in SMS:
        cc = "n/a" if dev.capability is None else f"{dev.capability[0]}.{dev.capability[1]}"
        return False, (f"needs SM100 (compute capability 10.x: B200/GB200/B300); this device is "
                       f"{dev.describe()} ({cc})")
    scheme = scheme_of(quant)
    if scheme not in TARGETS:
        return False, _config_refusal(cfg, quant)
    if _module() is None:
        return False, _state["error"]
    if scheme not in compiled_schemes():
        return False, (f"scheme {scheme!r}: this build of jax_moe._jax_moe_trtllm has no {TARGETS[scheme]} "
                       f"handler (it serves {', '.join(compiled_schemes()) or 'nothing'}); rebuild it")
    why = _config_refusal(cfg, quant)
    if why:
        return False, why
    why = _cubin_refusal(cfg, quant)
    if why:
        return False, why
    return True, f"FlashInfer TRT-LLM gen fused MoE (SM100; {', '.join(compiled_schemes())})"


def _register():
    register_module_targets(_state, _module())


# ----------------------------------------------------------------------------- load time


def prepare_fp8_weights(w13, w2):
    """FP8 weights ``w13 [E, 2I, H]`` (vLLM's ``[gate; up]``) and ``w2 [E, H, I]`` (float8_e4m3fn, or
    any float dtype, cast) -> the runner's ``(w13 [E, 2Ip, H], w2 [E, H, Ip])`` float8_e4m3fn,
    ``Ip = fp8_padded_intermediate(I)``: I zero-padded (gate/up halves each), w13 rows
    ``[up; gate]`` then interleaved then ``shuffle_matrix_a``; w2 ``shuffle_matrix_a``."""
    w13, w2 = jnp.asarray(w13), jnp.asarray(w2)
    if w13.ndim != 3 or w2.ndim != 3:
        raise ValueError(f"w13 must be [E, 2I, H] and w2 [E, H, I], got {list(w13.shape)} and {list(w2.shape)}")
    e, h, i = w2.shape
    if w13.shape != (e, 2 * i, h):
        raise ValueError(f"w13 must have shape {[e, 2 * i, h]} for w2 {list(w2.shape)}, got {list(w13.shape)}")
    if h % HIDDEN_ALIGN:
        raise ValueError(f"w2: hidden size {h} must be a multiple of {HIDDEN_ALIGN}")
    ip = fp8_padded_intermediate(i)
    w13 = pad_gate_up(w13.astype(jnp.float8_e4m3fn), ip)
    w2 = pad_axis(w2.astype(jnp.float8_e4m3fn), ip, -1)
    w13 = shuffle_matrix_a(reorder_rows_for_gated_act_gemm(swap_w13_to_w31(w13)))
    return w13, shuffle_matrix_a(w2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Prepared:
    """FP8 per-tensor weights in the runner's layout (a pytree; from :func:`prepare`).

    w13 float8_e4m3fn [E, 2Ip, H], w2 float8_e4m3fn [E, H, Ip] (:func:`prepare_fp8_weights`);
    float32 ``out1_scale [E]`` (``output1_scales_scalar``), ``out1_gate_scale [E]``,
    ``out2_scale [E]`` (:func:`jax_moe.layouts.trtllm_fp8_output_scales`); ``a13_scale []`` the
    static input scale x is quantized with; ``intermediate`` the unpadded I (static)."""

    w13: jax.Array
    w2: jax.Array
    out1_scale: jax.Array
    out1_gate_scale: jax.Array
    out2_scale: jax.Array
    a13_scale: jax.Array
    intermediate: int = dataclasses.field(default=0, metadata=dict(static=True))
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))
    scheme: str = dataclasses.field(default="fp8", metadata=dict(static=True))


def prepare(w13, w2, cfg, quant=None, *, w13_bias=None, w2_bias=None):
    """vLLM-layout experts (as ``fused_experts`` takes them) -> the runner's layout, once, at load
    time: :class:`Prepared` (``fp8``), :class:`Mxfp4Prepared`, :class:`Nvfp4Prepared` or
    :class:`Fp8BlockPrepared` by ``quant.scheme``. ValueError with the reason when the scheme's
    contract refuses (cfg, quant) (:func:`_scheme_refusal`), whether or not this build's module has
    the scheme's handler. Biases: MXFP4 only (``w13_bias [E, 2I]``, ``w2_bias [E, H]``)."""
    scheme = scheme_of(quant)
    if scheme not in TARGETS:
        raise ValueError(f"{NAME}: {_config_refusal(cfg, quant)}")
    if scheme != "mxfp4" and (w13_bias is not None or w2_bias is not None):
        raise ValueError(f"{NAME}: expert biases (w13_bias/w2_bias) are not supported yet for scheme {scheme!r}")
    why = _scheme_refusal(cfg, quant)
    if why:
        raise ValueError(f"{NAME}: {why}")
    if scheme == "mxfp4":
        return prepare_mxfp4(w13, w2, cfg, quant, w13_bias=w13_bias, w2_bias=w2_bias)
    if scheme == "nvfp4":
        return prepare_nvfp4(w13, w2, cfg, quant)
    if scheme == "fp8_block":
        return prepare_fp8_block(w13, w2, cfg, quant)
    e = jnp.shape(w13)[0]
    w13_scale = jnp.broadcast_to(jnp.asarray(quant.w13_scale, jnp.float32), (e,))
    w2_scale = jnp.broadcast_to(jnp.asarray(quant.w2_scale, jnp.float32), (e,))
    a13 = jnp.max(jnp.asarray(quant.a13_scale, jnp.float32))
    a2 = jnp.max(jnp.asarray(quant.a2_scale, jnp.float32))
    scales = trtllm_fp8_output_scales(w13_scale, a13, w2_scale, a2)
    w13p, w2p = prepare_fp8_weights(w13, w2)
    return Prepared(w13p, w2p, jnp.broadcast_to(scales.output1_scales_scalar, (e,)),
                    jnp.broadcast_to(scales.output1_scales_gate_scalar, (e,)),
                    jnp.broadcast_to(scales.output2_scales_scalar, (e,)), a13,
                    intermediate=int(jnp.shape(w2)[2]), activation=cfg.activation)


# ---------------------------------------------------- load time: the schemes without a handler yet


def _check_operand(name: str, a, dtype, shape) -> None:
    """ValueError naming ``name`` unless ``a`` has ``dtype`` (a tuple: any of them) and ``shape``."""
    dts = dtype if isinstance(dtype, tuple) else (dtype,)
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in dts] or tuple(a.shape) != tuple(shape):
        want = " or ".join(jnp.dtype(d).name for d in dts)
        raise ValueError(f"{name} must be {want} {list(shape)}, got {jnp.dtype(a.dtype).name} {list(a.shape)}")


def _fp4_dims(w2, packed_block: int, w2_name: str = "w2") -> tuple[int, int, int]:
    """(E, H, I) from a packed FP4 ``w2 [E, H, I/2]`` uint8; ValueError unless H and I are
    multiples of the scale block."""
    if w2.ndim != 3 or w2.dtype != jnp.uint8:
        raise ValueError(f"{w2_name} must be uint8 [E, H, I/2] (two E2M1 codes per byte), got "
                         f"{jnp.dtype(w2.dtype).name} {list(w2.shape)}")
    e, h, i2 = w2.shape
    for dim, v in (("hidden size H", h), ("intermediate size I", 2 * i2)):
        if v % packed_block:
            raise ValueError(f"{w2_name}: {dim} = {v} must be a multiple of the scale block {packed_block}")
    return e, h, 2 * i2


def prepare_mxfp4_weights(w13, w13_scale, w2, w2_scale, w13_bias=None, w2_bias=None, *,
                          gate_up_layout: str = "concat"):
    """MXFP4 (GPT-OSS) experts -> ``trtllm_fp4_block_scale_moe``'s operands (seed 002).

    In: ``w13 [E, 2I, H/2]`` uint8 (two E2M1 codes a byte, element 2k in the low nibble),
    ``w13_scale [E, 2I, H/32]`` uint8 E8M0, ``w2 [E, H, I/2]``, ``w2_scale [E, H, I/32]``, optional
    biases ``w13_bias [E, 2I]``, ``w2_bias [E, H]`` (bfloat16 or float32). w13's gate/up rows (and
    its scales' and bias's) are ``[gate; up]`` (``gate_up_layout="concat"``) or alternate
    ``gate0, up0, gate1, ...`` (``"interleaved"``, the GPT-OSS checkpoint).

    Out, with ``(Hp, Ip) = mxfp4_padded_sizes("flashinfer_trtllm", H, I)`` (both rounded up to 256):

    * GEMM1 rows in the runner's order: row ``2j`` holds up row j, row ``2j + 1`` gate row j
      (:func:`~jax_moe.layouts.to_trtllm_gated_rows`); rows ``2I .. 2Ip - 1`` are zero.
    * ``w13 [E, 2Ip, Hp/2]`` uint8: those rows, each row's bytes zero-extended to ``Hp/2``, then
      rows shuffled inside every block of 32 rows: output row ``32b + 8c + a`` is input row
      ``32b + 4a + c`` (``a < 8``, ``c < 4``; FlashInfer ``shuffle_matrix_a``, epilogue tile 128).
    * ``w13_scale [E, 2Ip, Hp/32]`` uint8: the scales through the same rows and zero padding
      (columns to ``Hp/32``) and the same row shuffle, then tiled: scale ``(m, k)`` lands at flat
      offset ``((m // 128) * (Hp/128) + k // 4) * 512 + (m % 32) * 16 + ((m % 128) // 32) * 4 + k % 4``
      of the expert's buffer (``shuffle_matrix_sf_a``), viewed as ``[2Ip, Hp/32]``.
    * ``w13_bias [E, 2Ip]`` float32: the same rows, zeros in the padding, the same row shuffle.
    * ``w2 [E, Hp, Ip/2]``, ``w2_scale [E, Hp, Ip/32]``, ``w2_bias [E, Hp]``: rows (H) zero-padded
      to Hp, bytes to ``Ip/2`` and scale columns to ``Ip/32``; the same row shuffle and tiling.

    Zero padding gives zero GEMM1 rows (a zero gate makes the activation 0) and zero GEMM2 rows.
    Returns ``(w13, w13_scale, w13_bias, w2, w2_scale, w2_bias)`` (biases None when not given).
    Inverse: :func:`restore_mxfp4_weights`.
    """
    w13, s13, w2, s2 = (jnp.asarray(a) for a in (w13, w13_scale, w2, w2_scale))
    e, h, i = _fp4_dims(w2, fp4.MX_BLOCK)
    _check_operand("w13", w13, jnp.uint8, (e, 2 * i, h // 2))
    _check_operand("w13_scale", s13, jnp.uint8, (e, 2 * i, h // fp4.MX_BLOCK))
    _check_operand("w2_scale", s2, jnp.uint8, (e, h, i // fp4.MX_BLOCK))
    hp, ip = mxfp4_padded_sizes(NAME, h, i)

    def rows(a, axis=-2):  # GEMM1 rows: runner order, zero pairs up to 2Ip
        return pad_axis(to_trtllm_gated_rows(a, gate_up_layout, axis), 2 * ip, axis)

    w13 = shuffle_matrix_a(pad_axis(rows(w13), hp // 2, -1))
    s13 = shuffle_matrix_sf_a(pad_axis(rows(s13), hp // fp4.MX_BLOCK, -1), as_2d=True)
    w2 = shuffle_matrix_a(pad_axis(pad_axis(w2, hp, -2), ip // 2, -1))
    s2 = shuffle_matrix_sf_a(pad_axis(pad_axis(s2, hp, -2), ip // fp4.MX_BLOCK, -1), as_2d=True)
    b13 = b2 = None
    if w13_bias is not None:
        b13 = jnp.asarray(w13_bias)
        _check_operand("w13_bias", b13, (jnp.bfloat16, jnp.float32), (e, 2 * i))
        b13 = shuffle_matrix_a(rows(b13.astype(jnp.float32), -1), axis=-1)
    if w2_bias is not None:
        b2 = jnp.asarray(w2_bias)
        _check_operand("w2_bias", b2, (jnp.bfloat16, jnp.float32), (e, h))
        b2 = shuffle_matrix_a(pad_axis(b2.astype(jnp.float32), hp, -1), axis=-1)
    return w13, s13, b13, w2, s2, b2


def restore_mxfp4_weights(prepared: "Mxfp4Prepared", gate_up_layout: str = "concat"):
    """Inverse of :func:`prepare_mxfp4_weights`: the stored ``(w13, w13_scale, w13_bias, w2,
    w2_scale, w2_bias)`` (biases float32, None when absent) in ``gate_up_layout``."""
    p = prepared
    h, i = p.hidden, p.intermediate
    e, n1, hp2 = p.w13.shape
    hp, ip = 2 * hp2, n1 // 2

    def rows(a, axis=-2):
        a = jax.lax.slice_in_dim(a, 0, 2 * i, axis=axis % a.ndim)
        return from_trtllm_gated_rows(a, gate_up_layout, axis)

    w13 = rows(unshuffle_matrix_a(p.w13))[..., : h // 2]
    s13 = rows(unshuffle_matrix_sf_a(p.w13_scale, n1, hp // fp4.MX_BLOCK, as_2d=True))[..., : h // fp4.MX_BLOCK]
    w2 = unshuffle_matrix_a(p.w2)[:, :h, : i // 2]
    s2 = unshuffle_matrix_sf_a(p.w2_scale, hp, ip // fp4.MX_BLOCK, as_2d=True)[:, :h, : i // fp4.MX_BLOCK]
    b13 = None if p.w13_bias is None else rows(unshuffle_matrix_a(p.w13_bias, axis=-1), -1)
    b2 = None if p.w2_bias is None else unshuffle_matrix_a(p.w2_bias, axis=-1)[:, :h]
    return w13, s13, b13, w2, s2, b2


def tile_tokens_dim(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Seed 002's tokens per CTA tile for ``trtllm_fp4_block_scale_moe``: the tokens an expert
    gets under a perfectly even routing, ``(T * k) // E``, times the imbalance factor 1.3
    (truncated to an int), rounded up to a power of two (1 for 0), clamped to [8, 64]."""
    for name, v, least in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1), ("num_experts", num_experts, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
            raise ValueError(f"{name} must be a {'non-negative' if least == 0 else 'positive'} int, got {v!r}")
    per_expert = int((num_tokens * top_k) // num_experts * TILE_TOKENS_IMBALANCE)
    pow2 = 1 if per_expert < 1 else 1 << (per_expert - 1).bit_length()
    lo, hi = TILE_TOKENS_RANGE
    return min(max(pow2, lo), hi)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Prepared:
    """MXFP4 (GPT-OSS) experts for ``trtllm_fp4_block_scale_moe`` (a pytree; from :func:`prepare`).

    ``w13 [E, 2Ip, Hp/2]``, ``w13_scale [E, 2Ip, Hp/32]``, ``w2 [E, Hp, Ip/2]``,
    ``w2_scale [E, Hp, Ip/32]`` uint8 (E2M1 pairs; E8M0 bytes, shuffled and 128x4-tiled) and
    float32 ``w13_bias [E, 2Ip]``, ``w2_bias [E, Hp]`` or None (:func:`prepare_mxfp4_weights`);
    ``swiglu_alpha``, ``swiglu_beta``, ``swiglu_limit`` float32 ``[E]`` (``gemm1_alpha``,
    ``gemm1_beta``, ``gemm1_clamp_limit``) for ``swigluoai``, None for ``silu``. Static: the
    unpadded ``hidden`` H and ``intermediate`` I, ``act`` the activation format the call feeds
    (``"bf16"``: x as is; ``"mxfp8"``: E4M3 with E8M0 block-32 scales, linear layout), the
    activation."""

    w13: jax.Array
    w13_scale: jax.Array
    w2: jax.Array
    w2_scale: jax.Array
    w13_bias: jax.Array | None = None
    w2_bias: jax.Array | None = None
    swiglu_alpha: jax.Array | None = None
    swiglu_beta: jax.Array | None = None
    swiglu_limit: jax.Array | None = None
    hidden: int = dataclasses.field(default=0, metadata=dict(static=True))
    intermediate: int = dataclasses.field(default=0, metadata=dict(static=True))
    act: str = dataclasses.field(default="bf16", metadata=dict(static=True))
    activation: str = dataclasses.field(default="swigluoai", metadata=dict(static=True))
    scheme: str = dataclasses.field(default="mxfp4", metadata=dict(static=True))


def prepare_mxfp4(w13, w2, cfg, quant, *, w13_bias=None, w2_bias=None) -> Mxfp4Prepared:
    """Stored MXFP4 experts (``quant``: an ``mxfp4`` QuantConfig, act ``bf16`` or ``mxfp8``) ->
    :class:`Mxfp4Prepared`; ``cfg.gate_up_layout`` says how w13's rows are stored. For
    ``swigluoai`` the per-expert alpha/beta/limit are ``cfg.swiglu_alpha``, 1, ``cfg.swiglu_limit``
    (GPT-OSS: 1.702, 1.0, 7.0)."""
    w13p, s13, b13, w2p, s2, b2 = prepare_mxfp4_weights(
        w13, quant.w13_scale, w2, quant.w2_scale, w13_bias, w2_bias, gate_up_layout=cfg.gate_up_layout)
    e = w13p.shape[0]
    consts = {}
    if cfg.activation == "swigluoai":
        consts = {name: jnp.full((e,), v, jnp.float32) for name, v in
                  (("swiglu_alpha", cfg.swiglu_alpha), ("swiglu_beta", 1.0), ("swiglu_limit", cfg.swiglu_limit))}
    return Mxfp4Prepared(w13p, s13, w2p, s2, b13, b2, **consts, hidden=int(jnp.shape(w2)[1]),
                         intermediate=2 * int(jnp.shape(w2)[2]), act=quant.act, activation=cfg.activation)


def prepare_nvfp4_weights(w13, w13_scale, w2, w2_scale, *, gate_up_layout: str = "concat"):
    """NVFP4 experts -> ``trtllm_fp4_block_scale_moe``'s weight operands (vLLM's
    ``prepare_static_weights_for_trtllm_fp4_moe`` after ``reorder_w1w3_to_w3w1``).

    In: ``w13 [E, 2I, H/2]`` uint8 (E2M1 pairs), ``w13_scale [E, 2I, H/16]`` float8_e4m3fn
    block-16 scales, ``w2 [E, H, I/2]``, ``w2_scale [E, H, I/16]``; w13's rows ``[gate; up]``
    (``"concat"``) or alternating (``"interleaved"``). H a multiple of 128 and I of 64; nothing is
    padded.

    Out ``(w13, w13_scale, w2, w2_scale)``, the same shapes and dtypes:

    * GEMM1 rows in the runner's order -- row ``2j`` is up row j, row ``2j + 1`` gate row j (vLLM
      swaps ``[w1; w3]`` to ``[w3; w1]``, then FlashInfer's gated-act interleave) -- for the
      weights and the scales alike;
    * weights: rows shuffled inside each block of 32: output row ``32b + 8c + a`` = input row
      ``32b + 4a + c`` (``shuffle_matrix_a``, epilogue tile 128);
    * scales: the same row shuffle, then the 128x4 tiling of :mod:`jax_moe.layouts.scales`
      (scale ``(m, k)`` at flat offset ``((m // 128) * (K/4) + k // 4) * 512 + (m % 32) * 16 +
      ((m % 128) // 32) * 4 + k % 4``, K = scale columns), viewed as ``[rows, K]``
      (``shuffle_matrix_sf_a`` with 16 elements per scale: the row map does not depend on it);
    * w2 and its scales: the same shuffle and tiling, rows H.

    Inverse: :func:`restore_nvfp4_weights`.
    """
    w13, s13, w2, s2 = (jnp.asarray(a) for a in (w13, w13_scale, w2, w2_scale))
    e, h, i = _fp4_dims(w2, fp4.NVFP4_BLOCK)
    if h % HIDDEN_ALIGN:
        raise ValueError(f"w2: hidden size {h} must be a multiple of {HIDDEN_ALIGN}")
    if i % NVFP4_INTERMEDIATE_ALIGN:
        raise ValueError(f"w2: intermediate size {i} must be a multiple of {NVFP4_INTERMEDIATE_ALIGN}")
    _check_operand("w13", w13, jnp.uint8, (e, 2 * i, h // 2))
    _check_operand("w13_scale", s13, jnp.float8_e4m3fn, (e, 2 * i, h // fp4.NVFP4_BLOCK))
    _check_operand("w2_scale", s2, jnp.float8_e4m3fn, (e, h, i // fp4.NVFP4_BLOCK))
    w13 = shuffle_matrix_a(to_trtllm_gated_rows(w13, gate_up_layout))
    s13 = shuffle_matrix_sf_a(to_trtllm_gated_rows(s13, gate_up_layout), as_2d=True)
    return w13, s13, shuffle_matrix_a(w2), shuffle_matrix_sf_a(s2, as_2d=True)


def restore_nvfp4_weights(w13, w13_scale, w2, w2_scale, *, gate_up_layout: str = "concat"):
    """Inverse of :func:`prepare_nvfp4_weights`."""
    e, n1, h2 = w13.shape
    h, i = 2 * h2, n1 // 2
    w13 = from_trtllm_gated_rows(unshuffle_matrix_a(w13), gate_up_layout)
    s13 = from_trtllm_gated_rows(unshuffle_matrix_sf_a(w13_scale, n1, h // fp4.NVFP4_BLOCK, as_2d=True),
                                 gate_up_layout)
    return (w13, s13, unshuffle_matrix_a(w2),
            unshuffle_matrix_sf_a(w2_scale, h, i // fp4.NVFP4_BLOCK, as_2d=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Nvfp4Prepared:
    """NVFP4 experts for ``trtllm_fp4_block_scale_moe`` (a pytree; from :func:`prepare`).

    ``w13 [E, 2I, H/2]``, ``w2 [E, H, I/2]`` uint8 and ``w13_scale [E, 2I, H/16]``,
    ``w2_scale [E, H, I/16]`` float8_e4m3fn (:func:`prepare_nvfp4_weights`); float32 ``[E]``
    ``out1_scale`` (``output1_scale_scalar = a13 * w13_scale_2 / a2``), ``out1_gate_scale``
    (``a13 * w13_scale_2``), ``out2_scale`` (``a2 * w2_scale_2``)
    (:func:`jax_moe.layouts.trtllm_nvfp4_output_scales`); ``a1_gscale []`` float32, the
    quantization-side global scale x is quantized to NVFP4 with (``1 / a13_scale``; E2M1 with
    e4m3 block-16 scales in the linear layout). ``a13``/``a2`` per expert collapse to their max."""

    w13: jax.Array
    w13_scale: jax.Array
    w2: jax.Array
    w2_scale: jax.Array
    out1_scale: jax.Array
    out1_gate_scale: jax.Array
    out2_scale: jax.Array
    a1_gscale: jax.Array
    intermediate: int = dataclasses.field(default=0, metadata=dict(static=True))
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))
    scheme: str = dataclasses.field(default="nvfp4", metadata=dict(static=True))


def prepare_nvfp4(w13, w2, cfg, quant) -> Nvfp4Prepared:
    """Stored NVFP4 experts (``quant``: an ``nvfp4`` QuantConfig with act ``nvfp4`` and static
    ``a13_scale``/``a2_scale``) -> :class:`Nvfp4Prepared`. jax_moe's ``w*_global_scale`` is the
    quantization-side ``448 * 6 / amax``; vLLM's ``weight_scale_2`` is its reciprocal."""
    w13p, s13, w2p, s2 = prepare_nvfp4_weights(w13, quant.w13_scale, w2, quant.w2_scale,
                                               gate_up_layout=cfg.gate_up_layout)
    e = w13p.shape[0]
    for name in ("w13_global_scale", "w2_global_scale"):
        if getattr(quant, name, None) is None:
            raise ValueError(f"{NAME}: NVFP4 needs {name} ([E] float32)")
    w13_s2 = jnp.broadcast_to(1.0 / jnp.asarray(quant.w13_global_scale, jnp.float32), (e,))
    w2_s2 = jnp.broadcast_to(1.0 / jnp.asarray(quant.w2_global_scale, jnp.float32), (e,))
    a13 = jnp.max(jnp.asarray(quant.a13_scale, jnp.float32))  # one scale for all experts, as vLLM
    a2 = jnp.max(jnp.asarray(quant.a2_scale, jnp.float32))
    sc = trtllm_nvfp4_output_scales(w13_s2, a13, w2_s2, a2)
    return Nvfp4Prepared(w13p, s13, w2p, s2, sc.output1_scales_scalar, sc.output1_scales_gate_scalar,
                         sc.output2_scales_scalar, jnp.float32(1.0) / a13,
                         intermediate=2 * int(jnp.shape(w2)[2]), activation=cfg.activation)


def prepare_fp8_block_weights(w13, w13_scale, w2, w2_scale):
    """DeepSeek FP8 block-scale experts -> ``trtllm_fp8_block_scale_moe``'s operands in its
    shuffled BlockMajorK layout (vLLM ``prepare_fp8_moe_layer_for_fi`` with ``is_trtllm``:
    ``swap_w13_to_w31`` then ``_shuffle_deepseek_fp8_moe_weights``; called with
    ``use_shuffled_weight=True, weight_layout=BlockMajorK``).

    In: ``w13 [E, 2I, H]`` float8_e4m3fn (``[gate; up]``), ``w13_scale [E, 2I/128, H/128]``
    float32, ``w2 [E, H, I]``, ``w2_scale [E, H/128, I/128]``; H and I multiples of 128.

    Out ``(w13, w13_scale, w2, w2_scale)``:

    * ``w13 [E, H/128, 2I, 128]`` float8_e4m3fn: rows ``[up; gate]`` (no row interleave for this
      kernel), then rows shuffled inside each block of 16 (epilogue tile 64): output row
      ``16b + 8c + a`` = input row ``16b + 2a + c`` (``a < 8``, ``c < 2``), then cut along H into
      chunks of 128 columns stored chunk-major: ``out[e, q, r, j] = shuffled[e, r, 128 q + j]``;
    * ``w13_scale [E, 2I/128, H/128]`` float32: scale row halves swapped (``[up; gate]``), not
      shuffled;
    * ``w2 [E, I/128, H, 128]``: the same shuffle and chunking of ``w2``; ``w2_scale`` as stored.

    The activations are FP8 with one float32 scale per token per 128 columns, handed over
    transposed as ``[H/128, T]``. Inverse: :func:`restore_fp8_block_weights`.
    """
    w13, s13, w2, s2 = (jnp.asarray(a) for a in (w13, w13_scale, w2, w2_scale))
    if w2.ndim != 3 or w2.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"w2 must be float8_e4m3fn [E, H, I], got {jnp.dtype(w2.dtype).name} {list(w2.shape)}")
    e, h, i = w2.shape
    hb, ib = fp8_block_scale_shape(h, i, "w2")
    _check_operand("w13", w13, jnp.float8_e4m3fn, (e, 2 * i, h))
    _check_operand("w13_scale", s13, jnp.float32, (e, 2 * ib, hb))
    _check_operand("w2_scale", s2, jnp.float32, (e, hb, ib))
    tile = FP8_BLOCK_EPILOGUE_TILE_M
    w13 = convert_to_block_layout(shuffle_matrix_a(swap_w13_to_w31(w13), tile))
    return w13, swap_w13_to_w31_block_scales(s13, i), convert_to_block_layout(shuffle_matrix_a(w2, tile)), s2


def restore_fp8_block_weights(w13, w13_scale, w2, w2_scale):
    """Inverse of :func:`prepare_fp8_block_weights`."""
    tile = FP8_BLOCK_EPILOGUE_TILE_M
    i = w13.shape[2] // 2
    w13 = swap_w13_to_w31(unshuffle_matrix_a(convert_from_block_layout(w13), tile))
    return (w13, swap_w13_to_w31_block_scales(w13_scale, i),
            unshuffle_matrix_a(convert_from_block_layout(w2), tile), w2_scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8BlockPrepared:
    """DeepSeek FP8 block-scale experts for ``trtllm_fp8_block_scale_moe`` (a pytree; from
    :func:`prepare`): ``w13 [E, H/128, 2I, 128]``, ``w2 [E, I/128, H, 128]`` float8_e4m3fn
    (shuffled, BlockMajorK), ``w13_scale [E, 2I/128, H/128]`` (``[up; gate]`` rows),
    ``w2_scale [E, H/128, I/128]`` float32 (:func:`prepare_fp8_block_weights`)."""

    w13: jax.Array
    w13_scale: jax.Array
    w2: jax.Array
    w2_scale: jax.Array
    intermediate: int = dataclasses.field(default=0, metadata=dict(static=True))
    activation: str = dataclasses.field(default="silu", metadata=dict(static=True))
    scheme: str = dataclasses.field(default="fp8_block", metadata=dict(static=True))


def prepare_fp8_block(w13, w2, cfg, quant) -> Fp8BlockPrepared:
    """Stored ``fp8_block`` experts (128 x 128 block scales, act ``fp8_per_group``) ->
    :class:`Fp8BlockPrepared`."""
    w13p, s13, w2p, s2 = prepare_fp8_block_weights(w13, quant.w13_scale, w2, quant.w2_scale)
    return Fp8BlockPrepared(w13p, s13, w2p, s2, intermediate=int(jnp.shape(w2)[2]), activation=cfg.activation)


# ----------------------------------------------------------------------------- per call


def default_tile_n(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Tokens per CTA tile: the smallest of :data:`TILE_NS` covering the average tokens per expert
    (the Python twin of the module's ``default_tile_n``, FlashInfer's ``selectDefaultTileN``)."""
    avg = num_tokens * top_k / max(num_experts, 1)
    return next((t for t in TILE_NS if t >= avg), TILE_NS[-1])


@functools.lru_cache(maxsize=None)
def workspace_size(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                   activation: str = "silu", tile_n: int = 8, config: int = -1, scheme: int = 0) -> int:
    """Bytes of the uint8 workspace result (asks the module; needs an SM100 device). ``hidden``,
    ``inter``: the kernel's sizes (:func:`kernel_sizes`); ``scheme``: :func:`scheme_id`."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return int(mod.workspace_size(num_tokens, hidden, inter, num_experts, top_k,
                                  ACTIVATION_CODES[activation], tile_n, config, scheme=scheme))


def output_shapes(num_tokens: int, hidden: int, workspace_bytes: int):
    """The call's results: ``out`` bfloat16 [T, H] and the workspace uint8 [bytes] (the shape rule;
    ``hidden`` is the kernel's H: padded for MXFP4, :func:`kernel_sizes`)."""
    return (jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16),
            jax.ShapeDtypeStruct((max(1, workspace_bytes),), jnp.uint8))


PREPARED_TYPES = (Prepared, Mxfp4Prepared, Nvfp4Prepared, Fp8BlockPrepared)


def kernel_sizes(prepared) -> tuple[int, int, int, int]:
    """``(E, H, Hk, Ik)`` of a prepared layer: experts, the model's hidden size (x's width), and
    the hidden and intermediate sizes the kernel runs with (MXFP4: padded; else H, I or Ip)."""
    if isinstance(prepared, Prepared):
        return prepared.w13.shape[0], prepared.w13.shape[2], prepared.w13.shape[2], prepared.w2.shape[2]
    if isinstance(prepared, Mxfp4Prepared):
        return prepared.w13.shape[0], prepared.hidden, prepared.w2.shape[1], prepared.w13.shape[1] // 2
    if isinstance(prepared, Nvfp4Prepared):
        return prepared.w13.shape[0], prepared.w2.shape[1], prepared.w2.shape[1], prepared.w13.shape[1] // 2
    if isinstance(prepared, Fp8BlockPrepared):  # BlockMajorK: w2 [E, I/128, H, 128], w13 [E, H/128, 2I, 128]
        return prepared.w13.shape[0], prepared.w2.shape[2], prepared.w2.shape[2], prepared.w13.shape[2] // 2
    raise ValueError(f"prepared must be one of {NAME}'s {', '.join(c.__name__ for c in PREPARED_TYPES)} "
                     f"(from prepare()), got {type(prepared).__name__}")


def input_shapes(prepared, num_tokens: int) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The activation operands the call takes for ``num_tokens`` rows (:func:`quantize_input`'s
    results): ``fp8`` e4m3 [T, H]; ``fp8_block`` e4m3 [T, H] and float32 scales [H/128, T];
    ``nvfp4`` uint8 [T, H/2] and e4m3 block-16 scales [T, H/16]; ``mxfp4`` bf16 [T, Hp], or with
    act ``mxfp8`` e4m3 [T, Hp] and uint8 E8M0 scales [T, Hp/32] (scales in the linear layout)."""
    _, _, hk, _ = kernel_sizes(prepared)
    t = num_tokens
    sds = jax.ShapeDtypeStruct
    if isinstance(prepared, Prepared):
        return (sds((t, hk), jnp.float8_e4m3fn),)
    if isinstance(prepared, Fp8BlockPrepared):
        return (sds((t, hk), jnp.float8_e4m3fn), sds((hk // FP8_BLOCK_SCALE, t), jnp.float32))
    if isinstance(prepared, Nvfp4Prepared):
        return (sds((t, hk // 2), jnp.uint8), sds((t, hk // fp4.NVFP4_BLOCK), jnp.float8_e4m3fn))
    if prepared.act == "mxfp8":
        return (sds((t, hk), jnp.float8_e4m3fn), sds((t, hk // fp4.MX_BLOCK), jnp.uint8))
    return (sds((t, hk), jnp.bfloat16),)


def quantize_input(x, prepared) -> tuple[jax.Array, ...]:
    """x [T, H] float -> the activation operands of :func:`input_shapes`: ``fp8`` static per-tensor
    FP8 (``a13_scale``); ``fp8_block`` FP8 per token per 128 columns, scales transposed to
    ``[H/128, T]``; ``nvfp4`` NVFP4 with the global scale ``a1_gscale``; ``mxfp4`` x zero-padded to
    Hp, as bf16 or MXFP8."""
    _, _, hk, _ = kernel_sizes(prepared)
    x = jnp.asarray(x)
    if isinstance(prepared, Prepared):
        return (fp8.quantize_fp8_static(x.astype(jnp.float32), prepared.a13_scale),)
    if isinstance(prepared, Fp8BlockPrepared):
        q, sc = fp8.quantize_fp8_per_token_group(x.astype(jnp.float32), FP8_BLOCK_SCALE)
        return q, sc.T
    if isinstance(prepared, Nvfp4Prepared):
        q, sf, _ = fp4.quantize_nvfp4(x.astype(jnp.float32), prepared.a1_gscale)
        return q, sf
    xp = pad_axis(x, hk, -1)
    if prepared.act == "mxfp8":
        return fp4.quantize_mxfp8(xp.astype(jnp.float32))
    return (xp.astype(jnp.bfloat16),)


def check_call(x, prepared, topk_weights, topk_ids, tile_n=None):
    """ValueErrors naming the argument, before anything is lowered. Returns (T, H, Ip, E, k)
    with H, Ip the kernel's sizes (:func:`kernel_sizes`)."""
    if not isinstance(prepared, PREPARED_TYPES):
        raise ValueError(f"prepared must be a {NAME}.Prepared (from prepare()), got {type(prepared).__name__}")
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x must be [T, H], got shape {list(getattr(x, 'shape', ()))}")
    t, h = x.shape
    if isinstance(prepared, Prepared):
        e, n1, hw = prepared.w13.shape
        ip = prepared.w2.shape[2]
        if hw != h or prepared.w2.shape[:2] != (e, h) or n1 != 2 * ip:
            raise ValueError(f"x [T, {h}] does not match prepared w13 {list(prepared.w13.shape)} / "
                             f"w2 {list(prepared.w2.shape)}")
    else:
        e, hm, h, ip = kernel_sizes(prepared)
        if x.shape[1] != hm:
            raise ValueError(f"x [T, {x.shape[1]}] does not match prepared {prepared.scheme} weights of hidden "
                             f"size {hm} (w13 {list(prepared.w13.shape)} / w2 {list(prepared.w2.shape)})")
    if getattr(topk_ids, "ndim", None) != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk_ids must be [T={t}, k], got shape {list(getattr(topk_ids, 'shape', ()))}")
    if jnp.dtype(topk_ids.dtype) != jnp.int32:
        raise ValueError(f"topk_ids must be int32, got {jnp.dtype(topk_ids.dtype).name}")
    if getattr(topk_weights, "shape", None) != topk_ids.shape:
        raise ValueError(f"topk_weights must have topk_ids' shape {list(topk_ids.shape)}, "
                         f"got {list(getattr(topk_weights, 'shape', ()))}")
    k = topk_ids.shape[1]
    if not 1 <= k <= min(MAX_TOP_K, e):
        raise ValueError(f"topk_ids: top_k {k} must be in [1, min({MAX_TOP_K}, E={e})]")
    if tile_n is not None and tile_n not in TILE_NS:
        raise ValueError(f"tile_n must be one of {TILE_NS}, got {tile_n!r}")
    if tile_n is not None and tile_n > MAX_TILE_N_BF16_ACT and isinstance(prepared, Mxfp4Prepared) \
            and prepared.act == "bf16":
        raise ValueError(f"tile_n must be at most {MAX_TILE_N_BF16_ACT} for MXFP4 with bf16 activations, "
                         f"got {tile_n}")
    return t, h, ip, e, k


def apply_prepared(x, prepared: Prepared, topk_weights, topk_ids, *, tile_n: int | None = None,
                   config: int = -1):
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on the TRT-LLM gen runner.

    x [T, H] float, quantized here (:func:`quantize_input`: FP8 with ``prepared.a13_scale``; FP8
    per token per 128 columns; NVFP4 with ``a1_gscale``; for MXFP4 zero-padded to Hp, as bf16 or
    MXFP8); topk_weights [T, k] float;
    topk_ids [T, k] int32 in [0, E); ``prepared``: any of :data:`PREPARED_TYPES`. ``tile_n``: tokens per CTA tile (default :func:`default_tile`);
    ``config``: the runner's config index (-1: its default). -> bf16 [T, H].
    """
    t, h, ip, e, k = check_call(x, prepared, topk_weights, topk_ids, tile_n)
    tile_n = default_tile(prepared.scheme, t, k, e) if tile_n is None else tile_n
    sid = scheme_id(prepared.scheme, getattr(prepared, "act", None))
    _register()
    ws = workspace_size(t, h, ip, e, k, prepared.activation, tile_n, config, sid)
    attrs = dict(activation=np.int64(ACTIVATION_CODES[prepared.activation]), tile_n=np.int64(tile_n),
                 config=np.int64(config), enable_pdl=True)
    ids, w = topk_ids, topk_weights.astype(jnp.float32)
    xs = quantize_input(x, prepared)
    if isinstance(prepared, Prepared):
        out, _ = jax.ffi.ffi_call(TARGETS["fp8"], output_shapes(t, h, ws))(
            xs[0], ids, w, prepared.w13, prepared.w2, prepared.out1_scale, prepared.out1_gate_scale,
            prepared.out2_scale, **attrs)
        return out
    if isinstance(prepared, Fp8BlockPrepared):
        out, _ = jax.ffi.ffi_call(TARGETS["fp8_block"], output_shapes(t, h, ws))(
            xs[0], xs[1], ids, w, prepared.w13, prepared.w13_scale, prepared.w2, prepared.w2_scale, **attrs)
        return out
    absent = jnp.zeros((0,), jnp.float32)  # the handler's "not given" for an optional operand
    opt = lambda a: absent if a is None else a  # noqa: E731
    x_scale = xs[1] if len(xs) > 1 else jnp.zeros((0,), jnp.uint8)
    p = prepared
    if isinstance(p, Nvfp4Prepared):
        extra = (absent, absent, absent, absent, p.w2, p.w2_scale, absent,
                 p.out1_scale, p.out1_gate_scale, p.out2_scale)
    else:
        extra = (opt(p.w13_bias), opt(p.swiglu_alpha), opt(p.swiglu_beta), opt(p.swiglu_limit),
                 p.w2, p.w2_scale, opt(p.w2_bias), absent, absent, absent)
    out, _ = jax.ffi.ffi_call(TARGETS[p.scheme], output_shapes(t, h, ws))(
        xs[0], x_scale, ids, w, p.w13, p.w13_scale, *extra, **attrs)
    return out[:, : kernel_sizes(p)[1]]  # MXFP4: the padded columns of Hp dropped


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input: bool = False):
    """The oracle's entry point (``fused_experts(..., backend="flashinfer_trtllm")``): repacks the
    weights on every call; prepare once (:func:`prepare`) and call :func:`apply_prepared` instead."""
    if apply_router_weight_on_input:
        raise ValueError(f"{NAME}: apply_router_weight_on_input is not supported yet")
    prepared = prepare(w13, w2, cfg, quant, w13_bias=w13_bias, w2_bias=w2_bias)
    return apply_prepared(x, prepared, topk_weights, topk_ids).astype(x.dtype)
