// Rotary position embedding, rotate-half (NeoX) layout, in place (Backend::rope): in each
// head, dim i pairs with i + rotary_dim/2 for i < rotary_dim/2; dims past rotary_dim are
// untouched (partial rotary). angle = float(position) * inv_freq[i] in float32 exactly as
// transformers and the CPU compute it, then cos/sin scaled by attention_factor (YaRN).
//
// Precise cosf/sinf (sincosf), not __cosf/__sinf: angles reach position * inv_freq[0] =
// position radians (1e5 and beyond at long context), and the intrinsics reduce the argument
// with a short constant so their error grows with |angle| (about 1e-2 absolute at 1e5 rad);
// sincosf does full (Payne-Hanek) reduction and stays within 2 ulp like glibc's cosf/sinf.
//
// Bound: memory, 8 bytes per rotated element (read + write), plus one sincosf per (row, i)
// that is reused across all heads. Layout: one block per row; threads.x over the rotary
// pairs i (32 lanes, looping for rotary_dim > 64), threads.y over heads (8, looping).
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace turbospark::cuda {
namespace {

constexpr int kPairThreads = 32;
constexpr int kHeadThreads = 8;

__global__ void __launch_bounds__(kPairThreads* kHeadThreads)
    rope_kernel(float* x, int64_t stride, int n_heads, int head_dim, int half, const int64_t* __restrict__ positions,
                const float* __restrict__ inv_freq, float attention_factor) {
  pdl_begin();
  const int64_t row = blockIdx.x;
  float* xr = x + row * stride;
  const float pos = float(positions[row]);  // int64 -> float rounds to nearest, as the CPU's float(p)
  for (int i = threadIdx.x; i < half; i += kPairThreads) {
    const float angle = pos * inv_freq[i];
    float s, c;
    sincosf(angle, &s, &c);
    c *= attention_factor;
    s *= attention_factor;
    for (int h = threadIdx.y; h < n_heads; h += kHeadThreads) {
      float* v = xr + int64_t(h) * head_dim;
      const float a = v[i], b = v[i + half];
      // Rounded products, no FMA contraction: the CPU's vector path multiplies then adds.
      v[i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
      v[i + half] = __fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s));
    }
  }
}

}  // namespace

void rope(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions, const float* inv_freq,
          float attention_factor, cudaStream_t stream) {
  TS_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim && int64_t(n_heads) * head_dim <= x.cols,
           "rope: bad shape (heads {}, head_dim {}, rotary_dim {}, cols {})", n_heads, head_dim, rotary_dim, x.cols);
  if (x.rows == 0 || rotary_dim == 0) return;
  TS_CHECK(x.rows <= 0x7fffffff, "rope: {} rows", x.rows);
  // Block per row, 32 x 8 threads: a row of 32 heads x 64 pairs is 8 passes of 256 threads.
  launch(rope_kernel, int(x.rows), dim3(kPairThreads, kHeadThreads), 0, stream, x.data, x.stride, n_heads, head_dim,
         rotary_dim / 2, positions, inv_freq, attention_factor);
  TS_CUDA_LAUNCH_CHECK("rope [{}, {}] heads {} head_dim {} rotary_dim {}", x.rows, x.cols, n_heads, head_dim,
                       rotary_dim);
}

}  // namespace turbospark::cuda
