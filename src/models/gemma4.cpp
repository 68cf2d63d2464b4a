// Gemma 4 text (Gemma4ForCausalLM, and the text part of Gemma4ForConditionalGeneration:
// model.language_model.*, vision/audio towers skipped, image/video/audio tokens refused).
// Per layer, as data in Gemma4LayerSpec: sliding or full attention, each with its own head
// dim (global_head_dim on full layers), KV head count and RoPE table (default on sliding,
// proportional with partial rotary on full); k_eq_v on full layers; KV sharing (the last
// num_kv_shared_layers layers attend over the cache of the last earlier layer of their type
// and own none); a dense GeGLU MLP, optionally with routed experts beside it; per-layer input
// embeddings gated into the residual after the FFN; a per-layer output scalar. Sandwich norms
// scale by w (no 1 + w offset, unlike Gemma 3), attention scale is 1, embeddings scale by
// sqrt(hidden), final logits are optionally soft-capped.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "core/error.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/arena.h"
#include "models/weights.h"
#include "models/blocks/ffn.h"
#include "models/blocks/gemma4_attention.h"
#include "models/blocks/gemma4_moe.h"
#include "models/blocks/gemma4_per_layer.h"
#include "models/blocks/output.h"
#include "models/blocks/rope.h"
#include "models/model.h"

