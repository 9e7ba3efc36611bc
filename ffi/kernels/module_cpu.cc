// jax_moe._jax_moe_cpu: the CPU XLA FFI handlers, exported as capsules.
#include <nanobind/nanobind.h>

#include "sort_by_expert.h"

namespace nb = nanobind;

NB_MODULE(_jax_moe_cpu, m) {
  m.def("registrations", []() {
    nb::dict d;
    d["jax_moe_sort_by_expert"] = nb::capsule(reinterpret_cast<void*>(&JaxMoeSortByExpertCpu));
    return d;
  });
}
