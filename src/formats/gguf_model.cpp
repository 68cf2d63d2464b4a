#include "formats/gguf_model.h"

#include <fmt/format.h>

#include <cstring>
#include <filesystem>
#include <map>
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
    {"gpt-oss", "GptOssForCausalLM", "gpt_oss", false, false},
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
  if (arch == "gpt-oss") {
    // Its expert stacks are rebuilt in gguf_hf_tensors (gpt_oss_experts); the rest by name.
    if (base == "attn_sinks" && suffix == ".weight") return "self_attn.sinks";
    if (base == "post_attention_norm") return "post_attention_layernorm" + suffix;
    if (base == "ffn_gate_inp") return "mlp.router" + suffix;
    if (base.ends_with("_exps")) return "";
  }
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

// gpt-oss's expert stacks as transformers names them, rebuilt from llama.cpp's: the gate and up
// stacks [E, I, H] become one gate_up stack with their rows interleaved (even gate, odd up) and
// the biases likewise [E, 2I]. MXFP4 stacks (ggml blocks of { scale, 16 nibble bytes }) become
// the _blocks [E, out, in/32, 16] / _scales [E, out, in/32] planes, each block's nibbles put back
// in transformers' order (byte i: values 2i, 2i + 1; ggml: byte j holds j and j + 16); float
// stacks become [E, in, out] (transformers' x @ W layout, which the model transposes back).
// A one-time copy into `owned` at load: these experts are resident, not streamed from the file.
class GptOssExperts {
 public:
  GptOssExperts(const GgufFile& g, std::vector<std::unique_ptr<uint8_t[]>>& owned) : g_(g), owned_(owned) {}

  void add(const std::string& layer, const std::string& base, const std::string& suffix, const GgufTensor& t) {
    Stack& st = layers_[layer];
    if (suffix == ".weight") {
      (base == "ffn_gate_exps" ? st.gate : base == "ffn_up_exps" ? st.up : st.down) = &t;
    } else if (suffix == ".bias") {
      (base == "ffn_gate_exps" ? st.gate_bias : base == "ffn_up_exps" ? st.up_bias : st.down_bias) = &t;
    } else {
      fail("{}: tensor {} is not supported for architecture gpt-oss", g_.path(), t.name);
    }
  }

  void emit(std::vector<TensorInfo>& out) {
    for (const auto& [layer, st] : layers_) {
      for (const GgufTensor* t : {st.gate, st.up, st.down, st.gate_bias, st.up_bias, st.down_bias})
        if (!t) fail("{}: layer {} lacks one of ffn_{{gate,up,down}}_exps.{{weight,bias}}", g_.path(), layer);
      const std::string p = "model.layers." + layer + ".mlp.experts.";
      const bool mxfp4 = st.gate->ggml_type == kGgmlMxfp4;
      if ((st.up->ggml_type == kGgmlMxfp4) != mxfp4 || (st.down->ggml_type == kGgmlMxfp4) != mxfp4 ||
          (!mxfp4 && (st.gate->dtype != st.up->dtype || st.gate->dtype != st.down->dtype)))
        fail("{}: layer {}: expert stacks of different types ({}, {}, {})", g_.path(), layer,
             ggml_type_name(st.gate->ggml_type), ggml_type_name(st.up->ggml_type), ggml_type_name(st.down->ggml_type));
      const int64_t H = dim(*st.gate, 0), I = dim(*st.gate, 1), E = dim(*st.gate, 2);
      if (st.up->dims != st.gate->dims)
        fail("{}: {}: dims {} differ from {}'s {}", g_.path(), st.up->name, st.up->dims_str(), st.gate->name,
             st.gate->dims_str());
      if (st.down->dims != std::vector<int64_t>{I, H, E})
        fail("{}: {}: dims {} where [{}, {}, {}] is expected", g_.path(), st.down->name, st.down->dims_str(), I, H, E);
      if (mxfp4) {
        planes(p + "gate_up_proj", {st.gate, st.up}, E, I, H, out);
        planes(p + "down_proj", {st.down}, E, H, I, out);
      } else {
        floats_in_out(p + "gate_up_proj", *st.gate, st.up, E, I, H, out);
        floats_in_out(p + "down_proj", *st.down, nullptr, E, H, I, out);
      }
      interleaved_bias(p + "gate_up_proj_bias", *st.gate_bias, *st.up_bias, E, I, out);
      check_bias(*st.down_bias, H, E);
      out.push_back(as_is(p + "down_proj_bias", *st.down_bias, {E, H}));
    }
  }

 private:
  struct Stack {
    const GgufTensor *gate = nullptr, *up = nullptr, *down = nullptr;
    const GgufTensor *gate_bias = nullptr, *up_bias = nullptr, *down_bias = nullptr;
  };

