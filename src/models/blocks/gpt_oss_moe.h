// gpt-oss mixture of experts: a router linear with bias, top-k over the router logits with
// the softmax taken among the k chosen (the same as softmax over all experts, top-k,
// renormalized, which is the op the backend has), and experts with a bias after every
// projection and the clamped GLU (ExpertWeights::glu_limit), weighted and summed.
#pragma once

#include <vector>

#include "models/blocks/ffn.h"
#include "ops/backend.h"

namespace turbospark {

struct GptOssMoeWeights {
  Weight router;                       // [n_experts, hidden]
  Param router_bias;      // [n_experts] f32
  // gate/up [inter, hidden], down [hidden, inter]; their bias pointers point into the
  // vectors below, so this struct moves but never copies.
  std::vector<ExpertWeights> experts;
  Param gate_bias, up_bias;  // [n_experts, inter] f32, de-interleaved from gate_up_proj_bias
  Param down_bias;           // [n_experts, hidden] f32
  int top_k = 0;

  GptOssMoeWeights() = default;
  GptOssMoeWeights(GptOssMoeWeights&&) = default;
  GptOssMoeWeights& operator=(GptOssMoeWeights&&) = default;
  GptOssMoeWeights(const GptOssMoeWeights&) = delete;
  GptOssMoeWeights& operator=(const GptOssMoeWeights&) = delete;
};

// out = sum_j w_j * expert_j(x) over the top-k experts of each row of x [rows, hidden].
// router_probs, when non-null, receives softmax(router logits) [rows, n_experts].
void gpt_oss_moe(Backend& be, const GptOssMoeWeights& w, const Mat& x, FfnScratch& s, const Mat& out,
                 float* router_probs);

}  // namespace turbospark
