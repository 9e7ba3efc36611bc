"""Side-by-side MoE forward timings, in one process, with the roofline next to them.

    python bench/moe_bench.py                 # GPU: the four model shapes; CPU: a small demo
    python bench/moe_bench.py --models qwen3 --tokens 1 64 1024 --write

Columns: each implementation's median time (ms), its speedup over the plain sort +
``jax.lax.ragged_dot`` MoE, and the floor ``max(bytes / bandwidth, FLOPs / peak)`` with the
bandwidth and bf16 matmul peak measured in the same run. Implementations:

- ``xla``: jax_moe's pure-JAX backend (blocked experts).
- ``ragged_dot``: the plain sort + ``jax.lax.ragged_dot`` MoE JAX users write today.
- ``dense``: the dense jnp reference (per-slot gathered weights; skipped where it cannot fit).
- every compiled backend the oracle finds on this machine (e.g. ``flashinfer_cutlass``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from jax_moe import oracle  # noqa: E402
from jax_moe.backends import xla  # noqa: E402
from jax_moe.config import MoEConfig  # noqa: E402
from jax_moe.routing import select_experts  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    e: int
    h: int
    i: int
    k: int


MODELS = {
    "mixtral": Model("Mixtral-8x7B", 8, 4096, 14336, 2),
    "qwen3": Model("Qwen3-30B-A3B", 128, 2048, 768, 8),
    "deepseek": Model("DeepSeek-V3", 256, 7168, 2048, 8),
    "gptoss": Model("GPT-OSS-120B", 128, 2880, 2880, 4),
    "tiny": Model("tiny (CPU demo)", 16, 256, 128, 4),
}


def timeit(fn, inputs, min_iters=5, max_iters=50, budget_s=0.6) -> float:
    """Median wall time (ms) of ``fn(*inputs[n % len(inputs)])`` after warm-up; blocks on each."""
    jax.block_until_ready(fn(*inputs[0]))  # compile + warm-up
    jax.block_until_ready(fn(*inputs[-1]))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*inputs[0]))
    first = time.perf_counter() - t0
    iters = int(min(max_iters, max(min_iters, budget_s / max(first, 1e-6))))
    times = []
    for n in range(iters):
        args = inputs[n % len(inputs)]
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure_ceilings() -> tuple[float, float]:
    """(bytes/s of an elementwise read+write, bf16 matmul FLOP/s) on the default device."""
    on_gpu = jax.devices()[0].platform == "gpu"
    n = (1 << 28) if on_gpu else (1 << 22)
    a = jnp.ones((n,), jnp.float32) * 1.5
    t = timeit(jax.jit(lambda v: v * 1.0001 + 1.0), [(a,)])
    bw = 2 * 4 * n / (t * 1e-3)
    m = 8192 if on_gpu else 512
    x = jax.random.normal(jax.random.key(0), (m, m), jnp.bfloat16)
    t = timeit(jax.jit(lambda p, q: p @ q), [(x, x)])
    return bw, 2 * m**3 / (t * 1e-3)


def roofline(m: Model, t: int, bw: float, peak: float) -> tuple[float, float, float]:
    """(floor ms, bytes, flops) of one bf16 forward with T=t tokens."""
    touched = m.e * (1 - (1 - m.k / m.e) ** t)
    expert_bytes = 2 * 3 * m.h * m.i
    nbytes = touched * expert_bytes + 2 * 2 * t * m.h
    flops = 2 * t * m.k * 3 * m.h * m.i
    return 1e3 * max(nbytes / bw, flops / peak), nbytes, flops


def dense_reference(x, w13, w2, w, ids, cfg):
    """Per-slot gathered weights, bf16 products with float32 accumulation."""
    h = jnp.einsum("th,tknh->tkn", x, w13[ids], preferred_element_type=jnp.float32)
    g, u = h[..., : cfg.intermediate_size], h[..., cfg.intermediate_size:]
    a = (jax.nn.silu(g) * u).astype(x.dtype)
    y = jnp.einsum("tki,tkhi->tkh", a, w2[ids], preferred_element_type=jnp.float32)
    return jnp.einsum("tkh,tk->th", y, w).astype(x.dtype)


def implementations(cfg: MoEConfig) -> dict:
    """name -> (prepare(w13, w2) -> (w13, w2), run at load time; fn(x, w13, w2, w, ids))."""
    same = lambda w13, w2: (w13, w2)  # noqa: E731
    impls = {
        "xla": (same, lambda *a: xla.apply(*a, cfg)),
        "ragged_dot": (same, lambda *a: xla.apply(*a, cfg, strategy="ragged_dot")),
        "dense": (same, lambda *a: dense_reference(*a, cfg)),
    }
    for name in oracle.MODULES:
        if name == "xla":
            continue
        mod, ok, reason = oracle.probe(name, cfg, None, None)
        if not ok:
            print(f"# {name}: not run ({reason})")
        elif hasattr(mod, "prepare_weights") and hasattr(mod, "apply_prepared"):
            impls[name] = (lambda w13, w2, mod=mod: mod.prepare_weights(w13, w2, cfg.activation, cfg.gate_up_layout),
                           lambda *a, mod=mod: mod.apply_prepared(*a, cfg.activation))
        else:
            impls[name] = (same, lambda *a, mod=mod: mod.apply(*a, cfg))
    return impls


def run_model(m: Model, tokens: list[int], bw: float, peak: float, dense_limit: float, rows: list):
    cfg = MoEConfig(m.e, m.k, m.h, m.i)
    key = jax.random.key(0)
    k1, k2 = jax.random.split(key)
    w13 = (jax.random.normal(k1, (m.e, 2 * m.i, m.h), jnp.bfloat16) * (m.h ** -0.5)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (m.e, m.h, m.i), jnp.bfloat16) * (m.i ** -0.5)).astype(jnp.bfloat16)
    impls = implementations(cfg)
    weights = {name: prep(w13, w2) for name, (prep, _) in impls.items()}  # load time, untimed
    for t in tokens:
        routed = []
        for r in range(3):  # rotate inputs so repeated runs don't measure the cache
            kx, kr = jax.random.split(jax.random.key(100 + r))
            x = jax.random.normal(kx, (t, m.h), jnp.bfloat16)
            w, ids = select_experts(jax.random.normal(kr, (t, m.e), jnp.float32), m.k)
            routed.append((x, w, ids))
        floor, nbytes, flops = roofline(m, t, bw, peak)
        row = {"model": m.name, "T": t, "floor": floor}
        for name, (_, fn) in impls.items():
            if name == "dense" and t * m.k * 3 * m.h * m.i * 2 > dense_limit:
                row[name] = None
                continue
            inputs = [(x, *weights[name], w, ids) for x, w, ids in routed]
            try:
                row[name] = timeit(jax.jit(fn), inputs)
            except Exception as err:  # out of memory and the like: recorded, not fatal
                msg = str(err).splitlines()[0][:80]
                print(f"# {m.name} T={t} {name}: failed ({msg})")
                row[name] = None
        rows.append(row)
        print(format_row(row, list(impls)), flush=True)
    del w13, w2, weights


def fmt(v):
    return "n/a" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def format_row(row, names):
    base = row.get("ragged_dot")
    cells = [row["model"], str(row["T"])]
    for n in names:
        v = row.get(n)
        cells.append(fmt(v))
    best = min((row[n] for n in names if n not in ("ragged_dot", "dense") and row.get(n)), default=None)
    cells.append("n/a" if not (best and base) else f"{base / best:.2f}x")
    cells.append(fmt(row["floor"]))
    cells.append("n/a" if not best else f"{100 * row['floor'] / best:.0f}%")
    return "| " + " | ".join(cells) + " |"


def header(names):
    cols = ["model", "T"] + [f"{n} ms" for n in names] + ["best jax_moe vs ragged_dot", "floor ms", "best % of floor"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def plot(rows, names, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("# matplotlib missing: no plot")
        return
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, mname in zip(axes[0], models):
        rs = [r for r in rows if r["model"] == mname]
        ts = [r["T"] for r in rs]
        for n in names + ["floor"]:
            ys = [r.get(n) for r in rs]
            pts = [(t, y) for t, y in zip(ts, ys) if y]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=n, linestyle="--" if n == "floor" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(mname)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("ms")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"# plot written to {path}")


def main(argv=None):
    on_gpu = jax.devices()[0].platform == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["mixtral", "qwen3", "deepseek", "gptoss"] if on_gpu else ["tiny"],
                   choices=sorted(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 64, 1024, 4096, 16384] if on_gpu else [1, 16, 256])
    p.add_argument("--dense-limit-gb", type=float, default=16.0, help="skip the dense reference above this many GB")
    p.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md and save a PNG plot")
    args = p.parse_args(argv)

    dev = jax.devices()[0]
    bw, peak = measure_ceilings()
    commit = os.environ.get("JAX_MOE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
    ).stdout.strip() or "unknown"
    title = (f"{dev.device_kind} ({dev.platform}), {datetime.date.today()}, commit {commit}, jax {jax.__version__}; "
             f"measured {bw / 1e12:.2f} TB/s read+write, {peak / 1e12:.0f} TFLOP/s bf16 matmul")
    print("#", title)
    rows: list = []
    names = None
    for key in args.models:
        m = MODELS[key]
        names = list(implementations(MoEConfig(m.e, m.k, m.h, m.i)))
        print(header(names), flush=True)
        run_model(m, args.tokens, bw, peak, args.dense_limit_gb * 1e9, rows)
    table = header(names) + "\n" + "\n".join(format_row(r, names) for r in rows)
    print("\n" + title + "\n" + table)
    if args.write:
        here = os.path.dirname(__file__)
        with open(os.path.join(here, "RESULTS.md"), "a") as f:
            f.write(f"\n## {title}\n\nbf16, times in ms (median), floor = max(bytes / measured bandwidth, "
                    f"FLOPs / measured peak).\n\n{table}\n")
        plot(rows, names, os.environ.get("JAX_MOE_PLOT", os.path.join(here, "roofline.png")))


if __name__ == "__main__":
    main()
