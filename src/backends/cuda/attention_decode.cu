// Attention over the paged KV cache for few query rows (decode): flash-decoding. Each
// (row, KV head, split) block reads one contiguous part of the row's visible context once
// for all the query heads of its GQA group, keeps an online softmax (running max, sum and
// V accumulator) per head, and either writes the normalized output (one split) or its
// partial state; a combine kernel then merges the splits (and the sink logit) per head.
// Also holds attention() (the kernel choice) and attention_scratch_floats().
//
// Math (as backends/cpu/kernels_ref.cpp): query row t at pos = positions[t] of sequence
// row_seq[t] sees positions [max(0, pos - window + 1), pos] (window <= 0: [0, pos]);
// s = (q . k) * scale; softmax in f32; sinks[h], when given, is an extra logit whose
// probability is dropped (it only enlarges the denominator).
//
// Bound: HBM bandwidth on K and V: context * n_kv_heads * head_dim * 4 bytes per row (bf16
// pools; GQA groups share the read). The split factor comes from the host knowing only the shapes
// (positions live on the device, and a CUDA graph replays a fixed launch): enough splits
// that rows * kv_heads * head_chunks * splits fills ~2 waves of SMs; each split's length is
// computed on the device from the row's actual span, at least kMinSplitKeys keys, so short
// contexts leave trailing splits empty (they exit after writing an empty state).
//
// Two forms of the split kernel: f32 SIMT (every shape; DecodeMath::kF32 for the CPU's
// rounding) and bf16 tensor cores (head_dim 64 / 128, up to 16 query heads per KV head; see
// attention_decode_tc_kernel). By default each query row takes the f32 form below
// attention_decode_tc_min_span() visible keys and the tensor cores from there, chosen on the
// device (attention_decode_auto_kernel). attention_decode_prep runs the tensor-core form with
// attention_prep's norms, RoPE and cache write folded in, for one decode row.
#include <algorithm>
#include <cstdlib>
#include <string_view>

#include "backends/cuda/common.cuh"
#include "backends/cuda/mma.cuh"
#include "backends/cuda/ops.h"
#include "backends/cuda/paged_kv.cuh"

