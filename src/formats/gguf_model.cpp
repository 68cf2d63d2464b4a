#include "formats/gguf_model.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <regex>
#include <thread>

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
    // Its (1 + w) norms, stored plus one, are undone in Qwen4ExpTensors (not the GatedDeltaNet's).
    {"qwen4exp", "Qwen4ExpForCausalLM", "qwen4_exp_text", false, false},
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

// Tensors a mapping builds: views into the file, or data it rewrote into `owned` at load.
class TensorBuilder {
 protected:
  TensorBuilder(const GgufFile& g, std::vector<std::unique_ptr<uint8_t[]>>& owned) : g_(g), owned_(owned) {}
  uint8_t* buffer(size_t n) {
    owned_.push_back(std::make_unique<uint8_t[]>(n));
    return owned_.back().get();
  }
  TensorInfo info(const std::string& name, DType dtype, std::vector<int64_t> shape, const uint8_t* data, size_t n) const {
    TensorInfo t;
    t.name = name;
    t.dtype = dtype;
    t.shape = std::move(shape);
    t.data = data;
    t.nbytes = n;
    t.file = &g_.path();
    return t;
  }

  const GgufFile& g_;
  std::vector<std::unique_ptr<uint8_t[]>>& owned_;
};

// gpt-oss's expert stacks as transformers names them, rebuilt from llama.cpp's: the gate and up
// stacks [E, I, H] become one gate_up stack with their rows interleaved (even gate, odd up) and
// the biases likewise [E, 2I]. MXFP4 stacks (ggml blocks of { scale, 16 nibble bytes }) become
// the _blocks [E, out, in/32, 16] / _scales [E, out, in/32] planes, each block's nibbles put back
// in transformers' order (byte i: values 2i, 2i + 1; ggml: byte j holds j and j + 16); float
// stacks become [E, in, out] (transformers' x @ W layout, which the model transposes back).
// A one-time copy into `owned` at load: these experts are resident, not streamed from the file.
class GptOssExperts : TensorBuilder {
 public:
  GptOssExperts(const GgufFile& g, std::vector<std::unique_ptr<uint8_t[]>>& owned) : TensorBuilder(g, owned) {}

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
  TensorInfo as_is(const std::string& name, const GgufTensor& t, std::vector<int64_t> shape) {
    return info(name, t.dtype, std::move(shape), t.data, t.nbytes);
  }

  // One ggml block (byte j: element j low nibble, j + 16 high) into transformers' 16 bytes
  // (byte i: elements 2i, 2i + 1), eight bytes at a time: the low (or high) nibbles of eight
  // code bytes pair up within each 16-bit lane, and the lanes' low bytes are packed.
  static uint32_t pair_nibbles(uint64_t nibbles) {  // nibbles: one value 0..15 a byte
    uint64_t x = (nibbles | (nibbles >> 4)) & 0x00FF00FF00FF00FFull;
    x = (x | (x >> 8)) & 0x0000FFFF0000FFFFull;
    return uint32_t(x | (x >> 16));
  }
  static void unshuffle(const uint8_t* qs, uint8_t* dst) {
    uint64_t a, b;
    std::memcpy(&a, qs, 8);
    std::memcpy(&b, qs + 8, 8);
    constexpr uint64_t kLow = 0x0F0F0F0F0F0F0F0Full;
    const uint32_t words[4] = {pair_nibbles(a & kLow), pair_nibbles(b & kLow), pair_nibbles((a >> 4) & kLow),
                               pair_nibbles((b >> 4) & kLow)};
    std::memcpy(dst, words, 16);
  }
  // Rows of `srcs` (each [E, rows, cols] in ggml blocks) interleaved row by row into planes, the
  // experts spread over the host's cores (gpt-oss-20b: 10 GB of expert stacks, 33 s to load on
  // one core of the H100 machine).
  void planes(const std::string& stem, std::vector<const GgufTensor*> srcs, int64_t E, int64_t rows, int64_t cols,
              std::vector<TensorInfo>& out) {
    const int64_t nb = cols / int64_t(kGgmlMxfp4Block), n = int64_t(srcs.size());
    const size_t src_row = size_t(nb) * kGgmlMxfp4BlockBytes;
    uint8_t* blocks = buffer(size_t(E * n * rows * nb * 16));
    uint8_t* scales = buffer(size_t(E * n * rows * nb));
    auto expert = [&](int64_t e) {
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t s = 0; s < n; ++s) {
          const int64_t row = (e * rows + r) * n + s;  // the output row
          const uint8_t* src = srcs[size_t(s)]->data + size_t(e * rows + r) * src_row;
          for (int64_t b = 0; b < nb; ++b) {
            scales[row * nb + b] = src[size_t(b) * kGgmlMxfp4BlockBytes];
            unshuffle(src + size_t(b) * kGgmlMxfp4BlockBytes + 1, blocks + (row * nb + b) * 16);
          }
        }
    };
    const int64_t n_threads = std::clamp<int64_t>(std::thread::hardware_concurrency(), 1, E);
    std::vector<std::thread> workers;
    for (int64_t w = 1; w < n_threads; ++w)
      workers.emplace_back([&, w] {
        for (int64_t e = w; e < E; e += n_threads) expert(e);
      });
    for (int64_t e = 0; e < E; e += n_threads) expert(e);
    for (std::thread& t : workers) t.join();
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

