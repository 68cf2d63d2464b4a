// Families by name. Registering a family is one line in registry.cpp's table.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "models/model.h"

namespace turbospark {

using FamilyFactory = std::unique_ptr<Model> (*)(const HfConfig&, const Checkpoint&, Backend&);

struct FamilyEntry {
  const char* model_type;    // config.json model_type
  const char* architecture;  // architectures[0] it accepts
  FamilyFactory make;
  bool cuda;                 // runs on the CUDA backend (else refused there by name)
};

const std::vector<FamilyEntry>& families();
// TURBOSPARK_CUDA_UNVERIFIED=1: families whose CUDA kernels are written but have not yet
// passed the device tests load on the GPU anyway (the device tests set it to test them).
bool cuda_unverified_allowed();
// Throws naming the family and the backend when `family` may not run on `backend` (a GPU
// backend, its kernels unverified, no TURBOSPARK_CUDA_UNVERIFIED=1); `path` leads the message.
void check_family_runs_on(const FamilyEntry& family, const std::string& backend, const std::string& path);

// Loads config.json and the safetensors checkpoint in `model_dir` and builds the family's
// model, its weights and parameters resident on `backend` (which the model must not
// outlive). Unknown architectures are refused by name.
LoadedModel load_model(const std::string& model_dir, Backend& backend);
// What a load will need, without building the model: the checkpoint's bytes and whether its
// config has routed experts (the CLI decides before a device load whether experts stream).
struct CheckpointFacts {
  int64_t bytes = 0;
  bool routed_experts = false;
};
CheckpointFacts probe_checkpoint(const std::string& model_dir);
// The same onto a 2-thread CPU backend the result owns: for inspecting a model (inspect,
// convert) and for tests that run it on any CPU backend (CPU weights are host memory).
LoadedModel load_model(const std::string& model_dir);

}  // namespace turbospark
