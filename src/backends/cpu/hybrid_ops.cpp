#include "backends/cpu/hybrid_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "backends/cpu/kernels.h"
#include "core/error.h"

namespace turbospark::cpu {

static inline float apply_act(Act act, float v) {
  switch (act) {
    case Act::kSilu: return v / (1.f + std::exp(-v));
    case Act::kSigmoid: return 1.f / (1.f + std::exp(-v));
    case Act::kGeluTanh: return 0.5f * v * (1.f + std::tanh(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    case Act::kTanh: return std::tanh(v);
    default: return v;
  }
}

void unary(const Mat& x, Act act, float pre, float post, const Mat& y) {
  for (int64_t r = 0; r < x.rows; ++r) {
    const float* xs = x.row(r);
    float* ys = y.row(r);
    for (int64_t c = 0; c < x.cols; ++c) ys[c] = post * apply_act(act, pre * xs[c]);
  }
}

void mul_act(const Mat& x, const Mat& gate, Act act) {
  const bool broadcast = gate.cols == 1;
  for (int64_t r = 0; r < x.rows; ++r) {
    float* xs = x.row(r);
    const float* gs = gate.row(r);
    if (broadcast) {
      const float g = apply_act(act, gs[0]);
      for (int64_t c = 0; c < x.cols; ++c) xs[c] *= g;
    } else {
      for (int64_t c = 0; c < x.cols; ++c) xs[c] *= apply_act(act, gs[c]);
    }
  }
}

void split_heads(const Mat& ab, int n_heads, int head_dim, const Mat& a, const Mat& b) {
  for (int64_t r = 0; r < ab.rows; ++r) {
    for (int h = 0; h < n_heads; ++h) {
      const float* src = ab.row(r) + int64_t(h) * 2 * head_dim;
      std::memcpy(a.row(r) + int64_t(h) * head_dim, src, size_t(head_dim) * 4);
      std::memcpy(b.row(r) + int64_t(h) * head_dim, src + head_dim, size_t(head_dim) * 4);
    }
  }
}

void causal_conv1d(const Mat& in, const float* w, int kernel, int dilation, const Mat& state, Act act, const Mat& out) {
  const int64_t ch = in.cols, span = int64_t(kernel - 1) * dilation;
  TS_CHECK(state.rows == span && state.cols == ch, "conv state is [{}, {}], expected [{}, {}]", state.rows, state.cols,
           span, ch);
  // history = state rows followed by this micro-batch's rows; out reads it before the state moves.
  const int64_t n = in.rows;
  std::vector<float> hist(size_t((span + n) * ch));
  for (int64_t r = 0; r < span; ++r) std::memcpy(&hist[size_t(r * ch)], state.row(r), size_t(ch) * 4);
  for (int64_t r = 0; r < n; ++r) std::memcpy(&hist[size_t((span + r) * ch)], in.row(r), size_t(ch) * 4);
  for (int64_t t = 0; t < n; ++t) {
    float* o = out.row(t);
    for (int64_t c = 0; c < ch; ++c) {
      float acc = 0.f;
      for (int k = 0; k < kernel; ++k) acc += w[c * kernel + k] * hist[size_t((t + int64_t(k) * dilation) * ch + c)];
      o[c] = apply_act(act, acc);
    }
  }
  for (int64_t r = 0; r < span; ++r) std::memcpy(state.row(r), &hist[size_t((n + r) * ch)], size_t(ch) * 4);
}

// GatedDeltaNet's q and k of one row and key head: L2-normalized (eps 1e-6 inside the sqrt),
// q also scaled by q_scale = 1/sqrt(dk).
static void normalize_qk(const float* qs, const float* ks, int dk, float q_scale, float* q, float* k) {
  float qn = 0.f, kn = 0.f;
  for (int i = 0; i < dk; ++i) {
    qn += qs[i] * qs[i];
    kn += ks[i] * ks[i];
  }
  const float qinv = 1.f / std::sqrt(qn + 1e-6f) * q_scale, kinv = 1.f / std::sqrt(kn + 1e-6f);
  for (int i = 0; i < dk; ++i) {
    q[i] = qs[i] * qinv;
    k[i] = ks[i] * kinv;
  }
}

void gated_delta_rule(ThreadPool& pool, const Mat& qkv, const Mat& a, const Mat& b, const float* a_log,
                      const float* dt_bias, int n_k_heads, int n_v_heads, int dk, int dv, bool v_heads_tiled,
                      const Mat& state, const Mat& out) {
  const int64_t key_dim = int64_t(n_k_heads) * dk;
  const float q_scale = 1.f / std::sqrt(float(dk));
  // Value heads are independent: each owns its [dk, dv] state and walks the rows in order.
  pool.parallel_for(n_v_heads, 1, [&](int64_t h0, int64_t h1) {
    std::vector<float> q(static_cast<size_t>(dk)), k(static_cast<size_t>(dk)), kv_mem(static_cast<size_t>(dv));
    for (int64_t h = h0; h < h1; ++h) {
      float* S = state.row(h);
      const int64_t kh = gdn_key_head(h, n_k_heads, n_v_heads, v_heads_tiled);
      const float A = -std::exp(a_log[h]);
      for (int64_t t = 0; t < qkv.rows; ++t) {
        const float* row = qkv.row(t);
        const float* qs = row + kh * dk;
        const float* ks = row + key_dim + kh * dk;
        const float* vs = row + 2 * key_dim + h * dv;
        normalize_qk(qs, ks, dk, q_scale, q.data(), k.data());
        const float x = a.row(t)[h] + dt_bias[h];
        const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
        const float decay = std::exp(A * softplus);
        const float beta = 1.f / (1.f + std::exp(-b.row(t)[h]));
        std::fill(kv_mem.begin(), kv_mem.end(), 0.f);
        for (int i = 0; i < dk; ++i) {
          float* Si = S + int64_t(i) * dv;
          for (int j = 0; j < dv; ++j) {
            Si[j] *= decay;
            kv_mem[size_t(j)] += Si[j] * k[size_t(i)];
          }
        }
        float* o = out.row(t) + h * dv;
        for (int j = 0; j < dv; ++j) {
          kv_mem[size_t(j)] = (vs[j] - kv_mem[size_t(j)]) * beta;  // delta
          o[j] = 0.f;
        }
        for (int i = 0; i < dk; ++i) {
          float* Si = S + int64_t(i) * dv;
          for (int j = 0; j < dv; ++j) {
            Si[j] += k[size_t(i)] * kv_mem[size_t(j)];
            o[j] += Si[j] * q[size_t(i)];
          }
        }
      }
    }
  });
}

void gated_delta_rule_chunked(ThreadPool& pool, const Mat& qkv, const Mat& a, const Mat& b, const float* a_log,
                              const float* dt_bias, int n_k_heads, int n_v_heads, int dk, int dv, bool v_heads_tiled,
                              const Mat& state, const Mat& out, int chunk) {
  TS_CHECK(chunk >= 1, "gated_delta_rule_chunked: chunk {}", chunk);
  const int64_t key_dim = int64_t(n_k_heads) * dk;
  const float q_scale = 1.f / std::sqrt(float(dk));
  pool.parallel_for(n_v_heads, 1, [&](int64_t h0, int64_t h1) {
    const size_t C = size_t(chunk);
    std::vector<float> q(C * size_t(dk)), k(C * size_t(dk)), u(C * size_t(dv)), cum(C), beta(C);
    std::vector<float> kk(C * C), qk(C * C);  // [t][s]: beta_t e^{cum_t - cum_s} k_t.k_s (s < t); e^{..} q_t.k_s (s <= t)
    for (int64_t h = h0; h < h1; ++h) {
      float* S = state.row(h);
      const int64_t kh = gdn_key_head(h, n_k_heads, n_v_heads, v_heads_tiled);
      const float A = -std::exp(a_log[h]);
      for (int64_t c0 = 0; c0 < qkv.rows; c0 += chunk) {
        const int64_t n = std::min<int64_t>(chunk, qkv.rows - c0);
        // Rows of the chunk: normalized q (scaled) and k, beta, cumulative log decay.
        float running = 0.f;
        for (int64_t t = 0; t < n; ++t) {
          const float* row = qkv.row(c0 + t);
          const float* qs = row + kh * dk;
          const float* ks = row + key_dim + kh * dk;
          normalize_qk(qs, ks, dk, q_scale, q.data() + t * dk, k.data() + t * dk);
          const float x = a.row(c0 + t)[h] + dt_bias[h];
          const float softplus = x > 20.f ? x : std::log1p(std::exp(x));
          running += A * softplus;
          cum[size_t(t)] = running;
          beta[size_t(t)] = 1.f / (1.f + std::exp(-b.row(c0 + t)[h]));
        }
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t s = 0; s <= t; ++s) {
            float dkk = 0.f, dqk = 0.f;
            for (int i = 0; i < dk; ++i) {
              dkk += k[size_t(t * dk + i)] * k[size_t(s * dk + i)];
              dqk += q[size_t(t * dk + i)] * k[size_t(s * dk + i)];
            }
            const float decay = std::exp(cum[size_t(t)] - cum[size_t(s)]);
            kk[size_t(t) * C + size_t(s)] = beta[size_t(t)] * decay * dkk;
            qk[size_t(t) * C + size_t(s)] = decay * dqk;
          }
        }
        // u = beta (v - e^{cum} S0^T k), then the triangular solve, column by column.
        for (int64_t t = 0; t < n; ++t) {
          const float* vs = qkv.row(c0 + t) + 2 * key_dim + h * dv;
          const float g = std::exp(cum[size_t(t)]);
          for (int j = 0; j < dv; ++j) {
            float sk = 0.f;
            for (int i = 0; i < dk; ++i) sk += S[int64_t(i) * dv + j] * k[size_t(t * dk + i)];
            u[size_t(t * dv + j)] = beta[size_t(t)] * (vs[j] - g * sk);
          }
        }
        for (int j = 0; j < dv; ++j) {
          for (int64_t t = 1; t < n; ++t) {
            float acc = u[size_t(t * dv + j)];
            for (int64_t s = 0; s < t; ++s) acc -= kk[size_t(t) * C + size_t(s)] * u[size_t(s * dv + j)];
            u[size_t(t * dv + j)] = acc;
          }
        }
        // Outputs from the chunk's starting state, then the state moves to the chunk's end.
        for (int64_t t = 0; t < n; ++t) {
          float* o = out.row(c0 + t) + h * dv;
          const float g = std::exp(cum[size_t(t)]);
          for (int j = 0; j < dv; ++j) {
            float sq = 0.f;
            for (int i = 0; i < dk; ++i) sq += S[int64_t(i) * dv + j] * q[size_t(t * dk + i)];
            float acc = g * sq;
            for (int64_t s = 0; s <= t; ++s) acc += qk[size_t(t) * C + size_t(s)] * u[size_t(s * dv + j)];
            o[j] = acc;
          }
        }
        const float last = cum[size_t(n - 1)];
        const float g_last = std::exp(last);
        for (int i = 0; i < dk; ++i) {
          for (int j = 0; j < dv; ++j) {
            float acc = g_last * S[int64_t(i) * dv + j];
            for (int64_t s = 0; s < n; ++s) {
              acc += std::exp(last - cum[size_t(s)]) * k[size_t(s * dk + i)] * u[size_t(s * dv + j)];
            }
            S[int64_t(i) * dv + j] = acc;
          }
        }
      }
    }
  });
}

void hc_mix(const Mat& weight, const Mat& normed, int n_streams, const Mat& mixed) {
  const int64_t H = mixed.cols;
  for (int64_t t = 0; t < mixed.rows; ++t) {
    float* m = mixed.row(t);
    std::fill(m, m + H, 0.f);
    for (int c = 0; c < n_streams; ++c) {
      const float* w = weight.row(t) + c * H;
      const float* x = normed.row(t) + c * H;
      for (int64_t i = 0; i < H; ++i) m[i] += w[i] * x[i];
    }
    for (int64_t i = 0; i < H; ++i) m[i] /= float(n_streams);
  }
}

void hc_inject(const Mat& streams, const Mat& branch, const Mat& inject, int n_streams) {
  const int64_t H = branch.cols;
  for (int64_t t = 0; t < streams.rows; ++t) {
    for (int c = 0; c < n_streams; ++c) {
      float* s = streams.row(t) + c * H;
      const float w = inject.row(t)[c];
      const float* y = branch.row(t);
      for (int64_t i = 0; i < H; ++i) s[i] += y[i] * w;
    }
  }
}

void ple_gate(const Mat& key, const Mat& query, const Mat& value, int n_streams, const Mat& out) {
  const int64_t H = value.cols;
  const float inv_sqrt = 1.f / std::sqrt(float(H));
  for (int64_t t = 0; t < value.rows; ++t) {
    for (int c = 0; c < n_streams; ++c) {
      const float* k = key.row(t) + c * H;
      const float* q = query.row(t) + c * H;
      float g = 0.f;
      for (int64_t i = 0; i < H; ++i) g += k[i] * q[i];
      g *= inv_sqrt;
      const float s = std::sqrt(std::max(std::fabs(g), 1e-6f)) * (g > 0.f ? 1.f : (g < 0.f ? -1.f : 0.f));
      const float sig = 1.f / (1.f + std::exp(-s));
      float* o = out.row(t) + c * H;
      const float* v = value.row(t);
      for (int64_t i = 0; i < H; ++i) o[i] = sig * v[i];
    }
  }
}

// Moves the k largest scores to the front exactly as torch.topk does on the CPU (partial
// sort when k * 64 <= n, else nth_element then a sort of the first k - 1), comparing values
// only. Scores tie often (relu zeroes every head for many blocks), and which tied block wins
// decides which tokens are attended: the reference's choice is the defined behaviour.
static void select_top_k_like_torch(std::vector<std::pair<float, int64_t>>& scores, size_t k) {
  if (k == 0) return;
  auto greater = [](const std::pair<float, int64_t>& x, const std::pair<float, int64_t>& y) { return x.first > y.first; };
  if (int64_t(k) * 64 <= int64_t(scores.size())) {
    std::partial_sort(scores.begin(), scores.begin() + long(k), scores.end(), greater);
  } else {
    std::nth_element(scores.begin(), scores.begin() + long(k) - 1, scores.end(), greater);
    std::sort(scores.begin(), scores.begin() + long(k) - 1, greater);
  }
}

void qsa_select(const QsaView& qsa, const Mat& index_q, const Mat& raw_keys, const int64_t* positions,
                int32_t* selected, int32_t* counts, int max_selected, QsaMargins* margins) {
  const int d = qsa.head_dim, r = qsa.ratio;
  const int64_t n = index_q.rows;
  // 1. Store this micro-batch's raw keys at their positions.
  for (int64_t t = 0; t < n; ++t) std::memcpy(qsa.raw_keys.row(positions[t]), raw_keys.row(t), size_t(d) * 4);
  // 2. Complete every block whose last position is now written (positions are consecutive).
  const int64_t first_pos = positions[0], last_pos = positions[n - 1];
  const int64_t first_block = first_pos / r, end_block = (last_pos + 1) / r;
  std::vector<float> pooled(static_cast<size_t>(d));
  for (int64_t blk = first_block; blk < end_block; ++blk) {
    std::fill(pooled.begin(), pooled.end(), 0.f);
    for (int j = 0; j < r; ++j) {
      const float* k = qsa.raw_keys.row(blk * r + j);
      for (int i = 0; i < d; ++i) pooled[size_t(i)] += k[i];
    }
    for (int i = 0; i < d; ++i) pooled[size_t(i)] /= float(r);
    Mat pm(pooled.data(), 1, d);
    Mat out = qsa.block_keys.rows_slice(blk, 1);
    rmsnorm(pm, qsa.k_norm, qsa.eps, out, 1.f);
    const int64_t start = blk * r;
    rope_neox(out, 1, d, qsa.rotary_dim, &start, qsa.inv_freq);
  }
  // 3. Select per query row.
  const float inv_sqrt = 1.f / std::sqrt(float(d));
  std::vector<std::pair<float, int64_t>> scores;
  for (int64_t t = 0; t < n; ++t) {
    const int64_t p = positions[t];
    const int64_t n_blocks = (p + 1) / r;
    int32_t* sel = selected + t * max_selected;
    int count = 0;
    scores.clear();
    for (int64_t blk = 0; blk < n_blocks; ++blk) {
      const float* kb = qsa.block_keys.row(blk);
      float s = 0.f;
      for (int h = 0; h < qsa.n_heads; ++h) {
        const float* qh = index_q.row(t) + h * d;
        float dot = 0.f;
        for (int i = 0; i < d; ++i) dot += qh[i] * kb[i];
        s += std::max(dot, 0.f);
      }
      if (std::isnan(s) && qsa.nan_score) *qsa.nan_score = 1;
      scores.emplace_back(s * inv_sqrt, blk);
    }
    const size_t keep = std::min<size_t>(size_t(qsa.block_topk), scores.size());
    select_top_k_like_torch(scores, keep);
    if (margins) {
      float margin = std::numeric_limits<float>::infinity();
      if (keep > 0 && keep < scores.size()) {
        float dropped = scores[keep].first;
        for (size_t i = keep + 1; i < scores.size(); ++i) dropped = std::max(dropped, scores[i].first);
        const float last = scores[keep - 1].first, top = scores[0].first;
        if (last != 0.f || dropped != 0.f) margin = (last - dropped) / std::max(std::fabs(top), 1e-30f);
      }
      margins->positions.push_back(p);
      margins->margins.push_back(margin);
    }
    for (size_t i = 0; i < keep; ++i) {
      for (int j = 0; j < r; ++j) sel[count++] = int32_t(scores[i].second * r + j);
    }
    for (int64_t q = n_blocks * r; q <= p; ++q) sel[count++] = int32_t(q);
    TS_CHECK(count <= max_selected, "QSA selected {} positions, room for {}", count, max_selected);
    counts[t] = count;
  }
}

void attention_selected(ThreadPool& pool, const Mat& q, const KvLayerView& kv, int n_heads, float scale,
                        const int32_t* selected, const int32_t* counts, int max_selected, const Mat& out) {
  const int hd = kv.head_dim, group = n_heads / kv.n_kv_heads;
  pool.parallel_for(q.rows * n_heads, 1, [&](int64_t b, int64_t e) {
    std::vector<float> scores(static_cast<size_t>(max_selected));
    for (int64_t job = b; job < e; ++job) {
      const int64_t t = job / n_heads;
      const int h = int(job % n_heads), kvh = h / group;
      const float* qh = q.row(t) + int64_t(h) * hd;
      const int32_t* sel = selected + t * max_selected;
      const int cnt = counts[t];
      float mx = -INFINITY;
      for (int i = 0; i < cnt; ++i) {
        const int64_t p = sel[i];
        const float* k = kv.k_at(kv.seq_of(t), p) + kvh * hd;
        float dot = 0.f;
        for (int j = 0; j < hd; ++j) dot += qh[j] * k[j];
        scores[size_t(i)] = dot * scale;
        mx = std::max(mx, scores[size_t(i)]);
      }
      float sum = 0.f;
      for (int i = 0; i < cnt; ++i) sum += (scores[size_t(i)] = std::exp(scores[size_t(i)] - mx));
      float* o = out.row(t) + int64_t(h) * hd;
      std::fill(o, o + hd, 0.f);
      for (int i = 0; i < cnt; ++i) {
        const int64_t p = sel[i];
        const float* v = kv.v_at(kv.seq_of(t), p) + kvh * hd;
        const float w = scores[size_t(i)] / sum;
        for (int j = 0; j < hd; ++j) o[j] += w * v[j];
      }
    }
  });
}

}  // namespace turbospark::cpu
