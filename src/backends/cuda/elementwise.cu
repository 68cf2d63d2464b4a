// Elementwise ops over strided f32 Mats: add, add_bias, swiglu, clamped_swiglu, unary,
// mul_act, copy, split_heads (Backend methods of the same names; math as in
// backends/cpu/kernels.cpp and hybrid_ops.cpp).
//
// Bound: memory, (inputs + 1) x 4 bytes per element at HBM bandwidth. Layout: a 2-D grid,
// x over columns (each thread 4 consecutive columns: one float4 when the operands are
// 16-byte aligned with strides and widths multiples of 4, else 4 scalar accesses that are
// still coalesced across the warp), y over rows. A block is 256 threads; short rows get
// fewer threads in x and more rows in y so that no block is mostly idle.
#include "backends/cuda/act.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace turbospark::cuda {
namespace {

constexpr int kThreads = 256;

// One input of an elementwise op: element (r, c) at p[r * stride + c * col_step]. stride 0
// broadcasts a row vector (bias); col_step 0 broadcasts one column over the row (mul_act's
// 1-column gate).
struct Operand {
  const float* p = nullptr;
  int64_t stride = 0;
  int col_step = 1;
};

struct AddOp {
  __device__ float operator()(float y, float x) const { return y + x; }
};
struct SwigluOp {
  __device__ float operator()(float g, float u) const { return g / (1.f + expf(-g)) * u; }
};
struct ClampedSwigluOp {
  float alpha, limit;
  __device__ float operator()(float g, float u) const {
    const float gc = fminf(g, limit);
    const float uc = fminf(fmaxf(u, -limit), limit);
    const float glu = gc * (1.f / (1.f + expf(-(gc * alpha))));
    return (uc + 1.f) * glu;
  }
};
struct UnaryOp {
  Act act;
  float pre, post;
  __device__ float operator()(float x, float) const { return post * apply_act(act, pre * x); }
};
struct MulActOp {
  Act act;
  __device__ float operator()(float x, float g) const { return x * apply_act(act, g); }
};
struct CopyOp {
  __device__ float operator()(float x, float) const { return x; }
};

__device__ __forceinline__ float4 load4(const Operand& o, int64_t r, int c) {
  const float* p = o.p + r * o.stride;
  if (o.col_step == 0) {
    const float v = p[0];
    return make_float4(v, v, v, v);
  }
  return *reinterpret_cast<const float4*>(p + c);
}

// out[r, c] = f(a[r, c], b[r, c]); out may alias a or b (each thread reads an element before
// writing that element only), so nothing is __restrict__.
template <class F, bool kVec>
__global__ void __launch_bounds__(kThreads) binary_kernel(F f, float* out, int64_t out_stride, Operand a, Operand b,
                                                          int64_t rows, int cols) {
  pdl_begin();
  const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * 4;
  if (c0 >= cols) return;
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += int64_t(gridDim.y) * blockDim.y) {
    float* o = out + r * out_stride;
    if constexpr (kVec) {
      const float4 x = load4(a, r, c0), y = load4(b, r, c0);
      *reinterpret_cast<float4*>(o + c0) = make_float4(f(x.x, y.x), f(x.y, y.y), f(x.z, y.z), f(x.w, y.w));
    } else {
      const float* pa = a.p + r * a.stride;
      const float* pb = b.p + r * b.stride;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = c0 + j;
        if (c < cols) o[c] = f(pa[c * a.col_step], pb[c * b.col_step]);
      }
    }
  }
}