  std::map<std::string, Stack> layers_;
};

// llama.cpp's qwen4exp files (its converter's conversion/qwen4exp.py) under transformers'
// Qwen4ExpForCausalLM names. What the converter did to the weights is undone here or told to
// the model:
//  - every (1 + w) norm (hyper-connections, q/k, indexer, PLE) was stored as 1 + w: minus 1,
//    exact in f32; the GatedDeltaNet's gated norm (plain w) is kept;
//  - A_log was stored as A = -exp(A_log): log(-A) in f32 (within an ulp of the checkpoint's);
//  - the indexer's fused q/k projection was split into indexer.{q,k}_proj: rows joined again;
//  - the conv1d kernels lost their middle dim: back to [C, 1, K];
//  - the n-gram table's shards became one per_layer_token_embd table: it is the one table of
//    the (single) PLE layer, its hashing constants read from the metadata (gguf_hf_config);
//  - GatedDeltaNet value heads were reordered from grouped to tiled in every value-head-indexed
//    tensor: kept as stored (no copy, any quant type) and the model runs them tiled
//    (config linear_value_heads_tiled).
class Qwen4ExpTensors : TensorBuilder {
 public:
  Qwen4ExpTensors(const GgufFile& g, std::vector<std::unique_ptr<uint8_t[]>>& owned) : TensorBuilder(g, owned) {
    if (g.has("qwen4exp.ple.layers")) {
      const auto layers = g.get_int_arr("qwen4exp.ple.layers");
      if (layers.size() == 1) ple_layer_ = layers[0];
    }
  }

