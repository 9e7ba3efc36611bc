"""bench/side_by_side.py: a baseline's tree written from git, and the table of a change against it."""

import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def side_by_side(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import side_by_side

    return side_by_side


def _row(model, t, busy, **stages):
    return {"model": model, "T": t, "impl": "cutlass fp8", "busy": busy, "stages": stages}


def _write(folder, side, rnd, rows):
    with open(os.path.join(folder, f"{side}_{rnd}.json"), "w") as f:
        json.dump(rows, f)


def test_the_table_gives_medians_their_ratio_and_the_rounds_range(side_by_side, tmp_path):
    for rnd, (b, n) in enumerate([(100.0, 90.0), (110.0, 88.0), (105.0, 95.0)], start=1):
        _write(tmp_path, "base", rnd, [_row("Qwen3", 4096, b + 200, gemm1=200.0, gemm2=b, act=0.0)])
        _write(tmp_path, "new", rnd, [_row("Qwen3", 4096, n + 200, gemm1=200.0, gemm2=n, act=0.0)])
    lines = side_by_side.table(side_by_side.read_rounds(str(tmp_path)))
    gemm2 = next(line for line in lines if "| gemm2 |" in line)
    assert gemm2 == "| Qwen3 | 4096 | cutlass fp8 | gemm2 | 105.0 | 90.0 | 0.857 | 0.800 - 0.905 |"
    gemm1 = next(line for line in lines if "| gemm1 |" in line)
    assert "| 200.0 | 200.0 | 1.000 | 1.000 - 1.000 |" in gemm1
    assert not any("| act |" in line for line in lines), "a stage zero on both sides is left out"
    assert "3 round(s)" in lines[-1]


def test_the_loops_figures_per_layer_are_compared_where_the_rows_have_them(side_by_side, tmp_path):
    for rnd, (b, n) in enumerate([(414.0, 408.0), (413.8, 407.9)], start=1):
        base, new = _row("Qwen3", 4096, b, gemm2=161.0), _row("Qwen3", 4096, n, gemm2=156.8)
        base["loop"], new["loop"] = {"layers": 8, "busy": b, "span": b + 30, "gemm": b - 43, "joules": 0.532}, None
        if rnd == 2:
            new["loop"] = {"layers": 8, "busy": n, "span": n + 30, "gemm": n - 43, "joules": 0.518}
        _write(tmp_path, "base", rnd, [base])
        _write(tmp_path, "new", rnd, [new])
    lines = side_by_side.table(side_by_side.read_rounds(str(tmp_path)))
    loop = next(line for line in lines if "| loop busy |" in line)
    assert loop == "| Qwen3 | 4096 | cutlass fp8 | loop busy | 413.8 | 407.9 | 0.986 | 0.986 - 0.986 |"  # round 2 only
    assert any("| loop gemm |" in line for line in lines)
    energy = next(line for line in lines if "| loop mJ |" in line)  # the board's energy per layer
    assert energy == "| Qwen3 | 4096 | cutlass fp8 | loop mJ | 532.0 | 518.0 | 0.974 | 0.974 - 0.974 |"


def test_moe_benchs_table_is_compared_per_call_and_in_the_loop(side_by_side, tmp_path):
    def bench(per_call_ms, loop_ms):  # moe_bench --json: ms per call, and [per call, per layer] in the loop
        return {"title": "bf16: ...",
                "rows": [{"model": "Qwen3", "T": 16, "floor": 0.27, "cutlass": per_call_ms, "tokamax": 0.5}],
                "in_loop": [{"model": "Qwen3", "T": 16, "floor": 0.27, "layers": 8,
                             "cutlass": [per_call_ms, loop_ms], "tokamax": [0.5, None]}]}

    _write(tmp_path, "base", 1, bench(0.460, 0.2614))
    _write(tmp_path, "new", 1, bench(0.428, 0.2562))
    lines = side_by_side.table(side_by_side.read_rounds(str(tmp_path)))
    assert "| Qwen3 | 16 | cutlass | per call | 460.0 | 428.0 | 0.930 | 0.930 - 0.930 |" in lines
    assert "| Qwen3 | 16 | cutlass | in loop | 261.4 | 256.2 | 0.980 | 0.980 - 0.980 |" in lines
    tokamax = [line for line in lines if "| tokamax |" in line]
    assert tokamax == ["| Qwen3 | 16 | tokamax | per call | 500.0 | 500.0 | 1.000 | 1.000 - 1.000 |"], \
        "an implementation the loop did not time is compared per call only"


def test_rounds_and_rows_on_one_side_only_are_left_out(side_by_side, tmp_path):
    _write(tmp_path, "base", 1, [_row("Qwen3", 64, 10.0, gemm2=5.0), _row("Qwen3", 4096, 100.0, gemm2=50.0)])
    _write(tmp_path, "new", 1, [_row("Qwen3", 4096, 80.0, gemm2=40.0)])
    _write(tmp_path, "base", 2, [_row("Qwen3", 4096, 999.0, gemm2=999.0)])  # its new run never wrote
    lines = side_by_side.table(side_by_side.read_rounds(str(tmp_path)))
    assert not any("| 64 |" in line for line in lines)
    assert "| Qwen3 | 4096 | cutlass fp8 | busy | 100.0 | 80.0 | 0.800 |" in lines[2]
    assert "1 round(s)" in lines[-1]


def test_no_paired_round_is_an_error_not_an_empty_table(side_by_side, tmp_path):
    _write(tmp_path, "base", 1, [_row("Qwen3", 4096, 100.0)])
    with pytest.raises(ValueError, match="no round has both"):
        side_by_side.table(side_by_side.read_rounds(str(tmp_path)))
    assert side_by_side.main(["table", str(tmp_path)]) == 1


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_prepare_writes_the_revisions_tree_and_names_its_commit(side_by_side, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "kernel.cu").write_text("old\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "old"], check=True)
    old = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (repo / "kernel.cu").write_text("new\n")
    subprocess.run([*git, "commit", "-q", "-am", "new"], check=True)

    dest = tmp_path / "base"
    dest.mkdir()
    (dest / "stale").write_text("from an earlier prepare")
    assert side_by_side.prepare("HEAD~1", str(dest), repo=str(repo)) == old
    assert (dest / "kernel.cu").read_text() == "old\n"
    assert (dest / "BASE_COMMIT").read_text().strip() == old
    assert not (dest / "stale").exists()
    with pytest.raises(subprocess.CalledProcessError):
        side_by_side.prepare("no-such-rev", str(dest), repo=str(repo))


def test_the_device_script_refuses_a_command_file_the_base_lacks(tmp_path):
    """bench/side_by_side.sh stops before any build when the bench command names a file of the
    working tree that .base/ does not hold: the base's runs could only fail."""
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    (tree / ".base" / "bench").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "bench", "side_by_side.sh"), tree / "bench")
    (tree / "bench" / "new_probe.py").write_text("")
    run = subprocess.run(["bash", "bench/side_by_side.sh", "1", "--", "python3", "bench/new_probe.py"], cwd=tree,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "bench/new_probe.py is not in .base/" in run.stderr


def test_the_device_script_reuses_builds_only_where_both_are_there(tmp_path):
    """REUSE=1 runs a second bench command in the last command's two builds; where the machine went
    back and they are gone, it says so and stops, rather than timing nothing."""
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    (tree / ".base").mkdir()
    shutil.copy(os.path.join(ROOT, "bench", "side_by_side.sh"), tree / "bench")
    work = tmp_path / "work"
    (work / "base" / "site" / "jax_moe").mkdir(parents=True)  # the base's build, but not the new one's
    env = {**os.environ, "REUSE": "1", "WORK": str(work), "OUT": str(tmp_path / "out")}
    run = subprocess.run(["bash", "bench/side_by_side.sh", "1", "--", "true"], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and f"{work}/new holds no build" in run.stderr
    assert (work / "base" / "site" / "jax_moe").is_dir(), "a refused reuse deletes nothing"
