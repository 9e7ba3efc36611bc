// A model's GEMM1 at T tokens (gptoss: E=128, N=2I=5760, K=H=2880, top-4; deepseek: E=256, N=4096,
// K=7168, top-8; qwen3: E=128, N=1536, K=2048, top-8; each token's k experts drawn uniformly, as the
// bench's random softmax routing does), three ways, with CUTLASS's stock SM90 grouped GEMM each time:
//   standard: d[rows_e, N] = x[rows_e, K] @ w[e][N, K]^T on a 128x256 cooperative tile, no cluster,
//             each expert's rows padded to 128-row tiles;
//   pingpong: the same on a 64x256 pingpong tile, each expert's rows padded to 64 (as the cutlass
//             backend's 64-row and 192-row tiles pad them);
//   swapped:  d^T[N, rows_e] = w[e][N, K] @ x[rows_e, K]^T, the tokens on the MMA's N: the experts
//             binned by row count (up to 96, 128, ..., 256 rows), one grouped launch per bin on a
//             128 x bin tile, d written column-major (the same [rows, N] row-major array), so that each
//             expert's rows pad only to their bin and each weight tile is read by one CTA.
// It checks the swapped and pingpong outputs against the standard one (all NaN-poisoned first), and
// sampled entries against a float64 dot product. Then it times the three in alternating rounds
// (median of 15 each, CUDA events; each timed sample runs the form `reps` times back to back, so that
// the power cap sets in as in a loop), and reads the joules each run draws (NVML's energy counter,
// over about two seconds of each form). `balanced` gives every expert T*k/E rows, so that no form
// multiplies a padded row. The bins hold up to 256 rows: qwen3 fits them up to T=2048.
// Build against the nvidia-cutlass wheel's headers (python -m pip download nvidia-cutlass, unzip; or
// the build's own CUTLASS), then run on an SM90 GPU:
//   CU=<cutlass_library/source>; nvcc -I$CU/include -I$CU/tools/util/include -O3 -DNDEBUG \
//     -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -diag-suppress=940,2473 -std=c++17 \
//     bench/swap_ab_probe.cu -ldl -o /tmp/swap_ab_probe && /tmp/swap_ab_probe 4096 deepseek [reps [balanced]]
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

using namespace cute;
using BF = cutlass::bfloat16_t;
using Problem = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e_), __LINE__); exit(1); } } while (0)

template <int TM, int TN, class LayoutD, bool kPingpong = false>
struct G {
  using Tile = Shape<Int<TM>, Int<TN>, _64>;
  using Cluster = Shape<_1, _1, _1>;
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, LayoutD*, 8, BF, LayoutD*, 8,
      std::conditional_t<kPingpong, cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative>,
      cutlass::epilogue::fusion::LinearCombination<BF, float, void, float>>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, BF, cutlass::layout::RowMajor*, 8, BF,
      cutlass::layout::ColumnMajor*, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      std::conditional_t<kPingpong, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using SA = typename Kernel::InternalStrideA;
  using SB = typename Kernel::InternalStrideB;
  using SD = typename Kernel::InternalStrideD;

  // One grouped GEMM over the problems (m, n, k) with A [m, k] row-major at pa, B [n, k] at pb, D at pd.
  struct Run {
    int groups = 0;
    typename Problem::UnderlyingProblemShape* shapes = nullptr;
    const BF** pa = nullptr; const BF** pb = nullptr; BF** pd = nullptr;
    SA* sa = nullptr; SB* sb = nullptr; SD* sd = nullptr;
    void* ws = nullptr;
    Gemm gemm;
    std::vector<typename Problem::UnderlyingProblemShape> host_shapes;
  };
  static Run* Make(const std::vector<std::array<int, 3>>& mnk, const std::vector<const BF*>& a,
                   const std::vector<const BF*>& b, const std::vector<BF*>& d, int sms) {
    auto* r = new Run;
    r->groups = int(mnk.size());
    std::vector<SA> sa; std::vector<SB> sb; std::vector<SD> sd;
    for (auto& p : mnk) {
      r->host_shapes.push_back({p[0], p[1], p[2]});
      sa.push_back(cutlass::make_cute_packed_stride(SA{}, {p[0], p[2], 1}));
      sb.push_back(cutlass::make_cute_packed_stride(SB{}, {p[1], p[2], 1}));
      sd.push_back(cutlass::make_cute_packed_stride(SD{}, {p[0], p[1], 1}));
    }
    auto up = [](auto*& dst, const auto& v) {
      CK(cudaMalloc(&dst, v.size() * sizeof(v[0]) + 16));
      CK(cudaMemcpy(dst, v.data(), v.size() * sizeof(v[0]), cudaMemcpyHostToDevice));
    };
    up(r->shapes, r->host_shapes); up(r->pa, a); up(r->pb, b); up(r->pd, d); up(r->sa, sa); up(r->sb, sb); up(r->sd, sd);
    cutlass::KernelHardwareInfo hw; hw.device_id = 0; hw.sm_count = sms;
    typename Gemm::Arguments args{};
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {r->groups, r->shapes, r->host_shapes.data()};
    args.mainloop = {r->pa, r->sa, r->pb, r->sb};
    args.epilogue.thread.alpha = 1.0f; args.epilogue.thread.beta = 0.0f;
    args.epilogue.ptr_C = nullptr; args.epilogue.dC = nullptr;
    args.epilogue.ptr_D = r->pd; args.epilogue.dD = r->sd;
    args.hw_info = hw;
    size_t wsb = Gemm::get_workspace_size(args);
    CK(cudaMalloc(&r->ws, wsb + 16));
    if (r->gemm.can_implement(args) != cutlass::Status::kSuccess) { printf("can_implement failed %dx%d\n", TM, TN); exit(1); }
    if (r->gemm.initialize(args, r->ws) != cutlass::Status::kSuccess) { printf("initialize failed\n"); exit(1); }
    return r;
  }
};

