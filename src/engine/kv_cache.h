// Paged KV cache: per layer one pool of fixed-size blocks of `block_size` positions, plus a
// block table per sequence mapping its logical blocks to physical ones, so a scheduler can
// later share one pool among many sequences. Pools and table are backend memory (host
// memory on CPU, device memory on CUDA), allocated once for the whole capacity so their
// addresses never change (a captured CUDA graph keeps reading them); the CPU backend's
// large allocations are lazily zeroed pages, so unused capacity costs address space only.
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

  // Makes positions [0, n_tokens) addressable.
  void reserve(int64_t n_tokens);
  KvLayerView layer(int i) const;
  int n_layers() const { return int(spec_.size()); }
  int64_t capacity() const { return max_tokens_; }
  // Bytes of the blocks that hold the positions reserved so far, over every layer.
  int64_t used_bytes() const;
  // Bytes of the pools (the whole capacity).
  int64_t pool_bytes() const;

 private:
  struct LayerPools {
    std::shared_ptr<void> k, v;  // [n_blocks, block_size, n_kv_heads, head_dim] of type_, or null
  };
  std::vector<KvLayerSpec> spec_;
  KvType type_;  // the backend's (Backend::kv_type)
  int64_t max_tokens_;
  int block_size_;
  int64_t n_blocks_;
  int64_t used_blocks_ = 0;
  std::vector<LayerPools> layers_;
  // One sequence: logical block i is physical block i.
  BackendArray<int32_t> block_table_;  // [n_blocks]
};

}  // namespace turbospark
