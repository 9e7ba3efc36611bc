"""Side-by-side MoE forward timings, in one process, with the roofline next to them.

    python bench/moe_bench.py                 # GPU: the four model shapes; CPU: a small demo
    python bench/moe_bench.py --models qwen3 --tokens 1 64 1024 --write
    python bench/moe_bench.py --scheme fp8    # FP8 per-tensor weights and activations
    python bench/moe_bench.py --scheme mxfp4 --models gptoss   # MXFP4 weights, bf16 activations
    python bench/moe_bench.py --scheme fp8_block --models deepseek   # DeepSeek-V3 FP8 128x128 blocks
    python bench/moe_bench.py --scheme w4a8   # int4 group-128 weights, FP8 activations
    python bench/moe_bench.py --scheme f16    # float16 activations and weights
    python bench/moe_bench.py --impls xla cutlass tokamax --in-loop 1 16   # + device time per layer
    python bench/moe_bench.py --models gptoss-native   # GPT-OSS's own layer: swigluoai, interleaved, biases

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
  once before timing (its ``prepare``, as ``MoEBlock.prepare()`` does: for ``cutlass``, a gated
  bf16 layer's gate and up rows interleaved, so that GEMM1 takes the activation into its epilogue
  where that pays, and bf16 weights transposed, N contiguous).
- ``tokamax`` (bf16 only, where tokamax is importable on an NVIDIA GPU; :mod:`bench.peers`): the
  same routing and data through tokamax's Mosaic-GPU ``ragged_dot``, the peer to beat. Its column
  is followed by "vs tokamax", tokamax's time over the best jax_moe time (above 1: jax_moe is faster).
- ``cutlass_sc`` and ``cutlass_ga`` (only when named in ``--impls``, with or without
  ``cutlass``): ``cutlass`` prepared, with ``finalize="scatter"`` (GEMM2's epilogue adds each
  weighted row into its token's output row with bf16 atomics, in place of the un-permute kernel:
  :mod:`jax_moe.backends.cutlass_scatter_gemm`) or ``finalize="gather"`` (the un-permute kernel's
  float32 sum, bit-reproducible). ``cutlass`` itself takes ``"auto"``: the scatter unless
  ``JAX_MOE_CUTLASS_FINALIZE`` or XLA's determinism flags say otherwise (the header says which).
- ``cutlass_nk`` (only when named in ``--impls``; bf16): ``cutlass`` prepared without the
  transpose, its weights K contiguous as stored (``cutlass.prepare(..., transpose=False)``; a gated
  layer's w13 still interleaved), to set the two layouts side by side; it holds a second copy of
  the weights. FP8 weights are K contiguous in ``cutlass`` itself. With
  ``JAX_MOE_CUTLASS_FUSED_ACT=0`` the interleaved GEMM1 leaves its activation to the activation
  kernel, to time the fusion against that pair.

``gptoss-native`` is GPT-OSS-120B's layer as the model defines it (``gptoss`` is its shapes with
silu): ``swigluoai`` on interleaved gate/up rows with random float32 expert biases, run by the
implementations that take all of it (``xla``, ``cutlass``, ``flashinfer_cutlass`` where built);
``ragged_dot``, ``dense`` and ``tokamax`` compute a silu MoE without biases and are skipped for
it, with the reason printed.

``best`` names the fastest jax_moe implementation of the row (``ragged_dot``, ``dense`` and the
peers are not jax_moe's). ``--impls`` restricts the columns; ``--in-loop T ...`` adds a second
table per model: each implementation's per-call time next to its device time per layer measured
inside one jitted loop of ``--layers`` layers (:mod:`bench.in_loop`), where host dispatch is not
counted. After each row a ``# check`` line gives every implementation's relative difference from
the first one's output on the same inputs (they compute the same function).

The floor counts weight bytes at the scheme's width (:data:`SCHEMES`: FP8 1 byte, FP8 block 1 byte
plus a float32 scale per 128x128, MXFP4 half a byte plus one E8M0 byte per 32, W4A8 half a byte
plus a float32 scale per 128) and FLOPs at the measured bf16 matmul peak, x2 where the products
are FP8 (:data:`FP8_MATH`, the Hopper ratio; MXFP4 weights are multiplied in bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench import in_loop, peers  # noqa: E402
from bench.routings import routing_of  # noqa: E402
from jax_moe import oracle, timing  # noqa: E402
from jax_moe.info import finalize_status, tile_cache_status  # noqa: E402
from jax_moe.backends import xla  # noqa: E402
from jax_moe.config import MoEConfig  # noqa: E402
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights  # noqa: E402

# bytes per weight, scales included
SCHEMES = {"bf16": 2, "f16": 2, "fp8": 1, "fp8_block": 1 + 4 / (128 * 128), "mxfp4": 0.5 + 1 / 32,
           "w4a8": 0.5 + 4 / 128}
FP8_MATH = ("fp8", "fp8_block", "w4a8")  # schemes whose GEMMs run on FP8 tensor cores
TOKEN_DTYPE = {"f16": jnp.float16}       # the tokens' dtype where it is not bfloat16
NOT_JAX_MOE = ("ragged_dot", "dense", "tokamax")  # baselines and peers: never "best jax_moe"
CUTLASS_VARIANTS = ("cutlass_nk", "cutlass_sc", "cutlass_ga")  # cutlass on other settings, only when named in --impls

@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    e: int
    h: int
    i: int
    k: int
    activation: str = "silu"
    gate_up_layout: str = "concat"
    biases: bool = False  # random float32 w13_bias [E, 2I] and w2_bias [E, H]

    @property
    def cfg(self) -> MoEConfig:
        return MoEConfig(self.e, self.k, self.h, self.i, activation=self.activation,
                         gate_up_layout=self.gate_up_layout)


MODELS = {
    "mixtral": Model("Mixtral-8x7B", 8, 4096, 14336, 2),
    "qwen3": Model("Qwen3-30B-A3B", 128, 2048, 768, 8),
    "deepseek": Model("DeepSeek-V3", 256, 7168, 2048, 8),
    "gptoss": Model("GPT-OSS-120B", 128, 2880, 2880, 4),
    "gptoss-native": Model("GPT-OSS-120B native", 128, 2880, 2880, 4, "swigluoai", "interleaved", biases=True),
    "tiny": Model("tiny (CPU demo)", 16, 256, 128, 4),
}


def timeit(fn, inputs, min_iters=5, max_iters=50, budget_s=0.6) -> float:
    """Median wall time (ms) of ``fn(*inputs[n % len(inputs)])`` after warm-up; blocks on each
    (:func:`jax_moe.timing.median_ms`)."""
    return timing.median_ms(fn, inputs, min_iters, max_iters, budget_s)


def source_commit(repo: str | None = None) -> str:
    """The commit a result belongs to: ``JAX_MOE_COMMIT`` if set (a device's copy of the tree may have
    no git history), else ``git rev-parse --short HEAD`` of ``repo`` (this checkout), with
    ``+changes`` appended when tracked files differ from it (so an uncommitted edit is not credited
    to the commit below it), or ``"unknown"``."""
    if os.environ.get("JAX_MOE_COMMIT"):
        return os.environ["JAX_MOE_COMMIT"]
    repo = repo or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")


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


def print_xla_flags() -> None:
    """A header line with ``XLA_FLAGS`` where it is set: command buffers and the like change the span
    and per-call figures."""
    if os.environ.get("XLA_FLAGS"):
        print(f"# XLA_FLAGS={os.environ['XLA_FLAGS']}")


def touched_experts(m: Model, t: int) -> float:
    """Experts with at least one of T=t tokens' rows, expected under uniform top-k routing."""
    return m.e * (1 - (1 - m.k / m.e) ** t)


