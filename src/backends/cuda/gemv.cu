// y = x W^T for few activation rows (decode: 1 row; up to kGemvMaxRows), any weight format,
// weights dequantized in registers (quant.cuh), f32 accumulation.
//
// Bound: HBM bandwidth on the weight bytes, read exactly once per call for all rows (the
// activations, rows x in x 4 bytes, stay in L1/L2). At 4.8 TB/s an H200 streams a 4096 x 4096
// Q4_K matrix (9.4 MB) in ~2 us, a bf16 one (33.5 MB) in ~7 us.
//
// Layout: a "group" of warps_per_group warps computes kOut consecutive output rows; its
// threads stride over 8-element units, so a warp reads 32 consecutive units of each weight
// row per step (contiguous bytes: 1 KB for f32, 512 B bf16, 128-176 B for 4-bit formats) and
// each activation chunk it loads (two 16-byte loads) meets kOut weight rows: without that
// reuse the activation reads from L1 would outweigh the 4-bit weight reads ~7:1 and bound the
// kernel on L1 rather than HBM. warps_per_group > 1 (split-K inside the block, reduced in
// shared memory) only when the matrix has too few rows to occupy the GPU otherwise.
//
// Q4_0 (in planes, the CUDA backend's layout, or ggml's blocks) and Q8_0 take
// gemv_q4_dp4a_kernel while the activation codes fit shared memory: a lane owns whole
// 32-element blocks, the block quantizes x per 32 as the CPU backend does (q8.cuh), eight dp4a a
// block (Q4_0 30B-A3B decode 295 -> 393 tok/s on the H200). Otherwise Q4_0 in planes reads
// whole blocks per thread with f32 activations (kBlock32, quant.cuh).
//
// The other 32-element ggml formats (Q4_1, Q5_0, Q5_1; Q8_0 past the codes' shared memory) take the unit-wise dp4a variant
// when the matrix has rows enough for blocks of one-warp groups (LM heads, wide FFNs): the
// block quantizes its activation rows to int8 in shared memory first (q8.cuh), then each unit
// is two dp4a on the raw codes and one scale, fewer instructions than the f32 dequantize.
// K-quants, MXFP4 and INT4-affine keep the f32 variant for now (the CPU quantizes their
// activations per 256 or not at all; a dp4a path for them must match that).
#include "backends/cuda/act.cuh"
#include "backends/cuda/matmul.h"
#include "backends/cuda/q8.cuh"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda {
namespace {

constexpr int kGemvThreads = 256;  // 8 warps: up to 8 groups of one warp per block

// Each group's sums to y: lane 0 of a one-warp group, or the group's first threads after a
// shared-memory reduction over its warps (split-K). acc is this thread's warp-reduced sums.
template <int kMaxRows, int kOut>
__device__ __forceinline__ void store_gemv(float (&acc)[kMaxRows][kOut], int n_rows, int64_t out_rows, int64_t o0,
                                           float* __restrict__ y, int64_t y_stride, const MatmulAct& act,
                                           int warps_per_group, int group, int t) {
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
    for (int j = 0; j < kOut; ++j) acc[r][j] = warp_sum(acc[r][j]);
  const int lane = threadIdx.x % kWarp;
  if (warps_per_group == 1) {
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
        for (int j = 0; j < kOut; ++j)
          if (r < n_rows && o0 + j < out_rows) y[r * y_stride + o0 + j] = apply_matmul_act(act, acc[r][j]);
    }
    return;
  }
  __shared__ float partial[kGemvThreads / kWarp][kMaxRows * kOut];
  const int warp = threadIdx.x / kWarp;
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
      for (int j = 0; j < kOut; ++j) partial[warp][r * kOut + j] = acc[r][j];
  }
  __syncthreads();
  if (t < kMaxRows * kOut) {
    const int r = t / kOut, j = t % kOut;
    float sum = 0.f;
    for (int i = 0; i < warps_per_group; ++i) sum += partial[group * warps_per_group + i][t];
    if (r < n_rows && o0 + j < out_rows) y[r * y_stride + o0 + j] = apply_matmul_act(act, sum);
  }
}

