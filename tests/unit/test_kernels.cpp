// Per-kernel tests: every fast CPU kernel against its scalar reference on ragged shapes
// (remainders of the 8-wide vectors, the 4-row and 3-token tiles, the per-thread row
// quarters and the 128-token block), every weight dtype, strided rows. The references themselves are checked against
// computations written independently here (dense attention in double, a sorted router), so
// a shared mistake cannot hide.
#include <gtest/gtest.h>

#include <chrono>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "backends/cpu/kernels.h"
#include "backends/cpu/membw.h"
#include "core/error.h"

namespace turbospark::cpu {
namespace {

// max |a - b| / max |b|: the error normalised by the reference's scale, as llama.cpp's
// test-backend-ops does, so one bound fits outputs of any magnitude. +infinity when either
// side holds a NaN or an infinity anywhere, or the sizes differ: std::max(num, NaN) keeps
// num, so a NaN-blind maximum would let a NaN-producing kernel pass.
double normalized_error(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return std::numeric_limits<double>::infinity();
    num = std::max(num, std::abs(double(a[i]) - double(b[i])));
    den = std::max(den, std::abs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

TEST(Kernels, NormalizedErrorFailsOnNonFiniteValues) {
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  const std::vector<float> ref = {1.f, -2.f, 0.5f, 4.f, 3.f};
  EXPECT_EQ(normalized_error(ref, ref), 0.0);
  std::vector<float> off = ref;
  off[2] += 0.04f;  // |diff| 0.04 over max |ref| 4
  EXPECT_NEAR(normalized_error(off, ref), 0.01, 1e-7);
  EXPECT_EQ(normalized_error(std::vector<float>(3, 0.f), std::vector<float>(3, 0.f)), 0.0);
  for (size_t at : {size_t(0), size_t(2), ref.size() - 1}) {  // the last element too: no early exit skips it
    for (float bad : {nan, -nan, inf, -inf}) {
      std::vector<float> a = ref, b = ref;
      a[at] = bad;
      EXPECT_EQ(normalized_error(a, ref), std::numeric_limits<double>::infinity()) << "a[" << at << "] = " << bad;
      b[at] = bad;
      EXPECT_EQ(normalized_error(ref, b), std::numeric_limits<double>::infinity()) << "b[" << at << "] = " << bad;
      EXPECT_EQ(normalized_error(a, b), std::numeric_limits<double>::infinity()) << "both [" << at << "] = " << bad;
    }
  }
  // NaN on both sides in the scale-free all-zero case too.
  EXPECT_EQ(normalized_error({0.f, nan}, {0.f, 0.f}), std::numeric_limits<double>::infinity());
}

constexpr double kTol = 1e-5;

// A float matrix [rows, cols] stored with `stride` >= cols, padding filled with a sentinel
// so that writes outside the view are caught.
struct MatStore {
  std::vector<float> data;
  Mat view;
  MatStore(int64_t rows, int64_t cols, int64_t pad = 0, float fill = 0.f)
      : data(size_t(std::max<int64_t>(1, rows * (cols + pad))), fill),
        view(data.data(), rows, cols, cols + pad) {}
  // Copies own their storage (the view must not point into the original).
  MatStore(const MatStore& o) : data(o.data), view(data.data(), o.view.rows, o.view.cols, o.view.stride) {}
  MatStore& operator=(const MatStore&) = delete;
  // The view's elements only, row by row.
  std::vector<float> values() const {
    std::vector<float> v;
    for (int64_t r = 0; r < view.rows; ++r) v.insert(v.end(), view.row(r), view.row(r) + view.cols);
    return v;
  }
  // The padding only (must be untouched by kernels).
  std::vector<float> padding() const {
    std::vector<float> v;
    for (int64_t r = 0; r < view.rows; ++r)
      v.insert(v.end(), view.row(r) + view.cols, view.row(r) + view.stride);
    return v;
  }
};

void fill_uniform(std::vector<float>& v, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> u(lo, hi);
  for (auto& x : v) x = u(rng);
}

void fill_uniform(const Mat& m, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> u(lo, hi);
  for (int64_t r = 0; r < m.rows; ++r)
    for (int64_t c = 0; c < m.cols; ++c) m.row(r)[c] = u(rng);
}

// A weight matrix of the given dtype with random values; rows are `row_pad` bytes wider than
// needed so kernels must honour row_bytes.
struct WeightStore {
  std::vector<uint8_t> bytes;
  WeightView view;
  WeightStore(DType dtype, int64_t rows, int64_t cols, std::mt19937& rng, int64_t row_pad = 0) {
    const int64_t elem = int64_t(dtype_size(dtype));
    const int64_t row_bytes = cols * elem + row_pad;
    bytes.assign(size_t(std::max<int64_t>(1, rows * row_bytes)), 0xcd);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        uint8_t* p = bytes.data() + r * row_bytes + c * elem;
        const float v = u(rng);
        if (dtype == DType::F32) {
          std::memcpy(p, &v, 4);
        } else {
          const uint16_t h = dtype == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
          std::memcpy(p, &h, 2);
        }
      }
    }
    view = WeightView{dtype, bytes.data(), rows, cols, row_bytes};
  }
};

const DType kWeightTypes[] = {DType::BF16, DType::F16, DType::F32};

// ---------------------------------------------------------------------------------------

TEST(Kernels, WeightAtDequantizes) {
  const uint16_t bf = f32_to_bf16(1.5f), hf = f32_to_f16(-0.25f);
  const float f = 3.75f;
  EXPECT_EQ(ref::weight_at(WeightView{DType::BF16, &bf, 1, 1, 2}, 0, 0), 1.5f);
  EXPECT_EQ(ref::weight_at(WeightView{DType::F16, &hf, 1, 1, 2}, 0, 0), -0.25f);
  EXPECT_EQ(ref::weight_at(WeightView{DType::F32, &f, 1, 1, 4}, 0, 0), 3.75f);
}

TEST(Kernels, DotRowMatchesRef) {
  std::mt19937 rng(1);
  for (DType dt : kWeightTypes) {
    for (int64_t cols : {1, 7, 8, 15, 16, 17, 31, 33, 100, 1029}) {
      WeightStore w(dt, 3, cols, rng, 6);
      std::vector<float> x(static_cast<size_t>(cols));
      fill_uniform(x, rng);
      for (int64_t r = 0; r < 3; ++r) {
        const float fast = dot_row(w.view, r, x.data());
        const float want = ref::dot_row(w.view, r, x.data());
        // Normalise by the sum of |terms|: a dot product's natural scale.
        double scale = 0;
        for (int64_t i = 0; i < cols; ++i) scale += std::abs(ref::weight_at(w.view, r, i) * x[size_t(i)]);
        EXPECT_LE(std::abs(fast - want), kTol * scale)
            << dtype_name(dt) << " cols " << cols << " row " << r;
      }
    }
  }
}

TEST(Kernels, RefMatmulIsAPlainProduct) {
  // w = [[1, 2], [3, 4], [-1, 0.5]] (exact in every dtype), x = [[1, 1], [2, -1]].
  const float wf[] = {1, 2, 3, 4, -1, 0.5f};
  uint16_t wb[6];
  for (int i = 0; i < 6; ++i) wb[i] = f32_to_bf16(wf[i]);
  float x[] = {1, 1, 2, -1};
  float y[6];
  ref::matmul(WeightView{DType::BF16, wb, 3, 2, 4}, Mat(x, 2, 2), Mat(y, 2, 3));
  const float want[] = {3, 7, -0.5f, 0, 2, -2.5f};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(y[i], want[i]) << i;
}

// Shapes chosen to hit every remainder: cols around the 8-lane vector; rows around the
// 4-row tile and its quarters; tokens around the 3-token tile; one activation row (GEMV)
// through many (GEMM).
TEST(Kernels, MatmulMatchesRef) {
  std::mt19937 rng(2);
  ThreadPool pool(2);
  for (DType dt : kWeightTypes) {
    for (int64_t cols : {1, 7, 33, 100, 517, 1029}) {
      for (int64_t rows : {1, 3, 5, 17, 33}) {
        WeightStore w(dt, rows, cols, rng, dt == DType::F32 ? 4 : 2);
        for (int64_t t : {1, 2, 3, 5, 40, 70}) {
          MatStore x(t, cols, 3);
          fill_uniform(x.view, rng);
          MatStore y(t, rows, 5, 42.f), y_ref(t, rows);
          matmul(pool, w.view, x.view, y.view);
          ref::matmul(w.view, x.view, y_ref.view);
          EXPECT_LE(normalized_error(y.values(), y_ref.values()), kTol)
              << dtype_name(dt) << " w [" << rows << ", " << cols << "] T " << t;
          for (float p : y.padding()) ASSERT_EQ(p, 42.f) << "matmul wrote outside y";
        }
      }
    }
  }
}

TEST(Kernels, MatmulCrossesTheTokenBlock) {
  std::mt19937 rng(21);
  ThreadPool pool(2);
  for (DType dt : kWeightTypes) {
    WeightStore w(dt, 37, 45, rng);
    for (int64_t t : {128, 131, 260}) {
      MatStore x(t, 45, 1), y(t, 37, 2), y_ref(t, 37);
      fill_uniform(x.view, rng);
      matmul(pool, w.view, x.view, y.view);
      ref::matmul(w.view, x.view, y_ref.view);
      EXPECT_LE(normalized_error(y.values(), y_ref.values()), kTol) << dtype_name(dt) << " T " << t;
    }
  }
}

TEST(Kernels, MatmulSplitsRowsAcrossThreads) {
  // Enough rows that every thread of an odd-sized pool gets a range, with a ragged end.
  std::mt19937 rng(3);
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (int64_t t : {1, 4}) {
      WeightStore w(DType::BF16, 1001, 72, rng);
      MatStore x(t, 72), y(t, 1001), y_ref(t, 1001);
      fill_uniform(x.view, rng);
      matmul(pool, w.view, x.view, y.view);
      ref::matmul(w.view, x.view, y_ref.view);
      EXPECT_LE(normalized_error(y.values(), y_ref.values()), kTol) << threads << " threads, T " << t;
    }
  }
}

TEST(Kernels, MatmulWritesIntoAColumnSlice) {
  // y is a slice of a wider buffer (e.g. q, k, v projections written side by side).
  std::mt19937 rng(4);
  ThreadPool pool(2);
  WeightStore w(DType::BF16, 24, 40, rng);
  for (int64_t t : {1, 5}) {
    MatStore x(t, 40), wide(t, 64, 0, 7.f), y_ref(t, 24);
    fill_uniform(x.view, rng);
    const Mat slice = wide.view.cols_slice(16, 24);
    matmul(pool, w.view, x.view, slice);
    ref::matmul(w.view, x.view, y_ref.view);
    std::vector<float> got;
    for (int64_t r = 0; r < t; ++r) {
      got.insert(got.end(), slice.row(r), slice.row(r) + 24);
      for (int64_t c = 0; c < 64; ++c)
        if (c < 16 || c >= 40) {
          ASSERT_EQ(wide.view.row(r)[c], 7.f) << "wrote outside the slice";
        }
    }
    EXPECT_LE(normalized_error(got, y_ref.values()), kTol);
  }
}

TEST(Kernels, MatmulRefusesUnsupportedDtype) {
  ThreadPool pool(1);
  int32_t data[4] = {};
  float x[2] = {}, y[2] = {};
  EXPECT_THROW(matmul(pool, WeightView{DType::I32, data, 2, 2, 8}, Mat(x, 1, 2), Mat(y, 1, 2)), Error);
  EXPECT_THROW(matmul(pool, WeightView{DType::BF16, data, 2, 2, 4}, Mat(x, 1, 2), Mat(y, 1, 3)), Error);
}

TEST(Kernels, EmbeddingMatchesRef) {
  std::mt19937 rng(5);
  for (DType dt : kWeightTypes) {
    for (int64_t dim : {1, 7, 64, 100}) {
      WeightStore table(dt, 50, dim, rng, 2);
      const int32_t ids[] = {0, 49, 7, 7, 23};
      for (float scale : {1.f, 8.5f}) {
        MatStore out(5, dim, 1, 9.f), want(5, dim);
        embedding(table.view, ids, 5, scale, out.view);
        ref::embedding(table.view, ids, 5, scale, want.view);
        EXPECT_EQ(out.values(), want.values()) << dtype_name(dt) << " dim " << dim;
        for (float p : out.padding()) ASSERT_EQ(p, 9.f);
        // The reference really is the dequantised row times the scale.
        EXPECT_EQ(want.view.row(1)[dim - 1], ref::weight_at(table.view, 49, dim - 1) * scale);
      }
    }
  }
}

TEST(Kernels, EmbeddingRefusesBadTokenId) {
  std::mt19937 rng(6);
  WeightStore table(DType::BF16, 10, 8, rng);
  MatStore out(1, 8);
  const int32_t bad[] = {10};
  EXPECT_THROW(embedding(table.view, bad, 1, 1.f, out.view), Error);
  const int32_t negative[] = {-1};
  EXPECT_THROW(embedding(table.view, negative, 1, 1.f, out.view), Error);
}

TEST(Kernels, RmsnormMatchesRef) {
  std::mt19937 rng(7);
  for (int64_t cols : {1, 7, 8, 33, 1024, 1031}) {
    for (int64_t rows : {1, 3}) {
      for (float offset : {0.f, 1.f}) {
        std::vector<float> weight(static_cast<size_t>(cols));
        fill_uniform(weight, rng, 0.5f, 1.5f);
        MatStore x(rows, cols, 2);
        fill_uniform(x.view, rng, -3.f, 3.f);
        MatStore y(rows, cols), want(rows, cols);
        rmsnorm(x.view, weight.data(), 1e-6f, y.view, offset);
        ref::rmsnorm(x.view, weight.data(), 1e-6f, want.view, offset);
        EXPECT_LE(normalized_error(y.values(), want.values()), kTol) << cols << " x " << rows;
        // In place (y aliases x) gives the same result.
        rmsnorm(x.view, weight.data(), 1e-6f, x.view, offset);
        EXPECT_LE(normalized_error(x.values(), want.values()), kTol);
      }
    }
  }
}

TEST(Kernels, RefRmsnormIsUnitRms) {
  // With weight 1 the output has root-mean-square 1 (eps negligible); with offset 1 a zero
  // weight means scale 1.
  std::mt19937 rng(8);
  MatStore x(1, 96);
  fill_uniform(x.view, rng, -5.f, 5.f);
  std::vector<float> ones(96, 1.f), zeros(96, 0.f);
  MatStore y(1, 96), y_offset(1, 96);
  ref::rmsnorm(x.view, ones.data(), 1e-12f, y.view);
  ref::rmsnorm(x.view, zeros.data(), 1e-12f, y_offset.view, 1.f);
  double ms = 0;
  for (float v : y.values()) ms += double(v) * v;
  EXPECT_NEAR(std::sqrt(ms / 96), 1.0, 1e-6);
  EXPECT_EQ(y.values(), y_offset.values());
}

TEST(Kernels, RopeMatchesRef) {
  std::mt19937 rng(9);
  struct Case { int heads, head_dim, rotary_dim; };
  const Case cases[] = {{1, 8, 8}, {2, 64, 64}, {3, 128, 128}, {4, 128, 32}, {2, 64, 48},
                        {2, 12, 6}, {1, 34, 34}, {2, 80, 20}};
  for (const Case& c : cases) {
    const int half = c.rotary_dim / 2;
    std::vector<float> inv_freq(static_cast<size_t>(half));
    for (int i = 0; i < half; ++i)
      inv_freq[size_t(i)] = float(1.0 / std::pow(1e6, double(2 * i) / c.rotary_dim));
    const std::vector<int64_t> positions = {0, 1, 17, 4095, 100000};
    for (float factor : {1.f, 1.2f}) {
      MatStore x(5, int64_t(c.heads) * c.head_dim, 3);
      fill_uniform(x.view, rng);
      MatStore want = x;
      rope_neox(x.view, c.heads, c.head_dim, c.rotary_dim, positions.data(), inv_freq.data(), factor);
      ref::rope_neox(want.view, c.heads, c.head_dim, c.rotary_dim, positions.data(), inv_freq.data(), factor);
      EXPECT_LE(normalized_error(x.values(), want.values()), kTol)
          << c.heads << " heads, head_dim " << c.head_dim << ", rotary " << c.rotary_dim;
    }
  }
}

TEST(Kernels, RefRopeRotatesPairsOnly) {
  // Position 0 is the identity; elsewhere each (i, i + half) pair is rotated by
  // float(pos) * inv_freq[i] (computed independently here in double from that float angle)
  // and dims past rotary_dim are untouched.
  const int head_dim = 16, rotary_dim = 8, half = 4;
  const float inv_freq[] = {1.f, 0.1f, 0.01f, 0.001f};
  std::mt19937 rng(10);
  MatStore x(2, 2 * head_dim);
  fill_uniform(x.view, rng);
  const std::vector<float> before = x.values();
  const int64_t positions[] = {0, 7};
  ref::rope_neox(x.view, 2, head_dim, rotary_dim, positions, inv_freq);
  for (int c = 0; c < 2 * head_dim; ++c) EXPECT_EQ(x.view.row(0)[c], before[size_t(c)]);
  for (int h = 0; h < 2; ++h) {
    const float* b = before.data() + 2 * head_dim + h * head_dim;
    const float* a = x.view.row(1) + h * head_dim;
    for (int i = 0; i < half; ++i) {
      const double angle = double(7.f * inv_freq[i]);
      EXPECT_NEAR(a[i], b[i] * std::cos(angle) - b[i + half] * std::sin(angle), 1e-6);
      EXPECT_NEAR(a[i + half], b[i + half] * std::cos(angle) + b[i] * std::sin(angle), 1e-6);
    }
    for (int i = rotary_dim; i < head_dim; ++i) EXPECT_EQ(a[i], b[i]);
  }
}

// ---------------------------------------------------------------------------------------
// Attention

// A paged KV cache holding n_positions positions, with the same K/V also kept dense
// ([position, kv_head, head_dim]) for the independent check. Blocks are allocated in a
// shuffled order so that a kernel which assumed block_table[i] == i would fail.
struct PagedKv {
  int n_kv_heads, head_dim, block_size;
  std::vector<float> k_dense, v_dense;
  std::vector<float> k_pool, v_pool;  // [n_physical, block_size, n_kv, head_dim]
  std::vector<int32_t> block_table;
  int64_t n_physical = 0;

