// The paged KV cache as the attention kernels read it: KvLayerView's fields by value (a
// kernel argument), without its host-side helpers. The CUDA backend's pools are bf16
// (Backend::kv_type): values enter the attention math as exact f32.
#pragma once

#include <cstdint>

#include "backends/cuda/common.cuh"
#include "ops/backend.h"

namespace turbospark::cuda {

struct PagedKv {
  const uint16_t* k;  // bf16 bits
  const uint16_t* v;
  const int32_t* block_table;
  const int32_t* row_seq;
  int max_blocks;
  int block_size;
  int n_kv_heads;
  int head_dim;
};

// Element offset of position p's row of kv head h in the pools, through one sequence's block
// table (32-bit division: positions < 2^31, and a 64-bit one per key costs more than the load).
__device__ __forceinline__ int64_t pool_offset(const PagedKv& kv, const int32_t* table, long long p, int h) {
  const unsigned pu = unsigned(p), blk = pu / unsigned(kv.block_size);
  return (int64_t(table[blk]) * kv.block_size + (pu - blk * unsigned(kv.block_size))) * kv.n_kv_heads * kv.head_dim +
         int64_t(h) * kv.head_dim;
}

// Four bf16 at p (8-byte aligned) as exact floats: a bf16 is the top half of its f32.
__device__ __forceinline__ float4 load_bf16x4(const uint16_t* p) {
  const uint2 u = __ldg(reinterpret_cast<const uint2*>(p));
  return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                     __uint_as_float(u.y & 0xffff0000u));
}

// x rounded to bf16 (nearest even), as the bits a pool stores.
__device__ __forceinline__ uint16_t f32_to_bf16_bits(float x) {
  const __nv_bfloat16 b = __float2bfloat16_rn(x);
  return *reinterpret_cast<const uint16_t*>(&b);
}

// Refuses pools that are not bf16 (a view made for another backend), by name.
void check_bf16_pools(const char* op, const KvLayerView& kv);
// The checks every attention launcher makes of q, out and the cache (attention_decode.cu),
// failing with the op's name and the shapes.
void check_attention_shapes(const char* op, const Mat& q, const KvLayerView& kv, int n_heads, const Mat& out);

inline PagedKv paged_kv(const KvLayerView& kv) {
  return {static_cast<const uint16_t*>(kv.k),
          static_cast<const uint16_t*>(kv.v),
          kv.block_table,
          kv.row_seq,
          kv.max_blocks,
          kv.block_size,
          kv.n_kv_heads,
          kv.head_dim};
}

}  // namespace turbospark::cuda
