// Depthwise causal conv over time with carried state (Backend::causal_conv1d): GatedDeltaNet's
// conv over q/k/v (kernel 4, dilation 1) and PLE's conv over the n-gram streams (dilation =
// ngram_size). out[t, c] = act(sum_k w[c, k] * h[t + k * dilation, c]) over the history h =
// the state's span = (K - 1) * dilation rows, oldest first, followed by the micro-batch's rows;
// then the state becomes the last `span` rows of h. Math as backends/cpu/hybrid_ops.cpp (taps
// summed in k order, precise expf).
//
// Bound: memory, one read of `in` and one write of `out` (the K taps of a column re-read rows
// that L1/L2 already hold). Layout: 2-D grid, x over channels (a thread per channel: adjacent
// threads read adjacent floats of a row), y over tiles of kRowsPerBlock rows. With several
// tiles the state moves in a second launch, after every output has read the old state; with
// one (decode, short micro-batches) each thread moves its own channel's state after its
// outputs, in the same launch. Rows of one column never race, and the update walks r upwards
// so that h[n + r] is read before row r is overwritten when n < span (the history's source row
// n + r lies past r).
#include "backends/cuda/act.cuh"
#include "backends/cuda/common.cuh"
#include "backends/cuda/ops.h"

namespace turbospark::cuda {
namespace {

constexpr int kChannelThreads = 128;
constexpr int kRowsPerBlock = 16;

// Row i of the history: a state row for i < span, else row i - span of the micro-batch.
__device__ __forceinline__ float history(const float* in, int64_t in_stride, const float* state, int64_t state_stride,
                                         int64_t span, int64_t i, int c) {
  return i < span ? state[i * state_stride + c] : in[(i - span) * in_stride + c];
}

// The state moved by one thread per channel (see above).
__device__ __forceinline__ void move_state(const float* __restrict__ in, int64_t in_stride, float* state,
                                           int64_t state_stride, int64_t span, int64_t rows, int c) {
  for (int64_t r = 0; r < span; ++r)
    state[r * state_stride + c] = history(in, in_stride, state, state_stride, span, rows + r, c);
}

// kMoveState: one tile of rows (gridDim.y == 1), the state moved after the outputs.
template <bool kMoveState>
__global__ void __launch_bounds__(kChannelThreads)
    conv_out_kernel(const float* __restrict__ in, int64_t in_stride, const float* __restrict__ w, int kernel,
                    int dilation, float* state, int64_t state_stride, Act act, float* out, int64_t out_stride,
                    int64_t rows, int channels) {
  pdl_begin();
  const int c = blockIdx.x * kChannelThreads + threadIdx.x;
  if (c >= channels) return;
  const int64_t span = int64_t(kernel - 1) * dilation;
  const int64_t t0 = int64_t(blockIdx.y) * kRowsPerBlock;
  const int64_t t1 = t0 + kRowsPerBlock < rows ? t0 + kRowsPerBlock : rows;
  for (int64_t t = t0; t < t1; ++t) {
    float acc = 0.f;
    for (int k = 0; k < kernel; ++k) {
      acc += w[int64_t(c) * kernel + k] * history(in, in_stride, state, state_stride, span, t + int64_t(k) * dilation, c);
    }
    out[t * out_stride + c] = apply_act(act, acc);
  }
  if constexpr (kMoveState) move_state(in, in_stride, state, state_stride, span, rows, c);
}

__global__ void __launch_bounds__(kChannelThreads)
    conv_state_kernel(const float* __restrict__ in, int64_t in_stride, float* state, int64_t state_stride,
                      int64_t span, int64_t rows, int channels) {
  pdl_begin();
  const int c = blockIdx.x * kChannelThreads + threadIdx.x;
  if (c >= channels) return;
  move_state(in, in_stride, state, state_stride, span, rows, c);
}

}  // namespace

void causal_conv1d(const Mat& in, const float* w, int kernel, int dilation, const Mat& state, Act act, const Mat& out,
                   cudaStream_t stream) {
  const int64_t ch = in.cols, span = int64_t(kernel - 1) * dilation;
  TS_CHECK(kernel >= 1 && dilation >= 1, "causal_conv1d: kernel {} dilation {}", kernel, dilation);
  TS_CHECK(state.rows == span && state.cols == ch, "conv state is [{}, {}], expected [{}, {}]", state.rows,
           state.cols, span, ch);
  TS_CHECK(out.rows == in.rows && out.cols == ch, "causal_conv1d: out [{}, {}] for in [{}, {}]", out.rows, out.cols,
           in.rows, ch);
  // Outputs are written while other threads still read the inputs' rows.
  TS_CHECK(out.data != in.data, "causal_conv1d: out may not alias in on CUDA");
  TS_CHECK(ch <= 0x7fffffff && in.rows / kRowsPerBlock < 65535, "causal_conv1d: [{}, {}] too large", in.rows, ch);
  if (in.rows == 0 || ch == 0) return;
  const dim3 grid(unsigned(ceil_div(ch, kChannelThreads)), unsigned(ceil_div(in.rows, kRowsPerBlock)));
  const bool one_tile = grid.y == 1;
  launch(one_tile ? conv_out_kernel<true> : conv_out_kernel<false>, grid, kChannelThreads, 0, stream, in.data,
         in.stride, w, kernel, dilation, state.data, state.stride, act, out.data, out.stride, in.rows, int(ch));
  TS_CUDA_LAUNCH_CHECK("causal_conv1d [{}, {}] kernel {} dilation {}", in.rows, ch, kernel, dilation);
  if (span == 0 || one_tile) return;
  launch(conv_state_kernel, unsigned(ceil_div(ch, kChannelThreads)), kChannelThreads, 0, stream, in.data, in.stride,
         state.data, state.stride, span, in.rows, int(ch));
  TS_CUDA_LAUNCH_CHECK("causal_conv1d state [{}, {}]", span, ch);
}

}  // namespace turbospark::cuda
