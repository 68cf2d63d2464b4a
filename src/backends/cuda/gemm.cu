// y = x W^T for many activation rows (prefill), any weight format: activations rounded to
// bf16, weights dequantized to bf16 in chunks of output rows, then cuBLASLt bf16 x bf16 with
// f32 compute and f32 output written straight into y (honouring y's row stride).
//
// Bound: FLOPs on the tensor cores once rows are in the hundreds (2 * rows * in * out at
// ~700+ dense bf16 TFLOP/s on an H200 in cuBLASLt's best kernels); the dequantize pass is
// memory-bound (read the quantized weight, write 2 bytes per element) and costs about the
// time the GEMM needs at ~300 rows, so it matters for short prefill chunks. Fusing the
// dequantization into the GEMM's B-tile loads is the known next step (mmq-style).
//
// Weight formats without the dequantize pass (when their rows are 16-byte aligned):
//  - BF16 weights go to cuBLASLt in place (lda = row stride), no copy.
//  - F32 weights use TF32 tensor cores on the f32 weight and f32 activations in place
//    (CUBLAS_COMPUTE_32F_FAST_TF32): no scratch, no conversion pass, and a 10-bit mantissa on
//    both operands, closer to the f32 CPU reference than bf16's 7 bits. F32 checkpoints are
//    the small test fixtures, where agreement with transformers matters more than speed.
// This file also owns WeightMatmul's construction, scratch and matmul() dispatch.
#include <cublasLt.h>

#include <algorithm>

#include "backends/cuda/matmul.h"
#include "backends/cuda/ops.h"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda {
namespace {

#define TS_CUBLAS_CHECK(expr, ...)                                                                          \
  do {                                                                                                      \
    cublasStatus_t ts_st_ = (expr);                                                                         \
    if (ts_st_ != CUBLAS_STATUS_SUCCESS)                                                                    \
      ::turbospark::fail("cublasLt: {}: status {}", ::fmt::format(__VA_ARGS__), int(ts_st_));               \
  } while (0)

constexpr size_t kLtWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper
constexpr size_t kWeightChunkBytes = size_t(64) << 20;  // bf16 dequantized weight rows per GEMM call
constexpr int kDequantThreads = 128;

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The alignment (<= 256 bytes) of every row start of a matrix at p with rows ld_bytes apart.
int alignment_of(const void* p, int64_t ld_bytes) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p) | uintptr_t(ld_bytes);
  int al = 256;
  while (al > 1 && a % al) al /= 2;
  return al;
}

// One weight row per block, its threads striding over 8-element units: each unit is one
// 16-byte bf16 store (ld % 8 == 0), consecutive threads consecutive units (coalesced).
template <class F>
__global__ void __launch_bounds__(kDequantThreads)
    dequant_bf16_kernel(DeviceWeight w, int64_t row0, __nv_bfloat16* __restrict__ out, int64_t ld) {
  const int64_t r = blockIdx.x;
  const WeightRow wr = weight_row(w, row0 + r);
  __nv_bfloat16* dst = out + r * ld;
  const int64_t n_units = w.cols / kUnit;
  for (int64_t u = threadIdx.x; u < n_units; u += kDequantThreads) {
    float v[kUnit];
    F::unit(wr, u, v);
    store_bf16x8(dst + u * kUnit, v);
  }
  if constexpr (F::kTail) {
    for (int64_t i = n_units * kUnit + threadIdx.x; i < w.cols; i += kDequantThreads)
      dst[i] = __float2bfloat16_rn(F::elem(wr, i));
  }
}

// One activation row per block; memory-bound (4 bytes in, 2 out per element).
__global__ void f32_to_bf16_kernel(const float* __restrict__ x, int64_t x_stride, int64_t cols,
                                   __nv_bfloat16* __restrict__ out, int64_t ld) {
  const int64_t r = blockIdx.x;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[r * ld + c] = __float2bfloat16_rn(x[r * x_stride + c]);
}

}  // namespace

// ---- launchers ------------------------------------------------------------------------------

