// turbospark bench: load time, prefill and decode throughput, and decode's achieved
// weight-streaming bandwidth next to the machine's measured DRAM read bandwidth.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <chrono>
#include <random>

#include "backends/cpu/membw.h"
#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "engine/batch.h"
#include "engine/sampler.h"
#include "engine/router_stats.h"
#include "engine/session.h"

namespace turbospark::cli {
namespace {

using Clock = std::chrono::steady_clock;

// A trace mark closes the block it names: the time since the previous mark (`last`) goes to
// that block ("layer_in" closes the residual work between blocks; the embedding mark opens the
// step and takes none), and `last` moves on.
void close_block(std::map<std::string, double>& blocks, const char* name, Clock::time_point& last) {
  const auto now = Clock::now();
  const bool opens = std::strcmp(name, "embedding") == 0;
  blocks[opens ? "embedding" : std::strcmp(name, "layer_in") == 0 ? "residual (other)" : name] +=
      opens ? 0.0 : std::chrono::duration<double>(now - last).count();
  last = now;
}

}  // namespace

void add_bench_command(CLI::App& app) {
  struct Opts {
    std::string model, device = "auto", router_stats;
    int64_t prompt = 128, decode = 32, ubatch = 0;
    int threads = 0, repeat = 3, warmup = 1, sequences = 1;
    bool no_membw = false, profile = false, random_decode = false;
    ExpertCacheFlags experts;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("bench", "Measure load, prefill and decode speed and decode bandwidth");
  cmd->add_option("--model,-m", o->model, "Model directory")->required();
  cmd->add_option("--prompt", o->prompt, "Prompt tokens for the prefill measurement")->capture_default_str();
  cmd->add_option("--decode", o->decode, "Tokens to decode")->capture_default_str();
  cmd->add_option("--ubatch", o->ubatch,
                  "Prompt tokens per forward (prefill micro-batch; default 0: the backend's, 64 on cpu, 2048 on cuda)")
      ->capture_default_str();
  cmd->add_option("--repeat", o->repeat, "Repetitions (the median is reported)")->capture_default_str();
  cmd->add_option("--warmup", o->warmup,
                  "Untimed runs (the prompt and one decode step) before the timed ones: they fill lazily allocated "
                  "buffers, CUDA graphs and, when streaming experts, the pinned pool and the cache")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "Worker threads (default: all cores)");
  cmd->add_option("--device", o->device, "cpu, cuda or auto (cuda when built with it and a GPU is present)")
      ->capture_default_str();
  cmd->add_flag("--no-membw", o->no_membw, "Skip measuring DRAM bandwidth");
  cmd->add_flag("--profile", o->profile, "Time each block (attention, GDN, QSA indexer, PLE, MoE, ...) in one extra run");
  cmd->add_flag("--random-decode", o->random_decode,
                "Feed a random token at each decode step (as llama-bench's tg does) instead of the greedy one: "
                "routing no longer repeats with the random weights' repetitive output");
  cmd->add_option("--router-stats", o->router_stats,
                  "MoE: in one extra run, count how often each expert of each layer is picked over the prompt and over "
                  "the decode steps; print a summary of each and write the decode steps' histogram as CSV "
                  "layer,expert,count,share (what an expert cache sees)");
  cmd->add_option("--sequences", o->sequences,
                  "Also decode this many sequences at once (continuous batching, as serve runs them): each reads "
                  "the prompt, then every step decodes one token of each; prints the aggregate tok/s")
      ->capture_default_str();
  add_expert_cache_options(cmd, o->experts);
  cmd->callback([o] {
    if (o->prompt < 1 || o->decode < 1) fail("bench: --prompt and --decode must be >= 1");
    if (o->warmup < 0) fail("bench: --warmup must be >= 0, got {}", o->warmup);
    if (o->ubatch < 0) fail("bench: --ubatch must be >= 1 (0 = the backend's), got {}", o->ubatch);
    if (o->sequences < 1) fail("bench: --sequences must be >= 1, got {}", o->sequences);
    LoadedRuntime rt = load_runtime(o->model, o->device, o->threads, false, o->experts);
    const Model& model = *rt.model.model;
    const ModelInfo& info = model.info();
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> pick(0, int32_t(info.vocab_size - 1));
    std::vector<int32_t> prompt(size_t(o->prompt));
    for (auto& t : prompt) t = pick(rng);
    SessionOptions so;
    so.max_context = std::max<int64_t>(info.max_context, o->prompt + o->decode + 1);
    so.max_prefill_batch = o->ubatch;
    Session session(model, *rt.backend, so);
    std::vector<double> prefill_tps, decode_tps;
    // Expert streaming: what the decode steps read from disk and how often the cache hit.
    int64_t decode_read = 0, decode_loads = 0, decode_acquires = 0, decode_tokens = 0;
    for (int w = 0; w < o->warmup; ++w) {
      session.reset();
      std::vector<float> logits = session.feed(prompt);
      int32_t next[1] = {argmax(logits.data(), info.vocab_size)};
      session.feed_greedy(next);
    }
    for (int r = 0; r < std::max(1, o->repeat); ++r) {
      session.reset();
      auto t0 = Clock::now();
      std::vector<float> logits = session.feed(prompt);
      double tp = std::chrono::duration<double>(Clock::now() - t0).count();
      prefill_tps.push_back(double(o->prompt) / tp);
      auto t1 = Clock::now();
      // Greedy decode as `run` does it: only the chosen id leaves the backend each step.
      int32_t next[1] = {argmax(logits.data(), info.vocab_size)};
      const ExpertStreamStats before = rt.experts ? rt.experts->stats() : ExpertStreamStats{};
      for (int64_t i = 0; i < o->decode; ++i) {
        next[0] = session.feed_greedy(next);
        if (o->random_decode) next[0] = pick(rng);
      }
      double td = std::chrono::duration<double>(Clock::now() - t1).count();
      decode_tps.push_back(double(o->decode) / td);
      if (rt.experts) {
        const ExpertStreamStats& after = rt.experts->stats();
        decode_read += after.bytes_read - before.bytes_read;
        decode_loads += after.loads() - before.loads();
        decode_acquires += (after.acquires - after.in_place) - (before.acquires - before.in_place);
        decode_tokens += o->decode;
      }
    }
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double pf = median(prefill_tps), dc = median(decode_tps);
    // Batched decode: --sequences sequences in one BatchRunner, each prefilled with the prompt
    // (untimed), then `decode` steps of one row per sequence, timed; the median over repeats.
    std::vector<double> batch_tps;
    std::map<std::string, double> batch_blocks;
    const bool queued = rt.backend->name() != "cpu";
    if (o->sequences > 1) {
      BatchOptions bo;
      bo.n_seqs = o->sequences;
      bo.max_context = o->prompt + o->decode + 1;
      bo.pool_tokens = o->sequences * ((bo.max_context + 255) / 256 * 256);  // whole KV blocks each
      bo.max_rows = std::max<int64_t>(o->sequences, rt.backend->preferred_prefill_batch());
      BatchRunner runner(model, *rt.backend, bo);
      std::vector<BatchRow> rows;
      std::vector<int32_t> ids;
      std::mt19937 batch_rng(13);
      std::vector<int32_t> next_profile;  // the last repeat's first decode ids
      for (int r = 0; r < std::max(1, o->repeat) + o->warmup; ++r) {
        std::vector<int32_t> next(size_t(o->sequences));
        for (int s = 0; s < o->sequences; ++s) {
          runner.release(s);
          if (!runner.reserve(s, o->prompt + o->decode)) fail("bench: the KV pool holds fewer than {} sequences", s + 1);
          for (int64_t c = 0; c < o->prompt; c += runner.max_rows()) {
            const int64_t m = std::min(runner.max_rows(), o->prompt - c);
            rows.clear();
            for (int64_t t = 0; t < m; ++t) rows.push_back({s, prompt[size_t(c + t)], c + t, c + t == o->prompt - 1});
            runner.step(rows, nullptr, &ids);
          }
          next[size_t(s)] = ids.empty() ? 0 : ids[0];
        }
        next_profile = next;
        auto t0 = Clock::now();
        for (int64_t i = 0; i < o->decode; ++i) {
          rows.clear();
          for (int s = 0; s < o->sequences; ++s) rows.push_back({s, next[size_t(s)], o->prompt + i, true});
          runner.step(rows, nullptr, &ids);
          for (int s = 0; s < o->sequences; ++s) next[size_t(s)] = o->random_decode ? pick(batch_rng) : ids[size_t(s)];
        }
        const double t = std::chrono::duration<double>(Clock::now() - t0).count();
        if (r >= o->warmup) batch_tps.push_back(double(o->sequences * o->decode) / t);
      }
      // --profile: the batched decode steps once more, eagerly, timed per block (below).
      if (o->profile) {
        Clock::time_point last;
        runner.trace = [&](const char* name, int, const Mat&) {
          if (queued) rt.backend->synchronize();
          close_block(batch_blocks, name, last);
        };
        for (int64_t i = 0; i < o->decode; ++i) {
          rows.clear();
          for (int s = 0; s < o->sequences; ++s) rows.push_back({s, next_profile[size_t(s)], o->prompt + i, true});
          if (queued) rt.backend->synchronize();
          last = Clock::now();
          runner.step(rows, nullptr, &ids);
          for (int s = 0; s < o->sequences; ++s) next_profile[size_t(s)] = ids[size_t(s)];
        }
        runner.trace = nullptr;
      }
      for (int s = 0; s < o->sequences; ++s) runner.release(s);
    }
    // Per-block profile: the CPU backend runs ops eagerly, so the wall time between two trace
    // marks is the cost of the block named by the later mark. A GPU backend queues its work, so
    // each mark waits for the queue first: the profile run is eager (no graphs) and pays one
    // host round trip per block, so its ms/token are above the timed runs'; the shares are
    // what it is for.
    std::map<std::string, double> prefill_blocks, decode_blocks;
    if (o->profile) {
      std::map<std::string, double>* into = nullptr;
      Clock::time_point last;
      session.trace = [&](const char* name, int, const Mat&) {
        if (queued) rt.backend->synchronize();
        close_block(*into, name, last);
      };
      session.reset();
      into = &prefill_blocks;
      last = Clock::now();
      std::vector<float> logits = session.feed(prompt);
      into = &decode_blocks;
      for (int64_t i = 0; i < o->decode; ++i) {
        int32_t next[1] = {argmax(logits.data(), info.vocab_size)};
        if (queued) rt.backend->synchronize();
        last = Clock::now();
        logits = session.feed(next);
      }
      session.trace = nullptr;
    }
    // Router histogram: one more run capturing the router probabilities (a download per layer
    // and step, so not timed).
    std::optional<RouterStats> prompt_routes, decode_routes;
    if (!o->router_stats.empty()) {
      if (model.n_experts() == 0) fail("--router-stats: {} has no routed experts", info.architecture);
      prompt_routes.emplace(info.n_layers, model.n_experts(), model.experts_per_token());
      decode_routes.emplace(info.n_layers, model.n_experts(), model.experts_per_token());
      std::vector<float> router;
      session.reset();
      std::vector<float> logits = session.feed(prompt, 0, /*all_logits=*/false, &router);
      prompt_routes->add(router, o->prompt);
      std::mt19937 decode_rng(11);
      for (int64_t i = 0; i < o->decode; ++i) {
        int32_t next[1] = {o->random_decode ? pick(decode_rng) : argmax(logits.data(), info.vocab_size)};
        logits = session.feed(next, 0, /*all_logits=*/false, &router);
        decode_routes->add(router, 1);
      }
      decode_routes->write_csv(o->router_stats);
    }
    const double gbs = dc * double(info.active_weight_bytes) / 1e9;
    fmt::print("model        {} ({}), {:.1f}M params, {:.1f} MiB weights, {:.1f} MiB read per token\n", info.architecture,
               o->model, double(info.n_params) / 1e6, double(info.weight_bytes) / (1 << 20),
               double(info.active_weight_bytes) / (1 << 20));
    fmt::print("load         {:.2f} s\n", rt.load_seconds);
    fmt::print("prefill      {:.1f} tok/s  ({} tokens, median of {})\n", pf, o->prompt, prefill_tps.size());
    fmt::print("decode       {:.2f} tok/s  ({} tokens after the prompt, median of {})\n", dc, o->decode, decode_tps.size());
    fmt::print("decode bw    {:.2f} GB/s of weights\n", gbs);
    if (!batch_tps.empty()) {
      const double bt = median(batch_tps);
      fmt::print("decode x {:<3} {:.2f} tok/s  ({} sequences at once, {:.2f} tok/s each, {:.2f}x one; median of {})\n",
                 o->sequences, bt, o->sequences, bt / o->sequences, bt / dc, batch_tps.size());
    }
    if (rt.experts && decode_tokens > 0) {
      fmt::print("experts      {:.2f} MiB read from disk per decode token, {:.1f}% cache hits while decoding\n",
                 double(decode_read) / double(decode_tokens) / (1 << 20),
                 decode_acquires > 0 ? 100.0 * (1.0 - double(decode_loads) / double(decode_acquires)) : 0.0);
      fmt::print("{}\n", rt.experts->summary());
    }
    // The device tier's cache over the whole bench (every repeat, prompt and decode).
    if (const std::string device = rt.backend->expert_cache_summary(); !device.empty()) fmt::print("{}\n", device);
    if (prompt_routes) {
      fmt::print("prompt {}\n", prompt_routes->summary());
      fmt::print("decode {} (histogram: {})\n", decode_routes->summary(), o->router_stats);
    }
    if (o->profile) {
      auto table = [&](const std::string& title, const std::map<std::string, double>& blocks, double tokens,
                       const char* unit = "token") {
        double total = 0;
        for (const auto& [k, v] : blocks) total += v;
        std::vector<std::pair<double, std::string>> rows;
        for (const auto& [k, v] : blocks) rows.emplace_back(v, k);
        std::sort(rows.rbegin(), rows.rend());
        fmt::print("{} profile ({:.0f} {}s, {:.2f} ms/{}):\n", title, tokens, unit, 1e3 * total / tokens, unit);
        for (const auto& [v, k] : rows) {
          fmt::print("  {:<18} {:8.3f} ms/{} {:5.1f}%\n", k, 1e3 * v / tokens, unit, 100 * v / std::max(total, 1e-12));
        }
      };
      table("prefill", prefill_blocks, double(o->prompt));
      table("decode", decode_blocks, double(o->decode));
      if (!batch_blocks.empty())
        table(fmt::format("decode x {}", o->sequences), batch_blocks, double(o->decode), "step");
    }
    if (!o->no_membw && rt.backend->name() != "cpu") {
      const double peak = rt.backend->copy_bandwidth_gbs();
      fmt::print("device copy  {:.0f} GB/s measured (device-to-device copy, bytes read + written, median of 5) -> "
                 "decode at {:.0f}% of it\n",
                 peak, 100.0 * gbs / peak);
    } else if (!o->no_membw) {
      rt.backend.reset();  // its workers stop spinning before the bandwidth probe
      ThreadPool pool(o->threads);
      // The median of five probes: on a shared host one probe varies by 1.5x run to run.
      std::vector<double> probes;
      for (int i = 0; i < 5; ++i) probes.push_back(cpu::measure_read_bandwidth_gbs(pool));
      std::sort(probes.begin(), probes.end());
      const double peak = probes[2];
      fmt::print("dram read    {:.2f} GB/s measured ({} threads, median of 5 probes, {:.1f}-{:.1f}) -> decode at {:.0f}% of it\n",
                 peak, pool.size(), probes.front(), probes.back(), 100.0 * gbs / peak);
    }
  });
}

}  // namespace turbospark::cli
