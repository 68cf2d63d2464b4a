// INT4_AFFINE (MLX affine 4-bit): packing order, the AVX2 matmul against the scalar
// reference for every scale dtype and group size, the quantizer's round trip, embedding
// lookups, and the loader's refusals (group size, packed shape, truncated file, config).
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>

#include "backends/cpu/grouped_matmul.h"
#include "backends/cpu/int4_affine.h"
#include "core/error.h"
#include "core/quant_grouped.h"
#include "core/thread_pool.h"
#include "formats/safetensors.h"
#include "ops/backend.h"
#include "test_util.h"

namespace turbospark {
namespace {

struct AffineMatrix {
  std::vector<uint8_t> packed, scales, biases;
  WeightView view;
  AffineMatrix(int64_t rows, int64_t cols, int64_t group, DType plane, std::mt19937& rng) {
    const int64_t groups = cols / group;
    const size_t es = dtype_size(plane);
    packed.resize(size_t(rows * cols / 2));
    scales.resize(size_t(rows * groups) * es);
    biases.resize(size_t(rows * groups) * es);
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> s(0.001f, 0.02f), b(-0.15f, 0.0f);
    for (auto& p : packed) p = uint8_t(byte(rng));
    for (int64_t i = 0; i < rows * groups; ++i) {
      int4_affine::set_plane_value(plane, scales.data(), i, s(rng));
      int4_affine::set_plane_value(plane, biases.data(), i, b(rng));
    }
    view.dtype = DType::INT4_AFFINE;
    view.data = packed.data();
    view.rows = rows;
    view.cols = cols;
    view.row_bytes = cols / 2;
    view.group_size = int32_t(group);
    view.scales_dtype = plane;
    view.scales = scales.data();
    view.biases = biases.data();
    view.scales_row_bytes = view.biases_row_bytes = groups * int64_t(es);
  }
};

std::vector<float> random_floats(size_t n, std::mt19937& rng, float sd = 1.f) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(Int4Affine, LowNibbleOfEachWordIsTheFirstColumn) {
  // One uint32 word 0x76543210 holds columns 0..7 = codes 0..7 (little-endian).
  const uint32_t words[4] = {0x76543210u, 0xFEDCBA98u, 0x0u, 0x11111111u};
  uint8_t packed[16];
  std::memcpy(packed, words, 16);
  const float scale = 0.5f, bias = -1.f;
  float got[32];
  int4_affine::dequantize_row(packed, &scale, &bias, DType::F32, 32, got, 32);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(got[i], 0.5f * float(i) - 1.f) << i;
  for (int i = 16; i < 24; ++i) EXPECT_EQ(got[i], -1.f) << i;
  for (int i = 24; i < 32; ++i) EXPECT_EQ(got[i], -0.5f) << i;
}

TEST(Int4Affine, MatmulMatchesScalarReference) {
  ThreadPool pool(2);
  std::mt19937 rng(11);
  for (DType plane : {DType::BF16, DType::F16, DType::F32}) {
    for (int64_t group : {32, 64, 128}) {
      for (int64_t rows : {1, 4, 5, 13, 33}) {
        for (int64_t cols : {128, 160, 384, 1056, 1152}) {  // 1056/1152: eight-group blocks plus tails
          if (cols % group) continue;
          AffineMatrix w(rows, cols, group, plane, rng);
          std::vector<float> wrow(static_cast<size_t>(cols));
          for (int64_t tokens : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64}) {
            std::vector<float> x = random_floats(size_t(tokens * cols), rng);
            std::vector<float> y(size_t(tokens * rows)), y_ref(static_cast<size_t>(tokens * rows));
            cpu::int4_affine_matmul(pool, w.view, Mat(x.data(), tokens, cols), Mat(y.data(), tokens, rows));
            cpu::ref::int4_affine_matmul(w.view, Mat(x.data(), tokens, cols), Mat(y_ref.data(), tokens, rows));
            std::vector<float> y_float(static_cast<size_t>(tokens * rows));
            cpu::grouped::matmul_reference(w.view, Mat(x.data(), tokens, cols), Mat(y_float.data(), tokens, rows), "test");
            for (int64_t r = 0; r < rows; ++r) {
              dequantize_weight_row(w.view, r, wrow.data());
              for (int64_t t = 0; t < tokens; ++t) {
                double mag = 0, act_rounding = 0;
                for (int64_t b = 0; b < cols / group; ++b) {  // activations share a scale per group
                  double amax = 0, wsum = 0;
                  for (int64_t i = group * b; i < group * b + group; ++i) {
                    mag += std::fabs(double(wrow[size_t(i)]) * x[size_t(t * cols + i)]);
                    amax = std::max(amax, double(std::fabs(x[size_t(t * cols + i)])));
                    wsum += std::fabs(wrow[size_t(i)]);
                  }
                  act_rounding += amax / 254 * wsum;
                }
                const size_t k = size_t(t * rows + r);
                // AVX2 == the scalar integer reference to float rounding,
                ASSERT_LE(std::fabs(double(y[k]) - y_ref[k]), 1e-5 * mag + 1e-6)
                    << dtype_name(plane) << " group " << group << " rows " << rows << " cols " << cols << " tokens " << tokens;
                // and both == dequantize-then-dot up to the int8 activation rounding.
                ASSERT_LE(std::fabs(double(y[k]) - y_float[k]), act_rounding * (1 + 1e-4) + 1e-5 * mag + 1e-6)
                    << dtype_name(plane) << " group " << group << " rows " << rows << " cols " << cols << " tokens " << tokens;
              }
            }
          }
        }
      }
    }
  }
}

TEST(Int4Affine, StridedRowSlicesReadTheirOwnPlanes) {
  // rows_slice (the up half of a fused gate_up) moves the packed, scale and bias planes.
  ThreadPool pool(2);
  std::mt19937 rng(12);
  AffineMatrix w(8, 64, 32, DType::BF16, rng);
  WeightView up = w.view.rows_slice(4, 4);
  std::vector<float> x = random_floats(64, rng), y(4), y_full(8);
  cpu::int4_affine_matmul(pool, up, Mat(x.data(), 1, 64), Mat(y.data(), 1, 4));
  cpu::int4_affine_matmul(pool, w.view, Mat(x.data(), 1, 64), Mat(y_full.data(), 1, 8));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(y[size_t(r)], y_full[size_t(4 + r)]);
  EXPECT_EQ(w.view.bytes(), 8 * (32 + 2 * 4));
}

TEST(Int4Affine, QuantizeRoundTripWithinHalfAStep) {
  std::mt19937 rng(13);
  for (float sd : {0.05f, 1e-3f, 1e-6f, 1e-7f}) {  // tiny weights too: the bound is relative
    for (int64_t group : {32, 64, 128}) {
      const int64_t cols = 128 * 32;
      std::vector<float> w = random_floats(size_t(cols), rng, sd);
      for (int64_t i = 0; i < 32; ++i) w[size_t(i)] = 0.25f;  // a constant group: scale 0
      std::vector<float> amax(size_t(cols / group), 0.f);    // float rounding of s * q + b scales with it
      for (int64_t i = 0; i < cols; ++i) amax[size_t(i / group)] = std::max(amax[size_t(i / group)], std::fabs(w[size_t(i)]));
      std::vector<uint8_t> packed(static_cast<size_t>(cols / 2));
      std::vector<float> scales(size_t(cols / group)), biases(size_t(cols / group)), back(static_cast<size_t>(cols));
      int4_affine::quantize_row(w.data(), cols, group, DType::F32, packed.data(), scales.data(), biases.data());
      int4_affine::dequantize_row(packed.data(), scales.data(), biases.data(), DType::F32, group, back.data(), cols);
      for (int64_t i = 0; i < cols; ++i) {
        const float s = scales[size_t(i / group)];
        ASSERT_LE(std::fabs(back[size_t(i)] - w[size_t(i)]), 0.5f * s * (1 + 1e-5f) + 4 * FLT_EPSILON * amax[size_t(i / group)])
            << "sd " << sd << " group " << group << " i " << i;
      }
      // BF16 planes (what convert writes for bf16 models): codes use the rounded scale and
      // bias, so the error stays within a half step plus the planes' rounding at the edges.
      std::vector<uint16_t> s16(scales.size()), b16(biases.size());
      int4_affine::quantize_row(w.data(), cols, group, DType::BF16, packed.data(), s16.data(), b16.data());
      int4_affine::dequantize_row(packed.data(), s16.data(), b16.data(), DType::BF16, group, back.data(), cols);
      for (int64_t i = 0; i < cols; ++i) {
        const float s = bf16_to_f32(s16[size_t(i / group)]), b = bf16_to_f32(b16[size_t(i / group)]);
        const float bound = 0.5f * s * (1 + 1e-5f) + 16.f * s / 128.f + std::fabs(b) / 128.f + 4 * FLT_EPSILON * amax[size_t(i / group)];
        ASSERT_LE(std::fabs(back[size_t(i)] - w[size_t(i)]), bound) << "bf16 sd " << sd << " group " << group << " i " << i;
      }
    }
  }
}

// The least-squares refit never does worse than MLX's min/max fit on any group, and does
// better on average (gaussian weights, the bulk of a real layer).
TEST(Int4Affine, RefitLowersSquaredErrorAgainstMinMax) {
  std::mt19937 rng(15);
  for (int64_t group : {32, 64, 128}) {
    const int64_t cols = 128 * 64;
    std::vector<float> w = random_floats(size_t(cols), rng, 0.02f);
    std::vector<uint8_t> packed(static_cast<size_t>(cols / 2));
    std::vector<uint16_t> s16(size_t(cols / group)), b16(size_t(cols / group));
    std::vector<float> back(static_cast<size_t>(cols));
    int4_affine::quantize_row(w.data(), cols, group, DType::BF16, packed.data(), s16.data(), b16.data());
    int4_affine::dequantize_row(packed.data(), s16.data(), b16.data(), DType::BF16, group, back.data(), cols);
    double ours = 0, minmax = 0;
    for (int64_t g = 0; g < cols / group; ++g) {
      const float* x = w.data() + g * group;
      float lo = x[0], hi = x[0];
      for (int64_t i = 1; i < group; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
      const float s = bf16_to_f32(f32_to_bf16((hi - lo) / 15.f)), b = bf16_to_f32(f32_to_bf16(lo));
      double e_ours = 0, e_mm = 0;
      for (int64_t i = 0; i < group; ++i) {
        const float q = std::clamp(std::nearbyint((x[i] - b) * (1.f / s)), 0.f, 15.f);  // as quantize_row rounds
        e_mm += std::pow(double(s * q + b - x[i]), 2);
        e_ours += std::pow(double(back[size_t(g * group + i)] - x[i]), 2);
      }
      ASSERT_LE(e_ours, e_mm * (1 + 1e-6)) << "group size " << group << " group " << g;
      ours += e_ours, minmax += e_mm;
    }
    EXPECT_LT(ours, 0.97 * minmax) << "group size " << group;
    std::printf("[int4] group %3lld: squared error %.4g vs min/max %.4g (%.1f%% lower)\n", (long long)group, ours, minmax,
                100 * (1 - ours / minmax));
  }
}

TEST(Int4Affine, EmbeddingLookupDequantizesRows) {
  std::mt19937 rng(14);
  AffineMatrix table(12, 128, 64, DType::F16, rng);
  auto be = make_cpu_backend(2);
  Weight w;
  w.view = table.view;
  const int32_t ids[4] = {11, 0, 3, 3};
  std::vector<float> out(4 * 128), want(128);
  be->embedding(w, ids, 4, 2.f, Mat(out.data(), 4, 128));
  for (int t = 0; t < 4; ++t) {
    dequantize_weight_row(table.view, ids[t], want.data());
    for (int i = 0; i < 128; ++i) ASSERT_EQ(out[size_t(t * 128 + i)], 2.f * want[size_t(i)]);
  }
}

// Routed experts in INT4_AFFINE through the backend's MoE path equal the same experts as
// floats up to the int8 activation rounding.
TEST(Int4Affine, MoeExpertsMatchDequantizedFloats) {
  std::mt19937 rng(15);
  std::vector<std::unique_ptr<AffineMatrix>> packed;
  const testing::ExpertPairs ex(128, 64, [&](int64_t rows, int64_t cols) {
    packed.push_back(std::make_unique<AffineMatrix>(rows, cols, 32, DType::BF16, rng));
    return packed.back()->view;
  });
  std::vector<float> x = random_floats(size_t(ex.kTokens * ex.hidden), rng, 1.f), yq, yf;
  auto be = make_cpu_backend(2);
  ex.run(*be, ex.packed, x, yq);
  ex.run(*be, ex.floats, x, yf);
  EXPECT_LT(testing::max_rel_error(yq.data(), yf.data(), yq.size()), 5e-2);  // two int8-rounded products deep
}

// ---- loader ----------------------------------------------------------------------------

TensorWriteSpec zeros(const std::string& name, DType t, std::vector<int64_t> shape) {
  return {name, t, shape, [](uint8_t* dst, size_t n) { std::memset(dst, 0, n); }};
}

void write_config(const std::string& dir, const std::string& text) { std::ofstream(dir + "/config.json") << text; }

std::string load_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Int4AffineLoader, ViewsPointAtThePlanes) {
  testing::TempDir dir;
  write_config(dir.str(), R"({"quantization": {"group_size": 32, "bits": 4, "mode": "affine"}})");
  write_safetensors(dir.str() + "/model.safetensors",
                    {zeros("l.weight", DType::U32, {6, 8}), zeros("l.scales", DType::BF16, {6, 2}),
                     zeros("l.biases", DType::BF16, {6, 2}), zeros("e.gate_up_proj", DType::U32, {2, 6, 8}),
                     zeros("e.gate_up_proj.scales", DType::F32, {2, 6, 2}),
                     zeros("e.gate_up_proj.biases", DType::F32, {2, 6, 2})});
  Checkpoint ck(dir.str());
  WeightView w = ck.matrix("l.weight", 6, 64);
  EXPECT_EQ(w.dtype, DType::INT4_AFFINE);
  EXPECT_EQ(w.group_size, 32);
  EXPECT_EQ(w.scales_dtype, DType::BF16);
  EXPECT_EQ(w.scales_row_bytes, 4);
  EXPECT_EQ(w.bytes(), 6 * (32 + 4 + 4));
  WeightView e1 = ck.expert_matrix("e.gate_up_proj", 1, 2, 6, 64);
  EXPECT_EQ(e1.dtype, DType::INT4_AFFINE);
  EXPECT_EQ(static_cast<const uint8_t*>(e1.scales) - static_cast<const uint8_t*>(ck.get("e.gate_up_proj.scales").data),
            6 * 2 * 4);
}

TEST(Int4AffineLoader, RefusesGroupSizeThatDoesNotDivideTheRow) {
  testing::TempDir dir;
  write_config(dir.str(), R"({"quantization_config": {"group_size": 64, "bits": 4, "mode": "affine"}})");
  write_safetensors(dir.str() + "/model.safetensors",
                    {zeros("l.weight", DType::U32, {4, 12}), zeros("l.scales", DType::BF16, {4, 1}),
                     zeros("l.biases", DType::BF16, {4, 1})});
  Checkpoint ck(dir.str());
  const std::string msg = load_error([&] { ck.matrix("l.weight", 4, 96); });
  EXPECT_NE(msg.find("l.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("group_size 64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not divide"), std::string::npos) << msg;
}

TEST(Int4AffineLoader, RefusesShortPackedTensorAndTruncatedFile) {
  testing::TempDir dir;
  write_config(dir.str(), R"({"quantization": {"group_size": 32, "bits": 4}})");
  write_safetensors(dir.str() + "/model.safetensors",
                    {zeros("l.weight", DType::U32, {4, 7}), zeros("l.scales", DType::BF16, {4, 2}),
                     zeros("l.biases", DType::BF16, {4, 2})});
  {
    Checkpoint ck(dir.str());
    const std::string msg = load_error([&] { ck.matrix("l.weight", 4, 64); });
    EXPECT_NE(msg.find("l.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[4, 7]"), std::string::npos) << msg;
  }
  // Cut the file short: the packed data no longer fits and opening says so.
  const std::string file = dir.str() + "/model.safetensors";
  std::filesystem::resize_file(file, std::filesystem::file_size(file) - 20);
  const std::string msg = load_error([&] { Checkpoint ck(dir.str()); });
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
}

TEST(Int4AffineLoader, RefusesUnsupportedConfigByName) {
  testing::TempDir dir;
  write_safetensors(dir.str() + "/model.safetensors", {zeros("w", DType::F32, {1})});
  write_config(dir.str(), R"({"quantization": {"group_size": 64, "bits": 8}})");
  EXPECT_NE(load_error([&] { Checkpoint ck(dir.str()); }).find("bits 8"), std::string::npos);
  write_config(dir.str(), R"({"quantization": {"group_size": 48, "bits": 4}})");
  EXPECT_NE(load_error([&] { Checkpoint ck(dir.str()); }).find("group_size 48"), std::string::npos);
  write_config(dir.str(), R"({"quantization": {"group_size": 32, "bits": 4, "mode": "nvfp4"}})");
  EXPECT_NE(load_error([&] { Checkpoint ck(dir.str()); }).find("mode nvfp4"), std::string::npos);
}

}  // namespace
}  // namespace turbospark