// This thread's place: its group (kOut consecutive output rows from o0), its index t within
// the group's threads, and the group's weight rows. Rows past the end read the last row (valid
// memory, result dropped): no divergence inside the unit loop.
template <int kOut>
struct GemvPlace {
  int group, t, group_threads;
  int64_t o0;
  WeightRow wr[kOut];

  __device__ __forceinline__ GemvPlace(const DeviceWeight& w, int warps_per_group, int block) {
    group_threads = warps_per_group * kWarp;
    const int groups_per_block = kGemvThreads / group_threads;
    group = threadIdx.x / group_threads;
    t = threadIdx.x % group_threads;
    o0 = (int64_t(block) * groups_per_block + group) * kOut;
#pragma unroll
    for (int j = 0; j < kOut; ++j) wr[j] = weight_row(w, o0 + j < w.rows ? o0 + j : w.rows - 1);
  }
};

// Up to kMaxGemvJobs weights of one format over the same activations in one launch (q, k and
// v of an attention layer; a GatedDeltaNet layer's four input projections: one launch instead
// of several, each a few microseconds of ramp and drain at decode): blocks [block_end[j - 1],
// block_end[j]) compute job j exactly as a launch of its own would (same groups, split-K and
// sums), so the outputs are bit-identical. Each job's outputs take its activation as they are
// stored (identity: unchanged).
constexpr int kMaxGemvJobs = 4;
struct GemvJobs {
  DeviceWeight w[kMaxGemvJobs];
  float* y[kMaxGemvJobs];
  int64_t y_stride[kMaxGemvJobs];
  MatmulAct act[kMaxGemvJobs];
  int warps_per_group[kMaxGemvJobs];
  int block_end[kMaxGemvJobs];  // cumulative block counts
  int n;
};

// This block's job, picked by static indices (a dynamic index into the parameter arrays would
// copy them to local memory), and the block's index within it.
struct GemvJob {
  DeviceWeight w;
  float* y;
  int64_t y_stride;
  MatmulAct act;
  int warps_per_group, block;
  __device__ __forceinline__ explicit GemvJob(const GemvJobs& jobs) {
    int job = 0;
#pragma unroll
    for (int i = 0; i + 1 < kMaxGemvJobs; ++i) job += i + 1 < jobs.n && int(blockIdx.x) >= jobs.block_end[i];
    w = jobs.w[0];
    y = jobs.y[0];
    y_stride = jobs.y_stride[0];
    act = jobs.act[0];
    warps_per_group = jobs.warps_per_group[0];
    block = int(blockIdx.x);
#pragma unroll
    for (int i = 1; i < kMaxGemvJobs; ++i) {
      if (job == i) {
        w = jobs.w[i];
        y = jobs.y[i];
        y_stride = jobs.y_stride[i];
        act = jobs.act[i];
        warps_per_group = jobs.warps_per_group[i];
        block = int(blockIdx.x) - jobs.block_end[i - 1];
      }
    }
  }
};

