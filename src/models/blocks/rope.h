// RoPE frequency tables. The kernels take inv_freq directly so every variant (default,
// partial rotary, YaRN, proportional) is only a different table plus an attention factor.
#pragma once

#include <vector>

namespace turbospark {

// inv_freq[i] = 1 / theta^(2i / rotary_dim), i < rotary_dim / 2, in float32 as transformers
// computes it ("default" rope_type).
std::vector<float> rope_inv_freq_default(double theta, int rotary_dim);

}  // namespace turbospark
