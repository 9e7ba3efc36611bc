"""FlashInfer's TRT-LLM gen fused MoE (SM100: tcgen05 batched GEMMs from prebuilt cubins) as an XLA
FFI custom call -- ``backend="flashinfer_trtllm"``.

Built (``cmake/flashinfer_trtllm.cmake``) only when an SM100-family arch (``100a``, ``100f``,
``103a``) is among ``JAX_MOE_CUDA_ARCHS`` and FlashInfer's sources and its TRT-LLM gen cubin pack
headers are found; the kernels themselves are FlashInfer's cubins, read at run time from a
directory (:func:`cubin_root`: ``JAX_MOE_TRTLLM_CUBIN_DIR``, else ``FLASHINFER_CUBIN_DIR``, else
FlashInfer's cache ``~/.cache/flashinfer/cubins``). :func:`supports` checks, in order: the device
is SM100/SM103, the scheme is built, the module is compiled, the activation and shapes fit, and the
cubins the call needs are present (:func:`missing_cubins`).

Scheme of this build: ``fp8`` (vLLM's FP8 per-tensor W8A8, FlashInfer's
``trtllm_fp8_per_tensor_scale_moe`` with routing done before the call): activations quantized to
float8_e4m3fn with the static per-tensor ``a13_scale``; FP8 weights with per-tensor or per-expert
scales; GEMM1 with the gated activation (``silu``) fused and the result re-quantized to FP8 with
``1 / a2_scale``; GEMM2; the weighted top-k reduce -> bfloat16. FP8 block scale, NVFP4 and
MXFP4 are planned (:data:`PLANNED`), not built.

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
    fp8_padded_intermediate,
    pad_axis,
    pad_gate_up,
    reorder_rows_for_gated_act_gemm,
    shuffle_matrix_a,
    swap_w13_to_w31,
    trtllm_fp8_output_scales,
)
from jax_moe.quant import fp8

NAME = "flashinfer_trtllm"
SMS = (100, 103)                      # compute capabilities the cubins run on (10.0, 10.3)
TARGETS = {"fp8": "jax_moe_trtllm_fp8_per_tensor_moe"}
SCHEME_IDS = {"fp8": 0}               # ffi/trtllm_module.h
PLANNED = ("fp8_block", "nvfp4", "mxfp4")  # vLLM's TRT-LLM rows not built yet
# jax_moe activation -> the runner's ActivationType (flashinfer/trtllm/fused_moe/runner.h)
ACTIVATION_CODES = {"silu": 3}        # Swiglu: silu(gate) * up, fused into GEMM1
HIDDEN_ALIGN = 128                    # H: GEMM1's K tile and shuffle_matrix_a on w2's rows
TILE_NS = (8, 16, 32, 64, 128)        # tokens per CTA tile the runner has kernels for
MAX_TOP_K = 32                        # the routing kernels' MaxSupportedTopExperts
MAX_EXPERTS = 512                     # the routing kernels' largest expert count (one block)
FEATURES = frozenset()                # no biases, no router weight on input yet
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


def required_cubins(cfg=None, num_tokens: int = 0, scheme: str = "fp8", device: int = 0):
    """``[(relative path, sha256)]`` of the cubins the runner may load: for ``num_tokens > 0`` the
    two kernels of that call's default tactic, else every kernel of the scheme and activation."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    act = ACTIVATION_CODES[getattr(cfg, "activation", "silu")]
    if num_tokens > 0:
        h, i = cfg.hidden_size, fp8_padded_intermediate(cfg.intermediate_size)
        e, k = cfg.num_experts, cfg.top_k
        return list(mod.cubins(SCHEME_IDS[scheme], act, -1, -1, num_tokens, h, i, e, k, device))
    return list(mod.cubins(SCHEME_IDS[scheme], act, device=device))


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


def _cubin_refusal() -> str | None:
    """Why the cubins are not usable (None: every kernel of the compiled scheme is present)."""
    try:
        needed = required_cubins()
    except (RuntimeError, ValueError) as e:  # the runner throws when it has no kernel at all
        return f"cannot list the TRT-LLM gen cubins: {e}"
    missing = missing_cubins(needed)
    if missing:
        return (f"cubins not found in {cubin_root()} ({len(missing)} of {len(needed)} missing, e.g. "
                f"{os.path.relpath(missing[0], cubin_root())}; set {CUBIN_ENV}, or let FlashInfer fill its cache)")
    return None


def scheme_of(quant) -> str:
    return "bf16" if quant is None else quant.scheme


def _config_refusal(cfg, quant) -> str | None:
    """What in (cfg, quant) this build cannot serve, whatever the device (None: nothing)."""
    scheme = scheme_of(quant)
    if scheme not in TARGETS:
        built = ", ".join(sorted(TARGETS))
        if scheme in PLANNED:
            return f"scheme {scheme!r} is not built yet (have {built})"
        return f"does not serve scheme {scheme!r} (serves {built}; planned {', '.join(PLANNED)})"
    if quant.act != "fp8_per_tensor":
        return f"FP8 needs per-tensor activation scales (act='fp8_per_tensor'), not {quant.act!r}"
    if quant.a13_scale is None or quant.a2_scale is None:
        return "FP8 needs static a13_scale and a2_scale (the runner re-quantizes with them)"
    for name in ("w13_scale", "w2_scale"):
        if np.ndim(getattr(quant, name)) > 1:
            return f"{name} is per channel; the runner takes per-tensor or per-expert weight scales"
    if cfg.activation not in ACTIVATION_CODES:
        return f"activation {cfg.activation!r} is not wired up (have {sorted(ACTIVATION_CODES)})"
    if getattr(cfg, "gate_up_layout", "concat") != "concat":
        return "gate_up_layout must be 'concat' ([gate; up] rows)"
    if cfg.hidden_size % HIDDEN_ALIGN:
        return f"hidden size {cfg.hidden_size} must be a multiple of {HIDDEN_ALIGN}"
    if not 1 <= cfg.top_k <= min(MAX_TOP_K, cfg.num_experts):
        return f"top_k {cfg.top_k} must be in [1, min({MAX_TOP_K}, E)]"
    if cfg.num_experts > MAX_EXPERTS:
        return f"{cfg.num_experts} experts exceed the routing kernels' {MAX_EXPERTS}"
    return None


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
        return False, f"scheme {scheme!r} is not compiled into this build"
    why = _config_refusal(cfg, quant)
    if why:
        return False, why
    why = _cubin_refusal()
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


