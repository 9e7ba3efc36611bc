"""jax_moe.kernels on a GPU: the CUDA kernels against the jnp references, which
test_moe_kernels.py checks against independent numpy definitions (``gpu``)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_moe import ffi, kernels
from helpers import need_native, np_moe, poison_memory, random_routing, rel_err
from kernel_cases import (
    FP8, MINUS_ONE, SHAPES, TINY, assert_same_bytes, dequant, gptoss_case, normal, np_act, np_unpermute,
    permute_three_ways, pipeline, poison_rows,
)


# ---------------------------------------------------------------- GPU: CUDA kernels vs references


def run_twice(fn, *args, target: str):
    """jit(fn)(*args) twice on poisoned memory; checks that the CUDA custom call is what runs and
    that both runs agree."""
    f = jax.jit(fn)
    assert f"@{target}" in f.lower(*args).as_text(), f"{target} is not in the lowered module"
    shapes = jax.eval_shape(f, *args)
    poison_memory(shapes)
    first = f(*args)
    poison_memory(shapes)
    second = f(*args)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    return first


def gpu_case(rng, t, k, e, minus_one):
    # experts 0 and 1: no tokens
    w, ids = random_routing(rng, t, e, k, experts=range(min(2, e - k), e), minus_one=MINUS_ONE * minus_one)
    sort = ffi.sort_by_expert(ids, e)
    return sort, w, int(sort.offsets[-1])


def check_fp8(q, s, ref_q, ref_s, valid, scale_rtol=1e-6):
    """FP8 rows and scales against the reference's: dequantized within 5e-2, rows past ``valid``
    zero with the smallest scale. Returns the fraction of FP8 values equal to the reference's."""
    q32, ref32 = np.asarray(q, np.float32), np.asarray(ref_q, np.float32)
    assert np.isfinite(q32).all() and np.isfinite(np.asarray(s)).all()
    assert rel_err(dequant(q, s), dequant(ref_q, ref_s)) < 5e-2
    if np.ndim(s):
        np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), rtol=scale_rtol)
        assert (np.asarray(s)[valid:] == TINY).all()
    assert (q32[valid:] == 0).all()
    return float(np.mean(q32 == ref32))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_permute_rows(rng, t, k, e, h, i, minus_one, dtype):
    need_native("cuda")
    sort, _, valid = gpu_case(rng, t, k, e, minus_one)
    x = normal(rng, (t, h), dtype, 3.0)
    v = sort.offsets[-1]
    rows = run_twice(lambda x, s, v: kernels.permute_rows(x, s, k, valid_rows=v), x, sort.sorted_slots, v,
                     target="jax_moe_permute_rows")
    ref = kernels.permute_rows_reference(x, sort.sorted_slots, k, valid_rows=v)
    assert rows.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(ref, np.float32))
    q, s = run_twice(lambda x, s, v: kernels.permute_rows(x, s, k, valid_rows=v, quant="fp8_per_token"),
                     x, sort.sorted_slots, v, target="jax_moe_permute_rows")
    same = check_fp8(q, s, *kernels.permute_rows_reference(x, sort.sorted_slots, k, valid_rows=v,
                                                           quant="fp8_per_token"), valid)
    assert same > 0.999, f"only {same:.4f} of the FP8 bytes equal the reference's"
    scale = jnp.float32(0.01)
    q, s = run_twice(lambda x, s: kernels.permute_rows(x, s, k, quant="fp8_static", scale=scale),
                     x, sort.sorted_slots, target="jax_moe_permute_rows")
    check_fp8(q, s, *kernels.permute_rows_reference(x, sort.sorted_slots, k, quant="fp8_static", scale=scale),
              t * k)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h", [(1, 1, 4, 128), (257, 1, 8, 203), (37, 7, 16, 256), (1024, 3, 16, 264),
                                     (4096, 8, 128, 2048)],
                         ids=["rows-1", "rows-257-scalar", "rows-259", "tokens-1024", "qwen3-rows-32768"])
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_permute_rows_with_the_inverse(rng, t, k, e, h, minus_one, dtype):
    """With the sort's inverse the kernel runs a warp per slot, or from 1024 tokens on a warp per
    token writing its row to its k slots' rows: either way its rows and scales are the gather-order
    kernel's, byte for byte, on freshly poisoned outputs, and the reference's."""
    need_native("cuda")
    sort, _, valid = gpu_case(rng, t, k, e, minus_one)
    x = normal(rng, (t, h), dtype, 3.0)
    v = sort.offsets[-1]

    def permute(x, slots, v, inverse):
        return permute_three_ways(kernels.permute_rows, x, slots, k, v, inverse=inverse)

    by_token = run_twice(permute, x, sort.sorted_slots, v, sort.inverse, target="jax_moe_permute_rows")
    gather_order = run_twice(lambda x, s, v: permute(x, s, v, None), x, sort.sorted_slots, v,
                             target="jax_moe_permute_rows")
    assert_same_bytes(by_token, gather_order)
    rows, (q, s), (qs, ss) = by_token
    ref_rows, ref_tok, ref_static = permute_three_ways(kernels.permute_rows_reference, x, sort.sorted_slots, k, v,
                                                       inverse=sort.inverse)
    assert_same_bytes(rows, ref_rows)
    same = check_fp8(q, s, *ref_tok, valid)
    assert same > 0.999, f"only {same:.4f} of the FP8 bytes equal the reference's"
    check_fp8(qs, ss, *ref_static, valid)


