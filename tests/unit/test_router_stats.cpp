// RouterStats (engine/router_stats.h): the histogram counts each token's top-k experts the way
// the backends route (largest probability, lower index on ties), skips dense layers' zero rows
// and NaN rows, and its summary measures tell a flat histogram from a skewed one.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "engine/router_stats.h"
#include "test_util.h"

namespace turbospark {
namespace {

TEST(RouterStats, CountsTopKWithTiesToTheLowerIndexAndSkipsDenseAndNanRows) {
  // 3 layers x 4 tokens x 5 experts, top-2. Layer 1 is dense (zero rows).
  const int L = 3, T = 4, E = 5;
  std::vector<float> p(size_t(L * T * E), 0.f);
  auto row = [&](int l, int t) { return p.data() + (l * T + t) * E; };
  const float rows0[T][E] = {{0.1f, 0.5f, 0.2f, 0.1f, 0.1f},   // picks 1, 2
                             {0.3f, 0.3f, 0.3f, 0.05f, 0.05f},  // ties: 0, 1
                             {0.f, 0.f, 0.f, 0.5f, 0.5f},       // 3, 4
                             {0.2f, 0.2f, 0.2f, 0.2f, 0.2f}};   // all tied: 0, 1
  for (int t = 0; t < T; ++t)
    for (int e = 0; e < E; ++e) row(0, t)[e] = rows0[t][e];
  for (int t = 0; t < T; ++t) row(2, t)[4] = 0.9f, row(2, t)[2] = 0.1f;
  row(2, 3)[0] = std::nanf("");  // a NaN row is not counted
  RouterStats s(L, E, 2);
  s.add(p, T);
  const int64_t want0[E] = {2, 3, 1, 1, 1};
  for (int e = 0; e < E; ++e) EXPECT_EQ(s.count(0, e), want0[e]) << "expert " << e;
  for (int e = 0; e < E; ++e) EXPECT_EQ(s.count(1, e), 0);
  EXPECT_EQ(s.count(2, 4), 3);
  EXPECT_EQ(s.count(2, 2), 3);
  EXPECT_EQ(s.routed_tokens(0), 4);
  EXPECT_EQ(s.routed_tokens(1), 0);
  EXPECT_EQ(s.routed_tokens(2), 3);
  EXPECT_EQ(s.moe_layers(), 2);
  // Layer 0: 5 of 5 experts picked, top share 3/8, half of 8 routings by 2 experts (3 + 2);
  // layer 2: 2 picked, top share 3/6, half by 1.
  EXPECT_DOUBLE_EQ(s.mean_distinct(), (5 + 2) / 2.0);
  EXPECT_DOUBLE_EQ(s.mean_top_share(), (3.0 / 8 + 3.0 / 6) / 2);
  EXPECT_DOUBLE_EQ(s.mean_experts_for_half(), (2 + 1) / 2.0);
  // A second call accumulates.
  s.add(p, T);
  EXPECT_EQ(s.count(0, 1), 6);

  testing::TempDir tmp;
  const std::string csv = tmp.str() + "/r.csv";
  s.write_csv(csv);
  std::ifstream in(csv);
  std::string line;
  std::getline(in, line);
  EXPECT_EQ(line, "layer,expert,count,share");
  int rows = 0;
  while (std::getline(in, line)) {
    ++rows;
    EXPECT_NE(line.rfind("1,", 0), 0u) << "the dense layer has no rows: " << line;
  }
  EXPECT_EQ(rows, 2 * E);
  EXPECT_NE(s.summary().find("over 2 MoE layers of 5 experts (top-2)"), std::string::npos) << s.summary();
}

TEST(RouterStats, RefusesMismatchedShapes) {
  EXPECT_THROW(RouterStats(2, 4, 5), Error);
  RouterStats s(2, 4, 2);
  std::vector<float> p(10, 0.f);
  EXPECT_THROW(s.add(p, 2), Error);
  EXPECT_THROW(s.write_csv("/nonexistent/dir/r.csv"), Error);
}

}  // namespace
}  // namespace turbospark
