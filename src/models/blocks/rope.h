// RoPE frequency tables. The kernels take inv_freq directly so every variant (default,
// partial rotary, YaRN, proportional) is only a different table plus an attention factor.
#pragma once

#include <cstdint>
#include <vector>

namespace turbospark {

// inv_freq[i] = 1 / theta^(2i / rotary_dim), i < rotary_dim / 2, in float32 as transformers
// computes it ("default" rope_type).
std::vector<float> rope_inv_freq_default(double theta, int rotary_dim);

// YaRN ("yarn" rope_type; transformers modeling_rope_utils._compute_yarn_parameters).
struct YarnParams {
  double theta = 10000.0;
  double factor = 1.0;
  int64_t original_max_positions = 0;  // original_max_position_embeddings
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;           // floor/ceil the correction range
  double attention_factor = 0.0;  // 0: from factor (and mscale / mscale_all_dim when both set)
  double mscale = 0.0, mscale_all_dim = 0.0;
};

struct RopeTable {
  std::vector<float> inv_freq;  // [rotary_dim / 2]
  float attention_factor = 1.f;  // scales cos and sin
};

// Blends interpolated (inv_freq / factor) and extrapolated (inv_freq) frequencies with a
// linear ramp over the dimensions between the beta_fast and beta_slow correction bounds,
// in float32 as transformers computes it.
RopeTable rope_yarn(const YarnParams& p, int rotary_dim);

}  // namespace turbospark
