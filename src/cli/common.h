// Pieces every subcommand shares: loading a model with progress on stderr, parsing token
// lists, finding the default model, stop tokens.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "experts/expert_streamer.h"
#include "formats/chat_template.h"
#include "formats/tokenizer.h"
#include "models/registry.h"
#include "ops/backend.h"

namespace CLI {
class App;
}

namespace turbospark::cli {

// A CLI11 check for unsigned options: CLI11 reads "-5" into a uint64_t as 2^64 - 5, so a
// negative value is refused by name here ("--seed: must be a whole number >= 0, got -5").
std::string non_negative_integer(const std::string& value);

// --expert-cache-slots / --expert-cache-gb / --expert-cache-policy (expert streaming).
struct ExpertCacheFlags {
  int64_t slots = -1;  // -1: not given (streaming only when the weights exceed memory); 0: off
  double gb = 0;       // a budget in GiB instead of a slot count
  std::string policy = "lru";
  int prefetch = 2;    // loads in flight ahead of compute
  std::string store;   // read streamed experts from this expert store (convert --expert-store)
  bool speculate = false;  // load the next layer's likely experts while a layer computes
  double gpu_memory_gb = 0;  // --gpu-memory-gb: cap on the device memory taken (0: all that is free)
};
void add_expert_cache_options(CLI::App* cmd, ExpertCacheFlags& flags);

struct LoadedRuntime {
  std::unique_ptr<Backend> backend;  // first: outlives the model whose weights live on it
  LoadedModel model;
  // Expert streaming, when on: routed experts come through it instead of the mapping.
  std::unique_ptr<ExpertStreamer> experts;
  std::optional<Tokenizer> tokenizer;  // tokenizer.json beside the model, or the GGUF vocabulary
  std::optional<ChatTemplate> chat_template;  // tokenizer_config.json / chat_template.jinja / GGUF
  std::vector<int32_t> stop_ids;       // eos ids from config, generation_config and tokenizer
  double load_seconds = 0;
};

// The backend --device names: cpu, cuda, or auto (cuda when this build has it and a GPU is
// present, else cpu). Anything else, and cuda in a build without it, is refused by name.
// `precision` applies to the CPU backend only (CpuPrecision: its rounding can mirror CUDA's).
std::unique_ptr<Backend> make_backend(const std::string& device, int threads, const CpuPrecision& precision = {});

// Loads the model in `path` on `device` (see make_backend).
LoadedRuntime load_runtime(const std::string& path, const std::string& device, int threads, bool quiet,
                           const ExpertCacheFlags& experts = {}, const CpuPrecision& cpu_precision = {});
// After a run: the expert cache's line (hit rate, bytes, GB/s, stalls) on stderr, when on.
void print_expert_cache_summary(const LoadedRuntime& rt);

// Prompt ids for a conversation: the chat template rendered with a generation prompt (when
// the model has one and `raw` is false), else the text itself; BOS as the vocabulary says,
// never twice.
// tools, when given (serve's OpenAI `tools`), are passed to the template as `tools`.
std::vector<int32_t> conversation_tokens(const LoadedRuntime& rt, const std::vector<ChatMessage>& messages, bool raw,
                                         const nlohmann::ordered_json* tools = nullptr);

// "5,17,9" -> {5, 17, 9}; throws naming the bad entry.
std::vector<int32_t> parse_token_list(const std::string& text);

// The default model: $TURBOSPARK_MODEL, then in the per-user data folder
// ($XDG_DATA_HOME or ~/.local/share)/turbospark/ default-model.gguf (installed by
// scripts/setup.sh) or a default-model directory. Throws with the install command when none
// is found.
std::string default_model_path();

// Text of one token for streaming output.
std::string join_ids(const std::vector<int32_t>& ids);

}  // namespace turbospark::cli
