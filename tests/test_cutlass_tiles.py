"""The cutlass backend's tile choice (jax_moe/backends/cutlass_tiles.py): the override, the measured
table, the heuristic, and the bench tool that writes the table. No GPU needed."""

from __future__ import annotations

import shutil

import pytest

from bench import tile_sweep
from jax_moe.backends import cutlass_tile_cache as tile_cache
from jax_moe.backends import cutlass_tiles as ct

RATES = (0.03125, 0.25, 1, 4, 16, 32, 63, 64, 100, 127, 128, 512, 4096)
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


@pytest.fixture(autouse=True)
def _no_override(monkeypatch):
    monkeypatch.delenv(ct.TILE_ENV, raising=False)
    monkeypatch.setattr(ct, "device_kind", lambda device=None: H100)  # the GPU model the table was measured on


def test_every_tile_named_anywhere_is_built():
    named = {ct.heuristic_tile(r, kind, gpu) for r in RATES for kind in ("bf16", "fp8") for gpu in (H100, H200)}
    named |= {tile for points in ct.MEASURED.values() for _, tile in points}
    assert named <= set(ct.TILES)


@pytest.mark.parametrize("kind", ["bf16_kn_act", "bf16_act", "fp8_act"])
def test_gemm1_with_its_activation_has_every_tile_but_the_scatter_only_one(kind):
    assert ct.tiles_for(kind) == tuple(t for t in ct.TILES if t != "pingpong_192x128")


@pytest.mark.parametrize("kind", ["bf16_scatter", "bf16_kn_scatter", "fp8_scatter"])
def test_gemm2_with_its_un_permute_has_every_tile_but_the_act_only_one(kind):
    assert ct.tiles_for(kind) == tuple(t for t in ct.TILES if t != "coop_192x256")


@pytest.mark.parametrize("kind", ["bf16", "bf16_kn", "fp8"])
def test_the_plain_gemms_run_the_one_kind_tiles_as_another_so_they_are_not_tiles_of_their_own(kind):
    assert ct.ONE_KIND_TILES == {"coop_192x256": "_act", "pingpong_192x128": "_scatter"}
    assert ct.tiles_for(kind) == tuple(t for t in ct.TILES if t not in ct.ONE_KIND_TILES)


@pytest.fixture
def h200_shipped_tiles(monkeypatch):
    """An H200 reading the package's own tile file: no user's cache, the shipped folder itself."""
    monkeypatch.delenv(tile_cache.CACHE_ENV, raising=False)
    monkeypatch.delenv(tile_cache.SHIPPED_ENV, raising=False)
    monkeypatch.setattr(ct, "device_kind", lambda device=None: H200)


@pytest.mark.parametrize("kind, rows", [("bf16_kn_scatter", (96, 128, 160)),
                                        ("fp8_scatter", (96, 128, 160, 256, 352, 512))])
def test_the_h200s_shipped_tiles_run_gpt_oss_120bs_gemm2_on_the_192_row_pingpong_tile_from_64_rows(kind, rows,
                                                                                                 h200_shipped_tiles):
    """GPT-OSS-120B's GEMM2 (E=128, N=K=2880) with its un-permute fused, on the package's own H200
    file: the 192-row pingpong tile from the midpoint of its 32- and 128-row points (64 rows per
    expert) on. In bf16 it stops at the midpoint with the 256-row point (181 rows); FP8, whose
    epilogue also scales every row and column, keeps it through the 512-row point. GEMM1 keeps the
    cooperative 192-row tile, and the GEMM without the un-permute cannot run the pingpong one."""
    e = 128
    probes = (48, 96, 128, 160, 256, 352, 512)
    picks = {r: ct.pick_tile(r * e, e, n=2880, k=2880, kind=kind) == "pingpong_192x128" for r in probes}
    assert picks == {r: r in rows for r in probes}
    assert "pingpong_192x128" not in ct.tiles_for("bf16_kn")
    gemm1 = {"bf16_kn_scatter": "bf16_kn_act", "fp8_scatter": "fp8_act"}[kind]
    assert ct.pick_tile(128 * e, e, n=5760, k=2880, kind=gemm1) == "coop_192x256"  # GEMM1 keeps its tile


@pytest.mark.parametrize("kind, rows", [("bf16_kn_act", (128, 512, 1024)), ("fp8_act", (128, 256, 512, 1024))])
def test_the_h200s_shipped_tiles_run_gpt_oss_120bs_gemm1_on_the_192_row_tile_from_128_rows(kind, rows,
                                                                                          h200_shipped_tiles):
    """GPT-OSS-120B's GEMM1 with its activation (E=128, N=5760, K=2880) on the package's own H200
    file: the cooperative 192-row tile at its points of 128 and 512 rows per expert (and past the
    last), in FP8 at 256 as well; bf16 at 256 keeps the unclustered 128x256 tile."""
    e = 128
    probes = (128, 256, 512, 1024)
    picks = {r: ct.pick_tile(r * e, e, n=5760, k=2880, kind=kind) for r in probes}
    assert picks == {r: "coop_192x256" if r in rows else "coop_128x256_c1" for r in probes}


