// Quant formats (core/quant.h) and the quantized CPU kernels (backends/cpu/quant_matmul.h).
//   - each dequantizer against golden values computed by the reference implementation
//     (gguf-py's numpy dequantizers, tests/data/quant/goldens.json, made by
//     tools/gguf/make_quant_goldens.py) from random block bytes;
//   - the reference quantizers round-trip within each format's step;
//   - quant_matmul against "dequantize, then float matmul in double" on ragged shapes, with
//     a per-output bound derived from the activation rounding, and against the scalar
//     integer reference to float rounding; with activations that quantize exactly, the
//     integer kernels must match the float product to float rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backends/cpu/quant_matmul.h"
#include "core/error.h"
#include "core/quant.h"
#include "test_util.h"

namespace turbospark {
namespace {

constexpr DType kQuantTypes[] = {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1,
                                 DType::Q8_0, DType::Q4_K, DType::Q5_K, DType::Q6_K};

std::vector<uint8_t> from_hex(const std::string& hex) {
  std::vector<uint8_t> out(hex.size() / 2);
  for (size_t i = 0; i < out.size(); ++i) out[i] = uint8_t(std::stoi(hex.substr(2 * i, 2), nullptr, 16));
  return out;
}

DType dtype_by_name(const std::string& name) {
  for (int i = 0; i < int(DType::kCount); ++i)
    if (dtype_name(DType(i)) == name) return DType(i);
  ADD_FAILURE() << "no dtype " << name;
  return DType::F32;
}

// Byte offsets of the f16 scale fields inside one block (as tools/gguf/make_quant_goldens.py).
std::vector<int> scale_offsets(DType t) {
  switch (t) {
    case DType::Q4_1: case DType::Q5_1: case DType::Q4_K: case DType::Q5_K: return {0, 2};
    case DType::Q6_K: return {208};
    default: return {0};
  }
}

// Random block bytes (every bit pattern of the quants, sub-block scales and high bits,
// including Q8_0's -128) with finite f16 scales of moderate size.
std::vector<uint8_t> random_blocks(DType t, int64_t n_blocks, std::mt19937& rng) {
  const int64_t bb = block_bytes(t);
  std::vector<uint8_t> bytes(size_t(n_blocks * bb));
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> scale(-0.05f, 0.05f);
  for (auto& b : bytes) b = uint8_t(byte(rng));
  for (int64_t b = 0; b < n_blocks; ++b) {
    for (int off : scale_offsets(t)) {
      const uint16_t h = f32_to_f16(scale(rng));
      std::memcpy(bytes.data() + b * bb + off, &h, 2);
    }
  }
  return bytes;
}

std::vector<float> random_normal(size_t n, std::mt19937& rng, float sigma = 1.f) {
  std::normal_distribution<float> dist(0.f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// ---- formats ----------------------------------------------------------------------------------

TEST(Quant, GeometryAndNames) {
  struct Expect { DType t; int64_t block, bytes; const char* name; };
  const Expect cases[] = {{DType::Q4_0, 32, 18, "Q4_0"},  {DType::Q4_1, 32, 20, "Q4_1"},
                          {DType::Q5_0, 32, 22, "Q5_0"},  {DType::Q5_1, 32, 24, "Q5_1"},
                          {DType::Q8_0, 32, 34, "Q8_0"},  {DType::Q4_K, 256, 144, "Q4_K"},
                          {DType::Q5_K, 256, 176, "Q5_K"}, {DType::Q6_K, 256, 210, "Q6_K"}};
  for (const auto& c : cases) {
    EXPECT_TRUE(is_quantized(c.t));
    EXPECT_EQ(block_size(c.t), c.block);
    EXPECT_EQ(block_bytes(c.t), c.bytes);
    EXPECT_EQ(dtype_name(c.t), c.name);
    EXPECT_EQ(row_bytes(c.t, 3 * c.block), 3 * c.bytes);
    EXPECT_THROW(row_bytes(c.t, c.block + 1), Error) << c.name;
  }
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    EXPECT_FALSE(is_quantized(t));
    EXPECT_EQ(block_size(t), 1);
    EXPECT_EQ(row_bytes(t, 7), 7 * int64_t(dtype_size(t)));
  }
  EXPECT_EQ(quant::Q4_K::kBlockBytes, 144);
  EXPECT_EQ(quant::Q6_K::kBlock, 256);
}

// Values computed by gguf-py from the same bytes. They agree bit for bit today; the
// tolerance (a few ulp of the block's largest value) only allows a compiler that contracts
// d * q - m into an FMA.
TEST(Quant, DequantizeMatchesGgufPyGoldens) {
  const auto goldens = testing::read_json(testing::source_dir() + "/tests/data/quant/goldens.json");
  int checked = 0;
  for (const auto& [name, g] : goldens.at("formats").items()) {
    const DType t = dtype_by_name(name);
    const std::vector<uint8_t> raw = from_hex(g.at("hex").get<std::string>());
    const std::vector<float> want = g.at("values").get<std::vector<float>>();
    const int64_t n = g.at("n").get<int64_t>();
    ASSERT_EQ(int64_t(want.size()), n) << name;
    ASSERT_EQ(int64_t(raw.size()), row_bytes(t, n)) << name;
    std::vector<float> got(size_t(n), std::nanf(""));
    dequantize_row(t, raw.data(), got.data(), n);
    const int64_t block = std::max<int64_t>(block_size(t), 1);
    for (int64_t b0 = 0; b0 < n; b0 += block) {
      float block_max = 0.f;
      for (int64_t i = b0; i < b0 + block; ++i) block_max = std::max(block_max, std::fabs(want[size_t(i)]));
      const float tol = is_quantized(t) ? 4e-7f * block_max : 0.f;
      for (int64_t i = b0; i < b0 + block; ++i)
        ASSERT_NEAR(got[size_t(i)], want[size_t(i)], tol) << name << " element " << i;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 10);
}

// A corrupted layout must be caught: swapping the two nibble halves of one Q4_0 block
// changes the dequantized values (guards against a test that cannot fail).
TEST(Quant, GoldensDetectLayoutMistakes) {
  const auto goldens = testing::read_json(testing::source_dir() + "/tests/data/quant/goldens.json");
  const auto& g = goldens.at("formats").at("Q4_0");
  std::vector<uint8_t> raw = from_hex(g.at("hex").get<std::string>());
  const std::vector<float> want = g.at("values").get<std::vector<float>>();
  for (int i = 2; i < 18; ++i) raw[size_t(i)] = uint8_t(raw[size_t(i)] >> 4 | raw[size_t(i)] << 4);
  std::vector<float> got(want.size());
  dequantize_row(DType::Q4_0, raw.data(), got.data(), int64_t(want.size()));
  int differ = 0;
  for (int i = 0; i < 32; ++i) differ += got[size_t(i)] != want[size_t(i)];
  EXPECT_GT(differ, 0);
}

TEST(Quant, K4ScalePackingRoundTrips) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> six(0, 63);
  for (int iter = 0; iter < 200; ++iter) {
    uint8_t sc[8], m[8], packed[12], sc2[8], m2[8];
    for (int s = 0; s < 8; ++s) sc[s] = uint8_t(six(rng)), m[s] = uint8_t(six(rng));
    quant::pack_k4_scales(sc, m, packed);
    quant::unpack_k4_scales(packed, sc2, m2);
    for (int s = 0; s < 8; ++s) {
      ASSERT_EQ(sc2[s], sc[s]);
      ASSERT_EQ(m2[s], m[s]);
    }
  }
}

// Round-to-nearest reference quantizers: RMS error relative to the data's RMS, per format
// (about step / sqrt(12) for each format's step), and exact zeros for a zero block.
TEST(Quant, ReferenceQuantizersRoundTrip) {
  struct Case { DType t; double max_rel_rms; };
  const Case cases[] = {{DType::Q4_0, 0.13}, {DType::Q4_1, 0.10}, {DType::Q5_0, 0.065},
                        {DType::Q5_1, 0.05}, {DType::Q8_0, 0.008},
                        {DType::Q4_K, 0.11}, {DType::Q5_K, 0.055}, {DType::Q6_K, 0.03},
                        {DType::F16, 1e-3},  {DType::BF16, 5e-3}};
  std::mt19937 rng(11);
  const int64_t n = 4096;
  for (const auto& c : cases) {
    const std::vector<float> x = random_normal(size_t(n), rng, 0.7f);
    std::vector<uint8_t> q(size_t(row_bytes(c.t, n)));
    quantize_row(c.t, x.data(), q.data(), n);
    std::vector<float> back(static_cast<size_t>(n));
    dequantize_row(c.t, q.data(), back.data(), n);
    double err = 0, ref = 0;
    for (int64_t i = 0; i < n; ++i) err += std::pow(back[size_t(i)] - x[size_t(i)], 2), ref += std::pow(x[size_t(i)], 2);
    EXPECT_LT(std::sqrt(err / ref), c.max_rel_rms) << dtype_name(c.t);
    EXPECT_GT(std::sqrt(err / ref), c.t == DType::F16 ? 0.0 : 1e-6) << dtype_name(c.t) << " (suspiciously exact)";

    std::vector<float> zeros(size_t(n), 0.f);
    quantize_row(c.t, zeros.data(), q.data(), n);
    dequantize_row(c.t, q.data(), back.data(), n);
    for (float v : back) ASSERT_EQ(v, 0.f) << dtype_name(c.t);
  }
}

TEST(Quant, ActivationQuantizersStayWithinHalfAStep) {
  std::mt19937 rng(3);
  const int64_t n = 512;
  std::vector<float> x = random_normal(size_t(n), rng, 2.f);
  x[5] = 0.f;
  std::fill(x.begin() + 64, x.begin() + 96, 0.f);  // an all-zero 32-block
  std::vector<BlockQ8x32> a(size_t(n / 32));
  quantize_row_q8x32(x.data(), a.data(), n);
  for (int64_t b = 0; b < n / 32; ++b) {
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      const float v = x[size_t(32 * b + i)];
      ASSERT_GE(a[size_t(b)].qs[i], -127);
      ASSERT_LE(std::fabs(a[size_t(b)].d * a[size_t(b)].qs[i] - v), a[size_t(b)].d * 0.5001f + 1e-30f);
      sum += a[size_t(b)].qs[i];
    }
    EXPECT_FLOAT_EQ(a[size_t(b)].s, a[size_t(b)].d * float(sum));
  }
  EXPECT_EQ(a[2].d, 0.f);
  std::vector<BlockQ8_K> k(size_t(n / 256));
  quantize_row_q8_K(x.data(), k.data(), n);
  for (int64_t b = 0; b < n / 256; ++b) {
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        const float v = x[size_t(256 * b + i)];
        ASSERT_LE(std::fabs(k[size_t(b)].d * k[size_t(b)].qs[i] - v), k[size_t(b)].d * 0.5001f);
        sum += k[size_t(b)].qs[i];
      }
      EXPECT_EQ(k[size_t(b)].bsums[g], sum);
    }
  }
}

