"""Two tile choices timed in alternating rounds in one tree, with no rebuild.

The autotuner's figures come from one timing per tile, and the timer spreads by a few percent
between trials. A tile that is 1-4% faster on a forward shows only in alternating rounds. This runs
a bench command ``rounds`` times on each of two tile choices in turn, each named to the backend by
``JAX_MOE_TILE_CACHE``. The rounds are written as :mod:`bench.side_by_side` reads them
(``base_<round>.json`` for the first choice, ``new_<round>.json`` for the second), and their table
is printed.

Two tiles of one GEMM: each run gets a tile cache of its own holding one point, the GEMM's tile at
``rows`` per expert::

    python3 bench/tile_rounds.py fp8_scatter/128/2048/768 256 coop_128x256 pingpong_64x256 --rounds 3 -- \\
        python3 bench/stage_breakdown.py --scheme fp8 --no-peer --models qwen3 --tokens 4096 --loop 8

Two whole tile caches (``--caches BASE NEW``): the autotuner's file against the shipped tiles, say,
or the shipped file before an edit against after it. ``shipped`` names the shipped tiles alone
(``JAX_MOE_TILE_CACHE`` unset)::

    python3 bench/tile_rounds.py --caches shipped tuned.json --rounds 2 -- \\
        python3 bench/stage_breakdown.py --no-peer --models qwen3 --tokens 1024 16384 --loop 8

The GEMM is keyed as the tile caches key it, ``kind/E/N/K``
(:func:`jax_moe.backends.cutlass_tile_cache.gemm_key`), as in the shipped files of
``jax_moe/backends/tuned_tiles/`` and in the autotuner's log lines. ``rows`` is the point's rows
per expert: the point answers from half to twice that, so pass the command's own T * k / E. A
cache answers before the shipped tiles at each point it has, and only on the GPU model it names.
The command must take ``--json FILE`` and write :mod:`bench.stage_breakdown`'s rows. Tiles that
win go into ``jax_moe/backends/tuned_tiles/`` with the figures they won by.
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


SHIPPED = "shipped"  # as a cache name: the shipped tiles alone, JAX_MOE_TILE_CACHE unset


def run_choices(choices: Sequence[tuple[str, str | None]], rounds: int, command: Sequence[str], folder: str, *,
                timeout: float = 300.0, runner: Runner = subprocess.run) -> list[str]:
    """Runs ``command`` on each of two tile ``choices`` in turn, ``rounds`` times, writing the
    rounds' rows into ``folder``; returns :func:`bench.side_by_side.table`'s lines (the first
    choice as base). A choice is (label, the tile cache ``JAX_MOE_TILE_CACHE`` names, or None: the
    shipped tiles alone). Round files an earlier run left in ``folder`` are removed first: the table
    reads every round file there."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    os.makedirs(folder, exist_ok=True)
    for _, _, path in side_by_side.round_files(folder):
        os.remove(path)
    for rnd in range(1, rounds + 1):
        for side, (label, cache) in zip(side_by_side.SIDES, choices, strict=True):
            print(f"== round {rnd}: {label} ({side})", flush=True)
            env = {k: v for k, v in os.environ.items() if k != tc.CACHE_ENV}
            if cache is not None:
                env[tc.CACHE_ENV] = cache
            try:
                runner([*command, "--json", os.path.join(folder, f"{side}_{rnd}.json")], env=env, timeout=timeout,
                       check=False)
            except subprocess.TimeoutExpired:  # that round's file is missing: the table leaves the round out
                print(f"== round {rnd}: {label} ran past {timeout:g} s", flush=True)
    labels = [label for label, _ in choices]
    return side_by_side.table(side_by_side.read_rounds(folder), sides=f"{labels[0]}, then {labels[1]}")


def run_rounds(gemm: str, rows: float, tiles: Sequence[str], rounds: int, command: Sequence[str], folder: str,
               device: str, *, timeout: float = 300.0, runner: Runner = subprocess.run) -> list[str]:
    """Two tiles of one GEMM: :func:`run_choices` on two one-point caches, ``gemm``'s ``tiles`` at
    ``rows`` per expert for GPU model ``device``, written into ``folder``."""
    if len(tiles) != 2 or tiles[0] == tiles[1]:
        raise ValueError(f"tiles must be two different tiles, got {list(tiles)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    os.makedirs(folder, exist_ok=True)
    choices = []
    for side, tile in zip(side_by_side.SIDES, tiles, strict=True):
        path = os.path.join(folder, f"tiles_{side}.json")
        write_cache(path, device, gemm, rows, tile)
        choices.append((tile, path))
    return run_choices(choices, rounds, command, folder, timeout=timeout, runner=runner)


def run_caches(caches: Sequence[str], rounds: int, command: Sequence[str], folder: str, device: str, *,
               timeout: float = 300.0, runner: Runner = subprocess.run) -> list[str]:
    """Two whole tile caches: :func:`run_choices` on ``caches`` (file paths, or :data:`SHIPPED`),
    each checked to be a tile cache of GPU model ``device`` (another GPU's would be ignored)."""
    if len(caches) != 2 or caches[0] == caches[1]:
        raise ValueError(f"caches must be two different tile caches, got {list(caches)}")
    choices = []
    for cache in caches:
        if cache == SHIPPED:
            choices.append(("the shipped tiles", None))
            continue
        try:
            found = tc.load(cache, TILES).device
        except OSError as err:
            raise ValueError(f"tile cache {cache}: {err.strerror or err}") from err
        if found != device:
            raise ValueError(f"tile cache {cache} holds tiles of {found}, not this {device}: it would not be read")
        choices.append((os.path.basename(cache), os.path.abspath(cache)))
    return run_choices(choices, rounds, command, folder, timeout=timeout, runner=runner)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("tile_rounds: give the bench command after --", file=sys.stderr)
        return 2
    cut = argv.index("--")
    own, command = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("point", nargs="*", metavar="GEMM ROWS TILE TILE",
                   help="the GEMM's key (kind/E/N/K), the point's rows per expert (T * k / E of the command's T), "
                        "the base tile and the new one")
    p.add_argument("--caches", nargs=2, metavar=("BASE", "NEW"),
                   help=f"two whole tile caches instead (a file, or {SHIPPED!r}: the shipped tiles alone)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="/tmp/tile_rounds", help="the folder for the caches and the rounds")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per run of the command")
    args = p.parse_args(own)
    if not command:
        p.error("no bench command after --")
    if args.caches and args.point:
        p.error("give either GEMM ROWS TILE TILE or --caches BASE NEW, not both")
    if not args.caches:
        if len(args.point) != 4:
            p.error(f"wants GEMM ROWS TILE TILE, got {args.point}")
        gemm, rows, *tiles = args.point
        try:
            rows = float(rows)
        except ValueError:
            p.error(f"ROWS must be a number of rows per expert, got {rows!r}")
        unknown = [t for t in tiles if t not in TILES]
        if unknown:
            p.error(f"unknown tile(s) {unknown} (have {sorted(TILES)})")
    from jax_moe.device import device_kind  # noqa: PLC0415  (initializes JAX: after the arguments are checked)

    try:
        if args.caches:
            lines = run_caches(args.caches, args.rounds, command, args.out, device_kind(), timeout=args.timeout)
        else:
            lines = run_rounds(gemm, rows, tiles, args.rounds, command, args.out, device_kind(), timeout=args.timeout)
    except ValueError as err:
        print(f"tile_rounds: {err}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