namespace turbospark {
namespace {

struct Gemma4LayerSpec {
  bool sliding = false;
  int head_dim = 0, n_kv_heads = 0;
  int kv_source = -1;  // the earlier layer whose cache this one reads (KV sharing), else -1
  bool k_eq_v = false;
  int64_t intermediate = 0;  // dense MLP width (doubled on shared layers with use_double_wide_mlp)
  std::vector<float> inv_freq;  // [head_dim / 2]
};

struct Gemma4Hparams {
  int64_t vocab = 0, hidden = 0, max_context = 0;
  int n_layers = 0, n_heads = 0;
  int window = 0;
  float eps = 1e-6f;
  float final_softcap = 0.f;
  bool tie = true;
  bool moe = false;
  int n_experts = 0, top_k = 0;
  int64_t moe_inter = 0;
  int64_t per_layer_dim = 0, per_layer_vocab = 0;  // per-layer inputs, 0 = none
  std::vector<Gemma4LayerSpec> layers;
  std::vector<int32_t> refused_tokens;  // multimodal placeholders (image, video, audio)
};

// RoPE inverse frequencies for one layer type, as transformers builds them: "default" over
// the whole head (partial_rotary_factor ignored); "proportional" rotates the first
// int(partial * head_dim // 2) frequency pairs with exponents 2i / head_dim (the full head
// dim, not the rotated part) and gives the rest frequency 0, so the whole head goes through
// the rotate-half kernel with those pairs left unrotated; both divided by `factor`.
std::vector<float> rope_for(const HfConfig& c, const std::string& type, int head_dim) {
  const auto& t = c.text();
  std::string rope_type = type == "sliding_attention" ? "default" : "proportional";
  double theta = type == "sliding_attention" ? 10000.0 : 1000000.0, partial = 0.25, factor = 1.0;
  if (t.contains("rope_parameters") && !t["rope_parameters"].is_null()) {
    const auto& rp = t["rope_parameters"];
    if (!rp.is_object() || !rp.contains(type) || !rp[type].is_object()) {
      fail("{}: field rope_parameters.{} is missing", c.path(), type);
    }
    const auto& p = rp[type];
    rope_type = p.value("rope_type", p.value("type", std::string("default")));
    if (!p.contains("rope_theta") || !p["rope_theta"].is_number()) {
      fail("{}: field rope_parameters.{}.rope_theta is missing", c.path(), type);
    }
    theta = p["rope_theta"].get<double>();
    partial = p.contains("partial_rotary_factor") && p["partial_rotary_factor"].is_number()
                  ? p["partial_rotary_factor"].get<double>()
                  : 1.0;
    factor = p.contains("factor") && p["factor"].is_number() ? p["factor"].get<double>() : 1.0;
  }
  if (theta <= 0 || factor <= 0) fail("{}: rope_parameters.{} has theta {} factor {}", c.path(), type, theta, factor);
  std::vector<float> inv;
  if (rope_type == "default") {
    inv = rope_inv_freq_default(theta, head_dim);
  } else if (rope_type == "proportional") {
    if (partial < 0 || partial > 1) {
      fail("{}: field rope_parameters.{}.partial_rotary_factor {} is not in [0, 1]", c.path(), type, partial);
    }
    const int angles = int(std::floor(partial * head_dim / 2));
    inv.assign(size_t(head_dim / 2), 0.f);
    for (int i = 0; i < angles; ++i) {
      inv[size_t(i)] = 1.0f / std::pow(float(theta), float(2 * i) / float(head_dim));
    }
  } else {
    fail("{}: rope_parameters.{}.rope_type {} is not supported (default, proportional)", c.path(), type, rope_type);
  }
  for (float& f : inv) f = f / float(factor);
  return inv;
}

Gemma4Hparams read_hparams(const HfConfig& c) {
  Gemma4Hparams hp;
  const std::string& path = c.path();
  const auto& t = c.text();
  hp.vocab = c.get_int("vocab_size");
  hp.hidden = c.get_int("hidden_size");
  hp.n_layers = int(c.get_int("num_hidden_layers"));
  hp.n_heads = int(c.get_int("num_attention_heads"));
  const int n_kv = int(c.get_int("num_key_value_heads"));
  const int head_dim = int(c.get_int("head_dim", 256));
  const int64_t intermediate = c.get_int("intermediate_size");
  hp.max_context = c.get_int("max_position_embeddings", 131072);
  hp.eps = float(c.get_float("rms_norm_eps", 1e-6));
  hp.window = int(c.get_int("sliding_window", 512));
  hp.final_softcap = float(c.get_float("final_logit_softcapping", 0.0));
  const auto& root = c.root();
  const bool root_tie = !root.contains("tie_word_embeddings") || !root["tie_word_embeddings"].is_boolean() ||
                        root["tie_word_embeddings"].get<bool>();
  hp.tie = c.get_bool("tie_word_embeddings", root_tie);
  auto positive = [&](const char* field, int64_t v) {
    if (v <= 0) fail("{}: field {} must be positive, got {}", path, field, v);
  };
  positive("vocab_size", hp.vocab);
  positive("hidden_size", hp.hidden);
  positive("num_hidden_layers", hp.n_layers);
  positive("num_attention_heads", hp.n_heads);
  positive("num_key_value_heads", n_kv);
  positive("head_dim", head_dim);
  positive("intermediate_size", intermediate);
  positive("sliding_window", hp.window);
  positive("max_position_embeddings", hp.max_context);
  if (hp.final_softcap < 0) fail("{}: field final_logit_softcapping must be positive, got {}", path, hp.final_softcap);
  const std::string act = c.get_string("hidden_activation", "gelu_pytorch_tanh");
  if (act != "gelu_pytorch_tanh" && act != "gelu_tanh") fail("{}: field hidden_activation {} is not supported", path, act);
  if (c.get_bool("attention_bias", false)) fail("{}: field attention_bias=true is not supported", path);
  const std::string bidir = c.get_string("use_bidirectional_attention", "");
  // "vision" only changes the mask around image tokens, which this text model refuses.
  if (!bidir.empty() && bidir != "vision") fail("{}: field use_bidirectional_attention={} is not supported", path, bidir);
  if (c.has("attn_logit_softcapping")) fail("{}: field attn_logit_softcapping is not supported", path);

  // Layer types; the reference forces the last layer to full attention.
  std::vector<std::string> types;
  if (t.contains("layer_types") && !t["layer_types"].is_null()) {
    if (!t["layer_types"].is_array()) fail("{}: field layer_types must be a list", path);
    for (const auto& e : t["layer_types"]) {
      if (!e.is_string()) fail("{}: field layer_types holds a non-string entry", path);
      types.push_back(e.get<std::string>());
    }
  } else {
    for (int i = 0; i < hp.n_layers; ++i) types.push_back((i + 1) % 6 ? "sliding_attention" : "full_attention");
  }
  if (int(types.size()) != hp.n_layers) fail("{}: field layer_types has {} entries for {} layers", path, types.size(), hp.n_layers);
  types.back() = "full_attention";

  // Full layers' geometry: per_layer_config (what transformers >= 5.15 saves) or the flat
  // global_head_dim / num_global_key_value_heads fields real checkpoints ship. As the
  // reference does, num_global_key_value_heads applies only with attention_k_eq_v.
  const bool k_eq_v = c.get_bool("attention_k_eq_v", false);
  const int global_head_dim = int(c.get_int("global_head_dim", 512));
  const int global_kv = k_eq_v && c.has("num_global_key_value_heads") ? int(c.get_int("num_global_key_value_heads")) : n_kv;
  std::map<int, std::pair<int, int>> overrides;  // layer -> (head_dim, kv heads)
  const bool per_layer_config = t.contains("per_layer_config") && !t["per_layer_config"].is_null();
  if (per_layer_config) {
    const auto& plc = t["per_layer_config"];
    if (!plc.is_object()) fail("{}: field per_layer_config must be an object", path);
    for (auto it = plc.begin(); it != plc.end(); ++it) {
      int layer = -1;
      try {
        layer = std::stoi(it.key());
      } catch (...) {
        fail("{}: field per_layer_config key {} is not a layer index", path, it.key());
      }
      if (layer < 0 || layer >= hp.n_layers) fail("{}: field per_layer_config names layer {} of {}", path, layer, hp.n_layers);
      const auto& o = it.value();
      for (auto f = o.begin(); f != o.end(); ++f) {
        if (f.key() != "head_dim" && f.key() != "num_key_value_heads") {
          fail("{}: field per_layer_config.{}.{} is not supported", path, layer, f.key());
        }
        if (!f.value().is_number_integer()) fail("{}: field per_layer_config.{}.{} must be an integer", path, layer, f.key());
      }
      overrides[layer] = {o.value("head_dim", head_dim), o.value("num_key_value_heads", n_kv)};
    }
  }

  const int n_shared = int(c.get_int("num_kv_shared_layers", 0));
  if (n_shared < 0 || n_shared >= hp.n_layers) {
    fail("{}: field num_kv_shared_layers {} must be in [0, {})", path, n_shared, hp.n_layers);
  }
  const int first_shared = hp.n_layers - n_shared;
  const bool double_wide = c.get_bool("use_double_wide_mlp", false);
  hp.layers.resize(size_t(hp.n_layers));
  for (int i = 0; i < hp.n_layers; ++i) {
    const std::string& type = types[size_t(i)];
    if (type != "sliding_attention" && type != "full_attention") {
      fail("{}: field layer_types[{}] = {} is not supported", path, i, type);
    }
    Gemma4LayerSpec& L = hp.layers[size_t(i)];
    L.sliding = type == "sliding_attention";
    if (per_layer_config) {
      auto it = overrides.find(i);
      L.head_dim = it != overrides.end() ? it->second.first : head_dim;
      L.n_kv_heads = it != overrides.end() ? it->second.second : n_kv;
    } else {
      L.head_dim = L.sliding ? head_dim : global_head_dim;
      L.n_kv_heads = L.sliding ? n_kv : global_kv;
    }
    if (L.head_dim <= 0 || L.head_dim % 2) fail("{}: layer {} head_dim {} must be positive and even", path, i, L.head_dim);
    if (L.n_kv_heads <= 0 || hp.n_heads % L.n_kv_heads) {
      fail("{}: layer {}: num_attention_heads {} is not a multiple of its {} KV heads", path, i, hp.n_heads, L.n_kv_heads);
    }
    L.k_eq_v = k_eq_v && !L.sliding;
    L.inv_freq = rope_for(c, type, L.head_dim);
    const bool shared = i >= first_shared;
    L.intermediate = intermediate * (double_wide && shared ? 2 : 1);
    if (shared) {
      // The last non-shared layer of the same type stored its full-length KV for them.
      for (int j = first_shared - 1; j >= 0; --j) {
        if (types[size_t(j)] == type) {
          L.kv_source = j;
          break;
        }
      }
      if (L.kv_source < 0) {
        fail("{}: num_kv_shared_layers {}: shared layer {} ({}) has no earlier {} layer to share KV with", path,
             n_shared, i, type, type);
      }
      const Gemma4LayerSpec& src = hp.layers[size_t(L.kv_source)];
      if (src.head_dim != L.head_dim || src.n_kv_heads != L.n_kv_heads) {
        fail("{}: layer {} shares KV with layer {} of another geometry", path, i, L.kv_source);
      }
    }
  }

  hp.moe = c.get_bool("enable_moe_block", false);
  if (hp.moe) {
    hp.n_experts = int(c.get_int("num_experts"));
    hp.top_k = int(c.get_int("top_k_experts"));
    hp.moe_inter = c.get_int("moe_intermediate_size");
    positive("num_experts", hp.n_experts);
    positive("moe_intermediate_size", hp.moe_inter);
    if (hp.top_k <= 0 || hp.top_k > hp.n_experts) {
      fail("{}: field top_k_experts {} must be in [1, {}]", path, hp.top_k, hp.n_experts);
    }
  }
  // A null hidden_size_per_layer_input disables per-layer inputs; absent means the
  // reference's default of 256.
  if (t.contains("hidden_size_per_layer_input") && t["hidden_size_per_layer_input"].is_null()) {
    hp.per_layer_dim = 0;
  } else {
    hp.per_layer_dim = c.get_int("hidden_size_per_layer_input", 256);
  }
  if (hp.per_layer_dim < 0) fail("{}: field hidden_size_per_layer_input must be >= 0, got {}", path, hp.per_layer_dim);
  if (hp.per_layer_dim > 0) {
    hp.per_layer_vocab = c.get_int("vocab_size_per_layer_input", 262144);
    positive("vocab_size_per_layer_input", hp.per_layer_vocab);
  }
  // Multimodal placeholders: a text-only engine cannot fill them.
  if (c.root().contains("text_config")) {
    for (const char* f : {"image_token_id", "video_token_id", "audio_token_id"}) {
      if (c.root().contains(f) && c.root()[f].is_number_integer()) hp.refused_tokens.push_back(c.root()[f].get<int32_t>());
    }
  }
  return hp;
}

struct Layer {
  Gemma4LayerSpec spec;
  AttentionParams attn_params;
  Gemma4AttentionWeights attn;
  Param attn_norm, post_attn_norm, pre_ffn_norm, post_ffn_norm;  // [hidden] f32, scale w
  Param post_ffn_norm_1, post_ffn_norm_2;  // [hidden] f32, MoE layers only
  DenseMlpWeights mlp;
  Gemma4MoeWeights moe;
  Gemma4PerLayerGateWeights per_layer;
  float scalar = 1.f;  // layer_scalar: the layer's output is multiplied by it
};

struct Gemma4Workspace : ModelWorkspace {
  std::shared_ptr<float> storage;
  int64_t capacity = 0;
  Mat x, xn, branch, branch2, logits;  // [rows, hidden] x4, [rows, vocab]
  AttentionScratch attn;               // q/attn [rows, heads * max hd], k/v [rows, max kv width]
  FfnScratch ffn;                      // gate/up [rows, max intermediate]
  Gemma4MoeScratch moe;                // normed [rows, hidden], router_logits [rows, experts]
  Mat per_layer, per_layer_context;    // [rows, layers * per_layer_dim]
  Mat pl_gate, pl_gated;               // [rows, per_layer_dim]
};

class Gemma4Model final : public Model {
 public:
  Gemma4Model(Gemma4Hparams hp, const HfConfig& config, const Checkpoint& ck, Backend& be) : hp_(std::move(hp)) {
    const WeightLoader ld{ck, be};
    const int64_t H = hp_.hidden;
    const bool multimodal = ck.has("model.language_model.embed_tokens.weight");
    const std::string trunk = multimodal ? "model.language_model." : "model.";
    auto weight = [&](const std::string& name, int64_t rows, int64_t cols, int layer) {
      return ld.matrix(name, rows, cols, layer);
    };
    embed_ = weight(trunk + "embed_tokens.weight", hp_.vocab, H, -1);
    if (hp_.tie) {
      lm_head_ = embed_;
    } else {
      lm_head_ = weight("lm_head.weight", hp_.vocab, H, -1);
    }
    final_norm_ = ld.floats(trunk + "norm.weight", {H});
    int64_t bytes = embed_.view.bytes() + (hp_.tie ? 0 : lm_head_.view.bytes());
    int64_t active = lm_head_.view.bytes();
    const int64_t P = hp_.per_layer_dim, L_P = int64_t(hp_.n_layers) * P;
    if (P > 0) {
      Gemma4PerLayerInputWeights& pl = per_layer_inputs_;
      pl.table = weight(trunk + "embed_tokens_per_layer.weight", hp_.per_layer_vocab, L_P, -1);
      pl.projection = weight(trunk + "per_layer_model_projection.weight", L_P, H, -1);
      pl.norm = ld.floats(trunk + "per_layer_projection_norm.weight", {P});
      pl.n_layers = hp_.n_layers;
      pl.dim = P;
      pl.hidden = H;
      pl.eps = hp_.eps;
      bytes += pl.table.view.bytes() + pl.projection.view.bytes();
      active += pl.projection.view.bytes();
    }
    int max_hd = 0;
    for (const auto& s : hp_.layers) max_hd = std::max(max_hd, s.head_dim);
    ones_ = ld.param(std::vector<float>(size_t(max_hd), 1.f));
    layers_.resize(size_t(hp_.n_layers));
    for (int i = 0; i < hp_.n_layers; ++i) {
      Layer& L = layers_[size_t(i)];
      L.spec = hp_.layers[size_t(i)];
      const Gemma4LayerSpec& s = L.spec;
      const std::string p = fmt::format("{}layers.{}.", trunk, i);
      L.attn_norm = ld.floats(p + "input_layernorm.weight", {H});
      L.post_attn_norm = ld.floats(p + "post_attention_layernorm.weight", {H});
      L.pre_ffn_norm = ld.floats(p + "pre_feedforward_layernorm.weight", {H});
      L.post_ffn_norm = ld.floats(p + "post_feedforward_layernorm.weight", {H});
      // A buffer the reference saves; checkpoints without it mean 1.
      if (ck.has(p + "layer_scalar")) L.scalar = ck.floats(p + "layer_scalar", {1})[0];

      AttentionParams& ap = L.attn_params;
      ap.n_heads = hp_.n_heads;
      ap.n_kv_heads = s.n_kv_heads;
      ap.head_dim = s.head_dim;
      ap.rotary_dim = s.head_dim;  // proportional RoPE: unrotated pairs have frequency 0
      ap.scale = 1.f;
      ap.window = s.sliding ? hp_.window : 0;
      ap.norm_eps = hp_.eps;
      ap.inv_freq = ld.param(s.inv_freq);
      const int64_t qw = int64_t(hp_.n_heads) * s.head_dim, kvw = int64_t(s.n_kv_heads) * s.head_dim;
      Gemma4AttentionWeights& aw = L.attn;
      aw.q = weight(p + "self_attn.q_proj.weight", qw, H, i);
      aw.o = weight(p + "self_attn.o_proj.weight", H, qw, i);
      aw.q_norm = ld.floats(p + "self_attn.q_norm.weight", {s.head_dim});
      aw.ones = ones_.data();
      aw.kv_shared = s.kv_source >= 0;
      int64_t layer_bytes = aw.q.view.bytes() + aw.o.view.bytes();
      if (!aw.kv_shared) {
        aw.k = weight(p + "self_attn.k_proj.weight", kvw, H, i);
        aw.k_norm = ld.floats(p + "self_attn.k_norm.weight", {s.head_dim});
        if (!s.k_eq_v) aw.v = weight(p + "self_attn.v_proj.weight", kvw, H, i);
        layer_bytes += aw.k.view.bytes() + aw.v.view.bytes();
      }
      L.mlp.gate = weight(p + "mlp.gate_proj.weight", s.intermediate, H, i);
      L.mlp.up = weight(p + "mlp.up_proj.weight", s.intermediate, H, i);
      L.mlp.down = weight(p + "mlp.down_proj.weight", H, s.intermediate, i);
      L.mlp.act = Act::kGeluTanh;
      layer_bytes += 3 * L.mlp.gate.view.bytes();
      int64_t layer_active = layer_bytes;
      if (hp_.moe) {
        const int64_t E = hp_.n_experts, I = hp_.moe_inter;
        Gemma4MoeWeights& m = L.moe;
        m.router = weight(p + "router.proj.weight", E, H, i);
        std::vector<float> router_norm = ck.floats(p + "router.scale", {H});
        const float root = 1.f / std::sqrt(float(H));
        for (float& v : router_norm) v *= root;
        m.router_norm = ld.param(router_norm);
        m.per_expert_scale = ld.floats(p + "router.per_expert_scale", {E});
        m.pre_norm = ld.floats(p + "pre_feedforward_layernorm_2.weight", {H});
        m.top_k = hp_.top_k;
        m.eps = hp_.eps;
        L.post_ffn_norm_1 = ld.floats(p + "post_feedforward_layernorm_1.weight", {H});
        L.post_ffn_norm_2 = ld.floats(p + "post_feedforward_layernorm_2.weight", {H});
        const std::string gate_up = p + "experts.gate_up_proj", down = p + "experts.down_proj";
        for (int e = 0; e < E; ++e) {
          ExpertWeights ew;
          // Gate rows first, then up rows; rows_slice moves packed formats' scale planes too.
          const WeightView fused = ld.expert_view(ck.matrix_in_stack(gate_up, e, E, 2 * I, H), gate_up);
          ew.gate.view = fused.rows_slice(0, I);
          ew.up.view = fused.rows_slice(I, I);
          ew.down.view = ld.expert_view(ck.matrix_in_stack(down, e, E, H, I), down);
          ew.gate.name = ew.up.name = gate_up;
          ew.down.name = down;
          ew.act = Act::kGeluTanh;
          for (Weight* w : {&ew.gate, &ew.up, &ew.down}) {
            w->layer = i;
            w->expert = e;
            w->residency = Residency::kStreamedExpert;
          }
          m.experts.push_back(std::move(ew));
        }
        const int64_t expert_bytes = 3 * m.experts[0].gate.view.bytes();
        layer_bytes += m.router.view.bytes() + E * expert_bytes;
        info_.expert_bytes = expert_bytes;
        info_.routed_weight_bytes += E * expert_bytes;
        layer_active += m.router.view.bytes() + hp_.top_k * expert_bytes;
      }
      if (P > 0) {
        L.per_layer.gate = weight(p + "per_layer_input_gate.weight", P, H, i);
        L.per_layer.projection = weight(p + "per_layer_projection.weight", H, P, i);
        L.per_layer.post_norm = ld.floats(p + "post_per_layer_input_norm.weight", {H});
        layer_bytes += 2 * L.per_layer.gate.view.bytes();
        layer_active += 2 * L.per_layer.gate.view.bytes();
      }
      bytes += layer_bytes;
      active += layer_active;
    }
    info_.architecture = config.architecture().empty() ? "Gemma4ForCausalLM" : config.architecture();
    info_.family = "gemma4";
    info_.vocab_size = hp_.vocab;
    info_.hidden_size = H;
    info_.n_layers = hp_.n_layers;
    info_.max_context = hp_.max_context;
    info_.weight_bytes = bytes;
    info_.active_weight_bytes = active;
    for (int64_t id : config.get_id_list("eos_token_id")) info_.eos_ids.push_back(int32_t(id));
    info_.n_params = ck.n_parameters([](const std::string& name) {
      return name.find("vision") != std::string::npos || name.find("audio") != std::string::npos;
    });
  }

