// The one small interface between models and hardware. A forward step records ops against
// a Backend: the CPU backend runs each op eagerly on its thread pool; the CUDA backend
// enqueues the same ops on its stream (and captures decode steps in graphs). Models never
// learn which, never touch raw kernels, and never branch on a weight's dtype: formats are
// the backend's business.
//
// Every pointer an op takes is backend memory: activations (Mat views into alloc()),
// weights (views made resident()), small parameters (param()), routing results, positions,
// token ids and QSA selections (BackendArray). On the CPU backend that is host memory; on
// CUDA it is device memory the host must not touch. Host code writes such memory only
// through upload ops at an explicit offset, so that on a queued backend the write is ordered
// with the work around it (the seed's PLE hazard), and reads it only through download ops,
// which are synchronisation points: a forward downloads only its logits (or, with greedy
// sampling, the chosen ids), and --router-out's capture on purpose.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "experts/expert_cache.h"

namespace turbospark {

// Backend::attention_prep's parameters: head geometry, the per-head q/k norms (null: none; both
// or neither), RoPE (rotate-half over the first rotary_dim dims, cos/sin scaled by
// attention_factor), backend pointers read by the kernels.
struct AttentionPrep {
  int n_heads = 0, n_kv_heads = 0, head_dim = 0, rotary_dim = 0;
  // Projection biases (gpt-oss), added to q, k and v before anything else; null when absent.
  // [n_heads * head_dim] for q, [n_kv_heads * head_dim] for k and v (backend params).
  const float* q_bias = nullptr;
  const float* k_bias = nullptr;
  const float* v_bias = nullptr;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float norm_eps = 1e-6f, norm_offset = 0.f;
  const float* inv_freq = nullptr;  // [rotary_dim / 2]
  float attention_factor = 1.f;
};

// n elements of T in backend memory, shared by whoever holds a copy. data() is a backend
// pointer: pass it to ops, never dereference it on the host.
template <typename T>
class BackendArray {
 public:
  BackendArray() = default;
  BackendArray(std::shared_ptr<void> storage, int64_t n) : storage_(std::move(storage)), n_(n) {}
  T* data() const { return static_cast<T*>(storage_.get()); }
  int64_t size() const { return n_; }
  bool empty() const { return n_ == 0; }

 private:
  std::shared_ptr<void> storage_;
  int64_t n_ = 0;
};

// A small f32 parameter (norm weight, bias, inv_freq, sinks, A_log, conv weights...),
// uploaded once at load: Backend::param().
using Param = BackendArray<float>;

// Where a weight lives at run time. The expert cache reads only this metadata.
enum class Residency : uint8_t { kResident, kStreamedExpert };

// A weight matrix plus the metadata the backend and expert cache need.
struct Weight {
  WeightView view;  // as stored, [out, in]
  std::string name;
  int layer = -1;
  Residency residency = Residency::kResident;
  int expert = -1;  // routed expert index, -1 for dense weights

