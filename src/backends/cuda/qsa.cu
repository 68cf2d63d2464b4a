// QSA sparse attention on the GPU (Backend::qsa_select, attention_selected), with no score
// read back and no wait mid-layer (the seed's rule): the selection stays in device memory and
// the attention reads it there.
//
// qsa_select is three launches:
//  1. store: each row's raw index key into the layer's key table at its position;
//  2. complete: every block of `ratio` keys whose last position this micro-batch wrote is
//     mean-pooled, RMS-normed with (1 + w) and rotated at its first position into block_keys
//     (which blocks: from positions[0] / ratio up to (positions[n-1] + 1) / ratio, read on the
//     device; the grid covers the most a micro-batch of n rows can complete, ceil(n / r) + 1);
//  3. select: a block per query row scores its complete blocks, sum over index heads of
//     relu(q_h . k_b) / sqrt(d) (a warp per key block), then picks the top budget / ratio
//     blocks as torch.topk does on the CPU, ties included (ops/topk_like_torch.h: the goldens'
//     selections hinge on ties at relu 0), and writes their positions plus the incomplete tail.
//     The pick: a radix select (four 8-bit passes, every thread) finds the k-th largest score;
//     when every block scoring that much is taken, no tie straddles the cutoff and the set is
//     exactly the blocks at or above it, whatever algorithm chose them. Only when a tie does
//     straddle it (or a score is NaN) does one thread replay torch's sequence of swaps
//     (O(n_blocks log k) dependent shared-memory steps; before the threshold path every row
//     took it, and the QSA indexer was 0.95 ms of a 3.83 ms decode step at 16k context on the
//     Flash-Next shape, top-128 of 1024 blocks in two layers, H100). The scores live in
//     shared memory, 8 bytes per key block, while max_context / ratio blocks fit (28k on the
//     H200); past that in global memory (the backend's spill scratch), a grid of kSpillBlocks
//     walking the rows.
// attention_selected: a block per (row, head); a warp per selected key for the q.k products
// (bf16 pool rows as exact floats), the softmax over the block, then a thread per output dim
// summing p_i v_i over the selection. Steps of up to kSplitMaxRows rows (decode) split each
// selection into pieces of kSplitKeys keys, a block per (row, head, piece) writing its partial
// maximum, sum and unnormalized output, and a second launch combines the pieces: a decode step
// over a 2k-position selection otherwise runs as n_heads blocks whose threads each walk all
// 2k values in turn (Flash-Next shape on an H100, 8 layers: decode after 2k tokens 125 tok/s
// against 404 after 16).
//
// Math as backends/cpu/hybrid_ops.cpp (pooling summed in key order then divided; sum over
// heads in order; softmax weights divided before the sum); the products' summation order
// differs (lanes), within f32 rounding.
//
// Bound: the selection's scoring reads n_blocks x d floats per row and head (at decode, a few
// hundred KB at 32k context) on one SM per row; the threshold pick reads the scores five times.
#include <algorithm>

#include "backends/cuda/common.cuh"
#include "backends/cuda/matmul.h"
#include "backends/cuda/ops.h"
#include "backends/cuda/paged_kv.cuh"
#include "ops/topk_like_torch.h"

namespace turbospark::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kSelectThreads = 256;
constexpr int64_t kSpillBlocks = 264;  // two per SM on the H200: rows beyond walk the grid
constexpr int kSplitKeys = 64;         // attention_selected: selected keys per piece
constexpr int64_t kSplitMaxRows = 16;  // steps of up to this many rows take the split paths
constexpr int kScoreKeysPerCta = 16;   // split scoring: key blocks per CTA (two per warp)

__global__ void __launch_bounds__(kThreads)
    qsa_store_kernel(const float* __restrict__ raw, int64_t raw_stride, const int64_t* __restrict__ positions,
                     float* table, int64_t table_stride, int d) {
  pdl_begin();
  const int64_t t = blockIdx.x;
  const int64_t p = positions[t];
  for (int i = threadIdx.x; i < d; i += kThreads) table[p * table_stride + i] = raw[t * raw_stride + i];
}