  PagedKv(int64_t n_positions, int n_kv, int hd, int bs, std::mt19937& rng)
      : n_kv_heads(n_kv), head_dim(hd), block_size(bs) {
    const int64_t row = int64_t(n_kv) * hd;
    k_dense.resize(size_t(n_positions * row));
    v_dense.resize(size_t(n_positions * row));
    fill_uniform(k_dense, rng, -1.f, 1.f);
    fill_uniform(v_dense, rng, -1.f, 1.f);
    const int64_t n_blocks = (n_positions + bs - 1) / bs;
    // Physical blocks: one more than needed (an unused one), in a shuffled order.
    n_physical = n_blocks + 1;
    k_pool.assign(size_t(n_physical * bs * row), NAN);
    v_pool.assign(size_t(n_physical * bs * row), NAN);
    std::vector<int32_t> physical(static_cast<size_t>(n_physical));
    std::iota(physical.begin(), physical.end(), 0);
    std::shuffle(physical.begin(), physical.end(), rng);
    block_table.assign(physical.begin(), physical.begin() + n_blocks);
    for (int64_t p = 0; p < n_positions; ++p) {
      const size_t b = size_t(block_table[size_t(p / bs)]);
      std::memcpy(k_pool.data() + (int64_t(b) * bs + p % bs) * row, k_dense.data() + p * row, size_t(row) * 4);
      std::memcpy(v_pool.data() + (int64_t(b) * bs + p % bs) * row, v_dense.data() + p * row, size_t(row) * 4);
    }
  }

