// One decode row's attention inputs and attention in one launch, for short visible spans:
// attention_prep's norms, RoPE and cache write, the split attention and the merge of the
// splits, where the separate path takes three kernels (attention_prep, the split kernel, the
// combine). At a few hundred keys each of those is a few kilobytes of work whose cost is the
// kernel boundary itself (completion, the next kernel's first dependent load).
//
// Layout: a cluster of n_splits blocks per KV head (grid [n_splits, n_kv_heads], cluster
// [n_splits, 1, 1]); block `split` takes one contiguous part of the row's visible span for all
// the query heads of the GQA group (up to kFusedMaxGroup). The split's keys and values travel
// into shared memory by cp.async in tiles of kFusedTile keys, kFusedStages tiles in flight;
// the first stages are issued before the PDL wait (every key but the row's own position was
// written by an earlier step), so at short spans the whole split arrives while the previous
// kernel drains. After the wait the block normalizes and rotates its group's q heads; the
// block that holds the row's position (the last key of the span) also the new k, writes k and
// v to the cache, and puts both into its tile in place of the slot it did not load. Each tile:
// scores (a lane group per key, the group's heads reduced together), an online softmax per
// head, P V with a thread per (dim, heads). The blocks' states (m, l, acc) stay in shared
// memory; after a cluster barrier each block merges a slice of the outputs by reading the
// others' states through distributed shared memory (no partials in global memory, no combine
// launch), and a second barrier keeps every block's memory alive until all have read it.
//
// Math: as attention_prep.cu (norm: sum of squares in f32, 1 / sqrtf(mean + eps),
// (x * inv_rms) * (w + offset); RoPE rotate-half with rounded products, no contraction) and the
// f32 decode kernel (f32 scores, natural-log online softmax, f32 P V); the new key and value
// enter the math rounded to bf16, as the cache holds them. Only summation orders differ.
#include <cooperative_groups.h>

#include <algorithm>
#include <cstdlib>

#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"
#include "backends/cuda/paged_kv.cuh"

namespace turbospark::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kFusedWarps = 4;
constexpr int kFusedThreads = kFusedWarps * kWarp;
constexpr int kFusedTile = 32;  // keys per tile: a lane per key in the softmax
constexpr int kFusedStages = 2;
constexpr int kFusedMaxGroup = 8;
constexpr int kFusedMaxSplits = 16;    // the largest cluster (non-portable: Hopper allows 16)
constexpr int kFusedMinSplitKeys = 16;  // short spans leave trailing splits empty

template <int kHd>
struct FusedSmem {
  static constexpr int kChunks = kHd / 8;  // 16-byte pieces of a key row
  alignas(16) uint16_t k[kFusedStages][kFusedTile][kHd];  // bf16 bits
  alignas(16) uint16_t v[kFusedStages][kFusedTile][kHd];
  float q[kFusedMaxGroup][kHd];       // the group's q heads, normed and rotated
  float s[kFusedMaxGroup][kFusedTile];  // a tile's scores, then its probabilities
  float m[kFusedMaxGroup], l[kFusedMaxGroup], corr[kFusedMaxGroup];
  float acc[kFusedMaxGroup][kHd];     // the block's V accumulators, read by the cluster's merge
  float own_k[kHd];                   // the new key, normed and rotated (the owner block)
  float cs[kHd];                      // cos | sin of the row's position
  float gm[kFusedMaxSplits][kFusedMaxGroup], gl[kFusedMaxSplits][kFusedMaxGroup];
};

// Sums each of kN values over the kLanes lanes of a lane group (kLanes a power of two <= 32)
// in log2(kLanes) shuffle rounds, halving the values a lane keeps while it holds more than one:
// 8 heads over 32 lanes take 4 + 2 + 1 + 1 + 1 shuffles instead of 8 * 5. Afterwards the lane
// holds the sums of max(1, kN / kLanes) consecutive heads from reduced_base().
template <int kN, int kO>
__device__ __forceinline__ void reduce_heads(float* v, int sl) {
  if constexpr (kO >= 1) {
    if constexpr (kN > 1) {
      const bool up = (sl & kO) != 0;
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) {
        const float keep = up ? v[i + kN / 2] : v[i];
        const float send = up ? v[i] : v[i + kN / 2];
        v[i] = keep + __shfl_xor_sync(0xffffffffu, send, kO);
      }
      reduce_heads<kN / 2, kO / 2>(v, sl);
    } else {
      v[0] += __shfl_xor_sync(0xffffffffu, v[0], kO);
      reduce_heads<1, kO / 2>(v, sl);
    }
  }
}
template <int kN, int kO>
__device__ __forceinline__ int reduced_base(int sl) {
  if constexpr (kO >= 1 && kN > 1) {
    return ((sl & kO) ? kN / 2 : 0) + reduced_base<kN / 2, kO / 2>(sl);
  } else {
    return 0;
  }
}
// Whether lane sl is the one that writes its reduced values (the lanes that only added full
// sums hold copies).
template <int kN, int kO>
__device__ __forceinline__ bool reduced_writer(int sl) {
  if constexpr (kO >= 1) {
    if constexpr (kN > 1) return reduced_writer<kN / 2, kO / 2>(sl);
    else return (sl & kO) == 0 && reduced_writer<1, kO / 2>(sl);
  } else {
    return true;
  }
}

