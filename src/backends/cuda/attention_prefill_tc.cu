// Prefill attention on tensor cores: the flash-attention loop of attention_prefill.cu (same
// tiles of 64 query vectors of one KV head's GQA group, same passes per sequence, same
// masks, sinks and windows) with both products, S = Q K^T and O += P V, as bf16
// mma.sync.m16n8k16 with f32 accumulation. See attention_prefill.cu for the tile layout and
// backends/cpu/kernels_ref.cpp for the math.
//
// Precision: Q and the probabilities P are rounded to bf16 (8 significant bits) as they
// enter the products (K and V are bf16 in the cache already); scores, the online softmax, the row sums and
// O stay f32. With bf16-exact inputs only P's rounding remains (relative 2^-9 per key, random
// in sign, so the output error shrinks with the number of keys a row sees; the row sums add
// the rounded P, so each output is an exact weighted mean of V); on general inputs
// the score error is ~2^-9 of |q| |k|. The f32 SIMT kernel stays for head_dim above 128 and
// for callers that want the CPU's rounding (tests); attention() takes this one for prefill.
//
// Layout: 8 warps, warp w owns query vectors 16w..16w+15 (the A rows of its mma tiles); keys
// in tiles of 64. K and V rows arrive by cp.async straight from the bf16 pools into one of
// two stages of bf16 tiles (the next tile's copies fly while this one is multiplied), rows
// of head_dim padded to kHd + 8 (the +16 bytes put the 8 rows an mma fragment or ldmatrix
// reads in distinct banks). Q's A fragments live in registers for the whole pass; S's
// accumulators become P's A fragments in registers (an m16n8 C fragment pair has the m16k16
// A layout); V's B fragments come from ldmatrix.trans (V is stored key-major, the product
// wants it dim-major).
//
// Bound: occupancy. 228 registers a thread (Q fragments, S and O accumulators for head_dim
// 128) leave one block (8 warps) per SM, with 104 KB of shared memory (head_dim 128; 205 KB
// while the pools were f32 and staged for a conversion pass); ncu put the tensor pipe at ~10%
// active (4-warp version, f32 pools).
#include <climits>

#include "backends/cuda/common.cuh"
#include "backends/cuda/mma.cuh"
#include "backends/cuda/ops.h"
#include "backends/cuda/paged_kv.cuh"
#include "backends/cuda/prefill_tile.cuh"