  KvView view() const {
    KvView v;
    v.k = const_cast<float*>(k_pool.data());
    v.v = const_cast<float*>(v_pool.data());
    v.block_table = block_table.data();
    v.max_blocks = int(block_table.size());
    v.block_size = block_size;
    v.n_kv_heads = n_kv_heads;
    v.head_dim = head_dim;
    return v;
  }
};

// Dense causal attention in double, straight from the definition: for each query row and
// head, softmax over [lo, pos] (plus the sink logit, whose probability is dropped).
std::vector<float> dense_attention(const PagedKv& kv, const Mat& q, const std::vector<int64_t>& pos,
                                   int n_heads, float scale, int window, const float* sinks) {
  const int hd = kv.head_dim, group = n_heads / kv.n_kv_heads;
  std::vector<float> out;
  for (int64_t t = 0; t < q.rows; ++t) {
    const int64_t p_hi = pos[size_t(t)];
    const int64_t p_lo = window > 0 ? std::max<int64_t>(0, p_hi - window + 1) : 0;
    for (int h = 0; h < n_heads; ++h) {
      const int g = h / group;
      std::vector<double> logits;
      for (int64_t p = p_lo; p <= p_hi; ++p) {
        double d = 0;
        for (int i = 0; i < hd; ++i)
          d += double(q.row(t)[h * hd + i]) * kv.k_dense[size_t((p * kv.n_kv_heads + g) * hd + i)];
        logits.push_back(d * scale);
      }
      double m = sinks ? sinks[h] : -INFINITY;
      for (double l : logits) m = std::max(m, l);
      double z = sinks ? std::exp(sinks[h] - m) : 0;
      for (double l : logits) z += std::exp(l - m);
      for (int i = 0; i < hd; ++i) {
        double o = 0;
        for (int64_t p = p_lo; p <= p_hi; ++p)
          o += std::exp(logits[size_t(p - p_lo)] - m) / z *
               kv.v_dense[size_t((p * kv.n_kv_heads + g) * hd + i)];
        out.push_back(float(o));
      }
    }
  }
  return out;
}

struct AttentionCase {
  int n_heads, n_kv_heads, head_dim, block_size;
  std::vector<int64_t> positions;  // of the query rows
  int window;
  bool sinks;
};

void check_attention(const AttentionCase& c, ThreadPool& pool, std::mt19937& rng) {
  const int64_t n_positions = *std::max_element(c.positions.begin(), c.positions.end()) + 1;
  PagedKv kv(n_positions, c.n_kv_heads, c.head_dim, c.block_size, rng);
  const int64_t rows = int64_t(c.positions.size());
  const int64_t width = int64_t(c.n_heads) * c.head_dim;
  MatStore q(rows, width, 2);
  fill_uniform(q.view, rng, -2.f, 2.f);
  std::vector<float> sinks(size_t(c.n_heads));
  fill_uniform(sinks, rng, -1.f, 3.f);
  const float* sink_ptr = c.sinks ? sinks.data() : nullptr;
  const float scale = 1.f / std::sqrt(float(c.head_dim));
  MatStore out(rows, width, 3, 5.f), out_ref(rows, width);
  attention(pool, q.view, c.positions.data(), kv.view(), c.n_heads, scale, c.window, sink_ptr, out.view);
  ref::attention(q.view, c.positions.data(), kv.view(), c.n_heads, scale, c.window, sink_ptr, out_ref.view);
  const std::vector<float> dense =
      dense_attention(kv, q.view, c.positions, c.n_heads, scale, c.window, sink_ptr);
  std::string what = "heads " + std::to_string(c.n_heads) + "/" + std::to_string(c.n_kv_heads) +
                     " hd " + std::to_string(c.head_dim) + " bs " + std::to_string(c.block_size) +
                     " rows " + std::to_string(rows) + " last pos " + std::to_string(c.positions.back()) +
                     " window " + std::to_string(c.window) + (c.sinks ? " sinks" : "");
  EXPECT_LE(normalized_error(out_ref.values(), dense), kTol) << "ref vs dense: " << what;
  EXPECT_LE(normalized_error(out.values(), out_ref.values()), kTol) << "fast vs ref: " << what;
  for (float p : out.padding()) ASSERT_EQ(p, 5.f) << "attention wrote outside out: " << what;
}

std::vector<int64_t> chunk_positions(int64_t start, int64_t n) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), start);
  return p;
}

