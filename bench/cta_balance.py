"""How evenly a grouped GEMM's persistent tile scheduler deals its tiles to the CTAs, per group order.

The cutlass backend's grouped GEMMs run one CTA per SM. The group scheduler numbers the tiles group
after group, in the order of the group arrays (the experts' order, or the setup launch's spread order;
``ffi/cutlass/group_order.cuh``), and within a group by row tile first, then column tile (its raster
along M). CTA c runs tiles c, c + grid, c + 2 grid, ... A kernel ends with its most loaded CTA, so
what a deal costs is its most loaded CTA's work over the mean (``max / mean``).

For one layer of the bench's models at T tokens, on the bench's routing, and for each group order of
:data:`bench.expert_order.ORDERS`, this counts that ratio from the experts' row counts (no GPU, no
timing; ``--sets N``: the means over N routings, as a loop's layers are each routed anew), under two
cost models of a tile:

- ``tiles``: every tile costs the same (the 64- and 128-row tiles, which multiply whole tiles);
- ``blocks``: a tile costs its 64-row blocks that hold rows (``coop_192x256``, which multiplies only
  those).

``lpt`` is what a scheduler free to put any tile on any CTA reaches with the greedy rule: the tiles one
by one, most costly first, each on the least loaded CTA. A group order cannot deal that way, since a
group's tiles go to consecutive CTAs. ``tiles / CTA`` shows the share of the ratio that is the tile
count's own rounding: a deal of 4096 equal tiles to 132 CTAs gives 4 of them a 32nd tile (1.031),
whatever the order or the scheduler, unless tiles are split.

These are counts behind an estimate, not a time: a CTA's tile also waits on the DRAM, which the CTAs
share, so a time moves less than its ratio::

    python bench/cta_balance.py --models gptoss deepseek qwen3 --tokens 4096
"""

from __future__ import annotations

import argparse
import heapq
import math
import os
import sys
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.expert_order import ORDERS, expert_order  # noqa: E402
from bench.moe_bench import Model  # noqa: E402
from bench.tile_padding import BLOCK_ROWS, add_layer_args, each_layer, gemm_shape, row_count_sets  # noqa: E402

SMS = 132  # an H100 SXM's and an H200's SMs: the persistent grid
COSTS = ("tiles", "blocks")


class Tile(NamedTuple):
    """A CTA tile: ``rows`` x ``cols``; ``cost``, one of :data:`COSTS`."""

    name: str
    rows: int
    cols: int
    cost: str


TILES = (
    Tile("pingpong_64x256", 64, 256, "tiles"),
    Tile("coop_128x256_c1", 128, 256, "tiles"),
    Tile("coop_192x256", 192, 256, "blocks"),
)


def tile_costs(rows: np.ndarray, order: np.ndarray, tile: Tile, n: int) -> np.ndarray:
    """[tiles] float: each tile's cost in the scheduler's linear order, for experts of ``rows`` [E]
    visited in ``order`` [E] (expert indices), N = ``n`` columns."""
    if tile.cost not in COSTS:
        raise ValueError(f"tile.cost must be one of {COSTS}, got {tile.cost!r}")
    col_tiles = math.ceil(n / tile.cols)
    out = []
    for e in order:
        r = int(rows[e])
        row_tiles = -(-r // tile.rows)
        in_tile = [min(tile.rows, r - m * tile.rows) for m in range(row_tiles)]  # rows of row tile m
        per_row_tile = [1.0 if tile.cost == "tiles" else float(-(-x // BLOCK_ROWS)) for x in in_tile]
        out.extend(per_row_tile * col_tiles)  # row tiles first, then the next column tile
    return np.asarray(out, dtype=np.float64)


def cta_loads(costs: np.ndarray, grid: int = SMS) -> np.ndarray:
    """[grid] float: each CTA's summed cost when tile i goes to CTA i % grid."""
    loads = np.zeros(grid)
    np.add.at(loads, np.arange(costs.shape[0]) % grid, costs)
    return loads


def lpt_max(costs: np.ndarray, grid: int = SMS) -> float:
    """The most loaded CTA's cost when each tile, most costly first, goes to the least loaded CTA (the
    greedy rule: within 4/3 of the best deal, and usually much nearer)."""
    heap = [0.0] * grid
    for c in sorted(costs.tolist(), reverse=True):
        heapq.heapreplace(heap, heap[0] + c)
    return max(heap)


def imbalance(rows: np.ndarray, tile: Tile, n: int, orders: Sequence[str] = ORDERS, grid: int = SMS
              ) -> dict[str, float]:
    """Per order (and ``"lpt"``): the most loaded CTA's cost over the mean CTA's."""
    out = {}
    costs = None
    for order in orders:
        costs = tile_costs(rows, expert_order(np.asarray(rows), order), tile, n)
        out[order] = float(cta_loads(costs, grid).max() / (costs.sum() / grid))
    if costs is not None:
        out["lpt"] = lpt_max(costs, grid) / (costs.sum() / grid)
    return out


def table(m: Model, t: int, gemm: str, routing: str = "random", tiles: Sequence[Tile] = TILES,
          grid: int = SMS, sets: int = 1) -> str:
    """The ratios of :func:`imbalance` per tile of ``tiles``; with ``sets`` > 1, their means over that
    many routings of the layer (each layer of a loop is routed anew)."""
    rows = row_count_sets(m, t, routing, sets)
    n, _ = gemm_shape(m, gemm)
    over = "" if sets == 1 else f", means over {sets} routings"
    lines = [f"{m.name} {gemm}, T={t}, {routing} routing, {grid} CTAs: {int(rows[0].sum())} rows over "
             f"{m.e} experts ({rows.min()}-{rows.max()} each), N={n}{over}. Most loaded CTA over the mean:",
             "| tile (cost) | tiles / CTA | " + " | ".join(ORDERS) + " | lpt |",
             "|---|---|" + "---|" * (len(ORDERS) + 1)]
    for tile in tiles:
        r = [imbalance(layer, tile, n, ORDERS, grid) for layer in rows]
        count = np.mean([tile_costs(layer, np.arange(m.e), tile, n).shape[0] for layer in rows])
        lines.append(f"| {tile.name} ({tile.cost}) | {count / grid:.2f} | "
                     + " | ".join(f"{np.mean([x[o] for x in r]):.3f}" for o in (*ORDERS, "lpt")) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_args(p)
    p.add_argument("--grid", type=int, default=SMS, help="CTAs of the persistent grid (the GPU's SMs)")
    p.add_argument("--sets", type=int, default=1, help="routings of each layer to average over")
    args = p.parse_args(argv)
    if args.grid < 1 or args.sets < 1:
        p.error("--grid and --sets must be at least 1")
    for m, t, gemm in each_layer(p, args):
        print(table(m, t, gemm, args.routing, grid=args.grid, sets=args.sets) + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