def roofline(m: Model, t: int, bw: float, peak: float, scheme: str = "bf16") -> tuple[float, float, float]:
    """(floor ms, bytes, flops) of one forward with T=t tokens (bf16 tokens in and out)."""
    touched = touched_experts(m, t)
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


def implementations(cfg: MoEConfig, quant=None, dtype=jnp.bfloat16, only: list[str] | None = None,
                    biases: tuple[jax.Array, jax.Array] | None = None) -> dict:
    """name -> (uses the scheme's weights?, prepare(w13, w2) -> weights (load time, untimed),
    fn(x, weights, w, ids)); ``dtype``: the unquantized scheme weights' dtype (float16 for f16);
    ``only``: the names to keep (None: every one that runs here); ``biases``: (w13_bias [E, 2I],
    w2_bias [E, H]) that every implementation applies (they travel with the weights: jit
    arguments, never constants), or None. The baselines and peers, which compute a silu MoE
    without biases, are left out of a layer that is not one (the reason printed)."""
    want = (lambda name: True) if only is None else (lambda name: name in only)  # noqa: E731
    b13, b2 = biases if biases is not None else (None, None)

    def same(w13, w2):
        return (w13, w2) if biases is None else (w13, w2, b13, b2)

    def bias_kw(ws) -> dict:
        return {} if len(ws) == 2 else dict(w13_bias=ws[2], w2_bias=ws[3])

    impls = {
        "xla": (True, same, lambda x, ws, w, ids: xla.apply(x, *ws[:2], w, ids, cfg, quant=quant, **bias_kw(ws))),
        "ragged_dot": (False, same, lambda x, ws, w, ids: xla.apply(x, *ws, w, ids, cfg, strategy="ragged_dot")),
    }
    if quant is None:
        impls["dense"] = (False, same, lambda x, ws, w, ids: dense_reference(x, *ws, w, ids, cfg))
    plain = biases is None and cfg.activation == "silu" and cfg.gate_up_layout == "concat"
    for name in ("ragged_dot", "dense", "tokamax"):
        if not plain and want(name):
            impls.pop(name, None)
            print(f"# {name}: not run (computes a silu MoE on concatenated gate/up without biases; this layer is "
                  f"{cfg.activation}, {cfg.gate_up_layout}{', with biases' if biases is not None else ''})")
    impls = {name: v for name, v in impls.items() if want(name)}
    features = oracle.call_features(dtype=dtype, w13_bias=b13, w2_bias=b2)
    variants = [v for v in CUTLASS_VARIANTS if only is not None and v in only]  # cutlass's, named: probe cutlass
    for name in oracle.MODULES:
        if name == "xla" or not (want(name) or (name == "cutlass" and variants)):
            continue
        mod, ok, reason = oracle.probe(name, cfg, quant, None, features)
        if not ok:
            print(f"# {name}: not run ({reason})")
        elif hasattr(mod, "prepare") and hasattr(mod, "apply_prepared"):
            impls[name] = (True, lambda w13, w2, mod=mod: mod.prepare(w13, w2, cfg, quant, w13_bias=b13, w2_bias=b2),
                           lambda x, p, w, ids, mod=mod: mod.apply_prepared(x, p, w, ids))
        else:
            impls[name] = (True, same, lambda x, ws, w, ids, mod=mod: mod.apply(x, *ws[:2], w, ids, cfg, quant=quant,
                                                                                **bias_kw(ws)))
    if "cutlass_nk" in variants and "cutlass" in impls and quant is None:
        from jax_moe.backends import cutlass

        impls["cutlass_nk"] = (True, lambda w13, w2: cutlass.prepare(w13, w2, cfg, w13_bias=b13, w2_bias=b2,
                                                                      transpose=False),
                               lambda x, p, w, ids: cutlass.apply_prepared(x, p, w, ids))
    for name, finalize in (("cutlass_sc", "scatter"), ("cutlass_ga", "gather")):
        if name in variants and "cutlass" in impls:
            from jax_moe.backends import cutlass

            impls[name] = (True, lambda w13, w2: cutlass.prepare(w13, w2, cfg, quant, w13_bias=b13, w2_bias=b2),
                           lambda x, p, w, ids, f=finalize: cutlass.apply_prepared(x, p, w, ids, finalize=f))
    if variants and not want("cutlass"):
        impls.pop("cutlass", None)
    if quant is None and jnp.dtype(dtype) == jnp.bfloat16 and plain and want("tokamax"):
        impls.update(peers.implementations())
    return impls


