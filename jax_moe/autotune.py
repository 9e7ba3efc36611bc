"""Tune the cutlass backend's tiles for your own layers on your own GPU, and ship the result.

The cutlass backend picks each grouped GEMM's CUTLASS tile at trace time: from the tuned tiles
shipped for popular layers on this GPU model, else from a table measured on an H100 for the
bench's models, else from a rows-per-expert heuristic (:mod:`jax_moe.backends.cutlass_tiles`).
:func:`tune` times a layer's forward with each GEMM on each tile, at the token counts you serve,
and writes the tiles that win to a cache file (:mod:`jax_moe.backends.cutlass_tile_cache`) that
later traces read first on the same GPU model::

    block = MoEBlock.from_pretrained("/models/GLM-4.5-Air", layer=1)
    block.prepare()
    report = jax_moe.autotune.tune(block, tokens=(16, 64, 256, 1024, 4096), path="tiles.json")
    print(report.markdown())
    jax_moe.autotune.use("tiles.json")   # or JAX_MOE_TILE_CACHE=tiles.json; then jit as usual

From the shell, on random weights of a model's shapes (no checkpoint is read)::

    python -m jax_moe.autotune --config /models/GLM-4.5-Air --layer 1 --out tiles.json
    python -m jax_moe.autotune --shape 160 5120 1536 8 --scheme fp8 --out tiles.json
    python -m jax_moe.autotune --shape 128 2880 2880 4 --tiles coop_192x256 pingpong_192x128 --out tiles.json

How: at each token count, the layer's forward is traced once to find its grouped GEMMs and the
tiles they pick today; then, one GEMM at a time, the forward is timed with that GEMM on each
other tile (device time per call: :func:`jax_moe.timing.loop_ms`, calls in a jitted loop, each on
the next of ``routings`` random softmax top-k routings). A tile replaces today's pick only where
the forward is faster by more than ``min_gain``; then the forward with every chosen tile is timed
against today's once more, and where it is not faster by more than ``min_gain`` too (two trials'
gains inside the timer's spread, measured at 4-7% per trial on an H200), today's picks are kept
for that token count. With ``rounds`` (``--rounds``) above one, that confirmation alternates today's
forward and the tuned one that many times and keeps the tiles where the median of the rounds'
ratios beats ``min_gain``: alternation lays a drift of the GPU's clock on both sides, so a smaller
``min_gain`` can go with it. Each GEMM's choice is made the same way first: where the fastest other
tile's one trial is within ``RUNOFF_WITHIN`` of today's pick, either side of it (inside one
timing's spread), the two run off in ``rounds`` alternations, and the median ratio decides.
What is written is the tile per GEMM at that token count's rows per expert; other token counts
take the nearest point on a log scale, up to twice as many or half as many rows per expert as any
tuned (beyond that, the shipped tiles and the heuristic decide: tune the token counts you serve).
Token counts on the decode path (a few slots, no grouped GEMM) have nothing to tune. Training's
backward GEMMs keep the shipped picks. ``tiles`` (``--tiles``) times today's picks against those
tiles alone, where a GEMM's kind has a kernel for them: the way to place a new tile in a file
already tuned, at a fraction of a full sweep's timings; the file's earlier figures of the other
tiles stay beside the new ones.
``bench/tune_models.py`` runs this over popular layers' shapes to write the shipped tiles.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jax_moe.backends import cutlass_tile_cache
from jax_moe.backends.cutlass_scatter_gemm import FINALIZE_ENV
from jax_moe.backends.cutlass_tile_cache import TileCache, choose
from jax_moe.backends.cutlass_tiles import MIN_GAIN, TILE_ENV, TILES, tiles_for, tuning
from jax_moe.config import MoEConfig
from jax_moe.device import device_kind
from jax_moe.timing import loop_ms

DEFAULT_TOKENS = (16, 64, 256, 1024, 4096)
# With rounds > 1: a GEMM's fastest other tile runs off against today's pick in rounds when their
# single trials are closer than this, either way. One trial's spread is 4-7% on an H200; on one
# GEMM (GPT-OSS-120B's FP8 GEMM1 at 128 rows per expert) a trial 2.7% slower was 5% faster in
# rounds in a loop of layers.
RUNOFF_WITHIN = 0.08
use = cutlass_tile_cache.use  # read tuned tiles from a file from now on (None: JAX_MOE_TILE_CACHE)

# forward(weights, x [T, H], topk_weights [T, k] float32, topk_ids [T, k] int32) -> [T, H]
Forward = Callable[[object, jax.Array, jax.Array, jax.Array], jax.Array]
# timer(jitted fn, argument sets, index of the argument that varies per call) -> ms per call
Timer = Callable[[Callable, list[tuple], int], float]


@dataclasses.dataclass(frozen=True)
class TunedGemm:
    """One GEMM at one token count: today's pick and the tile kept, with every tile's forward ms."""

    tokens: int
    key: str  # "kind/E/N/K"
    rows_per_expert: float
    default: str
    chosen: str
    cell: dict[str, float]

    @property
    def gain(self) -> float:
        """Forward time on today's pick over forward time on the tile kept (1.0: kept today's)."""
        return self.cell[self.default] / self.cell[self.chosen]


@dataclasses.dataclass(frozen=True)
class TunedForward:
    """The whole forward at one token count (ms per call): on today's picks and on every GEMM's
    fastest tile (with one confirmation round: today's the faster of two timings, before and after
    the trials; with more: each side's median over the rounds); ``kept``: whether those tiles were
    kept (the forward on them faster by more than ``min_gain``)."""

    tokens: int
    default_ms: float
    tuned_ms: float
    kept: bool


@dataclasses.dataclass
class Report:
    """What :func:`tune` measured and kept; ``cache`` as written to ``path`` (None: not written)."""

    device: str
    gemms: list[TunedGemm]
    forwards: list[TunedForward]
    cache: TileCache
    path: str | None

    def markdown(self) -> str:
        lines = [f"Tiles tuned on {self.device}" + (f", written to {self.path}" if self.path else ""), "",
                 "| T | GEMM | rows per expert | today's tile | ms | tuned tile | ms | gain |",
                 "|---|---|---|---|---|---|---|---|"]
        for g in self.gemms:
            lines.append(f"| {g.tokens} | {g.key} | {g.rows_per_expert:g} | {g.default} | {g.cell[g.default]:.4f} | "
                         f"{g.chosen} | {g.cell[g.chosen]:.4f} | {g.gain:.2f}x |")
        lines += ["", "| T | forward, today's tiles ms | forward, fastest tiles ms | gain | kept |",
                  "|---|---|---|---|---|"]
        lines += [f"| {f.tokens} | {f.default_ms:.4f} | {f.tuned_ms:.4f} | {f.default_ms / f.tuned_ms:.2f}x | "
                  f"{'yes' if f.kept else 'no'} |" for f in self.forwards]
        tiles = sorted({tile for g in self.gemms for tile in g.cell})
        lines += ["", "Forward ms with each GEMM on each tile (the others on today's picks):", "",
                  "| T | GEMM | " + " | ".join(tiles) + " |", "|---|---|" + "---|" * len(tiles)]
        lines += [f"| {g.tokens} | {g.key} | " + " | ".join(f"{g.cell[t]:.4f}" if t in g.cell else "-" for t in tiles)
                  + " |" for g in self.gemms]
        return "\n".join(lines)


def _routed(cfg: MoEConfig, t: int, routings: int, dtype) -> tuple[jax.Array, list[tuple[jax.Array, jax.Array]]]:
    """x [T, H] and ``routings`` random softmax top-k routings ((topk_weights, topk_ids) [T, k])."""
    from jax_moe.routing import select_experts  # noqa: PLC0415  (routing imports the kernels)

    x = jax.random.normal(jax.random.key(t), (t, cfg.hidden_size), dtype)
    routes = [select_experts(jax.random.normal(jax.random.key(1000 * t + s), (t, cfg.num_experts), jnp.float32),
                             cfg.top_k) for s in range(routings)]
    return x, routes


def _timed(forward: Forward, weights, x, routes, tiles: dict[str, str], timer: Timer) -> float:
    """ms per call of the forward traced with ``tiles`` forced (:func:`cutlass_tiles.tuning`).
    RuntimeError if a forced GEMM was not traced with its tile (a cached trace)."""
    with tuning(tiles) as trial:
        fn = jax.jit(lambda w, v, route: forward(w, v, *route))
        ms = timer(fn, [(weights, x, r) for r in routes], 2)
    used = {key: tile for key, _, tile in trial.picks}
    if any(used.get(key) != tile for key, tile in tiles.items()):
        raise RuntimeError(f"the forward was not traced with the tiles tried ({tiles}; traced: {used})")
    return ms


def _confirm(base_ms: float, time_today: Callable[[], float], time_tuned: Callable[[], float], rounds: int,
             min_gain: float) -> tuple[float, float, bool]:
    """Today's forward ms, the tuned forward's, and whether the tuned tiles are faster by more than
    ``min_gain``. One round: the tuned forward once, against the faster of today's ``base_ms``
    (timed before the trials) and one timing after. More rounds: today's and the tuned forward
    timed alternately, back to back, so that a drift of the GPU's clock falls on both; kept where
    the median of the rounds' ratios (today's over the tuned) exceeds 1 + ``min_gain``; the ms
    reported are each side's median."""
    if rounds == 1:
        tuned_ms = time_tuned()
        default_ms = min(base_ms, time_today())
        return default_ms, tuned_ms, tuned_ms * (1 + min_gain) < default_ms
    today, tuned = [], []
    for _ in range(rounds):
        today.append(time_today())
        tuned.append(time_tuned())
    ratio = statistics.median(a / b for a, b in zip(today, tuned, strict=True))
    return statistics.median(today), statistics.median(tuned), ratio > 1 + min_gain


