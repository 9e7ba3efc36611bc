"""Forward + backward timings of one MoE layer, side by side in one process, with the floor.

    python bench/train_bench.py                       # GPU: the four model shapes at T=1024/4096/16384
    python bench/train_bench.py --models qwen3 --tokens 4096 --write

Each implementation runs ``jax.jit(jax.value_and_grad(loss, (x, w13, w2, router_logits)))`` with
``loss = sum(moe(x) * cotangent)`` and softmax top-k routing (renormalized), bf16 tokens and
weights; the median of many runs after warm-up, inputs rotated:

- ``cutlass``: ``fused_moe(..., backend="cutlass")``: jax_moe's CUTLASS forward and its own
  grouped-GEMM backward (``docs/TRAINING.md``).
- ``xla``: ``fused_moe(..., backend="xla")``, differentiated by JAX.
- ``tokamax``: the same MoE on tokamax's Mosaic-GPU ``ragged_dot`` and its VJP, where tokamax is
  importable (:mod:`bench.peers`), weights stored in its ``[E, K, N]`` orientation.
- ``ragged_dot``: the plain sort + ``jax.lax.ragged_dot`` MoE, differentiated by JAX.

Floor: three times the forward's FLOPs (two GEMMs forward, four backward) at the bf16 matmul peak
measured in the same run. ``--write`` appends the table to ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import peers  # noqa: E402
from bench.moe_bench import MODELS, Model, measure_ceilings, source_commit, timeit  # noqa: E402
from jax_moe import fused_moe  # noqa: E402
from jax_moe.routing import select_experts  # noqa: E402


def ragged_dot_moe(x, w13, w2, topk_weights, topk_ids):
    """The plain sort + ``jax.lax.ragged_dot`` gated-SiLU MoE (w13 [E, 2I, H], w2 [E, H, I]), written
    out here because the xla backend's ``ragged_dot`` strategy (bench/moe_bench.py's forward
    baseline) does not differentiate."""
    e, i = w13.shape[0], w2.shape[2]
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((e,), jnp.int32).at[flat].add(1)
    xs = jnp.take(x, order // k, axis=0)
    h = jax.lax.ragged_dot(xs, jnp.swapaxes(w13, 1, 2), sizes, preferred_element_type=jnp.float32)
    a = (jax.nn.silu(h[:, :i]) * h[:, i:]).astype(x.dtype)
    y = jax.lax.ragged_dot(a, jnp.swapaxes(w2, 1, 2), sizes, preferred_element_type=jnp.float32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0]))
    return jnp.einsum("tkh,tk->th", jnp.take(y, inverse, axis=0).reshape(t, k, -1), topk_weights).astype(x.dtype)


def implementations(k: int, peer_impls: dict) -> dict:
    """name -> (prepare(w13, w2) -> weights, moe(x, weights, router_logits) -> [T, H]); ``peer_impls``
    from :func:`bench.peers.implementations`."""
    def routed(fn):
        def moe(x, weights, logits):
            w, ids = select_experts(logits, k)
            return fn(x, weights, w, ids)
        return moe

    impls = {
        "cutlass": (lambda a, b: (a, b), lambda x, ws, lg: fused_moe(x, *ws, lg, k, backend="cutlass")),
        "xla": (lambda a, b: (a, b), lambda x, ws, lg: fused_moe(x, *ws, lg, k, backend="xla")),
        "ragged_dot": (lambda a, b: (a, b), routed(lambda x, ws, w, ids: ragged_dot_moe(x, *ws, w, ids))),
    }
    for name, (_, prep, fn) in peer_impls.items():
        impls[name] = (prep, routed(fn))
    return impls


def step(moe):
    """jit(value_and_grad) of sum(moe(x) * cot) in x, the weights and the router logits."""
    def loss(x, weights, logits, cot):
        return jnp.sum(moe(x, weights, logits).astype(jnp.float32) * cot)

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))


def run_model(m: Model, tokens: list[int], peak: float, names: list[str], peer_impls: dict, rows: list) -> None:
    rng = np.random.default_rng(0)
    w13 = jnp.asarray(rng.standard_normal((m.e, 2 * m.i, m.h)) / np.sqrt(m.h), jnp.bfloat16)
    w2 = jnp.asarray(rng.standard_normal((m.e, m.h, m.i)) / np.sqrt(m.i), jnp.bfloat16)
    impls = {n: v for n, v in implementations(m.k, peer_impls).items() if n in names}
    for t in tokens:
        inputs = [(jnp.asarray(rng.standard_normal((t, m.h)), jnp.bfloat16),
                   jnp.asarray(rng.standard_normal((t, m.e)), jnp.float32),
                   jnp.asarray(rng.standard_normal((t, m.h)), jnp.float32)) for _ in range(2)]
        floor = 1e3 * 3 * (2 * t * m.k * 3 * m.h * m.i) / peak
        row = {"model": m.name, "T": t, "floor": floor}
        for name, (prep, moe) in impls.items():
            weights = prep(w13, w2)
            f = step(moe)
            try:
                row[name] = timeit(lambda x, lg, c: f(x, weights, lg, c), inputs, budget_s=1.0)
            except Exception as err:  # out of memory, or a peer that cannot run this shape
                print(f"# {m.name} T={t} {name}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                row[name] = None
            jax.clear_caches()
        rows.append(row)
        print(format_row(row, list(impls)), flush=True)


def fmt(v) -> str:
    return "n/a" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def header(names: list[str]) -> str:
    cols = ["model", "T", *(f"{n} ms" for n in names), "cutlass vs tokamax", "cutlass vs ragged_dot",
            "floor ms", "cutlass % of floor"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def format_row(row: dict, names: list[str]) -> str:
    c = row.get("cutlass")

    def ratio(other):
        o = row.get(other)
        return "n/a" if c is None or o is None else f"{o / c:.2f}x"

    pct = "n/a" if c is None else f"{100 * row['floor'] / c:.0f}%"
    cells = [row["model"], str(row["T"]), *(fmt(row.get(n)) for n in names), ratio("tokamax"),
             ratio("ragged_dot"), fmt(row["floor"]), pct]
    return "| " + " | ".join(cells) + " |"


def main(argv=None) -> None:
    on_gpu = jax.devices()[0].platform == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["mixtral", "qwen3", "deepseek", "gptoss"] if on_gpu else ["tiny"],
                   choices=sorted(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 4096, 16384] if on_gpu else [64])
    p.add_argument("--impls", nargs="+", default=None, help="only these implementations")
    p.add_argument("--write", action="store_true", help="append the table to bench/RESULTS.md")
    args = p.parse_args(argv)
    _, peak = measure_ceilings()
    dev = jax.devices()[0]
    peer_impls = peers.implementations()
    names = [n for n in implementations(2, peer_impls) if args.impls is None or n in args.impls]
    print(f"# {dev.device_kind}, jax {jax.__version__}; bf16 matmul peak {peak / 1e12:.0f} TFLOP/s")
    print(header(names))
    rows: list = []
    for name in args.models:
        run_model(MODELS[name], args.tokens, peak, names, peer_impls, rows)
    if args.write:
        commit = source_commit()
        with open(os.path.join(os.path.dirname(__file__), "RESULTS.md"), "a") as fh:
            fh.write(f"\n## Training step (forward + backward), {dev.device_kind}, {datetime.date.today()}, "
                     f"commit {commit}, jax {jax.__version__}; measured {peak / 1e12:.0f} TFLOP/s bf16 matmul\n\n"
                     "`python bench/train_bench.py`: jit(value_and_grad) in x, w13, w2 and the router logits; "
                     "floor = 3 x the forward FLOPs at the measured peak.\n\n")
            fh.write(header(names) + "\n" + "\n".join(format_row(r, names) for r in rows) + "\n")


if __name__ == "__main__":
    main()
