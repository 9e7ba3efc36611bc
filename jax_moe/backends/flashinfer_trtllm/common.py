"""What every scheme of ``backend="flashinfer_trtllm"`` shares: the handlers and runners of the
native module, the routing kernels' limits, the scheme's own contract tables, operand checks and the
tokens-per-tile rules.

FlashInfer's TRT-LLM gen fused MoE runs on SM100 (tcgen05 batched GEMMs from prebuilt cubins).
Schemes with a handler (:data:`TARGETS`; ``ffi/trtllm/handlers.cu``), routing done before
the call in every one of them: ``fp8`` (:mod:`.fp8`), ``mxfp4`` and ``nvfp4`` (one target,
:mod:`.mxfp4`, :mod:`.nvfp4`), ``fp8_block`` (:mod:`.fp8_block`). Every scheme's weight
preparation is pure jnp, CPU-tested against the layouts as documented in words.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_moe.layouts import SF_TILE_M

NAME = "flashinfer_trtllm"
SMS = (100, 103)                      # compute capabilities the cubins run on (10.0, 10.3)
TARGETS = {"fp8": "jax_moe_trtllm_fp8_per_tensor_moe",
           "nvfp4": "jax_moe_trtllm_fp4_block_scale_moe",
           "mxfp4": "jax_moe_trtllm_fp4_block_scale_moe",
           "fp8_block": "jax_moe_trtllm_fp8_block_scale_moe"}
# the runner a (scheme, activation format) builds: ffi/trtllm/host_queries.h's kScheme* (scheme_id())
SCHEME_IDS = {"fp8": 0, "nvfp4": 1, "mxfp4": 2, "mxfp4_mxfp8": 3, "fp8_block": 4}
# the FlashInfer entry point each scheme's handler wraps
KERNELS = {"fp8": "trtllm_fp8_per_tensor_scale_moe", "fp8_block": "trtllm_fp8_block_scale_moe",
           "nvfp4": "trtllm_fp4_block_scale_moe", "mxfp4": "trtllm_fp4_block_scale_moe"}
# jax_moe activation -> the runner's ActivationType (flashinfer/trtllm/fused_moe/runner.h)
ACTIVATION_CODES = {"silu": 3,        # Swiglu: silu(gate) * up, fused into GEMM1
                    "swigluoai": 3}   # the same Swiglu with per-expert alpha/beta/limit tensors (GPT-OSS)
# the activations each scheme's preparation is written for (vLLM: silu; GPT-OSS MXFP4: swigluoai)
SCHEME_ACTIVATIONS = {"fp8": ("silu",), "fp8_block": ("silu",), "nvfp4": ("silu",),
                      "mxfp4": ("silu", "swigluoai")}
HIDDEN_ALIGN = 128                    # H: GEMM1's K tile and shuffle_matrix_a on w2's rows
# NVFP4 is not padded (vLLM's prepare_static_weights_for_trtllm_fp4_moe): w13's 2I scale rows
# must fill whole 128-row scale tiles (shuffle_matrix_sf_a), so I is a multiple of 64
NVFP4_INTERMEDIATE_ALIGN = SF_TILE_M // 2
MIN_EXPERTS_MULTIPLE = {"fp8_block": 4}  # vLLM's TrtLlmFp8Experts asserts E % 4 == 0 (block scale)
TILE_TOKENS_IMBALANCE = 1.3           # vLLM's GPT-OSS MXFP4 path: _get_tile_tokens_dim
TILE_TOKENS_RANGE = (8, 64)
TILE_NS = (8, 16, 32, 64, 128)        # tokens per CTA tile the runner has kernels for
MAX_TILE_N_BF16_ACT = 64              # FP4 weights x bf16 activations: no tile-128 kernels
MXFP4_ACTS = ("bf16", "mxfp8")        # the activation formats trtllm_fp4_block_scale_moe takes for MXFP4
MAX_TOP_K = 32                        # the routing kernels' MaxSupportedTopExperts
MAX_EXPERTS = 512                     # the routing kernels' largest expert count (one block)
FEATURES = frozenset()                # no router weight on input; biases: MXFP4 only (prepare())
BIAS_SCHEMES = frozenset({"mxfp4"})    # the schemes that take expert biases (prepare())
CONCAT_ONLY = frozenset({"fp8", "fp8_block"})  # w13 must be [gate; up] (gate_up_layout="concat")
PADDED = frozenset({"mxfp4"})         # prepare pads H (and I): any H is served


def scheme_of(quant) -> str:
    return "bf16" if quant is None else quant.scheme


def scheme_id(scheme: str, act: str | None = None) -> int:
    """The module's scheme id (:data:`SCHEME_IDS`) of a jax_moe scheme and its activation format:
    ``mxfp4`` names two runners, BF16 activations (act ``bf16``) and MXFP8 (act ``mxfp8``)."""
    if scheme == "mxfp4" and act == "mxfp8":
        return SCHEME_IDS["mxfp4_mxfp8"]
    if scheme not in TARGETS:
        raise ValueError(f"{NAME}: no handler for scheme {scheme!r} (have {', '.join(sorted(TARGETS))})")
    return SCHEME_IDS[scheme]


def check_operand(name: str, a, dtype, shape) -> None:
    """ValueError naming ``name`` unless ``a`` has ``dtype`` (a tuple: any of them) and ``shape``."""
    dts = dtype if isinstance(dtype, tuple) else (dtype,)
    if jnp.dtype(a.dtype) not in [jnp.dtype(d) for d in dts] or tuple(a.shape) != tuple(shape):
        want = " or ".join(jnp.dtype(d).name for d in dts)
        raise ValueError(f"{name} must be {want} {list(shape)}, got {jnp.dtype(a.dtype).name} {list(a.shape)}")


def fp4_dims(w2, packed_block: int, w2_name: str = "w2") -> tuple[int, int, int]:
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


def tile_tokens_dim(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Tokens per CTA tile for ``trtllm_fp4_block_scale_moe``, vLLM's GPT-OSS MXFP4 rule: the
    tokens an expert gets under a perfectly even routing, ``(T * k) // E``, times the imbalance
    factor 1.3 (truncated to an int), rounded up to a power of two (1 for 0), clamped to [8, 64]."""
    for name, v, least in (("num_tokens", num_tokens, 0), ("top_k", top_k, 1), ("num_experts", num_experts, 1)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < least:
            raise ValueError(f"{name} must be a {'non-negative' if least == 0 else 'positive'} int, got {v!r}")
    per_expert = int((num_tokens * top_k) // num_experts * TILE_TOKENS_IMBALANCE)
    pow2 = 1 if per_expert < 1 else 1 << (per_expert - 1).bit_length()
    lo, hi = TILE_TOKENS_RANGE
    return min(max(pow2, lo), hi)


def default_tile_n(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Tokens per CTA tile: the smallest of :data:`TILE_NS` covering the average tokens per expert
    (the Python twin of the module's ``default_tile_n``, FlashInfer's ``selectDefaultTileN``)."""
    avg = num_tokens * top_k / max(num_experts, 1)
    return next((t for t in TILE_NS if t >= avg), TILE_NS[-1])


def hidden_check(kernel_sizes):
    """A scheme's ``check_x`` that asks x [T, H] for the prepared layer's hidden size (the second
    of the scheme's ``kernel_sizes``, before any padding)."""
    def check_x(prepared, x) -> None:
        hidden = kernel_sizes(prepared)[1]
        if x.shape[1] != hidden:
            raise ValueError(f"x [T, {x.shape[1]}] does not match prepared {prepared.scheme} weights of hidden "
                             f"size {hidden} (w13 {list(prepared.w13.shape)} / w2 {list(prepared.w2.shape)})")
    return check_x


def no_tile_limit(prepared) -> None:
    """A scheme's ``max_tile_n`` where the runner has kernels for every tile of ``TILE_NS``."""
    return None


def fp4_operands(xs, ids, w, gemm1: tuple, gemm2: tuple, out_scales: tuple) -> tuple:
    """``trtllm_fp4_block_scale_moe``'s operands after the activations ``xs`` (x, and its scales
    when quantized) and the routing (ids, w): GEMM1's (w13, w13_scale, w13_bias, swiglu alpha, beta,
    limit), GEMM2's (w2, w2_scale, w2_bias) and the three epilogue scales; None: not given."""
    absent = jnp.zeros((0,), jnp.float32)  # the handler's "not given" for an optional operand
    opt = lambda a: absent if a is None else a  # noqa: E731
    x_scale = xs[1] if len(xs) > 1 else jnp.zeros((0,), jnp.uint8)
    return (xs[0], x_scale, ids, w, *(opt(a) for a in gemm1 + gemm2 + out_scales))
