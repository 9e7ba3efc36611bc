"""Expert-parallel MoE on every local GPU: naive (all-gather + reduce-scatter) vs all-to-all.

    python bench/ep_bench.py                       # DeepSeek-V3 shapes, T = 64 1024 8192 per device
    python bench/ep_bench.py --tokens 64 --check   # also compare with the single-device result
    python bench/ep_bench.py --backend flashinfer_cutlass   # experts on the FlashInfer runner
                                                            # (weights repacked per device once)
    python bench/ep_bench.py --backend cutlass --expert-format standard batched
                                  # also the batched expert format after the dispatch (GPU: cutlass)

Prints, per tokens-per-device T: median step time of each strategy and the bytes each device
sends per step (counted from the routing, not estimated): naive sends its tokens to every other
device and reduce-scatters float32 partials; all_to_all (the default, capacity-padded) sends a
fixed [ep, T, H] buffer, zero rows included, and gets float32 partials back the same way;
all_to_all ragged (``jax.lax.ragged_all_to_all``) sends each token once to each other device that
owns one of its experts, and the partial outputs back.

``--expert-format batched`` times each strategy again with ``ParallelConfig(expert_format="batched")``
(columns ``<strategy>+batched``: the same exchange, the received token copies laid out as
[E_local, ep * T, H] for the backend's ``apply_batched``). Its temporaries grow as E_local * ep * T
rows; a T whose estimate (:func:`batched_bytes`) passes ``--batched-max-gb`` is skipped (nan). With
``--backend xla`` every row of that capacity is computed (a reference, not a fast path).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.moe_bench import source_commit, timeit  # noqa: E402
from jax_moe import fused_experts, select_experts  # noqa: E402
from jax_moe.parallel import (  # noqa: E402
    ParallelConfig,
    parallel_apply_prepared,
    parallel_fused_experts,
    shard_prepared,
    shard_weights,
)


def bytes_sent(ids: np.ndarray, ep: int, e_local: int, h: int, t_local: int, xb: int = 2) -> dict[str, float]:
    """Mean bytes one device sends per step, per strategy; ``xb`` bytes per token value on the
    wire (2 for bf16, 1 when FP8 tokens are quantized before dispatch). Every strategy sends
    each row with its k ids (int32) and k weights (float32) and gets float32 partials back."""
    row = xb * h + 8 * ids.shape[1] + 4 * h
    naive = (ep - 1) * t_local * row
    padded = (ep - 1) * t_local * row  # the same volume: a fixed T-row slot per destination
    owner = ids // e_local  # [T, k]
    a2a = 0.0
    for src in range(ep):
        mine = owner[src * t_local:(src + 1) * t_local]
        for dst in range(ep):
            if dst != src:
                rows = (mine == dst).any(1).sum()
                a2a += rows * row
    return {"naive": naive, "all_to_all": padded, "all_to_all_ragged": a2a / ep}


def batched_bytes(e_local: int, rows: int, h: int, i: int, xb: int = 2) -> int:
    """Bytes of one device's batched-format temporaries: x, GEMM1's output, the activation and
    y, each [E_local, rows, ...] in bf16 (``xb`` bytes per value)."""
    return e_local * rows * xb * (h + 2 * i + i + h)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", nargs="+", type=int, default=[64, 1024, 8192], help="tokens per device")
    p.add_argument("--check", action="store_true", help="compare with the single-device MoE")
    p.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    p.add_argument("--scheme", default="bf16", choices=["bf16", "fp8"],
                   help="fp8: FP8 per-tensor weights (flashinfer_cutlass quantizes tokens before dispatch)")
    p.add_argument("--backend", default="xla", choices=["xla", "cutlass", "flashinfer_cutlass"],
                   help="the local experts' backend (flashinfer_cutlass: prepared weights)")
    p.add_argument("--no-ragged", action="store_true", help="skip the ragged_all_to_all exchange (GPU only)")
    p.add_argument("--expert-format", nargs="+", default=["standard"], choices=["standard", "batched"],
                   help="the local experts' input after the dispatch (ParallelConfig.expert_format)")
    p.add_argument("--batched-max-gb", type=float, default=16.0,
                   help="skip the batched format where its temporaries would pass this (GB per device)")
    args = p.parse_args(argv)
    if "batched" in args.expert_format and args.backend == "flashinfer_cutlass":
        p.error("--expert-format batched: flashinfer_cutlass (prepared weights) has no batched stage; "
                "use --backend cutlass (GPU) or xla")

    devs = jax.devices()
    ep = len(devs)
    mesh = Mesh(np.array(devs), ("ep",))
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    kw, k2 = jax.random.split(jax.random.key(0))
    w13 = jax.random.normal(kw, (e, 2 * i, h), jnp.bfloat16) * (h ** -0.5)
    w2 = jax.random.normal(k2, (e, h, i), jnp.bfloat16) * (i ** -0.5)
    rows = []
    exchanges = {"naive": dict(strategy="naive"), "all_to_all": dict(strategy="all_to_all")}
    if not args.no_ragged and devs[0].platform == "gpu":  # XLA:CPU has no ragged-all-to-all
        exchanges["all_to_all_ragged"] = dict(strategy="all_to_all", ragged=True)
    strategies = {name + ("" if fmt == "standard" else "+batched"):
                  ParallelConfig(mesh, ep_axis="ep", expert_format=fmt, **opts)
                  for fmt in args.expert_format for name, opts in exchanges.items()}
    quant = None
    if args.scheme == "fp8":
        from jax_moe.quant.scheme import quantize_weights

        w13, w2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a2_scale=0.02)
    prepared = args.backend == "flashinfer_cutlass"
    base = ParallelConfig(mesh, ep_axis="ep")
    if not prepared:
        placed = shard_weights(w13, w2, base, quant=quant)
    else:
        placed = shard_prepared(w13, w2, base, backend=args.backend, quant=quant)
    tok = NamedSharding(mesh, P("ep"))
    for t_local in args.tokens:
        t = t_local * ep
        kx, kr = jax.random.split(jax.random.key(t))
        x = jax.device_put(jax.random.normal(kx, (t, h), jnp.bfloat16), tok)
        w, ids = select_experts(jax.random.normal(kr, (t, e), jnp.float32), k)
        w, ids = jax.device_put(w, tok), jax.device_put(ids, tok)
        row = {"T": t_local}
        for name, pcfg in strategies.items():
            need = batched_bytes(e // ep, ep * t_local, h, i)
            if pcfg.expert_format == "batched" and need > args.batched_max_gb * 1e9:
                print(f"{name}: skipped at T={t_local}, batched temporaries ~{need / 1e9:.1f} GB/device "
                      "(--batched-max-gb)", flush=True)
                row[name] = float("nan")
                continue
            if not prepared:
                fn = jax.jit(lambda x, w, ids, p, pcfg=pcfg: parallel_fused_experts(
                    x, p["w13"], p["w2"], w, ids, pcfg, quant=p["quant"], backend=args.backend))
            else:
                fn = jax.jit(lambda x, w, ids, p, pcfg=pcfg: parallel_apply_prepared(x, p, w, ids, pcfg,
                                                                                     backend=args.backend))
            row[name] = timeit(fn, [(x, w, ids, placed)])
            if args.check:
                ref = jax.jit(lambda *a: fused_experts(*a, quant=quant))(
                    jax.device_put(x, devs[0]), jax.device_put(w13, devs[0]), jax.device_put(w2, devs[0]),
                    jax.device_put(w, devs[0]), jax.device_put(ids, devs[0]))
                out = np.asarray(fn(x, w, ids, placed), np.float64)
                r = np.asarray(ref, np.float64)
                row[name + "_err"] = float(np.linalg.norm(out - r) / np.linalg.norm(r))
        sent = bytes_sent(np.asarray(ids), ep, e // ep, h, t_local, 1 if args.scheme == "fp8" and prepared else 2)
        row["bytes"] = {name: sent[name.split("+")[0]] for name in strategies}  # a format moves what its exchange does
        rows.append(row)
        print(row, flush=True)

    commit = source_commit()
    title = (f"{ep} x {devs[0].device_kind}, {datetime.date.today()}, commit {commit}: expert parallel "
             f"E={e} H={h} I={i} k={k}, {args.scheme}, {args.backend} backend")
    names = list(strategies)
    table = ["| T per device | " + " | ".join(f"{n} ms" for n in names) + " | "
             + " | ".join(f"{n} MB sent/device" for n in names) + " |",
             "|---" * (1 + 2 * len(names)) + "|"]
    for r in rows:
        table.append(f"| {r['T']} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " | "
                     + " | ".join(f"{r['bytes'][n] / 1e6:.1f}" for n in names) + " |")
    text = "\n".join(table)
    print("\n" + title + "\n" + text)
    if args.write:
        with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as f:
            f.write(f"\n## {title}\n\n{text}\n")


if __name__ == "__main__":
    main()