// kQ8: the dp4a variant (q8.cuh): the block first quantizes its activation rows to int8 in
// shared memory, then reads them as codes and the weights as integer codes (one job only).
template <class F, int kMaxRows, int kOut, bool kQ8>
__global__ void __launch_bounds__(kGemvThreads)
    gemv_kernel(GemvJobs jobs, const float* __restrict__ x, int64_t x_stride, int n_rows, int64_t prefetch_bytes) {
  const GemvJob job(jobs);
  const DeviceWeight& w = job.w;
  float* __restrict__ y = job.y;
  const int64_t y_stride = job.y_stride;
  const int warps_per_group = job.warps_per_group, block = job.block;
  // The block's weight rows (up to prefetch_bytes of them) into L2 while the previous kernel drains.
  if (prefetch_bytes > 0 && threadIdx.x == 0 && w.row_bytes > 0) {
    const int64_t block_rows = int64_t(kGemvThreads / (warps_per_group * kWarp)) * kOut;
    prefetch_weight_rows(w, int64_t(block) * block_rows, min(block_rows, prefetch_bytes / w.row_bytes));
  }
  pdl_begin();
  [[maybe_unused]] SmemQ8 xq{};
  if constexpr (kQ8) {
    extern __shared__ int4 q8_smem[];
    xq = quantize_q8_rows(x, x_stride, n_rows, w.cols, q8_smem);
  }
  const GemvPlace<kOut> at(w, warps_per_group, block);
  const int t = at.t, group_threads = at.group_threads;
  const int64_t o0 = at.o0;
  const WeightRow* wr = at.wr;
  float acc[kMaxRows][kOut] = {};
  const int64_t n_units = kBlock32<F> ? w.cols / 32 : w.cols / kUnit;
  if (o0 < w.rows) {
#pragma unroll 2
    for (int64_t u = t; u < n_units; u += group_threads) {
      if constexpr (kQ8) {
        int32_t c0[kOut], c1[kOut];
        float a[kOut], b[kOut];
#pragma unroll
        for (int j = 0; j < kOut; ++j) F::unit_q8(wr[j], u, c0[j], c1[j], a[j], b[j]);
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < n_rows) {
            int32_t x0, x1;
            float dx, sx;
            xq.unit(r, u, x0, x1, dx, sx);
#pragma unroll
            for (int j = 0; j < kOut; ++j) acc[r][j] += q8_unit_dot(c0[j], c1[j], a[j], b[j], x0, x1, dx, sx);
          }
        }
      } else if constexpr (kBlock32<F>) {
        // u counts 32-element blocks here (see run_gemv).
        typename F::Block32 blk[kOut];
#pragma unroll
        for (int j = 0; j < kOut; ++j) blk[j] = F::load32(wr[j], u);
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < n_rows) {
            float xv[32];
            load_x32(x + r * x_stride + u * 32, xv);
#pragma unroll
            for (int j = 0; j < kOut; ++j) acc[r][j] += F::dot32(blk[j], xv);
          }
        }
      } else {
        float wv[kOut][kUnit];
#pragma unroll
        for (int j = 0; j < kOut; ++j) F::unit(wr[j], u, wv[j]);
#pragma unroll
        for (int r = 0; r < kMaxRows; ++r) {
          if (r < n_rows) {
            float xv[kUnit];
            load_x8(x + r * x_stride + u * kUnit, xv);
#pragma unroll
            for (int j = 0; j < kOut; ++j)
#pragma unroll
              for (int i = 0; i < kUnit; ++i) acc[r][j] = fmaf(wv[j][i], xv[i], acc[r][j]);
          }
        }
      }
    }
    if constexpr (F::kTail && !kQ8) {
      for (int64_t i = n_units * kUnit + t; i < w.cols; i += group_threads) {
#pragma unroll
        for (int j = 0; j < kOut; ++j) {
          const float wj = F::elem(wr[j], i);
#pragma unroll
          for (int r = 0; r < kMaxRows; ++r)
            if (r < n_rows) acc[r][j] = fmaf(wj, __ldg(x + r * x_stride + i), acc[r][j]);
        }
      }
    }
  }
  store_gemv<kMaxRows, kOut>(acc, n_rows, w.rows, o0, y, y_stride, job.act, warps_per_group, at.group, t);
}

// Q4_0 (either layout) with int8 activations in whole 32-element blocks (q8.cuh): a warp
// computes kRowsW consecutive output rows, its lanes taking blocks b = lane, lane + 32, ... of
// them. The first kPre blocks of each row are loaded into registers before pdl_begin()
// (weights are never written by a step's kernels), so those loads are in flight while the
// previous kernel drains; then the block quantizes its activation rows into shared memory
// once (BlockQ8x32's values, as the CPU backend does) and the loaded blocks meet them. With a
// 2048- or 4096-wide row every block of it is loaded before the wait.
constexpr int kQ4Warps = kGemvThreads / kWarp;

