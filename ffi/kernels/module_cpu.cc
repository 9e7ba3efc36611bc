// jax_moe._jax_moe_cpu: the CPU XLA FFI handlers, exported as capsules, and the decode kernels' launch
// rules (decode_launch.h: plain C++, so that tests specify them with no GPU).
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <cstdint>

#include "../common/capsules.h"
#include "decode_launch.h"
#include "sort_by_expert.h"

namespace nb = nanobind;

namespace {

nb::dict LaunchDict(const jax_moe::decode::Launch& l) {
  nb::dict d;
  d["kernel"] = std::string(l.kernel);
  d["vecs"] = l.vecs;
  d["depth"] = l.depth;
  d["outputs_per_warp"] = l.outputs_per_warp;
  d["grid"] = nb::make_tuple(l.grid.x, l.grid.y);
  d["threads"] = l.threads;
  return d;
}

}  // namespace

NB_MODULE(_jax_moe_cpu, m) {
  m.def("registrations",
        []() { return jax_moe::HandlerCapsules({{"jax_moe_sort_by_expert", &JaxMoeSortByExpertCpu}}); });
  m.def(
      "decode_launches",
      [](int64_t t, int64_t k, int64_t h, int64_t i, bool fp8, bool transposed, int sms) {
        const auto plan = jax_moe::decode::PlanDecode(t, k, h, i, fp8, transposed, sms);
        nb::dict d;
        d["gemm1"] = LaunchDict(plan.gemm1);
        d["gemm2"] = LaunchDict(plan.gemm2);
        return d;
      },
      nb::arg("t"), nb::arg("k"), nb::arg("h"), nb::arg("i"), nb::arg("fp8"), nb::arg("transposed"), nb::arg("sms"));
}
