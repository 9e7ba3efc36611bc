// The `registrations()` dict of a jax_moe nanobind module: XLA FFI target name -> handler capsule
// (api_version 1; the Python side registers each with jax.ffi.register_ffi_target).
#pragma once

#include <nanobind/nanobind.h>

#include <initializer_list>

namespace jax_moe {

// One FFI target: its name and its handler symbol (XLA_FFI_DEFINE_HANDLER_SYMBOL).
struct FfiTarget {
  template <typename Fn>
  FfiTarget(char const* target_name, Fn* fn) : name(target_name), handler(reinterpret_cast<void*>(fn)) {}
  char const* name;
  void* handler;
};

inline nanobind::dict HandlerCapsules(std::initializer_list<FfiTarget> targets) {
  nanobind::dict d;
  for (FfiTarget const& t : targets) d[t.name] = nanobind::capsule(t.handler);
  return d;
}

}  // namespace jax_moe
