"""Side-by-side MoE forward timings, in one process, with the roofline next to them.

    python bench/moe_bench.py                 # GPU: the four model shapes; CPU: a small demo
    python bench/moe_bench.py --models qwen3 --tokens 1 64 1024 --write
    python bench/moe_bench.py --scheme fp8    # FP8 per-tensor weights and activations
    python bench/moe_bench.py --scheme mxfp4 --models gptoss   # MXFP4 weights, bf16 activations
    python bench/moe_bench.py --scheme fp8_block --models deepseek   # DeepSeek-V3 FP8 128x128 blocks
    python bench/moe_bench.py --scheme w4a8   # int4 group-128 weights, FP8 activations
    python bench/moe_bench.py --scheme f16    # float16 activations and weights

Columns: each implementation's median time (ms), its speedup over the plain sort +
``jax.lax.ragged_dot`` MoE, and the floor ``max(bytes / bandwidth, FLOPs / peak)`` with the
bandwidth and bf16 matmul peak measured in the same run. Implementations:

- ``xla``: jax_moe's pure-JAX backend (blocked experts) on the scheme's weights (quantized ones
  dequantized in the graph, as the reference does; ``f16``: float16 tokens and weights).
- ``ragged_dot``: the plain sort + ``jax.lax.ragged_dot`` MoE JAX users write today, always on
  bf16 weights (the baseline of the speedup column, whatever the scheme).
- ``dense``: the dense jnp reference (bf16 only; per-slot gathered weights; skipped where it
  cannot fit).
- every compiled backend the oracle finds on this machine for the scheme (e.g.
  ``flashinfer_cutlass`` and ``cutlass``, for bf16 and for ``--scheme fp8``), on weights prepared
  once before timing (its ``prepare``, as ``MoEBlock.prepare()`` does; ``cutlass`` needs none and
  runs on the stored weights).

The floor counts weight bytes at the scheme's width (:data:`SCHEMES`: FP8 1 byte, FP8 block 1 byte
plus a float32 scale per 128x128, MXFP4 half a byte plus one E8M0 byte per 32, W4A8 half a byte
plus a float32 scale per 128) and FLOPs at the measured bf16 matmul peak, x2 where the products
are FP8 (:data:`FP8_MATH`, the Hopper ratio; MXFP4 weights are multiplied in bf16).
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
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights  # noqa: E402
from jax_moe.routing import select_experts  # noqa: E402

# bytes per weight, scales included
SCHEMES = {"bf16": 2, "f16": 2, "fp8": 1, "fp8_block": 1 + 4 / (128 * 128), "mxfp4": 0.5 + 1 / 32,
           "w4a8": 0.5 + 4 / 128}
FP8_MATH = ("fp8", "fp8_block", "w4a8")  # schemes whose GEMMs run on FP8 tensor cores
TOKEN_DTYPE = {"f16": jnp.float16}       # the tokens' dtype where it is not bfloat16

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


def roofline(m: Model, t: int, bw: float, peak: float, scheme: str = "bf16") -> tuple[float, float, float]:
    """(floor ms, bytes, flops) of one forward with T=t tokens (bf16 tokens in and out)."""
    touched = m.e * (1 - (1 - m.k / m.e) ** t)
    expert_bytes = SCHEMES[scheme] * 3 * m.h * m.i
    nbytes = touched * expert_bytes + 2 * 2 * t * m.h
    flops = 2 * t * m.k * 3 * m.h * m.i
    peak = peak * (2 if scheme in FP8_MATH else 1)
    return 1e3 * max(nbytes / bw, flops / peak), nbytes, flops


def dense_reference(x, w13, w2, w, ids, cfg):
    """Per-slot gathered weights, bf16 products with float32 accumulation."""
    h = jnp.einsum("th,tknh->tkn", x, w13[ids], preferred_element_type=jnp.float32)
    g, u = h[..., : cfg.intermediate_size], h[..., cfg.intermediate_size:]
    a = (jax.nn.silu(g) * u).astype(x.dtype)
    y = jnp.einsum("tki,tkhi->tkh", a, w2[ids], preferred_element_type=jnp.float32)
    return jnp.einsum("tkh,tk->th", y, w).astype(x.dtype)


def implementations(cfg: MoEConfig, quant=None, dtype=jnp.bfloat16) -> dict:
    """name -> (uses the scheme's weights?, prepare(w13, w2) -> weights (load time, untimed),
    fn(x, weights, w, ids)); ``dtype``: the unquantized scheme weights' dtype (float16 for f16)."""
    same = lambda w13, w2: (w13, w2)  # noqa: E731
    impls = {
        "xla": (True, same, lambda x, ws, w, ids: xla.apply(x, *ws, w, ids, cfg, quant=quant)),
        "ragged_dot": (False, same, lambda x, ws, w, ids: xla.apply(x, *ws, w, ids, cfg, strategy="ragged_dot")),
    }
    if quant is None:
        impls["dense"] = (False, same, lambda x, ws, w, ids: dense_reference(x, *ws, w, ids, cfg))
    for name in oracle.MODULES:
        if name == "xla":
            continue
        mod, ok, reason = oracle.probe(name, cfg, quant, None, oracle.call_features(dtype=dtype))
        if not ok:
            print(f"# {name}: not run ({reason})")
        elif hasattr(mod, "prepare") and hasattr(mod, "apply_prepared"):
            impls[name] = (True, lambda w13, w2, mod=mod: mod.prepare(w13, w2, cfg, quant),
                           lambda x, p, w, ids, mod=mod: mod.apply_prepared(x, p, w, ids))
        else:
            impls[name] = (True, same, lambda x, ws, w, ids, mod=mod: mod.apply(x, *ws, w, ids, cfg, quant=quant))
    return impls


