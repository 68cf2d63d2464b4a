// Routed experts, prefill: the kernels and the launcher (MoeCall::prefill) that moe_experts
// (moe.cu) calls for more than kMoeDecodeMaxRows rows; shared types in moe_common.cuh.
//
// Prefill (more rows): rows are grouped by expert on the device: count pairs per expert,
// prefix-sum to offsets and to 128-row tile offsets, scatter pair ids into expert order, and
// gather the activations once in that order as bf16. Then one grouped kernel per projection
// covers every expert's tiles: block (m_tile, n_tile) finds its expert by binary search over
// the tile offsets (device memory; the grid is the host-known upper bound pairs / 128 +
// min(experts, pairs) + 1 and surplus blocks exit at once), streams its rows' activations
// into shared memory with cp.async (two stages), dequantizes the expert's weight tile to
// bf16 while the other stage is multiplied, and multiplies on tensor cores (WMMA 16x16x16,
// f32 accumulate). Gate/up writes act(gate) * up as bf16 in expert order, which the down
// pass streams the same way. Each expert's weights are read once per 128-row tile of its
// rows. A final kernel forms the weighted sum per row.
//   Bound: the dequantize arithmetic and tensor-core issue for experts with many rows (each
//   dequantized weight serves 128 rows); for few rows per expert the weight bytes (HBM). No
//   wgmma/TMA yet (see NOTES_matmul.md).
#include <mma.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "backends/cuda/mma.cuh"
#include "backends/cuda/moe_common.cuh"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda::moe {
namespace {

// ---- prefill: grouping -------------------------------------------------------------------------

constexpr int kScanThreads = 1024;

__global__ void moe_count_kernel(const int32_t* __restrict__ idx, int64_t n_pairs, MoeParams p,
                                 int32_t* __restrict__ counts) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_pairs) return;
  const int32_t e = idx[i];
  if (valid_expert(e, p)) atomicAdd(&counts[e], 1);
}

// One block: exclusive prefix sums of the counts (row offsets) and of the counts in tiles
// (tile offsets), E + 1 entries each; resets the scatter cursors. Experts in chunks of 1024.
__global__ void __launch_bounds__(kScanThreads)
    moe_scan_kernel(const int32_t* __restrict__ counts, int n_experts, int tile_rows, int32_t* __restrict__ offsets,
                    int32_t* __restrict__ tile_offsets, int32_t* __restrict__ cursors) {
  __shared__ int32_t s_rows[kScanThreads], s_tiles[kScanThreads];
  int32_t carry_rows = 0, carry_tiles = 0;
  for (int base = 0; base < n_experts; base += kScanThreads) {
    const int e = base + int(threadIdx.x);
    const int32_t c = e < n_experts ? counts[e] : 0;
    const int32_t tiles = (c + tile_rows - 1) / tile_rows;
    s_rows[threadIdx.x] = c;
    s_tiles[threadIdx.x] = tiles;
    __syncthreads();
    for (int step = 1; step < kScanThreads; step *= 2) {  // Hillis-Steele inclusive scan
      const int32_t r = threadIdx.x >= unsigned(step) ? s_rows[threadIdx.x - step] : 0;
      const int32_t tl = threadIdx.x >= unsigned(step) ? s_tiles[threadIdx.x - step] : 0;
      __syncthreads();
      s_rows[threadIdx.x] += r;
      s_tiles[threadIdx.x] += tl;
      __syncthreads();
    }
    if (e < n_experts) {
      offsets[e] = carry_rows + s_rows[threadIdx.x] - c;
      tile_offsets[e] = carry_tiles + s_tiles[threadIdx.x] - tiles;
      cursors[e] = 0;
    }
    carry_rows += s_rows[kScanThreads - 1];
    carry_tiles += s_tiles[kScanThreads - 1];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    offsets[n_experts] = carry_rows;
    tile_offsets[n_experts] = carry_tiles;
  }
}

// sorted_pairs[pos] = pair for pos in expert e's range; pair_pos[pair] = pos (-1: bad expert id).
// The order within an expert depends on atomics, but each pair's result does not.
__global__ void moe_scatter_kernel(const int32_t* __restrict__ idx, int64_t n_pairs, MoeParams p,
                                   const int32_t* __restrict__ offsets, int32_t* __restrict__ cursors,
                                   int32_t* __restrict__ sorted_pairs, int32_t* __restrict__ pair_pos) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n_pairs) return;
  const int32_t e = idx[i];
  if (!valid_expert(e, p)) {
    pair_pos[i] = -1;
    return;
  }
  const int32_t pos = offsets[e] + atomicAdd(&cursors[e], 1);
  sorted_pairs[pos] = int32_t(i);
  pair_pos[i] = pos;
}

