"""The energy the GPU draws while a bench step runs, read from NVML's total-energy counter.

A long loop of large GEMMs runs at the board's power limit: the driver lowers the SM clock until the
board draws no more than that (:mod:`bench.gpu_clocks` shows the clock fall). A layer's time there
is its energy over the limit, so joules per layer tell two implementations, or two tiles, apart on
what bounds them both: a form that multiplies more rows, or moves more bytes, but draws the same
joules runs in the same time at the cap.

    with EnergyMeter() as energy:
        while time.perf_counter() < end or not energy.advanced():
            ...one call of the loop, waited for...
    energy.summary  # {"joules", "seconds", "watts", "limit_watts"}, or None

The counter steps about every 100 ms (on an H200), not at each joule. So the meter starts at one of
its steps, and a caller that keeps running until :meth:`EnergyMeter.advanced` ends at the next
step after its time is up: the joules are then those of whole steps, and the calls counted between
the two are known to within one.

The counter is read through ``pynvml`` (NVIDIA's ``nvidia-ml-py``, in the ``bench`` extra).
Without it, without a GPU, or on a GPU whose counter is not supported, the meter does nothing and
its summary is None.
"""
from __future__ import annotations

import time
from typing import Any, TypedDict


class EnergySummary(TypedDict):
    """What the board drew over a ``with`` block: joules, the block's wall seconds, their mean watts,
    and the board's enforced power limit in watts. A plain dict, so that the bench's JSON rows carry
    it."""
    joules: float
    seconds: float
    watts: float
    limit_watts: float


def nvml_device(index: int = 0) -> tuple[Any, Any] | None:
    """``(pynvml, handle)`` for GPU ``index`` if its energy counter can be read here, else None."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
    except Exception:  # no module, no driver, no GPU, or the counter not supported: no meter
        return None
    return pynvml, handle


def per_layer(summary: EnergySummary | None, layers: int) -> float | None:
    """Joules per layer of a summary taken over ``layers`` layers in all; None without one."""
    return summary["joules"] / layers if summary and layers > 0 else None


def cell(joules_per_layer: float | None, summary: EnergySummary | None) -> str:
    """A table's cell: ``mJ per layer (mean W)``, or "-" without a reading."""
    if joules_per_layer is None or not summary:
        return "-"
    return f"{1e3 * joules_per_layer:.0f} ({summary['watts']:.0f} W)"


class EnergyMeter:
    """Reads GPU ``device``'s energy counter on entering and leaving the ``with`` block; ``summary``
    is what the board drew in between (None without a counter, or when not ``enabled``: a caller not
    running on the GPU). The counter counts the whole board, idle gaps between calls included."""

    def __init__(self, device: int = 0, enabled: bool = True, step_wait_s: float = 1.0):
        self.device, self.enabled, self.step_wait_s = device, enabled, step_wait_s
        self.summary: EnergySummary | None = None
        self._nvml = None
        self._start = (0, 0.0)
        self._mark: int | None = None

    def _millijoules(self) -> int:
        pynvml, handle = self._nvml
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)

    def __enter__(self) -> EnergyMeter:
        self._nvml = nvml_device(self.device) if self.enabled else None
        if self._nvml is not None:
            first, deadline = self._millijoules(), time.perf_counter() + self.step_wait_s
            mj = first
            while mj == first and time.perf_counter() < deadline:  # start at a step of the counter
                mj = self._millijoules()
            self._start = (mj, time.perf_counter())
        return self

    def advanced(self) -> bool:
        """Whether the counter has stepped since this method was first called in the block (True
        without a counter, so that a caller's loop ends on its time alone)."""
        if self._nvml is None:
            return True
        mj = self._millijoules()
        if self._mark is None:
            self._mark = mj
            return False
        return mj != self._mark

    def __exit__(self, *exc) -> None:
        if self._nvml is None:
            return
        mj, t = self._millijoules(), time.perf_counter()
        pynvml, handle = self._nvml
        seconds = t - self._start[1]
        joules = (mj - self._start[0]) / 1e3
        self.summary = EnergySummary(joules=joules, seconds=seconds, watts=joules / seconds if seconds > 0 else 0.0,
                                     limit_watts=pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3)
