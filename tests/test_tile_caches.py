"""Tile caches as a trace reads them (jax_moe/backends/cutlass_tile_cache.py): the user's tuned
cache first, within its reach and on its GPU model only, then the tiles shipped for this GPU model,
then the table; a fused GEMM falls back on its plain GEMM's tiles; the H200's shipped clustered and
192-row picks run as measured; every cache asked for is read or is an error naming it."""

from __future__ import annotations

import json
import os

import pytest

from jax_moe import autotune
from jax_moe.backends import cutlass_tile_cache as tc
from jax_moe.backends import cutlass_tiles as ct
from jax_moe.device import device_kind
from tile_cache_cases import E, GEMM1, GEMM2, K, N, SHIPPED, no_tile_caches, ship  # noqa: F401 (the autouse fixture)


def test_later_traces_on_the_same_gpu_model_read_the_tuned_tiles_first(tmp_path, monkeypatch):
    path = tmp_path / "tiles.json"
    cache = tc.TileCache(device_kind())
    cache.record(GEMM1, 16.0, "pingpong_64x256", {"pingpong_64x256": 0.5})
    cache.save(path)
    shipped = ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn_act")
    assert shipped != "pingpong_64x256"
    monkeypatch.setenv(tc.CACHE_ENV, str(path))
    assert ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn_act") == "pingpong_64x256"
    assert ct.pick_tile(20 * E, E, n=N, k=K, kind="bf16_kn_act") == "pingpong_64x256"  # the nearest point
    assert ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn") == ct.heuristic_tile(16)  # another GEMM: as shipped
    monkeypatch.setenv(ct.TILE_ENV, "coop_128x128")
    assert ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn_act") == "coop_128x128"  # the forced tile still wins


def test_tuned_tiles_answer_only_within_twice_the_tuned_rows_per_expert(tmp_path, monkeypatch):
    """A tile that won at 16 to 64 rows per expert says nothing of 256 (nor of 4): there the
    shipped tiles and the heuristic decide, as for a GEMM never tuned."""
    path = tmp_path / "tiles.json"
    cache = tc.TileCache(device_kind())
    cache.record(GEMM1, 16.0, "pingpong_64x256", {"pingpong_64x256": 0.5})
    cache.record(GEMM1, 64.0, "coop_128x128", {"coop_128x128": 0.5})
    cache.save(path)
    monkeypatch.setenv(tc.CACHE_ENV, str(path))
    pick = lambda rows: ct.pick_tile(int(rows * E), E, n=N, k=K, kind="bf16_kn_act")  # noqa: E731
    assert [pick(r) for r in (8, 16, 24, 64, 128)] == ["pingpong_64x256"] * 3 + ["coop_128x128"] * 2
    monkeypatch.delenv(tc.CACHE_ENV)
    for rows in (4, 7, 129, 256, 1024):
        shipped = ct.pick_tile(rows * E, E, n=N, k=K, kind="bf16_kn_act")
        monkeypatch.setenv(tc.CACHE_ENV, str(path))
        assert pick(rows) == shipped, rows
        monkeypatch.delenv(tc.CACHE_ENV)
    assert tc.load(path, ct.TILES).tile_for(GEMM1, 128.0 * tc.REACH) is None


def test_a_gemm_key_splits_back_into_its_kind_and_shape_and_nothing_else_passes_for_one():
    assert tc.split_gemm_key(tc.gemm_key("bf16_kn_act", 128, 5760, 2880)) == ("bf16_kn_act", 128, 5760, 2880)
    for key in ["bf16/1/2", "bf16/1/2/3/4", "/1/2/3", "bf16/0/2/3", "bf16/1/x/3", "bf16/1/2/-3"]:
        with pytest.raises(ValueError, match="kind/E/N/K"):
            tc.split_gemm_key(key)