__global__ void __launch_bounds__(kThreads)
    qsa_complete_kernel(const float* __restrict__ table, int64_t table_stride, const int64_t* __restrict__ positions,
                        int64_t rows, int ratio, const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                        int rotary_dim, float eps, float* block_keys, int64_t bk_stride, int d) {
  pdl_begin();
  extern __shared__ float pooled[];  // [d]
  __shared__ float red[kWarp];
  const int64_t first_block = positions[0] / ratio, end_block = (positions[rows - 1] + 1) / ratio;
  const int64_t blk = first_block + blockIdx.x;
  if (blk >= end_block) return;  // uniform across the block
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < d; i += kThreads) {
    float acc = 0.f;
    for (int j = 0; j < ratio; ++j) acc += table[(blk * ratio + j) * table_stride + i];
    acc /= float(ratio);
    pooled[i] = acc;
    sum_sq += acc * acc;
  }
  sum_sq = block_sum(sum_sq, red);  // also publishes `pooled`
  const float inv_rms = 1.f / sqrtf(sum_sq / float(d) + eps);
  for (int i = threadIdx.x; i < d; i += kThreads) pooled[i] = (pooled[i] * inv_rms) * (k_norm[i] + 1.f);
  __syncthreads();
  const int half = rotary_dim / 2;
  const float pos = float(blk * ratio);
  float* out = block_keys + blk * bk_stride;
  for (int i = threadIdx.x; i < d; i += kThreads) {
    float v = pooled[i];
    if (i < rotary_dim) {
      const int pair = i < half ? i : i - half;
      float s, c;
      sincosf(pos * inv_freq[pair], &s, &c);
      const float a = pooled[pair], b = pooled[pair + half];
      v = i < half ? __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)) : __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
    out[i] = v;
  }
}

// Order-preserving unsigned key of a non-NaN score: a > b exactly when key(a) > key(b), with
// -0 and +0 one key (they tie under the `>` the emulation compares with).
__device__ __forceinline__ uint32_t score_key(float x) {
  const uint32_t u = __float_as_uint(x == 0.f ? 0.f : x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Inclusive prefix sum over the block (kSelectThreads threads); `warp_totals` is kWarp ints of
// shared memory. Contains __syncthreads.
__device__ __forceinline__ int block_inclusive_scan(int v, int* warp_totals) {
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int o = 1; o < kWarp; o <<= 1) {
    const int up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += up;
  }
  __syncthreads();  // warp_totals may still be read by a previous call
  if (lane == kWarp - 1) warp_totals[warp] = v;
  __syncthreads();
  for (int w = 0; w < warp; ++w) v += warp_totals[w];
  return v;
}

// The k-th largest key among scored[0, n) (1 <= k <= n), by four 8-bit radix passes whose
// histograms have a bin per thread. Returns the key; `*taken_at_key` = how many elements equal
// to it the top k take, `*at_key` = how many there are. Every thread gets the results.
__device__ uint32_t radix_kth_key(const ScoredIndex* scored, int n, int k, int* taken_at_key, int* at_key,
                                  int* hist, int* warp_totals, int* found) {
  static_assert(kSelectThreads == 256, "a histogram bin per thread");
  uint32_t prefix = 0, mask = 0;
  int want = k, equal = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    hist[threadIdx.x] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += kSelectThreads) {
      const uint32_t key = score_key(scored[i].score);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1);
    }
    __syncthreads();
    // Thread t holds bin 255 - t: the inclusive scan counts the elements at or above its bin.
    const int bin = kSelectThreads - 1 - int(threadIdx.x), count = hist[bin];
    const int at_or_above = block_inclusive_scan(count, warp_totals), above = at_or_above - count;
    if (above < want && want <= at_or_above) {  // exactly one bin
      found[0] = bin;
      found[1] = above;
      found[2] = count;
    }
    __syncthreads();
    prefix |= uint32_t(found[0]) << shift;
    mask |= 0xffu << shift;
    want -= found[1];
    equal = found[2];
    __syncthreads();  // `found` is written again by the next pass
  }
  *taken_at_key = want;
  *at_key = equal;
  return prefix;
}

