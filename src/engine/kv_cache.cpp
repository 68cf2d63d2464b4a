#include "engine/kv_cache.h"

#include <numeric>

#include "core/error.h"

namespace turbospark {

KvCache::KvCache(Backend& backend, std::vector<KvLayerSpec> spec, int64_t max_tokens, int block_size)
    : spec_(std::move(spec)), type_(backend.kv_type()), max_tokens_(max_tokens), block_size_(block_size) {
  TS_CHECK(max_tokens_ > 0 && block_size_ > 0, "KV cache of {} tokens in blocks of {}", max_tokens_, block_size_);
  n_blocks_ = (max_tokens_ + block_size_ - 1) / block_size_;
  layers_.resize(spec_.size());
  for (size_t i = 0; i < spec_.size(); ++i) {
    const int64_t elems = n_blocks_ * block_size_ * spec_[i].n_kv_heads * spec_[i].head_dim;
    // A layer without a cache of its own (0 KV heads: linear attention, or KV shared with an
    // earlier layer) gets no pool.
    if (elems == 0) continue;
    layers_[i].k = backend.alloc_bytes(elems * kv_type_bytes(type_));
    layers_[i].v = backend.alloc_bytes(elems * kv_type_bytes(type_));
  }
  std::vector<int32_t> identity(static_cast<size_t>(n_blocks_));
  std::iota(identity.begin(), identity.end(), 0);
  block_table_ = backend.alloc_array<int32_t>(n_blocks_);
  backend.upload_array<int32_t>(block_table_, identity);
}

void KvCache::reserve(int64_t n_tokens) {
  TS_CHECK(n_tokens <= max_tokens_, "KV cache request for {} tokens exceeds its capacity {}", n_tokens, max_tokens_);
  used_blocks_ = std::max(used_blocks_, (n_tokens + block_size_ - 1) / block_size_);
}

KvLayerView KvCache::layer(int i) const {
  const LayerPools& L = layers_[size_t(i)];
  KvLayerView v;
  v.k = L.k.get();
  v.v = L.v.get();
  v.block_table = block_table_.data();
  v.max_blocks = int(n_blocks_);
  v.block_size = block_size_;
  v.n_kv_heads = spec_[size_t(i)].n_kv_heads;
  v.head_dim = spec_[size_t(i)].head_dim;
  v.type = type_;
  return v;
}

int64_t KvCache::used_bytes() const {
  int64_t total = 0;
  for (const KvLayerSpec& s : spec_) total += 2 * used_blocks_ * block_size_ * s.n_kv_heads * s.head_dim * kv_type_bytes(type_);
  return total;
}

int64_t KvCache::pool_bytes() const {
  int64_t total = 0;
  for (const KvLayerSpec& s : spec_) total += 2 * n_blocks_ * block_size_ * s.n_kv_heads * s.head_dim * kv_type_bytes(type_);
  return total;
}

}  // namespace turbospark
