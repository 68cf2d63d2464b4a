// Long prompts against transformers 5.17 (tools/fixtures/make_long_goldens.py): a 160-token
// prompt per random fixture, past two micro-batch boundaries at the default
// kMaxPrefillBatch (64), ten at max_prefill_batch 16, and past 128. The 40-token goldens
// never leave the first micro-batch, so state carried across micro-batches (KV pages,
// sliding windows, GatedDeltaNet and conv state, n-gram context across EOS segments, QSA
// block keys) is only checked here. Logits at every position at several chunk sizes, and the
// 24-token greedy continuation of the whole prompt (for the tied-embedding fixtures, whose
// plain greedy path is one repeated token, greedy without repeats: see continuation()).
//
// Every fixture listed below must have long_golden.json and long_logits.npy: a missing file
// fails (generate them with the script above on a machine with transformers).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "core/npy.h"
#include "engine/generate.h"
#include "engine/sampler.h"
#include "engine/session.h"
#include "golden/golden.h"
#include "test_util.h"

namespace turbospark {
namespace {

using testing::fixture;
using testing::max_rel_error;

// bf16 (or exactly dequantized MXFP4) weights, float32 activations on both sides: the
// differences are summation order only. The shared golden tests' bound for every family
// (GoldenFamily in test_golden_families.cpp); MXFP4 runs in exact float arithmetic
// (GoldenTest holds Mxfp4Activations(false)).
constexpr double kLogitTol = 2e-4;
constexpr int64_t kLongPromptLen = 160;
constexpr int64_t kGreedyNew = 24;

struct LongGolden {
  std::vector<int32_t> tokens, greedy;
  NpyArray logits;  // [T, vocab]
  nlohmann::json json;
};

class LongPrompt : public testing::GoldenTest {
 protected:
  void SetUp() override {
    const std::string dir = fixture(GetParam());
    for (const char* f : {"/long_golden.json", "/long_logits.npy"}) {
      ASSERT_TRUE(std::filesystem::exists(dir + f))
          << GetParam() << f << " is missing: generate it with `CUDA_VISIBLE_DEVICES= python3 "
          << "tools/fixtures/make_long_goldens.py --only " << GetParam()
          << "` on a machine with transformers 5.17 and torch 2.11 (the device machine)";
    }
    testing::GoldenTest::SetUp();
    long_.json = testing::read_json(dir + "/long_golden.json");
    long_.tokens = long_.json["tokens"].get<std::vector<int32_t>>();
    long_.greedy = long_.json["greedy"].get<std::vector<int32_t>>();
    long_.logits = read_npy_f32(dir + "/long_logits.npy");
  }

  // The session options every run uses: the prompt plus its continuation must fit (gpt-oss's
  // YaRN fixture declares max_position_embeddings 128, as transformers, which does not
  // enforce it, ran past).
  SessionOptions options(int64_t max_batch) const {
    SessionOptions so;
    so.max_prefill_batch = max_batch;
    so.max_context = std::max<int64_t>(model().info().max_context, int64_t(long_.tokens.size()) + kGreedyNew);
    return so;
  }

  // Per micro-batch-sized row range [r, r + 64), the error: where a mismatch starts.
  std::string error_by_rows(const std::vector<float>& logits) const {
    const int64_t V = vocab(), T = int64_t(long_.tokens.size());
    std::ostringstream os;
    for (int64_t r = 0; r < T; r += kMaxPrefillBatch) {
      const int64_t n = std::min(kMaxPrefillBatch, T - r);
      os << " rows " << r << ".." << r + n - 1 << ": "
         << max_rel_error(&logits[size_t(r * V)], &long_.logits.data[size_t(r * V)], size_t(n * V)) << ";";
    }
    return os.str();
  }