  int64_t rows() const { return view.rows; }
  int64_t cols() const { return view.cols; }
};

// Elementwise activations for Backend::unary and Backend::mul_act.
enum class Act : uint8_t { kIdentity, kSilu, kSigmoid, kGeluTanh, kTanh };

// y = post * act(pre * y), Backend::unary's arguments, as an activation a matmul's output
// takes (Backend::matmul_shared_input).
struct MatmulAct {
  Act act = Act::kIdentity;
  float pre = 1.f, post = 1.f;
  bool is_identity() const { return act == Act::kIdentity && pre == 1.f && post == 1.f; }
};

// One routed expert: gated FFN [hidden] -> [inter] -> [hidden], act(gate) * up: SwiGLU, or
// GeGLU (GELU-tanh) for Gemma 4.
struct ExpertWeights {
  Weight gate;  // [inter, hidden]
  Weight up;    // [inter, hidden]
  Weight down;  // [hidden, inter]
  Act act = Act::kSilu;
  // gpt-oss: biases after each projection (backend memory owned by the model; null when absent),
  // and when glu_limit > 0 its clamped GLU in place of act(gate) * up:
  // (clamp(up, -limit, limit) + 1) * g * sigmoid(glu_alpha * g), g = min(gate, limit).
  const float* gate_bias = nullptr;  // [inter]
  const float* up_bias = nullptr;    // [inter]
  const float* down_bias = nullptr;  // [hidden]
  float glu_alpha = 0.f;
  float glu_limit = 0.f;
  // gpt-oss: gate and up are the even and odd rows of one [2 * inter, hidden] matrix (views
  // with twice the row stride, gate's starting at row 0): a backend may run them as one
  // contiguous matmul (fused_gate_up) instead of two strided ones.
  bool gate_up_interleaved = false;
};

// Expert streaming (experts/expert_streamer.h): routed experts that are not read in place
// from their stored views but brought into a bounded cache as the router asks for them. A
// backend computing moe_experts() asks the provider for each expert right before it uses it.
class ExpertProvider {
 public:
  virtual ~ExpertProvider() = default;
  // The experts the backend will acquire next, in order: loads may start now.
  virtual void prefetch(std::span<const ExpertWeights* const> next) { (void)next; }
  // `stored`'s weights, readable now: the same values at other addresses. Valid until the
  // next acquire() or the end of the moe_experts() call, whichever comes first.
  virtual const ExpertWeights& acquire(const ExpertWeights& stored) = 0;
  // Whether speculate() does anything (it costs the caller a router product per layer).
  virtual bool speculates() const { return false; }
  // Experts likely to be asked for after the ones at hand (the next MoE layer's, from its
  // router on this layer's input): a guess, loaded once everything prefetch() was given is
  // under way, into slots nothing at hand needs; never protected afterwards. Replaces the
  // previous guess.
  virtual void speculate(std::span<const ExpertWeights* const> likely) { (void)likely; }
};

// The [2 * inter, hidden] matrix whose even rows are e.gate and odd rows e.up, for an expert
// with gate_up_interleaved.
inline WeightView fused_gate_up(const ExpertWeights& e) {
  WeightView v = e.gate.view;
  v.rows *= 2;
  v.row_bytes /= 2;
  v.scales_row_bytes /= 2;
  v.biases_row_bytes /= 2;
  return v;
}

// Element type of a KV cache's pools (Backend::kv_type): f32 on the CPU, bf16 on CUDA (half
// the bytes a decode step and a prefill tile read; the attention math stays f32).
enum class KvType : uint8_t { kF32, kBf16 };

inline int kv_type_bytes(KvType t) { return t == KvType::kBf16 ? 2 : 4; }

// One layer's paged KV cache as the backend sees it (see engine/kv_cache.h). Position p of
// sequence s lives in physical block block_table[s * max_blocks + p / block_size], row
// p % block_size. Pools and tables are backend memory. Rows of a micro-batch may belong to
// different sequences (row_seq); null row_seq means every row is sequence 0.
struct KvLayerView {
  void* k = nullptr;  // [n_blocks, block_size, n_kv_heads, head_dim] of `type`
  void* v = nullptr;  // same
  const int32_t* block_table = nullptr;  // [n_seqs, max_blocks] logical -> physical block
  int max_blocks = 0;                    // row stride of block_table
  const int32_t* row_seq = nullptr;      // [rows] sequence of each micro-batch row, or null
  int block_size = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  KvType type = KvType::kF32;
  // Host-known bound on the positions any row of this call sees (its visible span), or 0 when
  // unknown: a backend may pick kernels by it (CUDA fuses a short decode row's attention). A
  // replayed step graph keeps the choice it was captured with, so the caller keys its graphs
  // by the bound (Session rounds it up to a power of two).
  int64_t span_bound = 0;
  // Host-known count of leading rows that are each the only row of their sequence in this
  // call (the decode rows of a continuous-batching step), or 0 when unknown. A hint only: a
  // backend may run them with its one-query-per-row kernel and the rest with its tiled one.
  // Graphs are captured with the choice, so callers that replay key them by it too.
  int64_t lone_rows = 0;

  int64_t block_floats() const { return int64_t(block_size) * n_kv_heads * head_dim; }
  int seq_of(int64_t row) const { return row_seq ? row_seq[row] : 0; }
  // Host-side addressing for backends whose memory is host memory and whose pools are f32
  // (the CPU backend, which checks `type` once per op: f32_pools()).
  float* k_f32() const { return static_cast<float*>(k); }
  float* v_f32() const { return static_cast<float*>(v); }
  float* k_at(int seq, int64_t pos) const { return k_f32() + slot(seq, pos); }
  float* v_at(int seq, int64_t pos) const { return v_f32() + slot(seq, pos); }