namespace turbospark::cuda {
namespace {

constexpr int kDecodeWarps = 4;  // 128 threads: 4 warps walk the split's keys side by side
constexpr int kDecodeThreads = kDecodeWarps * kWarp;
constexpr int kMaxSplits = 64;
// 16: at short context the live splits are many short ones side by side (512 keys: 32 of 16,
// one pass of a block's lane groups each) rather than 8 of 64 walked in 4 dependent passes
// (9.5 us a layer for 78 KB at 64, ncu); long contexts still split by kMaxSplits.
constexpr int kMinSplitKeys = 16;
constexpr int kCombineThreads = 128;


// Where the split's partial states go: [rows, n_heads, n_splits] for m and l, and
// [rows, n_heads, n_splits, head_dim] for the unnormalized V accumulators.
struct Partials {
  float* m;
  float* l;
  float* acc;
};

__device__ __forceinline__ float4 f4_zero() { return make_float4(0.f, 0.f, 0.f, 0.f); }
__device__ __forceinline__ float dot4(float4 a, float4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
__device__ __forceinline__ float4 f4_axpby(float4 x, float a, float4 y, float b) {
  return make_float4(x.x * a + y.x * b, x.y * a + y.y * b, x.z * a + y.z * b, x.w * a + y.w * b);
}
// exp(m - m_new) for a running max that may still be -inf (no key seen yet).
__device__ __forceinline__ float rescale(float m, float m_new) { return m == m_new ? 1.f : expf(m - m_new); }

// Row t's visible span: positions [pos - span + 1, pos] (the window, when set, bounds it).
__device__ __forceinline__ int64_t visible_span(int64_t pos, int window) {
  return window > 0 ? min(pos + 1, int64_t(window)) : pos + 1;
}

// The keys split `split` of row t reads: [begin, end) of its visible span cut into n_splits
// parts of at least min_keys keys (so a short span leaves the trailing splits empty).
struct SplitRange {
  int64_t pos;        // the row's position
  int seq;            // its sequence (block table row)
  int64_t begin, end;  // end <= begin: an empty split
  int64_t len;        // the parts' length
};
__device__ __forceinline__ SplitRange split_range(const int64_t* __restrict__ positions, const PagedKv& kv, int64_t t,
                                                  int window, int split, int n_splits, int min_keys) {
  SplitRange r;
  r.pos = positions[t];
  r.seq = kv.row_seq ? kv.row_seq[t] : 0;
  const int64_t span = visible_span(r.pos, window);
  r.len = max(int64_t(min_keys), (span + n_splits - 1) / n_splits);
  r.begin = r.pos - span + 1 + split * r.len;
  r.end = min(r.pos + 1, r.begin + r.len);
  return r;
}

// The block's warps' states (s_m, s_l natural-log units, s_acc
// [warp][head][dim] with row strides kRows and kLd) merged per (head, dim) and written: the
// normalized output (one split; the sink enlarges the denominator) or the split's partial state.
template <int kWarps>
__device__ __forceinline__ void finish_block(const float* s_m, const float* s_l, const float* s_acc, int kRows,
                                             int kLd, int n_here, int hd, int head0, int64_t t, int n_heads,
                                             int split, int n_splits, const float* __restrict__ sinks,
                                             float* __restrict__ out, int64_t out_stride, const Partials& part) {
  for (int i = threadIdx.x; i < n_here * hd; i += blockDim.x) {
    const int j = i / hd, d = i - j * hd;
    const int h = head0 + j;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) mm = fmaxf(mm, s_m[w * kRows + j]);
    float ll = 0.f, aa = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const float mw = s_m[w * kRows + j];
      const float f = mw == -INFINITY ? 0.f : expf(mw - mm);
      ll += s_l[w * kRows + j] * f;
      aa += s_acc[(w * kRows + j) * kLd + d] * f;
    }
    if (n_splits == 1) {
      // The whole context was this block's: normalize here (with the sink) and skip the combine.
      float denom = ll, num = aa;
      if (sinks) {
        const float mf = fmaxf(mm, sinks[h]);
        const float f = expf(mm - mf);
        denom = ll * f + expf(sinks[h] - mf);
        num = aa * f;
      }
      out[t * out_stride + int64_t(h) * hd + d] = num / denom;
    } else {
      const int64_t slot = (t * n_heads + h) * n_splits + split;
      part.acc[slot * hd + d] = aa;
      if (d == 0) part.m[slot] = mm, part.l[slot] = ll;
    }
  }
}

// Keys read before the PDL wait: with one query row in the launch, every key
// of the row's span but its own position was written by an earlier forward (the previous
// kernel, attention_prep or kv_write, writes only that position; positions, row_seq and the
// block table are uploaded before the step's first kernel), so the f32 form loads its first
// pass of keys before pdl_begin() and they arrive while the previous kernel drains. With
// several rows (a short prefill chunk, or rows of one sequence) one row's span holds another's
// new key, so those launches wait first, as before.
//
// Layout: a key is read by kLanes lanes, each holding kChunks 4-element chunks of head_dim
// (lane sl holds chunks sl, sl + kLanes, ...): 8-byte loads of 4 bf16, one contiguous
// head_dim * 2 bytes per key (>= 64 B). head_dim 32/64: 4/2 keys per warp at once; 128: one key per warp, one
// float4 per lane; 256: two float4 per lane; 512: four (at most 2 heads a block). Each lane keeps q and the V accumulators of its
// chunks for kGroupTile query heads in registers; the head_dim < kHdMax tail is masked.
// kUnroll keys per lane group per step keep 2 * kUnroll * kChunks 8-byte loads in flight.
template <int kHdMax, int kGroupTile>
struct F32Smem {
  float m[kDecodeWarps][kGroupTile];
  float l[kDecodeWarps][kGroupTile];
  float acc[kDecodeWarps][kGroupTile][kHdMax];
};

// early: the kernel has not passed pdl_begin() yet (one query row; see above): the
// first pass's keys other than the row's own position are loaded first, then the wait, then
// the row's own key (the previous kernel, attention_prep or kv_write, writes it) and q.
template <int kHdMax, int kGroupTile>
__device__ __forceinline__ void decode_split_f32(const float* __restrict__ q, int64_t q_stride, const PagedKv& kv,
                                                 int n_heads, int group, int head_chunks, float scale,
                                                 const float* __restrict__ sinks, float* __restrict__ out,
                                                 int64_t out_stride, int n_splits, const Partials& part,
                                                 const SplitRange& sr, F32Smem<kHdMax, kGroupTile>& sm,
                                                 bool early) {
  constexpr int kLanes = kHdMax / 4 < kWarp ? kHdMax / 4 : kWarp;
  constexpr int kChunks = kHdMax / 4 / kLanes;
  constexpr int kKeysPerWarp = kWarp / kLanes;
  constexpr int kGroups = kDecodeWarps * kKeysPerWarp;  // lane groups per block
  constexpr int kUnroll = kChunks >= 2 ? 2 : 4;

  const int split = blockIdx.x;
  const int kv_head = blockIdx.y / head_chunks;
  const int chunk = blockIdx.y - kv_head * head_chunks;
  const int64_t t = blockIdx.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int sl = lane % kLanes;                      // lane within the key's lane group
  const int lg = warp * kKeysPerWarp + lane / kLanes;  // lane group within the block
  const int hd = kv.head_dim, hd4 = hd / 4;
  const int head0 = kv_head * group + chunk * kGroupTile;
  const int n_here = min(kGroupTile, group - chunk * kGroupTile);  // heads of this block

  const int seq = sr.seq;
  const int64_t begin = sr.begin, end = sr.end;
  const int32_t* table = kv.block_table + int64_t(seq) * kv.max_blocks;
  constexpr int64_t kPass = int64_t(kGroups) * kUnroll;  // keys of one pass of the block

  // One pass's keys [base, base + kPass) into registers; `skip` is left zero (valid, loaded later).
  auto load_pass = [&](int64_t base, float4 (&kk)[kUnroll][kChunks], float4 (&vv)[kUnroll][kChunks],
                       bool (&valid)[kUnroll], int64_t skip) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = base + int64_t(u) * kGroups + lg;
      valid[u] = p < end;
      const uint16_t* kp = nullptr;
      const uint16_t* vp = nullptr;
      const bool live = valid[u] && p != skip;
      if (live) {
        const int64_t off = pool_offset(kv, table, p, kv_head);
        kp = kv.k + off;
        vp = kv.v + off;
      }
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int ch = sl + c * kLanes;
        // 8-byte aligned: pools are, and every offset is a multiple of head_dim % 4 == 0 elements.
        const bool ld = live && ch < hd4;
        kk[u][c] = ld ? load_bf16x4(kp + 4 * ch) : f4_zero();
        vv[u][c] = ld ? load_bf16x4(vp + 4 * ch) : f4_zero();
      }
    }
  };
  float4 kk0[kUnroll][kChunks], vv0[kUnroll][kChunks];
  bool valid0[kUnroll];
  load_pass(begin, kk0, vv0, valid0, early ? sr.pos : -1);
  if (early) {
    pdl_begin();
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = begin + int64_t(u) * kGroups + lg;
      if (valid0[u] && p == sr.pos) {
        const int64_t off = pool_offset(kv, table, p, kv_head);
#pragma unroll
        for (int c = 0; c < kChunks; ++c) {
          const int ch = sl + c * kLanes;
          if (ch < hd4) {
            kk0[u][c] = load_bf16x4(kv.k + off + 4 * ch);
            vv0[u][c] = load_bf16x4(kv.v + off + 4 * ch);
          }
        }
      }
    }
  }

  float4 qv[kGroupTile][kChunks];
#pragma unroll
  for (int j = 0; j < kGroupTile; ++j) {
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int ch = sl + c * kLanes;
      qv[j][c] = f4_zero();
      if (j < n_here && ch < hd4) {
        const float* qp = q + t * q_stride + int64_t(head0 + j) * hd + 4 * ch;  // any alignment
        qv[j][c] = make_float4(qp[0], qp[1], qp[2], qp[3]);
      }
    }
  }
  float m[kGroupTile], l[kGroupTile];
  float4 acc[kGroupTile][kChunks];
