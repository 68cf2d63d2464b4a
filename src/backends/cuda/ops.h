// Launchers of the CUDA backend's non-matmul ops: norms, RoPE, elementwise, router, paged KV
// writes and attention. Each mirrors the Backend method of the same name (ops/backend.h)
// plus a trailing stream: every pointer is device memory, every launcher only enqueues on
// `stream` (no synchronisation, nothing read back, so all of them can be captured in a CUDA
// graph) and checks its launch naming the op and shape. The math is the CPU backend's
// (backends/cpu/kernels_ref.cpp, hybrid_ops.cpp): tests/device/test_cuda_ops.cpp holds
// each launcher to it.
//
// Alignment: Mats may be any strided views. Kernels take 128-bit paths only when every base
// pointer is 16-byte aligned and every row stride and width is a multiple of 4 floats, and
// fall back to scalar (still coalesced) accesses otherwise.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"
#include "ops/backend.h"

namespace turbospark::cuda {

// ---- norm.cu ----
// y = x * rsqrt(mean(x^2) + eps) * (weight + weight_offset) per row, f32; y may alias x.
// Also run on [rows * heads, head_dim] views for per-head q/k norms.
void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset, cudaStream_t stream);
// Each of a row's `groups` equal column ranges normed on its own with its slice of weight
// (one launch; Backend::rmsnorm_groups).
void rmsnorm_groups(const Mat& x, const float* weight, int groups, float eps, const Mat& y, float weight_offset,
                    cudaStream_t stream);
// rmsnorm of each of `groups` column ranges with one weight, times act(gate) (one launch;
// Backend::rmsnorm_gated).
void rmsnorm_gated(const Mat& x, const float* weight, int groups, float eps, const Mat& gate, Act act, const Mat& y,
                   cudaStream_t stream);
// x += residual, then y = rmsnorm(x) (one launch; Backend::add_rmsnorm).
void add_rmsnorm(const Mat& x, const Mat& residual, const float* weight, float eps, const Mat& y, float weight_offset,
                 cudaStream_t stream);

// ---- elementwise.cu ----
void add(const Mat& y, const Mat& x, cudaStream_t stream);                // y += x
void add_bias(const Mat& y, const float* bias, cudaStream_t stream);      // y[t, :] += bias
void swiglu(const Mat& gate, const Mat& up, const Mat& out, cudaStream_t stream);  // silu(gate) * up
// gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
void clamped_swiglu(const Mat& gate, const Mat& up, float alpha, float limit, const Mat& out, cudaStream_t stream);
void unary(const Mat& x, Act act, float pre, float post, const Mat& y, cudaStream_t stream);  // y = post*act(pre*x)
void mul_act(const Mat& x, const Mat& gate, Act act, cudaStream_t stream);  // x *= act(gate), gate 1 col broadcasts
void split_heads(const Mat& ab, int n_heads, int head_dim, const Mat& a, const Mat& b, cudaStream_t stream);
void copy(const Mat& src, const Mat& dst, cudaStream_t stream);

// ---- attention_prep.cu ----
// Backend::attention_prep in one launch; false (nothing queued) for a head too large for the
// kernel's shared memory, which the caller then runs as the separate ops.
bool attention_prep(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p, const int64_t* positions,
                    const KvLayerView& kv, cudaStream_t stream);

// ---- rope.cu ----
// In place, rotate-half, over x viewed as [rows, n_heads, head_dim]; positions [rows] int64,
// inv_freq [rotary_dim / 2] f32, both device memory.
void rope(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions, const float* inv_freq,
          float attention_factor, cudaStream_t stream);

// ---- router.cu ----
// idx int32 / weight f32 [rows, k]; expert_scale [n_experts] or null. n_experts <= 512,
// k <= 16.
void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight,
                         const float* expert_scale, cudaStream_t stream);
// logits = x w^T (+ bias [n_experts] when non-null; w F32 or BF16 [n_experts, cols], resident)
// and the routing above, in one launch; returns false, launching nothing, outside its shapes
// (rows 1..8, n_experts <= 512, cols % 8 == 0, 16-byte-aligned rows): the caller then runs the
// GEMV, the bias and the top-k. `ticket` is a device counter at 0 that the launch leaves at 0
// (one per stream).
bool router_gemv_topk(const WeightView& w, const Mat& x, const Mat& logits, int k, bool renormalize, int32_t* idx,
                      float* weight, const float* expert_scale, const float* bias, unsigned* ticket,
                      cudaStream_t stream);
