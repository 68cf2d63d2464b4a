// Feed-forward blocks: the dense SwiGLU MLP and the routed mixture of experts.
#pragma once

#include <vector>

#include "ops/backend.h"

namespace turbospark {

struct DenseMlpWeights {
  Weight gate, up;  // [inter, hidden]
  Weight down;      // [hidden, inter]
  Act act = Act::kSilu;  // act(gate) * up: SiLU (SwiGLU) or GELU-tanh (GeGLU)
};

struct MoeWeights {
  Weight router;                      // [n_experts, hidden]
  std::vector<ExpertWeights> experts; // n_experts routed experts
  int top_k = 0;
  bool renormalize = false;           // norm_topk_prob
};

struct FfnScratch {
  Mat gate, up;          // [rows, inter] (dense)
  Mat router_logits;     // [rows, n_experts]
  BackendArray<int32_t> topk_idx;  // [rows, top_k]
  BackendArray<float> topk_weight; // [rows, top_k]
  BackendArray<int32_t> guess_idx;   // [rows, top_k]: the next MoE layer's likely experts (streaming)
  BackendArray<float> guess_weight;  // [rows, top_k]

  // The routing buffers for micro-batches of up to `rows` rows.
  void allocate_routing(Backend& be, int64_t rows, int top_k) {
    topk_idx = be.alloc_array<int32_t>(rows * top_k);
    topk_weight = be.alloc_array<float>(rows * top_k);
    guess_idx = be.alloc_array<int32_t>(rows * top_k);
    guess_weight = be.alloc_array<float>(rows * top_k);
  }
};

// out = down(act(x gate^T) * x up^T). With `side` (a weight reading the same x, e.g. Qwen4-Exp's
// shared-expert gate [1, hidden]) side_out = x side^T too, in gate and up's launch.
void dense_mlp(Backend& be, const DenseMlpWeights& w, const Mat& x, FfnScratch& s, const Mat& out,
               const Weight* side = nullptr, const Mat* side_out = nullptr);

// Routing from router logits [rows, n_experts]: the top_k experts of each row and their
// softmax weights (renormalized over the k when asked, then scaled per expert when
// expert_scale is non-null) into the scratch's idx/weight [rows, top_k], backend memory the
// host never reads. When router_probs (host) is non-null it also receives softmax(logits)
// [rows, n_experts]: the --router-out capture path, a deliberate download that overwrites
// the logits.
void route_tokens(Backend& be, const Mat& logits, int top_k, bool renormalize, const BackendArray<int32_t>& idx,
                  const BackendArray<float>& weight, float* router_probs, const float* expert_scale = nullptr);

// logits = x router^T (+ bias when non-null, backend memory [n_experts]), then route_tokens on
// them, in one backend call (Backend::router_topk; CUDA decode: one launch).
void route_with_router(Backend& be, const Weight& router, const float* bias, const Mat& x, const Mat& logits,
                       int top_k, bool renormalize, const BackendArray<int32_t>& idx,
                       const BackendArray<float>& weight, float* router_probs);

// When router_probs is non-null it receives softmax(router logits) [rows, n_experts]. With
// `next` (the next MoE layer's weights) and a backend that speculates (expert streaming with
// --expert-speculate), next's router also runs on x and its picks go to the expert provider as
// a guess, loaded while this layer computes (the logits scratch is reused for it).
void moe_ffn(Backend& be, const MoeWeights& w, const Mat& x, FfnScratch& s, const Mat& out, float* router_probs,
             const MoeWeights* next = nullptr);

}  // namespace turbospark
