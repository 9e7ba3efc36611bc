"""``python -m jax_moe.info [--model E,H,I,k]``: the device, the compiled kernels, and which
backend would serve a model shape (and why every other one would not)."""

from __future__ import annotations

import argparse

import jax
import numpy as np

from jax_moe import oracle
from jax_moe.config import MoEConfig


def model_shape(text: str) -> tuple[int, int, int, int]:
    """``"E,H,I,k"`` -> four positive ints (argparse's ``type=``: a bad value is a usage error)."""
    parts = text.split(",")
    try:
        values = tuple(int(v) for v in parts)
    except ValueError:
        values = ()
    if len(parts) != 4 or len(values) != 4 or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected four positive integers E,H,I,k (experts, hidden size, "
                                         f"intermediate size, top-k), got {text!r}")
    return values


def tile_cache_status() -> str:
    """Where the cutlass backend's tiles come from here: the tuned-tile cache named by
    ``JAX_MOE_TILE_CACHE`` / ``jax_moe.autotune.use`` (its GPU model and GEMMs), the tuned tiles
    shipped for this GPU model, and the shipped table."""
    from jax_moe.backends import cutlass_tile_cache as tc
    from jax_moe.backends.cutlass_tiles import MEASURED_ON, TILES
    from jax_moe.device import device_kind

    here = device_kind()
    try:
        ours = tc.shipped(here, TILES)
    except ValueError as err:
        return f"shipped tuned tiles unusable: {err}"
    shipped = f"the shipped table (measured on {MEASURED_ON}) and the heuristic"
    if ours is not None:
        shipped = f"{len(ours.gemms)} shipped tuned GEMM shapes of {here}, then {shipped}"
    path = tc.active_path()
    if path is None:
        return f"{shipped}; no tuned-tile cache ({tc.CACHE_ENV} unset; python -m jax_moe.autotune writes one)"
    try:
        cache = tc.active(TILES)
    except ValueError as err:
        return f"tuned-tile cache unusable: {err}"
    if cache.device != here:
        return f"{path} holds tiles of {cache.device}, not this {here}: not used; {shipped}"
    return f"{path}: {len(cache.gemms)} tuned GEMM shapes of {cache.device}, read first; then {shipped}"


def finalize_status() -> str:
    """How the cutlass forward sums each token's k expert rows when ``finalize="auto"``, and why
    (:func:`jax_moe.backends.cutlass_scatter_gemm.auto_finalize`)."""
    from jax_moe.backends.cutlass_scatter_gemm import FINALIZE_ENV, auto_finalize

    try:
        mode, why = auto_finalize()
    except ValueError as err:
        return f"unusable: {err}"
    if mode == "scatter":
        return (f"scatter ({why}): GEMM2's epilogue adds each row into its token's row, on every layout of "
                f"the weights; not bit-reproducible ({FINALIZE_ENV}=gather or XLA's "
                "--xla_gpu_deterministic_ops=true: the un-permute kernel)")
    return f"gather ({why}): the un-permute kernel, bit-reproducible"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m jax_moe.info", description=__doc__)
    p.add_argument("--model", default="128,2048,768,8", type=model_shape,
                   help="E,H,I,k (default: Qwen3-30B-A3B)")
    p.add_argument("--activation", default="silu")
    p.add_argument("--scheme", default="bf16", choices=sorted(oracle.SCHEME_ORDER))
    args = p.parse_args(argv)
    e, h, i, k = args.model
    try:
        cfg = MoEConfig(e, k, h, i, args.activation)
    except ValueError as err:
        p.error(f"--model {e},{h},{i},{k} --activation {args.activation}: {err}")
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}; device: {dev.device_kind} ({dev.platform}); "
          f"compute capability: {getattr(dev, 'compute_capability', 'n/a')}")
    try:
        from jax_moe import ffi

        for key, value in ffi.native_status().items():
            print(f"native {key}: {value}")
    except ImportError as err:
        print(f"native: unavailable ({err})")
    from jax_moe.backends import flashinfer_cutlass as fic
    from jax_moe.backends import flashinfer_trtllm as trt

    if fic.compiled_schemes():
        print(f"native flashinfer_cutlass: loaded ({', '.join(fic.compiled_schemes())})")
    else:
        print(f"native flashinfer_cutlass: unavailable: {fic._state['error'] or 'the module compiles no scheme'}")
    if trt.compiled_schemes():
        print(f"native trtllm: loaded ({', '.join(trt.compiled_schemes())}); cubins read from {trt.cubin_root()}")
    else:
        print(f"native trtllm: unavailable: {trt._state['error']}")
    print(f"cutlass tiles: {tile_cache_status()}")
    print(f"cutlass finalize: {finalize_status()}")
    quant = None if args.scheme == "bf16" else SchemeOnly(args.scheme, e)
    static = "" if quant is None or quant.a2_scale is None else ", static scales"
    print(f"model E={e} H={h} I={i} k={k} activation={args.activation} scheme={args.scheme}"
          f"{'' if quant is None else f' (act={quant.act}{static})'}:")
    for name in oracle.order_for(quant):
        _, ok, reason = oracle.probe(name, cfg, quant, None)
        note = ""
        if ok and name not in oracle.AUTO:
            note = " (prepared weights: MoEBlock.prepare())" if name in oracle.AUTO_PREPARED else " (only when forced)"
        print(f"  {name:20s} {'yes' if ok else 'no '}  {reason}{note}")
    print(f"  -> fused_experts: {oracle.select_backend(cfg, quant).name}; "
          f"MoEBlock.prepare(): {oracle.select_backend(cfg, quant, prepared=True).name}")


class SchemeOnly:
    """A stand-in for a QuantConfig of ``scheme`` in its most common serving form (for
    reporting): the scheme's default activation format, per-expert weight scales, static
    activation scales where the format has them."""

    def __init__(self, scheme: str, num_experts: int):
        from jax_moe.quant.scheme import SCHEME_ACTS, STATIC_ACTS

        self.scheme = scheme
        self.act = SCHEME_ACTS[scheme][0]
        self.w13_scale = self.w2_scale = np.ones((num_experts,), np.float32)
        static = np.float32(1.0) if self.act in STATIC_ACTS else None
        self.a13_scale = self.a2_scale = static


if __name__ == "__main__":
    main()
