"""bench/tune_models.py tunes the tiles of a list of popular MoE layers, each in its own autotuner
process, into one cache file: this GPU model's shipped file by default."""

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def tune_models(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import tune_models

    return tune_models


def test_tune_models_tunes_each_layer_in_its_own_process_into_one_file(tune_models, monkeypatch, capsys):
    calls = []

    def call(cmd):
        calls.append(cmd)
        return 1 if cmd[cmd.index("--shape") + 1] == "16" else 0  # DBRX's 16 experts fail here

    monkeypatch.setattr(tune_models.subprocess, "call", call)
    assert tune_models.main(["--models", "qwen3-235b", "dbrx", "--out", "t.json"]) == 1
    assert [c[c.index("--shape") + 1:c.index("--shape") + 5] for c in calls] == [
        ["128", "4096", "1536", "8"], ["16", "6144", "10752", "4"]]
    assert all(c[1:3] == ["-m", "jax_moe.autotune"] and c[c.index("--out") + 1] == "t.json" for c in calls)
    # the bench's token counts, so that no shipped tile is carried past twice its tuned rows per expert
    assert all(c[c.index("--tokens") + 1:c.index("--out")] == ["16", "64", "256", "1024", "4096", "16384"]
               for c in calls)
    assert "failed: dbrx" in capsys.readouterr().out


def test_tune_models_hands_finalize_to_each_tuner(tune_models, monkeypatch):
    calls = []
    monkeypatch.setattr(tune_models.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert tune_models.main(["--models", "olmoe", "--finalize", "scatter", "--out", "t.json"]) == 0
    assert calls[0][-2:] == ["--finalize", "scatter"]
    assert tune_models.main(["--models", "olmoe", "--out", "t.json"]) == 0
    assert "--finalize" not in calls[1]


def test_tune_models_hands_rounds_min_gain_and_tiles_to_each_tuner_only_when_given(tune_models, monkeypatch):
    calls = []
    monkeypatch.setattr(tune_models.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert tune_models.main(["--models", "olmoe", "--rounds", "3", "--min-gain", "0.01", "--tiles", "coop_192x256",
                             "--out", "t.json"]) == 0
    assert calls[0][-6:] == ["--min-gain", "0.01", "--rounds", "3", "--tiles", "coop_192x256"]
    assert tune_models.main(["--models", "olmoe", "--out", "t.json"]) == 0
    assert not {"--rounds", "--min-gain", "--tiles"} & set(calls[1])


def test_tune_models_says_how_to_confirm_the_bench_models_tiles_in_a_loop(tune_models, monkeypatch, capsys):
    monkeypatch.setattr(tune_models.subprocess, "call", lambda cmd: 0)
    assert tune_models.main(["--models", "qwen3", "olmoe", "--scheme", "fp8", "--tokens", "1024", "4096",
                             "--out", "t.json"]) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if "tile_rounds.py" in line]
    assert hint == ["## confirm them layer after layer: python3 bench/tile_rounds.py --caches shipped t.json "
                    "--rounds 2 -- python3 bench/stage_breakdown.py --scheme fp8 --no-peer --models qwen3 "
                    "--tokens 1024 4096 --loop 8"]
    assert tune_models.main(["--models", "olmoe", "--out", "t.json"]) == 0  # stage_breakdown has no such model
    assert "tile_rounds.py" not in capsys.readouterr().out


def test_tune_models_leaves_the_bench_models_to_the_measured_table_on_its_gpu_model(tune_models, monkeypatch):
    from jax_moe import device
    from jax_moe.backends.cutlass_tiles import MEASURED_ON

    calls = []
    monkeypatch.setattr(tune_models.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    for gpu, bench_models_tuned in ((MEASURED_ON, False), ("NVIDIA H200", True)):
        calls.clear()
        monkeypatch.setattr(device, "device_kind", lambda d=None, gpu=gpu: gpu)
        assert tune_models.main([]) == 0
        shapes = {tuple(c[c.index("--shape") + 1:c.index("--shape") + 5]) for c in calls}
        assert (("128", "2048", "768", "8") in shapes) == bench_models_tuned  # Qwen3-30B-A3B
        assert len(calls) == len(tune_models.LAYERS) - (0 if bench_models_tuned else 4)


def test_tiles_ship_on_an_h200_for_every_layer_tune_models_names(tune_models):
    from jax_moe.backends import cutlass_tile_cache as tc
    from jax_moe.backends.cutlass_tiles import TILES

    cache = tc.load(os.path.join(tc.SHIPPED_DIR, tc.shipped_file_name("NVIDIA H200")), TILES)
    for name, (e, h, i, k) in tune_models.LAYERS.items():
        assert tc.gemm_key("bf16_kn", e, h, i) in cache.gemms, name  # GEMM2: [T*k, I] @ [E, I, H]


def test_tune_models_writes_this_gpu_models_shipped_file_by_default(tune_models, monkeypatch, capsys):
    from jax_moe import device
    from jax_moe.backends import cutlass_tile_cache as tc

    calls = []
    monkeypatch.setattr(tune_models.subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    monkeypatch.setattr(device, "device_kind", lambda d=None: "NVIDIA H200")
    assert tune_models.main(["--models", "olmoe"]) == 0
    assert calls[0][calls[0].index("--out") + 1] == os.path.join(tc.SHIPPED_DIR, "nvidia_h200.json")
    assert "nvidia_h200.json" in capsys.readouterr().out