@pytest.mark.gpu
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e30])
def test_cuda_fp8_rows_quantize_a_nonfinite_value_as_the_reference(rng, bad):
    """FP8 rows as jax_moe.quant.fp8 defines them: a NaN or an infinity becomes NaN (never a
    plausible +-448), a finite overflow saturates to +-448, and per token the scale is the amax of
    the finite values, so the bad value's neighbours keep theirs."""
    need_native("cuda")
    t, k, e, h = 16, 2, 8, 256
    sort, _, _ = gpu_case(rng, t, k, e, False)
    x = normal(rng, (t, h), "bfloat16", 3.0).at[5, 17].set(bad)
    h2 = normal(rng, (t * k, 2 * h), "bfloat16", 2.0).at[3, h + 9].set(bad)  # an up value
    cases = [(kernels.permute_rows, kernels.permute_rows_reference, (x, sort.sorted_slots, k), "jax_moe_permute_rows"),
             (kernels.act_and_mul, kernels.act_and_mul_reference, (h2, "silu"), "jax_moe_act_and_mul")]
    for quant, scale in (("fp8_static", jnp.float32(0.01)), ("fp8_per_token", None)):
        for fn, ref_fn, (a, *rest), target in cases:
            q, s = run_twice(lambda a: fn(a, *rest, quant=quant, scale=scale), a, target=target)
            ref_q, ref_s = ref_fn(a, *rest, quant=quant, scale=scale)
            q32, ref32 = np.asarray(q, np.float32), np.asarray(ref_q, np.float32)
            np.testing.assert_array_equal(np.isnan(q32), np.isnan(ref32))
            assert np.isnan(q32).any() == bool(np.isnan(bad) or np.isinf(bad))
            assert np.mean(q32[~np.isnan(q32)] == ref32[~np.isnan(ref32)]) > 0.99
            np.testing.assert_allclose(np.asarray(s), np.asarray(ref_s), rtol=1e-6)
            if quant == "fp8_static" and bad == 1e30:
                assert np.abs(q32).max() == 448.0


