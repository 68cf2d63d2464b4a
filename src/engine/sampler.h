// Token sampling: greedy at temperature 0, else temperature, top-k, top-p and min-p
// filtering (in that order, as llama.cpp and transformers apply them) with a seeded RNG.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace turbospark {

struct SamplingParams {
  float temperature = 0.7f;
  int top_k = 40;       // 0 = off
  float top_p = 0.95f;  // 1 = off
  float min_p = 0.05f;  // 0 = off
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(SamplingParams params);
  // Refuses NaN, infinite and out-of-range parameters by flag name (the constructor does too;
  // commands call this before loading a model).
  static void validate(const SamplingParams& p);
  // Picks the next token from logits[0..vocab). Throws on NaN logits.
  int32_t sample(const float* logits, int64_t vocab);
  // Temperature 0: the pick is the argmax, which a backend can compute without the logits.
  bool greedy() const { return params_.temperature == 0.f; }

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;
};

// Index of the largest logit (lowest index on ties).
int32_t argmax(const float* logits, int64_t n);

}  // namespace turbospark
