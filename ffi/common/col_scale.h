// The forms of a weight's float32 column scales, one definition for every handler that reads them:
// per channel [E, N], per expert [E, 1] and per tensor [1, 1], for E experts of N output columns.
#pragma once

#include <cstdint>

namespace jax_moe {

enum class ColScaleForm { kNone, kPerChannel, kPerExpert, kPerTensor };

// The form of a scale with dimensions d, the first that matches taken (with one expert and N = 1 they
// coincide); kNone where none does.
template <typename Dims>
ColScaleForm ColScaleFormOf(const Dims& d, int64_t experts, int64_t n) {
  if (d.size() != 2) return ColScaleForm::kNone;
  if (d[0] == experts && d[1] == n) return ColScaleForm::kPerChannel;
  if (d[0] == experts && d[1] == 1) return ColScaleForm::kPerExpert;
  if (d[0] == 1 && d[1] == 1) return ColScaleForm::kPerTensor;
  return ColScaleForm::kNone;
}

// The step from one expert's scales to the next: n per channel, 1 per expert, 0 per tensor.
inline int64_t ColScaleExpertStep(ColScaleForm form, int64_t n) {
  return form == ColScaleForm::kPerChannel ? n : form == ColScaleForm::kPerExpert ? 1 : 0;
}

}  // namespace jax_moe
