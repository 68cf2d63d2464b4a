// Per-family golden tests: turbospark's logits, per-layer hidden states and greedy ids
// against transformers 5.17 on tiny random checkpoints (tools/fixtures/make_fixtures.py),
// and the engine invariants: chunk boundaries do not move the logits, cached decode equals
// full recompute.
#include <gtest/gtest.h>

#include <cstring>

#include "core/npy.h"
#include "engine/generate.h"
#include "engine/sampler.h"
#include "engine/session.h"
#include "models/registry.h"
#include "golden/golden.h"
#include "test_util.h"

namespace turbospark {
namespace {

using testing::fixture;
using testing::Golden;
using testing::load_golden;
using testing::max_rel_error;

// bf16 weights, float32 activations on both sides: differences are summation order only.
constexpr double kLogitTol = 2e-4;

class GoldenFamily : public testing::GoldenTest {};

TEST_P(GoldenFamily, LogitsMatchTransformersAtEveryChunkSize) {
  const int64_t T = int64_t(golden_.tokens.size());
  ASSERT_EQ(golden_.logits.shape, (std::vector<int64_t>{T, vocab()}));
  // 0 = whole prompt in one micro-batch; max_prefill_batch 16 forces several full
  // micro-batches plus a ragged one.
  for (int64_t max_batch : {kMaxPrefillBatch, int64_t(16)}) {
    for (int64_t chunk : {int64_t(0), int64_t(1), int64_t(2), int64_t(3), int64_t(5), int64_t(7), kMaxPrefillBatch}) {
      SessionOptions so;
      so.max_prefill_batch = max_batch;
      Session s(model(), *backend_, so);
      std::vector<float> logits = s.feed(golden_.tokens, chunk, /*all_logits=*/true);
      ASSERT_EQ(int64_t(logits.size()), T * vocab());
      double err = max_rel_error(logits.data(), golden_.logits.data.data(), logits.size());
      EXPECT_LT(err, kLogitTol) << GetParam() << " chunk " << chunk << " max batch " << max_batch;
    }
  }
}

TEST_P(GoldenFamily, HiddenStatesMatchTransformersPerLayer) {
  const int64_t T = int64_t(golden_.tokens.size());
  const int L = model().info().n_layers;
  ASSERT_EQ(golden_.hidden.shape.size(), 3u);
  const int64_t H = golden_.hidden.shape[2];  // hidden, or hc_count * hidden for hyper-connection streams
  ASSERT_EQ(golden_.hidden.shape, (std::vector<int64_t>{L, T, H}));
  std::vector<float> ours(size_t(L * T * H), std::nanf(""));
  Session s(model(), *backend_);
  s.trace = [&](const char* name, int layer, const Mat& m) {
    if (std::strcmp(name, "layer_in") != 0) return;
    ASSERT_EQ(m.cols, H);
    for (int64_t r = 0; r < m.rows; ++r) std::memcpy(&ours[size_t((layer * T + r) * H)], m.row(r), size_t(H) * 4);
  };
  s.feed(golden_.tokens, 0, true);
  for (int l = 0; l < L; ++l) {
    double err = max_rel_error(&ours[size_t(l * T * H)], &golden_.hidden.data[size_t(l * T * H)], size_t(T * H));
    EXPECT_LT(err, kLogitTol) << GetParam() << " input of layer " << l;
  }
}

TEST_P(GoldenFamily, CachedDecodeEqualsFullRecompute) {
  const int64_t T = int64_t(golden_.tokens.size());
  Session decode(model(), *backend_);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<float> step = decode.feed(std::span<const int32_t>(&golden_.tokens[size_t(t)], 1));
    if (t % 9 != 4 && t != T - 1) continue;  // recompute a handful of prefixes from scratch
    Session full(model(), *backend_);
    std::vector<float> again = full.feed(std::span<const int32_t>(golden_.tokens.data(), size_t(t + 1)));
    EXPECT_LT(max_rel_error(step.data(), again.data(), step.size()), 1e-5) << "position " << t;
    EXPECT_LT(max_rel_error(step.data(), &golden_.logits.data[size_t(t * vocab())], size_t(vocab())), kLogitTol);
  }
}

TEST_P(GoldenFamily, GreedyContinuationMatchesTransformers) {
  Session s(model(), *backend_);
  SamplingParams sp;
  sp.temperature = 0;
  Sampler sampler(sp);
  std::vector<int32_t> out;
  std::span<const int32_t> prompt(golden_.tokens.data(), size_t(golden_.greedy_prompt_len));
  generate(s, sampler, prompt, int64_t(golden_.greedy.size()), {}, [&](int32_t tok, bool) {
    out.push_back(tok);
    return true;
  });
  EXPECT_EQ(out, golden_.greedy);
}

INSTANTIATE_TEST_SUITE_P(Dense, GoldenFamily,
                         ::testing::Values("qwen3_tiny", "qwen3_moe_tiny", "qwen3_moe_norenorm_tiny", "qwen2_tiny",
                                           "llama_tiny", "gemma3_tiny", "gemma3_p6_tiny"));
INSTANTIATE_TEST_SUITE_P(Qwen4Exp, GoldenFamily,
                         ::testing::Values("qwen4_exp_tiny", "qwen4_exp_hc4_tiny", "qwen4_exp_mm_tiny"));
INSTANTIATE_TEST_SUITE_P(GptOss, GoldenFamily,
                         ::testing::Values("gpt_oss_tiny", "gpt_oss_mxfp4_tiny", "gpt_oss_yarn_tiny"));
INSTANTIATE_TEST_SUITE_P(Gemma4, GoldenFamily,
                         ::testing::Values("gemma4_dense_tiny", "gemma4_moe_tiny", "gemma4_mm_tiny"));

}  // namespace
}  // namespace turbospark

