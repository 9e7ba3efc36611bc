"""Which weight layout streams faster on the cutlass grouped GEMM: K-contiguous or N-contiguous.

The forward GEMMs read the weights as vLLM stores them, ``[E, N, K]`` (K contiguous: each stage
reads a short run of many rows). The same product with the weights stored ``[E, K, N]`` (N
contiguous: the CTAs on neighbouring N tiles read neighbouring bytes of one row) is what the
dgrad kind computes (:func:`jax_moe.backends.cutlass_grad_gemm.grouped_gemm_dgrad`), so both
layouts can be timed on the same kernels' tiles without a new instantiation. tokamax's
``ragged_dot`` (which takes ``[E, K, N]``) runs alongside where it is importable.

    python bench/layout_sweep.py                                  # DeepSeek-V3, GPT-OSS, Qwen3 at T = 16, 64, 1024
    python bench/layout_sweep.py --models deepseek --tokens 64 --tiles pingpong_64x256

Per (model, GEMM, T): each tile's ms as ``[E, N, K] / [E, K, N]`` (wall time per call with
dispatch, the better of two interleaved medians), tokamax's ms last. bf16 only: the FP8 tensor
cores read only K-major operands.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import moe_bench, peers, tile_sweep  # noqa: E402
from jax_moe.backends import cutlass_gemm  # noqa: E402
from jax_moe.backends.cutlass_grad_gemm import grouped_gemm_dgrad  # noqa: E402

DEFAULT_TILES = ("pingpong_64x128", "pingpong_64x128_k256", "pingpong_64x256")


def best_of_two(fns_and_inputs) -> list[float]:
    """Each (fn, inputs)'s ms: the smaller of two medians, the functions interleaved."""
    first = [moe_bench.timeit(f, ins) for f, ins in fns_and_inputs]
    second = [moe_bench.timeit(f, ins) for f, ins in fns_and_inputs]
    return [min(a, b) for a, b in zip(first, second)]


def sweep_model(m: moe_bench.Model, tokens, tiles) -> None:
    tokamax = None
    if peers.available()[0]:
        import tokamax  # noqa: PLC0415
    w13, w2 = moe_bench.random_experts(m)
    for which, w in ((1, w13), (2, w2)):
        wt = jnp.swapaxes(w, 1, 2).copy()  # [E, K, N]
        for t in tokens:
            ins = [(op[which][0], op[0]) for op in tile_sweep.gemm_operands(m, t, "bf16")]
            cells = []
            for tile in tiles:
                nk = jax.jit(lambda a, b, o, tile=tile: cutlass_gemm.grouped_gemm(a, b, o, tile=tile))
                kn = jax.jit(lambda a, b, o, tile=tile: grouped_gemm_dgrad(a, b, o, tile=tile))
                a0, o0 = ins[0]
                diff = float(jnp.max(jnp.abs(nk(a0, w, o0).astype(jnp.float32) - kn(a0, wt, o0).astype(jnp.float32))))
                ms = best_of_two([(nk, [(a, w, o) for a, o in ins]), (kn, [(a, wt, o) for a, o in ins])])
                cells.append(f"{ms[0]:.3f} / {ms[1]:.3f}" + ("" if diff < 0.05 else f" (differ by {diff:.2g})"))
            peer = "n/a"
            if tokamax is not None:
                rd = jax.jit(lambda a, b, o: tokamax.ragged_dot(a, b, jnp.diff(o), implementation="mosaic"))
                peer = moe_bench.fmt(moe_bench.timeit(rd, [(a, wt, o) for a, o in ins]))
            print(f"| {m.name} | gemm{which} | {t} | " + " | ".join(cells) + f" | {peer} |", flush=True)
        del wt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["deepseek", "gptoss", "qwen3"], choices=sorted(moe_bench.MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[16, 64, 1024])
    p.add_argument("--tiles", nargs="+", default=list(DEFAULT_TILES), choices=sorted(cutlass_gemm.TILES))
    args = p.parse_args()
    ok, why = cutlass_gemm.available(None)
    if not ok:
        sys.exit(f"layout_sweep needs the CUTLASS module on an SM90 GPU: {why}")
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| model | GEMM | T | " + " | ".join(f"{t} [E,N,K] / [E,K,N] ms" for t in args.tiles) + " | tokamax ms |")
    print("|" + "---|" * (len(args.tiles) + 4))
    for name in args.models:
        sweep_model(moe_bench.MODELS[name], args.tokens, args.tiles)


if __name__ == "__main__":
    main()
