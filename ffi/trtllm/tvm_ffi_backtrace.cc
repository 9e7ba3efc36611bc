// The one TVM-FFI runtime symbol libjax_moe_trtllm.so needs. FlashInfer's custom-routing kernels
// (fused_moe/trtllm_backend/trtllm_fused_moe_routing_custom.cuh) check their arguments with
// TVM_FFI_ICHECK; everything it throws (tvm::ffi::Error, a std::exception whose what() is the
// message) is header-only except the backtrace text, which it asks libtvm_ffi.so for through
// TVMFFIBacktrace. jax_moe does not load libtvm_ffi, so the library defines it here, hidden (only
// this library's own calls bind to it; a libtvm_ffi loaded by something else in the process is
// untouched), returning an empty backtrace: the handler turns the error's message into an XLA error.
//
// Signature as in tvm/ffi/c_api.h (apache-tvm-ffi 0.1):
//   const TVMFFIByteArray* TVMFFIBacktrace(const char* filename, int lineno, const char* func,
//                                          int cross_ffi_boundary);
// TVMFFIByteArray is {const char* data; size_t size;}. c_api.h is not included: its declaration has
// default visibility, which would override the hidden one.

#include <cstddef>

namespace {
struct ByteArray {  // layout of TVMFFIByteArray
  const char* data;
  std::size_t size;
};
}  // namespace

extern "C" __attribute__((visibility("hidden"))) const void* TVMFFIBacktrace(
    const char* /*filename*/, int /*lineno*/, const char* /*func*/, int /*cross_ffi_boundary*/) {
  static const ByteArray kEmpty{"", 0};
  return &kEmpty;
}
