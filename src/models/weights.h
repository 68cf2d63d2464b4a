// Loading a family's tensors onto the backend, once, at load: matrices made resident (the
// CPU backend reads them in place from the mapped checkpoint; CUDA copies them to the
// device) and small parameters (norm weights, biases, sinks, conv weights...) uploaded as
// backend tensors, so that no kernel ever reads host memory inside a step.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "formats/safetensors.h"
#include "ops/backend.h"

namespace turbospark {

struct WeightLoader {
  const Checkpoint& ck;
  Backend& be;

  // A [rows, cols] matrix weight of layer `layer` (-1: not in a layer), resident.
  Weight matrix(const std::string& name, int64_t rows, int64_t cols, int layer) const {
    return named(be.resident(ck.matrix(name, rows, cols), name), name, layer);
  }
  // A float tensor of the expected shape, uploaded.
  Param floats(const std::string& name, const std::vector<int64_t>& shape) const {
    return be.param(ck.floats(name, shape));
  }
  Param param(std::span<const float> host) const { return be.param(host); }
  WeightView resident(const WeightView& view, const std::string& name) const { return be.resident(view, name); }
  // A routed expert's stack slice or matrix: resident, unless the backend keeps routed experts
  // in host memory for expert streaming (Backend::resident_expert).
  WeightView expert_view(const WeightView& view, const std::string& name) const {
    return be.resident_expert(view, name);
  }
  Weight expert_matrix(const std::string& name, int64_t rows, int64_t cols, int layer) const {
    return named(be.resident_expert(ck.matrix(name, rows, cols), name), name, layer);
  }
  // Expert `e` of an [n_experts, rows, cols] stack (GGUF's *_exps tensors), as expert_matrix.
  Weight expert_in_stack(const std::string& name, int64_t e, int64_t n_experts, int64_t rows, int64_t cols,
                         int layer) const {
    return named(be.resident_expert(ck.matrix_in_stack(name, e, n_experts, rows, cols), name), name, layer);
  }

 private:
  static Weight named(const WeightView& view, const std::string& name, int layer) {
    Weight w;
    w.view = view;
    w.name = name;
    w.layer = layer;
    return w;
  }
};

}  // namespace turbospark
