// Qwen4-Exp text model (Qwen4ExpForCausalLM, and the text part of
// Qwen4ExpForConditionalGeneration): hyper-connection residual streams, GatedDeltaNet
// linear-attention layers, gated full attention with QSA sparse selection, n-gram PLE on
// some linear layers, and a top-k MoE with a gated shared expert in every layer.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

#include "core/error.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/blocks/ffn.h"
#include "models/blocks/gated_delta_net.h"
#include "models/blocks/hyper_connection.h"
#include "models/blocks/ple.h"
#include "models/blocks/qsa_attention.h"
#include "models/arena.h"
#include "models/blocks/output.h"
#include "models/weights.h"
#include "models/blocks/rope.h"
#include "models/model.h"

namespace turbospark {
namespace {

enum class MixerKind : uint8_t { kLinear, kSparseAttention };

struct LayerSpec {
  MixerKind mixer = MixerKind::kLinear;
  int ple_index = -1;  // index among PLE layers, -1 when the layer has none
};

struct Hparams {
  int64_t vocab = 0, hidden = 0, max_context = 0;
  int n_layers = 0, n_streams = 0;
  int64_t hc_rank = 0;
  float eps = 1e-6f;
  AttentionParams attn;
  std::vector<float> inv_freq;  // [rotary_dim / 2] host copy of attn.inv_freq
  QsaParams qsa;
  GatedDeltaNetParams gdn;
  int n_experts = 0, top_k = 0;
  int64_t moe_inter = 0, shared_inter = 0;
  bool norm_topk = true;
  int32_t eos = -1;
  std::vector<LayerSpec> layers;
  // PLE
  int64_t ple_dim = 0;
  int ple_kernel = 0;
  NgramHashSpec ngram;  // ple_index filled per layer
  // Hashing constants the checkpoint states instead of deriving them (GGUF files: one PLE
  // layer); padded_rows is then the table's own row count.
  std::optional<NgramHash> given_hash;
};

Hparams read_hparams(const HfConfig& c) {
  Hparams hp;
  const std::string& path = c.path();
  hp.vocab = c.get_int("vocab_size");
  hp.hidden = c.get_int("hidden_size");
  hp.n_layers = int(c.get_int("num_hidden_layers"));
  hp.max_context = c.get_int("max_position_embeddings", 32768);
  hp.eps = float(c.get_float("rms_norm_eps", 1e-6));
  hp.n_streams = int(c.get_int("hc_count", 4));
  hp.hc_rank = c.get_int("hc_lowrank", 320);
  if (hp.n_streams <= 1) fail("{}: field hc_count must be > 1, got {}", path, hp.n_streams);
  if (hp.hc_rank <= 0) fail("{}: field hc_lowrank must be positive, got {}", path, hp.hc_rank);
  const std::string act = c.get_string("hidden_act", "silu");
  if (act != "silu") fail("{}: field hidden_act {} is not supported (only silu)", path, act);
  const std::string gate = c.get_string("output_gate_type", act);
  if (gate == "silu") {
    hp.gdn.gate_act = Act::kSilu;
  } else if (gate == "sigmoid") {
    hp.gdn.gate_act = Act::kSigmoid;
  } else {
    fail("{}: field output_gate_type {} is not supported (sigmoid or silu)", path, gate);
  }
  if (c.get_bool("attention_bias", false)) fail("{}: field attention_bias=true is not supported", path);
  if (c.get_bool("tie_word_embeddings", false)) fail("{}: field tie_word_embeddings=true is not supported", path);

  // Attention geometry and RoPE (text positions: the three mRoPE sections coincide).
  AttentionParams& a = hp.attn;
  a.n_heads = int(c.get_int("num_attention_heads"));
  a.n_kv_heads = int(c.get_int("num_key_value_heads"));
  a.head_dim = int(c.get_int("head_dim", 256));
  if (a.n_heads <= 0 || a.n_kv_heads <= 0 || a.n_heads % a.n_kv_heads) {
    fail("{}: num_attention_heads {} must be a positive multiple of num_key_value_heads {}", path, a.n_heads, a.n_kv_heads);
  }
  double partial = 1.0;
  const auto& text = c.text();
  if (text.contains("rope_parameters") && text["rope_parameters"].is_object() &&
      text["rope_parameters"].contains("partial_rotary_factor")) {
    partial = text["rope_parameters"]["partial_rotary_factor"].get<double>();
  } else if (c.has("partial_rotary_factor")) {
    partial = c.get_float("partial_rotary_factor");
  }
  a.rotary_dim = int(a.head_dim * partial);
  if (a.rotary_dim <= 0 || a.rotary_dim % 2 || a.rotary_dim > a.head_dim) {
    fail("{}: partial_rotary_factor {} gives rotary dim {} for head_dim {}", path, partial, a.rotary_dim, a.head_dim);
  }
  if (c.rope_type() != "default") fail("{}: rope_type {} is not supported for qwen4_exp", path, c.rope_type());
  a.scale = 1.f / std::sqrt(float(a.head_dim));
  a.norm_eps = hp.eps;
  hp.inv_freq = rope_inv_freq_default(c.rope_theta(10000.0), a.rotary_dim);  // uploaded into attn at load

  // Layer types: a QSA layer is "qwen_sparse_attention" (transformers 5.17), "indexed_attention"
  // (what later transformers save) or "full_attention" (the released checkpoints' name).
  std::vector<std::string> types;
  if (text.contains("layer_types") && text["layer_types"].is_array()) {
    for (const auto& t : text["layer_types"]) types.push_back(t.get<std::string>());
  } else {
    const int64_t interval = c.get_int("full_attention_interval", 4);
    for (int i = 0; i < hp.n_layers; ++i) types.push_back((i + 1) % interval ? "linear_attention" : "qwen_sparse_attention");
  }
  if (int(types.size()) != hp.n_layers) {
    fail("{}: field layer_types has {} entries for {} layers", path, types.size(), hp.n_layers);
  }
  hp.layers.resize(size_t(hp.n_layers));
  bool any_sparse = false;
  for (int i = 0; i < hp.n_layers; ++i) {
    const std::string& t = types[size_t(i)];
    if (t == "linear_attention") {
      hp.layers[size_t(i)].mixer = MixerKind::kLinear;
    } else if (t == "qwen_sparse_attention" || t == "indexed_attention" || t == "full_attention") {
      hp.layers[size_t(i)].mixer = MixerKind::kSparseAttention;
      any_sparse = true;
    } else {
      fail("{}: field layer_types[{}] = {} is not supported", path, i, t);
    }
  }

  // QSA: all five fields or none.
  const char* qsa_fields[] = {"indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget",
                              "indexer_compress_ratio"};
  int n_present = 0;
  for (const char* f : qsa_fields) n_present += c.has(f);
  if (n_present != 0 && n_present != 5) {
    std::string names;
    for (const char* f : qsa_fields) {
      if (!c.has(f)) names += (names.empty() ? "" : ", ") + std::string(f);
    }
    fail("{}: QSA config is partly set: missing {}", path, names);
  }
  if (any_sparse && n_present == 0) fail("{}: qwen_sparse_attention layers need the indexer_* (QSA) fields", path);
  if (n_present == 5) {
    hp.qsa.n_heads = int(c.get_int("indexer_n_heads"));
    hp.qsa.head_dim = int(c.get_int("indexer_head_dim"));
    hp.qsa.budget = int(c.get_int("indexer_budget"));
    hp.qsa.ratio = int(c.get_int("indexer_compress_ratio"));
    const int64_t kv_heads = c.get_int("indexer_kv_heads");
    for (const char* f : qsa_fields) {
      if (c.get_int(f) <= 0) fail("{}: field {} must be positive, got {}", path, f, c.get_int(f));
    }
    if (kv_heads != 1) fail("{}: field indexer_kv_heads must be 1, got {}", path, kv_heads);
    if (hp.qsa.budget % hp.qsa.ratio) {
      fail("{}: field indexer_budget {} must be divisible by indexer_compress_ratio {}", path, hp.qsa.budget, hp.qsa.ratio);
    }
    if (a.rotary_dim > hp.qsa.head_dim) {
      fail("{}: field indexer_head_dim {} is smaller than the rotary dim {}", path, hp.qsa.head_dim, a.rotary_dim);
    }
  }

  // GatedDeltaNet.
  GatedDeltaNetParams& g = hp.gdn;
  g.n_k_heads = int(c.get_int("linear_num_key_heads", 16));
  g.n_v_heads = int(c.get_int("linear_num_value_heads", 32));
  g.dk = int(c.get_int("linear_key_head_dim", 128));
  g.dv = int(c.get_int("linear_value_head_dim", 128));
  g.conv_kernel = int(c.get_int("linear_conv_kernel_dim", 4));
  g.eps = hp.eps;
  if (g.n_k_heads <= 0 || g.n_v_heads % g.n_k_heads) {
    fail("{}: linear_num_value_heads {} must be a multiple of linear_num_key_heads {}", path, g.n_v_heads, g.n_k_heads);
  }
  // Not a transformers field: set by the GGUF mapping (formats/gguf_model.cpp) for files whose
  // value heads llama.cpp's converter reordered.
  g.v_heads_tiled = c.get_bool("linear_value_heads_tiled", false);

  // MoE.
  hp.n_experts = int(c.has("num_local_experts") ? c.get_int("num_local_experts") : c.get_int("num_experts"));
  hp.top_k = int(c.get_int("num_experts_per_tok"));
  hp.moe_inter = c.get_int("moe_intermediate_size");
  hp.shared_inter = c.get_int("shared_expert_intermediate_size");
  hp.norm_topk = c.get_bool("norm_topk_prob", true);
  if (hp.n_experts <= 0) fail("{}: field num_experts must be positive", path);
  if (hp.top_k <= 0 || hp.top_k > hp.n_experts) {
    fail("{}: field num_experts_per_tok {} must be in [1, {}]", path, hp.top_k, hp.n_experts);
  }

  // PLE.
  const auto eos = c.get_id_list("eos_token_id");
  if (!eos.empty()) hp.eos = int32_t(eos[0]);
  const auto ple_ids = c.get_int_list("ple_layer_ids");
  std::vector<int64_t> sorted_ids(ple_ids);
  std::sort(sorted_ids.begin(), sorted_ids.end());
  sorted_ids.erase(std::unique(sorted_ids.begin(), sorted_ids.end()), sorted_ids.end());
  if (!sorted_ids.empty()) {
    hp.ple_dim = c.get_int("ple_embed_dim", hp.hidden);
    hp.ple_kernel = int(c.get_int("ple_conv_kernel_size", 4));
    NgramHashSpec& s = hp.ngram;
    s.ngram_size = int(c.get_int("ngram_size", 3));
    s.heads_per_ngram = int(c.get_int("heads_per_ngram", 8));
    s.vocab_size = hp.vocab;
    s.base = c.get_int("ngram_vocab_size_base", 20000000);
    s.divisor = c.get_int("make_ngram_vocab_size_divisible_by", 128);
    s.seed = c.get_int("seed", 1234);
    if (s.n_heads() <= 0 || hp.ple_dim <= 0 || hp.ple_dim % s.n_heads()) {
      fail("{}: field ple_embed_dim {} must be a positive multiple of the {} n-gram heads", path, hp.ple_dim, s.n_heads());
    }
    if (eos.empty()) fail("{}: field eos_token_id must be set when ple_layer_ids is", path);
    s.eos = hp.eos;
    for (size_t k = 0; k < sorted_ids.size(); ++k) {
      const int64_t id = sorted_ids[k];
      if (id < 1 || id > hp.n_layers) fail("{}: field ple_layer_ids has {} outside [1, {}]", path, id, hp.n_layers);
      if (hp.layers[size_t(id - 1)].mixer != MixerKind::kLinear) {
        fail("{}: field ple_layer_ids names layer {}, which is not a linear_attention layer", path, id);
      }
      hp.layers[size_t(id - 1)].ple_index = int(k);
    }
    // Not a transformers field: the constants a GGUF file states (formats/gguf_model.cpp).
    if (text.contains("ple_hash_constants")) {
      const auto& j = text["ple_hash_constants"];
      if (sorted_ids.size() != 1) fail("{}: field ple_hash_constants holds one PLE layer's constants, not {}", path, sorted_ids.size());
      NgramHash h;
      try {
        h.multipliers = j.at("layer_multipliers").get<std::vector<uint64_t>>();
        h.head_sizes = j.at("head_vocab_sizes").get<std::vector<int64_t>>();
        h.head_offsets = j.at("head_offsets").get<std::vector<int64_t>>();
      } catch (const nlohmann::json::exception& e) {
        fail("{}: field ple_hash_constants: {}", path, e.what());
      }
      if (int(h.multipliers.size()) < s.ngram_size || int(h.head_sizes.size()) < s.n_heads() ||
          int(h.head_offsets.size()) < s.n_heads())
        fail("{}: field ple_hash_constants has {} multipliers, {} head sizes and {} offsets; {} n-grams of {} heads need "
             "{}, {} and {}", path, h.multipliers.size(), h.head_sizes.size(), h.head_offsets.size(), s.ngram_size,
             s.n_heads(), s.ngram_size, s.n_heads(), s.n_heads());
      h.multipliers.resize(size_t(s.ngram_size));
      h.head_sizes.resize(size_t(s.n_heads()));
      h.head_offsets.resize(size_t(s.n_heads()));
      constexpr int64_t kMaxRows = int64_t(1) << 40;  // a real table has ~1.8e8 rows
      for (int i = 0; i < s.n_heads(); ++i) {
        if (h.head_sizes[size_t(i)] <= 0 || h.head_offsets[size_t(i)] < 0 || h.head_sizes[size_t(i)] > kMaxRows ||
            h.head_offsets[size_t(i)] > kMaxRows)
          fail("{}: field ple_hash_constants: head {} has size {} at offset {}", path, i, h.head_sizes[size_t(i)],
               h.head_offsets[size_t(i)]);
        h.padded_rows = std::max(h.padded_rows, h.head_offsets[size_t(i)] + h.head_sizes[size_t(i)]);
      }
      hp.given_hash = std::move(h);
    }
  }
  return hp;
}

struct Layer {
  LayerSpec spec;
  HyperConnectionWeights attn_hc, mlp_hc;
  GatedDeltaNetWeights gdn;
  QsaAttentionWeights attn;
  MoeWeights moe;
  DenseMlpWeights shared;
  Weight shared_gate;  // [1, hidden]
  PleWeights ple;
};

struct Workspace : ModelWorkspace {
  std::shared_ptr<float> storage;
  int64_t capacity = 0;
  Mat streams, mixed, branch, inject, shared_out, shared_gate, logits;
  HyperConnectionScratch hc;
  GatedDeltaNetScratch gdn;
  QsaScratch qsa;
  FfnScratch ffn;
  PleScratch ple;
  // Each PLE layer's gathered n-gram rows [capacity, ple_dim]: prepare_step uploads every
  // layer's before the step's device work runs (a replayed step graph reads them there).
  std::vector<Mat> ple_emb;
  std::shared_ptr<float> ple_storage;
  Mat exit_rows;  // [capacity, C*H]: the wanted rows' streams, rows of several sequences
};

struct State : SequenceState {
  Backend* backend = nullptr;
  std::shared_ptr<float> storage;  // every Mat below, backend memory
  int64_t storage_floats = 0;
  std::vector<GatedDeltaNetState> gdn;  // per layer (empty Mats on attention layers)
  std::vector<QsaState> qsa;
  std::vector<PleState> ple;
  int32_t eos = 0;
  int context = 0;
  BackendArray<int32_t> qsa_nan;  // [n_layers] QsaState::nan_score of each layer, zeroed by reset()
  std::vector<int32_t> qsa_nan_host;
  // Zeroes every recurrent state through the backend (ordered with queued work) and refills
  // the host n-gram contexts with EOS. QSA keys need no clearing: positions are rewritten
  // before they are read.
  void reset() override {
    backend->zero_bytes(storage.get(), storage_floats * 4);
    backend->zero_bytes(qsa_nan.data(), qsa_nan.size() * 4);
    for (auto& p : ple) p.context.assign(size_t(context), eos);
  }
};


class Qwen4Exp final : public Model {
 public:
  Qwen4Exp(const HfConfig& config, const Checkpoint& ck, Backend& be) : hp_(read_hparams(config)) {
    const WeightLoader ld{ck, be};
    hp_.attn.inv_freq = ld.param(hp_.inv_freq);
    // Three checkpoint layouts: Qwen4ExpForCausalLM (model.*), the multimodal
    // Qwen4ExpForConditionalGeneration (model.language_model.*, vision tensors skipped) and
    // the language_model.model.* form.
    std::string head = "lm_head.weight";
    if (ck.has("model.embed_tokens.weight")) {
      trunk_ = "model.";
    } else if (ck.has("model.language_model.embed_tokens.weight")) {
      trunk_ = "model.language_model.";
    } else if (ck.has("language_model.model.embed_tokens.weight")) {
      trunk_ = "language_model.model.";
      head = "language_model.lm_head.weight";
    } else {
      fail("{}: missing tensor model.embed_tokens.weight (nor the multimodal forms)", ck.dir());
    }
    const int64_t H = hp_.hidden;
    embed_ = ld.matrix(trunk_ + "embed_tokens.weight", hp_.vocab, H, -1);
    lm_head_ = ld.matrix(head, hp_.vocab, H, -1);
    exit_mixer_ = HyperConnectionWeights::load(ld, trunk_ + "hyper_connection_mixer.", hp_.n_streams, H, hp_.hc_rank,
                                               false, hp_.eps, -1);
    // bytes: every weight; active: what one decode token reads (dense parts, top-k experts).
    int64_t bytes = embed_.view.bytes() + lm_head_.view.bytes(), active = lm_head_.view.bytes();
    auto dense = [&](int64_t n) {
      bytes += n;
      active += n;
    };
    for (int i = 0; i < hp_.n_layers; ++i) {
      Layer L;
      L.spec = hp_.layers[size_t(i)];
      const std::string p = fmt::format("{}layers.{}.", trunk_, i);
      L.attn_hc = HyperConnectionWeights::load(ld, p + "attn_hyper_connection.", hp_.n_streams, H, hp_.hc_rank, true,
                                               hp_.eps, i);
      L.mlp_hc = HyperConnectionWeights::load(ld, p + "mlp_hyper_connection.", hp_.n_streams, H, hp_.hc_rank, true,
                                              hp_.eps, i);
      if (L.spec.mixer == MixerKind::kLinear) {
        L.gdn = GatedDeltaNetWeights::load(ld, p + "linear_attn.", hp_.gdn, H, i);
        dense(L.gdn.in_qkv.view.bytes() + L.gdn.in_z.view.bytes() + L.gdn.out.view.bytes());
      } else {
        const auto& a = hp_.attn;
        const int64_t qw = int64_t(a.n_heads) * a.head_dim, kvw = int64_t(a.n_kv_heads) * a.head_dim;
        L.attn.q_gate = ld.matrix(p + "self_attn.q_proj.weight", 2 * qw, H, i);
        L.attn.k = ld.matrix(p + "self_attn.k_proj.weight", kvw, H, i);
        L.attn.v = ld.matrix(p + "self_attn.v_proj.weight", kvw, H, i);
        L.attn.o = ld.matrix(p + "self_attn.o_proj.weight", H, qw, i);
        L.attn.q_norm = ld.floats(p + "self_attn.q_norm.weight", {a.head_dim});
        L.attn.k_norm = ld.floats(p + "self_attn.k_norm.weight", {a.head_dim});
        const int64_t id = hp_.qsa.head_dim;
        L.attn.index_qk = ld.matrix(p + "self_attn.indexer.index_qk_proj.weight", (hp_.qsa.n_heads + 1) * id, H, i);
        L.attn.index_q_norm = ld.floats(p + "self_attn.indexer.q_layernorm.weight", {id});
        L.attn.index_k_norm = ld.floats(p + "self_attn.indexer.k_layernorm.weight", {id});
        dense(L.attn.q_gate.view.bytes() + 2 * L.attn.k.view.bytes() + L.attn.o.view.bytes() +
              L.attn.index_qk.view.bytes());
      }
      load_moe(ld, p + "mlp.", i, L);
      const int64_t expert_bytes = 3 * L.moe.experts[0].gate.view.bytes();
      const int64_t shared_bytes = 3 * L.shared.gate.view.bytes() + L.moe.router.view.bytes();
      dense(shared_bytes + L.attn_hc.down.view.bytes() * 2 + L.attn_hc.inject.view.bytes() * 2);
      bytes += hp_.n_experts * expert_bytes;
      info_.expert_bytes = expert_bytes;
      info_.routed_weight_bytes += hp_.n_experts * expert_bytes;
      active += hp_.top_k * expert_bytes;
      if (L.spec.ple_index >= 0) load_ple(ld, p + "ple.", i, L);
      layers_.push_back(std::move(L));
    }
    info_.architecture = config.architecture().empty() ? "Qwen4ExpForCausalLM" : config.architecture();
    info_.family = "qwen4_exp";
    info_.vocab_size = hp_.vocab;
    info_.hidden_size = H;
    info_.n_layers = hp_.n_layers;
    info_.max_context = hp_.max_context;
    for (int64_t e : config.get_id_list("eos_token_id")) info_.eos_ids.push_back(int32_t(e));
    info_.weight_bytes = bytes;
    info_.active_weight_bytes = active;
    info_.n_params = ck.n_parameters([](const std::string& name) { return name.find(".visual.") != std::string::npos; });
  }