void launch_dequant_bf16(const WeightView& w, int64_t row0, int64_t n_rows, void* out, int64_t ld,
                         cudaStream_t stream) {
  TS_CHECK(row0 >= 0 && n_rows >= 0 && row0 + n_rows <= w.rows && ld % 8 == 0 && ld >= w.cols &&
               reinterpret_cast<uintptr_t>(out) % 16 == 0,
           "dequant_bf16: rows [{}, {}) of a [{}, {}] weight into ld {}", row0, row0 + n_rows, w.rows, w.cols, ld);
  dispatch_weight_format(w, "dequant_bf16", [&](auto fmt) {
    using F = decltype(fmt);
    if (n_rows == 0) return;
    dequant_bf16_kernel<F><<<dim3(unsigned(n_rows)), kDequantThreads, 0, stream>>>(
        device_weight(w), row0, static_cast<__nv_bfloat16*>(out), ld);
    TS_CUDA_LAUNCH_CHECK("dequant_bf16 {} [{}, {}] rows {} + {}", dtype_name(w.dtype), w.rows, w.cols, row0, n_rows);
  });
}

void launch_f32_to_bf16(const Mat& x, void* out, int64_t ld, cudaStream_t stream) {
  TS_CHECK(ld >= x.cols, "f32_to_bf16: [{}, {}] into ld {}", x.rows, x.cols, ld);
  if (x.rows == 0) return;
  f32_to_bf16_kernel<<<dim3(unsigned(x.rows)), 256, 0, stream>>>(x.data, x.stride, x.cols,
                                                                 static_cast<__nv_bfloat16*>(out), ld);
  TS_CUDA_LAUNCH_CHECK("f32_to_bf16 [{}, {}] stride {}", x.rows, x.cols, x.stride);
}

// ---- scratch ----------------------------------------------------------------------------------

DeviceScratch::~DeviceScratch() {
  if (ptr_) cudaFree(ptr_);
  for (void* p : retired_) cudaFree(p);
}

void* DeviceScratch::get(size_t bytes, cudaStream_t stream, const char* what) {
  if (bytes <= bytes_ && ptr_) return ptr_;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  TS_CUDA_CHECK(cudaStreamIsCapturing(stream, &status), "scratch {}", what);
  TS_CHECK(status == cudaStreamCaptureStatusNone,
           "cuda scratch {} must grow to {} bytes (has {}) while a graph is being captured: run the shape once "
           "before capture",
           what, bytes, bytes_);
  const size_t grown = std::max(bytes, bytes_ + bytes_ / 2);
  const size_t rounded = (std::max<size_t>(grown, 256) + 255) / 256 * 256;
  if (ptr_) retired_.push_back(ptr_);
  ptr_ = nullptr;
  bytes_ = 0;
  TS_CUDA_CHECK(cudaMalloc(&ptr_, rounded), "scratch {} of {} bytes", what, rounded);
  bytes_ = rounded;
  return ptr_;
}

// ---- WeightMatmul ------------------------------------------------------------------------------

struct WeightMatmul::GemmPlan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~GemmPlan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

WeightMatmul::WeightMatmul() {
  int device = 0;
  TS_CUDA_CHECK(cudaGetDevice(&device), "WeightMatmul: current device");
  TS_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device),
                "WeightMatmul: SM count of device {}", device);
  cublasLtHandle_t handle = nullptr;
  TS_CUBLAS_CHECK(cublasLtCreate(&handle), "create handle");
  lt_ = handle;
  // The workspace is taken now, outside any capture, at its final size.
  workspace_.get(kLtWorkspaceBytes, nullptr, "cublasLt workspace");
}

WeightMatmul::~WeightMatmul() {
  plans_.clear();
  for (auto& [key, table] : moe_tables_)
    if (table.device) cudaFree(table.device);
  if (lt_) cublasLtDestroy(lt_);
}

const float* WeightMatmul::aligned_rows(const Mat& x, int64_t* stride, cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(x.data) % 16 == 0 && x.stride % 4 == 0) {
    *stride = x.stride;
    return x.data;
  }
  const int64_t ld = round_up(x.cols, 4);
  auto* dst = static_cast<float*>(x_aligned_.get(size_t(x.rows * ld) * 4, stream, "aligned activations"));
  TS_CUDA_CHECK(cudaMemcpy2DAsync(dst, size_t(ld) * 4, x.data, size_t(x.stride) * 4, size_t(x.cols) * 4,
                                  size_t(x.rows), cudaMemcpyDeviceToDevice, stream),
                "align activations [{}, {}] stride {}", x.rows, x.cols, x.stride);
  *stride = ld;
  return dst;
}

