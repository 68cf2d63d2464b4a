#include "models/blocks/ffn.h"

#include <algorithm>
#include <cmath>

namespace turbospark {

void dense_mlp(Backend& be, const DenseMlpWeights& w, const Mat& x, FfnScratch& s, const Mat& out) {
  const int64_t rows = x.rows;
  Mat gate = s.gate.rows_slice(0, rows), up = s.up.rows_slice(0, rows);
  be.matmul(w.gate, x, gate);
  be.matmul(w.up, x, up);
  if (w.act == Act::kSilu) {
    be.swiglu(gate, up, gate);
  } else {
    be.unary(gate, w.act, 1.f, 1.f, gate);
    be.mul_act(gate, up, Act::kIdentity);
  }
  be.matmul(w.down, gate, out);
}

void moe_ffn(Backend& be, const MoeWeights& w, const Mat& x, FfnScratch& s, const Mat& out, float* router_probs) {
  const int64_t rows = x.rows;
  const int64_t n_experts = int64_t(w.experts.size());
  Mat logits = s.router_logits.rows_slice(0, rows);
  be.matmul(w.router, x, logits);
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
  be.router_softmax_topk(logits, w.top_k, w.renormalize, s.topk_idx.data(), s.topk_weight.data());
  be.moe_experts(w.experts, x, s.topk_idx.data(), s.topk_weight.data(), w.top_k, out);
}

}  // namespace turbospark
