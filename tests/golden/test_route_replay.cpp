// CpuPrecision::route_replay on whole models: the device tests hand the CPU reference CUDA's
// routing (its router probabilities), so the replay must map each router call to the right
// MoE layer and rows at every chunk size. Replaying a run's own routing changes no logit; one
// row's experts changed in one layer changes the logits from that row on and none before it,
// and is counted as one flip with the CPU's margin there.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <string>
#include <vector>

#include "engine/session.h"
#include "golden/golden.h"
#include "models/registry.h"
#include "ops/backend.h"
#include "test_util.h"

namespace turbospark {
namespace {

struct ReplayRun {
  std::vector<float> logits, probs;
};

ReplayRun run(const std::string& fixture, const std::vector<int32_t>& tokens, int64_t chunk,
        std::shared_ptr<RouteReplay> replay) {
  CpuPrecision p = CpuPrecision::like_cuda();
  p.route_replay = std::move(replay);
  auto be = make_cpu_backend(2, p);
  LoadedModel m = load_model(testing::fixture(fixture), *be);
  Session s(*m.model, *be);
  ReplayRun r;
  r.logits = s.feed(tokens, chunk, /*all_logits=*/true, &r.probs);
  return r;
}

class RouteReplayModels : public ::testing::TestWithParam<std::string> {};

TEST_P(RouteReplayModels, OwnRoutingChangesNothingAndOneChangedRowChangesOnlyWhatFollows) {
  const std::vector<int32_t> tokens = testing::load_golden(GetParam()).tokens;
  const int64_t T = int64_t(tokens.size());
  auto be = make_cpu_backend(1);
  LoadedModel shape = load_model(testing::fixture(GetParam()), *be);
  const int64_t layers = shape.model->info().n_layers, n = shape.model->n_experts(),
                vocab = shape.model->info().vocab_size;
  const int k = shape.model->experts_per_token();
  ASSERT_GT(n, 0);
  for (int64_t chunk : {int64_t(0), int64_t(1), int64_t(5)}) {
    const ReplayRun own = run(GetParam(), tokens, chunk, nullptr);
    auto same = route_replay_from_probs(own.probs, layers, T, n, k);
    const ReplayRun replayed = run(GetParam(), tokens, chunk, same);
    EXPECT_EQ(replayed.logits, own.logits) << "chunk " << chunk;
    EXPECT_EQ(same->flips, 0);
    for (size_t l = 0; l < same->layers.size(); ++l) EXPECT_EQ(same->cursor[l], T) << "MoE layer " << l;

    // Row `at` of the last MoE layer takes its (k+1)-th expert instead of its k-th.
    auto changed = route_replay_from_probs(own.probs, layers, T, n, k);
    const int64_t at = T / 2;
    int64_t last = layers - 1;
    while (std::all_of(own.probs.begin() + last * T * n, own.probs.begin() + (last + 1) * T * n,
                       [](float p) { return p == 0.f; }))
      --last;
    const float* p = own.probs.data() + (last * T + at) * n;
    std::vector<int32_t> order(static_cast<size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return p[a] > p[b]; });
    changed->layers.back()[size_t(at * k + k - 1)] = order[size_t(k)];
    const ReplayRun other = run(GetParam(), tokens, chunk, changed);
    EXPECT_EQ(changed->flips, 1) << "chunk " << chunk;
    EXPECT_NEAR(changed->widest_flip_margin, (p[order[size_t(k - 1)]] - p[order[size_t(k)]]) / p[order[0]], 1e-5);
    EXPECT_TRUE(std::equal(other.logits.begin(), other.logits.begin() + at * vocab, own.logits.begin()))
        << "rows before the changed one are untouched";
    EXPECT_FALSE(std::equal(other.logits.begin() + at * vocab, other.logits.begin() + (at + 1) * vocab,
                            own.logits.begin() + at * vocab))
        << "the changed row's logits move";
  }
}

// Three routers: softmax then top-k renormalized (Qwen3-MoE), top-k of logits then softmax
// (gpt-oss), and per-expert scales (Gemma 4).
INSTANTIATE_TEST_SUITE_P(Fixtures, RouteReplayModels, ::testing::Values("qwen3_moe_tiny", "gpt_oss_tiny", "gemma4_moe_tiny"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace turbospark
