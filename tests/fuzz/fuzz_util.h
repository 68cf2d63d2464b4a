// What the fuzz harnesses share: the input as a file (the parsers map paths), and the rule
// that a parser may refuse an input only with turbospark::Error; anything else (a crash, a
// sanitizer report, another exception type, a hang) is a finding.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include "core/error.h"

namespace turbospark::fuzz {

// A fresh folder in the temp directory named `stem`-<pid>, removed (with what the harness
// wrote) when the process ends normally: a run that reaches -max_total_time or replays its
// inputs leaves nothing behind (CI's smoke runs used to leave one per harness per run).
class ScratchDir {
 public:
  explicit ScratchDir(const std::string& stem)
      : path_(std::filesystem::temp_directory_path() / (stem + "-" + std::to_string(getpid()))) {
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// The bytes as an anonymous in-memory file, named by its /proc/self/fd path; closed on
// destruction.
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = memfd_create("turbospark-fuzz", 0);
    if (fd_ < 0) __builtin_trap();
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) __builtin_trap();
      done += size_t(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

// Runs fn; turbospark::Error is an accepted refusal, every other exception a finding.
template <typename Fn>
void refusals_only(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    // TURBOSPARK_FUZZ_VERBOSE=1: say why, to check that seeds get past the first checks.
    static const bool verbose = std::getenv("TURBOSPARK_FUZZ_VERBOSE") != nullptr;
    if (verbose) std::fprintf(stderr, "refused: %s\n", e.what());
  }
}

}  // namespace turbospark::fuzz