  // False when `t` is not one of this architecture's tensors.
  bool add(const GgufTensor& t, std::vector<TensorInfo>& out) {
    static const std::regex kBlock(R"(blk\.(\d+)\.(.+))");
    std::smatch m;
    if (t.name == "token_embd.weight") {
      out.push_back(as_is("model.embed_tokens.weight", t));
      if (!g_.find("output.weight")) out.push_back(as_is("lm_head.weight", t));  // tied
      return true;
    }
    if (t.name == "output.weight") return out.push_back(as_is("lm_head.weight", t)), true;
    if (t.name == "output_hc_norm.weight") return out.push_back(minus_one("model.hyper_connection_mixer.hc_norm.weight", t)), true;
    if (t.name == "output_hc_down.weight")
      return out.push_back(as_is("model.hyper_connection_mixer.input_mix_weight_down.weight", t)), true;
    if (t.name == "output_hc_up.weight")
      return out.push_back(as_is("model.hyper_connection_mixer.input_mix_weight_up.weight", t)), true;
    if (t.name == "per_layer_token_embd.weight") {
      if (ple_layer_ < 0) fail("{}: tensor {} without qwen4exp.ple.layers naming its one layer", g_.path(), t.name);
      return out.push_back(as_is(fmt::format("model.layers.{}.ple.ple_embedding.ngram_embedding.weight", ple_layer_), t)), true;
    }
    if (!std::regex_match(t.name, m, kBlock)) return false;
    const std::string layer = m[1].str(), rest = m[2].str(), p = "model.layers." + layer + ".";
    static const std::map<std::string, std::string> kAsIs = {
        {"hc_attn_down.weight", "attn_hyper_connection.input_mix_weight_down.weight"},
        {"hc_attn_up.weight", "attn_hyper_connection.input_mix_weight_up.weight"},
        {"hc_attn_inject.weight", "attn_hyper_connection.block_inject_weight.weight"},
        {"hc_ffn_down.weight", "mlp_hyper_connection.input_mix_weight_down.weight"},
        {"hc_ffn_up.weight", "mlp_hyper_connection.input_mix_weight_up.weight"},
        {"hc_ffn_inject.weight", "mlp_hyper_connection.block_inject_weight.weight"},
        {"ssm_dt.bias", "linear_attn.dt_bias"},
        {"ssm_alpha.weight", "linear_attn.in_proj_a.weight"},
        {"ssm_beta.weight", "linear_attn.in_proj_b.weight"},
        {"attn_qkv.weight", "linear_attn.in_proj_qkv.weight"},
        {"attn_gate.weight", "linear_attn.in_proj_z.weight"},
        {"ssm_norm.weight", "linear_attn.norm.weight"},
        {"ssm_out.weight", "linear_attn.out_proj.weight"},
        {"attn_q.weight", "self_attn.q_proj.weight"},
        {"attn_k.weight", "self_attn.k_proj.weight"},
        {"attn_v.weight", "self_attn.v_proj.weight"},
        {"attn_output.weight", "self_attn.o_proj.weight"},
        {"ffn_gate_inp.weight", "mlp.gate.weight"},
        {"ffn_gate_exps.weight", "mlp.experts.gate_proj"},
        {"ffn_up_exps.weight", "mlp.experts.up_proj"},
        {"ffn_down_exps.weight", "mlp.experts.down_proj"},
        {"ffn_gate_shexp.weight", "mlp.shared_expert.gate_proj.weight"},
        {"ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"},
        {"ffn_down_shexp.weight", "mlp.shared_expert.down_proj.weight"},
        {"ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"},
        {"ple_key.weight", "ple.key_proj.weight"},
        {"ple_value.weight", "ple.value_proj.weight"},
    };
    static const std::map<std::string, std::string> kPlusOne = {
        {"hc_attn_norm.weight", "attn_hyper_connection.hc_norm.weight"},
        {"hc_ffn_norm.weight", "mlp_hyper_connection.hc_norm.weight"},
        {"attn_q_norm.weight", "self_attn.q_norm.weight"},
        {"attn_k_norm.weight", "self_attn.k_norm.weight"},
        {"indexer.q_norm.weight", "self_attn.indexer.q_layernorm.weight"},
        {"indexer.k_norm.weight", "self_attn.indexer.k_layernorm.weight"},
        {"ple_norm_key.weight", "ple.norm_key.weight"},
        {"ple_norm_query.weight", "ple.norm_query.weight"},
        {"ple_norm_conv.weight", "ple.norm_conv.weight"},
    };
    if (auto it = kAsIs.find(rest); it != kAsIs.end()) return out.push_back(as_is(p + it->second, t)), true;
    if (auto it = kPlusOne.find(rest); it != kPlusOne.end()) return out.push_back(minus_one(p + it->second, t)), true;
    if (rest == "ssm_a") return out.push_back(a_log(p + "linear_attn.A_log", t)), true;
    if (rest == "ssm_conv1d.weight") return out.push_back(conv(p + "linear_attn.conv1d.weight", t)), true;
    if (rest == "ple_conv1d.weight") return out.push_back(conv(p + "ple.conv1d.weight", t)), true;
    if (rest == "indexer.q_proj.weight" || rest == "indexer.k_proj.weight") {
      (rest.starts_with("indexer.q") ? index_q_ : index_k_)[layer] = &t;
      return true;
    }
    return false;
  }