#pragma unroll
  for (int j = 0; j < kGroupTile; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) acc[j][c] = f4_zero();
  }

  // The online softmax over one pass's keys.
  auto take_pass = [&](const float4 (&kk)[kUnroll][kChunks], const float4 (&vv)[kUnroll][kChunks],
                       const bool (&valid)[kUnroll]) {
#pragma unroll
    for (int j = 0; j < kGroupTile; ++j) {
      float s[kUnroll];
      float tile_max = -INFINITY;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float d = 0.f;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) d += dot4(qv[j][c], kk[u][c]);
#pragma unroll
        for (int o = kLanes / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        s[u] = valid[u] ? d * scale : -INFINITY;
        tile_max = fmaxf(tile_max, s[u]);
      }
      const float m_new = fmaxf(m[j], tile_max);
      if (m_new == -INFINITY) continue;  // no key yet for this lane group (uniform within it)
      const float corr = rescale(m[j], m_new);
      l[j] *= corr;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) acc[j][c] = f4_axpby(acc[j][c], corr, f4_zero(), 0.f);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const float e = valid[u] ? expf(s[u] - m_new) : 0.f;
        l[j] += e;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) acc[j][c] = f4_axpby(acc[j][c], 1.f, vv[u][c], e);
      }
      m[j] = m_new;
    }
  };
  if (begin < end) take_pass(kk0, vv0, valid0);
  for (int64_t base = begin + kPass; base < end; base += kPass) {
    float4 kk[kUnroll][kChunks], vv[kUnroll][kChunks];
    bool valid[kUnroll];
    load_pass(base, kk, vv, valid, -1);
    take_pass(kk, vv, valid);
  }

  // Merge the lane groups of a warp (head_dim 32/64 only), then the warps through shared memory.
#pragma unroll
  for (int o = kLanes; o < kWarp; o <<= 1) {
#pragma unroll
    for (int j = 0; j < kGroupTile; ++j) {
      const float om = __shfl_xor_sync(0xffffffffu, m[j], o);
      const float ol = __shfl_xor_sync(0xffffffffu, l[j], o);
      const float mm = fmaxf(m[j], om);
      const float a = mm == -INFINITY ? 0.f : expf(m[j] - mm);
      const float b = mm == -INFINITY ? 0.f : expf(om - mm);
      l[j] = l[j] * a + ol * b;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        float4 oa;
        oa.x = __shfl_xor_sync(0xffffffffu, acc[j][c].x, o);
        oa.y = __shfl_xor_sync(0xffffffffu, acc[j][c].y, o);
        oa.z = __shfl_xor_sync(0xffffffffu, acc[j][c].z, o);
        oa.w = __shfl_xor_sync(0xffffffffu, acc[j][c].w, o);
        acc[j][c] = f4_axpby(acc[j][c], a, oa, b);
      }
      m[j] = mm;
    }
  }
  if (lane < kLanes) {
#pragma unroll
    for (int j = 0; j < kGroupTile; ++j) {
      if (lane == 0) sm.m[warp][j] = m[j], sm.l[warp][j] = l[j];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int ch = sl + c * kLanes;
        if (ch < kHdMax / 4) *reinterpret_cast<float4*>(&sm.acc[warp][j][4 * ch]) = acc[j][c];
      }
    }
  }
  __syncthreads();
  finish_block<kDecodeWarps>(&sm.m[0][0], &sm.l[0][0], &sm.acc[0][0][0], kGroupTile, kHdMax, n_here, hd, head0, t,
                             n_heads, split, n_splits, sinks, out, out_stride, part);
}

template <int kHdMax, int kGroupTile>
__global__ void __launch_bounds__(kDecodeThreads)
    attention_decode_kernel(const float* __restrict__ q, int64_t q_stride, const int64_t* __restrict__ positions,
                            PagedKv kv, int n_heads, int group, int head_chunks, float scale, int window,
                            const float* __restrict__ sinks, float* __restrict__ out, int64_t out_stride,
                            int n_splits, Partials part) {
  const bool early = gridDim.z == 1;  // see "Keys read before the PDL wait"
  if (!early) pdl_begin();
  __shared__ F32Smem<kHdMax, kGroupTile> sm;
  const SplitRange sr = split_range(positions, kv, blockIdx.z, window, blockIdx.x, n_splits, kMinSplitKeys);
  decode_split_f32<kHdMax, kGroupTile>(q, q_stride, kv, n_heads, group, head_chunks, scale, sinks, out, out_stride,
                                       n_splits, part, sr, sm, early);
}

// ---- tensor cores (head_dim 64 / 128, GQA groups up to 16) ----
//
// The same split, online softmax and epilogue, with S = Q K^T and O += P V as bf16
// mma.sync.m16n8k16 (f32 accumulate): the GQA group's query heads are the 16 rows of A (rows
// past the group are zero), a warp takes 16 keys a step (two 8-key column tiles of S, one
// k-step of P V). The f32 kernel above gave a full warp to each key and reduced every
// (key, head) dot product across it: ~60 instructions per key and head, instruction-bound at
// ~0.4 TB/s from L2 for an 8k context (41.8 us a layer on the Qwen3-30B-A3B shape, ncu).
//
// No shared-memory staging: each lane loads its fragments straight from the pools, and the
// products' index orders are chosen so that those loads are contiguous. A dot product does not
// care in which order it meets the dims, so S's depth index (k-step s, position 2c + j or
// 2c + 8 + j) maps to dim c * kHd / 4 + 4 s + j (or + 2 + j): lane (r, c) reads dims
// [c kHd / 4, (c + 1) kHd / 4) of key r of the column tile, Q's A fragments use the same map.
// For P V, O's column index (n-tile nt, column r) maps to dim r * kHd / 8 + nt: lane (r, c) reads
// dims [r kHd / 8, (r + 1) kHd / 8) of keys 2c, 2c + 1, 2c + 8, 2c + 9 and pairs the keys' halves
// into B registers with one byte permute each; the outputs are written back through the same map.
//
// Precision: as attention_prefill_tc.cu (Q and P rounded to bf16 as they enter the products;
// the row sums add the rounded P, so each output is an exact weighted mean of V).
constexpr int kTcWarps = 4;
constexpr int kTcThreads = kTcWarps * kWarp;
constexpr int kTcKeysPerStep = 16;
constexpr int kTcMinSplitKeys = kTcWarps * kTcKeysPerStep;  // one step for each warp
constexpr int kTcMaxGroup = 16;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// With kPrep (one query row; attention_decode_prep below) the kernel also does
// attention_prep's work: the block normalizes and rotates its group's q heads in shared
// memory (attention_prep.cu's arithmetic), and the block whose split holds the row's position
// also the new k (and v), writes both to the cache and then reads them back with the
// other keys (its own global writes, visible to the block after the barrier; the key loads
// go through L2, not the read-only cache, for that reason). No other block reads that position.
struct DecodePrep {
  const float* k;  // [1, n_kv_heads * head_dim] before norm and RoPE
  const float* v;
  AttentionPrep p;
};

