// Gemma 4 text against transformers 5.17 (tools/fixtures/make_gemma4_fixtures.py): logits at
// several chunk sizes, per-layer hidden states, greedy ids, cached decode vs recompute, both
// config forms (flat global_head_dim fields and save_pretrained's per_layer_config), no KV
// storage for shared layers, and malformed configs / refused inputs named in the error.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>

#include "core/error.h"
#include "core/npy.h"
#include "engine/generate.h"
#include "engine/kv_cache.h"
#include "engine/sampler.h"
#include "engine/batch.h"
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

class Gemma4Golden : public testing::GoldenTest {};

// The same weights under the other config form give the same logits.
TEST_P(Gemma4Golden, AlternateConfigFormGivesSameLogits) {
  const std::string alt = fixture(GetParam()) + "/config_alt.json";
  if (!std::filesystem::exists(alt)) GTEST_SKIP() << "no config_alt.json";
  testing::TempDir tmp;
  testing::copy_fixture(GetParam(), tmp.path / "m");
  std::filesystem::copy_file(alt, tmp.path / "m" / "config.json", std::filesystem::copy_options::overwrite_existing);
  LoadedModel m = load_model((tmp.path / "m").string());
  Session s(*m.model, *backend_);
  std::vector<float> logits = s.feed(golden_.tokens, 0, true);
  ASSERT_EQ(logits.size(), golden_.logits.data.size());
  EXPECT_LT(max_rel_error(logits.data(), golden_.logits.data.data(), logits.size()), kLogitTol);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Gemma4Golden,
                         ::testing::Values("gemma4_dense_tiny", "gemma4_moe_tiny", "gemma4_mm_tiny"));

// num_kv_shared_layers = 2 on 6 layers [S S F S S F]: layers 4 (sliding) and 5 (full) reuse
// layers 3 and 2, and the cache holds nothing for them.
TEST(Gemma4Kv, SharedLayersOwnNoCache) {
  LoadedModel m = load_model(fixture("gemma4_dense_tiny"));
  auto spec = m.model->kv_spec();
  ASSERT_EQ(spec.size(), 6u);
  const int heads[] = {2, 2, 1, 2, 0, 0}, dims[] = {16, 16, 32, 16, 0, 0};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(spec[size_t(i)].n_kv_heads, heads[i]) << "layer " << i;
    EXPECT_EQ(spec[size_t(i)].head_dim, dims[i]) << "layer " << i;
  }
  auto be = make_cpu_backend(1);
  KvCache kv(*be, spec, 64);
  kv.reserve(40);
  const int64_t blocks = (40 + kKvBlockSize - 1) / kKvBlockSize;
  EXPECT_EQ(kv.used_bytes(), 2 * blocks * kKvBlockSize * (2 * 16 * 3 + 1 * 32) * 4);
  EXPECT_EQ(kv.pool_bytes(), 2 * ((64 + kKvBlockSize - 1) / kKvBlockSize) * kKvBlockSize * (2 * 16 * 3 + 1 * 32) * 4);
  EXPECT_EQ(kv.layer(4).k, nullptr);
  EXPECT_EQ(kv.layer(5).v, nullptr);
}

// Malformed configs: one line naming the field.
void expect_config_error(const std::string& name, const std::function<void(nlohmann::json&)>& edit,
                         const std::string& needle) {
  testing::TempDir tmp;
  testing::copy_fixture(name, tmp.path / "m");
  auto path = (tmp.path / "m" / "config.json").string();
  auto cfg = testing::read_json(path);
  edit(cfg);
  std::ofstream(path) << cfg.dump();
  auto r = testing::run_cli("logits --model " + (tmp.path / "m").string() + " --tokens 3,4 --out " + tmp.str() + "/x.npy");
  EXPECT_NE(r.exit_code, 0) << needle;
  EXPECT_NE(r.out.find(needle), std::string::npos) << r.out;
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
}

