// turbospark inspect: what a checkpoint holds, without running it.
#include <fmt/format.h>

#include <map>

#include "cli/commands.h"
#include "core/error.h"
#include "formats/gguf.h"
#include "formats/gguf_model.h"
#include "formats/hf_config.h"
#include "formats/safetensors.h"
#include "models/registry.h"

namespace turbospark::cli {

void add_inspect_command(CLI::App& app) {
  struct Opts {
    std::string model;
    bool tensors = false;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("inspect", "Show a checkpoint's config, tensor table and bytes by dtype");
  cmd->add_option("--model,-m", o->model, "Model directory or .gguf file")->required();
  cmd->add_flag("--tensors", o->tensors, "List every tensor (name, dtype, shape, bytes)");
  cmd->callback([o] {
    Checkpoint ckpt(o->model);
    // A GGUF's metadata maps onto the Hugging Face config the families read.
    HfConfig config = ckpt.is_gguf() ? HfConfig::from_json(gguf_hf_config(*ckpt.gguf()), o->model)
                                     : HfConfig::load(o->model);
    fmt::print("model      {}\n", o->model);
    if (ckpt.is_gguf()) {
      const bool has_template = !gguf_chat_template(*ckpt.gguf()).empty();
      fmt::print("format     GGUF ({} chat template)\n", has_template ? "with a" : "without a");
    }
    fmt::print("arch       {} (model_type {})\n", config.architecture(), config.model_type());
    for (const char* f : {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                          "head_dim", "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                          "num_experts_per_tok", "max_position_embeddings"}) {
      if (config.has(f)) fmt::print("{:<26} {}\n", f, config.text()[f].dump());
    }
    fmt::print("rope       {} theta {}\n", config.rope_type(), config.rope_theta(10000.0));
    std::map<std::string, std::pair<int64_t, int64_t>> by_dtype;  // dtype -> (tensors, bytes)
    int64_t total = 0, params = 0;
    for (const auto& [name, t] : ckpt.all()) {
      auto& e = by_dtype[std::string(dtype_name(t->dtype))];
      e.first += 1;
      e.second += int64_t(t->nbytes);
      total += int64_t(t->nbytes);
      params += t->numel();
      if (o->tensors) fmt::print("  {:<64} {:<5} {:<18} {}\n", name, dtype_name(t->dtype), t->shape_str(), t->nbytes);
    }
    fmt::print("tensors    {} ({:.2f}M stored elements, {:.2f} MiB)\n", ckpt.all().size(), double(params) / 1e6,
               double(total) / (1 << 20));
    for (const auto& [dt, e] : by_dtype) {
      fmt::print("  {:<5} {:>6} tensors {:>12.2f} MiB\n", dt, e.first, double(e.second) / (1 << 20));
    }
    // Building the model validates every tensor's presence, dtype and shape.
    LoadedModel loaded = load_model(o->model);
    const ModelInfo& info = loaded.model->info();
    fmt::print("family     {}: {:.2f}M parameters, weights {:.2f} MiB, read per decode token {:.2f} MiB\n", info.family,
               double(info.n_params) / 1e6, double(info.weight_bytes) / (1 << 20),
               double(info.active_weight_bytes) / (1 << 20));
    if (!ckpt.is_gguf()) {
      const QuantConfig& q = ckpt.quantization();
      if (q.method == QuantConfig::Method::kInt4Affine) {
        fmt::print("quant      int4-affine (MLX), group size {}{}\n", q.group_size,
                   q.group_overrides.empty() ? "" : fmt::format(", {} per-module entries", q.group_overrides.size()));
      } else if (q.method == QuantConfig::Method::kMxfp4) {
        fmt::print("quant      mxfp4 (routed experts), 32 per scale\n");
      }
    }
    // The capability table: what this model supports beyond its forward pass, and why not.
    const Capabilities caps = loaded.model->capabilities();
    fmt::print("capabilities\n");
    for (const auto& [name, c] : {std::pair<const char*, const Capability&>{"chunked prefill", caps.chunked_prefill},
                                  {"CUDA decode graphs", caps.decode_graphs},
                                  {"batched sequences (serve)", caps.batched_sequences},
                                  {"prefix cache (serve)", caps.prefix_cache},
                                  {"expert streaming", caps.expert_streaming},
                                  {"expert speculation", caps.expert_speculation}})
      fmt::print("  {:<26} {}\n", name, c.on ? "yes" : "no: " + c.why_not);
  });
}

}  // namespace turbospark::cli
