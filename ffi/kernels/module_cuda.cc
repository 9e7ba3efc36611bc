// jax_moe._jax_moe_cuda: the CUDA XLA FFI handlers, exported as capsules, plus build facts.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <string>

#include "../common/capsules.h"
#include "moe_prepare_finalize.h"
#include "route.h"
#include "sort_by_expert.h"
#include "top_k.h"

namespace nb = nanobind;

#ifndef JAX_MOE_CUDA_ARCHS_STR
#define JAX_MOE_CUDA_ARCHS_STR ""
#endif

NB_MODULE(_jax_moe_cuda, m) {
  m.def("registrations", []() {
    return jax_moe::HandlerCapsules({{"jax_moe_sort_by_expert", &JaxMoeSortByExpertCuda},
                                     {"jax_moe_permute_rows", &JaxMoePermuteRowsCuda},
                                     {"jax_moe_act_and_mul", &JaxMoeActAndMulCuda},
                                     {"jax_moe_unpermute_reduce", &JaxMoeUnpermuteReduceCuda},
                                     {"jax_moe_decode_moe", &JaxMoeDecodeMoeCuda},
                                     {"jax_moe_decode_moe_fp8", &JaxMoeDecodeMoeFp8Cuda},
                                     {"jax_moe_top_k", &JaxMoeTopKCuda},
                                     {"jax_moe_route", &JaxMoeRouteCuda}});
  });
  m.def("cuda_archs", []() { return std::string(JAX_MOE_CUDA_ARCHS_STR); });
  m.attr("sort_chunk") = jax_moe::kSortChunk;
  m.attr("fp8_max") = jax_moe::kFp8Max;
  m.attr("top_k_max_n") = jax_moe::kTopKMaxN;
  m.attr("route_max_k") = jax_moe::kRouteMaxK;
  m.attr("route_max_groups") = jax_moe::kRouteMaxGroups;
  m.attr("fp8_min_scale") = jax_moe::kFp8MinScale;
}
