// The one small interface between models and hardware. A forward step records ops against
// a Backend: the CPU backend runs each op eagerly on its thread pool; the CUDA backend
// (next) enqueues the same ops on a stream and captures decode steps in graphs. Models never
// learn which, never touch raw kernels, and never branch on a weight's dtype: formats are
// the backend's business.
//
// Activations are Mat views into buffers the backend allocated (host memory on CPU). Any
// host write into such a buffer goes through upload() at an explicit row, so that on a
// queued backend it is ordered with the work around it (the seed's PLE hazard).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace turbospark {

// Where a weight lives at run time. The expert cache reads only this metadata.
enum class Residency : uint8_t { kResident, kStreamedExpert };

// A weight matrix plus the metadata the backend and expert cache need.
struct Weight {
  WeightView view;  // as stored, [out, in]
  std::string name;
  int layer = -1;
  Residency residency = Residency::kResident;
  int expert = -1;  // routed expert index, -1 for dense weights

  int64_t rows() const { return view.rows; }
  int64_t cols() const { return view.cols; }
};

// Elementwise activations for Backend::unary and Backend::mul_act.
enum class Act : uint8_t { kIdentity, kSilu, kSigmoid, kGeluTanh, kTanh };

// One routed expert: gated FFN [hidden] -> [inter] -> [hidden], act(gate) * up: SwiGLU, or
// GeGLU (GELU-tanh) for Gemma 4.
struct ExpertWeights {
  Weight gate;  // [inter, hidden]
  Weight up;    // [inter, hidden]
  Weight down;  // [hidden, inter]
  Act act = Act::kSilu;
  // gpt-oss: biases after each projection (host f32 owned by the model; null when absent),
  // and when glu_limit > 0 its clamped GLU in place of act(gate) * up:
  // (clamp(up, -limit, limit) + 1) * g * sigmoid(glu_alpha * g), g = min(gate, limit).
  const float* gate_bias = nullptr;  // [inter]
  const float* up_bias = nullptr;    // [inter]
  const float* down_bias = nullptr;  // [hidden]
  float glu_alpha = 0.f;
  float glu_limit = 0.f;
  // gpt-oss: gate and up are the even and odd rows of one [2 * inter, hidden] matrix (views
  // with twice the row stride, gate's starting at row 0): a backend may run them as one
  // contiguous matmul (fused_gate_up) instead of two strided ones.
  bool gate_up_interleaved = false;
};

// The [2 * inter, hidden] matrix whose even rows are e.gate and odd rows e.up, for an expert
// with gate_up_interleaved.
inline WeightView fused_gate_up(const ExpertWeights& e) {
  WeightView v = e.gate.view;
  v.rows *= 2;
  v.row_bytes /= 2;
  v.scales_row_bytes /= 2;
  v.biases_row_bytes /= 2;
  return v;
}

// One layer's paged KV cache as the backend sees it (see engine/kv_cache.h).
struct KvLayerView {
  float* const* k_blocks = nullptr;  // per block: [block_size, n_kv_heads, head_dim] f32
  float* const* v_blocks = nullptr;
  const int32_t* block_table = nullptr;
  int block_size = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
};

// One layer's QSA indexer state as the backend sees it (see models/blocks/qsa.h).
struct QsaView {
  Mat raw_keys;      // [max_context, head_dim] un-normalized index keys, one row per position
  Mat block_keys;    // [max_context / ratio, head_dim] pooled, normed, rotated complete blocks
  const float* k_norm = nullptr;  // [head_dim], applied as (1 + w)
  const float* inv_freq = nullptr;
  int rotary_dim = 0;
  int ratio = 0;       // indexer_compress_ratio
  int block_topk = 0;  // indexer_budget / ratio
  int n_heads = 0;
  int head_dim = 0;
  float eps = 1e-6f;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // Scratch activations [rows, cols] f32, owned by the backend until released with the
  // returned handle.
  virtual std::shared_ptr<float> alloc(int64_t n_floats) = 0;
  // Host -> backend copy into `dst` (rows of a Mat the backend allocated).
  virtual void upload(const Mat& dst, const float* src) = 0;
  // Backend -> host copy; a synchronisation point on queued backends.
  virtual void download(const Mat& src, float* dst) = 0;

