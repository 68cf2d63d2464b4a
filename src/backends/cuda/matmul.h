// Weight products on the CUDA backend: matmul (GEMV for decode rows, dequantize + cuBLASLt
// GEMM for prefill), embedding lookups and routed-expert FFNs, for every weight format
// (backends/cuda/quant.cuh). The CUDA backend owns one WeightMatmul and calls these; kernels
// and launchers live in gemv.cu, gemm.cu, embedding.cu and moe*.cu (moe.cu dispatches to
// moe_decode.cu and moe_prefill.cu).
//
// Every pointer is device memory: activations (Mat), weight planes (WeightView made resident:
// same byte layout and strides as the checkpoint), token ids, routing indices and weights.
// Nothing here reads device memory on the host or synchronises the stream.
//
// Scratch and graph capture: device scratch (bf16 copies of activations and dequantized
// weight tiles, cuBLASLt workspace, MoE grouping buffers, the expert descriptor tables) grows
// on demand with cudaMalloc, which must not happen while a stream is being captured into a
// graph. The backend therefore runs each captured shape once eagerly (its warm-up step) before
// capture; a call that would still need to grow scratch, or to build a new expert table,
// during capture is refused with a message naming the buffer instead of breaking the capture.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "ops/backend.h"

struct cublasLtContext;  // cublasLt.h's handle type (cublasLtHandle_t), kept out of this header

