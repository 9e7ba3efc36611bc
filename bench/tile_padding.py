"""What a row tiling costs a grouped GEMM on a routing: rows multiplied, and passes through the L2.

For one layer of the bench's models at T tokens, on the bench's routing (``--routing``), and for
each row tiling below, counted from the experts' row counts (no GPU, no timing):

- ``row tiles``: the tiles along the rows, over all experts (a cluster's rounding included);
- ``rows multiplied / rows``: what the tensor cores multiply, padding included, over the T*k
  rows. A tiling that skips a 64-row block with no row in it multiplies to 64-row granularity;
- ``weight passes``: how many times each expert's weight tile of one column tile goes through the
  L2 (its row tiles; a 2x1 cluster's multicast makes one pass for two);
- ``row passes``: how many times each row goes through the L2 (the column tiles);
- ``L2 GB``: the two passes times their bytes, for GEMM1 (``w13`` [E, 2I, H] and the rows
  [T*k, H]) or GEMM2 (``w2`` [E, H, I] and the rows [T*k, I]), bf16.

These are the counts behind an estimate, not a time: the GEMMs at T=4096 are bound by the HBM,
the L2 and the tensor cores together (``bench/RESULTS.md``)::

    python bench/tile_padding.py --models gptoss deepseek qwen3 --tokens 4096
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.moe_bench import MODELS, Model, routed_inputs  # noqa: E402
from bench.routings import ROUTINGS  # noqa: E402

BLOCK_ROWS = 64  # the rows of one warpgroup's MMA block (a WGMMA's M)


class Tiling(NamedTuple):
    """A row tiling: ``tile_m`` x ``tile_n`` tiles; ``cluster_m`` CTAs along the rows share a weight
    tile by multicast (the scheduler rounds each expert's row tiles up to whole clusters);
    ``skips_empty_blocks``: 64-row blocks with no row in them are not multiplied; ``swap_step``: an
    expert's last, partly filled row tile is multiplied with its tokens on the MMA's N (a WGMMA's N
    steps by 8: its rows rounded up to ``swap_step``), not built, counted to bound what it could save."""

    name: str
    tile_m: int
    tile_n: int
    cluster_m: int = 1
    skips_empty_blocks: bool = False
    swap_step: int = 0


TILINGS = (
    Tiling("128x256", 128, 256),
    Tiling("64x256", 64, 256),
    Tiling("128x256, 2x1 cluster", 128, 256, cluster_m=2),
    Tiling("128x256, 2x1 cluster, empty blocks skipped", 128, 256, cluster_m=2, skips_empty_blocks=True),
    Tiling("256x128", 256, 128),
    Tiling("256x128, empty blocks skipped", 256, 128, skips_empty_blocks=True),
    Tiling("192x256, empty blocks skipped (coop_192x256)", 192, 256, skips_empty_blocks=True),
    Tiling("192x128, empty blocks skipped (pingpong_192x128)", 192, 128, skips_empty_blocks=True),
    Tiling("64x256, the last partial tile's tokens on N (not built)", 64, 256, swap_step=8),
)


class Cost(NamedTuple):
    row_tiles: int
    multiplied_per_row: float
    weight_passes: float
    row_passes: int
    l2_bytes: float


def row_count_sets(m: Model, t: int, routing: str = "random", sets: int = 1) -> np.ndarray:
    """[sets, E] int: each expert's rows at T=t tokens in each of ``routed_inputs``' first ``sets``
    routings of the bench."""
    return np.stack([np.bincount(np.asarray(ids).ravel(), minlength=m.e)
                     for _, _, ids in routed_inputs(m, t, sets=sets, routing=routing)])


def row_counts(m: Model, t: int, routing: str = "random") -> np.ndarray:
    """[E] int: each expert's rows at T=t tokens on the bench's routing (``routed_inputs``' first set)."""
    return row_count_sets(m, t, routing)[0]


def cost(rows: np.ndarray, tiling: Tiling, n: int, k: int, element_bytes: int = 2) -> Cost:
    """The counts of the module's docstring for a GEMM of ``rows`` [E] rows per expert, ``n`` output
    columns and reduction ``k``."""
    rows = np.asarray(rows, dtype=np.int64)
    used = rows[rows > 0]
    tiles = -(-used // tiling.tile_m)
    tiles = -(-tiles // tiling.cluster_m) * tiling.cluster_m
    if tiling.swap_step:
        last = used % tiling.tile_m  # the partly filled last tile's rows (0: none)
        multiplied = int(np.sum(used - last + -(-last // tiling.swap_step) * tiling.swap_step))
    elif tiling.skips_empty_blocks:
        multiplied = int(np.sum(-(-used // BLOCK_ROWS))) * BLOCK_ROWS
    else:
        multiplied = int(np.sum(tiles)) * tiling.tile_m
    total_rows = int(np.sum(used))
    weight_passes = float(np.sum(tiles)) / tiling.cluster_m / max(len(used), 1)
    row_passes = math.ceil(n / tiling.tile_n)
    l2 = element_bytes * (weight_passes * len(used) * n * k + row_passes * total_rows * k)
    return Cost(int(np.sum(tiles)), multiplied / max(total_rows, 1), weight_passes, row_passes, l2)


def gemm_shape(m: Model, gemm: str) -> tuple[int, int]:
    """(n, k) of the forward's GEMM1 (rows [T*k, H] by ``w13``) or GEMM2 (rows [T*k, I] by ``w2``)."""
    if gemm == "gemm1":
        return 2 * m.i, m.h
    if gemm == "gemm2":
        return m.h, m.i
    raise ValueError(f"gemm must be 'gemm1' or 'gemm2', got {gemm!r}")


def table(m: Model, t: int, gemm: str, routing: str = "random", tilings: Sequence[Tiling] = TILINGS) -> str:
    rows = row_counts(m, t, routing)
    n, k = gemm_shape(m, gemm)
    lines = [f"{m.name} {gemm}, T={t}, {routing} routing: {int(rows.sum())} rows over {int((rows > 0).sum())} "
             f"experts ({rows.min()}-{rows.max()} each)",
             "| tiling | row tiles | rows multiplied / rows | weight passes | row passes | L2 GB |",
             "|---|---|---|---|---|---|"]
    for tiling in tilings:
        c = cost(rows, tiling, n, k)
        lines.append(f"| {tiling.name} | {c.row_tiles} | {c.multiplied_per_row:.3f} | {c.weight_passes:.2f} | "
                     f"{c.row_passes} | {c.l2_bytes / 1e9:.2f} |")
    return "\n".join(lines)


def add_layer_args(p: argparse.ArgumentParser) -> None:
    """The layers a counting bench reads: ``--models``, ``--tokens``, ``--gemm`` and ``--routing``."""
    p.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["gptoss", "deepseek", "qwen3"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096])
    p.add_argument("--gemm", nargs="+", choices=("gemm1", "gemm2"), default=["gemm1", "gemm2"])
    p.add_argument("--routing", choices=ROUTINGS, default="random")


def each_layer(p: argparse.ArgumentParser, args: argparse.Namespace) -> Iterator[tuple[Model, int, str]]:
    """(model, T, gemm) for every layer that :func:`add_layer_args`' arguments name."""
    if min(args.tokens) < 1:
        p.error("--tokens must be at least 1")
    for key in args.models:
        for t in args.tokens:
            for gemm in args.gemm:
                yield MODELS[key], t, gemm


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_args(p)
    args = p.parse_args(argv)
    for m, t, gemm in each_layer(p, args):
        print(table(m, t, gemm, args.routing) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
