"""How the decode path's CUDA kernels are launched (jax_moe.decode.kernel_launches): the kernels' own
rules, read from the CPU module, so they are specified here with no GPU. The figures for the three
large models are the launches measured on an H200 (132 SMs); the properties hold for any shape and
SM count."""

from __future__ import annotations

import itertools

import pytest

from jax_moe.decode import kernel_launches

from helpers import need_native

H200_SMS = 132
GEMV_WARPS = 8        # warps per block of a GEMV kernel, one output each at a time
COLUMN_THREADS = 512  # threads per block of a column kernel (16 warps)
FILL_BLOCKS = 66      # a column kernel narrows its chunk until its grid has this many blocks
DEEP_MIN_ROWS = 64    # GEMM2 runs eight rows deep only where a thread streams at least this many rows

MODELS = {"Qwen3-30B-A3B": (8, 2048, 768), "GPT-OSS-120B": (4, 2880, 2880), "DeepSeek-V3": (8, 7168, 2048)}


@pytest.fixture(autouse=True)
def _cpu_module():
    need_native("cpu")


@pytest.mark.parametrize("model, t, gemm1, gemm2", [
    # model, T, (GEMM1 vectors a row, blocks), (GEMM2 vectors a row, blocks, rows in flight)
    ("Qwen3-30B-A3B", 1, (8, 192), (2, 128, 4)),   # 24 rows a thread: four deep
    ("Qwen3-30B-A3B", 2, (16, 192), (4, 128, 4)),  # 8 vectors would launch 384 blocks: two waves
    ("GPT-OSS-120B", 1, (16, 180), (4, 90, 8)),    # 360 blocks of 8 vectors for 264 places
    ("GPT-OSS-120B", 2, (8, 720), (8, 90, 8)),     # 16 vectors: 360 blocks, still more than a wave
    ("DeepSeek-V3", 1, (16, 256), (8, 112, 8)),
    ("DeepSeek-V3", 2, (8, 1024), (8, 224, 4)),    # 224 blocks: more than one per SM, four deep
])
def test_bf16_column_kernels_at_the_measured_model_sizes(model, t, gemm1, gemm2):
    k, h, i = MODELS[model]
    g1, g2 = kernel_launches(t, k, h, i, sms=H200_SMS, transposed=True)
    assert (g1.kernel, g2.kernel) == ("ExpertColumnsAct", "ExpertColumnsReduce")
    assert (g1.vecs, g1.blocks) == gemm1
    assert (g2.vecs, g2.blocks, g2.depth) == gemm2
    assert g1.grid[1] == t * k and g2.grid[1] == t
    assert g1.threads == g2.threads == COLUMN_THREADS


@pytest.mark.parametrize("model, t, gemm1, gemm2", [
    # model, T, (GEMM1 outputs per warp, blocks), (GEMM2 outputs per warp, blocks)
    ("Qwen3-30B-A3B", 1, (3, 256), (1, 256)),
    ("Qwen3-30B-A3B", 2, (6, 256), (2, 256)),
    ("GPT-OSS-120B", 1, (6, 240), (1, 360)),   # one output a warp: 180 blocks would leave 32% of places
    ("GPT-OSS-120B", 2, (11, 264), (3, 240)),
    ("DeepSeek-V3", 1, (8, 256), (1, 896)),    # 224 blocks would leave 15%
    ("DeepSeek-V3", 2, (16, 256), (7, 256)),
])
def test_fp8_gemvs_at_the_measured_model_sizes(model, t, gemm1, gemm2):
    k, h, i = MODELS[model]
    g1, g2 = kernel_launches(t, k, h, i, sms=H200_SMS, scheme="fp8")
    assert (g1.kernel, g2.kernel) == ("ExpertGemvActFp8", "ExpertGemvReduceFp8")
    assert (g1.outputs_per_warp, g1.blocks) == gemm1
    assert (g2.outputs_per_warp, g2.blocks) == gemm2


@pytest.mark.parametrize("h, i, t, gemm1, gemm2", [
    # the GPU test's Qwen3-size cases (k = 8): (GEMM1 outputs per chunk, chunks), (GEMM2 columns, blocks, depth)
    (2048, 768, 1, (32, 24), (16, 128, 4)),
    (2048, 768, 3, (32, 24), (64, 96, 8)),     # 64 columns: 96 blocks, 96 rows a thread
    (2048, 768, 5, (32, 24), (64, 160, 4)),    # 160 blocks: more than the SMs, four deep
    (2056, 776, 2, (64, 13), (64, 66, 8)),     # 64-output chunks, the last of 8 outputs; 97 rows a thread
    (2048, 2056, 1, (64, 33), (16, 128, 8)),   # 65 rows a thread, eight deep
    (200, 40, 2, (8, 5), (8, 50, 4)),          # the narrowest chunks
])
def test_the_gpu_tests_qwen3_size_cases_take_the_launches_they_name(h, i, t, gemm1, gemm2):
    g1, g2 = kernel_launches(t, 8, h, i, sms=H200_SMS, transposed=True)
    assert (4 * g1.vecs, g1.grid[0]) == gemm1
    assert (8 * g2.vecs, g2.blocks, g2.depth) == gemm2


