"""One of the bench's layers, its prepared forward run a few times, for a profiler to attach to.

Random weights of the layer's shapes are prepared for the cutlass backend (FP8: quantized first),
as ``MoEBlock.prepare()`` leaves them, and the jitted ``cutlass.apply_prepared`` runs ``--runs``
times on one routed input: the same forward ``bench/stage_breakdown.py`` traces, built by its
``prepared_weights`` and ``prepared_fn``. The first run
compiles; skip it in the profiler::

    ncu --launch-skip 2 --launch-count 1 -k regex:ScatterRowsAdapter \\
        python bench/profile_forward.py --model qwen3 --scheme fp8 --tokens 4096
    nsys profile python bench/profile_forward.py --model deepseek --tokens 16384

``bench/ncu_gemm.sh`` wraps the first. ``--routing balanced`` gives every expert the same rows
(``bench.routings.balanced_routing``), so that no GEMM runs a partly filled row tile.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402

from bench.moe_bench import MODELS, random_experts, routed_inputs  # noqa: E402
from bench.routings import ROUTINGS  # noqa: E402
from bench.stage_breakdown import prepared_fn, prepared_weights  # noqa: E402

SCHEMES = ("bf16", "fp8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    parser.add_argument("--scheme", choices=SCHEMES, default="bf16")
    parser.add_argument("--tokens", type=int, default=4096, help="T, the tokens of the forward")
    parser.add_argument("--runs", type=int, default=4, help="forwards run (the first compiles)")
    parser.add_argument("--routing", choices=ROUTINGS, default="random",
                        help="random softmax top-k, or the same rows for every expert")
    args = parser.parse_args(argv)
    if args.tokens < 1 or args.runs < 1:
        parser.error("--tokens and --runs need to be at least 1")
    m = MODELS[args.model]
    w13, w2 = random_experts(m)
    weights = prepared_weights(m, w13, w2, args.scheme)
    del w13, w2
    x, w, ids = routed_inputs(m, args.tokens, sets=1, routing=args.routing)[0]
    forward = jax.jit(prepared_fn())
    for _ in range(args.runs):
        forward(x, weights, w, ids).block_until_ready()
    print(f"{m.name} {args.scheme} T={args.tokens} ({args.routing} routing): {args.runs} forwards run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
