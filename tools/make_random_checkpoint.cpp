// Writes a random bf16 checkpoint (config.json + model.safetensors) at real model shapes,
// without transformers, for benchmarks: the engine's speed depends on shapes, not values.
//
//   make_random_checkpoint --preset qwen3-0.6b --out /tmp/qwen3-0.6b-random
//   make_random_checkpoint --preset qwen3-moe-2b --out /tmp/qwen3-moe-2b-random [--layers 8]
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
  fail("--preset {}: unknown (qwen3-0.6b, qwen3-moe-2b)", name);
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Write a random bf16 checkpoint at real model shapes (for benchmarks)"};
  std::string preset_name, out;
  int64_t layers = 0;
  app.add_option("--preset", preset_name, "qwen3-0.6b or qwen3-moe-2b")->required();
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

    std::vector<TensorWriteSpec> tensors;
    uint64_t seed = 1;
    auto add = [&](const std::string& name, std::vector<int64_t> shape, bool norm = false) {
      int64_t fan_in = shape.back();
      uint64_t sd = seed++;
      tensors.push_back({name, DType::BF16, shape, [fan_in, sd, norm](uint8_t* d, size_t n) { fill_random(d, n, fan_in, sd, norm); }});
    };
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
    fmt::print(stderr, "writing {} tensors to {}/model.safetensors\n", tensors.size(), out);
    write_safetensors(out + "/model.safetensors", tensors, {{"format", "pt"}});
  } catch (const Error& e) {
    fmt::print(stderr, "error: {}\n", e.what());
    return 1;
  }
  return 0;
}
