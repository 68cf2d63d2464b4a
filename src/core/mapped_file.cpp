#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>
#include <vector>

#include "core/error.h"

namespace turbospark {
namespace {

// Every live mapping, for locate_mapped(). Few entries (one per checkpoint file).
struct Registry {
  std::mutex mu;
  std::vector<const MappedFile*> files;
};
Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

std::optional<MappedLocation> locate_mapped(const void* p, int64_t bytes) {
  const auto* b = static_cast<const uint8_t*>(p);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const MappedFile* f : r.files) {
    if (f->data() && b >= f->data() && bytes >= 0 && b + bytes <= f->data() + f->size()) {
      return MappedLocation{f->path(), int64_t(b - f->data()), int64_t(f->size())};
    }
  }
  return std::nullopt;
}

MappedFile::MappedFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", path);
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      fail("{}: mmap failed: {}", path, std::strerror(err));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.files.push_back(this);
}

MappedFile::~MappedFile() {
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    r.files.erase(std::remove(r.files.begin(), r.files.end(), this), r.files.end());
  }
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

void MappedFile::prefault(size_t offset, size_t bytes, const std::function<void(size_t)>& progress) const {
  constexpr size_t kPiece = size_t(64) << 20;
  const long page = ::sysconf(_SC_PAGESIZE);
  const size_t begin = offset / size_t(page) * size_t(page);
  const size_t end = std::min(size_, offset + bytes);
  for (size_t at = begin; at < end; at += kPiece) {
    const size_t len = std::min(kPiece, end - at);
    uint8_t* p = const_cast<uint8_t*>(data_) + at;
#ifdef MADV_POPULATE_READ
    if (::madvise(p, len, MADV_POPULATE_READ) != 0)
#endif
    {
      // Older kernels: touch one byte per page.
      volatile uint8_t sink = 0;
      for (size_t i = 0; i < len; i += size_t(page)) sink = sink + p[i];
    }
    if (progress) progress(std::min(end, at + len) - begin);
  }
}

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot open: {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

int64_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  int64_t kb = 0;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return 0;
}

}  // namespace turbospark