@pytest.mark.gpu
def test_cuda_permute_rows_rejects_an_inverse_of_the_wrong_size():
    """The handler's own check (before any launch): inverse has T*k elements or none."""
    need_native("cuda")
    x, slots = jnp.ones((4, 8), jnp.bfloat16), jnp.arange(8, dtype=jnp.int32)
    call = jax.ffi.ffi_call("jax_moe_permute_rows", [jax.ShapeDtypeStruct((8, 8), jnp.bfloat16),
                                                     jax.ShapeDtypeStruct((0,), jnp.float32)])
    with pytest.raises(Exception, match=r"permute_rows: inverse must have T\*k elements"):
        jax.block_until_ready(call(x, slots, slots[:7], jnp.full((1,), 8, jnp.int32), jnp.zeros((0,), jnp.float32),
                                   top_k=2, quant=0))


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_act_and_mul(rng, t, k, e, h, i, minus_one, activation, dtype):
    need_native("cuda")
    sort, _, valid = gpu_case(rng, t, k, e, minus_one)
    v = sort.offsets[-1]
    hin = poison_rows(normal(rng, (t * k, 2 * i), dtype, 2.0), valid)
    for out_dtype in (None, jnp.float32, jnp.bfloat16):
        out = run_twice(lambda h, v: kernels.act_and_mul(h, activation, valid_rows=v, out_dtype=out_dtype), hin, v,
                        target="jax_moe_act_and_mul")
        ref = kernels.act_and_mul_reference(hin, activation, valid_rows=v, out_dtype=out_dtype)
        assert out.dtype == ref.dtype
        # XLA's exp/erf and CUDA's expf/erff differ in the last bits
        assert rel_err(out, ref) < (1e-2 if ref.dtype == jnp.bfloat16 else 1e-4)
        assert (np.asarray(out, np.float32)[valid:] == 0).all()
    q, s = run_twice(lambda h, v: kernels.act_and_mul(h, activation, valid_rows=v, quant="fp8_per_token"), hin, v,
                     target="jax_moe_act_and_mul")
    check_fp8(q, s, *kernels.act_and_mul_reference(hin, activation, valid_rows=v, quant="fp8_per_token"), valid,
              scale_rtol=1e-4)
    scale = jnp.float32(0.02)
    q, s = run_twice(lambda h, v: kernels.act_and_mul(h, activation, valid_rows=v, quant="fp8_static", scale=scale),
                     hin, v, target="jax_moe_act_and_mul")
    check_fp8(q, s, *kernels.act_and_mul_reference(hin, activation, valid_rows=v, quant="fp8_static", scale=scale),
              valid)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