// The relu'd score of key block `blk` against a row's index q (n_heads x d), by one warp;
// lane 0's value is the score, already scaled by 1 / sqrt(d).
__device__ __forceinline__ float block_score(const float* q, const float* __restrict__ kb, int n_heads, int d,
                                             int lane) {
  float s = 0.f;
  for (int h = 0; h < n_heads; ++h) {
    float dot = 0.f;
    for (int i = lane; i < d; i += kWarp) dot += q[int64_t(h) * d + i] * kb[i];
    dot = warp_sum(dot);
    s += dot < 0.f ? 0.f : dot;  // std::max(dot, 0.f), as the CPU: a NaN stays NaN
  }
  return s * (1.f / sqrtf(float(d)));
}

// Split scoring (steps of a few rows: decode): a CTA per (kScoreKeysPerCta key blocks, row),
// the grid walking the blocks, each CTA with the row's index q in shared memory. One CTA per
// row would leave a decode step's scoring on one SM (Flash-Next shape at 16k context: 1024
// blocks x 8 heads x 128 dims in 0.35 ms per layer on an H100).
__global__ void __launch_bounds__(kSelectThreads)
    qsa_score_kernel(const float* __restrict__ index_q, int64_t q_stride, const int64_t* __restrict__ positions,
                     const float* __restrict__ block_keys, int64_t bk_stride, int n_heads, int d, int ratio,
                     ScoredIndex* scores, int64_t scores_stride, int32_t* nan_score) {
  pdl_begin();
  extern __shared__ float q_s[];  // [n_heads * d]
  const int64_t t = blockIdx.y;
  const int n_blocks = int((positions[t] + 1) / ratio);
  if (int64_t(blockIdx.x) * kScoreKeysPerCta >= n_blocks) return;  // uniform across the CTA
  const float* q = index_q + t * q_stride;
  for (int i = threadIdx.x; i < n_heads * d; i += kSelectThreads) q_s[i] = q[i];
  __syncthreads();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = kSelectThreads / kWarp;
  ScoredIndex* out = scores + t * scores_stride;
  for (int first = blockIdx.x * kScoreKeysPerCta; first < n_blocks; first += gridDim.x * kScoreKeysPerCta) {
    const int last = min(n_blocks, first + kScoreKeysPerCta);
    for (int blk = first + warp; blk < last; blk += n_warps) {
      const float s = block_score(q_s, block_keys + int64_t(blk) * bk_stride, n_heads, d, lane);
      if (lane == 0) {
        out[blk] = ScoredIndex{s, blk};
        if (isnan(s) && nan_score) *nan_score = 1;
      }
    }
  }
}

