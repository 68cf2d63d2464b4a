// Paged KV cache writes (Backend::kv_write): row t of k and v ([rows, n_kv_heads * head_dim])
// goes to position positions[t] of sequence row_seq[t] (0 when row_seq is null), i.e. to
// physical block block_table[seq * max_blocks + pos / block_size], row pos % block_size of
// the pools ([n_blocks, block_size, n_kv_heads, head_dim] bf16, rounded to nearest even).
//
// Bound: memory, 12 bytes per element (k and v, f32 read + bf16 write). One thread per 4
// columns of a row (a float4 read and an 8-byte write when k, v, strides and pools allow it:
// the pool row of a position starts at a multiple of n_kv_heads * head_dim elements), rows
// over grid y. The block-table lookup is
// one int32 per row, shared by the row's threads through L1.
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"
#include "backends/cuda/paged_kv.cuh"

namespace turbospark::cuda {
namespace {

constexpr int kThreads = 256;

template <bool kVec>
__global__ void __launch_bounds__(kThreads)
    kv_write_kernel(uint16_t* __restrict__ k_pool, uint16_t* __restrict__ v_pool, const int32_t* __restrict__ block_table,
                    int max_blocks, const int32_t* __restrict__ row_seq, int block_size, int width,
                    const float* __restrict__ k, int64_t k_stride, const float* __restrict__ v, int64_t v_stride,
                    const int64_t* __restrict__ positions, int64_t rows) {
  pdl_begin();
  const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (c0 >= width) return;
  for (int64_t t = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; t < rows; t += int64_t(gridDim.y) * blockDim.y) {
    const int64_t pos = positions[t];
    const int seq = row_seq ? row_seq[t] : 0;
    const int64_t block = block_table[int64_t(seq) * max_blocks + pos / block_size];
    const int64_t off = (block * block_size + pos % block_size) * width;
    const float* kr = k + t * k_stride;
    const float* vr = v + t * v_stride;
    if constexpr (kVec) {
      const float4 a = *reinterpret_cast<const float4*>(kr + c0), b = *reinterpret_cast<const float4*>(vr + c0);
      *reinterpret_cast<uint2*>(k_pool + off + c0) = make_uint2(
          f32_to_bf16_bits(a.x) | uint32_t(f32_to_bf16_bits(a.y)) << 16,
          f32_to_bf16_bits(a.z) | uint32_t(f32_to_bf16_bits(a.w)) << 16);
      *reinterpret_cast<uint2*>(v_pool + off + c0) = make_uint2(
          f32_to_bf16_bits(b.x) | uint32_t(f32_to_bf16_bits(b.y)) << 16,
          f32_to_bf16_bits(b.z) | uint32_t(f32_to_bf16_bits(b.w)) << 16);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (c0 + j < width) {
          k_pool[off + c0 + j] = f32_to_bf16_bits(kr[c0 + j]);
          v_pool[off + c0 + j] = f32_to_bf16_bits(vr[c0 + j]);
        }
      }
    }
  }
}

bool aligned(const void* p, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(p) & (bytes - 1)) == 0; }

}  // namespace

void check_bf16_pools(const char* op, const KvLayerView& kv) {
  TS_CHECK(kv.type == KvType::kBf16, "{}: the CUDA backend's KV pools are bf16 (this view's are not)", op);
}

void kv_write(const KvLayerView& kv, const Mat& k, const Mat& v, const int64_t* positions, cudaStream_t stream) {
  check_bf16_pools("kv_write", kv);
  const int64_t width = int64_t(kv.n_kv_heads) * kv.head_dim;
  TS_CHECK(k.cols == width && v.cols == width && k.rows == v.rows,
           "kv_write: k [{}, {}], v [{}, {}] for {} kv heads of {}", k.rows, k.cols, v.rows, v.cols, kv.n_kv_heads,
           kv.head_dim);
  TS_CHECK(kv.block_size > 0 && kv.max_blocks > 0, "kv_write: block_size {}, max_blocks {}", kv.block_size,
           kv.max_blocks);
  if (k.rows == 0 || width == 0) return;
  const bool vec = width % 4 == 0 && aligned(kv.k, 8) && aligned(kv.v, 8) && aligned(k.data, 16) && aligned(v.data, 16) &&
                   k.stride % 4 == 0 && v.stride % 4 == 0;
  const int64_t units = (width + 3) / 4;  // threads per row
  const int tx = int(std::min<int64_t>(kThreads, (units + kWarp - 1) / kWarp * kWarp));
  const int ty = kThreads / tx;
  const dim3 grid(unsigned((units + tx - 1) / tx), unsigned(std::min<int64_t>((k.rows + ty - 1) / ty, 65535)));
  if (vec) {
    launch(kv_write_kernel<true>, grid, dim3(tx, ty), 0, stream, static_cast<uint16_t*>(kv.k),
           static_cast<uint16_t*>(kv.v), kv.block_table, kv.max_blocks, kv.row_seq, kv.block_size, int(width), k.data,
           k.stride, v.data, v.stride, positions, k.rows);
  } else {
    launch(kv_write_kernel<false>, grid, dim3(tx, ty), 0, stream, static_cast<uint16_t*>(kv.k),
           static_cast<uint16_t*>(kv.v), kv.block_table, kv.max_blocks, kv.row_seq, kv.block_size, int(width), k.data,
           k.stride, v.data, v.stride, positions, k.rows);
  }
  TS_CUDA_LAUNCH_CHECK("kv_write rows {} kv_heads {} head_dim {} block_size {}", k.rows, kv.n_kv_heads, kv.head_dim,
                       kv.block_size);
}

}  // namespace turbospark::cuda
