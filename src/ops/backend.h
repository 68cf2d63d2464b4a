// The one small interface between models and hardware. A forward step records ops against
// a Backend: the CPU backend runs each op eagerly on its thread pool; the CUDA backend
// (next) enqueues the same ops on a stream and captures decode steps in graphs. Models never
// learn which, never touch raw kernels, and never branch on a weight's dtype: formats are
// the backend's business.
//
// Activations are Mat views into buffers the backend allocated (host memory on CPU). Any
// host write into such a buffer goes through upload() at an explicit row, so that on a
// queued backend it is ordered with the work around it (the seed's PLE hazard).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace turbospark {

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

// One routed expert: SwiGLU FFN [hidden] -> [inter] -> [hidden].
struct ExpertWeights {
  Weight gate;  // [inter, hidden]
  Weight up;    // [inter, hidden]
  Weight down;  // [hidden, inter]
};

// One layer's paged KV cache as the backend sees it (see engine/kv_cache.h).
struct KvLayerView {
  float* const* k_blocks = nullptr;  // per block: [block_size, n_kv_heads, head_dim] f32
  float* const* v_blocks = nullptr;
  const int32_t* block_table = nullptr;
  int block_size = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;

  // Scratch activations [rows, cols] f32, owned by the backend until released with the
  // returned handle.
  virtual std::shared_ptr<float> alloc(int64_t n_floats) = 0;
  // Host -> backend copy into `dst` (rows of a Mat the backend allocated).
  virtual void upload(const Mat& dst, const float* src) = 0;
  // Backend -> host copy; a synchronisation point on queued backends.
  virtual void download(const Mat& src, float* dst) = 0;

  // y = x W^T for W [out, in]; one row of x is a GEMV (decode), many a GEMM (prefill).
  virtual void matmul(const Weight& w, const Mat& x, const Mat& y) = 0;
  // y[t, :] += bias (length y.cols)
  virtual void add_bias(const Mat& y, const float* bias) = 0;
  virtual void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset = 0.f) = 0;
  // In-place RoPE (rotate-half layout) over x viewed as [rows, n_heads, head_dim].
  virtual void rope(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions,
                    const float* inv_freq, float attention_factor) = 0;
  // Writes k/v rows [rows, n_kv_heads * head_dim] at positions into the paged cache.
  virtual void kv_write(const KvLayerView& kv, const Mat& k, const Mat& v, const int64_t* positions) = 0;
  virtual void attention(const Mat& q, const int64_t* positions, const KvLayerView& kv, int n_heads, float scale,
                         int window, const float* sinks, const Mat& out) = 0;
  virtual void swiglu(const Mat& gate, const Mat& up, const Mat& out) = 0;
  virtual void embedding(const Weight& table, const int32_t* ids, int64_t n, float scale, const Mat& out) = 0;
  virtual void add(const Mat& y, const Mat& x) = 0;  // y += x
  // Softmax top-k routing of router logits [rows, n_experts] into idx/weight [rows, k].
  virtual void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight) = 0;
  // out[t] = sum_j weight[t, j] * expert_{idx[t, j]}(x[t]). Routing stays on the backend:
  // resident experts need no host round trip (the streaming path syncs here, by design).
  virtual void moe_experts(const std::vector<ExpertWeights>& experts, const Mat& x, const int32_t* idx,
                           const float* weight, int k, const Mat& out) = 0;
};

std::unique_ptr<Backend> make_cpu_backend(int n_threads);

}  // namespace turbospark
