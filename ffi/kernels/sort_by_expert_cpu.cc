// CPU handler of sort_by_expert: a stable counting sort.
#include <cstdint>
#include <vector>

#include "../common/binding.h"
#include "../common/errors.h"
#include "sort_by_expert.h"

namespace jax_moe {
namespace {

ffi::Error SortByExpertCpu(ffi::Buffer<ffi::S32> ids, ffi::ResultBuffer<ffi::S32> sorted,
                           ffi::ResultBuffer<ffi::S32> inverse, ffi::ResultBuffer<ffi::S32> counts,
                           ffi::ResultBuffer<ffi::S32> offsets, ffi::ResultBuffer<ffi::S32> valid,
                           int64_t num_experts) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  if (num_experts < 1) return InvalidArgument("num_experts must be >= 1");
  if (static_cast<int64_t>(sorted->element_count()) != n || static_cast<int64_t>(inverse->element_count()) != n ||
      static_cast<int64_t>(counts->element_count()) != num_experts ||
      static_cast<int64_t>(offsets->element_count()) != num_experts + 1 || valid->element_count() != 1)
    return InvalidArgument("sort_by_expert: output sizes do not match T*k and num_experts");
  const int32_t* id = ids.typed_data();
  std::vector<int64_t> start(num_experts + 2, 0);  // bucket num_experts holds the invalid ids
  auto bucket = [&](int32_t e) { return (e >= 0 && e < num_experts) ? int64_t(e) : num_experts; };
  for (int64_t i = 0; i < n; ++i) start[bucket(id[i]) + 1]++;
  for (int64_t e = 0; e <= num_experts; ++e) {
    if (e < num_experts) counts->typed_data()[e] = static_cast<int32_t>(start[e + 1]);
    start[e + 1] += start[e];
  }
  for (int64_t e = 0; e <= num_experts; ++e) offsets->typed_data()[e] = static_cast<int32_t>(start[e]);
  valid->typed_data()[0] = static_cast<int32_t>(start[num_experts]);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = start[bucket(id[i])]++;
    sorted->typed_data()[pos] = static_cast<int32_t>(i);
    inverse->typed_data()[i] = static_cast<int32_t>(pos);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_moe

// Binding read off SortByExpertCpu's signature (common/binding.h).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeSortByExpertCpu, jax_moe::SortByExpertCpu,
                              (jax_moe::BindHandler<decltype(&jax_moe::SortByExpertCpu)>("num_experts")));