def test_a_cache_asked_for_is_never_skipped_silently(tmp_path, monkeypatch):
    monkeypatch.setenv(tc.CACHE_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing.json"):
        ct.pick_tile(64, E, n=N, k=K)
    bad = tmp_path / "bad.json"
    for doc, what in [({"format": "x"}, "not a jax_moe tile cache"),
                      ({"format": tc.FORMAT, "device": "G", "gemms": {"bf16/1/2": {}}}, "kind/E/N/K"),
                      ({"format": tc.FORMAT, "device": "G", "gemms": {GEMM1: {"4": "huge_tile"}}}, "huge_tile"),
                      ({"format": tc.FORMAT, "device": "G", "gemms": {GEMM1: {"-1": "coop_128x128"}}}, "positive"),
                      ({"format": tc.FORMAT, "gemms": {}}, "device")]:
        bad.write_text(json.dumps(doc))
        with pytest.raises(ValueError, match=what):
            tc.load(bad, ct.TILES)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        tc.load(bad, ct.TILES)


def test_tiles_shipped_for_this_gpu_model_are_read_after_the_users_and_before_the_table(tmp_path, monkeypatch):
    monkeypatch.setattr(tc, "SHIPPED_DIR", str(tmp_path))
    ship(tmp_path, device_kind(), GEMM1, {16.0: "pingpong_64x256"})
    ship(tmp_path, "Some Other GPU", GEMM2, {16.0: "coop_128x256"})
    assert ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn_act") == "pingpong_64x256"
    assert ct.pick_tile(16 * E, E, n=K, k=N // 2, kind="bf16_kn") == ct.heuristic_tile(16)  # another GPU's
    users = tmp_path / "users" / "tiles.json"
    users.parent.mkdir()
    cache = tc.TileCache(device_kind())
    cache.record(GEMM1, 16.0, "coop_128x128", {"coop_128x128": 0.5})
    cache.save(users)
    autotune.use(users)
    assert ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn_act") == "coop_128x128"  # the user's first
    cache.gemms[GEMM1] = ((256.0, "coop_128x128"),)
    cache.save(users)
    autotune.use(users)
    assert ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn_act") == "pingpong_64x256"  # the user's out of reach
    autotune.use(None)
    monkeypatch.setenv(tc.SHIPPED_ENV, "off")
    assert ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn_act") == ct.heuristic_tile(16)  # set aside


def test_a_fused_gemm_without_tuned_tiles_of_its_own_takes_its_plain_gemms(tmp_path, monkeypatch):
    """GEMM2 tuned while it wrote its rows (key "bf16_kn/...") keeps its tile when it scatters
    ("bf16_kn_scatter/...") until that form is tuned itself; another GEMM's tiles are not taken."""
    monkeypatch.setattr(tc, "SHIPPED_DIR", str(tmp_path))
    ship(tmp_path, device_kind(), GEMM2, {16.0: "pingpong_64x256"})
    assert ct.pick_tile(16 * E, E, n=K, k=N // 2, kind="bf16_kn_scatter") == "pingpong_64x256"
    assert ct.pick_tile(16 * E, E, n=K, k=N // 2, kind="bf16_scatter") == ct.heuristic_tile(16)  # not bf16_kn's
    users = tmp_path / "users.json"
    cache = tc.TileCache(device_kind())
    cache.record(tc.gemm_key("bf16_kn_scatter", E, K, N // 2), 16.0, "coop_128x128", {"coop_128x128": 0.5})
    cache.save(users)
    autotune.use(users)
    assert ct.pick_tile(16 * E, E, n=K, k=N // 2, kind="bf16_kn_scatter") == "coop_128x128"  # its own first
    assert ct.pick_tile(16 * E, E, n=K, k=N // 2, kind="bf16_kn") == "pingpong_64x256"


def test_on_an_h200_a_shipped_clustered_pick_runs_unclustered_below_1536_rows_per_expert(tmp_path, monkeypatch):
    """The 2x1 cluster rounds each expert's row tiles up to pairs. The shipped picks were tuned before
    the unclustered tile was built; the user's cache and the tuner's trials timed both and are kept."""
    h200 = "NVIDIA H200"
    monkeypatch.setattr(tc, "SHIPPED_DIR", str(tmp_path))
    monkeypatch.setattr(ct, "device_kind", lambda device=None: h200)
    ship(tmp_path, h200, GEMM1, {128.0: "coop_128x256", 2048.0: "coop_128x256"})
    assert ct.pick_tile(128 * E, E, n=N, k=K, kind="bf16_kn_act") == "coop_128x256_c1"
    assert ct.pick_tile(2048 * E, E, n=N, k=K, kind="bf16_kn_act") == "coop_128x256"
    with ct.tuning() as trial:
        ct.pick_tile(128 * E, E, n=N, k=K, kind="bf16_kn_act")
    assert trial.picks == [(GEMM1, 128.0, "coop_128x256_c1")]  # today's tile, as it runs
    with ct.tuning({GEMM1: "coop_128x256"}) as trial:
        ct.pick_tile(128 * E, E, n=N, k=K, kind="bf16_kn_act")
    assert trial.picks == [(GEMM1, 128.0, "coop_128x256")]  # a trial's tile, as named
    users = tmp_path / "users" / "tiles.json"
    users.parent.mkdir()
    cache = tc.TileCache(h200)
    cache.record(GEMM1, 128.0, "coop_128x256", {"coop_128x256": 0.5, "coop_128x256_c1": 0.6})
    cache.save(users)
    autotune.use(users)
    assert ct.pick_tile(128 * E, E, n=N, k=K, kind="bf16_kn_act") == "coop_128x256"


def test_a_shipped_192_row_pick_runs_only_where_enough_experts_pass_128_rows(tmp_path, monkeypatch):
    """Near 64 rows per expert both tiles multiply the same rows: below ROW_BLOCK_TILE_FROM_ROWS the
    point's fastest other tile, the pick it had before, runs. The user's cache is taken as tuned."""
    monkeypatch.setattr(tc, "SHIPPED_DIR", str(tmp_path))
    cache = tc.TileCache(device_kind())
    cache.record(GEMM1, 128.0, "coop_192x256", {"coop_192x256": 0.9, "pingpong_64x256": 1.0, "coop_128x256_c1": 1.1})
    cache.save(tmp_path / tc.shipped_file_name(device_kind()))
    picks = {r: ct.pick_tile(r * E, E, n=N, k=K, kind="bf16_kn_act") for r in (128, 124, 120, 96)}
    assert ct.ROW_BLOCK_TILE_FROM_ROWS == 124.0 and picks == {128: "coop_192x256", 124: "coop_192x256",
                                                              120: "pingpong_64x256", 96: "pingpong_64x256"}
    cache.save(tmp_path / "users.json")
    autotune.use(tmp_path / "users.json")
    assert ct.pick_tile(96 * E, E, n=N, k=K, kind="bf16_kn_act") == "coop_192x256"


def test_below_the_192_row_tiles_rows_the_runner_up_comes_from_the_nearest_cell_of_figures(tmp_path, monkeypatch):
    """A cell of figures measured where no tile is picked (120 rows per expert here) decides what a
    192-row pick runs as near it: the fastest other tile there, not at the pick's own point."""
    monkeypatch.setattr(tc, "SHIPPED_DIR", str(tmp_path))
    cache = tc.TileCache(device_kind())
    cache.record(GEMM1, 128.0, "coop_192x256", {"coop_192x256": 0.9, "pingpong_64x256": 1.0, "coop_128x256_c1": 1.1})
    cache.figures[GEMM1]["120"] = {"coop_128x256_c1": 1.0, "pingpong_64x256": 1.1}
    cache.save(tmp_path / tc.shipped_file_name(device_kind()))
    picks = {r: ct.pick_tile(r * E, E, n=N, k=K, kind="bf16_kn_act") for r in (128, 124, 120, 96)}
    assert picks == {128: "coop_192x256", 124: "coop_192x256", 120: "coop_128x256_c1", 96: "coop_128x256_c1"}
    assert tc.load(tmp_path / tc.shipped_file_name(device_kind()), ct.TILES).gemms[GEMM1] == ((128.0, "coop_192x256"),)


def test_a_malformed_or_doubled_shipped_cache_is_an_error_naming_it(tmp_path, monkeypatch):
    monkeypatch.setattr(tc, "SHIPPED_DIR", str(tmp_path))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json"):
        ct.pick_tile(16 * E, E, n=N, k=K, kind="bf16_kn_act")
    (tmp_path / "broken.json").unlink()
    ship(tmp_path, device_kind(), GEMM1, {16.0: "pingpong_64x256"})
    (tmp_path / "copy.json").write_text((tmp_path / tc.shipped_file_name(device_kind())).read_text())
    with pytest.raises(ValueError, match="two shipped tile caches"):
        tc.shipped_caches(ct.TILES, str(tmp_path))


@pytest.mark.parametrize("name", sorted(os.listdir(SHIPPED)) if os.path.isdir(SHIPPED) else [])
def test_every_shipped_cache_loads_names_built_tiles_and_its_gpu_model(name):
    cache = tc.load(os.path.join(SHIPPED, name), ct.TILES)
    assert name == tc.shipped_file_name(cache.device)
    assert cache.gemms, "a shipped cache holds tuned GEMMs"
    for key, points in cache.gemms.items():
        figures = cache.figures[key]
        for r, tile in points:
            assert tile in figures[f"{r:g}"], (key, r)
        for r, cell in figures.items():  # the picks' cells, and any that stand only for a runner-up
            assert cell and set(cell) <= set(ct.TILES) and all(ms > 0 for ms in cell.values()), (key, r)


def test_tiles_ship_for_the_hopper_gpus_the_bench_measures():
    assert {tc.shipped_file_name(d) for d in ("NVIDIA H100 80GB HBM3", "NVIDIA H200")} <= set(os.listdir(SHIPPED))
