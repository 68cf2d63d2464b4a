#include "backends/cuda/expert_slots.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"
#include "core/quant.h"
#include "core/quant_grouped.h"

namespace turbospark::cuda {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kPlaneAlign = 256;  // every plane 256-byte aligned in its slot: the kernels' 16-byte loads

int64_t align_up(int64_t v) { return (v + kPlaneAlign - 1) / kPlaneAlign * kPlaneAlign; }

// Bytes from a plane's first row to the end of its last (rows may be strided: gpt-oss's
// interleaved gate/up views step over each other's rows, and the copy keeps that layout).
int64_t span(int64_t rows, int64_t stride, int64_t packed_row) { return rows <= 0 ? 0 : (rows - 1) * stride + packed_row; }

int64_t packed_data_row(const WeightView& w) {
  if (is_grouped(w.dtype)) return grouped_row_bytes(w.dtype, w.cols);
  if (is_quantized(w.dtype)) return row_bytes(w.dtype, w.cols);
  return w.cols * int64_t(dtype_size(w.dtype));
}

int64_t packed_group_row(const WeightView& w) {
  const int64_t groups = w.group_size > 0 ? w.cols / w.group_size : 0;
  return groups * int64_t(w.dtype == DType::MXFP4 ? 1 : dtype_size(w.scales_dtype));
}

}  // namespace

DeviceExpertSlots::DeviceExpertSlots(int64_t slots, int top_k, EvictionPolicy policy) : cache_(slots, top_k, policy) {}

DeviceExpertSlots::~DeviceExpertSlots() {
  if (memory_) cudaFree(memory_);
}

void DeviceExpertSlots::allocate(const ExpertWeights& e0) {
  int64_t at = 0;
  const WeightView* views[3] = {&e0.gate.view, &e0.up.view, &e0.down.view};
  for (int v = 0; v < 3; ++v) {
    const WeightView& w = *views[v];
    ViewLayout& l = layout_[v];
    l.data = at;
    l.data_bytes = span(w.rows, w.row_bytes, packed_data_row(w));
    at += align_up(l.data_bytes);
    if (w.scales) {
      l.scales = at;
      l.scales_bytes = span(w.rows, w.scales_row_bytes, packed_group_row(w));
      at += align_up(l.scales_bytes);
    }
    if (w.biases) {
      l.biases = at;
      l.biases_bytes = span(w.rows, w.biases_row_bytes, packed_group_row(w));
      at += align_up(l.biases_bytes);
    }
  }
  slot_bytes_ = at;
  const int64_t total = slot_bytes_ * cache_.slots();
  if (cudaMalloc(&memory_, size_t(total)) != cudaSuccess) {
    cudaGetLastError();
    size_t free_b = 0, total_b = 0;
    cudaMemGetInfo(&free_b, &total_b);
    fail("cuda: the expert cache of {} slots x {:.2f} MiB = {:.2f} GiB does not fit ({:.2f} GiB free): give fewer "
         "--expert-cache-slots or a smaller --expert-cache-gb",
         cache_.slots(), double(slot_bytes_) / (1 << 20), double(total) / (1 << 30), double(free_b) / (1 << 30));
  }
}

WeightView DeviceExpertSlots::in_slot(const WeightView& host, const ViewLayout& l, int32_t slot) const {
  char* base = static_cast<char*>(memory_) + int64_t(slot) * slot_bytes_;
  WeightView d = host;
  d.data = base + l.data;
  if (host.scales) d.scales = base + l.scales;
  if (host.biases) d.biases = base + l.biases;
  return d;
}

void DeviceExpertSlots::load(const ExpertWeights& e, int32_t slot, const Upload& upload) {
  char* base = static_cast<char*>(memory_) + int64_t(slot) * slot_bytes_;
  const WeightView* views[3] = {&e.gate.view, &e.up.view, &e.down.view};
  for (int v = 0; v < 3; ++v) {
    const WeightView& w = *views[v];
    const ViewLayout& l = layout_[v];
    upload(base + l.data, w.data, l.data_bytes);
    if (w.scales) upload(base + l.scales, w.scales, l.scales_bytes);
    if (w.biases) upload(base + l.biases, w.biases, l.biases_bytes);
    bytes_loaded_ += l.data_bytes + l.scales_bytes + l.biases_bytes;
  }
}

const std::vector<ExpertWeights>& DeviceExpertSlots::place(const std::vector<ExpertWeights>& experts,
                                                           std::span<const int32_t> ids, const Upload& upload) {
  TS_CHECK(!experts.empty() && !ids.empty(), "expert cache: {} experts, {} routed rows", experts.size(), ids.size());
  const int32_t layer = experts[0].gate.layer;
  const int64_t n_experts = int64_t(experts.size());
  TS_CHECK(layer >= 0, "expert cache: routed experts without a layer index ({})", experts[0].gate.name);
  if (!memory_) allocate(experts[0]);
  // The distinct experts in order of first use (the order the kernels meet them).
  unique_.clear();
  for (int32_t id : ids) {
    TS_CHECK(id >= 0 && id < n_experts, "expert cache: layer {} routed a row to expert {} of {}", layer, id, n_experts);
    if (std::find(unique_.begin(), unique_.end(), id) == unique_.end()) unique_.push_back(id);
  }
  TS_CHECK(int64_t(unique_.size()) <= cache_.slots(), "expert cache: {} distinct experts at once in {} slots",
           unique_.size(), cache_.slots());
  const ExpertCache::Plan plan = cache_.plan(layer, unique_);
  const auto t0 = Clock::now();
  for (size_t i = 0; i < unique_.size(); ++i) {
    if (!plan.load[i]) continue;
    try {
      load(experts[size_t(unique_[i])], plan.slot[i], upload);
    } catch (...) {
      cache_.invalidate(plan.slot[i]);  // its bytes are not the expert's
      throw;
    }
  }
  if (plan.misses > 0) load_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();

  if (placed_.size() <= size_t(layer)) placed_.resize(size_t(layer) + 1);
  std::vector<ExpertWeights>& out = placed_[size_t(layer)];
  out.resize(experts.size());
  std::vector<int32_t> slot_of(experts.size(), plan.slot[0]);
  for (size_t i = 0; i < unique_.size(); ++i) slot_of[size_t(unique_[i])] = plan.slot[i];
  for (size_t e = 0; e < experts.size(); ++e) {
    out[e] = experts[e];
    out[e].gate.view = in_slot(experts[e].gate.view, layout_[0], slot_of[e]);
    out[e].up.view = in_slot(experts[e].up.view, layout_[1], slot_of[e]);
    out[e].down.view = in_slot(experts[e].down.view, layout_[2], slot_of[e]);
  }
  return out;
}

std::string DeviceExpertSlots::summary() const {
  const ExpertCacheStats& s = cache_.stats();
  const int64_t asked = s.hits + s.misses;
  return fmt::format("expert cache (device): {} slots x {:.2f} MiB, {} policy; hits {:.1f}% ({} of {}), {:.2f} GiB "
                     "loaded at {:.1f} GB/s",
                     cache_.slots(), double(slot_bytes_) / (1 << 20), eviction_policy_name(cache_.policy()),
                     asked ? 100.0 * double(s.hits) / double(asked) : 0.0, s.hits, asked,
                     double(bytes_loaded_) / (1 << 30),
                     load_seconds_ > 0 ? double(bytes_loaded_) / 1e9 / load_seconds_ : 0.0);
}

}  // namespace turbospark::cuda