@pytest.mark.parametrize("r, tile", [(0.05, "pingpong_64x128"), (63, "pingpong_64x128"), (64, "coop_128x128"),
                                     (127, "coop_128x128"), (128, "coop_128x256"), (4096, "coop_128x256")])
def test_bf16_heuristic_by_rows_per_expert(r, tile):
    assert ct.heuristic_tile(r) == tile
    assert ct.heuristic_tile(r, "fp8") == tile


@pytest.mark.parametrize("r, tile", [(63, "pingpong_64x128"), (64, "coop_128x128"), (127, "coop_128x128"),
                                     (128, "coop_128x256_c1"), (1535, "coop_128x256_c1"), (1536, "coop_128x256"),
                                     (4096, "coop_128x256")])
def test_an_h200_runs_the_wide_tile_without_its_cluster_below_1536_rows_per_expert(r, tile, monkeypatch):
    """The 2x1 cluster rounds each expert's row tiles up to pairs: most costly at few rows per expert."""
    assert ct.heuristic_tile(r, "fp8", H200) == tile
    monkeypatch.setattr(ct, "device_kind", lambda device=None: H200)
    assert ct.pick_tile(int(r * 16), 16, n=64, k=32, kind="fp8") == tile  # a shape in no table
    assert ct.heuristic_tile(r, "fp8", H100) == ("coop_128x256" if r >= 128 else tile)  # not measured on an H100


def test_a_tables_clustered_pick_runs_unclustered_on_an_h200_only(monkeypatch):
    monkeypatch.setitem(ct.MEASURED, ("fp8", 16, 256, 512), ((256.0, "coop_128x256"),))
    assert ct.pick_tile(16 * 256, 16, n=256, k=512, kind="fp8") == "coop_128x256"  # an H100: as measured
    monkeypatch.setattr(ct, "device_kind", lambda device=None: H200)
    assert ct.pick_tile(16 * 256, 16, n=256, k=512, kind="fp8") == "coop_128x256_c1"
    assert ct.pick_tile(16 * 2048, 16, n=256, k=512, kind="fp8") == "coop_128x256"  # few pairs padded


@pytest.mark.parametrize("r, tile", [(63, "pingpong_64x128"), (64, "pingpong_64x256"), (128, "pingpong_64x256"),
                                     (384, "pingpong_64x256"), (448, "coop_128x256_c1"), (4096, "coop_128x256")])
def test_an_h200_takes_the_wide_pingpong_tile_for_bf16_from_64_to_448_rows_per_expert(r, tile, monkeypatch):
    for kind in ("bf16", "bf16_kn", "bf16_kn_act"):
        assert ct.heuristic_tile(r, kind, H200) == tile
    monkeypatch.setattr(ct, "device_kind", lambda device=None: H200)
    assert ct.pick_tile(int(r * 16), 16, n=64, k=32, kind="bf16_kn") == tile  # a shape in no table
    assert ct.pick_tile(int(r * 16), 16) == tile


@pytest.mark.parametrize("r", RATES)
def test_both_kinds_share_the_heuristic(r):
    """FP8 accumulates without a second register accumulator, so it takes the wide tile as bf16 does."""
    rows = max(1, int(r * 16))  # a shape the table does not hold
    assert ct.pick_tile(rows, 16, n=64, k=32, kind="fp8") == ct.pick_tile(rows, 16, n=64, k=32, kind="bf16")


def test_measured_table_is_sorted_and_positive():
    for key, points in ct.MEASURED.items():
        kind, e, n, k = key
        assert kind in ("bf16", "fp8", "bf16_kn", "bf16_act", "bf16_kn_act", "fp8_act") and min(e, n, k) > 0, key
        rates = [r for r, _ in points]
        assert rates == sorted(rates) and rates[0] > 0, key


def test_a_measured_shape_takes_the_nearest_point_on_a_log_scale(monkeypatch):
    key = ("bf16", 16, 256, 512)
    monkeypatch.setitem(ct.MEASURED, key, ((1.0, "coop_128x128"), (64.0, "pingpong_64x128")))
    assert ct.pick_tile(16 * 7, 16, n=256, k=512) == "coop_128x128"     # 7 rows: nearer 1 than 64 (log2)
    assert ct.pick_tile(16 * 9, 16, n=256, k=512) == "pingpong_64x128"  # 9 rows: nearer 64
    assert ct.pick_tile(16 * 4096, 16, n=256, k=512) == "pingpong_64x128"  # past the last point: the last
    assert ct.pick_tile(16 * 4096, 16) == "coop_128x256"  # no N, K: the heuristic
    assert ct.pick_tile(16 * 100, 16, n=256, k=512, kind="fp8") == "coop_128x128"  # another kind: heuristic


