"""Which CUTLASS tile serves each grouped GEMM of the cutlass backend best, per model shape and T.

Times :func:`jax_moe.backends.cutlass_gemm.grouped_gemm` alone, each tile of ``TILES`` forced, on
the two GEMMs of a layer (GEMM1: ``a [T*k, H] @ w13 [E, 2I, H]``; GEMM2: ``a [T*k, I] @ w2 [E, H, I]``;
kind ``bf16_kn``: the same products on the transposed weights, ``w13 [E, H, 2I]`` and ``w2 [E, I, H]``,
through :func:`jax_moe.backends.cutlass_grad_gemm.grouped_gemm_dgrad`'s kernel)
with the rows of a random softmax top-k routing, in one process, the tiles interleaved per cell.
Each figure is device time per call: the median over a jitted loop of calls, each on the next
routing's expert offsets (:func:`jax_moe.timing.loop_ms`, about ``LOOP_MS`` per loop), so
the host's dispatch, which is most of a per-call figure below a millisecond, does not pick the
tile (``--timer call``: the per-call medians instead). Optionally the whole forward per tile
next to tokamax (``--forward``), to see what a tile choice is worth end to end.

    python bench/tile_sweep.py                                   # the four models, bf16
    python bench/tile_sweep.py --kinds bf16 fp8 --json sweep.json
    python bench/tile_sweep.py --models qwen3 --tokens 64 1024 --forward-only
    python bench/tile_sweep.py --act --kinds bf16 bf16_kn fp8 --tokens 64 1024   # GEMM1 with the activation fused

Prints one markdown table per kind: per (model, GEMM, T) each tile's ms, the best tile, and the
tile the trace-time pick chooses (with its loss against the best). ``--json`` writes the raw
figures (``kind/E/N/K`` -> rows per expert -> tile -> ms, with the device under ``"device"``).
``--update-table`` rewrites the measured table of :mod:`jax_moe.backends.cutlass_tiles` from this
run's figures, or from ``--from-json`` files of earlier runs (no GPU needed for that)::

    python bench/tile_sweep.py --kinds bf16 fp8 --json sweep.json      # on the GPU
    python bench/tile_sweep.py --from-json sweep.json --update-table  # anywhere
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import moe_bench, peers  # noqa: E402
from jax_moe import ffi, kernels, timing  # noqa: E402
from jax_moe.backends import cutlass, cutlass_gemm, cutlass_tiles  # noqa: E402
from jax_moe.backends.cutlass_tile_cache import choose, gemm_key, split_gemm_key  # noqa: E402
from jax_moe.backends.cutlass_grad_gemm import grouped_gemm_dgrad  # noqa: E402
from jax_moe.layouts.transposed import transpose_experts  # noqa: E402
from jax_moe.config import MoEConfig  # noqa: E402
from jax_moe.quant import fp8  # noqa: E402
from jax_moe.quant.scheme import quantize_weights  # noqa: E402

TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
LOOP_MS = 4.0  # device time of one timed loop of --timer loop
KINDS = (*cutlass_gemm.KINDS, "bf16_kn")  # bf16_kn: the bf16 forward on transposed weights


def gemm_operands(m: moe_bench.Model, t: int, kind: str, sets: int = 3):
    """Per routing set: (offsets [E+1], a1 [T*k, H], a2 [T*k, I]) in the kind's dtype (FP8 rows
    with per-row scales [T*k]), as the forward hands them to the two GEMMs: a1 from the forward's
    own permute (quantized in it for FP8), a2 random."""
    out = []
    for x, _, ids in moe_bench.routed_inputs(m, t, sets):
        sort = ffi.sort_by_expert(ids.astype(jnp.int32), m.e)
        rows = t * m.k
        a2 = jax.random.normal(jax.random.key(rows), (rows, m.i), jnp.bfloat16)
        if kind == "fp8":
            q2, s2 = fp8.quantize_fp8_per_token(a2)
            a1 = kernels.permute_rows(x, sort.sorted_slots, m.k, quant="fp8_per_token", inverse=sort.inverse)
            out.append((sort.offsets, a1, (q2, s2[:, 0])))
        else:
            a1 = kernels.permute_rows(x, sort.sorted_slots, m.k, inverse=sort.inverse)
            out.append((sort.offsets, (a1, None), (a2, None)))
    return out


def fp8_weights(w13, w2):
    """Both weights in FP8 with per-channel scales ([E, N] float32), as the FP8 GEMM takes them."""
    q13, q2, quant = quantize_weights("fp8", w13, w2, weight_scale="per_channel")
    return (q13, quant.w13_scale[..., 0]), (q2, quant.w2_scale[..., 0])


def loop_timer(fn, inputs: list[tuple], vary: int) -> float:
    """Device ms per call of ``fn``: about ``LOOP_MS`` of calls in one jitted loop, argument
    ``vary`` (the expert offsets) cycled over the routing sets of ``inputs``."""
    return timing.loop_ms(fn, inputs, vary, LOOP_MS)


def call_timer(fn, inputs: list[tuple], vary: int) -> float:
    """Median ms of blocked calls, the host's dispatch included."""
    return moe_bench.timeit(fn, inputs)


