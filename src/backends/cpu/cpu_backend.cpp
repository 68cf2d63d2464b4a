// The CPU backend: every op runs eagerly on the backend's own thread pool.
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string_view>

#include "backends/cpu/hybrid_ops.h"
#include "backends/cpu/int4_affine.h"
#include "backends/cpu/mxfp4.h"
#include "backends/cpu/kernels.h"
#include "backends/cpu/quant_matmul.h"
#include "core/quant.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "ops/backend.h"

namespace turbospark {
namespace {

// Runs fn(first_row, n_rows, view) over maximal runs of consecutive rows of one sequence,
// the view's block table pointing at that sequence's row: the kernels see one sequence.
template <typename Fn>
void for_each_sequence_run(const KvLayerView& kv, int64_t rows, Fn&& fn) {
  TS_CHECK(kv.type == KvType::kF32, "CPU attention: KV pools must be f32");
  int64_t t0 = 0;
  while (t0 < rows) {
    const int seq = kv.seq_of(t0);
    int64_t t1 = t0 + 1;
    while (t1 < rows && kv.seq_of(t1) == seq) ++t1;
    KvLayerView one = kv;
    one.block_table = kv.block_table + int64_t(seq) * kv.max_blocks;
    one.row_seq = nullptr;
    fn(t0, t1 - t0, one);
    t0 = t1;
  }
}

class CpuBackend final : public Backend {
 public:
  CpuBackend(int n_threads, const CpuPrecision& precision) : precision_(precision), pool_(n_threads) {}

  std::string name() const override { return "cpu"; }

  std::shared_ptr<void> alloc_bytes(int64_t n) override {
    // 64-byte aligned so vector loads of a row start never split a cache line. Large
    // allocations (KV pools sized for the whole context) are anonymous mappings: zero pages
    // the kernel hands out on first touch, so capacity never used costs no memory.
    const size_t bytes = (size_t(std::max<int64_t>(n, 1)) + 63) / 64 * 64;
    if (bytes >= (size_t(1) << 20)) {
      void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) fail("out of memory mapping {} bytes of activations", bytes);
      return std::shared_ptr<void>(p, [bytes](void* q) { munmap(q, bytes); });
    }
    void* p = std::aligned_alloc(64, bytes);
    if (!p) fail("out of memory allocating {} bytes of activations", bytes);
    std::memset(p, 0, bytes);
    return std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  }

  void upload_bytes(void* dst, const void* src, int64_t n) override { std::memcpy(dst, src, size_t(n)); }
  void download_bytes(void* dst, const void* src, int64_t n) override { std::memcpy(dst, src, size_t(n)); }
  void zero_bytes(void* dst, int64_t n) override { std::memset(dst, 0, size_t(n)); }

  void matmul(const Weight& w, const Mat& x, const Mat& y) override { matmul_view(w.view, x, y); }

  // Weights in ggml block formats over a few rows (decode: an attention layer's q | k | v, a
  // GatedDeltaNet layer's four input projections) in one thread-pool dispatch
  // (quant_matmul_jobs, the same bits as one matmul each); anything else as the default does.
  void matmul_shared_input(std::span<const Weight* const> ws, const Mat& x, std::span<const Mat> ys,
                           std::span<const MatmulAct> acts) override {
    bool jobs = jobs_allowed() && x.rows <= kJobsMaxRows && ws.size() > 1;
    for (const Weight* w : ws) jobs = jobs && cpu::quant_matmul_takes(w->view.dtype);
    if (!jobs) return Backend::matmul_shared_input(ws, x, ys, acts);
    shared_jobs_.clear();
    for (size_t i = 0; i < ws.size(); ++i) shared_jobs_.push_back({&ws[i]->view, x, ys[i]});
    cpu::quant_matmul_jobs(pool_, shared_jobs_);
    for (size_t i = 0; i < acts.size(); ++i)
      if (!acts[i].is_identity()) unary(ys[i], acts[i].act, acts[i].pre, acts[i].post, ys[i]);
  }

  void add_bias(const Mat& y, const float* bias) override {
    for (int64_t r = 0; r < y.rows; ++r) {
      float* row = y.row(r);
      for (int64_t c = 0; c < y.cols; ++c) row[c] += bias[c];
    }
  }

  void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset) override {
    cpu::rmsnorm(x, weight, eps, y, weight_offset);
  }

  void rope(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions,
            const float* inv_freq, float attention_factor) override {
    cpu::rope_neox(x, n_heads, head_dim, rotary_dim, positions, inv_freq, attention_factor);
  }