template <class F, int kMaxRows, int kRowsW>
__global__ void __launch_bounds__(kGemvThreads)
    gemv_q4_dp4a_kernel(GemvJobs jobs, const float* __restrict__ x, int64_t x_stride, int n_rows,
                        int64_t prefetch_bytes) {
  constexpr int kPre = kRowsW == 1 ? 4 : 2;
  const GemvJob job(jobs);
  const DeviceWeight& w = job.w;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t o0 = (int64_t(job.block) * kQ4Warps + warp) * kRowsW;
  const int64_t nb = w.cols / 32;
  WeightRow wr[kRowsW];
#pragma unroll
  for (int j = 0; j < kRowsW; ++j) wr[j] = weight_row(w, o0 + j < w.rows ? o0 + j : w.rows - 1);  // past the end: dropped
  codes32_t<F> c[kPre][kRowsW];
  float d[kPre][kRowsW];
#pragma unroll
  for (int p = 0; p < kPre; ++p)
#pragma unroll
    for (int j = 0; j < kRowsW; ++j) {
      c[p][j] = codes32_t<F>{};
      d[p][j] = 0.f;
      if (lane + 32 * p < nb) F::codes32(wr[j], lane + 32 * p, c[p][j], d[p][j]);
    }
  if (prefetch_bytes > 0 && threadIdx.x == 0 && nb > 32 * kPre) {
    const int64_t block_rows = int64_t(kQ4Warps) * kRowsW;
    prefetch_weight_rows(w, int64_t(job.block) * block_rows, min(block_rows, prefetch_bytes / w.row_bytes));
  }
  pdl_begin();
  extern __shared__ int4 q8_smem[];
  const Q8x32Rows xq = quantize_q8x32_rows(x, x_stride, n_rows, w.cols, q8_smem);
  __syncthreads();
  float acc[kMaxRows][kRowsW] = {};
  auto accumulate = [&](int64_t b, const codes32_t<F> (&cb)[kRowsW], const float (&db)[kRowsW]) {
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < n_rows) {
        int4 lo, hi;
        float2 dsv;
        xq.block(r, b, lo, hi, dsv);
#pragma unroll
        for (int j = 0; j < kRowsW; ++j) acc[r][j] += codes32_dot_q8x32<F>(cb[j], db[j], lo, hi, dsv);
      }
    }
  };
#pragma unroll
  for (int p = 0; p < kPre; ++p)
    if (lane + 32 * p < nb) accumulate(lane + 32 * p, c[p], d[p]);
  for (int64_t b = lane + 32 * kPre; b < nb; b += kWarp) {
    codes32_t<F> cb[kRowsW];
    float db[kRowsW];
#pragma unroll
    for (int j = 0; j < kRowsW; ++j) F::codes32(wr[j], b, cb[j], db[j]);
    accumulate(b, cb, db);
  }
#pragma unroll
  for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
    for (int j = 0; j < kRowsW; ++j) acc[r][j] = warp_sum(acc[r][j]);
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r)
#pragma unroll
      for (int j = 0; j < kRowsW; ++j)
        if (r < n_rows && o0 + j < w.rows) job.y[r * job.y_stride + o0 + j] = apply_matmul_act(job.act, acc[r][j]);
  }
}