// The GPU's energy counter (NVML's total energy in mJ since the driver loaded), read through the
// driver's libnvidia-ml.so.1 at run time so that the probe builds without NVML's header. Returns -1
// where the library or the counter is not there.
struct EnergyMeter {
  using InitFn = int (*)();
  using HandleFn = int (*)(unsigned, void**);
  using EnergyFn = int (*)(void*, unsigned long long*);
  EnergyFn energy = nullptr;
  void* device = nullptr;
  EnergyMeter() {
    void* lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) return;
    auto init = reinterpret_cast<InitFn>(dlsym(lib, "nvmlInit_v2"));
    auto handle = reinterpret_cast<HandleFn>(dlsym(lib, "nvmlDeviceGetHandleByIndex_v2"));
    energy = reinterpret_cast<EnergyFn>(dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption"));
    if (!init || !handle || !energy || init() != 0 || handle(0, &device) != 0) energy = nullptr;
  }
  double millijoules() const {
    unsigned long long mj = 0;
    return energy && energy(device, &mj) == 0 ? double(mj) : -1.0;
  }
};

__global__ void Fill(BF* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed; h ^= h >> 13; h *= 0x5bd1e995u; h ^= h >> 15;
    p[i] = BF(float(h & 0xffff) / 32768.0f - 1.0f);
  }
}