struct FusedArgs {
  const float* q;  // [1, n_heads * head_dim] before norm and RoPE (any alignment)
  const float* k;  // [1, n_kv_heads * head_dim]
  const float* v;
  AttentionPrep p;
  const int64_t* positions;
  PagedKv kv;
  float scale;
  int window;
  const float* sinks;
  float* out;  // [1, n_heads * head_dim]
};

template <int kHd>
__global__ void __launch_bounds__(kFusedThreads) attention_decode_fused_kernel(FusedArgs a) {
  constexpr int kChunks = FusedSmem<kHd>::kChunks;
  constexpr int kKeyLanes = kHd / 4 < kWarp ? kHd / 4 : kWarp;  // lanes per key in the scores
  static_assert(kKeyLanes * 4 == kHd, "a lane holds four dims of a key");
  constexpr int kKeysPerWarp = kWarp / kKeyLanes;
  constexpr int kHeadsPerThread = kFusedMaxGroup * kHd / kFusedThreads;  // P V: a thread per (dim, heads)
  static_assert(kHeadsPerThread >= 1 && kFusedThreads % kHd == 0);
  static_assert(kFusedTile == kWarp, "the softmax gives a lane to each key of a tile");
  constexpr int kHeld = kFusedMaxGroup / kKeyLanes > 0 ? kFusedMaxGroup / kKeyLanes : 1;

  __shared__ FusedSmem<kHd> sm;
  cg::cluster_group cluster = cg::this_cluster();
  const int n_splits = int(gridDim.x);
  const int split = int(blockIdx.x);  // == the block's rank in its cluster (cluster = the grid's x)
  const int kv_head = int(blockIdx.y);
  const int tid = int(threadIdx.x), warp = tid / kWarp, lane = tid % kWarp;
  const AttentionPrep& pp = a.p;
  const int group = pp.n_heads / pp.n_kv_heads;
  const int head0 = kv_head * group;
  const PagedKv& kv = a.kv;

  // The split's keys (positions, row_seq and the block table were uploaded before the step).
  const int64_t pos = a.positions[0];
  const int seq = kv.row_seq ? kv.row_seq[0] : 0;
  const int64_t span = a.window > 0 ? min(pos + 1, int64_t(a.window)) : pos + 1;
  const int64_t len = max(int64_t(kFusedMinSplitKeys), (span + n_splits - 1) / n_splits);
  const int64_t begin = pos - span + 1 + int64_t(split) * len;
  const int64_t end = min(pos + 1, begin + len);
  const int n_keys = end > begin ? int(end - begin) : 0;
  const int n_tiles = (n_keys + kFusedTile - 1) / kFusedTile;
  const bool owner = n_keys > 0 && end == pos + 1;  // the split holding the new key
  const int32_t* table = kv.block_table + int64_t(seq) * kv.max_blocks;

  // A tile's keys and values into its stage; the row's own slot is zero-filled (written below).
  auto issue = [&](int tile) {
    const int stage = tile % kFusedStages;
    const int64_t key0 = begin + int64_t(tile) * kFusedTile;
    const int nk = int(min(int64_t(kFusedTile), end - key0));
    for (int i = tid; i < 2 * kFusedTile * kChunks; i += kFusedThreads) {
      const bool is_v = i >= kFusedTile * kChunks;
      const int rem = is_v ? i - kFusedTile * kChunks : i;
      const int key = rem / kChunks, ch = rem - key * kChunks;
      const int64_t p = key0 + key;
      const bool live = key < nk && p != pos;
      const uint16_t* pool = is_v ? kv.v : kv.k;
      const uint16_t* src = live ? pool + pool_offset(kv, table, p, kv_head) + ch * 8 : pool;
      uint16_t* dst = is_v ? &sm.v[stage][key][ch * 8] : &sm.k[stage][key][ch * 8];
      cp_async16(dst, src, live ? 16 : 0);
    }
  };
#pragma unroll
  for (int t = 0; t < kFusedStages; ++t) {
    if (t < n_tiles) issue(t);
    cp_async_commit();  // an empty group past the last tile keeps the wait counts uniform
  }

  pdl_begin();

  // The group's q heads (and the owner's new k): norm, then RoPE, in shared memory.
  const int half = pp.rotary_dim / 2;
  if (n_keys > 0) {
    const float fpos = float(pos);  // int64 -> float rounds to nearest, as attention_prep.cu
    for (int i = tid; i < half; i += kFusedThreads) {
      float sn, cs;
      sincosf(fpos * pp.inv_freq[i], &sn, &cs);
      sm.cs[i] = cs * pp.attention_factor;
      sm.cs[half + i] = sn * pp.attention_factor;
    }
    const int n_rows = group + (owner ? 1 : 0);
    for (int j = warp; j < n_rows; j += kFusedWarps) {  // a warp per head
      const bool is_k = j == group;
      float* dst = is_k ? sm.own_k : sm.q[j];
      const float* src = is_k ? a.k + int64_t(kv_head) * kHd : a.q + int64_t(head0 + j) * kHd;
      const float* w = is_k ? pp.k_norm : pp.q_norm;
      float inv_rms = 1.f;
      if (w) {
        float ss = 0.f;
        for (int d = lane; d < kHd; d += kWarp) ss += src[d] * src[d];
        ss = warp_sum(ss);
        inv_rms = 1.f / sqrtf(ss / float(kHd) + pp.norm_eps);
      }
      for (int d = lane; d < kHd; d += kWarp) dst[d] = w ? (src[d] * inv_rms) * (w[d] + pp.norm_offset) : src[d];
    }
    for (int j = group; j < kFusedMaxGroup; ++j)  // unused heads score 0 and are never written
      for (int d = tid; d < kHd; d += kFusedThreads) sm.q[j][d] = 0.f;
    __syncthreads();
    for (int e = tid; e < n_rows * half; e += kFusedThreads) {
      const int j = e / half, i = e - j * half;
      float* h = j == group ? sm.own_k : sm.q[j];
      const float c = sm.cs[i], sn = sm.cs[half + i];
      const float x = h[i], y = h[i + half];
      h[i] = __fsub_rn(__fmul_rn(x, c), __fmul_rn(y, sn));
      h[i + half] = __fadd_rn(__fmul_rn(y, c), __fmul_rn(x, sn));
    }
    if (owner) {
      __syncthreads();
      const int64_t off = pool_offset(kv, table, pos, kv_head);
      auto* k_pool = const_cast<uint16_t*>(kv.k);
      auto* v_pool = const_cast<uint16_t*>(kv.v);
      const float* vr = a.v + int64_t(kv_head) * kHd;
      for (int d = tid; d < kHd; d += kFusedThreads) {
        k_pool[off + d] = f32_to_bf16_bits(sm.own_k[d]);
        v_pool[off + d] = f32_to_bf16_bits(vr[d]);
      }
    }
  }
  if (tid < kFusedMaxGroup) {
    sm.m[tid] = -INFINITY;
    sm.l[tid] = 0.f;
    sm.corr[tid] = 1.f;
  }
  __syncthreads();

  // q in registers for the scores: lane sl of a key's lane group holds dims [4 sl, 4 sl + 4).
  const int sl = lane % kKeyLanes;
  float4 qv[kFusedMaxGroup];
#pragma unroll
  for (int j = 0; j < kFusedMaxGroup; ++j) qv[j] = *reinterpret_cast<const float4*>(&sm.q[j][4 * sl]);
  const int pv_d = tid % kHd, pv_h0 = (tid / kHd) * kHeadsPerThread;
  float acc[kHeadsPerThread];
#pragma unroll
  for (int i = 0; i < kHeadsPerThread; ++i) acc[i] = 0.f;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile % kFusedStages;
    const int64_t key0 = begin + int64_t(tile) * kFusedTile;
    const int nk = int(min(int64_t(kFusedTile), end - key0));
    cp_async_wait<kFusedStages - 1>();
    __syncthreads();
    if (owner && pos - key0 < kFusedTile) {  // the new key and value, rounded as the cache holds them
      const int key = int(pos - key0);
      const float* vr = a.v + int64_t(kv_head) * kHd;
      for (int d = tid; d < kHd; d += kFusedThreads) {
        sm.k[stage][key][d] = f32_to_bf16_bits(sm.own_k[d]);
        sm.v[stage][key][d] = f32_to_bf16_bits(vr[d]);
      }
      __syncthreads();
    }
    // Scores: a lane group per key, all the group's heads at once.
    for (int kb = warp * kKeysPerWarp; kb < kFusedTile; kb += kFusedWarps * kKeysPerWarp) {
      const int key = kb + lane / kKeyLanes;
      const bool valid = key < nk;
      const uint2 u = *reinterpret_cast<const uint2*>(&sm.k[stage][valid ? key : 0][4 * sl]);
      const float4 k4 = make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                                    __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
      float vals[kFusedMaxGroup];
#pragma unroll
      for (int j = 0; j < kFusedMaxGroup; ++j)
        vals[j] = qv[j].x * k4.x + qv[j].y * k4.y + qv[j].z * k4.z + qv[j].w * k4.w;
      reduce_heads<kFusedMaxGroup, kKeyLanes / 2>(vals, sl);
      if (reduced_writer<kFusedMaxGroup, kKeyLanes / 2>(sl)) {
        const int jb = reduced_base<kFusedMaxGroup, kKeyLanes / 2>(sl);
#pragma unroll
        for (int i = 0; i < kHeld; ++i) sm.s[jb + i][key] = valid ? vals[i] * a.scale : -INFINITY;
      }
    }
    __syncthreads();
    // Online softmax: a warp per head, a lane per key.
    for (int j = warp; j < group; j += kFusedWarps) {
      const float x = sm.s[j][lane];  // -inf past the tile's keys
      const float m_old = sm.m[j];
      const float m_new = fmaxf(m_old, warp_max(x));  // finite: the tile's first key is valid
      const float p = lane < nk ? expf(x - m_new) : 0.f;
      const float lt = warp_sum(p);
      sm.s[j][lane] = p;
      if (lane == 0) {
        const float corr = m_old == -INFINITY ? 0.f : expf(m_old - m_new);
        sm.corr[j] = corr;
        sm.l[j] = sm.l[j] * corr + lt;
        sm.m[j] = m_new;
      }
    }
    __syncthreads();
    // P V: thread (pv_d, pv_h0..) over the tile's keys. Rows past the group hold scores of a
    // zero q (0) and corr 1: their accumulators stay finite and are never read.
#pragma unroll
    for (int i = 0; i < kHeadsPerThread; ++i) acc[i] *= sm.corr[pv_h0 + i];
    for (int key = 0; key < nk; ++key) {
      const float vv = bf16_bits_to_f32(sm.v[stage][key][pv_d]);
#pragma unroll
      for (int i = 0; i < kHeadsPerThread; ++i) acc[i] += sm.s[pv_h0 + i][key] * vv;
    }
    __syncthreads();  // the stage is free again
    if (tile + kFusedStages < n_tiles) issue(tile + kFusedStages);
    cp_async_commit();
  }
  cp_async_wait<0>();
