// Activations on the device (Backend::unary's Act), shared by the elementwise kernels and the
// GEMV's fused store (Backend::matmul_shared_input's MatmulAct), so both compute the same
// float ops in the same order.
#pragma once

#include "ops/backend.h"

namespace turbospark::cuda {

__device__ __forceinline__ float apply_act(Act act, float v) {
  // Precise expf/tanhf (no fast-math intrinsics): these match the CPU's std::exp/std::tanh to
  // an ulp or two, so the tests can hold the CUDA path to 1e-6.
  switch (act) {
    case Act::kSilu: return v / (1.f + expf(-v));
    case Act::kSigmoid: return 1.f / (1.f + expf(-v));
    case Act::kGeluTanh: return 0.5f * v * (1.f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    case Act::kTanh: return tanhf(v);
    default: return v;
  }
}

// post * act(pre * v): Backend::unary's formula (with act identity, pre = post = 1: v exactly).
__device__ __forceinline__ float apply_matmul_act(const MatmulAct& a, float v) { return a.post * apply_act(a.act, a.pre * v); }

}  // namespace turbospark::cuda
