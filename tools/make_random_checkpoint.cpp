// Writes a random bf16 checkpoint (config.json + model.safetensors) at real model shapes,
// without transformers, for benchmarks: the engine's speed depends on shapes, not values.
//
//   make_random_checkpoint --preset qwen3-0.6b --out /tmp/qwen3-0.6b-random
//   make_random_checkpoint --preset qwen3-moe-2b --out /tmp/qwen3-moe-2b-random [--layers 8]
//   make_random_checkpoint --preset qwen3-8b | qwen3-30b-a3b --out DIR [--layers N]
//   make_random_checkpoint --preset qwen4-exp --out /tmp/qwen4-exp-random [--layers 3]
//   make_random_checkpoint --preset gemma4-26b-a4b --out /tmp/gemma4-26b-a4b-random [--layers 3]
//   make_random_checkpoint --preset gpt-oss-20b[-mxfp4] --out /tmp/gpt-oss-20b-random [--layers 2]
// qwen4-exp has the real widths (hidden 2048, 512 experts top-10, hc_count 4, GDN 16/32 heads
// of 128) at reduced depth; its QSA sizes are assumptions (the public config leaves them
// unset) and its n-gram table base is 200k instead of 20M (a ~90 GiB table does not fit
// here; the per-token gather is the same 16 rows either way).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/dtype.h"
#include "core/error.h"
#include "formats/safetensors.h"

using namespace turbospark;

namespace {

struct Shape {
  std::string model_type, architecture;
  int64_t vocab, hidden, inter, layers, heads, kv_heads, head_dim;
  int64_t experts = 0, top_k = 0, moe_inter = 0;
  bool tie = false;
};

Shape preset(const std::string& name) {
  if (name == "qwen3-0.6b") return {"qwen3", "Qwen3ForCausalLM", 151936, 1024, 3072, 28, 16, 8, 128, 0, 0, 0, true};
  if (name == "qwen3-moe-2b") {
    return {"qwen3_moe", "Qwen3MoeForCausalLM", 151936, 1024, 3072, 16, 16, 4, 128, 64, 8, 512, false};
  }
  // Qwen3-8B and Qwen3-30B-A3B widths (the CUDA benches: dense and MoE at real shapes).
  if (name == "qwen3-8b") return {"qwen3", "Qwen3ForCausalLM", 151936, 4096, 12288, 36, 32, 8, 128, 0, 0, 0, false};
  if (name == "qwen3-30b-a3b") {
    return {"qwen3_moe", "Qwen3MoeForCausalLM", 151936, 2048, 6144, 48, 32, 4, 128, 128, 8, 768, false};
  }
  if (name == "qwen4-exp") return {"qwen4_exp_text", "Qwen4ExpForCausalLM", 248320, 2048, 0, 3, 16, 2, 256, 512, 10, 512, false};
  // Gemma 4 26B-A4B widths (as published: 128 experts top-8 beside a dense GeGLU MLP, 16 heads,
  // sliding layers 8 KV heads x 256, full layers 2 KV heads x 512 with k_eq_v), reduced depth.
  if (name == "gemma4-26b-a4b") return {"gemma4_text", "Gemma4ForCausalLM", 262144, 2816, 2112, 3, 16, 8, 256, 128, 8, 704, true};
  // gpt-oss-20b widths (32 experts top-4, 64 heads, 8 KV heads of 64, YaRN, sliding 128 on
  // even layers); -mxfp4 stores the experts as the published checkpoint does.
  if (name == "gpt-oss-20b" || name == "gpt-oss-20b-mxfp4") {
    return {"gpt_oss", "GptOssForCausalLM", 201088, 2880, 2880, 24, 64, 8, 64, 32, 4, 2880, false};
  }
  fail("--preset {}: unknown (qwen3-0.6b, qwen3-8b, qwen3-moe-2b, qwen3-30b-a3b, qwen4-exp, gemma4-26b-a4b, gpt-oss-20b, gpt-oss-20b-mxfp4)", name);
}

// Uniform values with the fan-in standard deviation; xorshift keeps multi-GiB writes fast.
void fill_random(uint8_t* dst, size_t nbytes, int64_t fan_in, uint64_t seed, bool norm) {
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  const float a = norm ? 0.1f : std::sqrt(3.0f / float(fan_in));
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  for (size_t i = 0; i < nbytes / 2; ++i) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    float u = float(s >> 40) / float(1 << 24) * 2.f - 1.f;
    out[i] = f32_to_bf16(norm ? 1.f + a * u : a * u);
  }
}

