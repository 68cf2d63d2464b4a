// GatedDeltaNet linear attention (Qwen3.5 / Qwen4-Exp): fused qkv projection, causal
// depthwise conv (carried state), L2-normalized q/k, beta = sigmoid(b),
// g = -exp(A_log) * softplus(a + dt_bias), the delta-rule recurrence per value head, a
// gated RMSNorm (weight * norm(o) * act(z)) and the out projection. Prefill runs the
// recurrent form token by token, which is the chunked reference's exact math.
#pragma once

#include <span>
#include <vector>

#include "models/blocks/state_rows.h"
#include "models/weights.h"
#include "ops/backend.h"

namespace turbospark {

class Checkpoint;

struct GatedDeltaNetParams {
  int n_k_heads = 0, n_v_heads = 0, dk = 0, dv = 0, conv_kernel = 0;
  Act gate_act = Act::kSilu;
  float eps = 1e-6f;
  // Value-head-indexed weights (in_proj_qkv's v rows, in_proj_z, a, b, A_log, dt_bias, the
  // conv's v channels, out_proj's columns) in llama.cpp's tiled order: value head h reads key
  // head h % n_k_heads instead of h / (n_v_heads / n_k_heads). Set for GGUF files.
  bool v_heads_tiled = false;
  int64_t conv_dim() const { return 2 * int64_t(n_k_heads) * dk + int64_t(n_v_heads) * dv; }
  int64_t value_dim() const { return int64_t(n_v_heads) * dv; }
};

struct GatedDeltaNetWeights {
  Weight in_qkv;   // [2*nk*dk + nv*dv, hidden]
  Weight in_z;     // [nv*dv, hidden]
  Weight in_b;     // [nv, hidden]
  Weight in_a;     // [nv, hidden]
  Weight out;      // [hidden, nv*dv]
  Param conv;     // [conv_dim, K] f32
  Param a_log;    // [nv]
  Param dt_bias;  // [nv]
  Param norm;     // [dv], plain scale

  static GatedDeltaNetWeights load(const WeightLoader& ld, const std::string& prefix, const GatedDeltaNetParams& p,
                                   int64_t hidden, int layer);
};

struct GatedDeltaNetState {
  Mat conv;        // [K-1, conv_dim]
  Mat recurrent;   // [nv, dk*dv]
};

struct GatedDeltaNetScratch {
  Mat qkv, qkv_conv;  // [rows, conv_dim]
  Mat z, core;        // [rows, nv*dv]
  Mat a, b;           // [rows, nv]
};

// out = GatedDeltaNet(x); `runs` cover x's rows, each advancing its sequence's state.
void gated_delta_net(Backend& be, const GatedDeltaNetParams& p, const GatedDeltaNetWeights& w, const Mat& x,
                     std::span<const StateRows<const GatedDeltaNetState>> runs, GatedDeltaNetScratch& s,
                     const Mat& out);

}  // namespace turbospark
