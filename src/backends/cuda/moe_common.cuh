// Routed experts, what moe.cu (the descriptor table, the switches and moe_experts, the
// dispatcher), moe_decode.cu and moe_prefill.cu (the kernels and their launchers) share: the
// expert descriptor and parameters the kernels read, the GLU and expert-id helpers of both
// the decode and the prefill kernels, the few-rows-per-expert kernel's shape (which
// moe_small_groups checks), and MoeCall, one checked call through which moe_experts reaches
// the launchers. Internal to those files: namespace moe.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "backends/cuda/matmul.h"
#include "backends/cuda/quant.cuh"

namespace turbospark::cuda::moe {

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

enum class Glu : int32_t { kSilu, kGeluTanh, kClamped };

struct MoeParams {
  int32_t n_experts;
  int32_t k;
  int64_t hidden;
  int64_t inter;
  Glu glu;
  float glu_alpha;
  float glu_limit;
};

__device__ __forceinline__ float nan_f32() { return __int_as_float(0x7fc00000); }

__device__ __forceinline__ float apply_glu(const MoeParams& p, float g, float u) {
  switch (p.glu) {
    case Glu::kSilu: return g / (1.f + expf(-g)) * u;
    case Glu::kGeluTanh:
      return 0.5f * g * (1.f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u;
    default: {
      const float gc = fminf(g, p.glu_limit);
      const float uc = fminf(fmaxf(u, -p.glu_limit), p.glu_limit);
      return (uc + 1.f) * (gc * (1.f / (1.f + expf(-(gc * p.glu_alpha)))));
    }
  }
}

__device__ __forceinline__ bool valid_expert(int32_t e, const MoeParams& p) { return e >= 0 && e < p.n_experts; }

// h for inter row i from its gate and up dot products: the biases, then the GLU.
__device__ __forceinline__ float biased_glu(const MoeExpertDesc& d, const MoeParams& p, int64_t i, float g, float u) {
  if (d.gate_bias) g += d.gate_bias[i];
  if (d.up_bias) u += d.up_bias[i];
  return apply_glu(p, g, u);
}

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The few-rows-per-expert grouped GEMV's shape (moe_prefill.cu moe_grouped_small_kernel, whose
// comment says why), here because moe_small_groups (moe.cu) checks that a call fits it.
constexpr int kSmallWarps = 8;
constexpr int kSmallThreads = kSmallWarps * kWarp;
constexpr int kSmallCols = 8;           // an expert's rows per pass (the mma's n)
constexpr int kSmallFeatures = 16 * kSmallWarps;  // output features per block
constexpr int kSmallK = 32;             // depth per step: a lane dequantizes 2 units of one row
constexpr int kSmallLdA = kSmallK + 8;  // bf16 staging row: 80 bytes (16-byte aligned)

inline int64_t small_smem_bytes(bool gate_up, int64_t depth) {
  const int64_t mats = gate_up ? 2 : 1;
  return kSmallCols * (depth + 8) * 2 + kSmallWarps * mats * 16 * kSmallLdA * 2;
}

// One moe_experts call, its experts and shapes checked (moe.cu), as the decode and prefill
// launchers read it: the fields carry the names of the dispatcher's locals they come from.
struct MoeCall {
  const std::vector<ExpertWeights>& experts;  // the layer's host-side views, every one in expert 0's format
  const ExpertWeights& e0;                    // experts[0]: its views choose the kernels
  const MoeExpertDesc* descs;                 // [n_experts] the device-side descriptor table
  MoeParams p;
  const Mat& x;                               // [rows, hidden] f32 activations
  const int32_t* idx;                         // [rows, k] int32 expert ids, device memory
  const float* weight;                        // [rows, k] f32 routing weights, device memory
  int k;
  int64_t hidden, inter, rows, n_pairs;       // n_pairs = rows * k
  const Mat& out;                             // [rows, hidden] f32
  bool gate_up_vec, down_vec;                 // every expert's gate and up (down) views 16-byte aligned
  cudaStream_t stream;
  std::span<const MoeBank> banks;             // empty: every expert is in place now

  // Every expert's views must suit the format variant chosen from expert 0's.
  void check_all(auto fmt, bool gate_up) const {
    using F = decltype(fmt);
    for (size_t e = 0; e < experts.size(); ++e) {
      const WeightView* views[2] = {gate_up ? &experts[e].gate.view : &experts[e].down.view,
                                    gate_up ? &experts[e].up.view : &experts[e].down.view};
      for (const WeightView* v : views)
        TS_CHECK(aligned_for<F>(*v), "moe_experts: expert {} {} rows not {}-byte aligned", e,
                 gate_up ? "gate/up" : "down", F::kAlign);
    }
  }

  // moe_decode.cu, the int8-activation kernels (moe_int8_activations): x (xa, xs floats a
  // row, rows 16-byte aligned) quantized per 32 in each gate/up block; h written as BlockQ8x32
  // rows to hq (q8x32_bytes(n_pairs, inter) bytes).
  void decode_int8(const float* xa, int64_t xs, void* hq) const;
  // moe_decode.cu, the f32-activation kernels (the other calls of up to kMoeDecodeMaxRows
  // rows): x as above, h [n_pairs, ldh] f32 (ldh % 4 == 0).
  void decode_f32(const float* xa, int64_t xs, float* h, int64_t ldh) const;
  // moe_prefill.cu, more rows: pairs grouped by expert, grouped projections (bank by bank,
  // each waiting for its experts, when `banks` is set), the weighted sum;
  // its buffers grow in WeightMatmul's moe_index_, moe_x_bf16_, moe_hidden_ and moe_out_,
  // passed in that order.
  void prefill(DeviceScratch& index_scratch, DeviceScratch& x_bf16_scratch, DeviceScratch& hidden_scratch,
               DeviceScratch& out_scratch) const;
};

}  // namespace turbospark::cuda::moe
