#include "formats/gguf_model.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <regex>

#include "core/error.h"
#include "core/quant.h"

namespace turbospark {

namespace {

struct ArchInfo {
  const char* gguf;          // general.architecture
  const char* hf_arch;       // architectures[0]
  const char* model_type;    // config model_type
  bool permuted_qk;          // converter permuted q/k rows for interleaved RoPE
  bool norms_plus_one;       // converter stored (1 + w) for (1 + w) norms
};

constexpr ArchInfo kArchs[] = {
    {"llama", "LlamaForCausalLM", "llama", true, false},
    {"qwen2", "Qwen2ForCausalLM", "qwen2", false, false},
    {"qwen3", "Qwen3ForCausalLM", "qwen3", false, false},
    {"gemma3", "Gemma3ForCausalLM", "gemma3_text", false, true},
    {"qwen3moe", "Qwen3MoeForCausalLM", "qwen3_moe", false, false},
};

const ArchInfo& arch_of(const GgufFile& g) {
  const std::string arch = g.get_str("general.architecture");
  for (const auto& a : kArchs) {
    if (arch == a.gguf) return a;
  }
  std::string known;
  for (const auto& a : kArchs) known += (known.empty() ? "" : ", ") + std::string(a.gguf);
  fail("{}: unsupported GGUF architecture {} (supported: {})", g.path(), arch, known);
}

// llama.cpp block tensor name -> Hugging Face name (relative to model.layers.N.).
std::string hf_block_name(const std::string& arch, const std::string& rest) {
  static const std::pair<const char*, const char*> kCommon[] = {
      {"attn_norm", "input_layernorm"},     {"attn_q", "self_attn.q_proj"},
      {"attn_k", "self_attn.k_proj"},       {"attn_v", "self_attn.v_proj"},
      {"attn_output", "self_attn.o_proj"},  {"attn_q_norm", "self_attn.q_norm"},
      {"attn_k_norm", "self_attn.k_norm"},  {"ffn_gate", "mlp.gate_proj"},
      {"ffn_up", "mlp.up_proj"},            {"ffn_down", "mlp.down_proj"},
      // Routed experts: the router, and llama.cpp's expert stacks [n_expert, rows, cols]
      // (one expert a contiguous slice), gate and up kept apart.
      {"ffn_gate_inp", "mlp.gate"},         {"ffn_gate_exps", "mlp.experts.gate_proj"},
      {"ffn_up_exps", "mlp.experts.up_proj"}, {"ffn_down_exps", "mlp.experts.down_proj"},
  };
  const size_t dot = rest.find('.');
  const std::string base = rest.substr(0, dot), suffix = dot == std::string::npos ? "" : rest.substr(dot);
  if (arch == "gemma3") {
    if (base == "ffn_norm") return "pre_feedforward_layernorm" + suffix;
    if (base == "post_attention_norm") return "post_attention_layernorm" + suffix;
    if (base == "post_ffw_norm") return "post_feedforward_layernorm" + suffix;
  } else if (base == "ffn_norm") {
    return "post_attention_layernorm" + suffix;
  }
  for (const auto& [g, h] : kCommon) {
    // Expert stacks carry no ".weight", as fused expert tensors in Hugging Face checkpoints.
    if (base == g) return h + (base.ends_with("_exps") && suffix == ".weight" ? "" : suffix);
  }
  return "";
}

}  // namespace

bool is_gguf_path(const std::string& path) {
  return path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0 && std::filesystem::is_regular_file(path);
}

std::vector<TensorInfo> gguf_hf_tensors(const GgufFile& g, std::vector<std::unique_ptr<uint8_t[]>>& owned) {
  const ArchInfo& arch = arch_of(g);
  const std::string a = arch.gguf;
  const int64_t n_head = g.get_u32(a + ".attention.head_count");
  const int64_t n_kv = g.get_u32(a + ".attention.head_count_kv", uint32_t(n_head));
  static const std::regex kBlock(R"(blk\.(\d+)\.(.+))");
  std::vector<TensorInfo> out;
  for (const GgufTensor& t : g.tensors()) {
    std::string name;
    std::smatch m;
    if (t.name == "token_embd.weight") name = "model.embed_tokens.weight";
    else if (t.name == "output_norm.weight") name = "model.norm.weight";
    else if (t.name == "output.weight") name = "lm_head.weight";
    else if (t.name == "rope_freqs.weight") continue;  // RoPE factors: only for rope types we refuse anyway
    else if (std::regex_match(t.name, m, kBlock)) {
      const std::string hf = hf_block_name(a, m[2].str());
      if (hf.empty()) fail("{}: tensor {} is not supported for architecture {}", g.path(), t.name, a);
      name = "model.layers." + m[1].str() + "." + hf;
    } else {
      fail("{}: tensor {} is not supported for architecture {}", g.path(), t.name, a);
    }
    TensorInfo info;
    info.name = name;
    info.dtype = t.dtype;
    for (auto it = t.dims.rbegin(); it != t.dims.rend(); ++it) info.shape.push_back(*it);
    info.data = t.data;
    info.nbytes = t.nbytes;
    info.file = &g.path();
    const bool is_q = name.ends_with("self_attn.q_proj.weight") || name.ends_with("self_attn.q_proj.bias");
    const bool is_k = name.ends_with("self_attn.k_proj.weight") || name.ends_with("self_attn.k_proj.bias");
    if (arch.permuted_qk && (is_q || is_k)) {
      // The converter reordered each head's rows from [first half, second half] to
      // interleaved pairs; put them back for rotate-half RoPE. Rows are whole blocks, so
      // this works for every quant type.
      const int64_t heads = is_q ? n_head : n_kv;
      const int64_t rows = info.shape[0];
      const int64_t row_bytes = int64_t(t.nbytes) / rows;
      const int64_t hd = rows / heads, half = hd / 2;
      auto buf = std::make_unique<uint8_t[]>(t.nbytes);
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t j = 0; j < 2; ++j) {
          for (int64_t i = 0; i < half; ++i) {
            std::memcpy(buf.get() + (h * hd + j * half + i) * row_bytes, t.data + (h * hd + 2 * i + j) * row_bytes,
                        size_t(row_bytes));
          }
        }
      }
      info.data = buf.get();
      owned.push_back(std::move(buf));
    }
    if (arch.norms_plus_one && name.ends_with("norm.weight")) {
      // Stored as 1 + w; the family applies (1 + w) itself.
      if (info.dtype != DType::F32) fail("{}: tensor {}: norm weights must be F32, got {}", g.path(), t.name, dtype_name(info.dtype));
      auto buf = std::make_unique<uint8_t[]>(t.nbytes);
      const float* src = reinterpret_cast<const float*>(t.data);
      float* dst = reinterpret_cast<float*>(buf.get());
      for (int64_t i = 0; i < t.numel(); ++i) dst[i] = src[i] - 1.f;
      info.data = buf.get();
      owned.push_back(std::move(buf));
    }
    out.push_back(std::move(info));
  }
  return out;
}