#pragma unroll
  for (int i = 0; i < kHeadsPerThread; ++i) sm.acc[pv_h0 + i][pv_d] = acc[i];

  // Merge the cluster's states: block `split` writes outputs split * threads + tid, stepping by
  // the cluster's threads. Empty splits have m = -inf and weigh nothing; the owner is never empty.
  cluster.sync();
  if (tid < n_splits * group) {
    const int r = tid / group, j = tid - r * group;
    sm.gm[r][j] = cluster.map_shared_rank(&sm.m[0], r)[j];
    sm.gl[r][j] = cluster.map_shared_rank(&sm.l[0], r)[j];
  }
  __syncthreads();
  for (int idx = split * kFusedThreads + tid; idx < group * kHd; idx += n_splits * kFusedThreads) {
    const int j = idx / kHd, d = idx - j * kHd;
    const int h = head0 + j;
    float mm = a.sinks ? a.sinks[h] : -INFINITY;
    for (int r = 0; r < n_splits; ++r) mm = fmaxf(mm, sm.gm[r][j]);
    float den = a.sinks ? expf(a.sinks[h] - mm) : 0.f, num = 0.f;
    for (int r = 0; r < n_splits; ++r) {
      const float mr = sm.gm[r][j];
      if (mr == -INFINITY) continue;
      const float f = expf(mr - mm);
      den += sm.gl[r][j] * f;
      num += cluster.map_shared_rank(&sm.acc[0][0], r)[j * kHd + d] * f;
    }
    a.out[int64_t(h) * kHd + d] = num / den;
  }
  cluster.sync();  // no block leaves while another reads its shared memory
}

