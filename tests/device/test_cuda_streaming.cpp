// Expert streaming's device tier (backends/cuda/expert_slots.h): routed experts kept in host
// memory and streamed through caches from top_k slots (every layer evicts, and prompts that
// name more experts than slots run in passes) up to every expert, on each MoE family and
// format, must give the logits of the resident CUDA run at every chunk size, cold and warm.
//
// Tolerance: the same kernels read the same bytes, except that resident Q4_0 is repacked into
// planes at upload while slots keep ggml's blocks (the same values, another load order), and a
// prompt split into passes sums the passes' outputs in another order: 1e-4 of the largest logit.
#include <gtest/gtest.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <ostream>
#include <string>
#include <vector>

#include "engine/session.h"
#include "golden/golden.h"
#include "models/registry.h"
#include "test_util.h"

namespace turbospark {
namespace {

using testing::fixture;
using testing::max_rel_error;

constexpr double kStreamTol = 1e-4;

struct StreamCase {
  std::string fixture;
  std::string file;  // a GGUF inside the fixture, or empty for the safetensors checkpoint
};

void PrintTo(const StreamCase& c, std::ostream* os) { *os << c.fixture << (c.file.empty() ? "" : "/" + c.file); }

std::string model_path(const StreamCase& c) { return c.file.empty() ? fixture(c.fixture) : fixture(c.fixture) + "/" + c.file; }

class CudaExpertStreaming : public ::testing::TestWithParam<StreamCase> {};

TEST_P(CudaExpertStreaming, LogitsEqualResidentAtEverySlotCount) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  const StreamCase& c = GetParam();
  const std::string path = model_path(c);
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  const std::vector<int32_t> tokens = testing::load_golden(c.fixture).tokens;
  const std::vector<int64_t> chunks = {0, 1, 5};

