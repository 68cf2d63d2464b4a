// A routed expert as the kernels see it (moe.cu's descriptor tables, one entry per expert of a
// layer), and what the router needs to ask L2 for the experts it picks (router.cu).
#pragma once

#include "backends/cuda/quant.cuh"

namespace turbospark::cuda {

// One expert as kernels see it. No padding: tables are compared bytewise to notice changes.
struct MoeExpertDesc {
  DeviceWeight gate;  // [inter, hidden]
  DeviceWeight up;    // [inter, hidden]
  DeviceWeight down;  // [hidden, inter]
  const float* gate_bias;  // [inter] or null
  const float* up_bias;    // [inter] or null
  const float* down_bias;  // [hidden] or null
};
static_assert(sizeof(MoeExpertDesc) == 3 * sizeof(DeviceWeight) + 3 * sizeof(void*));
static_assert(sizeof(DeviceWeight) == 6 * 8 + 2 * 8 + 2 * 4);

// The router's last block, once it has picked, asks L2 for every picked expert's gate and up
// rows (Backend::prefetch_routed). table null: nothing to fetch.
struct ExpertPrefetch {
  const MoeExpertDesc* table = nullptr;
  int32_t n_experts = 0;
};

// One thread asks L2 for the gate and up rows of expert e (half 0: gate, 1: up).
__device__ __forceinline__ void prefetch_expert_half(const ExpertPrefetch& ep, int32_t e, int half) {
  if (!ep.table || e < 0 || e >= ep.n_experts) return;
  const DeviceWeight& w = half == 0 ? ep.table[e].gate : ep.table[e].up;
  prefetch_weight_rows(w, 0, w.rows);
}

}  // namespace turbospark::cuda