namespace turbospark {
namespace {

// The capability table per family (README "Capabilities"): what each supports beyond its
// forward pass. The engine consults it (Session's decode graphs, BatchRunner's batching and
// prefix cache, the expert flags' refusals), so this pins what users are told and get.
TEST(CapabilityTable, EveryFamilyAsDocumented) {
  struct Row {
    const char* fixture;
    bool prefix, streaming, speculation;
  };
  for (const Row& row : {Row{"qwen3_tiny", true, false, false}, Row{"qwen2_tiny", true, false, false},
                         Row{"llama_tiny", true, false, false}, Row{"gemma3_tiny", true, false, false},
                         Row{"qwen3_moe_tiny", true, true, true}, Row{"qwen4_exp_tiny", false, true, true},
                         Row{"gpt_oss_tiny", true, true, false}, Row{"gemma4_moe_tiny", true, true, false},
                         Row{"gemma4_dense_tiny", true, false, false}}) {
    SCOPED_TRACE(row.fixture);
    LoadedModel m = load_model(fixture(row.fixture));
    const Capabilities c = m.model->capabilities();
    EXPECT_TRUE(c.chunked_prefill.on);
    EXPECT_TRUE(c.decode_graphs.on);
    EXPECT_TRUE(c.batched_sequences.on);
    EXPECT_EQ(c.prefix_cache.on, row.prefix);
    EXPECT_EQ(c.expert_streaming.on, row.streaming);
    EXPECT_EQ(c.expert_speculation.on, row.speculation);
    for (const Capability* x : {&c.decode_graphs, &c.batched_sequences, &c.prefix_cache, &c.expert_streaming,
                                &c.expert_speculation})
      if (!x->on) EXPECT_EQ(x->why_not.rfind(m.model->info().architecture + " ", 0), 0u) << x->why_not;
  }
}

// GGUF files made from the same checkpoints by llama.cpp's converter (tools/fixtures/
// make_gguf_fixtures.py): the name mapping and the undone converter transforms (Llama q/k
// permutation, Gemma's +1 norms) must reproduce transformers' logits. BF16 files are exact
// up to summation order; Q8_0 is held to a quantization-level bound.
struct GgufCase {
  const char* fixture;
  const char* file;
  double max_rel_error;
  double min_top1;
};

class GgufGolden : public ::testing::TestWithParam<GgufCase> {};

TEST_P(GgufGolden, LogitsMatchTransformers) {
  const GgufCase& c = GetParam();
  LoadedModel m = load_model(fixture(c.fixture) + "/" + c.file);
  auto be = make_cpu_backend(2);
  Golden g = load_golden(c.fixture);
  const int64_t V = m.model->info().vocab_size, T = int64_t(g.tokens.size());
  for (int64_t chunk : {int64_t(0), int64_t(3)}) {
    Session s(*m.model, *be);
    std::vector<float> logits = s.feed(g.tokens, chunk, true);
    ASSERT_EQ(logits.size(), g.logits.data.size());
    EXPECT_LT(max_rel_error(logits.data(), g.logits.data.data(), logits.size()), c.max_rel_error) << c.file;
    int agree = 0;
    for (int64_t t = 0; t < T; ++t) {
      agree += argmax(&logits[size_t(t * V)], V) == argmax(&g.logits.data[size_t(t * V)], V);
    }
    EXPECT_GE(double(agree) / double(T), c.min_top1) << c.file;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Converted, GgufGolden,
    ::testing::Values(GgufCase{"llama_tiny", "llama_tiny-bf16.gguf", kLogitTol, 1.0},
                      GgufCase{"qwen2_tiny", "qwen2_tiny-bf16.gguf", kLogitTol, 1.0},
                      GgufCase{"qwen3_tiny", "qwen3_tiny-bf16.gguf", kLogitTol, 1.0},
                      GgufCase{"gemma3_p6_tiny", "gemma3_p6_tiny-bf16.gguf", kLogitTol, 1.0},
                      GgufCase{"qwen2_tiny", "qwen2_tiny-q8_0.gguf", 0.05, 0.9},
                      // qwen3moe: router, ffn_{gate,up,down}_exps stacks (qwen3_moe_tiny's
                      // dense mlp_only layer has no qwen3moe form; this fixture routes every layer).
                      GgufCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-bf16.gguf", kLogitTol, 1.0},
                      // Q8_0 flips one token's expert choice (position 14): transformers on the
                      // dequantized weights is 0.34 off the golden there too, <= 0.05 elsewhere.
                      GgufCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q8_0.gguf", 0.5, 0.9},
                      // Q4_0 (tools/fixtures/requantize_gguf.py): 4-bit random weights move the
                      // logits far (0.39 of the largest, 60% top-1 measured); a loose check that
                      // the file loads and runs end to end. The format's arithmetic is held to
                      // its dequantized reference by the kernel tests; the CUDA device tests
                      // compare this file on CUDA against the CPU backend, tightly.
                      GgufCase{"qwen3_moe_gguf_tiny", "qwen3_moe_gguf_tiny-q4_0.gguf", 0.5, 0.5},
                      // qwen4exp: hyper-connections, GatedDeltaNet with value heads in llama.cpp's
                      // tiled order (2 key heads, 4 value heads), QSA, one PLE layer; the bf16 file
                      // is held to the safetensors model more tightly in test_qwen4_exp.cpp. Q8_0
                      // moves the logits 0.13 of the largest (measured), its top-1 95%: random
                      // top-10-of-16 routing amplifies the quantization, as qwen3_moe's above.
                      GgufCase{"qwen4_exp_mm_tiny", "qwen4_exp_mm_tiny-bf16.gguf", kLogitTol, 1.0},
                      GgufCase{"qwen4_exp_mm_tiny", "qwen4_exp_mm_tiny-q8_0.gguf", 0.25, 0.9}),
    [](const auto& info) {
      std::string n = info.param.file;
      for (char& ch : n) if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return n;
    });

}  // namespace
}  // namespace turbospark
