// CPU implementations of the hybrid-model ops (GatedDeltaNet, causal convs, hyper-connection
// mixing, PLE gate, QSA selection and selected attention). Straightforward float32 loops,
// parallel over rows or heads where it pays; the math follows transformers' reference.
#pragma once

#include "core/thread_pool.h"
#include "ops/backend.h"

namespace turbospark::cpu {

void unary(const Mat& x, Act act, float pre, float post, const Mat& y);
void mul_act(const Mat& x, const Mat& gate, Act act);
void split_heads(const Mat& ab, int n_heads, int head_dim, const Mat& a, const Mat& b);
void causal_conv1d(const Mat& in, const float* w, int kernel, int dilation, const Mat& state, Act act, const Mat& out);
// Key head of value head h: h / (nv / nk) grouped (transformers), h % nk tiled (GGUF files).
inline int64_t gdn_key_head(int64_t h, int n_k_heads, int n_v_heads, bool v_heads_tiled) {
  return v_heads_tiled ? h % n_k_heads : h / (n_v_heads / n_k_heads);
}
void gated_delta_rule(ThreadPool& pool, const Mat& qkv, const Mat& a, const Mat& b, const float* a_log,
                      const float* dt_bias, int n_k_heads, int n_v_heads, int dk, int dv, bool v_heads_tiled,
                      const Mat& state, const Mat& out);
// The same recurrence in its chunked form (the reference for CUDA's prefill kernel,
// gated_delta_rule.cu): rows in chunks of `chunk`; within a chunk the per-row updates are
// solved at once from the state at the chunk's start. With cum_t the running sum of log decays
// from the chunk's start, S0 that state and u_t the row's delta:
//   u_t = beta_t (v_t - e^{cum_t} S0^T k_t) - sum_{s<t} beta_t e^{cum_t - cum_s} (k_t . k_s) u_s
//   o_t = e^{cum_t} S0^T q_t + sum_{s<=t} e^{cum_t - cum_s} (q_t . k_s) u_s
//   S   = e^{cum_last} S0 + sum_s e^{cum_last - cum_s} k_s u_s^T
// Equal to gated_delta_rule up to f32 rounding (tests/unit/test_gated_delta_chunked.cpp).
void gated_delta_rule_chunked(ThreadPool& pool, const Mat& qkv, const Mat& a, const Mat& b, const float* a_log,
                              const float* dt_bias, int n_k_heads, int n_v_heads, int dk, int dv, bool v_heads_tiled,
                              const Mat& state, const Mat& out, int chunk);
void hc_mix(const Mat& weight, const Mat& normed, int n_streams, const Mat& mixed);
void hc_inject(const Mat& streams, const Mat& branch, const Mat& inject, int n_streams);
void ple_gate(const Mat& key, const Mat& query, const Mat& value, int n_streams, const Mat& out);
// margins: when non-null, each row's position and selection margin appended (QsaMargins).
void qsa_select(const QsaView& qsa, const Mat& index_q, const Mat& raw_keys, const int64_t* positions,
                int32_t* selected, int32_t* counts, int max_selected, QsaMargins* margins = nullptr);
void attention_selected(ThreadPool& pool, const Mat& q, const KvLayerView& kv, int n_heads, float scale,
                        const int32_t* selected, const int32_t* counts, int max_selected, const Mat& out);

}  // namespace turbospark::cpu