__global__ void __launch_bounds__(kSelectThreads)
    qsa_select_kernel(const float* __restrict__ index_q, int64_t q_stride, const int64_t* __restrict__ positions,
                      const float* __restrict__ block_keys, int64_t bk_stride, int n_heads, int d, int ratio,
                      int block_topk, int32_t* selected, int32_t* counts, int max_selected, int32_t* nan_score,
                      int64_t rows, ScoredIndex* spill, int64_t spill_stride, bool scores_ready,
                      bool serial_top_k, int32_t* threshold_rows) {
  pdl_begin();
  extern __shared__ ScoredIndex smem_scored[];  // [n_blocks], unless they spill to global memory
  __shared__ int hist[kSelectThreads], warp_totals[kWarp], found[3], any_nan;
  ScoredIndex* scored = spill ? spill + int64_t(blockIdx.x) * spill_stride : smem_scored;
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const int64_t p = positions[t];
    const int n_blocks = int((p + 1) / ratio);
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = kSelectThreads / kWarp;
    if (threadIdx.x == 0) any_nan = 0;
    __syncthreads();
    if (scores_ready) {  // qsa_score_kernel wrote them (and raised nan_score)
      bool nan_here = false;
      for (int i = threadIdx.x; i < n_blocks; i += kSelectThreads) nan_here |= isnan(scored[i].score);
      if (nan_here) any_nan = 1;
    } else {
      const float* q = index_q + t * q_stride;
      for (int blk = warp; blk < n_blocks; blk += n_warps) {
        const float s = block_score(q, block_keys + int64_t(blk) * bk_stride, n_heads, d, lane);
        if (lane == 0) {
          scored[blk] = ScoredIndex{s, blk};
          if (isnan(s)) {
            any_nan = 1;
            if (nan_score) *nan_score = 1;
          }
        }
      }
    }
    __syncthreads();
    const int keep = block_topk < n_blocks ? block_topk : n_blocks;
    int32_t* sel = selected + t * max_selected;
    // The threshold path: the k-th largest score T by radix select; when every block scoring T
    // is taken (no tie straddles the cutoff) the top k are exactly the blocks scoring >= T,
    // whichever algorithm picks them, and they are written in block order. Otherwise (a tie
    // at the cutoff, or a NaN) torch.topk's choice among the tied blocks is emulated serially.
    bool threshold = false;
    if (!serial_top_k && keep > 0 && keep < n_blocks && !any_nan) {
      int taken_at_key = 0, at_key = 0;
      const uint32_t kth = radix_kth_key(scored, n_blocks, keep, &taken_at_key, &at_key, hist, warp_totals, found);
      threshold = taken_at_key == at_key;
      if (threshold && threshold_rows && threadIdx.x == 0) atomicAdd(threshold_rows, 1);
      if (threshold) {
        // Each thread compacts a contiguous range, so the blocks land in ascending order.
        const int per = (n_blocks + kSelectThreads - 1) / kSelectThreads;
        const int lo = min(n_blocks, int(threadIdx.x) * per), hi = min(n_blocks, lo + per);
        int mine = 0;
        for (int i = lo; i < hi; ++i) mine += score_key(scored[i].score) >= kth;
        int at = block_inclusive_scan(mine, warp_totals) - mine;
        for (int i = lo; i < hi; ++i) {
          if (score_key(scored[i].score) < kth) continue;
          for (int j = 0; j < ratio; ++j) sel[at * ratio + j] = int32_t(int64_t(i) * ratio + j);
          ++at;
        }
      }
    }
    if (!threshold) {
      if (threadIdx.x == 0) select_top_k_like_torch(scored, n_blocks, keep);
      __syncthreads();
      for (int i = threadIdx.x; i < keep * ratio; i += kSelectThreads) {
        sel[i] = int32_t(int64_t(scored[i / ratio].index) * ratio + i % ratio);
      }
    }
    const int64_t tail_start = int64_t(n_blocks) * ratio;
    const int tail = int(p + 1 - tail_start);
    for (int i = threadIdx.x; i < tail; i += kSelectThreads) sel[keep * ratio + i] = int32_t(tail_start + i);
    if (threadIdx.x == 0) counts[t] = keep * ratio + tail;
    __syncthreads();  // the next row reuses `scored`
  }
}

// Scores of the n selected keys sel[0..n) against q_s (a warp per key), then their softmax
// numerators in place: w[i] = exp(q.k_i * scale - max). Returns (max, sum of w) to every
// thread; the block's barriers publish w. Every thread of the block calls it.
__device__ float2 selected_weights(const float* q_s, const PagedKv& kv, const int32_t* table, const int32_t* sel,
                                  int n, int kvh, float scale, float* w, float* red) {
  const int hd = kv.head_dim;
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = kThreads / kWarp;
  for (int i = warp; i < n; i += n_warps) {
    const uint16_t* k = kv.k + pool_offset(kv, table, sel[i], kvh);
    float dot = 0.f;
    for (int j = lane; j < hd; j += kWarp) dot += q_s[j] * bf16_bits_to_f32(k[j]);
    dot = warp_sum(dot);
    if (lane == 0) w[i] = dot * scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int i = threadIdx.x; i < n; i += kThreads) mx = fmaxf(mx, w[i]);
  mx = block_max(mx, red);
  float sum = 0.f;
  for (int i = threadIdx.x; i < n; i += kThreads) sum += (w[i] = expf(w[i] - mx));
  sum = block_sum(sum, red);  // its barriers also publish w
  return make_float2(mx, sum);
}

