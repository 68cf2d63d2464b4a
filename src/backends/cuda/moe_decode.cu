// Routed experts, decode: the kernels and launchers (MoeCall::decode_int8, decode_f32) that
// moe_experts (moe.cu) calls for up to kMoeDecodeMaxRows rows; shared types in moe_common.cuh.
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
//   instead (moe_int8_activations, moe.cu): x quantized once per block of 32 inter rows, h
//   written as BlockQ8x32 codes by the gate/up pass, eight dp4a per 32-element block and lane
//   (MXFP4's codes looked up as int8 first: q8.cuh mxfp4_dot_q8x32; gpt-oss-20b's MoE took 182
//   us a layer on the f32 unit-wise kernels, eager; Q8_0's codes as stored, read from ggml's
//   34-byte blocks by FmtQ8_0::codes32: the Flash-Next-shaped Qwen4-Exp GGUF's MoE took 188 us
//   a layer on the f32 kernels, eager). (Per-unit dp4a variants of the
//   kernels above measured slower: a block covering 8 output rows did not amortize its own
//   quantization of x.)
#include <cstdint>

#include "backends/cuda/moe_common.cuh"
#include "backends/cuda/q8.cuh"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda::moe {
namespace {

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

}  // namespace

void MoeCall::decode_int8(const float* xa, int64_t xs, void* hq) const {
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
}

void MoeCall::decode_f32(const float* xa, int64_t xs, float* h, int64_t ldh) const {
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
}

}  // namespace turbospark::cuda::moe
