// Row-wise softmax family: MoE router softmax + top-k (Backend::router_softmax_topk), the
// router GEMV fused with it for decode (Backend::router_topk), softmax_rows (--router-out
// probabilities) and argmax_rows (greedy sampling).
//
// router_softmax_topk mirrors the CPU kernel step by step so that the chosen experts are
// identical, ties included: p_e = exp(l_e - max) * (1 / sum) in f32, the k largest by rank
// (p descending, then index ascending: repeated arg-max with ties to the lower index, as the
// CPU and torch.topk pick; block_route below), then (renormalize)
// p_j / (p_0 + ... + p_{k-1}) summed in pick order, then (expert_scale) p_j * scale[idx_j].
// The only difference left is the order of the f32 sum over experts (a tree here, a loop
// there): an ulp in 1/sum, which scales every probability alike.
//
// Bounds: all three are memory-bound on their input row (the router and softmax on
// [rows, n_experts], tiny; argmax on [rows, vocab], 1 MB per row at vocab 262144).
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace turbospark::cuda {
namespace {

// Softmax top-k of one router row by a whole block:
//   warp 0: p_e = exp(l_e - max) over lanes holding experts lane, lane + 32, ..., the sum of
//   each lane's in slot order then a warp tree, p_e *= 1 / sum;
//   every warp: the k largest of its slice of the row by (p desc, index asc), in k rounds of
//   warp arg-max with ties to the lower index; then warp 0 the k largest of the warps'
//   candidates the same way: the pick order of repeated arg-max over the whole row, as the CPU
//   and torch.topk pick. (Each thread ranking its experts against the whole row took O(E^2)
//   shared-memory reads: with 512 experts the router of a Flash-Next-shaped Qwen4-Exp took 29 us
//   a decode layer under ncu.)
//   thread 0: renormalize by the picks' sum in pick order, then the per-expert scale.
// A row whose probabilities hold a NaN (a NaN or infinite logit) routes to expert -1, which the
// expert kernels turn into NaN outputs.
constexpr int kRouteMaxExperts = 512;
constexpr int kRouteMaxK = 16;
// block_route's block sizes: 4 to 8 warps (a lane holds up to kRouteMaxExperts / 128 experts of
// its warp's slice; the candidates of up to 8 warps fit shared memory).
constexpr int kRouteMinThreads = 128, kRouteMaxThreads = 256;
constexpr int kRouteSlotsPerLane = kRouteMaxExperts / kRouteMinThreads;

struct RouteSmem {
  float p[kRouteMaxExperts];
  int32_t idx[kRouteMaxK];
  float w[kRouteMaxK];
  float cand_p[kRouteMaxThreads / kWarp * kRouteMaxK];
  int32_t cand_e[kRouteMaxThreads / kWarp * kRouteMaxK];
  int nan;
};

// (value, index) arg-max across the warp: larger value wins, equal values go to the lower index.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
  }
}

// The k largest of n (value, index) pairs spread over a warp's lanes (slot j of lane l holds pair
// l + 32 j; values >= 0, absent ones -1 with index INT_MAX), by rounds of warp arg-max: pick r
// of the warp to out_p[r] / out_e[r] (lane 0 writes).
__device__ __forceinline__ void warp_top_k(float (&v)[kRouteSlotsPerLane], int (&id)[kRouteSlotsPerLane], int k,
                                           float* out_p, int32_t* out_e) {
  const int lane = threadIdx.x % kWarp;
  for (int r = 0; r < k; ++r) {
    float bv = -1.f;
    int bi = 0x7fffffff, slot = -1;
#pragma unroll
    for (int j = 0; j < kRouteSlotsPerLane; ++j)
      if (v[j] > bv || (v[j] == bv && id[j] < bi)) bv = v[j], bi = id[j], slot = j;
    float wv = bv;
    int wi = bi;
    warp_argmax(wv, wi);
    if (slot >= 0 && bi == wi && bi != 0x7fffffff) {
#pragma unroll
      for (int j = 0; j < kRouteSlotsPerLane; ++j)
        if (j == slot) v[j] = -1.f, id[j] = 0x7fffffff;
    }
    if (lane == 0) out_p[r] = wv, out_e[r] = wi;
  }
}

