// Backend's default compositions (ops/backend.h) on the CPU backend: matmul_shared_input with
// activations is each matmul followed by unary, and rmsnorm_groups is one rmsnorm per column
// range with its slice of the weight; the CUDA backend's fused forms are held to these
// (tests/device).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "core/quant.h"
#include "ops/backend.h"
#include "test_util.h"

namespace turbospark {
namespace {

std::vector<float> randoms(size_t n, uint32_t seed) { return testing::uniform_floats(n, seed); }

// 1 / sqrt(mean(x^2) + 1e-6) over n values, in double.
double inv_rms(const float* x, int64_t n) {
  double ss = 0;
  for (int64_t c = 0; c < n; ++c) ss += double(x[c]) * x[c];
  return 1.0 / std::sqrt(ss / double(n) + 1e-6);
}

Weight f32_weight(std::vector<float>& data, int64_t rows, int64_t cols) {
  Weight w;
  w.view.dtype = DType::F32;
  w.view.data = data.data();
  w.view.rows = rows;
  w.view.cols = cols;
  w.view.row_bytes = cols * 4;
  return w;
}

TEST(BackendDefaults, SharedInputActivationsAreMatmulThenUnary) {
  auto be = make_cpu_backend(2);
  const int64_t rows = 3, in = 40;
  std::vector<float> x = randoms(size_t(rows * in), 1);
  std::vector<float> w0 = randoms(size_t(9 * in), 2), w1 = randoms(size_t(5 * in), 3), w2 = randoms(size_t(7 * in), 4);
  const Weight ws[] = {f32_weight(w0, 9, in), f32_weight(w1, 5, in), f32_weight(w2, 7, in)};
  const Weight* wp[] = {&ws[0], &ws[1], &ws[2]};
  const MatmulAct acts[] = {{Act::kSilu, 0.25f, 1.f}, {}, {Act::kSigmoid, 0.5f, 2.f}};
  std::vector<float> y[3], want[3];
  Mat ys[3];
  for (int i = 0; i < 3; ++i) {
    y[i].assign(size_t(rows * ws[i].view.rows), 0.f);
    want[i] = y[i];
    ys[i] = Mat(y[i].data(), rows, ws[i].view.rows);
  }
  const Mat xm(x.data(), rows, in);
  be->matmul_shared_input(wp, xm, ys, acts);
  for (int i = 0; i < 3; ++i) {
    const Mat wm(want[i].data(), rows, ws[i].view.rows);
    be->matmul(ws[i], xm, wm);
    if (!acts[i].is_identity()) be->unary(wm, acts[i].act, acts[i].pre, acts[i].post, wm);
    EXPECT_EQ(y[i], want[i]) << "job " << i;
  }
  // The activations did apply: silu(v / 4) differs from v.
  std::vector<float> plain(y[0].size());
  be->matmul(ws[0], xm, Mat(plain.data(), rows, 9));
  EXPECT_NE(plain, y[0]);
}

// The CPU backend runs ggml-format weights over up to 8 rows in one dispatch
// (cpu::quant_matmul_jobs): the same bits as one matmul each, then unary, at decode and
// small-batch row counts, for a mix of formats; past 8 rows it takes the default.
TEST(BackendDefaults, QuantizedSharedInputEqualsMatmulThenUnaryBitForBit) {
  auto be = make_cpu_backend(3);
  const int64_t in = 256;
  const DType types[] = {DType::Q4_0, DType::Q8_0, DType::Q6_K, DType::Q4_K};
  const int64_t outs[] = {33, 8, 17, 64};
  std::vector<std::vector<uint8_t>> bytes(4);
  Weight ws[4];
  for (int i = 0; i < 4; ++i) {
    const std::vector<float> w = randoms(size_t(outs[i] * in), 10 + uint32_t(i));
    const int64_t rb = row_bytes(types[i], in);
    bytes[size_t(i)].resize(size_t(outs[i] * rb));
    for (int64_t r = 0; r < outs[i]; ++r) quantize_row(types[i], &w[size_t(r * in)], bytes[size_t(i)].data() + r * rb, in);
    ws[i].view = WeightView{types[i], bytes[size_t(i)].data(), outs[i], in, rb};
  }
  const Weight* wp[] = {&ws[0], &ws[1], &ws[2], &ws[3]};
  const MatmulAct acts[] = {{}, {Act::kSilu, 1.f, 1.f}, {}, {Act::kSigmoid, 0.5f, 2.f}};
  for (int64_t rows : {1, 2, 5, 8, 9}) {
    std::vector<float> x = randoms(size_t(rows * in), 20 + uint32_t(rows));
    const Mat xm(x.data(), rows, in);
    std::vector<float> y[4], want[4];
    Mat ys[4];
    for (int i = 0; i < 4; ++i) {
      y[i].assign(size_t(rows * outs[i]), -7.f);
      want[i] = y[i];
      ys[i] = Mat(y[i].data(), rows, outs[i]);
    }
    be->matmul_shared_input(wp, xm, ys, acts);
    for (int i = 0; i < 4; ++i) {
      const Mat wm(want[i].data(), rows, outs[i]);
      be->matmul(ws[i], xm, wm);
      if (!acts[i].is_identity()) be->unary(wm, acts[i].act, acts[i].pre, acts[i].post, wm);
      EXPECT_EQ(y[i], want[i]) << dtype_name(types[i]) << " rows " << rows;
    }
  }
}

TEST(BackendDefaults, RmsnormGroupsNormsEachRangeWithItsWeights) {
  auto be = make_cpu_backend(1);
  const int64_t rows = 2, cols = 6, groups = 3, width = cols * groups, stride = width + 2;
  std::vector<float> x = randoms(size_t(rows * stride), 5), w = randoms(size_t(width), 6);
  std::vector<float> y(x.size(), -7.f), want(x.size(), -7.f);
  be->rmsnorm_groups(Mat(x.data(), rows, width, stride), w.data(), int(groups), 1e-6f, Mat(y.data(), rows, width, stride),
                     1.f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const float* xr = x.data() + r * stride + g * cols;
      const double inv = inv_rms(xr, cols);
      for (int64_t c = 0; c < cols; ++c) want[size_t(r * stride + g * cols + c)] = float(xr[c] * inv * (w[size_t(g * cols + c)] + 1.0));
    }
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(y[i], want[i], 1e-5f * (1.f + std::fabs(want[i]))) << i;
  EXPECT_THROW(be->rmsnorm_groups(Mat(x.data(), rows, 7), w.data(), 3, 1e-6f, Mat(y.data(), rows, 7)), Error);
}

TEST(BackendDefaults, RmsnormGatedIsRangeNormsTimesTheActivatedGate) {
  auto be = make_cpu_backend(1);
  const int64_t rows = 2, cols = 5, groups = 3, width = cols * groups;
  for (int64_t stride : {width, width + 3}) {  // one view of all ranges, or one per row
    std::vector<float> x = randoms(size_t(rows * stride), 7), g = randoms(size_t(rows * stride), 8),
                       w = randoms(size_t(cols), 9);
    std::vector<float> y(x.size(), -7.f);
    be->rmsnorm_gated(Mat(x.data(), rows, width, stride), w.data(), int(groups), 1e-6f, Mat(g.data(), rows, width, stride),
                      Act::kSigmoid, Mat(y.data(), rows, width, stride));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < groups; ++k) {
        const float* xr = x.data() + r * stride + k * cols;
        const double inv = inv_rms(xr, cols);
        for (int64_t c = 0; c < cols; ++c) {
          const size_t at = size_t(r * stride + k * cols + c);
          const double want = xr[c] * inv * w[size_t(c)] / (1.0 + std::exp(-double(g[at])));
          EXPECT_NEAR(y[at], want, 1e-5 * (1.0 + std::fabs(want))) << r << " " << k << " " << c;
        }
      }
    for (int64_t r = 0; r < rows; ++r)  // the padding untouched
      for (int64_t c = width; c < stride; ++c) EXPECT_EQ(y[size_t(r * stride + c)], -7.f);
  }
}

TEST(BackendDefaults, HcInjectGatedJoinsTheSharedExpertThenInjects) {
  auto be = make_cpu_backend(1);
  const int64_t rows = 2, H = 6, C = 3;
  std::vector<float> streams = randoms(size_t(rows * C * H), 10), branch = randoms(size_t(rows * H), 11),
                     shared = randoms(size_t(rows * H), 12), gate = randoms(size_t(rows), 13),
                     inject = randoms(size_t(rows * C), 14);
  std::vector<float> want_streams = streams;
  std::vector<float> want_branch(branch.size());
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < H; ++i) {
      const float s = shared[size_t(t * H + i)] * (1.f / (1.f + std::exp(-gate[size_t(t)])));
      const float b = branch[size_t(t * H + i)] + s;
      want_branch[size_t(t * H + i)] = b;
      for (int64_t c = 0; c < C; ++c) want_streams[size_t(t * C * H + c * H + i)] += b * inject[size_t(t * C + c)];
    }
  be->hc_inject_gated(Mat(streams.data(), rows, C * H), Mat(branch.data(), rows, H), Mat(shared.data(), rows, H),
                      Mat(gate.data(), rows, 1), Mat(inject.data(), rows, C), int(C));
  for (size_t i = 0; i < branch.size(); ++i) EXPECT_NEAR(branch[i], want_branch[i], 1e-5f) << i;
  for (size_t i = 0; i < streams.size(); ++i) EXPECT_NEAR(streams[i], want_streams[i], 1e-5f) << i;
}

}  // namespace
}  // namespace turbospark
