// Gemma 4 routed experts, run beside the dense MLP of the same layer. The router reads the
// residual stream (not the FFN input) through a weightless RMSNorm times router.scale times
// hidden^-0.5, takes softmax top-k, always renormalizes the k weights, then multiplies each
// by its expert's per_expert_scale. The experts are GeGLU (GELU-tanh) over their own
// pre-norm of the residual.
#pragma once

#include <vector>

#include "ops/backend.h"

namespace turbospark {

struct Gemma4MoeWeights {
  Weight router;                        // [n_experts, hidden]
  Param router_norm;       // [hidden] f32: router.scale * hidden^-0.5
  Param per_expert_scale;  // [n_experts] f32
  Param pre_norm;          // [hidden] f32, pre_feedforward_layernorm_2
  std::vector<ExpertWeights> experts;   // n_experts, act = GELU-tanh
  int top_k = 0;
  float eps = 1e-6f;
};

struct Gemma4MoeScratch {
  Mat normed;                      // [rows, hidden]
  Mat router_logits;               // [rows, n_experts]
  BackendArray<int32_t> topk_idx;  // [rows, top_k]
  BackendArray<float> topk_weight; // [rows, top_k]
};

// out = sum_j w_j * expert_j(pre_norm(residual)). router_probs, when non-null, receives the
// softmax router probabilities [rows, n_experts].
void gemma4_moe(Backend& be, const Gemma4MoeWeights& w, const Mat& residual, Gemma4MoeScratch& s, const Mat& out,
                float* router_probs);

}  // namespace turbospark
