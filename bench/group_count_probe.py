"""A grouped GEMM's device time at a fixed number of rows, as the rows are split among more groups.

    python bench/group_count_probe.py                         # the two shape sets below, pingpong_64x256
    python bench/group_count_probe.py --shape 2048 768 --rows 32768 --groups 8 128 --random 8 \\
        --tiles pingpong_64x256 coop_128x256_c1

Each row times one call of ``cutlass_gemm.grouped_gemm``: bf16, ``a [rows, K]``, weights ``[E, N, K]``.
Its device time is the GEMM kernel's, from one profiler trace, as the median of ``--calls`` calls.

How the rows are split: evenly among the E groups, or with ``--random k`` as softmax top-k routing
of ``rows / k`` random tokens over E experts splits them. The columns are:
- microseconds and TFLOP/s (of the rows, not of the padded tiles);
- the tiles per group;
- microseconds per tile per CTA: the kernel's time over the tiles each of the GPU's CTAs runs.

Why the groups matter. CUTLASS's persistent grouped kernel gives its tiles to the CTAs in turn. So
when a group has fewer tiles than there are CTAs, a CTA's next tile is in another group: its loads
switch to the group's tensor maps (the TMA descriptors, built for every group by the setup launch),
and its consumers to the group's shape. Two shape sets separate that cost from the weights' traffic:
- ``--shape 256 256 --rows 262144`` and ``--shape 512 256 --rows 131072``: 128 groups' weights
  (16.8 MB) stay in the L2. Any change from 1 to 128 groups is the switch.
- A model's GEMM (``--shape 2048 768`` is Qwen3-30B-A3B's GEMM2, ``--shape 1536 2048`` its GEMM1,
  ``--rows 32768`` its T=4096): this adds the weights streamed from DRAM.

Each call's output is checked against float32 on one 64-row block of its last group, before
timing. Without a GPU every call runs the pure-JAX reference, and the times are the CPU's.

``--json FILE`` also writes the rows as :mod:`bench.side_by_side` reads them, so that
``bench/side_by_side.sh`` can time two trees' kernels: "model" names the shape and the split, "T"
is the group count, "impl" the tile, and "busy" the GEMM's microseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import kernel_trace  # noqa: E402
from bench.moe_bench import rel_diff  # noqa: E402
from jax_moe.backends.cutlass_gemm import grouped_gemm  # noqa: E402
from jax_moe.backends.cutlass_tiles import TILES  # noqa: E402
from jax_moe.permute import sort_by_expert  # noqa: E402
from jax_moe.routing import select_experts  # noqa: E402

DEFAULT_SHAPES = ((256, 256, 262144), (512, 256, 131072))  # (N, K, rows): 128 groups' weights stay in L2


def offsets_of(rows: int, groups: int, top_k: int | None, seed: int = 0) -> np.ndarray:
    """int32 offsets [groups + 1] of ``rows`` expert-sorted rows: even, or as softmax top-``top_k``
    routing (``select_experts`` on random logits, then ``sort_by_expert``) of ``rows / top_k`` tokens
    over ``groups`` experts splits them."""
    if top_k is None:
        if rows % groups:
            raise ValueError(f"--rows ({rows}) must be a multiple of each group count ({groups}) when split evenly")
        return np.arange(groups + 1, dtype=np.int32) * (rows // groups)
    if rows % top_k or top_k > groups:
        raise ValueError(f"--random {top_k}: needs --rows ({rows}) a multiple of {top_k} and at least {top_k} "
                         f"groups (have {groups})")
    _, ids = select_experts(jax.random.normal(jax.random.key(seed), (rows // top_k, groups)), top_k)
    return np.asarray(sort_by_expert(ids, groups).offsets)


def tiles_of(offsets: np.ndarray, n: int, tile: str) -> int:
    """The tiles a grouped GEMM of these offsets runs on ``tile`` (its rows and columns are in its name,
    ``pingpong_64x256``): each group's rows and N in whole tiles (a cluster's rounding not counted)."""
    tm, tn = (int(v) for v in re.search(r"(\d+)x(\d+)", tile).groups())
    return int(sum(-(-int(c) // tm) for c in np.diff(offsets))) * -(-n // tn)


def check(d: jax.Array, a: jax.Array, b: jax.Array, offsets: np.ndarray) -> float:
    """Relative error of the last non-empty group's first 64 rows against float32; raises where it is
    not finite or above bf16's 1e-2."""
    e = int(np.flatnonzero(np.diff(offsets))[-1])
    r0, r1 = int(offsets[e]), min(int(offsets[e]) + 64, int(offsets[e + 1]))
    err = rel_diff(d[r0:r1], a[r0:r1].astype(jnp.float32) @ b[e].astype(jnp.float32).T)
    if not np.isfinite(err) or err > 1e-2:
        raise AssertionError(f"group {e}: relative error {err} against float32")
    return err


