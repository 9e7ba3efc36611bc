"""Two tiles of one grouped GEMM, timed in alternating rounds in one tree, with no rebuild.

The autotuner's figures come from one timing per tile, and the timer spreads by a few percent
between trials. A tile that is 1-4% faster on a forward shows only in alternating rounds. This runs
a bench command ``rounds`` times with the GEMM on each of the two tiles in turn. Each run gets a
tile cache of its own (``JAX_MOE_TILE_CACHE``), holding one point: the GEMM's tile at ``rows`` per
expert. The rounds are written as :mod:`bench.side_by_side` reads them (``base_<round>.json`` for
the first tile, ``new_<round>.json`` for the second), and their table is printed::

    python3 bench/tile_rounds.py fp8_scatter/128/2048/768 256 coop_128x256 pingpong_64x256 --rounds 3 -- \\
        python3 bench/stage_breakdown.py --scheme fp8 --no-peer --models qwen3 --tokens 4096 --loop 8

The GEMM is keyed as the tile caches key it, ``kind/E/N/K``
(:func:`jax_moe.backends.cutlass_tile_cache.gemm_key`), as in the shipped files of
``jax_moe/backends/tuned_tiles/`` and in the autotuner's log lines. ``rows`` is the point's rows
per expert: the point answers from half to twice that, so pass the command's own T * k / E. The
command must take ``--json FILE`` and write :mod:`bench.stage_breakdown`'s rows. Tiles that win go
into ``jax_moe/backends/tuned_tiles/`` with the figures they won by.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable, Sequence

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import side_by_side  # noqa: E402
from jax_moe.backends import cutlass_tile_cache as tc  # noqa: E402
from jax_moe.backends.cutlass_tiles import TILES  # noqa: E402

Runner = Callable[..., object]  # subprocess.run's signature: (cmd, env=..., timeout=..., check=False)


def write_cache(path: str, device: str, gemm: str, rows: float, tile: str) -> None:
    """A tile cache for GPU model ``device`` with one point: ``gemm``'s ``tile`` at ``rows`` per expert."""
    cache = tc.TileCache(device)
    cache.record(gemm, rows, tile, {})
    tc.from_json(cache.to_json(), path, TILES)  # the key, the rows and the tile, checked as a reader would
    cache.save(path)


def run_rounds(gemm: str, rows: float, tiles: Sequence[str], rounds: int, command: Sequence[str], folder: str,
               device: str, *, timeout: float = 300.0, runner: Runner = subprocess.run) -> list[str]:
    """Runs ``command`` with each of the two ``tiles`` in turn, ``rounds`` times, writing the rounds'
    rows into ``folder``; returns :func:`bench.side_by_side.table`'s lines (the first tile as base)."""
    if len(tiles) != 2 or tiles[0] == tiles[1]:
        raise ValueError(f"tiles must be two different tiles, got {list(tiles)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    os.makedirs(folder, exist_ok=True)
    caches = {}
    for side, tile in zip(side_by_side.SIDES, tiles, strict=True):
        caches[side] = os.path.join(folder, f"tiles_{side}.json")
        write_cache(caches[side], device, gemm, rows, tile)
    for rnd in range(1, rounds + 1):
        for side, tile in zip(side_by_side.SIDES, tiles, strict=True):
            print(f"== round {rnd}: {gemm} on {tile} ({side})", flush=True)
            env = {**os.environ, tc.CACHE_ENV: caches[side]}
            try:
                runner([*command, "--json", os.path.join(folder, f"{side}_{rnd}.json")], env=env, timeout=timeout,
                       check=False)
            except subprocess.TimeoutExpired:  # that round's file is missing: the table leaves the round out
                print(f"== round {rnd}: {tile} ran past {timeout:g} s", flush=True)
    return side_by_side.table(side_by_side.read_rounds(folder), sides=f"{tiles[0]}, then {tiles[1]}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("tile_rounds: give the bench command after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    own, command = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("gemm", help="the GEMM's key, kind/E/N/K")
    p.add_argument("rows", type=float, help="the point's rows per expert (T * k / E of the command's T)")
    p.add_argument("tiles", nargs=2, choices=sorted(TILES), metavar="TILE", help="the base tile, then the new one")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="/tmp/tile_rounds", help="the folder for the caches and the rounds")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run of the command")
    args = p.parse_args(own)
    if not command:
        p.error("no bench command after --")
    from jax_moe.device import device_kind  # noqa: PLC0415  (initializes JAX: after the arguments are checked)

    try:
        lines = run_rounds(args.gemm, args.rows, args.tiles, args.rounds, command, args.out, device_kind(),
                           timeout=args.timeout)
    except ValueError as err:
        print(f"tile_rounds: {err}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