namespace turbospark::cuda {

namespace {

// 8 warps and 64-key tiles measured fastest on the H200 (Q4_0 30B-A3B, 8k prompt: 4 warps /
// 32 keys 10169 tok/s, 8 / 32 10625, 8 / 64 11735).
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * kWarp;
constexpr int kTileQ = 16 * kWarps;  // query vectors per block
constexpr int kTileK = 64;           // keys per step
constexpr float kLog2e = 1.4426950408889634f;

// Shared memory: Q as bf16 (read once into registers), then two stages of the bf16 K and V
// tiles the products read (cp.async targets).
template <int kHd>
struct TcSmem {
  static constexpr int kLd = kHd + 8;  // bf16 per row (16-byte aligned rows)
  static constexpr int kStage = 2 * kTileK * kLd;  // K and V of one tile, bf16
  static constexpr size_t kBytes = (size_t(kTileQ) * kLd + 2 * size_t(kStage)) * sizeof(__nv_bfloat16);
};


__device__ __forceinline__ void store_bf16x4(__nv_bfloat16* dst, float4 v) {
  uint2 u;
  u.x = pack_bf16x2(v.x, v.y);
  u.y = pack_bf16x2(v.z, v.w);
  *reinterpret_cast<uint2*>(dst) = u;
}

__device__ __forceinline__ uint32_t lds32(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// Four transposed 8x8 b16 matrices; lane l gives the row address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* row) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

template <int kHd>
__global__ void __launch_bounds__(kThreads)
    attention_prefill_tc_kernel(const float* __restrict__ q, int64_t q_stride, int64_t rows,
                                const int64_t* __restrict__ positions, PagedKv kv, int group, float scale_log2,
                                int window, const float* __restrict__ sinks, float* __restrict__ out,
                                int64_t out_stride) {
  using S = TcSmem<kHd>;
  constexpr int kLd = S::kLd;
  constexpr int kKSteps = kHd / 16;    // depth steps of S = Q K^T
  constexpr int kSTiles = kTileK / 8;  // 8-key column tiles of S
  constexpr int kOTiles = kHd / 8;     // 8-dim column tiles of O
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto* s_q = reinterpret_cast<__nv_bfloat16*>(smem_raw);  // [kTileQ][kLd]
  __nv_bfloat16* s_stage = s_q + kTileQ * kLd;             // [2][K, V][kTileK][kLd]
  __shared__ PrefillTileQueries<kTileQ> tq;

  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp, g = lane / 4, t4 = lane % 4;
  const int kv_head = blockIdx.y;
  const int rows_per_tile = kTileQ / group;
  const int64_t row0 = int64_t(blockIdx.x) * rows_per_tile;
  const int hd = kv.head_dim, hd4 = hd / 4, hd8 = hd / 8;

  // Query vectors: m -> (row row0 + m / group, head kv_head * group + m % group).
  tq.init(tid, row0, rows_per_tile, group, rows, positions, window, kv.row_seq);
  // Q as bf16, zero past head_dim and for empty vectors (q rows need not be 16-byte aligned).
  for (int i = tid; i < kTileQ * (kHd / 4); i += kThreads) {
    const int m = i / (kHd / 4), d4 = i % (kHd / 4);
    const int64_t t = row0 + m / group;
    float4 val = make_float4(0.f, 0.f, 0.f, 0.f);
    if (m < rows_per_tile * group && t < rows && d4 < hd4) {
      const float* src = q + t * q_stride + int64_t(kv_head * group + m % group) * hd + 4 * d4;
      val = make_float4(src[0], src[1], src[2], src[3]);
    }
    store_bf16x4(s_q + m * kLd + 4 * d4, val);
  }
  __syncthreads();
  uint32_t qa[kKSteps][4];
  {
    const __nv_bfloat16* qw = s_q + (16 * warp) * kLd;
#pragma unroll
    for (int ks = 0; ks < kKSteps; ++ks) {
      qa[ks][0] = lds32(qw + g * kLd + 16 * ks + 2 * t4);
      qa[ks][1] = lds32(qw + (g + 8) * kLd + 16 * ks + 2 * t4);
      qa[ks][2] = lds32(qw + g * kLd + 16 * ks + 8 + 2 * t4);
      qa[ks][3] = lds32(qw + (g + 8) * kLd + 16 * ks + 8 + 2 * t4);
    }
  }

  // This thread's C-fragment rows: query vectors mv[0] = 16 warp + g and mv[1] = mv[0] + 8.
  const int mv[2] = {16 * warp + g, 16 * warp + g + 8};
  float o[kOTiles][4];
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // m in log2 units; l per thread
#pragma unroll
  for (int j = 0; j < kOTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;

  for (;;) {
    const int cur_seq = tq.next_pass(tid);
    if (cur_seq < 0) break;
    const long long kmin = tq.kmin, kmax = tq.kmax;
    const int32_t* table = kv.block_table + int64_t(cur_seq) * kv.max_blocks;
    bool act[2];
    long long lo_i[2], pos_i[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      act[r] = tq.state[mv[r]] == 1;
      lo_i[r] = tq.lo[mv[r]];
      pos_i[r] = tq.pos[mv[r]];
    }
    // The warp's own key range in this pass: tiles outside it skip the products.
    long long w_lo = act[0] ? lo_i[0] : LLONG_MAX, w_hi = act[0] ? pos_i[0] : -1;
    if (act[1]) w_lo = min(w_lo, lo_i[1]), w_hi = max(w_hi, pos_i[1]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      w_lo = min(w_lo, __shfl_xor_sync(0xffffffffu, w_lo, off));
      w_hi = max(w_hi, __shfl_xor_sync(0xffffffffu, w_hi, off));
    }

    // Stage `tile` (keys kmin + kTileK tile ..) into buffer `buf` with cp.async, 8 bf16 per
    // copy (head_dim % 8 == 0: every row offset is 16-byte aligned); keys past kmax and dims
    // past head_dim are zero-filled (a zero V row keeps masked keys' garbage out of P V).
    auto issue = [&](long long tile, int buf) {
      __nv_bfloat16* sk = s_stage + buf * S::kStage;
      __nv_bfloat16* sv = sk + kTileK * kLd;
      const long long base = kmin + tile * kTileK;
      for (int i = tid; i < kTileK * (kHd / 8); i += kThreads) {
        const int n = i / (kHd / 8), d8 = i % (kHd / 8);
        const long long p = base + n;
        const bool ok = p <= kmax && d8 < hd8;
        int64_t off = 0;
        if (ok) {
          off = pool_offset(kv, table, p, kv_head) + 8 * d8;
        }
        cp_async16(sk + n * kLd + 8 * d8, kv.k + off, ok ? 16 : 0);
        cp_async16(sv + n * kLd + 8 * d8, kv.v + off, ok ? 16 : 0);
      }
      cp_async_commit();
    };
    const long long n_tiles = (kmax - kmin) / kTileK + 1;
    issue(0, 0);
    for (long long tile = 0; tile < n_tiles; ++tile) {
      const long long k0 = kmin + tile * kTileK;
      if (tile + 1 < n_tiles) {
        issue(tile + 1, int((tile + 1) & 1));
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();  // this tile's stage has landed for every thread
      const __nv_bfloat16* s_k = s_stage + (tile & 1) * S::kStage;
      const __nv_bfloat16* s_v = s_k + kTileK * kLd;

      if (k0 <= w_hi && k0 + kTileK - 1 >= w_lo) {
        // S = Q K^T for this warp's 16 vectors x kTileK keys.
        float s[kSTiles][4];
#pragma unroll
        for (int j = 0; j < kSTiles; ++j) {
          s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
          const __nv_bfloat16* kr = s_k + (8 * j + g) * kLd + 2 * t4;
#pragma unroll
          for (int ks = 0; ks < kKSteps; ++ks) mma_bf16_16816(s[j], qa[ks], lds32(kr + 16 * ks), lds32(kr + 16 * ks + 8));
        }
        // Mask and scale (log2 units); element e of tile j is vector mv[e / 2], key 8j + 2 t4 + e % 2.
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int j = 0; j < kSTiles; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2;
            const long long p = k0 + 8 * j + 2 * t4 + (e & 1);
            const bool ok = act[r] && p >= lo_i[r] && p <= pos_i[r];
            s[j][e] = ok ? s[j][e] * scale_log2 : -INFINITY;
            tile_max[r] = fmaxf(tile_max[r], s[j][e]);
          }
        float corr[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 1));
          tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffffu, tile_max[r], 2));
          const float m_new = fmaxf(m_run[r], tile_max[r]);
          corr[r] = m_run[r] == m_new ? 1.f : exp2f(m_run[r] - m_new);
          m_run[r] = m_new;
        }
        float row_sum[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < kSTiles; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e / 2;
            // Rounded here, as P V will see it: the row sum then normalizes exactly the
            // weights the product used.
            s[j][e] = s[j][e] == -INFINITY ? 0.f : __bfloat162float(__float2bfloat16_rn(exp2f(s[j][e] - m_run[r])));
            row_sum[r] += s[j][e];
          }
#pragma unroll
        for (int r = 0; r < 2; ++r) l_run[r] = l_run[r] * corr[r] + row_sum[r];
#pragma unroll
        for (int j = 0; j < kOTiles; ++j) {
          o[j][0] *= corr[0];
          o[j][1] *= corr[0];
          o[j][2] *= corr[1];
          o[j][3] *= corr[1];
        }
        // O += P V: P's A fragment for keys 16kk.. is S tiles 2kk and 2kk + 1.
#pragma unroll
        for (int kk = 0; kk < kTileK / 16; ++kk) {
          const uint32_t pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                                  pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                  pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
          const __nv_bfloat16* vrow = s_v + (16 * kk + lane % 8 + 8 * ((lane / 8) % 2)) * kLd + 8 * (lane / 16);
#pragma unroll
          for (int j = 0; j < kOTiles; j += 2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, vrow + 8 * j);
            mma_bf16_16816(o[j], pa, b[0], b[1]);
            mma_bf16_16816(o[j + 1], pa, b[2], b[3]);
          }
        }
      }
      __syncthreads();  // every warp is done with this stage before a later issue() refills it
    }
    tq.end_pass(tid);
  }

  // Row sums across the quad, then normalize (with the sink) and write out[t, h * hd + d].
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 1);
    l_run[r] += __shfl_xor_sync(0xffffffffu, l_run[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int m = mv[r];
    const int64_t t = row0 + m / group;
    if (m >= rows_per_tile * group || t >= rows) continue;
    const int h = kv_head * group + m % group;
    float factor = 1.f / l_run[r];
    if (sinks) {
      const float sink = sinks[h] * kLog2e;
      const float mf = fmaxf(m_run[r], sink);
      const float f = exp2f(m_run[r] - mf);
      factor = f / (l_run[r] * f + exp2f(sink - mf));
    }
    float* orow = out + t * out_stride + int64_t(h) * hd;
#pragma unroll
    for (int j = 0; j < kOTiles; ++j) {
      const int d = 8 * j + 2 * t4;
      if (d < hd) orow[d] = o[j][2 * r] * factor;
      if (d + 1 < hd) orow[d + 1] = o[j][2 * r + 1] * factor;
    }
  }
}

