// Llama (LlamaForCausalLM; SmolLM2 and friends): pre-norm GQA with RoPE and a SwiGLU MLP.
#include "core/error.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/decoder.h"

namespace turbospark {

std::unique_ptr<Model> make_llama(const HfConfig& config, const Checkpoint& ckpt, Backend& be) {
  DecoderHparams hp = read_common_hparams(config);
  if (config.get_bool("mlp_bias", false)) fail("{}: field mlp_bias=true is not supported", config.path());
  ModelInfo info;
  info.architecture = "LlamaForCausalLM";
  info.family = "llama";
  for (int64_t id : config.get_id_list("eos_token_id")) info.eos_ids.push_back(int32_t(id));
  return std::make_unique<DecoderModel>(std::move(info), std::move(hp), TensorNames{}, ckpt, be);
}

}  // namespace turbospark