  int64_t dim(const GgufTensor& t, size_t i) const {
    if (t.dims.size() != 3) fail("{}: {}: dims {} where [in, out, experts] is expected", g_.path(), t.name, t.dims_str());
    return t.dims[i];
  }
  uint8_t* buffer(size_t n) {
    owned_.push_back(std::make_unique<uint8_t[]>(n));
    return owned_.back().get();
  }
  TensorInfo info(const std::string& name, DType dtype, std::vector<int64_t> shape, const uint8_t* data, size_t n) {
    TensorInfo t;
    t.name = name;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.data = data;
    t.nbytes = n;
    t.file = &g_.path();
    return t;
  }
  TensorInfo as_is(const std::string& name, const GgufTensor& t, std::vector<int64_t> shape) {
    return info(name, t.dtype, std::move(shape), t.data, t.nbytes);
  }

  // One ggml block into transformers' 16 nibble bytes.
  static void unshuffle(const uint8_t* qs, uint8_t* dst) {
    uint8_t v[32];
    for (int j = 0; j < 16; ++j) v[j] = qs[j] & 0x0f, v[j + 16] = qs[j] >> 4;
    for (int i = 0; i < 16; ++i) dst[i] = uint8_t(v[2 * i] | (v[2 * i + 1] << 4));
  }
  // Rows of `srcs` (each [E, rows, cols] in ggml blocks) interleaved row by row into planes.
  void planes(const std::string& stem, std::vector<const GgufTensor*> srcs, int64_t E, int64_t rows, int64_t cols,
              std::vector<TensorInfo>& out) {
    const int64_t nb = cols / int64_t(kGgmlMxfp4Block), n = int64_t(srcs.size());
    const size_t src_row = size_t(nb) * kGgmlMxfp4BlockBytes;
    uint8_t* blocks = buffer(size_t(E * n * rows * nb * 16));
    uint8_t* scales = buffer(size_t(E * n * rows * nb));
    for (int64_t e = 0; e < E; ++e)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t s = 0; s < n; ++s) {
          const int64_t row = (e * rows + r) * n + s;  // the output row
          const uint8_t* src = srcs[size_t(s)]->data + size_t(e * rows + r) * src_row;
          for (int64_t b = 0; b < nb; ++b) {
            scales[row * nb + b] = src[size_t(b) * kGgmlMxfp4BlockBytes];
            unshuffle(src + size_t(b) * kGgmlMxfp4BlockBytes + 1, blocks + (row * nb + b) * 16);
          }
        }
    out.push_back(info(stem + "_blocks", DType::U8, {E, n * rows, nb, 16}, blocks, size_t(E * n * rows * nb * 16)));
    out.push_back(info(stem + "_scales", DType::U8, {E, n * rows, nb}, scales, size_t(E * n * rows * nb)));
  }
  // [E, rows, cols] stacks ([out, in], `up` interleaved with `a` when given) into [E, cols, n * rows].
  void floats_in_out(const std::string& name, const GgufTensor& a, const GgufTensor* up, int64_t E, int64_t rows,
                     int64_t cols, std::vector<TensorInfo>& out) {
    if (a.dtype != DType::BF16 && a.dtype != DType::F16 && a.dtype != DType::F32)
      fail("{}: {}: gpt-oss experts of type {} are not supported (MXFP4, BF16, F16 or F32)", g_.path(), a.name,
           dtype_name(a.dtype));
    const size_t es = dtype_size(a.dtype);
    const int64_t n = up ? 2 : 1;
    uint8_t* dst = buffer(size_t(E * rows * cols * n) * es);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t s = 0; s < n; ++s) {
        const uint8_t* src = (s == 0 ? a : *up).data + size_t(e * rows * cols) * es;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < cols; ++c)
            std::memcpy(dst + size_t((e * cols + c) * n * rows + r * n + s) * es, src + size_t(r * cols + c) * es, es);
      }
    out.push_back(info(name, a.dtype, {E, cols, n * rows}, dst, size_t(E * rows * cols * n) * es));
  }
  void check_bias(const GgufTensor& t, int64_t n, int64_t E) const {
    if (t.dtype != DType::F32 || t.dims != std::vector<int64_t>{n, E})
      fail("{}: {}: {} {} where F32 [{}, {}] is expected", g_.path(), t.name, dtype_name(t.dtype), t.dims_str(), n, E);
  }
  void interleaved_bias(const std::string& name, const GgufTensor& gate, const GgufTensor& up, int64_t E, int64_t I,
                        std::vector<TensorInfo>& out) {
    check_bias(gate, I, E);
    check_bias(up, I, E);
    auto* dst = reinterpret_cast<float*>(buffer(size_t(E * 2 * I) * 4));
    const auto* g = reinterpret_cast<const float*>(gate.data);
    const auto* u = reinterpret_cast<const float*>(up.data);
    for (int64_t k = 0; k < E * I; ++k) dst[2 * k] = g[k], dst[2 * k + 1] = u[k];
    out.push_back(info(name, DType::F32, {E, 2 * I}, reinterpret_cast<const uint8_t*>(dst), size_t(E * 2 * I) * 4));
  }

  const GgufFile& g_;
  std::vector<std::unique_ptr<uint8_t[]>>& owned_;
  std::map<std::string, Stack> layers_;
};

}  // namespace

