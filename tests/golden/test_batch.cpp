// Continuous batching (engine/batch.h) must not change results: eight sequences fed through
// steps that mix prefill chunks of varying sizes with decode rows of other sequences, the
// sequences admitted at different steps, give each sequence the logits it gets alone (a
// Session) at every position asked for, bit for bit, and the same greedy continuation; the
// fixture's own sequence also matches transformers' golden logits and greedy tokens. Bit
// equality holds because every CPU kernel computes a row the same way whatever shares its
// call (quantized matmuls: backends/cpu/quant_contract.h; attention: fixed position splits
// and blocks, kernels.cpp); with quantized activations any rounding difference upstream
// flips 8-bit steps that grow through the layers (up to 8% of the largest logit on
// gemma-3-270m Q4_K_M before).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "engine/batch.h"
#include "engine/session.h"
#include "golden.h"

namespace turbospark {
namespace {

using testing::max_rel_error;

constexpr int kSeqs = 8;
constexpr int kGreedy = 6;          // tokens each sequence generates after its prompt
constexpr double kGoldenTol = 2e-4; // vs transformers, as the family goldens

int32_t argmax(const float* row, int64_t n) { return int32_t(std::max_element(row, row + n) - row); }

struct Seq {
  std::vector<int32_t> tokens;  // prompt, then (in the batch) what it generated
  size_t prompt = 0;
  int start = 0;                          // the step it is admitted at
  std::vector<std::vector<float>> ref;    // alone: logits after each position
  std::vector<int32_t> ref_tokens;        // alone: prompt + greedy continuation
  size_t fed = 0;
};

struct BatchCase {
  std::string fixture, file;
  // A real model file named by this environment variable instead of the fixture's checkpoint
  // (the fixture still gives the prompts' token ids); skipped when it is not set.
  std::string env = {};
};

void PrintTo(const BatchCase& c, std::ostream* os) {
  *os << c.fixture << (c.file.empty() ? "" : "/" + c.file) << (c.env.empty() ? "" : " $" + c.env);
}

class BatchInvariance : public ::testing::TestWithParam<BatchCase> {};

TEST_P(BatchInvariance, EverySequenceGetsItsAloneLogitsAndTokens) {
  const BatchCase& c = GetParam();
  const char* real = c.env.empty() ? nullptr : std::getenv(c.env.c_str());
  if (!c.env.empty() && !real) GTEST_SKIP() << c.env << " is not set (scripts/test.sh sets it)";
  auto be = make_cpu_backend(2);
  LoadedModel m = load_model(real ? std::string(real) : testing::fixture_model(c.fixture, c.file));
  const Model& model = *m.model;
  const int64_t V = model.info().vocab_size;
  const testing::Golden g = testing::load_golden(c.fixture);

  std::vector<Seq> seqs(kSeqs);
  for (int s = 0; s < kSeqs; ++s) {
    Seq& q = seqs[size_t(s)];
    // Sequence 0 is the golden prompt; the others rotations of the golden tokens, 5 to 40 long.
    q.prompt = s == 0 ? size_t(g.greedy_prompt_len) : size_t(5 + (s * 11) % 36);
    for (size_t i = 0; i < q.prompt; ++i) q.tokens.push_back(g.tokens[(i + size_t(3 * s)) % g.tokens.size()]);
    q.start = (s * 3) % 7;
    Session alone(model, *be);
    std::vector<float> all = alone.feed(q.tokens, 0, true);
    for (size_t p = 0; p < q.prompt; ++p) q.ref.emplace_back(all.begin() + int64_t(p) * V, all.begin() + int64_t(p + 1) * V);
    q.ref_tokens = q.tokens;
    for (int k = 0; k < kGreedy; ++k) {
      const int32_t next = argmax(q.ref.back().data(), V);
      q.ref_tokens.push_back(next);
      if (k + 1 < kGreedy) q.ref.push_back(alone.feed(std::vector<int32_t>{next}));
    }
  }
  // transformers' greedy continuation of the same prompt, as far as both go.
  const bool golden = c.file.empty() && !real;  // the golden is the checkpoint's, not another file's
  for (size_t i = 0; golden && i < std::min<size_t>(kGreedy, g.greedy.size()); ++i)
    ASSERT_EQ(seqs[0].ref_tokens[seqs[0].prompt + i], g.greedy[i]) << "alone, greedy token " << i;

  const BatchOptions o{.n_seqs = kSeqs, .max_context = 128, .max_rows = 16};
  BatchRunner runner(model, *be, o);
  int compared = 0, mixed_steps = 0;
  for (int step = 0; step < 200; ++step) {
    std::vector<BatchRow> rows;
    std::vector<std::pair<int, int64_t>> runs;  // (sequence, rows) in row order
    // Decode rows first, as the server orders them, then prompt chunks while there is room.
    for (int phase = 0; phase < 2; ++phase)
      for (int s = 0; s < kSeqs; ++s) {
        Seq& q = seqs[size_t(s)];
        const size_t total = q.prompt + kGreedy - 1;  // the last generated token is not fed
        if (step < q.start || q.fed >= total || (q.fed >= q.prompt) != (phase == 0)) continue;
        const int64_t room = o.max_rows - int64_t(rows.size());
        if (room <= 0) continue;
        const int64_t n = q.fed >= q.prompt ? 1
                                            : std::min<int64_t>({room, 1 + (step + s) % 7, int64_t(q.prompt - q.fed)});
        ASSERT_TRUE(runner.reserve(s, int64_t(q.fed) + n));
        for (int64_t i = 0; i < n; ++i) rows.push_back({s, q.tokens[q.fed + size_t(i)], int64_t(q.fed) + i, false});
        rows.back().want = true;
        runs.emplace_back(s, n);
      }
    if (rows.empty()) break;
    const bool decode = std::any_of(runs.begin(), runs.end(), [&](auto& r) { return seqs[size_t(r.first)].fed >= seqs[size_t(r.first)].prompt; });
    const bool prefill = std::any_of(runs.begin(), runs.end(), [](auto& r) { return r.second > 1; });
    mixed_steps += decode && prefill && runs.size() >= 3;
    std::vector<float> logits;
    runner.step(rows, &logits, nullptr);
    ASSERT_EQ(logits.size(), runs.size() * size_t(V));
    for (size_t k = 0; k < runs.size(); ++k) {
      Seq& q = seqs[size_t(runs[k].first)];
      q.fed += size_t(runs[k].second);
      const size_t pos = q.fed - 1;
      const float* row = logits.data() + int64_t(k) * V;
      EXPECT_EQ(max_rel_error(row, q.ref[pos].data(), size_t(V)), 0.0)
          << c.fixture << " sequence " << runs[k].first << " position " << pos << " step " << step;
      if (golden && runs[k].first == 0 && pos < q.prompt)
        EXPECT_LT(max_rel_error(row, &g.logits.data[pos * size_t(V)], size_t(V)), kGoldenTol) << "position " << pos;
      ++compared;
      if (pos + 1 >= q.prompt && q.tokens.size() < q.prompt + kGreedy) q.tokens.push_back(argmax(row, V));
    }
  }
  for (int s = 0; s < kSeqs; ++s) {
    const Seq& q = seqs[size_t(s)];
    EXPECT_EQ(q.tokens, q.ref_tokens) << c.fixture << " sequence " << s << ": greedy tokens in the batch";
  }
  EXPECT_GT(mixed_steps, 0) << "no step mixed prefill chunks and decode rows of three sequences";
  EXPECT_GT(compared, kSeqs * kGreedy);
  // Freed sequences give their blocks back.
  for (int s = 0; s < kSeqs; ++s) runner.release(s);
  EXPECT_EQ(runner.kv().free_blocks(), runner.kv().total_blocks());
}

INSTANTIATE_TEST_SUITE_P(Families, BatchInvariance,
                         ::testing::Values(BatchCase{"qwen3_tiny", ""}, BatchCase{"qwen3_moe_tiny", ""},
                                           BatchCase{"llama_tiny", ""}, BatchCase{"gemma3_tiny", ""},
                                           BatchCase{"gpt_oss_tiny", ""}, BatchCase{"gemma4_moe_tiny", ""},
                                           BatchCase{"qwen4_exp_tiny", ""}, BatchCase{"qwen4_exp_hc4_tiny", ""},
                                           // Quantized matmuls take the tiled kernel from 16
                                           // rows and the row kernel below; both follow one
                                           // accumulation contract (quant_contract.h), so a row
                                           // gets the same logits alone or batched.
                                           BatchCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q4_0.gguf"},
                                           // A real Q4_K_M file (Q4_K, Q6_K and Q8_0 matmuls,
                                           // sliding-window attention), where batching used to
                                           // move greedy tokens: 13-15 of 120 served replies
                                           // differed from the same requests alone.
                                           BatchCase{"qwen3_tiny", "", "TS_GEMMA_GGUF"}),
                         [](const ::testing::TestParamInfo<BatchCase>& i) {
                           if (!i.param.env.empty()) return std::string("gemma3_270m_q4_k_m");
                           return i.param.fixture + (i.param.file.empty() ? "" : "_q4_0");
                         });

// The pool: blocks taken as sequences grow, refused (nothing taken) when too few are free,
// given back on release; a position beyond what was reserved is refused by the step.
TEST(KvPool, GrowsRefusesAndReleases) {
  auto be = make_cpu_backend(1);
  LoadedModel m = load_model(testing::fixture("qwen3_tiny"));
  const BatchOptions o{.n_seqs = 3, .max_context = 64, .pool_tokens = 80};
  BatchRunner r(*m.model, *be, o);
  EXPECT_EQ(r.kv().total_blocks(), 5);
  EXPECT_TRUE(r.reserve(0, 33));  // 3 blocks
  EXPECT_EQ(r.kv().free_blocks(), 2);
  EXPECT_FALSE(r.reserve(1, 48));  // 3 more: refused
  EXPECT_EQ(r.kv().free_blocks(), 2);
  EXPECT_TRUE(r.reserve(1, 32));
  EXPECT_EQ(r.kv().free_blocks(), 0);
  EXPECT_TRUE(r.reserve(0, 40));  // within its blocks
  std::vector<float> logits;
  const BatchRow beyond[] = {{2, 1, 0, true}};
  EXPECT_THROW(r.step(beyond, &logits, nullptr), Error);
  r.release(0);
  EXPECT_EQ(r.kv().free_blocks(), 3);
  EXPECT_TRUE(r.reserve(2, 20));
  const BatchRow ok[] = {{2, 1, 0, false}, {2, 2, 1, true}, {1, 3, 0, true}};
  r.step(ok, &logits, nullptr);
  EXPECT_EQ(logits.size(), size_t(2 * m.model->info().vocab_size));
  const BatchRow gap[] = {{2, 1, 0, false}, {2, 2, 2, true}};
  EXPECT_THROW(r.step(gap, &logits, nullptr), Error);
}

// Prefix caching as the server meets it: two sequences read the same prompt in one step (the
// second's blocks are not registered: the first's hold the prefix), then two more attach the
// cached blocks in one step and decode side by side; every wanted row matches the prompt alone.
TEST(KvPool, ConcurrentSamePromptsShareBlocksCorrectly) {
  auto be = make_cpu_backend(2);
  LoadedModel m = load_model(testing::fixture("qwen3_tiny"));
  const Model& model = *m.model;
  const int64_t V = model.info().vocab_size;
  const std::vector<int32_t> g = testing::load_golden("qwen3_tiny").tokens;
  const std::vector<int32_t> prompt(g.begin(), g.begin() + 36);
  Session alone(model, *be);
  const std::vector<float> ref = alone.feed(prompt, 0, true);
  const BatchOptions o{.n_seqs = 4, .max_context = 64, .max_rows = 64};
  BatchRunner r(model, *be, o);
  std::vector<std::vector<int32_t>> hist(4);
  // rows: (seq, first position, count); returns each run's last-row logits.
  auto step = [&](std::vector<std::tuple<int, int64_t, int64_t>> runs) {
    std::vector<BatchRow> rows;
    for (auto [seq, from, n] : runs) {
      EXPECT_TRUE(r.reserve(seq, from + n));
      for (int64_t p = from; p < from + n; ++p) rows.push_back({seq, prompt[size_t(p)], p, false});
      rows.back().want = true;
    }
    std::vector<float> logits;
    r.step(rows, &logits, nullptr);
    for (auto [seq, from, n] : runs) {
      hist[size_t(seq)].assign(prompt.begin(), prompt.begin() + from + n);
      r.register_prefix(seq, hist[size_t(seq)]);
    }
    size_t k = 0;
    for (auto [seq, from, n] : runs) {
      const int64_t pos = from + n - 1;
      EXPECT_EQ(max_rel_error(logits.data() + int64_t(k++) * V, ref.data() + pos * V, size_t(V)), 0.0)
          << "sequence " << seq << " position " << pos;
    }
  };
  step({{0, 0, 36}, {1, 0, 28}});
  step({{1, 28, 8}});
  r.release(0);
  r.release(1);
  EXPECT_EQ(r.attach_prefix(2, prompt, 35), 32);
  EXPECT_EQ(r.attach_prefix(3, prompt, 35), 32);
  step({{2, 32, 4}, {3, 32, 4}});
  r.release(2);
  EXPECT_EQ(r.attach_prefix(0, prompt, 35), 32);
  step({{3, 35, 1}, {0, 32, 4}});
}

// Prefix caching under churn: sequences with prompts that share prefixes of several lengths
// come and go in a pool too small to keep everything (cached blocks are evicted and taken
// again), several at a time, each attaching what the cache holds; the last row of every
// prompt matches the prompt alone.
TEST(KvPool, PrefixCachingUnderChurnKeepsTheAloneLogits) {
  for (const char* fixture : {"qwen3_tiny", "gemma3_tiny"}) {
    auto be = make_cpu_backend(2);
    LoadedModel m = load_model(testing::fixture(fixture));
    const Model& model = *m.model;
    const int64_t V = model.info().vocab_size;
    const std::vector<int32_t> g = testing::load_golden(fixture).tokens;
    // Eight prompts: two stems of 40 tokens, each cut at 20..40 and given tails of their own.
    std::vector<std::vector<int32_t>> prompts;
    for (int i = 0; i < 8; ++i) {
      std::vector<int32_t> p;
      for (int t = 0; t < 20 + (i * 7) % 21; ++t) p.push_back(g[size_t((t + (i % 2) * 5) % 40)]);
      for (int t = 0; t < 3 + i % 4; ++t) p.push_back(int32_t((i * 31 + t * 7) % V));
      prompts.push_back(p);
    }
    std::vector<std::vector<float>> ref;
    for (const auto& p : prompts) {
      Session s(model, *be);
      ref.push_back(s.feed(p));
    }
    const BatchOptions o{.n_seqs = 3, .max_context = 64, .pool_tokens = 10 * 16, .max_rows = 24};
    BatchRunner r(model, *be, o);
    struct Live {
      int prompt = -1;
      int64_t fed = 0;
    };
    std::vector<Live> live(3);
    std::mt19937 rng(5);
    int finished = 0, attached = 0;
    for (int iter = 0; iter < 400 && finished < 60; ++iter) {
      for (int s = 0; s < 3; ++s)
        if (live[size_t(s)].prompt < 0 && rng() % 2) {
          const int pi = int(rng() % prompts.size());
          const auto& p = prompts[size_t(pi)];
          live[size_t(s)] = {pi, r.attach_prefix(s, p, int64_t(p.size()) - 1)};
          attached += live[size_t(s)].fed > 0;
        }
      std::vector<BatchRow> rows;
      std::vector<int> seqs;
      for (int s = 0; s < 3; ++s) {
        Live& l = live[size_t(s)];
        if (l.prompt < 0) continue;
        const auto& p = prompts[size_t(l.prompt)];
        const int64_t room = o.max_rows - int64_t(rows.size());
        const int64_t n = std::min<int64_t>({room, 1 + int64_t(rng() % 9), int64_t(p.size()) - l.fed});
        if (n <= 0 || !r.reserve(s, l.fed + n)) continue;
        for (int64_t i = 0; i < n; ++i) rows.push_back({s, p[size_t(l.fed + i)], l.fed + i, false});
        rows.back().want = true;
        seqs.push_back(s);
      }
      if (rows.empty()) continue;
      std::vector<float> logits;
      r.step(rows, &logits, nullptr);
      size_t k = 0;
      for (int s : seqs) {
        Live& l = live[size_t(s)];
        const auto& p = prompts[size_t(l.prompt)];
        int64_t n = 0;
        for (const BatchRow& row : rows) n += row.seq == s;
        l.fed += n;
        r.register_prefix(s, std::span<const int32_t>(p.data(), size_t(l.fed)));
        if (l.fed == int64_t(p.size())) {
          EXPECT_EQ(max_rel_error(logits.data() + int64_t(k) * V, ref[size_t(l.prompt)].data(), size_t(V)), 0.0)
              << fixture << " prompt " << l.prompt << " iteration " << iter;
          r.release(s);
          l = Live{};
          ++finished;
        }
        ++k;
      }
    }
    EXPECT_GE(finished, 40) << fixture;
    EXPECT_GE(attached, 10) << fixture;
  }
}

// Prefix caching: a second sequence whose tokens begin like a first one's attaches the first
// one's full blocks (while it runs, and after it is released), computes only the rest, and
// gets the logits it gets alone; a different first token attaches nothing; cached blocks
// no sequence holds are taken back when the free list runs dry.
TEST(KvPool, PrefixBlocksAreSharedAndGiveTheAloneLogits) {
  auto be = make_cpu_backend(2);
  LoadedModel m = load_model(testing::fixture("qwen3_tiny"));
  const Model& model = *m.model;
  const int64_t V = model.info().vocab_size;
  const std::vector<int32_t> base = testing::load_golden("qwen3_tiny").tokens;  // 40 tokens
  const BatchOptions o{.n_seqs = 3, .max_context = 64, .pool_tokens = 8 * 16, .max_rows = 64};
  BatchRunner r(model, *be, o);
  ASSERT_TRUE(r.caches_prefixes());
  auto feed = [&](int seq, const std::vector<int32_t>& t, int64_t from) {
    std::vector<BatchRow> rows;
    for (int64_t p = from; p < int64_t(t.size()); ++p) rows.push_back({seq, t[size_t(p)], p, false});
    rows.back().want = true;
    EXPECT_TRUE(r.reserve(seq, int64_t(t.size())));
    std::vector<float> logits;
    r.step(rows, &logits, nullptr);
    r.register_prefix(seq, t);
    return logits;
  };
  auto alone = [&](const std::vector<int32_t>& t) {
    Session s(model, *be);
    return s.feed(t);
  };
  feed(0, base, 0);
  EXPECT_EQ(r.kv().cached_blocks(), 2);  // 40 tokens: two full blocks
  // Same 35 first tokens, then another tail: two blocks attach while sequence 0 holds them.
  std::vector<int32_t> other(base.begin(), base.begin() + 35);
  for (int32_t t : {7, 8, 9, 10, 11}) other.push_back(t);
  EXPECT_EQ(r.attach_prefix(1, other, int64_t(other.size()) - 1), 32);
  const std::vector<float> got = feed(1, other, 32);
  EXPECT_EQ(max_rel_error(got.data(), alone(other).data(), size_t(V)), 0.0);
  // Both released: the blocks stay cached and attach again; the prompt's last token is never
  // attached (max_tokens), so a 32-token prompt attaches one block.
  r.release(0);
  r.release(1);
  EXPECT_EQ(r.kv().free_blocks(), r.kv().total_blocks());
  const std::vector<int32_t> first32(base.begin(), base.begin() + 32);
  EXPECT_EQ(r.attach_prefix(2, first32, 31), 16);
  const std::vector<float> again = feed(2, first32, 16);
  EXPECT_EQ(max_rel_error(again.data(), alone(first32).data(), size_t(V)), 0.0);
  r.release(2);
  std::vector<int32_t> shifted = base;
  shifted[0] = base[0] == 1 ? 2 : 1;
  EXPECT_EQ(r.attach_prefix(0, shifted, 39), 0);
  // Fill the pool (8 blocks) with sequences of other tokens: the cached blocks are taken
  // back, and the prefix no longer attaches.
  std::vector<int32_t> filler(64);
  for (size_t i = 0; i < filler.size(); ++i) filler[i] = int32_t((i * 5 + 3) % size_t(V));
  feed(0, filler, 0);                        // 4 blocks
  feed(1, std::vector<int32_t>(filler.begin(), filler.begin() + 64), 0);  // 4 more: evicts
  EXPECT_EQ(r.kv().free_blocks(), 0);
  r.release(1);
  EXPECT_EQ(r.attach_prefix(1, base, 39), 0);
}

}  // namespace
}  // namespace turbospark
