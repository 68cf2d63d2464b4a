// gpt-oss (GptOssForCausalLM): pre-norm decoder whose attention has q/k/v/o biases, one
// learned sink logit per head, a sliding window on the layers layer_types marks
// "sliding_attention" (full causal on the others) and YaRN RoPE; its FFN is a mixture of
// experts with a biased router (softmax over the top-k logits) and biased experts with the
// clamped GLU (blocks/gpt_oss_moe.h).
//
// Experts come as bf16 or MXFP4, under the names transformers uses:
//   bf16:  mlp.experts.gate_up_proj [E, hidden, 2*inter], mlp.experts.down_proj [E, inter, hidden]
//          stored [in, out] (the reference computes x @ W), gate/up columns interleaved
//          (even = gate, odd = up). The kernels read [out, in]: Checkpoint::expert_matrix
//          transposes each expert once at load into memory the checkpoint owns.
//   MXFP4: mlp.experts.{gate_up,down}_proj_{blocks,scales} ([E, out, in/32, 16] and
//          [E, out, in/32] u8, core/quant_grouped.h), already [out, in]: read in place.
//   Either way the interleaved gate/up rows become two views with twice the row stride.
//   Both:  mlp.experts.gate_up_proj_bias [E, 2*inter] (interleaved), down_proj_bias [E, hidden].
//
// Why not DecoderModel: its layers are Qwen-style (unbiased router, SwiGLU experts stored
// [out, in]); the stack here is the same 40 lines of forward built from the same blocks
// (attention_block, rmsnorm, the backend's MoE op), with the gpt-oss router and expert
// layout kept in this file.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <memory>

#include "core/error.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/arena.h"
#include "models/weights.h"
#include "models/blocks/attention.h"
#include "models/blocks/gpt_oss_moe.h"
#include "models/blocks/output.h"
#include "models/blocks/rope.h"
#include "models/model.h"

