"""bench/tile_rounds.py: two tiles of one grouped GEMM (each run reading a one-point tile cache), or
two whole tile caches, timed in alternating rounds, and the rounds' table."""

import json
import os

import pytest

from jax_moe.backends import cutlass_tile_cache as tc
from jax_moe.backends import cutlass_tiles as ct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GEMM = "fp8_scatter/128/2048/768"


@pytest.fixture
def tile_rounds(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import tile_rounds

    return tile_rounds


def fake_bench(gemm2_us: dict, runs: list):
    """A bench command that reads its tile cache as the backend would (the point for GEMM at 256
    rows per expert) and writes one stage_breakdown row whose GEMM2 takes that tile's time."""

    def run(cmd, env, timeout, check):
        tile = tc.load(env[tc.CACHE_ENV], ct.TILES).tile_for(GEMM, 256.0)
        runs.append(tile)
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump([{"model": "Qwen3-30B-A3B", "T": 4096, "impl": "cutlass fp8", "busy": 250 + gemm2_us[tile],
                        "stages": {"gemm2": gemm2_us[tile]}}], f)

    return run


def test_each_round_runs_the_two_tiles_in_turn_and_the_table_compares_them(tile_rounds, tmp_path):
    runs = []
    bench = fake_bench({"coop_128x256": 161.0, "pingpong_64x256": 156.8}, runs)
    lines = tile_rounds.run_rounds(GEMM, 256, ["coop_128x256", "pingpong_64x256"], 3, ["bench"], str(tmp_path),
                                   "NVIDIA H200", runner=bench)
    assert runs == ["coop_128x256", "pingpong_64x256"] * 3
    assert "| Qwen3-30B-A3B | 4096 | cutlass fp8 | gemm2 | 161.0 | 156.8 | 0.974 | 0.974 - 0.974 |" in lines
    assert "3 round(s); each round ran coop_128x256, then pingpong_64x256" in lines[-1]
    cache = tc.load(tmp_path / "tiles_new.json", ct.TILES)
    assert cache.device == "NVIDIA H200" and cache.gemms == {GEMM: ((256.0, "pingpong_64x256"),)}


def test_round_files_of_an_earlier_run_in_the_folder_are_not_read(tile_rounds, tmp_path):
    """Three rounds of one pair of tiles, then two of another in the same folder: the second table
    has the second run's two rounds only."""
    runs = []
    bench = fake_bench({"coop_128x256": 161.0, "pingpong_64x256": 156.8, "coop_128x128": 170.0}, runs)
    tile_rounds.run_rounds(GEMM, 256, ["coop_128x256", "pingpong_64x256"], 3, ["bench"], str(tmp_path), "H",
                           runner=bench)
    lines = tile_rounds.run_rounds(GEMM, 256, ["coop_128x256", "coop_128x128"], 2, ["bench"], str(tmp_path), "H",
                                   runner=bench)
    assert "| Qwen3-30B-A3B | 4096 | cutlass fp8 | gemm2 | 161.0 | 170.0 | 1.056 | 1.056 - 1.056 |" in lines
    assert lines[-1].lstrip().startswith("2 round(s)")
    assert sorted(os.listdir(tmp_path)) == ["base_1.json", "base_2.json", "new_1.json", "new_2.json",
                                            "tiles_base.json", "tiles_new.json"]


def test_what_it_cannot_compare_is_refused_before_any_run(tile_rounds, tmp_path):
    runs = []
    bench = fake_bench({}, runs)
    with pytest.raises(ValueError, match="two different tiles"):
        tile_rounds.run_rounds(GEMM, 256, ["coop_128x256", "coop_128x256"], 3, ["b"], str(tmp_path), "H", runner=bench)
    with pytest.raises(ValueError, match="kind/E/N/K"):
        tile_rounds.run_rounds("fp8_scatter/128", 256, ["coop_128x256", "pingpong_64x256"], 3, ["b"], str(tmp_path),
                               "H", runner=bench)
    assert runs == []
    assert tile_rounds.main(["fp8_scatter/128/2048/768", "256", "coop_128x256", "pingpong_64x256"]) == 2  # no --


def test_a_run_past_its_timeout_leaves_its_round_out(tile_rounds, tmp_path):
    import subprocess

    runs = []
    bench = fake_bench({"coop_128x256": 161.0, "pingpong_64x256": 156.8}, runs)

    def flaky(cmd, env, timeout, check):
        if len(runs) == 3:  # round 2's second tile
            runs.append("timed out")
            raise subprocess.TimeoutExpired(cmd, timeout)
        bench(cmd, env, timeout, check)

    lines = tile_rounds.run_rounds(GEMM, 256, ["coop_128x256", "pingpong_64x256"], 3, ["bench"], str(tmp_path),
                                   "NVIDIA H200", runner=flaky)
    assert len(runs) == 6 and lines[-1].lstrip().startswith("2 round(s)")


def cache_file(path, device: str, tile: str) -> str:
    cache = tc.TileCache(device)
    cache.record(GEMM, 256, tile, {})
    cache.save(path)
    return str(path)


def test_two_whole_caches_run_in_turn_and_shipped_names_the_shipped_tiles_alone(tile_rounds, tmp_path, monkeypatch):
    monkeypatch.setenv(tc.CACHE_ENV, "/somewhere/else.json")  # the caller's own cache is never read
    seen = []

    def bench(cmd, env, timeout, check):
        path = env.get(tc.CACHE_ENV)
        seen.append(path)
        gemm2 = 161.0 if path is None else 156.8  # the shipped tiles, then the tuned file
        with open(cmd[cmd.index("--json") + 1], "w") as f:
            json.dump([{"model": "Qwen3-30B-A3B", "T": 4096, "impl": "cutlass fp8", "busy": 250 + gemm2,
                        "stages": {"gemm2": gemm2}}], f)

    tuned = cache_file(tmp_path / "tuned.json", "NVIDIA H200", "pingpong_64x256")
    lines = tile_rounds.run_caches(["shipped", tuned], 2, ["bench"], str(tmp_path / "rounds"), "NVIDIA H200",
                                   runner=bench)
    assert seen == [None, tuned] * 2
    assert "| Qwen3-30B-A3B | 4096 | cutlass fp8 | gemm2 | 161.0 | 156.8 | 0.974 | 0.974 - 0.974 |" in lines
    assert "each round ran the shipped tiles, then tuned.json" in lines[-1]


def test_a_cache_that_would_not_be_read_is_refused_before_any_run(tile_rounds, tmp_path):
    runs = []
    bench = fake_bench({}, runs)
    other = cache_file(tmp_path / "h100.json", "NVIDIA H100 80GB HBM3", "pingpong_64x256")
    with pytest.raises(ValueError, match="holds tiles of NVIDIA H100 80GB HBM3, not this NVIDIA H200"):
        tile_rounds.run_caches(["shipped", other], 2, ["b"], str(tmp_path), "NVIDIA H200", runner=bench)
    with pytest.raises(ValueError, match="missing.json"):
        tile_rounds.run_caches(["shipped", str(tmp_path / "missing.json")], 2, ["b"], str(tmp_path), "NVIDIA H200",
                               runner=bench)
    with pytest.raises(ValueError, match="two different tile caches"):
        tile_rounds.run_caches(["shipped", "shipped"], 2, ["b"], str(tmp_path), "NVIDIA H200", runner=bench)
    assert runs == []


def test_the_command_line_takes_one_form_or_the_other(tile_rounds, capsys):
    cmd = ["--", "bench"]
    for argv in (["--caches", "shipped", "t.json", GEMM, "256", "coop_128x256", "pingpong_64x256"],  # both
                 [GEMM, "256", "coop_128x256"],  # a tile short
                 [GEMM, "many", "coop_128x256", "pingpong_64x256"],  # rows not a number
                 [GEMM, "256", "coop_128x256", "no_such_tile"]):
        with pytest.raises(SystemExit) as exit_:
            tile_rounds.main(argv + cmd)
        assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "not both" in err and "GEMM ROWS TILE TILE" in err and "must be a number" in err and "no_such_tile" in err
