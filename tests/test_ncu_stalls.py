"""bench/ncu_stalls.py: Nsight Compute's SASS source page summed by opcode and stall reason."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The shape of `ncu -i R --page source --print-source sass --csv`: a note, a header, a row per instruction.
HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
          '"Instructions Executed","stall_barrier","stall_long_sb","stall_wait","stall_long_sb (Not Issued)"')
ROWS = [
    '"7f00","SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR8+0x32880], R7","20","18","100","0","0","20","0"',
    '"7f10","@!P0  BRA 0x7f00","1,200","1100","100","0","1200","0","1100"',
    '"7f20","HGMMA.64x256x16.F32.BF16 R24, gdesc[UR8].tnspB, R24, UP0, gsb0","30","20","400","0","0","30","0"',
    '"7f30","WARPGROUP.DEPBAR.LE gsb0, 0x1","250","240","400","250","0","0","0"',
    '"7f40","@P0   BRA 0x7f90","500","400","50","0","500","0","400"',
    '"7f50","NOP","0","0","10","0","0","0","0"',
]


@pytest.fixture
def ncu_stalls(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import ncu_stalls

    return ncu_stalls


def _page(rows=ROWS):
    return ["==PROF== a note ncu prints first", HEADER, *rows]


def test_samples_are_summed_per_opcode_without_predicates_or_modifiers(ncu_stalls):
    instructions = ncu_stalls.read_source_page(_page())
    assert len(instructions) == len(ROWS)
    totals = ncu_stalls.by_opcode(instructions)
    assert totals["BRA"] == 1700  # "1,200" read as 1200, both predicated branches counted
    assert totals["WARPGROUP"] == 250 and totals["HGMMA"] == 30 and totals["SYNCS"] == 20


def test_stall_reasons_count_all_samples_not_their_not_issued_twins(ncu_stalls):
    totals = ncu_stalls.by_reason(ncu_stalls.read_source_page(_page()))
    assert totals == {"stall_long_sb": 1700, "stall_barrier": 250, "stall_wait": 50}


def test_the_report_lists_the_hottest_instruction_after_the_ones_before_it(ncu_stalls):
    lines = ncu_stalls.report(ncu_stalls.read_source_page(_page()), top=2, context=1)
    assert lines[0] == "samples: 2000 over 6 instructions"
    hot = next(i for i, line in enumerate(lines) if "BRA 0x7f00" in line)
    assert "60.0%" in lines[hot] and "long_sb 1200" in lines[hot]
    assert "TRYWAIT" in lines[hot + 1], "the barrier wait the branch loops on is shown under it"
    assert not any("NOP" in line for line in lines[hot:]), "only the top 2 are listed"


def test_a_report_without_samples_is_a_clear_error(ncu_stalls, tmp_path):
    with pytest.raises(ValueError, match="SourceCounters"):
        ncu_stalls.read_source_page(['"Address","Source","Instructions Executed"', '"7f00","NOP","1"'])
    page = tmp_path / "page.csv"
    page.write_text('"Address","Source"\n')
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ncu_stalls.py"), str(page)],
                         capture_output=True, text=True)
    assert run.returncode == 1 and "page.csv" in run.stderr


def test_the_command_prints_the_summary(tmp_path):
    page = tmp_path / "page.csv"
    page.write_text("\n".join(_page()) + "\n")
    run = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "ncu_stalls.py"), str(page), "--top", "3"],
                         capture_output=True, text=True, check=True)
    assert "by opcode:" in run.stdout and "by stall reason:" in run.stdout
    assert "hottest 3 instructions" in run.stdout
