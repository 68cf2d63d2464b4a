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
//     relu(q_h . k_b) / sqrt(d) (a warp per key block), then one thread picks the top
//     budget / ratio blocks with torch.topk's CPU tie-breaking (ops/topk_like_torch.h: the
//     goldens' selections hinge on ties at relu 0) and the block writes their positions plus
//     the incomplete tail. The scores live in shared memory, 8 bytes per key block, while
//     max_context / ratio blocks fit (28k on the H200); past that in global memory (the
//     backend's spill scratch), a grid of kSpillBlocks walking the rows.
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
// hundred KB at 32k context); the top-k is serial on one thread, O(n_blocks log k) shared
// memory steps: fine at the tiny and Flash-Next shapes' block counts, the first thing to
// parallelise (a threshold search that skips the emulation when no tie straddles the cutoff)
// once a long-context benchmark says it costs.
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
constexpr int64_t kSplitMaxRows = 16;  // steps of up to this many rows take the split path

__global__ void __launch_bounds__(kThreads)
    qsa_store_kernel(const float* __restrict__ raw, int64_t raw_stride, const int64_t* __restrict__ positions,
                     float* table, int64_t table_stride, int d) {
  const int64_t t = blockIdx.x;
  const int64_t p = positions[t];
  for (int i = threadIdx.x; i < d; i += kThreads) table[p * table_stride + i] = raw[t * raw_stride + i];
}