 private:
  int64_t slot(int seq, int64_t pos) const {
    const int32_t block = block_table[int64_t(seq) * max_blocks + pos / block_size];
    return int64_t(block) * block_floats() + (pos % block_size) * int64_t(n_kv_heads) * head_dim;
  }
};

// One layer's QSA indexer state as the backend sees it (see models/blocks/qsa.h).
struct QsaView {
  Mat raw_keys;      // [max_context, head_dim] un-normalized index keys, one row per position
  Mat block_keys;    // [max_context / ratio, head_dim] pooled, normed, rotated complete blocks
  const float* k_norm = nullptr;  // [head_dim], applied as (1 + w) (backend memory)
  const float* inv_freq = nullptr;  // [rotary_dim / 2] (backend memory)
  int rotary_dim = 0;
  int ratio = 0;       // indexer_compress_ratio
  int block_topk = 0;  // indexer_budget / ratio
  int n_heads = 0;
  int head_dim = 0;
  float eps = 1e-6f;
  // Backend memory, or null: set to 1 when a block score comes out NaN (which would decide the
  // selection by accident); the model reports the layer after the step (the seed's rule: no
  // readback mid-layer).
  int32_t* nan_score = nullptr;
};

// A recorded step a backend can replay (a CUDA graph); opaque, owned by whoever runs the
// step (the session), so it goes when the buffers it was recorded against go.
class StepGraph {
 public:
  virtual ~StepGraph() = default;
};

// The prompt rows per forward a backend asks for unless it knows better (the CPU's).
inline constexpr int64_t kDefaultPrefillBatch = 64;

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // ---- memory ----
  // Zeroed backend memory, 64-byte aligned, freed when the last handle goes.
  virtual std::shared_ptr<void> alloc_bytes(int64_t bytes) = 0;
  // Host -> backend copy of `bytes` at `dst`, ordered after the work already recorded (the
  // host buffer may be reused as soon as the call returns).
  virtual void upload_bytes(void* dst, const void* src, int64_t bytes) = 0;
  // Backend -> host copy after the work already recorded: a synchronisation point.
  virtual void download_bytes(void* dst, const void* src, int64_t bytes) = 0;
  // Zeroes `bytes` of backend memory at dst, ordered with the recorded work.
  virtual void zero_bytes(void* dst, int64_t bytes) = 0;
  // The device memory's copy bandwidth in GB/s (bytes read + written by a large
  // device-to-device copy), the roofline bench reports decode against; 0 where the backend
  // has no memory of its own (the CPU bench probes DRAM itself).
  virtual double copy_bandwidth_gbs() { return 0; }
  // Runs `record` (a forward whose launch shapes and buffers are the same every call: a
  // decode step of one session) as a replayable graph where the backend has them: the first
  // call runs it as usual (sizing every scratch buffer), the second captures it into `graph`,
  // later ones replay it. Uploads must happen before the call (they are not part of the
  // step); downloads inside it land in the same host pointers on every replay, once the call
  // returns. The CPU backend just runs it.
  virtual void run_step(std::unique_ptr<StepGraph>& graph, const std::function<void()>& record) { record(); }
  // Waits for every recorded op (no-op on the eager CPU backend).
  virtual void synchronize() {}
  // Prompt rows per forward a session uses unless told otherwise (SessionOptions): each
  // micro-batch reads every weight it touches once, so a GPU wants micro-batches large enough
  // that a routed expert sees tens of rows; the CPU's caches want small ones.
  virtual int64_t preferred_prefill_batch() const { return kDefaultPrefillBatch; }
  // Element type of the KV pools this backend's attention reads and writes (KvCache
  // allocates them so).
  virtual KvType kv_type() const { return KvType::kF32; }

  // Scratch activations of n_floats f32 (zeroed).
  std::shared_ptr<float> alloc(int64_t n_floats) {
    return std::static_pointer_cast<float>(alloc_bytes(n_floats * int64_t(sizeof(float))));
  }
  template <typename T>
  BackendArray<T> alloc_array(int64_t n) {
    return BackendArray<T>(alloc_bytes(n * int64_t(sizeof(T))), n);
  }
  template <typename T>
  void upload_array(const BackendArray<T>& dst, std::span<const T> src, int64_t offset = 0) {
    upload_bytes(dst.data() + offset, src.data(), int64_t(src.size_bytes()));
  }
  template <typename T>
  void download_array(std::span<T> dst, const BackendArray<T>& src, int64_t offset = 0) {
    download_bytes(dst.data(), src.data() + offset, int64_t(dst.size_bytes()));
  }
  // Host -> backend copy into `dst` (rows of a Mat the backend allocated).
  void upload(const Mat& dst, const float* src);
  // Backend -> host copy of a Mat's rows; a synchronisation point on queued backends.
  void download(const Mat& src, float* dst);
  // A parameter vector uploaded once (at load).
  Param param(std::span<const float> host) {
    Param p = alloc_array<float>(int64_t(host.size()));
    if (!host.empty()) upload_array(p, host);
    return p;
  }

