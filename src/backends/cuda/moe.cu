// Routed experts: out[t] = sum_j weight[t, j] * expert_{idx[t, j]}(x[t]), where each expert is
// a gated FFN down(glu(gate x + gb, up x + ub)) + db and glu is SiLU(g) * u, GELU-tanh(g) * u,
// or gpt-oss's clamped GLU. idx/weight [rows, k] stay in device memory: kernels read expert
// ids there and find each expert's planes in a device-side descriptor table (one per expert
// vector, uploaded at its first use).
//
// Decode (rows <= kMoeDecodeMaxRows): two launches.
//   gate_up: one warp per (pair, inter row), pair = (t, j); the warp streams expert e's gate
//     and up rows together (for gpt-oss's interleaved gate/up they are adjacent rows of one
//     matrix) against x[t] and writes glu(...) to h[pair]. Grid (inter / 8, rows * k).
//   down: one warp per (t, hidden row) loops over the k experts of row t, so the weighted sum
//     is formed in registers: no atomics, deterministic, out written once. Grid (hidden / 8, rows).
//   Experts of 16-byte units (vector-aligned BF16 / F16) take two inter rows a gate/up warp and
//   a down pass with the experts split over a block's warps, four output rows a block, its first
//   weights loaded before the PDL wait (moe_down_unit_split_kernel).
//   Bound: HBM on the k selected experts' bytes (3 * inter * hidden per expert and row); the
//     gate/up kernel prefetches the down rows into L2 (when they fit) so they stream during it.
//   Formats read in 32-element blocks (kBlock32: Q4_0 in planes) take block32 variants of both
//   (below) where the int8 kernels do not apply: each lane owns whole blocks (one 16-byte load
//   each), a warp two output rows, and the down pass spreads the k experts' blocks over the
//   warp's lanes instead of looping.
//   Q4_0 experts (either layout), MXFP4 and Q8_0 experts take the int8-activation kernels
//   instead (moe_int8_activations, below): x quantized once per block of 32 inter rows, h
//   written as BlockQ8x32 codes by the gate/up pass, eight dp4a per 32-element block and lane
//   (MXFP4's codes looked up as int8 first: q8.cuh mxfp4_dot_q8x32; gpt-oss-20b's MoE took 182
//   us a layer on the f32 unit-wise kernels, eager; Q8_0's codes as stored, read from ggml's
//   34-byte blocks by FmtQ8_0::codes32: the Flash-Next-shaped Qwen4-Exp GGUF's MoE took 188 us
//   a layer on the f32 kernels, eager). (Per-unit dp4a variants of the
//   kernels above measured slower: a block covering 8 output rows did not amortize its own
//   quantization of x.)
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
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <type_traits>

#include "backends/cuda/matmul.h"
#include "backends/cuda/mma.cuh"
#include "backends/cuda/q8.cuh"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda {
namespace {

// One expert as kernels see it. No padding: tables are compared bytewise to notice changes.
struct MoeExpertDesc {
  DeviceWeight gate;  // [inter, hidden]
  DeviceWeight up;    // [inter, hidden]
  DeviceWeight down;  // [hidden, inter]
  const float* gate_bias;  // [inter] or null
  const float* up_bias;    // [inter] or null
  const float* down_bias;  // [hidden] or null
};
static_assert(sizeof(MoeExpertDesc) == 3 * sizeof(DeviceWeight) + 3 * sizeof(void*));
static_assert(sizeof(DeviceWeight) == 6 * 8 + 2 * 8 + 2 * 4);

enum class Glu : int32_t { kSilu, kGeluTanh, kClamped };

struct MoeParams {
  int32_t n_experts;
  int32_t k;
  int64_t hidden;
  int64_t inter;
  Glu glu;
  float glu_alpha;
  float glu_limit;
};

__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fc00000); }

__device__ __forceinline__ float apply_glu(const MoeParams& p, float g, float u) {
  switch (p.glu) {
    case Glu::kSilu: return g / (1.f + expf(-g)) * u;
    case Glu::kGeluTanh:
      return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    default: {
      const float gc = fminf(g, p.glu_limit);
      const float uc = fminf(fmaxf(u, -p.glu_limit), p.glu_limit);
      return (uc + 1.f) * (gc * (1.f / (1.f + expf(-(gc * p.glu_alpha)))));
    }
  }
}

__device__ __forceinline__ bool valid_expert(int32_t e, const MoeParams& p) { return e >= 0 && e < p.n_experts; }

// h for inter row i from its gate and up dot products: the biases, then the GLU.
__device__ __forceinline__ float biased_glu(const MoeExpertDesc& d, const MoeParams& p, int64_t i, float g, float u) {
  if (d.gate_bias) g += d.gate_bias[i];
  if (d.up_bias) u += d.up_bias[i];
  return apply_glu(p, g, u);
}

// ---- decode ------------------------------------------------------------------------------------

constexpr int kDecodeThreads = 256;  // 8 warps = 8 output rows per block
constexpr int kDecodeRowsPerBlock = kDecodeThreads / kWarp;

// The f32 gate/up kernels' warps (kR inter rows from i0 of one pair): the rows' gate and up
// weights (rows past inter read the last one; their sums are dropped), and the sums reduced
// and written to h through the bias and GLU, lane r < kR writing row i0 + r.
template <int kR>
__device__ __forceinline__ void gate_up_rows(const MoeExpertDesc& d, const MoeParams& p, int64_t i0, WeightRow (&wg)[kR],
                                             WeightRow (&wu)[kR]) {
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const int64_t i = i0 + r < p.inter ? i0 + r : p.inter - 1;
    wg[r] = weight_row(d.gate, i);
    wu[r] = weight_row(d.up, i);
  }
}

template <int kR>
__device__ __forceinline__ void store_gate_up_rows(const float (&g)[kR], const float (&u)[kR], const MoeExpertDesc& d,
                                                   const MoeParams& p, int64_t i0, float* __restrict__ h_row) {
  const int lane = threadIdx.x % kWarp;
  float gi = 0.f, ui = 0.f;
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const float gs = warp_sum(g[r]), us = warp_sum(u[r]);
    if (lane == r) gi = gs, ui = us;
  }
  if (lane < kR && i0 + lane < p.inter) h_row[i0 + lane] = biased_glu(d, p, i0 + lane, gi, ui);
}