__global__ void __launch_bounds__(kThreads)
    attention_selected_kernel(const float* __restrict__ q, int64_t q_stride, PagedKv kv, int n_heads, float scale,
                              const int32_t* __restrict__ selected, const int32_t* __restrict__ counts,
                              int max_selected, float* out, int64_t out_stride) {
  pdl_begin();
  extern __shared__ float smem[];
  float* q_s = smem;                 // [head_dim]
  float* weights = smem + kv.head_dim;  // [max_selected]
  __shared__ float red[kWarp];
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y, kvh = h / (n_heads / kv.n_kv_heads);
  const int hd = kv.head_dim;
  const int32_t* table = kv.block_table + int64_t(kv.row_seq ? kv.row_seq[t] : 0) * kv.max_blocks;
  const int32_t* sel = selected + t * max_selected;
  const int cnt = counts[t];
  for (int i = threadIdx.x; i < hd; i += kThreads) q_s[i] = q[t * q_stride + int64_t(h) * hd + i];
  __syncthreads();
  const float sum = selected_weights(q_s, kv, table, sel, cnt, kvh, scale, weights, red).y;
  float* o = out + t * out_stride + int64_t(h) * hd;
  for (int j = threadIdx.x; j < hd; j += kThreads) {
    float acc = 0.f;
    for (int i = 0; i < cnt; ++i) {
      acc += (weights[i] / sum) * bf16_bits_to_f32(kv.v[pool_offset(kv, table, sel[i], kvh) + j]);
    }
    o[j] = acc;
  }
}

// One piece of one (row, head)'s selection: keys [s * kSplitKeys, ...) of it. Writes, at
// part[((t * n_heads + h) * n_splits + s) * (hd + 2)], the unnormalized sum of exp(w_i - m) v_i
// over its keys, then m and the sum of exp(w_i - m) (m = -inf, sum 0 for a piece past the count).
__global__ void __launch_bounds__(kThreads)
    attention_selected_split_kernel(const float* __restrict__ q, int64_t q_stride, PagedKv kv, int n_heads,
                                    float scale, const int32_t* __restrict__ selected,
                                    const int32_t* __restrict__ counts, int max_selected, int n_splits,
                                    float* __restrict__ part) {
  pdl_begin();
  extern __shared__ float smem[];
  float* q_s = smem;                  // [head_dim]
  float* p_s = smem + kv.head_dim;    // [kSplitKeys]
  __shared__ float red[kWarp];
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y, s = blockIdx.z, kvh = h / (n_heads / kv.n_kv_heads);
  const int hd = kv.head_dim;
  float* dst = part + ((t * n_heads + h) * n_splits + s) * (int64_t(hd) + 2);
  const int begin = s * kSplitKeys, n = min(counts[t], begin + kSplitKeys) - begin;
  if (n <= 0) {
    if (threadIdx.x == 0) dst[hd] = -INFINITY, dst[hd + 1] = 0.f;
    return;
  }
  const int32_t* table = kv.block_table + int64_t(kv.row_seq ? kv.row_seq[t] : 0) * kv.max_blocks;
  const int32_t* sel = selected + t * max_selected + begin;
  for (int i = threadIdx.x; i < hd; i += kThreads) q_s[i] = q[t * q_stride + int64_t(h) * hd + i];
  __syncthreads();
  const float2 ms = selected_weights(q_s, kv, table, sel, n, kvh, scale, p_s, red);
  const float mx = ms.x, sum = ms.y;
  for (int j = threadIdx.x; j < hd; j += kThreads) {
    float acc = 0.f;
    for (int i = 0; i < n; ++i) acc += p_s[i] * bf16_bits_to_f32(kv.v[pool_offset(kv, table, sel[i], kvh) + j]);
    dst[j] = acc;
  }
  if (threadIdx.x == 0) dst[hd] = mx, dst[hd + 1] = sum;
}

