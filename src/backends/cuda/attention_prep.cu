// The attention inputs in one launch (Backend::attention_prep): the projection biases, per-head RMSNorm of q and k,
// RoPE on both, and k and v written to the paged cache (bf16), where the separate kernels took five
// launches per layer (two norms, two ropes, the cache write; at decode each is a few
// microseconds of launch and latency for a few kilobytes: ~20 us per layer on the H200, ncu).
//
// Same arithmetic as the separate kernels: the norm is norm.cu's (sum of squares in f32,
// 1 / sqrtf(mean + eps), (x * inv_rms) * (w + offset)), the rotation rope.cu's (angle =
// float(pos) * inv_freq[i] in f32, sincosf, rounded products without FMA contraction); only
// the order of the sum of squares differs (a block reduction instead of a warp's).
//
// Layout: one block per (row, head) over q heads then kv heads (grid y = n_heads + n_kv_heads);
// a kv-head block also copies that head of v into the cache. The head lives in shared memory
// between the steps; threads stride over its dims and rotary pairs. Bound: latency (the work
// is rows x (2 heads + ...) x head_dim floats).
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"
#include "backends/cuda/paged_kv.cuh"

namespace turbospark::cuda {
namespace {

constexpr int kPrepThreads = 128;

__global__ void __launch_bounds__(kPrepThreads)
    attention_prep_kernel(float* __restrict__ q, int64_t q_stride, float* __restrict__ k, int64_t k_stride,
                          const float* __restrict__ v, int64_t v_stride, AttentionPrep p,
                          const int64_t* __restrict__ positions, KvLayerView kv) {
  pdl_begin();
  extern __shared__ float head[];  // [head_dim]
  __shared__ float s_partial[kPrepThreads / kWarp];
  const int64_t t = blockIdx.x;
  const int h = blockIdx.y;
  const bool is_q = h < p.n_heads;
  const int kvh = h - p.n_heads;
  const int hd = p.head_dim;
  float* src = is_q ? q + t * q_stride + int64_t(h) * hd : k + t * k_stride + int64_t(kvh) * hd;
  // The projection's bias first (add_bias's one f32 addition), where there is one.
  const float* bias = is_q ? p.q_bias : p.k_bias;
  if (bias) bias += int64_t(is_q ? h : kvh) * hd;
  for (int d = threadIdx.x; d < hd; d += kPrepThreads) head[d] = bias ? src[d] + bias[d] : src[d];
  __syncthreads();

  const float* norm_w = is_q ? p.q_norm : p.k_norm;
  if (norm_w) {
    float sum_sq = 0.f;
    for (int d = threadIdx.x; d < hd; d += kPrepThreads) sum_sq += head[d] * head[d];
    sum_sq = warp_sum(sum_sq);
    if (threadIdx.x % kWarp == 0) s_partial[threadIdx.x / kWarp] = sum_sq;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kPrepThreads / kWarp; ++w) total += s_partial[w];
    const float inv_rms = 1.f / sqrtf(total / float(hd) + p.norm_eps);
    __syncthreads();  // every thread has read the unnormed head
    for (int d = threadIdx.x; d < hd; d += kPrepThreads) head[d] = (head[d] * inv_rms) * (norm_w[d] + p.norm_offset);
    __syncthreads();
  }

  const int64_t pos = positions[t];
  const int half = p.rotary_dim / 2;
  if (half > 0) {
    const float fpos = float(pos);  // int64 -> float rounds to nearest, as rope.cu and the CPU
    for (int i = threadIdx.x; i < half; i += kPrepThreads) {
      float s, c;
      sincosf(fpos * p.inv_freq[i], &s, &c);
      c *= p.attention_factor;
      s *= p.attention_factor;
      const float a = head[i], b = head[i + half];
      head[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
      head[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
    __syncthreads();
  }
  for (int d = threadIdx.x; d < hd; d += kPrepThreads) src[d] = head[d];
  if (is_q) return;

  const int seq = kv.row_seq ? kv.row_seq[t] : 0;
  const int64_t block = kv.block_table[int64_t(seq) * kv.max_blocks + pos / kv.block_size];
  const int64_t off = (block * kv.block_size + pos % kv.block_size) * int64_t(kv.n_kv_heads) * hd + int64_t(kvh) * hd;
  const float* vr = v + t * v_stride + int64_t(kvh) * hd;
  const float* vb = p.v_bias ? p.v_bias + int64_t(kvh) * hd : nullptr;
  auto* k_pool = static_cast<uint16_t*>(kv.k);
  auto* v_pool = static_cast<uint16_t*>(kv.v);
  for (int d = threadIdx.x; d < hd; d += kPrepThreads) {
    k_pool[off + d] = f32_to_bf16_bits(head[d]);
    v_pool[off + d] = f32_to_bf16_bits(vb ? vr[d] + vb[d] : vr[d]);
  }
}

}  // namespace

bool attention_prep(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p, const int64_t* positions,
                    const KvLayerView& kv, cudaStream_t stream) {
  TS_CHECK(int64_t(p.n_heads) * p.head_dim <= q.cols && int64_t(p.n_kv_heads) * p.head_dim <= k.cols &&
               k.cols == v.cols && q.rows == k.rows && k.rows == v.rows && p.rotary_dim % 2 == 0 &&
               p.rotary_dim <= p.head_dim && (p.q_norm == nullptr) == (p.k_norm == nullptr),
           "attention_prep: q [{}, {}], k [{}, {}], v [{}, {}] for heads {}/{} of {} (rotary {})", q.rows, q.cols,
           k.rows, k.cols, v.rows, v.cols, p.n_heads, p.n_kv_heads, p.head_dim, p.rotary_dim);
  TS_CHECK(kv.n_kv_heads == p.n_kv_heads && kv.head_dim == p.head_dim && kv.block_size > 0 && kv.max_blocks > 0,
           "attention_prep: cache of {} kv heads x {} (block size {}) for {} x {}", kv.n_kv_heads, kv.head_dim,
           kv.block_size, p.n_kv_heads, p.head_dim);
  check_bf16_pools("attention_prep", kv);
  // A head in shared memory: up to 48 KB without an opt-in (12288 floats, far past any model).
  if (int64_t(p.head_dim) * 4 > 48 * 1024) return false;
  if (q.rows == 0) return true;
  TS_CHECK(q.rows <= 0x7fffffff, "attention_prep: {} rows", q.rows);
  const dim3 grid(unsigned(q.rows), unsigned(p.n_heads + p.n_kv_heads));
  launch(attention_prep_kernel, grid, kPrepThreads, size_t(p.head_dim) * 4, stream, q.data, q.stride, k.data, k.stride,
         v.data, v.stride, p, positions, kv);
  TS_CUDA_LAUNCH_CHECK("attention_prep rows {} heads {}/{} head_dim {} rotary_dim {}", q.rows, p.n_heads,
                       p.n_kv_heads, p.head_dim, p.rotary_dim);
  return true;
}

}  // namespace turbospark::cuda
