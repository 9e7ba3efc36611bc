"""Device kernels of jitted calls, from a ``jax.profiler`` trace, and their attribution to MoE stages.

:func:`trace_calls` runs a list of jitted calls under one ``jax.profiler.trace`` with the host
asleep between calls, reads the trace back with ``jax.profiler.ProfileData`` and returns the
kernels of each call (:class:`Kernel`: name, start, duration), split at the idle gaps. On a GPU
these are the CUDA kernels (and memsets/copies) of the device's stream lines, timed by CUPTI; on
a CPU, where there is no device plane, the XLA CPU runtime's thunks (events with an ``hlo_op``
stat), which lets the same code run in CPU tests.

:func:`attribute` maps one forward's kernels to stages: by name where a kernel is one of
jax_moe's (``STAGE_PATTERNS``: the sort's counting-sort launches, the permute and activation
row kernels, the CUTLASS grouped GEMM and its group-array setup, the un-permute reduce) or a
peer's grouped GEMM (``ragged_dot``), and by position for the rest (XLA fusions and copies): a
kernel before the sort is routing, one between two known stages is "glue". The first grouped GEMM
of a forward is GEMM1 and the one after the activation is GEMM2; where a forward's activation is
an XLA fusion (the peer), GEMM2 is the second GEMM and the fusions between the GEMMs are ``act``.
"""

from __future__ import annotations

import dataclasses
import glob
import re
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import jax

STAGES = ("route", "sort", "permute", "gemm1", "act", "gemm2", "finalize", "setup", "glue")

# name pattern -> stage, first match wins; "gemm" becomes gemm1 or gemm2 by position
STAGE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"ChunkRanks|ScanBuckets|ScanChunks|ScanExperts|\bPlace\b|5Place|SortSmall|WarpRanks", "sort"),
    (r"GatherRow|SlotRow|PermuteToken", "permute"),  # gather order, or by slot or token (permute_rows(inverse=))
    (r"GatedActRow", "act"),
    (r"UnpermuteReduce", "finalize"),
    (r"FillGroupArrays|ZeroUnownedRows|ZeroUnusedBatchedRows|ZeroEmptyGroups", "setup"),
    # ExpertGemv*, ExpertColumns*: the decode path's GEMVs on stored and on transposed weights
    (r"cutlass|GemmUniversal|ragged_dot|device_kernel|ExpertGemv|ExpertColumns", "gemm"),
    (r"^(Memset|Memcpy|memset|memcpy)", "copy"),
)


# a GPU plane's lines that summarize its stream lines rather than hold kernels
DERIVED_LINES = frozenset({"XLA Modules", "XLA Ops", "Steps", "Launch Stats", "Source code", "XLA TraceMe",
                           "Framework Ops", "Framework Name Scope", "TensorFlow Ops", "TensorFlow Name Scope"})


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One device kernel (or copy) of a trace: times in nanoseconds from the trace's start."""

    name: str
    start_ns: float
    duration_ns: float


def kind_of(name: str) -> str:
    """The stage a kernel's name says (``"gemm"`` for either grouped GEMM), or ``"other"``."""
    for pattern, stage in STAGE_PATTERNS:
        if re.search(pattern, name):
            return stage
    return "other"


def _after(kernels: Sequence[Kernel]) -> Iterator[tuple[Kernel, float | None]]:
    """Each kernel in start order, with the latest end of the kernels before it (None for the first)."""
    end = None
    for k in sorted(kernels, key=lambda k: k.start_ns):
        yield k, end
        k_end = k.start_ns + k.duration_ns
        end = k_end if end is None else max(end, k_end)


def exclusive(kernels: Sequence[Kernel]) -> list[tuple[Kernel, float]]:
    """Each kernel, in start order, with the nanoseconds it adds to the time at least one kernel runs:
    its duration less its overlap with the kernels that started before it. Kernels of one stream run
    one after another, and get their durations. A kernel that starts while an earlier one still runs
    (on another stream, or a programmatic dependent launch waiting for its primary) counts from that
    kernel's end. The values sum to :func:`busy_ns`."""
    return [(k, k.duration_ns if end is None else max(0.0, k.start_ns + k.duration_ns - max(k.start_ns, end)))
            for k, end in _after(kernels)]


def busy_ns(kernels: Sequence[Kernel]) -> float:
    """The time at least one of the kernels runs (the union of their intervals)."""
    return sum(ns for _, ns in exclusive(kernels))


