// The paged KV cache as the attention kernels read it: KvLayerView's fields by value (a
// kernel argument), without its host-side helpers.
#pragma once

#include <cstdint>

#include "ops/backend.h"

namespace turbospark::cuda {

struct PagedKv {
  const float* k;
  const float* v;
  const int32_t* block_table;
  const int32_t* row_seq;
  int max_blocks;
  int block_size;
  int n_kv_heads;
  int head_dim;
};

// Float offset of position p's row of kv head h in the pools, through one sequence's block
// table (32-bit division: positions < 2^31, and a 64-bit one per key costs more than the load).
__device__ __forceinline__ int64_t pool_offset(const PagedKv& kv, const int32_t* table, long long p, int h) {
  const unsigned pu = unsigned(p), blk = pu / unsigned(kv.block_size);
  return (int64_t(table[blk]) * kv.block_size + (pu - blk * unsigned(kv.block_size))) * kv.n_kv_heads * kv.head_dim +
         int64_t(h) * kv.head_dim;
}

inline PagedKv paged_kv(const KvLayerView& kv) {
  return {kv.k, kv.v, kv.block_table, kv.row_seq, kv.max_blocks, kv.block_size, kv.n_kv_heads, kv.head_dim};
}

}  // namespace turbospark::cuda
