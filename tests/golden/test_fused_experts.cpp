// The fused-expert safetensors layout (transformers' in-memory [E, 2*inter, hidden] stacks)
// gives the same logits as the per-expert layout transformers saves.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>

#include "core/dtype.h"
#include "core/npy.h"
#include "engine/session.h"
#include "formats/safetensors.h"
#include "models/registry.h"
#include "test_util.h"

namespace turbospark {
namespace {

namespace fs = std::filesystem;
using testing::TempDir;

// Rewrites the MoE fixture with experts stacked into [E, 2*inter, hidden] / [E, hidden,
// inter] tensors and checks the logits stay those of transformers.
TEST(Safetensors, FusedExpertStacksMatchPerExpertLayout) {
  const std::string src = testing::fixture("qwen3_moe_norenorm_tiny");
  Checkpoint ck(src);
  auto cfg = testing::read_json(src + "/config.json");
  const int64_t E = cfg["num_local_experts"], I = cfg["moe_intermediate_size"], H = cfg["hidden_size"];
  std::vector<TensorWriteSpec> out;
  auto copy = [&](const TensorInfo* t) {
    out.push_back({t->name, t->dtype, t->shape, [t](uint8_t* d, size_t n) { std::memcpy(d, t->data, n); }});
  };
  for (const auto& [name, t] : ck.all()) {
    if (name.find(".mlp.experts.") == std::string::npos) copy(t);
  }
  for (int layer = 0; layer < int(cfg["num_hidden_layers"]); ++layer) {
    std::string p = "model.layers." + std::to_string(layer) + ".mlp.experts.";
    out.push_back({p + "gate_up_proj", DType::BF16, {E, 2 * I, H}, [&ck, p, E](uint8_t* d, size_t) {
                     for (int64_t e = 0; e < E; ++e) {
                       for (const char* part : {"gate_proj", "up_proj"}) {
                         const TensorInfo& t = ck.get(p + std::to_string(e) + "." + part + ".weight");
                         std::memcpy(d, t.data, t.nbytes);
                         d += t.nbytes;
                       }
                     }
                   }});
    out.push_back({p + "down_proj", DType::BF16, {E, H, I}, [&ck, p, E](uint8_t* d, size_t) {
                     for (int64_t e = 0; e < E; ++e) {
                       const TensorInfo& t = ck.get(p + std::to_string(e) + ".down_proj.weight");
                       std::memcpy(d, t.data, t.nbytes);
                       d += t.nbytes;
                     }
                   }});
  }
  TempDir tmp;
  write_safetensors(tmp.str() + "/model.safetensors", out);
  fs::copy_file(src + "/config.json", tmp.str() + "/config.json");
  LoadedModel fused = load_model(tmp.str());
  auto backend = make_cpu_backend(2);
  Session s(*fused.model, *backend);
  auto tokens = testing::read_json(src + "/golden.json")["tokens"].get<std::vector<int32_t>>();
  std::vector<float> logits = s.feed(tokens, 0, true);
  NpyArray ref = read_npy_f32(src + "/logits.npy");
  EXPECT_LT(testing::max_rel_error(logits.data(), ref.data.data(), ref.data.size()), 2e-4);
}

}  // namespace
}  // namespace turbospark
