// Scalar references for the CPU kernels: the ground truth the fast paths (and later the CUDA
// backend) are tested against. They favour obviousness over speed: one element at a time,
// reductions accumulated in double so that the reference's own rounding error is far below
// the tolerance the tests allow the fast paths.
#include <algorithm>
#include <cmath>
#include <vector>

#include "backends/cpu/kernels.h"
#include "core/error.h"

namespace turbospark::cpu::ref {

float weight_at(const WeightView& w, int64_t row, int64_t col) {
  const uint8_t* p = w.row(row);
  switch (w.dtype) {
    case DType::F32: {
      float v;
      std::memcpy(&v, p + col * 4, 4);
      return v;
    }
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, p + col * 2, 2);
      return bf16_to_f32(h);
    }
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, p + col * 2, 2);
      return f16_to_f32(h);
    }
    default:
      fail("cpu kernels: unsupported weight dtype {}", dtype_name(w.dtype));
  }
}

float dot_row(const WeightView& w, int64_t row, const float* x) {
  double acc = 0;
  for (int64_t i = 0; i < w.cols; ++i) acc += double(weight_at(w, row, i)) * double(x[i]);
  return float(acc);
}

void matmul(const WeightView& w, const Mat& x, const Mat& y) {
  TS_CHECK(x.cols == w.cols && y.cols == w.rows && y.rows == x.rows,
           "matmul: shape mismatch w [{}, {}] x [{}, {}] y [{}, {}]", w.rows, w.cols, x.rows,
           x.cols, y.rows, y.cols);
  for (int64_t t = 0; t < x.rows; ++t)
    for (int64_t o = 0; o < w.rows; ++o) y.row(t)[o] = dot_row(w, o, x.row(t));
}

void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset) {
  for (int64_t t = 0; t < x.rows; ++t) {
    const float* xr = x.row(t);
    float* yr = y.row(t);
    double sum_sq = 0;
    for (int64_t i = 0; i < x.cols; ++i) sum_sq += double(xr[i]) * double(xr[i]);
    // transformers: variance in float32, then x * rsqrt(variance + eps), then * weight.
    float variance = float(sum_sq / double(x.cols));
    float inv_rms = 1.f / std::sqrt(variance + eps);
    for (int64_t i = 0; i < x.cols; ++i) yr[i] = (xr[i] * inv_rms) * (weight[i] + weight_offset);
  }
}

void rope_neox(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions,
               const float* inv_freq, float attention_factor) {
  TS_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim && int64_t(n_heads) * head_dim <= x.cols,
           "rope: bad shape (heads {}, head_dim {}, rotary_dim {}, cols {})", n_heads, head_dim,
           rotary_dim, x.cols);
  const int half = rotary_dim / 2;
  for (int64_t t = 0; t < x.rows; ++t) {
    for (int h = 0; h < n_heads; ++h) {
      float* v = x.row(t) + int64_t(h) * head_dim;
      for (int i = 0; i < half; ++i) {
        float angle = float(positions[t]) * inv_freq[i];
        float c = std::cos(angle) * attention_factor;
        float s = std::sin(angle) * attention_factor;
        float x1 = v[i], x2 = v[i + half];
        v[i] = x1 * c - x2 * s;
        v[i + half] = x2 * c + x1 * s;
      }
    }
  }
}

