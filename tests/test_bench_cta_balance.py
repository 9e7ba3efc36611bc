"""bench/cta_balance.py: how evenly the persistent scheduler deals a grouped GEMM's tiles, counted from rows."""

import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cta_balance(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import cta_balance

    return cta_balance


def test_tiles_come_group_after_group_row_tiles_first_and_cost_their_blocks_on_the_192_row_tile(cta_balance):
    rows = np.array([100, 0, 200])
    tile = cta_balance.Tile("coop_192x256", 192, 256, "blocks")
    costs = cta_balance.tile_costs(rows, np.array([2, 1, 0]), tile, n=512)
    # expert 2: row tiles of 192 rows (3 blocks) and 8 rows (1 block), for each of 2 column tiles;
    # expert 1 has no tiles; expert 0: one row tile of 100 rows (2 blocks) per column tile
    assert costs.tolist() == [3, 1, 3, 1, 2, 2]


def test_whole_tile_tiles_cost_one_each(cta_balance):
    tile = cta_balance.Tile("pingpong_64x256", 64, 256, "tiles")
    assert cta_balance.tile_costs(np.array([65, 64]), np.array([0, 1]), tile, n=300).tolist() == [1] * 6


def test_cta_c_runs_every_grid_th_tile_from_tile_c(cta_balance):
    assert cta_balance.cta_loads(np.array([1.0, 2, 3, 4, 5]), grid=2).tolist() == [9, 6]


def test_the_greedy_deal_puts_each_tile_most_costly_first_on_the_least_loaded_cta(cta_balance):
    assert cta_balance.lpt_max(np.array([3.0, 3, 2, 2, 2]), grid=2) == 7  # 3+2+2 and 3+2


def test_equal_tiles_cost_the_rounding_of_their_count_whatever_the_order(cta_balance):
    rows = np.full(256, 128)  # 256 experts of one 192-row tile each, 16 column tiles: 4096 tiles
    tile = cta_balance.Tile("coop_192x256", 192, 256, "blocks")
    r = cta_balance.imbalance(rows, tile, n=4096, grid=132)
    assert set(r) == {*cta_balance.ORDERS, "lpt"}
    assert all(v == pytest.approx(32 / (4096 / 132)) for v in r.values())


def test_an_unknown_cost_model_is_refused(cta_balance):
    with pytest.raises(ValueError, match="tile.cost must be one of"):
        cta_balance.tile_costs(np.array([1]), np.array([0]), cta_balance.Tile("x", 64, 256, "rows"), n=256)


def test_the_table_has_a_row_per_tile_and_a_column_per_order(cta_balance):
    from bench.moe_bench import MODELS

    text = cta_balance.table(MODELS["tiny"], 32, "gemm1", "balanced", grid=4)
    assert "4 CTAs" in text
    assert text.count("\n| ") == 1 + len(cta_balance.TILES)
    assert "| spread |" in text and "| lpt |" in text


def test_the_command_prints_a_table_per_layer(cta_balance, capsys):
    assert cta_balance.main(["--models", "tiny", "--tokens", "32", "--gemm", "gemm2", "--grid", "4"]) == 0
    assert capsys.readouterr().out.count("Most loaded CTA over the mean") == 1
    with pytest.raises(SystemExit):
        cta_balance.main(["--models", "tiny", "--grid", "0"])


def test_the_table_averages_over_several_routings_of_the_layer(cta_balance):
    from bench.moe_bench import MODELS

    text = cta_balance.table(MODELS["tiny"], 32, "gemm1", grid=4, sets=3)
    assert "means over 3 routings" in text
    assert text.count("\n| ") == 1 + len(cta_balance.TILES)