bool is_gguf_path(const std::string& path) {
  return path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0 && std::filesystem::is_regular_file(path);
}

std::vector<TensorInfo> gguf_hf_tensors(const GgufFile& g, std::vector<std::unique_ptr<uint8_t[]>>& owned) {
  const ArchInfo& arch = arch_of(g);
  const std::string a = arch.gguf;
  const int64_t n_head = g.get_u32(a + ".attention.head_count");
  const int64_t n_kv = g.get_u32(a + ".attention.head_count_kv", uint32_t(n_head));
  if (n_head <= 0 || n_kv <= 0)
    fail("{}: {}.attention.head_count {} / head_count_kv {} must be positive", g.path(), a, n_head, n_kv);
  static const std::regex kBlock(R"(blk\.(\d+)\.(.+))");
  std::vector<TensorInfo> out;
  GptOssExperts gpt_oss(g, owned);
  for (const GgufTensor& t : g.tensors()) {
    std::string name;
    std::smatch m;
    if (a == "gpt-oss" && std::regex_match(t.name, m, kBlock)) {
      const std::string rest = m[2].str();
      const size_t dot = rest.find('.');
      const std::string base = rest.substr(0, dot);
      if (base == "ffn_gate_exps" || base == "ffn_up_exps" || base == "ffn_down_exps") {
        gpt_oss.add(m[1].str(), base, dot == std::string::npos ? "" : rest.substr(dot), t);
        continue;
      }
    }
    if (t.ggml_type == kGgmlMxfp4)
      fail("{}: tensor {}: ggml MXFP4 is supported for gpt-oss expert stacks only", g.path(), t.name);
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
      if (rows <= 0 || rows % (2 * heads) != 0)
        fail("{}: tensor {}: {} rows are not {} heads of an even size", g.path(), t.name, rows, heads);
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
  gpt_oss.emit(out);
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
  if (heads <= 0) fail("{}: {}.attention.head_count must be positive, got {}", g.path(), a, heads);
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
  // Every block has tensors of its own: a count past the file's tensors is refused before a
  // model sizes anything by it.
  const int64_t layers = g.get_u32(a + ".block_count");
  if (layers < 1 || layers > int64_t(g.tensors().size()))
    fail("{}: {}.block_count {} is not between 1 and the file's {} tensors", g.path(), a, layers, g.tensors().size());
  c["num_hidden_layers"] = layers;
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
  } else if (a == "gpt-oss") {
    // llama.cpp's gpt-oss: experts of expert_feed_forward_length, sliding window on even layers
    // (its swa pattern 2), YaRN as the file states it. transformers' gpt-oss computes YaRN's
    // correction range without rounding it to whole dims (rope_parameters.truncate false), which
    // a GGUF cannot state; this follows transformers (llama.cpp's runtime rounds it).
    c.erase("num_experts");
    c.erase("moe_intermediate_size");
    c.erase("norm_topk_prob");
    c["num_local_experts"] = g.get_u32(a + ".expert_count");
    c["intermediate_size"] = g.get_u32(a + ".expert_feed_forward_length");
    c["attention_bias"] = true;
    if (g.has(a + ".attention.sliding_window")) {
      c["sliding_window"] = g.get_u32(a + ".attention.sliding_window");
      nlohmann::json types = nlohmann::json::array();
      for (int64_t i = 0; i < layers; ++i) types.push_back(i % 2 == 0 ? "sliding_attention" : "full_attention");
      c["layer_types"] = types;
    } else {
      c["layer_types"] = nlohmann::json(std::vector<std::string>(size_t(layers), "full_attention"));
    }
    if (scaling == "yarn") {
      c["rope_parameters"] = {{"rope_type", "yarn"},
                              {"rope_theta", theta},
                              {"factor", factor},
                              {"original_max_position_embeddings", g.get_u32(a + ".rope.scaling.original_context_length")},
                              {"beta_fast", g.get_f32(a + ".rope.scaling.yarn_beta_fast", 32.f)},
                              {"beta_slow", g.get_f32(a + ".rope.scaling.yarn_beta_slow", 1.f)},
                              {"truncate", false}};
    } else if (scaling == "none" || (scaling == "linear" && factor == 1.0)) {
      c["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", theta}};
    } else {
      fail("{}: rope scaling {} is not supported for {}", g.path(), scaling, a);
    }
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
