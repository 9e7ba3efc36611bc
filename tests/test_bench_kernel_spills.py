"""bench/kernel_spills.py: registers and spills of the grouped-GEMM kernels, read from ptxas and cuobjdump."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PTXAS = """\
ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function '_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIXEEEvNT_6ParamsE' for 'sm_90a'
ptxas info    : Function properties for _ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIXEEEvNT_6ParamsE
    32 bytes stack frame, 32 bytes spill stores, 48 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 32 bytes cumulative stack size
ptxas info    : Compiling entry function '_ZN7jax_moe10cutlass_gg15FillGroupArraysIXEEvv' for 'sm_90a'
ptxas info    : Function properties for _ZN7jax_moe10cutlass_gg15FillGroupArraysIXEEvv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 35 registers, used 1 barriers, 384 bytes smem
"""

SASS = """\
\t\tFunction : _ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalIXEEEvNT_6ParamsE
        /*3120*/                   LDL R9, [R1+0x68] ;                     /* 0x0000680001097983 */
        /*3130*/                   STL [R1+0x38], R222 ;                   /* 0x000038de01007387 */
        /*3140*/               @P1 STL [R1+0x48], R223 ;                   /* 0x000048df01001387 */
        /*3150*/                   LDL.LU.64 R6, [R1+0x80] ;               /* 0x0000800001067983 */
        /*3160*/                   FFMA R0, R1, R2, R3 ;                   /* 0x0000000201007223 */
\t\tFunction : _ZN7jax_moe10cutlass_gg15FillGroupArraysIXEEvv
        /*0010*/                   STL [R1], R2 ;                          /* 0x0000000201007387 */
"""


@pytest.fixture
def kernel_spills(monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    from bench import kernel_spills

    return kernel_spills


def test_ptxas_report_gives_each_functions_registers_stack_and_spill_bytes(kernel_spills):
    gemm, setup = kernel_spills.parse_ptxas(PTXAS)
    assert kernel_spills.GEMM_KERNEL in gemm.function and "FillGroupArrays" in setup.function
    assert (gemm.registers, gemm.stack, gemm.spill_stores, gemm.spill_loads) == (168, 32, 32, 48)
    assert (setup.registers, setup.spill_stores) == (35, 0)


def test_local_loads_and_stores_are_counted_in_the_gemm_kernels_sass_only(kernel_spills):
    assert kernel_spills.local_ops(SASS) == (2, 2)  # a predicated STL counts; the setup launch's does not


def test_a_translation_unit_instantiates_one_kind_on_one_tile_as_the_build_does(kernel_spills):
    src = kernel_spills.translation_unit(6, 6)
    assert "#define JAX_MOE_CUTLASS_IMPL 1" in src and '#include "grouped_gemm_impl.cuh"' in src
    assert "JAX_MOE_INSTANTIATE_CUTLASS_GEMM(6, 6)" in src and "namespace jax_moe::cutlass_gg" in src


def test_every_kind_of_the_native_enum_has_its_backend_name(kernel_spills):
    with open(os.path.join(ROOT, "ffi", "cutlass", "grouped_gemm.h")) as f:
        header = f.read()
    enum = header[header.index("enum CutlassGemmKind"):]
    enum = enum[:enum.index("};")]
    values = {int(v) for name, v in re.findall(r"(kGemm\w+) = (\d+)", enum)}
    count = int(re.search(r"kNumCutlassGemmKinds = (\d+)", enum).group(1))
    assert values == set(range(count)) == set(kernel_spills.kind_ids().values())


def test_nvdisasm_is_found_beside_cuobjdump_before_path(kernel_spills, tmp_path, monkeypatch):
    tools, path = tmp_path / "bin", tmp_path / "path"
    tools.mkdir(), path.mkdir()
    for exe in (tools / "cuobjdump", tools / "nvdisasm", path / "nvdisasm"):
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(path))
    assert kernel_spills.nvdisasm_dir(str(tools / "cuobjdump")) == str(tools)
    (tools / "nvdisasm").unlink()
    assert kernel_spills.nvdisasm_dir(str(tools / "cuobjdump")) == str(path)
    (path / "nvdisasm").unlink()
    assert kernel_spills.nvdisasm_dir(str(tools / "cuobjdump")) is None


def test_a_cuobjdump_without_nvdisasm_is_refused_before_anything_compiles(kernel_spills, tmp_path, monkeypatch,
                                                                          capsys):
    cuobjdump = tmp_path / "cuobjdump"
    cuobjdump.write_text("#!/bin/sh\n")
    cuobjdump.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    monkeypatch.setattr(kernel_spills, "compile_one", lambda *a, **k: pytest.fail("compiled"))
    with pytest.raises(SystemExit):
        kernel_spills.main(["--kinds", "bf16", "--tiles", "coop_128x128", "--nvcc", "/bin/true",
                            "--cuobjdump", str(cuobjdump)])
    assert "needs nvdisasm" in capsys.readouterr().err


def test_a_failed_sass_dump_keeps_the_pairs_ptxas_figures(kernel_spills, tmp_path):
    report = tmp_path / "ptxas.txt"
    report.write_text(PTXAS)
    nvcc, cuobjdump = tmp_path / "nvcc", tmp_path / "cuobjdump"
    nvcc.write_text(f"#!/bin/sh\ncat {report} >&2\n")
    cuobjdump.write_text("#!/bin/sh\necho 'cannot run nvdisasm' >&2\nexit 1\n")
    for exe in (nvcc, cuobjdump):
        exe.chmod(0o755)
    usage, ops, text = kernel_spills.compile_one("bf16", "coop_128x128", nvcc=str(nvcc), cutlass="/none",
                                                 ffi_inc="/none", cuobjdump=str(cuobjdump), workdir=str(tmp_path))
    assert (usage.registers, usage.spill_stores, ops) == (168, 32, None)
    assert text.rstrip().endswith("failed: cannot run nvdisasm")


def test_a_translation_unit_compiles_as_the_packages_release_build_does(kernel_spills):
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        assert 'cmake.build-type = "Release"' in f.read()  # CMake's Release flags for CUDA: -O3 -DNDEBUG
    assert {"-O3", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a"} <= set(kernel_spills.NVCC_FLAGS)