template <int kHd>
void launch_tc(const Mat& q, const int64_t* positions, const PagedKv& kv, int group, float scale, int window,
               const float* sinks, const Mat& out, cudaStream_t stream) {
  constexpr size_t bytes = TcSmem<kHd>::kBytes;  // head_dim 128: 104 KB, 64: 54 KB
  TS_CUDA_CHECK(cudaFuncSetAttribute(attention_prefill_tc_kernel<kHd>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                     int(bytes)),
                "attention_prefill_tc: shared memory {} bytes for head_dim <= {}", bytes, kHd);
  const int rows_per_tile = kTileQ / group;
  const dim3 grid(unsigned((q.rows + rows_per_tile - 1) / rows_per_tile), unsigned(kv.n_kv_heads));
  attention_prefill_tc_kernel<kHd><<<grid, kThreads, bytes, stream>>>(
      q.data, q.stride, q.rows, positions, kv, group, scale * kLog2e, window, sinks, out.data, out.stride);
}

}  // namespace

bool attention_prefill_tc_supports(int head_dim) { return head_dim <= 128 && head_dim % 8 == 0; }

void attention_prefill_tc(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                          int window, const float* sinks, const Mat& out, cudaStream_t stream) {
  check_attention_shapes("attention_prefill_tc", q, kv, n_heads, out);
  TS_CHECK(attention_prefill_tc_supports(kv.head_dim),
           "attention_prefill_tc: head_dim {} (takes multiples of 8 up to 128)", kv.head_dim);
  if (q.rows == 0) return;
  const int group = n_heads / kv.n_kv_heads;
  TS_CHECK(group <= kTileQ, "attention_prefill_tc: GQA group {} above {}", group, kTileQ);
  const PagedKv pk = paged_kv(kv);
  if (kv.head_dim <= 64) {
    launch_tc<64>(q, positions, pk, group, scale, window, sinks, out, stream);
  } else {
    launch_tc<128>(q, positions, pk, group, scale, window, sinks, out, stream);
  }
  TS_CUDA_LAUNCH_CHECK("attention_prefill_tc rows {} heads {}/{} head_dim {} window {}", q.rows, n_heads,
                       kv.n_kv_heads, kv.head_dim, window);
}

}  // namespace turbospark::cuda
