#include "engine/sampler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace turbospark {

int32_t argmax(const float* logits, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  return int32_t(best);
}

void Sampler::validate(const SamplingParams& p) {
  // Written as "not inside the range" so that NaN (every comparison false) is refused too.
  if (!(p.temperature >= 0 && p.temperature <= 100)) {
    fail("--temperature must be in [0, 100] (0 = greedy), got {}", p.temperature);
  }
  if (!(p.top_p > 0 && p.top_p <= 1)) fail("--top-p must be in (0, 1], got {}", p.top_p);
  if (!(p.min_p >= 0 && p.min_p < 1)) fail("--min-p must be in [0, 1), got {}", p.min_p);
  if (p.top_k < 0) fail("--top-k must be >= 0, got {}", p.top_k);
}

Sampler::Sampler(SamplingParams params) : params_(params), rng_(params.seed) { validate(params_); }

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  for (int64_t i = 0; i < vocab; ++i) {
    if (std::isnan(logits[i])) fail("NaN logit for token {}", i);
  }
  if (params_.temperature == 0.f) return argmax(logits, vocab);
  candidates_.clear();
  for (int64_t i = 0; i < vocab; ++i) candidates_.emplace_back(logits[i] / params_.temperature, int32_t(i));
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t keep = candidates_.size();
  if (params_.top_k > 0 && size_t(params_.top_k) < keep) {
    keep = size_t(params_.top_k);
    std::partial_sort(candidates_.begin(), candidates_.begin() + long(keep), candidates_.end(), by_logit);
  } else {
    std::sort(candidates_.begin(), candidates_.end(), by_logit);
  }
  candidates_.resize(keep);
  // Softmax over the survivors.
  const float mx = candidates_[0].first;
  double sum = 0;
  for (auto& c : candidates_) {
    c.first = std::exp(c.first - mx);
    sum += c.first;
  }
  for (auto& c : candidates_) c.first = float(c.first / sum);
  if (params_.top_p < 1.f) {
    double cum = 0;
    size_t n = 0;
    while (n < candidates_.size()) {
      cum += candidates_[n].first;
      ++n;
      if (cum >= params_.top_p) break;
    }
    candidates_.resize(n);
  }
  if (params_.min_p > 0.f) {
    const float floor = candidates_[0].first * params_.min_p;
    size_t n = 1;
    while (n < candidates_.size() && candidates_[n].first >= floor) ++n;
    candidates_.resize(n);
  }
  double total = 0;
  for (const auto& c : candidates_) total += c.first;
  std::uniform_real_distribution<double> uniform(0.0, total);
  double r = uniform(rng_), acc = 0;
  for (const auto& c : candidates_) {
    acc += c.first;
    if (r < acc) return c.second;
  }
  return candidates_.back().second;
}

}  // namespace turbospark