void WeightMatmul::lt_matmul(bool tf32, const void* a, int64_t lda, const void* b, int64_t ldb, float* c,
                             int64_t ldc, int64_t m, int64_t n, int64_t k, cudaStream_t stream) {
  const int64_t in_bytes = tf32 ? 4 : 2;
  const GemmKey key = {tf32, m, n, k, lda, ldb, ldc, alignment_of(a, lda * in_bytes), alignment_of(b, ldb * in_bytes),
                       alignment_of(c, ldc * 4)};
  auto it = plans_.find(key);
  if (it == plans_.end()) {
    auto plan = std::make_unique<GemmPlan>();
    const cudaDataType_t in_type = tf32 ? CUDA_R_32F : CUDA_R_16BF;
    TS_CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F,
                                             CUDA_R_32F),
                    "matmul desc");
    const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
    TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a),
                    "transa");
    TS_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b),
                    "transb");
    // Column-major views: A = W^T [k, m] (ld lda), B = x^T [k, n] (ld ldb), C = y^T [m, n] (ld ldc).
    TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, in_type, uint64_t(k), uint64_t(m), lda), "layout A");
    TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, in_type, uint64_t(k), uint64_t(n), ldb), "layout B");
    TS_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, CUDA_R_32F, uint64_t(m), uint64_t(n), ldc), "layout C");
    cublasLtMatmulPreference_t pref = nullptr;
    TS_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref), "preference");
    const uint64_t ws = kLtWorkspaceBytes;
    const uint32_t al_a = uint32_t(key[7]), al_b = uint32_t(key[8]), al_c = uint32_t(key[9]);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof al_a);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof al_b);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof al_c);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof al_c);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(lt_), plan->op, plan->a,
                                                             plan->b, plan->c, plan->c, pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    TS_CHECK(st == CUBLAS_STATUS_SUCCESS && found > 0,
             "cublasLt: no {} algorithm for m {} n {} k {} (lda {} ldb {} ldc {}, alignments {}/{}/{}): status {}",
             tf32 ? "tf32" : "bf16", m, n, k, lda, ldb, ldc, al_a, al_b, al_c, int(st));
    plan->algo = result.algo;
    it = plans_.emplace(key, std::move(plan)).first;
  }
  const GemmPlan& plan = *it->second;
  const float alpha = 1.f, beta = 0.f;  // beta 0: C is written only (NaN-poisoned y stays harmless)
  TS_CUBLAS_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(lt_), plan.op, &alpha, a, plan.a, b, plan.b, &beta, c,
                                 plan.c, c, plan.c, &plan.algo, workspace_.get(kLtWorkspaceBytes, stream, "cublasLt"),
                                 kLtWorkspaceBytes, stream),
                  "{} matmul m {} n {} k {}", tf32 ? "tf32" : "bf16", m, n, k);
}

void WeightMatmul::gemm(const WeightView& w, const Mat& x, const Mat& y, cudaStream_t stream) {
  const int64_t rows = x.rows, in = w.cols, out = w.rows;
  // Every cuBLASLt operand is 16-byte aligned (pointer and row stride), so its fast kernels
  // apply: an unaligned output goes through scratch, unaligned F32/BF16 weights through the
  // dequantize pass.
  auto aligned16 = [](const void* p, int64_t stride_bytes) {
    return reinterpret_cast<uintptr_t>(p) % 16 == 0 && stride_bytes % 16 == 0;
  };
  const bool y_aligned = aligned16(y.data, y.stride * 4);
  const int64_t ldc = y_aligned ? y.stride : round_up(out, 4);
  float* c = y_aligned ? y.data
                       : static_cast<float*>(y_aligned_.get(size_t(rows * ldc) * 4, stream, "aligned gemm output"));
  if (w.dtype == DType::F32 && aligned16(w.data, w.row_bytes)) {
    int64_t ldx = 0;
    const float* xa = aligned_rows(x, &ldx, stream);
    lt_matmul(true, w.data, w.row_bytes / 4, xa, ldx, c, ldc, out, rows, in, stream);
  } else {
    const int64_t ldx = round_up(in, 8);
    void* xb = x_bf16_.get(size_t(rows * ldx) * 2, stream, "bf16 activations");
    launch_f32_to_bf16(x, xb, ldx, stream);
    if (w.dtype == DType::BF16 && aligned16(w.data, w.row_bytes)) {
      lt_matmul(false, w.data, w.row_bytes / 2, xb, ldx, c, ldc, out, rows, in, stream);
    } else {
      // Dequantize chunks of output rows (multiples of 128, the GEMM tile) into one bounded buffer.
      const int64_t ldw = round_up(in, 8);
      int64_t chunk = int64_t(kWeightChunkBytes) / (2 * ldw) / 128 * 128;
      chunk = std::clamp<int64_t>(chunk, 128, 65536);
      chunk = std::min(chunk, out);
      void* wb = w_bf16_.get(size_t(chunk * ldw) * 2, stream, "bf16 weight chunk");
      for (int64_t o0 = 0; o0 < out; o0 += chunk) {
        const int64_t n = std::min(chunk, out - o0);
        launch_dequant_bf16(w, o0, n, wb, ldw, stream);
        lt_matmul(false, wb, ldw, xb, ldx, c + o0, ldc, n, rows, in, stream);
      }
    }
  }
  if (!y_aligned)
    TS_CUDA_CHECK(cudaMemcpy2DAsync(y.data, size_t(y.stride) * 4, c, size_t(ldc) * 4, size_t(out) * 4, size_t(rows),
                                    cudaMemcpyDeviceToDevice, stream),
                  "gemm output [{}, {}] to stride {}", rows, out, y.stride);
}