// All threads of the block call it (it holds __syncthreads); blockDim.x a multiple of 32.
// On return s.idx[0..k) / s.w[0..k) are the row's picks.
__device__ __forceinline__ void block_route(const float* __restrict__ logits, int n_experts, int k, bool renormalize,
                                            const float* __restrict__ expert_scale, RouteSmem& s) {
  constexpr int kPerLane = kRouteMaxExperts / kWarp;
  if (threadIdx.x < kWarp) {
    const int lane = threadIdx.x;
    float p[kPerLane];
    float m = -INFINITY;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + i * kWarp;
      p[i] = e < n_experts ? logits[e] : -INFINITY;
      m = fmaxf(m, p[i]);
    }
    m = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + i * kWarp;
      p[i] = e < n_experts ? expf(p[i] - m) : 0.f;
      sum += p[i];
    }
    sum = warp_sum(sum);
    const float inv = 1.f / sum;
    bool nan = false;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int e = lane + i * kWarp;
      if (e < n_experts) {
        s.p[e] = p[i] * inv;
        nan |= !(s.p[e] == s.p[e]);
      }
    }
    nan = __any_sync(0xffffffffu, nan);
    if (lane < kRouteMaxK) s.idx[lane] = -1, s.w[lane] = 0.f;
    if (lane == 0) s.nan = nan;
  }
  __syncthreads();
  const int warps = blockDim.x / kWarp, warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  if (!s.nan) {
    const int per = (n_experts + warps - 1) / warps, lo = warp * per, hi = min(n_experts, lo + per);
    float v[kRouteSlotsPerLane];
    int id[kRouteSlotsPerLane];
#pragma unroll
    for (int j = 0; j < kRouteSlotsPerLane; ++j) {
      const int e = lo + lane + j * kWarp;
      v[j] = e < hi ? s.p[e] : -1.f;
      id[j] = e < hi ? e : 0x7fffffff;
    }
    warp_top_k(v, id, k, s.cand_p + warp * k, s.cand_e + warp * k);
  }
  __syncthreads();
  if (!s.nan && warp == 0) {
    const int n = warps * k;
    float v[kRouteSlotsPerLane];
    int id[kRouteSlotsPerLane];
#pragma unroll
    for (int j = 0; j < kRouteSlotsPerLane; ++j) {
      const int c = lane + j * kWarp;
      v[j] = c < n ? s.cand_p[c] : -1.f;
      id[j] = c < n ? s.cand_e[c] : 0x7fffffff;
    }
    warp_top_k(v, id, k, s.w, s.idx);
  }
  __syncthreads();
  if (threadIdx.x == 0 && !s.nan) {
    if (renormalize) {
      float picked = 0.f;
      for (int j = 0; j < k; ++j) picked += s.w[j];
      for (int j = 0; j < k; ++j) s.w[j] /= picked;
    }
    if (expert_scale)
      for (int j = 0; j < k; ++j) s.w[j] *= expert_scale[s.idx[j]];
  }
  __syncthreads();
}

constexpr int kRouterThreads = 128;
static_assert(kRouterThreads >= kRouteMinThreads && kRouterThreads <= kRouteMaxThreads);

// One block per row (block_route). It replaced one warp per row taking k dependent rounds of
// shuffled arg-max (5.3 us a decode layer under ncu); measured only together with the L2
// prefetches of the same change (Q4_0 30B-A3B decode 285 -> 295 tok/s, NOTES_matmul.md).
__global__ void __launch_bounds__(kRouterThreads)
    router_topk_kernel(const float* __restrict__ logits, int64_t stride, int n_experts, int k, bool renormalize,
                       int32_t* __restrict__ idx, float* __restrict__ weight, const float* __restrict__ expert_scale) {
  pdl_begin();
  __shared__ RouteSmem s;
  const int64_t row = blockIdx.x;
  block_route(logits + row * stride, n_experts, k, renormalize, expert_scale, s);
  if (threadIdx.x < k) {
    idx[row * k + threadIdx.x] = s.idx[threadIdx.x];
    weight[row * k + threadIdx.x] = s.w[threadIdx.x];
  }
}

