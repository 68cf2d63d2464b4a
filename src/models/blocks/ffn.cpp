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

void route_tokens(Backend& be, const Mat& logits, int top_k, bool renormalize, std::vector<int32_t>& idx,
                  std::vector<float>& weight, float* router_probs) {
  const int64_t rows = logits.rows, n_experts = logits.cols;
  if (router_probs) {
    std::vector<float> host(size_t(rows * n_experts));
    be.download(logits, host.data());
    for (int64_t t = 0; t < rows; ++t) {
      const float* l = host.data() + t * n_experts;
      float mx = *std::max_element(l, l + n_experts), sum = 0.f;
      for (int64_t e = 0; e < n_experts; ++e) sum += std::exp(l[e] - mx);
      for (int64_t e = 0; e < n_experts; ++e) router_probs[t * n_experts + e] = std::exp(l[e] - mx) / sum;
    }
  }
  idx.resize(size_t(rows * top_k));
  weight.resize(size_t(rows * top_k));
  be.router_softmax_topk(logits, top_k, renormalize, idx.data(), weight.data());
}

void moe_ffn(Backend& be, const MoeWeights& w, const Mat& x, FfnScratch& s, const Mat& out, float* router_probs) {
  const int64_t rows = x.rows;
  Mat logits = s.router_logits.rows_slice(0, rows);
  be.matmul(w.router, x, logits);
  route_tokens(be, logits, w.top_k, w.renormalize, s.topk_idx, s.topk_weight, router_probs);
  be.moe_experts(w.experts, x, s.topk_idx.data(), s.topk_weight.data(), w.top_k, out);
}

}  // namespace turbospark
