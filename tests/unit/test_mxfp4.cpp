// MXFP4: the reference dequantizer against transformers' convert_moe_packed_tensors
// semantics, the AVX2 matmul against the scalar reference, the quantizer's round trip, and
// the loader's packed _blocks/_scales views and refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include "backends/cpu/mxfp4.h"
#include "core/error.h"
#include "core/quant_grouped.h"
#include "core/thread_pool.h"
#include "formats/safetensors.h"
#include "ops/backend.h"
#include "test_util.h"
#include "unit/mxfp4_matrix.h"

namespace turbospark {
namespace {

using testing::Mxfp4Matrix;

std::vector<float> random_floats(size_t n, std::mt19937& rng, float sd = 1.f) {
  std::normal_distribution<float> d(0.f, sd);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(Mxfp4, DequantizeMatchesTransformersLayout) {
  // transformers: out[:, 0::2] = lut[blk & 0xF], out[:, 1::2] = lut[blk >> 4], then ldexp by
  // scale - 127, per row of 16 bytes (32 values).
  std::mt19937 rng(1);
  for (int s : {0, 1, 100, 126, 127, 128, 140, 254}) {
    uint8_t blocks[16], scale = uint8_t(s);
    for (auto& b : blocks) b = uint8_t(rng());
    float got[32];
    mxfp4::dequantize_row(blocks, &scale, got, 32);
    for (int k = 0; k < 16; ++k) {
      EXPECT_EQ(got[2 * k], std::ldexp(mxfp4::kFp4Values[blocks[k] & 0xF], s - 127)) << s << " " << k;
      EXPECT_EQ(got[2 * k + 1], std::ldexp(mxfp4::kFp4Values[blocks[k] >> 4], s - 127)) << s << " " << k;
    }
  }
  // A hand-checked byte: 0x9A = low code 0xA (-1.0), high code 0x9 (-0.5); scale 2^1.
  uint8_t blocks[16] = {0x9A, 0x71};
  uint8_t scale = 128;
  float got[32];
  mxfp4::dequantize_row(blocks, &scale, got, 32);
  EXPECT_EQ(got[0], -2.0f);
  EXPECT_EQ(got[1], -1.0f);
  EXPECT_EQ(got[2], 1.0f);
  EXPECT_EQ(got[3], 12.0f);
  EXPECT_EQ(got[4], 0.0f);
}

// The exact float path: weights decoded exactly, so only the summation order differs.
TEST(Mxfp4, ExactMatmulMatchesScalarReference) {
  ThreadPool pool(2);
  std::mt19937 rng(2);
  for (int64_t rows : {1, 7, 33, 100}) {
    for (int64_t cols : {32, 64, 96, 288, 2880}) {
      Mxfp4Matrix w(rows, cols, rng);
      std::vector<float> wrow(static_cast<size_t>(cols));
      for (int64_t tokens : {1, 2, 3, 4, 5, 6, 7, 8, 9, 64}) {
        std::vector<float> x = random_floats(size_t(tokens * cols), rng);
        std::vector<float> y(size_t(tokens * rows)), y_ref(static_cast<size_t>(tokens * rows));
        cpu::mxfp4_matmul_exact(pool, w.view, Mat(x.data(), tokens, cols), Mat(y.data(), tokens, rows));
        cpu::ref::mxfp4_matmul(w.view, Mat(x.data(), tokens, cols), Mat(y_ref.data(), tokens, rows));
        for (int64_t r = 0; r < rows; ++r) {
          dequantize_weight_row(w.view, r, wrow.data());
          for (int64_t t = 0; t < tokens; ++t) {
            double mag = 0;
            for (int64_t i = 0; i < cols; ++i) mag += std::fabs(double(wrow[size_t(i)]) * x[size_t(t * cols + i)]);
            const double err = std::fabs(double(y[size_t(t * rows + r)]) - y_ref[size_t(t * rows + r)]);
            ASSERT_LE(err, 1e-5 * mag + 1e-6) << "rows " << rows << " cols " << cols << " tokens " << tokens;
          }
        }
      }
    }
  }
}

// The int8 fast path: against its scalar twin (same activation rounding) to float rounding,
// and against "dequantize, then float matmul" within the activation step: each element of
// x moves by at most amax(its 32-block) / 254, so the dot by at most the sum of |w| times that.
TEST(Mxfp4, Int8MatmulWithinActivationStepOfFloatReference) {
  ThreadPool pool(2);
  std::mt19937 rng(12);
  for (int64_t rows : {1, 3, 7, 33, 100}) {
    for (int64_t cols : {32, 64, 96, 288, 2880}) {
      Mxfp4Matrix w(rows, cols, rng);
      std::vector<float> wrow(static_cast<size_t>(cols));
      for (int64_t tokens : {1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 64}) {
        std::vector<float> x = random_floats(size_t(tokens * cols), rng);
        if (tokens == 3) std::fill(x.begin(), x.begin() + 32, 0.f);  // an all-zero block
        std::vector<float> y(size_t(tokens * rows)), y_ref(size_t(tokens * rows)), y_int(size_t(tokens * rows));
        cpu::mxfp4_matmul_int8(pool, w.view, Mat(x.data(), tokens, cols), Mat(y.data(), tokens, rows));
        cpu::ref::mxfp4_matmul(w.view, Mat(x.data(), tokens, cols), Mat(y_ref.data(), tokens, rows));
        cpu::ref::mxfp4_matmul_int8(w.view, Mat(x.data(), tokens, cols), Mat(y_int.data(), tokens, rows));
        for (int64_t r = 0; r < rows; ++r) {
          dequantize_weight_row(w.view, r, wrow.data());
          for (int64_t t = 0; t < tokens; ++t) {
            const float* xt = x.data() + t * cols;
            double mag = 0, bound = 0;
            for (int64_t b = 0; b < cols / 32; ++b) {
              double amax = 0, wsum = 0;
              for (int64_t i = 32 * b; i < 32 * b + 32; ++i) {
                amax = std::max(amax, std::fabs(double(xt[i])));
                wsum += std::fabs(double(wrow[size_t(i)]));
                mag += std::fabs(double(wrow[size_t(i)]) * xt[i]);
              }
              bound += wsum * amax / 254.0;
            }
            const size_t o = size_t(t * rows + r);
            ASSERT_LE(std::fabs(double(y[o]) - y_int[o]), 1e-5 * (mag + bound) + 1e-6)
                << "rows " << rows << " cols " << cols << " tokens " << tokens;
            ASSERT_LE(std::fabs(double(y[o]) - y_ref[o]), bound * (1 + 1e-4) + 1e-5 * mag + 1e-6)
                << "rows " << rows << " cols " << cols << " tokens " << tokens;
          }
        }
      }
    }
  }
}

TEST(Mxfp4, ExtremeScalesDecodeLikeLdexp) {
  // The kernels build 2^(e-127) from bits or a table; e = 0 (subnormal) and large e must
  // agree. x in {-1, 0, 1} is exact in int8 up to the scale's own rounding.
  ThreadPool pool(1);
  std::mt19937 rng(3);
  for (auto range : {std::pair{0, 3}, std::pair{200, 220}}) {
    // 288 columns: nine blocks, so the int8 kernel's eight-block loop (vector exponent
    // decode) and its one-block tail both meet the extreme exponents.
    constexpr int64_t C = 288;
    Mxfp4Matrix w(4, C, rng, range.first, range.second);
    std::vector<float> x(C, 0.f);
    for (int i = 0; i < C; ++i) x[size_t(i)] = (i % 3) - 1.f;
    std::vector<float> y(4), y_ref(4), y_int(4);
    cpu::mxfp4_matmul_exact(pool, w.view, Mat(x.data(), 1, C), Mat(y.data(), 1, 4));
    cpu::mxfp4_matmul_int8(pool, w.view, Mat(x.data(), 1, C), Mat(y_int.data(), 1, 4));
    cpu::ref::mxfp4_matmul(w.view, Mat(x.data(), 1, C), Mat(y_ref.data(), 1, 4));
    for (int r = 0; r < 4; ++r) {
      EXPECT_NEAR(y[size_t(r)], y_ref[size_t(r)], 1e-5 * std::fabs(y_ref[size_t(r)]) + 1e-40f);
      // d * 2^-128 is subnormal for the smallest scales: a few bits of the scale go.
      EXPECT_NEAR(y_int[size_t(r)], y_ref[size_t(r)], 1e-3 * std::fabs(y_ref[size_t(r)]) + 1e-40f);
    }
  }
}

TEST(Mxfp4, QuantizeRoundTripWithinHalfAStep) {
  std::mt19937 rng(4);
  const int64_t cols = 32 * 64;
  std::vector<float> w = random_floats(size_t(cols), rng, 0.05f);
  w[5] = 0.f;
  w[100] = -3e-3f;
  std::vector<uint8_t> blocks(size_t(cols / 2)), scales(static_cast<size_t>(cols / 32));
  std::vector<float> back(static_cast<size_t>(cols));
  mxfp4::quantize_row(w.data(), blocks.data(), scales.data(), cols);
  mxfp4::dequantize_row(blocks.data(), scales.data(), back.data(), cols);
  for (int64_t i = 0; i < cols; ++i) {
    const float s = mxfp4::e8m0_to_float(scales[size_t(i / 32)]);
    const float a = std::fabs(w[size_t(i)]) / s;  // <= 6 by construction of the scale
    ASSERT_LE(a, 6.f) << i;
    const float half_step = a < 2.f ? 0.25f : (a < 4.f ? 0.5f : 1.f);
    ASSERT_LE(std::fabs(back[size_t(i)] - w[size_t(i)]), half_step * s * (1 + 1e-6f)) << i;
  }
  // Representable values survive exactly.
  std::vector<uint8_t> blocks2(blocks.size()), scales2(scales.size());
  std::vector<float> back2(back.size());
  mxfp4::quantize_row(back.data(), blocks2.data(), scales2.data(), cols);
  mxfp4::dequantize_row(blocks2.data(), scales2.data(), back2.data(), cols);
  EXPECT_EQ(back, back2);
}

// ---- loader ----------------------------------------------------------------------------

void write_config(const std::string& dir, const std::string& text) {
  std::ofstream(dir + "/config.json") << text;
}

TensorWriteSpec bytes_tensor(const std::string& name, DType t, std::vector<int64_t> shape, std::vector<uint8_t> data) {
  auto shared = std::make_shared<std::vector<uint8_t>>(std::move(data));
  return {name, t, shape, [shared](uint8_t* dst, size_t n) { std::memcpy(dst, shared->data(), n); }};
}

TEST(Mxfp4Loader, ExpertStackViewsReadTheFileInPlace) {
  testing::TempDir dir;
  write_config(dir.str(), R"({"quantization_config": {"quant_method": "mxfp4"}})");
  const int64_t E = 3, rows = 4, cols = 64;
  std::mt19937 rng(5);
  std::vector<uint8_t> blocks(size_t(E * rows * cols / 2)), scales(size_t(E * rows * cols / 32));
  for (auto& b : blocks) b = uint8_t(rng());
  for (auto& s : scales) s = uint8_t(120 + rng() % 10);
  write_safetensors(dir.str() + "/model.safetensors",
                    {bytes_tensor("mlp.experts.down_proj_blocks", DType::U8, {E, rows, cols / 32, 16}, blocks),
                     bytes_tensor("mlp.experts.down_proj_scales", DType::U8, {E, rows, cols / 32}, scales)});
  Checkpoint ck(dir.str());
  EXPECT_EQ(ck.quantization().method, QuantConfig::Method::kMxfp4);
  EXPECT_TRUE(ck.has("mlp.experts.down_proj"));
  for (int64_t e = 0; e < E; ++e) {
    WeightView w = ck.expert_matrix("mlp.experts.down_proj", e, E, rows, cols, StackLayout::kInOut);
    ASSERT_EQ(w.dtype, DType::MXFP4);
    WeightView w2 = ck.matrix_in_stack("mlp.experts.down_proj", e, E, rows, cols);
    EXPECT_EQ(w.data, w2.data);
    for (int64_t r = 0; r < rows; ++r) {
      float got[64], want[64];
      dequantize_weight_row(w, r, got);
      const int64_t rr = e * rows + r;
      mxfp4::dequantize_row(blocks.data() + rr * cols / 2, scales.data() + rr * cols / 32, want, cols);
      for (int i = 0; i < cols; ++i) ASSERT_EQ(got[i], want[i]);
    }
  }
  EXPECT_TRUE(ck.matrix_uses().at("mlp.experts.down_proj").expert_stack);
}

TEST(Mxfp4Loader, Bf16InOutExpertsAreTransposed) {
  testing::TempDir dir;
  const int64_t E = 2, in = 3, out = 5;
  std::vector<uint8_t> data(size_t(E * in * out * 2));
  for (int64_t k = 0; k < E * in * out; ++k) {
    const uint16_t h = f32_to_bf16(float(k));
    std::memcpy(data.data() + 2 * k, &h, 2);
  }
  write_safetensors(dir.str() + "/model.safetensors", {bytes_tensor("experts.gate_up_proj", DType::BF16, {E, in, out}, data)});
  Checkpoint ck(dir.str());
  WeightView w = ck.expert_matrix("experts.gate_up_proj", 1, E, out, in, StackLayout::kInOut);
  for (int64_t o = 0; o < out; ++o) {
    float row[3];
    dequantize_weight_row(w, o, row);
    for (int64_t i = 0; i < in; ++i) EXPECT_EQ(row[i], float(in * out + i * out + o));
  }
}

TEST(Mxfp4Loader, RefusesBlocksAndScalesThatDisagree) {
  testing::TempDir dir;
  write_config(dir.str(), R"({"quantization_config": {"quant_method": "mxfp4"}})");
  write_safetensors(dir.str() + "/model.safetensors",
                    {bytes_tensor("mlp.experts.gate_up_proj_blocks", DType::U8, {2, 4, 2, 16}, std::vector<uint8_t>(256)),
                     bytes_tensor("mlp.experts.gate_up_proj_scales", DType::U8, {2, 4, 3}, std::vector<uint8_t>(24))});
  Checkpoint ck(dir.str());
  try {
    ck.matrix_in_stack("mlp.experts.gate_up_proj", 0, 2, 4, 64);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("gate_up_proj_blocks"), std::string::npos) << msg;
    EXPECT_NE(msg.find("disagrees"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST(Mxfp4Loader, RefusesUnknownQuantMethodByName) {
  testing::TempDir dir;
  write_config(dir.str(), R"({"quantization_config": {"quant_method": "gptq", "bits": 4}})");
  write_safetensors(dir.str() + "/model.safetensors",
                    {bytes_tensor("w", DType::F32, {1}, std::vector<uint8_t>(4))});
  try {
    Checkpoint ck(dir.str());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("quant_method gptq"), std::string::npos) << e.what();
  }
}

TEST(Mxfp4Backend, EmbeddingDequantizesRows) {
  std::mt19937 rng(6);
  Mxfp4Matrix table(10, 64, rng);
  auto be = make_cpu_backend(2);
  Weight w;
  w.view = table.view;
  const int32_t ids[3] = {9, 0, 4};
  std::vector<float> out(3 * 64), want(64);
  be->embedding(w, ids, 3, 0.5f, Mat(out.data(), 3, 64));
  for (int t = 0; t < 3; ++t) {
    dequantize_weight_row(table.view, ids[t], want.data());
    for (int i = 0; i < 64; ++i) ASSERT_EQ(out[size_t(t * 64 + i)], 0.5f * want[size_t(i)]);
  }
  const int32_t bad[1] = {10};
  EXPECT_THROW(be->embedding(w, bad, 1, 1.f, Mat(out.data(), 1, 64)), Error);
}

// Routed experts in MXFP4 through the backend's MoE path equal the same experts as floats.
TEST(Mxfp4Backend, MoeExpertsMatchDequantizedFloats) {
  std::mt19937 rng(7);
  std::vector<std::unique_ptr<Mxfp4Matrix>> packed;
  const testing::ExpertPairs ex(64, 32, [&](int64_t rows, int64_t cols) {
    packed.push_back(std::make_unique<Mxfp4Matrix>(rows, cols, rng));
    return packed.back()->view;
  });
  std::vector<float> x = random_floats(size_t(ex.kTokens * ex.hidden), rng, 0.1f), yq, yf;
  auto be = make_cpu_backend(2);
  ex.run(*be, ex.floats, x, yf);
  {
    testing::Mxfp4Activations float32(false);
    ex.run(*be, ex.packed, x, yq);
    EXPECT_LT(testing::max_rel_error(yq.data(), yf.data(), yq.size()), 1e-4);
  }
  testing::Mxfp4Activations int8(true);
  ex.run(*be, ex.packed, x, yq);
  EXPECT_LT(testing::max_rel_error(yq.data(), yf.data(), yq.size()), 5e-2);  // two int8-rounded products deep
}

}  // namespace
}  // namespace turbospark