  // ---- weights ----
  // Called once before a model's weights are made resident, with the bytes they will take:
  // a backend with memory of its own reserves them here and refuses a model that does not fit
  // (bytes needed, bytes free), naming expert streaming when the model has routed experts.
  virtual void begin_weights(int64_t total_bytes, bool has_routed_experts) {}
  // The weight as the backend reads it: the CPU backend reads checkpoint memory in place; a
  // device backend copies every plane (data, scales, biases) into its memory once.
  virtual WeightView resident(const WeightView& host, const std::string& name) { return host; }
  // After the last resident(): reports the upload (bytes, seconds, GB/s) where there was one.
  virtual void end_weights() {}
  // A routed expert's weights (WeightLoader::expert_view): resident like any weight, unless the
  // backend was told to keep routed experts in host memory (keep_experts_on_host), which it then
  // streams into a bounded cache of device slots as the router asks (set_expert_cache).
  virtual WeightView resident_expert(const WeightView& host, const std::string& name) { return resident(host, name); }

  // ---- expert streaming's device tier (the CPU tier is set_expert_provider) ----
  // Before the model loads: routed experts stay in host memory. Backends whose weights are host
  // memory anyway have no such tier and refuse by name.
  virtual void keep_experts_on_host() {
    fail("--device {}: routed experts already live in host memory (expert streaming here is the disk tier)", name());
  }
  virtual bool experts_on_host() const { return false; }
  // After it loaded: the cache of `slots` device slots (>= top_k) the experts stream through,
  // laid out from one routed expert of every MoE layer (Model::for_each_routed_expert).
  virtual void set_expert_cache(int64_t slots, int top_k, EvictionPolicy policy,
                                std::span<const ExpertWeights* const> layer_experts) {
    (void)slots, (void)top_k, (void)policy, (void)layer_experts;
    fail("--device {}: no device tier for expert streaming", name());
  }
  // The device tier's hit rate, bytes and link speed so far; empty without one.
  virtual std::string expert_cache_summary() const { return {}; }
  // The device tier's counts so far into *out; false without one.
  virtual bool device_expert_cache_stats(ExpertCacheStats* out) const {
    (void)out;
    return false;
  }
  // Device memory the engine may still take (free memory, or what is left of a limit set by
  // set_memory_limit), or -1 for a backend whose memory is the host's.
  virtual int64_t device_memory_available() const { return -1; }
  // Caps the device memory this backend takes (weights, expert cache, KV cache, activations):
  // `bytes` counted from its creation. A backend without device memory refuses by name.
  virtual void set_memory_limit(int64_t bytes) {
    (void)bytes;
    fail("--gpu-memory-gb: --device {} has no device memory to cap", name());
  }

