#include "models/blocks/ffn.h"

#include "core/error.h"

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

void route_tokens(Backend& be, const Mat& logits, int top_k, bool renormalize, const BackendArray<int32_t>& idx,
                  const BackendArray<float>& weight, float* router_probs, const float* expert_scale) {
  TS_CHECK(idx.size() >= logits.rows * top_k && weight.size() >= logits.rows * top_k,
           "routing buffers hold {} entries, {} rows x top {} need more", idx.size(), logits.rows, top_k);
  be.router_softmax_topk(logits, top_k, renormalize, idx.data(), weight.data(), expert_scale);
  if (router_probs) {
    be.softmax_rows(logits, logits);
    be.download(logits, router_probs);
  }
}

void moe_ffn(Backend& be, const MoeWeights& w, const Mat& x, FfnScratch& s, const Mat& out, float* router_probs) {
  const int64_t rows = x.rows;
  Mat logits = s.router_logits.rows_slice(0, rows);
  be.matmul(w.router, x, logits);
  route_tokens(be, logits, w.top_k, w.renormalize, s.topk_idx, s.topk_weight, router_probs);
  be.moe_experts(w.experts, x, s.topk_idx.data(), s.topk_weight.data(), w.top_k, out);
}

}  // namespace turbospark