def prepare(w13, w2, cfg, quant=None, *, w13_bias=None, w2_bias=None) -> Prepared:
    """vLLM-layout FP8 experts -> :class:`Prepared`, once, at load time. ``quant``: an ``fp8``
    :class:`jax_moe.QuantConfig` with per-tensor or per-expert weight scales and static
    ``a13_scale``/``a2_scale`` (per-expert activation scales use their max, as vLLM)."""
    if w13_bias is not None or w2_bias is not None:
        raise ValueError(f"{NAME}: expert biases (w13_bias/w2_bias) are not supported yet")
    why = _config_refusal(cfg, quant)
    if why:
        raise ValueError(f"{NAME}: {why}")
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


# ----------------------------------------------------------------------------- per call


def default_tile_n(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Tokens per CTA tile: the smallest of :data:`TILE_NS` covering the average tokens per expert
    (the Python twin of the module's ``default_tile_n``, FlashInfer's ``selectDefaultTileN``)."""
    avg = num_tokens * top_k / max(num_experts, 1)
    return next((t for t in TILE_NS if t >= avg), TILE_NS[-1])


@functools.lru_cache(maxsize=None)
def workspace_size(num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                   activation: str = "silu", tile_n: int = 8, config: int = -1) -> int:
    """Bytes of the uint8 workspace result (asks the module; needs an SM100 device)."""
    mod = _module()
    if mod is None:
        raise RuntimeError(_state["error"])
    return int(mod.workspace_size(num_tokens, hidden, inter, num_experts, top_k,
                                  ACTIVATION_CODES[activation], tile_n, config))


def output_shapes(num_tokens: int, hidden: int, workspace_bytes: int):
    """The call's results: ``out`` bfloat16 [T, H] and the workspace uint8 [bytes] (the shape rule)."""
    return (jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16),
            jax.ShapeDtypeStruct((max(1, workspace_bytes),), jnp.uint8))


def check_call(x, prepared: Prepared, topk_weights, topk_ids, tile_n=None):
    """ValueErrors naming the argument, before anything is lowered. Returns (T, H, Ip, E, k)."""
    if not isinstance(prepared, Prepared):
        raise ValueError(f"prepared must be a {NAME}.Prepared (from prepare()), got {type(prepared).__name__}")
    if getattr(x, "ndim", None) != 2:
        raise ValueError(f"x must be [T, H], got shape {list(getattr(x, 'shape', ()))}")
    t, h = x.shape
    e, n1, hw = prepared.w13.shape
    ip = prepared.w2.shape[2]
    if hw != h or prepared.w2.shape[:2] != (e, h) or n1 != 2 * ip:
        raise ValueError(f"x [T, {h}] does not match prepared w13 {list(prepared.w13.shape)} / "
                         f"w2 {list(prepared.w2.shape)}")
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
    return t, h, ip, e, k


def apply_prepared(x, prepared: Prepared, topk_weights, topk_ids, *, tile_n: int | None = None,
                   config: int = -1):
    """``y[t] = sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t])`` on the TRT-LLM gen runner.

    x [T, H] float (quantized here to FP8 with ``prepared.a13_scale``); topk_weights [T, k] float;
    topk_ids [T, k] int32 in [0, E). ``tile_n``: tokens per CTA tile (default
    :func:`default_tile_n`); ``config``: the runner's config index (-1: its default). -> bf16 [T, H].
    """
    t, h, ip, e, k = check_call(x, prepared, topk_weights, topk_ids, tile_n)
    tile_n = default_tile_n(t, k, e) if tile_n is None else tile_n
    _register()
    ws = workspace_size(t, h, ip, e, k, prepared.activation, tile_n, config)
    xq = fp8.quantize_fp8_static(x.astype(jnp.float32), prepared.a13_scale)
    out, _ = jax.ffi.ffi_call(TARGETS["fp8"], output_shapes(t, h, ws))(
        xq, topk_ids, topk_weights.astype(jnp.float32), prepared.w13, prepared.w2,
        prepared.out1_scale, prepared.out1_gate_scale, prepared.out2_scale,
        activation=np.int64(ACTIVATION_CODES[prepared.activation]), tile_n=np.int64(tile_n),
        config=np.int64(config), enable_pdl=True)
    return out


def apply(x, w13, w2, topk_weights, topk_ids, cfg, *, quant=None, w13_bias=None, w2_bias=None,
          apply_router_weight_on_input: bool = False):
    """The oracle's entry point (``fused_experts(..., backend="flashinfer_trtllm")``): repacks the
    weights on every call; prepare once (:func:`prepare`) and call :func:`apply_prepared` instead."""
    if apply_router_weight_on_input:
        raise ValueError(f"{NAME}: apply_router_weight_on_input is not supported yet")
    prepared = prepare(w13, w2, cfg, quant, w13_bias=w13_bias, w2_bias=w2_bias)
    return apply_prepared(x, prepared, topk_weights, topk_ids).astype(x.dtype)
