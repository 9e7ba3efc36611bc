"""One process of tests/test_multiprocess.py: ``python tests/multiprocess_worker.py RANK NPROC PORT``.

Each process has 4 CPU devices; ``jax.distributed.initialize`` joins them into one global
device list, and the several-hosts recipe of docs/PARALLEL.md runs unchanged on a mesh over all of them.
Every process loads the same weights (``shard_weights`` places them) and brings its own tokens
(a global array from process-local data). Prints one JSON line: the largest difference of this
process's output shards from the single-device result, per case."""

import json
import os
import sys

rank, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

NO_CPU_COLLECTIVES = 3  # exit status: this jaxlib cannot join CPU processes (the test skips)
try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=nproc, process_id=rank)
except Exception as e:  # noqa: BLE001  (any failure to set up is reported as such)
    print(f"cannot join CPU processes here: {type(e).__name__}: {e}", file=sys.stderr)
    sys.exit(NO_CPU_COLLECTIVES)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402

from jax_moe import fused_experts, select_experts  # noqa: E402
from jax_moe.parallel import ParallelConfig, parallel_fused_experts, shard_prepared, shard_weights  # noqa: E402
from jax_moe.quant.scheme import calibrate_activation_scale, quantize_weights  # noqa: E402

E, K, H, I, T = 16, 4, 32, 32, 64
rng = np.random.default_rng(0)  # the same checkpoint and batch in every process
x = rng.standard_normal((T, H)).astype(np.float32)
w13 = (rng.standard_normal((E, 2 * I, H)) / np.sqrt(H)).astype(np.float32)
w2 = (rng.standard_normal((E, H, I)) / np.sqrt(I)).astype(np.float32)
w, ids = (np.asarray(a) for a in select_experts(jnp.asarray(rng.standard_normal((T, E)), jnp.float32), K))
devices = np.array(jax.devices())
assert len(devices) == 4 * nproc and len(jax.local_devices()) == 4

CASES = {  # name: (mesh shape, axis names, ParallelConfig axes, strategy, quant scheme, eager call)
    "ep4-tp2-naive": ((4, 2), ("ep", "tp"), dict(ep_axis="ep", tp_axis="tp"), "naive", None, False),
    "ep8-all_to_all-fp8-eager": ((8,), ("ep",), dict(ep_axis="ep"), "all_to_all", "fp8", True),
    "dp2-ep4-all_to_all-nvfp4": ((2, 4), ("dp", "ep"), dict(dp_axis="dp", ep_axis="ep"), "all_to_all", "nvfp4", False),
}
errors = {}
for name, (shape, names, axes, strategy, scheme, eager) in CASES.items():
    pcfg = ParallelConfig(Mesh(devices.reshape(shape), names), strategy=strategy, **axes)
    tok = NamedSharding(pcfg.mesh, pcfg.token_spec)

    def tokens(a):  # this process's rows of the batch -> the global array (docs/PARALLEL.md's recipe)
        rows = [index[0] for index in tok.addressable_devices_indices_map(a.shape).values()]
        lo, hi = min(r.start or 0 for r in rows), max(r.stop or len(a) for r in rows)
        return jax.make_array_from_process_local_data(tok, a[lo:hi], a.shape)

    quant, a13, b2 = None, w13, w2
    if scheme is not None:
        act = "fp8_per_tensor" if scheme == "fp8" else "nvfp4"
        a13, b2, quant = quantize_weights(scheme, w13, w2, act=act, a13_scale=calibrate_activation_scale(act, x),
                                          a2_scale=0.02)
    ref = np.asarray(fused_experts(jnp.asarray(x), a13, b2, jnp.asarray(w), jnp.asarray(ids), quant=quant,
                                   backend="xla"))
    p = shard_weights(a13, b2, pcfg, quant=quant)

    def run(x, w, ids, p):
        return parallel_fused_experts(x, p["w13"], p["w2"], w, ids, pcfg, quant=p["quant"])

    out = (run if eager else jax.jit(run))(tokens(x), tokens(w), tokens(ids), p)
    errors[name] = max(float(np.abs(np.asarray(s.data) - ref[s.index]).max()) for s in out.addressable_shards)

# load time with a backend's own layout: each device repacks its (ep, tp) block (FP8 scales span processes)
pcfg = ParallelConfig(Mesh(devices.reshape(4, 2), ("ep", "tp")), ep_axis="ep", tp_axis="tp")
q13, q2, quant = quantize_weights("fp8", w13, w2, act="fp8_per_tensor", a2_scale=0.02)
prep = shard_prepared(q13, q2, pcfg, quant=quant)
errors["shard_prepared-block"] = list(prep.w13.addressable_shards[0].data.shape)
print(json.dumps(errors), flush=True)
