"""Where a kernel's warps stall, instruction by instruction: Nsight Compute's SASS source page, summed.

ncu samples each warp's program counter and why it did not issue. Its source page lists, per SASS
instruction, the samples and their stall reasons; this module sums them by opcode and by reason and
lists the hottest instructions with the few before each (a hot branch is usually the loop of an
mbarrier wait, and the instruction before it names the barrier's shared-memory offset)::

    ncu -i gemm2.ncu-rep --page source --print-source sass --csv > gemm2_source.csv
    python bench/ncu_stalls.py gemm2_source.csv --top 30 --context 2

``bench/ncu_gemm.sh`` runs both steps on the device. The sampled report needs the SourceCounters
(or WarpStateStats) section.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

SAMPLES = "Warp Stall Sampling (All Samples)"
NOT_ISSUED = " (Not Issued)"


class Instruction(NamedTuple):
    """One SASS instruction of the source page: its text, all its samples, and samples per stall reason."""

    address: str
    source: str
    samples: float
    reasons: dict[str, float]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(lines: Sequence[str]) -> list[Instruction]:
    """The instructions of ncu's ``--page source --print-source sass --csv`` output, in address order.

    Lines before the header (ncu's own notes) are skipped. The reasons are the ``stall_*`` columns
    of all samples (not their "Not Issued" twins). Raises ValueError when there is no header with
    ``Source`` and the all-samples column (the report was taken without sampling)."""
    rows = list(csv.reader(lines))
    for i, row in enumerate(rows):
        cells = [c.strip() for c in row]
        if "Source" in cells and SAMPLES in cells:
            header, body = cells, rows[i + 1:]
            break
    else:
        raise ValueError(f"no source-page header with 'Source' and '{SAMPLES}': was the report "
                         "taken with the SourceCounters section, and printed with --page source --csv?")
    src, samples = header.index("Source"), header.index(SAMPLES)
    address = header.index("Address") if "Address" in header else None
    reasons = [(j, name) for j, name in enumerate(header)
               if name.startswith("stall_") and not name.endswith(NOT_ISSUED)]
    out = []
    for row in body:
        if len(row) <= max(src, samples):
            continue
        out.append(Instruction(row[address].strip() if address is not None else "", row[src].strip(),
                               _number(row[samples]),
                               {name: _number(row[j]) for j, name in reasons if j < len(row) and _number(row[j])}))
    return out


def opcode(source: str) -> str:
    """The instruction's opcode without its modifiers or predicate: ``@!P0 BRA 0x7f..`` -> ``BRA``."""
    words = [w for w in source.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else "?"


def by_opcode(instructions: Sequence[Instruction]) -> Counter:
    """Samples summed per opcode."""
    totals: Counter = Counter()
    for ins in instructions:
        totals[opcode(ins.source)] += ins.samples
    return totals


def by_reason(instructions: Sequence[Instruction]) -> Counter:
    """Samples summed per stall reason (``stall_long_sb``, ``stall_barrier``, ...)."""
    totals: Counter = Counter()
    for ins in instructions:
        totals.update(ins.reasons)
    return totals


def report(instructions: Sequence[Instruction], top: int = 30, context: int = 2) -> list[str]:
    """The summary as lines: total samples, shares by opcode and by reason, and the ``top`` hottest
    instructions, each after the ``context`` instructions before it."""
    total = sum(ins.samples for ins in instructions) or 1.0

    def share(v: float) -> str:
        return f"{v:10.0f} {100 * v / total:5.1f}%"

    lines = [f"samples: {total:.0f} over {len(instructions)} instructions", "", "by opcode:"]
    lines += [f"  {name:24s} {share(v)}" for name, v in by_opcode(instructions).most_common(20) if v]
    lines += ["", "by stall reason:"]
    lines += [f"  {name:24s} {share(v)}" for name, v in by_reason(instructions).most_common(12) if v]
    lines += ["", f"hottest {top} instructions (with the {context} before each):"]
    hottest = sorted(range(len(instructions)), key=lambda i: -instructions[i].samples)[:top]
    for i in hottest:
        ins = instructions[i]
        if not ins.samples:
            break
        reasons = ", ".join(f"{k[len('stall_'):]} {v:.0f}" for k, v in
                            sorted(ins.reasons.items(), key=lambda kv: -kv[1])[:3])
        lines.append(f"{share(ins.samples)}  {ins.address} {ins.source[:90]}  [{reasons}]")
        lines += [f"{'':17s}  {p.address} {p.source[:90]}" for p in instructions[max(0, i - context):i]]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", help="ncu -i REPORT --page source --print-source sass --csv > this file")
    parser.add_argument("--top", type=int, default=30, help="hottest instructions listed (default 30)")
    parser.add_argument("--context", type=int, default=2, help="instructions shown before each (default 2)")
    args = parser.parse_args(argv)
    with open(args.csv, errors="replace") as f:
        try:
            instructions = read_source_page(f.read().splitlines())
        except ValueError as e:
            print(f"ncu_stalls: {args.csv}: {e}", file=sys.stderr)
            return 1
    print("\n".join(report(instructions, args.top, args.context)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
