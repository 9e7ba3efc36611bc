"""``python -m jax_moe.info [--model E,H,I,k]``: the device, the compiled kernels, and which
backend would serve a model shape (and why every other one would not)."""

from __future__ import annotations

import argparse

import jax

from jax_moe import oracle
from jax_moe.config import MoEConfig


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="128,2048,768,8", help="E,H,I,k (default: Qwen3-30B-A3B)")
    p.add_argument("--activation", default="silu")
    p.add_argument("--scheme", default="bf16", choices=sorted(oracle.SCHEME_ORDER))
    args = p.parse_args(argv)
    dev = jax.devices()[0]
    print(f"jax {jax.__version__}; device: {dev.device_kind} ({dev.platform}); "
          f"compute capability: {getattr(dev, 'compute_capability', 'n/a')}")
    try:
        from jax_moe import ffi

        for key, value in ffi.native_status().items():
            print(f"native {key}: {value}")
    except ImportError as err:
        print(f"native: unavailable ({err})")
    e, h, i, k = (int(v) for v in args.model.split(","))
    cfg = MoEConfig(e, k, h, i, args.activation)
    quant = None if args.scheme == "bf16" else SchemeOnly(args.scheme)
    print(f"model E={e} H={h} I={i} k={k} activation={args.activation} scheme={args.scheme}:")
    for name in oracle.order_for(quant):
        _, ok, reason = oracle.probe(name, cfg, quant, None)
        auto = "" if not ok or name in oracle.AUTO else " (only when forced)"
        print(f"  {name:20s} {'yes' if ok else 'no '}  {reason}{auto}")
    if quant is None:
        print(f"  -> selected: {oracle.select_backend(cfg).name}")


class SchemeOnly:
    """A stand-in for a QuantConfig that carries only the scheme name (for reporting)."""

    def __init__(self, scheme: str):
        self.scheme = scheme


if __name__ == "__main__":
    main()