// The tensors of one random checkpoint, each filled when written with its own seed (in
// the order added) so files are reproducible.
struct RandomTensors {
  std::vector<TensorWriteSpec> specs;
  uint64_t seed = 1;
  // BF16, uniform with fan-in scaling (norm: around 1).
  void add(const std::string& name, std::vector<int64_t> shape, bool norm = false) {
    const int64_t fan_in = shape.back();
    const uint64_t sd = seed++;
    specs.push_back({name, DType::BF16, shape, [fan_in, sd, norm](uint8_t* d, size_t n) { fill_random(d, n, fan_in, sd, norm); }});
  }
  void write(const std::string& out) const {
    fmt::print(stderr, "writing {} tensors to {}/model.safetensors\n", specs.size(), out);
    write_safetensors(out + "/model.safetensors", specs, {{"format", "pt"}});
  }
};

void write_config(const nlohmann::json& cfg, const std::string& out) {
  FILE* f = std::fopen((out + "/config.json").c_str(), "w");
  if (!f) fail("{}/config.json: cannot write", out);
  std::string text = cfg.dump(2);
  std::fwrite(text.data(), 1, text.size(), f);
  std::fclose(f);
}

bool write_qwen4_exp(const Shape& s, const std::string& out) {
  const int64_t H = s.hidden, C = 4, CH = C * H, rank = 320;
  const int64_t nk = 16, nv = 32, dk = 128, dv = 128, K = 4, conv_dim = 2 * nk * dk + nv * dv;
  const int64_t ih = 8, id = 128, shared = 512;
  const int ngram = 3, heads_per_ngram = 8, ngram_heads = (ngram - 1) * heads_per_ngram;
  const int64_t base = 200000, ple_dim = H, ple_head = ple_dim / ngram_heads;
  std::vector<std::string> types;
  for (int64_t i = 0; i < s.layers; ++i) types.push_back((i + 1) % 3 ? "linear_attention" : "qwen_sparse_attention");
  if (s.layers < 3) types.back() = "qwen_sparse_attention";
  nlohmann::json cfg = {{"architectures", {s.architecture}}, {"model_type", s.model_type}, {"vocab_size", s.vocab},
                        {"hidden_size", H}, {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
                        {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim},
                        {"max_position_embeddings", 32768}, {"rms_norm_eps", 1e-6}, {"hidden_act", "silu"},
                        {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 10000000.0}, {"partial_rotary_factor", 0.25}}},
                        {"layer_types", types}, {"linear_conv_kernel_dim", K}, {"linear_key_head_dim", dk},
                        {"linear_value_head_dim", dv}, {"linear_num_key_heads", nk}, {"linear_num_value_heads", nv},
                        {"moe_intermediate_size", s.moe_inter}, {"shared_expert_intermediate_size", shared},
                        {"num_experts", s.experts}, {"num_experts_per_tok", s.top_k}, {"norm_topk_prob", true},
                        {"hc_count", C}, {"hc_lowrank", rank}, {"ple_layer_ids", {1}}, {"ple_embed_dim", ple_dim},
                        {"ple_conv_kernel_size", 4}, {"ngram_size", ngram}, {"heads_per_ngram", heads_per_ngram},
                        {"ngram_vocab_size_base", base}, {"make_ngram_vocab_size_divisible_by", 128}, {"seed", 1234},
                        {"indexer_n_heads", ih}, {"indexer_kv_heads", 1}, {"indexer_head_dim", id},
                        {"indexer_budget", 2048}, {"indexer_compress_ratio", 16}, {"output_gate_type", "sigmoid"},
                        {"eos_token_id", 248046}, {"tie_word_embeddings", false}};
  write_config(cfg, out);
  // n-gram table rows: the sum of the first 16 primes >= base, rounded up to 128.
  int64_t rows = 0, prime = base - 1;
  for (int g = 0; g < ngram_heads; ++g) {
    ++prime;
    for (;;) {
      bool is_prime = prime > 1;
      for (int64_t d = 2; d * d <= prime && is_prime; ++d) is_prime = prime % d != 0;
      if (is_prime) break;
      ++prime;
    }
    rows += prime;
  }
  rows = (rows + 127) / 128 * 128;
  RandomTensors tensors;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool norm = false) { tensors.add(name, shape, norm); };
  auto hc = [&](const std::string& p, bool inject) {
    add(p + "hc_norm.weight", {CH}, true);
    add(p + "input_mix_weight_down.weight", {rank, CH});
    add(p + "input_mix_weight_up.weight", {CH, rank});
    if (inject) add(p + "block_inject_weight.weight", {C, CH});
  };
  add("model.embed_tokens.weight", {s.vocab, H});
  add("lm_head.weight", {s.vocab, H});
  hc("model.hyper_connection_mixer.", false);
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    hc(p + "attn_hyper_connection.", true);
    hc(p + "mlp_hyper_connection.", true);
    if (types[size_t(i)] == "linear_attention") {
      const std::string l = p + "linear_attn.";
      add(l + "in_proj_qkv.weight", {conv_dim, H});
      add(l + "in_proj_z.weight", {nv * dv, H});
      add(l + "in_proj_b.weight", {nv, H});
      add(l + "in_proj_a.weight", {nv, H});
      add(l + "out_proj.weight", {H, nv * dv});
      add(l + "conv1d.weight", {conv_dim, 1, K});
      add(l + "A_log", {nv}, true);
      add(l + "dt_bias", {nv}, true);
      add(l + "norm.weight", {dv}, true);
    } else {
      const std::string a = p + "self_attn.";
      add(a + "q_proj.weight", {2 * s.heads * s.head_dim, H});
      add(a + "k_proj.weight", {s.kv_heads * s.head_dim, H});
      add(a + "v_proj.weight", {s.kv_heads * s.head_dim, H});
      add(a + "o_proj.weight", {H, s.heads * s.head_dim});
      add(a + "q_norm.weight", {s.head_dim}, true);
      add(a + "k_norm.weight", {s.head_dim}, true);
      add(a + "indexer.index_qk_proj.weight", {(ih + 1) * id, H});
      add(a + "indexer.q_layernorm.weight", {id}, true);
      add(a + "indexer.k_layernorm.weight", {id}, true);
    }
    if (i == 0) {
      const std::string e = p + "ple.";
      add(e + "key_proj.weight", {CH, ple_dim});
      add(e + "value_proj.weight", {H, ple_dim});
      add(e + "norm_key.weight", {CH}, true);
      add(e + "norm_query.weight", {CH}, true);
      add(e + "norm_conv.weight", {CH}, true);
      add(e + "conv1d.weight", {CH, 1, 4});
      add(e + "ple_embedding.ngram_embedding.weight", {rows, ple_head});
    }
    const std::string m = p + "mlp.";
    add(m + "gate.weight", {s.experts, H});
    add(m + "experts.gate_up_proj", {s.experts, 2 * s.moe_inter, H});
    add(m + "experts.down_proj", {s.experts, H, s.moe_inter});
    add(m + "shared_expert.gate_proj.weight", {shared, H});
    add(m + "shared_expert.up_proj.weight", {shared, H});
    add(m + "shared_expert.down_proj.weight", {H, shared});
    add(m + "shared_expert_gate.weight", {1, H});
  }
  tensors.write(out);
  return true;
}