// ---- prefill: grouped tensor-core tiles -----------------------------------------------------------

constexpr int kBM = 128;  // rows (pairs) per tile
constexpr int kBN = 64;   // output features per tile (of each of gate and up)
constexpr int kBK = 32;   // reduction depth per step: 4 units
constexpr int kGroupedThreads = 256;  // 8 warps: 4 (rows) x 2 (cols), each 32 x 32 of every matrix (2 x 2 WMMA)
constexpr int kLdAB = kBK + 8;        // bf16 smem row: 80 bytes (16-byte aligned, staggered banks)
constexpr int kLdC = kBN + 4;         // f32 smem row for the epilogue (ldm % 4 == 0)

template <bool kGateUp>
struct GroupedSmem {
  static constexpr int kMats = kGateUp ? 2 : 1;
  static constexpr size_t kStage = size_t(kBM + kMats * kBN) * kLdAB * 2;  // bytes of one stage's A and B
  static constexpr size_t kOut = size_t(kMats) * kBM * kLdC * 4;
  static constexpr size_t kBytes = 2 * kStage > kOut ? 2 * kStage : kOut;  // gate/up 70 KB, down 35 KB
};

// a[pos, :] = bf16(x[sorted_pairs[pos] / k, :]) for pos < offsets[n_experts]: gate/up's
// activations gathered once, in expert order, so its tiles stream them with cp.async.
__global__ void moe_gather_bf16_kernel(const float* __restrict__ x, int64_t x_stride, const int32_t* __restrict__ sorted_pairs,
                                       const int32_t* __restrict__ total, int k, int64_t cols,
                                       __nv_bfloat16* __restrict__ out, int64_t ld) {
  const int64_t pos = blockIdx.x;
  if (pos >= *total) return;
  const float* xr = x + int64_t(sorted_pairs[pos] / k) * x_stride;
  __nv_bfloat16* dst = out + pos * ld;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[c] = __float2bfloat16_rn(xr[c]);
}

// Row r of the matrices one grouped projection reads: gate and up, or down.
template <bool kGateUp>
__device__ __forceinline__ void projection_rows(const MoeExpertDesc& d, int64_t r, WeightRow (&w)[kGateUp ? 2 : 1]) {
  if constexpr (kGateUp) {
    w[0] = weight_row(d.gate, r);
    w[1] = weight_row(d.up, r);
  } else {
    w[0] = weight_row(d.down, r);
  }
}