  // y = x W^T for W [out, in]; one row of x is a GEMV (decode), many a GEMM (prefill).
  virtual void matmul(const Weight& w, const Mat& x, const Mat& y) = 0;
  // ys[i] = x ws[i]^T for several weights over the same x (an attention layer's q, k and v):
  // the same results as one matmul each, which is what it does unless a backend can do better
  // (CUDA: one GEMV launch at decode). With acts (one per weight, or empty), each output then
  // becomes acts[i](ys[i]) as unary() computes it: the default runs unary after the matmuls, a
  // GPU backend applies it as the GEMV stores (a decode step's small projections followed by an
  // activation: one launch instead of two each).
  virtual void matmul_shared_input(std::span<const Weight* const> ws, const Mat& x, std::span<const Mat> ys,
                                   std::span<const MatmulAct> acts = {}) {
    for (size_t i = 0; i < ws.size(); ++i) matmul(*ws[i], x, ys[i]);
    for (size_t i = 0; i < acts.size(); ++i)
      if (!acts[i].is_identity()) unary(ys[i], acts[i].act, acts[i].pre, acts[i].post, ys[i]);
  }
  // y[t, :] += bias (length y.cols)
  virtual void add_bias(const Mat& y, const float* bias) = 0;
  virtual void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset = 0.f) = 0;
  // rmsnorm of each of a row's `groups` equal column ranges on its own, range g scaled by
  // weight[g * cols / groups ...] (hyper-connection streams side by side in one row): the same
  // results as one rmsnorm per range, which is the default; one launch on a GPU backend.
  virtual void rmsnorm_groups(const Mat& x, const float* weight, int groups, float eps, const Mat& y,
                              float weight_offset = 0.f) {
    TS_CHECK(groups > 0 && x.cols % groups == 0 && y.cols == x.cols, "rmsnorm_groups: [{}, {}] in {} groups", x.rows,
             x.cols, groups);
    const int64_t w = x.cols / groups;
    for (int g = 0; g < groups; ++g)
      rmsnorm(x.cols_slice(g * w, w), weight + g * w, eps, y.cols_slice(g * w, w), weight_offset);
  }
  // y = rmsnorm(x) * act(gate) over each of a row's `groups` equal column ranges, one weight
  // [x.cols / groups] for every range (GatedDeltaNet's gated norm per value head); y may alias
  // x. The default: rmsnorm over the ranges (offset 0), then mul_act; one launch on a GPU.
  virtual void rmsnorm_gated(const Mat& x, const float* weight, int groups, float eps, const Mat& gate, Act act,
                             const Mat& y) {
    TS_CHECK(groups > 0 && x.cols % groups == 0 && y.cols == x.cols && y.rows == x.rows && gate.cols == x.cols &&
                 gate.rows == x.rows,
             "rmsnorm_gated: x [{}, {}] in {} groups, gate [{}, {}], y [{}, {}]", x.rows, x.cols, groups, gate.rows,
             gate.cols, y.rows, y.cols);
    const int64_t w = x.cols / groups;
    // The ranges as rows of their own: one view when the rows are contiguous, else one per row.
    const bool dense = x.stride == x.cols && y.stride == y.cols;
    for (int64_t r = 0; r < (dense ? 1 : x.rows); ++r) {
      const int64_t n = (dense ? x.rows : 1) * groups;
      rmsnorm(Mat(x.data + r * x.stride, n, w), weight, eps, Mat(y.data + r * y.stride, n, w));
    }
    mul_act(y, gate, act);
  }
  // x += residual, then y = rmsnorm(x): a decoder's residual add and the next norm, one launch on
  // a GPU backend. The default runs add then rmsnorm.
  virtual void add_rmsnorm(const Mat& x, const Mat& residual, const float* weight, float eps, const Mat& y,
                           float weight_offset = 0.f) {
    add(x, residual);
    rmsnorm(x, weight, eps, y, weight_offset);
  }
  // In-place RoPE (rotate-half layout) over x viewed as [rows, n_heads, head_dim].
  virtual void rope(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions,
                    const float* inv_freq, float attention_factor) = 0;
  // Writes k/v rows [rows, n_kv_heads * head_dim] at positions into the paged cache.
  virtual void kv_write(const KvLayerView& kv, const Mat& k, const Mat& v, const int64_t* positions) = 0;
  virtual void attention(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                         int window, const float* sinks, const Mat& out) = 0;
  // The attention inputs after projection, in one op: the projection biases (p.q_bias / k_bias /
  // v_bias; skipped when null), per-head RMSNorm of q and k (p.q_norm / p.k_norm, [head_dim]
  // backend params; skipped when null), RoPE on both, then k and v written to the cache at each
  // row's position. q and k are left biased, normed and rotated, as the separate ops leave them
  // (v biased). This default runs those ops (add_bias, rmsnorm, rope, kv_write); a GPU backend
  // fuses them into one launch (up to eight per layer otherwise, at decode each a few
  // microseconds of launch and latency for kilobytes of work).
  virtual void attention_prep(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p,
                              const int64_t* positions, const KvLayerView& kv) {
    if (p.q_bias) add_bias(q, p.q_bias);
    if (p.k_bias) add_bias(k, p.k_bias);
    if (p.v_bias) add_bias(v, p.v_bias);
    if (p.q_norm) {
      // Per-head norm: [rows, heads * hd] viewed as [rows * heads, hd] (one view when the rows
      // are contiguous, else one per row).
      auto per_head = [&](const Mat& m, int heads, const float* w) {
        const bool dense = m.stride == int64_t(heads) * p.head_dim;
        for (int64_t r = 0; r < (dense ? 1 : m.rows); ++r) {
          const Mat h(m.data + r * m.stride, (dense ? m.rows : 1) * heads, p.head_dim);
          rmsnorm(h, w, p.norm_eps, h, p.norm_offset);
        }
      };
      per_head(q, p.n_heads, p.q_norm);
      per_head(k, p.n_kv_heads, p.k_norm);
    }
    rope(q, p.n_heads, p.head_dim, p.rotary_dim, positions, p.inv_freq, p.attention_factor);
    rope(k, p.n_kv_heads, p.head_dim, p.rotary_dim, positions, p.inv_freq, p.attention_factor);
    kv_write(kv, k, v, positions);
  }
  // attention_prep, then attention into out, as one call so a backend can fuse them (CUDA, one
  // decode row: the attention kernel's blocks do the norms, RoPE and cache write). Afterwards
  // q and k hold unspecified values (callers read only out and the cache).
  virtual void prep_attention(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p,
                              const int64_t* positions, const KvLayerView& kv, float scale, int window,
                              const float* sinks, const Mat& out) {
    attention_prep(q, k, v, p, positions, kv);
    attention(q, positions, kv, p.n_heads, scale, window, sinks, out);
  }
  virtual void swiglu(const Mat& gate, const Mat& up, const Mat& out) = 0;
  virtual void embedding(const Weight& table, const int32_t* ids, int64_t n, float scale, const Mat& out) = 0;
  virtual void add(const Mat& y, const Mat& x) = 0;  // y += x
  // Softmax top-k routing of router logits [rows, n_experts] into idx/weight [rows, k]
  // (backend memory); when expert_scale (backend memory, [n_experts]) is non-null each
  // chosen weight is then multiplied by its expert's scale (Gemma 4).
  virtual void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight,
                                   const float* expert_scale = nullptr) = 0;
  // logits = x router^T (+ bias, backend memory [n_experts], when non-null: gpt-oss), then
  // router_softmax_topk on them: one call so a backend can fuse them (CUDA decode: one launch,
  // the last block routing). logits hold the raw router outputs either way (--router-out reads
  // them).
  virtual void router_topk(const Weight& router, const Mat& x, const Mat& logits, int k, bool renormalize,
                           int32_t* idx, float* weight, const float* expert_scale = nullptr,
                           const float* bias = nullptr) {
    matmul(router, x, logits);
    if (bias) add_bias(logits, bias);
    router_softmax_topk(logits, k, renormalize, idx, weight, expert_scale);
  }
  // Softmax of each row of x into y (may alias): --router-out's probabilities.
  virtual void softmax_rows(const Mat& x, const Mat& y) = 0;
  // ids[t] = argmax_j logits[t, j] (lowest index on ties; -1 when the row holds a NaN),
  // backend memory [rows]: greedy sampling downloads only these.
  virtual void argmax_rows(const Mat& logits, int32_t* ids) = 0;
  // y = post * act(pre * x), elementwise; y may alias x.
  virtual void unary(const Mat& x, Act act, float pre, float post, const Mat& y) = 0;
  // x *= act(gate); gate has x.cols columns, or 1 column broadcast over the row.
  virtual void mul_act(const Mat& x, const Mat& gate, Act act) = 0;
  // Splits rows of [heads, 2 * head_dim] (per head: first half a, second half b) into a and b.
  virtual void split_heads(const Mat& ab, int n_heads, int head_dim, const Mat& a, const Mat& b) = 0;
  virtual void copy(const Mat& src, const Mat& dst) = 0;

  // Depthwise causal conv over time for each channel: out[t, c] = act(sum_k w[c, k] *
  // in[t - (K-1-k) * dilation, c]), where inputs before the micro-batch come from `state`
  // ([(K-1) * dilation, channels], oldest first), which is then advanced. w is [channels, K].
  virtual void causal_conv1d(const Mat& in, const float* w, int kernel, int dilation, const Mat& state, Act act,
                             const Mat& out) = 0;
  // GatedDeltaNet recurrence over the micro-batch (rows in order). qkv [rows, 2*nk*dk + nv*dv]
  // after the conv; a, b [rows, nv] projections; state [nv, dk*dv] (S[i][j] at i*dv+j) is
  // advanced in place. out [rows, nv*dv]. Value head h reads key head h / (nv / nk) when the
  // value heads are grouped by key head (transformers' order), h % nk when `v_heads_tiled`
  // (the order llama.cpp's converter writes into GGUF files).
  virtual void gated_delta_rule(const Mat& qkv, const Mat& a, const Mat& b, const float* a_log,
                                const float* dt_bias, int n_k_heads, int n_v_heads, int dk, int dv,
                                bool v_heads_tiled, const Mat& state, const Mat& out) = 0;
  // Hyper-connections: mixed[t] = mean_c(weight[t, c] * normed[t, c]) over C streams of
  // `hidden` each, and streams[t, c] += inject[t, c] * branch[t].
  virtual void hc_mix(const Mat& weight, const Mat& normed, int n_streams, const Mat& mixed) = 0;
  virtual void hc_inject(const Mat& streams, const Mat& branch, const Mat& inject, int n_streams) = 0;
  // A MoE's gated shared expert joined to its routed output, then injected: shared *=
  // sigmoid(shared_gate) ([rows, 1]), branch += shared, hc_inject(streams, branch, inject). The
  // default runs those three ops; a GPU backend one launch (every Qwen4-Exp layer ends so).
  virtual void hc_inject_gated(const Mat& streams, const Mat& branch, const Mat& shared, const Mat& shared_gate,
                               const Mat& inject, int n_streams) {
    mul_act(shared, shared_gate, Act::kSigmoid);
    add(branch, shared);
    hc_inject(streams, branch, inject, n_streams);
  }
  // PLE gate: g_c = sum(key_c * query_c) / sqrt(hidden), s = sign(g) sqrt(max(|g|, 1e-6)),
  // out_c = sigmoid(s) * value, for each of the C streams.
  virtual void ple_gate(const Mat& key, const Mat& query, const Mat& value, int n_streams, const Mat& out) = 0;
  // QSA: stores the micro-batch's raw index keys, completes any newly full blocks, and for
  // each query row picks its visible positions (top blocks by sum_h relu(q_h . k_b) /
  // sqrt(d) plus the incomplete tail). selected is [rows, max_selected], counts [rows].
  virtual void qsa_select(const QsaView& qsa, const Mat& index_q, const Mat& raw_keys, const int64_t* positions,
                          int32_t* selected, int32_t* counts, int max_selected) = 0;
  // Attention restricted to each row's selected positions (all <= its own position).
  virtual void attention_selected(const Mat& q, const KvLayerView& kv, int n_heads, float scale,
                                  const int32_t* selected, const int32_t* counts, int max_selected,
                                  const Mat& out) = 0;

  // out[t] = sum_j weight[t, j] * expert_{idx[t, j]}(x[t]). Routing stays on the backend:
  // resident experts need no host round trip (the streaming path will sync here, by design).
  virtual void moe_experts(const std::vector<ExpertWeights>& experts, const Mat& x, const int32_t* idx,
                           const float* weight, int k, const Mat& out) = 0;
  // Expert streaming with speculation: whether speculate_experts() is worth its router product.
  virtual bool speculates_experts() const { return false; }
  // The experts idx [rows, k] (backend memory, from router_topk) names, of a later MoE layer,
  // handed to the provider as a guess (ExpertProvider::speculate). The default ignores them.
  virtual void speculate_experts(const std::vector<ExpertWeights>& experts, const int32_t* idx, int64_t rows, int k) {
    (void)experts, (void)idx, (void)rows, (void)k;
  }
  // Streams routed experts through `provider` (null: read them in place again). Backends
  // without a streaming tier refuse it by name.
  virtual void set_expert_provider(ExpertProvider* provider) {
    TS_CHECK(provider == nullptr, "expert streaming (--expert-cache-slots) is not supported on --device {} yet",
             name());
  }
};