template <int kHd, bool kPrep>
struct TcSmem {
  // kPrep: rows 0..group-1 the group's q heads, row kTcMaxGroup the new k; then cos | sin.
  static constexpr int kPrepRows = kPrep ? kTcMaxGroup + 1 : 1;
  float m[kTcWarps][kTcMaxGroup];
  float l[kTcWarps][kTcMaxGroup];
  float acc[kTcWarps][kTcMaxGroup][kHd + 1];  // + 1: the 4 lanes of a row hit 4 banks, not 1
  float head[kPrepRows][kHd];
  float cs[kPrep ? kHd : 1];
};

template <int kHd, bool kPrep>
__device__ __forceinline__ void decode_split_tc(const float* __restrict__ q, int64_t q_stride, const PagedKv& kv,
                                                int n_heads, int group, float scale, const float* __restrict__ sinks,
                                                float* __restrict__ out, int64_t out_stride, int n_splits,
                                                const Partials& part, const DecodePrep& prep, const SplitRange& sr,
                                                TcSmem<kHd, kPrep>& sm) {
  constexpr int kSteps = kHd / 16;  // k-steps of S
  constexpr int kDimsK = kHd / 4;   // dims of a key a lane reads for S
  constexpr int kNt = kHd / 8;      // n-tiles of O = dims of a V row a lane reads
  constexpr int kKVec = kDimsK / 8;  // 16-byte loads per key for S
  constexpr int kVVec = kNt / 8;     // 16-byte loads per key for P V

  const int split = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int64_t t = blockIdx.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int r = lane / 4, c = lane % 4;
  const int head0 = kv_head * group;

  const int64_t pos = sr.pos;
  const int seq = sr.seq;
  const int64_t begin = sr.begin, end = sr.end, split_len = sr.len;
  auto& s_head = sm.head;
  auto& s_cs = sm.cs;
  if constexpr (kPrep) {
    const AttentionPrep& pp = prep.p;
    const bool owner = begin <= pos && pos < begin + split_len;  // this split holds the new key
    const int n_rows = begin > pos ? 0 : group + (owner ? 1 : 0);  // an empty split needs no q
    const int half = pp.rotary_dim / 2;
    const float fpos = float(pos);  // as attention_prep.cu
    for (int i = threadIdx.x; i < half; i += kTcThreads) {
      float sn, cs;
      sincosf(fpos * pp.inv_freq[i], &sn, &cs);
      s_cs[i] = cs * pp.attention_factor;
      s_cs[half + i] = sn * pp.attention_factor;
    }
    // Norms: a warp per head.
    for (int j = warp; j < n_rows; j += kTcWarps) {
      const bool is_k = j == group;
      const int row = is_k ? kTcMaxGroup : j;
      const float* src = is_k ? prep.k + int64_t(kv_head) * kHd : q + t * q_stride + int64_t(head0 + j) * kHd;
      const float* w = is_k ? pp.k_norm : pp.q_norm;
      float x[kHd / kWarp];
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < kHd / kWarp; ++i) {
        x[i] = src[lane + i * kWarp];
        ss += x[i] * x[i];
      }
      if (w) {
        ss = warp_sum(ss);
        const float inv_rms = 1.f / sqrtf(ss / float(kHd) + pp.norm_eps);
#pragma unroll
        for (int i = 0; i < kHd / kWarp; ++i) x[i] = (x[i] * inv_rms) * (w[lane + i * kWarp] + pp.norm_offset);
      }
#pragma unroll
      for (int i = 0; i < kHd / kWarp; ++i) s_head[row][lane + i * kWarp] = x[i];
    }
    __syncthreads();
    // RoPE: rotate-half pairs (i, i + half) of every row.
    for (int e = threadIdx.x; e < n_rows * half; e += kTcThreads) {
      const int j = e / half, i = e - j * half;
      float* h = s_head[j == group ? kTcMaxGroup : j];
      const float cs = s_cs[i], sn = s_cs[half + i];
      const float a = h[i], b = h[i + half];
      h[i] = __fsub_rn(__fmul_rn(a, cs), __fmul_rn(b, sn));
      h[i + half] = __fadd_rn(__fmul_rn(b, cs), __fmul_rn(a, sn));
    }
    __syncthreads();
    if (owner) {
      const int32_t* tbl = kv.block_table + int64_t(seq) * kv.max_blocks;
      const int64_t off = pool_offset(kv, tbl, pos, kv_head);
      auto* k_pool = const_cast<uint16_t*>(kv.k);
      auto* v_pool = const_cast<uint16_t*>(kv.v);
      const float* vr = prep.v + int64_t(kv_head) * kHd;
      for (int d = threadIdx.x; d < kHd; d += kTcThreads) {
        k_pool[off + d] = f32_to_bf16_bits(s_head[kTcMaxGroup][d]);
        v_pool[off + d] = f32_to_bf16_bits(vr[d]);
      }
      __syncthreads();
    }
  }

  // Q's A fragments: heads r and r + 8 of the group (zero past it), dims through S's map.
  uint32_t qa[kSteps][4];
  {
    const bool h0 = r < group, h1 = r + 8 < group;
    const float* q0 = kPrep ? &s_head[h0 ? r : 0][c * kDimsK]
                            : q + t * q_stride + int64_t(head0 + r) * kHd + c * kDimsK;
    const float* q1 = kPrep ? &s_head[h1 ? r + 8 : 0][c * kDimsK]
                            : q + t * q_stride + int64_t(head0 + r + 8) * kHd + c * kDimsK;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      float a[4], b[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        a[j] = h0 ? q0[4 * s + j] : 0.f;
        b[j] = h1 ? q1[4 * s + j] : 0.f;
      }
      qa[s][0] = pack_bf16x2(a[0], a[1]);
      qa[s][1] = pack_bf16x2(b[0], b[1]);
      qa[s][2] = pack_bf16x2(a[2], a[3]);
      qa[s][3] = pack_bf16x2(b[2], b[3]);
    }
  }

  const float scale_log2 = scale * kLog2e;
  float m0 = -INFINITY, m1 = -INFINITY;  // running maxima of rows r and r + 8, log2 units
  float l0 = 0.f, l1 = 0.f;              // this lane's share of the row sums
  float acc[kNt][4];
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;

  const int32_t* table = kv.block_table + int64_t(seq) * kv.max_blocks;
  for (int64_t base = begin + int64_t(warp) * kTcKeysPerStep; base < end; base += int64_t(kTcWarps) * kTcKeysPerStep) {
    // Keys past the split's end read its last key (valid memory) and are masked out of P.
    uint4 kw[2][kKVec];
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
      const int64_t p = min(base + 8 * tile + r, end - 1);
      const uint4* kp = reinterpret_cast<const uint4*>(kv.k + pool_offset(kv, table, p, kv_head) + c * kDimsK);
#pragma unroll
      for (int i = 0; i < kKVec; ++i) kw[tile][i] = __ldcg(kp + i);
    }
    uint4 vw[4][kVVec];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t p = min(base + 2 * c + (j & 1) + 8 * (j >> 1), end - 1);
      const uint4* vp = reinterpret_cast<const uint4*>(kv.v + pool_offset(kv, table, p, kv_head) + r * kNt);
