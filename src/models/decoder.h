// The pre-norm decoder stack shared by the dense and MoE families: embedding, layers of
// [norm -> attention -> residual, norm -> FFN -> residual], final norm, LM head. What
// differs between families and between layers is data (DecoderHparams, LayerConfig,
// TensorNames), not branches in the forward pass.
#pragma once

#include <string>
#include <vector>

#include "models/blocks/attention.h"
#include "models/blocks/ffn.h"
#include "models/model.h"

namespace turbospark {

enum class FfnKind : uint8_t { kDense, kMoe };

struct LayerConfig {
  FfnKind ffn = FfnKind::kDense;
  int window = 0;            // sliding-window size, 0 = full attention
  double rope_theta = 0;     // 0: the model's rope_theta
  double rope_linear = 1.0;  // linear RoPE scaling factor (positions divided by it)
};

struct DecoderHparams {
  int64_t vocab_size = 0, hidden = 0, intermediate = 0, moe_intermediate = 0;
  int n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, rotary_dim = 0;
  int n_experts = 0, top_k = 0;
  bool norm_topk_prob = false, qk_norm = false, attention_bias = false, tie_embeddings = false;
  double rope_theta = 10000.0;
  float rms_eps = 1e-6f;
  float norm_offset = 0.f;      // 1: norms scale by (1 + w) (Gemma)
  bool sandwich_norms = false;  // norms after attention and FFN too (Gemma)
  Act ffn_act = Act::kSilu;
  float embed_scale = 1.f;      // Gemma: sqrt(hidden)
  float attn_scale = 0.f;       // 0: head_dim^-0.5
  float final_softcap = 0.f;    // logits = cap * tanh(logits / cap) when > 0
  int64_t max_context = 0;
  std::vector<LayerConfig> layers;
};

// Checkpoint tensor names; "{}" is replaced by the layer index and then, for per-expert
// names, by the expert index.
struct TensorNames {
  std::string embed = "model.embed_tokens.weight";
  std::string final_norm = "model.norm.weight";
  std::string lm_head = "lm_head.weight";
  std::string layer = "model.layers.{}.";
  // relative to layer
  std::string attn_norm = "input_layernorm.weight", ffn_norm = "post_attention_layernorm.weight";
  std::string post_attn_norm, post_ffn_norm;  // with sandwich norms
  std::string q = "self_attn.q_proj", k = "self_attn.k_proj", v = "self_attn.v_proj", o = "self_attn.o_proj";
  std::string q_norm = "self_attn.q_norm.weight", k_norm = "self_attn.k_norm.weight";
  std::string gate = "mlp.gate_proj.weight", up = "mlp.up_proj.weight", down = "mlp.down_proj.weight";
  std::string router = "mlp.gate.weight";
  std::string expert = "mlp.experts.{}.";  // per-expert prefix, + gate_proj/up_proj/down_proj
  std::string fused_gate_up = "mlp.experts.gate_up_proj";  // [E, 2*inter, hidden], gate rows first
  std::string fused_down = "mlp.experts.down_proj";        // [E, hidden, inter]
  std::string stacked_gate = "mlp.experts.gate_proj";      // [E, inter, hidden] (GGUF ffn_gate_exps)
  std::string stacked_up = "mlp.experts.up_proj";          // [E, inter, hidden] (GGUF ffn_up_exps)
  std::string stacked_down = "mlp.experts.down_proj";      // [E, hidden, inter] (GGUF ffn_down_exps)
};

class DecoderModel : public Model {
 public:
  DecoderModel(ModelInfo info, DecoderHparams hp, const TensorNames& names, const Checkpoint& ckpt, Backend& be);

  const ModelInfo& info() const override { return info_; }
  std::vector<KvLayerSpec> kv_spec() const override;
  int64_t n_experts() const override { return hp_.n_experts; }
  int experts_per_token() const override { return hp_.n_experts > 0 ? hp_.top_k : 0; }
  bool guesses_next_experts() const override { return hp_.n_experts > 0; }
  void for_each_routed_expert(const std::function<void(const ExpertWeights&)>& fn) const override {
    for (const Layer& L : layers_)
      for (const ExpertWeights& e : L.moe.experts) fn(e);
  }
  std::unique_ptr<ModelWorkspace> new_workspace(Backend& backend, int64_t max_rows) const override;
  void forward(Backend& backend, const ForwardBatch& batch) const override;

 private:
  struct Layer {
    Param attn_norm, ffn_norm;            // [hidden] f32
    Param post_attn_norm, post_ffn_norm;  // [hidden] f32, sandwich norms only
    AttentionParams attn_params;
    AttentionWeights attn;
    DenseMlpWeights mlp;
    MoeWeights moe;
    FfnKind ffn = FfnKind::kDense;
  };

  ModelInfo info_;
  DecoderHparams hp_;
  Weight embed_;     // [vocab, hidden]
  Weight lm_head_;   // [vocab, hidden] (the embedding when tied)
  Param final_norm_;  // [hidden] f32
  std::vector<Layer> layers_;
};

// Reads the fields every Qwen/Llama-style config shares (sizes, heads, rope, eps, tying).
DecoderHparams read_common_hparams(const HfConfig& config);

}  // namespace turbospark
