#include "backends/cuda/expert_slots.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/quant.h"
#include "core/quant_grouped.h"

namespace turbospark::cuda {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kPlaneAlign = 256;
constexpr int64_t kActivationReserve = int64_t(512) << 20;  // activations and scratch still to come  // every plane 256-byte aligned in its slot: the kernels' 16-byte loads

int64_t align_up(int64_t v) { return (v + kPlaneAlign - 1) / kPlaneAlign * kPlaneAlign; }

// Bytes from a plane's first row to the end of its last (rows may be strided: gpt-oss's
// interleaved gate/up views step over each other's rows, and the copy keeps that layout).
int64_t span(int64_t rows, int64_t stride, int64_t packed_row) { return rows <= 0 ? 0 : (rows - 1) * stride + packed_row; }

int64_t packed_group_row(const WeightView& w) {
  const int64_t groups = w.group_size > 0 ? w.cols / w.group_size : 0;
  return groups * int64_t(w.dtype == DType::MXFP4 ? 1 : dtype_size(w.scales_dtype));
}

// A view's three planes: host pointer and span (null / 0 where absent).
struct HostPlane {
  const uint8_t* p = nullptr;
  int64_t bytes = 0;
};
void host_planes(const WeightView& w, HostPlane out[3]) {
  int64_t packed = 0;
  if (is_grouped(w.dtype)) {
    packed = grouped_row_bytes(w.dtype, w.cols);
  } else if (is_quantized(w.dtype)) {
    packed = row_bytes(w.dtype, w.cols);
  } else {
    packed = w.cols * int64_t(dtype_size(w.dtype));
  }
  out[0] = {static_cast<const uint8_t*>(w.data), span(w.rows, w.row_bytes, packed)};
  out[1] = w.scales ? HostPlane{static_cast<const uint8_t*>(w.scales), span(w.rows, w.scales_row_bytes, packed_group_row(w))}
                    : HostPlane{};
  out[2] = w.biases ? HostPlane{static_cast<const uint8_t*>(w.biases), span(w.rows, w.biases_row_bytes, packed_group_row(w))}
                    : HostPlane{};
}

}  // namespace

DeviceExpertSlots::LayerLayout DeviceExpertSlots::layout_of(const ExpertWeights& e, int64_t* slot_bytes) {
  LayerLayout layout;
  layout.known = true;
  const WeightView* views[3] = {&e.gate.view, &e.up.view, &e.down.view};
  HostPlane planes[3][3];
  for (int v = 0; v < 3; ++v) host_planes(*views[v], planes[v]);
  // The gate's planes grow to cover an up plane that starts inside them (interleaved rows).
  for (int k = 0; k < 3; ++k) {
    const HostPlane& g = planes[0][k];
    const HostPlane& u = planes[1][k];
    if (g.p && u.p && u.p >= g.p && u.p < g.p + g.bytes) {
      planes[0][k].bytes = std::max(g.bytes, int64_t(u.p - g.p) + u.bytes);
      layout.view[1].shared_offset[k] = int64_t(u.p - g.p);
    }
  }
  int64_t at = 0;
  for (int v = 0; v < 3; ++v) {
    for (int k = 0; k < 3; ++k) {
      if (!planes[v][k].p || layout.view[v].shared_offset[k] >= 0) continue;
      layout.view[v].plane[k] = {at, planes[v][k].bytes};
      at += align_up(planes[v][k].bytes);
    }
  }
  *slot_bytes = at;
  return layout;
}

DeviceExpertSlots::DeviceExpertSlots(int64_t slots, int top_k, EvictionPolicy policy,
                                     std::span<const ExpertWeights* const> layer_experts, int64_t available) {
  TS_CHECK(!layer_experts.empty(), "expert cache: no routed experts to lay out");
  TS_CHECK(slots >= top_k && top_k >= 1, "expert cache: {} slots for top-{} routing: at least {} are needed", slots, top_k,
           top_k);
  for (const ExpertWeights* e : layer_experts) {
    const int layer = e->gate.layer;
    TS_CHECK(layer >= 0, "expert cache: routed expert {} without a layer index", e->gate.name);
    if (layouts_.size() <= size_t(layer)) layouts_.resize(size_t(layer) + 1);
    int64_t bytes = 0;
    layouts_[size_t(layer)] = layout_of(*e, &bytes);
    slot_bytes_ = std::max(slot_bytes_, bytes);
  }
  const int64_t total = slots > (int64_t(1) << 62) / std::max<int64_t>(slot_bytes_, 1) ? INT64_MAX : slot_bytes_ * slots;
  const int64_t room = available - kActivationReserve;
  if (total > room || cudaMalloc(&memory_, size_t(total)) != cudaSuccess) {
    cudaGetLastError();
    memory_ = nullptr;
    fail("cuda: the expert cache of {} slots x {:.2f} MiB = {:.2f} GiB does not fit ({:.2f} GiB available after the "
         "resident weights, 0.5 GiB of it kept for activations): give fewer --expert-cache-slots or a smaller "
         "--expert-cache-gb",
         slots, double(slot_bytes_) / (1 << 20), double(total) / (1 << 30), double(available) / (1 << 30));
  }
  cache_ = std::make_unique<ExpertCache>(slots, top_k, policy);
}

DeviceExpertSlots::~DeviceExpertSlots() {
  if (memory_) cudaFree(memory_);
}

