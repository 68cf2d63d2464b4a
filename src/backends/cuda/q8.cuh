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

// Four activations (one float4) of a 32-element block shared by eight consecutive lanes: the
// block's scale d = amax / 127 (amax over the eight lanes), this float4's four codes packed in
// element order (round half to even, clamped to +-127: quantize_row_q8x32's operations) and
// their sum. All 32 lanes call it (full-warp shuffles).
struct Q8Word {
  int32_t codes;
  float d;
  int sum;
};
__device__ __forceinline__ Q8Word quantize_q8_word(float4 v) {
  float amax = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
  for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  auto code = [&](float f) { return min(max(__float2int_rn(f * id), -127), 127); };
  const int c0 = code(v.x), c1 = code(v.y), c2 = code(v.z), c3 = code(v.w);
  return {int32_t((uint32_t(c0) & 0xFF) | (uint32_t(c1) & 0xFF) << 8 | (uint32_t(c2) & 0xFF) << 16 | uint32_t(c3) << 24),
          d, c0 + c1 + c2 + c3};
}

// Quantizes rows [0, rows) of x (row r at x + r * x_stride, 16-byte aligned, cols % 32 == 0)
// into `smem` (q8_smem_bytes(rows, cols) bytes, 16-byte aligned) with all of the block's
// threads, then synchronises the block. Eight threads share a 32-element block, one float4 and
// one code word each.
__device__ __forceinline__ SmemQ8 quantize_q8_rows(const float* __restrict__ x, int64_t x_stride, int rows,
                                                   int64_t cols, void* smem) {
  auto* q = static_cast<int32_t*>(smem);
  auto* d = reinterpret_cast<float*>(static_cast<int8_t*>(smem) + rows * cols);
  float* us = d + rows * (cols / 32);
  // 32-bit index arithmetic (see quantize_q8x32_rows); total % 8 == 0: groups of 8 share validity.
  const uint32_t words = uint32_t(cols / 4), total = uint32_t(rows) * words;
  for (uint32_t i0 = 0; i0 < total; i0 += blockDim.x) {  // uniform trip count: full-warp shuffles
    const uint32_t i = i0 + threadIdx.x;
    const bool ok = i < total;
    const uint32_t r = rows == 1 || !ok ? 0 : i / words, w = ok ? i - r * words : 0;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (ok) v = __ldg(reinterpret_cast<const float4*>(x + int64_t(r) * x_stride) + w);
    const Q8Word qw = quantize_q8_word(v);
    const int sum = qw.sum + __shfl_xor_sync(0xffffffffu, qw.sum, 1);  // the other half of this 8-element unit
    if (ok) {
      q[i] = qw.codes;
      if ((w & 1) == 0) us[r * (cols / kUnit) + w / 2] = qw.d * float(sum);
      if ((w & 7) == 0) d[r * (cols / 32) + w / 8] = qw.d;
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

// ---- whole 32-element blocks against BlockQ8x32-shaped activations --------------------------
// The decode kernels of Q4_0 (both layouts; gemv.cu, moe_decode.cu) give each lane whole 32-element
// blocks: one block of weight codes (16 bytes) meets one block of activation codes (32 bytes)
// in eight dp4a, and the scales once:
//   sum_i d (c_i - 8) dx q_i = d (dx sum_i c_i q_i - 8 s),  s = dx sum_i q_i (BlockQ8x32's s).
// About one instruction per weight, against ~12 for the unit-wise f32 dequantize (ncu).

// Formats whose 32-element blocks F::codes32 reads as codes and a scale: Q4_0 (either layout)
// and MXFP4, 16 code bytes (uint4); Q8_0, 32 code bytes (its F::Codes32, Q8Codes). The MoE
// decode kernels take all three, the dense GEMV's whole-block kernel Q4_0 and Q8_0 (below).
template <class F>
struct Codes32Of {
  using type = uint4;
};
template <class F>
  requires requires { typename F::Codes32; }
struct Codes32Of<F> {
  using type = typename F::Codes32;
};
template <class F>
using codes32_t = typename Codes32Of<F>::type;
template <class F>
constexpr bool kHasCodes32 = requires(const WeightRow& w, int64_t b, codes32_t<F>& c, float& d) { F::codes32(w, b, c, d); };
// The dense GEMV's whole-block dp4a kernel (gemv.cu gemv_q4_dp4a_kernel): Q4_0 and Q8_0, whose
// CPU matmuls quantize activations per 32 the same way.
template <class F>
constexpr bool kHasGemvCodes32 = kHasCodes32<F> && (F::kDType == DType::Q4_0 || F::kDType == DType::Q8_0);

// Activation rows quantized per 32 as core/quant.cpp's quantize_row_q8x32 does (the CPU
// backend's BlockQ8x32): codes [rows][cols] int8, then {d, s} [rows][cols / 32] as float2.
__host__ __device__ constexpr int64_t q8x32_bytes(int64_t rows, int64_t cols) {
  return rows * cols + rows * (cols / 32) * 8;
}

struct Q8x32Rows {
  const int8_t* q;
  const float2* ds;
  int64_t cols;
  // Block b of row r: its 32 codes as two int4 (elements 0..15, 16..31) and {d, s}.
  __device__ __forceinline__ void block(int64_t r, int64_t b, int4& lo, int4& hi, float2& dsv) const {
    const int4* p = reinterpret_cast<const int4*>(q + r * cols + 32 * b);
    lo = p[0];
    hi = p[1];
    dsv = ds[r * (cols / 32) + b];
  }
};

__host__ __device__ inline Q8x32Rows q8x32_view(void* base, int64_t rows, int64_t cols) {
  auto* q = static_cast<int8_t*>(base);
  return {q, reinterpret_cast<const float2*>(q + rows * cols), cols};
}

// Rows [0, rows) of x (16-byte-aligned rows, cols % 32 == 0) into `dst` (q8x32_bytes; 16-byte
// aligned, shared or global memory) with all of the block's threads; eight threads share a
// block (one float4 each), so the trip count is uniform and the shuffles full-warp. The caller
// synchronises before reading (shared memory: __syncthreads).
__device__ __forceinline__ Q8x32Rows quantize_q8x32_rows(const float* __restrict__ x, int64_t x_stride, int rows,
                                                         int64_t cols, void* dst) {
  auto* q = static_cast<int32_t*>(dst);
  auto* ds = reinterpret_cast<float2*>(static_cast<int8_t*>(dst) + rows * cols);
  // 32-bit index arithmetic (the codes fit shared memory): a 64-bit division per float4 cost
  // about half of a [5120, 2048] GEMV's instructions (ncu).
  const uint32_t words = uint32_t(cols / 4), total = uint32_t(rows) * words;  // total % 8 == 0
  for (uint32_t i0 = 0; i0 < total; i0 += blockDim.x) {
    const uint32_t i = i0 + threadIdx.x;
    const bool ok = i < total;
    const uint32_t r = rows == 1 || !ok ? 0 : i / words, w = ok ? i - r * words : 0;
    float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
    if (ok) v = __ldg(reinterpret_cast<const float4*>(x + int64_t(r) * x_stride) + w);
    const Q8Word qw = quantize_q8_word(v);
    int sum = qw.sum;
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (ok) {
      q[i] = qw.codes;
      if ((w & 7) == 0) ds[r * (words / 8) + w / 8] = make_float2(qw.d, qw.d * float(sum));
    }
  }
  return {reinterpret_cast<const int8_t*>(dst), ds, cols};
}

// One warp quantizes 32 consecutive values, one a lane (v), into block b of row r of dst:
// the same codes and {d, s} as quantize_q8x32_rows.
__device__ __forceinline__ void quantize_q8x32_warp(float v, int8_t* __restrict__ q, float2* __restrict__ ds) {
  float amax = fabsf(v);
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float d = amax / 127.f;
  const float id = d > 0.f ? 1.f / d : 0.f;
  const int c = min(max(__float2int_rn(v * id), -127), 127);
  int sum = c;
#pragma unroll
  for (int o = kWarp / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const int lane = threadIdx.x % kWarp;
  q[lane] = int8_t(c);
  if (lane == 0) *ds = make_float2(d, d * float(sum));
}

// sum over one 32-element block of Q4_0 weights (codes c, scale d) times activation codes.
__device__ __forceinline__ float q4_dot_q8x32(const uint4& c, float d, const int4& lo, const int4& hi, float2 dsv) {
  int s = 0;
  s = __dp4a(int(c.x & 0x0F0F0F0Fu), lo.x, s);
  s = __dp4a(int(c.y & 0x0F0F0F0Fu), lo.y, s);
  s = __dp4a(int(c.z & 0x0F0F0F0Fu), lo.z, s);
  s = __dp4a(int(c.w & 0x0F0F0F0Fu), lo.w, s);
  s = __dp4a(int((c.x >> 4) & 0x0F0F0F0Fu), hi.x, s);
  s = __dp4a(int((c.y >> 4) & 0x0F0F0F0Fu), hi.y, s);
  s = __dp4a(int((c.z >> 4) & 0x0F0F0F0Fu), hi.z, s);
  s = __dp4a(int((c.w >> 4) & 0x0F0F0F0Fu), hi.w, s);
  return d * fmaf(dsv.x, float(s), -8.f * dsv.y);
}

// Four MXFP4 codes (nibbles 0..3 of s; bit 3 the sign, bits 0..2 an index into twice the e2m1
// magnitudes {0, 1, 2, 3, 4, 6, 8, 12}) as four int8 in element order: the magnitude and its
// negation are each looked up with one byte permute (3-bit selectors), and a third permute
// takes, byte by byte, the negated one where the sign bit is set (bit 3 moved to bit 2 of the
// selector picks the second word).
__device__ __forceinline__ int32_t mxfp4_codes_to_int8(uint32_t s) {
  constexpr uint32_t kPos0 = 0x03020100u, kPos1 = 0x0C080604u;  // 0 1 2 3 | 4 6 8 12
  constexpr uint32_t kNeg0 = 0xFDFEFF00u, kNeg1 = 0xF4F8FAFCu;  // 0 -1 -2 -3 | -4 -6 -8 -12
  const uint32_t index = s & 0x7777u;
  const uint32_t pos = __byte_perm(kPos0, kPos1, index), neg = __byte_perm(kNeg0, kNeg1, index);
  return int32_t(__byte_perm(pos, neg, 0x3210u | ((s & 0x8888u) >> 1)));
}

// sum over one 32-element MXFP4 group (codes c as FmtMXFP4::codes32 reads them, d = half the
// group's scale) times BlockQ8x32 activation codes: the CPU backend's int8 MXFP4 path
// (backends/cpu/mxfp4.cpp) in the same integers, d * dx * sum_i (2 e2m1_i) q_i.
__device__ __forceinline__ float mxfp4_dot_q8x32(const uint4& c, float d, const int4& lo, const int4& hi,
                                                 float2 dsv) {
  int s = 0;
  s = __dp4a(mxfp4_codes_to_int8(c.x), lo.x, s);
  s = __dp4a(mxfp4_codes_to_int8(c.x >> 16), lo.y, s);
  s = __dp4a(mxfp4_codes_to_int8(c.y), lo.z, s);
  s = __dp4a(mxfp4_codes_to_int8(c.y >> 16), lo.w, s);
  s = __dp4a(mxfp4_codes_to_int8(c.z), hi.x, s);
  s = __dp4a(mxfp4_codes_to_int8(c.z >> 16), hi.y, s);
  s = __dp4a(mxfp4_codes_to_int8(c.w), hi.z, s);
  s = __dp4a(mxfp4_codes_to_int8(c.w >> 16), hi.w, s);
  return d * dsv.x * float(s);
}

// Q8_0's 32 signed codes (words a: elements 0..15, b: 16..31) against a BlockQ8x32: eight dp4a
// on the codes as stored; w = d * code, so no offset term.
__device__ __forceinline__ float q8_0_dot_q8x32(const Q8Codes& c, float d, const int4& lo, const int4& hi, float2 dsv) {
  int s = 0;
  s = __dp4a(int(c.a.x), lo.x, s);
  s = __dp4a(int(c.a.y), lo.y, s);
  s = __dp4a(int(c.a.z), lo.z, s);
  s = __dp4a(int(c.a.w), lo.w, s);
  s = __dp4a(int(c.b.x), hi.x, s);
  s = __dp4a(int(c.b.y), hi.y, s);
  s = __dp4a(int(c.b.z), hi.z, s);
  s = __dp4a(int(c.b.w), hi.w, s);
  return d * dsv.x * float(s);
}

// The block dot of a kHasCodes32 format.
template <class F>
__device__ __forceinline__ float codes32_dot_q8x32(const codes32_t<F>& c, float d, const int4& lo, const int4& hi,
                                                   float2 dsv) {
  if constexpr (F::kDType == DType::MXFP4) return mxfp4_dot_q8x32(c, d, lo, hi, dsv);
  else if constexpr (F::kDType == DType::Q8_0) return q8_0_dot_q8x32(c, d, lo, hi, dsv);
  else return q4_dot_q8x32(c, d, lo, hi, dsv);
}

// Whether the 32-element dp4a kernels are on (TURBOSPARK_CUDA_Q4_DP4A=0 turns them off, for
// measuring them against the unit-wise kernels in one build).
inline bool q4_dp4a_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("TURBOSPARK_CUDA_Q4_DP4A");
    return !(v && std::string_view(v) == "0");
  }();
  return on;
}

}  // namespace turbospark::cuda
