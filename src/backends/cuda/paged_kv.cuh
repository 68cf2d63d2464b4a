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

inline PagedKv paged_kv(const KvLayerView& kv) {
  return {kv.k, kv.v, kv.block_table, kv.row_seq, kv.max_blocks, kv.block_size, kv.n_kv_heads, kv.head_dim};
}

}  // namespace turbospark::cuda
