#include "engine/kv_cache.h"

#include <algorithm>
#include <numeric>

#define XXH_INLINE_ALL  // header-only, as in the expert store
#include <xxhash.h>

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
  registered_.assign(size_t(n_seqs_), 0);
  chain_.assign(size_t(n_seqs_), 0);
  free_.resize(size_t(n_blocks_));
  // Popped from the back: block 0 first.
  for (int64_t b = 0; b < n_blocks_; ++b) free_[size_t(b)] = int32_t(n_blocks_ - 1 - b);
  refs_.assign(size_t(n_blocks_), 0);
  meta_.resize(size_t(n_blocks_));
  lru_at_.resize(size_t(n_blocks_), evictable_.end());
}

int32_t KvCache::take_block() {
  int32_t b;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else {
    TS_CHECK(!evictable_.empty(), "KV pool: no block to take");
    b = evictable_.front();
    evictable_.pop_front();
    lru_at_[size_t(b)] = evictable_.end();
    auto it = cache_.find(meta_[size_t(b)].hash);
    if (it != cache_.end() && it->second == b) cache_.erase(it);
    meta_[size_t(b)] = Cached{};
  }
  refs_[size_t(b)] = 1;
  return b;
}

static uint64_t block_hash(uint64_t parent, const int32_t* tokens, int n) {
  return uint64_t(XXH3_64bits_withSeed(tokens, size_t(n) * sizeof(int32_t), parent));
}

int64_t KvCache::attach_prefix(int seq, std::span<const int32_t> tokens, int64_t max_tokens) {
  TS_CHECK(!owned_.empty() && seq >= 0 && seq < n_seqs_, "KV pool: sequence {} outside [0, {})", seq, n_seqs_);
  std::vector<int32_t>& mine = owned_[size_t(seq)];
  TS_CHECK(mine.empty(), "KV pool: a prefix attaches to an empty sequence ({} holds {} blocks)", seq, mine.size());
  const int64_t limit = std::min({int64_t(tokens.size()), max_tokens, max_tokens_});
  uint64_t h = 0;
  for (int64_t i = 0; (i + 1) * block_size_ <= limit; ++i) {
    const int32_t* t = tokens.data() + i * block_size_;
    const uint64_t next = block_hash(h, t, block_size_);
    auto it = cache_.find(next);
    if (it == cache_.end()) break;
    const int32_t b = it->second;
    const std::vector<int32_t>& kept = meta_[size_t(b)].tokens;
    if (!std::equal(kept.begin(), kept.end(), t, t + block_size_)) break;  // a hash collision
    if (refs_[size_t(b)]++ == 0) {
      evictable_.erase(lru_at_[size_t(b)]);
      lru_at_[size_t(b)] = evictable_.end();
    }
    mine.push_back(b);
    h = next;
  }
  if (mine.empty()) return 0;
  used_blocks_ += int64_t(mine.size());
  registered_[size_t(seq)] = int64_t(mine.size());
  chain_[size_t(seq)] = h;
  backend_.upload_array<int32_t>(block_table_, std::span<const int32_t>(mine), int64_t(seq) * max_blocks_);
  return int64_t(mine.size()) * block_size_;
}