// Warps per group: 1, or more (split-K inside the block) while the matrix has too few rows
// to give ~16 warps per SM of groups. Aim for ~16 warps per SM before splitting K: each thread
// then keeps >= 4 units in its loop (a split-K group of 8 warps on a 4096-column row left 2
// per thread, and the block's life was load latency plus the shared-memory reduction: 56% of
// peak DRAM on 4096 x 4096 bf16, measured). Split K only while every thread keeps >= 2 units.
// Formats read in 32-element blocks (kBlock32) split while every thread keeps >= 1 block:
// each block is already four units' bytes in one load.
int gemv_warps_per_group(int64_t out_rows, int64_t cols, int k_out, int num_sms, bool block32 = false) {
  const int64_t n_items = block32 ? cols / 32 : cols / kUnit;
  const int64_t min_per_thread = block32 ? 1 : 2;
  const int64_t groups = (out_rows + k_out - 1) / k_out;
  const int64_t target_warps = int64_t(std::max(num_sms, 1)) * 16;
  int warps_per_group = 1;
  while (warps_per_group < kGemvThreads / kWarp && groups * warps_per_group < target_warps &&
         n_items >= int64_t(warps_per_group) * 2 * kWarp * min_per_thread)
    warps_per_group *= 2;
  return warps_per_group;
}

int gemv_out_per_group(int64_t rows) { return rows == 1 ? 4 : 2; }

// What each block may prefetch (gemv_kernel): all its rows while the blocks resident at once
// (up to 2048 threads an SM) ask for at most half the L2 together; 0 with prefetch off. (The
// occupancy API's count of resident blocks instead measured the same: 295.5 / 294.5 tok/s.)
int64_t gemv_prefetch_bytes(int64_t blocks, int num_sms) {
  if (!l2_prefetch_enabled()) return 0;
  const int64_t resident = std::max<int64_t>(std::min<int64_t>(blocks, int64_t(num_sms) * (2048 / kGemvThreads)), 1);
  return device_l2_bytes() / 2 / resident;
}

// The dp4a variant only where each block's quantization of x is spread over a block full of
// one-warp groups (>= 16 output rows): with split-K a block covers 2-4 rows and quantizing x
// costs more than it saves (ncu on the H200, Q4_0: [4096, 2048] 10.3 -> 11.1 us, [512, 2048]
// 5.7 -> 7.9 us, while the [151936, 2048] LM head went 196 -> 158 us).
bool use_q8(bool has_q8, int64_t rows, int64_t out_rows, int64_t cols, int num_sms) {
  return has_q8 && cols % 32 == 0 && q8_smem_bytes(rows, cols) <= kQ8SmemMax &&
         gemv_warps_per_group(out_rows, cols, gemv_out_per_group(rows), num_sms) == 1;
}

// The whole-block dp4a kernel (Q4_0, Q8_0) applies while the activation rows' codes fit a block's
// shared memory (every decode GEMV of the 30B-A3B and 8B shapes at one row).
bool use_q4_dp4a(bool has_codes32, int64_t rows, int64_t cols) {
  return has_codes32 && q4_dp4a_enabled() && cols % 32 == 0 && q8x32_bytes(rows, cols) <= kQ8SmemMax;
}

// Two output rows a warp (each activation block met twice, the block's quantization of x
// spread over twice the rows) where that still leaves ~2 blocks an SM; else one, so a
// 2048-row matrix still spreads over every SM.
int q4_rows_per_warp(int64_t out_rows, int num_sms) {
  return out_rows >= int64_t(std::max(num_sms, 1)) * kQ4Warps * 2 * 2 ? 2 : 1;
}

