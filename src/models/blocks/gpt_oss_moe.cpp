#include "models/blocks/gpt_oss_moe.h"

#include <algorithm>
#include <cmath>

namespace turbospark {

void gpt_oss_moe(Backend& be, const GptOssMoeWeights& w, const Mat& x, FfnScratch& s, const Mat& out,
                 float* router_probs) {
  const int64_t rows = x.rows;
  const int64_t n_experts = int64_t(w.experts.size());
  Mat logits = s.router_logits.rows_slice(0, rows);
  be.matmul(w.router, x, logits);
  be.add_bias(logits, w.router_bias.data());
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
  // softmax over the k largest logits == softmax over all, top k, renormalized.
  be.router_softmax_topk(logits, w.top_k, /*renormalize=*/true, s.topk_idx.data(), s.topk_weight.data());
  be.moe_experts(w.experts, x, s.topk_idx.data(), s.topk_weight.data(), w.top_k, out);
}

}  // namespace turbospark
