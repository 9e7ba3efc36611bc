// The SM count of a CUDA device, read once per device and process: the launch shapes that aim at one
// wave of blocks (the decode GEMVs) and CUTLASS's persistent schedulers size their grids with it.
#pragma once

#include <cuda_runtime.h>

namespace jax_moe {

// SMs of `device`, or 0 where the runtime cannot say.
inline int SmCount(int device) {
  constexpr int kMaxDevices = 64;
  static int cache[kMaxDevices] = {};  // 0: not asked yet (benign race: every writer stores the same value)
  if (device >= 0 && device < kMaxDevices && cache[device] > 0) return cache[device];
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) return 0;
  if (device >= 0 && device < kMaxDevices) cache[device] = sms;
  return sms;
}

// SMs of the current device, or 0.
inline int CurrentSmCount() {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  return SmCount(device);
}

}  // namespace jax_moe
