// Device-side dequantization of every weight format, shared by the matmul, embedding and MoE
// kernels (gemv.cu, gemm.cu, embedding.cu, moe_decode.cu, moe_prefill.cu). Byte layouts are those of core/quant.h
// (ggml blocks) and core/quant_grouped.h (MXFP4, INT4_AFFINE); the scalar dequantizers there
// are the ground truth these are tested against (tests/device/test_cuda_matmul.cpp).
//
// One abstraction for all formats: a row of `cols` elements is read as units of kUnit = 8
// consecutive elements (unit u = elements [8u, 8u + 8)), each dequantized into 8 f32
// registers by Format::unit(row, u, v). Every ggml block (32 or 256 elements), every MXFP4
// group (32) and every INT4_AFFINE group (a power of two >= 8) is a whole number of units, so
// a unit never straddles two scales, and kernels stride units across threads the same way
// for every format (lane-contiguous units read contiguous bytes across a warp: coalesced).
// Float formats may have cols % 8 != 0 (odd hidden sizes, tests use 67): they also provide
// elem(row, i) for the tail past the last whole unit (kTail).
//
// Alignment: each format states kAlign, the byte alignment its loads need of the row start
// (data pointer and row_bytes). ggml blocks of 18/22/34/210 bytes only guarantee 2-byte
// alignment, so those formats load 16-bit halves; Q4_K/Q5_K blocks (144/176 bytes) and MXFP4
// groups (16 bytes) allow 8-byte loads. Float formats come in two variants: kVec (16-byte
// loads; row start 16-byte aligned) and scalar (any strided view), picked at dispatch.
//
// Instantiation: dispatch_weight_format() is the one list of formats; every kernel is
// instantiated by calling it with a generic lambda, so adding a format is one line there.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "backends/cuda/common.cuh"
#include "core/dtype.h"
#include "core/quant.h"
#include "core/quant_grouped.h"
#include "core/tensor.h"

namespace turbospark::cuda {

constexpr int kUnit = 8;  // elements per dequantized unit (see above)

// One unit rounded to bf16 and stored with one 16-byte write (dst 16-byte aligned).
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* dst, const float (&v)[kUnit]) {
  uint4 packed;
  uint32_t* words = reinterpret_cast<uint32_t*>(&packed);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
    words[i] = *reinterpret_cast<const uint32_t*>(&pair);
  }
  *reinterpret_cast<uint4*>(dst) = packed;
}

// A weight matrix as kernels see it: the WeightView's planes and strides, by value.
struct DeviceWeight {
  const uint8_t* data = nullptr;
  const uint8_t* scales = nullptr;
  const uint8_t* biases = nullptr;
  int64_t row_bytes = 0;
  int64_t scales_row_bytes = 0;
  int64_t biases_row_bytes = 0;
  int64_t rows = 0;
  int64_t cols = 0;
  int32_t group_shift = 0;  // INT4_AFFINE: log2(group_size)
  int32_t unused = 0;       // explicit padding: tables of these are compared bytewise (moe.cu)
};

// One row's planes.
struct WeightRow {
  const uint8_t* data;
  const uint8_t* scales;
  const uint8_t* biases;
  int32_t group_shift;
};

__device__ __forceinline__ WeightRow weight_row(const DeviceWeight& w, int64_t r) {
  return {w.data + r * w.row_bytes, w.scales + r * w.scales_row_bytes, w.biases + r * w.biases_row_bytes,
          w.group_shift};
}

// Rows [r0, r0 + n) of every plane of w (clipped to w.rows) into L2 (prefetch_l2): one thread.
__device__ __forceinline__ void prefetch_weight_rows(const DeviceWeight& w, int64_t r0, int64_t n) {
  n = min(n, w.rows - r0);
  if (n <= 0) return;
  prefetch_l2(w.data + r0 * w.row_bytes, n * w.row_bytes);
  if (w.scales) prefetch_l2(w.scales + r0 * w.scales_row_bytes, n * w.scales_row_bytes);
  if (w.biases) prefetch_l2(w.biases + r0 * w.biases_row_bytes, n * w.biases_row_bytes);
}

// ---- loads (read-only path; weights never change during a kernel) ---------------------------

