// Gemma 4 attention: per-head q/k RMSNorm (scale w, no offset) and a scale-free RMSNorm on v,
// RoPE from the layer's own table (default on sliding layers, proportional with zero tail
// frequencies on full ones), attention scale 1 (the norms fix the scale). Two variants the
// shared attention block does not have: k_eq_v (full layers of some checkpoints have no
// v_proj: values are the raw key projection, v-normed, before k's norm and RoPE), and KV
// sharing (later layers project only q and attend over an earlier layer's cache, writing
// nothing).
#pragma once

#include <vector>

#include "models/blocks/attention.h"

namespace turbospark {

struct Gemma4AttentionWeights {
  Weight q;                           // [n_heads * hd, hidden]
  Weight k, v;                        // [n_kv * hd, hidden]; v absent (rows 0) when k_eq_v;
                                      // both absent on KV-shared layers
  Weight o;                           // [hidden, n_heads * hd]
  Param q_norm, k_norm;  // [hd] f32, scale w
  const float* ones = nullptr;        // [hd] of 1.0: v_norm has no weight
  bool kv_shared = false;             // attend over another layer's cache, write nothing
};

// out = o_proj(attention(x)); x is the normalized input [rows, hidden]. `kv` is the layer's
// own cache view, or the source layer's when the weights say kv_shared.
void gemma4_attention(Backend& be, const AttentionParams& p, const Gemma4AttentionWeights& w, const Mat& x,
                      const int64_t* positions, const KvLayerView& kv, const AttentionScratch& s, const Mat& out);

}  // namespace turbospark
