// Microbenchmarks of the CPU matmuls: BF16 at Qwen3-0.6B shapes, the ggml formats at
// Qwen2.5-1.5B Q4_K_M shapes (the default model), the grouped 4-bit formats (INT4-affine
// g64, MXFP4 exact and int8) at gpt-oss-20b expert shapes and a MoE decode layer at
// Qwen3-30B-A3B's, decode GEMV (reported as weight GB/s
// next to this machine's measured DRAM read bandwidth) and prefill GEMM (GFLOP/s; 64 tokens
// is one prefill micro-batch). Not built by CMake; from the repository root, after a build:
//
//   g++ -std=c++20 -O3 -march=native -Isrc bench/kernels_bench.cpp build/libturbospark_lib.a
//       -lbenchmark -lfmt -pthread -o /tmp/kernels_bench  (one line)
//   /tmp/kernels_bench --benchmark_min_time=1 [--benchmark_filter=bm_quant]
//
// On a shared machine wall time follows the other tenants' load; the "cpu" column (this
// process's CPU time) is steadier for comparing kernels.
//
// Small matrices would sit in the 32 MiB L3 after the first call, which measures the cache,
// not DRAM; GEMV therefore cycles through enough copies of each matrix to span 256 MiB
// (TS_BENCH_IN_CACHE=1: the grouped formats run one copy, from cache, to separate compute
// from memory).
#include <benchmark/benchmark.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "backends/cpu/int4_affine.h"
#include "backends/cpu/kernels.h"
#include "backends/cpu/membw.h"
#include "backends/cpu/mxfp4.h"
#include "backends/cpu/quant_matmul.h"
#include "ops/backend.h"
#include "core/quant.h"
#include "core/quant_grouped.h"

