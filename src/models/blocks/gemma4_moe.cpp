#include "models/blocks/gemma4_moe.h"

#include "models/blocks/ffn.h"

namespace turbospark {

void gemma4_moe(Backend& be, const Gemma4MoeWeights& w, const Mat& residual, Gemma4MoeScratch& s, const Mat& out,
                float* router_probs) {
  const int64_t rows = residual.rows;
  Mat normed = s.normed.rows_slice(0, rows), logits = s.router_logits.rows_slice(0, rows);
  be.rmsnorm(residual, w.router_norm.data(), w.eps, normed, 0.f);
  be.matmul(w.router, normed, logits);
  // The per-expert scale folds into the backend's top-k: the weights never visit the host.
  route_tokens(be, logits, w.top_k, /*renormalize=*/true, s.topk_idx, s.topk_weight, router_probs,
               w.per_expert_scale.data());
  be.rmsnorm(residual, w.pre_norm.data(), w.eps, normed, 0.f);
  be.moe_experts(w.experts, normed, s.topk_idx.data(), s.topk_weight.data(), w.top_k, out);
}

}  // namespace turbospark