namespace turbospark::cuda {

// Up to this many activation rows a matmul is a GEMV that reads each weight once for all
// rows, dequantizing in registers with f32 accumulation (gemv.cu); above it the weight is
// dequantized to bf16 and multiplied on tensor cores by cuBLASLt (gemm.cu). At 8 rows the
// GEMV still streams the weight once at close to HBM bandwidth while the GEMM's dequantize
// pass (read quantized, write + re-read bf16) costs ~3x the weight bytes, so the crossover
// sits above 8; the GEMV's per-row accumulators (8 x outputs per warp) cap it here.
constexpr int64_t kGemvMaxRows = 8;
// The same split for routed experts (moe.cu): up to this many rows each (row, expert) pair is
// a GEMV reading expert ids from device memory; above it pairs are grouped by expert on the
// device and each expert's rows multiplied as bf16 tensor-core tiles.
constexpr int64_t kMoeDecodeMaxRows = 8;

// One bank of a layer's streamed experts (expert_slots.h): the experts with ids from the
// previous bank's expert_end (0 for the first) up to expert_end are in their device slots once
// `ready` has fired (an event on the slots' copy stream; null: already). `pairs`: how many of
// the call's (row, expert) pairs name them (the host knows the routing while streaming). The
// grouped prefill projections of a bank wait for its event only, so later banks' loads overlap
// earlier banks' compute; the results are those of one launch over every expert, bit for bit.
struct MoeBank {
  int32_t expert_end = 0;
  int64_t pairs = 0;
  cudaEvent_t ready = nullptr;
};

// Device memory of at least a requested size, grown (never shrunk) on demand.
class DeviceScratch {
 public:
  DeviceScratch() = default;
  ~DeviceScratch();
  DeviceScratch(const DeviceScratch&) = delete;
  DeviceScratch& operator=(const DeviceScratch&) = delete;
  // At least `bytes` (256-byte aligned). Growing calls cudaMalloc, refused naming `what` while
  // `stream` is capturing. The old buffer is kept until this object goes: a captured step
  // graph (a decode step recorded after a short prompt) still addresses it, and a later, larger
  // prefill must not free memory those replays write (freeing it let the next cudaMalloc hand
  // it out again). Growth is by half at least, so the retired buffers add up to at most twice
  // the live one.
  void* get(size_t bytes, cudaStream_t stream, const char* what);
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
  std::vector<void*> retired_;
};

// ---- launchers (the .cu files); shapes are checked, launches named by op and shape ----------

// gemv.cu: y[t, o] = sum_i w[o, i] * x[t, i] for t < y.rows <= kGemvMaxRows. x rows are
// 16-byte aligned (x % 16 == 0, x_stride % 4 == 0) with w.cols floats each.
void launch_gemv(const WeightView& w, const float* x, int64_t x_stride, const Mat& y, int num_sms,
                 cudaStream_t stream);
// gemv.cu: the GEMVs of several weights (at most max_gemv_jobs()) over the same x in one
// launch, each output bit-identical to its own launch_gemv, then acts[i] applied as it is
// stored (acts empty, or one per weight; the same float ops as cuda::unary). Returns false,
// launching nothing, where they cannot share one (formats or load widths differ, a weight takes
// the per-unit int8 path, rows outside 1..kGemvMaxRows): the caller then launches them one by one.
int max_gemv_jobs();
bool launch_gemv_shared_input(std::span<const WeightView* const> ws, const float* x, int64_t x_stride,
                              std::span<const Mat> ys, std::span<const MatmulAct> acts, int num_sms,
                              cudaStream_t stream);
// Whether a GEMV of a [out_rows, cols] weight of this format over `rows` activation rows
// quantizes the activations to int8 per 32 (q8.cuh's dp4a paths: Q4_0 in either layout while
// the codes fit a block's shared memory; ggml-layout Q4_1/Q5_0/Q5_1/Q8_0 for matrices with rows
// enough to skip split-K); else the activations stay f32.
bool gemv_int8_activations(const WeightView& w, int64_t rows, int num_sms);
// moe.cu: whether moe_experts over these experts (expert 0's views) at `rows` rows and top-k
// quantizes x and the hidden activations to int8 per 32 (the dp4a decode kernels: both
// projections Q4_0, both MXFP4 or both Q8_0; sizes multiples of 32, k <= 32);
// else the decode path keeps them f32.
bool moe_int8_activations(const ExpertWeights& e0, int64_t rows, int k);
// Whether a grouped (more than kMoeDecodeMaxRows rows) MoE call of n_pairs (row, expert) pairs
// takes the few-rows-per-expert kernel (moe_prefill.cu moe_grouped_small_kernel) instead of the 128-row
// tiles: by default while pairs average at most 8 an expert; TURBOSPARK_CUDA_MOE_SMALL=0|1
// forces it, where the shapes allow (tests run both).
bool moe_small_groups(int64_t n_pairs, int64_t n_experts, int64_t hidden, int64_t inter);
// moe.cu, the int8 decode kernels (moe_decode.cu): inter rows a warp of the gate/up pass (2 or 4; the
// TURBOSPARK_CUDA_MOE_WIDE_WARPS override is read at every call), and whether the down pass
// splits each token's experts over a block's warps (TURBOSPARK_CUDA_MOE_DOWN_SPLIT likewise).
int moe_gate_up_rows_per_warp(int64_t n_pairs, int64_t inter);
bool moe_down_split(int64_t inter);
// The f32-activation decode kernels of 16-byte-unit experts (vector-aligned BF16 / F16): inter
// rows a gate/up warp (1 or 2; TURBOSPARK_CUDA_MOE_WIDE_WARPS=0 gives 1) and whether the down pass
// splits each token's experts over a block's warps (TURBOSPARK_CUDA_MOE_DOWN_SPLIT=0: not).
int moe_unit_gate_up_rows_per_warp();
bool moe_unit_down_split();
// repack.cu: a ggml Q4_0 weight in device memory (any 2-byte-aligned row stride) rewritten
// into code and f16 scale planes at dst (256-byte aligned, q4_0_planes_bytes long: codes
// first, scales at *scales_offset); returns the view kernels read as FmtQ4_0Planes.
int64_t q4_0_planes_bytes(int64_t rows, int64_t cols, int64_t* scales_offset = nullptr);
WeightView launch_repack_q4_0(const WeightView& raw, void* dst, cudaStream_t stream);
// gemm.cu: rows [row0, row0 + n_rows) of w dequantized to bf16 at out (row-major, ld elements
// per row, ld % 8 == 0, out 16-byte aligned).
void launch_dequant_bf16(const WeightView& w, int64_t row0, int64_t n_rows, void* out, int64_t ld,
                         cudaStream_t stream);
// gemm.cu: x rounded to bf16 at out ([x.rows, x.cols], ld elements per row).
void launch_f32_to_bf16(const Mat& x, void* out, int64_t ld, cudaStream_t stream);
// embedding.cu: out[t, :] = scale * dequantized row ids[t] of table (NaN row for an id outside
// the table: the device cannot throw, and a NaN fails every comparison downstream).
void launch_embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out,
                      cudaStream_t stream);

// ---- the object the backend holds -----------------------------------------------------------

class WeightMatmul {
 public:
  // On the current device.
  WeightMatmul();
  ~WeightMatmul();
  WeightMatmul(const WeightMatmul&) = delete;
  WeightMatmul& operator=(const WeightMatmul&) = delete;