inline void Backend::upload(const Mat& dst, const float* src) {
  if (dst.stride == dst.cols) return upload_bytes(dst.data, src, dst.rows * dst.cols * 4);
  for (int64_t r = 0; r < dst.rows; ++r) upload_bytes(dst.row(r), src + r * dst.cols, dst.cols * 4);
}

inline void Backend::download(const Mat& src, float* dst) {
  if (src.stride == src.cols) return download_bytes(dst, src.data, src.rows * src.cols * 4);
  for (int64_t r = 0; r < src.rows; ++r) download_bytes(dst + r * src.cols, src.row(r), src.cols * 4);
}

std::unique_ptr<Backend> make_cpu_backend(int n_threads);

// The experts another run chose (CUDA's, from its --router-out probabilities), imposed on the CPU
// reference so that a near tie the two break differently does not split the comparison: each
// MoE layer's [tokens * top_k] ids, consumed in call order (router calls cycle through the MoE
// layers per micro-batch). Where the CPU's own choice differs, the row is counted with the CPU's
// margin there ((k-th - (k+1)-th probability) / the first), so a test can require every such
// difference to be a near tie.
struct RouteReplay {
  int top_k = 0;
  std::vector<std::vector<int32_t>> layers;
  // Filled as the run goes.
  size_t calls = 0;
  std::vector<int64_t> cursor;  // rows consumed per layer
  int64_t flips = 0;
  double widest_flip_margin = 0;
};

