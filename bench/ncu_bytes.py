"""A grouped GEMM's DRAM traffic under Nsight Compute, against the least the GEMM must move.

Reads the details that ``ncu -i R --print-summary none`` prints for one kernel (the
SpeedOfLight and MemoryWorkloadAnalysis sections): its duration, its DRAM throughput in bytes per
second, the L2's and the SMs' throughput. The bytes it moved are the DRAM's own counters,
``dram__bytes_read.sum`` and ``dram__bytes_write.sum``, where the profile collected them
(``bench/ncu_gemm.sh`` asks for both); else the throughput times the duration. That product can
stray from the counters: ncu replays the kernel to collect its sections, and with the clocks
left free each replay runs for its own time. The least it must move, for the bench's layer at T
tokens:

- ``gemm1`` (GEMM1 with its activation fused, the forward's): the touched experts' ``w13``
  [E, 2I, H], the T*k rows in [T*k, H], and the activated rows out [T*k, I] (bf16, or FP8);
- ``gemm2`` (GEMM2 with the scatter epilogue): the touched experts' ``w2`` [E, H, I], the T*k rows
  in [T*k, I], and the output [T, H] bf16 written once;
- ``gemm2_gather`` (GEMM2 of the gathering forward, ``JAX_MOE_CUTLASS_FINALIZE=gather``): the same
  weights and rows in, and its rows out [T*k, H] bf16, which the finalize then sums per token.

Weights and rows in are two bytes each in bf16 and one in FP8. The excess over the least is
traffic the L2 did not absorb: an operand read from DRAM more than once, or output lines written
back and read again between adds::

    python bench/ncu_bytes.py gemm2_details.txt --model deepseek --tokens 4096 --gemm gemm2

``bench/ncu_gemm.sh`` runs it after each profile of ``GatedActEpilogue`` or
``ScatterRowsAdapter``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from typing import NamedTuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.moe_bench import MODELS, Model, touched_experts  # noqa: E402

GEMMS = ("gemm1", "gemm2", "gemm2_gather")
SCHEMES = ("bf16", "fp8")
_UNITS = {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}
_RATES = {"Kbyte/s": 1e3, "Mbyte/s": 1e6, "Gbyte/s": 1e9, "Tbyte/s": 1e12}
_BYTES = {"byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}


class KernelFigures(NamedTuple):
    """One kernel's figures from the details page; the DRAM counters are None where not collected."""

    duration_us: float
    dram_bytes_per_s: float
    dram_pct: float
    l2_pct: float
    sm_pct: float
    sm_ghz: float
    dram_read_bytes: float | None = None
    dram_write_bytes: float | None = None

    @property
    def counted(self) -> bool:
        """Whether the DRAM's byte counters were collected (else the bytes are rate times duration)."""
        return self.dram_read_bytes is not None and self.dram_write_bytes is not None

    @property
    def dram_bytes(self) -> float:
        """Bytes the kernel moved to and from the DRAM: its counters, else rate times duration."""
        if self.counted:
            return self.dram_read_bytes + self.dram_write_bytes
        return self.dram_bytes_per_s * self.duration_us * 1e-6


def _value(text: str, metric: str, units: dict[str, float] | None = None) -> float:
    """The value of the first line ``metric  [unit]  value`` (scaled by ``units[unit]`` when given)."""
    unit_re = "|".join(re.escape(u) for u in units) if units else r"%|Ghz"
    m = re.search(rf"^\s*{re.escape(metric)}\s+({unit_re})\s+([\d.,]+)\s*$", text, re.MULTILINE)
    if m is None:
        raise ValueError(f"the details have no {metric!r} line"
                         + (f" in {'/'.join(units)}" if units else "") + ": profile with the SpeedOfLight "
                         "and MemoryWorkloadAnalysis sections")
    value = float(m.group(2).replace(",", ""))
    return value * units[m.group(1)] if units else value