WeightView DeviceExpertSlots::in_slot(const WeightView& host, const ViewPlanes& planes,
                                      const ViewPlanes& gate_planes, int32_t slot) const {
  char* base = static_cast<char*>(memory_) + int64_t(slot) * slot_bytes_;
  const void* host_ptr[3] = {host.data, host.scales, host.biases};
  void* dev[3] = {nullptr, nullptr, nullptr};
  for (int k = 0; k < 3; ++k) {
    if (!host_ptr[k]) continue;
    if (planes.shared_offset[k] >= 0) {
      dev[k] = base + gate_planes.plane[k].offset + planes.shared_offset[k];
    } else {
      dev[k] = base + planes.plane[k].offset;
    }
  }
  WeightView d = host;
  d.data = dev[0];
  d.scales = dev[1];
  d.biases = dev[2];
  return d;
}

void DeviceExpertSlots::load(const ExpertWeights& e, const LayerLayout& layout, int32_t slot, const Upload& upload) {
  char* base = static_cast<char*>(memory_) + int64_t(slot) * slot_bytes_;
  const WeightView* views[3] = {&e.gate.view, &e.up.view, &e.down.view};
  HostPlane planes[3][3];
  for (int v = 0; v < 3; ++v) host_planes(*views[v], planes[v]);
  for (int v = 0; v < 3; ++v) {
    for (int k = 0; k < 3; ++k) {
      const Plane& dst = layout.view[v].plane[k];
      if (layout.view[v].shared_offset[k] >= 0) continue;
      TS_CHECK((dst.offset >= 0) == (planes[v][k].p != nullptr),
               "expert cache: expert {} of layer {} is stored unlike the layer's first expert", e.gate.expert,
               e.gate.layer);
      if (!planes[v][k].p) continue;
      // The gate's plane covers an up plane inside it: the layout's (larger) span.
      TS_CHECK(dst.bytes >= planes[v][k].bytes, "expert cache: expert {} of layer {}: a plane of {} bytes in {}",
               e.gate.expert, e.gate.layer, planes[v][k].bytes, dst.bytes);
      upload(base + dst.offset, planes[v][k].p, dst.bytes);
      bytes_loaded_ += dst.bytes;
    }
  }
}

const std::vector<ExpertWeights>& DeviceExpertSlots::place(const std::vector<ExpertWeights>& experts,
                                                           std::span<const int32_t> ids, const Upload& upload) {
  TS_CHECK(!experts.empty() && !ids.empty(), "expert cache: {} experts, {} routed rows", experts.size(), ids.size());
  const int32_t layer = experts[0].gate.layer;
  const int64_t n_experts = int64_t(experts.size());
  TS_CHECK(layer >= 0 && size_t(layer) < layouts_.size() && layouts_[size_t(layer)].known,
           "expert cache: layer {} was not laid out (set_expert_cache with one expert of every MoE layer)", layer);
  const LayerLayout& layout = layouts_[size_t(layer)];
  // The distinct experts in order of first use (the order the kernels meet them).
  unique_.clear();
  for (int32_t id : ids) {
    TS_CHECK(id >= 0 && id < n_experts, "expert cache: layer {} routed a row to expert {} of {}", layer, id, n_experts);
    if (std::find(unique_.begin(), unique_.end(), id) == unique_.end()) unique_.push_back(id);
  }
  TS_CHECK(int64_t(unique_.size()) <= cache_->slots(), "expert cache: {} distinct experts at once in {} slots",
           unique_.size(), cache_->slots());
  const ExpertCache::Plan plan = cache_->plan(layer, unique_);
  const auto t0 = Clock::now();
  for (size_t i = 0; i < unique_.size(); ++i) {
    if (!plan.load[i]) continue;
    try {
      load(experts[size_t(unique_[i])], layout, plan.slot[i], upload);
    } catch (...) {
      // This load and every later one in the plan never happened: those slots hold no expert.
      for (size_t j = i; j < unique_.size(); ++j) {
        if (plan.load[j]) cache_->invalidate(plan.slot[j]);
      }
      throw;
    }
  }
  if (plan.misses > 0) load_seconds_ += std::chrono::duration<double>(Clock::now() - t0).count();

  if (placed_.size() <= size_t(layer)) placed_.resize(size_t(layer) + 1);
  std::vector<ExpertWeights>& out = placed_[size_t(layer)];
  if (out.size() != experts.size()) out = experts;  // names and metadata once; views below every call
  slot_of_.assign(experts.size(), plan.slot[0]);
  for (size_t i = 0; i < unique_.size(); ++i) slot_of_[size_t(unique_[i])] = plan.slot[i];
  for (size_t e = 0; e < experts.size(); ++e) {
    const ExpertWeights& h = experts[e];
    const int32_t s = slot_of_[e];
    out[e].gate.view = in_slot(h.gate.view, layout.view[0], layout.view[0], s);
    out[e].up.view = in_slot(h.up.view, layout.view[1], layout.view[0], s);
    out[e].down.view = in_slot(h.down.view, layout.view[2], layout.view[0], s);
  }
  return out;
}

std::string DeviceExpertSlots::summary() const {
  const ExpertCacheStats& s = cache_->stats();
  const int64_t asked = s.hits + s.misses;
  return fmt::format("expert cache (device): {} slots x {:.2f} MiB, {} policy; hits {:.1f}% ({} of {}), {:.2f} GiB "
                     "loaded, {:.1f} GB/s while loading (host copy into staging included)",
                     cache_->slots(), double(slot_bytes_) / (1 << 20), eviction_policy_name(cache_->policy()),
                     asked ? 100.0 * double(s.hits) / double(asked) : 0.0, s.hits, asked,
                     double(bytes_loaded_) / (1 << 30),
                     load_seconds_ > 0 ? double(bytes_loaded_) / 1e9 / load_seconds_ : 0.0);
}

}  // namespace turbospark::cuda