__global__ void __launch_bounds__(kThreads)
    qsa_complete_kernel(const float* __restrict__ table, int64_t table_stride, const int64_t* __restrict__ positions,
                        int64_t rows, int ratio, const float* __restrict__ k_norm, const float* __restrict__ inv_freq,
                        int rotary_dim, float eps, float* block_keys, int64_t bk_stride, int d) {
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

__global__ void __launch_bounds__(kSelectThreads)
    qsa_select_kernel(const float* __restrict__ index_q, int64_t q_stride, const int64_t* __restrict__ positions,
                      const float* __restrict__ block_keys, int64_t bk_stride, int n_heads, int d, int ratio,
                      int block_topk, int32_t* selected, int32_t* counts, int max_selected, int32_t* nan_score,
                      int64_t rows, ScoredIndex* spill, int64_t spill_stride) {
  extern __shared__ ScoredIndex smem_scored[];  // [n_blocks], unless they spill to global memory
  ScoredIndex* scored = spill ? spill + int64_t(blockIdx.x) * spill_stride : smem_scored;
  for (int64_t t = blockIdx.x; t < rows; t += gridDim.x) {
    const int64_t p = positions[t];
    const int n_blocks = int((p + 1) / ratio);
    const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp, n_warps = kSelectThreads / kWarp;
    const float* q = index_q + t * q_stride;
    const float inv_sqrt = 1.f / sqrtf(float(d));
    for (int blk = warp; blk < n_blocks; blk += n_warps) {
      const float* kb = block_keys + int64_t(blk) * bk_stride;
      float s = 0.f;
      for (int h = 0; h < n_heads; ++h) {
        float dot = 0.f;
        for (int i = lane; i < d; i += kWarp) dot += q[int64_t(h) * d + i] * kb[i];
        dot = warp_sum(dot);
        s += dot < 0.f ? 0.f : dot;  // std::max(dot, 0.f), as the CPU: a NaN stays NaN
      }
      if (lane == 0) {
        scored[blk] = ScoredIndex{s * inv_sqrt, blk};
        if (isnan(s) && nan_score) *nan_score = 1;
      }
    }
    __syncthreads();
    const int keep = block_topk < n_blocks ? block_topk : n_blocks;
    if (threadIdx.x == 0) select_top_k_like_torch(scored, n_blocks, keep);
    __syncthreads();
    int32_t* sel = selected + t * max_selected;
    for (int i = threadIdx.x; i < keep * ratio; i += kSelectThreads) {
      sel[i] = int32_t(int64_t(scored[i / ratio].index) * ratio + i % ratio);
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
                QsaScores scores) {
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
  qsa_store_kernel<<<unsigned(n), kThreads, 0, stream>>>(raw_keys.data, raw_keys.stride, positions,
                                                         qsa.raw_keys.data, qsa.raw_keys.stride, d);
  TS_CUDA_LAUNCH_CHECK("qsa_select store [{}, {}]", n, d);
  const int64_t max_complete = (n + r - 1) / r + 1;
  qsa_complete_kernel<<<unsigned(max_complete), kThreads, size_t(d) * 4, stream>>>(
      qsa.raw_keys.data, qsa.raw_keys.stride, positions, n, r, qsa.k_norm, qsa.inv_freq, qsa.rotary_dim, qsa.eps,
      qsa.block_keys.data, qsa.block_keys.stride, d);
  TS_CUDA_LAUNCH_CHECK("qsa_select complete {} blocks of {} x {}", max_complete, r, d);
  // Every row sees at most block_keys.rows complete blocks (the table's length): their scores
  // go to shared memory when they fit, else to `spill` (a slice per block of a grid that walks
  // the rows), which long contexts need (262144 positions at ratio 4: 512 KiB of scores).
  const size_t smem = size_t(qsa.block_keys.rows) * sizeof(ScoredIndex);
  cudaFuncAttributes attr = {};
  TS_CUDA_CHECK(cudaFuncGetAttributes(&attr, qsa_select_kernel), "qsa_select attributes");
  int device = 0, limit = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device), "current device");
  TS_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "smem limit");
  const bool fits = smem + attr.sharedSizeBytes <= size_t(limit);
  if (scores == QsaScores::kShared || (scores == QsaScores::kAuto && fits)) {
    allow_smem(qsa_select_kernel, smem, "qsa_select (scores of max_context / ratio key blocks)");
    qsa_select_kernel<<<unsigned(n), kSelectThreads, smem, stream>>>(
        index_q.data, index_q.stride, positions, qsa.block_keys.data, qsa.block_keys.stride, qsa.n_heads, d, r,
        qsa.block_topk, selected, counts, max_selected, qsa.nan_score, n, nullptr, 0);
  } else {
    TS_CHECK(spill, "qsa_select: {} key blocks' scores ({} bytes) exceed shared memory and no spill buffer was given",
             qsa.block_keys.rows, smem);
    const int64_t grid = std::min<int64_t>(n, kSpillBlocks);
    auto* buf = static_cast<ScoredIndex*>(spill->get(size_t(grid) * smem, stream, "qsa scores"));
    qsa_select_kernel<<<unsigned(grid), kSelectThreads, 0, stream>>>(
        index_q.data, index_q.stride, positions, qsa.block_keys.data, qsa.block_keys.stride, qsa.n_heads, d, r,
        qsa.block_topk, selected, counts, max_selected, qsa.nan_score, n, buf, qsa.block_keys.rows);
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
    attention_selected_split_kernel<<<dim3(unsigned(q.rows), unsigned(n_heads), unsigned(n_splits)), kThreads,
                                      split_smem, stream>>>(q.data, q.stride, paged_kv(kv), n_heads, scale, selected,
                                                            counts, max_selected, n_splits, scratch);
    TS_CUDA_LAUNCH_CHECK("attention_selected pieces rows {} heads {} head dim {} pieces {}", q.rows, n_heads,
                         kv.head_dim, n_splits);
    attention_selected_combine_kernel<<<dim3(unsigned(q.rows), unsigned(n_heads)), kThreads, 0, stream>>>(
        scratch, n_heads, kv.head_dim, n_splits, out.data, out.stride);
    TS_CUDA_LAUNCH_CHECK("attention_selected combine rows {} heads {} pieces {}", q.rows, n_heads, n_splits);
    return;
  }
  const size_t smem = (size_t(kv.head_dim) + size_t(max_selected)) * 4;
  allow_smem(attention_selected_kernel, smem, "attention_selected (the selection's weights)");
  attention_selected_kernel<<<dim3(unsigned(q.rows), unsigned(n_heads)), kThreads, smem, stream>>>(
      q.data, q.stride, paged_kv(kv), n_heads, scale, selected, counts, max_selected, out.data, out.stride);
  TS_CUDA_LAUNCH_CHECK("attention_selected rows {} heads {} head dim {} selected {}", q.rows, n_heads, kv.head_dim,
                       max_selected);
}

}  // namespace turbospark::cuda
