#include "engine/kv_cache.h"

#include <numeric>

#include "core/error.h"

namespace turbospark {

KvCache::KvCache(Backend& backend, std::vector<KvLayerSpec> spec, int64_t max_tokens, int block_size)
    : backend_(backend), spec_(std::move(spec)), type_(backend.kv_type()), max_tokens_(max_tokens), block_size_(block_size) {
  TS_CHECK(max_tokens_ > 0 && block_size_ > 0, "KV cache of {} tokens in blocks of {}", max_tokens_, block_size_);
  n_blocks_ = (max_tokens_ + block_size_ - 1) / block_size_;
  max_blocks_ = int(n_blocks_);
  allocate_pools(backend);
  std::vector<int32_t> identity(static_cast<size_t>(n_blocks_));
  std::iota(identity.begin(), identity.end(), 0);
  block_table_ = backend.alloc_array<int32_t>(n_blocks_);
  backend.upload_array<int32_t>(block_table_, identity);
}

KvCache::KvCache(Backend& backend, std::vector<KvLayerSpec> spec, const KvPoolOptions& o, int block_size)
    : backend_(backend), spec_(std::move(spec)), type_(backend.kv_type()), max_tokens_(o.max_tokens_per_seq),
      block_size_(block_size), n_seqs_(o.n_seqs) {
  TS_CHECK(o.n_seqs >= 1 && o.max_tokens_per_seq > 0 && o.pool_tokens > 0 && block_size_ > 0,
           "KV pool of {} tokens for {} sequences of {} in blocks of {}", o.pool_tokens, o.n_seqs,
           o.max_tokens_per_seq, block_size_);
  n_blocks_ = (o.pool_tokens + block_size_ - 1) / block_size_;
  max_blocks_ = int((max_tokens_ + block_size_ - 1) / block_size_);
  allocate_pools(backend);
  // Unassigned entries point at block 0: never read (a sequence reads only positions it was
  // given), but valid memory for a kernel that loads ahead.
  block_table_ = backend.alloc_array<int32_t>(int64_t(n_seqs_) * max_blocks_);
  backend.upload_array<int32_t>(block_table_, std::vector<int32_t>(size_t(n_seqs_) * size_t(max_blocks_), 0));
  owned_.resize(size_t(n_seqs_));
  free_.resize(size_t(n_blocks_));
  // Popped from the back: block 0 first.
  for (int64_t b = 0; b < n_blocks_; ++b) free_[size_t(b)] = int32_t(n_blocks_ - 1 - b);
}

void KvCache::allocate_pools(Backend& backend) {
  layers_.resize(spec_.size());
  for (size_t i = 0; i < spec_.size(); ++i) {
    const int64_t elems = n_blocks_ * block_size_ * spec_[i].n_kv_heads * spec_[i].head_dim;
    // A layer without a cache of its own (0 KV heads: linear attention, or KV shared with an
    // earlier layer) gets no pool.
    if (elems == 0) continue;
    layers_[i].k = backend.alloc_bytes(elems * kv_type_bytes(type_));
    layers_[i].v = backend.alloc_bytes(elems * kv_type_bytes(type_));
  }
}

void KvCache::reserve(int64_t n_tokens) {
  TS_CHECK(owned_.empty(), "KvCache::reserve is for one-sequence caches; a pool grows per sequence");
  TS_CHECK(n_tokens <= max_tokens_, "KV cache request for {} tokens exceeds its capacity {}", n_tokens, max_tokens_);
  used_blocks_ = std::max(used_blocks_, (n_tokens + block_size_ - 1) / block_size_);
}

bool KvCache::grow(int seq, int64_t n_tokens) {
  TS_CHECK(!owned_.empty() && seq >= 0 && seq < n_seqs_, "KV pool: sequence {} outside [0, {})", seq, n_seqs_);
  TS_CHECK(n_tokens <= max_tokens_, "KV cache request for {} tokens exceeds the context of {}", n_tokens, max_tokens_);
  std::vector<int32_t>& mine = owned_[size_t(seq)];
  const size_t need = size_t((n_tokens + block_size_ - 1) / block_size_);
  if (need <= mine.size()) return true;
  if (need - mine.size() > free_.size()) return false;
  const size_t first = mine.size();
  while (mine.size() < need) {
    mine.push_back(free_.back());
    free_.pop_back();
  }
  used_blocks_ += int64_t(need - first);
  backend_.upload_array<int32_t>(block_table_, std::span<const int32_t>(mine.data() + first, need - first),
                                 int64_t(seq) * max_blocks_ + int64_t(first));
  return true;
}

void KvCache::release(int seq) {
  TS_CHECK(!owned_.empty() && seq >= 0 && seq < n_seqs_, "KV pool: sequence {} outside [0, {})", seq, n_seqs_);
  std::vector<int32_t>& mine = owned_[size_t(seq)];
  used_blocks_ -= int64_t(mine.size());
  // Back in reverse so the next grow takes them in the same order.
  for (auto it = mine.rbegin(); it != mine.rend(); ++it) free_.push_back(*it);
  mine.clear();
}

KvLayerView KvCache::layer(int i) const {
  const LayerPools& L = layers_[size_t(i)];
  KvLayerView v;
  v.k = L.k.get();
  v.v = L.v.get();
  v.block_table = block_table_.data();
  v.max_blocks = max_blocks_;
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