// Once the expert is known, thread 0 asks L2 (prefetch_l2) for the block's gate and up rows
// and, with prefetch_down, for its share (1 / gridDim.x) of the expert's down matrix, which the
// down pass then finds in L2 instead of HBM (Q4_0 30B-A3B: 7 MB a layer, 0.5 MB left to read).
// The host asks for them only while what they bring fits in half the L2 (see prefetch_l2):
// bf16 experts of that shape (50 MB of gate/up a layer) evicted their own prefetched rows.
// kRW inter rows a warp (moe_gate_up_rows_per_warp): each x unit a lane loads then meets 2 kRW
// weight units, and the grid is 1 / kRW as many blocks (bf16 30B-A3B shape, one row a warp:
// 768 blocks, 1.16 waves at five an SM, 64% of DRAM peak under ncu).
template <class F, int kRW>
__global__ void __launch_bounds__(kDecodeThreads)
    moe_gate_up_gemv_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p, const float* __restrict__ x,
                            int64_t x_stride, const int32_t* __restrict__ idx, float* __restrict__ h, int64_t ldh,
                            bool prefetch, bool prefetch_down) {
  pdl_begin();
  constexpr int64_t kBlockRows = int64_t(kDecodeRowsPerBlock) * kRW;
  const int64_t pair = blockIdx.y;
  const int lane = threadIdx.x % kWarp;
  const int64_t i0 = int64_t(blockIdx.x) * kBlockRows + threadIdx.x / kWarp * kRW;
  const int32_t e = idx[pair];
  if (prefetch && threadIdx.x == 0 && valid_expert(e, p)) {
    const MoeExpertDesc& d = experts[e];
    prefetch_weight_rows(d.gate, int64_t(blockIdx.x) * kBlockRows, kBlockRows);
    prefetch_weight_rows(d.up, int64_t(blockIdx.x) * kBlockRows, kBlockRows);
    if (prefetch_down) {
      const int64_t share = (p.hidden + gridDim.x - 1) / gridDim.x;
      prefetch_weight_rows(d.down, int64_t(blockIdx.x) * share, share);
    }
  }
  if (i0 >= p.inter) return;  // whole warps: i0 is the warp's
  if (!valid_expert(e, p)) {
    if (lane < kRW && i0 + lane < p.inter) h[pair * ldh + i0 + lane] = nan_f32();
    return;
  }
  const MoeExpertDesc& d = experts[e];
  WeightRow wg[kRW], wu[kRW];
  gate_up_rows<kRW>(d, p, i0, wg, wu);
  const float* xr = x + (pair / p.k) * x_stride;
  const int64_t n_units = p.hidden / kUnit;
  float g[kRW] = {}, u[kRW] = {};
#pragma unroll 2
  for (int64_t q = lane; q < n_units; q += kWarp) {
    float vg[kRW][kUnit], vu[kRW][kUnit], xv[kUnit];
#pragma unroll
    for (int r = 0; r < kRW; ++r) F::unit(wg[r], q, vg[r]), F::unit(wu[r], q, vu[r]);
    load_x8(xr + q * kUnit, xv);
#pragma unroll
    for (int r = 0; r < kRW; ++r)
#pragma unroll
      for (int c = 0; c < kUnit; ++c) g[r] = fmaf(vg[r][c], xv[c], g[r]), u[r] = fmaf(vu[r][c], xv[c], u[r]);
  }
  if constexpr (F::kTail) {
    for (int64_t c = n_units * kUnit + lane; c < p.hidden; c += kWarp) {
      const float xc = __ldg(xr + c);
#pragma unroll
      for (int r = 0; r < kRW; ++r) g[r] = fmaf(F::elem(wg[r], c), xc, g[r]), u[r] = fmaf(F::elem(wu[r], c), xc, u[r]);
    }
  }
  store_gate_up_rows<kRW>(g, u, d, p, i0, h + pair * ldh);
}

// The k experts' partial dots are weighted and summed per lane, and the warp reduces once.
// Experts are taken kDownExpertsInFlight (8: 282 tok/s vs 4: 275, alternated in one H200 call;
// with the down rows already in L2 (gate/up's prefetch) the two measure the same, 301-302)
// at a time with their unit loads interleaved in one
// loop: a loop over experts one by one made each a chain of dependent loads (id, descriptor,
// weights), ~1 us apiece, 21 us for the Q4_0 30B-A3B layer's 7 MB (ncu). Same per-lane
// arithmetic and order as one expert after another, so bit-identical to it.
// Two blocks an SM (<= 128 registers; one unit an expert in flight per lane, not two): at 194
// registers one block of 8 warps fitted an SM, so the 256 blocks of a 2048-row down
// projection ran in two waves (bf16 30B-A3B shape: 18 us a layer at 30% of DRAM peak, ncu).
constexpr int kDownExpertsInFlight = 8;

template <class F>
__global__ void __launch_bounds__(kDecodeThreads, 2)
    moe_down_gemv_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p, const float* __restrict__ h,
                         int64_t ldh, const int32_t* __restrict__ idx, const float* __restrict__ weight,
                         float* __restrict__ out, int64_t out_stride) {
  constexpr int kE = kDownExpertsInFlight;
  const int64_t t = blockIdx.y;
  const int lane = threadIdx.x % kWarp;
  const int64_t o = int64_t(blockIdx.x) * kDecodeRowsPerBlock + threadIdx.x / kWarp;
  if (o >= p.hidden) return;
  float acc = 0.f;
  bool bad = false;
  const int64_t n_units = p.inter / kUnit;
  bool waited = false;
  for (int j0 = 0; j0 < p.k; j0 += kE) {
    bool live[kE];
    WeightRow wr[kE];
    const float* hr[kE];
    const MoeExpertDesc* dp[kE];
    // The first kE experts' ids and rows are found before pdl_begin(), as in
    // moe_down_q4_kernel (the routing was written before the gate/up kernel this one follows;
    // __ldcg, not the read-only path); h, the gate/up kernel's output, is read after it. (Their
    // first weight units loaded before the wait as well cost 64 more live registers: spills at
    // the 128 that keep the whole grid resident.)
#pragma unroll
    for (int jj = 0; jj < kE; ++jj) {
      const int64_t pair = t * p.k + j0 + jj;
      const int32_t e = j0 + jj < p.k ? __ldcg(idx + pair) : 0;
      live[jj] = j0 + jj < p.k && valid_expert(e, p);
      bad |= j0 + jj < p.k && !live[jj];
      // Absent or invalid: read expert 0's row and this row's h (valid memory), drop the sum.
      dp[jj] = &experts[live[jj] ? e : 0];
      wr[jj] = weight_row(dp[jj]->down, o);
      hr[jj] = h + (live[jj] ? pair : t * p.k) * ldh;
    }
    float y[kE] = {};
    if (!waited) {
      pdl_begin();
      waited = true;
    }
#pragma unroll 1
    for (int64_t u = lane; u < n_units; u += kWarp) {
#pragma unroll
      for (int jj = 0; jj < kE; ++jj) {
        float wv[kUnit], xv[kUnit];
        F::unit(wr[jj], u, wv);
        load_x8(hr[jj] + u * kUnit, xv);
#pragma unroll
        for (int i = 0; i < kUnit; ++i) y[jj] = fmaf(wv[i], xv[i], y[jj]);
      }
    }
    if constexpr (F::kTail) {
#pragma unroll
      for (int jj = 0; jj < kE; ++jj)
        for (int64_t i = n_units * kUnit + lane; i < p.inter; i += kWarp)
          y[jj] = fmaf(F::elem(wr[jj], i), __ldg(hr[jj] + i), y[jj]);
    }
#pragma unroll
    for (int jj = 0; jj < kE; ++jj) {
      if (!live[jj]) continue;
      if (lane == 0 && dp[jj]->down_bias) y[jj] += dp[jj]->down_bias[o];
      acc = fmaf(weight[t * p.k + j0 + jj], y[jj], acc);
    }
  }
  acc = warp_sum(acc);
  if (lane == 0) out[t * out_stride + o] = bad ? nan_f32() : acc;
}

// The split down kernels (moe_down_unit_split_kernel, moe_down_q4_split_kernel): a block of kW
// warps covers kR output rows o of token t, warp `warp` taking experts j = warp, warp + kW, ...,
// its first id `e` read by the caller before the PDL wait. split_down_expert: pair's expert (the
// id read here past the first), null and `bad` set for an invalid id. split_down_weigh: the
// expert's kR row sums of this lane into acc, weighted, its bias added on lane 0.
__device__ __forceinline__ const MoeExpertDesc* split_down_expert(const MoeExpertDesc* __restrict__ experts,
                                                                  const MoeParams& p, const int32_t* __restrict__ idx,
                                                                  int64_t pair, bool first, int32_t& e, bool& bad) {
  if (!first) e = __ldcg(idx + pair);
  if (!valid_expert(e, p)) {
    bad = true;
    return nullptr;
  }
  return &experts[e];
}

template <int kR>
__device__ __forceinline__ void split_down_weigh(const MoeExpertDesc& d, float wt, const int64_t (&o)[kR], float (&y)[kR],
                                                 float (&acc)[kR]) {
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    if (threadIdx.x % kWarp == 0 && d.down_bias) y[r] += d.down_bias[o[r]];
    acc[r] = fmaf(wt, y[r], acc[r]);
  }
}

// Then each warp's sums reduced, the warps' added in warp order (deterministic) into rows
// o0 .. o0 + kR - 1 of token t's output, NaN where any warp met an invalid id.
template <int kW, int kR>
__device__ __forceinline__ void split_down_store(float (&acc)[kR], bool bad, float (&part)[kW][kR], int64_t t,
                                                 int64_t o0, const MoeParams& p, float* __restrict__ out,
                                                 int64_t out_stride) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
