"""Tuned tiles: a JSON file of the cutlass backend's tile per GEMM, measured on one GPU model.

The tile table shipped in :mod:`jax_moe.backends.cutlass_tiles` covers the bench's four models on
an H100. Any other layer shape, or another GPU, falls back to a rows-per-expert heuristic.
:func:`jax_moe.autotune.tune` times every tile on a layer's own GEMMs on this GPU and writes
what it found here; :func:`~jax_moe.backends.cutlass_tiles.pick_tile` then reads it first.

A cache is used where ``JAX_MOE_TILE_CACHE`` names its file, or after :func:`use`. It applies
only on the GPU model it was measured on (its ``"device"``, ``jax.Device.device_kind``); on
another, the tiles that ship decide.

Caches also ship with the package, one per GPU model, in ``jax_moe/backends/tuned_tiles/``
(:func:`shipped`): ``bench/tune_models.py`` tunes popular models' layer shapes into them, and a few
points come from longer runs of two tiles side by side, where the tuner's one confirmation trial
could not tell them apart (``bench/RESULTS.md`` names them, with their figures). They are
read after the user's cache and before the table measured for the bench's models, on their own
GPU model only; ``JAX_MOE_SHIPPED_TILES=off`` sets them aside. The file::

    {"format": "jax_moe.cutlass_tiles/1",
     "device": "NVIDIA H100 80GB HBM3",
     "gemms":   {"bf16_kn_act/160/3072/5120": {"4": "pingpong_64x128", "32": "pingpong_64x256"}},
     "figures": {"bf16_kn_act/160/3072/5120": {"4": {"pingpong_64x128": 0.41, ...}, ...}}}

A GEMM is keyed ``"kind/E/N/K"`` (:func:`gemm_key`: the kind the forward asks for, ``"_act"``
for GEMM1 with its activation; N and K of ``d [M, N] = a [M, K] @ w[e]`` whatever the weight
layout); under it, per average rows per expert, the chosen tile. The nearest point on a log
scale answers (:func:`nearest`), as for the shipped table, but only within :data:`REACH` times
the tuned range: further out the next source of tiles decides (a tile that won at 256 rows per
expert need not win at 1024, where a 128x256 tile usually does). ``"figures"`` keeps the milliseconds
each choice came from (the forward's device time per call with that GEMM on that tile), so a
cache can be read, diffed and shipped as a record of what was measured. A cell of figures may also
stand where no tile is picked: a shipped ``coop_192x256`` pick runs below
``cutlass_tiles.ROW_BLOCK_TILE_FROM_ROWS`` rows per expert as the fastest other tile of the cell
nearest those rows (:meth:`TileCache.runner_up`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterable, Mapping

FORMAT = "jax_moe.cutlass_tiles/1"
CACHE_ENV = "JAX_MOE_TILE_CACHE"
SHIPPED_ENV = "JAX_MOE_SHIPPED_TILES"  # "off": the shipped caches are not read
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned_tiles")

Points = tuple[tuple[float, str], ...]  # (rows per expert, tile), increasing rows per expert
# A tuned GEMM's points answer for rows per expert at most this factor below its smallest point or
# above its largest. On an H200, tiles tuned up to 4096 tokens and carried to 16384 cost
# Qwen3-30B-A3B's forward 10% (GEMM1 kept pingpong_64x256 from 256 rows per expert to 1024, where
# coop_128x256 wins) and GPT-OSS-120B's 5% (GEMM2 kept it from 128 rows to 512).
REACH = 2.0


def gemm_key(kind: str, num_groups: int, n: int, k: int) -> str:
    """``"kind/E/N/K"``: one grouped GEMM shape of one kind (the tile sweep's figures use it too)."""
    return f"{kind}/{int(num_groups)}/{int(n)}/{int(k)}"


def split_gemm_key(key: str) -> tuple[str, int, int, int]:
    """``(kind, E, N, K)`` of a :func:`gemm_key`; ValueError where ``key`` is not ``"kind/E/N/K"``
    with positive integer E, N and K."""
    parts = key.split("/")
    if len(parts) != 4 or not parts[0] or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        raise ValueError(f"GEMM key {key!r} is not \"kind/E/N/K\"")
    return parts[0], int(parts[1]), int(parts[2]), int(parts[3])


def rows_key(rows_per_expert: float) -> str:
    """A point's rows per expert as the file keys it (``"128"``, ``"0.5"``), in ``gemms`` and ``figures``."""
    return f"{rows_per_expert:g}"


def nearest_point(points: Points, rows_per_expert: float) -> tuple[float, str]:
    """The point (rows per expert, tile) nearest ``rows_per_expert`` on a log scale (the first on a tie)."""
    x = math.log2(max(rows_per_expert, 1e-6))
    return min(points, key=lambda p: abs(math.log2(p[0]) - x))


def nearest(points: Points, rows_per_expert: float) -> str:
    """The tile of the point nearest ``rows_per_expert`` on a log scale (the first on a tie)."""
    return nearest_point(points, rows_per_expert)[1]


def choose(cell: Mapping[str, float], default: str, min_gain: float) -> str:
    """The tile to keep from one GEMM's timings ``cell`` (tile -> ms): the fastest where it beats
    ``default`` by more than ``min_gain`` (or ``default`` was not timed), else ``default``: a
    choice inside the timer's spread is not a choice."""
    best = min(cell, key=cell.get)
    if default not in cell or cell[default] > cell[best] * (1 + min_gain):
        return best
    return default


@dataclasses.dataclass
class TileCache:
    """Tuned tiles of one GPU model: ``gemms`` gemm_key -> :data:`Points`; ``figures`` gemm_key ->
    rows per expert (as written) -> tile -> ms."""

    device: str
    gemms: dict[str, Points] = dataclasses.field(default_factory=dict)
    figures: dict[str, dict[str, dict[str, float]]] = dataclasses.field(default_factory=dict)

    def record(self, key: str, rows_per_expert: float, tile: str, cell: Mapping[str, float],
               merge: bool = False) -> None:
        """Keep ``tile`` for GEMM ``key`` at ``rows_per_expert`` (replacing a point there) and its timings
        ``cell`` (tile -> ms); ``merge``: the point's earlier timings of tiles not in ``cell`` stay."""
        points = {r: t for r, t in self.gemms.get(key, ()) if r != rows_per_expert}
        points[float(rows_per_expert)] = tile
        self.gemms[key] = tuple(sorted(points.items()))
        cells = self.figures.setdefault(key, {})
        earlier = cells.get(rows_key(rows_per_expert), {}) if merge else {}
        cells[rows_key(rows_per_expert)] = {**earlier, **{t: float(ms) for t, ms in cell.items()}}

    def tile_for(self, key: str, rows_per_expert: float) -> str | None:
        """The tile of GEMM ``key``'s nearest point, or None where it has no points within
        :data:`REACH` of ``rows_per_expert``."""
        points = self.gemms.get(key)
        if not points or not points[0][0] / REACH <= rows_per_expert <= points[-1][0] * REACH:
            return None
        return nearest(points, rows_per_expert)

    def runner_up(self, key: str, rows_per_expert: float, tile: str) -> str | None:
        """The fastest tile other than ``tile`` in GEMM ``key``'s figures nearest ``rows_per_expert``
        (on a log scale; a cell of figures may stand at rows per expert where no tile is picked,
        to give the runner-up there), or None where they time no other."""
        cells = self.figures.get(key, {})
        if not cells:
            return None
        _, r = nearest_point(sorted((float(rows), rows) for rows in cells), rows_per_expert)
        cell = {t: ms for t, ms in cells[r].items() if t != tile}
        return min(cell, key=cell.get) if cell else None

    def to_json(self) -> dict:
        return {"format": FORMAT, "device": self.device,
                "gemms": {k: {rows_key(r): t for r, t in pts} for k, pts in sorted(self.gemms.items())},
                "figures": {k: self.figures[k] for k in sorted(self.figures)}}

    def save(self, path: str | os.PathLike) -> None:
        """Writes the file (atomically: a reader never sees half of it)."""
        path = os.fspath(path)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")
        os.replace(tmp, path)


def from_json(doc: Mapping, where: str, tiles: Iterable[str]) -> TileCache:
    """A :class:`TileCache` from a parsed file; ValueError naming ``where`` and what is wrong."""
    tiles = set(tiles)
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not a jax_moe tile cache (wants \"format\": {FORMAT!r})")
    device, gemms = doc.get("device"), doc.get("gemms", {})
    if not isinstance(device, str) or not device:
        raise ValueError(f"{where}: \"device\" must name the GPU model the tiles were measured on")
    cache = TileCache(device)
    for key, points in gemms.items():
        try:
            split_gemm_key(key)
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        try:
            pts = tuple(sorted((float(r), t) for r, t in points.items()))
        except (AttributeError, ValueError) as err:
            raise ValueError(f"{where}: {key}: wants {{rows per expert: tile}}, got {points!r}") from err
        for r, t in pts:
            if not (r > 0 and math.isfinite(r)):
                raise ValueError(f"{where}: {key}: rows per expert must be positive, got {r}")
            if t not in tiles:
                raise ValueError(f"{where}: {key}: tile {t!r} is not built (have {sorted(tiles)})")
        cache.gemms[key] = pts
    cache.figures = {k: dict(v) for k, v in doc.get("figures", {}).items()}
    return cache


def load(path: str | os.PathLike, tiles: Iterable[str]) -> TileCache:
    """The cache in ``path``; ValueError naming the file when it is not one."""
    path = os.fspath(path)
    try:
        with open(path) as f:
            doc = json.load(f)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON ({err})") from err
    return from_json(doc, path, tiles)


# ----------------------------------------------------------------------------- the active cache

_used: dict = {"path": None}  # set by use(); else the environment decides
_loaded: dict = {}  # path -> (mtime, TileCache)


def use(path: str | os.PathLike | None) -> None:
    """Read tuned tiles from ``path`` from now on in this process (it overrides
    ``JAX_MOE_TILE_CACHE``); ``None`` goes back to the environment. Programs already jitted keep
    the tiles they were traced with."""
    _used["path"] = None if path is None else os.fspath(path)


def active_path() -> str | None:
    """The file tuned tiles are read from: :func:`use`'s, else ``JAX_MOE_TILE_CACHE``'s, else None."""
    return _used["path"] or os.environ.get(CACHE_ENV) or None


def active(tiles: Iterable[str]) -> TileCache | None:
    """The active cache (re-read when its file changes), or None when no file is named. A named
    file that is missing or malformed is a ValueError: a cache asked for is never skipped silently."""
    path = active_path()
    if path is None:
        return None
    try:
        mtime = os.stat(path).st_mtime_ns
    except FileNotFoundError as err:
        raise ValueError(f"{CACHE_ENV} / jax_moe.autotune.use names {path}, which does not exist") from err
    hit = _loaded.get(path)
    if hit is None or hit[0] != mtime:
        hit = (mtime, load(path, tiles))
        _loaded[path] = hit
    return hit[1]


# ----------------------------------------------------------------------------- the shipped caches

_shipped: dict = {}  # (directory, tiles) -> {device: TileCache}


def shipped_file_name(device: str) -> str:
    """The file a GPU model's shipped cache is kept in: ``"NVIDIA H100 80GB HBM3"`` ->
    ``nvidia_h100_80gb_hbm3.json`` (what is read is each file's ``"device"``, not its name)."""
    return "".join(c if c.isalnum() else "_" for c in device.lower()).strip("_") + ".json"


def shipped_caches(tiles: Iterable[str], directory: str | None = None) -> dict[str, TileCache]:
    """Every cache in ``directory`` (default :data:`SHIPPED_DIR`), by GPU model. Read once per
    process; a malformed file, or two for one GPU model, is a ValueError naming them."""
    directory = directory or SHIPPED_DIR
    tiles = tuple(sorted(tiles))
    hit = _shipped.get((directory, tiles))
    if hit is None:
        hit = {}
        names = sorted(n for n in os.listdir(directory) if n.endswith(".json")) if os.path.isdir(directory) else []
        for name in names:
            cache = load(os.path.join(directory, name), tiles)
            if cache.device in hit:
                raise ValueError(f"{directory}: two shipped tile caches for {cache.device} ({name} and another)")
            hit[cache.device] = cache
        _shipped[(directory, tiles)] = hit
    return hit


def shipped(device: str, tiles: Iterable[str]) -> TileCache | None:
    """The shipped cache of GPU model ``device``, or None: none ships for it, or
    ``JAX_MOE_SHIPPED_TILES=off``."""
    if os.environ.get(SHIPPED_ENV, "").lower() in ("off", "0", "false", "no"):
        return None
    return shipped_caches(tiles).get(device)
