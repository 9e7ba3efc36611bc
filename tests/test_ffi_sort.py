"""The compiled sort_by_expert (XLA FFI custom call) equals jax_moe.permute.sort_by_expert."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import ffi
from jax_moe.permute import sort_by_expert
from helpers import need_native, random_routing

CASES = [(0, 2, 8), (1, 1, 4), (1, 8, 256), (37, 4, 16), (300, 2, 8), (3000, 8, 256), (5000, 6, 1024)]


def random_ids(rng, t, k, e, invalid=False):
    """topk_ids [T, k] of k distinct experts per token (about 20 % of them -1 with ``invalid``)."""
    return random_routing(rng, t, e, k, minus_one=0.2 if invalid else 0.0)[1]


def np_sort(ids, e):
    """The sort's definition in NumPy: slots stably sorted by bucket (the id in [0, E), else E)."""
    flat = np.asarray(ids, np.int64).reshape(-1)
    key = np.where((flat >= 0) & (flat < e), flat, e)
    slots = np.argsort(key, kind="stable").astype(np.int32)
    inverse = np.empty_like(slots)
    inverse[slots] = np.arange(flat.size, dtype=np.int32)
    counts = np.bincount(key, minlength=e + 1)[:e].astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return slots, inverse, counts, offsets


def edge_ids(rng, n, e):
    """[n, 1] ids over [0, E) with about 10 % each of -1 and of ids >= E (E, E + 7, 2^31 - 1)."""
    ids = rng.integers(0, e, n)
    u = rng.random(n)
    ids = np.where(u < 0.1, -1, ids)
    ids = np.where((u >= 0.1) & (u < 0.2), rng.choice([e, e + 7, 2**31 - 1], n), ids)
    return jnp.asarray(ids.reshape(n, 1), jnp.int32)


# (n, E): every bucket count at the chunk edges (255, 256, 257 slots), one chunk, none, and the
# T=16384, k=8 batch (512 chunks: more than one scan tile), each over 1 to 1000 experts.
EDGE_N = [0, 1, 255, 256, 257, 131072]
EDGE_E = [1, 8, 128, 256, 1000]


def check_np(f, ids, e):
    """f = jit(sort_by_expert_valid): the four arrays and valid against the NumPy definition."""
    sort, valid = f(ids)
    want = np_sort(ids, e)
    for g, w, name in zip(sort, want, ("sorted_slots", "inverse", "counts", "offsets")):
        np.testing.assert_array_equal(np.asarray(g), w, err_msg=name)
    np.testing.assert_array_equal(np.asarray(valid), want[3][e:], err_msg="valid")


def sort_valid(e):
    return jax.jit(lambda i: ffi.sort_by_expert_valid(i, e))


def check(ids, e):
    f = jax.jit(lambda i: ffi.sort_by_expert(i, e))
    got, again, want = f(ids), f(ids), sort_by_expert(ids, e)
    for g, a, w in zip(got, again, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(w))


@pytest.mark.parametrize("t,k,e", [c if c in ((0, 2, 8), (37, 4, 16))
                                   else pytest.param(*c, marks=pytest.mark.slow) for c in CASES])