__device__ __forceinline__ uint32_t ld_u8(const uint8_t* p) { return __ldg(p); }
__device__ __forceinline__ uint32_t ld_u16(const uint8_t* p) { return __ldg(reinterpret_cast<const uint16_t*>(p)); }
__device__ __forceinline__ uint32_t ld_u32(const uint8_t* p) { return __ldg(reinterpret_cast<const uint32_t*>(p)); }
// 4 bytes at a 2-byte-aligned address.
__device__ __forceinline__ uint32_t ld_u32_a2(const uint8_t* p) { return ld_u16(p) | ld_u16(p + 2) << 16; }
__device__ __forceinline__ uint2 ld_u64(const uint8_t* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
__device__ __forceinline__ uint4 ld_u128(const uint8_t* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ float f16_at(const uint8_t* p) { return f16_bits_to_f32(uint16_t(ld_u16(p))); }

// float(v) for 0 <= v < 2^23 without an I2F (a quarter-rate conversion on sm_90, once per
// dequantized weight): v in the mantissa of 2^23, minus 2^23. Exact; two full-rate ops. Measured
// neutral on the decode GEMVs (qkv 10.3 -> 9.5 us under ncu): they are not conversion bound.
// u2f_minus(v, c) is float(v) - c for an integer c with |c| < 2^22, in the same two ops.
__device__ __forceinline__ float u2f_minus(uint32_t v, float c) { return __uint_as_float(v | 0x4B000000u) - (8388608.f + c); }
__device__ __forceinline__ float u2f(uint32_t v) { return u2f_minus(v, 0.f); }

// 8 nibbles of two little-endian words (element i of the unit = bits [4i + shift...]) as
// w = d * (q + offset) or (min_form) d * q + min: the shared tail of Q4_0 / Q4_1. Each nibble
// is read in place (no shift down): q 2^p in the mantissa of 2^23 (p = 0 or 8), the offset
// taken in that scale, then a scale d 2^-p (exact): the same single rounding as d * (q + off).
__device__ __forceinline__ void nibbles_affine(uint32_t lo, uint32_t hi, int shift, float d, float offset_or_min,
                                               bool min_form, float (&v)[kUnit]) {
  const uint32_t ws[4] = {lo >> shift, lo >> (shift + 16), hi >> shift, hi >> (shift + 16)};
  const float d8 = d * 0x1p-8f;
  const float c0 = min_form ? 0.f : -offset_or_min, c8 = min_form ? 0.f : -256.f * offset_or_min;
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float a = u2f_minus(ws[k] & 0xFu, c0), b = u2f_minus(ws[k] & 0xF00u, c8);
    v[2 * k] = min_form ? fmaf(a, d, offset_or_min) : a * d;
    v[2 * k + 1] = min_form ? fmaf(b, d8, offset_or_min) : b * d8;
  }
}

// ---- float formats ----------------------------------------------------------------------------

template <bool kVec>
struct FmtF32 {
  static constexpr DType kDType = DType::F32;
  static constexpr int kAlign = kVec ? 16 : 4;
  static constexpr bool kTail = true;
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const uint8_t* p = w.data + u * 32;
    if constexpr (kVec) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
      for (int i = 0; i < kUnit; ++i) v[i] = __ldg(reinterpret_cast<const float*>(p) + i);
    }
  }
  static __device__ __forceinline__ float elem(const WeightRow& w, int64_t i) {
    return __ldg(reinterpret_cast<const float*>(w.data) + i);
  }
};

// F16 and BF16: 8 halves = 16 bytes per unit.
template <DType kType, bool kVec>
struct FmtHalf {
  static constexpr DType kDType = kType;
  static constexpr int kAlign = kVec ? 16 : 2;
  static constexpr bool kTail = true;
  static __device__ __forceinline__ float cvt(uint32_t h) {
    if constexpr (kType == DType::BF16) return bf16_bits_to_f32(uint16_t(h));
    else return f16_bits_to_f32(uint16_t(h));
  }
  // A unit's 16 bytes as loaded (kVec) to its 8 values: kernels that load units ahead of their
  // use (before a PDL wait) keep the 4 raw words, not the 8 floats.
  static __device__ __forceinline__ void bits(const uint4& q, float (&v)[kUnit]) {
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) v[2 * i] = cvt(words[i] & 0xFFFF), v[2 * i + 1] = cvt(words[i] >> 16);
  }
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const uint8_t* p = w.data + u * 16;
    if constexpr (kVec) {
      bits(ld_u128(p), v);
    } else {
#pragma unroll
      for (int i = 0; i < kUnit; ++i) v[i] = cvt(ld_u16(p + 2 * i));
    }
  }
  static __device__ __forceinline__ float elem(const WeightRow& w, int64_t i) { return cvt(ld_u16(w.data + 2 * i)); }
};

// Formats whose units are 16 bytes loaded whole and decoded by F::bits (vector-aligned F16 and
// BF16 rows): kernels may hold a unit's raw words in flight and decode them later.
template <class F>
constexpr bool kHasUnitBits = F::kAlign == 16 && requires(const uint4& q, float (&v)[kUnit]) { F::bits(q, v); };

// ---- ggml 32-element blocks: 4 units per block -------------------------------------------------
// Unit p (0..3) of a block is elements 8p..8p+7: the low (p < 2) or high (p >= 2) nibbles of
// qs[8 (p & 1) .. + 8].