def _runoff(cell: dict[str, float], default: str, time_on: Callable[[str], float], rounds: int,
            min_gain: float) -> tuple[str, bool]:
    """The tile kept for one GEMM from its trials ``cell`` (tile -> forward ms, today's pick
    ``default`` among them). One round: :func:`choose`. More: the fastest other tile, where its trial
    is within :data:`RUNOFF_WITHIN` of today's either way, is timed against today's pick in ``rounds``
    alternations (``time_on(tile)``: the forward's ms with this GEMM on ``tile``) and kept where the
    median ratio beats ``min_gain``; both entries of ``cell`` become the rounds' medians. A gap wider
    than that is taken from the trials. Returns the tile and whether the two ran off."""
    others = [t for t in cell if t != default]
    other = min(others, key=cell.get) if others else None
    if rounds == 1 or other is None or abs(cell[other] / cell[default] - 1) > RUNOFF_WITHIN:
        return choose(cell, default, min_gain), False
    today_ms, other_ms, wins = _confirm(cell[default], lambda: time_on(default), lambda: time_on(other), rounds,
                                        min_gain)
    cell[default], cell[other] = today_ms, other_ms
    return (other if wins else default), True


def tune_forward(forward: Forward, weights, cfg: MoEConfig, tokens: Sequence[int] = DEFAULT_TOKENS, *,
                 path: str | os.PathLike | None = None, min_gain: float = MIN_GAIN, routings: int = 3,
                 rounds: int = 1, tiles: Sequence[str] | None = None, dtype=jnp.bfloat16,
                 timer: Timer | None = None, log: Callable[[str], None] | None = print) -> Report:
    """:func:`tune` on any forward ``forward(weights, x, topk_weights, topk_ids)`` of layer ``cfg``
    whose grouped GEMMs pick their tiles through :func:`jax_moe.backends.cutlass_tiles.pick_tile`
    (``weights``: a pytree, an argument of the jitted program, not a constant folded into it)."""
    if os.environ.get(TILE_ENV):
        raise ValueError(f"{TILE_ENV} forces one tile everywhere; unset it to tune")
    if min_gain < 0:
        raise ValueError(f"min_gain must be >= 0, got {min_gain}")
    if routings < 1:
        raise ValueError(f"routings must be >= 1, got {routings}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds must be a positive int, got {rounds!r}")
    bad = [t for t in tokens if not isinstance(t, int) or t < 1]
    if bad or not tokens:
        raise ValueError(f"tokens must be positive token counts, got {list(tokens)}")
    if tiles is not None and (isinstance(tiles, str) or not tiles or any(t not in TILES for t in tiles)):
        raise ValueError(f"tiles must be a non-empty list of the cutlass tiles {list(TILES)}, got {tiles!r}")
    timer = timer or (lambda fn, inputs, vary: loop_ms(fn, inputs, vary))
    say = log or (lambda _: None)
    device = device_kind()
    cache = TileCache(device)
    if path is not None and os.path.exists(path):
        cache = cutlass_tile_cache.load(path, TILES)
        if cache.device != device:
            raise ValueError(f"{path} holds tiles measured on {cache.device}, not this {device}: write another file")
    gemms, forwards = [], []
    for t in sorted(set(tokens)):
        x, routes = _routed(cfg, t, routings, dtype)
        with tuning() as probe:
            jax.eval_shape(lambda w, v, route: forward(w, v, *route), weights, x, routes[0])
        today = {key: (r, tile) for key, r, tile in probe.picks}
        if not today:
            say(f"# T={t}: no grouped GEMM (the decode path): nothing to tune")
            continue

        def forward_ms(tiles: dict[str, str], x=x, routes=routes) -> float:  # today's picks but ``tiles``
            return _timed(forward, weights, x, routes, tiles, timer)

        base_ms = forward_ms({})
        cells = {}
        for key, (r, tile) in today.items():
            cells[key] = {tile: base_ms}
            for other in tiles_for(cutlass_tile_cache.split_gemm_key(key)[0]):  # those with a kernel of their own
                if other != tile and (tiles is None or other in tiles):
                    cells[key][other] = forward_ms({key: other})
        picks = {key: tile for key, (_, tile) in today.items()}
        chosen, ran_off = {}, set()
        for key in today:
            chosen[key], ran = _runoff(cells[key], picks[key], lambda tile, key=key: forward_ms({key: tile}), rounds,
                                       min_gain)
            if ran:
                ran_off.add(key)
        default_ms = tuned_ms = base_ms
        if chosen != picks:  # the forward on every chosen tile, and on today's once more, must confirm
            default_ms, tuned_ms, confirmed = _confirm(base_ms, lambda: forward_ms({}), lambda: forward_ms(chosen),
                                                       rounds, min_gain)
            if not confirmed:
                chosen = picks
        for key, (r, tile) in today.items():
            g = TunedGemm(t, key, r, tile, chosen[key], cells[key])
            cache.record(key, r, g.chosen, g.cell, merge=tiles is not None)
            gemms.append(g)
            every = ", ".join(f"{other} {ms:.4f}" for other, ms in g.cell.items())
            runoff = f"; {tile} and the next fastest: medians of {rounds} rounds" if key in ran_off else ""
            say(f"# T={t} {key} ({r:g} rows per expert): {tile} {g.cell[tile]:.4f} ms -> "
                f"{g.chosen} {g.cell[g.chosen]:.4f} ms ({every}{runoff})")
        forwards.append(TunedForward(t, default_ms, tuned_ms, chosen != picks))
        say(f"# T={t}: forward {default_ms:.4f} ms on today's tiles, {tuned_ms:.4f} ms on the fastest: "
            + ("those kept" if chosen != picks else "today's kept"))
    if path is not None:
        cache.save(path)
    return Report(device, gemms, forwards, cache, None if path is None else os.fspath(path))