#pragma unroll
      for (int i = 0; i < kVVec; ++i) vw[j][i] = __ldcg(vp + i);
    }

    float sc[2][4];
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
      sc[tile][0] = sc[tile][1] = sc[tile][2] = sc[tile][3] = 0.f;
      const uint32_t* kwords = reinterpret_cast<const uint32_t*>(kw[tile]);
#pragma unroll
      for (int s = 0; s < kSteps; ++s) mma_bf16_16816(sc[tile], qa[s], kwords[2 * s], kwords[2 * s + 1]);
    }
    // Column j of tile `tile` is key base + 8 tile + 2c + (j & 1); rows r (j < 2) and r + 8.
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int tile = 0; tile < 2; ++tile)
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const bool valid = base + 8 * tile + 2 * c + (j & 1) < end;
        sc[tile][j] = valid ? sc[tile][j] * scale_log2 : -INFINITY;
        if (j < 2) mx0 = fmaxf(mx0, sc[tile][j]);
        else mx1 = fmaxf(mx1, sc[tile][j]);
      }
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, o));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, o));
    }
    // Finite: key `base` is valid and every row scores it (padding rows score 0).
    const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
    const float corr0 = exp2f(m0 - mn0), corr1 = exp2f(m1 - mn1);  // 0 while m was -inf
    l0 *= corr0;
    l1 *= corr1;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      acc[nt][0] *= corr0;
      acc[nt][1] *= corr0;
      acc[nt][2] *= corr1;
      acc[nt][3] *= corr1;
    }
    uint32_t pa[4];
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
      const float p0 = exp2f(sc[tile][0] - mn0), p1 = exp2f(sc[tile][1] - mn0);
      const float p2 = exp2f(sc[tile][2] - mn1), p3 = exp2f(sc[tile][3] - mn1);
      pa[2 * tile] = pack_bf16x2(p0, p1);
      pa[2 * tile + 1] = pack_bf16x2(p2, p3);
      l0 += bf16x2_lo(pa[2 * tile]) + bf16x2_hi(pa[2 * tile]);
      l1 += bf16x2_lo(pa[2 * tile + 1]) + bf16x2_hi(pa[2 * tile + 1]);
    }
    const uint32_t a_frag[4] = {pa[0], pa[1], pa[2], pa[3]};
    const uint32_t* v0 = reinterpret_cast<const uint32_t*>(vw[0]);
    const uint32_t* v1 = reinterpret_cast<const uint32_t*>(vw[1]);
    const uint32_t* v2 = reinterpret_cast<const uint32_t*>(vw[2]);
    const uint32_t* v3 = reinterpret_cast<const uint32_t*>(vw[3]);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      // Dim r kNt + nt of keys 2c, 2c + 1 (b0) and 2c + 8, 2c + 9 (b1), lower key in the low half.
      const unsigned sel = (nt & 1) ? 0x7632u : 0x5410u;
      const uint32_t b0 = __byte_perm(v0[nt / 2], v1[nt / 2], sel);
      const uint32_t b1 = __byte_perm(v2[nt / 2], v3[nt / 2], sel);
      mma_bf16_16816(acc[nt], a_frag, b0, b1);
    }
    m0 = mn0;
    m1 = mn1;
  }

  // Row sums over the four lanes of a row; the states into shared memory through O's map.
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o);
    l1 += __shfl_xor_sync(0xffffffffu, l1, o);
  }
  if (c == 0) {
    sm.m[warp][r] = m0 * kLn2;  // -inf stays -inf (a warp without keys)
    sm.m[warp][r + 8] = m1 * kLn2;
    sm.l[warp][r] = l0;
    sm.l[warp][r + 8] = l1;
  }
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    sm.acc[warp][r][2 * c * kNt + nt] = acc[nt][0];
    sm.acc[warp][r][(2 * c + 1) * kNt + nt] = acc[nt][1];
    sm.acc[warp][r + 8][2 * c * kNt + nt] = acc[nt][2];
    sm.acc[warp][r + 8][(2 * c + 1) * kNt + nt] = acc[nt][3];
  }
  __syncthreads();
  finish_block<kTcWarps>(&sm.m[0][0], &sm.l[0][0], &sm.acc[0][0][0], kTcMaxGroup, kHd + 1, group, kHd, head0, t,
                         n_heads, split, n_splits, sinks, out, out_stride, part);
}

template <int kHd, bool kPrep>
__global__ void __launch_bounds__(kTcThreads)
    attention_decode_tc_kernel(const float* __restrict__ q, int64_t q_stride, const int64_t* __restrict__ positions,
                               PagedKv kv, int n_heads, int group, float scale, int window,
                               const float* __restrict__ sinks, float* __restrict__ out, int64_t out_stride,
                               int n_splits, Partials part, DecodePrep prep) {
  pdl_begin();
  __shared__ TcSmem<kHd, kPrep> sm;
  const SplitRange sr = split_range(positions, kv, blockIdx.z, window, blockIdx.x, n_splits, kTcMinSplitKeys);
  decode_split_tc<kHd, kPrep>(q, q_stride, kv, n_heads, group, scale, sinks, out, out_stride, n_splits, part, prep, sr,
                              sm);
}

// Both forms in one launch, chosen per query row on the device from its visible span: the f32
// kernel below tc_min_span keys (at short context its splits are many short ones side by side
// and it is the quicker: ~3 us a layer at 512 keys on the Qwen3-30B-A3B shape), the tensor
// cores from there (twice as fast at 8k). Positions live on the device and a CUDA graph
// replays one launch for every context length, so the host cannot make this choice; rows of
// different sequences in one step each get their own. Both forms use the same grid when the
// f32 form takes the whole GQA group in one block (group <= 8) and the same partial layout.
template <int kHd, int kGroupTile>
union AutoSmem {
  F32Smem<kHd, kGroupTile> f32;
  TcSmem<kHd, false> tc;
};

