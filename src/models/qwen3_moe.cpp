// Qwen3-MoE (Qwen3MoeForCausalLM): the Qwen3 attention with a softmax top-k router over
// routed SwiGLU experts (optionally renormalized), and dense MLP layers where
// mlp_only_layers or decoder_sparse_step say so.
#include <algorithm>

#include "core/error.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/decoder.h"

namespace turbospark {

std::unique_ptr<Model> make_qwen3_moe(const HfConfig& config, const Checkpoint& ckpt, Backend& be) {
  DecoderHparams hp = read_common_hparams(config);
  hp.qk_norm = true;
  // transformers 5 writes num_local_experts; older configs num_experts.
  hp.n_experts = int(config.has("num_local_experts") ? config.get_int("num_local_experts") : config.get_int("num_experts"));
  hp.top_k = int(config.get_int("num_experts_per_tok"));
  hp.moe_intermediate = config.get_int("moe_intermediate_size");
  hp.norm_topk_prob = config.get_bool("norm_topk_prob", false);
  const int64_t sparse_step = config.get_int("decoder_sparse_step", 1);
  const auto mlp_only = config.get_int_list("mlp_only_layers");
  if (hp.n_experts <= 0) fail("{}: field num_experts must be positive, got {}", config.path(), hp.n_experts);
  if (hp.top_k <= 0 || hp.top_k > hp.n_experts) {
    fail("{}: field num_experts_per_tok {} must be in [1, {}]", config.path(), hp.top_k, hp.n_experts);
  }
  if (sparse_step <= 0) fail("{}: field decoder_sparse_step must be positive, got {}", config.path(), sparse_step);
  for (int i = 0; i < hp.n_layers; ++i) {
    bool dense = std::find(mlp_only.begin(), mlp_only.end(), i) != mlp_only.end() || (i + 1) % sparse_step != 0;
    hp.layers[size_t(i)].ffn = dense ? FfnKind::kDense : FfnKind::kMoe;
  }
  ModelInfo info;
  info.architecture = "Qwen3MoeForCausalLM";
  info.family = "qwen3_moe";
  for (int64_t id : config.get_id_list("eos_token_id")) info.eos_ids.push_back(int32_t(id));
  return std::make_unique<DecoderModel>(std::move(info), std::move(hp), TensorNames{}, ckpt, be);
}

}  // namespace turbospark
