// Tokenizing long prompts must take time and memory linear in their length (issue 14's
// runaway inputs: a 50 MB prompt). Encodes the first 1, 5, 25 and 50 MB of a text built from
// tests/data/tokenizer/corpus.jsonl's lines (prose, code, CJK, emoji, long runs of spaces and
// digits) with a tokenizer.json or a GGUF vocabulary, and prints seconds, MB/s and the peak
// resident memory after each. Not built by CMake; from the repository root, after a build:
//
//   g++ -std=c++20 -O2 -Isrc bench/tokenize_bench.cpp build/libturbospark_lib.a -lfmt -lpcre2-8 -pthread
//       -o /tmp/tokenize_bench  (one line)
//   /tmp/tokenize_bench TOKENIZER.json|MODEL.gguf
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "formats/gguf.h"
#include "formats/tokenizer.h"

int main(int argc, char** argv) {
  using namespace turbospark;
  if (argc != 2) {
    std::fprintf(stderr, "usage: tokenize_bench TOKENIZER.json|MODEL.gguf\n");
    return 2;
  }
  const std::string path = argv[1];
  const Tokenizer tok = path.ends_with(".gguf") ? Tokenizer::from_vocab(vocab_spec_from_gguf(GgufFile(path)))
                                                : Tokenizer::from_file(path);
  std::string unit;
  std::ifstream in("tests/data/tokenizer/corpus.jsonl");
  for (std::string line; std::getline(in, line);) { const auto j = nlohmann::json::parse(line); unit += (j.is_string() ? j.get<std::string>() : j.value("text", "")) + "\n"; }
  if (unit.empty()) {
    std::fprintf(stderr, "run from the repository root (tests/data/tokenizer/corpus.jsonl)\n");
    return 2;
  }
  std::string text;
  while (text.size() < (size_t(50) << 20)) text += unit;
  for (size_t mb : {1, 5, 25, 50}) {
    // Cut at a line end so the piece stays valid UTF-8.
    const size_t cut = text.rfind('\n', mb << 20);
    const auto t0 = std::chrono::steady_clock::now();
    const auto ids = tok.encode(std::string_view(text).substr(0, cut + 1), true, false);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    std::printf("%3zu MB: %9zu tokens in %6.2f s (%5.2f MB/s), peak RSS %6.0f MB\n", mb, ids.size(), s,
                double(cut + 1) / 1e6 / s, double(ru.ru_maxrss) / 1024);
  }
  // One pre-token of megabytes (no spaces: a run of one letter, of CJK, of spaces, of digits):
  // BPE over a single huge word is where a tokenizer turns quadratic.
  const std::pair<const char*, std::string> runs[] = {{"'a' x", "a"}, {"CJK x", "\xe4\xb8\xad\xe6\x96\x87"},
                                                      {"space x", " "}, {"digit x", "7"}, {"'ab' x", "ab"}};
  for (const auto& [name, piece] : runs) {
    for (size_t mb : {1, 4}) {
      std::string run;
      while (run.size() < (mb << 20)) run += piece;
      const auto t0 = std::chrono::steady_clock::now();
      const auto ids = tok.encode(run, true, false);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%-8s %zu MB: %9zu tokens in %6.2f s\n", name, mb, ids.size(), s);
    }
  }
}
