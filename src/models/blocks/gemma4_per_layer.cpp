#include "models/blocks/gemma4_per_layer.h"

#include <cmath>

namespace turbospark {

void gemma4_per_layer_inputs(Backend& be, const Gemma4PerLayerInputWeights& w, const int32_t* tokens,
                             const Mat& embeds, const Mat& context, const Mat& out) {
  const int64_t rows = embeds.rows;
  be.embedding(w.table, tokens, rows, std::sqrt(float(w.dim)), out);
  be.matmul(w.projection, embeds, context);
  be.unary(context, Act::kIdentity, 1.f, 1.f / std::sqrt(float(w.hidden)), context);
  // One norm per (token, layer): [rows, layers * dim] viewed as [rows * layers, dim].
  Mat per_layer(context.data, rows * w.n_layers, w.dim);
  be.rmsnorm(per_layer, w.norm.data(), w.eps, per_layer, 0.f);
  be.add(context, out);
  be.unary(context, Act::kIdentity, 1.f, 1.f / std::sqrt(2.f), out);
}

void gemma4_per_layer_gate(Backend& be, const Gemma4PerLayerGateWeights& w, Act act, float eps, const Mat& input,
                           const Mat& x, const Mat& gate, const Mat& gated, const Mat& branch) {
  be.matmul(w.gate, x, gate);
  be.copy(input, gated);
  be.mul_act(gated, gate, act);
  be.matmul(w.projection, gated, branch);
  be.rmsnorm(branch, w.post_norm.data(), eps, branch, 0.f);
  be.add(x, branch);
}

}  // namespace turbospark