def tune(block, tokens: Sequence[int] = DEFAULT_TOKENS, *, path: str | os.PathLike | None = None,
         min_gain: float = MIN_GAIN, routings: int = 3, rounds: int = 1, tiles: Sequence[str] | None = None,
         timer: Timer | None = None, log: Callable[[str], None] | None = print) -> Report:
    """Times ``block``'s routed experts (a :class:`jax_moe.MoEBlock`, as it will run: quantized
    and prepared or not) with each grouped GEMM on each cutlass tile, at each of ``tokens``
    tokens, on this GPU; keeps a tile only where the forward is faster than today's pick by more
    than ``min_gain``, in the whole forward's confirmation too (``rounds`` > 1: that many rounds of
    today's and the tuned forward back to back, their median ratio deciding: the way to keep gains
    smaller than one timing's spread, with a smaller ``min_gain``; a GEMM's two closest tiles run
    off the same way first, :data:`RUNOFF_WITHIN`); ``tiles``: today's picks against those tiles alone
    (None: every tile a GEMM's kind has a kernel for); writes the tiles to ``path``
    (JSON; tiles of other GEMMs already there are kept; None: not written). Returns the
    :class:`Report` (``report.markdown()`` prints it).

    Raises ValueError when the block's experts do not run on the ``cutlass`` backend (tiles are
    its), when ``JAX_MOE_CUTLASS_TILE`` forces a tile, or when ``path`` holds another GPU's tiles."""
    from flax import nnx  # noqa: PLC0415

    from jax_moe import oracle  # noqa: PLC0415

    backend = block.prepared_backend
    if backend is None:
        quant = None if block.quant is None else block.quant.get_value()
        backend = oracle.select_backend(block.config, quant, backend=block.backend).name
    if backend != "cutlass":
        raise ValueError(f"this block's experts run on {backend!r}; tiles are the 'cutlass' backend's "
                         "(prepare('cutlass'), or build the block with backend='cutlass')")
    graphdef, state = nnx.split(block)

    def forward(w, x, topk_weights, topk_ids):
        return nnx.merge(graphdef, w)._run_experts(x, topk_weights, topk_ids)

    return tune_forward(forward, state, block.config, tokens, path=path, min_gain=min_gain, routings=routings,
                        rounds=rounds, tiles=tiles, dtype=block.dtype, timer=timer, log=log)


