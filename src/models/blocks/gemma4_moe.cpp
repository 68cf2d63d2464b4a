#include "models/blocks/gemma4_moe.h"

#include <algorithm>
#include <cmath>

namespace turbospark {

void gemma4_moe(Backend& be, const Gemma4MoeWeights& w, const Mat& residual, Gemma4MoeScratch& s, const Mat& out,
                float* router_probs) {
  const int64_t rows = residual.rows, n_experts = int64_t(w.experts.size());
  Mat normed = s.normed.rows_slice(0, rows), logits = s.router_logits.rows_slice(0, rows);
  be.rmsnorm(residual, w.router_norm.data(), w.eps, normed, 0.f);
  be.matmul(w.router, normed, logits);
  if (router_probs) {
    // Capture path (logits --router-out): an explicit download, off the normal decode path.
    std::vector<float> host(size_t(rows * n_experts));
    be.download(logits, host.data());
    for (int64_t t = 0; t < rows; ++t) {
      const float* l = host.data() + t * n_experts;
      float mx = *std::max_element(l, l + n_experts), sum = 0.f;
      for (int64_t e = 0; e < n_experts; ++e) sum += std::exp(l[e] - mx);
      for (int64_t e = 0; e < n_experts; ++e) router_probs[t * n_experts + e] = std::exp(l[e] - mx) / sum;
    }
  }
  s.topk_idx.resize(size_t(rows * w.top_k));
  s.topk_weight.resize(size_t(rows * w.top_k));
  be.router_softmax_topk(logits, w.top_k, /*renormalize=*/true, s.topk_idx.data(), s.topk_weight.data());
  // The per-expert scale is applied to the routing weights, which the CPU backend (like the
  // shared MoE block) hands back in host memory; a queued backend would fold this into its
  // top-k op instead.
  for (size_t j = 0; j < s.topk_idx.size(); ++j) s.topk_weight[j] *= w.per_expert_scale[size_t(s.topk_idx[j])];
  be.rmsnorm(residual, w.pre_norm.data(), w.eps, normed, 0.f);
  be.moe_experts(w.experts, normed, s.topk_idx.data(), s.topk_weight.data(), w.top_k, out);
}

}  // namespace turbospark