namespace turbospark {

namespace {

// The GLU constants transformers hard-codes (GptOssExperts.alpha / .limit).
constexpr float kGluAlpha = 1.702f;
constexpr float kGluLimit = 7.0f;

struct GptOssHparams {
  int64_t vocab = 0, hidden = 0, inter = 0, max_context = 0;
  int n_layers = 0, n_heads = 0, n_kv_heads = 0, head_dim = 0, n_experts = 0, top_k = 0;
  int window = 0;
  float rms_eps = 1e-5f;
  bool attention_bias = true, tie_embeddings = false;
  std::vector<bool> sliding;  // per layer
  RopeTable rope;
};

const nlohmann::json* rope_dict(const HfConfig& c, std::string* field) {
  const auto& t = c.text();
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (t.contains(key) && t[key].is_object()) {
      *field = key;
      return &t[key];
    }
  }
  return nullptr;
}

RopeTable read_rope(const HfConfig& c, int head_dim, int64_t max_context) {
  const std::string& path = c.path();
  std::string field;
  const nlohmann::json* rp = rope_dict(c, &field);
  const double theta = c.rope_theta(150000.0);  // GptOssConfig.default_theta
  if (!(theta > 1.0)) fail("{}: field rope_theta must be > 1, got {}", path, theta);
  const std::string type = c.rope_type();
  if (type == "default") return RopeTable{rope_inv_freq_default(theta, head_dim), 1.f};
  if (type != "yarn") fail("{}: field {}.rope_type {} is not supported for gpt_oss (default, yarn)", path, field, type);
  auto number = [&](const char* key, double fallback) -> double {
    if (!rp->contains(key) || (*rp)[key].is_null()) return fallback;
    const auto& v = (*rp)[key];
    if (!v.is_number()) fail("{}: field {}.{} must be a number, got {}", path, field, key, v.dump());
    return v.get<double>();
  };
  if (rp->contains("partial_rotary_factor") && number("partial_rotary_factor", 1.0) != 1.0) {
    fail("{}: field {}.partial_rotary_factor {} is not supported for gpt_oss", path, field,
         (*rp)["partial_rotary_factor"].dump());
  }
  YarnParams y;
  y.theta = theta;
  const double original = number("original_max_position_embeddings", double(max_context));
  if (!(original >= 1)) fail("{}: field {}.original_max_position_embeddings must be positive, got {}", path, field, original);
  y.original_max_positions = int64_t(original);
  y.factor = number("factor", double(max_context) / original);
  if (!(y.factor >= 1.0)) fail("{}: field {}.factor must be >= 1, got {}", path, field, y.factor);
  // The reference reads these with `or`: a 0 falls back to the default too.
  y.beta_fast = number("beta_fast", 0.0);
  y.beta_slow = number("beta_slow", 0.0);
  if (y.beta_fast == 0) y.beta_fast = 32.0;
  if (y.beta_slow == 0) y.beta_slow = 1.0;
  if (!(y.beta_fast > 0 && y.beta_slow > 0)) {
    fail("{}: fields {}.beta_fast {} and beta_slow {} must be positive", path, field, y.beta_fast, y.beta_slow);
  }
  y.attention_factor = number("attention_factor", 0.0);
  if (y.attention_factor < 0) fail("{}: field {}.attention_factor must be positive, got {}", path, field, y.attention_factor);
  y.mscale = number("mscale", 0.0);
  y.mscale_all_dim = number("mscale_all_dim", 0.0);
  if (rp->contains("truncate") && !(*rp)["truncate"].is_null()) {
    if (!(*rp)["truncate"].is_boolean()) fail("{}: field {}.truncate must be a boolean, got {}", path, field, (*rp)["truncate"].dump());
    y.truncate = (*rp)["truncate"].get<bool>();
  }
  return rope_yarn(y, head_dim);
}

GptOssHparams read_hparams(const HfConfig& c) {
  const std::string& path = c.path();
  GptOssHparams hp;
  hp.vocab = c.get_int("vocab_size");
  hp.hidden = c.get_int("hidden_size");
  hp.inter = c.get_int("intermediate_size");
  hp.n_layers = int(c.get_int("num_hidden_layers"));
  hp.n_heads = int(c.get_int("num_attention_heads"));
  hp.n_kv_heads = int(c.get_int("num_key_value_heads", hp.n_heads));
  hp.head_dim = int(c.get_int("head_dim", hp.n_heads ? hp.hidden / hp.n_heads : 0));
  hp.n_experts = int(c.has("num_local_experts") ? c.get_int("num_local_experts") : c.get_int("num_experts"));
  hp.top_k = int(c.has("num_experts_per_tok") ? c.get_int("num_experts_per_tok") : c.get_int("experts_per_token"));
  hp.max_context = c.get_int("max_position_embeddings", 131072);
  hp.rms_eps = float(c.get_float("rms_norm_eps", 1e-5));
  hp.attention_bias = c.get_bool("attention_bias", true);
  hp.tie_embeddings = c.get_bool("tie_word_embeddings", false);
  auto positive = [&](const char* f, int64_t v) {
    if (v <= 0) fail("{}: field {} must be positive, got {}", path, f, v);
  };
  positive("vocab_size", hp.vocab);
  positive("hidden_size", hp.hidden);
  positive("intermediate_size", hp.inter);
  positive("num_hidden_layers", hp.n_layers);
  positive("num_attention_heads", hp.n_heads);
  positive("num_key_value_heads", hp.n_kv_heads);
  positive("head_dim", hp.head_dim);
  positive("num_local_experts", hp.n_experts);
  positive("max_position_embeddings", hp.max_context);
  if (hp.top_k <= 0 || hp.top_k > hp.n_experts) {
    fail("{}: field num_experts_per_tok {} must be in [1, {}]", path, hp.top_k, hp.n_experts);
  }
  if (hp.n_heads % hp.n_kv_heads != 0) {
    fail("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", path, hp.n_heads, hp.n_kv_heads);
  }
  if (hp.head_dim % 2 != 0) fail("{}: field head_dim {} must be even for RoPE", path, hp.head_dim);
  // transformers ignores swiglu_limit and uses 7; a checkpoint asking for another limit
  // would silently differ from the reference, so it is refused by name.
  if (c.has("swiglu_limit") && c.get_float("swiglu_limit") != double(kGluLimit)) {
    fail("{}: field swiglu_limit {} is not supported (only {})", path, c.get_float("swiglu_limit"), kGluLimit);
  }
  const auto& t = c.text();
  std::vector<std::string> types;
  if (t.contains("layer_types") && !t["layer_types"].is_null()) {
    if (!t["layer_types"].is_array()) fail("{}: field layer_types must be a list, got {}", path, t["layer_types"].dump());
    for (const auto& e : t["layer_types"]) {
      if (!e.is_string()) fail("{}: field layer_types has a non-string entry {}", path, e.dump());
      types.push_back(e.get<std::string>());
    }
  } else {  // GptOssConfig's default: sliding on even layers
    for (int i = 0; i < hp.n_layers; ++i) types.push_back((i + 1) % 2 ? "sliding_attention" : "full_attention");
  }
  if (int(types.size()) != hp.n_layers) {
    fail("{}: field layer_types has {} entries for {} layers", path, types.size(), hp.n_layers);
  }
  bool any_sliding = false;
  for (int i = 0; i < hp.n_layers; ++i) {
    const std::string& type = types[size_t(i)];
    if (type != "sliding_attention" && type != "full_attention") {
      fail("{}: field layer_types[{}] = {} is not supported (sliding_attention, full_attention)", path, i, type);
    }
    hp.sliding.push_back(type == "sliding_attention");
    any_sliding |= hp.sliding.back();
  }
  if (any_sliding) {
    const int64_t window = c.get_int("sliding_window");
    if (window <= 0 || window > INT32_MAX) fail("{}: field sliding_window must be positive, got {}", path, window);
    hp.window = int(window);
  }
  if (t.contains("quantization_config") && !t["quantization_config"].is_null()) {
    const auto& q = t["quantization_config"];
    const std::string method = q.is_object() && q.contains("quant_method") && q["quant_method"].is_string()
                                   ? q["quant_method"].get<std::string>()
                                   : std::string("<none>");
    if (method != "mxfp4") {
      fail("{}: field quantization_config.quant_method {} is not supported for gpt_oss (mxfp4)", path, method);
    }
  }
  hp.rope = read_rope(c, hp.head_dim, hp.max_context);
  return hp;
}

// Rows of v with r % 2 == offset: the gate (0) or up (1) half of an interleaved gate_up.
// The two halves share storage and each spans the whole matrix (its bytes() counts the
// matrix once, and the up half ends one row past it): an expert cache must copy the fused
// matrix once per expert, not each half by bytes().
WeightView every_other_row(WeightView v, int offset) {
  v.data = v.row(offset);
  if (v.scales) v.scales = v.scales_row(offset);
  if (v.biases) v.biases = v.biases_row(offset);
  v.rows /= 2;
  v.row_bytes *= 2;
  v.scales_row_bytes *= 2;
  v.biases_row_bytes *= 2;
  return v;
}

class GptOssModel final : public Model {
 public:
  GptOssModel(ModelInfo info, GptOssHparams hp, const Checkpoint& ck, Backend& be);