// Gemma 4 MoE text model: 5 sliding layers then 1 full (the last always full); full layers
// have head_dim 512, 2 KV heads and no v_proj (attention_k_eq_v); no per-layer inputs.
bool write_gemma4(const Shape& s, const std::string& out) {
  const int64_t H = s.hidden, global_hd = 512, global_kv = 2;
  std::vector<std::string> types;
  for (int64_t i = 0; i < s.layers; ++i) types.push_back((i + 1) % 6 ? "sliding_attention" : "full_attention");
  types.back() = "full_attention";
  nlohmann::json rope = {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
                         {"full_attention", {{"rope_type", "proportional"}, {"partial_rotary_factor", 0.25},
                                             {"rope_theta", 1000000.0}}}};
  nlohmann::json cfg = {{"architectures", {s.architecture}}, {"model_type", s.model_type}, {"vocab_size", s.vocab},
                        {"hidden_size", H}, {"intermediate_size", s.inter}, {"num_hidden_layers", s.layers},
                        {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads},
                        {"head_dim", s.head_dim}, {"global_head_dim", global_hd},
                        {"num_global_key_value_heads", global_kv}, {"attention_k_eq_v", true},
                        {"max_position_embeddings", 262144}, {"rms_norm_eps", 1e-6},
                        {"hidden_activation", "gelu_pytorch_tanh"}, {"sliding_window", 1024},
                        {"layer_types", types}, {"rope_parameters", rope}, {"final_logit_softcapping", 30.0},
                        {"hidden_size_per_layer_input", 0}, {"num_kv_shared_layers", 0},
                        {"enable_moe_block", true}, {"num_experts", s.experts}, {"top_k_experts", s.top_k},
                        {"moe_intermediate_size", s.moe_inter}, {"tie_word_embeddings", true},
                        {"eos_token_id", {1, 106}}};
  write_config(cfg, out);
  RandomTensors tensors;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool norm = false) { tensors.add(name, shape, norm); };
  add("model.embed_tokens.weight", {s.vocab, H});
  add("model.norm.weight", {H}, true);
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    const bool full = types[size_t(i)] == "full_attention";
    const int64_t hd = full ? global_hd : s.head_dim, kv = full ? global_kv : s.kv_heads;
    for (const char* n : {"input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                          "post_feedforward_layernorm", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_1",
                          "post_feedforward_layernorm_2"}) {
      add(p + n + ".weight", {H}, true);
    }
    add(p + "layer_scalar", {1}, true);
    add(p + "self_attn.q_proj.weight", {s.heads * hd, H});
    add(p + "self_attn.k_proj.weight", {kv * hd, H});
    if (!full) add(p + "self_attn.v_proj.weight", {kv * hd, H});
    add(p + "self_attn.o_proj.weight", {H, s.heads * hd});
    add(p + "self_attn.q_norm.weight", {hd}, true);
    add(p + "self_attn.k_norm.weight", {hd}, true);
    add(p + "mlp.gate_proj.weight", {s.inter, H});
    add(p + "mlp.up_proj.weight", {s.inter, H});
    add(p + "mlp.down_proj.weight", {H, s.inter});
    add(p + "router.proj.weight", {s.experts, H});
    add(p + "router.scale", {H}, true);
    add(p + "router.per_expert_scale", {s.experts}, true);
    add(p + "experts.gate_up_proj", {s.experts, 2 * s.moe_inter, H});
    add(p + "experts.down_proj", {s.experts, H, s.moe_inter});
  }
  tensors.write(out);
  return true;
}