// The cluster size: 16 blocks where the device runs such clusters (non-portable, Hopper), else
// the portable 8. Asked once per kernel (one device per process).
template <int kHd>
int fused_cluster_size() {
  static const int n = [] {
    auto kernel = attention_decode_fused_kernel<kHd>;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) != cudaSuccess) {
      (void)cudaGetLastError();
      return 8;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(kFusedMaxSplits, 1, 1);
    cfg.blockDim = dim3(kFusedThreads);
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kFusedMaxSplits;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int clusters = 0;
    if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess || clusters < 1) {
      (void)cudaGetLastError();
      return 8;
    }
    return kFusedMaxSplits;
  }();
  return n;
}

template <int kHd>
void launch_fused(const FusedArgs& args, int n_kv_heads, cudaStream_t stream) {
  // TURBOSPARK_CUDA_DECODE_FUSED_SPLITS: fewer blocks per KV head (a power of two, for measuring).
  static const int64_t asked = env_count("TURBOSPARK_CUDA_DECODE_FUSED_SPLITS", kFusedMaxSplits, "1, 2, 4, 8 or 16");
  TS_CHECK(asked >= 1 && asked <= kFusedMaxSplits && (asked & (asked - 1)) == 0,
           "TURBOSPARK_CUDA_DECODE_FUSED_SPLITS must be 1, 2, 4, 8 or 16, got {}", asked);
  const int n_splits = std::min(int(asked), fused_cluster_size<kHd>());
  launch_cluster(attention_decode_fused_kernel<kHd>, dim3(unsigned(n_splits), unsigned(n_kv_heads)), kFusedThreads,
                 0, stream, unsigned(n_splits), args);
}

}  // namespace