  void kv_write(const KvLayerView& kv, const Mat& k, const Mat& v, const int64_t* positions) override {
    TS_CHECK(kv.type == KvType::kF32, "CPU kv_write: KV pools must be f32");
    const int64_t width = int64_t(kv.n_kv_heads) * kv.head_dim;
    for (int64_t t = 0; t < k.rows; ++t) {
      float* kd = kv.k_at(kv.seq_of(t), positions[t]);
      float* vd = kv.v_at(kv.seq_of(t), positions[t]);
      std::memcpy(kd, k.row(t), size_t(width) * 4);
      std::memcpy(vd, v.row(t), size_t(width) * 4);
      if (precision_.bf16_kv) {
        for (int64_t i = 0; i < width; ++i) kd[i] = bf16_to_f32(f32_to_bf16(kd[i])), vd[i] = bf16_to_f32(f32_to_bf16(vd[i]));
      }
    }
  }

  void attention(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                 int window, const float* sinks, const Mat& out) override {
    // The head dims CUDA's tensor-core prefill kernel takes (cuda::attention_prefill_tc_supports).
    if (precision_.tc_attention_above_rows > 0 && q.rows > precision_.tc_attention_above_rows && kv.head_dim <= 128 &&
        kv.head_dim % 8 == 0) {
      for_each_sequence_run(kv, q.rows, [&](int64_t t0, int64_t n, const KvLayerView& one) {
        attention_like_tensor_cores(q.rows_slice(t0, n), positions + t0, one, n_heads, scale, window, sinks,
                                    out.rows_slice(t0, n));
      });
      return;
    }
    for_each_sequence_run(kv, q.rows, [&](int64_t t0, int64_t n, const KvLayerView& one) {
      cpu::attention(pool_, q.rows_slice(t0, n), positions + t0, one, n_heads, scale, window, sinks,
                     out.rows_slice(t0, n));
    });
  }

  void swiglu(const Mat& gate, const Mat& up, const Mat& out) override { cpu::swiglu(gate, up, out); }

  void embedding(const Weight& table, const int32_t* ids, int64_t n, float scale, const Mat& out) override {
    if (table.view.dtype == DType::MXFP4) {
      cpu::mxfp4_embedding(table.view, ids, n, scale, out);
    } else if (table.view.dtype == DType::INT4_AFFINE) {
      cpu::int4_affine_embedding(table.view, ids, n, scale, out);
    } else if (is_quantized(table.view.dtype)) {
      cpu::quant_embedding(table.view, ids, n, scale, out);
    } else {
      cpu::embedding(table.view, ids, n, scale, out);
    }
  }

  void add(const Mat& y, const Mat& x) override { cpu::add_scaled(y, x, 1.f); }
  int64_t preferred_prefill_batch() const override {
    return precision_.prefill_batch > 0 ? precision_.prefill_batch : kDefaultPrefillBatch;
  }