// gpt-oss: biased attention with sinks, biased router, experts [E, in, out] in bf16 (gate/up
// columns interleaved) or MXFP4 _blocks/_scales [E, out, in/32, 16] / [E, out, in/32].
bool write_gpt_oss(const Shape& s, const std::string& out, bool mxfp4) {
  const int64_t H = s.hidden, I = s.inter, E = s.experts, q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
  std::vector<std::string> types;
  for (int64_t i = 0; i < s.layers; ++i) types.push_back(i % 2 ? "full_attention" : "sliding_attention");
  nlohmann::json cfg = {{"architectures", {s.architecture}}, {"model_type", s.model_type}, {"vocab_size", s.vocab},
                        {"hidden_size", H}, {"intermediate_size", I}, {"num_hidden_layers", s.layers},
                        {"num_attention_heads", s.heads}, {"num_key_value_heads", s.kv_heads},
                        {"head_dim", s.head_dim}, {"num_local_experts", E}, {"num_experts_per_tok", s.top_k},
                        {"max_position_embeddings", 131072}, {"rms_norm_eps", 1e-5}, {"sliding_window", 128},
                        {"layer_types", types}, {"attention_bias", true}, {"tie_word_embeddings", false},
                        {"rope_parameters", {{"rope_type", "yarn"}, {"rope_theta", 150000.0}, {"factor", 32.0},
                                             {"beta_fast", 32.0}, {"beta_slow", 1.0}, {"truncate", false},
                                             {"original_max_position_embeddings", 4096}}},
                        {"eos_token_id", 200002}};
  if (mxfp4) cfg["quantization_config"] = {{"quant_method", "mxfp4"}};
  write_config(cfg, out);
  RandomTensors tensors;
  auto add = [&](const std::string& name, std::vector<int64_t> shape, bool norm = false) { tensors.add(name, shape, norm); };
  // Random FP4 codes; scales near 2^-5 so weights stay in the fan-in range.
  auto add_u8 = [&](const std::string& name, std::vector<int64_t> shape, bool scales) {
    uint64_t sd = tensors.seed++;
    tensors.specs.push_back({name, DType::U8, shape, [sd, scales](uint8_t* d, size_t n) {
                         uint64_t x = sd * 0x9E3779B97F4A7C15ull + 1;
                         for (size_t i = 0; i < n; ++i) {
                           x ^= x << 13;
                           x ^= x >> 7;
                           x ^= x << 17;
                           d[i] = scales ? uint8_t(120 + (x >> 61)) : uint8_t(x >> 56);
                         }
                       }});
  };
  add("model.embed_tokens.weight", {s.vocab, H});
  add("lm_head.weight", {s.vocab, H});
  add("model.norm.weight", {H}, true);
  for (int64_t i = 0; i < s.layers; ++i) {
    const std::string p = fmt::format("model.layers.{}.", i);
    add(p + "input_layernorm.weight", {H}, true);
    add(p + "post_attention_layernorm.weight", {H}, true);
    for (auto [n, rows] : {std::pair<const char*, int64_t>{"q_proj", q}, {"k_proj", kv}, {"v_proj", kv}}) {
      add(p + "self_attn." + n + ".weight", {rows, H});
      add(p + "self_attn." + n + ".bias", {rows});
    }
    add(p + "self_attn.o_proj.weight", {H, q});
    add(p + "self_attn.o_proj.bias", {H});
    add(p + "self_attn.sinks", {s.heads});
    add(p + "mlp.router.weight", {E, H});
    add(p + "mlp.router.bias", {E});
    const std::string x = p + "mlp.experts.";
    if (mxfp4) {
      add_u8(x + "gate_up_proj_blocks", {E, 2 * I, H / 32, 16}, false);
      add_u8(x + "gate_up_proj_scales", {E, 2 * I, H / 32}, true);
      add_u8(x + "down_proj_blocks", {E, H, I / 32, 16}, false);
      add_u8(x + "down_proj_scales", {E, H, I / 32}, true);
    } else {
      add(x + "gate_up_proj", {E, H, 2 * I});
      add(x + "down_proj", {E, I, H});
    }
    add(x + "gate_up_proj_bias", {E, 2 * I});
    add(x + "down_proj_bias", {E, H});
  }
  tensors.write(out);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Write a random bf16 checkpoint at real model shapes (for benchmarks)"};
  std::string preset_name, out;
  int64_t layers = 0;
  app.add_option("--preset", preset_name, "qwen3-0.6b, qwen3-8b, qwen3-moe-2b, qwen3-30b-a3b, qwen4-exp, gemma4-26b-a4b, gpt-oss-20b[-mxfp4]")->required();
  app.add_option("--out", out, "Output directory")->required();
  app.add_option("--layers", layers, "Override the number of layers (reduced depth)");
  CLI11_PARSE(app, argc, argv);
  try {
    Shape s = preset(preset_name);
    if (layers > 0) s.layers = layers;
    std::filesystem::create_directories(out);
    nlohmann::json cfg = {{"architectures", {s.architecture}}, {"model_type", s.model_type},
                          {"vocab_size", s.vocab}, {"hidden_size", s.hidden}, {"intermediate_size", s.inter},
                          {"num_hidden_layers", s.layers}, {"num_attention_heads", s.heads},
                          {"num_key_value_heads", s.kv_heads}, {"head_dim", s.head_dim},
                          {"max_position_embeddings", 40960}, {"rms_norm_eps", 1e-6},
                          {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 1000000.0}}},
                          {"tie_word_embeddings", s.tie}, {"hidden_act", "silu"}, {"eos_token_id", 151645}};
    if (s.model_type == "qwen4_exp_text") {
      return write_qwen4_exp(s, out) ? 0 : 1;
    }
    if (s.model_type == "gemma4_text") return write_gemma4(s, out) ? 0 : 1;
    if (s.model_type == "gpt_oss") return write_gpt_oss(s, out, preset_name.find("mxfp4") != std::string::npos) ? 0 : 1;
    if (s.experts) {
      cfg["num_experts"] = s.experts;
      cfg["num_experts_per_tok"] = s.top_k;
      cfg["moe_intermediate_size"] = s.moe_inter;
      cfg["norm_topk_prob"] = true;
      cfg["decoder_sparse_step"] = 1;
      cfg["mlp_only_layers"] = nlohmann::json::array();
    }
    FILE* f = std::fopen((out + "/config.json").c_str(), "w");
    if (!f) fail("{}/config.json: cannot write", out);
    std::string text = cfg.dump(2);
    std::fwrite(text.data(), 1, text.size(), f);
    std::fclose(f);

    RandomTensors tensors;
    auto add = [&](const std::string& name, std::vector<int64_t> shape, bool norm = false) { tensors.add(name, shape, norm); };
    const int64_t H = s.hidden, q = s.heads * s.head_dim, kv = s.kv_heads * s.head_dim;
    add("model.embed_tokens.weight", {s.vocab, H});
    if (!s.tie) add("lm_head.weight", {s.vocab, H});
    add("model.norm.weight", {H}, true);
    for (int64_t i = 0; i < s.layers; ++i) {
      std::string p = fmt::format("model.layers.{}.", i);
      add(p + "input_layernorm.weight", {H}, true);
      add(p + "post_attention_layernorm.weight", {H}, true);
      add(p + "self_attn.q_proj.weight", {q, H});
      add(p + "self_attn.k_proj.weight", {kv, H});
      add(p + "self_attn.v_proj.weight", {kv, H});
      add(p + "self_attn.o_proj.weight", {H, q});
      add(p + "self_attn.q_norm.weight", {s.head_dim}, true);
      add(p + "self_attn.k_norm.weight", {s.head_dim}, true);
      if (s.experts) {
        add(p + "mlp.gate.weight", {s.experts, H});
        for (int64_t e = 0; e < s.experts; ++e) {
          std::string ep = fmt::format("{}mlp.experts.{}.", p, e);
          add(ep + "gate_proj.weight", {s.moe_inter, H});
          add(ep + "up_proj.weight", {s.moe_inter, H});
          add(ep + "down_proj.weight", {H, s.moe_inter});
        }
      } else {
        add(p + "mlp.gate_proj.weight", {s.inter, H});
        add(p + "mlp.up_proj.weight", {s.inter, H});
        add(p + "mlp.down_proj.weight", {H, s.inter});
      }
    }
    tensors.write(out);
  } catch (const Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
