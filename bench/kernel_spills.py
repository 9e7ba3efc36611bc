"""Registers and spills of the cutlass backend's grouped-GEMM kernels, read from ptxas without a GPU.

A kernel that spills moves registers through local memory on every tile it runs. On an H200 the
192-row tile's GEMM1 ran 2-3% faster once a branch it never took stopped costing it registers (its
spill stores fell from 324 to 32 bytes; bench/RESULTS.md, forty-fourth session). This compiles
one (kind, tile) instantiation per translation unit for sm_90a, with the package's Release flags
(``-O3 -DNDEBUG``: CUTLASS's asserts compiled out, as they are in the installed kernels) and
``-Xptxas -v``. It reads back the grouped GEMM kernel's registers, stack frame and spill bytes.
Where ``cuobjdump`` is found (``--cuobjdump``, or on PATH) with its ``nvdisasm`` (beside it or on
PATH), it also counts the local loads and stores (LDL, STL) in the kernel's SASS::

    python bench/kernel_spills.py --kinds fp8_act bf16_act_kn --tiles coop_192x256 coop_128x256_c1

Kinds are the cutlass backend's names (``jax_moe.backends.cutlass_gemm``: ``bf16``, ``fp8_act``,
``bf16_kn_scatter``...), tiles those of ``jax_moe.backends.cutlass_tiles.TILES``. A tile that a kind
runs as another (``coop_192x256`` outside the act kinds, ``pingpong_192x128`` outside the scatter
kinds) compiles as that other. It needs nvcc (12.8 or later), CUTLASS's headers (``CUTLASS_DIR``,
or the ``nvidia-cutlass`` package) and jaxlib's FFI headers. One instantiation takes 1-3 minutes on
two cores (``--jobs`` runs several at once).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jax_moe.backends.cutlass_gemm import ACT_KINDS, GRAD_KINDS, KINDS, SCATTER_KINDS  # noqa: E402
from jax_moe.backends.cutlass_tiles import TILES  # noqa: E402

# The grouped GEMM's own kernel among a TU's entry functions (the setup launch is FillGroupArrays).
GEMM_KERNEL = "GemmUniversal"
NVCC_FLAGS = ("-std=c++17", "-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
              "-diag-suppress=940,2473", "-Xptxas", "-v")


def kind_ids() -> dict[str, int]:
    """The backend's kind name -> its CutlassGemmKind (ffi/cutlass/grouped_gemm.h)."""
    ids = {name: v[0] for table in (KINDS, ACT_KINDS, SCATTER_KINDS, GRAD_KINDS) for name, v in table.items()}
    return dict(sorted(ids.items(), key=lambda kv: kv[1]))


def translation_unit(kind: int, tile: int) -> str:
    """The source of a TU that instantiates grouped GEMM ``kind`` on ``tile`` (both as numbered in
    ffi/cutlass/grouped_gemm.h), as ffi/cutlass/grouped_gemm_kind.cu instantiates them all."""
    return ("#define JAX_MOE_CUTLASS_IMPL 1\n#include \"grouped_gemm_impl.cuh\"\n"
            f"namespace jax_moe::cutlass_gg {{\nJAX_MOE_INSTANTIATE_CUTLASS_GEMM({kind}, {tile})\n}}\n")


@dataclasses.dataclass
class Usage:
    """One entry function's resources as ptxas reports them; bytes per thread."""

    function: str
    registers: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0


_PROPS = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")


def parse_ptxas(text: str) -> list[Usage]:
    """Each function of ``ptxas -v``'s report: its properties line, then its frame and register lines."""
    out: list[Usage] = []
    for line in text.splitlines():
        if m := _PROPS.search(line):
            out.append(Usage(m.group(1)))
        elif out and (m := _FRAME.search(line)):
            out[-1].stack, out[-1].spill_stores, out[-1].spill_loads = (int(g) for g in m.groups())
        elif out and (m := _USED.search(line)):
            out[-1].registers = int(m.group(1))
    return out


def local_ops(sass: str, function_part: str = GEMM_KERNEL) -> tuple[int, int]:
    """(STL, LDL): the local stores and loads in the SASS of the functions whose name holds
    ``function_part``, in ``cuobjdump -sass`` output."""
    stores = loads = 0
    inside = False
    for line in sass.splitlines():
        if "Function : " in line:
            inside = function_part in line
        elif inside:
            op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
            if op and op.group(1) == "STL":
                stores += 1
            elif op and op.group(1) == "LDL":
                loads += 1
    return stores, loads


def cutlass_dir() -> str:
    """CUTLASS's source root (include/ and tools/util/include/): CUTLASS_DIR, else the nvidia-cutlass
    package's copy, as cmake/cutlass_gemm.cmake looks them up."""
    cands = [os.environ.get("CUTLASS_DIR", "")]
    spec = importlib.util.find_spec("cutlass_library")
    if spec and spec.submodule_search_locations:
        cands.append(os.path.join(list(spec.submodule_search_locations)[0], "source"))
    for c in cands:
        if c and os.path.exists(os.path.join(c, "include", "cutlass", "gemm", "group_array_problem_shape.hpp")):
            return c
    raise SystemExit("kernel_spills: no CUTLASS headers: set CUTLASS_DIR to a CUTLASS checkout, or "
                     "pip install nvidia-cutlass")


