"""Where the all-to-all EP step spends its time, on every local GPU: each collective and each
pack/unpack op of jax_moe.parallel's all_to_all strategy timed alone (bf16 rows of width H,
T tokens per device, k experts per token over E experts).

    python bench/ep_parts.py --tokens 1024 8192
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.moe_bench import timeit  # noqa: E402
from jax_moe import select_experts  # noqa: E402
from jax_moe.parallel import _dispatch_masks  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--tokens", nargs="+", type=int, default=[1024, 8192])
    args = p.parse_args(argv)
    devs = jax.devices()
    n = len(devs)
    mesh = Mesh(np.array(devs), ("ep",))
    e, h, k = args.experts, args.hidden, args.top_k
    e_local = e // n
    tok = NamedSharding(mesh, P("ep"))
    for t in args.tokens:
        x = jax.device_put(jax.random.normal(jax.random.key(0), (t * n, h), jnp.bfloat16), tok)
        _, ids = select_experts(jax.random.normal(jax.random.key(1), (t * n, e), jnp.float32), k)
        ids = jax.device_put(ids, tok)
        cap = t * min(n, k)

        def smap(f, out_spec=P("ep")):
            return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=out_spec,
                                         check_vma=False))

        def pack(x, ids):
            owner, send = _dispatch_masks(ids, e_local, n)
            counts = send.sum(1).astype(jnp.int32)
            order = jnp.argsort(~send.reshape(-1), stable=True)[:cap]
            tok_ = order % t
            return x[tok_], counts, tok_

        def ragged(x, ids):
            xp, counts, _ = pack(x, ids)
            starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts)[:-1].astype(jnp.int32)])
            recv = jax.lax.all_to_all(counts, "ep", 0, 0, tiled=True)
            me = jax.lax.axis_index("ep")
            buf = jnp.zeros((n * t, h), x.dtype)
            return jax.lax.ragged_all_to_all(xp, buf, starts, counts, jnp.full((n,), me * t, jnp.int32), recv,
                                             axis_name="ep")

        def dense(x, ids):
            _, send = _dispatch_masks(ids, e_local, n)
            xs = jnp.where(send[:, :, None], x[None], 0).astype(x.dtype)
            return jax.lax.all_to_all(xs, "ep", 0, 0, tiled=True).reshape(n * t, h)

        def gather(x, ids):
            return jax.lax.all_gather(x, "ep", tiled=True)

        def scatter_add(x, ids):
            _, _, tok_ = pack(x, ids)
            y = jnp.ones((cap, h), jnp.float32)
            return jnp.zeros((t, h), jnp.float32).at[tok_].add(y)

        def reduce_scatter(x, ids):
            y = jnp.ones((n * t, h), jnp.float32)
            return jax.lax.psum_scatter(y, "ep", scatter_dimension=0, tiled=True)

        parts = {"pack only": lambda x, ids: pack(x, ids)[0], "pack + ragged_all_to_all": ragged,
                 "dense all_to_all [ep,T,H]": dense, "all_gather (naive)": gather,
                 "scatter-add unpack f32": scatter_add, "psum_scatter f32 (naive)": reduce_scatter}
        for name, f in parts.items():
            try:
                ms = f"{timeit(smap(f), [(x, ids)]):8.3f} ms"
            except Exception as err:  # noqa: BLE001 - e.g. ragged_all_to_all on CPU
                ms = f"n/a ({str(err).splitlines()[0][:80]})"
            print(f"T={t} per device: {name:28s} {ms}", flush=True)


if __name__ == "__main__":
    main()
