"""Does the order in which a grouped GEMM visits its experts change a layer's time? Relabel the routing.

The grouped GEMMs visit their groups in expert order, and their persistent tile scheduler deals the
groups' tiles to the CTAs in turn. On random routing the experts' row counts differ, so which experts'
tiles run at the same time, and how heavy they are, follows from that order. Here each layer's
routing is relabeled so that the same row counts come in another order, and the forward's layer is
timed inside one jitted loop (:mod:`bench.in_loop`) for each order, all in one profiler trace per round,
the orders' places in it rotated between rounds. The expert weights are random, so relabeling the
routing gives the same work in another order; no kernel changes.

Orders (:data:`ORDERS`), each a permutation of the experts by their rows in one layer:

- ``expert``: as routed (today's order);
- ``heaviest``, ``lightest``: by rows, most or fewest first;
- ``alternate``: the heaviest, the lightest, the second heaviest, the second lightest, ...;
- ``spread``: by rows, the r-th heaviest at the r-th place of the van der Corput order (bit-reversed
  ranks where E is a power of two), so that every stretch of the order holds heavy and light experts
  in the same mix.

    JAX_MOE_CUTLASS_GROUP_ORDER=expert python bench/expert_order.py --models gptoss deepseek --tokens 4096 8192

The setup launch itself lays the groups out in the spread order where the experts are many and their
mean rows near the ridge (``docs/BACKENDS.md``); there every relabeled order reads the same, which
checks that it does. ``JAX_MOE_CUTLASS_GROUP_ORDER=expert`` keeps the routing's order, for the table.

Per layer, in microseconds: the kernels' busy time, GEMM1 and GEMM2 (medians over the rounds' calls),
each over the ``expert`` order's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import in_loop, kernel_trace  # noqa: E402
from bench.moe_bench import MODELS, Model, random_experts, routed_inputs  # noqa: E402
from bench.stage_breakdown import prepared_fn, prepared_weights  # noqa: E402

ORDERS = ("expert", "heaviest", "lightest", "alternate", "spread")


def van_der_corput_ranks(n: int) -> np.ndarray:
    """[n] int: the place of rank r in the van der Corput order of 0..n-1 (the base-2 digits of r
    mirrored about the point): bit reversal where n is a power of two."""
    def radical_inverse(r: int) -> float:
        value, scale = 0.0, 0.5
        while r:
            value += scale * (r & 1)
            r >>= 1
            scale /= 2
        return value

    places = np.empty(n, np.int64)
    places[np.argsort([radical_inverse(r) for r in range(n)], kind="stable")] = np.arange(n)
    return places


def expert_order(rows: np.ndarray, order: str) -> np.ndarray:
    """[E] int: the experts in the order ``order`` (:data:`ORDERS`) gives them, from their ``rows`` [E]
    in one layer; ties keep expert order."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    e = rows.shape[0]
    if order == "expert":
        return np.arange(e)
    by_rows = np.argsort(-rows, kind="stable")  # heaviest first
    if order == "heaviest":
        return by_rows
    if order == "lightest":
        return by_rows[::-1].copy()
    if order == "alternate":
        take = np.empty(e, np.int64)
        take[0::2] = np.arange((e + 1) // 2)
        take[1::2] = e - 1 - np.arange(e // 2)
        return by_rows[take]
    out = np.empty(e, np.int64)  # spread
    out[van_der_corput_ranks(e)] = by_rows
    return out


def relabeled(topk_ids: np.ndarray, num_experts: int, order: str) -> np.ndarray:
    """``topk_ids`` [T, k] (one layer) relabeled so that its experts' groups come in ``order``: the
    expert at place j of :func:`expert_order` becomes expert j. Same dtype and shape."""
    rows = np.bincount(topk_ids.ravel(), minlength=num_experts)
    place = np.empty(num_experts, np.int64)
    place[expert_order(rows, order)] = np.arange(num_experts)
    return place[topk_ids].astype(topk_ids.dtype)


def gemm_split(kernels: Sequence[kernel_trace.Kernel], layers: int) -> tuple[float, float] | None:
    """(GEMM1 ns, GEMM2 ns) of one loop call's kernels: its grouped GEMMs in start order alternate
    GEMM1, GEMM2 (two per layer); None if it holds another count."""
    gemms = [ns for k, ns in kernel_trace.exclusive(kernels) if kernel_trace.kind_of(k.name) == "gemm"]
    if len(gemms) != 2 * layers:
        return None
    return sum(gemms[0::2]), sum(gemms[1::2])


def time_orders(m: Model, t: int, layers: int, rounds: int, orders: Sequence[str], calls: int = 2
                ) -> dict[str, dict[str, float]]:
    """Per order: busy, GEMM1 and GEMM2 microseconds per layer of ``m`` at ``t`` tokens in a loop of
    ``layers`` layers (medians over ``rounds`` traces of ``calls`` loop calls per order)."""
    w13, w2 = random_experts(m)
    weights = prepared_weights(m, w13, w2)
    del w13, w2
    x = routed_inputs(m, t, sets=1)[0][0]
    fn = prepared_fn()
    tw, ids = in_loop.stacked_routing(t, m.e, m.k, layers)
    tw = tw * in_loop.output_scale(fn, x, weights, tw[0], ids[0])
    loop = in_loop.layer_loop(fn, layers)
    ids_np = np.asarray(ids)
    args = {o: (x, weights, tw, jax.numpy.asarray(np.stack([relabeled(ids_np[n], m.e, o) for n in range(layers)])))
            for o in orders}
    for a in args.values():
        jax.block_until_ready(loop(*a))
    samples: dict[str, dict[str, list[float]]] = {o: {"busy": [], "gemm1": [], "gemm2": []} for o in orders}
    for r in range(rounds):
        rotated = list(orders[r % len(orders):]) + list(orders[:r % len(orders)])
        groups = kernel_trace.trace_calls([(loop, args[o]) for o in rotated for _ in range(calls)])
        if groups is None:
            raise RuntimeError(f"{m.name} T={t}: the trace could not be split into its {len(rotated) * calls} calls")
        for j, o in enumerate(rotated):
            for g in groups[calls * j: calls * (j + 1)]:
                samples[o]["busy"].append(kernel_trace.busy_ns(g) / layers / 1e3)
                split = gemm_split(g, layers)
                if split is not None:
                    samples[o]["gemm1"].append(split[0] / layers / 1e3)
                    samples[o]["gemm2"].append(split[1] / layers / 1e3)
    return {o: {key: (statistics.median(v) if v else float("nan")) for key, v in s.items()} for o, s in samples.items()}


def table(rows: list[tuple[str, int, dict[str, dict[str, float]]]]) -> str:
    """The markdown table: per model, T and order, us per layer and the ratio to ``expert``."""
    lines = ["| model | T | order | busy us | / expert | GEMM1 us | / expert | GEMM2 us | / expert |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, t, result in rows:
        base = result["expert"]
        for o, v in result.items():
            cells = [name, str(t), o]
            for key in ("busy", "gemm1", "gemm2"):
                cells += [f"{v[key]:.1f}", f"{v[key] / base[key]:.3f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["gptoss", "deepseek"], choices=sorted(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 8192])
    p.add_argument("--loop", type=int, default=8, metavar="N", help="layers in the jitted loop")
    p.add_argument("--rounds", type=int, default=3, help="traces, each of every order's calls")
    p.add_argument("--orders", nargs="+", choices=ORDERS, default=list(ORDERS))
    args = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu":
        print("# expert_order: needs a GPU (the loops' kernels come from a profiler trace of the cutlass backend)")
        return 0
    orders = ["expert"] + [o for o in args.orders if o != "expert"]
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, bf16, random routing, a loop of {args.loop} "
          f"layers, {args.rounds} rounds; microseconds per layer", flush=True)
    rows = []
    for key in args.models:
        for t in args.tokens:
            result = time_orders(MODELS[key], t, args.loop, args.rounds, orders)
            rows.append((MODELS[key].name, t, result))
            print(table([rows[-1]]), flush=True)
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