TEST(Kernels, AttentionMatchesRefAndDense) {
  std::mt19937 rng(11);
  ThreadPool pool(2);
  for (int group : {1, 2, 4}) {
    for (int head_dim : {64, 12}) {
      for (int block_size : {16, 5}) {
        for (int window : {0, 7}) {
          for (bool sinks : {false, true}) {
            const int n_kv = 2, n_heads = n_kv * group;
            // Decode at a position whose block is partly filled; a prefill chunk from 0; a
            // chunk after a cached prefix spanning several blocks; a long single row.
            for (const auto& positions :
                 {chunk_positions(37, 1), chunk_positions(0, 2), chunk_positions(0, 5),
                  chunk_positions(23, 40), chunk_positions(150, 1)}) {
              check_attention({n_heads, n_kv, head_dim, block_size, positions, window, sinks}, pool, rng);
            }
          }
        }
      }
    }
  }
}

TEST(Kernels, AttentionRowsAtUnrelatedPositions) {
  // Rows need not be consecutive: each attends only up to its own position.
  std::mt19937 rng(12);
  ThreadPool pool(2);
  check_attention({4, 2, 64, 16, {3, 40, 4, 0, 17}, 0, false}, pool, rng);
  check_attention({4, 1, 32, 8, {63, 2, 64}, 10, true}, pool, rng);
}