# (T, k, (H, I)) over decode-sized calls; each property is checked on GPUs of 78, 132 and 148 SMs
SHAPES = list(itertools.product([1, 2, 3, 5, 16], [1, 2, 4, 8],
                                [(200, 40), (2048, 768), (2880, 2880), (7168, 2048), (4096, 1536)]))
SMS = [78, 132, 148]


@pytest.mark.parametrize("sms", SMS)
def test_column_grids_cover_every_output_once_with_the_widest_chunk_that_fills_the_gpu(sms):
    for t, k, (h, i) in SHAPES:
        g1, g2 = kernel_launches(t, k, h, i, sms=sms, transposed=True)
        # GEMM1: a chunk of v vectors yields 4v outputs (its gate and up columns), 2 vectors at least
        assert g1.vecs in (16, 8, 4, 2)
        assert (g1.grid[0] - 1) * 4 * g1.vecs < i <= g1.grid[0] * 4 * g1.vecs and g1.grid[1] == t * k
        # GEMM2: a chunk of v vectors yields 8v outputs
        assert g2.vecs in (8, 4, 2, 1)
        assert (g2.grid[0] - 1) * 8 * g2.vecs < h <= g2.grid[0] * 8 * g2.vecs and g2.grid[1] == t
        # no narrower than needed: twice the chunk would leave fewer than FILL_BLOCKS blocks
        if g2.vecs < 8:
            assert -(-h // (16 * g2.vecs)) * t < FILL_BLOCKS
        if g1.vecs in (2, 4):
            assert -(-i // (8 * g1.vecs)) * t * k < FILL_BLOCKS


@pytest.mark.parametrize("sms", SMS)
def test_gemm1_reads_256_bytes_a_row_only_where_that_is_one_full_wave_and_128_are_more(sms):
    for t, k, (h, i) in SHAPES:
        g1, _ = kernel_launches(t, k, h, i, sms=sms, transposed=True)
        blocks8 = -(-i // 32) * t * k
        if g1.vecs == 16:
            assert blocks8 > 2 * sms and sms <= g1.blocks <= 2 * sms
        elif g1.vecs == 8:
            sixteen = -(-i // 64) * t * k
            assert blocks8 <= 2 * sms or not sms <= sixteen <= 2 * sms


@pytest.mark.parametrize("sms", SMS)
def test_gemm2_runs_eight_rows_deep_only_on_at_most_one_block_per_sm_with_long_row_streams(sms):
    for t, k, (h, i) in SHAPES:
        _, g2 = kernel_launches(t, k, h, i, sms=sms, transposed=True)
        teams = min(k, 16)                                 # a team of warps per slot, up to 16 at once
        groups = (16 // teams) * (32 // g2.vecs)           # a team's threads per column vector, each a row in groups
        deep = g2.blocks <= sms and -(-i // groups) >= DEEP_MIN_ROWS
        assert g2.depth == (8 if deep else 4)


@pytest.mark.parametrize("sms", SMS)
def test_fp8_gemvs_take_several_outputs_a_warp_only_to_fill_one_wave(sms):
    for t, k, (h, i) in SHAPES:
        for g, outputs, rows in zip(kernel_launches(t, k, h, i, sms=sms, scheme="fp8"), (i, h), (t * k, t)):
            groups = -(-outputs // GEMV_WARPS)
            assert g.grid == (-(-groups // g.outputs_per_warp), rows) and g.threads == 32 * GEMV_WARPS
            if g.outputs_per_warp > 1:  # one wave of two blocks per SM, at least 90% full
                assert 0.9 * 2 * sms <= g.blocks <= 2 * sms
                fewer = -(-groups // (g.outputs_per_warp - 1)) * rows
                assert fewer > 2 * sms  # one output fewer a warp would take a second wave


def test_bf16_weights_as_stored_take_one_output_a_warp():
    g1, g2 = kernel_launches(2, 8, 2048, 768, sms=H200_SMS)
    assert (g1.kernel, g1.grid, g1.outputs_per_warp) == ("ExpertGemvAct", (96, 16), 1)
    assert (g2.kernel, g2.grid, g2.outputs_per_warp) == ("ExpertGemvReduce", (256, 2), 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(scheme="fp4"), "scheme must be 'bf16' or 'fp8'"),
    (dict(scheme="fp8", transposed=True), "transposed must be False"),
    (dict(sms=0), "sms must be a positive int"),
    (dict(t=0), "t must be a positive int"),
    (dict(i=2.5), "i must be a positive int"),
])
def test_bad_arguments_are_named(kwargs, match):
    args = dict(t=1, k=8, h=2048, i=768, sms=H200_SMS) | kwargs
    with pytest.raises(ValueError, match=match):
        kernel_launches(**args)
