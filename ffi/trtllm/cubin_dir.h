// Where the TRT-LLM gen batched-GEMM cubins come from: a plain directory, read on first use.
//
// FlashInfer's batched-GEMM export headers load each kernel through
// flashinfer::trtllm_cubin_loader::getCubin(relative_path, sha256). FlashInfer implements it as a
// callback into Python that downloads into its cache; jax_moe implements it here (cubin_dir.cc)
// as a file read under CubinRoot(), so nothing is fetched at run time and a missing kernel fails
// with the full path it looked for.
//
// CubinRoot(), first that is set and non-empty:
//   1. $JAX_MOE_TRTLLM_CUBIN_DIR
//   2. $FLASHINFER_CUBIN_DIR                       (FlashInfer's own override)
//   3. ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer/cubins   (FlashInfer's cache)
// Relative paths (the build's TLLM_GEN_GEMM_CUBIN_PATH + "/" + kernel name + ".cubin") are
// appended to it.
#pragma once

#include <string>

namespace jax_moe_trtllm {

// The directory cubins are read from (see above); never empty.
std::string CubinRoot();

// The bytes of <CubinRoot()>/<relative_path>. Throws std::runtime_error naming the full path when
// the file is missing, unreadable or empty.
std::string ReadCubin(const std::string& relative_path);

}  // namespace jax_moe_trtllm