// ---- router GEMV + top-k in one launch (decode) -----------------------------------------------
// Block e computes router row e's logit for every activation row (<= kRouterMaxRows): its
// threads take 8-column chunks, the first loaded before pdl_begin() (weights are never written
// by a step's kernels), sums reduced in shared memory, written to logits. Then the block takes
// a ticket; the last block of the grid to finish reads every logit back (past L1: other SMs
// wrote them) and routes each row with block_route, as router_topk_kernel does, then resets
// the ticket for the next launch (graph replays reuse the counter). One launch instead of a
// GEMV and a top-k kernel (4.3 + 5.2 us a decode layer under ncu, mostly ramp and drain).
// Summation order differs from the GEMV's (8-column chunks per thread, then a block tree).
constexpr int kRouterGemvThreads = 256;
static_assert(kRouterGemvThreads >= kRouteMinThreads && kRouterGemvThreads <= kRouteMaxThreads);
constexpr int kRouterMaxRows = 8;

template <bool kBf16>
__device__ __forceinline__ void load_router_chunk(const uint8_t* __restrict__ row, int64_t c, float (&w)[8]) {
  if constexpr (kBf16) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + 2 * c));
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) w[2 * i] = __uint_as_float(words[i] << 16), w[2 * i + 1] = __uint_as_float(words[i] & 0xFFFF0000u);
  } else {
    const float4 a = __ldg(reinterpret_cast<const float4*>(row + 4 * c));
    const float4 b = __ldg(reinterpret_cast<const float4*>(row + 4 * c) + 1);
    w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w, w[4] = b.x, w[5] = b.y, w[6] = b.z, w[7] = b.w;
  }
}

template <bool kBf16>
__global__ void __launch_bounds__(kRouterGemvThreads)
    router_gemv_topk_kernel(const uint8_t* __restrict__ w, int64_t w_row_bytes, int64_t cols,
                            const float* __restrict__ x, int64_t x_stride, int rows, float* __restrict__ logits,
                            int64_t l_stride, int k, bool renormalize, const float* __restrict__ expert_scale,
                            const float* __restrict__ bias, int32_t* __restrict__ idx, float* __restrict__ weight,
                            unsigned* __restrict__ ticket) {
  __shared__ float partial[kRouterGemvThreads / kWarp][kRouterMaxRows];
  __shared__ float row_logits[kRouteMaxExperts];
  __shared__ RouteSmem route;
  __shared__ bool last;
  const int e = blockIdx.x, n_experts = gridDim.x;
  const uint8_t* wr = w + int64_t(e) * w_row_bytes;
  const int64_t c0 = int64_t(threadIdx.x) * 8, step = int64_t(kRouterGemvThreads) * 8;
  float first[8] = {};
  if (c0 < cols) load_router_chunk<kBf16>(wr, c0, first);
  pdl_begin();
  float acc[kRouterMaxRows] = {};
  auto accumulate = [&](int64_t c, const float (&wv)[8]) {
#pragma unroll
    for (int r = 0; r < kRouterMaxRows; ++r) {
      if (r < rows) {
        const float4 a = __ldg(reinterpret_cast<const float4*>(x + r * x_stride + c));
        const float4 b = __ldg(reinterpret_cast<const float4*>(x + r * x_stride + c) + 1);
        float v = acc[r];
        v = fmaf(wv[0], a.x, v), v = fmaf(wv[1], a.y, v), v = fmaf(wv[2], a.z, v), v = fmaf(wv[3], a.w, v);
        v = fmaf(wv[4], b.x, v), v = fmaf(wv[5], b.y, v), v = fmaf(wv[6], b.z, v), v = fmaf(wv[7], b.w, v);
        acc[r] = v;
      }
    }
  };
  if (c0 < cols) accumulate(c0, first);
  for (int64_t c = c0 + step; c < cols; c += step) {
    float wv[8];
    load_router_chunk<kBf16>(wr, c, wv);
    accumulate(c, wv);
  }
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
#pragma unroll
  for (int r = 0; r < kRouterMaxRows; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0) partial[warp][r] = v;
  }
  __syncthreads();
  if (threadIdx.x < rows) {
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < kRouterGemvThreads / kWarp; ++i) v += partial[i][threadIdx.x];
    logits[threadIdx.x * l_stride + e] = bias ? v + bias[e] : v;  // add_bias's one addition
    __threadfence();  // the logit is visible device-wide before the ticket says so
  }
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == unsigned(n_experts - 1);
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int r = 0; r < rows; ++r) {
    for (int i = threadIdx.x; i < n_experts; i += kRouterGemvThreads) row_logits[i] = __ldcg(logits + r * l_stride + i);
    __syncthreads();
    block_route(row_logits, n_experts, k, renormalize, expert_scale, route);
    if (threadIdx.x < k) {
      idx[r * k + threadIdx.x] = route.idx[threadIdx.x];
      weight[r * k + threadIdx.x] = route.w[threadIdx.x];
    }
    __syncthreads();  // route and row_logits are rewritten for the next row
  }
  if (threadIdx.x == 0) *ticket = 0u;
}