void softmax_rows(const Mat& x, const Mat& y, cudaStream_t stream);  // y may alias x
// ids int32 [rows]: lowest index on ties, -1 for a row holding a NaN (as the CPU backend).
void argmax_rows(const Mat& logits, int32_t* ids, cudaStream_t stream);

// ---- causal_conv1d.cu, gated_delta_rule.cu, hyper_connection.cu, qsa.cu ----
// Qwen4-Exp's hybrid ops (Backend methods of the same names). causal_conv1d's out and
// ple_gate's out may not alias their inputs. qsa_select's scores of max_context / ratio key
// blocks (qsa.block_keys.rows), 8 bytes each, live in shared memory when they fit, else in spill.
void causal_conv1d(const Mat& in, const float* w, int kernel, int dilation, const Mat& state, Act act, const Mat& out,
                   cudaStream_t stream);
// gated_delta_rule's two forms: the recurrent one (a row at a time, the state in registers) and
// the chunked one (a chunk of rows solved at once from the state at its start). kAuto takes the
// chunked form from kGdnChunkedMinRows rows (TURBOSPARK_CUDA_GDN_CHUNKED=0: never); kChunked
// insists (refused for key heads too large for a chunk in shared memory).
enum class GdnForm { kAuto, kRecurrent, kChunked };
constexpr int64_t kGdnChunkedMinRows = 32;
void gated_delta_rule(const Mat& qkv, const Mat& a, const Mat& b, const float* a_log, const float* dt_bias,
                      int n_k_heads, int n_v_heads, int dk, int dv, bool v_heads_tiled, const Mat& state,
                      const Mat& out, cudaStream_t stream, GdnForm form = GdnForm::kAuto);
void hc_mix(const Mat& weight, const Mat& normed, int n_streams, const Mat& mixed, cudaStream_t stream);
void hc_inject(const Mat& streams, const Mat& branch, const Mat& inject, int n_streams, cudaStream_t stream);
// Backend::hc_inject_gated in one launch.
void hc_inject_gated(const Mat& streams, const Mat& branch, const Mat& shared, const Mat& shared_gate,
                     const Mat& inject, int n_streams, cudaStream_t stream);
void ple_gate(const Mat& key, const Mat& query, const Mat& value, int n_streams, const Mat& out, cudaStream_t stream);
// Where qsa_select keeps a row's block scores: shared memory when max_context / ratio blocks fit
// (kAuto), else global memory from `spill`; kShared / kGlobal insist (for tests).
// Where qsa_select scores: kAuto splits steps of up to 16 rows across the GPU (needs `spill`)
// and gives longer ones a CTA per row with the scores in shared memory when they fit, else in
// `spill`; the others force one way (tests run each).
enum class QsaScores { kAuto, kShared, kGlobal, kSplit };
// kSerial: every row's top-k through the serial torch.topk emulation, never the threshold path.
// `threshold_rows`, when given, counts the rows the threshold path picked (tests compare the two
// paths and check that both ran).
enum class QsaTopK { kAuto, kSerial };
class DeviceScratch;
void qsa_select(const QsaView& qsa, const Mat& index_q, const Mat& raw_keys, const int64_t* positions,
                int32_t* selected, int32_t* counts, int max_selected, cudaStream_t stream,
                DeviceScratch* spill = nullptr, QsaScores scores = QsaScores::kAuto,
                QsaTopK top_k = QsaTopK::kAuto, int32_t* threshold_rows = nullptr);
// With `scratch` of attention_selected_scratch_floats() floats (non-zero for steps of a few rows,
// decode), the selection is split into pieces run in parallel and combined.
void attention_selected(const Mat& q, const KvLayerView& kv, int n_heads, float scale, const int32_t* selected,
                        const int32_t* counts, int max_selected, const Mat& out, cudaStream_t stream,
                        float* scratch = nullptr, int64_t scratch_floats = 0);
int64_t attention_selected_scratch_floats(int64_t rows, int n_heads, int head_dim, int max_selected);

// ---- kv_cache.cu ----
// k, v [rows, n_kv_heads * head_dim] into the paged pools at positions[t] of row_seq[t].
void kv_write(const KvLayerView& kv, const Mat& k, const Mat& v, const int64_t* positions, cudaStream_t stream);