struct FmtQ4_0 {
  static constexpr DType kDType = DType::Q4_0;
  static constexpr int kAlign = 2;
  static constexpr bool kTail = false;
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ4_0));
    const int p = int(u & 3);
    const float d = f16_at(blk);
    const uint8_t* qs = blk + 2 + 8 * (p & 1);
    nibbles_affine(ld_u32_a2(qs), ld_u32_a2(qs + 4), 4 * (p >> 1), d, -8.f, false, v);
  }
  // dp4a path (q8.cuh): the unit's codes 0..15 and w = d * c - 8 d.
  static __device__ __forceinline__ void unit_q8(const WeightRow& w, int64_t u, int32_t& c0, int32_t& c1, float& a,
                                                 float& b) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ4_0));
    const int p = int(u & 3), shift = 4 * (p >> 1);
    const uint8_t* qs = blk + 2 + 8 * (p & 1);
    c0 = int32_t((ld_u32_a2(qs) >> shift) & 0x0F0F0F0Fu);
    c1 = int32_t((ld_u32_a2(qs + 4) >> shift) & 0x0F0F0F0Fu);
    a = f16_at(blk);
    b = -8.f * a;
  }
  // Block b's 16 code bytes (byte j: element j low nibble, j + 16 high) and scale, for the
  // 32-element dp4a kernels (q8.cuh q4_dot_q8x32). 18-byte blocks: eight 2-byte loads.
  static __device__ __forceinline__ void codes32(const WeightRow& w, int64_t b, uint4& c, float& d) {
    const uint8_t* blk = w.data + b * int64_t(sizeof(BlockQ4_0));
    c = make_uint4(ld_u32_a2(blk + 2), ld_u32_a2(blk + 6), ld_u32_a2(blk + 10), ld_u32_a2(blk + 14));
    d = f16_at(blk);
  }
};

// Q4_0 in planes (repack.cu rewrites ggml blocks so at upload): block b of a row is the 16 code
// bytes at data + 16 b (byte j: element j in the low nibble, element j + 16 in the high, as in
// ggml) and its f16 scale at scales + 2 b. One 16-byte load per 32 elements where ggml's
// 18-byte blocks allow only 2-byte loads. The view keeps dtype Q4_0; the scale plane marks the
// layout (is_q4_0_planes). Dequantized values are those of FmtQ4_0, bit for bit.
struct FmtQ4_0Planes {
  static constexpr DType kDType = DType::Q4_0;
  static constexpr int kAlign = 16;
  static constexpr bool kTail = false;
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const int p = int(u & 3);
    const uint2 q = ld_u64(w.data + (u >> 2) * 16 + 8 * (p & 1));
    nibbles_affine(q.x, q.y, 4 * (p >> 1), f16_at(w.scales + 2 * (u >> 2)), -8.f, false, v);
  }
  // Block b as one 16-byte load and its scale; dot32 forms d * sum_i (q_i - 8) x_i with
  // x = the activations of the block's 32 elements (q4_block_dot below).
  struct Block32 {
    uint4 codes;
    float d;
  };
  static __device__ __forceinline__ Block32 load32(const WeightRow& w, int64_t b) {
    return {ld_u128(w.data + 16 * b), f16_at(w.scales + 2 * b)};
  }
  static __device__ __forceinline__ float dot32(const Block32& blk, const float (&x)[32]);
  // The same for the dp4a kernels (FmtQ4_0::codes32): one 16-byte load.
  static __device__ __forceinline__ void codes32(const WeightRow& w, int64_t b, uint4& c, float& d) {
    c = ld_u128(w.data + 16 * b);
    d = f16_at(w.scales + 2 * b);
  }
};

struct FmtQ4_1 {
  static constexpr DType kDType = DType::Q4_1;
  static constexpr int kAlign = 4;
  static constexpr bool kTail = false;
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ4_1));
    const int p = int(u & 3);
    const uint32_t dm = ld_u32(blk);
    const float d = f16_bits_to_f32(uint16_t(dm & 0xFFFF)), m = f16_bits_to_f32(uint16_t(dm >> 16));
    const uint8_t* qs = blk + 4 + 8 * (p & 1);
    nibbles_affine(ld_u32(qs), ld_u32(qs + 4), 4 * (p >> 1), d, m, true, v);
  }
  static __device__ __forceinline__ void unit_q8(const WeightRow& w, int64_t u, int32_t& c0, int32_t& c1, float& a,
                                                 float& b) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ4_1));
    const int p = int(u & 3), shift = 4 * (p >> 1);
    const uint32_t dm = ld_u32(blk);
    const uint8_t* qs = blk + 4 + 8 * (p & 1);
    c0 = int32_t((ld_u32(qs) >> shift) & 0x0F0F0F0Fu);
    c1 = int32_t((ld_u32(qs + 4) >> shift) & 0x0F0F0F0Fu);
    a = f16_bits_to_f32(uint16_t(dm & 0xFFFF));
    b = f16_bits_to_f32(uint16_t(dm >> 16));
  }
};

// Q5: the 5th bit of element i is bit i of qh (little-endian u32).
__device__ __forceinline__ void q5_unit(uint32_t lo, uint32_t hi, int shift, uint32_t qh_bits, float d, float off,
                                        bool min_form, float (&v)[kUnit]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t q0 = ((lo >> (8 * i + shift)) & 0xF) | ((qh_bits >> i) & 1) << 4;
    const uint32_t q1 = ((hi >> (8 * i + shift)) & 0xF) | ((qh_bits >> (4 + i)) & 1) << 4;
    v[i] = min_form ? fmaf(u2f(q0), d, off) : d * u2f_minus(q0, -off);
    v[4 + i] = min_form ? fmaf(u2f(q1), d, off) : d * u2f_minus(q1, -off);
  }
}

