// GatedDeltaNet's recurrence (Backend::gated_delta_rule), the recurrent form: rows in order,
// the state S [dk, dv] per value head in f32. Per row t and value head h (key head h / group):
//   q, k  = l2norm(q_t), l2norm(k_t) (eps 1e-6 inside the sqrt), q scaled by 1/sqrt(dk)
//   decay = exp(-exp(a_log[h]) * softplus(a_t[h] + dt_bias[h])), beta = sigmoid(b_t[h])
//   S    *= decay;  delta = (v_t - S^T k) * beta;  S += k delta^T;  o_t = S^T q
// Math as backends/cpu/hybrid_ops.cpp, in the same order per column (decay applied before the
// column's k-product is summed; precise expf/log1pf).
//
// Layout: a column j of S evolves on its own given the row's q, k, decay and beta, so each
// column lives in registers for the whole micro-batch: kParts adjacent lanes own it, each the
// rows i = part, part + kParts, ... (kPer of them), and reduce S^T k and S^T q through two
// shuffles. A block of 128 threads owns 32 columns of one head; the row's normalized q and k
// are staged in shared memory by the whole block (every block of the same key head repeats
// that small load). Grid: (ceil(dv / 32), n_v_heads). State read once and written once per
// call: at decode the kernel is bound by those 2 x dk x dv x 4 bytes per head.
//
// Prefill walks the rows one by one (three block barriers per row): correct at any chunk size
// but serial in the rows; the chunked (WY) form for long prompts is still to come.
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace turbospark::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kParts = 4;                       // lanes per state column
constexpr int kColumns = kThreads / kParts;     // columns per block
constexpr int kMaxDk = 256;

template <int kPer>
__global__ void __launch_bounds__(kThreads)
    gated_delta_kernel(const float* __restrict__ qkv, int64_t qkv_stride, const float* __restrict__ a, int64_t a_stride,
                       const float* __restrict__ b, int64_t b_stride, const float* __restrict__ a_log,
                       const float* __restrict__ dt_bias, int group, int dk, int dv, int64_t key_dim, float* state,
                       int64_t state_stride, float* out, int64_t out_stride, int64_t rows) {
  __shared__ float q_s[kMaxDk], k_s[kMaxDk];
  __shared__ float red[kWarp];
  const int h = blockIdx.y, kh = h / group;
  const int part = threadIdx.x % kParts;
  const int col = blockIdx.x * kColumns + threadIdx.x / kParts;
  const bool live = col < dv;
  float* S = state + int64_t(h) * state_stride;

  float s[kPer];
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = part + u * kParts;
    s[u] = live && i < dk ? S[int64_t(i) * dv + col] : 0.f;
  }
  const float A = -expf(a_log[h]);
  const float dt = dt_bias[h];
  const float q_scale = 1.f / sqrtf(float(dk));

  for (int64_t t = 0; t < rows; ++t) {
    const float* row = qkv + t * qkv_stride;
    float qn = 0.f, kn = 0.f;
    __syncthreads();  // the previous row's q_s / k_s are consumed
    for (int i = threadIdx.x; i < dk; i += kThreads) {
      const float qv = row[int64_t(kh) * dk + i], kv = row[key_dim + int64_t(kh) * dk + i];
      q_s[i] = qv;
      k_s[i] = kv;
      qn += qv * qv;
      kn += kv * kv;
    }
    qn = block_sum(qn, red);  // its barriers also publish q_s / k_s
    kn = block_sum(kn, red);
    const float qinv = 1.f / sqrtf(qn + 1e-6f) * q_scale, kinv = 1.f / sqrtf(kn + 1e-6f);
    const float x = a[t * a_stride + h] + dt;
    const float softplus = x > 20.f ? x : log1pf(expf(x));
    const float decay = expf(A * softplus);
    const float beta = 1.f / (1.f + expf(-b[t * b_stride + h]));

    float kv_mem = 0.f;
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = part + u * kParts;
      s[u] *= decay;
      if (i < dk) kv_mem += s[u] * (k_s[i] * kinv);
    }