  const ModelInfo& info() const override { return info_; }
  int64_t n_experts() const override { return hp_.n_experts; }
  int experts_per_token() const override { return hp_.n_experts > 0 ? hp_.top_k : 0; }
  bool guesses_next_experts() const override { return hp_.n_experts > 0; }
  void for_each_routed_expert(const std::function<void(const ExpertWeights&)>& fn) const override {
    for (const Layer& L : layers_)
      for (const ExpertWeights& e : L.moe.experts) fn(e);
  }

  std::vector<KvLayerSpec> kv_spec() const override {
    std::vector<KvLayerSpec> spec(size_t(hp_.n_layers));
    for (int i = 0; i < hp_.n_layers; ++i) {
      if (hp_.layers[size_t(i)].mixer == MixerKind::kSparseAttention) spec[size_t(i)] = {hp_.attn.n_kv_heads, hp_.attn.head_dim};
    }
    return spec;
  }

  std::unique_ptr<ModelWorkspace> new_workspace(Backend& be, int64_t R) const override;
  std::unique_ptr<SequenceState> new_sequence_state(Backend& be, int64_t max_context) const override;
  std::string sequence_state() const override {
    bool ple = false;
    for (const auto& L : hp_.layers) ple = ple || L.ple_index >= 0;
    return ple ? "GatedDeltaNet, convolution and n-gram state" : "GatedDeltaNet and convolution state";
  }
  void forward(Backend& be, const ForwardBatch& b) const override;
  void prepare_step(Backend& be, const ForwardBatch& b) const override;
  void finish_step(Backend& be, const ForwardBatch& b) const override;