template <class F, int kMaxRows>
void run_q4_dp4a(std::span<const WeightView* const> ws, const float* x, int64_t x_stride, std::span<const Mat> ys,
                 std::span<const MatmulAct> acts, int num_sms, cudaStream_t stream) {
  int64_t total_rows = 0;
  for (const WeightView* w : ws) total_rows += w->rows;
  const int rows_per_warp = q4_rows_per_warp(total_rows, num_sms);
  GemvJobs jobs{};
  for (size_t i = 0; i < ws.size(); ++i) {
    const int64_t per_block = int64_t(kQ4Warps) * rows_per_warp;
    const int64_t blocks = (ws[i]->rows + per_block - 1) / per_block;
    const int prev = jobs.n ? jobs.block_end[jobs.n - 1] : 0;
    TS_CHECK(prev + blocks < (int64_t(1) << 31), "gemv: {} blocks", prev + blocks);
    jobs.w[jobs.n] = device_weight(*ws[i]);
    jobs.y[jobs.n] = ys[i].data;
    jobs.y_stride[jobs.n] = ys[i].stride;
    if (i < acts.size()) jobs.act[jobs.n] = acts[i];
    jobs.warps_per_group[jobs.n] = 1;
    jobs.block_end[jobs.n] = int(prev + blocks);
    ++jobs.n;
  }
  const int blocks = jobs.block_end[jobs.n - 1];
  const int64_t rows = ys[0].rows, cols = ws[0]->cols;
  const size_t smem = size_t(q8x32_bytes(rows, cols));
  const int64_t prefetch = gemv_prefetch_bytes(blocks, num_sms);
  if (rows_per_warp == 2) {
    launch(gemv_q4_dp4a_kernel<F, kMaxRows, 2>, dim3(unsigned(blocks)), kGemvThreads, smem, stream, jobs, x, x_stride,
           int(rows), prefetch);
  } else {
    launch(gemv_q4_dp4a_kernel<F, kMaxRows, 1>, dim3(unsigned(blocks)), kGemvThreads, smem, stream, jobs, x, x_stride,
           int(rows), prefetch);
  }
  TS_CUDA_LAUNCH_CHECK("gemv {} (int8 activations, whole blocks) x {} jobs [{}, {}] ... x {} rows ({} blocks, {} "
                       "rows/warp)",
                       dtype_name(ws[0]->dtype), jobs.n, ws[0]->rows, cols, rows, blocks, rows_per_warp);
}

// One job's launch geometry.
template <class F, int kOut>
void add_gemv_job(GemvJobs& jobs, const WeightView& w, const Mat& y, const MatmulAct& act, int num_sms) {
  const int64_t groups = (w.rows + kOut - 1) / kOut;
  const int warps_per_group = gemv_warps_per_group(w.rows, w.cols, kOut, num_sms, kBlock32<F>);
  const int groups_per_block = kGemvThreads / (warps_per_group * kWarp);
  const int64_t blocks = (groups + groups_per_block - 1) / groups_per_block;
  const int prev = jobs.n ? jobs.block_end[jobs.n - 1] : 0;
  TS_CHECK(jobs.n < kMaxGemvJobs && prev + blocks < (int64_t(1) << 31), "gemv: {} jobs, {} blocks", jobs.n + 1,
           prev + blocks);
  jobs.w[jobs.n] = device_weight(w);
  jobs.y[jobs.n] = y.data;
  jobs.y_stride[jobs.n] = y.stride;
  jobs.act[jobs.n] = act;
  jobs.warps_per_group[jobs.n] = warps_per_group;
  jobs.block_end[jobs.n] = int(prev + blocks);
  ++jobs.n;
}