@pytest.mark.parametrize("plain", [False, True], ids=["weighted", "weight-on-input"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cuda_unpermute_reduce(rng, t, k, e, h, i, minus_one, plain, dtype):
    need_native("cuda")
    sort, w, valid = gpu_case(rng, t, k, e, minus_one)
    v = sort.offsets[-1]
    y = poison_rows(normal(rng, (t * k, h), dtype), valid)
    for out_dtype in (None, jnp.float32, jnp.bfloat16):
        out = run_twice(lambda y, i, w, v: kernels.unpermute_reduce(y, i, w, valid_rows=v, out_dtype=out_dtype,
                                                                    apply_router_weight_on_input=plain),
                        y, sort.inverse, w, v, target="jax_moe_unpermute_reduce")
        ref = kernels.unpermute_reduce_reference(y, sort.inverse, w, valid_rows=v, out_dtype=out_dtype,
                                                 apply_router_weight_on_input=plain)
        assert out.dtype == ref.dtype and out.shape == (t, h)
        # float32: the reference's reduce is an einsum, which may run in TF32 on the GPU
        assert rel_err(out, ref) < (2e-3 if ref.dtype == jnp.float32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("layout", ["concat", "interleaved"])
@pytest.mark.parametrize("activation", ["swigluoai", "silu"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_act_and_mul_layouts_biases_and_swigluoai(rng, t, k, e, h, i, layout, activation, dtype):
    """GPT-OSS's activation on the CUDA kernel: each row's expert bias (binary search over the
    offsets; experts 0 and 1 empty), both layouts, swigluoai with non-default constants and
    values past its limit, every output mode; NaN rows past valid_rows stay zero."""
    need_native("cuda")
    sort, _, valid = gpu_case(rng, t, k, e, True)
    v, off = sort.offsets[-1], sort.offsets
    hin = poison_rows(normal(rng, (t * k, 2 * i), dtype, 4.0), valid)
    bias = normal(rng, (e, 2 * i), jnp.float32)
    kw = dict(layout=layout, alpha=1.5, limit=5.0)
    want = np_act(np.asarray(hin, np.float32), activation, valid, layout, bias, off, alpha=1.5, limit=5.0)
    for out_dtype in (None, jnp.float32):
        out = run_twice(lambda h, v, b, o: kernels.act_and_mul(h, activation, valid_rows=v, out_dtype=out_dtype,
                                                               bias=b, offsets=o, **kw),
                        hin, v, bias, off, target="jax_moe_act_and_mul")
        ref = kernels.act_and_mul_reference(hin, activation, valid_rows=v, out_dtype=out_dtype, bias=bias,
                                            offsets=off, **kw)
        assert out.dtype == ref.dtype
        assert rel_err(out, ref) < (1e-2 if ref.dtype == jnp.bfloat16 else 1e-4)
        assert rel_err(out, want) < (1e-2 if ref.dtype == jnp.bfloat16 else 1e-4)
        assert (np.asarray(out, np.float32)[valid:] == 0).all()
    out = run_twice(lambda h, v: kernels.act_and_mul(h, activation, valid_rows=v, **kw), hin, v,
                    target="jax_moe_act_and_mul")  # no bias
    assert rel_err(out, kernels.act_and_mul_reference(hin, activation, valid_rows=v, **kw)) < 1e-2
    for quant, scale in (("fp8_per_token", None), ("fp8_static", jnp.float32(0.05))):
        args = dict(valid_rows=v, quant=quant, scale=scale, bias=bias, offsets=off, **kw)
        q, s = run_twice(lambda h: kernels.act_and_mul(h, activation, **args), hin, target="jax_moe_act_and_mul")
        check_fp8(q, s, *kernels.act_and_mul_reference(hin, activation, **args), valid, scale_rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("t,k,e,h,i", SHAPES)
@pytest.mark.parametrize("plain", [False, True], ids=["weighted", "weight-on-input"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_cuda_unpermute_reduce_with_bias(rng, t, k, e, h, i, plain, dtype):
    """The GEMM2 bias of each slot's expert added to its row before the weight; slots of ids -1
    (NaN rows) skipped, bias included."""
    need_native("cuda")
    sort, w, valid = gpu_case(rng, t, k, e, True)
    v, off = sort.offsets[-1], sort.offsets
    y = poison_rows(normal(rng, (t * k, h), dtype), valid)
    bias = normal(rng, (e, h), jnp.float32)
    want = np_unpermute(np.asarray(y, np.float32), sort.inverse, w, valid, plain, bias, off)
    for out_dtype in (None, jnp.float32):
        out = run_twice(lambda y, i, w, v, b, o: kernels.unpermute_reduce(
            y, i, w, valid_rows=v, out_dtype=out_dtype, apply_router_weight_on_input=plain, bias=b, offsets=o),
            y, sort.inverse, w, v, bias, off, target="jax_moe_unpermute_reduce")
        ref = kernels.unpermute_reduce_reference(y, sort.inverse, w, valid_rows=v, out_dtype=out_dtype,
                                                 apply_router_weight_on_input=plain, bias=bias, offsets=off)
        assert out.dtype == ref.dtype and out.shape == (t, h)
        tol = 2e-3 if ref.dtype == jnp.float32 else 1e-2
        assert rel_err(out, ref) < tol and rel_err(out, want) < tol


@pytest.mark.gpu
def test_cuda_kernels_chain_to_the_gptoss_moe(rng):
    need_native("cuda")
    x, w13, w2, w, ids, b13, b2 = gptoss_case(rng, t=77, k=4, e=16, h=256, i=128)
    want = np_moe(x, w13, w2, w, ids, "swigluoai", "interleaved", b13, b2)
    f = jax.jit(lambda *a: pipeline(*a[:5], "swigluoai", None, "interleaved", *a[5:]))
    assert rel_err(f(x, w13, w2, w, ids, b13, b2), want) < 1e-4
    assert rel_err(f(x.astype(jnp.bfloat16), w13, w2, w, ids, b13, b2), want) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("minus_one", [False, True], ids=["ids-in-range", "some-ids-minus-1"])
def test_cuda_kernels_chain_to_the_moe(rng, minus_one):
    need_native("cuda")
    t, k, e, h, i = 77, 4, 16, 256, 128
    w, ids = random_routing(rng, t, e, k, experts=range(1, e), minus_one=MINUS_ONE * minus_one)
    x = normal(rng, (t, h), jnp.float32)
    w13 = normal(rng, (e, 2 * i, h), jnp.float32, 1 / math.sqrt(h))
    w2 = normal(rng, (e, h, i), jnp.float32, 1 / math.sqrt(i))
    want = np_moe(x, w13, w2, w, ids, "silu")
    assert rel_err(jax.jit(pipeline, static_argnums=5)(x, w13, w2, w, ids, "silu"), want) < 1e-4
    assert rel_err(pipeline(x.astype(jnp.bfloat16), w13, w2, w, ids, "silu"), want) < 2e-2
    assert rel_err(pipeline(x, w13, w2, w, ids, "gelu", "fp8_per_token"), np_moe(x, w13, w2, w, ids, "gelu")) < 5e-2


@pytest.mark.gpu
def test_cuda_kernels_under_command_buffers():
    """The handlers declare command-buffer compatibility: run them with XLA's command buffers forced
    on, fresh inputs each round, against the references."""
    need_native("cuda")
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import numpy as np, jax, jax.numpy as jnp
        from jax_moe import ffi, kernels as K
        rng = np.random.default_rng(7)
        t, k, e, h, i = 333, 8, 64, 512, 192

        def step(x, ids, w, hin, y, suffix=""):  # suffix "_reference": the jnp references
            permute, act, unpermute = (getattr(K, n + suffix) for n in ("permute_rows", "act_and_mul",
                                                                        "unpermute_reduce"))
            s = ffi.sort_by_expert(ids, e)
            v = s.offsets[-1]
            return (permute(x, s.sorted_slots, k, valid_rows=v, quant="fp8_per_token"),
                    act(hin, "silu", valid_rows=v), unpermute(y, s.inverse, w, valid_rows=v))

        f = jax.jit(step)
        for _ in range(3):
            ids = np.argsort(-rng.standard_normal((t, e)), axis=1)[:, :k].astype(np.int32)
            ids[rng.random(ids.shape) < 0.1] = -1
            args = (jnp.asarray(rng.standard_normal((t, h)), jnp.bfloat16), jnp.asarray(ids),
                    jnp.asarray(rng.random((t, k)) + 0.1, jnp.float32),
                    jnp.asarray(rng.standard_normal((t * k, 2 * i)), jnp.bfloat16),
                    jnp.asarray(rng.standard_normal((t * k, h)), jnp.bfloat16))
            (q, s), a, out = f(*args)
            (rq, rs), ra, rout = step(*args, suffix="_reference")
            deq = lambda q, s: np.asarray(q, np.float32) * np.asarray(s)[:, None]
            for got, want, tol in ((deq(q, s), deq(rq, rs), 5e-2), (a, ra, 1e-2), (out, rout, 1e-2)):
                got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
                err = np.linalg.norm(got - want) / np.linalg.norm(want)
                assert np.isfinite(got).all() and err < tol, err
        print("OK")
    """)
    env = dict(__import__("os").environ,
               XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
