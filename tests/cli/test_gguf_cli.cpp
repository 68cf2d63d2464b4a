// Damaged or unsupported GGUF files through the CLI: one line naming the problem, exit 1.
#include <gtest/gtest.h>

#include <fstream>

#include "core/mapped_file.h"
#include "test_util.h"

namespace turbospark {
namespace {

using testing::fixture;
using testing::run_cli;
using testing::TempDir;

std::string gguf_fixture() { return read_text_file(fixture("llama_tiny") + "/llama_tiny-bf16.gguf"); }

std::string write(const TempDir& dir, const std::string& bytes) {
  const std::string path = dir.str() + "/model.gguf";
  std::ofstream(path, std::ios::binary).write(bytes.data(), std::streamsize(bytes.size()));
  return path;
}

void expect_one_line_error(const std::string& args, const std::string& needle) {
  auto r = run_cli(args);
  EXPECT_EQ(r.exit_code, 1) << r.out;
  std::string out = r.out;
  while (!out.empty() && out.back() == '\n') out.pop_back();
  EXPECT_EQ(out.find('\n'), std::string::npos) << "more than one line: " << r.out;
  EXPECT_EQ(out.rfind("error: ", 0), 0u) << r.out;
  EXPECT_NE(out.find(needle), std::string::npos) << "expected '" << needle << "' in: " << r.out;
}

TEST(GgufCli, TheFixtureRuns) {
  auto r = run_cli("generate -q -m " + fixture("llama_tiny") + "/llama_tiny-bf16.gguf --tokens 1,2,3 -n 2 --format ids");
  EXPECT_EQ(r.exit_code, 0) << r.out;
}

TEST(GgufCli, TruncatedFile) {
  TempDir dir;
  const std::string bytes = gguf_fixture();
  for (size_t keep : {size_t(3), size_t(40), bytes.size() / 3, bytes.size() - 1}) {
    SCOPED_TRACE(keep);
    expect_one_line_error("run -q -m " + write(dir, bytes.substr(0, keep)) + " hi", "model.gguf");
  }
}

TEST(GgufCli, WrongMagic) {
  TempDir dir;
  std::string bytes = gguf_fixture();
  bytes[0] = 'X';
  expect_one_line_error("run -q -m " + write(dir, bytes) + " hi", "model.gguf");
}

TEST(GgufCli, UnknownArchitectureRefusedByName) {
  TempDir dir;
  std::string bytes = gguf_fixture();
  // general.architecture's value "llama" -> "mamba" (same length, so the file stays valid).
  const std::string key = "general.architecture";
  const size_t at = bytes.find(key);
  ASSERT_NE(at, std::string::npos);
  const size_t value = bytes.find("llama", at + key.size());
  ASSERT_NE(value, std::string::npos);
  bytes.replace(value, 5, "mamba");
  expect_one_line_error("run -q -m " + write(dir, bytes) + " hi", "mamba");
}

TEST(GgufCli, InspectReadsGguf) {
  auto r = run_cli("inspect -m " + fixture("llama_tiny") + "/llama_tiny-bf16.gguf");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_NE(r.out.find("GGUF"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("LlamaForCausalLM"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace turbospark
