#include "models/registry.h"

#include <cstdlib>
#include <string>

#include "core/error.h"
#include "formats/hf_config.h"
#include "formats/gguf_model.h"
#include "formats/safetensors.h"

namespace turbospark {

std::unique_ptr<Model> make_qwen3(const HfConfig&, const Checkpoint&, Backend&);
std::unique_ptr<Model> make_qwen3_moe(const HfConfig&, const Checkpoint&, Backend&);
std::unique_ptr<Model> make_qwen4_exp(const HfConfig&, const Checkpoint&, Backend&);
std::unique_ptr<Model> make_llama(const HfConfig&, const Checkpoint&, Backend&);
std::unique_ptr<Model> make_qwen2(const HfConfig&, const Checkpoint&, Backend&);
std::unique_ptr<Model> make_gemma3(const HfConfig&, const Checkpoint&, Backend&);
std::unique_ptr<Model> make_gpt_oss(const HfConfig&, const Checkpoint&, Backend&);
std::unique_ptr<Model> make_gemma4(const HfConfig&, const Checkpoint&, Backend&);

bool cuda_unverified_allowed() {
  const char* v = std::getenv("TURBOSPARK_CUDA_UNVERIFIED");
  return v && std::string(v) == "1";
}

void check_family_runs_on(const FamilyEntry& family, const std::string& backend, const std::string& path) {
  if (backend != "cpu" && !family.cuda && !cuda_unverified_allowed()) {
    fail("{}: {} is not supported on --device {} yet (it runs on --device cpu; TURBOSPARK_CUDA_UNVERIFIED=1 runs its "
         "GPU kernels, which have not passed the device tests yet)",
         path, family.architecture, backend);
  }
}

const std::vector<FamilyEntry>& families() {
  static const std::vector<FamilyEntry> kFamilies = {
      // model_type, architecture, factory, runs on CUDA (false: its CUDA kernels exist but have
      // not yet passed tests/device/run.sh on a GPU; refused unless TURBOSPARK_CUDA_UNVERIFIED=1)
      {"llama", "LlamaForCausalLM", make_llama, true},
      {"qwen2", "Qwen2ForCausalLM", make_qwen2, true},
      {"qwen3", "Qwen3ForCausalLM", make_qwen3, true},
      {"gemma3_text", "Gemma3ForCausalLM", make_gemma3, true},
      {"gemma4_text", "Gemma4ForCausalLM", make_gemma4, true},
      {"gemma4_text", "Gemma4ForConditionalGeneration", make_gemma4, true},
      {"qwen3_moe", "Qwen3MoeForCausalLM", make_qwen3_moe, true},
      {"gpt_oss", "GptOssForCausalLM", make_gpt_oss, true},
      {"qwen4_exp_text", "Qwen4ExpForCausalLM", make_qwen4_exp, true},
      {"qwen4_exp_text", "Qwen4ExpForConditionalGeneration", make_qwen4_exp, true},
  };
  return kFamilies;
}

LoadedModel load_model(const std::string& model_dir, Backend& backend) {
  std::shared_ptr<Checkpoint> gguf_checkpoint;
  if (is_gguf_path(model_dir)) gguf_checkpoint = std::make_shared<Checkpoint>(model_dir);
  HfConfig config = gguf_checkpoint ? HfConfig::from_json(gguf_hf_config(*gguf_checkpoint->gguf()), model_dir)
                                    : HfConfig::load(model_dir);
  const std::string type = config.model_type();
  const std::string arch = config.architecture();
  const FamilyEntry* entry = nullptr;
  for (const auto& f : families()) {
    if (type == f.model_type && (arch.empty() || arch == f.architecture)) entry = &f;
  }
  if (!entry) {
    std::string known;
    for (const auto& f : families()) known += (known.empty() ? "" : ", ") + std::string(f.architecture);
    fail("{}: unsupported architecture {} (model_type {}); supported: {}", config.path(),
         arch.empty() ? "<none>" : arch, type.empty() ? "<none>" : type, known);
  }
  check_family_runs_on(*entry, backend.name(), config.path());
  LoadedModel loaded;
  loaded.checkpoint = gguf_checkpoint ? gguf_checkpoint : std::make_shared<Checkpoint>(model_dir);
  const bool routed = config.has("num_experts") || config.has("num_local_experts");
  backend.begin_weights(loaded.checkpoint->total_bytes(), routed);
  loaded.model = entry->make(config, *loaded.checkpoint, backend);
  backend.end_weights();
  return loaded;
}

CheckpointFacts probe_checkpoint(const std::string& model_dir) {
  auto ck = std::make_shared<Checkpoint>(model_dir);
  const HfConfig config =
      is_gguf_path(model_dir) ? HfConfig::from_json(gguf_hf_config(*ck->gguf()), model_dir) : HfConfig::load(model_dir);
  return {ck->total_bytes(), config.has("num_experts") || config.has("num_local_experts")};
}

LoadedModel load_model(const std::string& model_dir) {
  std::shared_ptr<Backend> cpu = make_cpu_backend(2);
  LoadedModel loaded = load_model(model_dir, *cpu);
  loaded.owned_backend = std::move(cpu);
  return loaded;
}

}  // namespace turbospark