// Four bits of n (element order) as bit 4 of four bytes: the Q5 formats' 5th bit in place.
__device__ __forceinline__ uint32_t q5_high_bits(uint32_t n) {
  return (n & 1) << 4 | (n & 2) << 11 | (n & 4) << 18 | (n & 8) << 25;
}

struct FmtQ5_0 {
  static constexpr DType kDType = DType::Q5_0;
  static constexpr int kAlign = 2;
  static constexpr bool kTail = false;
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ5_0));
    const int p = int(u & 3);
    const float d = f16_at(blk);
    const uint32_t qh = ld_u32_a2(blk + 2);
    const uint8_t* qs = blk + 6 + 8 * (p & 1);
    q5_unit(ld_u32_a2(qs), ld_u32_a2(qs + 4), 4 * (p >> 1), (qh >> (8 * p)) & 0xFF, d, -16.f, false, v);
  }
  static __device__ __forceinline__ void unit_q8(const WeightRow& w, int64_t u, int32_t& c0, int32_t& c1, float& a,
                                                 float& b) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ5_0));
    const int p = int(u & 3), shift = 4 * (p >> 1);
    const uint32_t bits = (ld_u32_a2(blk + 2) >> (8 * p)) & 0xFF;
    const uint8_t* qs = blk + 6 + 8 * (p & 1);
    c0 = int32_t(((ld_u32_a2(qs) >> shift) & 0x0F0F0F0Fu) | q5_high_bits(bits & 0xF));
    c1 = int32_t(((ld_u32_a2(qs + 4) >> shift) & 0x0F0F0F0Fu) | q5_high_bits(bits >> 4));
    a = f16_at(blk);
    b = -16.f * a;
  }
};

struct FmtQ5_1 {
  static constexpr DType kDType = DType::Q5_1;
  static constexpr int kAlign = 8;
  static constexpr bool kTail = false;
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ5_1));
    const int p = int(u & 3);
    const uint2 head = ld_u64(blk);  // d, m, qh
    const float d = f16_bits_to_f32(uint16_t(head.x & 0xFFFF)), m = f16_bits_to_f32(uint16_t(head.x >> 16));
    const uint2 q = ld_u64(blk + 8 + 8 * (p & 1));
    q5_unit(q.x, q.y, 4 * (p >> 1), (head.y >> (8 * p)) & 0xFF, d, m, true, v);
  }
  static __device__ __forceinline__ void unit_q8(const WeightRow& w, int64_t u, int32_t& c0, int32_t& c1, float& a,
                                                 float& b) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ5_1));
    const int p = int(u & 3), shift = 4 * (p >> 1);
    const uint2 head = ld_u64(blk);  // d, m, qh
    const uint32_t bits = (head.y >> (8 * p)) & 0xFF;
    const uint2 q = ld_u64(blk + 8 + 8 * (p & 1));
    c0 = int32_t(((q.x >> shift) & 0x0F0F0F0Fu) | q5_high_bits(bits & 0xF));
    c1 = int32_t(((q.y >> shift) & 0x0F0F0F0Fu) | q5_high_bits(bits >> 4));
    a = f16_bits_to_f32(uint16_t(head.x & 0xFFFF));
    b = f16_bits_to_f32(uint16_t(head.x >> 16));
  }
};

// A Q8_0 block's 32 codes as four-byte words (a: elements 0..15, b: 16..31), for the int8 MoE
// decode kernels (q8.cuh q8_0_dot_q8x32).
struct Q8Codes {
  uint4 a, b;
};

struct FmtQ8_0 {
  static constexpr DType kDType = DType::Q8_0;
  static constexpr int kAlign = 2;
  static constexpr bool kTail = false;
  using Codes32 = Q8Codes;
  // Block b's codes and scale. ggml's 34-byte blocks leave the codes 2-byte aligned: eight
  // 4-byte loads from the aligned word at or below them, shifted into place by 0 or 16 bits (the
  // last word's top half then comes from one 2-byte load inside the block), instead of sixteen
  // 2-byte loads.
  static __device__ __forceinline__ void codes32(const WeightRow& w, int64_t b, Q8Codes& c, float& d) {
    const uint8_t* blk = w.data + b * int64_t(sizeof(BlockQ8_0));
    const uint8_t* q = blk + 2;
    const uintptr_t off = reinterpret_cast<uintptr_t>(q) & 3;  // 0 or 2
    const uint32_t* base = reinterpret_cast<const uint32_t*>(q - off);
    uint32_t v[9];
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = __ldg(base + i);
    v[8] = off ? ld_u16(q + 30) : 0u;  // codes 30, 31 (the 8 words end 2 bytes short of them)
    const uint32_t sh = uint32_t(off) * 8;
    uint32_t o[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = __funnelshift_r(v[i], v[i + 1], sh);
    c.a = make_uint4(o[0], o[1], o[2], o[3]);
    c.b = make_uint4(o[4], o[5], o[6], o[7]);
    d = f16_at(blk);
  }
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ8_0));
    const float d = f16_at(blk);
    const uint8_t* qs = blk + 2 + 8 * (u & 3);
    const uint32_t lo = ld_u32_a2(qs), hi = ld_u32_a2(qs + 4);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      // int8 = (byte ^ 0x80) - 128: the flip folds into the OR of u2f.
      v[i] = d * u2f_minus(((lo >> (8 * i)) & 0xFFu) ^ 0x80u, 128.f);
      v[4 + i] = d * u2f_minus(((hi >> (8 * i)) & 0xFFu) ^ 0x80u, 128.f);
    }
  }
  static __device__ __forceinline__ void unit_q8(const WeightRow& w, int64_t u, int32_t& c0, int32_t& c1, float& a,
                                                 float& b) {
    const uint8_t* blk = w.data + (u >> 2) * int64_t(sizeof(BlockQ8_0));
    const uint8_t* qs = blk + 2 + 8 * (u & 3);
    c0 = int32_t(ld_u32_a2(qs));
    c1 = int32_t(ld_u32_a2(qs + 4));
    a = f16_at(blk);
    b = 0.f;
  }
};

