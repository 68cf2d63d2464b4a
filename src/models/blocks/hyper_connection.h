// Hyper-connections (Qwen4-Exp): the residual is C streams of `hidden` each. Before every
// branch a gated residual normalizes the streams per group (scale 1 + w), mixes them into
// the branch input through a low-rank gate sigmoid(up(silu(down(x) / C))) averaged over the
// streams, and computes the inject weights 2 * sigmoid(W x / C) with which the branch output
// is added back to every stream. The exit mixer is the same without inject weights.
#pragma once

#include <vector>

#include "models/weights.h"
#include "ops/backend.h"

namespace turbospark {

class Checkpoint;

struct HyperConnectionWeights {
  Param norm;  // [C*H] f32, applied as (1 + w) per group of H
  Weight down;              // [rank, C*H]
  Weight up;                // [C*H, rank]
  Weight inject;            // [C, C*H]; absent (rows 0) for the exit mixer
  int n_streams = 0;
  int64_t hidden = 0;
  float eps = 1e-6f;

  static HyperConnectionWeights load(const WeightLoader& ld, const std::string& prefix, int n_streams, int64_t hidden,
                                     int64_t rank, bool with_inject, float eps, int layer);
};

struct HyperConnectionScratch {
  Mat normed;  // [rows, C*H]
  Mat low;     // [rows, rank]
  Mat gate;    // [rows, C*H]
};

// mixed = the branch input [rows, H]; inject [rows, C] when the weights have an inject.
void hc_gated_residual(Backend& be, const HyperConnectionWeights& w, const Mat& streams, HyperConnectionScratch& s,
                       const Mat& mixed, const Mat* inject);

}  // namespace turbospark
