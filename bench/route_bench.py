"""Routing's device time: ``select_experts`` (one route kernel on a GPU) against its pure-JAX path
with the top-k kernel, and with ``jax.lax.top_k``, per model's router, from one profiler trace
(kernel time, no dispatch).

    python bench/route_bench.py --tokens 64 4096 16384

Rows: the model's routing mode (Qwen3-30B-A3B: softmax top-8 of 128; GPT-OSS-120B: softmax top-4
of 128; Mixtral-8x7B: softmax top-2 of 8; DeepSeek-V3: sigmoid scores with a correction bias, the
best 4 of 8 groups, top-8 of 256, scaled by 2.5), microseconds and kernels per call, and the route
kernel's speedup over ``lax.top_k``'s routing. Needs a GPU with jax_moe's CUDA module; elsewhere
every column is the pure-JAX path on ``lax.top_k``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench import kernel_trace  # noqa: E402
from jax_moe import routing, top_k  # noqa: E402

ROUTERS = {  # name: (E, k, select_experts options)
    "qwen3": (128, 8, {}),
    "gptoss": (128, 4, {}),
    "mixtral": (8, 2, {}),
    "deepseek": (256, 8, dict(scoring="sigmoid", num_expert_group=8, topk_group=4, routed_scaling_factor=2.5)),
}


COLUMNS = ("route kernel", "pure JAX + top-k kernel", "pure JAX + lax.top_k")


def routers(name: str, e: int, k: int, opts: dict):
    """The router's select_experts, jitted three ways, in the order of COLUMNS."""
    if "num_expert_group" in opts:
        opts = dict(opts, e_score_correction_bias=jnp.linspace(-0.1, 0.1, e, dtype=jnp.float32))
    fused = jax.jit(lambda lg: routing.select_experts(lg, k, **opts))
    on_kernel = jax.jit(lambda lg: routing.select_experts_lax(lg, k, **opts))

    def on_lax(lg):
        saved = top_k.top_k
        top_k.top_k = top_k.lax_top_k  # routing calls top_k.top_k at trace time
        try:
            return routing.select_experts_lax(lg, k, **opts)
        finally:
            top_k.top_k = saved

    return fused, on_kernel, jax.jit(on_lax)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(ROUTERS), choices=list(ROUTERS))
    p.add_argument("--tokens", nargs="+", type=int, default=[64, 4096, 16384])
    p.add_argument("--calls", type=int, default=7)
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    print(f"# {dev.device_kind} ({dev.platform}), jax {jax.__version__}; microseconds of device time per call\n")
    head = " | ".join(f"{c} us (kernels)" for c in COLUMNS)
    print(f"| router | T | {head} | speedup |\n|---|---|{'---|' * len(COLUMNS)}---|")
    for name in args.models:
        e, k, opts = ROUTERS[name]
        for t in args.tokens:
            logits = jax.random.normal(jax.random.key(t), (t, e), jnp.float32)
            fns = routers(name, e, k, opts)
            for fn in fns:
                jax.block_until_ready(fn(logits))
            groups = kernel_trace.trace_calls([(fn, (logits,)) for fn in fns for _ in range(args.calls)])
            if groups is None:
                print(f"| {name} | {t} | {'n/a | ' * len(COLUMNS)}|")
                continue
            cells = []
            for j in range(len(fns)):
                gs = groups[j * args.calls:(j + 1) * args.calls]
                us = statistics.median(sum(x.duration_ns for x in g) for g in gs) / 1e3
                cells.append((us, statistics.median(len(g) for g in gs)))
            text = " | ".join(f"{us:.1f} ({n:g})" for us, n in cells)
            print(f"| {name} | {t} | {text} | {cells[-1][0] / cells[0][0]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