def quantized(scheme: str, w13, w2, m: Model):
    """(w13, w2, QuantConfig or None) of ``scheme``; FP8: per-expert weight scales and static
    activation scales calibrated on a random batch, as a checkpoint's would be."""
    if scheme == "bf16":
        return w13, w2, None
    if scheme == "f16":  # unquantized: the weights' dtype selects the scheme
        return w13.astype(jnp.float16), w2.astype(jnp.float16), None
    if scheme in ("mxfp4", "fp8_block"):  # bf16 activations / dynamic per-group: nothing to calibrate
        return quantize_weights(scheme, w13, w2)
    x = jax.random.normal(jax.random.key(7), (256, m.h), jnp.float32)
    a13 = calibrate_activation_scale("fp8_per_tensor", x)
    h1 = jnp.einsum("th,nh->tn", x, w13[0].astype(jnp.float32))
    inter = jax.nn.silu(h1[:, : m.i]) * h1[:, m.i:]
    a2 = calibrate_activation_scale("fp8_per_tensor", inter)
    return quantize_weights(scheme, w13, w2, act="fp8_per_tensor", a13_scale=a13, a2_scale=a2)


def run_model(m: Model, tokens: list[int], bw: float, peak: float, dense_limit: float, rows: list,
              scheme: str = "bf16"):
    cfg = MoEConfig(m.e, m.k, m.h, m.i)
    key = jax.random.key(0)
    k1, k2 = jax.random.split(key)
    w13 = (jax.random.normal(k1, (m.e, 2 * m.i, m.h), jnp.bfloat16) * (m.h ** -0.5)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (m.e, m.h, m.i), jnp.bfloat16) * (m.i ** -0.5)).astype(jnp.bfloat16)
    q13, q2, quant = quantized(scheme, w13, w2, m)
    tok_dtype = TOKEN_DTYPE.get(scheme, jnp.bfloat16)
    impls = implementations(cfg, quant, tok_dtype)
    print(header(list(impls)), flush=True)
    weights = {name: prep(*((q13, q2) if scheme_w else (w13, w2)))
               for name, (scheme_w, prep, _) in impls.items()}  # load time, untimed
    if quant is not None:
        del q13, q2
    for t in tokens:
        routed = []
        for r in range(3):  # rotate inputs so repeated runs don't measure the cache
            kx, kr = jax.random.split(jax.random.key(100 + r))
            x = jax.random.normal(kx, (t, m.h), jnp.bfloat16)
            w, ids = select_experts(jax.random.normal(kr, (t, m.e), jnp.float32), m.k)
            routed.append((x, w, ids))
        floor, nbytes, flops = roofline(m, t, bw, peak, scheme)
        row = {"model": m.name, "T": t, "floor": floor}
        for name, (_, _, fn) in impls.items():
            if name == "dense" and t * m.k * 3 * m.h * m.i * 2 > dense_limit:
                row[name] = None
                continue
            scheme_w = impls[name][0]
            inputs = [(x.astype(tok_dtype) if scheme_w else x, weights[name], w, ids) for x, w, ids in routed]
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
    p.add_argument("--scheme", default="bf16", choices=sorted(SCHEMES), help="expert weight format")
    p.add_argument("--tune", action="store_true",
                   help="autotune the FlashInfer CUTLASS tactics of each shape before timing it (fresh cache)")
    p.add_argument("--dense-limit-gb", type=float, default=16.0, help="skip the dense reference above this many GB")
    p.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md and save a PNG plot")
    args = p.parse_args(argv)

    if args.tune:
        import tempfile

        os.environ["JAX_MOE_FI_AUTOTUNE"] = "1"
        os.environ["JAX_MOE_FI_TUNING_CACHE"] = os.path.join(tempfile.mkdtemp(), "tactics.json")
    dev = jax.devices()[0]
    bw, peak = measure_ceilings()
    commit = os.environ.get("JAX_MOE_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=os.path.dirname(__file__)
    ).stdout.strip() or "unknown"
    title = (f"{args.scheme}{' (tactics autotuned)' if args.tune else ''}: {dev.device_kind} ({dev.platform}), {datetime.date.today()}, commit {commit}, jax {jax.__version__}; "
             f"measured {bw / 1e12:.2f} TB/s read+write, {peak / 1e12:.0f} TFLOP/s bf16 matmul")
    print("#", title)
    rows: list = []
    here = os.path.dirname(__file__)
    results = os.path.join(here, "RESULTS.md")
    if args.write:  # the section first, then each model's table as soon as it is measured
        with open(results, "a") as f:
            f.write(f"\n## {title}\n\n{args.scheme} weights, times in ms (median), floor = max(bytes / measured "
                    f"bandwidth, FLOPs / measured peak{' x2 (fp8)' if args.scheme in FP8_MATH else ''}); ragged_dot "
                    f"is bf16.\n")
    for key in args.models:
        m = MODELS[key]
        rows_before = len(rows)
        run_model(m, args.tokens, bw, peak, args.dense_limit_gb * 1e9, rows, args.scheme)
        names = [n for n in rows[rows_before] if n not in ("model", "T", "floor")] if len(rows) > rows_before else []
        table = header(names) + "\n" + "\n".join(format_row(r, names) for r in rows[rows_before:])
        if args.write:
            with open(results, "a") as f:
                f.write(f"\n{table}\n")
    print("\n" + title)
    if args.write:
        plot(rows, sorted({n for r in rows for n in r if n not in ("model", "T", "floor")}),
             os.environ.get("JAX_MOE_PLOT", os.path.join(here, "roofline.png")))


if __name__ == "__main__":
    main()
