// turbospark logits: teacher-forced next-token logits for a token list, as .npy.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "core/npy.h"
#include "engine/router_stats.h"
#include "engine/session.h"

namespace turbospark::cli {

void add_logits_command(CLI::App& app) {
  struct Opts {
    std::string model, tokens, out, router_out, router_stats, trace_out, device = "auto", precision = "exact";
    std::string replay_routes;
    uint32_t nudge = 0;
    int64_t chunk = 0;
    int threads = 0;
    ExpertCacheFlags experts;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("logits", "Write next-token logits for every prefix of a token list (float32 [T, vocab] .npy)");
  cmd->add_option("--model,-m", o->model, "Model directory (config.json + safetensors) or .gguf file")->required();
  cmd->add_option("--tokens", o->tokens, "Comma-separated token ids, e.g. 5,17,9")->required();
  cmd->add_option("--out", o->out, "Output .npy: row t = logits after tokens[0..t]")->required();
  cmd->add_option("--chunk", o->chunk, "Feed the prompt as prefill chunks of N tokens (default 0: largest micro-batch)");
  cmd->add_option("--router-out", o->router_out, "Also write router probabilities [layers, T, n_experts] .npy (MoE models)");
  cmd->add_option("--router-stats", o->router_stats,
                  "Also write how often each expert of each layer was picked (CSV layer,expert,count,share; MoE models) "
                  "and print a one-line summary");
  cmd->add_option("--trace-out", o->trace_out,
                  "Also write every traced activation as DIR/<name>_<layer>.npy [T, cols] (dump-and-diff)");
  cmd->add_option("--device", o->device, "cpu, cuda or auto (cuda when built with it and a GPU is present)")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "Worker threads (default: all cores)");
  cmd->add_option("--precision", o->precision,
                  "--device cpu only: exact (default), or cuda: round where the CUDA backend does (K/V stored as "
                  "bf16, GEMM inputs of micro-batches over 8 rows as bf16/tf32), a reference that tells a GPU "
                  "kernel's error from its path's precision (tools/diff_trace.py --precision cuda)")
      ->capture_default_str();
  cmd->add_option("--nudge", o->nudge,
                  "--precision cuda only: scale every matmul output by 1 +- 2^-22 (signs from this seed): comparing "
                  "with an un-nudged run shows how far f32 rounding noise alone moves this reference "
                  "(tools/diff_trace.py --noise)");
  cmd->add_option("--replay-routes", o->replay_routes,
                  "--precision cuda only: route as the run that wrote this --router-out .npy did (CUDA's), and "
                  "print how many rows the CPU would have routed differently and its widest margin there");
  add_expert_cache_options(cmd, o->experts);
  cmd->callback([o] {
    if (o->chunk < 0) fail("logits: --chunk must be >= 0 (0 = the largest micro-batch), got {}", o->chunk);
    std::vector<int32_t> tokens = parse_token_list(o->tokens);
    if (o->precision != "exact" && o->precision != "cuda")
      fail("logits: --precision {}: want exact or cuda", o->precision);
    if (o->precision == "cuda" && o->device != "cpu")
      fail("logits: --precision cuda is the CPU backend's emulation of CUDA's rounding: use it with --device cpu");
    if (o->precision != "cuda" && (o->nudge != 0 || !o->replay_routes.empty()))
      fail("logits: {} shapes the CPU reference of CUDA: use it with --device cpu --precision cuda",
           o->nudge != 0 ? "--nudge" : "--replay-routes");
    CpuPrecision precision;
    if (o->precision == "cuda") precision = CpuPrecision::like_cuda();
    precision.nudge_seed = o->nudge;
    // Filled once the model says its shape; the backend holds the same object.
    if (!o->replay_routes.empty()) precision.route_replay = std::make_shared<RouteReplay>();
    LoadedRuntime rt = load_runtime(o->model, o->device, o->threads, /*quiet=*/true, o->experts, precision);
    if (!o->replay_routes.empty()) {
      const NpyArray routes = read_npy_f32(o->replay_routes);
      const Model& m = *rt.model.model;
      if (m.n_experts() == 0) fail("--replay-routes: {} has no routed experts", m.info().architecture);
      if (routes.shape != std::vector<int64_t>{m.info().n_layers, int64_t(tokens.size()), m.n_experts()})
        fail("--replay-routes {}: shape {} is not [layers {}, tokens {}, experts {}]", o->replay_routes,
             fmt::join(routes.shape, "x"), m.info().n_layers, tokens.size(), m.n_experts());
      *precision.route_replay = *route_replay_from_probs(routes.data, m.info().n_layers, int64_t(tokens.size()),
                                                         m.n_experts(), m.experts_per_token());
    }
    const Model& model = *rt.model.model;
    for (const auto& [flag, value] : {std::pair<const char*, const std::string*>{"--router-out", &o->router_out},
                                      {"--router-stats", &o->router_stats}})
      if (!value->empty() && model.n_experts() == 0) fail("{}: {} has no routed experts", flag, model.info().architecture);
    const bool capture = !o->router_out.empty() || !o->router_stats.empty();
    SessionOptions so;
    so.max_context = model.info().max_context;
    Session session(model, *rt.backend, so);
    std::map<std::string, std::pair<int64_t, std::vector<float>>> traced;  // name -> (cols, rows)
    if (!o->trace_out.empty()) {
      session.trace = [&](const char* name, int layer, const Mat& m) {
        auto& [cols, data] = traced[fmt::format("{}_{}", name, layer)];
        cols = m.cols;
        // The view is backend memory: downloaded (a deliberate sync of this diagnostic path).
        const size_t at = data.size();
        data.resize(at + size_t(m.rows * m.cols));
        rt.backend->download(m, data.data() + at);
      };
    }
    std::vector<float> router;
    std::vector<float> logits = session.feed(tokens, o->chunk, /*all_logits=*/true, capture ? &router : nullptr);
    const int64_t T = int64_t(tokens.size());
    write_npy_f32(o->out, {T, model.info().vocab_size}, logits.data());
    for (const auto& [key, value] : traced) {
      const auto& [cols, data] = value;
      write_npy_f32(o->trace_out + "/" + key + ".npy", {int64_t(data.size()) / cols, cols}, data.data());
    }
    if (!o->router_out.empty()) {
      write_npy_f32(o->router_out, {model.info().n_layers, T, model.n_experts()}, router.data());
    }
    if (!o->router_stats.empty()) {
      RouterStats stats(model.info().n_layers, model.n_experts(), model.experts_per_token());
      stats.add(router, T);
      stats.write_csv(o->router_stats);
      fmt::print(stderr, "{}\n", stats.summary());
    }
    if (precision.route_replay) {
      const RouteReplay& r = *precision.route_replay;
      fmt::print(stderr, "route replay: {} of {} routed rows differ from the CPU's own choice (its widest margin there {:.3g})\n",
                 r.flips, T * int64_t(r.layers.size()), r.widest_flip_margin);
    }
  });
}

}  // namespace turbospark::cli
