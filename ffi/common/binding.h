// The XLA FFI binding of a handler, read off the handler's own signature, so that a binding cannot
// drift from the function it decodes into and the repeated Bind() blocks are written once:
//
//   BindHandler<decltype(&Impl), Ctx...>(attr names...)
//
// for Impl(C..., Operands..., Attrs...) is ffi::Ffi::Bind() with, in order,
//   .Ctx<Ctx>()        for each context tag given (one per leading parameter C: e.g.
//                      ffi::PlatformStream<cudaStream_t> for a cudaStream_t, ffi::DeviceOrdinal
//                      for an int32_t device),
//   .Arg<T>()          for each operand parameter of type T (ffi::AnyBuffer, ffi::Buffer<...>),
//   .Ret<T>()          for each operand parameter of type ffi::Result<T>,
//   .Attr<A>(name)     for each of the last sizeof...(names) parameters (type A), named in order.
// The result is the same type as the hand-written chain, so the positional contract with the
// Python side is the handler's parameter list. Pass it to XLA_FFI_DEFINE_HANDLER_SYMBOL in
// parentheses (the template arguments hold commas).
#pragma once

#include <cstddef>
#include <tuple>
#include <type_traits>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jax_moe {
namespace binding {

namespace ffi = xla::ffi;

// One step of the chain each: Binding methods are rvalue-qualified and Binding is not movable from
// outside, so the chain is built as a single fold over prvalues (no intermediate is ever named).
template <typename T>
struct CtxStep {};
template <typename T>
struct OperandStep {};
template <typename T>
struct AttrStep {
  char const* name;
};

template <typename B, typename T>
auto operator|(B&& b, CtxStep<T>) {
  return std::move(b).template Ctx<T>();
}
template <typename B, typename T>
auto operator|(B&& b, OperandStep<T>) {
  return std::move(b).template Arg<T>();
}
template <typename B, typename T>
auto operator|(B&& b, OperandStep<ffi::Result<T>>) {
  return std::move(b).template Ret<T>();
}
template <typename B, typename T>
auto operator|(B&& b, AttrStep<T> a) {
  return std::move(b).template Attr<T>(a.name);
}

template <typename Fn, typename... Ctx>
struct Signature;

template <typename... P, typename... Ctx>
struct Signature<ffi::Error (*)(P...), Ctx...> {
  using Params = std::tuple<P...>;
  static constexpr size_t kCtx = sizeof...(Ctx);

  template <size_t... O, size_t... A>
  static auto Bind(char const* const* names, std::index_sequence<O...>, std::index_sequence<A...>) {
    constexpr size_t kFirstAttr = kCtx + sizeof...(O);
    return (((ffi::Ffi::Bind() | ... | CtxStep<Ctx>{}) | ... |
             OperandStep<std::tuple_element_t<kCtx + O, Params>>{}) | ... |
            AttrStep<std::tuple_element_t<kFirstAttr + A, Params>>{names[A]});
  }
};

}  // namespace binding

template <typename Fn, typename... Ctx, typename... Names>
auto BindHandler(Names... attr_names) {
  using S = binding::Signature<Fn, Ctx...>;
  constexpr size_t kParams = std::tuple_size_v<typename S::Params>;
  static_assert(kParams >= S::kCtx + sizeof...(Names), "more contexts and attributes than parameters");
  char const* const names[sizeof...(Names) > 0 ? sizeof...(Names) : 1] = {attr_names...};
  return S::Bind(names, std::make_index_sequence<kParams - S::kCtx - sizeof...(Names)>{},
                 std::make_index_sequence<sizeof...(Names)>{});
}

}  // namespace jax_moe

// XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, impl) for a CUDA handler whose one context is its stream
// (impl's first parameter, a cudaStream_t), command-buffer compatible; the attribute names follow.
#define JAX_MOE_DEFINE_CUDA_HANDLER(symbol, impl, ...)                                                 \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(                                                                       \
      symbol, impl,                                                                                    \
      (::jax_moe::BindHandler<decltype(&impl), ::xla::ffi::PlatformStream<cudaStream_t>>(__VA_ARGS__)), \
      {::xla::ffi::Traits::kCmdBufferCompatible})
