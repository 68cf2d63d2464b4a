// The tiled multi-token kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) (backends/cpu/quant_gemm.h): the AVX2 kernels and
// the scalar tile kernels against the scalar row-at-a-time integer reference
// (cpu::ref::quant_matmul), on random block bytes (every quant and scale bit pattern), for
// token counts around the kernel's 4-token groups and row counts around its 8-row tiles;
// and quant_matmul, which picks the tiled path for batches, against the same reference.
// All of them follow one accumulation contract (quant_matmul.h), so they agree bit for bit
// (serving relies on it: a row's logits must not depend on what it is batched with); the
// reference is also checked against the float product within float rounding.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/quant_gemm.h"
#include "backends/cpu/quant_matmul.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/thread_pool.h"

namespace turbospark {
namespace {

// Random block bytes with finite, moderate f16 scales at the given byte offsets.
std::vector<uint8_t> random_rows(DType t, int64_t rows, int64_t cols, std::mt19937& rng) {
  const int64_t bb = block_bytes(t), nb = rows * cols / block_size(t);
  std::vector<uint8_t> bytes(size_t(nb * bb));
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  for (auto& b : bytes) b = uint8_t(byte(rng));
  std::vector<int> offsets{0, 2};  // d and dmin (k-quants) or d and m (Q4_1, Q5_1)
  if (t == DType::Q6_K) offsets = {208};
  if (t == DType::Q4_0 || t == DType::Q5_0) offsets = {0};
  for (int64_t b = 0; b < nb; ++b) {
    for (int off : offsets) {
      const uint16_t h = f32_to_f16(scale(rng));
      std::memcpy(bytes.data() + b * bb + off, &h, 2);
    }
  }
  return bytes;
}

std::vector<float> random_normal(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }

constexpr DType kTiledTypes[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1,
                                 DType::Q4_K, DType::Q5_K, DType::Q6_K};

TEST(QuantGemm, TiledKernelsMatchScalarReference) {
  ThreadPool pool(2);
  std::mt19937 rng(2024);
  for (DType t : kTiledTypes) {
    ASSERT_TRUE(cpu::quant_gemm::has_tiled_kernel(t));
    for (int64_t cols : {256, 768}) {
      for (int64_t rows : {1, 7, 8, 9, 17, 30}) {
        const std::vector<uint8_t> bytes = random_rows(t, rows, cols, rng);
        const int64_t rb = row_bytes(t, cols);
        const WeightView w{t, bytes.data(), rows, cols, rb};
        for (int64_t T : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64}) {
          const std::string label = std::string(dtype_name(t)) + " [" + std::to_string(rows) + ", " +
                                    std::to_string(cols) + "] T " + std::to_string(T);
          const std::vector<float> x = random_normal(size_t(T * cols), rng);
          const Mat xm(const_cast<float*>(x.data()), T, cols);
          // Outputs with a stride wider than the row: the padding must stay untouched.
          const int64_t ys = rows + 3;
          std::vector<float> yfast(size_t(T * ys), -7.f), yscalar(size_t(T * ys), -7.f), ydispatch(size_t(T * ys), -7.f);
          std::vector<float> yref(size_t(T * rows));
          cpu::quant_gemm::matmul(&pool, w, xm, Mat(yfast.data(), T, rows, ys), /*fast=*/true);
          cpu::quant_gemm::matmul(nullptr, w, xm, Mat(yscalar.data(), T, rows, ys), /*fast=*/false);
          cpu::quant_matmul(pool, w, xm, Mat(ydispatch.data(), T, rows, ys));
          cpu::ref::quant_matmul(w, xm, Mat(yref.data(), T, rows));
          for (int64_t i = 0; i < T; ++i) {
            for (int64_t k = rows; k < ys; ++k) {
              ASSERT_EQ(yfast[size_t(i * ys + k)], -7.f) << label << " (fast wrote padding)";
              ASSERT_EQ(yscalar[size_t(i * ys + k)], -7.f) << label << " (scalar wrote padding)";
              ASSERT_EQ(ydispatch[size_t(i * ys + k)], -7.f) << label << " (quant_matmul wrote padding)";
            }
            for (int64_t o = 0; o < rows; ++o) {
              const float want = yref[size_t(i * rows + o)];
              ASSERT_EQ(bits(yfast[size_t(i * ys + o)]), bits(want)) << label << " t " << i << " o " << o << " (AVX2 tile)";
              ASSERT_EQ(bits(yscalar[size_t(i * ys + o)]), bits(want)) << label << " t " << i << " o " << o << " (scalar tile)";
              ASSERT_EQ(bits(ydispatch[size_t(i * ys + o)]), bits(want)) << label << " t " << i << " o " << o << " (quant_matmul)";
            }
          }
        }
      }
    }
  }
}

// Weights whose every quant is at its maximum (and activations at +-127) drive the int16
// partial sums to their bound: a kernel that summed one maddubs too many per int16 lane
// would saturate and differ from the reference here.
TEST(QuantGemm, SaturationBoundIsRespected) {
  std::mt19937 rng(7);
  for (DType t : kTiledTypes) {
    const int64_t rows = 9, cols = 512, T = 5;
    std::vector<uint8_t> bytes = random_rows(t, rows, cols, rng);
    const int64_t bb = block_bytes(t);
    for (int64_t b = 0; b < rows * cols / block_size(t); ++b) {
      uint8_t* blk = bytes.data() + b * bb;
      if (t == DType::Q4_K) {
        std::memset(blk + 4, 0xFF, 12);   // every scale and minimum 63
        std::memset(blk + 16, 0xFF, 128);  // every quant 15
      } else if (t == DType::Q5_K) {
        std::memset(blk + 4, 0xFF, 12);   // every scale and minimum 63
        std::memset(blk + 16, 0xFF, 160);  // every quant 31
      } else if (t == DType::Q6_K) {
        std::memset(blk, 0xFF, 192);       // every quant 63
        std::memset(blk + 192, 127, 16);   // every scale 127
      } else {
        // The 32-element formats: every quant at its maximum (15 or 31), scales kept.
        const int head = t == DType::Q4_1 || t == DType::Q5_1 ? 4 : 2;
        std::memset(blk + head, 0xFF, size_t(bb - head));
      }
    }
    const WeightView w{t, bytes.data(), rows, cols, row_bytes(t, cols)};
    std::vector<float> x(size_t(T * cols));
    for (int64_t i = 0; i < T * cols; ++i) x[size_t(i)] = (i / cols) % 2 ? -1.f : 1.f;
    std::vector<float> yfast(size_t(T * rows)), yref(size_t(T * rows));
    cpu::quant_gemm::matmul(nullptr, w, Mat(x.data(), T, cols), Mat(yfast.data(), T, rows), /*fast=*/true);
    cpu::ref::quant_matmul(w, Mat(x.data(), T, cols), Mat(yref.data(), T, rows));
    for (int64_t i = 0; i < T * rows; ++i)
      ASSERT_EQ(bits(yfast[size_t(i)]), bits(yref[size_t(i)])) << dtype_name(t) << " output " << i;
  }
}

TEST(QuantGemm, RefusesFormatsWithoutTiledKernel) {
  std::vector<uint8_t> bytes(size_t(row_bytes(DType::Q8_0, 32)));
  const WeightView w{DType::Q8_0, bytes.data(), 1, 32, int64_t(bytes.size())};
  std::vector<float> x(32), y(1);
  EXPECT_FALSE(cpu::quant_gemm::has_tiled_kernel(DType::Q8_0));
  EXPECT_THROW(cpu::quant_gemm::matmul(nullptr, w, Mat(x.data(), 1, 32), Mat(y.data(), 1, 1), true), Error);
}

// quant_matmul_jobs against quant_matmul job by job, bit for bit: mixed formats in one call,
// ragged row and token counts (one row, rows that do not fill the pool's 8-row grain, jobs past
// the tiled bound that take quant_matmul's own path), several jobs naming the same x (one
// quantization shared) and jobs whose x has the same memory but another shape (not shared),
// strided outputs whose padding must stay untouched, and pools of 1 and 3 threads.
TEST(QuantMatmulJobs, EveryJobEqualsQuantMatmulBitForBit) {
  std::mt19937 rng(31);
  constexpr DType kTypes[] = {DType::Q4_0, DType::Q8_0, DType::Q4_K, DType::Q6_K, DType::Q5_1};
  struct Case {
    DType t;
    int64_t rows, cols, T;
    int x;  // which activation buffer
  };
  for (int threads : {1, 3}) {
    ThreadPool pool(threads);
    for (int round = 0; round < 6; ++round) {
      std::vector<Case> cases;
      std::uniform_int_distribution<int> pick_t(0, 4), pick_rows(1, 41), pick_T(1, 5), pick_x(0, 2);
      const int n_jobs = 1 + round * 3;
      for (int j = 0; j < n_jobs; ++j) cases.push_back({kTypes[pick_t(rng)], pick_rows(rng), 256, pick_T(rng), pick_x(rng)});
      if (round == 5) cases.push_back({DType::Q4_0, 9, 256, 17, 0});  // tiled: its own call
      // Three activation buffers of 17 rows; a job reads the first T rows of its buffer.
      std::vector<std::vector<float>> xs;
      for (int b = 0; b < 3; ++b) xs.push_back(random_normal(size_t(17 * 256), rng));
      std::vector<std::vector<uint8_t>> weights;
      std::vector<WeightView> views;
      std::vector<std::vector<float>> ys, want;
      for (const Case& c : cases) {
        weights.push_back(random_rows(c.t, c.rows, c.cols, rng));
        views.push_back(WeightView{c.t, weights.back().data(), c.rows, c.cols, row_bytes(c.t, c.cols)});
        ys.emplace_back(size_t(c.T * (c.rows + 2)), -7.f);
        want.emplace_back(size_t(c.T * (c.rows + 2)), -7.f);
      }
      std::vector<cpu::QuantMatmulJob> jobs;
      for (size_t j = 0; j < cases.size(); ++j) {
        const Case& c = cases[j];
        const Mat x(xs[size_t(c.x)].data(), c.T, c.cols);
        jobs.push_back({&views[j], x, Mat(ys[j].data(), c.T, c.rows, c.rows + 2)});
        cpu::quant_matmul(pool, views[j], x, Mat(want[j].data(), c.T, c.rows, c.rows + 2));
      }
      cpu::quant_matmul_jobs(pool, jobs);
      for (size_t j = 0; j < cases.size(); ++j) {
        const Case& c = cases[j];
        for (size_t i = 0; i < ys[j].size(); ++i)
          ASSERT_EQ(bits(ys[j][i]), bits(want[j][i]))
              << "threads " << threads << " round " << round << " job " << j << " " << dtype_name(c.t) << " [" << c.rows
              << ", " << c.cols << "] T " << c.T << " x " << c.x << " element " << i;
      }
    }
  }
}

TEST(QuantMatmulJobs, RefusesWhatQuantMatmulRefuses) {
  ThreadPool pool(2);
  std::vector<uint8_t> bytes(size_t(row_bytes(DType::Q4_0, 64) * 2));
  const WeightView w{DType::Q4_0, bytes.data(), 2, 64, row_bytes(DType::Q4_0, 64)};
  const WeightView f32{DType::F32, bytes.data(), 2, 16, 64};
  std::vector<float> x(64), y(2);
  const cpu::QuantMatmulJob good{&w, Mat(x.data(), 1, 64), Mat(y.data(), 1, 2)};
  const cpu::QuantMatmulJob wrong_cols{&w, Mat(x.data(), 1, 32), Mat(y.data(), 1, 2)};
  const cpu::QuantMatmulJob not_quantized{&f32, Mat(x.data(), 1, 16), Mat(y.data(), 1, 2)};
  const cpu::QuantMatmulJob no_weight{nullptr, Mat(x.data(), 1, 64), Mat(y.data(), 1, 2)};
  for (const cpu::QuantMatmulJob& bad : {wrong_cols, not_quantized, no_weight}) {
    const std::vector<cpu::QuantMatmulJob> jobs{good, bad};
    EXPECT_THROW(cpu::quant_matmul_jobs(pool, jobs), Error);
  }
  EXPECT_TRUE(cpu::quant_matmul_takes(DType::Q6_K));
  EXPECT_FALSE(cpu::quant_matmul_takes(DType::MXFP4));
  EXPECT_FALSE(cpu::quant_matmul_takes(DType::BF16));
}

}  // namespace
}  // namespace turbospark