  const ModelInfo& info() const override { return info_; }
  std::vector<KvLayerSpec> kv_spec() const override {
    return std::vector<KvLayerSpec>(size_t(hp_.n_layers), KvLayerSpec{hp_.n_kv_heads, hp_.head_dim});
  }
  int64_t n_experts() const override { return hp_.n_experts; }
  int experts_per_token() const override { return hp_.top_k; }
  void for_each_routed_expert(const std::function<void(const ExpertWeights&)>& fn) const override {
    for (const Layer& L : layers_)
      for (const ExpertWeights& e : L.moe.experts) fn(e);
  }
  std::unique_ptr<ModelWorkspace> new_workspace(Backend& backend, int64_t max_rows) const override;
  void forward(Backend& backend, const ForwardBatch& batch) const override;

 private:
  struct Layer {
    Param attn_norm, ffn_norm;  // [hidden] f32
    AttentionParams attn_params;
    AttentionWeights attn;
    GptOssMoeWeights moe;
  };

  void load_experts(const WeightLoader& ld, const std::string& p, int layer, GptOssMoeWeights& moe);

  ModelInfo info_;
  GptOssHparams hp_;
  Weight embed_;    // [vocab, hidden]
  Weight lm_head_;  // [vocab, hidden] (the embedding when tied)
  Param final_norm_;  // [hidden] f32
  std::vector<Layer> layers_;
  int64_t expert_bytes_ = 0;  // one expert's gate_up + down, as stored (or transposed)
};

void GptOssModel::load_experts(const WeightLoader& ld, const std::string& p, int layer, GptOssMoeWeights& moe) {
  const Checkpoint& ck = ld.ck;
  const int64_t E = hp_.n_experts, H = hp_.hidden, I = hp_.inter;
  const std::string gate_up = p + "mlp.experts.gate_up_proj", down = p + "mlp.experts.down_proj";
  // Biases: [E, 2I] interleaved like the gate_up outputs, [E, H].
  std::vector<float> gu_bias = ck.floats(gate_up + "_bias", {E, 2 * I});
  std::vector<float> gate_bias(size_t(E * I)), up_bias(size_t(E * I));
  for (int64_t k = 0; k < E * I; ++k) {
    gate_bias[size_t(k)] = gu_bias[size_t(2 * k)];
    up_bias[size_t(k)] = gu_bias[size_t(2 * k + 1)];
  }
  moe.gate_bias = ld.param(gate_bias);
  moe.up_bias = ld.param(up_bias);
  moe.down_bias = ld.floats(down + "_bias", {E, H});
  moe.experts.resize(size_t(E));
  for (int64_t e = 0; e < E; ++e) {
    ExpertWeights& ew = moe.experts[size_t(e)];
    // [out, in] whatever the storage: MXFP4 planes in place, bf16 [in, out] transposed once
    // by the checkpoint.
    // The fused matrix is made resident once; gate and up are its even and odd rows.
    const WeightView gu = ld.expert_view(ck.expert_matrix(gate_up, e, E, 2 * I, H, StackLayout::kInOut), gate_up);
    ew.gate.view = every_other_row(gu, 0);
    ew.up.view = every_other_row(gu, 1);
    ew.gate_up_interleaved = true;
    ew.down.view = ld.expert_view(ck.expert_matrix(down, e, E, H, I, StackLayout::kInOut), down);
    if (e == 0) expert_bytes_ = gu.bytes() + ew.down.view.bytes();
    ew.gate.name = ew.up.name = gate_up;
    ew.down.name = down;
    for (Weight* w : {&ew.gate, &ew.up, &ew.down}) {
      w->layer = layer;
      w->expert = int(e);
      w->residency = Residency::kStreamedExpert;
    }
    ew.gate_bias = moe.gate_bias.data() + e * I;
    ew.up_bias = moe.up_bias.data() + e * I;
    ew.down_bias = moe.down_bias.data() + e * H;
    ew.glu_alpha = kGluAlpha;
    ew.glu_limit = kGluLimit;
  }
}

GptOssModel::GptOssModel(ModelInfo info, GptOssHparams hp, const Checkpoint& ck, Backend& be)
    : info_(std::move(info)), hp_(std::move(hp)) {
  const WeightLoader ld{ck, be};
  const int64_t H = hp_.hidden, E = hp_.n_experts;
  embed_ = ld.matrix("model.embed_tokens.weight", hp_.vocab, H, -1);
  lm_head_ = hp_.tie_embeddings ? embed_ : ld.matrix("lm_head.weight", hp_.vocab, H, -1);
  final_norm_ = ld.floats("model.norm.weight", {H});
  const Param inv_freq = ld.param(hp_.rope.inv_freq);
  const int64_t qw = int64_t(hp_.n_heads) * hp_.head_dim, kvw = int64_t(hp_.n_kv_heads) * hp_.head_dim;
  int64_t bytes = embed_.view.bytes() + (hp_.tie_embeddings ? 0 : lm_head_.view.bytes());
  int64_t active = lm_head_.view.bytes();  // a decode token reads one embedding row, the whole head
  layers_.resize(size_t(hp_.n_layers));
  for (int i = 0; i < hp_.n_layers; ++i) {
    Layer& L = layers_[size_t(i)];
    const std::string p = fmt::format("model.layers.{}.", i);
    L.attn_norm = ld.floats(p + "input_layernorm.weight", {H});
    L.ffn_norm = ld.floats(p + "post_attention_layernorm.weight", {H});
    AttentionParams& ap = L.attn_params;
    ap.n_heads = hp_.n_heads;
    ap.n_kv_heads = hp_.n_kv_heads;
    ap.head_dim = hp_.head_dim;
    ap.rotary_dim = hp_.head_dim;
    ap.scale = 1.0f / std::sqrt(float(hp_.head_dim));
    ap.window = hp_.sliding[size_t(i)] ? hp_.window : 0;
    ap.norm_eps = hp_.rms_eps;
    ap.inv_freq = inv_freq;
    ap.attention_factor = hp_.rope.attention_factor;
    AttentionWeights& aw = L.attn;
    const std::string a = p + "self_attn.";
    aw.q = ld.matrix(a + "q_proj.weight", qw, H, i);
    aw.k = ld.matrix(a + "k_proj.weight", kvw, H, i);
    aw.v = ld.matrix(a + "v_proj.weight", kvw, H, i);
    aw.o = ld.matrix(a + "o_proj.weight", H, qw, i);
    if (hp_.attention_bias) {
      aw.q_bias = ld.floats(a + "q_proj.bias", {qw});
      aw.k_bias = ld.floats(a + "k_proj.bias", {kvw});
      aw.v_bias = ld.floats(a + "v_proj.bias", {kvw});
      aw.o_bias = ld.floats(a + "o_proj.bias", {H});
    }
    aw.sinks = ld.floats(a + "sinks", {hp_.n_heads});
    int64_t layer_bytes = aw.q.view.bytes() + aw.k.view.bytes() + aw.v.view.bytes() + aw.o.view.bytes();
    GptOssMoeWeights& moe = L.moe;
    moe.router = ld.matrix(p + "mlp.router.weight", E, H, i);
    moe.router_bias = ld.floats(p + "mlp.router.bias", {E});
    moe.top_k = hp_.top_k;
    load_experts(ld, p, i, moe);
    const int64_t expert_bytes = expert_bytes_;
    layer_bytes += moe.router.view.bytes();
    bytes += layer_bytes + E * expert_bytes;
    info_.expert_bytes = expert_bytes;
    info_.routed_weight_bytes += E * expert_bytes;
    active += layer_bytes + hp_.top_k * expert_bytes;
  }
  info_.vocab_size = hp_.vocab;
  info_.hidden_size = H;
  info_.n_layers = hp_.n_layers;
  info_.max_context = hp_.max_context;
  info_.weight_bytes = bytes;
  info_.active_weight_bytes = active;
  info_.n_params = ck.n_parameters();  // MXFP4 bytes hold two, their scales none
}

struct GptOssWorkspace : ModelWorkspace {
  std::shared_ptr<float> storage;
  int64_t capacity = 0;
  Mat x, xn, branch, logits;  // [rows, hidden] x3, [rows, vocab]
  AttentionScratch attn;
  FfnScratch ffn;             // router logits and top-k only (experts run inside the backend op)
};

std::unique_ptr<ModelWorkspace> GptOssModel::new_workspace(Backend& be, int64_t max_rows) const {
  auto ws = std::make_unique<GptOssWorkspace>();
  const int64_t H = hp_.hidden, R = max_rows;
  const int64_t qw = int64_t(hp_.n_heads) * hp_.head_dim, kvw = int64_t(hp_.n_kv_heads) * hp_.head_dim;
  ws->storage = allocate_mats(be, R, {{&ws->x, H}, {&ws->xn, H}, {&ws->branch, H}, {&ws->logits, hp_.vocab},
                                      {&ws->attn.q, qw}, {&ws->attn.k, kvw}, {&ws->attn.v, kvw}, {&ws->attn.attn, qw},
                                      {&ws->ffn.router_logits, hp_.n_experts}});
  ws->ffn.allocate_routing(be, R, hp_.top_k);
  ws->capacity = R;
  return ws;
}

void GptOssModel::forward(Backend& be, const ForwardBatch& b) const {
  auto& ws = *static_cast<GptOssWorkspace*>(b.workspace);
  b.check(ws.capacity, hp_.n_layers);
  const int64_t n = b.n;
  Mat x = ws.x.rows_slice(0, n), xn = ws.xn.rows_slice(0, n), branch = ws.branch.rows_slice(0, n);
  auto trace = [&](const char* name, int layer, const Mat& m) { b.emit(name, layer, m); };
  be.embedding(embed_, b.tokens, n, 1.f, x);
  trace("embedding", -1, x);
  // Each residual add is fused with the norm that reads its sum (add_rmsnorm), as the shared
  // decoder does: the first layer's attention norm stands alone.
  be.rmsnorm(x, layers_[0].attn_norm.data(), hp_.rms_eps, xn);
  for (int i = 0; i < hp_.n_layers; ++i) {
    const Layer& L = layers_[size_t(i)];
    trace("layer_in", i, x);
    attention_block(be, L.attn_params, L.attn, xn, b.positions, b.kv[size_t(i)], ws.attn, branch);
    trace("attention", i, branch);
    be.add_rmsnorm(x, branch, L.ffn_norm.data(), hp_.rms_eps, xn);
    float* probs = b.router_probs ? b.router_probs + int64_t(i) * n * hp_.n_experts : nullptr;
    gpt_oss_moe(be, L.moe, xn, ws.ffn, branch, probs);
    trace("moe", i, branch);
    if (i + 1 < hp_.n_layers) {
      be.add_rmsnorm(x, branch, layers_[size_t(i) + 1].attn_norm.data(), hp_.rms_eps, xn);
    } else {
      be.add(x, branch);
    }
  }
  output_logits(be, b, {&final_norm_, hp_.rms_eps, 0.f, &lm_head_, 0.f}, hp_.n_layers, x, xn, ws.logits);
}

}  // namespace

std::unique_ptr<Model> make_gpt_oss(const HfConfig& config, const Checkpoint& ckpt, Backend& be) {
  GptOssHparams hp = read_hparams(config);
  ModelInfo info;
  info.architecture = "GptOssForCausalLM";
  info.family = "gpt_oss";
  for (int64_t id : config.get_id_list("eos_token_id")) info.eos_ids.push_back(int32_t(id));
  return std::make_unique<GptOssModel>(std::move(info), std::move(hp), ckpt, be);
}

}  // namespace turbospark
