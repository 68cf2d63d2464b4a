#include "engine/kv_cache.h"

#include "core/error.h"

namespace turbospark {

KvCache::KvCache(Backend& backend, std::vector<KvLayerSpec> spec, int64_t max_tokens, int block_size)
    : backend_(backend), spec_(std::move(spec)), max_tokens_(max_tokens), block_size_(block_size) {
  layers_.resize(spec_.size());
}

void KvCache::reserve(int64_t n_tokens) {
  TS_CHECK(n_tokens <= max_tokens_, "KV cache request for {} tokens exceeds its capacity {}", n_tokens, max_tokens_);
  const int64_t blocks_needed = (n_tokens + block_size_ - 1) / block_size_;
  while (int64_t(block_table_.size()) < blocks_needed) {
    const int32_t id = int32_t(block_table_.size());
    for (size_t i = 0; i < spec_.size(); ++i) {
      const int64_t floats = int64_t(block_size_) * spec_[i].n_kv_heads * spec_[i].head_dim;
      LayerBlocks& L = layers_[i];
      // A layer without a cache of its own (0 KV heads: linear attention, or KV shared with
      // an earlier layer) gets null blocks, never storage.
      L.k_storage.push_back(floats > 0 ? backend_.alloc(floats) : nullptr);
      L.v_storage.push_back(floats > 0 ? backend_.alloc(floats) : nullptr);
      L.k.push_back(L.k_storage.back().get());
      L.v.push_back(L.v_storage.back().get());
    }
    block_table_.push_back(id);
  }
}

KvLayerView KvCache::layer(int i) const {
  const LayerBlocks& L = layers_[size_t(i)];
  KvLayerView v;
  v.k_blocks = L.k.data();
  v.v_blocks = L.v.data();
  v.block_table = block_table_.data();
  v.block_size = block_size_;
  v.n_kv_heads = spec_[size_t(i)].n_kv_heads;
  v.head_dim = spec_[size_t(i)].head_dim;
  return v;
}

int64_t KvCache::allocated_bytes() const {
  int64_t total = 0;
  for (size_t i = 0; i < spec_.size(); ++i) {
    total += 2 * int64_t(layers_[i].k.size()) * block_size_ * spec_[i].n_kv_heads * spec_[i].head_dim * 4;
  }
  return total;
}

}  // namespace turbospark