TEST(Kernels, AttentionSplitsLongContextsIntoChunks) {
  // Decode over a long context is split into position chunks whose partial softmax states
  // are merged; rows far apart leave some chunks without any of a row's positions.
  std::mt19937 rng(22);
  for (int threads : {2, 3}) {
    ThreadPool pool(threads);
    for (int window : {0, 300}) {
      for (bool sinks : {false, true}) {
        check_attention({4, 2, 64, 16, {1000}, window, sinks}, pool, rng);
        check_attention({4, 4, 32, 7, {5, 900}, window, sinks}, pool, rng);
        check_attention({8, 2, 16, 16, {1500, 1501}, window, sinks}, pool, rng);
      }
    }
  }
}

TEST(Kernels, AttentionSingleThreadAndManyThreads) {
  std::mt19937 rng(13);
  for (int threads : {1, 3}) {
    ThreadPool pool(threads);
    check_attention({8, 2, 64, 16, chunk_positions(10, 9), 0, true}, pool, rng);
  }
}

TEST(Kernels, AttentionWideHeadsOneKvHead) {
  // Gemma 3 270M's shape: 4 query heads over 1 KV head of 256 dims.
  std::mt19937 rng(14);
  for (int threads : {1, 2}) {
    ThreadPool pool(threads);
    for (int window : {0, 512}) {
      check_attention({4, 1, 256, 16, chunk_positions(0, 19), window, false}, pool, rng);
      check_attention({4, 1, 256, 16, chunk_positions(8, 8), window, false}, pool, rng);
      check_attention({4, 1, 256, 16, chunk_positions(13, 1), window, false}, pool, rng);
    }
  }
}