// kGateUp: A = the gathered activations ([pairs, hidden] bf16, expert order), B = gate and up,
// the epilogue writes glu(...) as bf16 to dst[pos] ([pairs, inter]). Else: A = that h, B =
// down, the epilogue writes the projection (+ bias) as f32 to dst[pos] ([pairs, hidden]).
//
// Pipeline (one barrier per step): A tiles arrive by cp.async into one of two stages while
// the other stage is multiplied; B tiles are dequantized into registers during the products
// and stored into the next stage after them. Each expert's weights are dequantized once per
// 128-row tile of its rows.
template <class F, bool kGateUp>
__global__ void __launch_bounds__(kGroupedThreads, 2)  // 2 blocks (16 warps) per SM: <= 128 registers
    moe_grouped_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p, const __nv_bfloat16* __restrict__ a_src,
                       int64_t lda, const int32_t* __restrict__ offsets, const int32_t* __restrict__ tile_offsets,
                       void* __restrict__ dst_ptr, int64_t ld_dst, int e_lo, int e_hi) {
  using namespace nvcuda;
  using S = GroupedSmem<kGateUp>;
  constexpr int kMats = S::kMats;
  // The tiles of experts [e_lo, e_hi) (every expert, or one bank of streamed ones).
  const int mt = tile_offsets[e_lo] + int(blockIdx.x);
  if (mt >= tile_offsets[e_hi]) return;
  // The expert owning tile mt: the largest e with tile_offsets[e] <= mt (experts without rows
  // share their successor's offset, so the largest is the one with tiles).
  int lo = e_lo, hi = e_hi - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (tile_offsets[mid] <= mt) lo = mid;
    else hi = mid - 1;
  }
  const int e = lo;
  const int row_begin = offsets[e] + (mt - tile_offsets[e]) * kBM;
  const int row_end = min(row_begin + kBM, offsets[e + 1]);
  const int64_t n0 = int64_t(blockIdx.y) * kBN;
  const int64_t n_out = kGateUp ? p.inter : p.hidden;
  const int64_t depth = kGateUp ? p.hidden : p.inter;
  const MoeExpertDesc& d = experts[e];

  extern __shared__ __align__(128) unsigned char smem[];
  auto stage_a = [&](int s) { return reinterpret_cast<__nv_bfloat16*>(smem + s * S::kStage); };  // [kBM][kLdAB]
  auto stage_b = [&](int s) { return stage_a(s) + kBM * kLdAB; };                               // [kMats][kBN][kLdAB]
  auto* sc = reinterpret_cast<float*>(smem);  // [kMats][kBM][kLdC], after the main loop

  // A: 128 rows x 4 chunks of 8 per step, 2 chunks a thread; B: kMats x 64 rows x 4 units,
  // kMats x 1 unit a thread (slot tid: row tid / 4, unit tid % 4).
  const int tid = threadIdx.x;
  const int b_n = tid / 4, b_q = tid % 4;
  const bool b_valid = n0 + b_n < n_out;
  WeightRow b_row[kMats];
  projection_rows<kGateUp>(d, b_valid ? n0 + b_n : 0, b_row);
  auto issue_a = [&](int64_t k0, int s) {
    __nv_bfloat16* sa = stage_a(s);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = tid + kGroupedThreads * i;
      const int r = c / 4, kc = 8 * (c % 4);
      const int pos = row_begin + r;
      const int64_t kk = k0 + kc;
      const int64_t left = depth - kk;
      const int bytes = pos < row_end && left > 0 ? int(left < 8 ? left : 8) * 2 : 0;
      const __nv_bfloat16* src = bytes ? a_src + int64_t(pos) * lda + kk : a_src;
      cp_async16(sa + r * kLdAB + kc, src, bytes);
    }
    cp_async_commit();
  };
  float bv[kMats][kUnit];
  auto load_b = [&](int64_t k0) {
    const int64_t kk = k0 + 8 * b_q;
#pragma unroll
    for (int m = 0; m < kMats; ++m) {
      if (b_valid && kk + kUnit <= depth) {
        F::unit(b_row[m], kk / kUnit, bv[m]);
      } else {
#pragma unroll
        for (int c = 0; c < kUnit; ++c) bv[m][c] = 0.f;
        if constexpr (F::kTail) {
          if (b_valid)
#pragma unroll
            for (int c = 0; c < kUnit; ++c)
              if (kk + c < depth) bv[m][c] = F::elem(b_row[m], kk + c);
        }
      }
    }
  };
  auto store_b = [&](int s) {
#pragma unroll
    for (int m = 0; m < kMats; ++m) store_bf16x8(stage_b(s) + (m * kBN + b_n) * kLdAB + 8 * b_q, bv[m]);
  };

  const int warp = tid / kWarp, warp_m = warp / 2, warp_n = warp % 2;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kMats][2][2];
#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[m][i][j], 0.f);

  const int64_t n_steps = (depth + kBK - 1) / kBK;
  issue_a(0, 0);
  load_b(0);
  store_b(0);
  for (int64_t step = 0; step < n_steps; ++step) {
    const int s = int(step & 1);
    cp_async_wait<0>();
    __syncthreads();  // stage s complete for all; every warp is past the products of stage s ^ 1
    const bool more = step + 1 < n_steps;
    if (more) {
      issue_a((step + 1) * kBK, s ^ 1);
      load_b((step + 1) * kBK);
    }
    const __nv_bfloat16* sa = stage_a(s);
    const __nv_bfloat16* sb = stage_b(s);
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(fa[i], sa + (32 * warp_m + 16 * i) * kLdAB + kk, kLdAB);
#pragma unroll
      for (int m = 0; m < kMats; ++m) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          // B^T rows in smem = B column-major: element (k, n) at sb[n][k].
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
          wmma::load_matrix_sync(fb, sb + (m * kBN + 32 * warp_n + 16 * j) * kLdAB + kk, kLdAB);
#pragma unroll
          for (int i = 0; i < 2; ++i) wmma::mma_sync(acc[m][i][j], fa[i], fb, acc[m][i][j]);
        }
      }
    }
    if (more) store_b(s ^ 1);
  }
  __syncthreads();  // the stages are reused for C

