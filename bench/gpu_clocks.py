"""The GPU's SM clock while a bench step runs, sampled by ``nvidia-smi`` in the background.

A long compute-bound loop can run below the GPU's top clock: the driver lowers it to keep the board
under its power limit (the "SW power cap" clock event reason). Two machines of one kind, or two
loop lengths on one machine, then read differently for the same kernels. The bench's loop table
gives each loop's clocks next to its times, so that such a difference can be told from a change
in the kernels.

    with ClockSampler() as clocks:
        ...run the loop back to back...
    clocks.summary  # {"samples", "p10_mhz", "median_mhz", "max_mhz", "power_capped"}, or None

Without ``nvidia-smi`` (a CPU machine) the sampler does nothing and its summary is None.
"""
from __future__ import annotations

import shutil
import statistics
import subprocess
import tempfile
from typing import TypedDict

QUERY = "clocks.sm,clocks_event_reasons.active"
GPU_IDLE = 0x1        # nvmlClocksEventReasonGpuIdle: nothing ran at that sample
SW_POWER_CAP = 0x4    # nvmlClocksEventReasonSwPowerCap: the clock lowered to stay under the power limit
INTERVAL_MS = 20


class ClockSummary(TypedDict):
    """The SM clock over the samples taken while the GPU was busy (MHz), and the share (0..1) of
    those samples at which the driver named its power cap as a reason for the clock. A plain dict,
    so that the bench's JSON rows carry it."""
    samples: int
    p10_mhz: int
    median_mhz: int
    max_mhz: int
    power_capped: float


def cell(summary: ClockSummary | None) -> str:
    """A table's cell for ``summary``: ``p10 / median (share power-capped)``, or "-" without one."""
    if not summary:
        return "-"
    return f"{summary['p10_mhz']} / {summary['median_mhz']} ({100 * summary['power_capped']:.0f}%)"


def summarize(lines: list[str]) -> ClockSummary | None:
    """Parse ``nvidia-smi --query-gpu=clocks.sm,clocks_event_reasons.active --format=csv,noheader,
    nounits`` lines (``"1980, 0x0000000000000004"``) of one GPU; the samples with the idle reason
    and the lines that do not parse are left out. None if no busy sample is left."""
    mhz, capped = [], 0
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2:
            continue
        try:
            clock, reasons = int(parts[0]), int(parts[1], 16)
        except ValueError:
            continue
        if reasons & GPU_IDLE:
            continue
        mhz.append(clock)
        capped += bool(reasons & SW_POWER_CAP)
    if not mhz:
        return None
    mhz.sort()
    return ClockSummary(samples=len(mhz), p10_mhz=mhz[len(mhz) // 10], median_mhz=int(statistics.median(mhz)),
                        max_mhz=mhz[-1], power_capped=capped / len(mhz))


class ClockSampler:
    """Samples GPU ``device``'s SM clock every :data:`INTERVAL_MS` ms while the ``with`` block
    runs; ``summary`` is :func:`summarize`'s afterwards (None without ``nvidia-smi``, or when not
    ``enabled``: a caller not running on the GPU)."""

    def __init__(self, device: int = 0, interval_ms: int = INTERVAL_MS, enabled: bool = True):
        self.device, self.interval_ms, self.enabled = device, interval_ms, enabled
        self.summary: ClockSummary | None = None
        self._proc: subprocess.Popen | None = None
        self._out = None

    def __enter__(self) -> ClockSampler:
        smi = shutil.which("nvidia-smi") if self.enabled else None
        if smi is not None:
            self._out = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed in __exit__)
            self._proc = subprocess.Popen(
                [smi, "-i", str(self.device), f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                 "-lms", str(self.interval_ms)], stdout=self._out, stderr=subprocess.DEVNULL)
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._out.seek(0)
        self.summary = summarize(self._out.read().splitlines())
        self._out.close()
