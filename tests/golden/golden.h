// What the golden tests share: a fixture's recorded transformers outputs, and a test class
// that loads the fixture's model, a 2-thread CPU backend and its golden.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/npy.h"
#include "models/registry.h"
#include "test_util.h"

namespace turbospark::testing {

struct Golden {
  std::vector<int32_t> tokens, greedy;
  int64_t greedy_prompt_len = 0;
  NpyArray logits;      // [T, vocab]
  NpyArray hidden;      // [layers, T, hidden]
  nlohmann::json json;  // golden.json whole, for family-specific records
};

inline Golden load_golden(const std::string& name) {
  Golden g;
  g.json = read_json(fixture(name) + "/golden.json");
  g.tokens = g.json["tokens"].get<std::vector<int32_t>>();
  g.greedy = g.json["greedy"].get<std::vector<int32_t>>();
  g.greedy_prompt_len = g.json["greedy_prompt_len"].get<int64_t>();
  g.logits = read_npy_f32(fixture(name) + "/logits.npy");
  g.hidden = read_npy_f32(fixture(name) + "/hidden.npy");
  return g;
}

// Parameterized by fixture name. MXFP4 runs in exact float arithmetic, what the MXFP4
// fixture's golden holds.
class GoldenTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    loaded_ = load_model(fixture(GetParam()));
    backend_ = make_cpu_backend(2);
    golden_ = load_golden(GetParam());
  }
  const Model& model() const { return *loaded_.model; }
  int64_t vocab() const { return model().info().vocab_size; }

  Mxfp4Activations exact_{false};
  LoadedModel loaded_;
  std::unique_ptr<Backend> backend_;
  Golden golden_;
};

}  // namespace turbospark::testing
