"""Where one MoE forward's time goes, stage by stage, on the ``cutlass`` backend (and the tokamax peer).

    python bench/stage_breakdown.py                                 # GPU: four models, T=1 64 4096 16384
    python bench/stage_breakdown.py --models qwen3 deepseek --tokens 64 16384 --kernels $OUT/kernels.txt
    python bench/stage_breakdown.py --method alone                  # each stage jitted alone (any platform)
    python bench/stage_breakdown.py --scheme fp8 --models qwen3 --tokens 4096   # FP8 per-tensor W8A8
    python bench/stage_breakdown.py --scheme bf16 fp8 --no-peer --models qwen3  # a table per scheme
    python bench/stage_breakdown.py --models qwen3 --tokens 4096 --loop 8     # + per layer inside a loop

Stages (the ``cutlass`` backend's pipeline, :mod:`jax_moe.backends.cutlass`): ``route``
(``select_experts``: softmax top-k), ``sort`` (``sort_by_expert``), ``permute`` (``permute_rows``),
``gemm1`` (grouped GEMM on w13), ``act`` (``act_and_mul``), ``gemm2`` (grouped GEMM on w2),
``finalize`` (``unpermute_reduce``), ``setup`` (the grouped GEMMs' group-array and zero-row
launches) and ``glue`` (XLA fusions between the custom calls).

Methods:

- ``trace`` (GPU): the routing call and the forwards (``cutlass`` on the weights of
  ``cutlass.prepare``, as ``MoEBlock.prepare()`` leaves them) run under one ``jax.profiler`` trace; each
  kernel's device time is attributed to a stage by its name and position
  (:mod:`bench.kernel_trace`). Also reported: kernels per forward, their busy time (the union of their
  intervals, where kernels overlap: :func:`bench.kernel_trace.exclusive`), the span
  from the first kernel's start to the last one's end (span - busy = launch gaps) and the per-call
  wall time with dispatch. ``--kernels FILE`` writes each forward's kernel list (name, launches,
  microseconds). The tokamax peer (:mod:`bench.peers`, where importable) is traced the same way:
  its sort and permute are XLA fusions (column ``sort``), its activation too (``act``).
- ``alone`` (any platform; the default without a GPU): each stage jitted alone on the intermediate
  arrays of a real forward, timed per call (host dispatch included: an upper bound at small T).

``--loop N`` (``trace`` only) also traces each implementation's forward inside one jitted loop of N
layers (:mod:`bench.in_loop`: each layer its own routing, its input the last layer's output) and
gives, per layer, the kernels' busy time, the span from the loop's first kernel to its last over N,
and the grouped GEMMs' share. This is a layer's device time as a model's layer loop runs it: no
dispatch, and none of the loop timer's once-per-call costs (the span still holds the loop's start).
The closing loop table reads each layer's busy time against the performance targets' floor
(:data:`TARGET_BANDWIDTH`, :data:`TARGET_PEAK`: the same figures on every machine) and, on jax_moe's
rows, against tokamax's at the same model and T (``x tokamax``). Its next-to-last column is the
GPU's SM clock (:mod:`bench.gpu_clocks`): the median while the loop was traced, with the count of
busy samples it rests on (one per 20 ms: a short loop's trace gives a few, which need not fall in
its GEMMs), then the 10th percentile and median while it runs back to back for a second after its
trace, with the share of those samples at which the driver lowered the clock for its power cap. A
loop that ran slower because the clock fell can so be told from a change in the kernels, and a
sustained run's clock read. The same back-to-back run reads the board's energy counter
(:mod:`bench.gpu_energy`): millijoules per layer and the mean watts. At the power cap a layer's time
is its energy over the limit, so that column compares two implementations on what bounds them both.

The GEMM columns also give each grouped GEMM's share of its own floor: ``max(touched experts'
weight bytes / bandwidth, FLOPs / peak)`` with the ceilings measured in the same run.

``--scheme fp8`` (``trace`` only): the weights quantized as ``bench/moe_bench.py --scheme fp8`` does
(per-expert FP8 weights, static per-tensor activation scales), so ``permute`` and ``act`` include
the activations' quantization and the GEMMs run on FP8 tensor cores (floors: one byte per weight
and activation element, twice the bf16 peak). The tokamax peer, a bf16 MoE, is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import gpu_clocks, gpu_energy, in_loop, kernel_trace, peers  # noqa: E402
from bench.moe_bench import (FP8_MATH, MODELS, Model, measure_ceilings, quantized, random_experts,  # noqa: E402
                              print_xla_flags, roofline, routed_inputs, timeit, touched_experts)
from bench.routings import ROUTINGS  # noqa: E402
from jax_moe import ffi, kernels  # noqa: E402
from jax_moe.backends import cutlass  # noqa: E402
from jax_moe.backends.cutlass_gemm import grouped_gemm  # noqa: E402
from jax_moe.config import MoEConfig  # noqa: E402
from jax_moe.routing import select_experts  # noqa: E402

COLUMNS = ("route", "sort", "permute", "gemm1", "act", "gemm2", "finalize", "setup", "glue")
# The performance targets' floor of a layer: max(touched-expert bytes / 3.0 TB/s, FLOPs / 800 TFLOP/s)
# (moe_bench.roofline; for FP8, one byte per weight and twice the peak). Fixed figures, not this run's
# measured ceilings, so that the loop table's "floor / busy" reads the same on any machine.
TARGET_BANDWIDTH, TARGET_PEAK = 3.0e12, 800e12
# How long each loop runs back to back under the clock sampler and the energy meter: a second, and at
# least MIN_CALLS calls, since the meter knows the calls between its counter's steps to within one.
CLOCK_SECONDS, MIN_CALLS = 1.0, 50
PEER_NA = ("permute", "setup", "glue")  # columns a peer's forward has no kernels of (shown as "-")


def gemm_floors(m: Model, t: int, bw: float, peak: float, scheme: str = "bf16") -> tuple[float, float]:
    """Floors (us) of GEMM1 and GEMM2 alone: touched experts' weights and the rows in (bf16, or
    one byte each for ``fp8``) and out (bf16) over the bandwidth, or the FLOPs over the peak (twice
    the bf16 peak for ``fp8``), whichever is larger."""
    touched = touched_experts(m, t)
    rows = t * m.k
    b = 1 if scheme in FP8_MATH else 2  # bytes per weight and input element
    peak = peak * (2 if scheme in FP8_MATH else 1)
    g1 = max((touched * 2 * m.i * m.h * b + rows * (m.h * b + 2 * m.i * 2)) / bw, 2 * rows * m.h * 2 * m.i / peak)
    g2 = max((touched * m.h * m.i * b + rows * (m.i * b + m.h * 2)) / bw, 2 * rows * m.i * m.h / peak)
    return 1e6 * g1, 1e6 * g2


def cutlass_fn(cfg: MoEConfig):
    """The forward on stored weights: ``fn(x, (w13, w2), topk_weights, topk_ids)``."""
    return lambda x, ws, w, ids: cutlass.apply(x, *ws, w, ids, cfg)


def prepared_fn():
    """The forward as the bench times it, on the weights of ``cutlass.prepare`` (what
    ``MoEBlock.prepare()`` leaves): ``fn(x, prepared, topk_weights, topk_ids)``."""
    return lambda x, p, w, ids: cutlass.apply_prepared(x, p, w, ids)


def alone_stages(m: Model, x, w13, w2, w, ids, logits) -> dict[str, float]:
    """Microseconds per stage, each stage jitted alone on the previous stage's real output
    (per-call timing, dispatch included), as :func:`jax_moe.backends.cutlass.apply` chains them."""
    e, k = m.e, m.k
    tw = w.astype(jnp.float32)
    steps = {
        "route": (lambda lg: select_experts(lg, k), (logits,)),
        "sort": (lambda i: tuple(ffi.sort_by_expert(i, e)), (ids,)),
    }
    sorted_slots, inverse, _, offsets = jax.jit(steps["sort"][0])(ids)
    valid = offsets[e:]
    steps["permute"] = (lambda xx, s, v, inv: kernels.permute_rows(xx, s, k, valid_rows=v, inverse=inv),
                        (x, sorted_slots, valid, inverse))
    a1 = jax.jit(steps["permute"][0])(*steps["permute"][1])
    steps["gemm1"] = (lambda a, b, o: grouped_gemm(a, b, o), (a1, w13, offsets))
    h1 = jax.jit(steps["gemm1"][0])(*steps["gemm1"][1])
    steps["act"] = (lambda h, v: kernels.act_and_mul(h, "silu", valid_rows=v), (h1, valid))
    a2 = jax.jit(steps["act"][0])(*steps["act"][1])
    steps["gemm2"] = (lambda a, b, o: grouped_gemm(a, b, o), (a2, w2, offsets))
    y = jax.jit(steps["gemm2"][0])(*steps["gemm2"][1])
    steps["finalize"] = (lambda yy, inv, ww, v: kernels.unpermute_reduce(yy, inv, ww, valid_rows=v,
                                                                         out_dtype=x.dtype), (y, inverse, tw, valid))
    out = {c: 0.0 for c in COLUMNS}
    for name, (fn, args) in steps.items():
        out[name] = 1e3 * timeit(jax.jit(fn), [args], budget_s=0.3)
    return out


def traced_stages(impls: dict, logits, top_k: int, calls: int) -> dict[str, dict] | None:
    """Per implementation of ``impls`` (name -> (jitted fn, args)): microseconds per stage (median
    over ``calls`` forwards), kernels per forward, busy and span microseconds and the kernel list,
    from one profiler trace of ``calls`` routing calls (``select_experts(logits, top_k)``, the
    ``route`` column of every implementation) and ``calls`` forwards of each implementation; None
    if the trace could not be split into calls."""
    route = jax.jit(lambda lg: select_experts(lg, top_k))
    jax.block_until_ready(route(logits))
    for fn, args in impls.values():
        jax.block_until_ready(fn(*args))
    order = [(route, (logits,))] * calls
    for fn, args in impls.values():
        order += [(fn, args)] * calls
    groups = kernel_trace.trace_calls(order)
    if groups is None:
        return None
    route_us = statistics.median(kernel_trace.busy_ns(g) for g in groups[:calls]) / 1e3
    result = {}
    for j, name in enumerate(impls):
        fwd = groups[calls * (j + 1): calls * (j + 2)]
        per = [kernel_trace.attribute(g) for g in fwd]
        stages = {c: statistics.median(p[c] for p in per) / 1e3 for c in COLUMNS}
        stages["route"] = route_us
        result[name] = {
            "stages": stages,
            "kernels": statistics.median(len(g) for g in fwd),
            "busy": statistics.median(kernel_trace.busy_ns(g) for g in fwd) / 1e3,
            "span": statistics.median(kernel_trace.span_ns(g) for g in fwd) / 1e3,
            "list": kernel_trace.kernel_table([k for g in fwd for k in g], calls),
            "timeline": kernel_trace.timeline(sorted(fwd, key=kernel_trace.span_ns)[len(fwd) // 2]),
        }
    return result


def on_gpu() -> bool:
    """Whether JAX runs on a GPU here (the clock sampler's condition: a CPU run on a GPU machine
    would sample a GPU it does not use)."""
    return jax.devices()[0].platform == "gpu"


def back_to_back(loop, loop_args: tuple, layers: int, seconds: float = CLOCK_SECONDS,
                 min_calls: int = MIN_CALLS) -> dict:
    """``loop`` (of ``layers`` layers) run back to back for about ``seconds``, and for at least
    ``min_calls`` calls: the GPU's SM clock meanwhile (``clocks``,
    :class:`bench.gpu_clocks.ClockSampler`), the energy the board drew (``energy``,
    :class:`bench.gpu_energy.EnergyMeter`) and its joules per layer (``joules``). Each is None off a
    GPU, or without ``nvidia-smi`` or NVML."""
    if not on_gpu():
        return {"clocks": None, "energy": None, "joules": None}
    start = time.perf_counter()
    jax.block_until_ready(loop(*loop_args))
    seconds = max(seconds, min_calls * (time.perf_counter() - start))
    calls = 0
    with gpu_clocks.ClockSampler() as clocks, gpu_energy.EnergyMeter() as energy:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end or not energy.advanced():  # (to the counter's next step)
            jax.block_until_ready(loop(*loop_args))
            calls += 1
    return {"clocks": clocks.summary, "energy": energy.summary,
            "joules": gpu_energy.per_layer(energy.summary, calls * layers)}


def traced_loop(fn, args: tuple, num_experts: int, top_k: int, layers: int, calls: int = 2,
                routing: str = "random") -> dict | None:
    """Per layer of ``fn`` run ``layers`` times inside one jitted loop (``args`` = (x, weights,
    topk_weights, topk_ids); the loop is :func:`bench.in_loop.scaled_loop`'s, its layers routed by
    ``routing``): microseconds of busy
    time, of span (the loop's first kernel's start to its last one's end, over ``layers``) and of
    grouped-GEMM time, medians over ``calls`` traced calls of the loop; the SM clock while it was
    traced (``clocks_traced``), and while it runs back to back the clock, the board's energy and
    its joules per layer (:func:`back_to_back`); None if the trace could not be split into calls."""
    loop, loop_args = in_loop.scaled_loop(fn, *args[:2], num_experts, top_k, layers, routing=routing)
    jax.block_until_ready(loop(*loop_args))
    with gpu_clocks.ClockSampler(enabled=on_gpu()) as traced_clocks:
        groups = kernel_trace.trace_calls([(loop, loop_args)] * calls)
    if groups is None:
        return None

    def per_layer(values) -> float:
        return statistics.median(values) / layers / 1e3

    return {"layers": layers,
            "busy": per_layer(kernel_trace.busy_ns(g) for g in groups),
            "span": per_layer(kernel_trace.span_ns(g) for g in groups),
            "gemm": per_layer(sum(ns for k, ns in kernel_trace.exclusive(g)
                                  if kernel_trace.kind_of(k.name) == "gemm") for g in groups),
            "clocks_traced": traced_clocks.summary, **back_to_back(loop, loop_args, layers)}


def target_floor_us(m: Model, t: int, scheme: str = "bf16") -> float:
    """The targets' floor of one layer of ``m`` at T=t, in microseconds (:data:`TARGET_BANDWIDTH`,
    :data:`TARGET_PEAK`)."""
    return 1e3 * roofline(m, t, TARGET_BANDWIDTH, TARGET_PEAK, scheme)[0]


def loop_header() -> str:
    cols = ["model", "T", "impl", "layers", "busy us per layer", "span us per layer", "gemm us per layer",
            "floor us", "floor / busy", "x tokamax",
            "SM MHz traced (busy samples); back to back p10 / median (power-capped)", "mJ per layer back to back (W)"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def format_loop_row(row: dict, peer_busy: float | None = None) -> str:
    """A row of the loop table; ``peer_busy``: the tokamax row's busy us per layer at the same model
    and T, for the speedup column ("-" without one, and on the peer's own row)."""
    lp = row["loop"]
    cells = [row["model"], str(row["T"]), row["impl"], str(lp["layers"])] + [
        fmt_us(lp[key]) for key in ("busy", "span", "gemm")]
    floor = row.get("target_floor")
    cells.append(fmt_us(floor))
    cells.append(f"{100 * floor / lp['busy']:.0f}%" if floor and lp["busy"] else "n/a")
    cells.append(f"{peer_busy / lp['busy']:.2f}x" if peer_busy and lp["busy"] else "-")
    traced = lp.get("clocks_traced")
    traced_cell = f"{traced['median_mhz']} ({traced['samples']})" if traced else "-"
    cells.append(f"{traced_cell}; {gpu_clocks.cell(lp.get('clocks'))}")
    cells.append(gpu_energy.cell(lp.get("joules"), lp.get("energy")))
    return "| " + " | ".join(cells) + " |"


def loop_table(rows: list[dict]) -> str:
    """The loop table of the rows traced in a loop: per layer, against the targets' floor and, for
    jax_moe's rows, against tokamax's row of the same model and T."""
    looped = [r for r in rows if r.get("loop")]
    peer = {(r["model"], r["T"]): r["loop"]["busy"] for r in looped if r["impl"] == "tokamax"}
    lines = [format_loop_row(r, None if r["impl"] == "tokamax" else peer.get((r["model"], r["T"])))
             for r in looped]
    return loop_header() + "\n" + "\n".join(lines)


def header() -> str:
    cols = (["model", "T", "impl"] + [f"{c} us" for c in COLUMNS]
            + ["kernels", "busy us", "span us", "per call us", "gemm1 % floor", "gemm2 % floor"])
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def fmt_us(v) -> str:
    return "n/a" if v is None else (f"{v:.1f}" if v < 1000 else f"{v:.0f}")


def format_row(row: dict) -> str:
    peer = not row["impl"].startswith("cutlass")  # its permute is in its XLA sort, and it has no setup or glue kernels
    cells = [row["model"], str(row["T"]), row["impl"]] + [
        "-" if peer and c in PEER_NA else fmt_us(row["stages"].get(c)) for c in COLUMNS]
    cells += [str(row.get("kernels", "n/a")), fmt_us(row.get("busy")), fmt_us(row.get("span")),
              fmt_us(row.get("per_call"))]
    for g, floor in (("gemm1", row["floors"][0]), ("gemm2", row["floors"][1])):
        v = row["stages"].get(g)
        cells.append(f"{100 * floor / v:.0f}%" if v else "n/a")
    return "| " + " | ".join(cells) + " |"


def prepared_weights(m: Model, w13: jax.Array, w2: jax.Array, scheme: str = "bf16"):
    """``m``'s experts as ``cutlass.prepare`` leaves them (what ``MoEBlock.prepare()`` does): in
    ``scheme`` ``bf16`` as given, else quantized first (:func:`bench.moe_bench.quantized`)."""
    cfg = MoEConfig(m.e, m.k, m.h, m.i)
    if scheme == "bf16":
        return cutlass.prepare(w13, w2, cfg)
    w13q, w2q, quant = quantized(scheme, w13, w2, m)
    return cutlass.prepare(w13q, w2q, cfg, quant)


def run(m: Model, tokens: list[int], method: str, calls: int, peer: bool, bw: float, peak: float,
        kernels_file=None, scheme: str = "bf16", loop: int = 0, routing: str = "random") -> list[dict]:
    """Rows of the breakdown for model ``m`` at each T (printed as they come); ``scheme``: ``bf16``
    or ``fp8`` (``trace`` only); ``loop``: also trace each forward inside a loop of this many
    layers (:func:`traced_loop`; 0: not); ``routing``: the forwards' and the loop's layers' routing,
    one of :data:`bench.routings.ROUTINGS`."""
    cfg = MoEConfig(m.e, m.k, m.h, m.i)
    w13, w2 = random_experts(m)
    traced_on_prepared = method == "trace"  # the stages of the forward MoEBlock.prepare() runs
    on_prepared = traced_on_prepared or scheme != "bf16"  # the stored-weights forward is bf16's only
    weights = prepared_weights(m, w13, w2, scheme) if on_prepared else (w13, w2)
    fwd = prepared_fn() if traced_on_prepared else cutlass_fn(cfg)
    tk = peers.tokamax_prepare(w13, w2) if peer else None
    rows = []
    for t in tokens:
        x, w, ids = routed_inputs(m, t, sets=1, routing=routing)[0]
        logits = jax.random.normal(jax.random.key(7), (t, m.e), jnp.float32)
        floors = gemm_floors(m, t, bw, peak, scheme)
        name = "cutlass" if scheme == "bf16" else f"cutlass {scheme}"
        impls = {name: (jax.jit(fwd), (x, weights, w, ids))}
        if tk is not None:
            impls["tokamax"] = (jax.jit(peers.tokamax_moe), (x, tk, w, ids))
        traced = traced_stages(impls, logits, m.k, calls) if method == "trace" else None
        if method == "trace" and traced is None:
            print(f"# {m.name} T={t}: trace not attributed, " + (
                "timing each stage alone instead" if scheme == "bf16"
                else "stages n/a (the stages alone are bf16's)"))
        for name in impls:
            fn, args = impls[name]
            row = {"model": m.name, "T": t, "impl": name, "floors": floors,
                   "target_floor": target_floor_us(m, t, scheme),
                   "per_call": 1e3 * timeit(fn, [args], budget_s=0.3)}
            if traced is not None:
                row.update({key: traced[name][key] for key in ("stages", "kernels", "busy", "span")})
                if kernels_file is not None:
                    kernels_file.write(f"\n## {m.name} T={t} {name}: {row['kernels']} kernels, "
                                       f"busy {row['busy']:.1f} us, span {row['span']:.1f} us\n")
                    for kind, kname, launches, us in traced[name]["list"]:
                        kernels_file.write(f"{us:10.1f} us  x{launches:<5g} {kind:9s} {kname[:200]}\n")
                    kernels_file.write("the forward of median span, in order: start us, idle us before, us, name\n")
                    for start, idle, us, kname in traced[name]["timeline"]:
                        kernels_file.write(f"{start:10.1f} {idle:8.1f} {us:8.1f}  {kname[:120]}\n")
                    kernels_file.flush()
            elif name == "cutlass":
                row["stages"] = alone_stages(m, x, w13, w2, w, ids, logits)
            elif name.startswith("cutlass"):  # another scheme: alone_stages would time bf16's stages
                row["stages"] = {}
            else:
                continue
            rows.append(row)
            print(format_row(row), flush=True)
            if loop and traced is not None:
                row["loop"] = traced_loop(fn, args, m.e, m.k, loop, routing=routing)
                print(f"# in a loop: {format_loop_row(row)}" if row["loop"] else
                      f"# {m.name} T={t} {name}: the loop's trace not attributed", flush=True)
    del w13, w2, tk, weights
    return rows


def main(argv=None) -> int:
    gpu = on_gpu()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["qwen3", "deepseek", "gptoss", "mixtral"] if gpu else ["tiny"],
                   choices=sorted(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 64, 4096, 16384] if gpu else [1, 16])
    p.add_argument("--method", choices=("trace", "alone"), default="trace" if gpu else "alone")
    p.add_argument("--calls", type=int, default=3, help="forwards traced per implementation (median)")
    p.add_argument("--no-peer", action="store_true", help="leave the tokamax peer out")
    p.add_argument("--scheme", nargs="+", choices=("bf16", "fp8"), default=["bf16"],
                   help="expert weight formats, a table each: fp8 is W8A8 per-tensor (trace method only; no peer)")
    p.add_argument("--kernels", default=None, help="write each forward's kernel list to this file")
    p.add_argument("--loop", type=int, default=0, metavar="N",
                   help="also trace each forward inside a jitted loop of N layers: device time per layer")
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--routing", choices=ROUTINGS, default="random",
                   help="random softmax top-k, or the same rows for every expert (bench.routings), in the "
                        "forwards and the --loop layers alike")
    args = p.parse_args(argv)
    not_bf16 = [scheme for scheme in args.scheme if scheme != "bf16"]  # (not `quantized`: moe_bench's function)
    if not_bf16 and args.method != "trace":
        p.error(f"--scheme {not_bf16[0]} needs --method trace (the stages alone are bf16's)")
    if args.loop and args.method != "trace":
        p.error("--loop needs --method trace (the loop's kernels come from a profiler trace)")

    peer_ok = not args.no_peer and peers.available()[0]
    if not args.no_peer and not peer_ok:
        print(f"# tokamax: not run ({peers.available()[1]})")
    bw, peak = measure_ceilings()
    dev = jax.devices()[0]
    rows = []
    kfile = open(args.kernels, "w") if args.kernels else None  # noqa: SIM115
    try:
        for scheme in args.scheme:  # a table each; the rows' impl names say the scheme ("cutlass fp8")
            if scheme != "bf16" and not args.no_peer:
                print(f"# tokamax: not run (a bf16 MoE; this table is {scheme})")
            print(f"# {dev.device_kind}, jax {jax.__version__}, {scheme}, method {args.method}, "
                  f"{args.routing} routing; "
                  f"measured {bw / 1e12:.2f} TB/s, {peak / 1e12:.0f} TFLOP/s bf16; microseconds per forward")
            print_xla_flags()
            print(header(), flush=True)
            for key in args.models:
                rows += run(MODELS[key], args.tokens, args.method, args.calls, peer_ok and scheme == "bf16", bw,
                            peak, kfile, scheme, args.loop, args.routing)
    finally:
        if kfile:
            kfile.close()
    if any(r.get("loop") for r in rows):
        print("\n" + loop_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
