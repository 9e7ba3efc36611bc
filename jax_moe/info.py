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
    print(f"model E={e} H={h} I={i} k={k} activation={args.activation}:")
    for name in oracle.ORDER:
        _, ok, reason = oracle.probe(name, cfg, None, None)
        print(f"  {name:20s} {'yes' if ok else 'no '}  {reason}")
    print(f"  -> selected: {oracle.select_backend(cfg).name}")


if __name__ == "__main__":
    main()