#pragma unroll
  for (int r = 0; r < kR; ++r) acc[r] = warp_sum(acc[r]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kR; ++r) part[warp][r] = acc[r];
  }
  bad = __syncthreads_or(bad);
  if (threadIdx.x < kR && o0 + threadIdx.x < p.hidden) {
    float v = 0.f;
#pragma unroll
    for (int w = 0; w < kW; ++w) v += part[w][threadIdx.x];
    out[t * out_stride + o0 + threadIdx.x] = bad ? nan_f32() : v;
  }
}

// down for formats of 16-byte units (kHasUnitBits: vector-aligned BF16 / F16), the experts
// split over a block's warps: a block of kUnitDownWarps warps covers kUnitDownRows output rows of
// one token, warp w takes experts j = w, w + kUnitDownWarps, ... (each one's id, weight and rows
// found once), lane l the units u = l, l + 32, ... of those rows, kUnitDownUnits of them a row
// per pass (a 768-wide row in one pass), so each h value it loads meets kUnitDownRows weight
// units. The first pass of the warp's first expert is loaded, as raw words, before the PDL wait
// (the routing and the weights were written before the gate/up kernel this one follows: see
// moe_down_q4_kernel); h after. Lanes' weighted partial sums are reduced per warp and the warps'
// sums added in warp order in shared memory: deterministic. (moe_down_gemv_kernel, one warp a row
// looping over the experts, ran the bf16 30B-A3B shape at 38% of DRAM peak: 21 us for 25 MB,
// 128 registers, 24% occupancy, ncu.)
constexpr int kUnitDownWarps = 8;
constexpr int kUnitDownRows = 4;
constexpr int kUnitDownUnits = 3;

template <class F>
__global__ void __launch_bounds__(kUnitDownWarps * kWarp, 2)
    moe_down_unit_split_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p, const float* __restrict__ h,
                               int64_t ldh, const int32_t* __restrict__ idx, const float* __restrict__ weight,
                               float* __restrict__ out, int64_t out_stride) {
  constexpr int kR = kUnitDownRows, kS = kUnitDownUnits, kW = kUnitDownWarps;
  constexpr int64_t kPass = int64_t(kWarp) * kS;  // units a warp covers per row and pass
  __shared__ float part[kW][kR];
  const int64_t t = blockIdx.y;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t o0 = int64_t(blockIdx.x) * kR;
  int64_t o[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) o[r] = o0 + r < p.hidden ? o0 + r : p.hidden - 1;  // past the end: dropped
  const int64_t n_units = p.inter / kUnit;
  int32_t e = warp < p.k ? __ldcg(idx + t * p.k + warp) : 0;
  uint4 c[kS][kR];  // the pass in flight: the first one loaded here, the others in the loop
#pragma unroll
  for (int s = 0; s < kS; ++s)
#pragma unroll
    for (int r = 0; r < kR; ++r) c[s][r] = make_uint4(0, 0, 0, 0);
  if (warp < p.k && valid_expert(e, p)) {
    const MoeExpertDesc& d = experts[e];
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      const WeightRow wr = weight_row(d.down, o[r]);
#pragma unroll
      for (int s = 0; s < kS; ++s)
        if (lane + kWarp * s < n_units) c[s][r] = ld_u128(wr.data + (lane + kWarp * s) * 16);
    }
  }
  pdl_begin();
  float acc[kR] = {};
  bool bad = false;
  for (int j = warp; j < p.k; j += kW) {
    const int64_t pair = t * p.k + j;
    const MoeExpertDesc* dp = split_down_expert(experts, p, idx, pair, j == warp, e, bad);
    if (!dp) continue;
    const MoeExpertDesc& d = *dp;
    float y[kR] = {};
    WeightRow wr[kR];
#pragma unroll
    for (int r = 0; r < kR; ++r) wr[r] = weight_row(d.down, o[r]);
    const float* hr = h + pair * ldh;
    for (int64_t u0 = 0; u0 < n_units; u0 += kPass) {
      if (j != warp || u0 != 0) {
#pragma unroll
        for (int s = 0; s < kS; ++s)
#pragma unroll
          for (int r = 0; r < kR; ++r)
            c[s][r] = u0 + lane + kWarp * s < n_units ? ld_u128(wr[r].data + (u0 + lane + kWarp * s) * 16)
                                                       : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int s = 0; s < kS; ++s) {
        const int64_t u = u0 + lane + kWarp * s;
        if (u >= n_units) continue;
        float hv[kUnit];
        load_x8(hr + u * kUnit, hv);
#pragma unroll
        for (int r = 0; r < kR; ++r) {
          float wv[kUnit];
          F::bits(c[s][r], wv);
#pragma unroll
          for (int i = 0; i < kUnit; ++i) y[r] = fmaf(wv[i], hv[i], y[r]);
        }
      }
    }
    split_down_weigh<kR>(d, __ldcg(weight + pair), o, y, acc);
  }
  split_down_store<kW, kR>(acc, bad, part, t, o0, p, out, out_stride);
}

// Formats read in 32-element blocks (kBlock32, e.g. Q4_0 in planes): each lane owns whole
// blocks, one 16-byte code load each, and a warp covers two output rows so every activation
// block it loads meets four (gate/up) or two (down) weight rows.
constexpr int kBlockRowsPerWarp = 2;
constexpr int kGateUpBlockThreads = 256;
constexpr int kDownBlockThreads = 128;

template <class F>
__global__ void __launch_bounds__(kGateUpBlockThreads)
    moe_gate_up_block32_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p, const float* __restrict__ x,
                               int64_t x_stride, const int32_t* __restrict__ idx, float* __restrict__ h,
                               int64_t ldh) {
  pdl_begin();
  const int64_t pair = blockIdx.y;
  const int lane = threadIdx.x % kWarp;
  const int64_t i0 = (int64_t(blockIdx.x) * (kGateUpBlockThreads / kWarp) + threadIdx.x / kWarp) * kBlockRowsPerWarp;
  if (i0 >= p.inter) return;
  const int32_t e = idx[pair];
  if (!valid_expert(e, p)) {
    if (lane < kBlockRowsPerWarp && i0 + lane < p.inter) h[pair * ldh + i0 + lane] = nan_f32();
    return;
  }
  const MoeExpertDesc& d = experts[e];
  WeightRow wg[kBlockRowsPerWarp], wu[kBlockRowsPerWarp];
  gate_up_rows<kBlockRowsPerWarp>(d, p, i0, wg, wu);
  const float* xr = x + (pair / p.k) * x_stride;
  const int64_t n_blocks = p.hidden / 32;
  float g[kBlockRowsPerWarp] = {}, u[kBlockRowsPerWarp] = {};
#pragma unroll 2
  for (int64_t b = lane; b < n_blocks; b += kWarp) {
    typename F::Block32 bg[kBlockRowsPerWarp], bu[kBlockRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kBlockRowsPerWarp; ++r) bg[r] = F::load32(wg[r], b), bu[r] = F::load32(wu[r], b);
    float xv[32];
    load_x32(xr + b * 32, xv);
#pragma unroll
    for (int r = 0; r < kBlockRowsPerWarp; ++r) g[r] += F::dot32(bg[r], xv), u[r] += F::dot32(bu[r], xv);
  }
  store_gate_up_rows<kBlockRowsPerWarp>(g, u, d, p, i0, h + pair * ldh);
}