// ---- ggml k-quants: 256-element blocks, 32 units per block -----------------------------------

// Sub-block s (0..7) scale and minimum of Q4_K/Q5_K's 12 packed bytes (quant::unpack_k4_scales).
__device__ __forceinline__ void k4_scale_min(const uint8_t* packed, int s, float& sc, float& m) {
  if (s < 4) {
    sc = float(ld_u8(packed + s) & 63);
    m = float(ld_u8(packed + s + 4) & 63);
  } else {
    const uint32_t b = ld_u8(packed + s + 4);
    sc = float((b & 0xF) | (ld_u8(packed + s - 4) >> 6) << 4);
    m = float((b >> 4) | (ld_u8(packed + s) >> 6) << 4);
  }
}

// Unit u of a Q4_K/Q5_K block: sub-block s = u / 4 (32 elements), l0 = 8 (u % 4) within it;
// sub-block s lives in the low (s even) or high (s odd) nibbles of qs[32 (s / 2) + l].
template <bool kFive>
struct FmtQK45 {
  using Block = std::conditional_t<kFive, BlockQ5_K, BlockQ4_K>;
  static constexpr DType kDType = kFive ? DType::Q5_K : DType::Q4_K;
  static constexpr int kAlign = 16;
  static constexpr bool kTail = false;
  static constexpr int kQsOffset = kFive ? 48 : 16;
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const uint8_t* blk = w.data + (u >> 5) * int64_t(sizeof(Block));
    const int s = int(u >> 2) & 7, q = int(u & 3), j = s >> 1, shift = 4 * (s & 1);
    const uint32_t dd = ld_u32(blk);
    const float d = f16_bits_to_f32(uint16_t(dd & 0xFFFF)), dmin = f16_bits_to_f32(uint16_t(dd >> 16));
    float sc, m;
    k4_scale_min(blk + 4, s, sc, m);
    const float d0 = d * sc, m0 = dmin * m;
    const uint2 qs = ld_u64(blk + kQsOffset + 32 * j + 8 * q);
    uint2 qh = {0, 0};
    if constexpr (kFive) qh = ld_u64(blk + 16 + 8 * q);  // qh[l], l = 8q .. 8q + 7
    const int hbit = 2 * j + (s & 1);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t q0 = (qs.x >> (8 * i + shift)) & 0xF, q1 = (qs.y >> (8 * i + shift)) & 0xF;
      if constexpr (kFive) {
        q0 |= ((qh.x >> (8 * i + hbit)) & 1) << 4;
        q1 |= ((qh.y >> (8 * i + hbit)) & 1) << 4;
      }
      v[i] = d0 * u2f(q0) - m0;
      v[4 + i] = d0 * u2f(q1) - m0;
    }
  }
};

// Q6_K: unit u of a block: half h = u / 16, quarter k = (u / 4) % 4, l0 = 8 (u % 4). Elements
// 128h + 32k + l take the low (k < 2) or high nibble of ql[64h + 32 (k & 1) + l], bits 2k..2k+1
// of qh[32h + l], and scale scales[8h + 2k + l / 16].
struct FmtQ6_K {
  static constexpr DType kDType = DType::Q6_K;
  static constexpr int kAlign = 2;
  static constexpr bool kTail = false;
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const uint8_t* blk = w.data + (u >> 5) * int64_t(sizeof(BlockQ6_K));
    const int r = int(u & 31), h = r >> 4, k = (r >> 2) & 3, q = r & 3;
    const float d = f16_at(blk + 208);
    const float scale = d * float(int8_t(ld_u8(blk + 192 + 8 * h + 2 * k + (q >> 1))));
    const uint8_t* ql = blk + 64 * h + 32 * (k & 1) + 8 * q;
    const uint8_t* qh = blk + 128 + 32 * h + 8 * q;
    const uint32_t l0 = ld_u32_a2(ql), l1 = ld_u32_a2(ql + 4), h0 = ld_u32_a2(qh), h1 = ld_u32_a2(qh + 4);
    const int lshift = 4 * (k >> 1), hshift = 2 * k;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t q0 = ((l0 >> (8 * i + lshift)) & 0xF) | ((h0 >> (8 * i + hshift)) & 3) << 4;
      const uint32_t q1 = ((l1 >> (8 * i + lshift)) & 0xF) | ((h1 >> (8 * i + hshift)) & 3) << 4;
      v[i] = scale * u2f_minus(q0, 32.f);
      v[4 + i] = scale * u2f_minus(q1, 32.f);
    }
  }
};