 private:
  void load_moe(const WeightLoader& ld, const std::string& p, int layer, Layer& L) const {
    const Checkpoint& ck = ld.ck;
    const int64_t H = hp_.hidden, I = hp_.moe_inter, E = hp_.n_experts;
    L.moe.router = ld.matrix(p + "gate.weight", E, H, layer);
    L.moe.top_k = hp_.top_k;
    L.moe.renormalize = hp_.norm_topk;
    const bool fused = ck.has(p + "experts.gate_up_proj");
    // GGUF files: llama.cpp's [E, rows, cols] stacks, one expert a contiguous slice of each.
    const bool stacked = !fused && ck.has(p + "experts.gate_proj");
    for (int e = 0; e < E; ++e) {
      ExpertWeights ew;
      if (stacked) {
        ew.gate = ld.expert_in_stack(p + "experts.gate_proj", e, E, I, H, layer);
        ew.up = ld.expert_in_stack(p + "experts.up_proj", e, E, I, H, layer);
        ew.down = ld.expert_in_stack(p + "experts.down_proj", e, E, H, I, layer);
      } else if (fused) {
        const WeightView gate_up =
            ld.expert_view(ck.matrix_in_stack(p + "experts.gate_up_proj", e, E, 2 * I, H), p + "experts.gate_up_proj");
        ew.gate.view = gate_up.rows_slice(0, I);  // gate rows first, then up rows
        ew.up.view = gate_up.rows_slice(I, I);
        ew.down.view = ld.expert_view(ck.matrix_in_stack(p + "experts.down_proj", e, E, H, I), p + "experts.down_proj");
        ew.gate.name = ew.up.name = p + "experts.gate_up_proj";
        ew.down.name = p + "experts.down_proj";
      } else {
        const std::string ep = fmt::format("{}experts.{}.", p, e);
        ew.gate = ld.expert_matrix(ep + "gate_proj.weight", I, H, layer);
        ew.up = ld.expert_matrix(ep + "up_proj.weight", I, H, layer);
        ew.down = ld.expert_matrix(ep + "down_proj.weight", H, I, layer);
      }
      for (Weight* w : {&ew.gate, &ew.up, &ew.down}) {
        w->layer = layer;
        w->expert = e;
        w->residency = Residency::kStreamedExpert;
      }
      L.moe.experts.push_back(std::move(ew));
    }
    const int64_t S = hp_.shared_inter;
    L.shared.gate = ld.matrix(p + "shared_expert.gate_proj.weight", S, H, layer);
    L.shared.up = ld.matrix(p + "shared_expert.up_proj.weight", S, H, layer);
    L.shared.down = ld.matrix(p + "shared_expert.down_proj.weight", H, S, layer);
    L.shared_gate = ld.matrix(p + "shared_expert_gate.weight", 1, H, layer);
  }

