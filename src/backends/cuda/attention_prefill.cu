// Attention over the paged KV cache for many query rows (prefill chunks, mixed batches):
// tiled flash attention with an online softmax, f32 SIMT tiles. Same math as
// attention_decode.cu (see there and backends/cpu/kernels_ref.cpp).
//
// Precision: f32 SIMT, agreeing with the CPU to 1e-5. attention() takes the bf16 tensor-core
// kernel (attention_prefill_tc.cu, same tiles and masks) for head_dim <= 128; this one runs
// head_dim 256 (Gemma 3) and 512 (Gemma 4's full-attention layers) and whatever calls it
// directly for f32 agreement.
//
// Tile: kTileQ query vectors (64; 32 at head_dim 512, whose tiles would not fit shared memory
// at 64) x 32 keys per step, 256 threads. The query vectors are (row, head) pairs of one KV
// head's GQA group -- kTileQ / group rows x group heads -- so one K/V tile in shared memory
// serves every head that reads it. Threads form 16 x 16 (ty, tx): thread (ty, tx) owns query
// vectors kQPer ty .. + kQPer - 1 (kQPer = kTileQ / 16); for scores it owns keys tx and
// tx + 16, for the output dims 4tx + 64c .. +3 (c < kHdMax / 64). The 16 threads of a query vector sit in
// one half-warp, so its row max and sum are 4 xor-shuffles. Shared rows are padded by one
// float4 (kHdMax + 4) so the 128-bit reads of a quarter-warp land in 8 distinct bank
// groups.
//
// Rows of one tile may belong to different sequences (row_seq): the tile walks the keys once
// per distinct sequence among its rows (usually one), over [min lo, max pos] of that
// sequence's rows, masking every query vector that is not of that sequence or whose own
// [lo, pos] excludes the key. Causal prefill tiles thus stop at their last row's position.
//
// Bound: at long context, FLOPs (4 * head_dim per query-key pair, f32 FMA; on an H200 SIMT
// peak is ~67 TFLOP/s and shared-memory bandwidth ~1/3 of that here); at short context,
// loading K/V tiles (each KV byte read once per 64 / group rows).
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"
#include "backends/cuda/paged_kv.cuh"
#include "backends/cuda/prefill_tile.cuh"

