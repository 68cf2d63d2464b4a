#include "models/decoder.h"

#include <fmt/format.h>

#include <cmath>

#include "core/error.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/arena.h"
#include "models/blocks/output.h"
#include "models/blocks/rope.h"
#include "models/weights.h"

namespace turbospark {

DecoderHparams read_common_hparams(const HfConfig& c) {
  DecoderHparams hp;
  hp.vocab_size = c.get_int("vocab_size");
  hp.hidden = c.get_int("hidden_size");
  hp.intermediate = c.get_int("intermediate_size");
  hp.n_layers = int(c.get_int("num_hidden_layers"));
  hp.n_heads = int(c.get_int("num_attention_heads"));
  hp.n_kv_heads = int(c.get_int("num_key_value_heads", hp.n_heads));
  hp.head_dim = int(c.get_int("head_dim", hp.n_heads ? hp.hidden / hp.n_heads : 0));
  hp.rotary_dim = hp.head_dim;
  hp.rope_theta = c.rope_theta(10000.0);
  hp.rms_eps = float(c.get_float("rms_norm_eps", 1e-6));
  hp.tie_embeddings = c.get_bool("tie_word_embeddings", false);
  hp.attention_bias = c.get_bool("attention_bias", false);
  hp.max_context = c.get_int("max_position_embeddings", 4096);
  auto positive = [&](const char* field, int64_t v) {
    if (v <= 0) fail("{}: field {} must be positive, got {}", c.path(), field, v);
  };
  positive("vocab_size", hp.vocab_size);
  positive("hidden_size", hp.hidden);
  positive("num_hidden_layers", hp.n_layers);
  positive("num_attention_heads", hp.n_heads);
  positive("num_key_value_heads", hp.n_kv_heads);
  positive("head_dim", hp.head_dim);
  positive("max_position_embeddings", hp.max_context);
  if (hp.n_heads % hp.n_kv_heads != 0) {
    fail("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", c.path(), hp.n_heads, hp.n_kv_heads);
  }
  if (hp.head_dim % 2 != 0) fail("{}: head_dim {} must be even for RoPE", c.path(), hp.head_dim);
  const std::string rope = c.rope_type();
  if (rope != "default") fail("{}: rope_type {} is not supported for this family yet", c.path(), rope);
  if (c.has("attention_bias") && c.get_bool("attention_bias", false)) hp.attention_bias = true;
  if (c.get_bool("use_sliding_window", false)) fail("{}: use_sliding_window=true is not supported for this family yet", c.path());
  const std::string act = c.get_string("hidden_act", "silu");
  if (act != "silu") fail("{}: hidden_act {} is not supported (only silu)", c.path(), act);
  hp.layers.assign(size_t(hp.n_layers), LayerConfig{});
  return hp;
}

static std::string layer_prefix(const TensorNames& n, int i) { return fmt::format(fmt::runtime(n.layer), i); }

DecoderModel::DecoderModel(ModelInfo info, DecoderHparams hp, const TensorNames& names, const Checkpoint& ck,
                           Backend& be)
    : info_(std::move(info)), hp_(std::move(hp)) {
  const WeightLoader ld{ck, be};
  const int64_t H = hp_.hidden;
  embed_ = ld.matrix(names.embed, hp_.vocab_size, H, -1);
  if (hp_.tie_embeddings) {
    lm_head_ = embed_;
  } else {
    lm_head_ = ld.matrix(names.lm_head, hp_.vocab_size, H, -1);
  }
  final_norm_ = ld.floats(names.final_norm, {H});
  const int64_t q_width = int64_t(hp_.n_heads) * hp_.head_dim, kv_width = int64_t(hp_.n_kv_heads) * hp_.head_dim;
  int64_t bytes = embed_.view.bytes() + (hp_.tie_embeddings ? 0 : lm_head_.view.bytes());
  // A decode token reads one embedding row but the whole LM head.
  int64_t active = lm_head_.view.bytes();
  layers_.resize(size_t(hp_.n_layers));
  for (int i = 0; i < hp_.n_layers; ++i) {
    Layer& L = layers_[size_t(i)];
    const std::string p = layer_prefix(names, i);
    L.attn_norm = ld.floats(p + names.attn_norm, {H});
    L.ffn_norm = ld.floats(p + names.ffn_norm, {H});
    if (hp_.sandwich_norms) {
      L.post_attn_norm = ld.floats(p + names.post_attn_norm, {H});
      L.post_ffn_norm = ld.floats(p + names.post_ffn_norm, {H});
    }
    const LayerConfig& lc = hp_.layers[size_t(i)];
    AttentionParams& ap = L.attn_params;
    ap.n_heads = hp_.n_heads;
    ap.n_kv_heads = hp_.n_kv_heads;
    ap.head_dim = hp_.head_dim;
    ap.rotary_dim = hp_.rotary_dim;
    ap.scale = hp_.attn_scale > 0 ? hp_.attn_scale : 1.0f / std::sqrt(float(hp_.head_dim));
    ap.window = lc.window;
    ap.norm_eps = hp_.rms_eps;
    ap.norm_offset = hp_.norm_offset;
    std::vector<float> inv_freq = rope_inv_freq_default(lc.rope_theta > 0 ? lc.rope_theta : hp_.rope_theta, hp_.rotary_dim);
    for (float& f : inv_freq) f = float(f / lc.rope_linear);
    ap.inv_freq = ld.param(inv_freq);
    AttentionWeights& aw = L.attn;
    aw.q = ld.matrix(p + names.q + ".weight", q_width, H, i);
    aw.k = ld.matrix(p + names.k + ".weight", kv_width, H, i);
    aw.v = ld.matrix(p + names.v + ".weight", kv_width, H, i);
    aw.o = ld.matrix(p + names.o + ".weight", H, q_width, i);
    if (hp_.attention_bias) {
      aw.q_bias = ld.floats(p + names.q + ".bias", {q_width});
      aw.k_bias = ld.floats(p + names.k + ".bias", {kv_width});
      aw.v_bias = ld.floats(p + names.v + ".bias", {kv_width});
      if (ck.has(p + names.o + ".bias")) aw.o_bias = ld.floats(p + names.o + ".bias", {H});
    }
    if (hp_.qk_norm) {
      aw.q_norm = ld.floats(p + names.q_norm, {hp_.head_dim});
      aw.k_norm = ld.floats(p + names.k_norm, {hp_.head_dim});
    }
    int64_t layer_bytes = aw.q.view.bytes() + aw.k.view.bytes() + aw.v.view.bytes() + aw.o.view.bytes();
    int64_t layer_active = layer_bytes;
    L.ffn = hp_.layers[size_t(i)].ffn;
    if (L.ffn == FfnKind::kDense) {
      const int64_t I = hp_.intermediate;
      L.mlp.gate = ld.matrix(p + names.gate, I, H, i);
      L.mlp.up = ld.matrix(p + names.up, I, H, i);
      L.mlp.down = ld.matrix(p + names.down, H, I, i);
      L.mlp.act = hp_.ffn_act;
      layer_bytes += 3 * L.mlp.gate.view.bytes();
      layer_active += 3 * L.mlp.gate.view.bytes();
    } else {
      const int64_t I = hp_.moe_intermediate, E = hp_.n_experts;
      L.moe.router = ld.matrix(p + names.router, E, H, i);
      L.moe.top_k = hp_.top_k;
      L.moe.renormalize = hp_.norm_topk_prob;
      const bool fused = ck.has(p + names.fused_gate_up);
      const bool stacked = ck.has(p + names.stacked_gate);
      for (int e = 0; e < E; ++e) {
        ExpertWeights ew;
        if (stacked) {
          // Separate [E, inter, hidden] gate and up stacks and an [E, hidden, inter] down stack
          // (GGUF's *_exps tensors): each expert a contiguous slice of each.
          ew.gate = ld.expert_in_stack(p + names.stacked_gate, e, E, I, H, i);
          ew.up = ld.expert_in_stack(p + names.stacked_up, e, E, I, H, i);
          ew.down = ld.expert_in_stack(p + names.stacked_down, e, E, H, I, i);
        } else if (fused) {
          const std::string& gu_name = p + names.fused_gate_up;
          const WeightView gate_up = ld.expert_view(ck.matrix_in_stack(gu_name, e, E, 2 * I, H), gu_name);
          ew.gate.view = gate_up.rows_slice(0, I);  // gate rows first, then up rows
          ew.up.view = gate_up.rows_slice(I, I);
          ew.down.view = ld.expert_view(ck.matrix_in_stack(p + names.fused_down, e, E, H, I), p + names.fused_down);
          ew.gate.name = ew.up.name = p + names.fused_gate_up;
          ew.down.name = p + names.fused_down;
        } else {
          const std::string ep = p + fmt::format(fmt::runtime(names.expert), e);
          ew.gate = ld.expert_matrix(ep + "gate_proj.weight", I, H, i);
          ew.up = ld.expert_matrix(ep + "up_proj.weight", I, H, i);
          ew.down = ld.expert_matrix(ep + "down_proj.weight", H, I, i);
        }
        for (Weight* w : {&ew.gate, &ew.up, &ew.down}) {
          w->layer = i;
          w->expert = e;
          w->residency = Residency::kStreamedExpert;
        }
        L.moe.experts.push_back(std::move(ew));
      }
      const int64_t expert_bytes = 3 * L.moe.experts[0].gate.view.bytes();
      layer_bytes += L.moe.router.view.bytes() + E * expert_bytes;
      info_.expert_bytes = expert_bytes;
      info_.routed_weight_bytes += E * expert_bytes;
      layer_active += L.moe.router.view.bytes() + hp_.top_k * expert_bytes;
    }
    bytes += layer_bytes;
    active += layer_active;
  }
  info_.vocab_size = hp_.vocab_size;
  info_.hidden_size = H;
  info_.n_layers = hp_.n_layers;
  info_.max_context = hp_.max_context;
  info_.weight_bytes = bytes;
  info_.active_weight_bytes = active;
  info_.n_params = ck.n_parameters();
}

std::vector<KvLayerSpec> DecoderModel::kv_spec() const {
  return std::vector<KvLayerSpec>(size_t(hp_.n_layers), KvLayerSpec{hp_.n_kv_heads, hp_.head_dim});
}

namespace {

struct DecoderWorkspace : ModelWorkspace {
  std::shared_ptr<float> storage;
  int64_t capacity = 0;
  Mat x, xn, branch, logits;  // [rows, hidden] x3, [rows, vocab]
  AttentionScratch attn;
  FfnScratch ffn;
};

}  // namespace

std::unique_ptr<ModelWorkspace> DecoderModel::new_workspace(Backend& be, int64_t max_rows) const {
  auto ws = std::make_unique<DecoderWorkspace>();
  const int64_t H = hp_.hidden, R = max_rows;
  const int64_t qw = int64_t(hp_.n_heads) * hp_.head_dim, kvw = int64_t(hp_.n_kv_heads) * hp_.head_dim;
  const int64_t inter = std::max(hp_.intermediate, hp_.moe_intermediate);
  const int64_t E = std::max(hp_.n_experts, 1);
  ws->storage = allocate_mats(be, R, {{&ws->x, H}, {&ws->xn, H}, {&ws->branch, H}, {&ws->logits, hp_.vocab_size},
                                      {&ws->attn.q, qw}, {&ws->attn.k, kvw}, {&ws->attn.v, kvw}, {&ws->attn.attn, qw},
                                      {&ws->ffn.gate, inter}, {&ws->ffn.up, inter}, {&ws->ffn.router_logits, E}});
  if (hp_.n_experts > 0) ws->ffn.allocate_routing(be, R, hp_.top_k);
  ws->capacity = R;
  return ws;
}

void DecoderModel::forward(Backend& be, const ForwardBatch& b) const {
  auto& ws = *static_cast<DecoderWorkspace*>(b.workspace);
  b.check(ws.capacity, hp_.n_layers);
  const int64_t n = b.n;
  Mat x = ws.x.rows_slice(0, n), xn = ws.xn.rows_slice(0, n), branch = ws.branch.rows_slice(0, n);
  auto trace = [&](const char* name, int layer, const Mat& m) { b.emit(name, layer, m); };
  be.embedding(embed_, b.tokens, n, hp_.embed_scale, x);
  trace("embedding", -1, x);
  // Each residual add is fused with the norm that reads its sum (add_rmsnorm): the first
  // layer's attention norm stands alone, every later one follows the previous layer's add.
  be.rmsnorm(x, layers_[0].attn_norm.data(), hp_.rms_eps, xn, hp_.norm_offset);
  for (int i = 0; i < hp_.n_layers; ++i) {
    const Layer& L = layers_[size_t(i)];
    trace("layer_in", i, x);
    attention_block(be, L.attn_params, L.attn, xn, b.positions, b.kv[size_t(i)], ws.attn, branch);
    if (hp_.sandwich_norms) be.rmsnorm(branch, L.post_attn_norm.data(), hp_.rms_eps, branch, hp_.norm_offset);
    trace("attention", i, branch);
    be.add_rmsnorm(x, branch, L.ffn_norm.data(), hp_.rms_eps, xn, hp_.norm_offset);
    if (L.ffn == FfnKind::kDense) {
      dense_mlp(be, L.mlp, xn, ws.ffn, branch);
    } else {
      float* probs = b.router_probs ? b.router_probs + int64_t(i) * n * hp_.n_experts : nullptr;
      const MoeWeights* next = nullptr;  // the next MoE layer (expert streaming's guess)
      for (int j = i + 1; j < hp_.n_layers && !next; ++j)
        if (layers_[size_t(j)].ffn != FfnKind::kDense) next = &layers_[size_t(j)].moe;
      moe_ffn(be, L.moe, xn, ws.ffn, branch, probs, next);
    }
    if (hp_.sandwich_norms) be.rmsnorm(branch, L.post_ffn_norm.data(), hp_.rms_eps, branch, hp_.norm_offset);
    trace(L.ffn == FfnKind::kDense ? "mlp" : "moe", i, branch);
    if (i + 1 < hp_.n_layers) {
      be.add_rmsnorm(x, branch, layers_[size_t(i) + 1].attn_norm.data(), hp_.rms_eps, xn, hp_.norm_offset);
    } else {
      be.add(x, branch);
    }
  }
  output_logits(be, b, {&final_norm_, hp_.rms_eps, hp_.norm_offset, &lm_head_, hp_.final_softcap}, hp_.n_layers, x, xn,
                ws.logits);
}

}  // namespace turbospark