# ----------------------------------------------------------------------------- command line


def random_block(cfg: MoEConfig, scheme: str = "bf16", seed: int = 0):
    """A :class:`jax_moe.MoEBlock` of ``cfg``'s shapes on random bf16 weights (fan-in scaled, made
    on the device in bf16), quantized to ``scheme`` (``"fp8"``: per-expert weight scales and static
    activation scales, the cutlass FP8 path's fused form) and prepared for the cutlass backend."""
    from jax_moe.checkpoint.readers import ExpertWeights, LayerTensors  # noqa: PLC0415
    from jax_moe.nn import MoEBlock  # noqa: PLC0415

    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    k13, k2, kr = jax.random.split(jax.random.key(seed), 3)
    w13 = (jax.random.normal(k13, (e, cfg.w13_rows, h), jnp.bfloat16) * h ** -0.5).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (e, h, i), jnp.bfloat16) * i ** -0.5).astype(jnp.bfloat16)
    t = LayerTensors(ExpertWeights(w13, w2), router=jax.random.normal(kr, (e, h), jnp.float32) * h ** -0.5,
                     activation=cfg.activation, gate_up_layout=cfg.gate_up_layout, top_k=cfg.top_k)
    block = MoEBlock.from_layer_tensors(t, backend="cutlass")
    if scheme == "fp8":
        block.quantize("fp8", act="fp8_per_tensor", a13_scale=4.0 / 448, a2_scale=1.0 / 448)
    elif scheme != "bf16":
        raise ValueError(f"scheme must be 'bf16' or 'fp8' (the cutlass backend's), got {scheme!r}")
    block.prepare("cutlass")
    return block