def random_biases(m: Model) -> tuple[jax.Array, jax.Array] | None:
    """float32 w13_bias [E, 2I] and w2_bias [E, H] (standard normal / 4) where ``m`` has biases, else None."""
    if not m.biases:
        return None
    k1, k2 = jax.random.split(jax.random.key(1))
    return (jax.random.normal(k1, (m.e, m.cfg.w13_rows), jnp.float32) / 4,
            jax.random.normal(k2, (m.e, m.h), jnp.float32) / 4)


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


def random_experts(m: Model) -> tuple[jax.Array, jax.Array]:
    """bf16 w13 [E, 2I, H], w2 [E, H, I], Gaussian with fan-in scaling (outputs of magnitude ~1)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    w13 = (jax.random.normal(k1, (m.e, 2 * m.i, m.h), jnp.bfloat16) * (m.h ** -0.5)).astype(jnp.bfloat16)
    w2 = (jax.random.normal(k2, (m.e, m.h, m.i), jnp.bfloat16) * (m.i ** -0.5)).astype(jnp.bfloat16)
    return w13, w2


def routed_inputs(m: Model, t: int, sets: int = 3,
                  routing: str = "random") -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """``sets`` (x [T, H] bf16, topk_weights, topk_ids) of random tokens and softmax top-k routing
    (rotated between timed calls, so that repeated runs do not measure the cache); ``routing``: one
    of :data:`bench.routings.ROUTINGS`."""
    routed = []
    for r in range(sets):
        kx, kr = jax.random.split(jax.random.key(100 + r))
        x = jax.random.normal(kx, (t, m.h), jnp.bfloat16)
        routed.append((x, *routing_of(routing, kr, t, m.e, m.k, shift=r)))
    return routed


def rel_diff(a: jax.Array, b: jax.Array) -> float:
    """``||a - b|| / ||b||`` in float32."""
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def run_model(m: Model, tokens: list[int], bw: float, peak: float, dense_limit: float, rows: list,
              scheme: str = "bf16", only: list[str] | None = None, loop_tokens: tuple[int, ...] = (),
              layers: int = 32, loop_rows: list | None = None):
    """Time every implementation at each T of ``tokens`` (one row each, appended to ``rows`` and
    printed), then, for each T of ``loop_tokens``, per call and per layer inside a jitted loop
    (:mod:`bench.in_loop`; rows appended to ``loop_rows``)."""
    cfg = m.cfg
    w13, w2 = random_experts(m)
    q13, q2, quant = quantized(scheme, w13, w2, m)
    tok_dtype = TOKEN_DTYPE.get(scheme, jnp.bfloat16)
    impls = implementations(cfg, quant, tok_dtype, only, random_biases(m))
    print(header(list(impls)), flush=True)
    weights = {name: prep(*((q13, q2) if scheme_w else (w13, w2)))
               for name, (scheme_w, prep, _) in impls.items()}  # load time, untimed
    del w13, w2, q13, q2  # what no implementation holds is freed (DeepSeek-V3's copies are 22.5 GB each)
    jitted = {name: jax.jit(fn) for name, (_, _, fn) in impls.items()}

    def inputs_of(name, routed):
        return [(x.astype(tok_dtype) if impls[name][0] else x, weights[name], w, ids) for x, w, ids in routed]

    def too_large(name, t):
        return name == "dense" and t * m.k * 3 * m.h * m.i * 2 > dense_limit

    per_call: dict[tuple[str, int], float | None] = {}
    for t in tokens:
        routed = routed_inputs(m, t)
        floor, nbytes, flops = roofline(m, t, bw, peak, scheme)
        row = {"model": m.name, "T": t, "floor": floor}
        outs = {}
        for name in impls:
            if too_large(name, t):
                row[name] = None
                continue
            try:
                row[name] = timeit(jitted[name], inputs_of(name, routed))
                outs[name] = jitted[name](*inputs_of(name, routed)[0])
            except Exception as err:  # out of memory and the like: recorded, not fatal
                msg = str(err).splitlines()[0][:80]
                print(f"# {m.name} T={t} {name}: failed ({msg})")
                row[name] = None
            per_call[name, t] = row[name]
        rows.append(row)
        print(format_row(row, list(impls)), flush=True)
        if len(outs) > 1:
            first = next(iter(outs))
            diffs = ", ".join(f"{n} {rel_diff(o, outs[first]):.1e}" for n, o in outs.items() if n != first)
            print(f"# check {m.name} T={t}: rel diff vs {first}: {diffs}", flush=True)
        del outs

    loop_names = [n for n in impls if n not in ("ragged_dot", "dense")]
    if loop_tokens:
        print(loop_header(loop_names), flush=True)
    for t in loop_tokens:
        routed = routed_inputs(m, t)
        row = {"model": m.name, "T": t, "floor": roofline(m, t, bw, peak, scheme)[0], "layers": layers}
        for name in loop_names:
            try:
                if (name, t) not in per_call:
                    per_call[name, t] = timeit(jitted[name], inputs_of(name, routed))
                x, ws = inputs_of(name, routed)[0][:2]
                row[name] = (per_call[name, t],
                             in_loop.per_layer_ms(jitted[name], x, ws, m.e, m.k, layers, timeit))
            except Exception as err:  # recorded, not fatal
                print(f"# {m.name} T={t} {name} in loop: failed ({str(err).splitlines()[0][:80]})")
                row[name] = (per_call.get((name, t)), None)
        if loop_rows is not None:
            loop_rows.append(row)
        print(format_loop_row(row, loop_names), flush=True)
    del weights


def fmt(v):
    return "n/a" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def best_of(row: dict, names: list[str], key=lambda v: v) -> tuple[str | None, float | None]:
    """(name, ms) of the fastest jax_moe implementation in ``row`` (baselines and peers excluded)."""
    cands = [(key(row[n]), n) for n in names if n not in NOT_JAX_MOE and row.get(n) and key(row[n])]
    if not cands:
        return None, None
    ms, name = min(cands)
    return name, ms


def ratio(num: float | None, den: float | None) -> str:
    return "n/a" if not (num and den) else f"{num / den:.2f}x"


def format_row(row: dict, names: list[str]) -> str:
    """One markdown row: each implementation's ms, the best jax_moe one, its speedup over
    ragged_dot and tokamax (where those columns exist), the floor and the best's % of it."""
    cells = [row["model"], str(row["T"])] + [fmt(row.get(n)) for n in names]
    best_name, best = best_of(row, names)
    cells.append(best_name or "n/a")
    if "ragged_dot" in names:
        cells.append(ratio(row.get("ragged_dot"), best))
    if "tokamax" in names:
        cells.append(ratio(row.get("tokamax"), best))
    cells.append(fmt(row["floor"]))
    cells.append("n/a" if not best else f"{100 * row['floor'] / best:.0f}%")
    return "| " + " | ".join(cells) + " |"


