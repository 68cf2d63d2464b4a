// Where an expert's planes go in a cache slot, for a tier that copies experts into slots of
// another memory (the CUDA tier: backends/cuda/expert_slots.h). Host code only, so the layout
// and the copies can be checked on any machine (tests/golden/test_expert_slot_layout.cpp
// copies experts of every MoE family into host "slots" and reads them back row by row).
//
// A layout is per layer (layers may store experts differently: a Q4_K_M GGUF keeps some
// layers' down projections in Q6_K). Each of gate, up and down has up to three planes (data,
// scales, biases), copied from the plane's first byte to the end of its last row (rows may be
// strided) to a 256-byte-aligned offset, so the slot keeps the host's row addressing. An up
// plane that starts inside the gate's plane of the same kind (gpt-oss's interleaved gate/up
// rows) is not copied again: the gate's copy grows to cover it and up points into it.
#pragma once

#include <cstdint>
#include <functional>

#include "ops/backend.h"

namespace turbospark {

class ExpertSlotLayout {
 public:
  // The layout of experts stored like `e` (one expert of the layer: they share formats).
  static ExpertSlotLayout of(const ExpertWeights& e);

  // Bytes one slot needs.
  int64_t bytes() const { return bytes_; }
  // Each copy an expert stored like the layout's needs: `bytes` from `src` to `offset` in the
  // slot. Fails naming the expert when its planes differ from the layout's.
  void for_each_copy(const ExpertWeights& e,
                     const std::function<void(const void* src, int64_t offset, int64_t bytes)>& copy) const;
  // The expert's views addressing a slot at `slot_base` that holds its copies.
  ExpertWeights in_slot(const ExpertWeights& host, void* slot_base) const;
  // Only the views (host's names and metadata untouched) into `out`, for callers that keep one.
  void views_in_slot(const ExpertWeights& host, void* slot_base, ExpertWeights* out) const;

 private:
  struct Plane {
    int64_t offset = -1;  // in the slot, -1 when the view has no such plane
    int64_t bytes = 0;
    int64_t shared = -1;  // >= 0: lies this far inside the gate's plane of the same kind, not copied
  };
  Plane plane_[3][3];  // [gate, up, down][data, scales, biases]
  int64_t bytes_ = 0;
};

}  // namespace turbospark
