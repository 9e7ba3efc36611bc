// How fast a GEMM's weight tiles stream from DRAM through the TMA unit, by weight layout, with no
// multiplies: the question is whether the layout of the expert weights, and not the GEMM, bounds the
// rate at which a weight-streaming grouped GEMM (GEMM1 at T=4096) reads them.
//
// One persistent CTA per SM, one thread issuing loads: the CTAs take the (expert, 256-column tile)
// pairs in turn (tile i to CTA i % SMs, in expert-major order, as the grouped GEMM's scheduler deals
// them), and each walks its tile's K in 64-row stages of 64 x 256 bf16 (32 KiB), `stages` stages in
// flight through an mbarrier ring, each reused as soon as it lands. Layouts of w, E x [K, N] bf16:
//   kn:        [E, K, N], N contiguous (the backend's prepared layout): four 64x64 TMA boxes (128-byte
//              swizzle, as CUTLASS loads an N-major operand) per stage, rows N * 2 bytes apart;
//   kn_wide:   the same array, one 256x64 box per stage without swizzle (512-byte rows);
//   blocked:   [E, N/256, K, 256]: each stage's 32 KiB contiguous, loaded as four 64x64 swizzled boxes;
//   blocked1d: the same array, one 32 KiB bulk copy per stage;
//   tiled:     [E, N/256, K/64, 4, 64, 64]: each stage's 32 KiB contiguous, and each of its four 64x64
//              swizzled boxes 8 KiB contiguous (the order of the stage's image in shared memory).
// Prints each layout's rate (median of `reps` timed runs after warm-up), in alternating rounds.
//   nvcc -O3 -gencode=arch=compute_90a,code=sm_90a -std=c++17 bench/weight_stream_probe.cu -o /tmp/wsp
//   /tmp/wsp gptoss|deepseek|qwen3 [stages [reps]]
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#define CK(x)                                                                          \
  do {                                                                                 \
    cudaError_t e_ = (x);                                                              \
    if (e_ != cudaSuccess) {                                                           \
      printf("CUDA %s at line %d\n", cudaGetErrorString(e_), __LINE__);                \
      exit(1);                                                                         \
    }                                                                                  \
  } while (0)

constexpr int kStageBytes = 64 * 256 * 2;
constexpr int kLayouts = 5;
enum Layout { kKn = 0, kKnWide = 1, kBlocked = 2, kBlocked1d = 3, kTiled = 4 };
const char* kNames[] = {"kn", "kn_wide", "blocked", "blocked1d", "tiled"};

__device__ __forceinline__ uint32_t Smem(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void Tma2d(const CUtensorMap* map, uint32_t dst, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(
          dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}

__global__ void __launch_bounds__(32) Stream(const __grid_constant__ CUtensorMap map, const uint8_t* w, int layout,
                                             int experts, int n_tiles, int k, int stages, unsigned long long* sink) {
  extern __shared__ __align__(1024) uint8_t smem[];
  __shared__ __align__(8) uint64_t bars[16];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < stages; ++s)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(Smem(&bars[s])) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");

  const int k_blocks = k / 64;
  const long long tiles = static_cast<long long>(experts) * n_tiles;
  // This CTA's loads in order: (tile, k block) for tile = blockIdx.x, + gridDim.x, ...
  const long long my_tiles = tiles > blockIdx.x ? (tiles - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
  const long long total = my_tiles * k_blocks;
  auto issue = [&](long long i) {
    const long long tile = blockIdx.x + (i / k_blocks) * gridDim.x;
    const int kb = static_cast<int>(i % k_blocks);
    const int e = static_cast<int>(tile / n_tiles), j = static_cast<int>(tile % n_tiles);
    const int s = static_cast<int>(i % stages);
    const uint32_t dst = Smem(smem + static_cast<size_t>(s) * kStageBytes), bar = Smem(&bars[s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(kStageBytes) : "memory");
    if (layout == kKn) {
      for (int c = 0; c < 4; ++c) Tma2d(&map, dst + c * 8192, bar, j * 256 + c * 64, e * k + kb * 64);
    } else if (layout == kKnWide) {
      Tma2d(&map, dst, bar, j * 256, e * k + kb * 64);
    } else if (layout == kBlocked) {
      const int row = (e * n_tiles + j) * k + kb * 64;
      for (int c = 0; c < 4; ++c) Tma2d(&map, dst + c * 8192, bar, c * 64, row);
    } else if (layout == kTiled) {
      const int row = (((e * n_tiles + j) * k_blocks + kb) * 4) * 64;
      for (int c = 0; c < 4; ++c) Tma2d(&map, dst + c * 8192, bar, 0, row + c * 64);
    } else {
      const uint8_t* src = w + ((static_cast<size_t>(e) * n_tiles + j) * k + kb * 64) * 512;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
          "l"(src), "r"(kStageBytes), "r"(bar)
          : "memory");
    }
  };
  for (long long i = 0; i < stages && i < total; ++i) issue(i);
  unsigned long long acc = 0;
  for (long long i = 0; i < total; ++i) {
    const int s = static_cast<int>(i % stages);
    const uint32_t parity = static_cast<uint32_t>((i / stages) & 1);
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
          : "=r"(done)
          : "r"(Smem(&bars[s])), "r"(parity)
          : "memory");
    }
    acc += smem[static_cast<size_t>(s) * kStageBytes + (i & 1023)];
    if (i + stages < total) issue(i + stages);
  }
  if (acc == 0x7fffffffffffffffull) *sink = acc;  // keeps the reads
}

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