void KvCache::register_prefix(int seq, std::span<const int32_t> tokens) {
  TS_CHECK(!owned_.empty() && seq >= 0 && seq < n_seqs_, "KV pool: sequence {} outside [0, {})", seq, n_seqs_);
  const std::vector<int32_t>& mine = owned_[size_t(seq)];
  const int64_t full = std::min<int64_t>(int64_t(tokens.size()) / block_size_, int64_t(mine.size()));
  uint64_t h = chain_[size_t(seq)];
  for (int64_t i = registered_[size_t(seq)]; i < full; ++i) {
    const int32_t* t = tokens.data() + i * block_size_;
    h = block_hash(h, t, block_size_);
    const int32_t b = mine[size_t(i)];
    // Another block may hold the same prefix already (two sequences read it at once): the
    // first stays the cached one, this one is freed on release.
    if (cache_.emplace(h, b).second) meta_[size_t(b)] = Cached{h, std::vector<int32_t>(t, t + block_size_)};
  }
  if (full > registered_[size_t(seq)]) {
    registered_[size_t(seq)] = full;
    chain_[size_t(seq)] = h;
  }
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
  if (int64_t(need - mine.size()) > free_blocks()) return false;
  const size_t first = mine.size();
  while (mine.size() < need) mine.push_back(take_block());
  used_blocks_ += int64_t(need - first);
  backend_.upload_array<int32_t>(block_table_, std::span<const int32_t>(mine.data() + first, need - first),
                                 int64_t(seq) * max_blocks_ + int64_t(first));
  return true;
}

void KvCache::release(int seq) {
  TS_CHECK(!owned_.empty() && seq >= 0 && seq < n_seqs_, "KV pool: sequence {} outside [0, {})", seq, n_seqs_);
  std::vector<int32_t>& mine = owned_[size_t(seq)];
  used_blocks_ -= int64_t(mine.size());
  // In reverse: free ones so the next grow takes them in the same order, registered ones so a
  // sequence's last blocks are evicted before its first (a prefix stays useful without its
  // tail; a tail is useless without its prefix).
  for (auto it = mine.rbegin(); it != mine.rend(); ++it) {
    const int32_t b = *it;
    if (--refs_[size_t(b)] > 0) continue;
    if (meta_[size_t(b)].tokens.empty()) {
      free_.push_back(b);
    } else {
      evictable_.push_back(b);
      lru_at_[size_t(b)] = std::prev(evictable_.end());
    }
  }
  mine.clear();
  registered_[size_t(seq)] = 0;
  chain_[size_t(seq)] = 0;
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

namespace turbospark {

void KvCache::check_invariants() const {
  if (owned_.empty()) return;
  std::vector<int32_t> held(size_t(n_blocks_), 0);
  for (const auto& mine : owned_)
    for (int32_t b : mine) held[size_t(b)]++;
  std::vector<int> where(size_t(n_blocks_), 0);  // 1 free, 2 evictable
  for (int32_t b : free_) {
    TS_CHECK(where[size_t(b)] == 0, "KV pool: block {} twice in the free list", b);
    where[size_t(b)] = 1;
    TS_CHECK(meta_[size_t(b)].tokens.empty(), "KV pool: free block {} is registered", b);
  }
  for (int32_t b : evictable_) {
    TS_CHECK(where[size_t(b)] == 0, "KV pool: block {} both free and evictable (or twice evictable)", b);
    where[size_t(b)] = 2;
    TS_CHECK(!meta_[size_t(b)].tokens.empty(), "KV pool: evictable block {} is not registered", b);
  }
  for (int64_t b = 0; b < n_blocks_; ++b) {
    TS_CHECK(refs_[size_t(b)] == held[size_t(b)], "KV pool: block {} has {} references, {} table rows hold it", b,
             refs_[size_t(b)], held[size_t(b)]);
    TS_CHECK((held[size_t(b)] > 0) == (where[size_t(b)] == 0), "KV pool: block {} held {} times, in list {}", b,
             held[size_t(b)], where[size_t(b)]);
  }
  for (const auto& [h, b] : cache_)
    TS_CHECK(meta_[size_t(b)].hash == h && !meta_[size_t(b)].tokens.empty(),
             "KV pool: the prefix index maps {:016x} to block {}, registered as {:016x}", h, b, meta_[size_t(b)].hash);
  for (int64_t b = 0; b < n_blocks_; ++b)
    if (!meta_[size_t(b)].tokens.empty()) {
      auto it = cache_.find(meta_[size_t(b)].hash);
      TS_CHECK(it != cache_.end() && it->second == b, "KV pool: block {} registered but not indexed", b);
    }
}

}  // namespace turbospark
