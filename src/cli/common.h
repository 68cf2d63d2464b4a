// Pieces every subcommand shares: loading a model with progress on stderr, parsing token
// lists, finding the default model, stop tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "formats/tokenizer.h"
#include "models/registry.h"
#include "ops/backend.h"

namespace turbospark::cli {

struct LoadedRuntime {
  LoadedModel model;
  std::unique_ptr<Backend> backend;
  std::optional<Tokenizer> tokenizer;  // when the model directory has tokenizer.json
  std::vector<int32_t> stop_ids;       // eos ids from config, generation_config and tokenizer
  double load_seconds = 0;
};

// Loads the model in `path` on `device` (only "cpu" so far; others are refused by name).
LoadedRuntime load_runtime(const std::string& path, const std::string& device, int threads, bool quiet);

// "5,17,9" -> {5, 17, 9}; throws naming the bad entry.
std::vector<int32_t> parse_token_list(const std::string& text);

// The default model directory: $TURBOSPARK_MODEL, then the per-user data folder
// ($XDG_DATA_HOME or ~/.local/share)/turbospark/default-model. Throws with the install
// command when none is found.
std::string default_model_path();

// Text of one token for streaming output.
std::string join_ids(const std::vector<int32_t>& ids);

}  // namespace turbospark::cli