namespace turbospark::cpu {
namespace {

ThreadPool& bench_pool() {
  static ThreadPool pool(0);
  return pool;
}

// `copies` BF16 matrices [rows, cols] with random values.
struct BF16Matrices {
  std::vector<std::vector<uint16_t>> storage;
  std::vector<WeightView> views;
  BF16Matrices(int64_t rows, int64_t cols, int copies) {
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> u(-0.1f, 0.1f);
    for (int c = 0; c < copies; ++c) {
      storage.emplace_back(size_t(rows * cols));
      for (auto& v : storage.back()) v = f32_to_bf16(u(rng));
      views.push_back(WeightView{DType::BF16, storage.back().data(), rows, cols, cols * 2});
    }
  }
};

// Qwen3-0.6B linear layers: [out, in].
struct Shape {
  const char* name;
  int64_t rows, cols;
};
constexpr Shape kShapes[] = {{"q_proj", 2048, 1024}, {"k_proj", 1024, 1024},
                             {"o_proj", 1024, 2048}, {"gate_proj", 3072, 1024},
                             {"down_proj", 1024, 3072}, {"lm_head", 151936, 1024}};

void bm_matmul(benchmark::State& state) {
  const Shape& shape = kShapes[state.range(0)];
  const int64_t tokens = state.range(1);
  const int64_t bytes = shape.rows * shape.cols * 2;
  const int copies = tokens == 1 ? int(std::max<int64_t>(1, (int64_t(256) << 20) / bytes)) : 1;
  BF16Matrices w(shape.rows, shape.cols, copies);
  std::vector<float> x(size_t(tokens * shape.cols), 0.5f), y(size_t(tokens * shape.rows));
  const Mat xm(x.data(), tokens, shape.cols), ym(y.data(), tokens, shape.rows);
  size_t i = 0;
  for (auto _ : state) {
    matmul(bench_pool(), w.views[i++ % w.views.size()], xm, ym);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetLabel(shape.name);
  state.SetBytesProcessed(int64_t(state.iterations()) * bytes);
  state.counters["GFLOP/s"] = benchmark::Counter(
      double(state.iterations()) * 2.0 * double(tokens * shape.rows * shape.cols) / 1e9,
      benchmark::Counter::kIsRate);
}

void matmul_args(benchmark::internal::Benchmark* b) {
  for (int s = 0; s < int(std::size(kShapes)); ++s)
    for (int tokens : {1, 64}) b->Args({s, tokens});
  b->ArgNames({"shape", "tokens"})->UseRealTime();
}
BENCHMARK(bm_matmul)->Apply(matmul_args);

// Qwen2.5-1.5B Q4_K_M linear layers: [out, in] and dtype (ffn_down is Q6_K in half the
// layers, Q4_K in the others).
struct QuantShape {
  const char* name;
  DType dtype;
  int64_t rows, cols;
};
constexpr QuantShape kQuantShapes[] = {{"attn_q q4_K", DType::Q4_K, 1536, 1536},
                                       {"ffn_gate q4_K", DType::Q4_K, 8960, 1536},
                                       {"ffn_down q4_K", DType::Q4_K, 1536, 8960},
                                       {"ffn_down q6_K", DType::Q6_K, 1536, 8960},
                                       {"ffn_gate q5_K", DType::Q5_K, 8960, 1536},
                                       {"ffn_gate q4_0", DType::Q4_0, 8960, 1536},
                                       {"ffn_gate q8_0", DType::Q8_0, 8960, 1536}};

// `copies` matrices of random block bytes with small finite f16 scales.
struct QuantMatrices {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<WeightView> views;
  QuantMatrices(DType t, int64_t rows, int64_t cols, int copies) {
    std::mt19937 rng(1);
    const int64_t rb = row_bytes(t, cols), bb = block_bytes(t);
    const uint16_t scale = f32_to_f16(0.01f);
    for (int c = 0; c < copies; ++c) {
      storage.emplace_back(size_t(rows * rb));
      std::vector<uint8_t>& bytes = storage.back();
      for (auto& b : bytes) b = uint8_t(rng());
      for (int64_t b = 0; b < rows * cols / block_size(t); ++b) {
        // f16 scales: Q6_K keeps d last, the other formats start with d (and dmin/m).
        if (t == DType::Q6_K) {
          std::memcpy(bytes.data() + b * bb + bb - 2, &scale, 2);
        } else {
          std::memcpy(bytes.data() + b * bb, &scale, 2);
          std::memcpy(bytes.data() + b * bb + 2, &scale, 2);
        }
      }
      views.push_back(WeightView{t, bytes.data(), rows, cols, rb});
    }
  }
};

void bm_quant_matmul(benchmark::State& state) {
  const QuantShape& shape = kQuantShapes[state.range(0)];
  const int64_t tokens = state.range(1);
  const int64_t bytes = shape.rows * row_bytes(shape.dtype, shape.cols);
  const int copies = tokens == 1 ? int(std::max<int64_t>(1, (int64_t(256) << 20) / bytes)) : 1;
  QuantMatrices w(shape.dtype, shape.rows, shape.cols, copies);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  std::vector<float> x(size_t(tokens * shape.cols)), y(size_t(tokens * shape.rows));
  for (auto& v : x) v = normal(rng);
  const Mat xm(x.data(), tokens, shape.cols), ym(y.data(), tokens, shape.rows);
  size_t i = 0;
  for (auto _ : state) {
    quant_matmul(bench_pool(), w.views[i++ % w.views.size()], xm, ym);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetLabel(shape.name);
  state.SetBytesProcessed(int64_t(state.iterations()) * bytes);
  state.counters["GFLOP/s"] = benchmark::Counter(
      double(state.iterations()) * 2.0 * double(tokens * shape.rows * shape.cols) / 1e9,
      benchmark::Counter::kIsRate);
}

void quant_matmul_args(benchmark::internal::Benchmark* b) {
  for (int s = 0; s < int(std::size(kQuantShapes)); ++s)
    for (int tokens : {1, 4, 64}) b->Args({s, tokens});
  b->ArgNames({"shape", "tokens"})->UseRealTime();
}
BENCHMARK(bm_quant_matmul)->Apply(quant_matmul_args);

// gpt-oss-20b expert matrices [out, in]: the fused gate/up and the down projection.
constexpr Shape kExpertShapes[] = {{"gate_up", 5760, 2880}, {"down", 2880, 2880}};
enum GroupedKind { kInt4G64, kMxfp4Exact, kMxfp4Int8 };
constexpr const char* kGroupedNames[] = {"int4-affine g64", "mxfp4 exact", "mxfp4 int8"};

// `copies` grouped matrices: random codes, INT4 bf16 scales/biases in a realistic range,
// MXFP4 exponents around 2^-7.
struct GroupedMatrices {
  std::vector<std::vector<uint8_t>> codes, scales, biases;
  std::vector<WeightView> views;
  GroupedMatrices(bool int4, int64_t rows, int64_t cols, int copies) {
    std::mt19937 rng(3);
    const int32_t group = int4 ? 64 : 32;
    const int64_t groups = cols / group, plane_bytes = int4 ? 2 : 1;
    for (int c = 0; c < copies; ++c) {
      codes.emplace_back(size_t(rows * cols / 2));
      scales.emplace_back(size_t(rows * groups * plane_bytes));
      biases.emplace_back(int4 ? size_t(rows * groups * plane_bytes) : 0);
      for (auto& b : codes.back()) b = uint8_t(rng());
      for (int64_t i = 0; i < rows * groups; ++i) {
        if (int4) {
          int4_affine::set_plane_value(DType::BF16, scales.back().data(), i, 0.002f + 1e-5f * float(rng() % 100));
          int4_affine::set_plane_value(DType::BF16, biases.back().data(), i, -0.015f);
        } else {
          scales.back()[size_t(i)] = uint8_t(118 + rng() % 4);
        }
      }
      WeightView v{int4 ? DType::INT4_AFFINE : DType::MXFP4, codes.back().data(), rows, cols, cols / 2};
      v.scales = scales.back().data();
      v.scales_row_bytes = groups * plane_bytes;
      v.scales_dtype = int4 ? DType::BF16 : DType::U8;
      v.biases = int4 ? biases.back().data() : nullptr;
      v.biases_row_bytes = int4 ? groups * plane_bytes : 0;
      v.group_size = group;
      views.push_back(v);
    }
  }
};

void bm_grouped_matmul(benchmark::State& state) {
  const Shape& shape = kExpertShapes[state.range(0)];
  const auto kind = GroupedKind(state.range(1));
  const int64_t tokens = state.range(2);
  const bool int4 = kind == kInt4G64;
  const int64_t bytes = GroupedMatrices(int4, 1, shape.cols, 1).views[0].bytes() * shape.rows;
  const int copies = std::getenv("TS_BENCH_IN_CACHE") ? 1 : tokens == 1 ? int(std::max<int64_t>(1, (int64_t(256) << 20) / bytes)) : 1;
  GroupedMatrices w(int4, shape.rows, shape.cols, copies);
  std::mt19937 rng(2);
  std::normal_distribution<float> normal;
  std::vector<float> x(size_t(tokens * shape.cols)), y(size_t(tokens * shape.rows));
  for (auto& v : x) v = normal(rng);
  const Mat xm(x.data(), tokens, shape.cols), ym(y.data(), tokens, shape.rows);
  size_t i = 0;
  for (auto _ : state) {
    const WeightView& v = w.views[i++ % w.views.size()];
    if (kind == kInt4G64) int4_affine_matmul(bench_pool(), v, xm, ym);
    else if (kind == kMxfp4Exact) mxfp4_matmul_exact(bench_pool(), v, xm, ym);
    else mxfp4_matmul_int8(bench_pool(), v, xm, ym);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetLabel(std::string(shape.name) + " " + kGroupedNames[kind]);
  state.SetBytesProcessed(int64_t(state.iterations()) * bytes);
}

void grouped_matmul_args(benchmark::internal::Benchmark* b) {
  for (int s = 0; s < int(std::size(kExpertShapes)); ++s)
    for (int k = 0; k < 3; ++k)
      for (int tokens : {1, 4}) b->Args({s, k, tokens});
  b->ArgNames({"shape", "format", "tokens"})->UseRealTime();
}
BENCHMARK(bm_grouped_matmul)->Apply(grouped_matmul_args);

// A decode step's MoE layer on the CPU backend (Backend::moe_experts, one token, top-8 of 128
// Qwen3-30B-A3B-shaped Q4_0 experts: gate/up [768, 2048], down [2048, 768]), the experts drawn
// at random from enough copies to span 512 MiB, as a streamed or host-computed layer reads
// them. Compare `TURBOSPARK_CPU_MOE_JOBS=0` (three dispatches per expert) with the default
// (two per layer). Bytes processed = the eight experts' weights.
void bm_moe_decode(benchmark::State& state) {
  constexpr int64_t kHidden = 2048, kInter = 768, kTopK = 8;
  const int64_t expert_bytes = 3 * kInter * row_bytes(DType::Q4_0, kHidden);
  const int n_experts = int(std::max<int64_t>(kTopK, (int64_t(512) << 20) / expert_bytes));
  QuantMatrices gates(DType::Q4_0, kInter, kHidden, n_experts), ups(DType::Q4_0, kInter, kHidden, n_experts),
      downs(DType::Q4_0, kHidden, kInter, n_experts);
  std::vector<ExpertWeights> experts(static_cast<size_t>(n_experts));
  for (int e = 0; e < n_experts; ++e) {
    experts[size_t(e)].gate.view = gates.views[size_t(e)];
    experts[size_t(e)].up.view = ups.views[size_t(e)];
    experts[size_t(e)].down.view = downs.views[size_t(e)];
  }
  static std::unique_ptr<Backend> backend = make_cpu_backend(0);
  std::mt19937 rng(4);
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(kHidden)), y(static_cast<size_t>(kHidden));
  for (auto& v : x) v = normal(rng);
  std::vector<int32_t> idx(static_cast<size_t>(kTopK));
  std::vector<float> weight(static_cast<size_t>(kTopK), 1.f / float(kTopK));
  std::vector<int32_t> all(static_cast<size_t>(n_experts));
  for (int32_t e = 0; e < n_experts; ++e) all[size_t(e)] = e;
  for (auto _ : state) {
    for (int64_t j = 0; j < kTopK; ++j) std::swap(all[size_t(j)], all[size_t(j) + rng() % size_t(n_experts - j)]);
    std::copy(all.begin(), all.begin() + kTopK, idx.begin());
    backend->moe_experts(experts, Mat(x.data(), 1, kHidden), idx.data(), weight.data(), int(kTopK),
                         Mat(y.data(), 1, kHidden));
    benchmark::DoNotOptimize(y.data());
  }
  state.SetBytesProcessed(int64_t(state.iterations()) * kTopK * expert_bytes);
}
BENCHMARK(bm_moe_decode)->UseRealTime();

}  // namespace
}  // namespace turbospark::cpu

int main(int argc, char** argv) {
  using namespace turbospark;
  std::printf("DRAM read bandwidth (membw, %d threads): %.1f GB/s\n", cpu::bench_pool().size(),
              cpu::measure_read_bandwidth_gbs(cpu::bench_pool()));
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
