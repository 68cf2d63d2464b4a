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
#include <algorithm>

#include "backends/cuda/common.cuh"
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

// Layout: a key is read by kLanes lanes, each holding kChunks 4-element chunks of head_dim
// (lane sl holds chunks sl, sl + kLanes, ...): 8-byte loads of 4 bf16, one contiguous
// head_dim * 2 bytes per key (>= 64 B). head_dim 32/64: 4/2 keys per warp at once; 128: one key per warp, one
// float4 per lane; 256: two float4 per lane. Each lane keeps q and the V accumulators of its
// chunks for kGroupTile query heads in registers; the head_dim < kHdMax tail is masked.
// kUnroll keys per lane group per step keep 2 * kUnroll * kChunks 8-byte loads in flight.
template <int kHdMax, int kGroupTile>
__global__ void __launch_bounds__(kDecodeThreads)
    attention_decode_kernel(const float* __restrict__ q, int64_t q_stride, const int64_t* __restrict__ positions,
                            PagedKv kv, int n_heads, int group, int head_chunks, float scale, int window,
                            const float* __restrict__ sinks, float* __restrict__ out, int64_t out_stride,
                            int n_splits, Partials part) {
  pdl_begin();
  constexpr int kLanes = kHdMax / 4 < kWarp ? kHdMax / 4 : kWarp;
  constexpr int kChunks = kHdMax / 4 / kLanes;
  constexpr int kKeysPerWarp = kWarp / kLanes;
  constexpr int kGroups = kDecodeWarps * kKeysPerWarp;  // lane groups per block
  constexpr int kUnroll = kChunks >= 2 ? 2 : 4;

  __shared__ float s_m[kDecodeWarps][kGroupTile];
  __shared__ float s_l[kDecodeWarps][kGroupTile];
  __shared__ float s_acc[kDecodeWarps][kGroupTile][kHdMax];

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

  const int64_t pos = positions[t];
  const int seq = kv.row_seq ? kv.row_seq[t] : 0;
  const int64_t lo = window > 0 ? max(int64_t(0), pos - window + 1) : int64_t(0);
  const int64_t span = pos - lo + 1;
  const int64_t split_len = max(int64_t(kMinSplitKeys), (span + n_splits - 1) / n_splits);
  const int64_t begin = lo + split * split_len;
  const int64_t end = min(pos + 1, begin + split_len);

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

  const int32_t* table = kv.block_table + int64_t(seq) * kv.max_blocks;
  for (int64_t base = begin; base < end; base += int64_t(kGroups) * kUnroll) {
    float4 kk[kUnroll][kChunks], vv[kUnroll][kChunks];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t p = base + int64_t(u) * kGroups + lg;
      valid[u] = p < end;
      const uint16_t* kp = nullptr;
      const uint16_t* vp = nullptr;
      if (valid[u]) {
        const int64_t off = pool_offset(kv, table, p, kv_head);
        kp = kv.k + off;
        vp = kv.v + off;
      }
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int ch = sl + c * kLanes;
        // 8-byte aligned: pools are, and every offset is a multiple of head_dim % 4 == 0 elements.
        const bool ld = valid[u] && ch < hd4;
        kk[u][c] = ld ? load_bf16x4(kp + 4 * ch) : f4_zero();
        vv[u][c] = ld ? load_bf16x4(vp + 4 * ch) : f4_zero();
      }
    }
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
      if (lane == 0) s_m[warp][j] = m[j], s_l[warp][j] = l[j];
#pragma unroll
      for (int c = 0; c < kChunks; ++c) {
        const int ch = sl + c * kLanes;
        if (ch < kHdMax / 4) *reinterpret_cast<float4*>(&s_acc[warp][j][4 * ch]) = acc[j][c];
      }
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n_here * hd; i += kDecodeThreads) {
    const int j = i / hd, d = i - j * hd;
    const int h = head0 + j;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) mm = fmaxf(mm, s_m[w][j]);
    float ll = 0.f, aa = 0.f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float f = s_m[w][j] == -INFINITY ? 0.f : expf(s_m[w][j] - mm);
      ll += s_l[w][j] * f;
      aa += s_acc[w][j][d] * f;
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
  TS_CHECK(kv.head_dim % 4 == 0 && kv.head_dim <= 256, "{}: head_dim {} (the CUDA kernels take multiples of 4 up to 256)",
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

void attention_decode(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                      int window, const float* sinks, const Mat& out, float* scratch, int64_t scratch_floats,
                      cudaStream_t stream) {
  check_attention_shapes("attention_decode", q, kv, n_heads, out);
  if (q.rows == 0) return;
  const int group = n_heads / kv.n_kv_heads;
  int group_tile = 1;  // heads per block: the group rounded up to a power of two, at most 8
  while (group_tile < group && group_tile < 8) group_tile *= 2;
  const int head_chunks = (group + group_tile - 1) / group_tile;

  // Split factor: ~2 waves of blocks over the SMs, no more splits than the longest visible
  // context (capacity, or the window) has kMinSplitKeys-key parts, and no more than the
  // scratch holds.
  const int64_t blocks_per_split = q.rows * kv.n_kv_heads * head_chunks;
  int64_t max_context = int64_t(kv.max_blocks) * kv.block_size;
  if (window > 0) max_context = std::min<int64_t>(max_context, window);
  int64_t n_splits = std::clamp<int64_t>((2 * sm_count() + blocks_per_split - 1) / blocks_per_split, 1, kMaxSplits);
  n_splits = std::min<int64_t>(n_splits, (max_context + kMinSplitKeys - 1) / kMinSplitKeys);
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
  if (kv.head_dim <= 32) {
    launch_decode_hd<32>(group_tile, q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  } else if (kv.head_dim <= 64) {
    launch_decode_hd<64>(group_tile, q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  } else if (kv.head_dim <= 128) {
    launch_decode_hd<128>(group_tile, q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  } else {
    launch_decode_hd<256>(group_tile, q, positions, pk, n_heads, group, scale, window, sinks, out, ns, part, stream);
  }
  TS_CUDA_LAUNCH_CHECK("attention_decode rows {} heads {}/{} head_dim {} splits {} window {}", q.rows, n_heads,
                       kv.n_kv_heads, kv.head_dim, n_splits, window);
  if (n_splits > 1) {
    // One block of 128 per (head, row): head_dim <= 256 is at most 2 outputs per thread.
    launch(attention_combine_kernel, dim3(unsigned(n_heads), unsigned(q.rows)), kCombineThreads, 0, stream, part,
           n_heads, kv.head_dim, ns, sinks, out.data, out.stride);
    TS_CUDA_LAUNCH_CHECK("attention_combine rows {} heads {} head_dim {} splits {}", q.rows, n_heads, kv.head_dim,
                         n_splits);
  }
}

void attention(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale, int window,
               const float* sinks, const Mat& out, float* scratch, int64_t scratch_floats, cudaStream_t stream) {
  if (q.rows <= kAttentionDecodeMaxRows) {
    attention_decode(q, positions, kv, n_heads, scale, window, sinks, out, scratch, scratch_floats, stream);
  } else if (attention_prefill_tc_supports(kv.head_dim)) {
    attention_prefill_tc(q, positions, kv, n_heads, scale, window, sinks, out, stream);
  } else {
    attention_prefill(q, positions, kv, n_heads, scale, window, sinks, out, stream);
  }
}

}  // namespace turbospark::cuda