  const ModelInfo& info() const override { return info_; }
  int64_t n_experts() const override { return hp_.moe ? hp_.n_experts : 0; }
  int experts_per_token() const override { return hp_.moe ? hp_.top_k : 0; }
  void for_each_routed_expert(const std::function<void(const ExpertWeights&)>& fn) const override {
    for (const Layer& L : layers_)
      for (const ExpertWeights& e : L.moe.experts) fn(e);
  }

  // Shared layers own no cache: 0 KV heads, so the engine allocates nothing for them.
  std::vector<KvLayerSpec> kv_spec() const override {
    std::vector<KvLayerSpec> spec(size_t(hp_.n_layers));
    for (int i = 0; i < hp_.n_layers; ++i) {
      const Gemma4LayerSpec& s = hp_.layers[size_t(i)];
      if (s.kv_source < 0) spec[size_t(i)] = {s.n_kv_heads, s.head_dim};
    }
    return spec;
  }

  std::unique_ptr<ModelWorkspace> new_workspace(Backend& be, int64_t R) const override {
    auto ws = std::make_unique<Gemma4Workspace>();
    const int64_t H = hp_.hidden;
    int64_t qw = 0, kvw = 0, inter = 0;
    for (const auto& s : hp_.layers) {
      qw = std::max(qw, int64_t(hp_.n_heads) * s.head_dim);
      kvw = std::max(kvw, int64_t(s.n_kv_heads) * s.head_dim);
      inter = std::max(inter, s.intermediate);
    }
    const int64_t E = std::max(hp_.n_experts, 1), P = hp_.per_layer_dim, LP = int64_t(hp_.n_layers) * P;
    ws->storage = allocate_mats(be, R, {{&ws->x, H}, {&ws->xn, H}, {&ws->branch, H}, {&ws->branch2, H},
                                        {&ws->logits, hp_.vocab}, {&ws->attn.q, qw}, {&ws->attn.k, kvw},
                                        {&ws->attn.v, kvw}, {&ws->attn.attn, qw}, {&ws->ffn.gate, inter},
                                        {&ws->ffn.up, inter}, {&ws->moe.normed, H}, {&ws->moe.router_logits, E},
                                        {&ws->per_layer, LP}, {&ws->per_layer_context, LP}, {&ws->pl_gate, P},
                                        {&ws->pl_gated, P}});
    if (hp_.moe) {
      ws->moe.topk_idx = be.alloc_array<int32_t>(R * hp_.top_k);
      ws->moe.topk_weight = be.alloc_array<float>(R * hp_.top_k);
    }
    ws->capacity = R;
    return ws;
  }