def gemm_us(calls: list[list[kernel_trace.Kernel]]) -> float:
    """Median over calls of the grouped GEMM kernels' microseconds (every kernel of the call where none
    is a GEMM by name: the CPU's thunks)."""
    per_call = []
    for kernels in calls:
        gemms = [k for k in kernels if kernel_trace.kind_of(k.name) == "gemm"] or list(kernels)
        per_call.append(sum(k.duration_ns for k in gemms) / 1e3)
    return statistics.median(per_call)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", nargs=2, type=int, metavar=("N", "K"), default=None,
                   help="one weight shape (default: the two whose 128 groups stay in L2)")
    p.add_argument("--rows", type=int, default=None, help="total rows (default: 262144 / (N / 256))")
    p.add_argument("--groups", nargs="+", type=int, default=[1, 8, 32, 128])
    p.add_argument("--random", type=int, default=None, metavar="K",
                   help="split the rows as top-K routing does (default: evenly)")
    p.add_argument("--tiles", nargs="+", default=["pingpong_64x256"], choices=sorted(TILES))
    p.add_argument("--calls", type=int, default=7, help="traced calls per row (the median is shown)")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file (bench/side_by_side.py's)")
    args = p.parse_args(argv)
    split = "even" if args.random is None else f"top-{args.random}"
    out_rows: list[dict] = []
    shapes = DEFAULT_SHAPES if args.shape is None else (
        (args.shape[0], args.shape[1], args.rows or 262144 * 256 // max(args.shape[0], 256)),)
    ctas = getattr(jax.devices()[0], "core_count", None) or 1
    print(f"# {jax.devices()[0].device_kind}, {ctas} CTAs; split {'evenly' if args.random is None else f'as top-{args.random} routing'}")
    print("| rows | N | K | groups | tile | tiles per group | us | TFLOP/s | us per tile per CTA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, k, rows in shapes:
        a = jax.random.normal(jax.random.key(1), (rows, k), jnp.bfloat16)
        for groups in args.groups:
            offsets = offsets_of(rows, groups, args.random)
            b = (jax.random.normal(jax.random.key(2), (groups, n, k), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
            off = jnp.asarray(offsets)
            for tile in args.tiles:
                fn = jax.jit(lambda a, b, o, t=tile: grouped_gemm(a, b, o, tile=t))
                check(fn(a, b, off), a, b, offsets)
                calls = kernel_trace.trace_calls([(fn, (a, b, off))] * args.calls)
                if calls is None:
                    print(f"# {rows} x {n} x {k}, {groups} groups, {tile}: the trace did not split into calls")
                    continue
                us = gemm_us(calls)
                tiles = tiles_of(offsets, n, tile)
                print(f"| {rows} | {n} | {k} | {groups} | {tile} | {tiles / groups:.1f} | {us:.1f} | "
                      f"{2 * rows * n * k / us / 1e6:.0f} | {us / (tiles / ctas):.3f} |", flush=True)
                out_rows.append({"model": f"{rows} rows, N={n} K={k}, {split}", "T": groups, "impl": tile,
                                 "busy": us, "stages": {}})
            del b
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out_rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
