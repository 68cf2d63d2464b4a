// Gemma 3 text (Gemma3ForCausalLM): sliding-window and global layers with their own RoPE
// (local base on sliding layers, global base with optional linear scaling on full ones),
// sandwich norms scaling by (1 + w), q/k norms, GELU-tanh MLP, embeddings scaled by
// sqrt(hidden), query_pre_attn_scalar, optional final logit soft-capping.
#include <cmath>

#include "core/error.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/decoder.h"

namespace turbospark {

namespace {

struct RopeSpec {
  double theta = 10000.0;
  double linear = 1.0;
};

// rope_parameters nested by layer type (transformers 5) or the legacy flat fields.
RopeSpec rope_for(const HfConfig& c, const std::string& layer_type) {
  const auto& t = c.text();
  RopeSpec r;
  if (t.contains("rope_parameters") && t["rope_parameters"].is_object() && t["rope_parameters"].contains(layer_type)) {
    const auto& p = t["rope_parameters"][layer_type];
    r.theta = p.value("rope_theta", 10000.0);
    const std::string type = p.value("rope_type", std::string("default"));
    if (type == "linear") {
      r.linear = p.value("factor", 1.0);
    } else if (type != "default") {
      fail("{}: rope_parameters.{}.rope_type {} is not supported", c.path(), layer_type, type);
    }
    return r;
  }
  if (layer_type == "sliding_attention") {
    r.theta = c.get_float("rope_local_base_freq", 10000.0);
  } else {
    r.theta = c.get_float("rope_theta", 1000000.0);
    if (t.contains("rope_scaling") && t["rope_scaling"].is_object()) {
      const auto& s = t["rope_scaling"];
      const std::string type = s.value("rope_type", s.value("type", std::string("default")));
      if (type == "linear") r.linear = s.value("factor", 1.0);
      else if (type != "default") fail("{}: rope_scaling type {} is not supported", c.path(), type);
    }
  }
  return r;
}

}  // namespace

std::unique_ptr<Model> make_gemma3(const HfConfig& config, const Checkpoint& ckpt, Backend& be) {
  DecoderHparams hp = read_common_hparams(config);
  const std::string& path = config.path();
  hp.qk_norm = true;
  hp.norm_offset = 1.f;
  hp.sandwich_norms = true;
  hp.embed_scale = std::sqrt(float(hp.hidden));
  const std::string act = config.get_string("hidden_activation", "gelu_pytorch_tanh");
  if (act != "gelu_pytorch_tanh" && act != "gelu_tanh") fail("{}: field hidden_activation {} is not supported", path, act);
  hp.ffn_act = Act::kGeluTanh;
  hp.attn_scale = 1.f / std::sqrt(float(config.get_float("query_pre_attn_scalar", hp.head_dim)));
  if (config.has("attn_logit_softcapping")) fail("{}: field attn_logit_softcapping is not supported", path);
  hp.final_softcap = float(config.get_float("final_logit_softcapping", 0.0));
  const int64_t window = config.get_int("sliding_window", 4096);
  std::vector<std::string> types;
  const auto& t = config.text();
  if (t.contains("layer_types") && t["layer_types"].is_array()) {
    for (const auto& e : t["layer_types"]) types.push_back(e.get<std::string>());
  } else {
    const int64_t pattern = config.get_int("sliding_window_pattern", 6);
    for (int i = 0; i < hp.n_layers; ++i) types.push_back((i + 1) % pattern ? "sliding_attention" : "full_attention");
  }
  if (int(types.size()) != hp.n_layers) fail("{}: field layer_types has {} entries for {} layers", path, types.size(), hp.n_layers);
  for (int i = 0; i < hp.n_layers; ++i) {
    const std::string& type = types[size_t(i)];
    if (type != "sliding_attention" && type != "full_attention") fail("{}: field layer_types[{}] = {} is not supported", path, i, type);
    LayerConfig& lc = hp.layers[size_t(i)];
    lc.window = type == "sliding_attention" ? int(window) : 0;
    RopeSpec r = rope_for(config, type);
    lc.rope_theta = r.theta;
    lc.rope_linear = r.linear;
  }
  TensorNames names;
  names.ffn_norm = "pre_feedforward_layernorm.weight";
  names.post_attn_norm = "post_attention_layernorm.weight";
  names.post_ffn_norm = "post_feedforward_layernorm.weight";
  ModelInfo info;
  info.architecture = "Gemma3ForCausalLM";
  info.family = "gemma3";
  for (int64_t id : config.get_id_list("eos_token_id")) info.eos_ids.push_back(int32_t(id));
  return std::make_unique<DecoderModel>(std::move(info), std::move(hp), names, ckpt, be);
}

}  // namespace turbospark