TIMERS = {"loop": loop_timer, "call": call_timer}


def sweep_model(m: moe_bench.Model, tokens, kind: str, results: dict, table: list, timer=loop_timer) -> None:
    w13, w2 = moe_bench.random_experts(m)
    if kind == "fp8":
        (w13, s13), (w2, s2) = fp8_weights(w13, w2)
    else:
        s13 = s2 = None
    if kind == "bf16_kn":
        w13, w2 = transpose_experts(w13), transpose_experts(w2)
        fns = {tile: jax.jit(lambda a, sa, b, sb, off, tile=tile: grouped_gemm_dgrad(a, b, off, tile=tile))
               for tile in cutlass_tiles.tiles_for(kind)}
    else:
        fns = {tile: jax.jit(lambda a, sa, b, sb, off, tile=tile: cutlass_gemm.grouped_gemm(
            a, b, off, a_scale=sa, b_scale=sb, tile=tile)) for tile in cutlass_tiles.tiles_for(kind)}
    gemms = (("gemm1", w13, s13, 1), ("gemm2", w2, s2, 2))
    for t in tokens:
        ops = gemm_operands(m, t, "fp8" if kind == "fp8" else "bf16")
        for name, w, ws, which in gemms:
            e, n, k = w.shape
            if kind == "bf16_kn":  # the table's (N, K) are the product's, whatever the layout
                n, k = k, n
            key = gemm_key(kind, e, n, k)
            cell = {}
            for tile, fn in fns.items():
                inputs = [(op[which][0], op[which][1], w, ws, op[0]) for op in ops]
                try:
                    cell[tile] = timer(fn, inputs, 4)
                except Exception as err:  # recorded, not fatal
                    print(f"# {m.name} {name} T={t} {tile}: failed ({str(err).splitlines()[0][:80]})")
            rows = t * m.k
            picked = cutlass_tiles.pick_tile(rows, e, n=n, k=k, kind=kind)
            best = min(cell, key=cell.get) if cell else None
            results.setdefault(key, {})[str(rows / e)] = cell
            row = [m.name, name, str(t)] + [moe_bench.fmt(cell.get(tl)) for tl in cutlass_gemm.TILES]
            loss = f"{cell[picked] / cell[best]:.2f}x" if best and picked in cell else "n/a"
            row += [best or "n/a", picked, loss]
            table.append(row)
            print("| " + " | ".join(row) + " |", flush=True)
        del ops
    del w13, w2


def forward_model(m: moe_bench.Model, tokens) -> None:
    """The bf16 forward with each tile forced for both GEMMs, and tokamax, in one process (the
    weights are arguments, not constants folded into the program)."""
    cfg = MoEConfig(m.e, m.k, m.h, m.i)
    w13, w2 = moe_bench.random_experts(m)
    impls = {tile: (jax.jit(lambda x, ws, w, ids, tile=tile: cutlass.apply(x, *ws, w, ids, cfg, tile=tile)),
                    (w13, w2)) for tile in cutlass_gemm.TILES}
    impls["auto"] = (jax.jit(lambda x, ws, w, ids: cutlass.apply(x, *ws, w, ids, cfg)), (w13, w2))
    ok, why = peers.available()
    if ok:
        impls["tokamax"] = (jax.jit(peers.tokamax_moe), peers.tokamax_prepare(w13, w2))
    else:
        print(f"# tokamax: not run ({why})")
    print("| model | T | " + " | ".join(f"{n} ms" for n in impls) + " |\n|" + "---|" * (len(impls) + 2))
    for t in tokens:
        routed = moe_bench.routed_inputs(m, t)
        cells = [moe_bench.fmt(moe_bench.timeit(fn, [(x, ws, w, ids) for x, w, ids in routed]))
                 for fn, ws in impls.values()]
        print(f"| {m.name} | {t} | " + " | ".join(cells) + " |", flush=True)


