// Hyper-connection stream ops (Backend::hc_mix, hc_inject) and the n-gram PLE gate
// (Backend::ple_gate): the small per-stream reductions Qwen4-Exp runs around every mixer and
// FFN. Rows hold C streams of `hidden` side by side. Math as backends/cpu/hybrid_ops.cpp
// (streams summed in order, then divided by C; the gate's dot product summed, then scaled).
//
// Bound: memory, each element read once or twice and written once; these are a few percent of
// a layer's bytes next to its weights. Layout: hc_mix and hc_inject a 2-D grid, x over a row's
// columns (a thread per column, coalesced), y over rows; ple_gate a block per (row, stream)
// reducing the key/query dot product, then writing that stream's gated value.
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace turbospark::cuda {
namespace {

constexpr int kThreads = 256;

// mixed[t, i] = (sum_c weight[t, c*H + i] * normed[t, c*H + i]) / C
__global__ void __launch_bounds__(kThreads)
    hc_mix_kernel(const float* __restrict__ weight, int64_t w_stride, const float* __restrict__ normed,
                  int64_t n_stride, int n_streams, float* mixed, int64_t m_stride, int hidden) {
  pdl_begin();
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= hidden) return;
  const int64_t t = blockIdx.y;
  float acc = 0.f;
  for (int c = 0; c < n_streams; ++c) {
    acc += weight[t * w_stride + int64_t(c) * hidden + i] * normed[t * n_stride + int64_t(c) * hidden + i];
  }
  mixed[t * m_stride + i] = acc / float(n_streams);
}

// streams[t, c*H + i] += branch[t, i] * inject[t, c]
__global__ void __launch_bounds__(kThreads)
    hc_inject_kernel(float* streams, int64_t s_stride, const float* __restrict__ branch, int64_t b_stride,
                     const float* __restrict__ inject, int64_t i_stride, int n_streams, int hidden) {
  pdl_begin();
  const int64_t col = int64_t(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= int64_t(n_streams) * hidden) return;
  const int64_t t = blockIdx.y;
  const int c = int(col / hidden), i = int(col % hidden);
  streams[t * s_stride + col] += branch[t * b_stride + i] * inject[t * i_stride + c];
}

// s = shared[t, i] * sigmoid(gate[t]); b = branch[t, i] + s; streams[t, c*H + i] += b * inject[t, c]
// for every c; shared and branch keep s and b (Backend::hc_inject_gated: mul_act, add and
// hc_inject in that order, each product and sum rounded as those kernels round it). A thread
// owns column i of a row, so nothing it reads is written by another thread.
__global__ void __launch_bounds__(kThreads)
    hc_inject_gated_kernel(float* streams, int64_t s_stride, float* branch, int64_t b_stride, float* shared,
                           int64_t sh_stride, const float* __restrict__ gate, int64_t g_stride,
                           const float* __restrict__ inject, int64_t i_stride, int n_streams, int hidden) {
  pdl_begin();
  const int i = blockIdx.x * kThreads + threadIdx.x;
  if (i >= hidden) return;
  const int64_t t = blockIdx.y;
  const float g = gate[t * g_stride];
  const float sh = __fmul_rn(shared[t * sh_stride + i], 1.f / (1.f + expf(-g)));
  const float b = __fadd_rn(branch[t * b_stride + i], sh);
  shared[t * sh_stride + i] = sh;
  branch[t * b_stride + i] = b;
  for (int c = 0; c < n_streams; ++c) streams[t * s_stride + int64_t(c) * hidden + i] += b * inject[t * i_stride + c];
}

// g = dot(key_c, query_c) / sqrt(H); s = sign(g) sqrt(max(|g|, 1e-6)); out_c = sigmoid(s) value
__global__ void __launch_bounds__(kThreads)
    ple_gate_kernel(const float* __restrict__ key, int64_t k_stride, const float* __restrict__ query,
                    int64_t q_stride, const float* __restrict__ value, int64_t v_stride, float* out,
                    int64_t o_stride, int hidden) {
  pdl_begin();
  __shared__ float red[kWarp];
  const int64_t t = blockIdx.x;
  const int c = blockIdx.y;
  const float* k = key + t * k_stride + int64_t(c) * hidden;
  const float* q = query + t * q_stride + int64_t(c) * hidden;
  float g = 0.f;
  for (int i = threadIdx.x; i < hidden; i += kThreads) g += k[i] * q[i];
  g = block_sum(g, red) * (1.f / sqrtf(float(hidden)));
  const float sign = g > 0.f ? 1.f : (g < 0.f ? -1.f : 0.f);
  const float mag = fabsf(g) < 1e-6f ? 1e-6f : fabsf(g);  // std::max(|g|, 1e-6f): a NaN stays NaN, as on the CPU
  const float s = sqrtf(mag) * sign;
  const float sig = 1.f / (1.f + expf(-s));
  const float* v = value + t * v_stride;
  float* o = out + t * o_stride + int64_t(c) * hidden;
  for (int i = threadIdx.x; i < hidden; i += kThreads) o[i] = sig * v[i];
}

void check_rows(const char* op, int64_t rows) { TS_CHECK(rows <= 65535, "{}: {} rows in one call (at most 65535)", op, rows); }

}  // namespace

