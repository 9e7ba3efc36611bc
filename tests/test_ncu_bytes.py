"""bench/ncu_bytes.py: a grouped GEMM's DRAM bytes under Nsight Compute against the least it must move."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The shape of `ncu -i R --print-summary none` for one kernel: the SpeedOfLight section, then the
# MemoryWorkloadAnalysis section, whose "Memory Throughput" is in bytes per second.
DETAILS = """\
[1558] python3.12@127.0.0.1
  void device_kernel<GemmUniversal<...>>(Params) (132, 1, 1)x(384, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Frequency                  Ghz         3.20
    SM Frequency                    Ghz         1.50
    Elapsed Cycles                cycle    6,120,000
    Memory Throughput                 %        85.00
    DRAM Throughput                   %        85.00
    Duration                         ms         4.00
    L2 Cache Throughput               %        98.00
    Compute (SM) Throughput           %        72.00
    ----------------------- ----------- ------------

    Section: Memory Workload Analysis
    -------------------------------------- ----------- ------------
    Memory Throughput                          Tbyte/s         4.10
    Mem Busy                                         %        70.00
"""


@pytest.fixture
def ncu_bytes(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import ncu_bytes

    return ncu_bytes


def test_the_details_page_gives_duration_dram_rate_and_utilizations(ncu_bytes):
    fig = ncu_bytes.read_details(DETAILS)
    assert fig.duration_us == pytest.approx(4000.0)  # "ms" scaled to microseconds
    assert fig.dram_bytes_per_s == pytest.approx(4.1e12)  # the rate, not the "%" line of the same name
    assert (fig.dram_pct, fig.l2_pct, fig.sm_pct, fig.sm_ghz) == (85.0, 98.0, 72.0, 1.5)
    in_us = ncu_bytes.read_details(DETAILS.replace("ms         4.00", "us       684.51"))
    assert in_us.duration_us == pytest.approx(684.51)


def test_gemm1_must_move_the_touched_weights_its_rows_in_and_its_activated_rows_out(ncu_bytes):
    from bench.moe_bench import MODELS

    m = MODELS["deepseek"]  # E=256, H=7168, I=2048, k=8: every expert is touched at T=4096
    rows = 4096 * 8
    bf16 = ncu_bytes.least_bytes(m, 4096, "bf16", "gemm1")
    assert bf16 == pytest.approx(2 * (256 * 2 * 2048 * 7168 + rows * 7168 + rows * 2048), rel=1e-9)
    assert ncu_bytes.least_bytes(m, 4096, "fp8", "gemm1") == pytest.approx(bf16 / 2, rel=1e-9)  # a byte each


def test_gemm2_must_move_the_touched_weights_its_rows_in_and_the_output_once(ncu_bytes):
    from bench.moe_bench import MODELS

    m = MODELS["deepseek"]
    rows = 4096 * 8
    expected = 2 * (256 * 7168 * 2048 + rows * 2048) + 4096 * 7168 * 2  # output [T, H] bf16, not [T*k, H]
    assert ncu_bytes.least_bytes(m, 4096, "bf16", "gemm2") == pytest.approx(expected, rel=1e-9)
    fp8 = 256 * 7168 * 2048 + rows * 2048 + 4096 * 7168 * 2  # the output stays bf16
    assert ncu_bytes.least_bytes(m, 4096, "fp8", "gemm2") == pytest.approx(fp8, rel=1e-9)


def test_the_gathering_gemm2_must_write_every_row_out_for_the_finalize_to_sum(ncu_bytes):
    from bench.moe_bench import MODELS

    m = MODELS["deepseek"]
    rows = 4096 * 8
    expected = 2 * (256 * 7168 * 2048 + rows * 2048) + rows * 7168 * 2  # rows out [T*k, H] bf16
    assert ncu_bytes.least_bytes(m, 4096, "bf16", "gemm2_gather") == pytest.approx(expected, rel=1e-9)
    assert ncu_bytes.flops(m, 4096, "gemm2_gather") == ncu_bytes.flops(m, 4096, "gemm2")


def test_few_tokens_touch_only_some_experts(ncu_bytes):
    from bench.moe_bench import MODELS

    m = MODELS["deepseek"]
    one_token = ncu_bytes.least_bytes(m, 1, "bf16", "gemm2")
    assert one_token == pytest.approx(2 * (8 * 7168 * 2048 + 8 * 2048) + 7168 * 2, rel=1e-9)  # k experts


def test_the_report_reads_bytes_moved_against_the_least_as_an_excess(ncu_bytes):
    from bench.moe_bench import MODELS

    fig = ncu_bytes.read_details(DETAILS)
    line = ncu_bytes.report(fig, MODELS["deepseek"], 4096, "bf16", "gemm1").splitlines()[-1]
    # 4.1 TB/s for 4 ms is 16.4 GB against 15.64 GB: 5% more than the GEMM must move
    assert "| 16.40 / 15.64 GB (+5%) |" in line and "4.10 TB/s" in line and line.startswith("| DeepSeek-V3 bf16 gemm1")


# What `--metrics dram__bytes_read.sum,dram__bytes_write.sum` adds to the same page.
COUNTERS = """\
    Section: Command line profiler metrics
    ---------------------------------------------------------------------- ----------- ------------
    dram__bytes_read.sum                                                         Gbyte        15.90
    dram__bytes_write.sum                                                        Mbyte       134.22
    ---------------------------------------------------------------------- ----------- ------------
"""


def test_the_dram_counters_give_the_bytes_where_the_profile_collected_them(ncu_bytes):
    """The counters, not rate x duration: ncu's replays with free clocks each run their own time."""
    from bench.moe_bench import MODELS

    fig = ncu_bytes.read_details(DETAILS + COUNTERS)
    assert fig.counted and fig.dram_read_bytes == pytest.approx(15.90e9)
    assert fig.dram_write_bytes == pytest.approx(134.22e6)  # each counter in its own unit
    assert fig.dram_bytes == pytest.approx(16.03422e9)  # not 4.1 TB/s x 4 ms = 16.4 GB
    line = ncu_bytes.report(fig, MODELS["deepseek"], 4096, "bf16", "gemm1").splitlines()[-1]
    assert "| 16.03 / 15.64 GB (+3%) |" in line and line.endswith("| counters: 15.90 read + 0.13 written |")


def test_without_the_counters_the_bytes_are_rate_times_duration_and_say_so(ncu_bytes):
    from bench.moe_bench import MODELS

    fig = ncu_bytes.read_details(DETAILS)
    assert not fig.counted and fig.dram_read_bytes is None and fig.dram_bytes == pytest.approx(16.4e9)
    line = ncu_bytes.report(fig, MODELS["deepseek"], 4096, "bf16", "gemm1").splitlines()[-1]
    assert line.endswith("| rate x duration |")
    one_counter = ncu_bytes.read_details(DETAILS + COUNTERS.replace("dram__bytes_write.sum", "other.sum"))
    assert not one_counter.counted and one_counter.dram_bytes == pytest.approx(16.4e9)


def test_bad_arguments_are_refused_by_name(ncu_bytes):
    from bench.moe_bench import MODELS

    with pytest.raises(ValueError, match="gemm one of"):
        ncu_bytes.least_bytes(MODELS["qwen3"], 64, "bf16", "gemm3")
    with pytest.raises(ValueError, match="'L2 Cache Throughput'.*MemoryWorkloadAnalysis"):
        ncu_bytes.read_details(DETAILS.replace("L2 Cache Throughput", "L2 Something"))


def test_the_command_line_prints_the_table_or_says_what_the_details_lack(tmp_path):
    details = tmp_path / "k_details.txt"
    details.write_text(DETAILS)
    cmd = [sys.executable, os.path.join(ROOT, "bench", "ncu_bytes.py"), str(details), "--model", "gptoss",
           "--tokens", "4096", "--gemm", "gemm2"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("| GPT-OSS-120B bf16 gemm2, T=4096 | 4000.0 |")
    details.write_text("no sections here\n")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "no 'Duration' line" in done.stderr