  // The indexer's q and k rows joined into transformers' index_qk_proj (q heads first).
  void emit(std::vector<TensorInfo>& out) {
    for (const auto& [layer, q] : index_q_) {
      auto k = index_k_.find(layer);
      if (k == index_k_.end()) fail("{}: blk.{}.indexer.q_proj.weight without its indexer.k_proj.weight", g_.path(), layer);
      const GgufTensor& kt = *k->second;
      if (q->dtype != kt.dtype || q->dims.size() != 2 || kt.dims.size() != 2 || q->dims[0] != kt.dims[0])
        fail("{}: {} ({} {}) and {} ({} {}) cannot be joined into one projection", g_.path(), q->name,
             dtype_name(q->dtype), q->dims_str(), kt.name, dtype_name(kt.dtype), kt.dims_str());
      uint8_t* dst = buffer(q->nbytes + kt.nbytes);
      std::memcpy(dst, q->data, q->nbytes);
      std::memcpy(dst + q->nbytes, kt.data, kt.nbytes);
      out.push_back(info("model.layers." + layer + ".self_attn.indexer.index_qk_proj.weight", q->dtype,
                         {q->dims[1] + kt.dims[1], q->dims[0]}, dst, q->nbytes + kt.nbytes));
    }
    for (const auto& [layer, k] : index_k_)
      if (!index_q_.count(layer)) fail("{}: {} without its indexer.q_proj.weight", g_.path(), k->name);
  }

 private:
  TensorInfo as_is(const std::string& name, const GgufTensor& t) const {
    return info(name, t.dtype, std::vector<int64_t>(t.dims.rbegin(), t.dims.rend()), t.data, t.nbytes);
  }
  const float* f32(const GgufTensor& t, size_t dims) const {
    if (t.dtype != DType::F32 || t.dims.size() != dims)
      fail("{}: tensor {}: {} {} where F32 with {} dims is expected", g_.path(), t.name, dtype_name(t.dtype), t.dims_str(), dims);
    return reinterpret_cast<const float*>(t.data);
  }
  TensorInfo minus_one(const std::string& name, const GgufTensor& t) {
    const float* src = f32(t, 1);
    auto* dst = reinterpret_cast<float*>(buffer(t.nbytes));
    for (int64_t i = 0; i < t.numel(); ++i) dst[i] = src[i] - 1.f;
    return info(name, DType::F32, {t.dims[0]}, reinterpret_cast<const uint8_t*>(dst), t.nbytes);
  }
  TensorInfo a_log(const std::string& name, const GgufTensor& t) {
    const float* src = f32(t, 1);
    auto* dst = reinterpret_cast<float*>(buffer(t.nbytes));
    for (int64_t i = 0; i < t.numel(); ++i) {
      // A = -exp(A_log) is negative and finite; anything else was not written by the converter.
      if (!(src[i] < 0.f) || !std::isfinite(src[i]))
        fail("{}: tensor {}[{}] = {} where a negative decay rate -exp(A_log) is expected", g_.path(), t.name, i, src[i]);
      dst[i] = float(std::log(-double(src[i])));
    }
    return info(name, DType::F32, {t.dims[0]}, reinterpret_cast<const uint8_t*>(dst), t.nbytes);
  }
  TensorInfo conv(const std::string& name, const GgufTensor& t) const {
    if (t.dims.size() != 2) fail("{}: tensor {}: dims {} where [kernel, channels] is expected", g_.path(), t.name, t.dims_str());
    return info(name, t.dtype, {t.dims[1], 1, t.dims[0]}, t.data, t.nbytes);
  }

  int64_t ple_layer_ = -1;
  std::map<std::string, const GgufTensor*> index_q_, index_k_;
};