nlohmann::json gguf_hf_config(const GgufFile& g) {
  const ArchInfo& arch = arch_of(g);
  const std::string a = arch.gguf;
  nlohmann::json c;
  c["architectures"] = {arch.hf_arch};
  c["model_type"] = arch.model_type;
  const int64_t hidden = g.get_u32(a + ".embedding_length");
  const int64_t heads = g.get_u32(a + ".attention.head_count");
  int64_t vocab = 0;
  if (g.has(a + ".vocab_size")) vocab = g.get_u32(a + ".vocab_size");
  else if (g.has("tokenizer.ggml.tokens")) vocab = int64_t(g.get_str_arr("tokenizer.ggml.tokens").size());
  if (const GgufTensor* emb = g.find("token_embd.weight"); emb && emb->dims.size() == 2) vocab = emb->dims[1];
  c["vocab_size"] = vocab;
  c["hidden_size"] = hidden;
  if (g.has(a + ".expert_count")) {
    c["num_experts"] = g.get_u32(a + ".expert_count");
    c["num_experts_per_tok"] = g.get_u32(a + ".expert_used_count");
    c["moe_intermediate_size"] = g.get_u32(a + ".expert_feed_forward_length");
    // llama.cpp renormalizes the chosen experts' weights for qwen3moe (Qwen3-MoE's released
    // configs say norm_topk_prob true); a file that states otherwise is followed.
    c["norm_topk_prob"] = g.get_bool(a + ".expert_weights_norm", true);
  }
  c["intermediate_size"] = g.has(a + ".feed_forward_length") || !g.has(a + ".expert_feed_forward_length")
                               ? g.get_u32(a + ".feed_forward_length")
                               : g.get_u32(a + ".expert_feed_forward_length");
  c["num_hidden_layers"] = g.get_u32(a + ".block_count");
  c["num_attention_heads"] = heads;
  c["num_key_value_heads"] = g.get_u32(a + ".attention.head_count_kv", uint32_t(heads));
  const int64_t head_dim = g.get_u32(a + ".attention.key_length", uint32_t(hidden / heads));
  c["head_dim"] = head_dim;
  c["rms_norm_eps"] = g.get_f32(a + ".attention.layer_norm_rms_epsilon", 1e-6f);
  c["max_position_embeddings"] = g.get_u32(a + ".context_length", 4096);
  c["tie_word_embeddings"] = g.find("output.weight") == nullptr;
  if (g.has("tokenizer.ggml.eos_token_id")) c["eos_token_id"] = g.get_u32("tokenizer.ggml.eos_token_id");
  if (g.has("tokenizer.ggml.bos_token_id")) c["bos_token_id"] = g.get_u32("tokenizer.ggml.bos_token_id");
  const double theta = g.get_f32(a + ".rope.freq_base", 10000.f);
  const std::string scaling = g.get_str(a + ".rope.scaling.type", "none");
  const double factor = g.get_f32(a + ".rope.scaling.factor", 1.f);
  if (a == "gemma3") {
    // llama.cpp's Gemma 3: sliding layers use base 10000 unscaled, every 6th layer is global
    // with freq_base and the file's scaling; attention scale 1/sqrt(head_dim).
    c["sliding_window"] = g.get_u32(a + ".attention.sliding_window", 512);
    c["sliding_window_pattern"] = 6;
    c["query_pre_attn_scalar"] = head_dim;
    c["hidden_activation"] = "gelu_pytorch_tanh";
    nlohmann::json global = {{"rope_type", "default"}, {"rope_theta", theta}};
    if (scaling == "linear" && factor != 1.0) global = {{"rope_type", "linear"}, {"rope_theta", theta}, {"factor", factor}};
    else if (scaling != "none" && scaling != "linear") fail("{}: rope scaling {} is not supported", g.path(), scaling);
    const double swa_theta = g.get_f32(a + ".rope.freq_base_swa", 10000.f);
    c["rope_parameters"] = {{"full_attention", global},
                            {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", swa_theta}}}};
    if (g.has(a + ".final_logit_softcapping")) c["final_logit_softcapping"] = g.get_f32(a + ".final_logit_softcapping");
  } else {
    if (scaling != "none" && !(scaling == "linear" && factor == 1.0)) {
      fail("{}: rope scaling {} is not supported for {}", g.path(), scaling, a);
    }
    c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", theta}};
  }
  return c;
}

std::string gguf_chat_template(const GgufFile& g) { return g.get_str("tokenizer.chat_template", ""); }

}  // namespace turbospark
