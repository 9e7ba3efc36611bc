"""Tune the cutlass backend's tiles for popular MoE layers on this GPU: the shipped tile caches.

Runs ``python -m jax_moe.autotune --shape E H I k`` (random weights of the layer's shapes, prepared
for the cutlass backend) for each layer of :data:`LAYERS`, each in its own process (a large
layer's weights are freed before the next), all into one cache file: by default this GPU model's
file in ``jax_moe/backends/tuned_tiles/``, the tiles that ship with the package (one file per GPU
model, written so). A layer already there is tuned again from its shipped tiles::

    python bench/tune_models.py                                  # every layer, into the shipped file
    python bench/tune_models.py --models qwen3-235b glm-4.5 --scheme fp8 --out tiles.json
    python bench/tune_models.py --tiles coop_192x256 pingpong_192x128 --rounds 2   # place new tiles
    python bench/tune_models.py --list

A layer that fails (out of memory on a smaller GPU, say) is reported and skipped; the exit status
is 1 if any failed. Layers already in :data:`jax_moe.backends.cutlass_tiles.MEASURED` (the bench's
four models, swept GEMM by GEMM on an H100) are tuned too when named; by default they are left
out on the GPU model that table was measured on.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import moe_bench  # noqa: E402


class Layer(NamedTuple):
    """A model's routed-expert layer: experts, hidden size, expert intermediate size, experts per token."""

    e: int
    h: int
    i: int
    k: int


# name -> layer shape, from each model's Hugging Face config.json
LAYERS: dict[str, Layer] = {
    "qwen3-235b": Layer(128, 4096, 1536, 8),  # Qwen3-235B-A22B
    "qwen3-coder-480b": Layer(160, 6144, 2560, 8),  # Qwen3-Coder-480B-A35B
    "qwen3-next-80b": Layer(512, 2048, 512, 10),  # Qwen3-Next-80B-A3B
    "glm-4.5": Layer(160, 5120, 1536, 8),  # GLM-4.5
    "glm-4.5-air": Layer(128, 4096, 1408, 8),  # GLM-4.5-Air
    "gpt-oss-20b": Layer(32, 2880, 2880, 4),  # gpt-oss-20b
    "mixtral-8x22b": Layer(8, 6144, 16384, 2),  # Mixtral-8x22B
    "llama-4-scout": Layer(16, 5120, 8192, 1),  # Llama-4-Scout-17B-16E
    "dbrx": Layer(16, 6144, 10752, 4),  # DBRX
    "phi-3.5-moe": Layer(16, 4096, 6400, 2),  # Phi-3.5-MoE
    "qwen2-57b": Layer(64, 3584, 2560, 8),  # Qwen2-57B-A14B
    "deepseek-v2-lite": Layer(64, 2048, 1408, 6),  # DeepSeek-V2-Lite
    "olmoe": Layer(64, 2048, 1024, 8),  # OLMoE-1B-7B
    "kimi-k2": Layer(384, 7168, 2048, 8),  # Kimi-K2 (bf16 weights: 34 GB)
}
BENCH_MODELS = ("mixtral", "qwen3", "deepseek", "gptoss")  # moe_bench's, in the H100-measured table
LAYERS.update({name: Layer(m.e, m.h, m.i, m.k) for name, m in moe_bench.MODELS.items() if name in BENCH_MODELS})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", choices=sorted(LAYERS), metavar="MODEL",
                   help="layers to tune (default: all; the bench's four only off the measured table's GPU model)")
    p.add_argument("--scheme", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--tokens", nargs="+", type=int, default=[16, 64, 256, 1024, 4096, 16384],
                   help="token counts to tune (a tuned tile answers up to twice or half its rows per expert)")
    p.add_argument("--finalize", choices=("gather", "scatter"), default=None,
                   help="scatter: tune GEMM2 with its scatter epilogue (its own tile keys), as the autotuner's flag")
    p.add_argument("--min-gain", type=float, default=None, help="the autotuner's --min-gain (default: its own)")
    p.add_argument("--rounds", type=int, default=1,
                   help="the autotuner's --rounds: rounds of each GEMM's run-off between its two closest tiles and "
                        "of each forward's confirmation, their median ratios deciding")
    p.add_argument("--tiles", nargs="+", default=None, metavar="TILE",
                   help="the autotuner's --tiles: today's picks timed against these tiles alone (the file's "
                        "figures of the others stay)")
    p.add_argument("--out", help="the cache file; tiles already there are kept (default: this GPU model's "
                   "shipped file, jax_moe/backends/tuned_tiles/)")
    p.add_argument("--list", action="store_true", help="print the layers and exit")
    args = p.parse_args(argv)
    if args.list:
        for name, s in LAYERS.items():
            print(f"{name:18s} E={s.e:4d} H={s.h:5d} I={s.i:5d} k={s.k}")
        return 0
    from jax_moe.backends import cutlass_tile_cache  # noqa: PLC0415
    from jax_moe.backends.cutlass_tiles import MEASURED_ON  # noqa: PLC0415
    from jax_moe.device import device_kind  # noqa: PLC0415

    out = args.out or os.path.join(cutlass_tile_cache.SHIPPED_DIR, cutlass_tile_cache.shipped_file_name(device_kind()))
    models = args.models
    if models is None:
        models = [m for m in LAYERS if m not in BENCH_MODELS or device_kind() != MEASURED_ON]
    failed = []
    for name in models:
        s = LAYERS[name]
        cmd = [sys.executable, "-m", "jax_moe.autotune", "--shape", *map(str, s), "--scheme", args.scheme,
               "--tokens", *map(str, args.tokens), "--out", out]
        if args.finalize is not None:
            cmd += ["--finalize", args.finalize]
        if args.min_gain is not None:
            cmd += ["--min-gain", str(args.min_gain)]
        if args.rounds != 1:
            cmd += ["--rounds", str(args.rounds)]
        if args.tiles is not None:
            cmd += ["--tiles", *args.tiles]
        print(f"## {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        rc = subprocess.call(cmd)
        print(f"## {name}: exit {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc:
            failed.append(name)
    print(f"## tiles in {out}")
    bench_models = [m for m in models if m in BENCH_MODELS]
    if args.out and bench_models:  # a 1-3% pick can tie or lose in a model's loop of layers: time it there
        print(f"## confirm them layer after layer: python3 bench/tile_rounds.py --caches shipped {out} --rounds 2 -- "
              f"python3 bench/stage_breakdown.py --scheme {args.scheme} --no-peer --models {' '.join(bench_models)} "
              f"--tokens {' '.join(map(str, args.tokens))} --loop 8")
    if failed:
        print(f"## failed: {' '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