void hc_mix(const Mat& weight, const Mat& normed, int n_streams, const Mat& mixed, cudaStream_t stream) {
  const int64_t H = mixed.cols;
  TS_CHECK(n_streams >= 1 && weight.cols >= n_streams * H && normed.cols >= n_streams * H &&
               weight.rows >= mixed.rows && normed.rows >= mixed.rows,
           "hc_mix: weight [{}, {}], normed [{}, {}], mixed [{}, {}], {} streams", weight.rows, weight.cols,
           normed.rows, normed.cols, mixed.rows, H, n_streams);
  check_rows("hc_mix", mixed.rows);
  if (mixed.rows == 0 || H == 0) return;
  launch(hc_mix_kernel, dim3(unsigned(ceil_div(H, kThreads)), unsigned(mixed.rows)), kThreads, 0, stream, weight.data,
         weight.stride, normed.data, normed.stride, n_streams, mixed.data, mixed.stride, int(H));
  TS_CUDA_LAUNCH_CHECK("hc_mix [{}, {}] streams {}", mixed.rows, H, n_streams);
}

void hc_inject(const Mat& streams, const Mat& branch, const Mat& inject, int n_streams, cudaStream_t stream) {
  const int64_t H = branch.cols;
  TS_CHECK(n_streams >= 1 && streams.cols >= n_streams * H && inject.cols >= n_streams && branch.rows >= streams.rows &&
               inject.rows >= streams.rows,
           "hc_inject: streams [{}, {}], branch [{}, {}], inject [{}, {}], {} streams", streams.rows, streams.cols,
           branch.rows, H, inject.rows, inject.cols, n_streams);
  check_rows("hc_inject", streams.rows);
  if (streams.rows == 0 || H == 0) return;
  launch(hc_inject_kernel, dim3(unsigned(ceil_div(n_streams * H, kThreads)), unsigned(streams.rows)), kThreads, 0,
         stream, streams.data, streams.stride, branch.data, branch.stride, inject.data, inject.stride, n_streams,
         int(H));
  TS_CUDA_LAUNCH_CHECK("hc_inject [{}, {}] streams {}", streams.rows, H, n_streams);
}

void hc_inject_gated(const Mat& streams, const Mat& branch, const Mat& shared, const Mat& shared_gate,
                     const Mat& inject, int n_streams, cudaStream_t stream) {
  const int64_t H = branch.cols;
  TS_CHECK(n_streams >= 1 && streams.cols >= n_streams * H && inject.cols >= n_streams && shared.cols == H &&
               shared_gate.cols == 1 && branch.rows >= streams.rows && inject.rows >= streams.rows &&
               shared.rows >= streams.rows && shared_gate.rows >= streams.rows,
           "hc_inject_gated: streams [{}, {}], branch [{}, {}], shared [{}, {}], gate [{}, {}], inject [{}, {}], {} "
           "streams",
           streams.rows, streams.cols, branch.rows, H, shared.rows, shared.cols, shared_gate.rows, shared_gate.cols,
           inject.rows, inject.cols, n_streams);
  check_rows("hc_inject_gated", streams.rows);
  if (streams.rows == 0 || H == 0) return;
  launch(hc_inject_gated_kernel, dim3(unsigned(ceil_div(H, kThreads)), unsigned(streams.rows)), kThreads, 0, stream,
         streams.data, streams.stride, branch.data, branch.stride, shared.data, shared.stride, shared_gate.data,
         shared_gate.stride, inject.data, inject.stride, n_streams, int(H));
  TS_CUDA_LAUNCH_CHECK("hc_inject_gated [{}, {}] streams {}", streams.rows, H, n_streams);
}

void ple_gate(const Mat& key, const Mat& query, const Mat& value, int n_streams, const Mat& out, cudaStream_t stream) {
  const int64_t H = value.cols;
  TS_CHECK(n_streams >= 1 && key.cols >= n_streams * H && query.cols >= n_streams * H && out.cols >= n_streams * H &&
               key.rows >= value.rows && query.rows >= value.rows && out.rows >= value.rows,
           "ple_gate: key [{}, {}], query [{}, {}], value [{}, {}], out [{}, {}], {} streams", key.rows, key.cols,
           query.rows, query.cols, value.rows, H, out.rows, out.cols, n_streams);
  // A stream's block writes out while the other streams' blocks still read value.
  TS_CHECK(out.data != value.data, "ple_gate: out may not alias value on CUDA");
  TS_CHECK(value.rows <= 0x7fffffff && n_streams <= 65535, "ple_gate: {} rows, {} streams", value.rows, n_streams);
  if (value.rows == 0 || H == 0) return;
  launch(ple_gate_kernel, dim3(unsigned(value.rows), unsigned(n_streams)), kThreads, 0, stream, key.data, key.stride,
         query.data, query.stride, value.data, value.stride, out.data, out.stride, int(H));
  TS_CUDA_LAUNCH_CHECK("ple_gate [{}, {}] streams {}", value.rows, H, n_streams);
}

}  // namespace turbospark::cuda