// One warp per two output rows of token t: its lanes stride over the (expert j, block b)
// items of all k experts, each item weighted by the token's routing weight, so the weighted
// sum is formed in registers and reduced once (deterministic, no atomics).
template <class F>
__global__ void __launch_bounds__(kDownBlockThreads)
    moe_down_block32_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p, const float* __restrict__ h,
                            int64_t ldh, const int32_t* __restrict__ idx, const float* __restrict__ weight,
                            float* __restrict__ out, int64_t out_stride) {
  pdl_begin();
  const int64_t t = blockIdx.y;
  const int lane = threadIdx.x % kWarp;
  const int64_t o0 = (int64_t(blockIdx.x) * (kDownBlockThreads / kWarp) + threadIdx.x / kWarp) * kBlockRowsPerWarp;
  if (o0 >= p.hidden) return;
  int64_t o[kBlockRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kBlockRowsPerWarp; ++r) o[r] = o0 + r < p.hidden ? o0 + r : p.hidden - 1;
  const int32_t nb = int32_t(p.inter / 32), items = p.k * nb;
  float acc[kBlockRowsPerWarp] = {};
  bool bad = false;
#pragma unroll 2
  for (int32_t it = lane; it < items; it += kWarp) {
    const int32_t j = it / nb, b = it - j * nb;
    const int64_t pair = t * p.k + j;
    const int32_t e = idx[pair];
    if (!valid_expert(e, p)) {
      bad = true;
      continue;
    }
    const MoeExpertDesc& d = experts[e];
    typename F::Block32 blk[kBlockRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kBlockRowsPerWarp; ++r) blk[r] = F::load32(weight_row(d.down, o[r]), b);
    float hv[32];
    load_x32(h + pair * ldh + int64_t(b) * 32, hv);
    const float wt = weight[pair];
#pragma unroll
    for (int r = 0; r < kBlockRowsPerWarp; ++r) {
      float y = F::dot32(blk[r], hv);
      if (b == 0 && d.down_bias) y += d.down_bias[o[r]];
      acc[r] = fmaf(wt, y, acc[r]);
    }
  }
  bad = __any_sync(0xffffffffu, bad);
#pragma unroll
  for (int r = 0; r < kBlockRowsPerWarp; ++r) acc[r] = warp_sum(acc[r]);
  if (lane < kBlockRowsPerWarp && o0 + lane < p.hidden) {
    float v = acc[0];
#pragma unroll
    for (int r = 1; r < kBlockRowsPerWarp; ++r)
      if (lane == r) v = acc[r];
    out[t * out_stride + o0 + lane] = bad ? nan_f32() : v;
  }
}

// ---- decode, Q4_0, MXFP4 and Q8_0 with int8 activations in whole blocks (q8.cuh) -------------
// gate/up: a block covers 32 consecutive inter rows of one pair, kR a warp, its lanes taking
// whole 32-element blocks of the gate and up rows (the first kQ4Pre of each loaded before x is
// quantized, so the loads are in flight meanwhile). The block
// quantizes x[t] into shared memory once, then its 32 values of h as one BlockQ8x32 (the CPU
// backend quantizes h the same way before its down product) into hq: codes [pairs][inter],
// then {d, s} [pairs][inter / 32]. A pair with an invalid expert writes nothing: the down pass
// reads the id and writes NaN. down: as moe_down_block32_kernel over h's codes, the token's k
// ids and weights held one a lane and shuffled to the lanes that need them.
// kR inter rows a warp (32 / kR warps a block): 2 by default; 4 where the grid would take
// more than two waves of two 16-warp blocks an SM (gpt-oss-20b: 90 x 4 blocks on 132 SMs ran
// 1.36 waves, the last a third full), so that 8-warp blocks, three an SM, fit one wave and each
// lane keeps twice the loads in flight (moe_gate_up_rows_per_warp).
constexpr int kQ4Pre = 1;

template <class F, int kR>
__global__ void __launch_bounds__(32 / kR * kWarp, kR == 2 ? 2 : 3)
    moe_gate_up_q4_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p, const float* __restrict__ x,
                          int64_t x_stride, const int32_t* __restrict__ idx, void* __restrict__ hq, bool prefetch_down) {
  pdl_begin();
  const int64_t pair = blockIdx.y;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int32_t e = idx[pair];
  if (!valid_expert(e, p)) return;  // the whole block: e is the pair's
  const MoeExpertDesc& d = experts[e];
  const int64_t i0 = int64_t(blockIdx.x) * 32 + kR * warp;  // inter % 32 == 0: every row exists
  WeightRow wg[kR], wu[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) wg[r] = weight_row(d.gate, i0 + r), wu[r] = weight_row(d.up, i0 + r);
  const int64_t nb = p.hidden / 32;
  codes32_t<F> cg[kQ4Pre][kR], cu[kQ4Pre][kR];
  float dg[kQ4Pre][kR], du[kQ4Pre][kR];
#pragma unroll
  for (int q = 0; q < kQ4Pre; ++q)
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      cg[q][r] = cu[q][r] = codes32_t<F>{};
      dg[q][r] = du[q][r] = 0.f;
      if (lane + 32 * q < nb) {
        F::codes32(wg[r], lane + 32 * q, cg[q][r], dg[q][r]);
        F::codes32(wu[r], lane + 32 * q, cu[q][r], du[q][r]);
      }
    }
  if (prefetch_down && threadIdx.x == 0) {
    const int64_t share = (p.hidden + gridDim.x - 1) / gridDim.x;
    prefetch_weight_rows(d.down, int64_t(blockIdx.x) * share, share);
  }
  extern __shared__ int4 xq_smem[];
  __shared__ float hs[32];
  const Q8x32Rows xq = quantize_q8x32_rows(x + (pair / p.k) * x_stride, x_stride, 1, p.hidden, xq_smem);
  __syncthreads();
  float g[kR] = {}, u[kR] = {};
  auto accumulate = [&](int64_t b, const codes32_t<F> (&bg)[kR], const float (&sg)[kR], const codes32_t<F> (&bu)[kR],
                        const float (&su)[kR]) {
    int4 lo, hi;
    float2 dsv;
    xq.block(0, b, lo, hi, dsv);
#pragma unroll
    for (int r = 0; r < kR; ++r) {
      g[r] += codes32_dot_q8x32<F>(bg[r], sg[r], lo, hi, dsv);
      u[r] += codes32_dot_q8x32<F>(bu[r], su[r], lo, hi, dsv);
    }
  };
#pragma unroll
  for (int q = 0; q < kQ4Pre; ++q)
    if (lane + 32 * q < nb) accumulate(lane + 32 * q, cg[q], dg[q], cu[q], du[q]);
  for (int64_t b = lane + 32 * kQ4Pre; b < nb; b += kWarp) {
    codes32_t<F> bg[kR], bu[kR];
    float sg[kR], su[kR];
#pragma unroll
    for (int r = 0; r < kR; ++r) F::codes32(wg[r], b, bg[r], sg[r]), F::codes32(wu[r], b, bu[r], su[r]);
    accumulate(b, bg, sg, bu, su);
  }
  float gi = 0.f, ui = 0.f;  // lane r < kR keeps row i0 + r's sums
#pragma unroll
  for (int r = 0; r < kR; ++r) {
    const float gs = warp_sum(g[r]), us = warp_sum(u[r]);
    if (lane == r) gi = gs, ui = us;
  }
  if (lane < kR) hs[kR * warp + lane] = biased_glu(d, p, i0 + lane, gi, ui);
  __syncthreads();
  if (warp == 0) {
    auto* codes = static_cast<int8_t*>(hq);
    auto* ds = reinterpret_cast<float2*>(codes + int64_t(gridDim.y) * p.inter);
    quantize_q8x32_warp(hs[lane], codes + pair * p.inter + 32 * int64_t(blockIdx.x),
                        ds + pair * (p.inter / 32) + blockIdx.x);
  }
}