  void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight,
                           const float* expert_scale) override {
    cpu::router_softmax_topk(logits, k, renormalize, idx, weight);
    if (precision_.route_replay) replay_routes(*precision_.route_replay, logits, k, renormalize, idx, weight);
    if (expert_scale) {
      for (int64_t j = 0; j < logits.rows * k; ++j) weight[j] *= expert_scale[idx[j]];
    }
  }

  void softmax_rows(const Mat& x, const Mat& y) override {
    for (int64_t t = 0; t < x.rows; ++t) {
      const float* in = x.row(t);
      float* o = y.row(t);
      const float mx = *std::max_element(in, in + x.cols);
      float sum = 0.f;
      for (int64_t c = 0; c < x.cols; ++c) sum += (o[c] = std::exp(in[c] - mx));
      for (int64_t c = 0; c < x.cols; ++c) o[c] /= sum;
    }
  }

  void argmax_rows(const Mat& logits, int32_t* ids) override {
    for (int64_t t = 0; t < logits.rows; ++t) {
      const float* row = logits.row(t);
      int32_t best = 0;
      for (int64_t c = 0; c < logits.cols; ++c) {
        if (std::isnan(row[c])) {
          best = -1;
          break;
        }
        if (row[c] > row[best]) best = int32_t(c);  // the first of equal maxima wins
      }
      ids[t] = best;
    }
  }

  void unary(const Mat& x, Act act, float pre, float post, const Mat& y) override { cpu::unary(x, act, pre, post, y); }
  void mul_act(const Mat& x, const Mat& gate, Act act) override { cpu::mul_act(x, gate, act); }
  void split_heads(const Mat& ab, int n_heads, int head_dim, const Mat& a, const Mat& b) override {
    cpu::split_heads(ab, n_heads, head_dim, a, b);
  }
  void copy(const Mat& src, const Mat& dst) override {
    for (int64_t r = 0; r < src.rows; ++r) std::memcpy(dst.row(r), src.row(r), size_t(src.cols) * 4);
  }
  void causal_conv1d(const Mat& in, const float* w, int kernel, int dilation, const Mat& state, Act act,
                     const Mat& out) override {
    cpu::causal_conv1d(in, w, kernel, dilation, state, act, out);
  }
  void gated_delta_rule(const Mat& qkv, const Mat& a, const Mat& b, const float* a_log, const float* dt_bias,
                        int n_k_heads, int n_v_heads, int dk, int dv, bool v_heads_tiled, const Mat& state,
                        const Mat& out) override {
    cpu::gated_delta_rule(pool_, qkv, a, b, a_log, dt_bias, n_k_heads, n_v_heads, dk, dv, v_heads_tiled, state, out);
  }
  void hc_mix(const Mat& weight, const Mat& normed, int n_streams, const Mat& mixed) override {
    cpu::hc_mix(weight, normed, n_streams, mixed);
  }
  void hc_inject(const Mat& streams, const Mat& branch, const Mat& inject, int n_streams) override {
    cpu::hc_inject(streams, branch, inject, n_streams);
  }
  void ple_gate(const Mat& key, const Mat& query, const Mat& value, int n_streams, const Mat& out) override {
    cpu::ple_gate(key, query, value, n_streams, out);
  }
  void qsa_select(const QsaView& qsa, const Mat& index_q, const Mat& raw_keys, const int64_t* positions,
                  int32_t* selected, int32_t* counts, int max_selected) override {
    cpu::qsa_select(qsa, index_q, raw_keys, positions, selected, counts, max_selected, precision_.qsa_margins.get());
  }
  void attention_selected(const Mat& q, const KvLayerView& kv, int n_heads, float scale, const int32_t* selected,
                          const int32_t* counts, int max_selected, const Mat& out) override {
    for_each_sequence_run(kv, q.rows, [&](int64_t t0, int64_t n, const KvLayerView& one) {
      cpu::attention_selected(pool_, q.rows_slice(t0, n), one, n_heads, scale, selected + t0 * max_selected,
                              counts + t0, max_selected, out.rows_slice(t0, n));
    });
  }

  void moe_experts(const std::vector<ExpertWeights>& experts, const Mat& x, const int32_t* idx,
                   const float* weight, int k, const Mat& out) override {
    // Group the micro-batch's (token, slot) pairs by expert so each expert's weights are
    // streamed once per micro-batch, as a GEMM over its tokens rather than a GEMV per token.
    const int64_t T = x.rows, hidden = x.cols;
    const int64_t n_experts = int64_t(experts.size());
    // CpuPrecision: the micro-batch's size decides the rounding of every expert's matmuls.
    moe_rows_ = T;
    moe_int8_formats_ = experts.empty() || cuda_moe_int8_formats(experts[0], k);
    struct Reset {
      int64_t& rows;
      ~Reset() { rows = 0; }
    } reset{moe_rows_};
    auto& by_expert = by_expert_;  // kept across calls: no allocation per decode token once warm
    if (int64_t(by_expert.size()) < n_experts) by_expert.resize(size_t(n_experts));
    for (auto& rows : by_expert) rows.clear();
    for (int64_t t = 0; t < T; ++t) {
      for (int j = 0; j < k; ++j) {
        int32_t e = idx[t * k + j];
        TS_CHECK(e >= 0 && e < n_experts, "router chose expert {} of {}", e, n_experts);
        by_expert[size_t(e)].emplace_back(int32_t(t), weight[t * k + j]);
      }
    }
    for (int64_t r = 0; r < T; ++r) std::memset(out.row(r), 0, size_t(out.cols) * 4);
    const int64_t inter = experts.empty() ? 0 : experts[0].gate.rows();
    if (!provider_ && moe_jobs_apply(experts, by_expert)) return moe_experts_as_jobs(experts, x, out);
    ensure_scratch(T * (hidden + 5 * inter + hidden));
    // Streaming: the experts this micro-batch uses, in the order they are computed, so the
    // provider can load the next ones while this one runs (the routing read above is the
    // host sync streaming needs; on the CPU it costs nothing).
    auto& used = used_experts_;
    used.clear();
    if (provider_) {
      for (int64_t e = 0; e < n_experts; ++e)
        if (!by_expert[size_t(e)].empty()) used.push_back(&experts[size_t(e)]);
      provider_->prefetch(used);  // the first ones' reads all in flight before any is waited for
    }
    size_t next_used = 0;
    for (int64_t e = 0; e < n_experts; ++e) {
      const auto& rows = by_expert[size_t(e)];
      if (rows.empty()) continue;
      const int64_t n = int64_t(rows.size());
      const ExpertWeights* ewp = &experts[size_t(e)];
      if (provider_) {
        ewp = &provider_->acquire(*ewp);
        provider_->prefetch(std::span<const ExpertWeights* const>(used).subspan(next_used + 1));
        ++next_used;
      }
      const ExpertWeights& ew = *ewp;
      Mat xs(scratch_.data(), n, hidden);
      Mat gate(xs.data + n * hidden, n, inter);
      Mat up(gate.data + n * inter, n, inter);
      Mat y(up.data + n * inter, n, hidden);
      for (int64_t i = 0; i < n; ++i) std::memcpy(xs.row(i), x.row(rows[size_t(i)].first), size_t(hidden) * 4);
      if (ew.gate_up_interleaved) {
        // One pass over the fused matrix (rows in order) rather than two over every other
        // row, then the outputs split: even columns gate, odd up. The views must still be
        // the two halves of one matrix (an expert cache must copy it whole).
        TS_CHECK(ew.up.view.data == ew.gate.view.row(0) + ew.gate.view.row_bytes / 2,
                 "moe_experts: expert {} gate/up views are not the halves of one interleaved matrix", e);
        Mat gu(y.data + n * hidden, n, 2 * inter);
        matmul_view(fused_gate_up(ew), xs, gu);
        for (int64_t i = 0; i < n; ++i) {
          const float* src = gu.row(i);
          float* g = gate.row(i);
          float* u = up.row(i);
          for (int64_t c = 0; c < inter; ++c) g[c] = src[2 * c], u[c] = src[2 * c + 1];
        }
      } else if (n <= kJobsMaxRows && plain_quant_pair(ew.gate.view, ew.up.view)) {
        // Streamed experts come one at a time: gate and up share one dispatch at least.
        const cpu::QuantMatmulJob pair[] = {{&ew.gate.view, xs, gate}, {&ew.up.view, xs, up}};
        cpu::quant_matmul_jobs(pool_, pair);
      } else {
        matmul_view(ew.gate.view, xs, gate);
        matmul_view(ew.up.view, xs, up);
      }
      expert_activation(ew, gate, up);
      matmul_view(ew.down.view, gate, y);
      expert_combine(ew, rows, y, out);
    }
  }

  // gate = act(gate + gate_bias) * (up + up_bias), the expert's GLU (h, the down projection's input).
  static void expert_activation(const ExpertWeights& ew, const Mat& gate, const Mat& up) {
    if (ew.gate_bias) cpu::add_bias(gate, ew.gate_bias);
    if (ew.up_bias) cpu::add_bias(up, ew.up_bias);
    if (ew.glu_limit > 0) {
      cpu::clamped_swiglu(gate, up, ew.glu_alpha, ew.glu_limit, gate);
    } else if (ew.act == Act::kSilu) {
      cpu::swiglu(gate, up, gate);
    } else {
      cpu::unary(gate, ew.act, 1.f, 1.f, gate);
      cpu::mul_act(gate, up, Act::kIdentity);
    }
  }

  // out[token] += weight * (y + down_bias) for each of the expert's (token, weight) rows, in order.
  static void expert_combine(const ExpertWeights& ew, const std::vector<std::pair<int32_t, float>>& rows, const Mat& y,
                             const Mat& out) {
    if (ew.down_bias) cpu::add_bias(y, ew.down_bias);
    for (size_t i = 0; i < rows.size(); ++i) {
      float* dst = out.row(rows[i].first);
      const float* src = y.row(int64_t(i));
      const float wgt = rows[i].second;
      for (int64_t c = 0; c < y.cols; ++c) dst[c] += wgt * src[c];
    }
  }

  // Whether products may share quant_matmul_jobs dispatches at all: not switched off, and the
  // CPU's own precision (CpuPrecision modelling CUDA routes matmuls by size and format).
  bool jobs_allowed() const { return moe_jobs_on_ && precision_.gemm_above_rows == 0 && precision_.nudge_seed == 0; }
  // Whether two weights may share a quant_matmul_jobs dispatch: both in ggml block formats.
  bool plain_quant_pair(const WeightView& a, const WeightView& b) const {
    return jobs_allowed() && cpu::quant_matmul_takes(a.dtype) && cpu::quant_matmul_takes(b.dtype);
  }

  // Whether moe_experts_as_jobs takes this micro-batch: every picked expert's gate, up and down
  // in a ggml block format (quant_matmul's), gate and up separate, few rows each (a decode step
  // or a small batch; bigger ones take the tiled kernels expert by expert), and the precision
  // the CPU's own (CpuPrecision modelling CUDA routes matmuls by size and format).
  bool moe_jobs_apply(const std::vector<ExpertWeights>& experts,
                      const std::vector<std::vector<std::pair<int32_t, float>>>& by_expert) const {
    if (!jobs_allowed()) return false;
    for (size_t e = 0; e < experts.size(); ++e) {
      if (by_expert[e].empty()) continue;
      const ExpertWeights& ew = experts[e];
      if (int64_t(by_expert[e].size()) > kJobsMaxRows || ew.gate_up_interleaved || !cpu::quant_matmul_takes(ew.gate.view.dtype) ||
          !cpu::quant_matmul_takes(ew.up.view.dtype) || !cpu::quant_matmul_takes(ew.down.view.dtype))
        return false;
    }
    return true;
  }
  // Rows per expert (moe_experts) or per call (matmul_shared_input) up to which several products
  // share a dispatch: decode and small batches (prefill micro-batches take the tiled kernels).
  static constexpr int64_t kJobsMaxRows = 8;
  // TURBOSPARK_CPU_MOE_JOBS=0: every micro-batch takes the loop over experts and every
  // shared-input matmul one dispatch per weight (to measure one against the other; the results
  // are the same bits).
  const bool moe_jobs_on_ = [] {
    const char* v = std::getenv("TURBOSPARK_CPU_MOE_JOBS");
    return !(v && std::string_view(v) == "0");
  }();

  // moe_experts for a micro-batch moe_jobs_apply takes: every picked expert's gate and up in one
  // parallel region, their activations, then every down projection in a second one, then the
  // weighted sums in expert order. The same products, rounding and summation order as the loop
  // over experts (bit for bit: quant_matmul_jobs keeps quant_matmul's contract), in two
  // dispatches instead of three per expert. An expert's single row is read in place (the jobs
  // of a decode step then share one quantized x).
  void moe_experts_as_jobs(const std::vector<ExpertWeights>& experts, const Mat& x, const Mat& out) {
    const int64_t hidden = x.cols, inter = experts[0].gate.rows();
    const auto& by_expert = by_expert_;
    int64_t pairs = 0;
    for (size_t e = 0; e < experts.size(); ++e) pairs += int64_t(by_expert[e].size());
    ensure_scratch(pairs * (2 * hidden + 2 * inter));
    auto& picked = moe_picked_;
    picked.clear();
    float* next = scratch_.data();
    auto take = [&next](int64_t rows, int64_t cols) {
      const Mat m(next, rows, cols);
      next += rows * cols;
      return m;
    };
    for (size_t e = 0; e < experts.size(); ++e) {
      const auto& rows = by_expert[e];
      if (rows.empty()) continue;
      const int64_t n = int64_t(rows.size());
      Mat xs = n == 1 ? Mat(x.row(rows[0].first), 1, hidden) : take(n, hidden);
      if (n > 1)
        for (int64_t i = 0; i < n; ++i) std::memcpy(xs.row(i), x.row(rows[size_t(i)].first), size_t(hidden) * 4);
      const Mat gate = take(n, inter), up = take(n, inter), y = take(n, hidden);
      picked.push_back({e, xs, gate, up, y});
    }
    auto& jobs = moe_jobs_;
    jobs.clear();
    for (const auto& p : picked) {
      jobs.push_back({&experts[p.e].gate.view, p.xs, p.gate});
      jobs.push_back({&experts[p.e].up.view, p.xs, p.up});
    }
    cpu::quant_matmul_jobs(pool_, jobs);
    jobs.clear();
    for (const auto& p : picked) {
      expert_activation(experts[p.e], p.gate, p.up);
      jobs.push_back({&experts[p.e].down.view, p.gate, p.y});
    }
    cpu::quant_matmul_jobs(pool_, jobs);
    for (const auto& p : picked) expert_combine(experts[p.e], by_expert[p.e], p.y, out);
  }

  void set_expert_provider(ExpertProvider* provider) override { provider_ = provider; }
  bool speculates_experts() const override { return provider_ && provider_->speculates(); }
  void speculate_experts(const std::vector<ExpertWeights>& experts, const int32_t* idx, int64_t rows,
                         int k) override {
    if (!provider_) return;
    // Each picked expert once, in expert order (as moe_experts computes them).
    std::vector<const ExpertWeights*> likely;
    std::vector<uint8_t> seen(experts.size(), 0);
    for (int64_t i = 0; i < rows * k; ++i) {
      const int32_t e = idx[i];
      if (e >= 0 && size_t(e) < experts.size()) seen[size_t(e)] = 1;
    }
    for (size_t e = 0; e < experts.size(); ++e)
      if (seen[e]) likely.push_back(&experts[e]);
    provider_->speculate(likely);
  }

 private:
  ExpertProvider* provider_ = nullptr;
  std::vector<const ExpertWeights*> used_experts_;

  CpuPrecision precision_;
  int64_t moe_rows_ = 0;  // the rows of the moe_experts call in progress (0 outside one)
  // CpuPrecision::gemm_above_rows > 0 and inside moe_experts: whether the micro-batch is past
  // the bound (every expert matmul rounds as a GEMM) or within it (CUDA's MoE decode kernels).
  bool moe_gemm_rounding() const { return precision_.gemm_above_rows > 0 && moe_rows_ > precision_.gemm_above_rows; }
  bool moe_decode() const { return precision_.gemm_above_rows > 0 && moe_rows_ > 0 && !moe_gemm_rounding(); }
  std::vector<float> rounded_x_;
  // Whether CUDA's int8 MoE decode kernels take the experts of the moe_experts call in progress
  // (cuda::moe_int8_activations' formats: Q4_0, MXFP4 or Q8_0 on both projections alike, sizes
  // multiples of 32, top-k <= 32). Where they do not, CUDA's decode kernels read f32 activations,
  // and a quantized expert matmul here does the same (float_matmul) instead of its int8 path.
  bool moe_int8_formats_ = true;
  std::vector<float> float_weight_;

  static bool cuda_moe_int8_formats(const ExpertWeights& e0, int k) {
    const DType t = e0.gate.view.dtype;
    return (t == DType::Q4_0 || t == DType::MXFP4 || t == DType::Q8_0) && e0.down.view.dtype == t &&
           e0.up.view.dtype == t && e0.gate.view.cols % 32 == 0 && e0.gate.view.rows % 32 == 0 && k <= 32;
  }

  // y = x W^T in f32 with W's values dequantized: a quantized matmul as CUDA's f32-activation
  // decode kernels compute it, or (bf16_weights) as its tensor-core GEMMs do, on W's values
  // dequantized and rounded to bf16 (CpuPrecision; tests only, so the whole weight is widened).
  void float_matmul(const WeightView& w, const Mat& x, const Mat& y, bool bf16_weights = false) {
    float_weight_.resize(size_t(w.rows * w.cols));
    for (int64_t r = 0; r < w.rows; ++r) dequantize_row(w.dtype, w.row(r), float_weight_.data() + r * w.cols, w.cols);
    if (bf16_weights)
      for (float& v : float_weight_) v = bf16_to_f32(f32_to_bf16(v));
    WeightView f;
    f.dtype = DType::F32;
    f.data = float_weight_.data();
    f.rows = w.rows;
    f.cols = w.cols;
    f.row_bytes = w.cols * 4;
    cpu::matmul(pool_, f, x, y);
  }

  // How CUDA's tensor cores read a matmul's operands (CpuPrecision::gemm_above_rows): not at all
  // (a GEMV or a MoE decode kernel), tf32 for aligned f32 dense weights (cuBLASLt on the stored
  // rows), bf16 activations against bf16 weights as stored, or bf16 activations against the
  // weights dequantized and rounded to bf16 (gemm.cu's dequantize pass for every other dense
  // weight; the grouped MoE tiles for every expert format but bf16).
  enum class GemmRead { kNone, kTf32, kBf16, kBf16Dequantized };
  GemmRead gemm_read(const WeightView& w, const Mat& x) const {
    if (!(precision_.gemm_above_rows > 0 && (x.rows > precision_.gemm_above_rows || moe_gemm_rounding())))
      return GemmRead::kNone;
    if (w.dtype == DType::BF16) return GemmRead::kBf16;
    if (w.dtype == DType::F32 && moe_rows_ == 0 && w.row_bytes % 16 == 0) return GemmRead::kTf32;
    return GemmRead::kBf16Dequantized;
  }

  // CpuPrecision::gemm_above_rows: x as a tensor-core GEMM reads it (bf16, or tf32 for f32
  // weights: 10 mantissa bits), round to nearest even.
  Mat gemm_input(const WeightView& w, const Mat& x) {
    const GemmRead read = gemm_read(w, x);
    if (read == GemmRead::kNone) return x;
    rounded_x_.resize(size_t(x.rows * x.cols));
    const bool tf32 = read == GemmRead::kTf32;
    for (int64_t r = 0; r < x.rows; ++r) {
      const float* src = x.row(r);
      float* dst = rounded_x_.data() + r * x.cols;
      for (int64_t c = 0; c < x.cols; ++c) {
        if (!tf32) {
          dst[c] = bf16_to_f32(f32_to_bf16(src[c]));
          continue;
        }
        uint32_t u;
        std::memcpy(&u, &src[c], 4);
        if ((u & 0x7fffffffu) <= 0x7f800000u) u = (u + 0xfffu + ((u >> 13) & 1u)) & 0xffffe000u;
        std::memcpy(&dst[c], &u, 4);
      }
    }
    return Mat(rounded_x_.data(), x.rows, x.cols, x.cols);
  }

  // CpuPrecision::tc_attention_above_rows: one sequence's rows as CUDA's tensor-core prefill
  // kernel rounds them (attention_prefill_tc.cu). Its blocks hold 128 query vectors (128 / group
  // rows of a KV head's group) and walk keys in tiles of 64 from the block's first visible key;
  // per tile, scores in f32 from the bf16 q, a running maximum, the probabilities against it
  // rounded to bf16 for both P V and the row sum; sinks join at the end. A scalar reference:
  // tests only.
  void attention_like_tensor_cores(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads,
                                   float scale, int window, const float* sinks, const Mat& out) {
    constexpr float kLog2e = 1.4426950408889634f;
    const int hd = kv.head_dim, group = n_heads / kv.n_kv_heads;
    const int64_t rows_per_block = std::max(1, 128 / group);
    const float scale_log2 = scale * kLog2e;
    auto first_key = [&](int64_t t) { return window > 0 ? std::max<int64_t>(0, positions[t] - window + 1) : int64_t(0); };
    std::vector<float> qr(static_cast<size_t>(hd)), o(static_cast<size_t>(hd));
    float scores[64];  // one tile's, in log2 units
    for (int64_t b0 = 0; b0 < q.rows; b0 += rows_per_block) {
      const int64_t b1 = std::min(q.rows, b0 + rows_per_block);
      int64_t kmin = INT64_MAX;
      for (int64_t t = b0; t < b1; ++t) kmin = std::min(kmin, first_key(t));
      for (int64_t t = b0; t < b1; ++t) {
        const int64_t lo = first_key(t), hi = positions[t];
        for (int h = 0; h < n_heads; ++h) {
          const int kvh = h / group;
          const float* qh = q.row(t) + int64_t(h) * hd;
          for (int d = 0; d < hd; ++d) qr[size_t(d)] = bf16_to_f32(f32_to_bf16(qh[d]));
          std::fill(o.begin(), o.end(), 0.f);
          float m = -INFINITY, l = 0.f;
          for (int64_t k0 = kmin; k0 <= hi; k0 += 64) {
            const int64_t j0 = std::max(k0, lo), k1 = std::min(hi, k0 + 63);
            float tile_max = -INFINITY;
            for (int64_t j = j0; j <= k1; ++j) {
              const float* kj = kv.k_at(0, j) + int64_t(kvh) * hd;
              float s = 0.f;
              for (int d = 0; d < hd; ++d) s += qr[size_t(d)] * kj[d];
              scores[j - k0] = s * scale_log2;
              tile_max = std::max(tile_max, scores[j - k0]);
            }
            if (tile_max == -INFINITY) continue;
            const float m_new = std::max(m, tile_max);
            const float alpha = std::exp2(m - m_new);
            l *= alpha;
            for (float& x : o) x *= alpha;
            for (int64_t j = j0; j <= k1; ++j) {
              const float* vj = kv.v_at(0, j) + int64_t(kvh) * hd;
              const float p = bf16_to_f32(f32_to_bf16(std::exp2(scores[j - k0] - m_new)));
              l += p;
              for (int d = 0; d < hd; ++d) o[size_t(d)] += p * vj[d];
            }
            m = m_new;
          }
          float factor = 1.f / l;
          if (sinks) {
            const float sink = sinks[h] * kLog2e, mf = std::max(m, sink), f = std::exp2(m - mf);
            factor = f / (l * f + std::exp2(sink - mf));
          }
          float* dst = out.row(t) + int64_t(h) * hd;
          for (int d = 0; d < hd; ++d) dst[d] = o[size_t(d)] * factor;
        }
      }
    }
  }

  // CpuPrecision::route_replay: rows whose experts differ from the replayed ones take those,
  // weighted from this run's own probabilities as cpu::router_softmax_topk weighs its picks.
  static void replay_routes(RouteReplay& r, const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight) {
    TS_CHECK(!r.layers.empty() && r.top_k == k, "route replay: {} MoE layers of top {}, the model routes top {}",
             r.layers.size(), r.top_k, k);
    if (r.cursor.size() != r.layers.size()) r.cursor.assign(r.layers.size(), 0);
    const size_t layer = r.calls++ % r.layers.size();
    const std::vector<int32_t>& want = r.layers[layer];
    int64_t& at = r.cursor[layer];
    TS_CHECK((at + logits.rows) * k <= int64_t(want.size()),
             "route replay: MoE layer {} holds {} rows, the run reached row {}", layer, int64_t(want.size()) / k,
             at + logits.rows);
    std::vector<float> prob(static_cast<size_t>(logits.cols)), sorted;
    for (int64_t t = 0; t < logits.rows; ++t) {
      const int32_t* forced = want.data() + (at + t) * k;
      int32_t* ti = idx + t * k;
      float* tw = weight + t * k;
      if (std::is_permutation(ti, ti + k, forced)) continue;
      const float* l = logits.row(t);
      const float m = *std::max_element(l, l + logits.cols);
      float sum = 0.f;
      for (int64_t e = 0; e < logits.cols; ++e) sum += (prob[size_t(e)] = std::exp(l[e] - m));
      sorted = prob;
      std::sort(sorted.begin(), sorted.end(), std::greater<float>());
      const double margin = k < logits.cols ? double(sorted[size_t(k - 1)] - sorted[size_t(k)]) / sorted[0] : 0.0;
      ++r.flips;
      r.widest_flip_margin = std::max(r.widest_flip_margin, margin);
      float picked = 0.f;
      for (int j = 0; j < k; ++j) {
        TS_CHECK(forced[j] >= 0 && forced[j] < logits.cols, "route replay: expert {} of {}", forced[j], logits.cols);
        ti[j] = forced[j];
        picked += (tw[j] = prob[size_t(forced[j])] / sum);
      }
      if (renormalize)
        for (int j = 0; j < k; ++j) tw[j] /= picked;
    }
    at += logits.rows;
  }

  // Quantized formats have their own kernels; models never see the difference.
  void matmul_view(const WeightView& w, const Mat& x_in, const Mat& y) {
    const Mat x = gemm_input(w, x_in);
    // Dequantized to bf16 on the device: every format dequantize_row widens (INT4-affine's planes
    // are not modelled; MXFP4's values are exact in bf16, so its exact path below is that GEMM).
    const bool bf16_dequantized = gemm_read(w, x_in) == GemmRead::kBf16Dequantized && w.dtype != DType::INT4_AFFINE &&
                                  w.dtype != DType::MXFP4;
    if (bf16_dequantized) {
      float_matmul(w, x, y, /*bf16_weights=*/true);
    } else if (moe_decode() && !moe_int8_formats_ && is_quantized(w.dtype) && w.dtype != DType::INT4_AFFINE &&
               w.dtype != DType::MXFP4) {
      float_matmul(w, x, y);
    } else if (w.dtype == DType::MXFP4) {
      if (precision_.float_mxfp4 && moe_decode() && moe_int8_formats_) {
        cpu::mxfp4_matmul_int8(pool_, w, x, y);  // CUDA's MoE decode kernels: int8, as the CPU's
      } else if (precision_.float_mxfp4) {
        cpu::mxfp4_matmul_exact(pool_, w, x, y);
      } else {
        cpu::mxfp4_matmul(pool_, w, x, y);
      }
    } else if (w.dtype == DType::INT4_AFFINE) {
      cpu::int4_affine_matmul(pool_, w, x, y);
    } else if (is_quantized(w.dtype)) {
      cpu::quant_matmul(pool_, w, x, y);
    } else {
      cpu::matmul(pool_, w, x, y);
    }
    if (precision_.nudge_seed != 0) nudge(y);
  }

  // CpuPrecision::nudge_seed: y *= 1 +- 2^-22, the sign from a hash of (seed, call, element).
  void nudge(const Mat& y) {
    const uint64_t call = nudge_calls_++;
    for (int64_t r = 0; r < y.rows; ++r) {
      float* row = y.row(r);
      for (int64_t c = 0; c < y.cols; ++c) {
        uint64_t h = (uint64_t(precision_.nudge_seed) << 40) ^ (call << 24) ^ uint64_t(r * y.cols + c);
        h ^= h >> 33, h *= 0xff51afd7ed558ccdull, h ^= h >> 33, h *= 0xc4ceb9fe1a85ec53ull, h ^= h >> 33;
        row[c] *= (h & 1) ? 1.f + 0x1p-22f : 1.f - 0x1p-22f;
      }
    }
  }

  void ensure_scratch(int64_t n) {
    if (int64_t(scratch_.size()) < n) scratch_.resize(size_t(n));
  }

  ThreadPool pool_;
  std::vector<float> scratch_;  // gathered expert inputs and FFN intermediates, grown once
  std::vector<std::vector<std::pair<int32_t, float>>> by_expert_;  // moe_experts: (token, weight) per expert
  struct MoePicked {
    size_t e;
    Mat xs, gate, up, y;
  };
  std::vector<MoePicked> moe_picked_;           // moe_experts_as_jobs: per picked expert, its buffers
  std::vector<cpu::QuantMatmulJob> moe_jobs_;   // moe_experts_as_jobs: one dispatch's products
  std::vector<cpu::QuantMatmulJob> shared_jobs_;  // matmul_shared_input's products
  uint64_t nudge_calls_ = 0;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(int n_threads) { return std::make_unique<CpuBackend>(n_threads, CpuPrecision{}); }
