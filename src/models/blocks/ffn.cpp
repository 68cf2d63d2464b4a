#include "models/blocks/ffn.h"

#include "core/error.h"

namespace turbospark {

void dense_mlp(Backend& be, const DenseMlpWeights& w, const Mat& x, FfnScratch& s, const Mat& out, const Weight* side,
               const Mat* side_out) {
  TS_CHECK((side == nullptr) == (side_out == nullptr), "dense_mlp: a side weight needs its output, and the reverse");
  const int64_t rows = x.rows;
  Mat gate = s.gate.rows_slice(0, rows), up = s.up.rows_slice(0, rows);
  // gate, up (and the side projection) in one launch at decode on a GPU, with act(gate) in its
  // store unless SwiGLU.
  const Weight* in[] = {&w.gate, &w.up, side};
  const Mat in_out[] = {gate, up, side ? *side_out : Mat{}};
  const size_t n = side ? 3 : 2;
  if (w.act == Act::kSilu) {
    be.matmul_shared_input(std::span(in, n), x, std::span(in_out, n));
    be.swiglu(gate, up, gate);
  } else {
    const MatmulAct acts[] = {{w.act, 1.f, 1.f}, {}, {}};
    be.matmul_shared_input(std::span(in, n), x, std::span(in_out, n), std::span(acts, n));
    be.mul_act(gate, up, Act::kIdentity);
  }
  be.matmul(w.down, gate, out);
}

namespace {

void check_routing_buffers(const Mat& logits, int top_k, const BackendArray<int32_t>& idx,
                           const BackendArray<float>& weight) {
  TS_CHECK(idx.size() >= logits.rows * top_k && weight.size() >= logits.rows * top_k,
           "routing buffers hold {} entries, {} rows x top {} need more", idx.size(), logits.rows, top_k);
}

// --router-out: the logits become probabilities (after routing has read them).
void emit_router_probs(Backend& be, const Mat& logits, float* router_probs) {
  if (!router_probs) return;
  be.softmax_rows(logits, logits);
  be.download(logits, router_probs);
}

}  // namespace

void route_tokens(Backend& be, const Mat& logits, int top_k, bool renormalize, const BackendArray<int32_t>& idx,
                  const BackendArray<float>& weight, float* router_probs, const float* expert_scale) {
  check_routing_buffers(logits, top_k, idx, weight);
  be.router_softmax_topk(logits, top_k, renormalize, idx.data(), weight.data(), expert_scale);
  emit_router_probs(be, logits, router_probs);
}

void route_with_router(Backend& be, const Weight& router, const float* bias, const Mat& x, const Mat& logits,
                       int top_k, bool renormalize, const BackendArray<int32_t>& idx,
                       const BackendArray<float>& weight, float* router_probs) {
  check_routing_buffers(logits, top_k, idx, weight);
  be.router_topk(router, x, logits, top_k, renormalize, idx.data(), weight.data(), nullptr, bias);
  emit_router_probs(be, logits, router_probs);
}

void moe_ffn(Backend& be, const MoeWeights& w, const Mat& x, FfnScratch& s, const Mat& out, float* router_probs,
             const MoeWeights* next) {
  const int64_t rows = x.rows;
  Mat logits = s.router_logits.rows_slice(0, rows);
  route_with_router(be, w.router, nullptr, x, logits, w.top_k, w.renormalize, s.topk_idx, s.topk_weight,
                    router_probs);
  if (next && be.speculates_experts() && next->router.view.rows <= s.router_logits.cols &&
      next->top_k <= w.top_k) {
    // The guess: the next layer's router on this layer's input (its own input is this x plus
    // two residual branches away). Read by the provider only; this layer's routing is untouched.
    const Mat guess_logits = s.router_logits.rows_slice(0, rows).cols_slice(0, next->router.view.rows);
    be.router_topk(next->router, x, guess_logits, next->top_k, next->renormalize, s.guess_idx.data(),
                   s.guess_weight.data());
    be.speculate_experts(next->experts, s.guess_idx.data(), rows, next->top_k);
  }
  be.moe_experts(w.experts, x, s.topk_idx.data(), s.topk_weight.data(), w.top_k, out);
}

}  // namespace turbospark