#pragma unroll
  for (int m = 0; m < kMats; ++m)
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(sc + (m * kBM + 32 * warp_m + 16 * i) * kLdC + 32 * warp_n + 16 * j, acc[m][i][j],
                                kLdC, wmma::mem_row_major);
  __syncthreads();
  for (int s2 = tid; s2 < kBM * kBN; s2 += kGroupedThreads) {
    const int r = s2 / kBN, c = s2 % kBN;
    const int pos = row_begin + r;
    const int64_t n = n0 + c;
    if (pos >= row_end || n >= n_out) continue;
    float v = sc[r * kLdC + c];
    if constexpr (kGateUp) {
      if (d.gate_bias) v += d.gate_bias[n];
      float u = sc[(kBM + r) * kLdC + c];
      if (d.up_bias) u += d.up_bias[n];
      static_cast<__nv_bfloat16*>(dst_ptr)[int64_t(pos) * ld_dst + n] = __float2bfloat16_rn(apply_glu(p, v, u));
    } else {
      if (d.down_bias) v += d.down_bias[n];
      static_cast<float*>(dst_ptr)[int64_t(pos) * ld_dst + n] = v;
    }
  }
}

// out[t, :] = sum_j weight[t, j] * y[pair_pos[t k + j], :]; one block per row.
__global__ void moe_combine_kernel(const float* __restrict__ y, int64_t ldy, const int32_t* __restrict__ pair_pos,
                                   const float* __restrict__ weight, int k, int64_t hidden, float* __restrict__ out,
                                   int64_t out_stride) {
  const int64_t t = blockIdx.x;
  for (int64_t c = threadIdx.x; c < hidden; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < k; ++j) {
      const int32_t pos = pair_pos[t * k + j];
      acc = pos < 0 ? nan_f32() : fmaf(weight[t * k + j], y[int64_t(pos) * ldy + c], acc);
    }
    out[t * out_stride + c] = acc;
  }
}

