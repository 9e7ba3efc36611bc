"""The several-hosts recipe of docs/PARALLEL.md on one machine: two processes with 4 CPU devices each,
joined by ``jax.distributed.initialize`` (gloo collectives), run jax_moe.parallel on meshes
over all 8 devices (tests/multiprocess_worker.py) and get the single-device result."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_one_mesh_equal_single_device():
    port, env = str(_free_port()), {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    logs = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")) for _ in range(2)]  # never a full pipe
    procs = [subprocess.Popen([sys.executable, WORKER, str(r), "2", port], stdout=o, stderr=e, text=True, env=env)
             for r, (o, e) in enumerate(logs)]
    deadline = time.monotonic() + 300
    try:  # a worker whose peer failed would wait on a collective forever: stop at the first failure
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                pytest.fail("the worker processes did not finish in 300 s")
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for o, e in logs:
        o.seek(0), e.seek(0)
    results = [(p.wait(), o.read(), e.read()) for p, (o, e) in zip(procs, logs)]
    for code, _, err in sorted(results, key=lambda r: r[0] < 0):  # a worker's own failure before a killed peer
        if code == 3:  # multiprocess_worker.NO_CPU_COLLECTIVES
            pytest.skip(err.strip().splitlines()[-1])
        assert code == 0, err[-3000:]
    outs = [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]
    for res in outs:
        assert res.pop("shard_prepared-block") == [4, 32, 32]  # E/ep experts, 2 * I/tp rows, H
        assert res and all(err < 1e-5 for err in res.values()), res
