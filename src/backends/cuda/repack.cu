// Q4_0 weights rewritten at upload from ggml's 18-byte blocks (f16 scale + 16 code bytes, so
// only 2-byte aligned) into two planes: codes [rows, cols / 2] with block b of a row at 16 b,
// and f16 scales [rows, cols / 32]. Kernels read the result as FmtQ4_0Planes (quant.cuh): one
// 16-byte load per 32 elements instead of nine 2-byte loads. Values are unchanged, bit for bit.
//
// One thread per block: it reads its 18 bytes as nine 16-bit words and writes one 16-byte
// store and one 2-byte store. Bound: HBM (the pass reads 18 and writes 18 bytes per block);
// it runs once per weight at load, in the upload stream.
#include "backends/cuda/matmul.h"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda {
namespace {

__global__ void repack_q4_0_kernel(const uint8_t* __restrict__ src, int64_t src_row_bytes, int64_t rows,
                                   int64_t blocks_per_row, uint8_t* __restrict__ codes, uint8_t* __restrict__ scales) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * blocks_per_row) return;
  const int64_t r = i / blocks_per_row, b = i % blocks_per_row;
  const uint8_t* blk = src + r * src_row_bytes + b * int64_t(sizeof(BlockQ4_0));
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = ld_u32_a2(blk + 2 + 4 * k);
  *reinterpret_cast<uint4*>(codes + i * 16) = make_uint4(w[0], w[1], w[2], w[3]);
  *reinterpret_cast<uint16_t*>(scales + i * 2) = uint16_t(ld_u16(blk));
}

}  // namespace

int64_t q4_0_planes_bytes(int64_t rows, int64_t cols, int64_t* scales_offset) {
  const int64_t codes = rows * cols / 2;
  const int64_t aligned = (codes + 255) / 256 * 256;
  if (scales_offset) *scales_offset = aligned;
  return aligned + rows * (cols / 32) * 2;
}

WeightView launch_repack_q4_0(const WeightView& raw, void* dst, cudaStream_t stream) {
  TS_CHECK(raw.dtype == DType::Q4_0 && !raw.scales && raw.cols % 32 == 0 &&
               raw.row_bytes >= raw.cols / 32 * int64_t(sizeof(BlockQ4_0)) && reinterpret_cast<uintptr_t>(raw.data) % 2 == 0 &&
               raw.row_bytes % 2 == 0,
           "repack_q4_0: weight [{}, {}] of {} is not ggml Q4_0 with 2-byte aligned rows", raw.rows, raw.cols,
           dtype_name(raw.dtype));
  TS_CHECK(reinterpret_cast<uintptr_t>(dst) % 256 == 0, "repack_q4_0: destination {} not 256-byte aligned", dst);
  int64_t scales_offset = 0;
  q4_0_planes_bytes(raw.rows, raw.cols, &scales_offset);
  WeightView v = raw;
  v.data = dst;
  v.row_bytes = raw.cols / 2;
  v.scales = static_cast<uint8_t*>(dst) + scales_offset;
  v.scales_row_bytes = raw.cols / 16;
  v.scales_dtype = DType::F16;
  v.group_size = 32;
  const int64_t n = raw.rows * (raw.cols / 32);
  if (n == 0) return v;
  constexpr int kThreads = 256;
  repack_q4_0_kernel<<<unsigned((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(raw.data), raw.row_bytes, raw.rows, raw.cols / 32,
      static_cast<uint8_t*>(const_cast<void*>(v.data)), static_cast<uint8_t*>(const_cast<void*>(v.scales)));
  TS_CUDA_LAUNCH_CHECK("repack_q4_0 [{}, {}]", raw.rows, raw.cols);
  return v;
}

}  // namespace turbospark::cuda
