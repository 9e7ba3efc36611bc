"""bench/tile_padding.py: what a row tiling multiplies and passes through the L2, counted from rows."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def tile_padding(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import tile_padding

    return tile_padding


ROWS = [128, 129, 0, 64]  # a full tile, one row over, an expert without rows, half a tile: 321 rows


def test_a_128_row_tile_multiplies_whole_tiles_and_passes_each_weight_tile_once_per_row_tile(tile_padding):
    c = tile_padding.cost(ROWS, tile_padding.Tiling("128x256", 128, 256), n=512, k=64)
    assert c.row_tiles == 4  # 1 + 2 + 1; the expert without rows has none
    assert c.multiplied_per_row == pytest.approx(4 * 128 / 321)
    assert c.weight_passes == pytest.approx(4 / 3)
    assert c.row_passes == 2  # 512 columns in 256-column tiles
    assert c.l2_bytes == pytest.approx(2 * (4 / 3 * 3 * 512 * 64 + 2 * 321 * 64))


def test_a_2x1_cluster_rounds_row_tiles_to_pairs_and_passes_a_weight_tile_once_per_pair(tile_padding):
    c = tile_padding.cost(ROWS, tile_padding.Tiling("c2", 128, 256, cluster_m=2), n=512, k=64)
    assert c.row_tiles == 6  # 2 + 2 + 2
    assert c.multiplied_per_row == pytest.approx(6 * 128 / 321)
    assert c.weight_passes == pytest.approx(1.0)


def test_skipping_empty_64_row_blocks_multiplies_to_64_row_granularity(tile_padding):
    c = tile_padding.cost(ROWS, tile_padding.Tiling("256x128 skip", 256, 128, skips_empty_blocks=True), n=512, k=64)
    assert c.row_tiles == 3
    assert c.multiplied_per_row == pytest.approx((2 + 3 + 1) * 64 / 321)
    assert c.weight_passes == pytest.approx(1.0) and c.row_passes == 4


def test_the_192_row_tile_is_one_row_tile_per_expert_of_up_to_192_rows_multiplied_to_64_rows(tile_padding):
    (c,) = [tile_padding.cost(ROWS, t, n=512, k=64) for t in tile_padding.TILINGS if "coop_192x256" in t.name]
    assert c.row_tiles == 3  # 1 + 1 + 1: no expert here passes 192 rows
    assert c.multiplied_per_row == pytest.approx((2 + 3 + 1) * 64 / 321)
    assert c.weight_passes == pytest.approx(1.0) and c.row_passes == 2


def test_a_last_tile_with_its_tokens_on_n_multiplies_its_rows_rounded_up_to_8(tile_padding):
    """The 64-row tiling with each expert's partly filled last tile multiplied with its tokens on the
    MMA's N: 128 rows in two full tiles, 129 in two and one row (8), 64 in one."""
    (c,) = [tile_padding.cost(ROWS, t, n=512, k=64) for t in tile_padding.TILINGS if t.swap_step]
    assert c.row_tiles == 2 + 3 + 1
    assert c.multiplied_per_row == pytest.approx((128 + 136 + 64) / 321)
    assert c.weight_passes == pytest.approx(6 / 3) and c.row_passes == 2


def test_the_table_counts_the_bench_routing_of_a_layer(tile_padding):
    from bench.moe_bench import MODELS

    m = MODELS["tiny"]
    rows = tile_padding.row_counts(m, 32, "balanced")
    assert rows.tolist() == [32 * m.k // m.e] * m.e
    text = tile_padding.table(m, 32, "gemm1", "balanced")
    assert "128 rows over 16 experts (8-8 each)" in text
    assert text.count("\n| ") == 1 + len(tile_padding.TILINGS)  # the header and a row per tiling
    with pytest.raises(ValueError, match="gemm must be"):
        tile_padding.gemm_shape(m, "gemm3")
    assert tile_padding.main(["--models", "tiny", "--tokens", "8", "--gemm", "gemm2"]) == 0