// ---- grouped formats (scales in their own planes) --------------------------------------------

// MXFP4: 16 packed bytes per 32-element group, one e8m0 scale byte per group; unit u is the 4
// bytes at 4u (element 2k low nibble, 2k + 1 high).
struct FmtMXFP4 {
  static constexpr DType kDType = DType::MXFP4;
  static constexpr int kAlign = 4;
  static constexpr bool kTail = false;
  // 2^(e - 127) exactly as mxfp4::e8m0_to_float (e = 0 is the subnormal 2^-127, 255 is +inf).
  static __device__ __forceinline__ float e8m0(uint32_t e) { return __uint_as_float(e == 0 ? 0x00400000u : e << 23); }
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const float s = e8m0(ld_u8(w.scales + (u >> 2)));
    const uint32_t q = ld_u32(w.data + 4 * u);
    // Twice the e2m1 magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}, one nibble each.
    constexpr uint32_t kTwiceMagnitude = 0xC8643210u;
#pragma unroll
    for (int i = 0; i < kUnit; ++i) {
      const uint32_t code = (q >> (4 * i)) & 0xF;
      const float mag = u2f((kTwiceMagnitude >> (4 * (code & 7))) & 0xF) * 0.5f;
      v[i] = (code & 8 ? -mag : mag) * s;
    }
  }
  // Group b's 16 code bytes (byte j: element 2j low nibble, 2j + 1 high, so nibble n of each
  // word is element 8 (word) + n) and half its scale (the codes stand for twice e2m1), for the
  // int8-activation MoE decode kernels (moe_decode.cu, q8.cuh mxfp4_dot_q8x32). One 16-byte load where
  // the group is 16-byte aligned (every view the loaders make), four 4-byte loads otherwise.
  static __device__ __forceinline__ void codes32(const WeightRow& w, int64_t b, uint4& c, float& d) {
    const uint8_t* p = w.data + 16 * b;
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) c = ld_u128(p);
    else c = make_uint4(ld_u32(p), ld_u32(p + 4), ld_u32(p + 8), ld_u32(p + 12));
    d = 0.5f * e8m0(ld_u8(w.scales + b));
  }
};

// INT4_AFFINE: w = scale * q + bias per group of 2^group_shift elements; unit u is the u32 at 4u.
template <DType kPlane>
struct FmtInt4Affine {
  static constexpr DType kDType = DType::INT4_AFFINE;
  static constexpr int kAlign = 4;
  static constexpr bool kTail = false;
  static __device__ __forceinline__ float plane(const uint8_t* p, int64_t g) {
    if constexpr (kPlane == DType::F32) return __ldg(reinterpret_cast<const float*>(p) + g);
    else if constexpr (kPlane == DType::F16) return f16_at(p + 2 * g);
    else return bf16_bits_to_f32(uint16_t(ld_u16(p + 2 * g)));
  }
  static __device__ __forceinline__ void unit(const WeightRow& w, int64_t u, float (&v)[kUnit]) {
    const int64_t g = (u * kUnit) >> w.group_shift;
    const float s = plane(w.scales, g), b = plane(w.biases, g);
    const uint32_t q = ld_u32(w.data + 4 * u);
#pragma unroll
    for (int i = 0; i < kUnit; ++i) v[i] = s * u2f((q >> (4 * i)) & 0xF) + b;
  }
};

// ---- 32-element blocks in one 16-byte load ----------------------------------------------------
// Formats with F::load32(row, b) (block b of 32 elements in a register-sized F::Block32) and
// F::dot32(block, x) let decode kernels give each lane whole 32-element blocks (gemv.cu,
// moe_decode.cu): one 16-byte code load and one scale load per block instead of four unit decodes.
template <class F>
constexpr bool kBlock32 = requires(const WeightRow& w) { F::load32(w, int64_t(0)); };

// (q - 8) * 2^p for the nibble q at bits [p, p + 4) of w, p <= 16, exactly, in two ALU ops and
// without an int-to-float conversion: OR-ing the masked bits into the mantissa of 2^23 gives
// 2^23 + q 2^p, and subtracting 2^23 + 8 2^p is exact (both below 2^24).
template <int kP>
__device__ __forceinline__ float q4_centered_scaled(uint32_t w) {
  static_assert(kP >= 0 && kP <= 16);
  return __uint_as_float((w & (0xFu << kP)) | 0x4B000000u) - (8388608.f + 8.f * float(1u << kP));
}

