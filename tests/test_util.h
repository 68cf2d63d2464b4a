// Helpers the test tiers share: fixture paths, golden files, running the CLI.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "backends/cpu/mxfp4.h"
#include "core/mapped_file.h"

namespace turbospark::testing {

inline std::string source_dir() { return TS_SOURCE_DIR; }
inline std::string fixture(const std::string& name) { return source_dir() + "/tests/data/fixtures/" + name; }

inline nlohmann::json read_json(const std::string& path) { return nlohmann::json::parse(read_text_file(path)); }

// Largest |a - b| / (max |b| over the array): errors relative to the logit scale.
inline double max_rel_error(const float* a, const float* b, size_t n) {
  double scale = 1e-6, err = 0;
  for (size_t i = 0; i < n; ++i) scale = std::max(scale, double(std::fabs(b[i])));
  for (size_t i = 0; i < n; ++i) err = std::max(err, double(std::fabs(a[i] - b[i])));
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

// Copies a fixture model directory (so a test can damage its copy).
inline void copy_fixture(const std::string& name, const std::filesystem::path& dst) {
  std::filesystem::copy(fixture(name), dst, std::filesystem::copy_options::recursive);
}

}  // namespace turbospark::testing