template <class F>
__global__ void __launch_bounds__(kDownBlockThreads)
    moe_down_q4_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p, const void* __restrict__ hq,
                       int64_t n_pairs, const int32_t* __restrict__ idx, const float* __restrict__ weight,
                       float* __restrict__ out, int64_t out_stride) {
  const int64_t t = blockIdx.y;
  const int lane = threadIdx.x % kWarp;
  const int64_t o0 = (int64_t(blockIdx.x) * (kDownBlockThreads / kWarp) + threadIdx.x / kWarp) * 2;
  if (o0 >= p.hidden) return;  // whole warps: o0 is the warp's
  const int64_t o[2] = {o0, o0 + 1 < p.hidden ? o0 + 1 : o0};
  const Q8x32Rows h = q8x32_view(const_cast<void*>(hq), n_pairs, p.inter);
  // The routing is read before pdl_begin(): this kernel follows the gate/up kernel of the same
  // call, and is scheduled only once every gate/up block has passed its own wait, so whatever
  // wrote idx and weight (the router, before this op) has completed; L2 loads (__ldcg), not
  // the read-only path, all the same. The expert's first weight blocks follow (weights are
  // never written by a step's kernels); only h, the gate/up kernel's output, waits.
  // k <= 32 (the host checks): lane j holds expert j's id and routing weight.
  const int32_t e_lane = lane < p.k ? __ldcg(idx + t * p.k + lane) : 0;
  const float w_lane = lane < p.k ? __ldcg(weight + t * p.k + lane) : 0.f;
  const bool bad = __any_sync(0xffffffffu, lane < p.k && !valid_expert(e_lane, p));
  const int32_t nb = int32_t(p.inter / 32), items = p.k * nb;
  float acc[2] = {};
  if (kWarp % p.k == 0) {
    // kWarp / k lanes an expert: each lane's expert is fixed (its descriptor and rows found
    // once), its blocks b = lane % lanes, + lanes, ... (the general loop below spent more on
    // finding each item's expert than on the item: 1.46M instructions a layer, ncu).
    constexpr int kPre = 2;  // blocks a row loaded before the wait
    const int lanes = kWarp / p.k, j = lane / lanes;
    const int32_t e = __shfl_sync(0xffffffffu, e_lane, j);
    const float wt = __shfl_sync(0xffffffffu, w_lane, j);
    const bool live = valid_expert(e, p);
    const MoeExpertDesc& d = experts[live ? e : 0];
    const WeightRow wr[2] = {weight_row(d.down, o[0]), weight_row(d.down, o[1])};
    codes32_t<F> c0[kPre][2];
    float s0[kPre][2];
#pragma unroll
    for (int q = 0; q < kPre; ++q)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        c0[q][r] = codes32_t<F>{};
        s0[q][r] = 0.f;
        const int32_t b = lane % lanes + q * lanes;
        if (live && b < nb) F::codes32(wr[r], b, c0[q][r], s0[q][r]);
      }
    pdl_begin();
    if (live) {
      const int64_t pair = t * p.k + j;
      float y[2] = {};
#pragma unroll
      for (int q = 0; q < kPre; ++q) {
        const int32_t b = lane % lanes + q * lanes;
        if (b < nb) {
          int4 lo, hi;
          float2 dsv;
          h.block(pair, b, lo, hi, dsv);
#pragma unroll
          for (int r = 0; r < 2; ++r) y[r] += codes32_dot_q8x32<F>(c0[q][r], s0[q][r], lo, hi, dsv);
        }
      }
#pragma unroll 4
      for (int32_t b = lane % lanes + kPre * lanes; b < nb; b += lanes) {
        codes32_t<F> c[2];
        float s[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) F::codes32(wr[r], b, c[r], s[r]);
        int4 lo, hi;
        float2 dsv;
        h.block(pair, b, lo, hi, dsv);
#pragma unroll
        for (int r = 0; r < 2; ++r) y[r] += codes32_dot_q8x32<F>(c[r], s[r], lo, hi, dsv);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (lane % lanes == 0 && d.down_bias) y[r] += d.down_bias[o[r]];
        acc[r] = wt * y[r];
      }
    }
  } else {
    pdl_begin();
#pragma unroll 2
    for (int32_t it0 = 0; it0 < items; it0 += kWarp) {  // uniform trip count: full-warp shuffles
      const int32_t it = it0 + lane;
      const int32_t j = it < items ? it / nb : 0, b = it - j * nb;
      const int32_t e = __shfl_sync(0xffffffffu, e_lane, j);
      const float wt = __shfl_sync(0xffffffffu, w_lane, j);
      if (it >= items || !valid_expert(e, p)) continue;
      const MoeExpertDesc& d = experts[e];
      codes32_t<F> c[2];
      float s[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) F::codes32(weight_row(d.down, o[r]), b, c[r], s[r]);
      int4 lo, hi;
      float2 dsv;
      h.block(t * p.k + j, b, lo, hi, dsv);
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float y = codes32_dot_q8x32<F>(c[r], s[r], lo, hi, dsv);
        if (b == 0 && d.down_bias) y += d.down_bias[o[r]];
        acc[r] = fmaf(wt, y, acc[r]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) acc[r] = warp_sum(acc[r]);
  if (lane < 2 && o0 + lane < p.hidden) out[t * out_stride + o0 + lane] = bad ? nan_f32() : (lane == 0 ? acc[0] : acc[1]);
}

// down with long expert rows (inter >= 1024: gpt-oss-20b's 2880 is 90 blocks, which the kernel
// above gave 8 lanes an expert, 11 dependent passes each, at 31% of DRAM bandwidth and 0.3
// waves, ncu): a block of kDownSplitWarps warps covers two output rows of one token, warp w takes
// experts j = w, w + kDownSplitWarps, ... (each one's id, weight and rows found once), its lanes
// striding the expert's blocks; the warps' sums meet in shared memory in warp order, so the
// result is deterministic. Chosen by moe_down_split().
constexpr int kDownSplitWarps = 4;

template <class F>
__global__ void __launch_bounds__(kDownSplitWarps * kWarp)
    moe_down_q4_split_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p, const void* __restrict__ hq,
                             int64_t n_pairs, const int32_t* __restrict__ idx, const float* __restrict__ weight,
                             float* __restrict__ out, int64_t out_stride) {
  __shared__ float part[kDownSplitWarps][2];
  const int64_t t = blockIdx.y;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t o0 = int64_t(blockIdx.x) * 2;
  const int64_t o[2] = {o0, o0 + 1 < p.hidden ? o0 + 1 : o0};
  const Q8x32Rows h = q8x32_view(const_cast<void*>(hq), n_pairs, p.inter);
  const int32_t nb = int32_t(p.inter / 32);
  // This warp's first expert and its first blocks before the wait (the routing and the weights
  // were written before the gate/up kernel this one follows: see moe_down_q4_kernel); h after.
  int32_t e = warp < p.k ? __ldcg(idx + t * p.k + warp) : 0;
  codes32_t<F> c0[2] = {};
  float s0[2] = {};
  if (warp < p.k && valid_expert(e, p) && lane < nb) {
#pragma unroll
    for (int r = 0; r < 2; ++r) F::codes32(weight_row(experts[e].down, o[r]), lane, c0[r], s0[r]);
  }
  pdl_begin();
  float acc[2] = {};
  bool bad = false;
  for (int j = warp; j < p.k; j += kDownSplitWarps) {
    const int64_t pair = t * p.k + j;
    const MoeExpertDesc* dp = split_down_expert(experts, p, idx, pair, j == warp, e, bad);
    if (!dp) continue;
    const MoeExpertDesc& d = *dp;
    float y[2] = {};
    const WeightRow wr[2] = {weight_row(d.down, o[0]), weight_row(d.down, o[1])};
#pragma unroll 2
    for (int32_t b = lane; b < nb; b += kWarp) {
      codes32_t<F> c[2];
      float sc[2];
      if (j == warp && b == lane) {
        c[0] = c0[0], c[1] = c0[1], sc[0] = s0[0], sc[1] = s0[1];
      } else {
#pragma unroll
        for (int r = 0; r < 2; ++r) F::codes32(wr[r], b, c[r], sc[r]);
      }
      int4 lo, hi;
      float2 dsv;
      h.block(pair, b, lo, hi, dsv);
#pragma unroll
      for (int r = 0; r < 2; ++r) y[r] += codes32_dot_q8x32<F>(c[r], sc[r], lo, hi, dsv);
    }
    split_down_weigh<2>(d, __ldcg(weight + pair), o, y, acc);
  }
  split_down_store<kDownSplitWarps, 2>(acc, bad, part, t, o0, p, out, out_stride);
}

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
                       void* __restrict__ dst_ptr, int64_t ld_dst) {
  using namespace nvcuda;
  using S = GroupedSmem<kGateUp>;
  constexpr int kMats = S::kMats;
  const int mt = blockIdx.x;
  const int n_experts = p.n_experts;
  if (mt >= tile_offsets[n_experts]) return;
  // The expert owning tile mt: the largest e with tile_offsets[e] <= mt (experts without rows
  // share their successor's offset, so the largest is the one with tiles).
  int lo = 0, hi = n_experts - 1;
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

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

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
constexpr int kSmallWarps = 8;
constexpr int kSmallThreads = kSmallWarps * kWarp;
constexpr int kSmallCols = 8;           // an expert's rows per pass (the mma's n)
constexpr int kSmallFeatures = 16 * kSmallWarps;  // output features per block
constexpr int kSmallK = 32;             // depth per step: a lane dequantizes 2 units of one row
constexpr int kSmallLdA = kSmallK + 8;  // bf16 staging row: 80 bytes (16-byte aligned)

int64_t small_smem_bytes(bool gate_up, int64_t depth) {
  const int64_t mats = gate_up ? 2 : 1;
  return kSmallCols * (depth + 8) * 2 + kSmallWarps * mats * 16 * kSmallLdA * 2;
}

template <class F, bool kGateUp>
__global__ void __launch_bounds__(kSmallThreads)
    moe_grouped_small_kernel(const MoeExpertDesc* __restrict__ experts, MoeParams p,
                             const __nv_bfloat16* __restrict__ a_src, int64_t lda, const int32_t* __restrict__ offsets,
                             void* __restrict__ dst_ptr, int64_t ld_dst) {
  constexpr int kMats = kGateUp ? 2 : 1;
  const int e = blockIdx.x;
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

bool vec_aligned(const WeightView& w) {
  return reinterpret_cast<uintptr_t>(w.data) % 16 == 0 && w.row_bytes % 16 == 0;
}

bool same_format(const WeightView& a, const WeightView& b) {
  return a.dtype == b.dtype && a.rows == b.rows && a.cols == b.cols && a.scales_dtype == b.scales_dtype &&
         a.group_size == b.group_size;
}

}  // namespace

const WeightMatmul::MoeTable& WeightMatmul::moe_table(const std::vector<ExpertWeights>& experts,
                                                      cudaStream_t stream) {
  std::vector<MoeExpertDesc> descs(experts.size());
  for (size_t e = 0; e < experts.size(); ++e) {
    const ExpertWeights& x = experts[e];
    descs[e] = {device_weight(x.gate.view), device_weight(x.up.view), device_weight(x.down.view),
                x.gate_bias, x.up_bias, x.down_bias};
  }
  const size_t bytes = descs.size() * sizeof(MoeExpertDesc);
  MoeTable& table = moe_tables_[{static_cast<const void*>(experts.data()), experts.size()}];
  if (table.host.size() == bytes && std::memcmp(table.host.data(), descs.data(), bytes) == 0) return table;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TS_CUDA_CHECK(cudaStreamIsCapturing(stream, &status), "moe_experts table");
  TS_CHECK(status == cudaStreamCaptureStatusNone,
           "moe_experts: the descriptor table of {} experts is new or changed while a graph is being captured: run "
           "the layer once before capture",
           experts.size());
  if (!table.device) TS_CUDA_CHECK(cudaMalloc(&table.device, bytes), "moe_experts table of {} bytes", bytes);
  table.host.assign(reinterpret_cast<const unsigned char*>(descs.data()),
                    reinterpret_cast<const unsigned char*>(descs.data()) + bytes);
  // Stream-ordered after any queued kernel still reading the old table; the source stays
  // alive in table.host.
  TS_CUDA_CHECK(cudaMemcpyAsync(table.device, table.host.data(), bytes, cudaMemcpyHostToDevice, stream),
                "moe_experts table upload ({} bytes)", bytes);
  return table;
}

bool moe_int8_activations(const ExpertWeights& e0, int64_t rows, int k) {
  const int64_t hidden = e0.gate.view.cols, inter = e0.gate.view.rows;
  const DType t = e0.gate.view.dtype;
  const bool format = (t == DType::Q4_0 || t == DType::MXFP4 || t == DType::Q8_0) && e0.down.view.dtype == t;
  return rows >= 1 && rows <= kMoeDecodeMaxRows && q4_dp4a_enabled() && format && hidden % 32 == 0 &&
         inter % 32 == 0 && k <= kWarp && q8x32_bytes(1, hidden) <= kQ8SmemMax;
}

namespace {

// An override from the environment ("0" / "1"), read at every call so tests can run both ways:
// -1 when unset.
int env_switch(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return -1;
  const std::string_view s(v);
  TS_CHECK(s == "0" || s == "1", "{} must be 0 or 1, got '{}'", name, s);
  return s == "1";
}

}  // namespace

int moe_gate_up_rows_per_warp(int64_t n_pairs, int64_t inter) {
  // TURBOSPARK_CUDA_MOE_WIDE_WARPS: 1 = four rows a warp, 0 = two; unset = four only where two
  // would spill the 16-warp blocks (two an SM) into a second, partial wave that the 8-warp
  // blocks (three an SM) avoid.
  if (const int forced = env_switch("TURBOSPARK_CUDA_MOE_WIDE_WARPS"); forced >= 0) return forced ? 4 : 2;
  static const int64_t sms = [] {
    int device = 0, n = 0;
    TS_CUDA_CHECK(cudaGetDevice(&device), "moe: cudaGetDevice");
    TS_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device), "moe: SM count");
    return int64_t(n);
  }();
  const int64_t blocks = inter / 32 * n_pairs;
  return blocks > 2 * sms && blocks <= 3 * sms ? 4 : 2;
}