def act_model(m: moe_bench.Model, tokens, kind: str = "bf16", results: dict | None = None,
              timer=loop_timer) -> None:
    """GEMM1 per tile: alone, followed by the activation kernel, and with the activation in its
    epilogue (:func:`jax_moe.backends.cutlass_act_gemm.grouped_gemm_act`), on w13 interleaved
    (``kind="bf16_kn"``: and transposed; ``"fp8"``: FP8 rows with per-row scales and per-channel
    FP8 weights, the activation's output quantized with a static scale, by ``act_and_mul`` or in
    the epilogue). ``results``: each tile's time for GEMM1 and the activation as the forward runs
    them (fused on the tiles that fuse, else the two kernels) under ``"{kind}_act/E/N/K"``, the
    tile table's GEMM1-with-activation rows."""
    from jax_moe.backends.cutlass_act_gemm import FUSED_TILES, grouped_gemm_act
    from jax_moe.layouts.gated import reorder_rows_for_gated_act_gemm

    w13, w2 = moe_bench.random_experts(m)
    w13 = reorder_rows_for_gated_act_gemm(w13)
    kn, scaled = kind == "bf16_kn", kind == "fp8"
    s13 = None
    if kn:
        w13 = transpose_experts(w13)
    if scaled:
        (w13, s13), _ = fp8_weights(w13, w2)
    del w2
    gemm = grouped_gemm_dgrad if kn else cutlass_gemm.grouped_gemm
    out_scale = jnp.float32(0.05)  # a static FP8 scale for act(gate) * up (the values do not matter here)
    quant = dict(quant="fp8_static", scale=out_scale) if scaled else {}

    def product(a, sa, b, sb, o, tile):
        return gemm(a, b, o, a_scale=sa, b_scale=sb, tile=tile) if scaled else gemm(a, b, o, tile=tile)

    def fused(a, sa, b, sb, o, tile):
        if scaled:
            return grouped_gemm_act(a, b, o, "silu", a_scale=sa, b_scale=sb, out_scale=out_scale, tile=tile)
        return grouped_gemm_act(a, b, o, "silu", tile=tile, transposed=kn)

    fns = {}
    for tile in cutlass_gemm.TILES:
        fns[tile] = (
            jax.jit(lambda *args, tile=tile: product(*args, tile)),
            jax.jit(lambda *args, tile=tile: kernels.act_and_mul(product(*args, tile), "silu", layout="interleaved",
                                                                 **quant)),
            jax.jit(lambda *args, tile=tile: fused(*args, tile)))
    print(f"\n{kind}\n\n| model | T | tile | gemm1 ms | gemm1 + act ms | act in epilogue ms | gain |\n"
          "|---|---|---|---|---|---|---|")
    e, n, k = m.e, 2 * m.i, m.h
    for t in tokens:
        inputs = [(op[1][0], op[1][1], w13, s13, op[0]) for op in gemm_operands(m, t, "fp8" if scaled else "bf16")]
        unit = {}
        for tile, (plain, two, fuse) in fns.items():
            ms = [timer(fn, inputs, 4) for fn in (plain, two, fuse)]
            unit[tile] = ms[2] if tile in FUSED_TILES[kind] else ms[1]
            print(f"| {m.name} | {t} | {tile} | " + " | ".join(moe_bench.fmt(v) for v in ms) +
                  f" | {ms[1] / ms[2]:.2f}x |", flush=True)
        if results is not None:
            results.setdefault(gemm_key(f"{kind}_act", e, n, k), {})[str(t * m.k / e)] = unit
        print(f"# {m.name} T={t}: GEMM1 + activation as the forward runs them, fastest on {min(unit, key=unit.get)}")
        del inputs