def ffi_include_dir() -> str:
    import jax  # noqa: PLC0415  (only to find jaxlib's headers)

    return jax.ffi.include_dir()


def compile_one(kind: str, tile: str, *, nvcc: str, cutlass: str, ffi_inc: str, cuobjdump: str | None,
                workdir: str) -> tuple[Usage | None, tuple[int, int] | None, str]:
    """Compiles one (kind, tile) TU; returns the GEMM kernel's usage (None where ptxas named none),
    its (STL, LDL) from the SASS where cuobjdump is given, and ptxas's report (or the compiler's
    errors)."""
    tu = os.path.join(workdir, f"{kind}_{tile}.cu")
    obj = tu[:-3] + ".o"
    with open(tu, "w") as f:
        f.write(translation_unit(kind_ids()[kind], TILES[tile]))
    cmd = [nvcc, *NVCC_FLAGS, "-c", tu, "-o", obj, f"-I{ROOT}/ffi/cutlass", f"-I{ROOT}/ffi", f"-I{ffi_inc}",
           "-isystem", f"{cutlass}/include", "-isystem", f"{cutlass}/tools/util/include"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    report = run.stdout + run.stderr
    with open(tu[:-3] + ".ptxas.txt", "w") as f:
        f.write(report)
    if run.returncode != 0:
        return None, None, report
    usage = next((u for u in parse_ptxas(report) if GEMM_KERNEL in u.function), None)
    ops = None
    if cuobjdump:
        env = dict(os.environ, PATH=os.pathsep.join(filter(None, (nvdisasm_dir(cuobjdump), os.environ.get("PATH")))))
        dump = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True, env=env)
        if dump.returncode == 0:
            ops = local_ops(dump.stdout)
        else:  # the pair keeps its ptxas figures; its STL and LDL read "-"
            report += f"\n{cuobjdump} -sass {obj} failed: {dump.stderr.strip()}\n"
    return usage, ops, report


def nvdisasm_dir(cuobjdump: str) -> str | None:
    """The folder of the ``nvdisasm`` that ``cuobjdump -sass`` runs: beside ``cuobjdump`` (the
    nvidia-cuda-nvdisasm and nvidia-cuda-cuobjdump packages unpack into one ``bin``), else on PATH;
    None where there is none."""
    beside = os.path.join(os.path.dirname(os.path.abspath(cuobjdump)), "nvdisasm")
    if os.access(beside, os.X_OK):
        return os.path.dirname(beside)
    found = shutil.which("nvdisasm")
    return os.path.dirname(found) if found else None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kinds", nargs="+", required=True, choices=list(kind_ids()))
    p.add_argument("--tiles", nargs="+", required=True, choices=list(TILES))
    p.add_argument("--nvcc", default=shutil.which("nvcc"))
    p.add_argument("--cuobjdump", default=shutil.which("cuobjdump"),
                   help="counts LDL and STL in the SASS where given (the nvidia-cuda-cuobjdump package has one; "
                        "it needs nvdisasm beside it or on PATH, from nvidia-cuda-nvdisasm)")
    p.add_argument("--jobs", type=int, default=1, help="instantiations compiled at once (each takes 3-4 GB)")
    p.add_argument("--keep", help="a folder to keep the TUs, objects and ptxas reports in")
    args = p.parse_args(argv)
    if not args.nvcc:
        p.error("no nvcc on PATH: pass --nvcc")
    if args.cuobjdump and nvdisasm_dir(args.cuobjdump) is None:
        p.error(f"--cuobjdump {args.cuobjdump} needs nvdisasm, beside it or on PATH (the nvidia-cuda-nvdisasm "
                "package has one); pass --cuobjdump '' to read ptxas's figures alone")
    cutlass, ffi_inc = cutlass_dir(), ffi_include_dir()
    workdir = args.keep or tempfile.mkdtemp(prefix="kernel_spills_")
    os.makedirs(workdir, exist_ok=True)
    pairs = [(k, t) for k in args.kinds for t in args.tiles]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(compile_one, k, t, nvcc=args.nvcc, cutlass=cutlass, ffi_inc=ffi_inc,
                               cuobjdump=args.cuobjdump, workdir=workdir) for k, t in pairs]
        results = [f.result() for f in futures]
    print("| kind | tile | registers | stack bytes | spill stores | spill loads | STL | LDL |")
    print("|---|---|---|---|---|---|---|---|")
    failed = 0
    for (kind, tile), (usage, ops, report) in zip(pairs, results):
        if usage is None:
            failed += 1
            print(f"| {kind} | {tile} | failed | | | | | |")
            print(report[-2000:], file=sys.stderr)
            continue
        stl, ldl = ops if ops else ("-", "-")
        if ops is None and args.cuobjdump:
            print(report.rstrip().splitlines()[-1], file=sys.stderr)
        print(f"| {kind} | {tile} | {usage.registers} | {usage.stack} | {usage.spill_stores} | {usage.spill_loads} "
              f"| {stl} | {ldl} |")
    if args.keep:
        print(f"\nTUs, objects and reports in {workdir}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