namespace turbospark::cuda {

namespace {

constexpr int kTileK = 32;    // keys per step
constexpr int kThreads = 256;

// Query vectors per tile: 64, or 32 where 64 would not fit shared memory (head_dim 512).
template <int kHdMax>
constexpr int kTileQFor = kHdMax <= 256 ? 64 : 32;

template <int kHdMax, int kTileQ = kTileQFor<kHdMax>>
struct PrefillSmem {
  static constexpr int kLd = kHdMax + 4;  // Q and K rows, padded one float4
  static constexpr int kLdP = kTileK + 4;
  static constexpr size_t kFloats = size_t(kTileQ) * kLd + size_t(kTileK) * kLd + size_t(kTileK) * kHdMax +
                                    size_t(kTileQ) * kLdP;
  static constexpr size_t kBytes = kFloats * sizeof(float);
};


template <int kHdMax>
__global__ void __launch_bounds__(kThreads)
    attention_prefill_kernel(const float* __restrict__ q, int64_t q_stride, int64_t rows,
                             const int64_t* __restrict__ positions, PagedKv kv, int group, float scale, int window,
                             const float* __restrict__ sinks, float* __restrict__ out, int64_t out_stride) {
  using S = PrefillSmem<kHdMax>;
  constexpr int kTileQ = kTileQFor<kHdMax>;
  constexpr int kQPer = kTileQ / 16;  // query vectors a thread owns
  constexpr int kLd = S::kLd, kLdP = S::kLdP;
  constexpr int kDimGroups = kHdMax / 64 > 0 ? kHdMax / 64 : 1;  // float4 output groups per thread
  extern __shared__ __align__(16) float smem[];
  float* s_q = smem;                     // [kTileQ][kLd]
  float* s_k = s_q + kTileQ * kLd;       // [kTileK][kLd]
  float* s_v = s_k + kTileK * kLd;       // [kTileK][kHdMax]
  float* s_p = s_v + kTileK * kHdMax;    // [kTileQ][kLdP]
  __shared__ PrefillTileQueries<kTileQ> tq;

  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int kv_head = blockIdx.y;
  const int rows_per_tile = kTileQ / group;
  const int64_t row0 = int64_t(blockIdx.x) * rows_per_tile;
  const int hd = kv.head_dim, hd4 = hd / 4;

  // Query vectors: m -> (row row0 + m / group, head kv_head * group + m % group).
  tq.init(tid, row0, rows_per_tile, group, rows, positions, window, kv.row_seq);
  for (int i = tid; i < kTileQ * kHdMax; i += kThreads) {
    const int m = i / kHdMax, d = i % kHdMax;
    const int64_t t = row0 + m / group;
    float val = 0.f;
    if (m < rows_per_tile * group && t < rows && d < hd)
      val = q[t * q_stride + int64_t(kv_head * group + m % group) * hd + d];
    s_q[m * kLd + d] = val;
  }

  float o[kQPer][kDimGroups][4];
  float m_run[kQPer], l_run[kQPer];
#pragma unroll
  for (int i = 0; i < kQPer; ++i) {
    m_run[i] = -INFINITY;
    l_run[i] = 0.f;
#pragma unroll
    for (int c = 0; c < kDimGroups; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[i][c][e] = 0.f;
  }

  for (;;) {
    const int cur_seq = tq.next_pass(tid);
    if (cur_seq < 0) break;
    const long long kmin = tq.kmin, kmax = tq.kmax;
    const int32_t* table = kv.block_table + int64_t(cur_seq) * kv.max_blocks;
    // Per owned query vector: active in this pass, and its visible range.
    bool act[kQPer];
    long long lo_i[kQPer], pos_i[kQPer];
#pragma unroll
    for (int i = 0; i < kQPer; ++i) {
      const int m = kQPer * ty + i;
      act[i] = tq.state[m] == 1;
      lo_i[i] = tq.lo[m];
      pos_i[i] = tq.pos[m];
    }

    for (long long k0 = kmin; k0 <= kmax; k0 += kTileK) {
      // K and V tiles: kTileK keys x head_dim, 8-byte loads of 4 bf16 (pools 16-byte aligned,
      // head_dim % 4 == 0); keys past kmax and dims past head_dim are zero.
      for (int i = tid; i < kTileK * (kHdMax / 4); i += kThreads) {
        const int n = i / (kHdMax / 4), d4 = i % (kHdMax / 4);
        const long long p = k0 + n;
        float4 kk = make_float4(0.f, 0.f, 0.f, 0.f), vv = kk;
        if (p <= kmax && d4 < hd4) {
          const int64_t off = pool_offset(kv, table, p, kv_head) + 4 * d4;
          kk = load_bf16x4(kv.k + off);
          vv = load_bf16x4(kv.v + off);
        }
        *reinterpret_cast<float4*>(&s_k[n * kLd + 4 * d4]) = kk;
        *reinterpret_cast<float4*>(&s_v[n * kHdMax + 4 * d4]) = vv;
      }
      __syncthreads();

      // Scores for (4ty + i, tx + 16j).
      float s[kQPer][2];
#pragma unroll
      for (int i = 0; i < kQPer; ++i) s[i][0] = s[i][1] = 0.f;
      for (int d = 0; d < hd; d += 4) {
        float4 qa[kQPer], kb[2];
#pragma unroll
        for (int i = 0; i < kQPer; ++i) qa[i] = *reinterpret_cast<const float4*>(&s_q[(kQPer * ty + i) * kLd + d]);
#pragma unroll
        for (int j = 0; j < 2; ++j) kb[j] = *reinterpret_cast<const float4*>(&s_k[(tx + 16 * j) * kLd + d]);
#pragma unroll
        for (int i = 0; i < kQPer; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j)
            s[i][j] += qa[i].x * kb[j].x + qa[i].y * kb[j].y + qa[i].z * kb[j].z + qa[i].w * kb[j].w;
      }
      // Mask, online softmax update, probabilities to shared memory.
#pragma unroll
      for (int i = 0; i < kQPer; ++i) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const long long p = k0 + tx + 16 * j;
          const bool ok = act[i] && p >= lo_i[i] && p <= pos_i[i];
          s[i][j] = ok ? s[i][j] * scale : -INFINITY;
          tile_max = fmaxf(tile_max, s[i][j]);
        }
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, off));
        const float m_new = fmaxf(m_run[i], tile_max);
        const float corr = m_run[i] == m_new ? 1.f : expf(m_run[i] - m_new);
        float row_sum = 0.f;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const float e = s[i][j] == -INFINITY ? 0.f : expf(s[i][j] - m_new);
          row_sum += e;
          s_p[(kQPer * ty + i) * kLdP + tx + 16 * j] = e;
        }
#pragma unroll
        for (int off = 8; off > 0; off >>= 1) row_sum += __shfl_xor_sync(0xffffffffu, row_sum, off);
        l_run[i] = l_run[i] * corr + row_sum;
        m_run[i] = m_new;
#pragma unroll
        for (int c = 0; c < kDimGroups; ++c)
#pragma unroll
          for (int e = 0; e < 4; ++e) o[i][c][e] *= corr;
      }
      __syncthreads();