bool moe_down_split(int64_t inter) {
  // TURBOSPARK_CUDA_MOE_DOWN_SPLIT: 1 / 0 forces; unset = experts of at least 32 blocks a row.
  if (const int forced = env_switch("TURBOSPARK_CUDA_MOE_DOWN_SPLIT"); forced >= 0) return forced;
  return inter >= 32 * 32;
}

int moe_unit_gate_up_rows_per_warp() {
  // The same switch as the int8 kernels': 1 = two rows a warp, 0 = one; unset = two.
  const int forced = env_switch("TURBOSPARK_CUDA_MOE_WIDE_WARPS");
  return forced == 0 ? 1 : 2;
}

bool moe_unit_down_split() {
  // The same switch as the int8 kernels': 1 / 0 forces; unset = split.
  return env_switch("TURBOSPARK_CUDA_MOE_DOWN_SPLIT") != 0;
}

bool moe_small_groups(int64_t n_pairs, int64_t n_experts, int64_t hidden, int64_t inter) {
  if (hidden % kSmallK != 0 || inter % kSmallK != 0) return false;
  if (std::max(small_smem_bytes(true, hidden), small_smem_bytes(false, inter)) > 200 * 1024) return false;
  // TURBOSPARK_CUDA_MOE_SMALL: 1 = always (where the shape allows), 0 = never; unset = while the
  // step averages at most 8 rows an expert. Read at every call so tests can run both.
  // Measured (H100, Q4_0 30B-A3B, serve_bench at concurrency 16 / 64, llama-server 409.8 / 473.0
  // in the same call): 671.6 / 985.6 out tok/s with it; 488.4 / 907.5 with the tiles (another
  // H100 call, llama-server 370.7 / 444.3 there). Without the passes spread over blocks, 64
  // sequences decoding the same token (every pair on 8 experts) took 54.5 ms a step against
  // the tiles' 13.3.
  if (const int forced = env_switch("TURBOSPARK_CUDA_MOE_SMALL"); forced >= 0) return forced;
  return n_pairs <= kSmallCols * n_experts;
}

