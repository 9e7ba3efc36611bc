#!/usr/bin/env bash
# Pack the part of an installed/unpacked flashinfer-python package that the SM90 CUTLASS MoE build
# reads (a build input, never committed) into .fi/fi_src.tar.xz (~2.4 MB), for GPU machines without
# network: carry it and point FLASHINFER_SRC_DIR at the unpacked flashinfer/ folder.
# Usage: bash bench/pack_flashinfer_src.sh [DIR containing flashinfer/]   (default: the installed package)
set -euo pipefail
src="${1:-$(python3 -c 'import importlib.util, os; print(os.path.dirname(os.path.dirname(importlib.util.find_spec("flashinfer").origin)))')}"
cd "$(dirname "$0")/.."; mkdir -p .fi
tar cJf .fi/fi_src.tar.xz -C "$src" \
  flashinfer/data/csrc/nv_internal flashinfer/data/csrc/fused_moe/cutlass_backend flashinfer/data/include \
  flashinfer/data/cutlass/include flashinfer/data/cutlass/tools/util/include flashinfer/jit/gemm/cutlass
ls -la .fi/fi_src.tar.xz