template <class F, int kMaxRows, int kOut>
void run_gemv(const WeightView& w, const float* x, int64_t x_stride, const Mat& y, int num_sms,
              cudaStream_t stream) {
  if constexpr (kHasGemvCodes32<F>) {
    if (use_q4_dp4a(true, y.rows, w.cols)) {
      const WeightView* one[] = {&w};
      run_q4_dp4a<F, kMaxRows>(one, x, x_stride, std::span<const Mat>(&y, 1), {}, num_sms, stream);
      return;
    }
  }
  GemvJobs jobs{};
  add_gemv_job<F, kOut>(jobs, w, y, MatmulAct{}, num_sms);
  const int64_t blocks = jobs.block_end[0];
  const int warps_per_group = jobs.warps_per_group[0];
  const bool q8 = use_q8(kHasQ8<F>, y.rows, w.rows, w.cols, num_sms);
  if constexpr (kHasQ8<F>) {
    if (q8) {
      launch(gemv_kernel<F, kMaxRows, kOut, true>, dim3(unsigned(blocks)), kGemvThreads,
             size_t(q8_smem_bytes(y.rows, w.cols)), stream, jobs, x, x_stride, int(y.rows),
             gemv_prefetch_bytes(blocks, num_sms));
    }
  }
  if (!q8) {
    launch(gemv_kernel<F, kMaxRows, kOut, false>, dim3(unsigned(blocks)), kGemvThreads, 0, stream, jobs, x, x_stride,
           int(y.rows), gemv_prefetch_bytes(blocks, num_sms));
  }
  TS_CUDA_LAUNCH_CHECK("gemv {}{} [{}, {}] x {} rows ({} blocks, {} warps/group)", dtype_name(w.dtype),
                       q8 ? " (int8 activations)" : "", w.rows, w.cols, y.rows, blocks, warps_per_group);
}

template <class F, int kMaxRows, int kOut>
void run_gemv_jobs(std::span<const WeightView* const> ws, const float* x, int64_t x_stride, std::span<const Mat> ys,
                   std::span<const MatmulAct> acts, int num_sms, cudaStream_t stream) {
  if constexpr (kHasGemvCodes32<F>) {
    if (use_q4_dp4a(true, ys[0].rows, ws[0]->cols)) {
      run_q4_dp4a<F, kMaxRows>(ws, x, x_stride, ys, acts, num_sms, stream);
      return;
    }
  }
  GemvJobs jobs{};
  for (size_t i = 0; i < ws.size(); ++i)
    add_gemv_job<F, kOut>(jobs, *ws[i], ys[i], i < acts.size() ? acts[i] : MatmulAct{}, num_sms);
  launch(gemv_kernel<F, kMaxRows, kOut, false>, dim3(unsigned(jobs.block_end[jobs.n - 1])), kGemvThreads, 0, stream,
         jobs, x, x_stride, int(ys[0].rows),
         gemv_prefetch_bytes(jobs.block_end[jobs.n - 1], num_sms));
  TS_CUDA_LAUNCH_CHECK("gemv {} x {} jobs [{}, {}] ... x {} rows ({} blocks)", dtype_name(ws[0]->dtype), jobs.n,
                       ws[0]->rows, ws[0]->cols, ys[0].rows, jobs.block_end[jobs.n - 1]);
}

}  // namespace

bool gemv_int8_activations(const WeightView& w, int64_t rows, int num_sms) {
  const DType dtype = w.dtype;
  const int64_t out_rows = w.rows, cols = w.cols;
  if (rows < 1 || rows > kGemvMaxRows) return false;
  static_assert(kHasGemvCodes32<FmtQ4_0> && kHasGemvCodes32<FmtQ4_0Planes> && kHasGemvCodes32<FmtQ8_0> &&
                !kHasGemvCodes32<FmtQ4_1> && !kHasGemvCodes32<FmtMXFP4>);
  if (use_q4_dp4a(dtype == DType::Q4_0 || dtype == DType::Q8_0, rows, cols)) return true;
  const bool has_q8 = (dtype == DType::Q4_0 && !is_q4_0_planes(w)) || dtype == DType::Q4_1 || dtype == DType::Q5_0 ||
                      dtype == DType::Q5_1 || dtype == DType::Q8_0;
  static_assert(kHasQ8<FmtQ4_0> && kHasQ8<FmtQ4_1> && kHasQ8<FmtQ5_0> && kHasQ8<FmtQ5_1> && kHasQ8<FmtQ8_0> &&
                !kHasQ8<FmtQK45<false>> && !kHasQ8<FmtQ6_K> && !kHasQ8<FmtMXFP4> && !kHasQ8<FmtQ4_0Planes>);
  return use_q8(has_q8, rows, out_rows, cols, num_sms);
}

