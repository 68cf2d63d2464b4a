// Paged KV cache: fixed-size blocks of `block_size` positions per layer plus one block
// table per sequence, so a scheduler can later share one pool among many sequences. Blocks
// come from the backend (host memory on CPU, device memory on CUDA).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "models/model.h"
#include "ops/backend.h"

namespace turbospark {

constexpr int kKvBlockSize = 16;

class KvCache {
 public:
  KvCache(Backend& backend, std::vector<KvLayerSpec> spec, int64_t max_tokens, int block_size = kKvBlockSize);

  // Makes positions [0, n_tokens) addressable, allocating blocks as needed.
  void reserve(int64_t n_tokens);
  KvLayerView layer(int i) const;
  int n_layers() const { return int(spec_.size()); }
  int64_t capacity() const { return max_tokens_; }
  int64_t allocated_bytes() const;

 private:
  struct LayerBlocks {
    std::vector<std::shared_ptr<float>> k_storage, v_storage;
    std::vector<float*> k, v;  // raw block pointers the kernels index by block id
  };
  Backend& backend_;
  std::vector<KvLayerSpec> spec_;
  int64_t max_tokens_;
  int block_size_;
  std::vector<LayerBlocks> layers_;
  std::vector<int32_t> block_table_;  // logical block -> physical block id (one sequence)
};

}  // namespace turbospark