template <int kHd, int kGroupTile>
__global__ void __launch_bounds__(kTcThreads)
    attention_decode_auto_kernel(const float* __restrict__ q, int64_t q_stride, const int64_t* __restrict__ positions,
                                 PagedKv kv, int n_heads, int group, float scale, int window,
                                 const float* __restrict__ sinks, float* __restrict__ out, int64_t out_stride,
                                 int n_splits, Partials part, int64_t tc_min_span) {
  static_assert(kTcThreads == kDecodeThreads && kGroupTile <= 8);
  const bool early = gridDim.z == 1;  // see "Keys read before the PDL wait"
  if (!early) pdl_begin();
  __shared__ AutoSmem<kHd, kGroupTile> sm;
  const int64_t t = blockIdx.z;
  if (visible_span(positions[t], window) >= tc_min_span) {
    if (early) pdl_begin();
    const SplitRange sr = split_range(positions, kv, t, window, blockIdx.x, n_splits, kTcMinSplitKeys);
    decode_split_tc<kHd, false>(q, q_stride, kv, n_heads, group, scale, sinks, out, out_stride, n_splits, part,
                                DecodePrep{}, sr, sm.tc);
  } else {
    const SplitRange sr = split_range(positions, kv, t, window, blockIdx.x, n_splits, kMinSplitKeys);
    decode_split_f32<kHd, kGroupTile>(q, q_stride, kv, n_heads, group, 1, scale, sinks, out, out_stride, n_splits,
                                      part, sr, sm.f32, early);
  }
}

// Merges the splits of one (row, head): out = sum_s acc_s e^(m_s - M) / (sum_s l_s e^(m_s - M)
// + e^(sink - M)), M the largest of the m_s and the sink. Bound: reading n_splits * head_dim
// partial floats per head, from L2 (the decode kernel just wrote them).
__global__ void __launch_bounds__(kCombineThreads)
    attention_combine_kernel(Partials part, int n_heads, int head_dim, int n_splits, const float* __restrict__ sinks,
                             float* __restrict__ out, int64_t out_stride) {
  pdl_begin();
  __shared__ float s_f[kMaxSplits];
  __shared__ float s_denom;
  __shared__ int s_live;
  const int h = blockIdx.x;
  const int64_t t = blockIdx.y;
  const int64_t slot0 = (t * n_heads + h) * n_splits;
  if (threadIdx.x < kWarp) {
    float mm = sinks ? sinks[h] : -INFINITY;
    for (int s = threadIdx.x; s < n_splits; s += kWarp) mm = fmaxf(mm, part.m[slot0 + s]);
    mm = warp_max(mm);  // finite: the split holding position pos is never empty
    float denom = 0.f;
    int live = 0;  // splits fill in order, so the non-empty ones are a prefix: [0, live)
    for (int s = threadIdx.x; s < n_splits; s += kWarp) {
      const float m = part.m[slot0 + s];
      const float f = m == -INFINITY ? 0.f : expf(m - mm);
      s_f[s] = f;
      denom += part.l[slot0 + s] * f;
      if (m != -INFINITY) live = s + 1;
    }
    denom = warp_sum(denom);
#pragma unroll
    for (int o = kWarp / 2; o > 0; o >>= 1) live = max(live, __shfl_xor_sync(0xffffffffu, live, o));
    if (threadIdx.x == 0) {
      s_denom = denom + (sinks ? expf(sinks[h] - mm) : 0.f);
      s_live = live;
    }
  }
  __syncthreads();
  const float inv = 1.f / s_denom;
  const int live = s_live;
  // Only the live splits are read (a short context in a graph sized for long ones leaves most
  // empty: reading all 64 cost ~10 us per layer), four independent sums for load parallelism.
  for (int d = threadIdx.x; d < head_dim; d += kCombineThreads) {
    const float* acc = part.acc + slot0 * head_dim + d;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
    int s = 0;
    for (; s + 4 <= live; s += 4) {
      a0 += acc[int64_t(s) * head_dim] * s_f[s];
      a1 += acc[int64_t(s + 1) * head_dim] * s_f[s + 1];
      a2 += acc[int64_t(s + 2) * head_dim] * s_f[s + 2];
      a3 += acc[int64_t(s + 3) * head_dim] * s_f[s + 3];
    }
    for (; s < live; ++s) a0 += acc[int64_t(s) * head_dim] * s_f[s];
    out[t * out_stride + int64_t(h) * head_dim + d] = ((a0 + a1) + (a2 + a3)) * inv;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

int sm_count() {
  int device = 0, n = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device), "attention: cudaGetDevice");
  TS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "attention: SM count");
  return n;
}

template <int kHdMax, int kGroupTile>
void launch_decode(const Mat& q, const int64_t* positions, const PagedKv& kv, int n_heads, int group, float scale,
                   int window, const float* sinks, const Mat& out, int n_splits, const Partials& part,
                   cudaStream_t stream) {
  const int head_chunks = (group + kGroupTile - 1) / kGroupTile;
  const dim3 grid(unsigned(n_splits), unsigned(kv.n_kv_heads * head_chunks), unsigned(q.rows));
  launch(attention_decode_kernel<kHdMax, kGroupTile>, grid, kDecodeThreads, 0, stream, q.data, q.stride, positions, kv,
         n_heads, group, head_chunks, scale, window, sinks, out.data, out.stride, n_splits, part);
}

template <int kHdMax>
void launch_decode_hd(int group_tile, const Mat& q, const int64_t* positions, const PagedKv& kv, int n_heads,
                      int group, float scale, int window, const float* sinks, const Mat& out, int n_splits,
                      const Partials& part, cudaStream_t stream) {
  switch (group_tile) {
    case 1: return launch_decode<kHdMax, 1>(q, positions, kv, n_heads, group, scale, window, sinks, out, n_splits, part, stream);
    case 2: return launch_decode<kHdMax, 2>(q, positions, kv, n_heads, group, scale, window, sinks, out, n_splits, part, stream);
    case 4: return launch_decode<kHdMax, 4>(q, positions, kv, n_heads, group, scale, window, sinks, out, n_splits, part, stream);
    default: return launch_decode<kHdMax, 8>(q, positions, kv, n_heads, group, scale, window, sinks, out, n_splits, part, stream);
  }
}

}  // namespace