TEST(Kernels, AttentionOfOnePositionReturnsItsValue) {
  // At position 0 with no sink, softmax over one logit is 1: out == v[0] exactly in the ref
  // and to rounding in the fast path. With a sink, out == v[0] * 1 / (1 + e^(sink - s)).
  std::mt19937 rng(14);
  ThreadPool pool(2);
  PagedKv kv(1, 1, 8, 4, rng);
  MatStore q(1, 16), out(1, 16), out_ref(1, 16);
  fill_uniform(q.view, rng);
  const int64_t pos[] = {0};
  attention(pool, q.view, pos, kv.view(), 2, 0.5f, 0, nullptr, out.view);
  ref::attention(q.view, pos, kv.view(), 2, 0.5f, 0, nullptr, out_ref.view);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(out_ref.view.row(0)[h * 8 + i], kv.v_dense[size_t(i)]);
      EXPECT_NEAR(out.view.row(0)[h * 8 + i], kv.v_dense[size_t(i)], 1e-6);
    }
  const float sinks[] = {0.3f, -2.f};
  ref::attention(q.view, pos, kv.view(), 2, 0.5f, 0, sinks, out_ref.view);
  for (int h = 0; h < 2; ++h) {
    double s = 0;
    for (int i = 0; i < 8; ++i) s += double(q.view.row(0)[h * 8 + i]) * kv.k_dense[size_t(i)];
    const double keep = 1.0 / (1.0 + std::exp(sinks[h] - 0.5 * s));
    for (int i = 0; i < 8; ++i)
      EXPECT_NEAR(out_ref.view.row(0)[h * 8 + i], kv.v_dense[size_t(i)] * keep, 1e-6);
  }
}

