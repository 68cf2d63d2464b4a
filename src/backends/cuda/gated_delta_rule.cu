// GatedDeltaNet's recurrence (Backend::gated_delta_rule), the recurrent form: rows in order,
// the state S [dk, dv] per value head in f32. Per row t and value head h (key head h / group,
// or h % n_k_heads for value heads in llama.cpp's tiled order):
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
// Prefill takes the chunked form (gated_delta_chunk_kernel below) from kChunkedMinRows rows:
// the rows of a chunk are solved at once from the state at its start, following
// cpu::gated_delta_rule_chunked (backends/cpu/hybrid_ops.h has the formulas), so the rows
// are serial only across chunks.
#include <cstdlib>
#include <string_view>

#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace turbospark::cuda {
namespace {

// The key head value head h reads: h / group (grouped, transformers' order), h % tiled when
// tiled > 0 (llama.cpp's GGUF order).
struct KeyHeads {
  int group = 1, tiled = 0;
  __device__ int of(int h) const { return tiled > 0 ? h % tiled : h / group; }
};

constexpr int kThreads = 128;
constexpr int kParts = 4;                       // lanes per state column
constexpr int kColumns = kThreads / kParts;     // columns per block
constexpr int kMaxDk = 256;

template <int kPer>
__global__ void __launch_bounds__(kThreads)
    gated_delta_kernel(const float* __restrict__ qkv, int64_t qkv_stride, const float* __restrict__ a, int64_t a_stride,
                       const float* __restrict__ b, int64_t b_stride, const float* __restrict__ a_log,
                       const float* __restrict__ dt_bias, KeyHeads heads, int dk, int dv, int64_t key_dim, float* state,
                       int64_t state_stride, float* out, int64_t out_stride, int64_t rows) {
  pdl_begin();
  __shared__ float q_s[kMaxDk], k_s[kMaxDk];
  __shared__ float red[kWarp];
  const int h = blockIdx.y, kh = heads.of(h);
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

// ---- the chunked form ----
// A block owns value head h and a tile of kTileV state columns, the state tile in shared memory
// for the whole call. Per chunk of C rows, in shared memory: q, k (normalized; rows padded to
// dk + 1 floats so that the pair products below do not all hit one bank), the cumulative log
// decays and their exponentials, beta, the [C, C] products beta_t e^{cum_t - cum_s} k_t.k_s and
// e^{cum_t - cum_s} q_t.k_s, and u [C, kTileV]. Phases, separated by barriers:
//   1. a warp per row: norms, q and k, beta and the log decay; then one thread's running sum;
//   2. a thread per (t, s) pair: the two products; and a thread per (t, column): u's right side
//      beta_t (v_t - e^{cum_t} S0^T k_t);
//   3. a thread per column: the triangular solve down the chunk;
//   4. a thread per (t, column): o_t = e^{cum_t} S0^T q_t + sum_{s<=t} (q_t.k_s term) u_s;
//   5. a thread per state element: S = e^{cum_last} S0 + sum_s e^{cum_last - cum_s} k_s u_s.
// Work per chunk and head ~ 3 C dk dv + C^2 (dk + dv) multiply-adds on CUDA cores (tensor cores
// are the next step); the grid, (ceil(dv / kTileV), n_v_heads), is small at prefill (64 blocks
// for 32 heads of 128), so each block keeps 256 threads busy.
constexpr int kTileV = 64;
constexpr int kChunkThreads = 256;

struct ChunkSmem {
  int dk, chunk;
  __host__ __device__ int ks() const { return dk + 1; }
  // Offsets in floats.
  __host__ __device__ int64_t s() const { return 0; }
  __host__ __device__ int64_t q() const { return s() + int64_t(dk) * kTileV; }
  __host__ __device__ int64_t k() const { return q() + int64_t(chunk) * ks(); }
  __host__ __device__ int64_t u() const { return k() + int64_t(chunk) * ks(); }
  __host__ __device__ int64_t kk() const { return u() + int64_t(chunk) * kTileV; }
  __host__ __device__ int64_t qk() const { return kk() + int64_t(chunk) * chunk; }
  __host__ __device__ int64_t cum() const { return qk() + int64_t(chunk) * chunk; }
  __host__ __device__ int64_t gcum() const { return cum() + chunk; }
  __host__ __device__ int64_t tail() const { return gcum() + chunk; }
  __host__ __device__ int64_t beta() const { return tail() + chunk; }
  __host__ __device__ int64_t floats() const { return beta() + chunk; }
  __host__ __device__ size_t bytes() const { return size_t(floats()) * 4; }
};

__global__ void __launch_bounds__(kChunkThreads)
    gated_delta_chunk_kernel(const float* __restrict__ qkv, int64_t qkv_stride, const float* __restrict__ a,
                             int64_t a_stride, const float* __restrict__ b, int64_t b_stride,
                             const float* __restrict__ a_log, const float* __restrict__ dt_bias, KeyHeads heads, int dk,
                             int dv, int64_t key_dim, float* state, int64_t state_stride, float* out,
                             int64_t out_stride, int64_t rows, int chunk) {
  pdl_begin();
  extern __shared__ float smem[];
  const ChunkSmem L{dk, chunk};
  const int ks = L.ks();
  float* S_s = smem + L.s();
  float* Q = smem + L.q();
  float* K = smem + L.k();
  float* U = smem + L.u();
  float* KK = smem + L.kk();
  float* QK = smem + L.qk();
  float* cum = smem + L.cum();
  float* gcum = smem + L.gcum();
  float* tail = smem + L.tail();
  float* beta = smem + L.beta();
  const int h = blockIdx.y, kh = heads.of(h), j0 = blockIdx.x * kTileV;
  const int tid = threadIdx.x, lane = tid % kWarp, warp = tid / kWarp, n_warps = kChunkThreads / kWarp;
  float* S = state + int64_t(h) * state_stride;
  for (int idx = tid; idx < dk * kTileV; idx += kChunkThreads) {
    const int i = idx / kTileV, j = j0 + idx % kTileV;
    S_s[idx] = j < dv ? S[int64_t(i) * dv + j] : 0.f;
  }
  const float A = -expf(a_log[h]);
  const float dt = dt_bias[h];
  const float q_scale = 1.f / sqrtf(float(dk));

  for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
    const int n = int(rows - c0 < chunk ? rows - c0 : chunk);
    // 1. Rows: normalized q and k, beta, log decay.
    for (int t = warp; t < n; t += n_warps) {
      const float* row = qkv + (c0 + t) * qkv_stride;
      float qn = 0.f, kn = 0.f;
      for (int i = lane; i < dk; i += kWarp) {
        const float qv = row[int64_t(kh) * dk + i], kv = row[key_dim + int64_t(kh) * dk + i];
        qn += qv * qv;
        kn += kv * kv;
      }
      qn = warp_sum(qn);
      kn = warp_sum(kn);
      const float qinv = 1.f / sqrtf(qn + 1e-6f) * q_scale, kinv = 1.f / sqrtf(kn + 1e-6f);
      for (int i = lane; i < dk; i += kWarp) {
        Q[t * ks + i] = row[int64_t(kh) * dk + i] * qinv;
        K[t * ks + i] = row[key_dim + int64_t(kh) * dk + i] * kinv;
      }
      if (lane == 0) {
        const float x = a[(c0 + t) * a_stride + h] + dt;
        const float softplus = x > 20.f ? x : log1pf(expf(x));
        cum[t] = A * softplus;
        beta[t] = 1.f / (1.f + expf(-b[(c0 + t) * b_stride + h]));
      }
    }
    __syncthreads();
    if (tid == 0) {
      float running = 0.f;
      for (int t = 0; t < n; ++t) {
        running += cum[t];
        cum[t] = running;
      }
    }
    __syncthreads();
    for (int t = tid; t < n; t += kChunkThreads) {
      gcum[t] = expf(cum[t]);
      tail[t] = expf(cum[n - 1] - cum[t]);
    }
    // 2. The pair products, and u's right side.
    for (int p = tid; p < n * n; p += kChunkThreads) {
      const int t = p / n, s = p % n;
      if (s > t) continue;
      float dkk = 0.f, dqk = 0.f;
      for (int i = 0; i < dk; ++i) {
        dkk += K[t * ks + i] * K[s * ks + i];
        dqk += Q[t * ks + i] * K[s * ks + i];
      }
      const float decay = expf(cum[t] - cum[s]);
      KK[t * chunk + s] = beta[t] * decay * dkk;
      QK[t * chunk + s] = decay * dqk;
    }
    __syncthreads();  // gcum for u's right side
    for (int p = tid; p < n * kTileV; p += kChunkThreads) {
      const int t = p / kTileV, jj = p % kTileV, j = j0 + jj;
      float value = 0.f;
      if (j < dv) {
        float sk = 0.f;
        for (int i = 0; i < dk; ++i) sk += S_s[i * kTileV + jj] * K[t * ks + i];
        value = beta[t] * (qkv[(c0 + t) * qkv_stride + 2 * key_dim + int64_t(h) * dv + j] - gcum[t] * sk);
      }
      U[t * kTileV + jj] = value;
    }
    __syncthreads();
    // 3. The triangular solve, a thread per column (columns are independent).
    if (tid < kTileV) {
      for (int t = 1; t < n; ++t) {
        float acc = U[t * kTileV + tid];
        for (int s = 0; s < t; ++s) acc -= KK[t * chunk + s] * U[s * kTileV + tid];
        U[t * kTileV + tid] = acc;
      }
    }
    __syncthreads();
    // 4. Outputs from the chunk's starting state.
    for (int p = tid; p < n * kTileV; p += kChunkThreads) {
      const int t = p / kTileV, jj = p % kTileV, j = j0 + jj;
      if (j >= dv) continue;
      float sq = 0.f;
      for (int i = 0; i < dk; ++i) sq += S_s[i * kTileV + jj] * Q[t * ks + i];
      float acc = gcum[t] * sq;
      for (int s = 0; s <= t; ++s) acc += QK[t * chunk + s] * U[s * kTileV + jj];
      out[(c0 + t) * out_stride + int64_t(h) * dv + j] = acc;
    }
    __syncthreads();  // every output has read S0
    // 5. The state to the chunk's end; each thread rewrites only the elements it reads.
    const float g_last = gcum[n - 1];
    for (int idx = tid; idx < dk * kTileV; idx += kChunkThreads) {
      const int i = idx / kTileV, jj = idx % kTileV;
      float acc = g_last * S_s[idx];
      for (int s = 0; s < n; ++s) acc += tail[s] * K[s * ks + i] * U[s * kTileV + jj];
      S_s[idx] = acc;
    }
    __syncthreads();  // before the next chunk overwrites q, k, u and the products
  }
  for (int idx = tid; idx < dk * kTileV; idx += kChunkThreads) {
    const int i = idx / kTileV, j = j0 + idx % kTileV;
    if (j < dv) S[int64_t(i) * dv + j] = S_s[idx];
  }
}

// The largest chunk (64, 32 or 16 rows) whose working set fits a block's shared memory, or 0.
int chunk_rows(int dk) {
  int device = 0, limit = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device), "current device");
  TS_CUDA_CHECK(cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device), "smem limit");
  for (int c : {64, 32, 16}) {
    if (ChunkSmem{dk, c}.bytes() <= size_t(limit)) return c;
  }
  return 0;
}