def attribute(kernels: Sequence[Kernel], routed: bool = False) -> dict[str, float]:
    """Nanoseconds of one forward's kernels per stage of :data:`STAGES` (see the module note), each
    kernel's :func:`exclusive` time, so that the stages sum to :func:`busy_ns`.

    Kernels that no pattern names (XLA fusions, copies) go by position. In a forward of jax_moe's
    kernels: before the sort they are ``route`` if the call began with the routing (``routed``),
    else ``glue``; after it, ``glue``. In a forward without them (a peer whose only named kernels
    are its GEMMs): before the first GEMM they are ``sort`` (sort and permute in XLA; ``route``
    where ``routed``), between the GEMMs ``act``, after the second ``finalize``."""
    out = {s: 0.0 for s in STAGES}
    ours = any(kind_of(k.name) in ("sort", "permute", "act", "finalize") for k in kernels)
    seen_sort = seen_act = False
    gemms = 0
    for k, ns in exclusive(kernels):
        kind = kind_of(k.name)
        if kind == "gemm":
            gemms += 1
            stage = "gemm2" if (seen_act or gemms > 1) else "gemm1"
        elif kind in ("sort", "permute", "act", "finalize", "setup"):
            stage = kind
            seen_sort |= kind == "sort"
            seen_act |= kind == "act"
        elif ours:
            stage = "route" if (routed and not seen_sort) else "glue"
        else:
            stage = (("route" if routed else "sort"), "act", "finalize")[min(gemms, 2)]
        out[stage] += ns
    return out


def _xplane(log_dir: str) -> str:
    paths = sorted(glob.glob(f"{log_dir}/**/*.xplane.pb", recursive=True))
    if not paths:
        raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {log_dir}")
    return paths[-1]


def read_kernels(path: str) -> list[Kernel]:
    """The device kernels of an ``.xplane.pb`` (GPU stream lines), or, without a GPU plane, the
    CPU runtime's thunk events (those carrying an ``hlo_op`` stat), in time order."""
    data = jax.profiler.ProfileData.from_file(path)
    gpu, cpu = [], []
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            lines = list(plane.lines)
            streams = [ln for ln in lines if ln.name.startswith("Stream")]
            for line in streams or [ln for ln in lines if ln.name not in DERIVED_LINES]:
                gpu += [Kernel(e.name, e.start_ns, e.duration_ns) for e in line.events]
        elif plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for e in line.events:
                    if any(name == "hlo_op" for name, _ in e.stats):
                        cpu.append(Kernel(e.name, e.start_ns, e.duration_ns))
    if not gpu and jax.devices()[0].platform == "gpu":
        print("# trace: no GPU kernels in the trace (CUPTI unavailable?); host events only")
    return sorted(gpu or cpu, key=lambda k: k.start_ns)


def split_calls(kernels: Sequence[Kernel], min_gap_ns: float) -> list[list[Kernel]]:
    """Kernels grouped into calls, in start order: a new group after an idle gap longer than ``min_gap_ns``."""
    groups: list[list[Kernel]] = []
    for k, end in _after(kernels):
        if end is None or k.start_ns - end > min_gap_ns:
            groups.append([])
        groups[-1].append(k)
    return groups


def trace_calls(calls: Sequence[tuple[Callable, tuple]], sleep_s: float = 0.02) -> list[list[Kernel]] | None:
    """Run each ``(fn, args)`` once (already warm: compile first) under one profiler trace, the
    host asleep ``sleep_s`` between calls; the kernels of each call, in order, or None where the
    trace's idle gaps do not split it into exactly one group per call."""
    log_dir = tempfile.mkdtemp(prefix="jax_moe_trace_")
    jax.profiler.start_trace(log_dir)
    try:
        time.sleep(sleep_s)
        for fn, args in calls:
            jax.block_until_ready(fn(*args))
            time.sleep(sleep_s)
    finally:
        jax.profiler.stop_trace()
    groups = split_calls(read_kernels(_xplane(log_dir)), min_gap_ns=0.5 * sleep_s * 1e9)
    if len(groups) != len(calls):
        print(f"# trace: {len(groups)} groups of kernels for {len(calls)} calls: not attributed")
        return None
    return groups


def span_ns(kernels: Sequence[Kernel]) -> float:
    """First kernel's start to last kernel's end."""
    if not kernels:
        return 0.0
    return max(k.start_ns + k.duration_ns for k in kernels) - min(k.start_ns for k in kernels)


def timeline(kernels: Sequence[Kernel]) -> list[tuple[float, float, float, str]]:
    """One call's kernels in start order as (start us from the first kernel's start, idle us before
    it: the gap since every earlier kernel ended, its microseconds, name): where span exceeds busy."""
    rows, t0 = [], None
    for k, end in _after(kernels):
        t0 = k.start_ns if t0 is None else t0
        idle = 0.0 if end is None else max(0.0, k.start_ns - end)
        rows.append(((k.start_ns - t0) / 1e3, idle / 1e3, k.duration_ns / 1e3, k.name))
    return rows


def kernel_table(kernels: Sequence[Kernel], calls: int) -> list[tuple[str, str, float, float]]:
    """(stage kind, name, launches per call, microseconds per call) per distinct kernel name,
    longest first."""
    agg: dict[str, list[float]] = {}
    for k in kernels:
        a = agg.setdefault(k.name, [0, 0.0])
        a[0] += 1
        a[1] += k.duration_ns
    rows = [(kind_of(n), n, c / calls, ns / calls / 1e3) for n, (c, ns) in agg.items()]
    return sorted(rows, key=lambda r: -r[3])