@pytest.mark.parametrize("invalid", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
def test_cpu_custom_call_matches_jnp(rng, t, k, e, invalid):
    need_native("cpu")
    with jax.default_device(jax.devices("cpu")[0]):
        check(random_ids(rng, t, k, e, invalid), e)


@pytest.mark.parametrize("n,e", [(0, 8), (1, 1), (257, 8), (300, 1000)])
def test_cpu_custom_call_matches_numpy_edges(rng, n, e):
    need_native("cpu")
    with jax.default_device(jax.devices("cpu")[0]):
        check_np(sort_valid(e), edge_ids(rng, n, e), e)


def test_valid_is_an_output_not_a_slice():
    """sort_by_expert_valid's valid is a result of the custom call: no slice of offsets in the program
    (on GPU XLA runs a slice as a device-to-device copy: one more launch)."""
    need_native("cpu")
    text = jax.jit(lambda i: ffi.sort_by_expert_valid(i, 8)[1]).lower(jnp.zeros((4, 2), jnp.int32)).as_text()
    assert "jax_moe_sort_by_expert" in text and "stablehlo.slice" not in text, text


def test_bad_arguments_raise_before_lowering():
    with pytest.raises(ValueError, match="topk_ids must have dtype int32"):
        ffi.sort_by_expert(jnp.zeros((2, 2), jnp.float32), 4)
    with pytest.raises(ValueError, match="topk_ids must have rank 2"):
        ffi.sort_by_expert(jnp.zeros((4,), jnp.int32), 4)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        ffi.sort_by_expert(jnp.zeros((2, 2), jnp.int32), 0)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e", CASES + [(16384, 8, 256)])
@pytest.mark.parametrize("invalid", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
def test_cuda_custom_call_matches_jnp(rng, t, k, e, invalid):
    need_native("cuda")
    check(random_ids(rng, t, k, e, invalid), e)


@pytest.mark.gpu
@pytest.mark.parametrize("e", EDGE_E)
@pytest.mark.parametrize("n", EDGE_N)
def test_cuda_custom_call_matches_numpy_edges(rng, n, e):
    """Sorted slots, inverse, counts and offsets equal the NumPy definition, ids of -1 and >= E
    included; the same jitted function twice on one input, then on a second input (the kernels'
    scratch, a counter included, carries nothing from one call to the next)."""
    need_native("cuda")
    f = sort_valid(e)
    ids = edge_ids(rng, n, e)
    check_np(f, ids, e)
    check_np(f, ids, e)
    check_np(f, edge_ids(rng, n, e), e)


# (n, E) on each side of the limits between the sort's forms: one launch of one block up to 1024 slots
# over at most 1024 buckets (E = 1023); above, three launches, whose first step ranks by warps up to
# 1024 buckets and by comparing every pair of a chunk's slots beyond.
FORM_EDGES = [
    (1024, 128), (1024, 1023), (512, 1023),                # one block
    (1025, 128), (1025, 1023), (4096, 383), (65537, 1),    # three launches, ranks by warps
    (1024, 1024), (512, 1024), (1025, 1024),               # three launches, ranks by pairs
]


@pytest.mark.gpu
@pytest.mark.parametrize("n,e", FORM_EDGES)
def test_cuda_every_form_of_the_sort_meets_the_definition(rng, n, e):
    """The sort runs as one launch of one block or as three, by the number of slots and experts.
    Either side of each limit, the arrays are the NumPy definition's."""
    need_native("cuda")
    f = sort_valid(e)
    check_np(f, edge_ids(rng, n, e), e)
    check_np(f, jnp.full((n, 1), e - 1, jnp.int32), e)  # every slot in the last expert's bucket


@pytest.mark.gpu
def test_cuda_custom_call_skewed_routing():
    """Every slot on one expert (one bucket's column holds every chunk's count), then on the last."""
    need_native("cuda")
    n, e = 131072, 256
    f = sort_valid(e)
    for ex in (0, e - 1):
        check_np(f, jnp.full((n // 8, 8), ex, jnp.int32), e)


@pytest.mark.gpu
def test_cuda_custom_call_under_command_buffers(tmp_path):
    """The handler claims command-buffer compatibility: run it with XLA's command buffers forced on."""
    need_native("cuda")
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import os, numpy as np, jax, jax.numpy as jnp
        from jax_moe import ffi
        from jax_moe.permute import sort_by_expert
        ids = jnp.asarray(np.random.default_rng(3).integers(0, 64, (999, 4)), jnp.int32)
        f = jax.jit(lambda i: ffi.sort_by_expert(i, 64))
        for _ in range(3):
            for g, w in zip(f(ids), sort_by_expert(ids, 64)):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        print("OK")
    """)
    env = dict(__import__("os").environ,
               XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]


def test_cpu_custom_call_batches_under_vmap(rng):
    """jax.vmap over a batch of routings: each element sorted as on its own."""
    ids = jnp.asarray(rng.integers(0, 6, (3, 10, 2)), jnp.int32)
    got = jax.vmap(lambda i: ffi.sort_by_expert(i, 6))(ids)
    for b in range(3):
        want = sort_by_expert(ids[b], 6)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.asarray(g[b]), np.asarray(w))
