#include "backends/cuda/expert_slots.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/mapped_file.h"
#include "core/quant.h"
#include "core/quant_grouped.h"

namespace turbospark::cuda {
namespace {

constexpr int64_t kActivationReserve = int64_t(512) << 20;  // activations and scratch still to come

// A runtime call's failure as an Error naming what was being done (common.cuh's TS_CUDA_CHECK
// lives with device code this host file does not compile).
template <class... Args>
void cuda_ok(cudaError_t err, fmt::format_string<Args...> what, Args&&... args) {
  if (err != cudaSuccess) fail("cuda: {}: {} ({})", fmt::format(what, std::forward<Args>(args)...), cudaGetErrorString(err), int(err));
}

// The pinned pool's limit: TURBOSPARK_CUDA_EXPERT_POOL_GB when set (0: no pool), else half of
// the host's available memory now.
int64_t pool_limit() {
  if (const char* v = std::getenv("TURBOSPARK_CUDA_EXPERT_POOL_GB")) {
    char* end = nullptr;
    const double gb = std::strtod(v, &end);
    TS_CHECK(end != v && *end == 0 && gb >= 0 && gb < 1e6, "TURBOSPARK_CUDA_EXPERT_POOL_GB={}: want a size in GiB, >= 0",
             v);
    return int64_t(gb * double(int64_t(1) << 30));
  }
  return host_memory_available() / 2;
}

// TURBOSPARK_CUDA_EXPERT_BANKS: the most banks a layer's pooled loads are split into (1: every
// load before any compute, as one bank).
int max_banks() {
  const char* v = std::getenv("TURBOSPARK_CUDA_EXPERT_BANKS");
  if (!v) return 8;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  TS_CHECK(end != v && *end == 0 && n >= 1 && n <= 64, "TURBOSPARK_CUDA_EXPERT_BANKS={}: want a count from 1 to 64", v);
  return int(n);
}

}  // namespace

DeviceExpertSlots::DeviceExpertSlots(int64_t slots, int top_k, EvictionPolicy policy,
                                     std::span<const ExpertWeights* const> layer_experts, int64_t available,
                                     cudaStream_t stream)
    : stream_(stream) {
  TS_CHECK(!layer_experts.empty(), "expert cache: no routed experts to lay out");
  // The environment's settings first: a bad one is refused before anything is allocated.
  pool_limit_ = pool_limit();
  max_banks_ = max_banks();
  TS_CHECK(slots >= top_k && top_k >= 1, "expert cache: {} slots for top-{} routing: at least {} are needed", slots, top_k,
           top_k);
  for (const ExpertWeights* e : layer_experts) {
    const int layer = e->gate.layer;
    TS_CHECK(layer >= 0, "expert cache: routed expert {} without a layer index", e->gate.name);
    if (layouts_.size() <= size_t(layer)) {
      layouts_.resize(size_t(layer) + 1);
      laid_out_.resize(size_t(layer) + 1, 0);
    }
    layouts_[size_t(layer)] = ExpertSlotLayout::of(*e);
    laid_out_[size_t(layer)] = 1;
    slot_bytes_ = std::max(slot_bytes_, layouts_[size_t(layer)].bytes());
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
  bank_events_.assign(size_t(max_banks_), nullptr);
  bool ok = cudaEventCreate(&load_start_) == cudaSuccess && cudaEventCreate(&load_end_) == cudaSuccess &&
            cudaEventCreateWithFlags(&queued_, cudaEventDisableTiming) == cudaSuccess &&
            cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking) == cudaSuccess;
  for (cudaEvent_t& e : bank_events_) ok = ok && cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess;
  if (!ok) {
    cudaGetLastError();
    release();
    fail("cuda: the expert cache's copy stream and events could not be created");
  }
}

void DeviceExpertSlots::release() {
  // The owner synchronized its stream; the copy stream's DMAs may still read the pool.
  if (copy_) cudaStreamSynchronize(copy_);
  for (PoolLayer& p : pool_) {
    if (p.memory) cudaFreeHost(p.memory);
    p.memory = nullptr;
  }
  if (memory_) cudaFree(memory_);
  memory_ = nullptr;
  auto destroy = [](cudaEvent_t& e) {
    if (e) cudaEventDestroy(e);
    e = nullptr;
  };
  for (cudaEvent_t& e : bank_events_) destroy(e);
  destroy(load_start_);
  destroy(load_end_);
  destroy(queued_);
  if (copy_) cudaStreamDestroy(copy_);
  copy_ = nullptr;
  cudaGetLastError();
}

DeviceExpertSlots::~DeviceExpertSlots() { release(); }

// Adds the last place()'s load time once its copies have completed (the routing download that
// precedes every place() waited for the whole queue, so this does not block in practice).
void DeviceExpertSlots::settle_timing() const {
  if (!timing_pending_) return;
  timing_pending_ = false;
  float ms = 0;
  if (cudaEventSynchronize(load_end_) == cudaSuccess && cudaEventElapsedTime(&ms, load_start_, load_end_) == cudaSuccess) {
    load_seconds_ += double(ms) / 1e3;
  }
  cudaGetLastError();
}

const std::vector<ExpertWeights>& DeviceExpertSlots::place(const std::vector<ExpertWeights>& experts,
                                                           std::span<const int32_t> ids, const Upload& upload,
                                                           std::vector<MoeBank>* banks) {
  TS_CHECK(!experts.empty() && !ids.empty(), "expert cache: {} experts, {} routed rows", experts.size(), ids.size());
  const int32_t layer = experts[0].gate.layer;
  const int64_t n_experts = int64_t(experts.size());
  TS_CHECK(layer >= 0 && size_t(layer) < layouts_.size() && laid_out_[size_t(layer)],
           "expert cache: layer {} was not laid out (set_expert_cache with one expert of every MoE layer)", layer);
  if (banks) banks->clear();
  const ExpertSlotLayout& layout = layouts_[size_t(layer)];
  // The distinct experts in order of first use (the order the kernels meet them).
  unique_.clear();
  for (int32_t id : ids) {
    TS_CHECK(id >= 0 && id < n_experts, "expert cache: layer {} routed a row to expert {} of {}", layer, id, n_experts);
    if (std::find(unique_.begin(), unique_.end(), id) == unique_.end()) unique_.push_back(id);
  }
  TS_CHECK(int64_t(unique_.size()) <= cache_->slots(), "expert cache: {} distinct experts at once in {} slots",
           unique_.size(), cache_->slots());
  const ExpertCache::Plan plan = cache_->plan(layer, unique_);
  settle_timing();
  if (pool_.size() <= size_t(layer)) pool_.resize(size_t(layer) + 1);
  PoolLayer& pool = pool_[size_t(layer)];
  const int64_t entry = layout.bytes();
  if (!pool.tried && plan.misses > 0) {
    // The layer's share of the pool, page-locked once (every expert of the layer laid out like a
    // slot), while it fits under the limit; a layer past it streams through staging.
    pool.tried = true;
    const int64_t want = entry * n_experts;
    if (pool_used_ + want <= pool_limit_) {
      if (cudaHostAlloc(&pool.memory, size_t(want), cudaHostAllocDefault) == cudaSuccess) {
        pool.filled.assign(size_t(n_experts), 0);
        pool_used_ += want;
      } else {
        cudaGetLastError();
        pool.memory = nullptr;
        pool_limit_ = pool_used_;  // the host refused: no later layer asks again
      }
    }
  }
  // Load order: the kernels' order. Banked, ascending expert id on the copy stream (a grouped
  // projection takes experts in id order); else first use, on the compute stream.
  const bool banked = banks && pool.memory && plan.misses > 1 && max_banks_ > 1;
  order_.resize(unique_.size());
  for (size_t i = 0; i < order_.size(); ++i) order_[i] = i;
  if (banked) std::sort(order_.begin(), order_.end(), [&](size_t a, size_t b) { return unique_[a] < unique_[b]; });
  const cudaStream_t to = banked ? copy_ : stream_;
  if (banked) {
    // Slots this plan rewrites were read by kernels queued before now: the copies wait for them.
    cuda_ok(cudaEventRecord(queued_, stream_), "expert loads: marking the compute queue");
    cuda_ok(cudaStreamWaitEvent(copy_, queued_, 0), "expert loads: ordering after the compute queue");
  }
  const int64_t n_banks = banked ? std::min<int64_t>(max_banks_, plan.misses) : 1;
  int64_t loaded = 0;  // misses enqueued so far
  if (plan.misses > 0) cuda_ok(cudaEventRecord(load_start_, to), "expert load timing");
  for (size_t n = 0; n < order_.size(); ++n) {
    const size_t i = order_[n];
    if (!plan.load[i]) continue;
    const int32_t e = unique_[i];
    try {
      char* base = static_cast<char*>(memory_) + int64_t(plan.slot[i]) * slot_bytes_;
      if (pool.memory) {
        char* held = static_cast<char*>(pool.memory) + int64_t(e) * entry;
        if (!pool.filled[size_t(e)]) {
          // Written once, before the first DMA that reads it; never rewritten while one may run.
          layout.for_each_copy(experts[size_t(e)], [&](const void* src, int64_t offset, int64_t bytes) {
            std::memcpy(held + offset, src, size_t(bytes));
          });
          pool.filled[size_t(e)] = 1;
        }
        cuda_ok(cudaMemcpyAsync(base, held, size_t(entry), cudaMemcpyHostToDevice, to),
                "expert {} of layer {} from the pinned pool", e, layer);
        bytes_loaded_ += entry;
        pool_dma_bytes_ += entry;
      } else {
        layout.for_each_copy(experts[size_t(e)], [&](const void* src, int64_t offset, int64_t bytes) {
          upload(base + offset, src, bytes);
          bytes_loaded_ += bytes;
        });
      }
      ++loaded;
      // A bank ends after its share of the misses: its experts are those below the next id.
      const int64_t b = int64_t(banks ? banks->size() : 0);
      if (banked && loaded == (b + 1) * plan.misses / n_banks) {
        const bool last = loaded == plan.misses;
        const int32_t end = last ? int32_t(n_experts) : e + 1;
        cuda_ok(cudaEventRecord(bank_events_[size_t(b)], copy_), "expert bank {} of layer {}", b, layer);
        int64_t pairs = 0;
        const int32_t begin = b ? banks->back().expert_end : 0;
        for (int32_t id : ids) pairs += id >= begin && id < end;
        banks->push_back({end, pairs, bank_events_[size_t(b)]});
      }
    } catch (...) {
      // This load and every later one in the plan never happened: those slots hold no expert.
      for (size_t m = n; m < order_.size(); ++m) {
        if (plan.load[order_[m]]) cache_->invalidate(plan.slot[order_[m]]);
      }
      if (banks) banks->clear();
      throw;
    }
  }
  if (plan.misses > 0) {
    cuda_ok(cudaEventRecord(load_end_, to), "expert load timing");
    timing_pending_ = true;
  }
  if (banked) {
    ++banked_calls_;
    banks_used_ += int64_t(banks->size());
  }

  if (placed_.size() <= size_t(layer)) placed_.resize(size_t(layer) + 1);
  std::vector<ExpertWeights>& out = placed_[size_t(layer)];
  if (out.size() != experts.size()) out = experts;  // names and metadata once; views below every call
  slot_of_.assign(experts.size(), plan.slot[0]);
  for (size_t i = 0; i < unique_.size(); ++i) slot_of_[size_t(unique_[i])] = plan.slot[i];
  for (size_t e = 0; e < experts.size(); ++e) {
    layout.views_in_slot(experts[e], static_cast<char*>(memory_) + int64_t(slot_of_[e]) * slot_bytes_, &out[e]);
  }
  return out;
}

std::string DeviceExpertSlots::summary() const {
  settle_timing();
  const ExpertCacheStats& s = cache_->stats();
  const int64_t asked = s.hits + s.misses;
  const std::string host =
      host_used_ > 0 ? fmt::format("; decode computed {} of {} expert uses on the host, {} loaded over the link (link "
                                   "share of misses now {:.2f})",
                                   host_computed_, host_used_, host_linked_, link_share_)
                     : "";
  return fmt::format("expert cache (device): {} slots x {:.2f} MiB, {} policy; hits {:.1f}% ({} of {}), {:.2f} GiB "
                     "loaded, {:.1f} GB/s while loading; pinned pool {:.2f} GiB ({:.0f}% of loads)",
                     cache_->slots(), double(slot_bytes_) / (1 << 20), eviction_policy_name(cache_->policy()),
                     asked ? 100.0 * double(s.hits) / double(asked) : 0.0, s.hits, asked,
                     double(bytes_loaded_) / (1 << 30),
                     load_seconds_ > 0 ? double(bytes_loaded_) / 1e9 / load_seconds_ : 0.0,
                     double(pool_used_) / (1 << 30),
                     bytes_loaded_ > 0 ? 100.0 * double(pool_dma_bytes_) / double(bytes_loaded_) : 0.0) +
         (banked_calls_ > 0 ? fmt::format("; {} prompt layers loaded in {:.1f} banks each under their compute",
                                          banked_calls_, double(banks_used_) / double(banked_calls_))
                            : "") +
         host;
}

}  // namespace turbospark::cuda
