// Gemma 4 per-layer input embeddings (not Qwen4-Exp's n-gram PLE): every token gets a small
// vector per decoder layer, the sum of a token-identity part (a packed [vocab, layers * dim]
// table scaled by sqrt(dim)) and a context part (a projection of the scaled input embedding
// times hidden^-0.5, RMS-normed per layer), divided by sqrt(2). Each layer gates its slice
// with GELU(gate(x)) after the FFN residual, projects it back to hidden, norms it and adds
// it to the residual.
#pragma once

#include <vector>

#include "ops/backend.h"

namespace turbospark {

struct Gemma4PerLayerInputWeights {
  Weight table;             // [vocab_per_layer, n_layers * dim], embed_tokens_per_layer
  Weight projection;        // [n_layers * dim, hidden], per_layer_model_projection
  Param norm;  // [dim] f32, per_layer_projection_norm
  int n_layers = 0;
  int64_t dim = 0, hidden = 0;
  float eps = 1e-6f;
};

// out [rows, n_layers * dim] from the token ids and the scaled input embeddings [rows, hidden];
// `context` is scratch of out's shape.
void gemma4_per_layer_inputs(Backend& be, const Gemma4PerLayerInputWeights& w, const int32_t* tokens,
                             const Mat& embeds, const Mat& context, const Mat& out);

struct Gemma4PerLayerGateWeights {
  Weight gate;                   // [dim, hidden], per_layer_input_gate
  Weight projection;             // [hidden, dim], per_layer_projection
  Param post_norm;  // [hidden] f32, post_per_layer_input_norm
};

// x += post_norm(projection(act(gate(x)) * input)); input is this layer's [rows, dim] slice,
// gate and gated are [rows, dim] scratch, branch [rows, hidden] scratch.
void gemma4_per_layer_gate(Backend& be, const Gemma4PerLayerGateWeights& w, Act act, float eps, const Mat& input,
                           const Mat& x, const Mat& gate, const Mat& gated, const Mat& branch);

}  // namespace turbospark