  void check_tokens(std::span<const int32_t> tokens) const override {
    for (const int32_t tok : tokens) {
      if (std::find(hp_.refused_tokens.begin(), hp_.refused_tokens.end(), tok) != hp_.refused_tokens.end()) {
        fail("token {} is an image/video/audio placeholder: Gemma 4 image, video and audio input is not supported", tok);
      }
      if (hp_.per_layer_dim > 0 && tok >= hp_.per_layer_vocab) {
        fail("token {} is outside vocab_size_per_layer_input {}", tok, hp_.per_layer_vocab);
      }
    }
  }

  void forward(Backend& be, const ForwardBatch& b) const override {
    auto& ws = *static_cast<Gemma4Workspace*>(b.workspace);
    b.check(ws.capacity, hp_.n_layers);
    const int64_t n = b.n;
    Mat x = ws.x.rows_slice(0, n), xn = ws.xn.rows_slice(0, n), branch = ws.branch.rows_slice(0, n);
    Mat branch2 = ws.branch2.rows_slice(0, n);
    auto trace = [&](const char* name, int layer, const Mat& m) { b.emit(name, layer, m); };
    be.embedding(embed_, b.tokens, n, std::sqrt(float(hp_.hidden)), x);
    trace("embedding", -1, x);
    const int64_t P = hp_.per_layer_dim;
    Mat per_layer;
    if (P > 0) {
      per_layer = ws.per_layer.rows_slice(0, n);
      gemma4_per_layer_inputs(be, per_layer_inputs_, b.tokens, x, ws.per_layer_context.rows_slice(0, n), per_layer);
      trace("per_layer_inputs", -1, per_layer);
    }
    for (int i = 0; i < hp_.n_layers; ++i) {
      const Layer& L = layers_[size_t(i)];
      trace("layer_in", i, x);
      be.rmsnorm(x, L.attn_norm.data(), hp_.eps, xn, 0.f);
      const KvLayerView& kv = b.kv[size_t(L.spec.kv_source >= 0 ? L.spec.kv_source : i)];
      gemma4_attention(be, L.attn_params, L.attn, xn, b.positions, kv, ws.attn, branch);
      be.rmsnorm(branch, L.post_attn_norm.data(), hp_.eps, branch, 0.f);
      trace("attention", i, branch);
      be.add(x, branch);
      // The dense MLP, and beside it the routed experts, both read the residual x.
      be.rmsnorm(x, L.pre_ffn_norm.data(), hp_.eps, xn, 0.f);
      // Scratch sized for the widest MLP, viewed at this layer's width (double-wide layers).
      FfnScratch mlp_scratch;
      mlp_scratch.gate = Mat(ws.ffn.gate.data, ws.capacity, L.spec.intermediate);
      mlp_scratch.up = Mat(ws.ffn.up.data, ws.capacity, L.spec.intermediate);
      dense_mlp(be, L.mlp, xn, mlp_scratch, branch);
      if (hp_.moe) be.rmsnorm(branch, L.post_ffn_norm_1.data(), hp_.eps, branch, 0.f);
      trace("mlp", i, branch);
      if (hp_.moe) {
        float* probs = b.router_probs ? b.router_probs + int64_t(i) * n * hp_.n_experts : nullptr;
        gemma4_moe(be, L.moe, x, ws.moe, branch2, probs);
        be.rmsnorm(branch2, L.post_ffn_norm_2.data(), hp_.eps, branch2, 0.f);
        trace("moe", i, branch2);
        be.add(branch, branch2);
      }
      be.rmsnorm(branch, L.post_ffn_norm.data(), hp_.eps, branch, 0.f);
      be.add(x, branch);
      if (P > 0) {
        gemma4_per_layer_gate(be, L.per_layer, Act::kGeluTanh, hp_.eps, per_layer.cols_slice(int64_t(i) * P, P), x,
                              ws.pl_gate.rows_slice(0, n), ws.pl_gated.rows_slice(0, n), branch);
      }
      if (L.scalar != 1.f) be.unary(x, Act::kIdentity, 1.f, L.scalar, x);
    }
    output_logits(be, b, {&final_norm_, hp_.eps, 0.f, &lm_head_, hp_.final_softcap}, hp_.n_layers, x, xn, ws.logits);
  }

 private:
  ModelInfo info_;
  Gemma4Hparams hp_;
  Weight embed_;    // [vocab, hidden]
  Weight lm_head_;  // [vocab, hidden] (the embedding when tied)
  Param final_norm_;  // [hidden] f32
  Gemma4PerLayerInputWeights per_layer_inputs_;
  Param ones_;  // [max head_dim] of 1.0, the weightless v norm
  std::vector<Layer> layers_;
};

}  // namespace

std::unique_ptr<Model> make_gemma4(const HfConfig& config, const Checkpoint& ckpt, Backend& be) {
  return std::make_unique<Gemma4Model>(read_hparams(config), config, ckpt, be);
}

}  // namespace turbospark
