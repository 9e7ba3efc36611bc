"""bench/train_bench.py on CPU: the forward + backward table prints a row per token count, with the
pure-JAX implementations timed and the kernel backends reported as not run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import train_bench  # noqa: E402


def test_prints_a_row_per_token_count(capsys):
    train_bench.main(["--models", "tiny", "--tokens", "8", "16", "--impls", "xla", "ragged_dot"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 2
    assert all(cell.strip() != "n/a" for cell in rows[0].split("|")[3:5])  # xla and ragged_dot timed