int main(int argc, char** argv) {
  const int T = argc > 1 ? atoi(argv[1]) : 4096;
  const std::string model = argc > 2 ? argv[2] : "gptoss";
  const int reps = argc > 3 ? atoi(argv[3]) : 1;
  const bool balanced = argc > 4 && std::string(argv[4]) == "balanced";
  int E = 128, H = 2880, N = 2 * 2880, k = 4;
  if (model == "deepseek") { E = 256; H = 7168; N = 2 * 2048; k = 8; }
  else if (model == "qwen3") { E = 128; H = 2048; N = 2 * 768; k = 8; }
  else if (model != "gptoss") { printf("model must be gptoss, deepseek or qwen3\n"); return 2; }
  int sms = 0; CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  // each token picks k distinct experts uniformly (the bench's random softmax top-k)
  std::mt19937 rng(7);
  std::vector<int> count(E, 0);
  for (int t = 0; t < T; ++t) {
    std::vector<int> pick;
    while (int(pick.size()) < k) { int e = rng() % E; if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e); }
    for (int e : pick) count[e]++;
  }
  if (balanced) std::fill(count.begin(), count.end(), T * k / E);  // every expert the same rows
  std::vector<int64_t> lo(E + 1, 0);
  for (int e = 0; e < E; ++e) lo[e + 1] = lo[e] + count[e];
  const int64_t M = lo[E];
  BF *x, *w, *d_std, *d_swp, *d_pp;
  CK(cudaMalloc(&x, M * H * 2)); CK(cudaMalloc(&w, size_t(E) * N * H * 2));
  CK(cudaMalloc(&d_std, M * N * 2)); CK(cudaMalloc(&d_swp, M * N * 2)); CK(cudaMalloc(&d_pp, M * N * 2));
  Fill<<<1024, 256>>>(x, M * H, 1); Fill<<<4096, 256>>>(w, size_t(E) * N * H, 2);
  CK(cudaMemset(d_std, 0xff, M * N * 2)); CK(cudaMemset(d_swp, 0xff, M * N * 2));  // NaN poison
  CK(cudaMemset(d_pp, 0xff, M * N * 2));
  CK(cudaDeviceSynchronize());

  // standard: 128x256, groups (rows_e, N, H)
  using Std = G<128, 256, cutlass::layout::RowMajor>;
  std::vector<std::array<int, 3>> mnk; std::vector<const BF*> pa, pb; std::vector<BF*> pd;
  for (int e = 0; e < E; ++e) {
    mnk.push_back({count[e], N, H}); pa.push_back(x + lo[e] * H); pb.push_back(w + size_t(e) * N * H);
    pd.push_back(d_std + lo[e] * N);
  }
  auto* std_run = Std::Make(mnk, pa, pb, pd, sms);
  using Pp = G<64, 256, cutlass::layout::RowMajor, true>;
  for (int e = 0; e < E; ++e) pd[e] = d_pp + lo[e] * N;
  auto* pp_run = Pp::Make(mnk, pa, pb, pd, sms);

  // swapped, binned: bin b holds the experts with rows in (bins[b-1], bins[b]]; the last takes the rest
  const int bins[] = {96, 128, 160, 192, 224, 256};
  using S96 = G<128, 96, cutlass::layout::ColumnMajor>;
  using S128 = G<128, 128, cutlass::layout::ColumnMajor>;
  using S160 = G<128, 160, cutlass::layout::ColumnMajor>;
  using S192 = G<128, 192, cutlass::layout::ColumnMajor>;
  using S224 = G<128, 224, cutlass::layout::ColumnMajor>;
  using S256 = G<128, 256, cutlass::layout::ColumnMajor>;
  std::vector<std::vector<int>> members(6);
  for (int e = 0; e < E; ++e) {
    int b = 0; while (b < 5 && count[e] > bins[b]) ++b;
    members[b].push_back(e);
  }
  auto mk = [&](auto tag, int b) -> void* {
    using S = decltype(tag);
    if (members[b].empty()) return nullptr;
    std::vector<std::array<int, 3>> m2; std::vector<const BF*> a2, b2; std::vector<BF*> d2;
    for (int e : members[b]) {
      m2.push_back({N, count[e], H}); a2.push_back(w + size_t(e) * N * H); b2.push_back(x + lo[e] * H);
      d2.push_back(d_swp + lo[e] * N);
    }
    return S::Make(m2, a2, b2, d2, sms);
  };
  void* runs[6] = {mk(S96{}, 0), mk(S128{}, 1), mk(S160{}, 2), mk(S192{}, 3), mk(S224{}, 4), mk(S256{}, 5)};
  auto run_swapped = [&](cudaStream_t s) {
    if (runs[0]) static_cast<S96::Run*>(runs[0])->gemm.run(s);
    if (runs[1]) static_cast<S128::Run*>(runs[1])->gemm.run(s);
    if (runs[2]) static_cast<S160::Run*>(runs[2])->gemm.run(s);
    if (runs[3]) static_cast<S192::Run*>(runs[3])->gemm.run(s);
    if (runs[4]) static_cast<S224::Run*>(runs[4])->gemm.run(s);
    if (runs[5]) static_cast<S256::Run*>(runs[5])->gemm.run(s);
  };
  auto run_std = [&](cudaStream_t s) { std_run->gemm.run(s); };
  auto run_pp = [&](cudaStream_t s) { pp_run->gemm.run(s); };

  cudaStream_t s; CK(cudaStreamCreate(&s));
  run_std(s); run_swapped(s); run_pp(s); CK(cudaStreamSynchronize(s)); CK(cudaGetLastError());
  // check: swapped against standard, and standard against a float64 dot on sampled entries
  std::vector<uint16_t> hs(M * N), hw(M * N), hp(M * N);
  CK(cudaMemcpy(hs.data(), d_std, M * N * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hw.data(), d_swp, M * N * 2, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(hp.data(), d_pp, M * N * 2, cudaMemcpyDeviceToHost));
  auto f = [](uint16_t v) { uint32_t u = uint32_t(v) << 16; float r; memcpy(&r, &u, 4); return r; };
  double num = 0, den = 0, pnum = 0; int64_t nans = 0;
  for (int64_t i = 0; i < M * N; ++i) {
    float a = f(hs[i]), b = f(hw[i]), c = f(hp[i]);
    if (!std::isfinite(a) || !std::isfinite(b) || !std::isfinite(c)) { ++nans; continue; }
    num += double(a - b) * (a - b); pnum += double(a - c) * (a - c); den += double(a) * a;
  }
  std::vector<uint16_t> hx(M * H);
  CK(cudaMemcpy(hx.data(), x, M * H * 2, cudaMemcpyDeviceToHost));
  double rn = 0, rd = 0;
  for (int smp = 0; smp < 2000; ++smp) {
    int e = rng() % E; if (!count[e]) continue;
    int r = rng() % count[e], c = rng() % N;
    static std::vector<uint16_t> wrow(H);
    CK(cudaMemcpy(wrow.data(), w + (size_t(e) * N + c) * H, H * 2, cudaMemcpyDeviceToHost));
    double ref = 0;
    for (int h = 0; h < H; ++h) ref += double(f(hx[(lo[e] + r) * H + h])) * f(wrow[h]);
    double got = f(hw[(lo[e] + r) * N + c]);
    rn += (got - ref) * (got - ref); rd += ref * ref;
  }
  printf("T=%d M=%lld rows per expert %.1f (min %d max %d); bins:", T, (long long)M, double(M) / E,
         *std::min_element(count.begin(), count.end()), *std::max_element(count.begin(), count.end()));
  double padded = 0;
  for (int b = 0; b < 6; ++b) {
    printf(" %d:%zu", bins[b], members[b].size());
    for (int e : members[b]) padded += (count[e] + bins[b] - 1) / bins[b] * bins[b];
  }
  double pstd = 0, p64 = 0;
  for (int e = 0; e < E; ++e) { pstd += (count[e] + 127) / 128 * 128; p64 += (count[e] + 63) / 64 * 64; }
  printf("\nrows multiplied / rows: standard 128-row tiles %.3f, pingpong 64-row tiles %.3f, swapped bins %.3f\n",
         pstd / M, p64 / M, padded / M);
  printf("swapped vs standard rel l2 %.2e, pingpong vs standard %.2e, non-finite %lld; "
         "swapped vs float64 (2000 samples) rel l2 %.2e\n",
         std::sqrt(num / den), std::sqrt(pnum / den), (long long)nans, std::sqrt(rn / rd));

  cudaEvent_t a, b; CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  auto time = [&](auto fn) {
    std::vector<float> ms;
    for (int i = 0; i < 3; ++i) fn(s);
    for (int rep = 0; rep < 15; ++rep) {
      CK(cudaEventRecord(a, s));
      for (int r = 0; r < reps; ++r) fn(s);
      CK(cudaEventRecord(b, s)); CK(cudaEventSynchronize(b));
      float t; CK(cudaEventElapsedTime(&t, a, b)); ms.push_back(t / reps);
    }
    std::sort(ms.begin(), ms.end()); return ms[ms.size() / 2] * 1000.0f;
  };
  // Joules per run, from tick to tick of the energy counter (it steps about every 100 ms): wait
  // for a tick, run back to back for about two seconds, then on until the next tick. Each run is
  // synchronized, so the count of runs between the ticks is known to within one. NaN without NVML.
  EnergyMeter meter;
  using Clock = std::chrono::steady_clock;
  auto joules_per_run = [&](auto fn) -> double {
    if (meter.millijoules() < 0) return NAN;
    const auto wait_tick = [&](double from) {
      const auto t0 = Clock::now();
      double m = from;
      while (m == from && Clock::now() - t0 < std::chrono::seconds(1)) m = meter.millijoules();
      return m;
    };
    const double m0 = wait_tick(meter.millijoules());
    const auto t0 = Clock::now();
    long runs = 0;
    double at_two_seconds = -1, m = m0;
    for (;;) {
      fn(s); CK(cudaStreamSynchronize(s)); ++runs;
      m = meter.millijoules();
      if (at_two_seconds < 0 && Clock::now() - t0 > std::chrono::seconds(2)) at_two_seconds = m;
      if (at_two_seconds >= 0 && m != at_two_seconds) break;
    }
    return (m - m0) * 1e-3 / runs;
  };
  printf("%s%s, %d back to back per sample\n", model.c_str(), balanced ? " (balanced rows)" : "", reps);
  double fl = 2.0 * M * N * H;
  for (int round = 0; round < 3; ++round) {
    float ts = time(run_std), tp = time(run_pp), tw = time(run_swapped);
    printf("round %d: standard 128x256 %.1f us (%.0f TFLOP/s of rows), pingpong 64x256 %.1f us (%.0f), "
           "swapped bins %.1f us (%.0f); swapped / pingpong %.3f\n",
           round, ts, fl / ts * 1e-6, tp, fl / tp * 1e-6, tw, fl / tw * 1e-6, tw / tp);
  }
  const double js = joules_per_run(run_std), jp = joules_per_run(run_pp), jw = joules_per_run(run_swapped);
  printf("joules per run, about 2 s back to back each: standard %.3f, pingpong %.3f, swapped %.3f "
         "(%.0f, %.0f, %.0f TFLOP of rows per kJ)\n", js, jp, jw, fl / js * 1e-9, fl / jp * 1e-9, fl / jw * 1e-9);
  return 0;
}