// The pieces of one (row, head) into its output: o = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s.
__global__ void __launch_bounds__(kThreads)
    attention_selected_combine_kernel(const float* __restrict__ part, int n_heads, int hd, int n_splits,
                                      float* out, int64_t out_stride) {
  pdl_begin();
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  const float* src = part + (t * n_heads + h) * n_splits * (int64_t(hd) + 2);
  float m = -INFINITY;
  for (int s = 0; s < n_splits; ++s) m = fmaxf(m, src[s * (int64_t(hd) + 2) + hd]);
  float l = 0.f;
  for (int s = 0; s < n_splits; ++s) {
    const float* p = src + s * (int64_t(hd) + 2);
    if (p[hd] != -INFINITY) l += p[hd + 1] * expf(p[hd] - m);
  }
  float* o = out + t * out_stride + int64_t(h) * hd;
  for (int j = threadIdx.x; j < hd; j += kThreads) {
    float acc = 0.f;
    for (int s = 0; s < n_splits; ++s) {
      const float* p = src + s * (int64_t(hd) + 2);
      if (p[hd] != -INFINITY) acc += p[j] * expf(p[hd] - m);
    }
    o[j] = acc / l;
  }
}

// Raises a kernel's dynamic shared memory limit to `bytes` when past the default 48 KiB;
// fails naming `what` when the device has less.
// The kernel's static shared memory counts against both limits.
template <typename Kernel>
void allow_smem(Kernel kernel, size_t bytes, const char* what) {
  cudaFuncAttributes attr = {};
  TS_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel), "{}: kernel attributes", what);
  if (bytes + attr.sharedSizeBytes <= 48 * 1024) return;
  int device = 0, limit = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device), "current device");
  TS_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "smem limit");
  TS_CHECK(bytes + attr.sharedSizeBytes <= size_t(limit),
           "{}: needs {} bytes of shared memory per block, the device has {}", what, bytes + attr.sharedSizeBytes,
           limit);
  TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
                "{}: shared memory of {} bytes", what, bytes);
}

}  // namespace