// ---------------------------------------------------------------------------------------

TEST(Kernels, SwigluMatchesRef) {
  std::mt19937 rng(15);
  for (int64_t cols : {1, 7, 8, 33, 3072, 3077}) {
    for (int64_t rows : {1, 3}) {
      MatStore gate(rows, cols, 1), up(rows, cols, 2);
      fill_uniform(gate.view, rng, -12.f, 12.f);
      fill_uniform(up.view, rng);
      // Extremes where exp under/overflows.
      gate.view.row(0)[0] = -100.f;
      if (cols > 1) gate.view.row(0)[1] = 100.f;
      if (cols > 2) gate.view.row(0)[2] = -87.5f;
      MatStore out(rows, cols), want(rows, cols);
      swiglu(gate.view, up.view, out.view);
      ref::swiglu(gate.view, up.view, want.view);
      EXPECT_LE(normalized_error(out.values(), want.values()), kTol) << cols << " x " << rows;
      // Element by element, relative to each value's own size where it is not tiny.
      const auto got = out.values(), ref_v = want.values();
      for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], ref_v[i], 1e-6 * std::max(1.f, std::abs(ref_v[i]))) << i;
      // In place over gate.
      swiglu(gate.view, up.view, gate.view);
      EXPECT_LE(normalized_error(gate.values(), want.values()), kTol);
    }
  }
}

TEST(Kernels, RefSwigluIsSiluTimesUp) {
  float g[] = {0.f, 1.f, -2.f}, u[] = {3.f, 2.f, 0.5f}, o[3];
  ref::swiglu(Mat(g, 1, 3), Mat(u, 1, 3), Mat(o, 1, 3));
  EXPECT_EQ(o[0], 0.f);
  EXPECT_NEAR(o[1], 1.0 / (1.0 + std::exp(-1.0)) * 2.0, 1e-7);
  EXPECT_NEAR(o[2], -2.0 / (1.0 + std::exp(2.0)) * 0.5, 1e-7);
}

TEST(Kernels, AddScaledMatchesRef) {
  std::mt19937 rng(16);
  for (int64_t cols : {1, 9, 64, 1029}) {
    MatStore y(3, cols, 2), x(3, cols, 1);
    fill_uniform(y.view, rng);
    fill_uniform(x.view, rng);
    MatStore want = y;
    add_scaled(y.view, x.view, 0.75f);
    ref::add_scaled(want.view, x.view, 0.75f);
    EXPECT_LE(normalized_error(y.values(), want.values()), 1e-6) << cols;
    EXPECT_EQ(y.padding(), want.padding());
  }
}

// ---------------------------------------------------------------------------------------
// Router