  void load_ple(const WeightLoader& ld, const std::string& p, int layer, Layer& L) const {
    const Checkpoint& ck = ld.ck;
    PleWeights& w = L.ple;
    const int64_t H = hp_.hidden, CH = int64_t(hp_.n_streams) * H;
    w.spec = hp_.ngram;
    w.spec.ple_index = L.spec.ple_index;
    w.hash = hp_.given_hash ? *hp_.given_hash : NgramHash::build(w.spec);
    w.n_streams = hp_.n_streams;
    w.hidden = H;
    w.ple_dim = hp_.ple_dim;
    w.head_dim = hp_.ple_dim / w.spec.n_heads();
    w.conv_kernel = hp_.ple_kernel;
    w.eps = hp_.eps;
    w.key = ld.matrix(p + "key_proj.weight", CH, hp_.ple_dim, layer);
    w.value = ld.matrix(p + "value_proj.weight", H, hp_.ple_dim, layer);
    w.norm_key = ld.floats(p + "norm_key.weight", {CH});
    w.norm_query = ld.floats(p + "norm_query.weight", {CH});
    w.norm_conv = ld.floats(p + "norm_conv.weight", {CH});
    w.conv = ld.floats(p + "conv1d.weight", {CH, 1, hp_.ple_kernel});
    // The table: one tensor, or shard_0..shard_{K-1} concatenated along rows. Only views
    // are kept: a real table is ~90 GiB and stays memory-mapped.
    const std::string table = p + "ple_embedding.ngram_embedding.";
    int64_t rows = 0;
    auto add_piece = [&](const std::string& name) {
      const TensorInfo& t = ck.get(name);
      if (t.shape.size() != 2 || t.shape[1] != w.head_dim) {
        fail("{}: tensor {}: shape {} where [rows, {}] is expected", *t.file, name, t.shape_str(), w.head_dim);
      }
      w.shard_starts.push_back(rows);
      // Not resident: the table stays in the mapped checkpoint, rows gathered on the host.
      Weight piece;
      piece.view = ck.matrix(name, t.shape[0], w.head_dim);
      piece.name = name;
      piece.layer = layer;
      w.table_shards.push_back(piece);
      rows += t.shape[0];
    };
    if (ck.has(table + "weight")) {
      add_piece(table + "weight");
    } else {
      for (int k = 0; ck.has(fmt::format("{}shard_{}.weight", table, k)); ++k) add_piece(fmt::format("{}shard_{}.weight", table, k));
      if (w.table_shards.empty()) fail("{}: missing tensor {}weight (or its shard_0.weight pieces)", ck.dir(), table);
    }
    if (hp_.given_hash) {
      // Stated constants: the table must hold every head's range (padded_rows is their end).
      if (rows < w.hash.padded_rows) {
        fail("{}: n-gram table {} has {} rows, too few for the stated head ranges (they end at row {})", ck.dir(), table,
             rows, w.hash.padded_rows);
      }
      w.hash.padded_rows = rows;
    } else if (rows != w.hash.padded_rows) {
      fail("{}: n-gram table {} has {} rows, the config implies {}", ck.dir(), table, rows, w.hash.padded_rows);
    }
    // Cross-check the derived hashing constants with the buffers the checkpoint carries.
    auto check_i64 = [&](const std::string& name, auto expected) {
      const TensorInfo* t = ck.find(p + "ple_embedding." + name);
      if (!t || t->dtype != DType::I64 || t->numel() != int64_t(expected.size())) return;
      for (size_t i = 0; i < expected.size(); ++i) {
        int64_t v;
        std::memcpy(&v, t->data + 8 * i, 8);
        if (uint64_t(v) != uint64_t(expected[i])) {
          fail("{}: tensor {}{}[{}] = {} but the config derives {}", ck.dir(), p, "ple_embedding." + name, i, v,
               int64_t(expected[i]));
        }
      }
    };
    check_i64("layer_multipliers", w.hash.multipliers);
    check_i64("ngram_heads_vocab_sizes", w.hash.head_sizes);
    check_i64("ngram_heads_offsets", w.hash.head_offsets);
  }

