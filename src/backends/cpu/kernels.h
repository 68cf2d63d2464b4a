// CPU kernels: the fast paths behind the CPU backend. Each kernel has a scalar reference
// in kernels_ref.cpp that tests compare against on ragged shapes. AVX2/FMA paths are
// chosen at compile time (the build targets the host with -march=native by default);
// every path has a scalar fallback.
//
// Conventions: activations are float32; weights are WeightView (BF16, F16 or F32, [out, in]
// row-major). Kernels that take a ThreadPool split their work across it.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "ops/backend.h"

namespace turbospark::cpu {

// y[t, o] = sum_i w[o, i] * x[t, i] for t < x.rows, o < w.rows. x.cols == w.cols,
// y.cols == w.rows, y.rows == x.rows. Works for one row (GEMV, decode) and many (GEMM,
// prefill); rows of y may be strided (writing into a slice of a wider buffer).
void matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y);

// y[t, :] = x[t, :] * rsqrt(mean(x[t, :]^2) + eps) * weight[:]  (weight f32, length x.cols).
// y may alias x. When `weight_offset` is 1 the scale is (1 + weight) (Gemma/Qwen-next style).
void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset = 0.f);

// Rotary embedding, rotate-half (NeoX) layout, applied in place to x viewed as
// [rows, n_heads, head_dim]; only the first `rotary_dim` dims of each head rotate (partial
// rotary), pairing dim i with i + rotary_dim/2. Row t uses position positions[t]:
// angle_i = float(position) * inv_freq[i] (float32, as transformers computes it),
// i < rotary_dim/2; cos/sin may be scaled by `attention_factor` (YaRN), 1 otherwise.
void rope_neox(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions,
               const float* inv_freq, float attention_factor = 1.f);

// One layer's paged KV cache (ops/backend.h). The kernels here see one sequence: row_seq
// null and block_table that sequence's row (the CPU backend splits a micro-batch of several
// sequences into runs of rows of one sequence).
using KvView = KvLayerView;

// Causal grouped-query attention over the cache. q is [rows, n_heads * head_dim]; query row
// t sits at position q_positions[t] and attends to cached positions
// [max(0, pos - window + 1), pos] (window <= 0: all of [0, pos]). Head h reads KV head
// h / (n_heads / n_kv_heads). scores = q.k * scale, softmax in float32; when `sinks` is
// non-null, sinks[h] is an extra logit in head h's softmax whose probability is dropped.
// out is [rows, n_heads * head_dim] (may not alias q).
void attention(ThreadPool& pool, const Mat& q, const int64_t* q_positions, const KvView& kv,
               int n_heads, float scale, int window, const float* sinks, const Mat& out);

// out[t, i] = silu(gate[t, i]) * up[t, i]. out may alias gate or up.
void swiglu(const Mat& gate, const Mat& up, const Mat& out);

// gpt-oss's clamped GLU: g = min(gate, limit), u = clamp(up, -limit, limit),
// out = (u + 1) * g * sigmoid(alpha * g). out may alias gate or up.
void clamped_swiglu(const Mat& gate, const Mat& up, float alpha, float limit, const Mat& out);

// y[t, :] += bias (length y.cols).
void add_bias(const Mat& y, const float* bias);

// out[t, :] = dequantized row ids[t] of `table` ([vocab, dim]), times `scale`.
void embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out);

// Softmax over each row of router logits [rows, n_experts], then the top k experts per row
// (largest probability first; ties to the lower index). When `renormalize` the k weights
// are divided by their sum. idx and weight are [rows, k].
void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight);

// y[t, :] += x[t, :] * alpha
void add_scaled(const Mat& y, const Mat& x, float alpha = 1.f);

// Dot of one weight row with a float vector (any WeightView dtype), the scalar building
// block the reference path and small ops use.
float dot_row(const WeightView& w, int64_t row, const float* x);

// ---- scalar references (kernels_ref.cpp): straightforward loops, used by tests ----
namespace ref {
void matmul(const WeightView& w, const Mat& x, const Mat& y);
void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset = 0.f);
void rope_neox(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions,
               const float* inv_freq, float attention_factor = 1.f);
void attention(const Mat& q, const int64_t* q_positions, const KvView& kv, int n_heads, float scale,
               int window, const float* sinks, const Mat& out);
void swiglu(const Mat& gate, const Mat& up, const Mat& out);
void embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out);
void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight);
void add_scaled(const Mat& y, const Mat& x, float alpha = 1.f);
float dot_row(const WeightView& w, int64_t row, const float* x);
// Element (row, col) of w as float32 (BF16, F16 or F32); the one scalar dequantizer the
// references share.
float weight_at(const WeightView& w, int64_t row, int64_t col);
}  // namespace ref

}  // namespace turbospark::cpu
