// bf16 tensor-core helpers shared by the attention kernels (attention_prefill_tc.cu,
// attention_decode.cu): packing f32 pairs into bf16x2 registers and mma.sync.m16n8k16.
//
// Fragment layout of m16n8k16 (lane l, r = l / 4, c = l % 4; PTX ISA "Matrix Fragments for
// mma.m16n8k16"): A (16x16, row-major) a0 = (r, 2c..2c+1), a1 = (r + 8, 2c..), a2 = (r, 2c+8..),
// a3 = (r + 8, 2c+8..); B (16x8, column-major) b0 = (k 2c..2c+1, n r), b1 = (k 2c+8.., n r);
// C (16x8, f32) c0, c1 = (r, 2c..2c+1), c2, c3 = (r + 8, 2c..2c+1). The lower k (or column)
// of a pair sits in the low half of its register.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace turbospark::cuda {

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
  return *reinterpret_cast<const uint32_t*>(&v);
}

// The two bf16 of a packed register as exact floats.
__device__ __forceinline__ float bf16x2_lo(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float bf16x2_hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }

// c += a b: A 16x16 row-major (4 regs), B 16x8 column-major (2 regs), C 16x8 f32.
__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace turbospark::cuda
