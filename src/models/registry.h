// Families by name. Registering a family is one line in registry.cpp's table.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "models/model.h"

namespace turbospark {

using FamilyFactory = std::unique_ptr<Model> (*)(const HfConfig&, const Checkpoint&);

struct FamilyEntry {
  const char* model_type;    // config.json model_type
  const char* architecture;  // architectures[0] it accepts
  FamilyFactory make;
};

const std::vector<FamilyEntry>& families();

// Loads config.json and the safetensors checkpoint in `model_dir` and builds the family's
// model. Unknown architectures are refused by name.
LoadedModel load_model(const std::string& model_dir);

}  // namespace turbospark