constexpr int kSoftmaxThreads = 256;

// One block per row: max, sum of exp, then exp / sum. y may alias x: the last pass starts
// after block_sum's barrier, when every read of the first two is done, and each thread
// rewrites only elements it reads itself.
__global__ void __launch_bounds__(kSoftmaxThreads) softmax_rows_kernel(const float* x, int64_t x_stride, float* y,
                                                                        int64_t y_stride, int cols) {
  __shared__ float scratch[kWarp];
  const float* xr = x + int64_t(blockIdx.x) * x_stride;
  float* yr = y + int64_t(blockIdx.x) * y_stride;
  float m = -INFINITY;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, xr[c]);
  m = block_max(m, scratch);
  float sum = 0.f;
  for (int c = threadIdx.x; c < cols; c += blockDim.x) sum += expf(xr[c] - m);
  sum = block_sum(sum, scratch);
  for (int c = threadIdx.x; c < cols; c += blockDim.x) yr[c] = expf(xr[c] - m) / sum;
}

constexpr int kArgmaxThreads = 1024;

// One block of 1024 threads per row; kVec: float4 loads (row 16-byte aligned, cols % 4 == 0).
// A thread scans its elements in increasing index order with a strict >, then (value, index)
// pairs reduce with ties to the lower index: the lowest index of the maximum wins. A row
// holding a NaN gives -1, as on the CPU.
template <bool kVec>
__global__ void __launch_bounds__(kArgmaxThreads)
    argmax_rows_kernel(const float* __restrict__ logits, int64_t stride, int cols, int32_t* __restrict__ ids) {
  pdl_begin();
  __shared__ float s_v[kArgmaxThreads / kWarp];
  __shared__ int s_i[kArgmaxThreads / kWarp];
  const float* l = logits + int64_t(blockIdx.x) * stride;
  float best = -INFINITY;
  int best_i = 0x7fffffff;
  bool nan = false;
  auto take = [&](float v, int i) {
    nan |= v != v;
    if (v > best) best = v, best_i = i;
  };
  if constexpr (kVec) {
    const float4* l4 = reinterpret_cast<const float4*>(l);
    for (int c = threadIdx.x; c < cols / 4; c += kArgmaxThreads) {
      const float4 v = l4[c];
      take(v.x, 4 * c);
      take(v.y, 4 * c + 1);
      take(v.z, 4 * c + 2);
      take(v.w, 4 * c + 3);
    }
  } else {
    for (int c = threadIdx.x; c < cols; c += kArgmaxThreads) take(l[c], c);
  }
  // A row of all -inf still names an index: the first element.
  if (best_i == 0x7fffffff && threadIdx.x == 0) best_i = 0;
  warp_argmax(best, best_i);
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  if (lane == 0) s_v[warp] = best, s_i[warp] = best_i;
  nan = __syncthreads_or(nan);
  if (warp == 0) {
    best = s_v[lane];
    best_i = s_i[lane];
    warp_argmax(best, best_i);
    if (lane == 0) ids[blockIdx.x] = nan ? -1 : best_i;
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight,
                         const float* expert_scale, cudaStream_t stream) {
  TS_CHECK(k >= 1 && k <= logits.cols, "router: top-k {} with {} experts", k, logits.cols);
  TS_CHECK(logits.cols <= kRouteMaxExperts && k <= kRouteMaxK,
           "router: {} experts, top-{} (the CUDA router takes up to {} experts and top-{})", logits.cols, k,
           kRouteMaxExperts, kRouteMaxK);
  TS_CHECK(logits.rows <= 0x7fffffff, "router: {} rows", logits.rows);
  if (logits.rows == 0) return;
  launch(router_topk_kernel, unsigned(logits.rows), kRouterThreads, 0, stream, logits.data, logits.stride,
         int(logits.cols), k, renormalize, idx, weight, expert_scale);
  TS_CUDA_LAUNCH_CHECK("router_softmax_topk [{}, {}] k {}", logits.rows, logits.cols, k);
}

bool router_gemv_topk(const WeightView& w, const Mat& x, const Mat& logits, int k, bool renormalize, int32_t* idx,
                      float* weight, const float* expert_scale, const float* bias, unsigned* ticket,
                      cudaStream_t stream) {
  const bool bf16 = w.dtype == DType::BF16;
  const int64_t elem = bf16 ? 2 : 4;
  if ((!bf16 && w.dtype != DType::F32) || w.scales || x.rows < 1 || x.rows > kRouterMaxRows ||
      w.rows < 1 || w.rows > kRouteMaxExperts || k < 1 || k > kRouteMaxK || k > w.rows || w.cols % 8 != 0 ||
      x.cols != w.cols || logits.cols != w.rows || logits.rows != x.rows || !aligned16(w.data) ||
      w.row_bytes % 16 != 0 || w.row_bytes < w.cols * elem || !aligned16(x.data) || x.stride % 4 != 0)
    return false;
  auto kernel = bf16 ? router_gemv_topk_kernel<true> : router_gemv_topk_kernel<false>;
  launch(kernel, unsigned(w.rows), kRouterGemvThreads, 0, stream, static_cast<const uint8_t*>(w.data), w.row_bytes,
         w.cols, static_cast<const float*>(x.data), x.stride, int(x.rows), logits.data, logits.stride, k, renormalize,
         expert_scale, bias, idx, weight, ticket);
  TS_CUDA_LAUNCH_CHECK("router gemv + top-{} {} [{}, {}] x {} rows", k, dtype_name(w.dtype), w.rows, w.cols, x.rows);
  return true;
}

void softmax_rows(const Mat& x, const Mat& y, cudaStream_t stream) {
  TS_CHECK(x.rows == y.rows && x.cols == y.cols, "softmax_rows: x [{}, {}] vs y [{}, {}]", x.rows, x.cols, y.rows,
           y.cols);
  TS_CHECK(x.rows <= 0x7fffffff && x.cols < (int64_t(1) << 31), "softmax_rows: [{}, {}]", x.rows, x.cols);
  if (x.rows == 0 || x.cols == 0) return;
  // Block of 256 per row: rows are n_experts wide (<= 512), one or two elements per thread.
  softmax_rows_kernel<<<int(x.rows), kSoftmaxThreads, 0, stream>>>(x.data, x.stride, y.data, y.stride, int(x.cols));
  TS_CUDA_LAUNCH_CHECK("softmax_rows [{}, {}]", x.rows, x.cols);
}

void argmax_rows(const Mat& logits, int32_t* ids, cudaStream_t stream) {
  TS_CHECK(logits.rows <= 0x7fffffff && logits.cols > 0 && logits.cols < (int64_t(1) << 31), "argmax_rows: [{}, {}]",
           logits.rows, logits.cols);
  if (logits.rows == 0) return;
  // Block of 1024 per row: vocab 262144 is 64 float4 per thread. Greedy decode has 1 row, so
  // this is one SM's bandwidth (~1 MB in ~10 us); a split over blocks would need scratch.
  const bool vec = aligned16(logits.data) && logits.stride % 4 == 0 && logits.cols % 4 == 0;
  if (vec) {
    launch(argmax_rows_kernel<true>, int(logits.rows), kArgmaxThreads, 0, stream, logits.data, logits.stride,
           int(logits.cols), ids);
  } else {
    launch(argmax_rows_kernel<false>, int(logits.rows), kArgmaxThreads, 0, stream, logits.data, logits.stride,
           int(logits.cols), ids);
  }
  TS_CUDA_LAUNCH_CHECK("argmax_rows [{}, {}]", logits.rows, logits.cols);
}

}  // namespace turbospark::cuda