def config_from_file(path: str, layer: int) -> MoEConfig:
    """The routed experts' :class:`MoEConfig` of MoE layer ``layer`` of a Hugging Face
    ``config.json`` (or the directory holding it)."""
    from jax_moe.checkpoint.families import spec_from_config  # noqa: PLC0415

    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        spec = spec_from_config(json.load(f), layer)
    missing = [n for n in ("num_experts", "top_k", "hidden_size", "intermediate_size") if getattr(spec, n) is None]
    if missing:
        raise ValueError(f"{path} does not give the {', '.join(missing)} of layer {layer}: pass --shape E H I k")
    layout = "interleaved" if spec.activation == "swigluoai" else "concat"
    return MoEConfig(spec.num_experts, spec.top_k, spec.hidden_size, spec.intermediate_size, spec.activation,
                     layout, swiglu_limit=spec.swiglu_limit)


def main(argv: Sequence[str] | None = None) -> Report:
    p = argparse.ArgumentParser(prog="python -m jax_moe.autotune", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="a Hugging Face config.json, or the model directory holding it")
    src.add_argument("--shape", nargs=4, type=int, metavar=("E", "H", "I", "K"),
                     help="experts, hidden size, intermediate size, top-k")
    p.add_argument("--layer", type=int, default=None, help="with --config: the MoE layer (default: the last)")
    p.add_argument("--activation", default="silu", help="with --shape: the experts' activation")
    p.add_argument("--scheme", choices=("bf16", "fp8"), default="bf16")
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    p.add_argument("--min-gain", type=float, default=MIN_GAIN)
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of each GEMM's run-off between its two closest tiles and of the whole forward's "
                        "confirmation, the two sides back to back (more than 1: their median ratio decides; "
                        "pair it with a smaller --min-gain)")
    p.add_argument("--tiles", nargs="+", choices=TILES, default=None, metavar="TILE",
                   help="time today's picks against these tiles alone (default: every tile; the file's figures "
                        f"of the others stay): {', '.join(TILES)}")
    p.add_argument("--finalize", choices=("gather", "scatter"), default=None,
                   help="how the tuned forward sums each token's rows (sets JAX_MOE_CUTLASS_FINALIZE in this "
                        "process; default: what finalize='auto' takes here, the scatter unless the environment "
                        "asks for determinism): scatter tunes GEMM2 with its scatter epilogue")
    p.add_argument("--out", default=os.environ.get(cutlass_tile_cache.CACHE_ENV) or "jax_moe_tiles.json",
                   help="the cache file to write (default: $JAX_MOE_TILE_CACHE, else ./jax_moe_tiles.json)")
    args = p.parse_args(argv)
    try:
        if args.config:
            layer = args.layer
            if layer is None:
                cfg_path = os.path.join(args.config, "config.json") if os.path.isdir(args.config) else args.config
                with open(cfg_path) as f:
                    layer = int(json.load(f).get("num_hidden_layers", 1)) - 1
            cfg = config_from_file(args.config, layer)
        else:
            e, h, i, k = args.shape
            cfg = MoEConfig(e, k, h, i, args.activation)
    except (OSError, ValueError) as err:
        p.error(str(err))
    if args.finalize is not None:
        os.environ[FINALIZE_ENV] = args.finalize  # read when the forward is traced
    print(f"# {device_kind()}: E={cfg.num_experts} H={cfg.hidden_size} I={cfg.intermediate_size} k={cfg.top_k} "
          f"{cfg.activation} {args.scheme}, T={args.tokens}"
          f"{'' if args.finalize is None else f', finalize={args.finalize}'}")
    try:
        report = tune(random_block(cfg, args.scheme), args.tokens, path=args.out, min_gain=args.min_gain,
                      rounds=args.rounds, tiles=args.tiles)
    except ValueError as err:  # what cannot be tuned here, said without a traceback
        p.exit(2, f"{p.prog}: {err}\n")
    print(report.markdown())
    print(f"# use it: export {cutlass_tile_cache.CACHE_ENV}={os.path.abspath(args.out)}")
    return report


if __name__ == "__main__":
    main()
