// The last step of a decoder forward: final RMSNorm, LM head, optional soft-capping.
#pragma once

#include <vector>

#include "models/model.h"
#include "ops/backend.h"

namespace turbospark {

struct OutputWeights {
  const Param* norm = nullptr;  // [hidden] final RMSNorm weight
  float eps = 1e-6f;
  float norm_offset = 0.f;                  // Gemma's (1 + w) norms: 1
  const Weight* lm_head = nullptr;           // [vocab, hidden]
  float softcap = 0.f;                      // > 0: logits = softcap * tanh(logits / softcap)
};

// The step's one download: `logits` into b.logits, or only their argmax ids into
// b.greedy_ids.
void download_outputs(Backend& be, const ForwardBatch& b, const Mat& logits);

// Only the rows whose logits are wanted (all of x, or its last row) go through the final
// norm (into normed_scratch) and the LM head (into logits_scratch), then download_outputs.
// Traces "final_norm" and "lm_head" as layer n_layers.
void output_logits(Backend& be, const ForwardBatch& b, const OutputWeights& w, int n_layers, const Mat& x,
                   const Mat& normed_scratch, const Mat& logits_scratch);

}  // namespace turbospark