// sum_i (q_i - 8) x_i over one ggml-ordered block of 16 code bytes (byte j: element j low,
// j + 16 high). Nibbles at bits 0..19 of a word are read in place, those at 20..31 after one
// shift by 12; five accumulators (one per bit offset, each exact product scaled by 2^p) are
// rescaled once at the end (multiplications by powers of two: exact).
__device__ __forceinline__ float q4_block_dot(uint4 codes, const float (&x)[32]) {
  const uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
  float a0 = 0.f, a4 = 0.f, a8 = 0.f, a12 = 0.f, a16 = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = words[i], s = w >> 12;
    a0 = fmaf(q4_centered_scaled<0>(w), x[4 * i], a0);           // byte 4i low
    a4 = fmaf(q4_centered_scaled<4>(w), x[16 + 4 * i], a4);      // byte 4i high
    a8 = fmaf(q4_centered_scaled<8>(w), x[4 * i + 1], a8);       // byte 4i+1 low
    a12 = fmaf(q4_centered_scaled<12>(w), x[17 + 4 * i], a12);   // byte 4i+1 high
    a16 = fmaf(q4_centered_scaled<16>(w), x[4 * i + 2], a16);    // byte 4i+2 low
    a8 = fmaf(q4_centered_scaled<8>(s), x[18 + 4 * i], a8);      // byte 4i+2 high
    a12 = fmaf(q4_centered_scaled<12>(s), x[4 * i + 3], a12);    // byte 4i+3 low
    a16 = fmaf(q4_centered_scaled<16>(s), x[19 + 4 * i], a16);   // byte 4i+3 high
  }
  return a0 + a4 * 0x1p-4f + a8 * 0x1p-8f + a12 * 0x1p-12f + a16 * 0x1p-16f;
}

__device__ __forceinline__ float FmtQ4_0Planes::dot32(const Block32& blk, const float (&x)[32]) {
  return blk.d * q4_block_dot(blk.codes, x);
}

// 32 consecutive floats of a 16-byte-aligned activation row.
__device__ __forceinline__ void load_x32(const float* __restrict__ x, float (&v)[32]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(x) + i);
    v[4 * i] = a.x, v[4 * i + 1] = a.y, v[4 * i + 2] = a.z, v[4 * i + 3] = a.w;
  }
}

// ---- host side: validation and the one list of formats ---------------------------------------

inline bool is_pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

inline int32_t log2_exact(int64_t v) {
  int32_t s = 0;
  while ((int64_t(1) << s) < v) ++s;
  return s;
}

// Q4_0 rewritten into code and scale planes (FmtQ4_0Planes; repack.cu): ggml's Q4_0 has no
// scale plane.
inline bool is_q4_0_planes(const WeightView& w) {
  return w.dtype == DType::Q4_0 && w.scales != nullptr && w.scales_dtype == DType::F16 && w.group_size == 32;
}

inline DeviceWeight device_weight(const WeightView& w) {
  DeviceWeight d;
  d.data = static_cast<const uint8_t*>(w.data);
  d.scales = static_cast<const uint8_t*>(w.scales);
  d.biases = static_cast<const uint8_t*>(w.biases);
  d.row_bytes = w.row_bytes;
  d.scales_row_bytes = w.scales_row_bytes;
  d.biases_row_bytes = w.biases_row_bytes;
  d.rows = w.rows;
  d.cols = w.cols;
  d.group_shift = w.dtype == DType::INT4_AFFINE ? log2_exact(w.group_size) : 0;
  return d;
}

// Checks the view against its format's geometry; `op` names the caller in the message.
inline void check_weight(const WeightView& w, const char* op) {
  const std::string_view name = dtype_name(w.dtype);
  TS_CHECK(w.data != nullptr || w.rows == 0, "{}: {} weight [{}, {}] has no data", op, name, w.rows, w.cols);
  int64_t packed = 0;
  switch (w.dtype) {
    case DType::F32: packed = 4 * w.cols; break;
    case DType::F16:
    case DType::BF16: packed = 2 * w.cols; break;
    case DType::Q4_0:
      if (is_q4_0_planes(w)) {
        TS_CHECK(w.cols % 32 == 0, "{}: Q4_0 weight [{}, {}] in planes: cols not a multiple of 32", op, w.rows,
                 w.cols);
        TS_CHECK(w.scales_row_bytes >= w.cols / 16 || w.rows <= 1,
                 "{}: Q4_0 weight [{}, {}] in planes: scale row stride {} below {}", op, w.rows, w.cols,
                 w.scales_row_bytes, w.cols / 16);
        packed = w.cols / 2;
        break;
      }
      [[fallthrough]];
    case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: case DType::Q8_0:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K:
      TS_CHECK(w.cols % block_size(w.dtype) == 0, "{}: {} weight [{}, {}]: cols not a multiple of the block size {}",
               op, name, w.rows, w.cols, block_size(w.dtype));
      packed = w.cols / block_size(w.dtype) * block_bytes(w.dtype);
      break;
    case DType::MXFP4:
      TS_CHECK(w.cols % mxfp4::kGroup == 0 && w.scales != nullptr && (w.group_size == 0 || w.group_size == 32),
               "{}: MXFP4 weight [{}, {}]: needs cols % 32 == 0 and an e8m0 scale plane (group 32)", op, w.rows,
               w.cols);
      packed = w.cols / 2;
      break;
    case DType::INT4_AFFINE:
      TS_CHECK(is_pow2(w.group_size) && w.group_size >= kUnit && w.cols % w.group_size == 0 && w.scales &&
                   w.biases && int4_affine::is_plane_dtype(w.scales_dtype),
               "{}: INT4_AFFINE weight [{}, {}]: group size {} (a power of two >= 8 dividing cols), scale/bias "
               "planes of BF16/F16/F32 (got {})",
               op, w.rows, w.cols, w.group_size, dtype_name(w.scales_dtype));
      packed = w.cols / 2;
      break;
    default: fail("{}: unsupported weight dtype {} (weight [{}, {}])", op, name, w.rows, w.cols);
  }
  TS_CHECK(w.row_bytes >= packed || w.rows <= 1, "{}: {} weight [{}, {}]: row stride {} bytes below the row size {}",
           op, name, w.rows, w.cols, w.row_bytes, packed);
}

