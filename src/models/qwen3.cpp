// Dense Qwen3 (Qwen3ForCausalLM): GQA with per-head q/k RMSNorm, RoPE, SwiGLU MLP.
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/decoder.h"

namespace turbospark {

std::unique_ptr<Model> make_qwen3(const HfConfig& config, const Checkpoint& ckpt, Backend& be) {
  DecoderHparams hp = read_common_hparams(config);
  hp.qk_norm = true;
  ModelInfo info;
  info.architecture = "Qwen3ForCausalLM";
  info.family = "qwen3";
  for (int64_t id : config.get_id_list("eos_token_id")) info.eos_ids.push_back(int32_t(id));
  return std::make_unique<DecoderModel>(std::move(info), std::move(hp), TensorNames{}, ckpt, be);
}

}  // namespace turbospark
