// out[t, :] = scale * dequantized row ids[t] of an embedding table, any weight format.
//
// Bound: memory, and tiny: one table row read and one f32 row written per token (a 4096-wide
// bf16 row is 8 KB in, 16 KB out). One block per token, threads striding over 8-element units
// so a warp reads contiguous table bytes and writes 1 KB of contiguous output.
//
// ids live in device memory; an id outside the table cannot throw on the device, so that row
// is written as NaN, which every comparison downstream fails loudly (the CPU backend throws).
#include "backends/cuda/matmul.h"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda {
namespace {

constexpr int kEmbeddingThreads = 128;

template <class F>
__global__ void __launch_bounds__(kEmbeddingThreads)
    embedding_kernel(DeviceWeight table, const int32_t* __restrict__ ids, float scale, float* __restrict__ out,
                     int64_t out_stride) {
  pdl_begin();
  const int64_t t = blockIdx.x;
  const int32_t id = ids[t];
  float* dst = out + t * out_stride;
  if (id < 0 || id >= table.rows) {
    for (int64_t i = threadIdx.x; i < table.cols; i += kEmbeddingThreads) dst[i] = __int_as_float(0x7fc00000);
    return;
  }
  const WeightRow wr = weight_row(table, id);
  const int64_t n_units = table.cols / kUnit;
  for (int64_t u = threadIdx.x; u < n_units; u += kEmbeddingThreads) {
    float v[kUnit];
    F::unit(wr, u, v);
#pragma unroll
    for (int i = 0; i < kUnit; ++i) dst[u * kUnit + i] = v[i] * scale;
  }
  if constexpr (F::kTail) {
    for (int64_t i = n_units * kUnit + threadIdx.x; i < table.cols; i += kEmbeddingThreads)
      dst[i] = F::elem(wr, i) * scale;
  }
}

}  // namespace

void launch_embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out,
                      cudaStream_t stream) {
  TS_CHECK(n >= 0 && out.rows >= n && out.cols == table.cols,
           "embedding: {} ids into output [{}, {}] from a {} table [{}, {}]", n, out.rows, out.cols,
           dtype_name(table.dtype), table.rows, table.cols);
  dispatch_weight_format(table, "embedding", [&](auto fmt) {
    using F = decltype(fmt);
    if (n == 0) return;
    launch(embedding_kernel<F>, dim3(unsigned(n)), kEmbeddingThreads, 0, stream, device_weight(table), ids, scale,
           out.data, out.stride);
    TS_CUDA_LAUNCH_CHECK("embedding {} [{}, {}] x {} ids", dtype_name(table.dtype), table.rows, table.cols, n);
  });
}

void WeightMatmul::embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out,
                             cudaStream_t stream) {
  launch_embedding(table, ids, n, scale, out, stream);
}

}  // namespace turbospark::cuda
