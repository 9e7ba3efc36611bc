"""bench/moe_bench.py runs every scheme it offers (on CPU: the tiny demo model, pure JAX)."""

import json
import os
import time

import jax
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def moe_bench(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import moe_bench

    return moe_bench


def test_every_scheme_has_its_weight_width_and_math(moe_bench):
    """Weight bytes include the scales; FP8 products count at twice the bf16 peak."""
    assert moe_bench.SCHEMES["bf16"] == moe_bench.SCHEMES["f16"] == 2
    assert moe_bench.SCHEMES["fp8_block"] == pytest.approx(1 + 4 / 128**2)
    assert moe_bench.SCHEMES["w4a8"] == pytest.approx(0.5 + 4 / 128)
    m = moe_bench.MODELS["tiny"]
    _, _, bf16_flops = moe_bench.roofline(m, 4096, 1e12, 1e12, "bf16")
    floor_bf16, _, _ = moe_bench.roofline(m, 4096, 1e30, 1e12, "bf16")
    for scheme in moe_bench.FP8_MATH:
        floor, _, flops = moe_bench.roofline(m, 4096, 1e30, 1e12, scheme)
        assert flops == bf16_flops and floor == pytest.approx(floor_bf16 / 2)


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU demo")
@pytest.mark.parametrize("scheme", [s if s == "bf16" else pytest.param(s, marks=pytest.mark.slow)
                                    for s in ("bf16", "f16", "fp8", "fp8_block", "mxfp4", "w4a8")])
def test_each_scheme_runs_and_prints_a_row_per_token_count(moe_bench, scheme, capsys):
    assert scheme in moe_bench.SCHEMES
    moe_bench.main(["--scheme", scheme, "--tokens", "1", "5"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert [r.split(" | ")[1] for r in rows] == ["1", "5"]
    for r in rows:  # the xla column is a time, never n/a
        assert float(r.split(" | ")[2]) > 0


@pytest.mark.parametrize("model", [pytest.param("tiny", marks=pytest.mark.slow), "tiny_mxfp4"])
def test_load_layer_writes_loads_and_matches_the_format_reference(monkeypatch, model, capsys):
    """bench/load_layer.py: a synthetic checkpoint in the release's on-disk form (DeepSeek-V3 FP8
    blocks + shared expert, GPT-OSS MXFP4) loads, runs, and matches its float32 reference."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import load_layer

    assert load_layer.main(["--model", model, "--tokens", "3"]) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU demo")
def test_in_loop_table_and_no_tokamax_column_on_cpu(moe_bench, capsys):
    """--in-loop adds a per-call / per-layer row per T; tokamax (absent on CPU) leaves no column."""
    moe_bench.main(["--impls", "xla", "tokamax", "--tokens", "2", "--in-loop", "1", "--layers", "2"])
    out = capsys.readouterr().out
    assert "tokamax: not run" in out
    assert not any("tokamax" in line for line in out.splitlines() if line.startswith("| model"))
    loop = [line for line in out.splitlines() if line.startswith("| tiny") and " / " in line]
    assert len(loop) == 1
    call, layer = (float(v) for v in loop[0].split(" | ")[2].split(" / "))
    assert call > 0 and layer > 0


def test_repeated_calls_in_one_loop_each_read_the_next_set_of_the_varying_argument(moe_bench):
    """bench.in_loop.repeated_ms: call n of the loop takes argument ``vary`` from set n % sets and
    the others from the first set; the figure is per call."""
    import jax.numpy as jnp

    from bench import in_loop

    seen = []

    def fn(a, offsets):
        jax.debug.callback(lambda a, o: seen.append((float(a[0]), int(o[0]))), a, offsets)
        return a * offsets[0]

    def timer(loop, sets):  # one run of the loop, said to take 2 ms
        jax.block_until_ready(loop(*sets[0]))
        return 2.0

    inputs = [(jnp.full((4,), 1.0 + s), jnp.full((3,), 10 * s, jnp.int32)) for s in range(3)]
    ms = in_loop.repeated_ms(fn, inputs, 1, 5, timer)
    assert ms == pytest.approx(2.0 / 5)
    assert seen == [(1.0, 0), (1.0, 10), (1.0, 20), (1.0, 0), (1.0, 10)]


def test_rows_name_the_best_jax_moe_and_its_speedup_over_tokamax(moe_bench):
    """Peers and baselines are never "best"; the tokamax column is tokamax's time over the best."""
    names = ["xla", "ragged_dot", "cutlass", "tokamax"]
    row = {"model": "m", "T": 4, "floor": 0.5, "xla": 2.0, "ragged_dot": 0.1, "cutlass": 1.0, "tokamax": 3.0}
    cells = moe_bench.format_row(row, names).strip("| ").split(" | ")
    assert len(cells) == len(moe_bench.header(names).splitlines()[0].strip("| ").split(" | "))
    assert cells[6:] == ["cutlass", "0.10x", "3.00x", "0.500", "50%"]
    loop = {"model": "m", "T": 1, "floor": 0.5, "layers": 2, "cutlass": (2.0, 1.0), "tokamax": (3.0, 2.0)}
    cells = moe_bench.format_loop_row(loop, ["cutlass", "tokamax"]).strip("| ").split(" | ")
    assert cells[2:] == ["2.000 / 1.000", "3.000 / 2.000", "cutlass 1.000", "2.00x", "0.500", "2.00x"]


def test_results_name_their_commit_and_say_when_tracked_files_differ_from_it(moe_bench, monkeypatch, tmp_path):
    """A result is credited to HEAD, marked ``+changes`` when a tracked file is edited (an untracked
    one does not count); ``JAX_MOE_COMMIT`` overrides; no repository reads "unknown"."""
    import subprocess

    monkeypatch.delenv("JAX_MOE_COMMIT", raising=False)
    repo = str(tmp_path / "repo")
    os.makedirs(repo)

    def git(*args):
        subprocess.run(["git", "-C", repo, "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                       capture_output=True)

    git("init", "-q")
    with open(os.path.join(repo, "tiles.json"), "w") as f:
        f.write("{}\n")
    git("add", "tiles.json")
    git("commit", "-q", "-m", "first")
    head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert moe_bench.source_commit(repo) == head
    with open(os.path.join(repo, "notes.txt"), "w") as f:
        f.write("untracked\n")
    assert moe_bench.source_commit(repo) == head
    with open(os.path.join(repo, "tiles.json"), "w") as f:
        f.write('{"edited": 1}\n')
    assert moe_bench.source_commit(repo) == head + "+changes"
    monkeypatch.setenv("JAX_MOE_COMMIT", "abc1234")
    assert moe_bench.source_commit(repo) == "abc1234"
    monkeypatch.delenv("JAX_MOE_COMMIT")
    assert moe_bench.source_commit(str(tmp_path / "not_a_repo")) == "unknown"


def test_kernels_are_attributed_to_stages_by_name_and_position(monkeypatch):
    """The cutlass forward's kernels by name (GEMM1 before the activation, GEMM2 after); XLA
    fusions by position; a peer's XLA sort/act/finalize around its two GEMMs."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.kernel_trace import Kernel, attribute, split_calls

    names = ["loop_convert_fusion", "void jax_moe::(anonymous namespace)::ChunkRanks(int const*)",
             "_ZN7jax_moe12_GLOBAL__N_15PlaceEPKi", "void jax_moe::RowKernel<GatherRow>",
             "FillGroupArrays", "void cutlass::device_kernel<GemmUniversal>", "RowKernel<GatedActRow>",
             "FillGroupArrays", "void cutlass::device_kernel<GemmUniversal>", "UnpermuteReduce<bf16>"]
    ks = [Kernel(n, 10.0 * j, 1.0 + j) for j, n in enumerate(names)]
    got = got_ours = attribute(ks, routed=True)
    assert got == {"route": 1, "sort": 2 + 3, "permute": 4, "setup": 5 + 8, "gemm1": 6, "act": 7, "gemm2": 9,
                   "finalize": 10, "glue": 0}
    peer = ["sort_fusion", "gather_fusion", "ragged_dot_sm90", "loop_silu_fusion", "ragged_dot_sm90", "reduce"]
    got = attribute([Kernel(n, 10.0 * j, 1.0) for j, n in enumerate(peer)])
    assert (got["sort"], got["gemm1"], got["act"], got["gemm2"], got["finalize"]) == (2, 1, 1, 1, 1)
    for inverse in ("void jax_moe::RowWarpKernel<SlotRow>", "void jax_moe::PermuteTokenKernel<Fp8, 8, 2>"):
        by_slot_or_token = [n.replace("void jax_moe::RowWarpKernel<GatherRow>", inverse) for n in names]
        assert attribute([Kernel(n, 10.0 * j, 1.0 + j) for j, n in enumerate(by_slot_or_token)],
                         routed=True) == got_ours  # permute_rows(inverse=)
    fused = [n for n in names if "GatedActRow" not in n]  # the activation in GEMM1's epilogue
    got = attribute([Kernel(n, 10.0 * j, 1.0) for j, n in enumerate(fused)], routed=True)
    assert (got["gemm1"], got["act"], got["gemm2"]) == (1, 0, 1)
    for decode in (["ExpertGemvAct(bf16)", "void jax_moe::ExpertGemvReduce<bf16>"],  # stored weights
                   ["void jax_moe::ExpertColumnsAct<8>", "void jax_moe::ExpertColumnsReduce<8, 4, bf16>"]):  # transposed
        got = attribute([Kernel(n, 10.0 * j, 1.0) for j, n in enumerate(decode)])
        assert (got["gemm1"], got["gemm2"], got["sort"]) == (1, 1, 0)
    one_block = [names[0], "_ZN7jax_moe12_GLOBAL__N_19SortSmallEPKi"] + names[3:]  # the sort in one launch
    got = attribute([Kernel(n, 10.0 * j, 1.0) for j, n in enumerate(one_block)], routed=True)
    assert (got["sort"], got["permute"], got["glue"]) == (1, 1, 0)
    by_warps = [names[0], "_ZN7jax_moe12_GLOBAL__N_19WarpRanksEPKi"] + names[2:]  # ranks by warps
    got = attribute([Kernel(n, 10.0 * j, 1.0) for j, n in enumerate(by_warps)], routed=True)
    assert (got["sort"], got["permute"], got["glue"]) == (2, 1, 0)
    calls = split_calls([Kernel("a", 0, 5), Kernel("b", 6, 1), Kernel("c", 100, 1)], min_gap_ns=20)
    assert [[k.name for k in g] for g in calls] == [["a", "b"], ["c"]]


def test_busy_time_counts_overlapping_kernels_once(monkeypatch):
    """A kernel that starts while an earlier one runs (a programmatic dependent waiting for its
    primary) adds only the time past that kernel's end; the stages then sum to the busy time."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.kernel_trace import Kernel, attribute, busy_ns, exclusive

    gemv1, gemv2 = Kernel("ExpertGemvActFp8<bf16>", 0, 10_000), Kernel("ExpertGemvReduceFp8<bf16>", 7_000, 8_000)
    after, inside = Kernel("loop_add_fusion", 20_000, 1_000), Kernel("copy", 1_000, 2_000)
    assert [ns for _, ns in exclusive([gemv2, after, gemv1])] == [10_000, 5_000, 1_000]
    assert [ns for _, ns in exclusive([gemv1, inside, gemv2])] == [10_000, 0.0, 5_000]
    assert busy_ns([gemv1, gemv2, after]) == 16_000
    got = attribute([gemv1, gemv2])
    assert (got["gemm1"], got["gemm2"]) == (10_000, 5_000)
    sequential = [Kernel("a", 0, 3), Kernel("b", 5, 4)]  # one stream: the durations as they are
    assert busy_ns(sequential) == 7


def test_a_calls_timeline_shows_where_its_span_exceeds_its_busy_time(monkeypatch):
    """Each kernel's start from the call's first, and the idle time before it: since every earlier
    kernel ended, so an overlapping kernel waits for nothing."""
    monkeypatch.syspath_prepend(ROOT)
    from bench.kernel_trace import Kernel, timeline

    ks = [Kernel("b", 12_000, 1_000), Kernel("a", 10_000, 5_000), Kernel("c", 45_000, 2_000)]
    assert timeline(ks) == [(0.0, 0.0, 5.0, "a"), (2.0, 0.0, 1.0, "b"), (35.0, 30.0, 2.0, "c")]


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU demo")
@pytest.mark.parametrize("method", ["alone", pytest.param("trace", marks=pytest.mark.slow)])
def test_stage_breakdown_prints_a_row_per_token_count(monkeypatch, method, tmp_path, capsys):
    """bench/stage_breakdown.py on the tiny model: every stage of the cutlass pipeline timed
    (alone: the jnp references on CPU; trace: the CPU runtime's thunks from a profiler trace)."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import stage_breakdown

    kernels = tmp_path / "kernels.txt"
    assert stage_breakdown.main(["--tokens", "3", "--method", method, "--kernels", str(kernels)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 1
    stages = [float(v) for v in rows[0].split(" | ")[3:3 + len(stage_breakdown.COLUMNS)]]
    assert sum(stages) > 0 and all(v >= 0 for v in stages)
    assert (kernels.read_text().count("## tiny") == 1) == (method == "trace")


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU demo")
def test_stage_breakdown_runs_on_balanced_routing_and_says_so(monkeypatch, capsys):
    """--routing balanced: every expert gets the same rows, and the table's header names the routing."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import stage_breakdown

    assert stage_breakdown.main(["--tokens", "4", "--method", "alone", "--no-peer", "--routing", "balanced"]) == 0
    out = capsys.readouterr().out
    assert "balanced routing" in out
    assert len([line for line in out.splitlines() if line.startswith("| tiny")]) == 1


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU demo")
def test_stage_breakdown_gives_the_device_time_per_layer_inside_a_loop(monkeypatch, capsys):
    """--loop N: each forward is also traced inside a jitted loop of N layers, and its busy time,
    span and GEMM time per layer are tabled (on CPU: the runtime's thunks)."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import stage_breakdown

    assert stage_breakdown.main(["--tokens", "3", "--method", "trace", "--no-peer", "--loop", "2"]) == 0
    out = capsys.readouterr().out
    if "not attributed" in out:  # a busy host split a call in two: nothing to check
        return
    table = out[out.index("| model | T | impl | layers"):].splitlines()
    row = table[2].split(" | ")
    assert row[0].startswith("| tiny") and row[1:4] == ["3", "cutlass", "2"]
    busy, span, gemm = (float(v.strip(" |")) for v in row[4:7])
    assert busy > 0 and span > 0 and gemm >= 0  # (CPU thunks nest, so busy may pass span here)
    floor, share, speedup, clocks = (v.strip(" |") for v in row[7:11])
    assert float(floor) > 0 and share.endswith("%") and speedup == "-"  # no peer here
    assert clocks == "-; -"  # no GPU clock to sample on CPU
    with pytest.raises(SystemExit):
        stage_breakdown.main(["--tokens", "3", "--method", "alone", "--loop", "2"])


def test_stage_breakdown_loop_table_reads_each_layer_against_the_targets_floor_and_tokamax(monkeypatch):
    """The loop table's floor is the performance targets' (touched-expert bytes / 3.0 TB/s against
    FLOPs / 800 TFLOP/s, whatever this machine measures): Qwen3-30B-A3B at T=4096 is 414 us, bound by
    its 1.24 GB of experts. jax_moe's rows are read against it and against tokamax's busy time at the
    same model and T."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import stage_breakdown
    from bench.moe_bench import MODELS

    assert stage_breakdown.target_floor_us(MODELS["qwen3"], 4096) == pytest.approx(414, abs=1)
    # FP8: one byte per weight, the tokens still bf16 in and out (33.5 MB)
    assert stage_breakdown.target_floor_us(MODELS["qwen3"], 4096, "fp8") == pytest.approx(212.5, abs=0.5)

    def row(impl, t, busy, traced=None, clocks=None, joules=None, energy=None):
        return {"model": "m", "T": t, "impl": impl, "target_floor": 400.0,
                "loop": {"layers": 8, "busy": busy, "span": busy + 10, "gemm": busy - 50,
                         "clocks_traced": traced, "clocks": clocks, "joules": joules, "energy": energy}}

    traced = {"samples": 9, "p10_mhz": 1845, "median_mhz": 1965, "max_mhz": 1980, "power_capped": 0.2}
    capped = {"samples": 40, "p10_mhz": 1110, "median_mhz": 1380, "max_mhz": 1980, "power_capped": 1.0}
    drawn = {"joules": 700.0, "seconds": 1.0, "watts": 700.0, "limit_watts": 700.0}
    rows = [row("cutlass", 64, 500.0, traced, capped, 0.35, drawn), row("tokamax", 64, 1000.0),
            row("cutlass", 128, 800.0)]
    lines = stage_breakdown.loop_table(rows).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert cells[0][7:] == ["400.0", "80%", "2.00x", "1965 (9); 1110 / 1380 (100%)", "350 (700 W)"]
    assert cells[1][7:] == ["400.0", "40%", "-", "-; -", "-"]     # the peer's own row (no clocks, no meter)
    assert cells[2][7:] == ["400.0", "50%", "-", "-; -", "-"]     # no peer at this T


def test_the_energy_meter_reads_the_board_from_one_step_of_nvmls_counter_to_another(monkeypatch):
    """bench.gpu_energy.EnergyMeter reads NVML's total-energy counter (mJ), which steps every few
    tens of ms. It starts at a step; a caller runs until ``advanced()`` says the counter stepped
    again, and the meter reads it on leaving: joules, seconds, mean watts and the board's power
    limit. Joules per layer divide by the layers run. Without NVML, or not enabled, it reads
    nothing, has no summary, and ``advanced()`` is always True."""
    import types

    monkeypatch.syspath_prepend(ROOT)
    from bench import gpu_energy

    readings = [1_000_000, 1_000_000, 1_100_000,  # entry: waits for the step to 1.1 MJ
                1_100_000, 1_100_000, 1_800_000]  # advanced(): marks, not yet, stepped
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: f"gpu{i}",
        nvmlDeviceGetTotalEnergyConsumption=lambda h: readings.pop(0) if len(readings) > 1 else readings[0],
        nvmlDeviceGetEnforcedPowerLimit=lambda h: 700_000)
    monkeypatch.setattr(gpu_energy, "nvml_device", lambda index: (nvml, f"gpu{index}"))
    with gpu_energy.EnergyMeter() as energy:
        time.sleep(0.05)
        assert [energy.advanced(), energy.advanced(), energy.advanced()] == [False, False, True]
    s = energy.summary
    assert s["joules"] == pytest.approx(700.0) and s["limit_watts"] == pytest.approx(700.0)
    assert s["seconds"] >= 0.05 and s["watts"] == pytest.approx(700.0 / s["seconds"])
    assert gpu_energy.per_layer(s, 2000) == pytest.approx(0.35)
    assert gpu_energy.per_layer(None, 8) is None and gpu_energy.cell(None, None) == "-"

    monkeypatch.setattr(gpu_energy, "nvml_device", lambda index: None)  # no NVML here
    with gpu_energy.EnergyMeter() as energy:
        assert energy.advanced()
    assert energy.summary is None
    with gpu_energy.EnergyMeter(enabled=False) as energy:  # a caller not on the GPU
        assert energy.advanced()
    assert energy.summary is None


def test_the_clock_sampler_reads_the_busy_samples_clock_and_how_often_the_power_cap_lowered_it(monkeypatch):
    """bench.gpu_clocks.summarize: nvidia-smi's ``clocks.sm, clocks_event_reasons.active`` lines.
    Idle samples (reason bit 0x1) and lines that do not parse are left out; the share power-capped
    counts the samples with bit 0x4 among the busy ones."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import gpu_clocks

    lines = ["1980, 0x0000000000000000", "1455, 0x0000000000000004", "1845, 0x0000000000000004",
             "345, 0x0000000000000001",  # idle between calls
             "1965, 0x0000000000000000", "[N/A], [N/A]", "", "1980, 0x0000000000000010"]
    s = gpu_clocks.summarize(lines)
    assert s == {"samples": 5, "p10_mhz": 1455, "median_mhz": 1965, "max_mhz": 1980, "power_capped": 0.4}
    assert gpu_clocks.cell(s) == "1455 / 1965 (40%)"
    assert gpu_clocks.summarize(["345, 0x1", "garbage"]) is None and gpu_clocks.cell(None) == "-"


def test_the_clock_sampler_summarizes_what_nvidia_smi_printed_while_the_block_ran(monkeypatch, tmp_path):
    """ClockSampler runs nvidia-smi (here a stand-in printing two samples) for the ``with`` block's
    length, stops it on leaving, and summarizes its output; without nvidia-smi, or not enabled, it
    runs nothing and has no summary."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import gpu_clocks

    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "1500, 0x4"\necho "1980, 0x0"\n')
    smi.chmod(0o755)
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: str(smi))
    with gpu_clocks.ClockSampler() as clocks:
        time.sleep(1.0)  # the stand-in prints at once; the real one until it is stopped
    assert clocks.summary == {"samples": 2, "p10_mhz": 1500, "median_mhz": 1740, "max_mhz": 1980,
                              "power_capped": 0.5}

    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: None)
    with gpu_clocks.ClockSampler() as clocks:
        pass
    assert clocks.summary is None
    monkeypatch.setattr(gpu_clocks.shutil, "which", lambda name: str(smi))
    with gpu_clocks.ClockSampler(enabled=False) as clocks:  # a caller not on the GPU
        time.sleep(0.2)
    assert clocks.summary is None


def test_route_bench_prints_a_row_per_router_and_token_count(monkeypatch, capsys):
    """bench/route_bench.py: select_experts (the route kernel) against its pure-JAX path with the
    top-k kernel and with lax.top_k (on CPU all three are lax.top_k), device time from one trace,
    for the routers asked."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import route_bench

    assert route_bench.main(["--models", "mixtral", "deepseek", "--tokens", "4", "16", "--calls", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("| mixtral", "| deepseek"))]
    assert len(rows) == 4 and all(line.endswith("x |") for line in rows)


def test_group_count_probe_times_one_gemm_per_group_count_and_tile_after_checking_it(monkeypatch, capsys):
    """bench/group_count_probe.py: a grouped GEMM of fixed rows split evenly, or as top-k routing
    splits them, among more groups; a row per group count and tile, each checked against float32
    first (on CPU: the pure-JAX reference)."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import group_count_probe as probe

    assert probe.main(["--shape", "256", "64", "--rows", "512", "--groups", "1", "4", "--calls", "2",
                       "--tiles", "pingpong_64x256", "coop_128x256_c1"]) == 0
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 512 |")]
    assert [(r[3], r[4]) for r in rows] == [("1", "pingpong_64x256"), ("1", "coop_128x256_c1"),
                                            ("4", "pingpong_64x256"), ("4", "coop_128x256_c1")]
    assert [r[5] for r in rows] == ["8.0", "4.0", "2.0", "1.0"]  # tiles per group: 512 rows / tile rows / groups


def test_group_count_probe_writes_rows_that_side_by_side_compares(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(ROOT)
    from bench import group_count_probe as probe
    from bench import side_by_side

    for side in ("base", "new"):
        assert probe.main(["--shape", "256", "64", "--rows", "512", "--groups", "1", "4", "--calls", "2",
                           "--json", str(tmp_path / f"{side}_1.json")]) == 0
    printed = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 512 |")]
    written = json.loads((tmp_path / "base_1.json").read_text())
    assert [(r["T"], r["impl"]) for r in written] == [(1, "pingpong_64x256"), (4, "pingpong_64x256")]
    assert [f"{r['busy']:.1f}" for r in written] == [r[6] for r in printed[:2]], "the JSON's us are the table's"
    lines = side_by_side.table(side_by_side.read_rounds(str(tmp_path)))
    assert [line.split(" | ")[:4] for line in lines if "| busy |" in line] == [
        ["| 512 rows, N=256 K=64, even", "1", "pingpong_64x256", "busy"],
        ["| 512 rows, N=256 K=64, even", "4", "pingpong_64x256", "busy"]]


def test_group_count_probe_splits_rows_as_routing_does_and_refuses_what_does_not_divide(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import group_count_probe as probe

    off = probe.offsets_of(4096, 128, top_k=8)
    assert off[0] == 0 and off[-1] == 4096 and (off[1:] >= off[:-1]).all()
    groups = np.array([0, 64, 65, 200, 200])  # 64, 1, 135 and 0 rows
    assert probe.tiles_of(groups, 512, "pingpong_64x256") == (1 + 1 + 3 + 0) * 2
    assert probe.tiles_of(groups, 300, "coop_128x256_c1") == (1 + 1 + 2 + 0) * 2
    assert list(probe.offsets_of(256, 4, None)) == [0, 64, 128, 192, 256]
    with pytest.raises(ValueError, match="--rows"):
        probe.offsets_of(100, 8, None)
    with pytest.raises(ValueError, match="--random"):
        probe.offsets_of(100, 8, top_k=3)


@pytest.mark.slow
@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU demo")
def test_stage_breakdown_of_the_fp8_forward(monkeypatch, capsys):
    """--scheme fp8: the forward on FP8 weights is traced, its row named for the scheme, and the
    bf16 peer left out with the reason printed."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import stage_breakdown

    assert stage_breakdown.main(["--tokens", "3", "--method", "trace", "--scheme", "fp8"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 1 and rows[0].split(" | ")[2] == "cutlass fp8"
    cells = rows[0].split(" | ")[3:3 + len(stage_breakdown.COLUMNS)]
    if "trace not attributed" in out:  # a busy host: no stages rather than another scheme's
        assert cells == ["n/a"] * len(cells)
    else:
        stages = [float(v) for v in cells]
        assert sum(stages) > 0 and all(v >= 0 for v in stages)
    assert "# tokamax: not run (a bf16 MoE" in out


@pytest.mark.slow
@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU demo")
def test_stage_breakdown_gives_a_table_per_scheme(monkeypatch, tmp_path, capsys):
    """--scheme bf16 fp8: one run, a table per scheme, and the JSON rows of both, told apart by
    their impl; a scheme other than bf16 needs the trace method."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import stage_breakdown

    out_json = tmp_path / "rows.json"
    argv = ["--tokens", "3", "--method", "trace", "--no-peer", "--scheme", "bf16", "fp8", "--json", str(out_json)]
    assert stage_breakdown.main(argv) == 0
    out = capsys.readouterr().out
    assert [line.split(", ")[2] for line in out.splitlines() if line.startswith("# ") and "method" in line] == [
        "bf16", "fp8"]
    assert [r["impl"] for r in json.loads(out_json.read_text())] == ["cutlass", "cutlass fp8"]
    with pytest.raises(SystemExit):
        stage_breakdown.main(["--tokens", "3", "--method", "alone", "--scheme", "bf16", "fp8"])


@pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU demo")
def test_an_fp8_forward_whose_trace_is_not_attributed_gets_no_bf16_stages(monkeypatch, capsys):
    """Where the trace cannot be split into calls, the bf16 forward falls back to its stages
    timed alone; the FP8 forward keeps its row (timed per call) with every stage n/a, because
    the stages alone are bf16's."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import stage_breakdown

    monkeypatch.setattr(stage_breakdown, "traced_stages", lambda *a, **k: None)
    n = len(stage_breakdown.COLUMNS)
    for scheme, name in (("fp8", "cutlass fp8"), ("bf16", "cutlass")):
        assert stage_breakdown.main(["--tokens", "3", "--method", "trace", "--scheme", scheme, "--no-peer"]) == 0
        out = capsys.readouterr().out
        rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| tiny")]
        assert len(rows) == 1 and rows[0][2] == name and "trace not attributed" in out
        assert float(rows[0][3 + n + 3]) > 0  # per call us
        if scheme == "fp8":
            assert rows[0][3:3 + n] == ["n/a"] * n
        else:
            assert sum(float(v) for v in rows[0][3:3 + n]) > 0


def test_stage_breakdown_of_fp8_needs_the_trace(monkeypatch):
    """The stages alone are bf16's: --scheme fp8 with --method alone is refused by name."""
    monkeypatch.syspath_prepend(ROOT)
    from bench import stage_breakdown

    with pytest.raises(SystemExit):
        stage_breakdown.main(["--scheme", "fp8", "--method", "alone"])


@pytest.mark.parametrize("only, names", [
    (["cutlass_sc"], ["cutlass_sc"]),
    (["cutlass", "cutlass_sc"], ["cutlass", "cutlass_sc"]),
    (["cutlass", "cutlass_nk", "cutlass_sc"], ["cutlass", "cutlass_nk", "cutlass_sc"]),
    (["cutlass_sc", "cutlass_ga"], ["cutlass_ga", "cutlass_sc"]),
    (["cutlass"], ["cutlass"]),
])
def test_cutlass_variants_run_when_named_with_or_without_cutlass(moe_bench, monkeypatch, only, names):
    """``--impls cutlass_sc`` alone times the scatter form (cutlass is probed for it, not timed)."""
    from jax_moe import oracle
    from jax_moe.backends import cutlass

    monkeypatch.setattr(oracle, "probe", lambda name, *a, **k: (cutlass, name == "cutlass", "here"))
    from jax_moe.config import MoEConfig

    m = moe_bench.MODELS["tiny"]
    impls = moe_bench.implementations(MoEConfig(m.e, m.k, m.h, m.i), only=only)
    assert sorted(impls) == names


@pytest.mark.parametrize("scheme", ["bf16", pytest.param("fp8", marks=pytest.mark.slow)])
def test_profile_forward_runs_the_prepared_forward_a_profiler_attaches_to(monkeypatch, scheme, capsys):
    monkeypatch.syspath_prepend(ROOT)
    from bench import profile_forward

    assert profile_forward.main(["--model", "tiny", "--scheme", scheme, "--tokens", "8", "--runs", "2"]) == 0
    assert f"{scheme} T=8 (random routing): 2 forwards run" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        profile_forward.main(["--model", "tiny", "--runs", "0"])