def table_from_figures(results: dict) -> dict:
    """The measured table (:data:`jax_moe.backends.cutlass_tiles.MEASURED`) from sweep figures:
    per GEMM shape, at each rows per expert, the fastest tile where it beats the heuristic's by
    more than ``MIN_GAIN`` (else the heuristic's); shapes where the heuristic is never beaten are
    left out (it answers for them)."""
    table = {}
    for key, points in results.items():
        if key == "device":
            continue
        kind, e, n, k = split_gemm_key(key)
        chosen, differs = [], kind.endswith("_act")  # GEMM1-with-activation rows: all kept
        for r, cell in sorted(points.items(), key=lambda p: float(p[0])):
            if not cell:
                continue
            heur = cutlass_tiles.heuristic_tile(float(r), kind, results.get("device", cutlass_tiles.MEASURED_ON))
            tile = choose(cell, heur, cutlass_tiles.MIN_GAIN)
            differs |= tile != heur
            chosen.append((float(r), tile))
        if differs:
            table[(kind, e, n, k)] = tuple(chosen)
    return table


def update_table(table: dict, device: str, path: str = cutlass_tiles.__file__) -> None:
    """Rewrites the lines between the measured-table markers of ``path`` with ``table``."""
    src = open(path).read()
    begin, end = "# measured table: begin\n", "# measured table: end\n"
    i, j = src.index(begin) + len(begin), src.index(end)
    lines = ["MEASURED: dict[tuple[str, int, int, int], tuple[tuple[float, str], ...]] = {"]
    for key in sorted(table):
        lines.append(f"    {key!r}: (")
        lines += [f"        ({r:g}, {t!r})," for r, t in table[key]]
        lines.append("    ),")
    lines += ["}", f"MEASURED_ON = {device!r}"]
    with open(path, "w") as f:
        f.write(src[:i] + "\n".join(lines) + "\n" + src[j:])
    print(f"# {len(table)} GEMM shapes written to {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3", "gptoss", "deepseek", "mixtral"],
                   choices=sorted(moe_bench.MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--kinds", nargs="+", default=["bf16"], choices=sorted(KINDS))
    p.add_argument("--forward", action="store_true", help="also time the whole forward per tile, and tokamax")
    p.add_argument("--forward-only", action="store_true", help="only the forward per tile (no GEMM sweep)")
    p.add_argument("--act", action="store_true",
                   help="only GEMM1 per tile: alone, + the activation kernel, and with the activation in its epilogue")
    p.add_argument("--timer", choices=sorted(TIMERS), default="loop",
                   help="loop: device time per call in a jitted loop (default); call: per-call medians")
    p.add_argument("--json", help="write the raw figures here")
    p.add_argument("--from-json", nargs="+", help="figures of earlier runs (no timing: with --update-table)")
    p.add_argument("--update-table", action="store_true",
                   help="rewrite jax_moe/backends/cutlass_tiles.py's measured table from the figures")
    args = p.parse_args()
    if args.from_json:
        results: dict = {}
        for path in args.from_json:
            with open(path) as f:
                for key, points in json.load(f).items():
                    if key == "device":
                        results.setdefault("device", points)
                    else:
                        results.setdefault(key, {}).update(points)
        if args.update_table:
            update_table(table_from_figures(results), results.get("device", ""))
        return
    ok, why = cutlass_gemm.available(None)
    if not ok:
        sys.exit(f"tile_sweep needs the CUTLASS module on an SM90 GPU: {why}")
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    results: dict = {"device": jax.devices()[0].device_kind}
    for kind in args.kinds if args.act else []:
        for name in args.models:
            act_model(moe_bench.MODELS[name], args.tokens, kind, results, TIMERS[args.timer])
    for kind in [] if args.forward_only or args.act else args.kinds:
        table: list = []
        cols = ["model", "GEMM", "T"] + [f"{tl} ms" for tl in cutlass_gemm.TILES] + ["best", "picked", "picked / best"]
        print(f"\n## {kind}\n\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)
        for name in args.models:
            sweep_model(moe_bench.MODELS[name], args.tokens, kind, results, table, TIMERS[args.timer])
    if args.forward or args.forward_only:
        for name in args.models:
            forward_model(moe_bench.MODELS[name], args.tokens)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
        print(f"# figures written to {args.json}")
    if args.update_table:
        update_table(table_from_figures(results), results["device"])


if __name__ == "__main__":
    main()