// Shape checks the decode and prefill launchers share (attention_prefill.cu calls it too).
void check_attention_shapes(const char* op, const Mat& q, const KvLayerView& kv, int n_heads, const Mat& out) {
  TS_CHECK(kv.n_kv_heads > 0 && n_heads % kv.n_kv_heads == 0, "{}: {} heads not a multiple of {} kv heads", op,
           n_heads, kv.n_kv_heads);
  TS_CHECK(q.cols >= int64_t(n_heads) * kv.head_dim && out.cols >= int64_t(n_heads) * kv.head_dim &&
               out.rows == q.rows,
           "{}: q [{}, {}] / out [{}, {}] for {} heads of {}", op, q.rows, q.cols, out.rows, out.cols, n_heads,
           kv.head_dim);
  TS_CHECK(kv.head_dim % 4 == 0 && kv.head_dim <= 512, "{}: head_dim {} (the CUDA kernels take multiples of 4 up to 512)",
           op, kv.head_dim);
  check_bf16_pools(op, kv);
  TS_CHECK(aligned16(kv.k) && aligned16(kv.v), "{}: KV pools not 16-byte aligned", op);
  TS_CHECK(kv.block_size > 0 && kv.max_blocks > 0, "{}: block_size {}, max_blocks {}", op, kv.block_size,
           kv.max_blocks);
  TS_CHECK(q.rows <= 65535, "{}: {} query rows (at most 65535 per call)", op, q.rows);
}

int64_t attention_scratch_floats(int64_t rows, int n_heads, int head_dim) {
  return rows * n_heads * kMaxSplits * (int64_t(head_dim) + 2);
}

namespace {

bool env_set(const char* name) {
  const char* v = std::getenv(name);
  return v && std::string_view(v) == "1";
}

// TURBOSPARK_CUDA_DECODE_TC: 1 = the tensor cores at every context length (where they apply),
// 0 = never; unset = per row by span (attention_decode_auto_kernel).
enum class TcEnv { kPerRow, kAlways, kNever };
TcEnv tc_env() {
  static const TcEnv mode = [] {
    const char* v = std::getenv("TURBOSPARK_CUDA_DECODE_TC");
    if (!v || !*v) return TcEnv::kPerRow;
    const std::string_view s(v);
    TS_CHECK(s == "0" || s == "1", "TURBOSPARK_CUDA_DECODE_TC must be 0 or 1, got '{}'", s);
    return s == "1" ? TcEnv::kAlways : TcEnv::kNever;
  }();
  return mode;
}

}  // namespace

int64_t attention_decode_tc_min_span() {
  static const int64_t span = env_count("TURBOSPARK_CUDA_DECODE_TC_MIN_SPAN", kDecodeTcMinSpan, "a count of keys");
  return span;
}

