// The query vectors of one prefill attention tile and the tile's passes over the sequences
// among them, shared by attention_prefill.cu (f32) and attention_prefill_tc.cu (tensor
// cores). Vector m of a tile is (row row0 + m / group, head kv_head * group + m % group); a
// pass takes every pending vector of the first pending vector's sequence, and the keys
// [min lo, max pos] over them (usually one pass: rows of one sequence).
#pragma once

#include <cstdint>

namespace turbospark::cuda {

template <int kTileQ>
struct PrefillTileQueries {
  long long pos[kTileQ], lo[kTileQ];
  int seq[kTileQ], state[kTileQ];  // 0 pending, 1 in this pass, 2 done or empty
  int cur_seq;
  long long kmin, kmax;

  // Threads tid < kTileQ fill vector tid (next_pass's barrier publishes them).
  __device__ __forceinline__ void init(int tid, int64_t row0, int rows_per_tile, int group, int64_t rows,
                                       const int64_t* __restrict__ positions, int window,
                                       const int32_t* __restrict__ row_seq) {
    if (tid >= kTileQ) return;
    const int64_t t = row0 + tid / group;
    const bool ok = tid < rows_per_tile * group && t < rows;
    const long long p = ok ? positions[t] : 0;
    pos[tid] = p;
    lo[tid] = window > 0 ? max(0ll, p - window + 1) : 0ll;
    seq[tid] = ok ? (row_seq ? row_seq[t] : 0) : -1;
    state[tid] = ok ? 0 : 2;
  }

  // Every thread: thread 0 marks the next pass's vectors (state 1) and its key range; returns
  // its sequence, or -1 when no vector is pending. Barriers on both sides: the previous pass's
  // readers are done before, every thread sees the pass after.
  __device__ __forceinline__ int next_pass(int tid) {
    __syncthreads();
    if (tid == 0) {
      int cur = -1;
      long long k_lo = 0, k_hi = -1;
      for (int m = 0; m < kTileQ; ++m) {
        if (state[m] != 0) continue;
        if (cur < 0) cur = seq[m], k_lo = lo[m], k_hi = pos[m];
        if (seq[m] != cur) continue;
        state[m] = 1;
        k_lo = min(k_lo, lo[m]);
        k_hi = max(k_hi, pos[m]);
      }
      cur_seq = cur;
      kmin = k_lo;
      kmax = k_hi;
    }
    __syncthreads();
    return cur_seq;
  }

  // After a pass: its vectors are done (once every thread has read this pass's states).
  __device__ __forceinline__ void end_pass(int tid) {
    __syncthreads();
    if (tid < kTileQ && state[tid] == 1) state[tid] = 2;
  }
};

}  // namespace turbospark::cuda