// Independent top-k: probabilities in double, indices stable-sorted by probability
// descending (so ties keep the lower index first).
void sorted_topk(const float* logits, int64_t n, int k, bool renormalize, std::vector<int32_t>* idx,
                 std::vector<double>* weight) {
  double m = -INFINITY;
  for (int64_t e = 0; e < n; ++e) m = std::max(m, double(logits[e]));
  std::vector<double> p(static_cast<size_t>(n));
  double z = 0;
  for (int64_t e = 0; e < n; ++e) z += p[size_t(e)] = std::exp(double(logits[e]) - m);
  for (auto& v : p) v /= z;
  std::vector<int32_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[size_t(a)] > p[size_t(b)]; });
  idx->assign(order.begin(), order.begin() + k);
  weight->clear();
  double picked = 0;
  for (int j = 0; j < k; ++j) picked += p[size_t(order[size_t(j)])];
  for (int j = 0; j < k; ++j) weight->push_back(p[size_t(order[size_t(j)])] / (renormalize ? picked : 1.0));
}

TEST(Kernels, RouterMatchesRefAndSort) {
  std::mt19937 rng(17);
  for (int64_t n : {8, 60, 128}) {
    for (int k : {1, 2, 4, 8}) {
      for (bool renormalize : {false, true}) {
        // Logits on a 0.25 grid: many exact ties (to test the lower-index rule) and
        // otherwise clear gaps (so float rounding cannot reorder experts).
        const int64_t rows = 7;
        MatStore logits(rows, n, 1);
        std::uniform_int_distribution<int> grid(-40, 40);
        for (int64_t t = 0; t < rows; ++t)
          for (int64_t e = 0; e < n; ++e) logits.view.row(t)[e] = 0.25f * float(grid(rng));
        // One row entirely tied.
        for (int64_t e = 0; e < n; ++e) logits.view.row(rows - 1)[e] = 1.5f;
        std::vector<int32_t> idx(size_t(rows * k)), idx_ref(size_t(rows * k));
        std::vector<float> w(size_t(rows * k)), w_ref(size_t(rows * k));
        router_softmax_topk(logits.view, k, renormalize, idx.data(), w.data());
        ref::router_softmax_topk(logits.view, k, renormalize, idx_ref.data(), w_ref.data());
        EXPECT_EQ(idx, idx_ref) << "n " << n << " k " << k;
        EXPECT_LE(normalized_error(w, w_ref), 1e-6);
        for (int64_t t = 0; t < rows; ++t) {
          std::vector<int32_t> want_idx;
          std::vector<double> want_w;
          sorted_topk(logits.view.row(t), n, k, renormalize, &want_idx, &want_w);
          for (int j = 0; j < k; ++j) {
            EXPECT_EQ(idx_ref[size_t(t * k + j)], want_idx[size_t(j)]) << "row " << t << " rank " << j;
            EXPECT_NEAR(w_ref[size_t(t * k + j)], want_w[size_t(j)], 1e-6 * want_w[0]);
          }
        }
        // The all-tied row picks experts 0..k-1.
        for (int j = 0; j < k; ++j) EXPECT_EQ(idx[size_t((rows - 1) * k + j)], j);
      }
    }
  }
}

TEST(Kernels, RouterRefusesBadK) {
  float logits[4] = {};
  int32_t idx[8];
  float w[8];
  EXPECT_THROW(router_softmax_topk(Mat(logits, 1, 4), 5, false, idx, w), Error);
  EXPECT_THROW(router_softmax_topk(Mat(logits, 1, 4), 0, false, idx, w), Error);
}

// The measurement against one taken here independently (one thread copying a buffer of the
// same size with memcpy, best of 3): with two threads it must come out within 0.1x-40x of it.
// A measurement whose reads the compiler dropped, or off by a unit (MB vs GB, ms vs s), is
// outside by orders of magnitude. The reference is memcpy, not a summing loop: under ASan a
// scalar loop pays a shadow check per 8 bytes (CI measured 0.39 GB/s against 9.1 for the
// vector loads, 23x), while memcpy is checked once per call and runs at native speed.
TEST(Kernels, MeasureReadBandwidthAgreesWithAPlainLoop) {
  ThreadPool pool(2);
  const size_t bytes = size_t(64) << 20;
  const double gbs = measure_read_bandwidth_gbs(pool, bytes);
  std::vector<uint8_t> src(bytes, 1), dst(bytes, 0);
  double best = 1e30;
  for (int rep = 0; rep < 3; ++rep) {
    src[size_t(rep) * 4096] = uint8_t(rep + 2);
    const auto t0 = std::chrono::steady_clock::now();
    std::memcpy(dst.data(), src.data(), bytes);
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    ASSERT_EQ(dst[size_t(rep) * 4096], uint8_t(rep + 2));
  }
  const double plain = double(bytes) / best / 1e9;
  EXPECT_GT(gbs, plain * 0.1) << "measured " << gbs << " GB/s, memcpy reads " << plain;
  EXPECT_LT(gbs, plain * 40) << "measured " << gbs << " GB/s, memcpy reads " << plain;
}

}  // namespace
}  // namespace turbospark::cpu