namespace {

enum class Form { kF32, kTc, kPerRow };

void decode_impl(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale, int window,
                 const float* sinks, const Mat& out, float* scratch, int64_t scratch_floats, cudaStream_t stream,
                 DecodeMath math, int64_t tc_min_span, const DecodePrep* prep) {
  const int group = n_heads / kv.n_kv_heads;
  const bool tc_ok = attention_decode_tc_supports(kv.head_dim, group);
  TS_CHECK(math != DecodeMath::kTensorCores || tc_ok,
           "attention_decode: tensor-core kernel asked for head_dim {} with {} heads per kv head (it takes 64 or "
           "128, up to {})", kv.head_dim, group, kTcMaxGroup);
  // Heads per block: the group rounded up to a power of two, at most 8 (2 past head_dim 256,
  // whose V accumulators would not fit a block's static shared memory or registers at more).
  const int max_group_tile = kv.head_dim > 256 ? 2 : 8;
  int group_tile = 1;
  while (group_tile < group && group_tile < max_group_tile) group_tile *= 2;
  int64_t max_context = int64_t(kv.max_blocks) * kv.block_size;  // the longest span a row can see
  if (window > 0) max_context = std::min<int64_t>(max_context, window);
  if (tc_min_span < 0) tc_min_span = attention_decode_tc_min_span();

  Form form = Form::kF32;
  if (math == DecodeMath::kTensorCores || prep) {
    form = Form::kTc;
  } else if (math == DecodeMath::kAuto && tc_ok && tc_env() != TcEnv::kNever) {
    if (tc_env() == TcEnv::kAlways) form = Form::kTc;
    // Per row on the device when both forms share a grid; a group too wide for one f32 block
    // (9..16 heads) is decided here by the longest span a row can reach.
    else if (group <= 8) form = Form::kPerRow;
    else form = max_context >= tc_min_span ? Form::kTc : Form::kF32;
  }
  const bool tc = form == Form::kTc;
  const int head_chunks = form == Form::kF32 ? (group + group_tile - 1) / group_tile : 1;
  const int min_split_keys = tc ? kTcMinSplitKeys : kMinSplitKeys;

  // Split factor: ~2 waves of blocks over the SMs, no more splits than the longest visible
  // context (capacity, or the window) has min_split_keys-key parts, and no more than the
  // scratch holds.
  const int64_t blocks_per_split = q.rows * kv.n_kv_heads * head_chunks;
  int64_t n_splits = std::clamp<int64_t>((2 * sm_count() + blocks_per_split - 1) / blocks_per_split, 1, kMaxSplits);
  n_splits = std::min<int64_t>(n_splits, (max_context + min_split_keys - 1) / min_split_keys);
  const int64_t per_split = q.rows * n_heads * (int64_t(kv.head_dim) + 2);
  n_splits = std::min<int64_t>(n_splits, scratch ? scratch_floats / per_split : 1);
  n_splits = std::max<int64_t>(n_splits, 1);

  Partials part{nullptr, nullptr, nullptr};
  if (n_splits > 1) {
    const int64_t slots = q.rows * n_heads * n_splits;
    part = Partials{scratch, scratch + slots, scratch + 2 * slots};
  }
  const PagedKv pk = paged_kv(kv);
  const int ns = int(n_splits);
  if (tc) {
    const dim3 grid(unsigned(n_splits), unsigned(kv.n_kv_heads), unsigned(q.rows));
    const DecodePrep dp = prep ? *prep : DecodePrep{};
    auto go = [&](auto kernel) {
      launch(kernel, grid, kTcThreads, 0, stream, q.data, q.stride, positions, pk, n_heads, group, scale, window,
             sinks, out.data, out.stride, ns, part, dp);
    };
    if (kv.head_dim == 64) {
      prep ? go(attention_decode_tc_kernel<64, true>) : go(attention_decode_tc_kernel<64, false>);
    } else {
      prep ? go(attention_decode_tc_kernel<128, true>) : go(attention_decode_tc_kernel<128, false>);
    }
  } else if (form == Form::kPerRow) {
    const dim3 grid(unsigned(n_splits), unsigned(kv.n_kv_heads), unsigned(q.rows));
    auto go = [&](auto kernel) {
      launch(kernel, grid, kTcThreads, 0, stream, q.data, q.stride, positions, pk, n_heads, group, scale, window,
             sinks, out.data, out.stride, ns, part, tc_min_span);
    };
    if (kv.head_dim == 64) {
      switch (group_tile) {
        case 1: go(attention_decode_auto_kernel<64, 1>); break;
        case 2: go(attention_decode_auto_kernel<64, 2>); break;
        case 4: go(attention_decode_auto_kernel<64, 4>); break;
        default: go(attention_decode_auto_kernel<64, 8>); break;
      }
    } else {
      switch (group_tile) {
        case 1: go(attention_decode_auto_kernel<128, 1>); break;
        case 2: go(attention_decode_auto_kernel<128, 2>); break;
        case 4: go(attention_decode_auto_kernel<128, 4>); break;
        default: go(attention_decode_auto_kernel<128, 8>); break;
      }
    }
  } else if (kv.head_dim <= 32) {
    launch_decode_hd<32>(group_tile, q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  } else if (kv.head_dim <= 64) {
    launch_decode_hd<64>(group_tile, q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  } else if (kv.head_dim <= 128) {
    launch_decode_hd<128>(group_tile, q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  } else if (kv.head_dim <= 256) {
    launch_decode_hd<256>(group_tile, q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  } else if (group_tile == 1) {
    launch_decode<512, 1>(q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  } else {
    launch_decode<512, 2>(q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  }
  TS_CUDA_LAUNCH_CHECK("attention_decode{} rows {} heads {}/{} head_dim {} splits {} window {}",
                       tc ? " (tc)" : form == Form::kPerRow ? " (per row)" : "",
                       q.rows, n_heads, kv.n_kv_heads, kv.head_dim, n_splits, window);
  if (n_splits > 1) {
    // One block of 128 per (head, row): head_dim <= 512 is at most 4 outputs per thread.
    launch(attention_combine_kernel, dim3(unsigned(n_heads), unsigned(q.rows)), kCombineThreads, 0, stream, part,
           n_heads, kv.head_dim, ns, sinks, out.data, out.stride);
    TS_CUDA_LAUNCH_CHECK("attention_combine rows {} heads {} head_dim {} splits {}", q.rows, n_heads, kv.head_dim,
                         n_splits);
  }
}

}  // namespace

bool attention_decode_prep_enabled() {
  // Opt-in: fusing gave no measurable decode gain on the H200 (Qwen3-30B-A3B Q4_0, 512 keys: 372
  // vs 369 tok/s), and it ties every context length to the tensor-core form.
  static const bool on = env_set("TURBOSPARK_CUDA_DECODE_PREP");
  return on;
}

bool attention_decode_tc_supports(int head_dim, int group) {
  return (head_dim == 64 || head_dim == 128) && group >= 1 && group <= kTcMaxGroup;
}

void attention_decode(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                      int window, const float* sinks, const Mat& out, float* scratch, int64_t scratch_floats,
                      cudaStream_t stream, DecodeMath math, int64_t tc_min_span) {
  check_attention_shapes("attention_decode", q, kv, n_heads, out);
  if (q.rows == 0) return;
  decode_impl(q, positions, kv, n_heads, scale, window, sinks, out, scratch, scratch_floats, stream, math,
              tc_min_span, nullptr);
}

bool attention_decode_prep(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p, const int64_t* positions,
                           const KvLayerView& kv, float scale, int window, const float* sinks, const Mat& out,
                           float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  // Projection biases are attention_prep's alone (the fused forms do not add them).
  if (p.q_bias || p.k_bias || p.v_bias) return false;
  if (q.rows != 1 || k.rows != 1 || v.rows != 1 || p.n_kv_heads != kv.n_kv_heads ||
      p.head_dim != kv.head_dim || p.n_heads % std::max(p.n_kv_heads, 1) != 0 ||
      !attention_decode_tc_supports(p.head_dim, p.n_heads / std::max(p.n_kv_heads, 1)) || p.rotary_dim % 2 != 0 ||
      p.rotary_dim > p.head_dim || (p.q_norm == nullptr) != (p.k_norm == nullptr) ||
      k.cols < int64_t(p.n_kv_heads) * p.head_dim || v.cols < int64_t(p.n_kv_heads) * p.head_dim)
    return false;
  check_attention_shapes("attention_decode_prep", q, kv, p.n_heads, out);
  const DecodePrep prep{k.data, v.data, p};
  decode_impl(q, positions, kv, p.n_heads, scale, window, sinks, out, scratch, scratch_floats, stream,
              DecodeMath::kTensorCores, -1, &prep);
  return true;
}

void attention(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale, int window,
               const float* sinks, const Mat& out, float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  if (q.rows <= kAttentionDecodeMaxRows) {
    attention_decode(q, positions, kv, n_heads, scale, window, sinks, out, scratch, scratch_floats, stream);
    return;
  }
  // Leading rows alone of their sequence (a continuous-batching step's decode rows): the
  // per-row kernel, whose grid spreads every row over the SMs. The tiled kernels group rows
  // by 128 / group query vectors and walk the keys once per sequence among a tile's rows,
  // which for one row per sequence is 16 passes in each of few blocks.
  const int64_t lone = std::min(kv.lone_rows, q.rows);
  if (lone > 0) {
    attention_decode(q.rows_slice(0, lone), positions, kv, n_heads, scale, window, sinks, out.rows_slice(0, lone),
                     scratch, scratch_floats, stream);
    if (lone == q.rows) return;
    KvLayerView rest = kv;
    if (rest.row_seq) rest.row_seq += lone;
    rest.lone_rows = 0;
    attention(q.rows_slice(lone, q.rows - lone), positions + lone, rest, n_heads, scale, window, sinks,
              out.rows_slice(lone, q.rows - lone), scratch, scratch_floats, stream);
    return;
  }
  if (attention_prefill_tc_supports(kv.head_dim)) {
    attention_prefill_tc(q, positions, kv, n_heads, scale, window, sinks, out, stream);
  } else {
    attention_prefill(q, positions, kv, n_heads, scale, window, sinks, out, stream);
  }
}

}  // namespace turbospark::cuda