  LongGolden long_;
};

TEST_P(LongPrompt, GoldenIsLongAndItsContinuationIsNotDegenerate) {
  EXPECT_EQ(int64_t(long_.tokens.size()), kLongPromptLen);
  EXPECT_GT(int64_t(long_.tokens.size()), 2 * kMaxPrefillBatch);
  EXPECT_EQ(long_.logits.shape, (std::vector<int64_t>{int64_t(long_.tokens.size()), vocab()}));
  EXPECT_TRUE(testing::all_finite(long_.logits.data.data(), long_.logits.data.size()));
  EXPECT_EQ(int64_t(long_.greedy.size()), kGreedyNew);
  EXPECT_GE(std::set<int32_t>(long_.greedy.begin(), long_.greedy.end()).size(), 3u);
  // The script's check that the checkpoint loaded as recorded: the first tokens are the
  // short golden's, and so are their logits.
  const size_t prefix = golden_.tokens.size();
  ASSERT_LE(prefix, long_.tokens.size());
  EXPECT_TRUE(std::equal(golden_.tokens.begin(), golden_.tokens.end(), long_.tokens.begin()));
  EXPECT_LT(max_rel_error(long_.logits.data.data(), golden_.logits.data.data(), golden_.logits.data.size()), 1e-4);
}

TEST_P(LongPrompt, LogitsMatchTransformersAtEveryChunkSize) {
  const int64_t T = int64_t(long_.tokens.size());
  ASSERT_EQ(long_.logits.shape, (std::vector<int64_t>{T, vocab()}));
  // max batch 64: the CPU's micro-batch (the whole prompt is 3 of them); 16: ten, and the
  // chunk sizes land on, inside and across their boundaries; 2048: the CUDA backend's, the
  // whole prompt in one forward. chunk 0 = the whole prompt.
  for (int64_t max_batch : {kMaxPrefillBatch, int64_t(16), int64_t(2048)}) {
    for (int64_t chunk : {int64_t(0), int64_t(1), int64_t(5), kMaxPrefillBatch, int64_t(100), T}) {
      Session s(model(), *backend_, options(max_batch));
      std::vector<float> logits = s.feed(long_.tokens, chunk, /*all_logits=*/true);
      ASSERT_EQ(int64_t(logits.size()), T * vocab());
      const double err = max_rel_error(logits.data(), long_.logits.data.data(), logits.size());
      EXPECT_LT(err, kLogitTol) << GetParam() << " chunk " << chunk << " max batch " << max_batch << ":"
                                << error_by_rows(logits);
    }
  }
}

// max_prefill_batch 0 is the backend's choice (the CPU's 64); a negative one is refused.
TEST_P(LongPrompt, PrefillBatchDefaultsToTheBackendsAndRefusesNegative) {
  EXPECT_EQ(backend_->preferred_prefill_batch(), kMaxPrefillBatch);
  Session s(model(), *backend_, options(0));
  const std::vector<float> logits = s.feed(long_.tokens, 0, /*all_logits=*/true);
  EXPECT_LT(max_rel_error(logits.data(), long_.logits.data.data(), logits.size()), kLogitTol);
  try {
    Session bad(model(), *backend_, options(-3));
    FAIL() << "max_prefill_batch -3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("prefill micro-batch must be >= 1"), std::string::npos) << e.what();
  }
}

// The prompt fed in uneven pieces across calls (the chat path: each turn is a new feed at
// the session's position), last-token logits only.
TEST_P(LongPrompt, PiecewiseFeedsMatchTransformers) {
  const int64_t T = int64_t(long_.tokens.size()), V = vocab();
  Session s(model(), *backend_, options(kMaxPrefillBatch));
  int64_t start = 0;
  for (int64_t piece : {int64_t(63), int64_t(2), int64_t(70), int64_t(1), int64_t(24)}) {
    ASSERT_LE(start + piece, T);
    std::vector<float> last = s.feed(std::span<const int32_t>(&long_.tokens[size_t(start)], size_t(piece)));
    start += piece;
    ASSERT_EQ(int64_t(last.size()), V);
    EXPECT_LT(max_rel_error(last.data(), &long_.logits.data[size_t((start - 1) * V)], size_t(V)), kLogitTol)
        << GetParam() << " after " << start << " tokens";
  }
  EXPECT_EQ(start, T);
}

// The continuation under long_golden.json's greedy_rule. "argmax" is generate() at
// temperature 0. "argmax_no_repeat" (for the tied-embedding fixtures, whose plain greedy path
// is their last token repeated: make_long_goldens.py) is the argmax over the tokens not yet
// in the sequence, prompt included (transformers' no_repeat_ngram_size=1), through the same
// feeds generate() makes: the whole prompt, then one token at a time.
std::vector<int32_t> continuation(Session& s, const std::vector<int32_t>& prompt, int64_t n, const std::string& rule) {
  std::vector<int32_t> out;
  if (rule == "argmax") {
    SamplingParams sp;
    sp.temperature = 0;
    Sampler sampler(sp);
    generate(s, sampler, prompt, n, {}, [&](int32_t tok, bool) {
      out.push_back(tok);
      return true;
    });
    return out;
  }
  if (rule != "argmax_no_repeat") {
    ADD_FAILURE() << "unknown greedy_rule " << rule;
    return out;
  }
  const int64_t V = s.model().info().vocab_size;
  std::vector<char> used(size_t(V), 0);
  for (int32_t t : prompt) used[size_t(t)] = 1;
  std::vector<float> logits = s.feed(prompt);
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(testing::all_finite(logits.data(), logits.size())) << "step " << i;
    int64_t best = -1;
    for (int64_t v = 0; v < V; ++v) {
      if (!used[size_t(v)] && (best < 0 || logits[size_t(v)] > logits[size_t(best)])) best = v;
    }
    out.push_back(int32_t(best));
    used[size_t(best)] = 1;
    if (i + 1 < n) {
      const int32_t one[1] = {int32_t(best)};
      logits = s.feed(one);
    }
  }
  return out;
}

TEST_P(LongPrompt, GreedyContinuationMatchesTransformers) {
  const std::string rule = long_.json.value("greedy_rule", "argmax");
  for (int64_t max_batch : {kMaxPrefillBatch, int64_t(16)}) {
    Session s(model(), *backend_, options(max_batch));
    EXPECT_EQ(continuation(s, long_.tokens, int64_t(long_.greedy.size()), rule), long_.greedy)
        << GetParam() << " rule " << rule << " max batch " << max_batch;
  }
}

// Listed explicitly (not discovered): a fixture whose long golden is missing fails.
INSTANTIATE_TEST_SUITE_P(Dense, LongPrompt,
                         ::testing::Values("qwen3_tiny", "qwen3_moe_tiny", "qwen3_moe_norenorm_tiny", "qwen2_tiny",
                                           "llama_tiny", "gemma3_tiny", "gemma3_p6_tiny"));
INSTANTIATE_TEST_SUITE_P(Qwen4Exp, LongPrompt,
                         ::testing::Values("qwen4_exp_tiny", "qwen4_exp_hc4_tiny", "qwen4_exp_mm_tiny"));
INSTANTIATE_TEST_SUITE_P(GptOss, LongPrompt,
                         ::testing::Values("gpt_oss_tiny", "gpt_oss_mxfp4_tiny", "gpt_oss_yarn_tiny"));
INSTANTIATE_TEST_SUITE_P(Gemma4, LongPrompt,
                         ::testing::Values("gemma4_dense_tiny", "gemma4_moe_tiny", "gemma4_mm_tiny"));

}  // namespace
}  // namespace turbospark
