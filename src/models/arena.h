// Carving activation matrices out of one backend allocation: per-forward workspaces and
// per-sequence states list their matrices once, then get them in a single alloc.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <utility>

#include "core/tensor.h"
#include "ops/backend.h"

namespace turbospark {

// Plan every matrix, allocate once, then take them in the planned order. Each matrix
// starts 16 floats (64 bytes) after the previous one's start rounding, so rows of
// different matrices never share a cache line.
class Arena {
 public:
  void plan(int64_t rows, int64_t cols) { total_ += padded(rows * cols); }
  void allocate(Backend& be) {
    storage_ = be.alloc(total_);
    next_ = storage_.get();
  }
  Mat take(int64_t rows, int64_t cols) {
    Mat m(next_, rows, cols);
    next_ += padded(rows * cols);
    return m;
  }
  std::shared_ptr<float> storage() const { return storage_; }
  int64_t total_floats() const { return total_; }

 private:
  static int64_t padded(int64_t n) { return (n + 15) / 16 * 16; }
  int64_t total_ = 0;
  std::shared_ptr<float> storage_;
  float* next_ = nullptr;
};

// Points each Mat at [rows, cols] of one allocation (cols < 1 counts as 1) and returns the
// storage that keeps them alive.
inline std::shared_ptr<float> allocate_mats(Backend& be, int64_t rows,
                                            std::initializer_list<std::pair<Mat*, int64_t>> mats) {
  Arena arena;
  for (const auto& [m, cols] : mats) arena.plan(rows, cols < 1 ? 1 : cols);
  arena.allocate(be);
  for (const auto& [m, cols] : mats) *m = arena.take(rows, cols < 1 ? 1 : cols);
  return arena.storage();
}

}  // namespace turbospark