// ---- few rows per expert: grouped GEMV on tensor cores ----------------------------------------
// A continuous-batching decode step (tens of rows, each picking k of many experts) leaves a few
// rows per expert. The 128-row tiles above then multiply mostly absent rows and wait on their
// weights one 32-deep step at a time (Q4_0 30B-A3B, 64 rows: 0.28 ms a layer for 340 MB). Here
// a block takes 128 output features of one expert for all of that expert's rows, 8 at a time,
// as the swapped product out^T = W x^T on mma.m16n8k16: each warp's 16 feature rows are the A
// operand, dequantized (F::unit) into the warp's own shared-memory slice 32 deep at a time, and
// the expert's activation rows are the B operand, read from shared memory where the block put
// them once. Every weight is read from HBM once per step, by one warp, in full 8-element units.
// Same rounding as the tiled kernel (activations and weights bf16, f32 sums; gate/up's output
// bf16), different summation order.
// (Its shape, kSmall*, is in moe_common.cuh, where moe_small_groups in moe.cu reads it.)
template <class F, bool kGateUp>
__global__ void __launch_bounds__(kSmallThreads)
    moe_grouped_small_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p,
                             const __nv_bfloat16* __restrict__ a_src, int64_t lda, const int32_t* __restrict__ offsets,
                             void* __restrict__ dst_ptr, int64_t ld_dst, int e_lo) {
  constexpr int kMats = kGateUp ? 2 : 1;
  const int e = e_lo + int(blockIdx.x);  // the grid covers experts [e_lo, e_lo + gridDim.x)
  const int begin = offsets[e], end = offsets[e + 1];
  if (begin >= end) return;
  const int64_t n_out = kGateUp ? p.inter : p.hidden;
  const int64_t depth = kGateUp ? p.hidden : p.inter;
  const int64_t ldx = depth + 8;
  const MoeExpertDesc& d = experts[e];
  extern __shared__ __align__(16) unsigned char smem[];
  auto* xs = reinterpret_cast<__nv_bfloat16*>(smem);  // [kSmallCols][ldx]
  const int tid = threadIdx.x, warp = tid / kWarp, lane = tid % kWarp;
  auto* stage = xs + kSmallCols * ldx + warp * kMats * 16 * kSmallLdA;  // [kMats][16][kSmallLdA]

  // This lane's share of a step: feature row fr of the warp's 16, units 2 (lane % 2) + {0, 1}.
  const int64_t n_base = int64_t(blockIdx.y) * kSmallFeatures + 16 * warp;
  const int fr = lane / 2, fu = 2 * (lane % 2);
  const bool row_ok = n_base + fr < n_out;
  WeightRow wrow[kMats];
  projection_rows<kGateUp>(d, row_ok ? n_base + fr : 0, wrow);
  const int r = lane / 4, c = lane % 4;  // fragment coordinates
  const int64_t n_steps = depth / kSmallK;

  // Passes of kSmallCols rows are spread over gridDim.z blocks (an expert most rows chose,
  // as when every sequence decodes the same token, still fills the GPU).
  for (int c0 = begin + int(blockIdx.z) * kSmallCols; c0 < end; c0 += int(gridDim.z) * kSmallCols) {
    const int m = min(kSmallCols, end - c0);
    __syncthreads();  // the previous pass is done with xs
    const int64_t chunks = depth / 8;  // 16-byte pieces of a row
    for (int64_t i = tid; i < kSmallCols * chunks; i += kSmallThreads) {
      const int row = int(i / chunks);
      const int64_t ck = i % chunks;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (row < m) v = *reinterpret_cast<const uint4*>(a_src + int64_t(c0 + row) * lda + 8 * ck);
      *reinterpret_cast<uint4*>(xs + row * ldx + 8 * ck) = v;
    }
    __syncthreads();

    float acc[kMats][4];
#pragma unroll
    for (int mt = 0; mt < kMats; ++mt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
    float w[kMats][2][kUnit];
    auto load = [&](int64_t step) {
#pragma unroll
      for (int mt = 0; mt < kMats; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          if (row_ok) {
            F::unit(wrow[mt], step * (kSmallK / kUnit) + fu + j, w[mt][j]);
          } else {
#pragma unroll
            for (int q = 0; q < kUnit; ++q) w[mt][j][q] = 0.f;
          }
        }
    };
    load(0);
    for (int64_t step = 0; step < n_steps; ++step) {
      __syncwarp();  // the warp's products of the previous step have read the staging slice
#pragma unroll
      for (int mt = 0; mt < kMats; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j) store_bf16x8(stage + (mt * 16 + fr) * kSmallLdA + (fu + j) * kUnit, w[mt][j]);
      __syncwarp();
      if (step + 1 < n_steps) load(step + 1);  // in flight during this step's products
      const int64_t k0 = step * kSmallK;
#pragma unroll
      for (int q = 0; q < kSmallK / 16; ++q) {
        const uint32_t* xr = reinterpret_cast<const uint32_t*>(xs + r * ldx + k0 + 16 * q + 2 * c);
        const uint32_t b0 = xr[0], b1 = xr[4];
#pragma unroll
        for (int mt = 0; mt < kMats; ++mt) {
          const __nv_bfloat16* sa = stage + mt * 16 * kSmallLdA + 16 * q + 2 * c;
          const uint32_t a[4] = {*reinterpret_cast<const uint32_t*>(sa + r * kSmallLdA),
                                 *reinterpret_cast<const uint32_t*>(sa + (r + 8) * kSmallLdA),
                                 *reinterpret_cast<const uint32_t*>(sa + r * kSmallLdA + 8),
                                 *reinterpret_cast<const uint32_t*>(sa + (r + 8) * kSmallLdA + 8)};
          mma_bf16_16816(acc[mt], a, b0, b1);
        }
      }
    }
    // acc[.][i]: feature n_base + r (+ 8 for i >= 2), the pass's row 2c + (i & 1).
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t n = n_base + r + (i >= 2 ? 8 : 0);
      const int row = 2 * c + (i & 1);
      if (row >= m || n >= n_out) continue;
      const int64_t pos = c0 + row;
      if constexpr (kGateUp) {
        static_cast<__nv_bfloat16*>(dst_ptr)[pos * ld_dst + n] =
            __float2bfloat16_rn(biased_glu(d, p, n, acc[0][i], acc[1][i]));
      } else {
        float v = acc[0][i];
        if (d.down_bias) v += d.down_bias[n];
        static_cast<float*>(dst_ptr)[pos * ld_dst + n] = v;
      }
    }
  }
}

}  // namespace