// a[r, h*hd + i] = ab[r, h*2*hd + i], b[r, h*hd + i] = ab[r, h*2*hd + hd + i]. One thread per
// output column pair (a and b together), rows over y.
__global__ void __launch_bounds__(kThreads) split_heads_kernel(const float* __restrict__ ab, int64_t ab_stride,
                                                               int head_dim, int width, float* __restrict__ a,
                                                               int64_t a_stride, float* __restrict__ b,
                                                               int64_t b_stride, int64_t rows) {
  pdl_begin();
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= width) return;
  const int h = c / head_dim, i = c - h * head_dim;
  const int src = 2 * h * head_dim + i;
  for (int64_t r = int64_t(blockIdx.y) * blockDim.y + threadIdx.y; r < rows; r += int64_t(gridDim.y) * blockDim.y) {
    const float* s = ab + r * ab_stride;
    a[r * a_stride + c] = s[src];
    b[r * b_stride + c] = s[src + head_dim];
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

bool vec_ok(const Operand& o) {
  // A broadcast column is read as a scalar; everything else as float4 rows.
  return o.col_step == 0 || (aligned16(o.p) && o.stride % 4 == 0);
}

// threads.x covers columns (4 per thread), threads.y rows, 256 threads in all.
struct Launch {
  dim3 grid, block;
};
Launch launch_shape(int64_t rows, int64_t cols_per_thread_unit) {
  int tx = int(std::min<int64_t>(kThreads, (cols_per_thread_unit + kWarp - 1) / kWarp * kWarp));
  int ty = kThreads / tx;
  const int64_t gx = (cols_per_thread_unit + tx - 1) / tx;
  const int64_t gy = std::min<int64_t>((rows + ty - 1) / ty, 65535);  // rows beyond loop in the kernel
  return {dim3(unsigned(gx), unsigned(gy)), dim3(unsigned(tx), unsigned(ty))};
}

template <class F>
void launch_binary(const char* op, F f, const Mat& out, Operand a, Operand b, cudaStream_t stream) {
  TS_CHECK(out.cols < (int64_t(1) << 30), "{}: {} columns", op, out.cols);
  if (out.rows == 0 || out.cols == 0) return;
  const bool vec = aligned16(out.data) && out.stride % 4 == 0 && out.cols % 4 == 0 && vec_ok(a) && vec_ok(b);
  const Launch l = launch_shape(out.rows, (out.cols + 3) / 4);
  if (vec) {
    launch(binary_kernel<F, true>, l.grid, l.block, 0, stream, f, out.data, out.stride, a, b, out.rows, int(out.cols));
  } else {
    launch(binary_kernel<F, false>, l.grid, l.block, 0, stream, f, out.data, out.stride, a, b, out.rows, int(out.cols));
  }
  TS_CUDA_LAUNCH_CHECK("{} [{}, {}] (out stride {}, a stride {}, b stride {}, vec {})", op, out.rows, out.cols,
                       out.stride, a.stride, b.stride, vec);
}

Operand operand(const Mat& m) { return Operand{m.data, m.stride, 1}; }

void check_same_shape(const char* op, const Mat& a, const Mat& b) {
  TS_CHECK(a.rows == b.rows && a.cols == b.cols, "{}: shapes [{}, {}] and [{}, {}] differ", op, a.rows, a.cols,
           b.rows, b.cols);
}

}  // namespace

void add(const Mat& y, const Mat& x, cudaStream_t stream) {
  check_same_shape("add", y, x);
  launch_binary("add", AddOp{}, y, operand(y), operand(x), stream);
}

void add_bias(const Mat& y, const float* bias, cudaStream_t stream) {
  launch_binary("add_bias", AddOp{}, y, operand(y), Operand{bias, 0, 1}, stream);
}

void swiglu(const Mat& gate, const Mat& up, const Mat& out, cudaStream_t stream) {
  check_same_shape("swiglu", gate, up);
  check_same_shape("swiglu", gate, out);
  launch_binary("swiglu", SwigluOp{}, out, operand(gate), operand(up), stream);
}

void clamped_swiglu(const Mat& gate, const Mat& up, float alpha, float limit, const Mat& out, cudaStream_t stream) {
  check_same_shape("clamped_swiglu", gate, up);
  check_same_shape("clamped_swiglu", gate, out);
  launch_binary("clamped_swiglu", ClampedSwigluOp{alpha, limit}, out, operand(gate), operand(up), stream);
}

void unary(const Mat& x, Act act, float pre, float post, const Mat& y, cudaStream_t stream) {
  check_same_shape("unary", x, y);
  launch_binary("unary", UnaryOp{act, pre, post}, y, operand(x), operand(x), stream);
}

void mul_act(const Mat& x, const Mat& gate, Act act, cudaStream_t stream) {
  TS_CHECK(gate.rows == x.rows && (gate.cols == x.cols || gate.cols == 1),
           "mul_act: gate [{}, {}] for x [{}, {}] (needs {} columns or 1)", gate.rows, gate.cols, x.rows, x.cols,
           x.cols);
  const Operand g{gate.data, gate.stride, gate.cols == 1 && x.cols != 1 ? 0 : 1};
  launch_binary("mul_act", MulActOp{act}, x, operand(x), g, stream);
}

void copy(const Mat& src, const Mat& dst, cudaStream_t stream) {
  check_same_shape("copy", src, dst);
  launch_binary("copy", CopyOp{}, dst, operand(src), operand(src), stream);
}

void split_heads(const Mat& ab, int n_heads, int head_dim, const Mat& a, const Mat& b, cudaStream_t stream) {
  const int64_t width = int64_t(n_heads) * head_dim;
  TS_CHECK(ab.cols >= 2 * width && a.cols >= width && b.cols >= width && a.rows == ab.rows && b.rows == ab.rows,
           "split_heads: ab [{}, {}] into a [{}, {}], b [{}, {}] for {} heads of {}", ab.rows, ab.cols, a.rows, a.cols,
           b.rows, b.cols, n_heads, head_dim);
  if (ab.rows == 0 || width == 0) return;
  // One thread per column of a (and of b): 1 read-pair and 2 writes, coalesced along columns.
  const Launch l = launch_shape(ab.rows, width);
  launch(split_heads_kernel, l.grid, l.block, 0, stream, ab.data, ab.stride, head_dim, int(width), a.data, a.stride,
         b.data, b.stride, ab.rows);
  TS_CUDA_LAUNCH_CHECK("split_heads [{}, {}] heads {} head_dim {}", ab.rows, ab.cols, n_heads, head_dim);
}

}  // namespace turbospark::cuda
