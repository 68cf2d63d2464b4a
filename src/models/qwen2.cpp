// Qwen2 / Qwen2.5 (Qwen2ForCausalLM): Llama-style with q/k/v projection biases.
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/decoder.h"

namespace turbospark {

std::unique_ptr<Model> make_qwen2(const HfConfig& config, const Checkpoint& ckpt, Backend& be) {
  DecoderHparams hp = read_common_hparams(config);
  hp.attention_bias = true;  // Qwen2 always has q/k/v biases (o_proj has none)
  ModelInfo info;
  info.architecture = "Qwen2ForCausalLM";
  info.family = "qwen2";
  for (int64_t id : config.get_id_list("eos_token_id")) info.eos_ids.push_back(int32_t(id));
  return std::make_unique<DecoderModel>(std::move(info), std::move(hp), TensorNames{}, ckpt, be);
}

}  // namespace turbospark