void WeightMatmul::matmul(const WeightView& w, const Mat& x, const Mat& y, cudaStream_t stream) {
  check_weight(w, "matmul");
  TS_CHECK(x.cols == w.cols && y.cols == w.rows && y.rows == x.rows,
           "matmul: {} weight [{}, {}] with x [{}, {}] and y [{}, {}]", dtype_name(w.dtype), w.rows, w.cols, x.rows,
           x.cols, y.rows, y.cols);
  if (x.rows == 0 || w.rows == 0) return;
  if (x.rows <= kGemvMaxRows) {
    int64_t stride = 0;
    const float* xa = aligned_rows(x, &stride, stream);
    launch_gemv(w, xa, stride, y, num_sms_, stream);
  } else {
    gemm(w, x, y, stream);
  }
}

void WeightMatmul::matmul_shared_input(std::span<const WeightView* const> ws, const Mat& x, std::span<const Mat> ys,
                                       std::span<const MatmulAct> acts, cudaStream_t stream) {
  TS_CHECK(ws.size() == ys.size() && (acts.empty() || acts.size() == ws.size()),
           "matmul_shared_input: {} weights, {} outputs, {} activations", ws.size(), ys.size(), acts.size());
  auto act_of = [&](size_t i) { return acts.empty() ? MatmulAct{} : acts[i]; };
  auto one_by_one = [&](size_t first, size_t n) {
    for (size_t i = first; i < first + n; ++i) {
      matmul(*ws[i], x, ys[i], stream);
      const MatmulAct a = act_of(i);
      if (!a.is_identity()) unary(ys[i], a.act, a.pre, a.post, ys[i], stream);
    }
  };
  bool shapes = x.rows >= 1 && x.rows <= kGemvMaxRows;
  for (size_t i = 0; i < ws.size(); ++i) {
    check_weight(*ws[i], "matmul");
    shapes = shapes && x.cols == ws[i]->cols && ys[i].cols == ws[i]->rows && ys[i].rows == x.rows;
  }
  if (!shapes) return one_by_one(0, ws.size());
  int64_t stride = 0;
  const float* xa = nullptr;
  // Launches of up to max_gemv_jobs() consecutive weights of one format each, in order (a
  // different format starts the next launch: Qwen4-Exp's f32 shared-expert gate after its
  // quantized gate | up); a lone weight with no activation is a plain matmul.
  for (size_t done = 0; done < ws.size();) {
    size_t n = 1;
    while (done + n < ws.size() && n < size_t(max_gemv_jobs()) && ws[done + n]->dtype == ws[done]->dtype &&
           is_q4_0_planes(*ws[done + n]) == is_q4_0_planes(*ws[done]))
      ++n;
    bool launched = false;
    if (n > 1 || !act_of(done).is_identity()) {
      if (!xa) xa = aligned_rows(x, &stride, stream);
      const std::span<const MatmulAct> a = acts.empty() ? acts : acts.subspan(done, n);
      launched = launch_gemv_shared_input(ws.subspan(done, n), xa, stride, ys.subspan(done, n), a, num_sms_, stream);
    }
    if (!launched) one_by_one(done, n);
    done += n;
  }
}

}  // namespace turbospark::cuda
