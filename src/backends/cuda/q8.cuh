// int8 activations for the dp4a GEMV path (gemv.cu) of the 32-element ggml formats (Q4_0,
// Q4_1, Q5_0, Q5_1, Q8_0).
//
// Why: dequantizing 4-bit weights to f32 costs ~6 instructions per element, and the f32 GEMV
// issues far more instructions per weight byte than HBM can feed (Q4_0 LM head [151936, 2048]:
// 196 us = 0.9 TB/s on the H200, ncu). With the activations quantized to int8 per 32 elements
// (the CPU backend's BlockQ8x32, llama.cpp's q8_1), one dp4a does 4 multiply-adds on the raw
// codes (that LM head: 158 us; the kernel stays latency and load bound, NOTES_matmul.md):
// w_i = a * c_i + b per weight block (c the integer codes), so
//   sum_i w_i x_i = a * dx * sum_i c_i q_i + b * (dx * sum_i q_i).
// The quantization is core/quant.cpp's quantize_row_q8x32 operation for operation (amax / 127,
// 1 / d, round half to even, clamp to +-127), so the codes equal the CPU backend's and both
// backends agree to f32 rounding; against exact f32 weights x f32 activations the error is the
// int8 rounding of the activations (~0.5% of a dot product), the same trade llama.cpp and the
// CPU backend make.
//
// Each block quantizes the activation rows it needs into shared memory (a 2048-wide row is
// 3.3 KB; every block re-reads it from L2, which costs far less than a separate launch), so
// the path applies while q8_smem_bytes(rows, cols) fits kQ8SmemMax (and, gemv.cu says, where
// a block covers enough output rows to amortize it); other inputs keep the f32 path.
#pragma once

#include <cstdint>

#include "backends/cuda/common.cuh"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda {

// Dynamic shared memory a block may take for int8 activations without an opt-in.
constexpr int64_t kQ8SmemMax = 48 * 1024;

// rows x cols (cols % 32 == 0): the codes, one f32 scale per 32, one f32 sum per 8-element unit.
__host__ __device__ constexpr int64_t q8_smem_bytes(int64_t rows, int64_t cols) {
  return rows * (cols + cols / 32 * 4 + cols / kUnit * 4);
}

// Formats with a dp4a path: F::unit_q8(row, u, c0, c1, a, b) gives unit u's 8 integer codes as
// two words of 4 int8 (element order) and the affine map w = a * c + b of its block.
template <class F>
constexpr bool kHasQ8 = requires(const WeightRow& w, int64_t u, int32_t& c, float& s) { F::unit_q8(w, u, c, c, s, s); };

struct SmemQ8 {
  const int32_t* q;  // [rows][cols / 4]
  const float* d;    // [rows][cols / 32]
  const float* us;   // [rows][cols / 8]: d * (sum of the unit's 8 codes)
  int64_t cols;

  // Unit u of row r: two code words, its block's scale, its scaled code sum.
  __device__ __forceinline__ void unit(int r, int64_t u, int32_t& x0, int32_t& x1, float& dx, float& sx) const {
    const int2 w = reinterpret_cast<const int2*>(q + r * (cols / 4))[u];
    x0 = w.x, x1 = w.y;
    dx = d[r * (cols / 32) + (u >> 2)];
    sx = us[r * (cols / kUnit) + u];
  }
};

// Quantizes rows [0, rows) of x (row r at x + r * x_stride, 16-byte aligned, cols % 32 == 0)
// into `smem` (q8_smem_bytes(rows, cols) bytes, 16-byte aligned) with all of the block's
// threads, then synchronises the block. Eight threads share a 32-element block, one float4 and
// one code word each.
__device__ __forceinline__ SmemQ8 quantize_q8_rows(const float* __restrict__ x, int64_t x_stride, int rows,
                                                   int64_t cols, void* smem) {
  auto* q = static_cast<int32_t*>(smem);
  auto* d = reinterpret_cast<float*>(static_cast<int8_t*>(smem) + rows * cols);
  float* us = d + rows * (cols / 32);
  const int64_t words = cols / 4, total = rows * words;  // total % 8 == 0: groups of 8 share validity
  for (int64_t i0 = 0; i0 < total; i0 += blockDim.x) {  // uniform trip count: full-warp shuffles
    const int64_t i = i0 + threadIdx.x;
    const bool ok = i < total;
    const int64_t r = ok ? i / words : 0, w = ok ? i % words : 0;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (ok) v = __ldg(reinterpret_cast<const float4*>(x + r * x_stride) + w);
    float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float ds = amax / 127.f;
    const float id = ds > 0.f ? 1.f / ds : 0.f;
    auto code = [&](float f) { return min(max(__float2int_rn(f * id), -127), 127); };
    const int c0 = code(v.x), c1 = code(v.y), c2 = code(v.z), c3 = code(v.w);
    int sum = c0 + c1 + c2 + c3;
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // the other half of this 8-element unit
    if (ok) {
      q[i] = int32_t((uint32_t(c0) & 0xFF) | (uint32_t(c1) & 0xFF) << 8 | (uint32_t(c2) & 0xFF) << 16 |
                     uint32_t(c3) << 24);
      if ((w & 1) == 0) us[r * (cols / kUnit) + w / 2] = ds * float(sum);
      if ((w & 7) == 0) d[r * (cols / 32) + w / 8] = ds;
    }
  }
  __syncthreads();
  return {q, d, us, cols};
}

// sum over unit u of w * x for one weight unit (codes c0, c1, map a, b) and one activation unit.
__device__ __forceinline__ float q8_unit_dot(int32_t c0, int32_t c1, float a, float b, int32_t x0, int32_t x1,
                                             float dx, float sx) {
  const int dot = __dp4a(c1, x1, __dp4a(c0, x0, 0));
  return fmaf(a * dx, float(dot), b * sx);
}

}  // namespace turbospark::cuda
