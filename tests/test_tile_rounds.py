"""bench/tile_rounds.py: two tiles of one grouped GEMM timed in alternating rounds, each run reading
a one-point tile cache, and the rounds' table."""

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
