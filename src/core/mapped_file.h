// Read-only memory-mapped files. Checkpoints are mapped, never copied: weights are read in
// place, and a 90 GiB table costs only the pages a token touches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace turbospark {

class MappedFile {
 public:
  // Maps `path` read-only; throws Error naming the path when it cannot be opened or mapped.
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

  // Maps every page of [offset, offset + bytes) now, in pieces, calling progress(done) after
  // each, so the first forward pass does not pay one page fault per 4 KiB of weights.
  void prefault(size_t offset, size_t bytes, const std::function<void(size_t done)>& progress) const;

 private:
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Where a pointer into a live MappedFile's pages comes from: the file and the byte offset
// (expert streaming reads routed experts from disk by offset instead of through the mapping).
// Empty when [p, p + bytes) is not inside one live mapping (e.g. memory a checkpoint owns).
struct MappedLocation {
  std::string path;
  int64_t offset = 0;
  int64_t file_size = 0;
};
std::optional<MappedLocation> locate_mapped(const void* p, int64_t bytes);

// Whole-file read for small text files (configs, JSON); throws Error naming the path.
std::string read_text_file(const std::string& path);
bool file_exists(const std::string& path);
// The host's available memory from /proc/meminfo (page cache counts: it can be reclaimed), or 0.
int64_t host_memory_available();

}  // namespace turbospark
