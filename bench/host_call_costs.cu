// The host's cost of each CUDA call that a grouped-GEMM FFI handler makes per call, in ns (median over
// 400 calls, the stream drained every 64): CUTLASS's per-call parameter set-up (a driver entry-point
// lookup and a TMA descriptor encode per operand, the kernel's shared-memory attribute) against the
// launches themselves. No JAX; on the GPU machine:
//   nvcc -O2 -std=c++17 -arch=sm_90a bench/host_call_costs.cu -o /tmp/host_call_costs && /tmp/host_call_costs
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

struct Params256 { char b[256]; };    // a small kernel's parameters
struct Params1536 { char b[1536]; };  // about a CUTLASS grouped GEMM's (with its TMA descriptors)
__global__ void SmallParams(Params256 p) { if (p.b[threadIdx.x] == 123) printf("x"); }
__global__ void LargeParams(Params1536 p) { if (p.b[threadIdx.x] == 123) printf("x"); }
__global__ void LargeSmem() { extern __shared__ char s[]; if (threadIdx.x == 999) s[0] = 1; }

template <class F>
double MedianNs(F f, int reps = 400) {
  std::vector<double> t;
  t.reserve(reps);
  for (int i = 0; i < reps; ++i) {
    const auto a = std::chrono::steady_clock::now();
    f();
    const auto b = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::nano>(b - a).count());
    if (i % 64 == 63) cudaDeviceSynchronize();  // keep the launch queue short
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  cudaFree(nullptr);
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  void* buf = nullptr;
  cudaMalloc(&buf, 1 << 24);
  constexpr int kSmem = 200 * 1024;

  cudaDriverEntryPointQueryResult found;
  void* encode = nullptr;
  std::printf("| call | ns |\n|---|---|\n");
  std::printf("| cudaGetDriverEntryPointByVersion(cuTensorMapEncodeTiled) | %.0f |\n", MedianNs([&] {
    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &encode, 12000, cudaEnableDefault, &found);
  }));
  auto encode_tiled = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(encode);
  CUtensorMap map;
  cuuint64_t dims[3] = {1, 1, 1};
  cuuint64_t strides[2] = {16, 16};
  cuuint32_t box[3] = {64, 64, 1}, elem_strides[3] = {1, 1, 1};
  CUresult encoded = CUDA_SUCCESS;
  std::printf("| cuTensorMapEncodeTiled (bf16, 64x64 box, 128B swizzle) | %.0f |\n", MedianNs([&] {
    encoded = encode_tiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, buf, dims, strides, box, elem_strides,
                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  }));
  std::printf("| cudaFuncSetAttribute(max dynamic shared memory) | %.0f |\n", MedianNs([&] {
    cudaFuncSetAttribute(LargeSmem, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  }));
  int device = 0;
  std::printf("| cudaGetDevice | %.0f |\n", MedianNs([&] { cudaGetDevice(&device); }));
  int blocks = 0;
  std::printf("| cudaOccupancyMaxActiveBlocksPerMultiprocessor | %.0f |\n", MedianNs([&] {
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, LargeSmem, 384, kSmem);
  }));
  Params256 small{};
  Params1536 large{};
  std::printf("| launch: 128 blocks of 128, 256 B of parameters | %.0f |\n",
              MedianNs([&] { SmallParams<<<128, 128, 0, stream>>>(small); }));
  std::printf("| launch: 132 blocks of 384, 1536 B of parameters | %.0f |\n",
              MedianNs([&] { LargeParams<<<132, 384, 0, stream>>>(large); }));
  std::printf("| launch: 132 blocks of 384, 200 KB of shared memory | %.0f |\n",
              MedianNs([&] { LargeSmem<<<132, 384, kSmem, stream>>>(); }));
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(132);
  config.blockDim = dim3(384);
  config.dynamicSmemBytes = kSmem;
  config.stream = stream;
  cudaLaunchAttribute cluster[1];
  cluster[0].id = cudaLaunchAttributeClusterDimension;
  cluster[0].val.clusterDim.x = cluster[0].val.clusterDim.y = cluster[0].val.clusterDim.z = 1;
  config.attrs = cluster;
  config.numAttrs = 1;
  std::printf("| cudaLaunchKernelEx with a 1x1x1 cluster, 200 KB of shared memory | %.0f |\n",
              MedianNs([&] { cudaLaunchKernelEx(&config, LargeSmem); }));
  std::printf("| cudaMemsetAsync, 1 MB | %.0f |\n", MedianNs([&] { cudaMemsetAsync(buf, 0, 1 << 20, stream); }));
  cudaDeviceSynchronize();
  const cudaError_t err = cudaGetLastError();
  std::printf("# encode: %d, CUDA: %s\n", static_cast<int>(encoded), cudaGetErrorString(err));
  return err == cudaSuccess && encoded == CUDA_SUCCESS ? 0 : 1;
}