// ---- quant_matmul -----------------------------------------------------------------------------

struct QuantWeight {
  std::vector<uint8_t> bytes;
  std::vector<float> dequant;  // [rows, cols]
  WeightView view;
};

// rows x cols weight of type t, either quantized from random normals by the reference
// quantizer or random block bytes; rows are `pad` bytes wider than needed so the kernels
// must honour row_bytes.
QuantWeight make_weight(DType t, int64_t rows, int64_t cols, bool random_bytes, std::mt19937& rng, int64_t pad = 0) {
  QuantWeight w;
  const int64_t rb = row_bytes(t, cols);
  w.bytes.assign(size_t(rows * (rb + pad)), 0xAB);
  w.dequant.resize(size_t(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* dst = w.bytes.data() + r * (rb + pad);
    if (random_bytes) {
      const std::vector<uint8_t> blocks = random_blocks(t, cols / block_size(t), rng);
      std::memcpy(dst, blocks.data(), blocks.size());
    } else {
      const std::vector<float> v = random_normal(size_t(cols), rng, 0.05f);
      quantize_row(t, v.data(), dst, cols);
    }
    dequantize_row(t, dst, w.dequant.data() + r * cols, cols);
  }
  w.view = WeightView{t, w.bytes.data(), rows, cols, rb + pad};
  return w;
}

int64_t activation_block(DType t) { return block_size(t) == 256 ? 256 : 32; }

// Scale of the float rounding in one output: the kernels form per-block terms as large as
// 2 * max|w| * |x| (a biased 4-bit quant times the scale, then the offset: Q4_0's -8,
// Q4_1's m, the k-quant minimums) that partly cancel, so rounding is relative to
// sum over blocks of max|w_block| * sum|x_block|, not to |y|.
double rounding_scale(const QuantWeight& w, int64_t o, const float* xt) {
  const int64_t cols = w.view.cols, blk = block_size(w.view.dtype);
  const float* wo = w.dequant.data() + o * cols;
  double scale = 0;
  for (int64_t b0 = 0; b0 < cols; b0 += blk) {
    double wmax = 0, xsum = 0;
    for (int64_t i = b0; i < b0 + blk; ++i) wmax = std::max(wmax, double(std::fabs(wo[i]))), xsum += std::fabs(xt[i]);
    scale += wmax * xsum;
  }
  return scale + 1e-30;
}

// |y - exact| <= (error of rounding each x to its Q8 block step) + float slack, per output.
void expect_within_activation_rounding(const QuantWeight& w, const std::vector<float>& x, int64_t T,
                                       const std::vector<float>& y, const std::string& label) {
  const int64_t rows = w.view.rows, cols = w.view.cols, ab = activation_block(w.view.dtype);
  for (int64_t t = 0; t < T; ++t) {
    const float* xt = x.data() + t * cols;
    for (int64_t o = 0; o < rows; ++o) {
      const float* wo = w.dequant.data() + o * cols;
      double exact = 0, bound = 0;
      for (int64_t b0 = 0; b0 < cols; b0 += ab) {
        double amax = 0, wsum = 0;
        for (int64_t i = b0; i < b0 + ab; ++i) {
          exact += double(wo[i]) * xt[i];
          amax = std::max(amax, double(std::fabs(xt[i])));
          wsum += std::fabs(wo[i]);
        }
        bound += amax / 127.0 * 0.5 * wsum;
      }
      bound = bound * 1.001 + 4e-6 * rounding_scale(w, o, xt);
      ASSERT_LE(std::fabs(y[size_t(t * rows + o)] - exact), bound) << label << " t " << t << " o " << o;
    }
  }
}

TEST(QuantMatmul, MatchesDequantizedMatmulOnRaggedShapes) {
  ThreadPool pool(3);
  std::mt19937 rng(42);
  for (DType t : kQuantTypes) {
    const int64_t blk = block_size(t);
    for (int64_t cols : {blk, 3 * blk}) {
      for (int64_t rows : {1, 3, 17}) {
        for (bool random_bytes : {false, true}) {
          const QuantWeight w = make_weight(t, rows, cols, random_bytes, rng, /*pad=*/rows == 3 ? 6 : 0);
          for (int64_t T : {1, 2, 5}) {
            const std::string label = std::string(dtype_name(t)) + " [" + std::to_string(rows) + ", " +
                                      std::to_string(cols) + "] T " + std::to_string(T) +
                                      (random_bytes ? " random bytes" : " quantized normals");
            std::vector<float> x = random_normal(size_t(T * cols), rng);
            // y has a stride wider than its columns; the padding must stay untouched.
            const int64_t ys = rows + 2;
            std::vector<float> ybuf(size_t(T * ys), -7.f), yref(size_t(T * rows));
            cpu::quant_matmul(pool, w.view, Mat(x.data(), T, cols), Mat(ybuf.data(), T, rows, ys));
            cpu::ref::quant_matmul(w.view, Mat(x.data(), T, cols), Mat(yref.data(), T, rows));
            std::vector<float> y(size_t(T * rows));
            for (int64_t i = 0; i < T; ++i) {
              for (int64_t o = 0; o < rows; ++o) y[size_t(i * rows + o)] = ybuf[size_t(i * ys + o)];
              EXPECT_EQ(ybuf[size_t(i * ys + rows)], -7.f) << label;
              EXPECT_EQ(ybuf[size_t(i * ys + rows + 1)], -7.f) << label;
            }
            for (int64_t i = 0; i < T; ++i)
              for (int64_t o = 0; o < rows; ++o)
                ASSERT_EQ(std::bit_cast<uint32_t>(y[size_t(i * rows + o)]), std::bit_cast<uint32_t>(yref[size_t(i * rows + o)]))
                    << label << " t " << i << " o " << o << " vs scalar integer reference (the contract: same bits)";
            expect_within_activation_rounding(w, x, T, y, label);
            expect_within_activation_rounding(w, x, T, yref, label + " (reference)");
          }
        }
      }
    }
  }
}

// Activations that are exact multiples of their block's step (integers in [-127, 127] with
// a +-127 in every block, times a power of two) quantize without error, so the integer
// kernels must reproduce the float product to float rounding: this checks every weight bit
// pattern's arithmetic, not just the error bound.
TEST(QuantMatmul, ExactWhenActivationsQuantizeExactly) {
  ThreadPool pool(2);
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> q8(-127, 127);
  for (DType t : kQuantTypes) {
    const int64_t cols = 2 * block_size(t), rows = 9, ab = activation_block(t);
    const QuantWeight w = make_weight(t, rows, cols, /*random_bytes=*/true, rng);
    for (int64_t T : {1, 4, 6}) {
      std::vector<float> x(size_t(T * cols));
      for (int64_t i = 0; i < T * cols; ++i) x[size_t(i)] = std::ldexp(float(q8(rng)), -5);
      for (int64_t i = 0; i < T * cols; i += ab) x[size_t(i)] = std::ldexp(i % 2 ? 127.f : -127.f, -5);
      std::vector<float> y(size_t(T * rows));
      cpu::quant_matmul(pool, w.view, Mat(x.data(), T, cols), Mat(y.data(), T, rows));
      for (int64_t i = 0; i < T; ++i) {
        for (int64_t o = 0; o < rows; ++o) {
          double exact = 0;
          for (int64_t c = 0; c < cols; ++c) exact += double(w.dequant[size_t(o * cols + c)]) * x[size_t(i * cols + c)];
          EXPECT_NEAR(y[size_t(i * rows + o)], exact, 4e-6 * rounding_scale(w, o, x.data() + i * cols))
              << dtype_name(t) << " T " << T << " row " << o;
        }
      }
    }
  }
}

TEST(QuantMatmul, LargerPrefillTileMatchesReference) {
  ThreadPool pool(2);
  std::mt19937 rng(9);
  for (DType t : {DType::Q4_K, DType::Q8_0, DType::Q6_K}) {
    const int64_t rows = 300, cols = 512, T = 11;
    const QuantWeight w = make_weight(t, rows, cols, false, rng);
    std::vector<float> x = random_normal(size_t(T * cols), rng);
    std::vector<float> y(size_t(T * rows)), yref(size_t(T * rows));
    cpu::quant_matmul(pool, w.view, Mat(x.data(), T, cols), Mat(y.data(), T, rows));
    cpu::ref::quant_matmul(w.view, Mat(x.data(), T, cols), Mat(yref.data(), T, rows));
    for (int64_t i = 0; i < T; ++i)
      for (int64_t o = 0; o < rows; ++o)
        ASSERT_EQ(std::bit_cast<uint32_t>(y[size_t(i * rows + o)]), std::bit_cast<uint32_t>(yref[size_t(i * rows + o)]))
            << dtype_name(t) << " t " << i << " o " << o;
  }
}

// The accumulation contract (quant_matmul.h): a row's result is the same bits whether it is
// computed alone (decode row kernel), in a group of 3 (row kernel, 3 tokens per call) or
// inside a batch of 40 (the tiled kernels from 16 rows), so batching requests together in
// a serving step cannot move a token. Random bytes: every quant and scale pattern.
TEST(QuantMatmul, RowResultsDoNotDependOnTheBatch) {
  ThreadPool pool(2);
  std::mt19937 rng(77);
  for (DType t : kQuantTypes) {
    const int64_t cols = 3 * block_size(t) + (block_size(t) == 32 ? 32 : 0), rows = 21, T = 40;
    const QuantWeight w = make_weight(t, rows, cols, /*random_bytes=*/true, rng);
    const std::vector<float> x = random_normal(size_t(T * cols), rng);
    std::vector<float> all(size_t(T * rows)), part(size_t(T * rows));
    cpu::quant_matmul(pool, w.view, Mat(const_cast<float*>(x.data()), T, cols), Mat(all.data(), T, rows));
    for (int64_t group : {1, 3, 17}) {
      for (int64_t t0 = 0; t0 < T; t0 += group) {
        const int64_t n = std::min(group, T - t0);
        cpu::quant_matmul(pool, w.view, Mat(const_cast<float*>(x.data()) + t0 * cols, n, cols),
                          Mat(part.data() + t0 * rows, n, rows));
      }
      for (int64_t i = 0; i < T * rows; ++i)
        ASSERT_EQ(std::bit_cast<uint32_t>(part[size_t(i)]), std::bit_cast<uint32_t>(all[size_t(i)]))
            << dtype_name(t) << " in groups of " << group << ": token " << i / rows << " output " << i % rows;
    }
  }
}

TEST(QuantMatmul, RefusesWhatItCannotDo) {
  ThreadPool pool(1);
  std::vector<float> x(512), y(4);
  std::vector<uint8_t> wbytes(4096);
  WeightView f32{DType::F32, wbytes.data(), 2, 256, 1024};
  try {
    cpu::quant_matmul(pool, f32, Mat(x.data(), 1, 256), Mat(y.data(), 1, 2));
    ADD_FAILURE() << "F32 weight accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("F32"), std::string::npos) << e.what();
  }
  WeightView q4k{DType::Q4_K, wbytes.data(), 2, 256, 144};
  EXPECT_THROW(cpu::quant_matmul(pool, q4k, Mat(x.data(), 1, 512), Mat(y.data(), 1, 2)), Error);  // cols
  EXPECT_THROW(cpu::quant_matmul(pool, q4k, Mat(x.data(), 1, 256), Mat(y.data(), 1, 3)), Error);  // rows
  WeightView ragged{DType::Q4_0, wbytes.data(), 2, 48, 36};
  EXPECT_THROW(cpu::quant_matmul(pool, ragged, Mat(x.data(), 1, 48), Mat(y.data(), 1, 2)), Error);
}

TEST(QuantEmbedding, DequantizesRowsAndScales) {
  std::mt19937 rng(13);
  for (DType t : {DType::Q4_0, DType::Q4_1, DType::Q5_0, DType::Q5_1, DType::Q8_0, DType::Q4_K, DType::Q5_K,
                  DType::Q6_K, DType::F16, DType::BF16, DType::F32}) {
    const int64_t vocab = 7, dim = 256;
    QuantWeight w;
    const int64_t rb = row_bytes(t, dim);
    if (is_quantized(t)) {
      w = make_weight(t, vocab, dim, true, rng);
    } else {
      w.bytes.resize(size_t(vocab * rb));
      w.dequant = random_normal(size_t(vocab * dim), rng);
      for (int64_t r = 0; r < vocab; ++r) quantize_row(t, w.dequant.data() + r * dim, w.bytes.data() + r * rb, dim);
      for (int64_t r = 0; r < vocab; ++r) dequantize_row(t, w.bytes.data() + r * rb, w.dequant.data() + r * dim, dim);
      w.view = WeightView{t, w.bytes.data(), vocab, dim, rb};
    }
    const int32_t ids[] = {6, 0, 6, 3};
    std::vector<float> out(4 * dim);
    cpu::quant_embedding(w.view, ids, 4, 0.5f, Mat(out.data(), 4, dim));
    for (int i = 0; i < 4; ++i)
      for (int64_t c = 0; c < dim; ++c)
        ASSERT_EQ(out[size_t(i * dim + c)], w.dequant[size_t(ids[i] * dim + c)] * 0.5f) << dtype_name(t);
    const int32_t bad[] = {7};
    try {
      cpu::quant_embedding(w.view, bad, 1, 1.f, Mat(out.data(), 1, dim));
      ADD_FAILURE() << "id 7 accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("token id 7"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace turbospark
