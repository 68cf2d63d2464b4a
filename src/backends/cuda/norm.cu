// RMSNorm over rows (Backend::rmsnorm): y = x * rsqrt(mean(x^2) + eps) * (weight + offset),
// in f32 like transformers (variance in float32, then x * inv_rms, then * weight).
//
// Bound: memory. Each row is read twice (the second read hits L1: a row of 8192 floats is
// 32 KB) and written once, so the target is 8 bytes per element at HBM bandwidth. Two
// shapes matter: hidden-size rows (few, 1k-8k columns) and per-head q/k norms viewed as
// [rows * heads, head_dim] (many rows of 64-256 columns). The first gets a block per row,
// the second a warp per row so that short rows do not leave 7 of 8 warps idle.
//
// The same kernels norm each of a row's equal column ranges on its own (Backend::rmsnorm_groups:
// hyper-connection streams side by side, each range with its slice of the weight) and multiply
// by an activated gate as they store (Backend::rmsnorm_gated: GatedDeltaNet's per-head norm, one
// weight for every range): a range is then what a row is above.
#include "backends/cuda/act.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace turbospark::cuda {
namespace {

constexpr int kWarpRowsPerBlock = 8;    // warp-per-row kernel: 8 rows per 256-thread block
constexpr int kBlockRowThreads = 1024;  // block-per-row kernel: the most threads a launch uses
constexpr int64_t kWarpRowMaxCols = 1024;

// x += residual first, in place, with the sum of squares taken over the sums (kAdd,
// Backend::add_rmsnorm: the residual add and the next norm in one launch). Each thread re-reads
// only the elements it wrote, so the second pass sees the sums without a barrier.
template <bool kVec, bool kAdd>
__device__ __forceinline__ float sum_squares(float* xr, const float* __restrict__ rr, int cols, int t, int n) {
  float sum_sq = 0.f;
  if constexpr (kVec) {
    float4* x4 = reinterpret_cast<float4*>(xr);
    for (int c = t; c < cols / 4; c += n) {
      float4 v = x4[c];
      if constexpr (kAdd) {
        const float4 r = reinterpret_cast<const float4*>(rr)[c];
        v = make_float4(v.x + r.x, v.y + r.y, v.z + r.z, v.w + r.w);
        x4[c] = v;
      }
      sum_sq += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
    }
  } else {
    for (int c = t; c < cols; c += n) {
      float v = xr[c];
      if constexpr (kAdd) xr[c] = v = v + rr[c];
      sum_sq += v * v;
    }
  }
  return sum_sq;
}

// What a launch norms: rows x groups ranges of `cols` columns. Range g of row r starts at column
// g * cols of x, y, residual and gate, and reads weight + g * w_group_stride (cols, or 0: one
// weight for all). gate (kGate): y = norm * act(gate), element by element.
struct NormArgs {
  float* x;
  int64_t x_stride;
  const float* residual;
  int64_t r_stride;
  const float* weight;
  int64_t w_group_stride;
  float eps, weight_offset;
  float* y;
  int64_t y_stride;
  const float* gate;
  int64_t g_stride;
  Act act;
  int64_t rows;
  int cols, groups;
};

// Range `item` (row-major over rows x groups): its x, y, residual, gate and weight.
struct NormRange {
  float *x, *y;
  const float *r, *g, *w;
  __device__ __forceinline__ NormRange(const NormArgs& a, int64_t item) {
    const int64_t row = item / a.groups, off = (item % a.groups) * a.cols;
    x = a.x + row * a.x_stride + off;
    y = a.y + row * a.y_stride + off;
    r = a.residual + row * a.r_stride + off;
    g = a.gate + row * a.g_stride + off;
    w = a.weight + (item % a.groups) * a.w_group_stride;
  }
};

// The normed range stored: (x * inv_rms) * (w + offset), times act(gate) with kGate. Threads t,
// t + n, ... over the range; y may alias x (each thread reads an element before writing it).
template <bool kVec, bool kGate>
__device__ __forceinline__ void store_normed(const NormArgs& a, const NormRange& at, float inv_rms, int t, int n) {
  const float off = a.weight_offset;
  if constexpr (kVec) {
    const float4* x4 = reinterpret_cast<const float4*>(at.x);
    const float4* w4 = reinterpret_cast<const float4*>(at.w);
    float4* y4 = reinterpret_cast<float4*>(at.y);
    for (int c = t; c < a.cols / 4; c += n) {
      const float4 v = x4[c], w = w4[c];
      float4 o = make_float4((v.x * inv_rms) * (w.x + off), (v.y * inv_rms) * (w.y + off), (v.z * inv_rms) * (w.z + off),
                             (v.w * inv_rms) * (w.w + off));
      if constexpr (kGate) {
        const float4 g = reinterpret_cast<const float4*>(at.g)[c];
        o = make_float4(o.x * apply_act(a.act, g.x), o.y * apply_act(a.act, g.y), o.z * apply_act(a.act, g.z),
                        o.w * apply_act(a.act, g.w));
      }
      y4[c] = o;
    }
  } else {
    for (int c = t; c < a.cols; c += n) {
      float o = (at.x[c] * inv_rms) * (at.w[c] + off);
      if constexpr (kGate) o = o * apply_act(a.act, at.g[c]);
      at.y[c] = o;
    }
  }
}

// One warp per range. kVec: every range is float4-aligned (x, y, weight, residual, gate,
// strides, cols % 4).
template <bool kVec, bool kAdd, bool kGate>
__global__ void rmsnorm_warp_kernel(NormArgs a) {
  pdl_begin();
  const int64_t item = int64_t(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / kWarp;
  if (item >= a.rows * a.groups) return;
  const int lane = threadIdx.x % kWarp;
  const NormRange at(a, item);
  float sum_sq = sum_squares<kVec, kAdd>(at.x, at.r, a.cols, lane, kWarp);
  sum_sq = warp_sum(sum_sq);
  const float inv_rms = 1.f / sqrtf(sum_sq / float(a.cols) + a.eps);
  store_normed<kVec, kGate>(a, at, inv_rms, lane, kWarp);
}

// One block per range (256 or kBlockRowThreads threads), for long ranges.
template <bool kVec, bool kAdd, bool kGate>
__global__ void __launch_bounds__(kBlockRowThreads) rmsnorm_block_kernel(NormArgs a) {
  pdl_begin();
  __shared__ float scratch[kWarp];
  const NormRange at(a, blockIdx.x);
  float sum_sq = sum_squares<kVec, kAdd>(at.x, at.r, a.cols, threadIdx.x, blockDim.x);
  sum_sq = block_sum(sum_sq, scratch);  // contains the barrier that orders every read before any write
  const float inv_rms = 1.f / sqrtf(sum_sq / float(a.cols) + a.eps);
  store_normed<kVec, kGate>(a, at, inv_rms, threadIdx.x, blockDim.x);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <bool kVec, bool kAdd, bool kGate>
void launch_norm(const NormArgs& a, cudaStream_t stream) {
  const int64_t items = a.rows * a.groups;
  if (a.cols <= kWarpRowMaxCols) {
    // Warp per range: 8 ranges per 256-thread block; a 1024-column range is 8 float4 loads per lane.
    launch(rmsnorm_warp_kernel<kVec, kAdd, kGate>, unsigned(ceil_div(items, kWarpRowsPerBlock)),
           kWarpRowsPerBlock * kWarp, 0, stream, a);
  } else {
    // Block per range: 256 threads x float4 cover 1024 columns per sweep (hidden 8192: 8 sweeps).
    // A decode step's few ranges get 1024 threads instead: the block is latency bound (read,
    // reduce, read again, write), and a 4096-column row then takes one float4 per thread
    // (5.5 us per call at 256 threads on the H200, measured with ncu).
    launch(rmsnorm_block_kernel<kVec, kAdd, kGate>, unsigned(items), items <= 16 ? kBlockRowThreads : 256, 0, stream,
           a);
  }
}

// Checks the shapes, picks the float4 form where everything is aligned, launches.
template <bool kAdd, bool kGate>
void run_norm(const char* op, const Mat& x, const Mat& y, NormArgs a, cudaStream_t stream) {
  TS_CHECK(x.rows == y.rows && x.cols == y.cols, "{}: x [{}, {}] vs y [{}, {}]", op, x.rows, x.cols, y.rows, y.cols);
  TS_CHECK(x.cols > 0 && x.cols < (int64_t(1) << 31), "{}: {} columns", op, x.cols);
  TS_CHECK(a.groups >= 1 && x.cols % a.groups == 0, "{}: {} columns in {} groups", op, x.cols, a.groups);
  if (x.rows == 0) return;
  a.x = x.data;
  a.x_stride = x.stride;
  a.y = y.data;
  a.y_stride = y.stride;
  a.rows = x.rows;
  a.cols = int(x.cols / a.groups);
  TS_CHECK(x.rows * a.groups <= 0x7fffffff, "{}: {} ranges", op, x.rows * a.groups);
  const bool vec = aligned16(a.x) && aligned16(a.y) && aligned16(a.weight) && a.x_stride % 4 == 0 &&
                   a.y_stride % 4 == 0 && a.cols % 4 == 0 && a.w_group_stride % 4 == 0 &&
                   (!kAdd || (aligned16(a.residual) && a.r_stride % 4 == 0)) &&
                   (!kGate || (aligned16(a.gate) && a.g_stride % 4 == 0));
  if (vec) launch_norm<true, kAdd, kGate>(a, stream);
  else launch_norm<false, kAdd, kGate>(a, stream);
  TS_CUDA_LAUNCH_CHECK("{} [{}, {}] in {} groups (stride {} -> {})", op, x.rows, x.cols, a.groups, x.stride, y.stride);
}

NormArgs norm_args(const float* weight, float eps, float weight_offset, int groups, int64_t w_group_stride) {
  NormArgs a{};
  a.weight = weight;
  a.eps = eps;
  a.weight_offset = weight_offset;
  a.groups = groups;
  a.w_group_stride = w_group_stride;
  a.act = Act::kIdentity;
  return a;
}

}  // namespace

void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset, cudaStream_t stream) {
  run_norm<false, false>("rmsnorm", x, y, norm_args(weight, eps, weight_offset, 1, 0), stream);
}

void rmsnorm_groups(const Mat& x, const float* weight, int groups, float eps, const Mat& y, float weight_offset,
                    cudaStream_t stream) {
  TS_CHECK(groups >= 1 && x.cols % groups == 0, "rmsnorm_groups: {} columns in {} groups", x.cols, groups);
  run_norm<false, false>("rmsnorm_groups", x, y, norm_args(weight, eps, weight_offset, groups, x.cols / groups), stream);
}

void rmsnorm_gated(const Mat& x, const float* weight, int groups, float eps, const Mat& gate, Act act, const Mat& y,
                   cudaStream_t stream) {
  TS_CHECK(gate.rows == x.rows && gate.cols == x.cols, "rmsnorm_gated: gate [{}, {}] for x [{}, {}]", gate.rows,
           gate.cols, x.rows, x.cols);
  NormArgs a = norm_args(weight, eps, 0.f, groups, 0);
  a.gate = gate.data;
  a.g_stride = gate.stride;
  a.act = act;
  run_norm<false, true>("rmsnorm_gated", x, y, a, stream);
}

void add_rmsnorm(const Mat& x, const Mat& residual, const float* weight, float eps, const Mat& y, float weight_offset,
                 cudaStream_t stream) {
  TS_CHECK(residual.rows == x.rows && residual.cols == x.cols, "add_rmsnorm: x [{}, {}] vs residual [{}, {}]",
           x.rows, x.cols, residual.rows, residual.cols);
  NormArgs a = norm_args(weight, eps, weight_offset, 1, 0);
  a.residual = residual.data;
  a.r_stride = residual.stride;
  run_norm<true, false>("add_rmsnorm", x, y, a, stream);
}

}  // namespace turbospark::cuda
