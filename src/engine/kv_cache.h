// Paged KV cache: per layer one pool of fixed-size blocks of `block_size` positions, plus a
// block table per sequence mapping its logical blocks to physical ones, so a scheduler can
// later share one pool among many sequences. Pools and table are backend memory (host
// memory on CPU, device memory on CUDA), allocated once for the whole capacity so their
// addresses never change (a captured CUDA graph keeps reading them); the CPU backend's
// large allocations are lazily zeroed pages, so unused capacity costs address space only.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "models/model.h"
#include "ops/backend.h"

namespace turbospark {

constexpr int kKvBlockSize = 16;

// Several sequences sharing one pool (continuous batching): each sequence's table row starts
// empty and grows from a free list of blocks as it is given positions.
//
// Prefix caching: a full block whose tokens a sequence has written can be registered under
// the hash of its whole token prefix (the chain of block hashes, the block's tokens kept to
// rule out collisions); a new sequence whose tokens begin the same way attaches those blocks
// instead of computing them (reference counted, never written again: a sequence writes only
// past its attached prefix, into blocks of its own). Released blocks that are registered stay
// cached until the free list runs dry, then go least recently released first.
struct KvPoolOptions {
  int n_seqs = 1;
  int64_t max_tokens_per_seq = 0;  // the context of one sequence
  int64_t pool_tokens = 0;         // positions the pool holds over all sequences
};

class KvCache {
 public:
  // One sequence owning the whole pool: logical block i is physical block i.
  KvCache(Backend& backend, std::vector<KvLayerSpec> spec, int64_t max_tokens, int block_size = kKvBlockSize);
  // A pool shared by o.n_seqs sequences.
  KvCache(Backend& backend, std::vector<KvLayerSpec> spec, const KvPoolOptions& o, int block_size = kKvBlockSize);

  // Makes positions [0, n_tokens) addressable (one-sequence caches).
  void reserve(int64_t n_tokens);
  // Makes positions [0, n_tokens) of sequence seq addressable, taking blocks from the free list
  // (uploads the table row's new entries); false, with nothing taken, when too few are free.
  bool grow(int seq, int64_t n_tokens);
  // Gives sequence seq's blocks back (registered ones stay cached, the rest are free).
  void release(int seq);
  // Prefix caching (pools only): an empty sequence seq attaches the cached blocks that hold
  // the longest prefix of `tokens` made of whole blocks and returns its length in tokens (0
  // when none). At most max_tokens are matched (a caller that needs the logits of the prompt's
  // last token passes one less than its length).
  int64_t attach_prefix(int seq, std::span<const int32_t> tokens, int64_t max_tokens);
  // Registers sequence seq's full blocks, whose positions hold `tokens` (its tokens so far),
  // for later attach_prefix calls. Idempotent; cheap when nothing new filled up.
  void register_prefix(int seq, std::span<const int32_t> tokens);
  // Blocks a grow can take: free ones plus cached ones no sequence holds.
  int64_t free_blocks() const { return int64_t(free_.size() + evictable_.size()); }
  int64_t cached_blocks() const { return int64_t(cache_.size()); }
  // Checks the pool's bookkeeping (reference counts against the table rows, the free and
  // eviction lists, the prefix index); throws naming the first inconsistency. For tests.
  void check_invariants() const;
  int64_t total_blocks() const { return n_blocks_; }
  int block_size() const { return block_size_; }
  int64_t seq_tokens(int seq) const { return int64_t(owned_[size_t(seq)].size()) * block_size_; }
  KvLayerView layer(int i) const;
  int n_layers() const { return int(spec_.size()); }
  int n_seqs() const { return n_seqs_; }
  int64_t capacity() const { return max_tokens_; }
  // Bytes of the blocks that hold the positions reserved so far, over every layer.
  int64_t used_bytes() const;
  // Bytes of the pools (the whole capacity).
  int64_t pool_bytes() const;

 private:
  void allocate_pools(Backend& backend);

  struct LayerPools {
    std::shared_ptr<void> k, v;  // [n_blocks, block_size, n_kv_heads, head_dim] of type_, or null
  };
  Backend& backend_;
  std::vector<KvLayerSpec> spec_;
  KvType type_;  // the backend's (Backend::kv_type)
  int64_t max_tokens_;  // per sequence
  int block_size_;
  int64_t n_blocks_;    // in the pool
  int n_seqs_ = 1;
  int max_blocks_ = 0;  // table row length: blocks of one sequence's context
  int64_t used_blocks_ = 0;
  std::vector<LayerPools> layers_;
  BackendArray<int32_t> block_table_;  // [n_seqs, max_blocks]
  std::vector<std::vector<int32_t>> owned_;  // per sequence, its blocks in logical order (pools)
  std::vector<int32_t> free_;                 // free physical blocks (pools)
  // Prefix caching.
  struct Cached {
    uint64_t hash = 0;            // of the whole prefix through this block
    std::vector<int32_t> tokens;  // the block's own tokens
  };
  int32_t take_block();                        // free first, else the oldest evictable cached one
  std::vector<int32_t> refs_;                  // per block: sequences holding it
  std::vector<Cached> meta_;                   // per block: its registration (tokens empty: none)
  std::unordered_map<uint64_t, int32_t> cache_;  // prefix hash -> block
  std::list<int32_t> evictable_;               // cached blocks no sequence holds, oldest first
  std::vector<std::list<int32_t>::iterator> lru_at_;  // per block: its place in evictable_
  std::vector<int64_t> registered_;            // per sequence: its leading blocks registered
  std::vector<uint64_t> chain_;                // per sequence: the hash through its last registered block
};

}  // namespace turbospark