def _counter(text: str, metric: str) -> float | None:
    """The bytes of counter ``metric`` (a "Command line profiler metrics" line), or None if absent."""
    try:
        return _value(text, metric, _BYTES)
    except ValueError:
        return None


def read_details(text: str) -> KernelFigures:
    """The figures of the first kernel in ``ncu -i R --print-summary none`` output."""
    return KernelFigures(duration_us=_value(text, "Duration", _UNITS),
                         dram_bytes_per_s=_value(text, "Memory Throughput", _RATES),
                         dram_pct=_value(text, "DRAM Throughput"),
                         l2_pct=_value(text, "L2 Cache Throughput"),
                         sm_pct=_value(text, "Compute (SM) Throughput"),
                         sm_ghz=_value(text, "SM Frequency"),
                         dram_read_bytes=_counter(text, "dram__bytes_read.sum"),
                         dram_write_bytes=_counter(text, "dram__bytes_write.sum"))


def least_bytes(m: Model, t: int, scheme: str, gemm: str) -> float:
    """Bytes GEMM ``gemm`` of layer ``m`` must move at ``t`` tokens (the module's docstring)."""
    if scheme not in SCHEMES or gemm not in GEMMS:
        raise ValueError(f"scheme must be one of {SCHEMES} and gemm one of {GEMMS}, got {scheme!r}, {gemm!r}")
    touched = touched_experts(m, t)
    rows = t * m.k
    b = 1 if scheme == "fp8" else 2
    if gemm == "gemm1":
        return touched * 2 * m.i * m.h * b + rows * m.h * b + rows * m.i * b
    out_rows = rows if gemm == "gemm2_gather" else t
    return touched * m.h * m.i * b + rows * m.i * b + out_rows * m.h * 2


def flops(m: Model, t: int, gemm: str) -> float:
    """Multiply-adds times two of the rows there are (no padding)."""
    return 2.0 * t * m.k * m.h * (2 * m.i if gemm == "gemm1" else m.i)


def report(fig: KernelFigures, m: Model, t: int, scheme: str, gemm: str) -> str:
    """A markdown table of the kernel's figures against what the GEMM must move; its last column
    says where the bytes come from (the counters, read + written, or rate times duration)."""
    moved = fig.dram_bytes
    least = least_bytes(m, t, scheme, gemm)
    tflops = flops(m, t, gemm) / (fig.duration_us * 1e-6) / 1e12
    source = (f"counters: {fig.dram_read_bytes / 1e9:.2f} read + {fig.dram_write_bytes / 1e9:.2f} written"
              if fig.counted else "rate x duration")
    return "\n".join([
        "| GEMM | us | SM GHz | DRAM | DRAM bytes / least bytes | L2 | SM | TFLOP/s of rows | bytes from |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {m.name} {scheme} {gemm}, T={t} | {fig.duration_us:.1f} | {fig.sm_ghz:.2f} | {fig.dram_pct:.1f}% "
        f"({fig.dram_bytes_per_s / 1e12:.2f} TB/s) | {moved / 1e9:.2f} / {least / 1e9:.2f} GB "
        f"({moved / least - 1:+.0%}) | {fig.l2_pct:.1f}% | {fig.sm_pct:.1f}% | {tflops:.0f} | {source} |",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("details", help="the output of `ncu -i REPORT --print-summary none` for one kernel")
    p.add_argument("--model", choices=sorted(MODELS), required=True)
    p.add_argument("--scheme", choices=SCHEMES, default="bf16")
    p.add_argument("--tokens", type=int, required=True, help="T, the forward's tokens")
    p.add_argument("--gemm", choices=GEMMS, required=True)
    args = p.parse_args(argv)
    if args.tokens < 1:
        p.error("--tokens must be at least 1")
    with open(args.details) as f:
        text = f.read()
    try:
        fig = read_details(text)
    except ValueError as err:
        p.exit(2, f"{p.prog}: {args.details}: {err}\n")
    print(report(fig, MODELS[args.model], args.tokens, args.scheme, args.gemm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