// From router probabilities [n_layers, tokens, n_experts] (Session::feed's capture, --router-out):
// each MoE layer's top_k experts per token, in descending probability, lower index first on
// ties (the routers' rule). Layers whose rows are all zero (dense) are left out.
std::shared_ptr<RouteReplay> route_replay_from_probs(const std::vector<float>& probs, int64_t n_layers, int64_t tokens,
                                                     int64_t n_experts, int top_k);

// Filled by the CPU backend's qsa_select when CpuPrecision::qsa_margins is set: for every query
// row of every call, in call order, its position and how near its selection came to another:
// (the last kept block's score - the best dropped one's) / the best score, +inf where no block
// was dropped or both are 0 (relu zeroed every head: a tie both backends break by the same rule,
// whatever the rounding). A margin within rounding noise is a selection another backend's
// roundings may make differently: tests exempt such rows as they do near-tied routings.
struct QsaMargins {
  std::vector<int64_t> positions;
  std::vector<float> margins;
};

// The CUDA backend's rounding on the CPU backend, as a reference for the device tests: they
// compare the GPU with a CPU that rounds where the GPU path does, which tells a kernel's error
// from the precision that path runs at (random-weight fixtures amplify a bf16 step in a KV row or
// a GEMM input into logit changes of 0.01-0.3 against transformers, on both backends alike).
struct CpuPrecision {
  // K and V rounded to bf16 as they are stored (the CUDA KV cache's type).
  bool bf16_kv = false;
  // > 0: a matmul of more than this many rows, and every matmul of a MoE micro-batch of more
  // than this many rows, reads its input rounded as a tensor-core GEMM does (bf16; tf32 for f32
  // weights); fewer rows keep f32 (the GEMV and MoE decode kernels). CUDA's bound: 8.
  int64_t gemm_above_rows = 0;
  // > 0: attention over a micro-batch of more than this many rows rounds as CUDA's tensor-core
  // prefill kernel does (head_dim a multiple of 8 up to 128): q rounded to bf16 as it enters
  // Q K^T, and each 64-key tile's probabilities, taken against the running maximum, rounded to
  // bf16 as they enter P V and the row sums. CUDA's bound: kAttentionDecodeMaxRows, 16.
  int64_t tc_attention_above_rows = 0;
  // MXFP4 matmuls read f32 activations (as CUDA's GEMV and GEMM do) instead of the CPU's
  // default int8 ones, except the experts of a MoE micro-batch of at most gemm_above_rows rows:
  // CUDA's MoE decode kernels quantize x and h per 32 exactly as the CPU's int8 path does.
  bool float_mxfp4 = false;
  // > 0: the backend's preferred_prefill_batch() (where a prompt is cut into micro-batches
  // decides what rounds): CUDA's 2048.
  int64_t prefill_batch = 0;
  // != 0: every matmul output is scaled by 1 +- 2^-22 (sign pseudo-random per element, from this
  // seed and the call): a stand-in for another summation order. Comparing a run with and without
  // it measures how far f32 rounding noise alone moves this reference (every bf16 rounding an
  // f32 difference tips over is amplified downstream): the resolution of a comparison with CUDA.
  uint32_t nudge_seed = 0;
  // Non-null: routing taken from another run (RouteReplay) instead of the CPU's own top-k.
  std::shared_ptr<RouteReplay> route_replay;
  // Non-null: QSA selection margins recorded here (QsaMargins).
  std::shared_ptr<QsaMargins> qsa_margins;