  // y = x W^T, W [out, in] as stored, x [rows, in] f32, y [rows, out] f32 (strided rows).
  // GEMV for rows <= kGemvMaxRows, else bf16 cuBLASLt GEMM (TF32 for F32 weights).
  void matmul(const WeightView& w, const Mat& x, const Mat& y, cudaStream_t stream);
  // ys[i] = acts[i](x ws[i]^T) for every i (acts empty: no activation): GEMV launches of up to
  // max_gemv_jobs() weights where launch_gemv_shared_input can, else one matmul each followed by
  // cuda::unary.
  void matmul_shared_input(std::span<const WeightView* const> ws, const Mat& x, std::span<const Mat> ys,
                           std::span<const MatmulAct> acts, cudaStream_t stream);
  // out[t, :] = scale * dequantized row ids[t] of table, t < n (ids int32, device memory).
  void embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out,
                 cudaStream_t stream);
  // out[t] = sum_j weight[t, j] * expert_{idx[t, j]}(x[t]); idx/weight [x.rows, k] in device
  // memory, never read on the host. `experts` is the layer's host-side list of device views;
  // its descriptor table is uploaded at the first call for that vector (address and size)
  // and reused, re-uploaded only when a view changed (outside capture). `banks` (ascending
  // expert_end, the last = experts.size()): the experts arrive bank by bank (MoeBank); calls
  // that take the decode kernels wait for every bank first.
  void moe_experts(const std::vector<ExpertWeights>& experts, const Mat& x, const int32_t* idx, const float* weight,
                   int k, const Mat& out, cudaStream_t stream, std::span<const MoeBank> banks = {});

  int num_sms() const { return num_sms_; }

 private:
  struct GemmPlan;  // gemm.cu: cuBLASLt descriptors and the chosen algorithm for one shape
  using GemmKey = std::array<int64_t, 10>;
  struct MoeTable {
    void* device = nullptr;            // [n_experts] moe_common.cuh MoeExpertDesc
    std::vector<unsigned char> host;   // the bytes uploaded, to notice a changed vector
  };

  // x itself when its rows are 16-byte aligned, else a copy into aligned scratch.
  const float* aligned_rows(const Mat& x, int64_t* stride, cudaStream_t stream);
  void gemm(const WeightView& w, const Mat& x, const Mat& y, cudaStream_t stream);
  // C[m, n] (column-major, ldc) = op(A)[m, k] * B[k, n] as y^T = W x^T: a, b bf16 (or f32
  // with tf32) row-major views of W [m, k] (lda) and x [n, k] (ldb).
  void lt_matmul(bool tf32, const void* a, int64_t lda, const void* b, int64_t ldb, float* c, int64_t ldc,
                 int64_t m, int64_t n, int64_t k, cudaStream_t stream);
  const MoeTable& moe_table(const std::vector<ExpertWeights>& experts, cudaStream_t stream);

  int num_sms_ = 0;
  cublasLtContext* lt_ = nullptr;
  std::map<GemmKey, std::unique_ptr<GemmPlan>> plans_;
  std::map<std::pair<const void*, size_t>, MoeTable> moe_tables_;

  DeviceScratch workspace_;   // cuBLASLt workspace
  DeviceScratch x_aligned_;   // [rows, round_up(in, 4)] f32: GEMV / MoE inputs whose rows are unaligned
  DeviceScratch x_bf16_;      // [rows, round_up(in, 8)] bf16: GEMM activations
  DeviceScratch w_bf16_;      // [chunk, round_up(in, 8)] bf16: a chunk of dequantized weight rows
  DeviceScratch y_aligned_;   // [rows, round_up(out, 4)] f32: GEMM output when y's rows are unaligned
  DeviceScratch moe_index_;   // int32 grouping buffers: counts, offsets, tiles, sorted pairs, positions
  DeviceScratch moe_hidden_;  // act(gate) * up per (row, expert): [pairs, round_up(inter, 4)] f32 (decode) or
                              // [pairs, round_up(inter, 8)] bf16 in expert order (prefill)
  DeviceScratch moe_x_bf16_;  // [pairs, round_up(hidden, 8)] bf16: prefill activations gathered in expert order
  DeviceScratch moe_out_;     // [pairs, round_up(hidden, 4)] f32: down projection per pair (prefill)
};

}  // namespace turbospark::cuda
