"""Load one full-size MoE layer from a checkpoint directory and run it: load time, peak host
memory, the prepared backend's output against a float32 reference written from the checkpoint
format's definition, and the forward time.

    python bench/load_layer.py --model deepseek     # DeepSeek-V3: E=256, H=7168, I=2048, FP8 128x128 blocks, 1 shared expert
    python bench/load_layer.py --model gptoss       # GPT-OSS-120B: E=128, H=2880, I=2880, MXFP4, biases
    python bench/load_layer.py --model tiny         # CPU-sized DeepSeek-like layer (the CPU test runs this)

The checkpoint is synthetic (random bytes in the release's on-disk form: tensor names, dtypes,
shapes, config.json, a sharded safetensors index) and written to ``--dir`` first; the loading,
timing and checking run in a fresh child process so that its peak resident memory
(``ru_maxrss``) is the loader's own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

MODELS = {  # E, H, I, k, shared experts, format
    "deepseek": dict(E=256, H=7168, I=2048, k=8, shared=1, fmt="fp8_block", groups=(8, 4)),
    "gptoss": dict(E=128, H=2880, I=2880, k=4, shared=0, fmt="mxfp4"),
    "tiny": dict(E=16, H=256, I=128, k=4, shared=1, fmt="fp8_block", groups=(4, 2)),
    "tiny_mxfp4": dict(E=8, H=128, I=64, k=2, shared=0, fmt="mxfp4"),
}
LAYER = 3
SHARDS = 4


# ----------------------------------------------------------------------------- writing


def _random_bytes(rng, shape) -> np.ndarray:
    return np.frombuffer(bytearray(rng.bytes(int(np.prod(shape)))), np.uint8).reshape(shape)


def _fp8_codes(rng, shape):
    """Random float8_e4m3fn bytes: random sign, mantissa and low exponent bit, exponent field 6 or 7,
    so magnitudes lie in [0.5, 2) (never NaN)."""
    r = _random_bytes(rng, shape)
    r &= 0x8F
    r |= 0x30
    return r.view(ml_dtypes.float8_e4m3fn)


def write_checkpoint(model: str, out: str, seed: int = 0) -> None:
    from safetensors.numpy import save_file

    m = MODELS[model]
    rng = np.random.default_rng(seed)
    e, h, i, k = m["E"], m["H"], m["I"], m["k"]
    shards: list[dict] = [{} for _ in range(SHARDS)]
    p = f"model.layers.{LAYER}.mlp."
    if m["fmt"] == "fp8_block":
        cfg = dict(model_type="deepseek_v3", hidden_size=h, n_routed_experts=e, num_experts_per_tok=k,
                   moe_intermediate_size=i, n_shared_experts=m["shared"], n_group=m["groups"][0],
                   topk_group=m["groups"][1], routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
                   topk_method="noaux_tc", first_k_dense_replace=LAYER, moe_layer_freq=1, hidden_act="silu",
                   num_hidden_layers=LAYER + 1, quantization_config=dict(
                       quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128]))

        def proj(d, name, n, kk):
            d[name + ".weight"] = _fp8_codes(rng, (n, kk))
            d[name + ".weight_scale_inv"] = (rng.uniform(0.5, 1.5, (-(-n // 128), -(-kk // 128))) / (4 * np.sqrt(kk))
                                             ).astype(np.float32)

        for x in range(e):
            d = shards[x * SHARDS // e]
            for name, n, kk in (("gate_proj", i, h), ("up_proj", i, h), ("down_proj", h, i)):
                proj(d, f"{p}experts.{x}.{name}", n, kk)
        for name, n, kk in (("gate_proj", i * m["shared"], h), ("up_proj", i * m["shared"], h),
                            ("down_proj", h, i * m["shared"])):
            proj(shards[-1], f"{p}shared_experts.{name}", n, kk)
        shards[0][p + "gate.weight"] = (rng.standard_normal((e, h)) / np.sqrt(h)).astype(ml_dtypes.bfloat16)
        shards[0][p + "gate.e_score_correction_bias"] = rng.uniform(0, 0.05, e).astype(np.float32)
    else:
        cfg = dict(model_type="gpt_oss", hidden_size=h, intermediate_size=i, num_local_experts=e,
                   num_experts_per_tok=k, experts_per_token=k, swiglu_limit=7.0, num_hidden_layers=LAYER + 1,
                   quantization_config=dict(quant_method="mxfp4", modules_to_not_convert=["model.layers.*.mlp.router"]))
        x = p + "experts."
        shards[0][x + "gate_up_proj_blocks"] = _random_bytes(rng, (e, 2 * i, h // 32, 16))
        shards[0][x + "gate_up_proj_scales"] = rng.integers(118, 122, (e, 2 * i, h // 32), dtype=np.uint8)
        shards[1][x + "down_proj_blocks"] = _random_bytes(rng, (e, h, i // 32, 16))
        shards[1][x + "down_proj_scales"] = rng.integers(118, 122, (e, h, i // 32), dtype=np.uint8)
        shards[2][x + "gate_up_proj_bias"] = (0.1 * rng.standard_normal((e, 2 * i))).astype(ml_dtypes.bfloat16)
        shards[2][x + "down_proj_bias"] = (0.1 * rng.standard_normal((e, h))).astype(ml_dtypes.bfloat16)
        shards[3][p + "router.weight"] = (rng.standard_normal((e, h)) / np.sqrt(h)).astype(ml_dtypes.bfloat16)
        shards[3][p + "router.bias"] = (0.1 * rng.standard_normal(e)).astype(ml_dtypes.bfloat16)
    shards[0][f"model.layers.{LAYER}.self_attn.o_proj.weight"] = np.ones((8, 8), ml_dtypes.bfloat16)
    os.makedirs(out, exist_ok=True)
    weight_map, total = {}, 0
    for n, d in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{SHARDS:05d}.safetensors"
        save_file(d, os.path.join(out, name), metadata={"format": "pt"})
        weight_map.update({t: name for t in d})
        total += sum(a.nbytes for a in d.values())
        d.clear()
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)


# ----------------------------------------------------------------------------- the reference


_E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def _fp8_matvec(f, name, x):
    """(weight * weight_scale_inv over 128x128 blocks) @ x for x [K] -> [N], block by block."""
    q = f(name + ".weight").astype(np.float32)
    s = f(name + ".weight_scale_inv").astype(np.float32)
    n, k = q.shape
    nb, kb = s.shape
    qp = np.zeros((nb * 128, kb * 128), np.float32)
    qp[:n, :k] = q
    xp = np.zeros(kb * 128, np.float32)
    xp[:k] = x
    parts = np.einsum("ibjc,jc->ibj", qp.reshape(nb, 128, kb, 128), xp.reshape(kb, 128))
    return (parts * s[:, None, :]).sum(-1).reshape(-1)[:n]


def _fp8_mlp(f, q, x):
    a = _silu(_fp8_matvec(f, q + "gate_proj", x)) * _fp8_matvec(f, q + "up_proj", x)
    return _fp8_matvec(f, q + "down_proj", a)


def _mxfp4_weight(blocks, scales):
    """[N, K/32, 16] uint8 codes (low nibble first) and [N, K/32] E8M0 -> [N, K] float32."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], -1).reshape(blocks.shape[0], blocks.shape[1], 32)
    return (_E2M1[codes] * np.exp2(scales.astype(np.float32) - 127)[..., None]).reshape(blocks.shape[0], -1)


