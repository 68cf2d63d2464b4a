#include "models/blocks/rope.h"

#include <cmath>

namespace turbospark {

std::vector<float> rope_inv_freq_default(double theta, int rotary_dim) {
  std::vector<float> inv(size_t(rotary_dim / 2));
  for (int i = 0; i < rotary_dim / 2; ++i) {
    float exponent = float(2 * i) / float(rotary_dim);
    inv[size_t(i)] = 1.0f / std::pow(float(theta), exponent);
  }
  return inv;
}

}  // namespace turbospark
