// The CUDA backend: every op is enqueued on the backend's one stream and returns at once;
// the host waits only in download_bytes (the step's logits or greedy ids, and --router-out's
// deliberate capture) and synchronize(). Activations are f32 in device memory (DESIGN.md
// asks bf16: at decode they are a rounding error of the bytes moved next to the weights, and
// f32 keeps CUDA within float tolerance of the CPU goldens; the prefill GEMMs round them to
// bf16 for the tensor cores inside the matmul op). Weights are uploaded once at load into one
// device pool through pinned staging.
//
// The backend calls launchers only (backends/cuda/ops.h, matmul.h); the kernels live one op
// per .cu file beside this one.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

#include "backends/cuda/common.cuh"
#include "backends/cuda/expert_slots.h"
#include "backends/cuda/matmul.h"
#include "backends/cuda/ops.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/quant_grouped.h"
#include "ops/backend.h"

namespace turbospark {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kAlign = 256;  // every device allocation and pool slice: 16-byte vector loads and cuBLASLt
constexpr int64_t kStagingBytes = int64_t(64) << 20;  // pinned staging: two halves of 32 MiB in flight

int64_t round_up(int64_t v, int64_t a) { return (v + a - 1) / a * a; }

// Bytes from a plane's first byte to the end of its last row: rows may be strided (gpt-oss's
// gate/up halves step over each other's rows), so the span covers rows-1 strides plus one
// packed row, and a view uploaded as a whole keeps its layout.
int64_t plane_span(int64_t rows, int64_t stride, int64_t packed_row) {
  return rows <= 0 ? 0 : (rows - 1) * stride + packed_row;
}

int64_t packed_data_row_bytes(const WeightView& w) {
  if (is_grouped(w.dtype)) return grouped_row_bytes(w.dtype, w.cols);
  if (is_quantized(w.dtype)) return row_bytes(w.dtype, w.cols);
  return w.cols * int64_t(dtype_size(w.dtype));
}

struct CudaStepGraph final : StepGraph {
  struct Download {
    void* dst = nullptr;     // host pointer the step downloads into (stable across replays)
    void* pinned = nullptr;  // where the graph's copy lands
    int64_t bytes = 0;
  };
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  std::vector<Download> downloads;
  ~CudaStepGraph() override {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
    for (const auto& d : downloads) cudaFreeHost(d.pinned);
  }
};

bool graphs_from_env() {
  const char* v = std::getenv("TURBOSPARK_CUDA_GRAPHS");
  return !(v && std::string(v) == "0");
}

// Q4_0 weights are rewritten into code/scale planes at upload (repack.cu): the int8 decode
// kernels then read a 32-element block in one 16-byte load instead of eight 2-byte ones
// (Q4_0 30B-A3B decode 376 vs 350 tok/s on the H200). TURBOSPARK_CUDA_Q4_0_PLANES=0 keeps
// ggml's 18-byte blocks (for measuring; both layouts are tested).
bool q4_0_planes_from_env() {
  const char* v = std::getenv("TURBOSPARK_CUDA_Q4_0_PLANES");
  return !(v && std::string(v) == "0");
}

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int ordinal) : ordinal_(ordinal) {
    int count = 0;
    TS_CUDA_CHECK(cudaGetDeviceCount(&count), "counting devices");
    TS_CHECK(ordinal >= 0 && ordinal < count, "--device cuda: device {} requested, {} present", ordinal, count);
    TS_CUDA_CHECK(cudaSetDevice(ordinal), "select device {}", ordinal);
    TS_CUDA_CHECK(cudaGetDeviceProperties(&props_, ordinal), "device {} properties", ordinal);
    TS_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream");
    matmul_ = std::make_unique<cuda::WeightMatmul>();
    TS_CUDA_CHECK(cudaMalloc(&router_ticket_, sizeof(unsigned)), "router ticket");
    TS_CUDA_CHECK(cudaMemset(router_ticket_, 0, sizeof(unsigned)), "router ticket");
    size_t total_b = 0;
    TS_CUDA_CHECK(cudaMemGetInfo(&free_at_start_, &total_b), "memory info");
  }

  ~CudaBackend() override {
    cudaStreamSynchronize(stream_);
    matmul_.reset();
    if (staging_) cudaFreeHost(staging_);
    for (auto& e : staging_done_) {
      if (e) cudaEventDestroy(e);
    }
    if (weight_pool_) cudaFree(weight_pool_);
    if (repack_src_) cudaFree(repack_src_);
    if (router_ticket_) cudaFree(router_ticket_);
    for (void* p : overflow_weights_) cudaFree(p);
    for (void* p : attention_scratch_) cudaFree(p);
    if (split_done_) cudaEventDestroy(split_done_);
    cudaStreamDestroy(stream_);
  }

  std::string name() const override { return "cuda"; }

  // Free device memory, or what a --gpu-memory-gb limit leaves of it (counting everything
  // taken since this backend was made, as the drop in free memory).
  int64_t device_memory_available() const override {
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) != cudaSuccess) return 0;
    if (memory_limit_ <= 0) return int64_t(free_b);
    const int64_t used = int64_t(free_at_start_) - int64_t(free_b);
    return std::max<int64_t>(0, std::min<int64_t>(int64_t(free_b), memory_limit_ - used));
  }
  void set_memory_limit(int64_t bytes) override {
    TS_CHECK(bytes > 0, "--gpu-memory-gb must be positive");
    memory_limit_ = bytes;
  }
  // Prompt micro-batches of 2048 rows: with 128 experts top-8 a micro-batch of 64 gives each
  // expert ~4 rows, so prefill re-read every expert's weights per 64 tokens (weight-bound at
  // ~2k tok/s on the Q4_0 30B-A3B shape); 512 rows give each expert ~32, a quarter of a
  // grouped MoE tile (128 rows).
  // Measured on the H200 (Q4_0 30B-A3B, bench --ubatch): 2k prompt 10434 (512) vs 13341
  // (2048) tok/s, 8k 6691 vs 8330. The workspace's logits rows cost 2048 x vocab floats.
  int64_t preferred_prefill_batch() const override { return 2048; }
  // bf16 pools: half the bytes a decode step reads at long context, and the prefill tiles the
  // tensor cores multiply come straight from them (attention math stays f32).
  KvType kv_type() const override { return KvType::kBf16; }

  // ---- memory ----
  std::shared_ptr<void> alloc_bytes(int64_t n) override {
    TS_CHECK(!capturing_, "cuda: an allocation of {} bytes inside a captured step", n);
    void* p = nullptr;
    const int64_t bytes = round_up(std::max<int64_t>(n, 1), kAlign);
    if (memory_limit_ > 0 && bytes > device_memory_available()) {
      fail("cuda: {:.1f} MiB of activations or KV cache exceed what --gpu-memory-gb leaves ({:.1f} MiB); a smaller "
           "--ctx needs less",
           double(bytes) / (1 << 20), double(device_memory_available()) / (1 << 20));
    }
    cudaError_t e = cudaMalloc(&p, size_t(bytes));
    if (e != cudaSuccess) {
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      fail("cuda: out of device memory allocating {:.1f} MiB of activations or KV cache ({:.1f} MiB free of {:.1f}); "
           "a smaller --ctx needs less",
           double(bytes) / (1 << 20), double(free_b) / (1 << 20), double(total_b) / (1 << 20));
    }
    TS_CUDA_CHECK(cudaMemsetAsync(p, 0, size_t(bytes), stream_), "zero {} bytes", bytes);
    return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
  }

  // Pageable source: the driver stages it before returning, so the caller may reuse it.
  void upload_bytes(void* dst, const void* src, int64_t n) override {
    if (n <= 0) return;
    TS_CHECK(!capturing_, "cuda: an upload of {} bytes inside a captured step (uploads belong before run_step)", n);
    TS_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(n), cudaMemcpyHostToDevice, stream_), "upload of {} bytes", n);
  }

  void download_bytes(void* dst, const void* src, int64_t n) override {
    if (n <= 0) return;
    if (capturing_) {
      // Inside a captured step: the copy goes to pinned memory the graph owns, and reaches
      // dst when run_step has waited for the replay.
      CudaStepGraph::Download d;
      d.dst = dst;
      d.bytes = n;
      TS_CUDA_CHECK(cudaMallocHost(&d.pinned, size_t(n)), "pinned download slot of {} bytes", n);
      capture_->downloads.push_back(d);
      TS_CUDA_CHECK(cudaMemcpyAsync(d.pinned, src, size_t(n), cudaMemcpyDeviceToHost, stream_),
                    "captured download of {} bytes", n);
      return;
    }
    TS_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(n), cudaMemcpyDeviceToHost, stream_), "download of {} bytes", n);
    TS_CUDA_CHECK(cudaStreamSynchronize(stream_), "the step before a download of {} bytes", n);
  }

  // Decode steps as CUDA graphs (TURBOSPARK_CUDA_GRAPHS=0 runs them eagerly): one launch of
  // the whole step instead of a few hundred, replayed with the position and token already
  // uploaded into the buffers the graph reads.
  void run_step(std::unique_ptr<StepGraph>& slot, const std::function<void()>& record) override {
    // Streamed experts: each MoE layer waits for its routing on the host, which no graph can hold.
    if (!graphs_enabled_ || experts_on_host_) return record();
    auto* g = static_cast<CudaStepGraph*>(slot.get());
    if (!g) {
      // First call: eager, so every scratch buffer reaches its size outside any capture.
      // (Relaxed capture below: the pinned download slots are allocated while capturing.)
      record();
      slot = std::make_unique<CudaStepGraph>();
      return;
    }
    if (!g->exec) {
      capture_ = g;
      capturing_ = true;
      TS_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeRelaxed), "begin step capture");
      try {
        record();
      } catch (...) {
        cudaGraph_t broken = nullptr;
        cudaStreamEndCapture(stream_, &broken);
        if (broken) cudaGraphDestroy(broken);
        capturing_ = false;
        capture_ = nullptr;
        slot.reset();
        throw;
      }
      capturing_ = false;
      capture_ = nullptr;
      TS_CUDA_CHECK(cudaStreamEndCapture(stream_, &g->graph), "end step capture");
      TS_CUDA_CHECK(cudaGraphInstantiate(&g->exec, g->graph, 0), "instantiate the step graph");
    }
    TS_CUDA_CHECK(cudaGraphLaunch(g->exec, stream_), "step graph launch");
    TS_CUDA_CHECK(cudaStreamSynchronize(stream_), "step graph");
    for (const auto& d : g->downloads) std::memcpy(d.dst, d.pinned, size_t(d.bytes));
  }

  void zero_bytes(void* dst, int64_t n) override {
    if (n > 0) TS_CUDA_CHECK(cudaMemsetAsync(dst, 0, size_t(n), stream_), "zero {} bytes", n);
  }

  void synchronize() override { TS_CUDA_CHECK(cudaStreamSynchronize(stream_), "synchronize"); }

  // A 1 GiB device-to-device copy timed by events, median of five after a warm-up: the HBM
  // roofline decode is reported against (about 4.3 TB/s on an H200).
  double copy_bandwidth_gbs() override {
    const size_t bytes = size_t(1) << 30;
    void *a = nullptr, *b = nullptr;
    TS_CUDA_CHECK(cudaMalloc(&a, bytes), "bandwidth probe");
    TS_CUDA_CHECK(cudaMalloc(&b, bytes), "bandwidth probe");
    TS_CUDA_CHECK(cudaMemsetAsync(a, 1, bytes, stream_), "bandwidth probe");
    cudaEvent_t start, stop;
    TS_CUDA_CHECK(cudaEventCreate(&start), "event");
    TS_CUDA_CHECK(cudaEventCreate(&stop), "event");
    std::vector<double> gbs;
    for (int i = 0; i < 6; ++i) {
      TS_CUDA_CHECK(cudaEventRecord(start, stream_), "event");
      TS_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream_), "bandwidth probe copy");
      TS_CUDA_CHECK(cudaEventRecord(stop, stream_), "event");
      TS_CUDA_CHECK(cudaEventSynchronize(stop), "bandwidth probe");
      float ms = 0;
      TS_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop), "event");
      if (i > 0) gbs.push_back(2.0 * double(bytes) / (double(ms) * 1e6));
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaFree(a);
    cudaFree(b);
    std::sort(gbs.begin(), gbs.end());
    return gbs[gbs.size() / 2];
  }

  // ---- weights ----
  void begin_weights(int64_t total_bytes, bool has_routed_experts) override {
    const size_t free_b = size_t(device_memory_available());
    // Room for activations, the KV cache and cuBLASLt's workspace beside the weights.
    const int64_t reserve = int64_t(1) << 30;
    if (experts_on_host_) {
      // Only the dense part comes up, and its size is known once it has: each weight gets its own
      // allocation (a pool sized by the checkpoint would take the room the expert slots need),
      // and one that does not fit fails naming itself.
      pool_bytes_ = 0;
      weight_pool_ = nullptr;
      pool_used_ = 0;
      if (!staging_) {
        TS_CUDA_CHECK(cudaMallocHost(&staging_, size_t(kStagingBytes)), "pinned staging of {} bytes", kStagingBytes);
        for (auto& e : staging_done_) TS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event");
      }
      uploaded_ = 0;
      total_expected_ = 0;
      next_report_ = 0;
      upload_start_ = Clock::now();
      progress_ = isatty(2);
      return;
    }
    const int64_t needed = total_bytes + reserve;
    if (needed > int64_t(free_b)) {
      fail("cuda: the model needs {:.2f} GiB of device memory ({:.2f} GiB of weights + 1 GiB for activations and "
           "the KV cache) but {} has {:.2f} GiB free{}{}",
           double(needed) / (1 << 30), double(total_bytes) / (1 << 30), props_.name, double(free_b) / (1 << 30),
           memory_limit_ > 0 ? " under --gpu-memory-gb" : "",
           has_routed_experts ? "; stream its routed experts from host memory (--expert-cache-gb X or "
                                "--expert-cache-slots N) or run on --device cpu"
                              : "; run on --device cpu");
    }
    // One pool for every weight; views are carved out of it in load order. Slack covers the
    // per-view alignment; anything beyond it (a checkpoint whose views overlap less than its
    // tensors) falls back to its own allocation.
    pool_bytes_ = total_bytes + (int64_t(64) << 20);
    TS_CUDA_CHECK(cudaMalloc(&weight_pool_, size_t(pool_bytes_)), "weight pool of {} bytes", pool_bytes_);
    pool_used_ = 0;
    if (!staging_) {
      TS_CUDA_CHECK(cudaMallocHost(&staging_, size_t(kStagingBytes)), "pinned staging of {} bytes", kStagingBytes);
      for (auto& e : staging_done_) TS_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event");
    }
    uploaded_ = 0;
    total_expected_ = total_bytes;
    next_report_ = 0;
    upload_start_ = Clock::now();
    progress_ = isatty(2);
  }

  WeightView resident(const WeightView& host, const std::string& name) override {
    // Q4_0 goes up as ggml blocks into a scratch buffer and is rewritten into aligned planes
    // (repack.cu) in the weight pool: same bytes, 16-byte loads for the kernels.
    if (q4_0_planes_ && host.dtype == DType::Q4_0 && !host.scales && host.rows > 0 && host.cols % 32 == 0 &&
        host.row_bytes % 2 == 0) {
      const int64_t raw_bytes = plane_span(host.rows, host.row_bytes, packed_data_row_bytes(host));
      if (raw_bytes > repack_src_bytes_) {
        // The old scratch may still feed a queued repack.
        TS_CUDA_CHECK(cudaStreamSynchronize(stream_), "weight upload");
        if (repack_src_) cudaFree(repack_src_);
        repack_src_ = nullptr;
        TS_CUDA_CHECK(cudaMalloc(&repack_src_, size_t(raw_bytes)), "repack scratch for weight {} ({} bytes)", name,
                      raw_bytes);
        repack_src_bytes_ = raw_bytes;
      }
      copy_through_staging(repack_src_, host.data, raw_bytes, name);
      WeightView raw = host;
      raw.data = repack_src_;
      return cuda::launch_repack_q4_0(raw, weight_slot(cuda::q4_0_planes_bytes(host.rows, host.cols), name),
                                      stream_);
    }
    WeightView d = host;
    d.data = upload_plane(host.data, plane_span(host.rows, host.row_bytes, packed_data_row_bytes(host)), name);
    if (host.scales) {
      const int64_t groups = host.group_size > 0 ? host.cols / host.group_size : 0;
      const int64_t packed = groups * int64_t(host.dtype == DType::MXFP4 ? 1 : dtype_size(host.scales_dtype));
      d.scales = upload_plane(host.scales, plane_span(host.rows, host.scales_row_bytes, packed), name);
    }
    if (host.biases) {
      const int64_t groups = host.group_size > 0 ? host.cols / host.group_size : 0;
      const int64_t packed = groups * int64_t(dtype_size(host.scales_dtype));
      d.biases = upload_plane(host.biases, plane_span(host.rows, host.biases_row_bytes, packed), name);
    }
    return d;
  }

  void end_weights() override {
    TS_CUDA_CHECK(cudaStreamSynchronize(stream_), "weight upload");
    if (repack_src_) cudaFree(repack_src_);
    repack_src_ = nullptr;
    repack_src_bytes_ = 0;
    const double s = std::chrono::duration<double>(Clock::now() - upload_start_).count();
    fmt::print(stderr, "{}weights on {}: {:.2f} GiB in {:.2f} s ({:.1f} GB/s through pinned staging)\n",
               progress_ ? "\r" : "", props_.name, double(uploaded_) / (1 << 30), s, double(uploaded_) / 1e9 / std::max(s, 1e-9));
  }

  // ---- expert streaming (expert_slots.h) ----
  WeightView resident_expert(const WeightView& host, const std::string& name) override {
    return experts_on_host_ ? host : resident(host, name);
  }
  void keep_experts_on_host() override {
    TS_CHECK(!weight_pool_ && uploaded_ == 0, "cuda: keep_experts_on_host after weights were uploaded");
    experts_on_host_ = true;
  }
  bool experts_on_host() const override { return experts_on_host_; }
  void set_expert_cache(int64_t slots, int top_k, EvictionPolicy policy,
                        std::span<const ExpertWeights* const> layer_experts) override {
    TS_CHECK(experts_on_host_, "cuda: an expert cache without keep_experts_on_host (the experts are resident)");
    TS_CUDA_CHECK(cudaStreamSynchronize(stream_), "expert cache");  // the load's queue settles what is free
    expert_slots_.reset();
    expert_slots_ = std::make_unique<cuda::DeviceExpertSlots>(slots, top_k, policy, layer_experts,
                                                              device_memory_available(), stream_);
    link_share_ = 0.5;
    link_share_fixed_ = false;
    if (const char* v = std::getenv("TURBOSPARK_CUDA_EXPERT_LINK_SHARE"); v && std::string(v) != "auto") {
      char* end = nullptr;
      const double share = std::strtod(v, &end);
      TS_CHECK(*v && end && *end == '\0' && share >= 0.0 && share <= 1.0,
               "TURBOSPARK_CUDA_EXPERT_LINK_SHARE must be a fraction in [0, 1] or auto, got '{}'", v);
      link_share_ = share;
      link_share_fixed_ = true;
    }
    if (host_compute_) expert_slots_->set_link_share(link_share_);
  }
  std::string expert_cache_summary() const override { return expert_slots_ ? expert_slots_->summary() : ""; }
  bool device_expert_cache_stats(ExpertCacheStats* out) const override {
    if (!expert_slots_) return false;
    *out = expert_slots_->stats();
    return true;
  }

  // ---- ops ----
  void matmul(const Weight& w, const Mat& x, const Mat& y) override { matmul_->matmul(w.view, x, y, stream_); }
  void matmul_shared_input(std::span<const Weight* const> ws, const Mat& x, std::span<const Mat> ys,
                           std::span<const MatmulAct> acts = {}) override {
    TS_CHECK(ws.size() <= 8, "matmul_shared_input: {} weights (at most 8)", ws.size());
    std::array<const WeightView*, 8> views{};
    for (size_t i = 0; i < ws.size(); ++i) views[i] = &ws[i]->view;
    matmul_->matmul_shared_input(std::span<const WeightView* const>(views.data(), ws.size()), x, ys, acts, stream_);
  }
  void add_bias(const Mat& y, const float* bias) override { cuda::add_bias(y, bias, stream_); }
  void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset) override {
    cuda::rmsnorm(x, weight, eps, y, weight_offset, stream_);
  }
  void rmsnorm_gated(const Mat& x, const float* weight, int groups, float eps, const Mat& gate, Act act,
                     const Mat& y) override {
    cuda::rmsnorm_gated(x, weight, groups, eps, gate, act, y, stream_);
  }
  void rmsnorm_groups(const Mat& x, const float* weight, int groups, float eps, const Mat& y,
                      float weight_offset = 0.f) override {
    cuda::rmsnorm_groups(x, weight, groups, eps, y, weight_offset, stream_);
  }
  void add_rmsnorm(const Mat& x, const Mat& residual, const float* weight, float eps, const Mat& y,
                   float weight_offset) override {
    cuda::add_rmsnorm(x, residual, weight, eps, y, weight_offset, stream_);
  }
  void rope(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions, const float* inv_freq,
            float attention_factor) override {
    cuda::rope(x, n_heads, head_dim, rotary_dim, positions, inv_freq, attention_factor, stream_);
  }
  void kv_write(const KvLayerView& kv, const Mat& k, const Mat& v, const int64_t* positions) override {
    cuda::kv_write(kv, k, v, positions, stream_);
  }
  void attention_prep(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p, const int64_t* positions,
                      const KvLayerView& kv) override {
    if (!cuda::attention_prep(q, k, v, p, positions, kv, stream_)) Backend::attention_prep(q, k, v, p, positions, kv);
  }
  void attention(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale, int window,
                 const float* sinks, const Mat& out) override {
    const int64_t want = cuda::attention_scratch_floats(q.rows, n_heads, kv.head_dim);
    float* scratch = attention_scratch(want);
    cuda::attention(q, positions, kv, n_heads, scale, window, sinks, out, scratch, want, stream_);
  }
  void prep_attention(const Mat& q, const Mat& k, const Mat& v, const AttentionPrep& p, const int64_t* positions,
                      const KvLayerView& kv, float scale, int window, const float* sinks, const Mat& out) override {
    // One decode row with a short span: norms, RoPE, cache write and attention in one launch.
    if (q.rows == 1 && kv.span_bound > 0) {
      const int64_t span = window > 0 ? std::min<int64_t>(kv.span_bound, window) : kv.span_bound;
      if (span <= cuda::attention_decode_fused_max_span() &&
          cuda::attention_decode_fused(q, k, v, p, positions, kv, scale, window, sinks, out, stream_))
        return;
    }
    const int64_t want = cuda::attention_scratch_floats(q.rows, p.n_heads, kv.head_dim);
    if (q.rows == 1 && cuda::attention_decode_prep_enabled()) {
      float* scratch = attention_scratch(want);
      if (cuda::attention_decode_prep(q, k, v, p, positions, kv, scale, window, sinks, out, scratch, want, stream_))
        return;
    }
    Backend::prep_attention(q, k, v, p, positions, kv, scale, window, sinks, out);
  }
  void swiglu(const Mat& gate, const Mat& up, const Mat& out) override { cuda::swiglu(gate, up, out, stream_); }
  void embedding(const Weight& table, const int32_t* ids, int64_t n, float scale, const Mat& out) override {
    matmul_->embedding(table.view, ids, n, scale, out, stream_);
  }
  void add(const Mat& y, const Mat& x) override { cuda::add(y, x, stream_); }
  void router_topk(const Weight& router, const Mat& x, const Mat& logits, int k, bool renormalize, int32_t* idx,
                   float* weight, const float* expert_scale, const float* bias) override {
    if (!cuda::router_gemv_topk(router.view, x, logits, k, renormalize, idx, weight, expert_scale, bias,
                                router_ticket_, stream_))
      Backend::router_topk(router, x, logits, k, renormalize, idx, weight, expert_scale, bias);
  }
  void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight,
                           const float* expert_scale) override {
    cuda::router_softmax_topk(logits, k, renormalize, idx, weight, expert_scale, stream_);
  }
  void softmax_rows(const Mat& x, const Mat& y) override { cuda::softmax_rows(x, y, stream_); }
  void argmax_rows(const Mat& logits, int32_t* ids) override { cuda::argmax_rows(logits, ids, stream_); }
  void unary(const Mat& x, Act act, float pre, float post, const Mat& y) override {
    cuda::unary(x, act, pre, post, y, stream_);
  }
  void mul_act(const Mat& x, const Mat& gate, Act act) override { cuda::mul_act(x, gate, act, stream_); }
  void split_heads(const Mat& ab, int n_heads, int head_dim, const Mat& a, const Mat& b) override {
    cuda::split_heads(ab, n_heads, head_dim, a, b, stream_);
  }
  void copy(const Mat& src, const Mat& dst) override { cuda::copy(src, dst, stream_); }
  void moe_experts(const std::vector<ExpertWeights>& experts, const Mat& x, const int32_t* idx, const float* weight,
                   int k, const Mat& out) override {
    if (!experts_on_host_) return matmul_->moe_experts(experts, x, idx, weight, k, out, stream_);
    moe_streamed(experts, x, idx, weight, k, out);
  }

  // Qwen4-Exp's hybrid ops (causal_conv1d.cu, gated_delta_rule.cu, hyper_connection.cu, qsa.cu).
  void causal_conv1d(const Mat& in, const float* w, int kernel, int dilation, const Mat& state, Act act,
                     const Mat& out) override {
    cuda::causal_conv1d(in, w, kernel, dilation, state, act, out, stream_);
  }
  void gated_delta_rule(const Mat& qkv, const Mat& a, const Mat& b, const float* a_log, const float* dt_bias,
                        int n_k_heads, int n_v_heads, int dk, int dv, bool v_heads_tiled, const Mat& state,
                        const Mat& out) override {
    cuda::gated_delta_rule(qkv, a, b, a_log, dt_bias, n_k_heads, n_v_heads, dk, dv, v_heads_tiled, state, out, stream_);
  }
  void hc_mix(const Mat& weight, const Mat& normed, int n_streams, const Mat& mixed) override {
    cuda::hc_mix(weight, normed, n_streams, mixed, stream_);
  }
  void hc_inject_gated(const Mat& streams, const Mat& branch, const Mat& shared, const Mat& shared_gate,
                       const Mat& inject, int n_streams) override {
    cuda::hc_inject_gated(streams, branch, shared, shared_gate, inject, n_streams, stream_);
  }
  void hc_inject(const Mat& streams, const Mat& branch, const Mat& inject, int n_streams) override {
    cuda::hc_inject(streams, branch, inject, n_streams, stream_);
  }
  void ple_gate(const Mat& key, const Mat& query, const Mat& value, int n_streams, const Mat& out) override {
    cuda::ple_gate(key, query, value, n_streams, out, stream_);
  }
  void qsa_select(const QsaView& qsa, const Mat& index_q, const Mat& raw_keys, const int64_t* positions,
                  int32_t* selected, int32_t* counts, int max_selected) override {
    cuda::qsa_select(qsa, index_q, raw_keys, positions, selected, counts, max_selected, stream_, &qsa_spill_);
  }
  void attention_selected(const Mat& q, const KvLayerView& kv, int n_heads, float scale, const int32_t* selected,
                          const int32_t* counts, int max_selected, const Mat& out) override {
    const int64_t want = cuda::attention_selected_scratch_floats(q.rows, n_heads, kv.head_dim, max_selected);
    cuda::attention_selected(q, kv, n_heads, scale, selected, counts, max_selected, out, stream_,
                             attention_scratch(want), want);
  }

 private:
  // Copies `bytes` of host memory into the weight pool (or its own allocation past the pool)
  // through pinned staging: two halves alternate, each reused only after its copy finished.
  void* upload_plane(const void* src, int64_t bytes, const std::string& name) {
    if (bytes <= 0 || !src) return nullptr;
    void* dst = weight_slot(bytes, name);
    copy_through_staging(dst, src, bytes, name);
    return dst;
  }

  // Streamed experts: the deliberate sync after the router (its choices decide the loads), then
  // the experts the rows name come into device slots and the grouped kernels run on the slots.
  // A micro-batch naming more distinct experts than there are slots (a long prompt through a
  // small cache) runs in passes of at most `slots` experts: each pass keeps the pairs routed to
  // its experts, gives the others weight 0 (they point at a loaded expert, and add nothing),
  // and the passes' outputs are summed. Otherwise a prompt micro-batch's pooled loads arrive in
  // banks on the slots' copy stream, each bank's grouped projections waiting only for it
  // (expert_slots.h).
  void moe_streamed(const std::vector<ExpertWeights>& experts, const Mat& x, const int32_t* idx, const float* weight,
                    int k, const Mat& out) {
    TS_CHECK(expert_slots_, "cuda: routed experts are in host memory but no expert cache was set (set_expert_cache)");
    if (x.rows == 0) return;
    const int64_t pairs = x.rows * k;
    const bool split = host_compute_ && x.rows <= cuda::kMoeDecodeMaxRows;
    routed_ids_.resize(size_t(pairs));
    if (split) download_for_split(idx, weight, x, pairs);  // moe_split's inputs too, in one wait
    else download_bytes(routed_ids_.data(), idx, pairs * 4);
    auto upload = [this](void* dst, const void* src, int64_t bytes) { stage_copy(dst, src, bytes, "routed expert"); };
    // The distinct experts in first-use order.
    std::vector<int32_t>& distinct = distinct_;
    std::vector<uint8_t>& seen = expert_flag_;
    distinct.clear();
    seen.assign(experts.size(), 0);
    for (int32_t id : routed_ids_) {
      TS_CHECK(id >= 0 && size_t(id) < seen.size(), "cuda: layer {} routed a row to expert {} of {}",
               experts[0].gate.layer, id, seen.size());
      if (!seen[size_t(id)]) {
        seen[size_t(id)] = 1;
        distinct.push_back(id);
      }
    }
    if (split) return moe_split(experts, x, k, out);
    const int64_t slots = expert_slots_->slots();
    if (int64_t(distinct.size()) <= slots) {
      // A prompt micro-batch's loads come in banks its grouped projections wait for one by one.
      std::vector<cuda::MoeBank>* banks = x.rows > cuda::kMoeDecodeMaxRows ? &moe_banks_ : nullptr;
      const std::vector<ExpertWeights>& placed = expert_slots_->place(experts, routed_ids_, upload, banks);
      return matmul_->moe_experts(placed, x, idx, weight, k, out, stream_,
                                  banks ? std::span<const cuda::MoeBank>(*banks) : std::span<const cuda::MoeBank>());
    }
    routed_weights_.resize(size_t(pairs));
    download_bytes(routed_weights_.data(), weight, pairs * 4);
    const Mat part = pass_part(x.rows, out.cols);
    for (size_t first = 0; first < distinct.size(); first += size_t(slots)) {
      const size_t last = std::min(distinct.size(), first + size_t(slots));
      std::fill(seen.begin(), seen.end(), 0);  // now: in this pass
      for (size_t i = first; i < last; ++i) seen[size_t(distinct[i])] = 1;
      // Stream-ordered after the previous pass's kernels, which read these buffers.
      upload_masked_routing(seen, distinct[first]);
      const std::vector<ExpertWeights>& placed = expert_slots_->place(experts, pass_ids_, upload);
      if (first == 0) {
        matmul_->moe_experts(placed, x, pass_idx_.data(), pass_weight_.data(), k, out, stream_);
      } else {
        matmul_->moe_experts(placed, x, pass_idx_.data(), pass_weight_.data(), k, part, stream_);
        cuda::add(out, part, stream_);
      }
      // The next pass may evict what this one's kernels read: wait for them (one bank).
      TS_CUDA_CHECK(cudaStreamSynchronize(stream_), "streamed MoE pass");
    }
  }

  // Decode-sized micro-batches with host compute on (TURBOSPARK_CUDA_EXPERT_HOST_COMPUTE=1):
  // the experts the slots hold run on the GPU; of the missed ones, a share crosses the link
  // into slots (and stays cached) for the GPU, and the rest run on the host's cores from their
  // host copies at the same time (a token's Q4_0 expert is ~2.5 MB, which the host might read
  // from RAM about as fast as the link moves it; measured on an H100 machine, the host's share
  // costs more than the link would, so this stays off by default: README). The host's share
  // is uploaded and added. The link's share of the misses
  // (TURBOSPARK_CUDA_EXPERT_LINK_SHARE, a fraction; default auto) balances itself: after the
  // host's share, a GPU still busy lowers it a step, an idle one raises it.
  // Its routing weights and x came down with the expert ids (download_for_split).
  void moe_split(const std::vector<ExpertWeights>& experts, const Mat& x, int k, const Mat& out) {
    const int32_t layer = experts[0].gate.layer;
    const int64_t rows = x.rows, hidden = out.cols, pairs = rows * k;
    // expert_flag_: whether the GPU computes the expert (held in a slot, or loaded now), for
    // the distinct ones.
    int32_t on_gpu = -1;
    int64_t held = 0, missed = 0;
    for (int32_t e : distinct_) {
      const bool h = expert_slots_->holds(layer, e);
      expert_flag_[size_t(e)] = h;
      if (h && on_gpu < 0) on_gpu = e;
      held += h;
      missed += !h;
    }
    // Misses for the link: as many as the share says and the free slots allow (the held ones
    // and these must all be in slots at once).
    const int64_t to_link =
        std::min<int64_t>(expert_slots_->slots() - held, std::llround(link_share_ * double(missed)));
    int64_t linked = 0;
    for (int32_t e : distinct_) {
      if (linked >= to_link) break;
      if (expert_flag_[size_t(e)]) continue;
      expert_flag_[size_t(e)] = 1;
      if (on_gpu < 0) on_gpu = e;
      ++linked;
    }
    const int64_t n_host = missed - linked;
    expert_slots_->count_host_compute(n_host, linked, int64_t(distinct_.size()));
    // The GPU's share (queued before the host computes its own, so both run at once).
    auto gpu_share = [&] {
      if (on_gpu < 0) return;
      upload_masked_routing(expert_flag_, on_gpu);
      auto upload = [this](void* dst, const void* src, int64_t bytes) { stage_copy(dst, src, bytes, "routed expert"); };
      const std::vector<ExpertWeights>& placed = expert_slots_->place(experts, pass_ids_, upload);
      matmul_->moe_experts(placed, x, pass_idx_.data(), pass_weight_.data(), k, out, stream_);
    };
    if (n_host == 0) {
      gpu_share();
      // The host had nothing to do: give it more next time (unless the link had nothing either).
      if (linked > 0) adjust_link_share(-1);
      return;
    }
    // The host's share: one row per (row, expert) pair it computes, so each expert's weights
    // are read once for all its pairs; then summed into the rows (x is in host_x_ already).
    host_pair_row_.clear();
    host_pair_id_.clear();
    host_pair_w_.clear();
    for (int64_t j = 0; j < pairs; ++j) {
      const int32_t id = routed_ids_[size_t(j)];
      if (expert_flag_[size_t(id)]) continue;
      host_pair_row_.push_back(int32_t(j / k));
      host_pair_id_.push_back(id);
      host_pair_w_.push_back(routed_weights_[size_t(j)]);
    }
    gpu_share();
    if (on_gpu >= 0) {
      if (!split_done_) TS_CUDA_CHECK(cudaEventCreateWithFlags(&split_done_, cudaEventDisableTiming), "event");
      TS_CUDA_CHECK(cudaEventRecord(split_done_, stream_), "event");
    }
    const int64_t n = int64_t(host_pair_row_.size());
    host_pair_x_.resize(size_t(n * hidden));
    host_pair_y_.resize(size_t(n * hidden));
    for (int64_t i = 0; i < n; ++i)
      std::memcpy(&host_pair_x_[size_t(i * hidden)], &host_x_[size_t(host_pair_row_[size_t(i)] * hidden)],
                  size_t(hidden) * 4);
    if (!host_) host_ = make_cpu_backend(0);
    host_->moe_experts(host_experts(experts), Mat(host_pair_x_.data(), n, hidden), host_pair_id_.data(),
                       host_pair_w_.data(), 1, Mat(host_pair_y_.data(), n, hidden));
    host_x_.assign(size_t(rows * hidden), 0.f);  // now: the host's share per row
    for (int64_t i = 0; i < n; ++i) {
      float* dst = &host_x_[size_t(host_pair_row_[size_t(i)] * hidden)];
      const float* src = &host_pair_y_[size_t(i * hidden)];
      for (int64_t c = 0; c < hidden; ++c) dst[c] += src[c];
    }
    // The host's share goes up from pinned memory without a wait: the next split's download
    // waits for the stream, so the copy has finished before this memory is written again.
    float* share = split_pinned_.upload;
    std::memcpy(share, host_x_.data(), size_t(rows * hidden) * 4);
    auto upload_share = [&](const Mat& dst) {
      TS_CUDA_CHECK(cudaMemcpy2DAsync(dst.data, size_t(dst.stride) * 4, share, size_t(hidden) * 4, size_t(hidden) * 4,
                                      size_t(rows), cudaMemcpyHostToDevice, stream_),
                    "MoE split: the host's share [{}, {}]", rows, hidden);
    };
    if (on_gpu < 0) {
      adjust_link_share(+1);  // the GPU sat idle
      return upload_share(out);  // the host's share is the whole output
    }
    // The GPU still busy once the host is done: the link took too much; idle: too little.
    const cudaError_t q = cudaEventQuery(split_done_);
    TS_CHECK(q == cudaSuccess || q == cudaErrorNotReady, "cuda: MoE split: {}", cudaGetErrorString(q));
    adjust_link_share(q == cudaSuccess ? +1 : -1);
    const Mat part = pass_part(rows, hidden);
    upload_share(part);
    cuda::add(out, part, stream_);
  }

  // moe_split's inputs from the device in one wait: the routing's ids (routed_ids_) and
  // weights (routed_weights_) and x (host_x_), through pinned memory (split_pinned_, which
  // also holds the host's share on its way up).
  void download_for_split(const int32_t* idx, const float* weight, const Mat& x, int64_t pairs) {
    const int64_t values = x.rows * x.cols;
    if (split_pinned_.pairs < pairs || split_pinned_.values < values) {
      split_pinned_.release();
      split_pinned_.pairs = std::max(split_pinned_.pairs, pairs);
      split_pinned_.values = std::max(split_pinned_.values, values);
      void* p = nullptr;
      const int64_t bytes = 8 * split_pinned_.pairs + 8 * split_pinned_.values;
      TS_CUDA_CHECK(cudaMallocHost(&p, size_t(bytes)), "pinned MoE split buffers of {} bytes", bytes);
      split_pinned_.ids = static_cast<int32_t*>(p);
      split_pinned_.weights = reinterpret_cast<float*>(split_pinned_.ids + split_pinned_.pairs);
      split_pinned_.x = split_pinned_.weights + split_pinned_.pairs;
      split_pinned_.upload = split_pinned_.x + split_pinned_.values;
    }
    TS_CUDA_CHECK(cudaMemcpyAsync(split_pinned_.ids, idx, size_t(pairs) * 4, cudaMemcpyDeviceToHost, stream_),
                  "MoE split: routing ids");
    TS_CUDA_CHECK(cudaMemcpyAsync(split_pinned_.weights, weight, size_t(pairs) * 4, cudaMemcpyDeviceToHost, stream_),
                  "MoE split: routing weights");
    TS_CUDA_CHECK(cudaMemcpy2DAsync(split_pinned_.x, size_t(x.cols) * 4, x.data, size_t(x.stride) * 4,
                                    size_t(x.cols) * 4, size_t(x.rows), cudaMemcpyDeviceToHost, stream_),
                  "MoE split: x [{}, {}]", x.rows, x.cols);
    TS_CUDA_CHECK(cudaStreamSynchronize(stream_), "the step before a MoE split's routing");
    routed_ids_.assign(split_pinned_.ids, split_pinned_.ids + pairs);
    routed_weights_.assign(split_pinned_.weights, split_pinned_.weights + pairs);
    host_x_.assign(split_pinned_.x, split_pinned_.x + values);
  }

  // The routing restricted to the experts `keep` flags: other pairs point at `fallback` (a kept
  // expert) with weight 0, into pass_ids_ and, uploaded in stream order, pass_idx_/pass_weight_.
  void upload_masked_routing(const std::vector<uint8_t>& keep, int32_t fallback) {
    const int64_t pairs = int64_t(routed_ids_.size());
    pass_ids_.resize(size_t(pairs));
    pass_weights_.resize(size_t(pairs));
    for (int64_t j = 0; j < pairs; ++j) {
      const int32_t id = routed_ids_[size_t(j)];
      const bool here = keep[size_t(id)];
      pass_ids_[size_t(j)] = here ? id : fallback;
      pass_weights_[size_t(j)] = here ? routed_weights_[size_t(j)] : 0.f;
    }
    if (pass_idx_.size() < pairs) {
      pass_idx_ = alloc_array<int32_t>(pairs);
      pass_weight_ = alloc_array<float>(pairs);
    }
    upload_bytes(pass_idx_.data(), pass_ids_.data(), pairs * 4);
    upload_bytes(pass_weight_.data(), pass_weights_.data(), pairs * 4);
  }

  // moe_split's balance between the link and the host's cores: a step towards whichever
  // finished first, unless the share was set by hand.
  void adjust_link_share(int direction) {
    if (link_share_fixed_) return;
    link_share_ = std::clamp(link_share_ + 0.02 * direction, 0.0, 1.0);
    expert_slots_->set_link_share(link_share_);
  }

  // [rows, cols] of device scratch for a partial MoE output added into the real one.
  Mat pass_part(int64_t rows, int64_t cols) {
    if (pass_out_.size() < rows * cols) pass_out_ = alloc_array<float>(rows * cols);
    return Mat(pass_out_.data(), rows, cols);
  }

  // The layer's experts as the host computes them: their weights are host views already, but
  // biases (gpt-oss) are backend memory: copied down once per layer.
  const std::vector<ExpertWeights>& host_experts(const std::vector<ExpertWeights>& experts) {
    const ExpertWeights& e0 = experts[0];
    if (!e0.gate_bias && !e0.up_bias && !e0.down_bias) return experts;
    const size_t layer = size_t(std::max(e0.gate.layer, 0));
    if (host_experts_.size() <= layer) {
      host_experts_.resize(layer + 1);
      host_biases_.resize(layer + 1);
    }
    std::vector<ExpertWeights>& he = host_experts_[layer];
    if (he.size() == experts.size()) return he;
    he = experts;
    std::vector<std::vector<float>>& store = host_biases_[layer];
    store.clear();
    store.reserve(3 * experts.size());
    auto copy_down = [&](const float*& bias, int64_t n) {
      if (!bias) return;
      store.emplace_back(size_t(n));
      download_bytes(store.back().data(), bias, n * 4);
      bias = store.back().data();
    };
    for (ExpertWeights& e : he) {
      copy_down(e.gate_bias, e.gate.view.rows);
      copy_down(e.up_bias, e.up.view.rows);
      copy_down(e.down_bias, e.down.view.rows);
    }
    return he;
  }

  // Host -> device through the pinned staging halves, ordered on the stream (no load progress).
  void stage_copy(void* dst, const void* src, int64_t bytes, const char* what) {
    TS_CHECK(staging_, "cuda: {} copied before any weights were loaded", what);
    const int64_t half = kStagingBytes / 2;
    for (int64_t off = 0; off < bytes; off += half) {
      const int64_t n = std::min(half, bytes - off);
      const int h = staging_half_;
      staging_half_ ^= 1;
      TS_CUDA_CHECK(cudaEventSynchronize(staging_done_[h]), "staging for {}", what);
      char* stage = static_cast<char*>(staging_) + h * half;
      std::memcpy(stage, static_cast<const char*>(src) + off, size_t(n));
      TS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + off, stage, size_t(n), cudaMemcpyHostToDevice, stream_),
                    "copy of {} ({} bytes)", what, n);
      TS_CUDA_CHECK(cudaEventRecord(staging_done_[h], stream_), "staging event");
    }
  }

  // kAlign-aligned room for `bytes` of weight: the pool, or its own allocation past it.
  void* weight_slot(int64_t bytes, const std::string& name) {
    void* dst = nullptr;
    const int64_t slot = round_up(std::max<int64_t>(bytes, 1), kAlign);
    if (weight_pool_ && pool_used_ + slot <= pool_bytes_) {
      dst = static_cast<char*>(weight_pool_) + pool_used_;
      pool_used_ += slot;
    } else {
      TS_CUDA_CHECK(cudaMalloc(&dst, size_t(slot)), "weight {} ({} bytes) beyond the pool", name, bytes);
      overflow_weights_.push_back(dst);
    }
    return dst;
  }

  void copy_through_staging(void* dst, const void* src, int64_t bytes, const std::string& name) {
    TS_CHECK(staging_, "cuda: weight {} made resident outside begin_weights/end_weights", name);
    stage_copy(dst, src, bytes, name.c_str());
    uploaded_ += bytes;
    report_progress();
  }

  // Every tenth of the weights, for loads of 256 MiB or more (a tiny model's ten lines said
  // nothing; end_weights' summary line is printed for every load).
  void report_progress() {
    if (uploaded_ < next_report_ || total_expected_ < (int64_t(256) << 20)) return;
    next_report_ = uploaded_ + std::max<int64_t>(total_expected_ / 10, 1);
    const double s = std::chrono::duration<double>(Clock::now() - upload_start_).count();
    const double pct = 100.0 * double(uploaded_) / double(total_expected_);
    fmt::print(stderr, "{}uploading weights: {:.0f}% ({:.2f} GiB, {:.1f} GB/s){}", progress_ ? "\r" : "",
               std::min(pct, 100.0), double(uploaded_) / (1 << 30), double(uploaded_) / 1e9 / std::max(s, 1e-9),
               progress_ ? "" : "\n");
  }

  // Grown before use, never during a forward that is being captured (the first, eager step
  // of each shape sizes it).
  float* attention_scratch(int64_t floats) {
    if (floats <= 0) return nullptr;
    if (floats <= attention_scratch_floats_) return static_cast<float*>(attention_scratch_.back());
    void* p = nullptr;
    TS_CUDA_CHECK(cudaMalloc(&p, size_t(floats) * 4), "attention scratch of {} floats", floats);
    // Older scratch may still be read by queued work: kept until the backend goes.
    attention_scratch_.push_back(p);
    attention_scratch_floats_ = floats;
    return static_cast<float*>(p);
  }

  int ordinal_;
  cudaDeviceProp props_{};
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<cuda::WeightMatmul> matmul_;

  void* weight_pool_ = nullptr;
  int64_t pool_bytes_ = 0, pool_used_ = 0;
  std::vector<void*> overflow_weights_;
  bool q4_0_planes_ = q4_0_planes_from_env();
  void* repack_src_ = nullptr;  // Q4_0 blocks on their way into planes (resident)
  int64_t repack_src_bytes_ = 0;
  unsigned* router_ticket_ = nullptr;  // router_gemv_topk's last-block counter (left at 0)
  void* staging_ = nullptr;
  cudaEvent_t staging_done_[2] = {nullptr, nullptr};
  int staging_half_ = 0;
  int64_t uploaded_ = 0, total_expected_ = 0, next_report_ = 0;
  Clock::time_point upload_start_;
  bool progress_ = false;

  std::vector<void*> attention_scratch_;
  int64_t attention_scratch_floats_ = 0;

  cuda::DeviceScratch qsa_spill_;  // QSA block scores past shared memory (long contexts)
  size_t free_at_start_ = 0;  // device memory free when this backend was made
  int64_t memory_limit_ = 0;  // --gpu-memory-gb, 0: none

  // Expert streaming: routed experts in host memory, streamed through device slots.
  bool experts_on_host_ = false;
  std::unique_ptr<cuda::DeviceExpertSlots> expert_slots_;
  std::vector<cuda::MoeBank> moe_banks_;
  std::vector<int32_t> routed_ids_;
  std::vector<float> routed_weights_;
  std::vector<int32_t> distinct_;     // moe_streamed: the layer's distinct routed experts
  std::vector<uint8_t> expert_flag_;  // per expert: in this pass (moe_streamed) or on the GPU (moe_split)
  std::vector<int32_t> pass_ids_;     // upload_masked_routing's host copies
  std::vector<float> pass_weights_;
  // moe_split's host side: the micro-batch's rows (then the host's share per row) and one row
  // per (row, expert) pair the host computes.
  std::vector<float> host_x_, host_pair_x_, host_pair_y_, host_pair_w_;
  // download_for_split's pinned memory: ids and weights [pairs], x and the host's share [values].
  struct SplitPinned {
    int64_t pairs = 0, values = 0;
    int32_t* ids = nullptr;
    float *weights = nullptr, *x = nullptr, *upload = nullptr;
    void release() {
      if (ids) cudaFreeHost(ids);
      ids = nullptr;
    }
    ~SplitPinned() { release(); }
  } split_pinned_;
  std::vector<int32_t> host_pair_row_, host_pair_id_;
  // Expert streaming: decode's missed experts computed on the host (moe_split), and its backend.
  const bool host_compute_ = [] {
    const char* v = std::getenv("TURBOSPARK_CUDA_EXPERT_HOST_COMPUTE");
    return v && std::string(v) == "1";
  }();
  std::unique_ptr<Backend> host_;
  // The share of a decode step's missed experts moe_split sends over the link (the rest run on
  // the host): TURBOSPARK_CUDA_EXPERT_LINK_SHARE, a fraction in [0, 1], fixes it; unset or
  // "auto" starts at one half and balances itself.
  double link_share_ = 0.5;
  bool link_share_fixed_ = false;
  cudaEvent_t split_done_ = nullptr;  // after moe_split's GPU share
  std::vector<std::vector<ExpertWeights>> host_experts_;        // per layer, with host biases
  std::vector<std::vector<std::vector<float>>> host_biases_;    // their storage
  BackendArray<int32_t> pass_idx_;  // a pass's masked routing (moe_streamed)
  BackendArray<float> pass_weight_;
  BackendArray<float> pass_out_;

  bool graphs_enabled_ = graphs_from_env();
  bool capturing_ = false;
  CudaStepGraph* capture_ = nullptr;
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int ordinal) { return std::make_unique<CudaBackend>(ordinal); }

bool cuda_available() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

}  // namespace turbospark
