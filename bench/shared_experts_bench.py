"""How to run shared experts: as a dense MLP in XLA next to the routed experts ("dense", what
``MoEBlock`` does unless prepared), as their own one-expert call on the routed experts' backend
("separate", after ``MoEBlock.prepare()``), or appended to the routed experts as always-selected extra
experts in one call ("fused": the shared MLP of size S*I split into S experts of size I, each
token's ids extended by E..E+S-1 with weight 1). Both on the backend ``MoEBlock.prepare()``
picks, against the routed experts alone, in one process, median ms after warm-up.

    python bench/shared_experts_bench.py                      # GPU: DeepSeek-V3 FP8 block, Qwen2-57B bf16
    python bench/shared_experts_bench.py --models tiny        # CPU
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.moe_bench import timeit  # noqa: E402
from jax_moe import fused_experts, oracle  # noqa: E402
from jax_moe.config import MoEConfig  # noqa: E402
from jax_moe.quant.scheme import quantize_weights  # noqa: E402
from jax_moe.shared_experts import dense_mlp  # noqa: E402

MODELS = {  # E, H, I, k, shared experts of size I, scheme
    "deepseek": (256, 7168, 2048, 8, 1, "fp8_block"),
    "qwen2_57b": (64, 3584, 2560, 8, 8, "bf16"),
    "tiny": (16, 256, 128, 4, 2, "bf16"),
}


def runner(w13, w2, k: int, quant):
    """(fn(weights, x, topk_weights, ids), weights, backend name) for these experts on the backend
    ``MoEBlock.prepare()`` would pick (weights are arguments, never captured constants)."""
    e, _, h = w13.shape
    cfg = MoEConfig(e, k, h, w2.shape[2])
    sel = oracle.select_backend(cfg, quant, prepared=True, features=oracle.call_features(
        dtype=w13.dtype if quant is None else None))
    if hasattr(sel.module, "prepare") and hasattr(sel.module, "apply_prepared"):
        return (lambda p, x, w, ids: sel.module.apply_prepared(x, p, w, ids),
                sel.module.prepare(w13, w2, cfg, quant), sel.name)
    return (lambda p, x, w, ids: fused_experts(x, p[0], p[1], w, ids, quant=p[2]), (w13, w2, quant), sel.name)


def split_shared(s13, s2, pieces: int):
    """One shared MLP [1, 2*S*I, H] / [1, H, S*I] -> S experts [S, 2I, H] / [S, H, I] (same sum)."""
    _, rows, h = s13.shape
    i = rows // 2 // pieces
    gate, up = s13[0, : rows // 2].reshape(pieces, i, h), s13[0, rows // 2:].reshape(pieces, i, h)
    return jnp.concatenate([gate, up], 1), jnp.transpose(s2[0].reshape(h, pieces, i), (1, 0, 2))


def run(model: str, tokens: list[int]) -> list[str]:
    e, h, i, k, s, scheme = MODELS[model]
    key = jax.random.key(0)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    w13 = (jax.random.normal(k1, (e, 2 * i, h), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (e, h, i), jnp.float32) / np.sqrt(i)).astype(jnp.bfloat16)
    s13 = (jax.random.normal(k3, (1, 2 * s * i, h), jnp.float32) / np.sqrt(h)).astype(jnp.bfloat16)
    s2 = (jax.random.normal(k4, (1, h, s * i), jnp.float32) / np.sqrt(s * i)).astype(jnp.bfloat16)
    f13, f2 = split_shared(s13, s2, s)
    all13, all2 = jnp.concatenate([w13, f13]), jnp.concatenate([w2, f2])
    q = {}
    if scheme != "bf16":
        w13, w2, q["routed"] = quantize_weights(scheme, w13, w2)
        s13, s2, q["shared"] = quantize_weights(scheme, s13, s2)
        all13, all2, q["fused"] = quantize_weights(scheme, all13, all2)
    f_routed, p_routed, name = runner(w13, w2, k, q.get("routed"))
    f_shared, p_shared, _ = runner(s13, s2, 1, q.get("shared"))
    f_fused, p_fused, _ = runner(all13, all2, k + s, q.get("fused"))
    d_shared = (s13, s2, q.get("shared"))
    scfg = MoEConfig(1, 1, h, s * i)
    del w13, w2, all13, all2
    routed = jax.jit(f_routed)
    fused = jax.jit(f_fused)
    sep = jax.jit(lambda pr, ps, x, w, ids, o, z: f_routed(pr, x, w, ids) + f_shared(ps, x, o, z))
    dense = jax.jit(lambda pr, ds, x, w, ids: f_routed(pr, x, w, ids) + dense_mlp(x, ds[0], ds[1], scfg, ds[2]))
    rows = []
    for t in tokens:
        x = jax.random.normal(k5, (t, h), jnp.float32).astype(jnp.bfloat16)
        ids = jnp.asarray(np.argsort(np.random.default_rng(t).standard_normal((t, e)), 1)[:, :k], jnp.int32)
        w = jnp.full((t, k), 1.0 / k, jnp.float32)
        ones, zeros = jnp.ones((t, 1), jnp.float32), jnp.zeros((t, 1), jnp.int32)
        fids = jnp.concatenate([ids, jnp.broadcast_to(jnp.arange(e, e + s, dtype=jnp.int32), (t, s))], 1)
        fw = jnp.concatenate([w, jnp.ones((t, s), jnp.float32)], 1)
        t_routed = timeit(routed, [(p_routed, x, w, ids)])
        t_sep = timeit(sep, [(p_routed, p_shared, x, w, ids, ones, zeros)])
        t_fused = timeit(fused, [(p_fused, x, fw, fids)])
        t_dense = timeit(dense, [(p_routed, d_shared, x, w, ids)])
        y_sep, y_fused = sep(p_routed, p_shared, x, w, ids, ones, zeros), fused(p_fused, x, fw, fids)
        err = float(jnp.linalg.norm((y_sep - y_fused).astype(jnp.float32)) / jnp.linalg.norm(y_sep.astype(jnp.float32)))
        rows.append(f"| {model} | {scheme} | {name} | {t} | {t_routed:.3f} | {t_dense:.3f} | {t_sep:.3f} | "
                    f"{t_fused:.3f} | {err:.1e} |")
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    on_gpu = jax.devices()[0].platform == "gpu"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["deepseek", "qwen2_57b"] if on_gpu else ["tiny"],
                   choices=sorted(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 64, 1024, 4096] if on_gpu else [1, 64])
    args = p.parse_args(argv)
    print(f"# {jax.devices()[0].device_kind}; ms, median after warm-up")
    print("| model | scheme | backend | T | routed only | + dense shared (XLA) | + separate shared (backend) | "
          "fused (E+S experts) | separate vs fused rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in args.models:
        run(m, args.tokens)


if __name__ == "__main__":
    main()
