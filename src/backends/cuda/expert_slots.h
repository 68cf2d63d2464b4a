// Expert streaming's CUDA tier: routed experts stay in host memory (the mapped checkpoint, in
// the page cache or on disk) and come into a bounded set of device slots as the router asks for
// them. Which slot holds which (layer, expert), and what to evict, is experts/expert_cache.h's
// ExpertCache; this class owns the device memory of the slots, copies missing experts in, and
// hands the MoE kernels the layer's experts with views into the slots.
//
// Layout: a slot holds one expert of any layer, laid out by its layer's ExpertSlotLayout
// (experts/slot_layout.h: layers may store experts differently); a slot is as large as the
// largest layer's expert.
//
// Pinned host pool (the tier between the slots and the mapped checkpoint): the first time an
// expert misses, its planes are copied on the host into a page-locked copy laid out like a slot;
// every later miss of it is then one DMA straight into the slot at the link's speed, where a
// copy from the mapped file has to pass through the pinned staging buffer (a host memcpy per
// chunk, about a third of the link's speed). The pool takes page-locked memory a layer at a time
// up to a limit (TURBOSPARK_CUDA_EXPERT_POOL_GB, default: half of the host's available memory
// when the cache is set; 0 turns the pool off); layers past the limit stream through staging.
//
// Protocol: the backend downloads the layer's routing (the deliberate sync after the router),
// place() plans the loads, and the MoE kernels queued after them read the slots. Nothing queued
// still reads a slot when the next place() plans (the download before it waited for the whole
// queue), so no protect set is needed.
//
// Banks (prompt micro-batches, whose grouped kernels take experts in id order): where the
// layer's misses come from the pinned pool, place() issues their DMAs on a copy stream of its
// own in ascending expert id, in up to `banks` groups, each ending with an event (MoeBank); the
// grouped projections of one bank wait only for its event, so the copy engine loads later banks
// while the SMs multiply earlier ones. The copy stream first waits for everything queued on the
// compute stream, so a slot is never rewritten under a kernel still reading it. Decode-sized
// calls, passes and layers streamed through staging load on the compute stream as one bank.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "experts/expert_cache.h"
#include "backends/cuda/matmul.h"
#include "experts/slot_layout.h"
#include "ops/backend.h"

namespace turbospark::cuda {

class DeviceExpertSlots {
 public:
  // Copies `bytes` from pageable host memory to the device, ordered on the compute stream.
  using Upload = std::function<void(void* dst, const void* src, int64_t bytes)>;

  // `layer_experts`: one routed expert of every MoE layer (its layer index in gate.layer), for
  // the layouts. Allocates the slots now, refusing by name what does not fit in `available`
  // bytes of device memory less 512 MiB kept for activations.
  DeviceExpertSlots(int64_t slots, int top_k, EvictionPolicy policy, std::span<const ExpertWeights* const> layer_experts,
                    int64_t available, cudaStream_t stream);
  ~DeviceExpertSlots();
  DeviceExpertSlots(const DeviceExpertSlots&) = delete;
  DeviceExpertSlots& operator=(const DeviceExpertSlots&) = delete;

  // `experts`: one layer's routed experts as loaded (views in host memory); `ids`: the experts
  // the kernels will read (at most slots() distinct ones). Loads the missing ones and returns
  // the layer's experts with their views in device slots; experts no id names point at a loaded
  // slot (the kernels read only the named ones). Valid until the next place(). Loads go through
  // the pinned pool where the layer has one (DMAs on the stream), else through `upload`.
  // With `banks` (a prompt micro-batch; ids: every routed pair's expert, to count a bank's
  // pairs), pooled misses load bank by bank on the copy stream and *banks receives the banks
  // to hand to moe_experts; left empty where the loads went on the compute stream.
  const std::vector<ExpertWeights>& place(const std::vector<ExpertWeights>& experts, std::span<const int32_t> ids,
                                          const Upload& upload, std::vector<MoeBank>* banks = nullptr);

  // "N slots x M MiB, hits H% (h of n), X GiB loaded at Y GB/s", and the pinned pool's use.
  std::string summary() const;
  int64_t pool_bytes() const { return pool_used_; }
  // Whether a slot holds (layer, expert) now (no load, no statistics).
  bool holds(int32_t layer, int32_t expert) const { return cache_->slot_of(layer, expert).has_value(); }
  // moe_split's count: of `used` distinct experts of a micro-batch, `host` ran on the host and
  // `linked` were missed and loaded over the link (the rest were held).
  void count_host_compute(int64_t host, int64_t linked, int64_t used) {
    host_computed_ += host;
    host_linked_ += linked;
    host_used_ += used;
  }
  // moe_split's current share of misses sent over the link (for the summary).
  void set_link_share(double share) { link_share_ = share; }
  int64_t slots() const { return cache_->slots(); }
  int64_t slot_bytes() const { return slot_bytes_; }
  const ExpertCacheStats& stats() const { return cache_->stats(); }

 private:
  std::unique_ptr<ExpertCache> cache_;  // made once the slots' memory is (its table is per slot)
  std::vector<ExpertSlotLayout> layouts_;  // per layer index
  std::vector<uint8_t> laid_out_;          // per layer index: whether layouts_ holds it
  int64_t slot_bytes_ = 0;
  void* memory_ = nullptr;
  std::vector<std::vector<ExpertWeights>> placed_;  // per layer: stable storage the MoE table is keyed by
  std::vector<int32_t> unique_, slot_of_;
  std::vector<size_t> order_;  // place()'s load order over unique_
  int64_t bytes_loaded_ = 0;
  mutable double load_seconds_ = 0;  // device time from a place()'s first load to its last, summed

  // The pinned pool, per layer index: page-locked memory for every expert of the layer laid out
  // like a slot (nullptr: none, the layer streams through staging) and which ones are filled.
  struct PoolLayer {
    void* memory = nullptr;
    std::vector<uint8_t> filled;
    bool tried = false;
  };
  std::vector<PoolLayer> pool_;
  int64_t pool_limit_ = 0, pool_used_ = 0, pool_dma_bytes_ = 0;
  int64_t host_computed_ = 0, host_linked_ = 0, host_used_ = 0;
  double link_share_ = -1;  // moe_split's, once set
  cudaStream_t stream_;
  // Banked loads: the copy stream, the event it waits on (the compute stream's queue), the
  // banks' events; TURBOSPARK_CUDA_EXPERT_BANKS (default 8, 1 = no overlap) caps their number.
  cudaStream_t copy_ = nullptr;
  cudaEvent_t queued_ = nullptr;
  std::vector<cudaEvent_t> bank_events_;
  int max_banks_ = 8;
  int64_t banked_calls_ = 0, banks_used_ = 0;
  cudaEvent_t load_start_ = nullptr, load_end_ = nullptr;
  mutable bool timing_pending_ = false;
  void settle_timing() const;
  void release();  // frees what the constructor made (after the copy stream's DMAs)
};

}  // namespace turbospark::cuda