void qsa_select(const QsaView& qsa, const Mat& index_q, const Mat& raw_keys, const int64_t* positions,
                int32_t* selected, int32_t* counts, int max_selected, cudaStream_t stream, DeviceScratch* spill,
                QsaScores scores, QsaTopK top_k, int32_t* threshold_rows) {
  const int d = qsa.head_dim, r = qsa.ratio;
  const int64_t n = index_q.rows;
  TS_CHECK(d >= 1 && r >= 1 && qsa.n_heads >= 1 && qsa.block_topk >= 0 && qsa.rotary_dim % 2 == 0 &&
               qsa.rotary_dim <= d,
           "qsa_select: head dim {}, ratio {}, heads {}, block top-k {}, rotary dim {}", d, r, qsa.n_heads,
           qsa.block_topk, qsa.rotary_dim);
  TS_CHECK(index_q.cols >= int64_t(qsa.n_heads) * d && raw_keys.cols >= d && raw_keys.rows >= n &&
               qsa.raw_keys.cols >= d && qsa.block_keys.cols >= d,
           "qsa_select: index q [{}, {}], raw keys [{}, {}] for {} heads of {}", n, index_q.cols, raw_keys.rows,
           raw_keys.cols, qsa.n_heads, d);
  TS_CHECK(int64_t(max_selected) >= int64_t(qsa.block_topk) * r + r - 1,
           "qsa_select: room for {} positions per row, the selection may take {}", max_selected,
           int64_t(qsa.block_topk) * r + r - 1);
  TS_CHECK(n <= 0x7fffffff, "qsa_select: {} rows", n);
  if (n == 0) return;
  launch(qsa_store_kernel, unsigned(n), kThreads, 0, stream, raw_keys.data, raw_keys.stride, positions,
         qsa.raw_keys.data, qsa.raw_keys.stride, d);
  TS_CUDA_LAUNCH_CHECK("qsa_select store [{}, {}]", n, d);
  const int64_t max_complete = (n + r - 1) / r + 1;
  launch(qsa_complete_kernel, unsigned(max_complete), kThreads, size_t(d) * 4, stream, qsa.raw_keys.data,
         qsa.raw_keys.stride, positions, n, r, qsa.k_norm, qsa.inv_freq, qsa.rotary_dim, qsa.eps, qsa.block_keys.data,
         qsa.block_keys.stride, d);
  TS_CUDA_LAUNCH_CHECK("qsa_select complete {} blocks of {} x {}", max_complete, r, d);
  // Every row sees at most block_keys.rows complete blocks (the table's length). Steps of a few
  // rows (decode) score them across the GPU into `spill`, a row each, then select a CTA per row;
  // longer steps score and select in one CTA per row, the scores in shared memory when they fit,
  // else in `spill` (a slice per CTA of a grid that walks the rows), which long contexts need
  // (262144 positions at ratio 4: 512 KiB of scores).
  const bool serial = top_k == QsaTopK::kSerial;
  const size_t smem = size_t(qsa.block_keys.rows) * sizeof(ScoredIndex);
  if (scores == QsaScores::kSplit || (scores == QsaScores::kAuto && spill && n <= kSplitMaxRows)) {
    TS_CHECK(spill, "qsa_select: split scoring needs a scratch buffer");
    auto* buf = static_cast<ScoredIndex*>(spill->get(size_t(n) * smem, stream, "qsa scores"));
    const size_t q_bytes = size_t(qsa.n_heads) * size_t(d) * 4;
    allow_smem(qsa_score_kernel, q_bytes, "qsa_select scoring (a row's index q)");
    const int64_t per_row = std::max<int64_t>(1, std::min<int64_t>(ceil_div(qsa.block_keys.rows, kScoreKeysPerCta),
                                                                    kSpillBlocks / n));
    launch(qsa_score_kernel, dim3(unsigned(per_row), unsigned(n)), kSelectThreads, q_bytes, stream, index_q.data,
           index_q.stride, positions, qsa.block_keys.data, qsa.block_keys.stride, qsa.n_heads, d, r, buf,
           qsa.block_keys.rows, qsa.nan_score);
    TS_CUDA_LAUNCH_CHECK("qsa_select scores rows {} heads {} dim {} blocks up to {}", n, qsa.n_heads, d,
                         qsa.block_keys.rows);
    launch(qsa_select_kernel, unsigned(n), kSelectThreads, 0, stream, index_q.data, index_q.stride, positions,
           qsa.block_keys.data, qsa.block_keys.stride, qsa.n_heads, d, r, qsa.block_topk, selected, counts,
           max_selected, qsa.nan_score, n, buf, qsa.block_keys.rows, true, serial, threshold_rows);
    TS_CUDA_LAUNCH_CHECK("qsa_select rows {} (split scoring)", n);
    return;
  }
  cudaFuncAttributes attr = {};
  TS_CUDA_CHECK(cudaFuncGetAttributes(&attr, qsa_select_kernel), "qsa_select attributes");
  int device = 0, limit = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device), "current device");
  TS_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "smem limit");
  const bool fits = smem + attr.sharedSizeBytes <= size_t(limit);
  if (scores == QsaScores::kShared || (scores == QsaScores::kAuto && fits)) {
    allow_smem(qsa_select_kernel, smem, "qsa_select (scores of max_context / ratio key blocks)");
    launch(qsa_select_kernel, unsigned(n), kSelectThreads, smem, stream, index_q.data, index_q.stride, positions,
           qsa.block_keys.data, qsa.block_keys.stride, qsa.n_heads, d, r, qsa.block_topk, selected, counts,
           max_selected, qsa.nan_score, n, nullptr, 0, false, serial, threshold_rows);
  } else {
    TS_CHECK(spill, "qsa_select: {} key blocks' scores ({} bytes) exceed shared memory and no spill buffer was given",
             qsa.block_keys.rows, smem);
    const int64_t grid = std::min<int64_t>(n, kSpillBlocks);
    auto* buf = static_cast<ScoredIndex*>(spill->get(size_t(grid) * smem, stream, "qsa scores"));
    launch(qsa_select_kernel, unsigned(grid), kSelectThreads, 0, stream, index_q.data, index_q.stride, positions,
           qsa.block_keys.data, qsa.block_keys.stride, qsa.n_heads, d, r, qsa.block_topk, selected, counts,
           max_selected, qsa.nan_score, n, buf, qsa.block_keys.rows, false, serial, threshold_rows);
  }
  TS_CUDA_LAUNCH_CHECK("qsa_select rows {} heads {} dim {} blocks up to {}", n, qsa.n_heads, d, qsa.block_keys.rows);
}