// ---- attention_decode.cu / attention_prefill.cu ----
// Causal GQA over the paged cache (Backend::attention). Unlike the Backend method it takes a
// scratch buffer: the decode kernel splits each row's context into parts (flash-decoding)
// whose partial softmax states go there. attention_scratch_floats(rows, n_heads, head_dim)
// floats let it use its full split factor; a smaller scratch (or null, 0) only lowers the
// split factor (1 split needs none), never the result. Scratch must not be shared by two
// attention calls in flight on different streams.
int64_t attention_scratch_floats(int64_t rows, int n_heads, int head_dim);
// Picks the kernel by row count: decode (split-K over the context, parallel over rows) for
// few rows, the tiled prefill kernel otherwise (on tensor cores for head_dim <= 128). Both are exposed for tests and for a caller
// that knows its batch better (e.g. many decode rows of distinct sequences -> decode).
void attention(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale, int window,
               const float* sinks, const Mat& out, float* scratch, int64_t scratch_floats, cudaStream_t stream);
// The decode kernel's products. kAuto takes, per query row and on the device, the f32 SIMT
// form below tc_min_span visible keys and bf16 tensor cores from there (head_dim 64 or 128, up to
// 16 query heads per KV head; Q and P rounded to bf16 as in attention_prefill_tc.cu); a negative
// tc_min_span means attention_decode_tc_min_span(). TURBOSPARK_CUDA_DECODE_TC=1 / 0 makes kAuto
// take the tensor cores at every span / never. kF32 keeps the f32 kernel (the CPU's rounding up
// to summation order); kTensorCores insists (refused outside its shapes).
enum class DecodeMath { kAuto, kF32, kTensorCores };
bool attention_decode_tc_supports(int head_dim, int group);
// Where kAuto switches: measured on the H200 (Qwen3-30B-A3B shape, README); the environment's
// TURBOSPARK_CUDA_DECODE_TC_MIN_SPAN overrides it.
constexpr int64_t kDecodeTcMinSpan = 1024;
int64_t attention_decode_tc_min_span();
void attention_decode(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                      int window, const float* sinks, const Mat& out, float* scratch, int64_t scratch_floats,
                      cudaStream_t stream, DecodeMath math = DecodeMath::kAuto, int64_t tc_min_span = -1);
// attention_prep and attention_decode as one launch (Backend::prep_attention) for one decode
// row on the tensor-core kernel: false, launching nothing, outside its shapes (the caller then
// runs the two ops). One row only: rows of one sequence in a call would read each other's new
// keys while another block writes them. The backend uses it only with
// TURBOSPARK_CUDA_DECODE_PREP=1 (attention_decode_prep_enabled): it measured no faster.
bool attention_decode_prep_enabled();
bool attention_decode_prep(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p, const int64_t* positions,
                           const KvLayerView& kv, float scale, int window, const float* sinks, const Mat& out,
                           float* scratch, int64_t scratch_floats, cudaStream_t stream);
// attention_decode_fused.cu: attention_prep and the decode attention of one row in one launch
// (a cluster of split blocks per KV head merging through distributed shared memory: no combine
// kernel), for head_dim 16/32/64/128 and up to 8 query heads per KV head; false, launching
// nothing, outside those shapes. Correct at any span; the backend takes it while a step's span
// bound (KvLayerView::span_bound) is at most attention_decode_fused_max_span() keys:
// TURBOSPARK_CUDA_DECODE_FUSED_MAX_SPAN=N. Off by default (kDecodeFusedMaxSpan = 0): on the
// H200 it measured slower than the three separate kernels (Qwen3-30B-A3B Q4_0 after 512
// tokens: 409.9 / 406.6 vs 414.8 / 413.1 tok/s, alternated in one call).
constexpr int64_t kDecodeFusedMaxSpan = 0;
int64_t attention_decode_fused_max_span();
bool attention_decode_fused_supports(int head_dim, int group);
bool attention_decode_fused(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p, const int64_t* positions,
                            const KvLayerView& kv, float scale, int window, const float* sinks, const Mat& out,
                            cudaStream_t stream);
void attention_prefill(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                       int window, const float* sinks, const Mat& out, cudaStream_t stream);
// attention_prefill_tc.cu: the prefill kernel on bf16 tensor cores (f32 softmax and
// accumulation; see the file for its precision), for head_dim <= 128.
bool attention_prefill_tc_supports(int head_dim);
void attention_prefill_tc(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                          int window, const float* sinks, const Mat& out, cudaStream_t stream);
// Row count up to which attention() takes the decode kernel.
constexpr int64_t kAttentionDecodeMaxRows = 16;

}  // namespace turbospark::cuda