  // y = x W^T for W [out, in]; one row of x is a GEMV (decode), many a GEMM (prefill).
  virtual void matmul(const Weight& w, const Mat& x, const Mat& y) = 0;
  // y[t, :] += bias (length y.cols)
  virtual void add_bias(const Mat& y, const float* bias) = 0;
  virtual void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset = 0.f) = 0;
  // In-place RoPE (rotate-half layout) over x viewed as [rows, n_heads, head_dim].
  virtual void rope(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions,
                    const float* inv_freq, float attention_factor) = 0;
  // Writes k/v rows [rows, n_kv_heads * head_dim] at positions into the paged cache.
  virtual void kv_write(const KvLayerView& kv, const Mat& k, const Mat& v, const int64_t* positions) = 0;
  virtual void attention(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                         int window, const float* sinks, const Mat& out) = 0;
  virtual void swiglu(const Mat& gate, const Mat& up, const Mat& out) = 0;
  virtual void embedding(const Weight& table, const int32_t* ids, int64_t n, float scale, const Mat& out) = 0;
  virtual void add(const Mat& y, const Mat& x) = 0;  // y += x
  // Softmax top-k routing of router logits [rows, n_experts] into idx/weight [rows, k].
  virtual void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight) = 0;
  // out[t] = sum_j weight[t, j] * expert_{idx[t, j]}(x[t]). Routing stays on the backend:
  // resident experts need no host round trip (the streaming path syncs here, by design).
  // y = post * act(pre * x), elementwise; y may alias x.
  virtual void unary(const Mat& x, Act act, float pre, float post, const Mat& y) = 0;
  // x *= act(gate); gate has x.cols columns, or 1 column broadcast over the row.
  virtual void mul_act(const Mat& x, const Mat& gate, Act act) = 0;
  // Splits rows of [heads, 2 * head_dim] (per head: first half a, second half b) into a and b.
  virtual void split_heads(const Mat& ab, int n_heads, int head_dim, const Mat& a, const Mat& b) = 0;
  virtual void copy(const Mat& src, const Mat& dst) = 0;

  // Depthwise causal conv over time for each channel: out[t, c] = act(sum_k w[c, k] *
  // in[t - (K-1-k) * dilation, c]), where inputs before the micro-batch come from `state`
  // ([(K-1) * dilation, channels], oldest first), which is then advanced. w is [channels, K].
  virtual void causal_conv1d(const Mat& in, const float* w, int kernel, int dilation, const Mat& state, Act act,
                             const Mat& out) = 0;
  // GatedDeltaNet recurrence over the micro-batch (rows in order). qkv [rows, 2*nk*dk + nv*dv]
  // after the conv; a, b [rows, nv] projections; state [nv, dk*dv] (S[i][j] at i*dv+j) is
  // advanced in place. out [rows, nv*dv].
  virtual void gated_delta_rule(const Mat& qkv, const Mat& a, const Mat& b, const float* a_log,
                                const float* dt_bias, int n_k_heads, int n_v_heads, int dk, int dv,
                                const Mat& state, const Mat& out) = 0;
  // Hyper-connections: mixed[t] = mean_c(weight[t, c] * normed[t, c]) over C streams of
  // `hidden` each, and streams[t, c] += inject[t, c] * branch[t].
  virtual void hc_mix(const Mat& weight, const Mat& normed, int n_streams, const Mat& mixed) = 0;
  virtual void hc_inject(const Mat& streams, const Mat& branch, const Mat& inject, int n_streams) = 0;
  // PLE gate: g_c = sum(key_c * query_c) / sqrt(hidden), s = sign(g) sqrt(max(|g|, 1e-6)),
  // out_c = sigmoid(s) * value, for each of the C streams.
  virtual void ple_gate(const Mat& key, const Mat& query, const Mat& value, int n_streams, const Mat& out) = 0;
  // QSA: stores the micro-batch's raw index keys, completes any newly full blocks, and for
  // each query row picks its visible positions (top blocks by sum_h relu(q_h . k_b) /
  // sqrt(d) plus the incomplete tail). selected is [rows, max_selected], counts [rows].
  virtual void qsa_select(const QsaView& qsa, const Mat& index_q, const Mat& raw_keys, const int64_t* positions,
                          int32_t* selected, int32_t* counts, int max_selected) = 0;
  // Attention restricted to each row's selected positions (all <= its own position).
  virtual void attention_selected(const Mat& q, const KvLayerView& kv, int n_heads, float scale,
                                  const int32_t* selected, const int32_t* counts, int max_selected,
                                  const Mat& out) = 0;

  virtual void moe_experts(const std::vector<ExpertWeights>& experts, const Mat& x, const int32_t* idx,
                           const float* weight, int k, const Mat& out) = 0;
};

std::unique_ptr<Backend> make_cpu_backend(int n_threads);

}  // namespace turbospark