TEST(Gemma4Config, MalformedConfigsNameTheField) {
  const std::string d = "gemma4_dense_tiny", m = "gemma4_moe_tiny";
  expect_config_error(d, [](auto& c) { c.erase("num_attention_heads"); }, "missing field num_attention_heads");
  expect_config_error(d, [](auto& c) { c.erase("intermediate_size"); }, "missing field intermediate_size");
  expect_config_error(d, [](auto& c) { c["layer_types"] = {"sliding_attention"}; }, "layer_types has 1 entries");
  expect_config_error(d, [](auto& c) { c["layer_types"][1] = "chunked_attention"; }, "layer_types[1] = chunked_attention");
  expect_config_error(d, [](auto& c) { c["rope_parameters"]["full_attention"]["rope_type"] = "yarn"; },
                      "rope_parameters.full_attention.rope_type yarn");
  expect_config_error(d, [](auto& c) { c["rope_parameters"].erase("sliding_attention"); },
                      "rope_parameters.sliding_attention is missing");
  expect_config_error(d, [](auto& c) { c["num_kv_shared_layers"] = 4; }, "has no earlier full_attention layer");
  expect_config_error(d, [](auto& c) { c["num_kv_shared_layers"] = 6; }, "num_kv_shared_layers 6");
  expect_config_error(d, [](auto& c) { c["hidden_activation"] = "relu"; }, "hidden_activation relu");
  expect_config_error(d, [](auto& c) { c["use_bidirectional_attention"] = "all"; }, "use_bidirectional_attention=all");
  expect_config_error(d, [](auto& c) { c["global_head_dim"] = 48; }, "layers.2.self_attn.q_proj.weight");
  expect_config_error(m, [](auto& c) { c["top_k_experts"] = 9; }, "top_k_experts 9");
  expect_config_error(m, [](auto& c) { c.erase("num_experts"); }, "missing field num_experts");
  expect_config_error(m, [](auto& c) { c["per_layer_config"]["x"] = {{"head_dim", 24}}; }, "per_layer_config key x");
  expect_config_error(m, [](auto& c) { c["per_layer_config"]["2"]["sliding_window"] = 4; },
                      "per_layer_config.2.sliding_window");
}

// A copy of the dense fixture in the multimodal form, image token 7 and audio token 8.
void multimodal_copy(const std::filesystem::path& dir) {
  testing::copy_fixture("gemma4_dense_tiny", dir);
  const std::string path = (dir / "config.json").string();
  auto text = testing::read_json(path);
  nlohmann::json root = {{"architectures", {"Gemma4ForConditionalGeneration"}}, {"model_type", "gemma4"},
                         {"text_config", text}, {"image_token_id", 7}, {"audio_token_id", 8}};
  std::ofstream(path) << root.dump();
}

// The multimodal form: a placeholder token (image, video, audio) is refused by name, and so
// is an image on the command line.
TEST(Gemma4Config, ImageInputIsRefusedByName) {
  testing::TempDir tmp;
  multimodal_copy(tmp.path / "m");
  auto r = testing::run_cli("logits --model " + (tmp.path / "m").string() + " --tokens 3,7 --out " + tmp.str() + "/x.npy");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.out.find("token 7 is an image/video/audio placeholder"), std::string::npos) << r.out;
  auto ok = testing::run_cli("logits --model " + (tmp.path / "m").string() + " --tokens 3,9 --out " + tmp.str() + "/y.npy");
  EXPECT_EQ(ok.exit_code, 0) << ok.out;
  auto img = testing::run_cli("generate -q --model " + (tmp.path / "m").string() + " --tokens 5,6 --image cat.png --format ids");
  EXPECT_NE(img.exit_code, 0);
  EXPECT_NE(img.out.find("image input is not supported"), std::string::npos) << img.out;
}

// The placeholder check runs before a step, outside forward (Model::check_tokens), so a step
// replayed as a device graph, which runs none of forward's host code, is refused as well: a
// session and a batch runner refuse the audio placeholder without running anything.
TEST(Gemma4Config, PlaceholderTokensAreRefusedBeforeTheStep) {
  testing::TempDir tmp;
  multimodal_copy(tmp.path / "m");
  auto be = make_cpu_backend(2);
  LoadedModel m = load_model((tmp.path / "m").string(), *be);
  Session s(*m.model, *be);
  EXPECT_THROW(s.feed(std::vector<int32_t>{3, 8}), Error);
  EXPECT_EQ(s.position(), 0);
  BatchRunner r(*m.model, *be, BatchOptions{});
  ASSERT_TRUE(r.reserve(0, 2));
  std::vector<int32_t> ids;
  const std::vector<BatchRow> rows = {{0, 3, 0, false}, {0, 8, 1, true}};
  try {
    r.step(rows, nullptr, &ids);
    ADD_FAILURE() << "the batch runner ran a placeholder token";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token 8 is an image/video/audio placeholder"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace turbospark
