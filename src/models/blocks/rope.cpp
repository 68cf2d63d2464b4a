#include "models/blocks/rope.h"

#include <algorithm>
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

RopeTable rope_yarn(const YarnParams& p, int rotary_dim) {
  const int half = rotary_dim / 2;
  const double two_pi = 2.0 * M_PI;
  auto mscale_of = [](double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * std::log(scale) + 1.0; };
  RopeTable t;
  if (p.attention_factor > 0) {
    t.attention_factor = float(p.attention_factor);
  } else if (p.mscale != 0 && p.mscale_all_dim != 0) {
    t.attention_factor = float(mscale_of(p.factor, p.mscale) / mscale_of(p.factor, p.mscale_all_dim));
  } else {
    t.attention_factor = float(mscale_of(p.factor, 1.0));
  }
  // The dimension at which a frequency completes `rotations` turns over the original context.
  auto correction_dim = [&](double rotations) {
    return (rotary_dim * std::log(double(p.original_max_positions) / (rotations * two_pi))) / (2 * std::log(p.theta));
  };
  double low = correction_dim(p.beta_fast), high = correction_dim(p.beta_slow);
  if (p.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(rotary_dim - 1));
  if (low == high) high += 0.001;  // as the reference: avoids a zero-width ramp
  const float low_f = float(low), width_f = float(high - low);
  const float factor_f = float(p.factor);
  t.inv_freq.resize(size_t(half));
  for (int i = 0; i < half; ++i) {
    const float pos_freq = std::pow(float(p.theta), float(2 * i) / float(rotary_dim));
    const float extrapolation = 1.0f / pos_freq;
    const float interpolation = 1.0f / (factor_f * pos_freq);
    const float ramp = std::clamp((float(i) - low_f) / width_f, 0.0f, 1.0f);
    const float extrapolation_weight = 1.0f - ramp;
    // Two rounded products, then the sum (no fused multiply-add), as torch evaluates it.
    volatile float a = interpolation * (1.0f - extrapolation_weight);
    volatile float b = extrapolation * extrapolation_weight;
    t.inv_freq[size_t(i)] = a + b;
  }
  return t;
}

}  // namespace turbospark