      // o += P V over the tile's keys.
      {
        for (int n = 0; n < kTileK; n += 4) {
          float4 pr[kQPer];
#pragma unroll
          for (int i = 0; i < kQPer; ++i) pr[i] = *reinterpret_cast<const float4*>(&s_p[(kQPer * ty + i) * kLdP + n]);
#pragma unroll
          for (int nn = 0; nn < 4; ++nn) {
#pragma unroll
            for (int c = 0; c < kDimGroups; ++c) {
              const float4 vv = *reinterpret_cast<const float4*>(&s_v[(n + nn) * kHdMax + 4 * tx + 64 * c]);
#pragma unroll
              for (int i = 0; i < kQPer; ++i) {
                const float pv = nn == 0 ? pr[i].x : nn == 1 ? pr[i].y : nn == 2 ? pr[i].z : pr[i].w;
                o[i][c][0] += pv * vv.x;
                o[i][c][1] += pv * vv.y;
                o[i][c][2] += pv * vv.z;
                o[i][c][3] += pv * vv.w;
              }
            }
          }
        }
      }
      __syncthreads();  // s_k / s_v / s_p are rewritten by the next step
    }
    tq.end_pass(tid);
  }

  // Normalize (with the sink) and write: out[t, h * hd + d].
#pragma unroll
  for (int i = 0; i < kQPer; ++i) {
    const int m = kQPer * ty + i;
    const int64_t t = row0 + m / group;
    if (m >= rows_per_tile * group || t >= rows) continue;
    const int h = kv_head * group + m % group;
    float factor = 1.f / l_run[i];
    if (sinks) {
      const float mf = fmaxf(m_run[i], sinks[h]);
      const float f = expf(m_run[i] - mf);
      factor = f / (l_run[i] * f + expf(sinks[h] - mf));
    }
    float* orow = out + t * out_stride + int64_t(h) * hd;
#pragma unroll
    for (int c = 0; c < kDimGroups; ++c)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = 4 * tx + 64 * c + e;
        if (d < hd) orow[d] = o[i][c][e] * factor;
      }
  }
}

template <int kHdMax>
void launch_prefill(const Mat& q, const int64_t* positions, const PagedKv& kv, int group, float scale, int window,
                    const float* sinks, const Mat& out, cudaStream_t stream) {
  constexpr size_t bytes = PrefillSmem<kHdMax>::kBytes;
  // Above 48 KB the dynamic limit must be raised (head_dim 128: 76 KB, 2 blocks/SM; 256: 141 KB,
  // 1 block/SM; 512 at 32 query vectors: 198 KB, 1 block/SM; 64: 44 KB, 4-5 blocks/SM).
  static_assert(bytes <= 227 * 1024, "attention_prefill: tile over the SM's shared memory");
  TS_CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_kernel<kHdMax>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(bytes)),
                "attention_prefill: shared memory {} bytes for head_dim <= {}", bytes, kHdMax);
  const int rows_per_tile = kTileQFor<kHdMax> / group;
  const dim3 grid(unsigned((q.rows + rows_per_tile - 1) / rows_per_tile), unsigned(kv.n_kv_heads));
  attention_prefill_kernel<kHdMax><<<grid, kThreads, bytes, stream>>>(q.data, q.stride, q.rows, positions, kv, group,
                                                                       scale, window, sinks, out.data, out.stride);
}

}  // namespace

void attention_prefill(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                       int window, const float* sinks, const Mat& out, cudaStream_t stream) {
  check_attention_shapes("attention_prefill", q, kv, n_heads, out);
  if (q.rows == 0) return;
  const int group = n_heads / kv.n_kv_heads;
  const int tile_q = kv.head_dim <= 256 ? kTileQFor<256> : kTileQFor<512>;
  TS_CHECK(group <= tile_q, "attention_prefill: GQA group {} above {} at head_dim {}", group, tile_q, kv.head_dim);
  const PagedKv pk = paged_kv(kv);
  // head_dim 32 runs the 64 instance: the output layout needs 16 threads x float4 per 64 dims.
  if (kv.head_dim <= 64) {
    launch_prefill<64>(q, positions, pk, group, scale, window, sinks, out, stream);
  } else if (kv.head_dim <= 128) {
    launch_prefill<128>(q, positions, pk, group, scale, window, sinks, out, stream);
  } else if (kv.head_dim <= 256) {
    launch_prefill<256>(q, positions, pk, group, scale, window, sinks, out, stream);
  } else {
    launch_prefill<512>(q, positions, pk, group, scale, window, sinks, out, stream);
  }
  TS_CUDA_LAUNCH_CHECK("attention_prefill rows {} heads {}/{} head_dim {} window {}", q.rows, n_heads, kv.n_kv_heads,
                       kv.head_dim, window);
}

}  // namespace turbospark::cuda