bool chunked_from_env() {
  static const bool on = [] {
    const char* v = std::getenv("TURBOSPARK_CUDA_GDN_CHUNKED");
    return !(v && std::string_view(v) == "0");
  }();
  return on;
}

}  // namespace

void gated_delta_rule(const Mat& qkv, const Mat& a, const Mat& b, const float* a_log, const float* dt_bias,
                      int n_k_heads, int n_v_heads, int dk, int dv, bool v_heads_tiled, const Mat& state, const Mat& out,
                      cudaStream_t stream, GdnForm form) {
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
  const KeyHeads heads{n_v_heads / n_k_heads, v_heads_tiled ? n_k_heads : 0};
  const bool chunked = form == GdnForm::kChunked ||
                       (form == GdnForm::kAuto && chunked_from_env() && qkv.rows >= kGdnChunkedMinRows);
  if (chunked) {
    const int chunk = chunk_rows(dk);
    TS_CHECK(chunk > 0 || form == GdnForm::kAuto, "gated_delta_rule: key head dim {} leaves no room for a chunk", dk);
    if (chunk > 0) {
      const ChunkSmem layout{dk, chunk};
      const size_t smem = layout.bytes();
      TS_CUDA_CHECK(cudaFuncSetAttribute(gated_delta_chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(smem)),
                    "gated_delta_rule (chunked): {} bytes of shared memory", smem);
      const dim3 chunk_grid(unsigned(ceil_div(dv, kTileV)), unsigned(n_v_heads));
      launch(gated_delta_chunk_kernel, chunk_grid, kChunkThreads, smem, stream, qkv.data, qkv.stride, a.data, a.stride,
             b.data, b.stride, a_log, dt_bias, heads, dk, dv, key_dim, state.data, state.stride, out.data, out.stride,
             qkv.rows, chunk);
      TS_CUDA_LAUNCH_CHECK("gated_delta_rule (chunks of {}) rows {} heads {}/{} dk {} dv {}", chunk, qkv.rows,
                           n_k_heads, n_v_heads, dk, dv);
      return;
    }
  }
  const dim3 grid(unsigned(ceil_div(dv, kColumns)), unsigned(n_v_heads));
  auto run = [&](auto kernel) {
    launch(kernel, grid, kThreads, 0, stream, qkv.data, qkv.stride, a.data, a.stride, b.data, b.stride, a_log, dt_bias,
           heads, dk, dv, key_dim, state.data, state.stride, out.data, out.stride, qkv.rows);
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
