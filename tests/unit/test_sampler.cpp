#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "engine/sampler.h"

namespace turbospark {
namespace {

TEST(Sampler, GreedyPicksLargestLowestIndexOnTies) {
  SamplingParams p;
  p.temperature = 0;
  Sampler s(p);
  float logits[] = {1.f, 3.f, -2.f, 3.f};
  EXPECT_EQ(s.sample(logits, 4), 1);
}

TEST(Sampler, SameSeedSameTokens) {
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 0;
  p.top_p = 1.f;
  p.min_p = 0.f;
  p.seed = 42;
  std::vector<float> logits(100);
  for (int i = 0; i < 100; ++i) logits[size_t(i)] = std::sin(float(i));
  Sampler a(p), b(p);
  std::vector<int32_t> xa, xb;
  for (int i = 0; i < 50; ++i) {
    xa.push_back(a.sample(logits.data(), 100));
    xb.push_back(b.sample(logits.data(), 100));
  }
  EXPECT_EQ(xa, xb);
  EXPECT_GT(std::set<int32_t>(xa.begin(), xa.end()).size(), 3u);
}

std::set<int32_t> support(SamplingParams p, const std::vector<float>& logits, int draws = 2000) {
  Sampler s(p);
  std::set<int32_t> seen;
  for (int i = 0; i < draws; ++i) seen.insert(s.sample(logits.data(), int64_t(logits.size())));
  return seen;
}

TEST(Sampler, TopKTopPMinPRestrictTheSupport) {
  // probabilities at temperature 1: softmax of log-probs [0.5, 0.25, 0.15, 0.07, 0.03]
  std::vector<float> logits = {std::log(0.5f), std::log(0.25f), std::log(0.15f), std::log(0.07f), std::log(0.03f)};
  SamplingParams base;
  base.temperature = 1.f;
  base.top_k = 0;
  base.top_p = 1.f;
  base.min_p = 0.f;
  EXPECT_EQ(support(base, logits).size(), 5u);
  SamplingParams k = base;
  k.top_k = 2;
  EXPECT_EQ(support(k, logits), (std::set<int32_t>{0, 1}));
  SamplingParams tp = base;
  tp.top_p = 0.8f;  // 0.5 + 0.25 < 0.8 <= 0.9
  EXPECT_EQ(support(tp, logits), (std::set<int32_t>{0, 1, 2}));
  SamplingParams mp = base;
  mp.min_p = 0.2f;  // keep p >= 0.1
  EXPECT_EQ(support(mp, logits), (std::set<int32_t>{0, 1, 2}));
}

// The distribution the sampler should draw from, computed here independently in double:
// softmax(logits / T), keep the top k, keep the smallest head whose mass reaches top_p, keep
// those with p >= min_p * max(p), renormalize.
std::vector<double> expected_distribution(const std::vector<float>& logits, const SamplingParams& p) {
  const size_t n = logits.size();
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
  if (p.top_k > 0 && size_t(p.top_k) < n) order.resize(size_t(p.top_k));
  std::vector<double> q(order.size());
  double sum = 0;
  for (size_t i = 0; i < order.size(); ++i) sum += q[i] = std::exp(double(logits[order[i]]) / p.temperature);
  for (auto& v : q) v /= sum;
  size_t keep = q.size();
  if (p.top_p < 1.f) {
    double cum = 0;
    for (keep = 0; keep < q.size();) {
      cum += q[keep++];
      if (cum >= double(p.top_p) - 1e-12) break;
    }
  }
  size_t kept_min = 1;
  while (kept_min < keep && q[kept_min] >= double(p.min_p) * q[0]) ++kept_min;
  keep = p.min_p > 0.f ? kept_min : keep;
  std::vector<double> out(n, 0.0);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += q[i];
  for (size_t i = 0; i < keep; ++i) out[order[i]] = q[i] / total;
  return out;
}

// Draws many tokens with one seed and checks every token's frequency against the exact
// probability, within 5 binomial standard deviations (a wrong temperature, a filter applied
// in the wrong order or renormalized wrongly moves some frequency by far more); tokens the
// filters remove must never appear.
void expect_draws_follow(const std::vector<float>& logits, const SamplingParams& p, const std::string& label) {
  constexpr int kDraws = 200000;
  const std::vector<double> want = expected_distribution(logits, p);
  Sampler s(p);
  std::vector<int> count(logits.size(), 0);
  for (int i = 0; i < kDraws; ++i) ++count[size_t(s.sample(logits.data(), int64_t(logits.size())))];
  for (size_t t = 0; t < logits.size(); ++t) {
    const double f = double(count[t]) / kDraws, pt = want[t];
    if (pt == 0) {
      EXPECT_EQ(count[t], 0) << label << ": token " << t << " is filtered out but was drawn";
      continue;
    }
    const double sigma = std::sqrt(pt * (1 - pt) / kDraws);
    EXPECT_NEAR(f, pt, 5 * sigma + 1e-9) << label << ": token " << t;
  }
}

TEST(Sampler, DrawsFollowTheExactFilteredDistribution) {
  const std::vector<float> logits = {2.0f, 1.5f, 1.2f, 0.3f, 0.0f, -0.4f, -1.0f, -2.5f};
  SamplingParams base;
  base.top_k = 0, base.top_p = 1.f, base.min_p = 0.f, base.seed = 7;
  for (float t : {0.5f, 1.0f, 2.0f}) {
    SamplingParams p = base;
    p.temperature = t;
    expect_draws_follow(logits, p, "temperature " + std::to_string(t));
  }
  SamplingParams k = base;
  k.temperature = 1.0f, k.top_k = 3;
  expect_draws_follow(logits, k, "top-k 3");
  SamplingParams tp = base;
  tp.temperature = 1.0f, tp.top_p = 0.7f;
  expect_draws_follow(logits, tp, "top-p 0.7");
  SamplingParams mp = base;
  mp.temperature = 1.0f, mp.min_p = 0.2f;
  expect_draws_follow(logits, mp, "min-p 0.2");
  SamplingParams all = base;
  all.temperature = 1.5f, all.top_k = 6, all.top_p = 0.9f, all.min_p = 0.1f, all.seed = 99;
  expect_draws_follow(logits, all, "T 1.5, top-k 6, top-p 0.9, min-p 0.1");
}

// The order: temperature first, then the filters. p = [0.5, 0.3, 0.2] at T = 1; at T = 0.5
// they sharpen to [0.658, 0.237, 0.105], so top-p 0.6 keeps token 0 alone (applied before
// the temperature it would keep 0 and 1). top-k before top-p: with k = 2 the survivors
// renormalize to [0.625, 0.375], so top-p 0.6 keeps only token 0 (after top-p, k would not
// matter).
TEST(Sampler, TemperatureThenTopKThenTopPThenMinP) {
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  SamplingParams p;
  p.top_k = 0, p.min_p = 0.f, p.temperature = 0.5f, p.top_p = 0.6f;
  EXPECT_EQ(support(p, logits), (std::set<int32_t>{0}));
  p.temperature = 1.f;
  EXPECT_EQ(support(p, logits), (std::set<int32_t>{0, 1}));
  p.top_k = 2;
  p.top_p = 0.6f;
  EXPECT_EQ(support(p, logits), (std::set<int32_t>{0}));
  // min-p after top-p: relative to the largest survivor, which top-p never removes.
  p.top_k = 0, p.top_p = 0.85f, p.min_p = 0.5f;  // top-p keeps {0, 1}; min-p keeps p >= 0.25
  EXPECT_EQ(support(p, logits), (std::set<int32_t>{0, 1}));
}

TEST(Sampler, RejectsNaNLogitsAndBadParams) {
  SamplingParams p;
  Sampler s(p);
  float logits[] = {0.f, std::nanf(""), 1.f};
  EXPECT_THROW(s.sample(logits, 3), Error);
  SamplingParams bad;
  bad.top_p = 0.f;
  EXPECT_THROW(Sampler{bad}, Error);
  bad = SamplingParams{};
  bad.temperature = -1.f;
  EXPECT_THROW(Sampler{bad}, Error);
}

// NaN compares false with everything: each parameter's check must refuse it (and infinity,
// and absurd values), naming the flag.
TEST(Sampler, RefusesNonFiniteAndAbsurdParamsByName) {
  const float nan = std::nanf(""), inf = INFINITY;
  auto refused = [](SamplingParams p, const std::string& flag) {
    try {
      Sampler s(p);
    } catch (const Error& e) {
      return std::string(e.what()).find(flag) != std::string::npos;
    }
    return false;
  };
  for (float v : {nan, inf, -inf, -1.f, 1000.f}) {
    SamplingParams p;
    p.temperature = v;
    EXPECT_TRUE(refused(p, "--temperature")) << v;
  }
  for (float v : {nan, inf, -inf, 0.f, 1.5f}) {
    SamplingParams p;
    p.top_p = v;
    EXPECT_TRUE(refused(p, "--top-p")) << v;
  }
  for (float v : {nan, inf, -inf, -0.1f, 1.f}) {
    SamplingParams p;
    p.min_p = v;
    EXPECT_TRUE(refused(p, "--min-p")) << v;
  }
  SamplingParams k;
  k.top_k = -3;
  EXPECT_TRUE(refused(k, "--top-k"));
  SamplingParams ok;
  ok.temperature = 0.f;
  EXPECT_FALSE(refused(ok, "--temperature"));
}

}  // namespace
}  // namespace turbospark