def test_gemm1_with_its_activation_takes_its_own_rows_else_the_plain_kinds(monkeypatch):
    """``kind + "_act"``: GEMM1 and the activation timed as one unit (a fused pingpong tile can beat
    a cooperative tile that is faster for the GEMM alone); where the table has no such row, the
    plain kind's, then the heuristic."""
    monkeypatch.setitem(ct.MEASURED, ("bf16_kn", 16, 256, 512), ((4.0, "coop_128x128"),))
    assert ct.pick_tile(16 * 4, 16, n=256, k=512, kind="bf16_kn_act") == "coop_128x128"
    monkeypatch.setitem(ct.MEASURED, ("bf16_kn_act", 16, 256, 512), ((4.0, "pingpong_64x256"),))
    assert ct.pick_tile(16 * 4, 16, n=256, k=512, kind="bf16_kn_act") == "pingpong_64x256"
    assert ct.pick_tile(16 * 4, 16, n=256, k=512, kind="bf16_kn") == "coop_128x128"
    assert ct.pick_tile(16 * 4, 16, n=64, k=512, kind="bf16_kn_act") == ct.heuristic_tile(4)


def test_the_scatter_gemm_takes_its_own_rows_else_gemm2s(monkeypatch):
    """``kind + "_scatter"``: GEMM2 with the un-permute in its epilogue; its own rows where a table or
    tile cache has them (the epilogue's cost moves the best tile), else the plain GEMM2's."""
    monkeypatch.setitem(ct.MEASURED, ("fp8", 16, 256, 512), ((4.0, "pingpong_64x128_k256"),))
    assert ct.pick_tile(16 * 4, 16, n=256, k=512, kind="fp8_scatter") == "pingpong_64x128_k256"
    monkeypatch.setitem(ct.MEASURED, ("fp8_scatter", 16, 256, 512), ((4.0, "coop_128x256"),))
    assert ct.pick_tile(16 * 4, 16, n=256, k=512, kind="fp8_scatter") == "coop_128x256"
    assert ct.pick_tile(16 * 4, 16, n=256, k=512, kind="fp8") == "pingpong_64x128_k256"


def test_the_override_wins_and_is_checked(monkeypatch):
    monkeypatch.setenv(ct.TILE_ENV, "coop_128x128")
    assert ct.pick_tile(1, 128, n=2048, k=768) == "coop_128x128"
    monkeypatch.setenv(ct.TILE_ENV, "huge")
    with pytest.raises(ValueError, match=ct.TILE_ENV):
        ct.pick_tile(1, 128)


def test_the_table_records_a_tile_only_where_it_beats_the_heuristic():
    figures = {
        "device": "H100",
        "bf16/8/64/32": {"4.0": {"pingpong_64x128": 1.00, "coop_128x128": 0.99, "coop_128x256": 2.0},  # 1%: noise
                         "256.0": {"pingpong_64x128": 3.0, "coop_128x128": 1.0, "coop_128x256": 1.2}},  # 20%: kept
        "fp8/8/64/32": {"4.0": {"pingpong_64x128": 1.0, "coop_128x128": 1.5},
                        "256.0": {"pingpong_64x128": 1.2, "coop_128x256": 1.0}},  # the heuristic is right
    }
    table = tile_sweep.table_from_figures(figures)
    assert table == {("bf16", 8, 64, 32): ((4.0, "pingpong_64x128"), (256.0, "coop_128x128"))}


def test_update_table_rewrites_only_the_marked_lines(tmp_path):
    path = tmp_path / "cutlass_tiles.py"
    shutil.copy(ct.__file__, path)
    before = path.read_text()
    tile_sweep.update_table({("fp8", 4, 16, 32): ((2.0, "coop_128x128"),)}, "Some GPU", str(path))
    after = path.read_text()
    ns: dict = {}
    block = after[after.index("# measured table: begin"):after.index("# measured table: end")]
    exec(block, ns)  # noqa: S102  (the table is plain literals)
    assert ns["MEASURED"] == {("fp8", 4, 16, 32): ((2.0, "coop_128x128"),)}
    assert ns["MEASURED_ON"] == "Some GPU"
    head = before[:before.index("# measured table: begin")]
    tail = before[before.index("# measured table: end"):]
    assert after.startswith(head) and after.endswith(tail)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_the_act_sweep_times_every_tile_and_records_the_kinds_act_rows(kind, capsys):
    """``tile_sweep --act`` on the tiny model (the kernels' jnp references on CPU): GEMM1 alone, then
    the activation kernel, then with the activation in its epilogue, per tile; the figures land
    under ``"{kind}_act/E/2I/H"``, the rows the forward's GEMM1 pick reads."""
    from bench import moe_bench

    m = moe_bench.MODELS["tiny"]
    results: dict = {}
    tile_sweep.act_model(m, [16], kind, results, tile_sweep.TIMERS["call"])
    key = f"{kind}_act/{m.e}/{2 * m.i}/{m.h}"
    assert list(results) == [key] and list(results[key]) == [str(16 * m.k / m.e)]
    assert sorted(results[key][str(16 * m.k / m.e)]) == sorted(ct.TILES)
    assert all(ms > 0 for ms in results[key][str(16 * m.k / m.e)].values())
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {m.name} | 16 |")]
    assert len(rows) == len(ct.TILES)
    table = tile_sweep.table_from_figures(results)
    assert list(table) == [(f"{kind}_act", m.e, 2 * m.i, m.h)]  # act rows are kept even where the heuristic wins
