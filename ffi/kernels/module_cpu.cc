// jax_moe._jax_moe_cpu: the CPU XLA FFI handlers, exported as capsules.
#include <nanobind/nanobind.h>

#include "../common/capsules.h"
#include "sort_by_expert.h"

NB_MODULE(_jax_moe_cpu, m) {
  m.def("registrations",
        []() { return jax_moe::HandlerCapsules({{"jax_moe_sort_by_expert", &JaxMoeSortByExpertCpu}}); });
}