int main(int argc, char** argv) {
  const std::string model = argc > 1 ? argv[1] : "gptoss";
  const int stages = argc > 2 ? atoi(argv[2]) : 4;
  const int reps = argc > 3 ? atoi(argv[3]) : 11;
  // GEMM1's weights: E experts of [K = H, N = 2I], N rounded down to whole 256-column tiles.
  int experts = 128, k = 2880, n = 5632;
  if (model == "deepseek") experts = 256, k = 7168, n = 4096;
  if (model == "qwen3") experts = 128, k = 2048, n = 1536;
  if (stages < 1 || stages > 6) return printf("stages: 1 to 6\n"), 1;
  const int n_tiles = n / 256;
  const size_t bytes = static_cast<size_t>(experts) * k * n * 2;
  int sms = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  uint8_t* w = nullptr;
  unsigned long long* sink = nullptr;
  CK(cudaMalloc(&w, bytes));
  CK(cudaMalloc(&sink, 8));
  CK(cudaMemset(w, 0x3c, bytes));

  EncodeTiled encode = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                        cudaEnableDefault, &q));
  CUtensorMap maps[kLayouts];
  for (int l = 0; l < kLayouts; ++l) {
    const bool blocked = l == kBlocked || l == kBlocked1d;
    // kn: [E * K rows, N]; blocked: [E * N/256 * K rows, 256]; tiled: [E * N/64 * K rows, 64].
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(blocked ? 256 : l == kTiled ? 64 : n),
                                static_cast<cuuint64_t>(blocked    ? static_cast<size_t>(experts) * n_tiles * k
                                                        : l == kTiled ? static_cast<size_t>(experts) * n_tiles * 4 * k
                                                                      : static_cast<size_t>(experts) * k)};
    const cuuint64_t strides[1] = {dims[0] * 2};
    const cuuint32_t box[2] = {static_cast<cuuint32_t>(l == kKnWide ? 256 : 64), 64};
    const cuuint32_t elem[2] = {1, 1};
    const CUresult r = encode(&maps[l], CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, w, dims, strides, box, elem,
                              CU_TENSOR_MAP_INTERLEAVE_NONE,
                              l == kKnWide ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) return printf("encode %s: %d\n", kNames[l], static_cast<int>(r)), 1;
  }
  const int smem = stages * kStageBytes;
  CK(cudaFuncSetAttribute(Stream, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  printf("%s: E=%d K=%d N=%d, %.2f GB of weights, %d SMs, %d stages of 32 KiB\n", model.c_str(), experts, k, n,
         bytes / 1e9, sms, stages);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<float> ms[kLayouts];
  for (int round = 0; round < reps + 2; ++round) {
    for (int l = 0; l < kLayouts; ++l) {
      CK(cudaEventRecord(a));
      Stream<<<sms, 32, smem>>>(maps[l], w, l, experts, n_tiles, k, stages, sink);
      CK(cudaEventRecord(b));
      CK(cudaEventSynchronize(b));
      CK(cudaGetLastError());
      float t = 0;
      CK(cudaEventElapsedTime(&t, a, b));
      if (round >= 2) ms[l].push_back(t);
    }
  }
  for (int l = 0; l < kLayouts; ++l) {
    std::sort(ms[l].begin(), ms[l].end());
    const float med = ms[l][ms[l].size() / 2];
    printf("  %-9s %8.1f us  %.2f TB/s  (range %.1f-%.1f us)\n", kNames[l], med * 1e3, bytes / (med * 1e-3) / 1e12,
           ms[l].front() * 1e3, ms[l].back() * 1e3);
  }
  return 0;
}