def header(names: list[str]) -> str:
    cols = ["model", "T"] + [f"{n} ms" for n in names] + ["best"]
    if "ragged_dot" in names:
        cols.append("best vs ragged_dot")
    if "tokamax" in names:
        cols.append("best vs tokamax")
    cols += ["floor ms", "best % of floor"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def loop_header(names: list[str]) -> str:
    cols = ["model", "T"] + [f"{n} per call / in loop ms" for n in names] + ["best in loop"]
    if "tokamax" in names:
        cols.append("in loop vs tokamax")
    cols += ["floor ms", "in loop / floor"]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


def format_loop_row(row: dict, names: list[str]) -> str:
    """One row of the in-loop table: per call / per layer in a jitted loop, for each implementation."""
    cells = [row["model"], str(row["T"])]
    for n in names:
        call, loop = row.get(n) or (None, None)
        cells.append(f"{fmt(call)} / {fmt(loop)}")
    best_name, best = best_of(row, names, key=lambda v: v[1])
    cells.append("n/a" if not best else f"{best_name} {fmt(best)}")
    if "tokamax" in names:
        cells.append(ratio((row.get("tokamax") or (None, None))[1], best))
    cells.append(fmt(row["floor"]))
    cells.append("n/a" if not best else f"{best / row['floor']:.2f}x")
    return "| " + " | ".join(cells) + " |"


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
    p.add_argument("--impls", nargs="+", default=None,
                   help="only these implementations (e.g. xla cutlass tokamax); default: every one that runs here "
                        "but cutlass's variants, which must be named: cutlass_nk (K-contiguous weights), "
                        "cutlass_sc / cutlass_ga (finalize='scatter' / 'gather')")
    p.add_argument("--in-loop", nargs="*", type=int, default=[], metavar="T",
                   help="also time these T per layer inside one jitted loop (device time, no dispatch)")
    p.add_argument("--layers", type=int, default=32, help="layers of the --in-loop loop")
    p.add_argument("--json", default=None, help="also write the rows (and in-loop rows) to this JSON file")
    args = p.parse_args(argv)

    if args.tune:
        import tempfile

        os.environ["JAX_MOE_FI_AUTOTUNE"] = "1"
        os.environ["JAX_MOE_FI_TUNING_CACHE"] = os.path.join(tempfile.mkdtemp(), "tactics.json")
    dev = jax.devices()[0]
    bw, peak = measure_ceilings()
    commit = source_commit()
    title = (f"{args.scheme}{' (tactics autotuned)' if args.tune else ''}: {dev.device_kind} ({dev.platform}), {datetime.date.today()}, commit {commit}, jax {jax.__version__}; "
             f"measured {bw / 1e12:.2f} TB/s read+write, {peak / 1e12:.0f} TFLOP/s bf16 matmul")
    print("#", title)
    print(f"# cutlass tiles: {tile_cache_status()}")
    print(f"# cutlass finalize: {finalize_status()}")
    print_xla_flags()
    rows: list = []
    loop_rows: list = []
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
        loops_before = len(loop_rows)
        run_model(m, args.tokens, bw, peak, args.dense_limit_gb * 1e9, rows, args.scheme, args.impls,
                  tuple(args.in_loop), args.layers, loop_rows)
        names = [n for n in rows[rows_before] if n not in ("model", "T", "floor")] if len(rows) > rows_before else []
        table = header(names) + "\n" + "\n".join(format_row(r, names) for r in rows[rows_before:])
        if len(loop_rows) > loops_before:
            lnames = [n for n in loop_rows[loops_before] if n not in ("model", "T", "floor", "layers")]
            table += "\n\n" + loop_header(lnames) + "\n" + "\n".join(
                format_loop_row(r, lnames) for r in loop_rows[loops_before:])
        if args.write:
            with open(results, "a") as f:
                f.write(f"\n{table}\n")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"title": title, "rows": rows, "in_loop": loop_rows}, f, indent=1)
    print("\n" + title)
    if args.write:
        plot(rows, sorted({n for r in rows for n in r if n not in ("model", "T", "floor")}),
             os.environ.get("JAX_MOE_PLOT", os.path.join(here, "roofline.png")))


if __name__ == "__main__":
    main()