  auto resident_backend = make_cuda_backend(0);
  LoadedModel resident = load_model(path, *resident_backend);
  const int k = resident.model->experts_per_token();
  const int64_t E = resident.model->n_experts();
  ASSERT_GT(k, 0);
  std::vector<std::vector<float>> want;
  for (int64_t chunk : chunks) {
    Session s(*resident.model, *resident_backend);
    want.push_back(s.feed(tokens, chunk, true));
  }
  const EvictionPolicy policies[] = {EvictionPolicy::kLru, EvictionPolicy::kLfu, EvictionPolicy::kFrequencyLru};
  // TURBOSPARK_CUDA_EXPERT_POOL_GB: unset (every layer pooled), 0 (staging only), and ~100 KB
  // (the first layers' experts pooled, the rest through staging).
  const char* pools[] = {nullptr, "0", "0.0001"};
  int round = 0;
  // Up to every expert of every MoE layer (the last: nothing is evicted, warm runs only hit).
  const int64_t every = E * int64_t(resident.model->first_expert_of_each_layer().size());
  for (int64_t slots : {int64_t(k), int64_t(k) + 1, 2 * int64_t(k), 3 * int64_t(k), E, every}) {
    if (slots > E && slots != int64_t(k) && slots != every) continue;
    const EvictionPolicy policy = policies[round % 3];
    const char* pool = pools[(round + 1) % 3];
    ++round;
    SCOPED_TRACE(c.fixture + " " + c.file + " slots " + std::to_string(slots) + " of " + std::to_string(E) + " " +
                 std::string(eviction_policy_name(policy)) + " pool " + (pool ? pool : "default"));
    if (pool) {
      setenv("TURBOSPARK_CUDA_EXPERT_POOL_GB", pool, 1);
    } else {
      unsetenv("TURBOSPARK_CUDA_EXPERT_POOL_GB");
    }
    auto be = make_cuda_backend(0);
    be->keep_experts_on_host();
    LoadedModel streamed = load_model(path, *be);
    be->set_expert_cache(slots, k, policy, streamed.model->first_expert_of_each_layer());
    for (size_t i = 0; i < chunks.size(); ++i) {
      // Twice: the first run starts cold, the second meets what the first left in the slots.
      for (int pass = 0; pass < 2; ++pass) {
        Session s(*streamed.model, *be);
        const std::vector<float> got = s.feed(tokens, chunks[i], true);
        ASSERT_EQ(got.size(), want[i].size());
        EXPECT_LT(max_rel_error(got.data(), want[i].data(), got.size()), kStreamTol)
            << "chunk " << chunks[i] << (pass ? " (warm)" : " (cold)");
      }
    }
    // The cache really ran: loads on the cold passes ("(h of n)"); when every expert fits, each
    // warm run hits on every expert it asks for, so at least half of all asks hit (fewer slots
    // may hit nothing: with top_k slots every layer evicts the one before).
    const std::string summary = be->expert_cache_summary();
    long long hits = -1, asked = -1;
    const size_t at = summary.find("% (");
    ASSERT_NE(at, std::string::npos) << summary;
    ASSERT_EQ(std::sscanf(summary.c_str() + at, "%% (%lld of %lld)", &hits, &asked), 2) << summary;
    if (slots == every) EXPECT_GE(2 * hits, asked) << summary;
    EXPECT_GT(asked, hits) << summary;
    // Where the loads came from: all from the pool by default, none without one.
    const size_t pooled_at = summary.find("pinned pool ");
    ASSERT_NE(pooled_at, std::string::npos) << summary;
    double pool_gib = -1, pooled_pct = -1;
    ASSERT_EQ(std::sscanf(summary.c_str() + pooled_at, "pinned pool %lf GiB (%lf%%", &pool_gib, &pooled_pct), 2) << summary;
    if (!pool) EXPECT_EQ(pooled_pct, 100.0) << summary;
    if (pool && std::string(pool) == "0") EXPECT_EQ(pooled_pct, 0.0) << summary;
    std::printf("[ measured ] %s slots %lld: %s\n", c.fixture.c_str(), static_cast<long long>(slots), summary.c_str());
  }
  unsetenv("TURBOSPARK_CUDA_EXPERT_POOL_GB");
}

INSTANTIATE_TEST_SUITE_P(
    Families, CudaExpertStreaming,
    ::testing::Values(StreamCase{"qwen3_moe_tiny", ""}, StreamCase{"qwen3_moe_norenorm_tiny", ""},
                      StreamCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q4_0.gguf"},
                      StreamCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-bf16.gguf"},
                      StreamCase{"gpt_oss_tiny", ""}, StreamCase{"gpt_oss_mxfp4_tiny", ""},
                      StreamCase{"gemma4_moe_tiny", ""}, StreamCase{"qwen4_exp_tiny", ""}),
    [](const ::testing::TestParamInfo<StreamCase>& info) {
      return testing::param_name(info.param.fixture, info.param.file);
    });

// Banks (expert_slots.h): a prompt micro-batch's pooled loads go bank by bank on the copy
// stream and each bank's grouped projections wait only for its experts. The kernels compute
// what one launch over every expert computes, so the logits equal the one-bank run's bit for
// bit at any bank count, on both grouped kernels (tiles, and few rows per expert), cold and
// warm; the summary says the banks ran.
TEST(CudaExpertStreamingBanks, LogitsEqualOneBankBitForBit) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  for (const StreamCase& c : {StreamCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q4_0.gguf"},
                              StreamCase{"qwen3_moe_tiny", ""}, StreamCase{"gpt_oss_mxfp4_tiny", ""},
                              StreamCase{"qwen4_exp_tiny", ""}}) {
    const std::string path = model_path(c);
    const std::vector<int32_t> tokens = testing::load_golden(c.fixture).tokens;
    for (const char* small : {"0", "1"}) {
      setenv("TURBOSPARK_CUDA_MOE_SMALL", small, 1);
      std::vector<float> one_bank;
      for (const char* banks : {"1", "2", "3", "8"}) {
        SCOPED_TRACE(c.fixture + " " + c.file + " small kernel " + small + " banks " + banks);
        setenv("TURBOSPARK_CUDA_EXPERT_BANKS", banks, 1);
        auto be = make_cuda_backend(0);
        be->keep_experts_on_host();
        LoadedModel m = load_model(path, *be);
        // Every expert of a layer fits, and layers evict each other: every prompt layer misses.
        be->set_expert_cache(m.model->n_experts(), m.model->experts_per_token(), EvictionPolicy::kLru,
                             m.model->first_expert_of_each_layer());
        for (int run = 0; run < 2; ++run) {
          Session s(*m.model, *be);
          const std::vector<float> got = s.feed(tokens, 0, true);
          if (one_bank.empty()) one_bank = got;
          ASSERT_EQ(got.size(), one_bank.size());
          size_t differ = 0;
          for (size_t i = 0; i < got.size(); ++i) differ += std::memcmp(&got[i], &one_bank[i], sizeof(float)) != 0;
          EXPECT_EQ(differ, 0u) << "run " << run << ": logits differ from one bank's";
        }
        const std::string summary = be->expert_cache_summary();
        const bool banked = summary.find("banks each under their compute") != std::string::npos;
        EXPECT_EQ(banked, std::string(banks) != "1") << summary;
        std::printf("[ measured ] %s banks %s small %s: %s\n", c.fixture.c_str(), banks, small, summary.c_str());
      }
    }
  }
  unsetenv("TURBOSPARK_CUDA_MOE_SMALL");
  unsetenv("TURBOSPARK_CUDA_EXPERT_BANKS");
}