void WeightMatmul::moe_experts(const std::vector<ExpertWeights>& experts, const Mat& x, const int32_t* idx,
                               const float* weight, int k, const Mat& out, cudaStream_t stream) {
  TS_CHECK(!experts.empty() && k >= 1, "moe_experts: {} experts, top-k {}", experts.size(), k);
  const ExpertWeights& e0 = experts[0];
  const int64_t hidden = e0.gate.view.cols, inter = e0.gate.view.rows;
  TS_CHECK(x.cols == hidden && out.cols == hidden && out.rows == x.rows,
           "moe_experts: x [{}, {}] and out [{}, {}] for experts of hidden {}", x.rows, x.cols, out.rows, out.cols,
           hidden);
  TS_CHECK(e0.act == Act::kSilu || e0.act == Act::kGeluTanh || e0.glu_limit > 0,
           "moe_experts: expert activation {} is not SiLU, GELU-tanh or the clamped GLU", int(e0.act));
  for (size_t e = 0; e < experts.size(); ++e) {
    const ExpertWeights& w = experts[e];
    TS_CHECK(same_format(w.gate.view, e0.gate.view) && same_format(w.up.view, e0.gate.view) &&
                 same_format(w.down.view, e0.down.view) && w.down.view.rows == hidden && w.down.view.cols == inter,
             "moe_experts: expert {} ({} gate [{}, {}], {} up [{}, {}], {} down [{}, {}]) differs from expert 0 "
             "({} [{}, {}] gate/up, {} down)",
             e, dtype_name(w.gate.view.dtype), w.gate.view.rows, w.gate.view.cols, dtype_name(w.up.view.dtype),
             w.up.view.rows, w.up.view.cols, dtype_name(w.down.view.dtype), w.down.view.rows, w.down.view.cols,
             dtype_name(e0.gate.view.dtype), inter, hidden, dtype_name(e0.down.view.dtype));
    TS_CHECK(w.act == e0.act && w.glu_limit == e0.glu_limit && w.glu_alpha == e0.glu_alpha,
             "moe_experts: expert {} has another activation than expert 0", e);
    check_weight(w.gate.view, "moe_experts gate");
    check_weight(w.up.view, "moe_experts up");
    check_weight(w.down.view, "moe_experts down");
  }
  if (x.rows == 0) return;
  bool gate_up_vec = true, down_vec = true;
  for (const ExpertWeights& w : experts) {
    gate_up_vec = gate_up_vec && vec_aligned(w.gate.view) && vec_aligned(w.up.view);
    down_vec = down_vec && vec_aligned(w.down.view);
  }

  const MoeTable& table = moe_table(experts, stream);
  const auto* descs = static_cast<const MoeExpertDesc*>(table.device);
  MoeParams p;
  p.n_experts = int32_t(experts.size());
  p.k = k;
  p.hidden = hidden;
  p.inter = inter;
  p.glu = e0.glu_limit > 0 ? Glu::kClamped : e0.act == Act::kSilu ? Glu::kSilu : Glu::kGeluTanh;
  p.glu_alpha = e0.glu_alpha;
  p.glu_limit = e0.glu_limit;
  const int64_t rows = x.rows, n_pairs = rows * k;

  // Every expert's views must suit the format variant chosen from expert 0's.
  auto check_all = [&](auto fmt, bool gate_up) {
    using F = decltype(fmt);
    for (size_t e = 0; e < experts.size(); ++e) {
      const WeightView* views[2] = {gate_up ? &experts[e].gate.view : &experts[e].down.view,
                                    gate_up ? &experts[e].up.view : &experts[e].down.view};
      for (const WeightView* v : views)
        TS_CHECK(aligned_for<F>(*v), "moe_experts: expert {} {} rows not {}-byte aligned", e,
                 gate_up ? "gate/up" : "down", F::kAlign);
    }
  };

  if (moe_int8_activations(e0, rows, k)) {
    void* hq = moe_hidden_.get(size_t(q8x32_bytes(n_pairs, inter)), stream, "moe hidden (int8)");
    int64_t xs = 0;
    const float* xa = aligned_rows(x, &xs, stream);
    const int64_t gate_up_bytes = n_pairs * inter * (e0.gate.view.row_bytes + e0.up.view.row_bytes);
    const int64_t down_bytes = n_pairs * hidden * e0.down.view.row_bytes;
    const bool prefetch_down = l2_prefetch_enabled() && gate_up_bytes + down_bytes <= device_l2_bytes() / 2;
    dispatch_weight_format(e0.gate.view, "moe_experts gate/up", [&](auto fmt) {
      using F = decltype(fmt);
      if constexpr (kHasCodes32<F>) {
        check_all(fmt, true);
        const dim3 grid(unsigned(inter / 32), unsigned(n_pairs));
        const int rows_per_warp = moe_gate_up_rows_per_warp(n_pairs, inter);
        const size_t smem = size_t(q8x32_bytes(1, hidden));
        if (rows_per_warp == 4) {
          launch(moe_gate_up_q4_kernel<F, 4>, grid, 8 * kWarp, smem, stream, descs, p, xa, xs, idx, hq, prefetch_down);
        } else {
          launch(moe_gate_up_q4_kernel<F, 2>, grid, 16 * kWarp, smem, stream, descs, p, xa, xs, idx, hq, prefetch_down);
        }
        TS_CUDA_LAUNCH_CHECK("moe gate_up {} dp4a [{}, {}] x {} rows x top-{} ({} rows a warp)",
                             dtype_name(e0.gate.view.dtype), inter, hidden, rows, k, rows_per_warp);
      }
    });
    dispatch_weight_format(e0.down.view, "moe_experts down", [&](auto fmt) {
      using F = decltype(fmt);
      if constexpr (kHasCodes32<F>) {
        check_all(fmt, false);
        const bool split = moe_down_split(inter);
        if (split) {
          const dim3 grid(unsigned((hidden + 1) / 2), unsigned(rows));
          launch(moe_down_q4_split_kernel<F>, grid, kDownSplitWarps * kWarp, 0, stream, descs, p,
                 static_cast<const void*>(hq), n_pairs, idx, weight, out.data, out.stride);
        } else {
          constexpr int64_t rows_per_block = kDownBlockThreads / kWarp * 2;
          const dim3 grid(unsigned((hidden + rows_per_block - 1) / rows_per_block), unsigned(rows));
          launch(moe_down_q4_kernel<F>, grid, kDownBlockThreads, 0, stream, descs, p, static_cast<const void*>(hq),
                 n_pairs, idx, weight, out.data, out.stride);
        }
        TS_CUDA_LAUNCH_CHECK("moe down {} dp4a [{}, {}] x {} rows x top-{}{}", dtype_name(e0.down.view.dtype), hidden,
                             inter, rows, k, split ? " (warps split the experts)" : "");
      }
    });
    return;
  }
  if (rows <= kMoeDecodeMaxRows) {
    const int64_t ldh = round_up(inter, 4);  // 16-byte aligned rows: the down pass loads them as float4
    auto* h = static_cast<float*>(moe_hidden_.get(size_t(n_pairs * ldh) * 4, stream, "moe hidden"));
    int64_t xs = 0;
    const float* xa = aligned_rows(x, &xs, stream);
    dispatch_weight_format(
        e0.gate.view, "moe_experts gate/up",
        [&](auto fmt) {
          using F = decltype(fmt);
          check_all(fmt, true);
          if constexpr (kBlock32<F>) {
            constexpr int64_t rows_per_block = kGateUpBlockThreads / kWarp * kBlockRowsPerWarp;
            const dim3 grid(unsigned((inter + rows_per_block - 1) / rows_per_block), unsigned(n_pairs));
            launch(moe_gate_up_block32_kernel<F>, grid, kGateUpBlockThreads, 0, stream, descs, p, xa, xs, idx, h,
                   ldh);
          } else {
            // Prefetches only while what they bring stays in L2 until read (half of it).
            const int64_t gate_up_bytes = n_pairs * e0.gate.view.rows * (e0.gate.view.row_bytes + e0.up.view.row_bytes);
            const int64_t down_bytes = n_pairs * e0.down.view.rows * e0.down.view.row_bytes;
            const bool prefetch = l2_prefetch_enabled() && gate_up_bytes <= device_l2_bytes() / 2;
            const bool down = prefetch && gate_up_bytes + down_bytes <= device_l2_bytes() / 2;
            const int rows_per_warp = kHasUnitBits<F> ? moe_unit_gate_up_rows_per_warp() : 1;
            const int64_t block_rows = int64_t(kDecodeRowsPerBlock) * rows_per_warp;
            const dim3 grid(unsigned((inter + block_rows - 1) / block_rows), unsigned(n_pairs));
            if constexpr (kHasUnitBits<F>) {
              if (rows_per_warp == 2) {
                launch(moe_gate_up_gemv_kernel<F, 2>, grid, kDecodeThreads, 0, stream, descs, p, xa, xs, idx, h, ldh,
                       prefetch, down);
              }
            }
            if (rows_per_warp == 1) {
              launch(moe_gate_up_gemv_kernel<F, 1>, grid, kDecodeThreads, 0, stream, descs, p, xa, xs, idx, h, ldh,
                     prefetch, down);
            }
          }
          TS_CUDA_LAUNCH_CHECK("moe gate_up gemv {} [{}, {}] x {} rows x top-{}", dtype_name(e0.gate.view.dtype),
                               inter, hidden, rows, k);
        },
        gate_up_vec);
    dispatch_weight_format(
        e0.down.view, "moe_experts down",
        [&](auto fmt) {
          using F = decltype(fmt);
          check_all(fmt, false);
          if constexpr (kBlock32<F>) {
            constexpr int64_t rows_per_block = kDownBlockThreads / kWarp * kBlockRowsPerWarp;
            const dim3 grid(unsigned((hidden + rows_per_block - 1) / rows_per_block), unsigned(rows));
            launch(moe_down_block32_kernel<F>, grid, kDownBlockThreads, 0, stream, descs, p, h, ldh, idx, weight,
                   out.data, out.stride);
          } else {
            bool split = false;
            if constexpr (kHasUnitBits<F>) {
              split = moe_unit_down_split();
              if (split) {
                const dim3 grid(unsigned((hidden + kUnitDownRows - 1) / kUnitDownRows), unsigned(rows));
                launch(moe_down_unit_split_kernel<F>, grid, kUnitDownWarps * kWarp, 0, stream, descs, p, h, ldh, idx,
                       weight, out.data, out.stride);
              }
            }
            if (!split) {
              const dim3 grid(unsigned((hidden + kDecodeRowsPerBlock - 1) / kDecodeRowsPerBlock), unsigned(rows));
              launch(moe_down_gemv_kernel<F>, grid, kDecodeThreads, 0, stream, descs, p, h, ldh, idx, weight, out.data,
                     out.stride);
            }
          }
          TS_CUDA_LAUNCH_CHECK("moe down gemv {} [{}, {}] x {} rows x top-{}", dtype_name(e0.down.view.dtype), hidden,
                               inter, rows, k);
        },
        down_vec);
    return;
  }

  // Prefill: group pairs by expert on the device.
  const int64_t n_experts = p.n_experts;
  const size_t n_ints = size_t(n_experts) * 2 + size_t(n_experts + 1) * 2 + size_t(n_pairs) * 2;
  auto* ints = static_cast<int32_t*>(moe_index_.get(n_ints * 4, stream, "moe grouping"));
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
  auto* xs = static_cast<__nv_bfloat16*>(moe_x_bf16_.get(size_t(n_pairs * lda) * 2, stream, "moe gathered x"));
  moe_gather_bf16_kernel<<<unsigned(n_pairs), 256, 0, stream>>>(x.data, x.stride, sorted_pairs, offsets + n_experts, k,
                                                               hidden, xs, lda);
  TS_CUDA_LAUNCH_CHECK("moe gather: {} pairs x {}", n_pairs, hidden);
  // Tiles: sum_e ceil(c_e / kBM) <= n_pairs / kBM + (number of experts with rows).
  const int64_t max_tiles = n_pairs / kBM + std::min<int64_t>(n_experts, n_pairs) + 1;
  const int64_t ldh16 = round_up(inter, 8);  // bf16 h rows, 16-byte aligned for the down pass's cp.async
  auto* h16 = static_cast<__nv_bfloat16*>(moe_hidden_.get(size_t(n_pairs * ldh16) * 2, stream, "moe hidden"));
  const int64_t ldy = round_up(hidden, 4);
  auto* y = static_cast<float*>(moe_out_.get(size_t(n_pairs * ldy) * 4, stream, "moe expert outputs"));
  if (moe_small_groups(n_pairs, n_experts, hidden, inter)) {
    // One projection: gate/up (xs -> h16) or down (h16 -> y).
    auto project = [&](auto gate_up) {
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
            const dim3 grid(unsigned(n_experts), unsigned((n_out + kSmallFeatures - 1) / kSmallFeatures),
                            unsigned(passes));
            if constexpr (kGateUp) {
              kernel<<<grid, kSmallThreads, size_t(bytes), stream>>>(descs, p, xs, lda, offsets, h16, ldh16);
            } else {
              kernel<<<grid, kSmallThreads, size_t(bytes), stream>>>(descs, p, h16, ldh16, offsets, y, ldy);
            }
            TS_CUDA_LAUNCH_CHECK("moe grouped small {} {} [{}, {}] x {} rows x top-{}", kGateUp ? "gate_up" : "down",
                                 dtype_name(kGateUp ? e0.gate.view.dtype : e0.down.view.dtype), n_out, depth, rows, k);
          },
          kGateUp ? gate_up_vec : down_vec);
    };
    project(std::true_type{});
    project(std::false_type{});
    moe_combine_kernel<<<unsigned(rows), 256, 0, stream>>>(y, ldy, pair_pos, weight, k, hidden, out.data, out.stride);
    TS_CUDA_LAUNCH_CHECK("moe combine [{}, {}] top-{}", rows, hidden, k);
    return;
  }
  dispatch_weight_format(
      e0.gate.view, "moe_experts gate/up",
      [&](auto fmt) {
        using F = decltype(fmt);
        check_all(fmt, true);
        constexpr size_t bytes = GroupedSmem<true>::kBytes;
        TS_CUDA_CHECK(cudaFuncSetAttribute(moe_grouped_kernel<F, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(bytes)),
                      "moe grouped gate_up: {} bytes of shared memory", bytes);
        const dim3 grid(unsigned(max_tiles), unsigned((inter + kBN - 1) / kBN));
        moe_grouped_kernel<F, true><<<grid, kGroupedThreads, bytes, stream>>>(descs, p, xs, lda, offsets, tile_offsets,
                                                                              h16, ldh16);
        TS_CUDA_LAUNCH_CHECK("moe grouped gate_up {} [{}, {}] x {} rows x top-{}", dtype_name(e0.gate.view.dtype),
                             inter, hidden, rows, k);
      },
      gate_up_vec);
  dispatch_weight_format(
      e0.down.view, "moe_experts down",
      [&](auto fmt) {
        using F = decltype(fmt);
        check_all(fmt, false);
        constexpr size_t bytes = GroupedSmem<false>::kBytes;
        TS_CUDA_CHECK(cudaFuncSetAttribute(moe_grouped_kernel<F, false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           int(bytes)),
                      "moe grouped down: {} bytes of shared memory", bytes);
        const dim3 grid(unsigned(max_tiles), unsigned((hidden + kBN - 1) / kBN));
        moe_grouped_kernel<F, false><<<grid, kGroupedThreads, bytes, stream>>>(descs, p, h16, ldh16, offsets,
                                                                               tile_offsets, y, ldy);
        TS_CUDA_LAUNCH_CHECK("moe grouped down {} [{}, {}] x {} rows x top-{}", dtype_name(e0.down.view.dtype), hidden,
                             inter, rows, k);
      },
      down_vec);
  moe_combine_kernel<<<unsigned(rows), 256, 0, stream>>>(y, ldy, pair_pos, weight, k, hidden, out.data, out.stride);
  TS_CUDA_LAUNCH_CHECK("moe combine [{}, {}] top-{}", rows, hidden, k);
}

}  // namespace turbospark::cuda
