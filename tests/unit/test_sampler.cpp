#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>

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