bool attention_decode_fused_supports(int head_dim, int group) {
  return (head_dim == 16 || head_dim == 32 || head_dim == 64 || head_dim == 128) && group >= 1 &&
         group <= kFusedMaxGroup;
}

int64_t attention_decode_fused_max_span() {
  static const int64_t span = env_count("TURBOSPARK_CUDA_DECODE_FUSED_MAX_SPAN", kDecodeFusedMaxSpan,
                                        "a count of keys (0: never fuse)");
  return span;
}

bool attention_decode_fused(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p, const int64_t* positions,
                            const KvLayerView& kv, float scale, int window, const float* sinks, const Mat& out,
                            cudaStream_t stream) {
  // Projection biases are attention_prep's alone (the fused forms do not add them).
  if (p.q_bias || p.k_bias || p.v_bias) return false;
  if (q.rows != 1 || k.rows != 1 || v.rows != 1 || out.rows != 1 || p.n_kv_heads != kv.n_kv_heads ||
      p.n_kv_heads <= 0 || p.head_dim != kv.head_dim || p.n_heads % p.n_kv_heads != 0 ||
      !attention_decode_fused_supports(p.head_dim, p.n_heads / p.n_kv_heads) || p.rotary_dim % 2 != 0 ||
      p.rotary_dim > p.head_dim || (p.q_norm == nullptr) != (p.k_norm == nullptr) ||
      q.cols < int64_t(p.n_heads) * p.head_dim || k.cols < int64_t(p.n_kv_heads) * p.head_dim ||
      v.cols < int64_t(p.n_kv_heads) * p.head_dim)
    return false;
  check_attention_shapes("attention_decode_fused", q, kv, p.n_heads, out);
  const FusedArgs args{q.data, k.data, v.data, p, positions, paged_kv(kv), scale, window, sinks, out.data};
  switch (p.head_dim) {
    case 16: launch_fused<16>(args, p.n_kv_heads, stream); break;
    case 32: launch_fused<32>(args, p.n_kv_heads, stream); break;
    case 64: launch_fused<64>(args, p.n_kv_heads, stream); break;
    default: launch_fused<128>(args, p.n_kv_heads, stream); break;
  }
  TS_CUDA_LAUNCH_CHECK("attention_decode_fused heads {}/{} head_dim {} rotary_dim {} window {}", p.n_heads,
                       p.n_kv_heads, p.head_dim, p.rotary_dim, window);
  return true;
}

}  // namespace turbospark::cuda