  // The CUDA backend's: bf16 KV, GEMMs past its 8-row GEMV and MoE-decode bound, tensor-core
  // attention past 16 rows, f32 activations into MXFP4 (int8 into MoE decode micro-batches'
  // MXFP4 experts), 2048-row micro-batches
  // (tests/device/test_cuda_golden.cpp holds them to cuda::kGemvMaxRows, kMoeDecodeMaxRows,
  // kAttentionDecodeMaxRows and the CUDA backend's preferred_prefill_batch()).
  static CpuPrecision like_cuda() {
    CpuPrecision p;
    p.bf16_kv = true;
    p.gemm_above_rows = 8;
    p.tc_attention_above_rows = 16;
    p.float_mxfp4 = true;
    p.prefill_batch = 2048;
    return p;
  }
};
std::unique_ptr<Backend> make_cpu_backend(int n_threads, const CpuPrecision& precision);

// The CUDA backend on device `ordinal` (backends/cuda/; built with TURBOSPARK_CUDA=ON).
// Throws naming the reason when this build has no CUDA or no GPU is usable.
std::unique_ptr<Backend> make_cuda_backend(int ordinal = 0);
// Whether this build has the CUDA backend and a GPU is present (for --device auto).
bool cuda_available();

}  // namespace turbospark