// TURBOSPARK_CUDA_EXPERT_HOST_COMPUTE=1: decode-sized micro-batches run the experts the slots
// hold on the GPU and the rest on the host's cores (moe_split). Logits stay the resident run's
// within what the CPU's kernels differ by (f32 for bf16 experts, the same int8 rounding for Q4_0:
// CudaMoe.MatchesCpuBackend); gpt-oss's MXFP4 is left out (the CPU rounds its activations to
// int8, CUDA does not). Chunks of 1 and 5 rows are all decode-sized; prefill of 40 rows first
// fills the slots that the decode rows then find.
TEST(CudaExpertStreamingHost, DecodeMissesComputedOnTheHostEqualResident) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  for (const StreamCase& c : {StreamCase{"qwen3_moe_tiny", ""}, StreamCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q4_0.gguf"},
                              StreamCase{"gpt_oss_tiny", ""}, StreamCase{"gemma4_moe_tiny", ""}, StreamCase{"qwen4_exp_tiny", ""}}) {
    SCOPED_TRACE(c.fixture + " " + c.file);
    const std::string path = model_path(c);
    const std::vector<int32_t> tokens = testing::load_golden(c.fixture).tokens;
    unsetenv("TURBOSPARK_CUDA_EXPERT_HOST_COMPUTE");
    auto resident_backend = make_cuda_backend(0);
    LoadedModel resident = load_model(path, *resident_backend);
    const int k = resident.model->experts_per_token();
    const int64_t E = resident.model->n_experts();
    setenv("TURBOSPARK_CUDA_EXPERT_HOST_COMPUTE", "1", 1);
    // Every miss on the host (0), every miss over the link that the slots allow (1), balanced.
    for (const char* share : {"0", "1", "auto"})
    for (int64_t slots : {int64_t(k), std::max<int64_t>(k, E / 2)}) {
      SCOPED_TRACE(std::string("link share ") + share);
      setenv("TURBOSPARK_CUDA_EXPERT_LINK_SHARE", share, 1);
      auto be = make_cuda_backend(0);
      be->keep_experts_on_host();
      LoadedModel streamed = load_model(path, *be);
      be->set_expert_cache(slots, k, EvictionPolicy::kLru, streamed.model->first_expert_of_each_layer());
      for (int64_t chunk : {int64_t(0), int64_t(1), int64_t(5)}) {
        Session want_s(*resident.model, *resident_backend);
        const std::vector<float> want = want_s.feed(tokens, chunk, true);
        Session s(*streamed.model, *be);
        // A prefill (40 rows: streamed through the slots) first, so decode finds some held.
        (void)s.feed(tokens, 0, false);
        s.reset();
        const std::vector<float> got = s.feed(tokens, chunk, true);
        EXPECT_LT(max_rel_error(got.data(), want.data(), got.size()), 2e-3) << "slots " << slots << " chunk " << chunk;
      }
      const std::string summary = be->expert_cache_summary();
      EXPECT_NE(summary.find("on the host"), std::string::npos) << summary;
      // Share 0 loads nothing while decoding; share 1 computes on the host only what the slots
      // could not take.
      if (std::string(share) == "0") EXPECT_NE(summary.find(" 0 loaded over the link"), std::string::npos) << summary;
      std::printf("[ measured ] %s host compute, link share %s, slots %lld: %s\n", c.fixture.c_str(), share,
                  static_cast<long long>(slots), summary.c_str());
    }
    unsetenv("TURBOSPARK_CUDA_EXPERT_HOST_COMPUTE");
    unsetenv("TURBOSPARK_CUDA_EXPERT_LINK_SHARE");
  }
}

// Fewer slots than a token's experts are refused by name (the cache's own rule), and so is a
// cache the device cannot hold.
TEST(CudaExpertStreamingRefusals, FewerSlotsThanTopK) {
  if (!cuda_available()) GTEST_SKIP() << "no CUDA device";
  auto be = make_cuda_backend(0);
  be->keep_experts_on_host();
  LoadedModel m = load_model(fixture("qwen3_moe_tiny"), *be);
  EXPECT_THROW(be->set_expert_cache(m.model->experts_per_token() - 1, m.model->experts_per_token(), EvictionPolicy::kLru,
                                    m.model->first_expert_of_each_layer()),
               Error);
  // A link share outside [0, 1] (or not a number) is refused by name.
  for (const char* bad : {"1.5", "-0.1", "half", ""}) {
    setenv("TURBOSPARK_CUDA_EXPERT_LINK_SHARE", bad, 1);
    try {
      be->set_expert_cache(m.model->experts_per_token(), m.model->experts_per_token(), EvictionPolicy::kLru,
                           m.model->first_expert_of_each_layer());
      ADD_FAILURE() << "link share '" << bad << "' was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("TURBOSPARK_CUDA_EXPERT_LINK_SHARE"), std::string::npos) << e.what();
    }
  }
  unsetenv("TURBOSPARK_CUDA_EXPERT_LINK_SHARE");
  // So is a bank count outside 1..64.
  for (const char* bad : {"0", "65", "many"}) {
    setenv("TURBOSPARK_CUDA_EXPERT_BANKS", bad, 1);
    try {
      be->set_expert_cache(m.model->experts_per_token(), m.model->experts_per_token(), EvictionPolicy::kLru,
                           m.model->first_expert_of_each_layer());
      ADD_FAILURE() << "bank count '" << bad << "' was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("TURBOSPARK_CUDA_EXPERT_BANKS"), std::string::npos) << e.what();
    }
  }
  unsetenv("TURBOSPARK_CUDA_EXPERT_BANKS");
  // A cache larger than the device: refused by name before anything runs.
  try {
    be->set_expert_cache(int64_t(1) << 40, m.model->experts_per_token(), EvictionPolicy::kLru,
                         m.model->first_expert_of_each_layer());
    ADD_FAILURE() << "a cache of 2^40 slots was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace turbospark