  Hparams hp_;
  std::string trunk_;
  ModelInfo info_;
  Weight embed_, lm_head_;
  HyperConnectionWeights exit_mixer_;
  std::vector<Layer> layers_;
};

std::unique_ptr<ModelWorkspace> Qwen4Exp::new_workspace(Backend& be, int64_t R) const {
  auto ws = std::make_unique<Workspace>();
  const int64_t H = hp_.hidden, C = hp_.n_streams, CH = C * H;
  const auto& a = hp_.attn;
  const int64_t qw = int64_t(a.n_heads) * a.head_dim, kvw = int64_t(a.n_kv_heads) * a.head_dim;
  const int64_t iw = (int64_t(hp_.qsa.n_heads) + 1) * hp_.qsa.head_dim;
  const int64_t inter = std::max(hp_.moe_inter, hp_.shared_inter);
  const int64_t conv_dim = hp_.gdn.conv_dim(), vdim = hp_.gdn.value_dim(), nv = hp_.gdn.n_v_heads;
  ws->storage = allocate_mats(be, R, {
      {&ws->streams, CH}, {&ws->exit_rows, CH}, {&ws->mixed, H}, {&ws->branch, H}, {&ws->inject, C}, {&ws->shared_out, H},
      {&ws->shared_gate, 1}, {&ws->logits, hp_.vocab}, {&ws->hc.normed, CH}, {&ws->hc.low, hp_.hc_rank},
      {&ws->hc.gate, CH}, {&ws->gdn.qkv, conv_dim}, {&ws->gdn.qkv_conv, conv_dim}, {&ws->gdn.z, vdim},
      {&ws->gdn.core, vdim}, {&ws->gdn.a, nv}, {&ws->gdn.b, nv}, {&ws->qsa.q_gate, 2 * qw}, {&ws->qsa.q, qw},
      {&ws->qsa.gate, qw}, {&ws->qsa.k, kvw}, {&ws->qsa.v, kvw}, {&ws->qsa.attn, qw}, {&ws->qsa.index_qk, iw},
      {&ws->qsa.index_q, iw - hp_.qsa.head_dim}, {&ws->ffn.gate, inter}, {&ws->ffn.up, inter},
      {&ws->ffn.router_logits, hp_.n_experts}, {&ws->ple.key, CH}, {&ws->ple.query, CH}, {&ws->ple.gated, CH}, {&ws->ple.normed, CH}, {&ws->ple.conv, CH},
      {&ws->ple.value, H}});
  ws->ffn.allocate_routing(be, R, hp_.top_k);
  int n_ple = 0;
  for (const LayerSpec& spec : hp_.layers) n_ple += spec.ple_index >= 0;
  if (n_ple > 0) {
    Arena arena;
    for (int k = 0; k < n_ple; ++k) arena.plan(R, hp_.ple_dim);
    arena.allocate(be);
    for (int k = 0; k < n_ple; ++k) ws->ple_emb.push_back(arena.take(R, hp_.ple_dim));
    ws->ple_storage = arena.storage();
  }
  const int max_sel = hp_.qsa.max_selected();
  ws->qsa.selected = be.alloc_array<int32_t>(R * max_sel);
  ws->qsa.counts = be.alloc_array<int32_t>(R);
  ws->capacity = R;
  return ws;
}

std::unique_ptr<SequenceState> Qwen4Exp::new_sequence_state(Backend& be, int64_t max_context) const {
  auto st = std::make_unique<State>();
  st->backend = &be;
  const int64_t CH = int64_t(hp_.n_streams) * hp_.hidden;
  const int n = hp_.n_layers;
  st->gdn.resize(size_t(n));
  st->qsa.resize(size_t(n));
  st->ple.resize(size_t(n));
  st->eos = hp_.eos;
  st->context = hp_.ngram.ngram_size - 1;
  Arena arena;
  const GatedDeltaNetParams& g = hp_.gdn;
  const int64_t ple_span = int64_t(hp_.ple_kernel - 1) * hp_.ngram.ngram_size;
  const int64_t n_blocks = hp_.qsa.ratio > 0 ? max_context / hp_.qsa.ratio + 1 : 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (int i = 0; i < n; ++i) {
      const LayerSpec& spec = hp_.layers[size_t(i)];
      auto mat = [&](Mat* m, int64_t rows, int64_t cols) {
        if (pass == 0) arena.plan(rows, cols);
        else *m = arena.take(rows, cols);
      };
      if (spec.mixer == MixerKind::kLinear) {
        mat(&st->gdn[size_t(i)].conv, g.conv_kernel - 1, g.conv_dim());
        mat(&st->gdn[size_t(i)].recurrent, g.n_v_heads, int64_t(g.dk) * g.dv);
      } else {
        mat(&st->qsa[size_t(i)].raw_keys, max_context, hp_.qsa.head_dim);
        mat(&st->qsa[size_t(i)].block_keys, n_blocks, hp_.qsa.head_dim);
      }
      if (spec.ple_index >= 0) mat(&st->ple[size_t(i)].conv, ple_span, CH);
    }
    if (pass == 0) arena.allocate(be);
  }
  st->qsa_nan = be.alloc_array<int32_t>(n);
  st->qsa_nan_host.assign(size_t(n), 0);
  for (int i = 0; i < n; ++i) st->qsa[size_t(i)].nan_score = st->qsa_nan.data() + i;
  st->storage = arena.storage();
  st->storage_floats = arena.total_floats();
  st->reset();
  return st;
}

void Qwen4Exp::forward(Backend& be, const ForwardBatch& b) const {
  auto& ws = *static_cast<Workspace*>(b.workspace);
  TS_CHECK(b.n > 0 && b.n <= ws.capacity, "micro-batch of {} rows exceeds the workspace ({})", b.n, ws.capacity);
  const std::vector<SequenceRun> runs = sequence_runs(b);
  // Each block's runs: rows of one sequence and its part of that sequence's state.
  auto layer_runs = [&](auto member, int i) {
    using Part = std::remove_cvref_t<decltype((std::declval<State&>().*member)[0])>;
    std::vector<StateRows<const Part>> out;
    for (const SequenceRun& r : runs)
      out.push_back({r.first, r.rows, &(static_cast<State*>(r.state)->*member)[size_t(i)]});
    return out;
  };
  const int64_t n = b.n, H = hp_.hidden;
  const int C = hp_.n_streams;
  auto trace = [&](const char* name, int layer, const Mat& m) { b.emit(name, layer, m); };
  if (!b.host_work_apart) prepare_step(be, b);
  Mat streams = ws.streams.rows_slice(0, n), mixed = ws.mixed.rows_slice(0, n), branch = ws.branch.rows_slice(0, n);
  Mat inject = ws.inject.rows_slice(0, n);
  // The residual starts as the embedding repeated in every stream.
  // Trace names say which block just finished (bench --profile times the gaps between them).
  be.embedding(embed_, b.tokens, n, 1.f, streams.cols_slice(0, H));
  for (int c = 1; c < C; ++c) be.copy(streams.cols_slice(0, H), streams.cols_slice(c * H, H));
  trace("embedding", -1, streams);
  for (int i = 0; i < hp_.n_layers; ++i) {
    const Layer& L = layers_[size_t(i)];
    trace("layer_in", i, streams);
    if (L.spec.ple_index >= 0) {
      ple_layer(be, L.ple, ws.ple_emb[size_t(L.spec.ple_index)].rows_slice(0, n), streams,
                layer_runs(&State::ple, i), ws.ple);
      trace("ple", i, streams);
    }
    hc_gated_residual(be, L.attn_hc, streams, ws.hc, mixed, &inject);
    trace("hyper_connection", i, mixed);
    if (L.spec.mixer == MixerKind::kLinear) {
      gated_delta_net(be, hp_.gdn, L.gdn, mixed, layer_runs(&State::gdn, i), ws.gdn, branch);
      trace("gdn", i, branch);
    } else {
      qsa_index(be, hp_.attn, hp_.qsa, L.attn, mixed, b.positions, layer_runs(&State::qsa, i), ws.qsa);
      trace("qsa_indexer", i, mixed);
      qsa_attention(be, hp_.attn, hp_.qsa, L.attn, mixed, b.positions, b.kv[size_t(i)], ws.qsa, branch);
      trace("attention", i, branch);
    }
    be.hc_inject(streams, branch, inject, C);
    hc_gated_residual(be, L.mlp_hc, streams, ws.hc, mixed, &inject);
    trace("hyper_connection", i, mixed);
    float* probs = b.router_probs ? b.router_probs + int64_t(i) * n * hp_.n_experts : nullptr;
    const MoeWeights* next = i + 1 < hp_.n_layers ? &layers_[size_t(i) + 1].moe : nullptr;  // streaming's guess
    moe_ffn(be, L.moe, mixed, ws.ffn, branch, probs, next);
    Mat shared = ws.shared_out.rows_slice(0, n), gate = ws.shared_gate.rows_slice(0, n);
    dense_mlp(be, L.shared, mixed, ws.ffn, shared, &L.shared_gate, &gate);  // its gate in gate | up's launch
    be.hc_inject_gated(streams, branch, shared, gate, inject, C);  // branch += shared * sigmoid(gate), injected
    trace("moe", i, branch);
    trace("hyper_connection", i, streams);
  }
  Mat last_streams = b.all_logits ? streams : streams.rows_slice(n - 1, 1);
  if (!b.logit_rows.empty()) {
    // Rows of several sequences: each wanted row's streams gathered, one row each.
    last_streams = ws.exit_rows.rows_slice(0, int64_t(b.logit_rows.size()));
    for (size_t k = 0; k < b.logit_rows.size(); ++k)
      be.copy(streams.rows_slice(b.logit_rows[k], 1), last_streams.rows_slice(int64_t(k), 1));
  }
  Mat out = mixed.rows_slice(0, last_streams.rows);
  hc_gated_residual(be, exit_mixer_, last_streams, ws.hc, out, nullptr);
  trace("hyper_connection", hp_.n_layers, out);
  Mat logits = ws.logits.rows_slice(0, out.rows);
  be.matmul(lm_head_, out, logits);
  trace("lm_head", hp_.n_layers, logits);
  download_outputs(be, b, logits);
  if (!b.host_work_apart) finish_step(be, b);
}

void Qwen4Exp::prepare_step(Backend& be, const ForwardBatch& b) const {
  auto& ws = *static_cast<Workspace*>(b.workspace);
  TS_CHECK(b.n > 0 && b.n <= ws.capacity, "micro-batch of {} rows exceeds the workspace ({})", b.n, ws.capacity);
  for (const SequenceRun& r : sequence_runs(b)) {
    auto& st = *static_cast<State*>(r.state);
    for (int i = 0; i < hp_.n_layers; ++i) {
      const Layer& L = layers_[size_t(i)];
      if (L.spec.ple_index < 0) continue;
      ple_gather(be, L.ple, b.host_tokens + r.first, r.rows, st.ple[size_t(i)], ws.ple,
                 ws.ple_emb[size_t(L.spec.ple_index)].rows_slice(r.first, r.rows));
    }
  }
}

void Qwen4Exp::finish_step(Backend& be, const ForwardBatch& b) const {
  // After the step (the queue has drained there): a NaN block score would have picked the
  // attended tokens by accident, so the run stops naming the first such layer.
  if (hp_.qsa.ratio <= 0) return;
  for (const SequenceRun& r : sequence_runs(b)) {
    auto& st = *static_cast<State*>(r.state);
    be.download_bytes(st.qsa_nan_host.data(), st.qsa_nan.data(), int64_t(st.qsa_nan_host.size()) * 4);
    for (int i = 0; i < hp_.n_layers; ++i) {
      if (st.qsa_nan_host[size_t(i)]) fail("layer {}: QSA indexer produced a NaN block score", i);
    }
  }
}

}  // namespace

std::unique_ptr<Model> make_qwen4_exp(const HfConfig& config, const Checkpoint& ckpt, Backend& be) {
  return std::make_unique<Qwen4Exp>(config, ckpt, be);
}

}  // namespace turbospark
