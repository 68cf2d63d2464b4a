// The chunked form of the gated delta rule (cpu::gated_delta_rule_chunked, the reference the
// CUDA prefill kernel follows) against the recurrent form the CPU backend runs, over ragged
// shapes, chunk sizes that do and do not divide the rows, and two calls in a row (the state
// carried between them). The forms differ only in f32 summation order.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/hybrid_ops.h"
#include "core/thread_pool.h"

namespace turbospark {
namespace {

std::vector<float> uniform(size_t n, uint32_t seed, float lo, float hi) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

double normalized_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? (num == 0 ? 0 : INFINITY) : std::sqrt(num / den);
}

// Measured worst 9.4e-6 (chunk 64, dk 16: short keys make k_t . k_s large, and the triangular
// solve over 64 rows compounds its rounding); a dropped decay or a wrong sign is O(1).
constexpr double kBound = 5e-5;

struct Shape {
  int nk, nv, dk, dv;
};

TEST(GatedDeltaChunked, MatchesTheRecurrentForm) {
  ThreadPool pool(2);
  double worst = 0;
  for (const Shape& sh : {Shape{1, 1, 8, 8}, Shape{2, 4, 16, 8}, Shape{1, 2, 32, 24}, Shape{2, 2, 64, 64}, Shape{1, 3, 5, 33},
                          Shape{3, 6, 8, 16}})
    for (int64_t rows : {1, 5, 64, 100, 130})
      for (int chunk : {1, 3, 16, 64})
        for (bool tiled : {false, true}) {
        if (tiled && (sh.nk == 1 || sh.nk == sh.nv)) continue;  // the same order either way
        SCOPED_TRACE("nk " + std::to_string(sh.nk) + " nv " + std::to_string(sh.nv) + " dk " + std::to_string(sh.dk) +
                     " dv " + std::to_string(sh.dv) + " rows " + std::to_string(rows) + " chunk " + std::to_string(chunk) +
                     (tiled ? " tiled" : ""));
        const int64_t key_dim = int64_t(sh.nk) * sh.dk, width = 2 * key_dim + int64_t(sh.nv) * sh.dv;
        const std::vector<float> a_log = uniform(size_t(sh.nv), 1, -1.f, 1.f);
        const std::vector<float> dt_bias = uniform(size_t(sh.nv), 2, -0.5f, 0.5f);
        std::vector<float> s_rec = uniform(size_t(sh.nv) * sh.dk * sh.dv, 3, -0.5f, 0.5f), s_chk = s_rec;
        for (int call = 0; call < 2; ++call) {
          std::vector<float> qkv = uniform(size_t(rows * width), uint32_t(4 + call), -1.f, 1.f);
          // a reaches softplus's linear regime; strong decays drive e^{cum} towards 0 in long chunks.
          std::vector<float> a = uniform(size_t(rows * sh.nv), uint32_t(6 + call), -4.f, 24.f);
          std::vector<float> b = uniform(size_t(rows * sh.nv), uint32_t(8 + call), -3.f, 3.f);
          std::vector<float> o_rec(size_t(rows * sh.nv * sh.dv), NAN), o_chk = o_rec;
          const Mat mq(qkv.data(), rows, width), ma(a.data(), rows, sh.nv), mb(b.data(), rows, sh.nv);
          cpu::gated_delta_rule(pool, mq, ma, mb, a_log.data(), dt_bias.data(), sh.nk, sh.nv, sh.dk, sh.dv, tiled,
                                Mat(s_rec.data(), sh.nv, int64_t(sh.dk) * sh.dv), Mat(o_rec.data(), rows, int64_t(sh.nv) * sh.dv));
          cpu::gated_delta_rule_chunked(pool, mq, ma, mb, a_log.data(), dt_bias.data(), sh.nk, sh.nv, sh.dk, sh.dv,
                                        tiled, Mat(s_chk.data(), sh.nv, int64_t(sh.dk) * sh.dv),
                                        Mat(o_chk.data(), rows, int64_t(sh.nv) * sh.dv), chunk);
          const double eo = normalized_error(o_chk, o_rec), es = normalized_error(s_chk, s_rec);
          EXPECT_LT(eo, kBound) << "outputs, call " << call;
          EXPECT_LT(es, kBound) << "state, call " << call;
          worst = std::max({worst, eo, es});
        }
      }
  std::printf("[ measured ] chunked vs recurrent gated delta rule: worst normalized error %.3g\n", worst);
}

// A wrong sign or a missing decay in any of the three chunk formulas shows at chunk 2 already:
// the chunked form with decays forced to 1 (a very negative) must still match, and so must a
// chunk of the whole prompt at weak decays (softplus ~ 0).
TEST(GatedDeltaChunked, WeakAndAbsentDecays) {
  ThreadPool pool(1);
  const int nk = 1, nv = 2, dk = 16, dv = 16;
  const int64_t rows = 40, width = 2 * nk * dk + nv * dv;
  for (float a_value : {-60.f, -5.f}) {
    const std::vector<float> a_log(size_t(nv), 0.f), dt_bias(size_t(nv), 0.f);
    std::vector<float> s_rec(size_t(nv * dk * dv), 0.f), s_chk = s_rec;
    std::vector<float> qkv = uniform(size_t(rows * width), 9, -1.f, 1.f), a(size_t(rows * nv), a_value);
    std::vector<float> b = uniform(size_t(rows * nv), 10, -3.f, 3.f);
    std::vector<float> o_rec(size_t(rows * nv * dv)), o_chk(o_rec.size());
    const Mat mq(qkv.data(), rows, width), ma(a.data(), rows, nv), mb(b.data(), rows, nv);
    cpu::gated_delta_rule(pool, mq, ma, mb, a_log.data(), dt_bias.data(), nk, nv, dk, dv, false,
                          Mat(s_rec.data(), nv, dk * dv),
                          Mat(o_rec.data(), rows, nv * dv));
    cpu::gated_delta_rule_chunked(pool, mq, ma, mb, a_log.data(), dt_bias.data(), nk, nv, dk, dv, false,
                                  Mat(s_chk.data(), nv, dk * dv), Mat(o_chk.data(), rows, nv * dv), int(rows));
    EXPECT_LT(normalized_error(o_chk, o_rec), kBound) << "a " << a_value;
    EXPECT_LT(normalized_error(s_chk, s_rec), kBound) << "a " << a_value;
  }
}

// llama.cpp's converter moves value head g * r + j (key head g, r = nv / nk) to position
// j * nk + g of every value-head-indexed tensor. Inputs permuted that way and run tiled give
// the grouped run's outputs and states permuted the same way, bit for bit (the same
// arithmetic per head); run grouped they do not (each head would read another key head).
TEST(GatedDeltaTiled, LlamaCppOrderGivesThePermutedResult) {
  ThreadPool pool(2);
  const int nk = 3, nv = 6, dk = 8, dv = 5, r = nv / nk;
  const int64_t rows = 23, key_dim = int64_t(nk) * dk, width = 2 * key_dim + int64_t(nv) * dv;
  auto tiled_pos = [&](int h) { return (h % r) * nk + h / r; };  // grouped head h -> its tiled position
  const std::vector<float> a_log = uniform(size_t(nv), 31, -1.f, 1.f), dt_bias = uniform(size_t(nv), 32, -0.5f, 0.5f);
  const std::vector<float> qkv = uniform(size_t(rows * width), 33, -1.f, 1.f);
  const std::vector<float> a = uniform(size_t(rows * nv), 34, -4.f, 4.f), b = uniform(size_t(rows * nv), 35, -3.f, 3.f);
  const std::vector<float> s0 = uniform(size_t(nv) * dk * dv, 36, -0.5f, 0.5f);
  std::vector<float> a_log_t(a_log.size()), dt_t(dt_bias.size()), qkv_t(qkv), a_t(a.size()), b_t(b.size()), s_t(s0.size());
  for (int h = 0; h < nv; ++h) {
    const int p = tiled_pos(h);
    a_log_t[size_t(p)] = a_log[size_t(h)];
    dt_t[size_t(p)] = dt_bias[size_t(h)];
    std::copy_n(s0.begin() + int64_t(h) * dk * dv, dk * dv, s_t.begin() + int64_t(p) * dk * dv);
    for (int64_t t = 0; t < rows; ++t) {
      a_t[size_t(t * nv + p)] = a[size_t(t * nv + h)];
      b_t[size_t(t * nv + p)] = b[size_t(t * nv + h)];
      std::copy_n(qkv.begin() + t * width + 2 * key_dim + int64_t(h) * dv, dv,
                  qkv_t.begin() + t * width + 2 * key_dim + int64_t(p) * dv);
    }
  }
  std::vector<float> s_g(s0), o_g(size_t(rows * nv * dv));
  cpu::gated_delta_rule(pool, Mat(const_cast<float*>(qkv.data()), rows, width), Mat(const_cast<float*>(a.data()), rows, nv),
                        Mat(const_cast<float*>(b.data()), rows, nv), a_log.data(), dt_bias.data(), nk, nv, dk, dv, false,
                        Mat(s_g.data(), nv, dk * dv), Mat(o_g.data(), rows, nv * dv));
  for (int chunked = 0; chunked < 2; ++chunked)
    for (bool tiled : {true, false}) {
      std::vector<float> s(s_t), o(size_t(rows * nv * dv));
      const Mat mq(qkv_t.data(), rows, width), ma(a_t.data(), rows, nv), mb(b_t.data(), rows, nv);
      if (chunked)
        cpu::gated_delta_rule_chunked(pool, mq, ma, mb, a_log_t.data(), dt_t.data(), nk, nv, dk, dv, tiled,
                                      Mat(s.data(), nv, dk * dv), Mat(o.data(), rows, nv * dv), 8);
      else
        cpu::gated_delta_rule(pool, mq, ma, mb, a_log_t.data(), dt_t.data(), nk, nv, dk, dv, tiled,
                              Mat(s.data(), nv, dk * dv), Mat(o.data(), rows, nv * dv));
      // Back to the grouped order.
      std::vector<float> o_back(o.size()), s_back(s.size());
      for (int h = 0; h < nv; ++h) {
        const int p = tiled_pos(h);
        std::copy_n(s.begin() + int64_t(p) * dk * dv, dk * dv, s_back.begin() + int64_t(h) * dk * dv);
        for (int64_t t = 0; t < rows; ++t)
          std::copy_n(o.begin() + t * nv * dv + int64_t(p) * dv, dv, o_back.begin() + t * nv * dv + int64_t(h) * dv);
      }
      SCOPED_TRACE(std::string(chunked ? "chunked" : "recurrent") + (tiled ? " tiled" : " grouped"));
      const double eo = normalized_error(o_back, o_g), es = normalized_error(s_back, s_g);
      if (tiled) {
        EXPECT_LT(eo, chunked ? kBound : 1e-12);
        EXPECT_LT(es, chunked ? kBound : 1e-12);
      } else {
        EXPECT_GT(eo, 1e-2);  // the wrong key heads
      }
    }
}

}  // namespace
}  // namespace turbospark