int64_t attention_selected_scratch_floats(int64_t rows, int n_heads, int head_dim, int max_selected) {
  if (rows > kSplitMaxRows) return 0;
  const int64_t splits = (int64_t(max_selected) + kSplitKeys - 1) / kSplitKeys;
  return rows * n_heads * splits * (int64_t(head_dim) + 2);
}

void attention_selected(const Mat& q, const KvLayerView& kv, int n_heads, float scale, const int32_t* selected,
                        const int32_t* counts, int max_selected, const Mat& out, cudaStream_t stream, float* scratch,
                        int64_t scratch_floats) {
  check_bf16_pools("attention_selected", kv);
  TS_CHECK(kv.n_kv_heads >= 1 && n_heads % kv.n_kv_heads == 0 && q.cols >= int64_t(n_heads) * kv.head_dim &&
               out.cols >= int64_t(n_heads) * kv.head_dim && out.rows >= q.rows && max_selected >= 1,
           "attention_selected: q [{}, {}], out [{}, {}], {} heads over {} kv heads of {}, {} selected", q.rows, q.cols,
           out.rows, out.cols, n_heads, kv.n_kv_heads, kv.head_dim, max_selected);
  TS_CHECK(q.rows <= 0x7fffffff && n_heads <= 65535, "attention_selected: {} rows, {} heads", q.rows, n_heads);
  if (q.rows == 0) return;
  const int64_t want = attention_selected_scratch_floats(q.rows, n_heads, kv.head_dim, max_selected);
  if (want > 0 && scratch && scratch_floats >= want && max_selected > kSplitKeys) {
    const int n_splits = (max_selected + kSplitKeys - 1) / kSplitKeys;
    TS_CHECK(n_splits <= 65535, "attention_selected: {} pieces of {} keys", n_splits, kSplitKeys);
    const size_t split_smem = (size_t(kv.head_dim) + kSplitKeys) * 4;
    allow_smem(attention_selected_split_kernel, split_smem, "attention_selected (a piece's query and weights)");
    launch(attention_selected_split_kernel, dim3(unsigned(q.rows), unsigned(n_heads), unsigned(n_splits)), kThreads,
           split_smem, stream, q.data, q.stride, paged_kv(kv), n_heads, scale, selected, counts, max_selected, n_splits,
           scratch);
    TS_CUDA_LAUNCH_CHECK("attention_selected pieces rows {} heads {} head dim {} pieces {}", q.rows, n_heads,
                         kv.head_dim, n_splits);
    launch(attention_selected_combine_kernel, dim3(unsigned(q.rows), unsigned(n_heads)), kThreads, 0, stream, scratch,
           n_heads, kv.head_dim, n_splits, out.data, out.stride);
    TS_CUDA_LAUNCH_CHECK("attention_selected combine rows {} heads {} pieces {}", q.rows, n_heads, n_splits);
    return;
  }
  const size_t smem = (size_t(kv.head_dim) + size_t(max_selected)) * 4;
  allow_smem(attention_selected_kernel, smem, "attention_selected (the selection's weights)");
  launch(attention_selected_kernel, dim3(unsigned(q.rows), unsigned(n_heads)), kThreads, smem, stream, q.data, q.stride,
         paged_kv(kv), n_heads, scale, selected, counts, max_selected, out.data, out.stride);
  TS_CUDA_LAUNCH_CHECK("attention_selected rows {} heads {} head dim {} selected {}", q.rows, n_heads, kv.head_dim,
                       max_selected);
}

}  // namespace turbospark::cuda
