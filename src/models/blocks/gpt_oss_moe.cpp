#include "models/blocks/ffn.h"
#include "models/blocks/gpt_oss_moe.h"

#include <algorithm>
#include <cmath>

namespace turbospark {

void gpt_oss_moe(Backend& be, const GptOssMoeWeights& w, const Mat& x, FfnScratch& s, const Mat& out,
                 float* router_probs) {
  const int64_t rows = x.rows;
  Mat logits = s.router_logits.rows_slice(0, rows);
  // softmax over the k largest logits == softmax over all, top k, renormalized.
  route_with_router(be, w.router, w.router_bias.data(), x, logits, w.top_k, /*renormalize=*/true, s.topk_idx,
                    s.topk_weight, router_probs);
  be.moe_experts(w.experts, x, s.topk_idx.data(), s.topk_weight.data(), w.top_k, out);
}

}  // namespace turbospark