def _silu(v):
    return v / (1 + np.exp(-v))


def reference(model: str, ckpt: str, x: np.ndarray) -> np.ndarray:
    """The layer's output for x [T, H] float32, from the checkpoint's definition (float32)."""
    from safetensors import safe_open

    from jax_moe.checkpoint.source import _float8_readable

    index = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    cfg = json.load(open(os.path.join(ckpt, "config.json")))
    files = {}

    def f(name):
        shard = index[name]
        if shard not in files:
            files[shard] = safe_open(os.path.join(ckpt, shard), framework="numpy")
        with _float8_readable():
            return files[shard].get_tensor(name)

    p = f"model.layers.{LAYER}.mlp."
    k = cfg["num_experts_per_tok"]
    out = np.zeros_like(x)
    if cfg["model_type"] == "deepseek_v3":
        s = 1 / (1 + np.exp(-(x @ f(p + "gate.weight").astype(np.float32).T)))
        choice = s + f(p + "gate.e_score_correction_bias")
        g, tg, e = cfg["n_group"], cfg["topk_group"], s.shape[1]
        for t in range(len(x)):
            gs = np.sort(choice[t].reshape(g, e // g), -1)[:, -2:].sum(-1)
            keep = np.repeat(np.isin(np.arange(g), np.argsort(-gs, kind="stable")[:tg]), e // g)
            sel = np.argsort(-np.where(keep, choice[t], -np.inf), kind="stable")[:k]
            w = s[t, sel] / s[t, sel].sum() * cfg["routed_scaling_factor"]
            for wj, ex in zip(w, sel):
                out[t] += wj * _fp8_mlp(f, f"{p}experts.{ex}.", x[t])
            out[t] += _fp8_mlp(f, p + "shared_experts.", x[t])
        return out
    xx = p + "experts."
    logits = x @ f(p + "router.weight").astype(np.float32).T + f(p + "router.bias").astype(np.float32)
    b13, s13 = f(xx + "gate_up_proj_blocks"), f(xx + "gate_up_proj_scales")
    b2, s2 = f(xx + "down_proj_blocks"), f(xx + "down_proj_scales")
    bias13, bias2 = f(xx + "gate_up_proj_bias").astype(np.float32), f(xx + "down_proj_bias").astype(np.float32)
    lim = cfg.get("swiglu_limit", 7.0)
    for t in range(len(x)):
        sel = np.argsort(-logits[t], kind="stable")[:k]
        w = np.exp(logits[t, sel] - logits[t, sel].max())
        w /= w.sum()
        for wj, ex in zip(w, sel):
            gu = _mxfp4_weight(b13[ex], s13[ex]) @ x[t] + bias13[ex]
            gate, up = np.minimum(gu[0::2], lim), np.clip(gu[1::2], -lim, lim)
            a = (up + 1) * gate / (1 + np.exp(-1.702 * gate))
            out[t] += wj * (_mxfp4_weight(b2[ex], s2[ex]) @ a + bias2[ex])
    return out


# ----------------------------------------------------------------------------- the child


def run_child(model: str, ckpt: str, tokens: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jax_moe import MoEBlock

    t0 = time.perf_counter()
    block = MoEBlock.from_pretrained(ckpt, LAYER)
    jax.block_until_ready(jax.tree.leaves(block))
    load_s = time.perf_counter() - t0
    rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    t0 = time.perf_counter()
    backend = block.prepare()
    jax.block_until_ready(jax.tree.leaves(block))
    prepare_s = time.perf_counter() - t0
    rng = np.random.default_rng(1)
    h = MODELS[model]["H"]
    x = rng.standard_normal((tokens, h)).astype(np.float32)
    fwd = jitted(block)
    y = np.asarray(fwd(jnp.asarray(x, jnp.bfloat16)), np.float32)
    ref = reference(model, ckpt, np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32))
    err = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    times, shared_times = {}, {}
    shared = None if block.shared is None else jitted(block.shared)
    for t in (1, 64, 1024):
        xt = [jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16) for _ in range(3)]
        times[t] = median_ms(fwd, xt)
        if shared is not None:
            shared_times[t] = median_ms(shared, xt)
    return dict(model=model, device=jax.devices()[0].device_kind, backend=backend,
                quant=block.quant.get_value().scheme if block.quant is not None else None,
                load_s=load_s, prepare_s=prepare_s, peak_rss_gib_after_load=rss_load,
                peak_rss_gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                finite=bool(np.isfinite(y).all()), rel_err=err, forward_ms=times,
                shared_experts_ms=shared_times or None)


def jitted(module):
    """``x -> module(x)`` under ``jax.jit`` with the module's state as an argument (split once)."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(module)
    fn = jax.jit(lambda s, v: nnx.merge(graphdef, s)(v))
    return lambda v: fn(state, v)


def median_ms(fn, inputs, iters: int = 20) -> float:
    """Median ms of ``fn(x)`` over ``iters`` calls rotating through ``inputs``, after warm-up."""
    import jax

    jax.block_until_ready(fn(inputs[0]))
    samples = []
    for n in range(iters):
        s = time.perf_counter()
        jax.block_until_ready(fn(inputs[n % len(inputs)]))
        samples.append(time.perf_counter() - s)
    return 1e3 * float(np.median(samples))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="deepseek")
    p.add_argument("--dir", default=None, help="checkpoint directory to write (default: a temporary one)")
    p.add_argument("--tokens", type=int, default=8, help="tokens checked against the reference")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(run_child(args.model, args.dir, args.tokens)), flush=True)
        return 0
    with tempfile.TemporaryDirectory(dir=args.dir and os.path.dirname(os.path.abspath(args.dir))) as tmp:
        ckpt = args.dir or os.path.join(tmp, args.model)
        t0 = time.perf_counter()
        write_checkpoint(args.model, ckpt)
        size = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt)) / 2**30
        print(f"wrote a synthetic {args.model} layer checkpoint: {size:.2f} GiB in {time.perf_counter() - t0:.1f} s",
              flush=True)
        out = subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--dir", ckpt,
                              "--tokens", str(args.tokens)], capture_output=True, text=True)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        if out.returncode or not lines:
            print(out.stdout[-3000:], out.stderr[-5000:])
            return 1
        r = json.loads(lines[-1][7:])
        r["checkpoint_gib"] = round(size, 2)
        print(json.dumps(r, indent=1))
        tol = 6e-2 if MODELS[args.model]["fmt"] == "fp8_block" else 2e-2
        ok = r["finite"] and r["rel_err"] < tol
        print(f"{'PASS' if ok else 'FAIL'}: {args.model} rel err {r['rel_err']:.4f} (bound {tol}) on {r['backend']}")
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