#pragma unroll
    for (int o = 1; o < kParts; o <<= 1) kv_mem += __shfl_xor_sync(0xffffffffu, kv_mem, o);
    const float v = live ? row[2 * key_dim + int64_t(h) * dv + col] : 0.f;
    const float delta = (v - kv_mem) * beta;
    float o_acc = 0.f;
#pragma unroll
    for (int u = 0; u < kPer; ++u) {
      const int i = part + u * kParts;
      if (i < dk) {
        s[u] += (k_s[i] * kinv) * delta;
        o_acc += s[u] * (q_s[i] * qinv);
      }
    }
#pragma unroll
    for (int o = 1; o < kParts; o <<= 1) o_acc += __shfl_xor_sync(0xffffffffu, o_acc, o);
    if (live && part == 0) out[t * out_stride + int64_t(h) * dv + col] = o_acc;
  }
#pragma unroll
  for (int u = 0; u < kPer; ++u) {
    const int i = part + u * kParts;
    if (live && i < dk) S[int64_t(i) * dv + col] = s[u];
  }
}

}  // namespace

void gated_delta_rule(const Mat& qkv, const Mat& a, const Mat& b, const float* a_log, const float* dt_bias,
                      int n_k_heads, int n_v_heads, int dk, int dv, const Mat& state, const Mat& out,
                      cudaStream_t stream) {
  TS_CHECK(n_k_heads >= 1 && n_v_heads % n_k_heads == 0, "gated_delta_rule: {} value heads over {} key heads",
           n_v_heads, n_k_heads);
  TS_CHECK(dk >= 1 && dk <= kMaxDk && dv >= 1, "gated_delta_rule: key head dim {} (1..{}), value head dim {}", dk,
           kMaxDk, dv);
  const int64_t key_dim = int64_t(n_k_heads) * dk;
  TS_CHECK(qkv.cols >= 2 * key_dim + int64_t(n_v_heads) * dv && a.cols >= n_v_heads && b.cols >= n_v_heads &&
               a.rows >= qkv.rows && b.rows >= qkv.rows,
           "gated_delta_rule: qkv [{}, {}], a [{}, {}], b [{}, {}] for {} key heads of {} and {} value heads of {}",
           qkv.rows, qkv.cols, a.rows, a.cols, b.rows, b.cols, n_k_heads, dk, n_v_heads, dv);
  TS_CHECK(state.rows == n_v_heads && state.cols == int64_t(dk) * dv, "gated_delta_rule: state [{}, {}], expected [{}, {}]",
           state.rows, state.cols, n_v_heads, int64_t(dk) * dv);
  TS_CHECK(out.rows >= qkv.rows && out.cols >= int64_t(n_v_heads) * dv, "gated_delta_rule: out [{}, {}]", out.rows,
           out.cols);
  if (qkv.rows == 0) return;
  const dim3 grid(unsigned(ceil_div(dv, kColumns)), unsigned(n_v_heads));
  const int group = n_v_heads / n_k_heads;
  auto run = [&](auto kernel) {
    kernel<<<grid, kThreads, 0, stream>>>(qkv.data, qkv.stride, a.data, a.stride, b.data, b.stride, a_log, dt_bias,
                                          group, dk, dv, key_dim, state.data, state.stride, out.data, out.stride,
                                          qkv.rows);
  };
  // Registers per thread: kPer state values. The smallest instance that holds dk.
  const int per = ceil_div(dk, kParts);
  if (per <= 2) {
    run(gated_delta_kernel<2>);
  } else if (per <= 8) {
    run(gated_delta_kernel<8>);
  } else if (per <= 32) {
    run(gated_delta_kernel<32>);
  } else {
    run(gated_delta_kernel<64>);
  }
  TS_CUDA_LAUNCH_CHECK("gated_delta_rule rows {} heads {}/{} dk {} dv {}", qkv.rows, n_k_heads, n_v_heads, dk, dv);
}

}  // namespace turbospark::cuda
