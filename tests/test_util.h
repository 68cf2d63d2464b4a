// Helpers the test tiers share: fixture paths, golden files, running the CLI.
#pragma once

#include <gtest/gtest.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "backends/cpu/mxfp4.h"
#include "core/quant_grouped.h"
#include "ops/backend.h"
#include "core/mapped_file.h"

namespace turbospark::testing {

inline std::string source_dir() { return TS_SOURCE_DIR; }
inline std::string fixture(const std::string& name) { return source_dir() + "/tests/data/fixtures/" + name; }
// A model inside a fixture folder: `file` there, or the folder itself when file is empty.
inline std::string fixture_model(const std::string& name, const std::string& file) {
  return file.empty() ? fixture(name) : fixture(name) + "/" + file;
}
// Same length and the same bits (NaNs included).
inline bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_text_file(path)); }

// n floats drawn uniformly from [lo, hi) by a Mersenne twister seeded with seed.
inline std::vector<float> uniform_floats(size_t n, uint32_t seed, float lo = -2.f, float hi = 2.f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// True when none of the n values is a NaN or an infinity.
inline bool all_finite(const float* a, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(a[i])) return false;
  }
  return true;
}

// Largest |a - b| / (max |b| over the array): errors relative to the logit scale.
// +infinity when either side holds a NaN or an infinity anywhere (std::max(err, NaN) keeps
// err, so a NaN-blind maximum would let NaN logits pass `EXPECT_LT(err, tol)`). Note that
// +infinity *passes* EXPECT_GT(err, x): a test proving that something moved the logits must
// also check all_finite.
inline double max_rel_error(const float* a, const float* b, size_t n) {
  if (!all_finite(a, n) || !all_finite(b, n)) return std::numeric_limits<double>::infinity();
  double scale = 1e-6, err = 0;
  for (size_t i = 0; i < n; ++i) {
    scale = std::max(scale, double(std::fabs(b[i])));
    err = std::max(err, std::fabs(double(a[i]) - double(b[i])));
  }
  return err / scale;
}

struct CliResult {
  int exit_code = 0;
  std::string out;  // stdout and stderr together
};

// Runs the turbospark binary with `args` (shell-quoted by the caller).
inline CliResult run_cli(const std::string& args) {
  std::string cmd = std::string(TS_BINARY) + " " + args + " 2>&1";
  CliResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  int status = pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// A fresh temporary directory, removed when the object goes away.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    path = std::filesystem::temp_directory_path() /
           ("turbospark-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string str() const { return path.string(); }
  static int& counter() {
    static int c = 0;
    return c;
  }
};

// MXFP4 matmuls with int8 activations (true) or in exact float arithmetic (false) while
// alive, whatever the environment says; the previous mode comes back after.
struct Mxfp4Activations {
  bool was = cpu::mxfp4_int8_activations();
  explicit Mxfp4Activations(bool int8) { cpu::mxfp4_set_int8_activations(int8); }
  ~Mxfp4Activations() { cpu::mxfp4_set_int8_activations(was); }
  Mxfp4Activations(const Mxfp4Activations&) = delete;
  Mxfp4Activations& operator=(const Mxfp4Activations&) = delete;
};

// Routed experts in a packed format next to the same experts as F32 matrices holding exactly
// their dequantized values, and one fixed routing of 5 tokens over 4 experts (top 2): what
// the formats' MoE tests run through the backend. make_view(rows, cols) returns a packed
// view whose storage it keeps alive.
struct ExpertPairs {
  static constexpr int64_t kExperts = 4, kTokens = 5;
  static constexpr int kTopK = 2;
  static constexpr int32_t kIdx[kTokens * kTopK] = {0, 3, 1, 2, 3, 0, 2, 1, 0, 1};
  static constexpr float kWeight[kTokens * kTopK] = {0.6f, 0.4f, 0.5f, 0.5f, 0.9f, 0.1f, 0.3f, 0.7f, 0.2f, 0.8f};
  int64_t hidden = 0;
  std::vector<ExpertWeights> packed, floats;
  std::vector<std::vector<float>> storage;

  template <class MakeView>
  ExpertPairs(int64_t hidden_size, int64_t inter, MakeView make_view)
      : hidden(hidden_size), packed(kExperts), floats(kExperts) {
    storage.reserve(3 * kExperts);
    auto make = [&](int64_t rows, int64_t cols, Weight* qw, Weight* fw) {
      qw->view = make_view(rows, cols);
      storage.emplace_back(static_cast<size_t>(rows * cols));
      for (int64_t r = 0; r < rows; ++r) dequantize_weight_row(qw->view, r, storage.back().data() + r * cols);
      fw->view = WeightView{DType::F32, storage.back().data(), rows, cols, cols * 4};
    };
    for (size_t e = 0; e < size_t(kExperts); ++e) {
      make(inter, hidden, &packed[e].gate, &floats[e].gate);
      make(inter, hidden, &packed[e].up, &floats[e].up);
      make(hidden, inter, &packed[e].down, &floats[e].down);
    }
  }
  // out = the routed experts' output for x ([kTokens, hidden]).
  void run(Backend& be, const std::vector<ExpertWeights>& experts, std::vector<float>& x, std::vector<float>& out) const {
    out.assign(static_cast<size_t>(kTokens * hidden), 0.f);
    be.moe_experts(experts, Mat(x.data(), kTokens, hidden), kIdx, kWeight, kTopK, Mat(out.data(), kTokens, hidden));
  }
};

// A gtest parameter name from a fixture and optional file name: letters and digits kept,
// everything else '_'.
inline std::string param_name(const std::string& fixture_name, const std::string& file) {
  std::string name = fixture_name + (file.empty() ? "" : "_" + file);
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

// Copies a fixture model directory (so a test can damage its copy).
inline void copy_fixture(const std::string& name, const std::filesystem::path& dst) {
  std::filesystem::copy(fixture(name), dst, std::filesystem::copy_options::recursive);
}

}  // namespace turbospark::testing