// Qwen4-Exp's config from a qwen4exp file's metadata (`c` holds the shared fields). What the
// format cannot state is what llama.cpp's runtime assumes (a sigmoid output gate on the
// GatedDeltaNet norm, renormalized top-k weights); what it states that the model cannot run is
// refused by name.
void qwen4exp_config(const GgufFile& g, int64_t layers, nlohmann::json& c) {
  const std::string a = "qwen4exp.";
  const std::string& path = g.path();
  c["model_type"] = "qwen4_exp_text";
  c["hidden_act"] = "silu";
  c["output_gate_type"] = "sigmoid";
  c["tie_word_embeddings"] = false;  // lm_head is given the embedding's tensor instead
  c["attention_bias"] = false;
  const int64_t head_dim = c["head_dim"].get<int64_t>();
  if (g.get_u32(a + "attention.value_length", uint32_t(head_dim)) != head_dim)
    fail("{}: {}attention.value_length {} differs from key_length {}; Qwen4-Exp attention has one head size", path, a,
         g.get_u32(a + "attention.value_length"), head_dim);
  if (!g.get_bool(a + "expert_weights_norm", true))
    fail("{}: {}expert_weights_norm false: llama.cpp's qwen4exp always renormalizes the chosen experts' weights, so "
         "the file cannot mean it", path, a);
  c["norm_topk_prob"] = true;
  c["shared_expert_intermediate_size"] = g.get_u32(a + "expert_shared_feed_forward_length");
  c["hc_count"] = g.get_u32(a + "hyper_connection.count");
  c["hc_lowrank"] = g.get_u32(a + "hyper_connection.low_rank");

  // RoPE: partial (dimension_count of head_dim); the mRoPE sections coincide for text positions.
  const std::string scaling = g.get_str(a + "rope.scaling.type", "none");
  if (scaling != "none" && !(scaling == "linear" && g.get_f32(a + "rope.scaling.factor", 1.f) == 1.f))
    fail("{}: rope scaling {} is not supported for qwen4exp", path, scaling);
  const int64_t rot = g.get_u32(a + "rope.dimension_count", uint32_t(head_dim));
  if (rot <= 0 || rot > head_dim || rot % 2)
    fail("{}: {}rope.dimension_count {} for heads of {}", path, a, rot, head_dim);
  c["rope_parameters"] = {{"rope_type", "default"},
                          {"rope_theta", g.get_f32(a + "rope.freq_base", 10000.f)},
                          {"partial_rotary_factor", double(rot) / double(head_dim)}};

  // GatedDeltaNet: key heads (group_count) of state_size, value heads (time_step_rank) of
  // inner_size / time_step_rank, in llama.cpp's tiled value order.
  const int64_t nk = g.get_u32(a + "ssm.group_count"), nv = g.get_u32(a + "ssm.time_step_rank");
  const int64_t inner = g.get_u32(a + "ssm.inner_size");
  if (nk <= 0 || nv <= 0 || nv % nk || inner % nv)
    fail("{}: {}ssm.group_count {}, time_step_rank {} and inner_size {} are not key heads, value heads and their "
         "width", path, a, nk, nv, inner);
  c["linear_num_key_heads"] = nk;
  c["linear_num_value_heads"] = nv;
  c["linear_key_head_dim"] = g.get_u32(a + "ssm.state_size");
  c["linear_value_head_dim"] = inner / nv;
  c["linear_conv_kernel_dim"] = g.get_u32(a + "ssm.conv_kernel");
  c["linear_value_heads_tiled"] = true;

  // Layer types: recurrent layers are GatedDeltaNet; the others QSA, whose compress ratio the
  // file must state. llama.cpp's converter writes 0 for layers its config names other than
  // full_attention (transformers 5.17 renames them qwen_sparse_attention on load, later versions
  // indexed_attention), and llama.cpp then runs them as dense attention, which differs from QSA
  // once the context passes the indexer's budget: refused here rather than guessed.
  std::vector<bool> recurrent;
  if (g.has(a + "attention.recurrent_layers")) {
    for (const auto& v : g.find_value(a + "attention.recurrent_layers")->as_array(path + ": " + a + "attention.recurrent_layers"))
      recurrent.push_back(v.as_bool(path + ": " + a + "attention.recurrent_layers element"));
  } else {
    const int64_t interval = g.get_u32(a + "full_attention_interval", 4);
    if (interval <= 0) fail("{}: {}full_attention_interval must be positive", path, a);
    for (int64_t i = 0; i < layers; ++i) recurrent.push_back((i + 1) % interval != 0);
  }
  if (int64_t(recurrent.size()) < layers)
    fail("{}: {}attention.recurrent_layers has {} entries for {} layers", path, a, recurrent.size(), layers);
  std::vector<int64_t> ratios(size_t(layers), 0);
  if (g.has(a + "attention.compress_ratios")) {
    const auto r = g.get_int_arr(a + "attention.compress_ratios");
    for (size_t i = 0; i < r.size() && i < ratios.size(); ++i) ratios[i] = r[i];
  }
  nlohmann::json types = nlohmann::json::array();
  int64_t ratio = 0;
  for (int64_t i = 0; i < layers; ++i) {
    if (recurrent[size_t(i)]) {
      types.push_back("linear_attention");
      continue;
    }
    const int64_t r = ratios[size_t(i)];
    if (r <= 0)
      fail("{}: layer {} is an attention layer without a QSA compress ratio ({}attention.compress_ratios[{}] = {}); "
           "Qwen4-Exp has no dense attention layers. llama.cpp's converter writes 0 when its config names the QSA "
           "layers other than full_attention (transformers renames them qwen_sparse_attention or indexed_attention on "
           "load): convert from config.json as released", path, i, a, i, r);
    if (ratio && r != ratio) fail("{}: QSA layers with compress ratios {} and {}: Qwen4-Exp has one", path, ratio, r);
    ratio = r;
    types.push_back("qwen_sparse_attention");
  }
  c["layer_types"] = types;
  if (ratio) {
    c["indexer_n_heads"] = g.get_u32(a + "attention.indexer.head_count");
    c["indexer_head_dim"] = g.get_u32(a + "attention.indexer.key_length");
    c["indexer_budget"] = g.get_u32(a + "attention.indexer.top_k");
    c["indexer_compress_ratio"] = ratio;
    c["indexer_kv_heads"] = 1;
  }

  // n-gram PLE: one layer (llama.cpp holds one set of hashing constants), the constants stated.
  if (g.has(a + "ple.layers")) {
    const auto ple = g.get_int_arr(a + "ple.layers");
    if (ple.size() > 1) fail("{}: {}ple.layers lists {} layers; llama.cpp's qwen4exp holds one", path, a, ple.size());
    if (ple.size() == 1) {
      if (ple[0] < 0 || ple[0] >= layers) fail("{}: {}ple.layers names layer {} of {}", path, a, ple[0], layers);
      const int64_t ngram = g.get_u32(a + "ple.ngram_size"), per = g.get_u32(a + "ple.heads_per_ngram");
      const int64_t row = g.get_u32(a + "embedding_length_per_layer_input");
      // Bounds far past any real model's (3, 8, 256) keep the products below meaningful.
      if (ngram < 2 || ngram > 64 || per < 1 || per > 1024 || row < 1 || row > (1 << 20))
        fail("{}: {}ple.ngram_size {}, heads_per_ngram {} and embedding_length_per_layer_input {} do not make n-gram "
             "heads (2..64, 1..1024, 1..2^20)", path, a, ngram, per, row);
      c["ple_layer_ids"] = {ple[0] + 1};
      c["ngram_size"] = ngram;
      c["heads_per_ngram"] = per;
      c["ple_embed_dim"] = row * (ngram - 1) * per;
      c["ple_conv_kernel_size"] = g.get_u32(a + "ple.conv_kernel");
      auto u64s = [&](const std::string& key) {
        std::vector<uint64_t> v;
        for (const auto& x : g.find_value(key)->as_array(path + ": " + key)) v.push_back(x.as_u64(path + ": " + key + " element"));
        return v;
      };
      for (const char* key : {"ple.layer_multipliers", "ple.head_offsets", "ple.head_vocab_sizes"})
        if (!g.has(a + key)) fail("{}: metadata {}{} is missing", path, a, key);
      c["ple_hash_constants"] = {{"layer_multipliers", u64s(a + "ple.layer_multipliers")},
                                 {"head_offsets", u64s(a + "ple.head_offsets")},
                                 {"head_vocab_sizes", u64s(a + "ple.head_vocab_sizes")}};
      // The n-gram context resets on this id; the tokenizer's EOS stops generation.
      const int64_t eos = g.get_u32(a + "ple.eos_token_id");
      nlohmann::json ids = {eos};
      if (g.has("tokenizer.ggml.eos_token_id") && g.get_u32("tokenizer.ggml.eos_token_id") != eos)
        ids.push_back(g.get_u32("tokenizer.ggml.eos_token_id"));
      c["eos_token_id"] = ids;
    }
  }
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
  if (n_head <= 0 || n_kv <= 0)
    fail("{}: {}.attention.head_count {} / head_count_kv {} must be positive", g.path(), a, n_head, n_kv);
  static const std::regex kBlock(R"(blk\.(\d+)\.(.+))");
  std::vector<TensorInfo> out;
  if (a == "qwen4exp") {
    Qwen4ExpTensors q(g, owned);
    for (const GgufTensor& t : g.tensors()) {
      if (t.ggml_type == kGgmlMxfp4 || !q.add(t, out))
        fail("{}: tensor {} ({}) is not supported for architecture {}", g.path(), t.name, ggml_type_name(t.ggml_type), a);
    }
    q.emit(out);
    return out;
  }
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
  } else if (a == "qwen4exp") {
    qwen4exp_config(g, layers, c);
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