template <class F>
inline bool aligned_for(const WeightView& w) {
  return (reinterpret_cast<uintptr_t>(w.data) % F::kAlign) == 0 && (w.row_bytes % F::kAlign) == 0;
}

// Calls fn(Format{}) with the format type of w (after check_weight). The list of formats every
// kernel is instantiated for; `op` names the caller in refusals. allow_vec = false keeps float
// formats on their scalar-load variant (a kernel reading several views of which one is
// unaligned).
template <class Fn>
inline void dispatch_weight_format(const WeightView& w, const char* op, Fn&& fn, bool allow_vec = true) {
  check_weight(w, op);
  auto run = [&](auto fmt) {
    using F = decltype(fmt);
    TS_CHECK(aligned_for<F>(w), "{}: {} weight [{}, {}]: data {} / row stride {} bytes not {}-byte aligned", op,
             dtype_name(w.dtype), w.rows, w.cols, w.data, w.row_bytes, F::kAlign);
    fn(fmt);
  };
  switch (w.dtype) {
    case DType::F32: return allow_vec && aligned_for<FmtF32<true>>(w) ? run(FmtF32<true>{}) : run(FmtF32<false>{});
    case DType::F16:
      return allow_vec && aligned_for<FmtHalf<DType::F16, true>>(w) ? run(FmtHalf<DType::F16, true>{})
                                                       : run(FmtHalf<DType::F16, false>{});
    case DType::BF16:
      return allow_vec && aligned_for<FmtHalf<DType::BF16, true>>(w) ? run(FmtHalf<DType::BF16, true>{})
                                                        : run(FmtHalf<DType::BF16, false>{});
    case DType::Q4_0: return is_q4_0_planes(w) ? run(FmtQ4_0Planes{}) : run(FmtQ4_0{});
    case DType::Q4_1: return run(FmtQ4_1{});
    case DType::Q5_0: return run(FmtQ5_0{});
    case DType::Q5_1: return run(FmtQ5_1{});
    case DType::Q8_0: return run(FmtQ8_0{});
    case DType::Q4_K: return run(FmtQK45<false>{});
    case DType::Q5_K: return run(FmtQK45<true>{});
    case DType::Q6_K: return run(FmtQ6_K{});
    case DType::MXFP4: return run(FmtMXFP4{});
    case DType::INT4_AFFINE:
      switch (w.scales_dtype) {
        case DType::BF16: return run(FmtInt4Affine<DType::BF16>{});
        case DType::F16: return run(FmtInt4Affine<DType::F16>{});
        default: return run(FmtInt4Affine<DType::F32>{});
      }
    default: fail("{}: unsupported weight dtype {}", op, dtype_name(w.dtype));
  }
}

// ---- shared device building blocks -------------------------------------------------------------

// 8 consecutive floats of a 16-byte-aligned activation row.
__device__ __forceinline__ void load_x8(const float* __restrict__ x, float (&v)[kUnit]) {
  const float4 a = __ldg(reinterpret_cast<const float4*>(x)), b = __ldg(reinterpret_cast<const float4*>(x) + 1);
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

// This thread's share of dot(weight row, x) over `n_threads` threads (thread `t`), units strided
// by n_threads so consecutive threads read consecutive units. x must be 16-byte aligned.
template <class F>
__device__ __forceinline__ float partial_dot(const WeightRow& w, int64_t cols, const float* __restrict__ x, int t,
                                             int n_threads) {
  const int64_t n_units = cols / kUnit;
  float acc = 0.f;
#pragma unroll 4
  for (int64_t u = t; u < n_units; u += n_threads) {
    float wv[kUnit], xv[kUnit];
    F::unit(w, u, wv);
    load_x8(x + u * kUnit, xv);
#pragma unroll
    for (int i = 0; i < kUnit; ++i) acc = fmaf(wv[i], xv[i], acc);
  }
  if constexpr (F::kTail) {
    for (int64_t i = n_units * kUnit + t; i < cols; i += n_threads) acc = fmaf(F::elem(w, i), __ldg(x + i), acc);
  }
  return acc;
}

}  // namespace turbospark::cuda
