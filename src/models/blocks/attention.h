// Softmax attention block: projections (optional biases), optional per-head q/k RMSNorm,
// RoPE, KV-cache write, causal GQA (optional sliding window and sinks), output projection.
#pragma once

#include "ops/backend.h"

namespace turbospark {

struct AttentionParams {
  int n_heads = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int rotary_dim = 0;   // == head_dim unless partial rotary
  float scale = 0.f;    // usually head_dim^-0.5
  int window = 0;       // sliding window in tokens, 0 = full causal
  float norm_eps = 1e-6f;
  float norm_offset = 0.f;  // 1 for (1 + w) q/k norms (Gemma)
  float attention_factor = 1.f;
  Param inv_freq;  // [rotary_dim / 2]
};

struct AttentionWeights {
  Weight q, k, v, o;                     // [heads*hd, hidden], [kv*hd, hidden] x2, [hidden, heads*hd]
  Param q_bias, k_bias, v_bias, o_bias;  // empty when the family has none
  Param q_norm, k_norm;                  // [head_dim] f32, empty when no q/k norm
  Param sinks;                           // [n_heads] f32, empty when no attention sinks
};

// Buffers sized for the micro-batch: q/out [rows, n_heads*hd], k/v [rows, n_kv*hd].
struct AttentionScratch {
  Mat q, k, v, attn;
};

// out = o_proj(attention(x)); x is the normalized input [rows, hidden].
void attention_block(Backend& be, const AttentionParams& p, const AttentionWeights& w, const Mat& x,
                     const int64_t* positions, const KvLayerView& kv, const AttentionScratch& s, const Mat& out);

}  // namespace turbospark