int max_gemv_jobs() { return kMaxGemvJobs; }

bool launch_gemv_shared_input(std::span<const WeightView* const> ws, const float* x, int64_t x_stride,
                              std::span<const Mat> ys, std::span<const MatmulAct> acts, int num_sms,
                              cudaStream_t stream) {
  if (ws.empty() || ws.size() > size_t(kMaxGemvJobs) || ws.size() != ys.size()) return false;
  TS_CHECK(acts.empty() || acts.size() == ws.size(), "gemv: {} activations for {} weights", acts.size(), ws.size());
  const int64_t rows = ys[0].rows;
  if (rows < 1 || rows > kGemvMaxRows) return false;
  TS_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0 && x_stride % 4 == 0 && x_stride >= ws[0]->cols,
           "gemv: activation rows must be 16-byte aligned (x {}, stride {} floats for {} cols)",
           static_cast<const void*>(x), x_stride, ws[0]->cols);
  for (size_t i = 0; i < ws.size(); ++i) {
    const WeightView& w = *ws[i];
    TS_CHECK(ys[i].cols == w.rows && ys[i].rows == rows && w.cols == ws[0]->cols,
             "gemv: job {}: {} weight [{}, {}] with output [{}, {}]", i, dtype_name(w.dtype), w.rows, w.cols,
             ys[i].rows, ys[i].cols);
    // One format for all (ggml Q4_0 and its planes are two), none empty, none on the per-block
    // int8 path (the Q4_0 whole-block dp4a kernel takes jobs: it applies to all or none).
    if (w.dtype != ws[0]->dtype || is_q4_0_planes(w) != is_q4_0_planes(*ws[0]) || w.rows == 0 ||
        (gemv_int8_activations(w, rows, num_sms) &&
         !use_q4_dp4a(w.dtype == DType::Q4_0 || w.dtype == DType::Q8_0, rows, w.cols)))
      return false;
  }
  bool done = false;
  dispatch_weight_format(*ws[0], "gemv", [&](auto fmt) {
    using F = decltype(fmt);
    for (const WeightView* w : ws)
      if (!aligned_for<F>(*w)) return;  // float formats: the first view's load width must suit every view
    if (rows == 1) run_gemv_jobs<F, 1, 4>(ws, x, x_stride, ys, acts, num_sms, stream);
    else run_gemv_jobs<F, kGemvMaxRows, 2>(ws, x, x_stride, ys, acts, num_sms, stream);
    done = true;
  });
  return done;
}

void launch_gemv(const WeightView& w, const float* x, int64_t x_stride, const Mat& y, int num_sms,
                 cudaStream_t stream) {
  TS_CHECK(y.cols == w.rows && y.rows >= 0 && y.rows <= kGemvMaxRows,
           "gemv: {} weight [{}, {}] with output [{}, {}] (at most {} rows)", dtype_name(w.dtype), w.rows, w.cols,
           y.rows, y.cols, kGemvMaxRows);
  TS_CHECK(reinterpret_cast<uintptr_t>(x) % 16 == 0 && x_stride % 4 == 0 && x_stride >= w.cols,
           "gemv: activation rows must be 16-byte aligned (x {}, stride {} floats for {} cols)",
           static_cast<const void*>(x), x_stride, w.cols);
  dispatch_weight_format(w, "gemv", [&](auto fmt) {
    using F = decltype(fmt);
    if (y.rows == 0 || w.rows == 0) return;
    // One row: 4 output rows per group reuse each activation chunk 4x. 2..8 rows: the rows
    // already reuse each weight unit, 2 outputs per group keep the accumulators at 16.
    if (y.rows == 1) run_gemv<F, 1, 4>(w, x, x_stride, y, num_sms, stream);
    else run_gemv<F, kGemvMaxRows, 2>(w, x, x_stride, y, num_sms, stream);
  });
}

}  // namespace turbospark::cuda