void attention(const Mat& q, const int64_t* q_positions, const KvView& kv, int n_heads, float scale,
               int window, const float* sinks, const Mat& out) {
  const int hd = kv.head_dim;
  TS_CHECK(kv.n_kv_heads > 0 && n_heads % kv.n_kv_heads == 0,
           "attention: {} heads not a multiple of {} kv heads", n_heads, kv.n_kv_heads);
  TS_CHECK(q.cols >= int64_t(n_heads) * hd && out.cols >= int64_t(n_heads) * hd,
           "attention: q/out have {}/{} columns, need {}", q.cols, out.cols, n_heads * hd);
  const int group = n_heads / kv.n_kv_heads;
  auto k_at = [&](int64_t p, int g) { return kv.k_at(0, p) + int64_t(g) * hd; };
  auto v_at = [&](int64_t p, int g) { return kv.v_at(0, p) + int64_t(g) * hd; };
  std::vector<float> scores;
  std::vector<double> acc(hd);
  for (int64_t t = 0; t < q.rows; ++t) {
    const int64_t pos = q_positions[t];
    const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    for (int h = 0; h < n_heads; ++h) {
      const int g = h / group;
      const float* qh = q.row(t) + int64_t(h) * hd;
      scores.assign(size_t(pos - lo + 1), 0.f);
      float max_score = sinks ? sinks[h] : -INFINITY;
      for (int64_t p = lo; p <= pos; ++p) {
        const float* k = k_at(p, g);
        double d = 0;
        for (int i = 0; i < hd; ++i) d += double(qh[i]) * double(k[i]);
        float s = float(d) * scale;
        scores[size_t(p - lo)] = s;
        max_score = std::max(max_score, s);
      }
      double denom = sinks ? std::exp(double(sinks[h] - max_score)) : 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t p = lo; p <= pos; ++p) {
        float e = std::exp(scores[size_t(p - lo)] - max_score);
        denom += e;
        const float* v = v_at(p, g);
        for (int i = 0; i < hd; ++i) acc[i] += double(e) * double(v[i]);
      }
      float* o = out.row(t) + int64_t(h) * hd;
      for (int i = 0; i < hd; ++i) o[i] = float(acc[i] / denom);
    }
  }
}

void swiglu(const Mat& gate, const Mat& up, const Mat& out) {
  for (int64_t t = 0; t < gate.rows; ++t) {
    for (int64_t i = 0; i < gate.cols; ++i) {
      float g = gate.row(t)[i];
      out.row(t)[i] = g / (1.f + std::exp(-g)) * up.row(t)[i];
    }
  }
}

void embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out) {
  for (int64_t t = 0; t < n; ++t) {
    TS_CHECK(ids[t] >= 0 && ids[t] < table.rows, "embedding: token id {} outside vocabulary of {}",
             ids[t], table.rows);
    for (int64_t i = 0; i < table.cols; ++i) out.row(t)[i] = weight_at(table, ids[t], i) * scale;
  }
}

void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight) {
  const int64_t n = logits.cols;
  TS_CHECK(k >= 1 && k <= n, "router: top-k {} with {} experts", k, n);
  std::vector<float> prob(static_cast<size_t>(n));
  std::vector<bool> taken(static_cast<size_t>(n));
  for (int64_t t = 0; t < logits.rows; ++t) {
    const float* l = logits.row(t);
    float m = l[0];
    for (int64_t e = 1; e < n; ++e) m = std::max(m, l[e]);
    double sum = 0;
    for (int64_t e = 0; e < n; ++e) {
      prob[size_t(e)] = std::exp(l[e] - m);
      sum += prob[size_t(e)];
    }
    for (int64_t e = 0; e < n; ++e) prob[size_t(e)] = float(prob[size_t(e)] / sum);
    // k passes of "largest not yet taken"; the strict > keeps the lower index on ties.
    std::fill(taken.begin(), taken.end(), false);
    double picked_sum = 0;
    for (int j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < n; ++e)
        if (!taken[size_t(e)] && (best < 0 || prob[size_t(e)] > prob[size_t(best)])) best = e;
      taken[size_t(best)] = true;
      idx[t * k + j] = int32_t(best);
      weight[t * k + j] = prob[size_t(best)];
      picked_sum += prob[size_t(best)];
    }
    if (renormalize)
      for (int j = 0; j < k; ++j) weight[t * k + j] = float(weight[t * k + j] / picked_sum);
  }
}

void add_scaled(const Mat& y, const Mat& x, float alpha) {
  for (int64_t t = 0; t < y.rows; ++t)
    for (int64_t i = 0; i < y.cols; ++i) y.row(t)[i] += x.row(t)[i] * alpha;
}

}  // namespace turbospark::cpu::ref