std::unique_ptr<Backend> make_cpu_backend(int n_threads, const CpuPrecision& precision) {
  TS_CHECK(precision.gemm_above_rows >= 0 && precision.tc_attention_above_rows >= 0 && precision.prefill_batch >= 0,
           "CpuPrecision: gemm_above_rows {} / tc_attention_above_rows {} / prefill_batch {} < 0",
           precision.gemm_above_rows, precision.tc_attention_above_rows, precision.prefill_batch);
  return std::make_unique<CpuBackend>(n_threads, precision);
}

std::shared_ptr<RouteReplay> route_replay_from_probs(const std::vector<float>& probs, int64_t n_layers, int64_t tokens,
                                                     int64_t n_experts, int top_k) {
  TS_CHECK(int64_t(probs.size()) == n_layers * tokens * n_experts && top_k >= 1 && top_k <= n_experts,
           "route replay: {} probabilities for {} layers x {} tokens x {} experts, top {}", probs.size(), n_layers,
           tokens, n_experts, top_k);
  auto r = std::make_shared<RouteReplay>();
  r->top_k = top_k;
  std::vector<int32_t> order(static_cast<size_t>(n_experts));
  for (int64_t l = 0; l < n_layers; ++l) {
    const float* layer = probs.data() + l * tokens * n_experts;
    if (std::all_of(layer, layer + tokens * n_experts, [](float p) { return p == 0.f; })) continue;
    std::vector<int32_t>& ids = r->layers.emplace_back();
    for (int64_t t = 0; t < tokens; ++t) {
      const float* p = layer + t * n_experts;
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
      ids.insert(ids.end(), order.begin(), order.begin() + top_k);
    }
  }
  TS_CHECK(!r->layers.empty(), "route replay: no layer routed any token");
  return r;
}

}  // namespace turbospark