void MoeCall::prefill(DeviceScratch& index_scratch, DeviceScratch& x_bf16_scratch, DeviceScratch& hidden_scratch,
                      DeviceScratch& out_scratch) const {
  // Prefill: group pairs by expert on the device.
  const int64_t n_experts = p.n_experts;
  const size_t n_ints = size_t(n_experts) * 2 + size_t(n_experts + 1) * 2 + size_t(n_pairs) * 2;
  auto* ints = static_cast<int32_t*>(index_scratch.get(n_ints * 4, stream, "moe grouping"));
  int32_t* counts = ints;
  int32_t* cursors = counts + n_experts;
  int32_t* offsets = cursors + n_experts;
  int32_t* tile_offsets = offsets + n_experts + 1;
  int32_t* sorted_pairs = tile_offsets + n_experts + 1;
  int32_t* pair_pos = sorted_pairs + n_pairs;
  TS_CUDA_CHECK(cudaMemsetAsync(counts, 0, size_t(n_experts) * 4, stream), "moe counts reset");
  const unsigned pair_blocks = unsigned((n_pairs + 255) / 256);
  moe_count_kernel<<<pair_blocks, 256, 0, stream>>>(idx, n_pairs, p, counts);
  TS_CUDA_LAUNCH_CHECK("moe count: {} pairs over {} experts", n_pairs, n_experts);
  moe_scan_kernel<<<1, kScanThreads, 0, stream>>>(counts, int(n_experts), kBM, offsets, tile_offsets, cursors);
  TS_CUDA_LAUNCH_CHECK("moe scan: {} experts", n_experts);
  moe_scatter_kernel<<<pair_blocks, 256, 0, stream>>>(idx, n_pairs, p, offsets, cursors, sorted_pairs, pair_pos);
  TS_CUDA_LAUNCH_CHECK("moe scatter: {} pairs", n_pairs);

  // Gate/up's activations in expert order, bf16 (the rounding the tensor cores apply anyway).
  const int64_t lda = round_up(hidden, 8);
  auto* xs = static_cast<__nv_bfloat16*>(x_bf16_scratch.get(size_t(n_pairs * lda) * 2, stream, "moe gathered x"));
  moe_gather_bf16_kernel<<<unsigned(n_pairs), 256, 0, stream>>>(x.data, x.stride, sorted_pairs, offsets + n_experts, k,
                                                               hidden, xs, lda);
  TS_CUDA_LAUNCH_CHECK("moe gather: {} pairs x {}", n_pairs, hidden);
  // Tiles: sum_e ceil(c_e / kBM) <= n_pairs / kBM + (number of experts with rows).
  const int64_t max_tiles = n_pairs / kBM + std::min<int64_t>(n_experts, n_pairs) + 1;
  const int64_t ldh16 = round_up(inter, 8);  // bf16 h rows, 16-byte aligned for the down pass's cp.async
  auto* h16 = static_cast<__nv_bfloat16*>(hidden_scratch.get(size_t(n_pairs * ldh16) * 2, stream, "moe hidden"));
  const int64_t ldy = round_up(hidden, 4);
  auto* y = static_cast<float*>(out_scratch.get(size_t(n_pairs * ldy) * 4, stream, "moe expert outputs"));
  // The experts in ranges: every expert at once, or bank by bank as streamed experts arrive
  // (each range waits for its bank's loads; tiles and blocks compute what one launch over every
  // expert would, so the results do not depend on the banks).
  struct Range {
    int e_lo, e_hi;
    int64_t max_tiles;
    cudaEvent_t ready;
  };
  std::vector<Range> ranges;
  if (banks.empty()) {
    ranges.push_back({0, int(n_experts), max_tiles, nullptr});
  } else {
    int lo = 0;
    for (const MoeBank& b : banks) {
      if (b.pairs > 0)
        ranges.push_back({lo, b.expert_end, b.pairs / kBM + std::min<int64_t>(b.expert_end - lo, b.pairs) + 1, b.ready});
      lo = b.expert_end;
    }
  }
  auto await = [&](const Range& r) {
    if (r.ready) TS_CUDA_CHECK(cudaStreamWaitEvent(stream, r.ready, 0), "moe_experts: waiting for experts {}..{}", r.e_lo, r.e_hi - 1);
  };
  if (moe_small_groups(n_pairs, n_experts, hidden, inter)) {
    // One projection over a range of experts: gate/up (xs -> h16) or down (h16 -> y).
    auto project = [&](auto gate_up, const Range& r) {
      constexpr bool kGateUp = decltype(gate_up)::value;
      const int64_t depth = kGateUp ? hidden : inter, n_out = kGateUp ? inter : hidden;
      dispatch_weight_format(
          kGateUp ? e0.gate.view : e0.down.view, kGateUp ? "moe_experts gate/up" : "moe_experts down",
          [&](auto fmt) {
            using F = decltype(fmt);
            check_all(fmt, kGateUp);
            auto* kernel = moe_grouped_small_kernel<F, kGateUp>;
            const int64_t bytes = small_smem_bytes(kGateUp, depth);
            TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
                          "moe grouped small: {} bytes of shared memory", bytes);
            // An expert holds at most one pair of each row: ceil(rows / kSmallCols) passes at most.
            const int64_t passes = std::min<int64_t>((rows + kSmallCols - 1) / kSmallCols, 65535);
            const dim3 grid(unsigned(r.e_hi - r.e_lo), unsigned((n_out + kSmallFeatures - 1) / kSmallFeatures),
                            unsigned(passes));
            if constexpr (kGateUp) {
              kernel<<<grid, kSmallThreads, size_t(bytes), stream>>>(descs, p, xs, lda, offsets, h16, ldh16, r.e_lo);
            } else {
              kernel<<<grid, kSmallThreads, size_t(bytes), stream>>>(descs, p, h16, ldh16, offsets, y, ldy, r.e_lo);
            }
            TS_CUDA_LAUNCH_CHECK("moe grouped small {} {} [{}, {}] x {} rows x top-{}", kGateUp ? "gate_up" : "down",
                                 dtype_name(kGateUp ? e0.gate.view.dtype : e0.down.view.dtype), n_out, depth, rows, k);
          },
          kGateUp ? gate_up_vec : down_vec);
    };
    for (const Range& r : ranges) {
      await(r);
      project(std::true_type{}, r);
      project(std::false_type{}, r);
    }
  } else {
    // One projection's tiles over a range of experts: gate/up (xs -> h16) or down (h16 -> y).
    auto tiles = [&](auto gate_up, const Range& r) {
      constexpr bool kGateUp = decltype(gate_up)::value;
      const char* what = kGateUp ? "gate_up" : "down";
      const WeightView& view = kGateUp ? e0.gate.view : e0.down.view;
      dispatch_weight_format(
          view, kGateUp ? "moe_experts gate/up" : "moe_experts down",
          [&](auto fmt) {
            using F = decltype(fmt);
            check_all(fmt, kGateUp);
            constexpr size_t bytes = GroupedSmem<kGateUp>::kBytes;
            auto* kernel = moe_grouped_kernel<F, kGateUp>;
            TS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)),
                          "moe grouped {}: {} bytes of shared memory", what, bytes);
            const int64_t n_out = kGateUp ? inter : hidden;
            const dim3 grid(unsigned(r.max_tiles), unsigned((n_out + kBN - 1) / kBN));
            if constexpr (kGateUp) {
              kernel<<<grid, kGroupedThreads, bytes, stream>>>(descs, p, xs, lda, offsets, tile_offsets, h16, ldh16,
                                                               r.e_lo, r.e_hi);
            } else {
              kernel<<<grid, kGroupedThreads, bytes, stream>>>(descs, p, h16, ldh16, offsets, tile_offsets, y, ldy,
                                                               r.e_lo, r.e_hi);
            }
            TS_CUDA_LAUNCH_CHECK("moe grouped {} {} [{}, {}] x {} rows x top-{}", what, dtype_name(view.dtype), n_out,
                                 kGateUp ? hidden : inter, rows, k);
          },
          kGateUp ? gate_up_vec : down_vec);
    };
    for (const Range& r : ranges) {
      await(r);
      tiles(std::true_type{}, r);
      tiles(std::false_type{}, r);
    }
  }
  moe_combine_kernel<<<unsigned(rows), 256, 0, stream>>>(y, ldy, pair_pos, weight, k, hidden, out.data, out.stride);
  TS_CUDA_LAUNCH_CHECK("moe combine [{}, {}] top-{}", rows, hidden, k);
}

}  // namespace turbospark::cuda::moe
