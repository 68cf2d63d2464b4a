#include "cli/common.h"

#include <CLI/CLI.hpp>

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/mapped_file.h"
#include "formats/gguf.h"
#include "formats/gguf_model.h"
#include "formats/safetensors.h"

namespace turbospark::cli {

namespace fs = std::filesystem;

static void add_ids_from_json(const nlohmann::json& j, const char* field, std::vector<int32_t>* out) {
  if (!j.contains(field)) return;
  const auto& v = j[field];
  if (v.is_number_integer()) out->push_back(v.get<int32_t>());
  if (v.is_array()) {
    for (const auto& e : v) {
      if (e.is_number_integer()) out->push_back(e.get<int32_t>());
    }
  }
}

// Pages the weights in up front when they fit in memory (as llama.cpp's mmap prefetch does),
// so decode timings do not include a page fault per 4 KiB; shows progress for big models.
static void prefault_weights(const Checkpoint& ckpt, bool quiet, const Checkpoint::SkipRanges& skip = {}) {
  int64_t total = ckpt.total_bytes();
  for (const auto& [path, ranges] : skip)
    for (const auto& [b, e] : ranges) total -= e - b;  // overlaps are rare and only shrink the estimate
  if (total > host_memory_available() * 9 / 10) {
    if (!quiet) fmt::print(stderr, "weights ({:.1f} GiB) exceed available memory: paging them in on demand\n", double(total) / (1 << 30));
    return;
  }
  const bool show = !quiet && total > (int64_t(256) << 20);
  int last_percent = -10;
  ckpt.prefault([&](int64_t done, int64_t all) {
    const int percent = int(100 * done / all);
    if (percent < last_percent + 10 && done != all) return;  // a line per 10%: logs stay readable
    last_percent = percent;
    if (show) fmt::print(stderr, "\rpaging in weights {:3d}% ({:.2f} / {:.2f} GiB)", percent,
                         double(done) / (1 << 30), double(all) / (1 << 30));
  });
  if (show) fmt::print(stderr, "\n");
}

// A chat format for checkpoints that ship without a template (many GGUF conversions): the
// family's documented turn format for Gemma, ChatML when the vocabulary has its markers.
static const char* builtin_chat_template(const ModelInfo& info, const Tokenizer& tok) {
  if (info.family.rfind("gemma", 0) == 0 && tok.token_id("<start_of_turn>")) {
    return "{{ bos_token }}{% set ns = namespace(sys='') %}"
           "{% for m in messages %}{% if m['role'] == 'system' %}{% set ns.sys = m['content'] + '\n\n' %}"
           "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
           "{{ ns.sys }}{{ m['content'] | trim }}<end_of_turn>\n{% set ns.sys = '' %}{% endif %}{% endfor %}"
           "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";
  }
  if (tok.token_id("<|im_start|>") && tok.token_id("<|im_end|>")) {
    return "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  }
  return nullptr;
}

std::unique_ptr<Backend> make_backend(const std::string& device, int threads, const CpuPrecision& precision) {
  if (threads < 0 || threads > 4096) fail("--threads must be in [0, 4096] (0 = every core), got {}", threads);
  if (device == "cpu") return make_cpu_backend(threads, precision);
  if (device == "cuda") return make_cuda_backend(0);
  if (device == "auto") return cuda_available() ? make_cuda_backend(0) : make_cpu_backend(threads);
  fail("--device {}: unknown device (cpu, cuda or auto)", device);
}

std::string non_negative_integer(const std::string& value) {
  const bool digits = !value.empty() && value.find_first_not_of("0123456789") == std::string::npos;
  return digits ? std::string() : "must be a whole number >= 0, got " + value;
}

void add_expert_cache_options(CLI::App* cmd, ExpertCacheFlags& f) {
  cmd->add_option("--expert-cache-slots", f.slots,
                  "MoE: stream routed experts from disk through N cache slots (>= top-k; 0 = off; default: only "
                  "when the weights exceed memory, sized from what is left)");
  cmd->add_option("--expert-cache-gb", f.gb, "MoE: stream routed experts through a cache of this many GiB");
  cmd->add_option("--expert-cache-policy", f.policy, "Expert cache eviction: lru, lfu or freq-lru")->capture_default_str();
  cmd->add_option("--expert-prefetch", f.prefetch, "Expert loads kept in flight ahead of compute")->capture_default_str();
  cmd->add_option("--expert-store", f.store,
                  "MoE: stream routed experts from this expert store (written by turbospark convert --expert-store): "
                  "one aligned, checksummed read per expert; implies streaming");
  cmd->add_option("--gpu-memory-gb", f.gpu_memory_gb,
                  "Device memory the engine may take, in GiB (weights, expert cache, KV cache): a large GPU stands "
                  "in for a smaller one; a MoE model that does not fit then streams its routed experts");
  cmd->add_flag("--expert-speculate", f.speculate,
                "MoE streaming: guess the next layer's experts (its router on this layer's input) and load them "
                "while this layer computes; the summary says how many guesses were used (needs >= 2 x top-k slots)");
}

// Turns expert streaming on when asked (or when the weights exceed memory on the CPU), with
// the slot count and why printed on stderr. Refusals name the flag.
// The checks that need no model: before the (possibly long) load.
static void validate_expert_cache_flags(const ExpertCacheFlags& f) {
  if (f.slots < -1) fail("--expert-cache-slots must be >= 0 (0 = off), got {}", f.slots);
  if (!(f.gb >= 0) || !std::isfinite(f.gb)) fail("--expert-cache-gb must be a finite size >= 0, got {}", f.gb);
  if (f.prefetch < 0 || f.prefetch > 64) fail("--expert-prefetch must be in [0, 64], got {}", f.prefetch);
  if (f.slots > 0 && f.gb > 0) fail("--expert-cache-slots and --expert-cache-gb: give one of them");
  if (!(f.gpu_memory_gb >= 0) || !std::isfinite(f.gpu_memory_gb) || f.gpu_memory_gb > 1e6) {
    fail("--gpu-memory-gb must be a finite size in GiB > 0, got {}", f.gpu_memory_gb);
  }
  if (!f.store.empty() && f.slots == 0) fail("--expert-store streams experts: it cannot go with --expert-cache-slots 0");
  try {
    parse_eviction_policy(f.policy);
  } catch (const Error& e) {
    fail("--expert-cache-policy: {}", e.what());
  }
}

static void configure_expert_streaming(LoadedRuntime& rt, const ExpertCacheFlags& f, bool quiet) {
  const EvictionPolicy policy = parse_eviction_policy(f.policy);
  const Model& model = *rt.model.model;
  const ModelInfo& info = model.info();
  const bool asked = f.slots > 0 || f.gb > 0 || !f.store.empty();
  const int k = model.experts_per_token();
  const Capabilities caps = model.capabilities();
  if ((asked || f.speculate) && !caps.expert_streaming.on) {
    fail("{}: {}",
         f.slots > 0  ? "--expert-cache-slots"
         : f.gb > 0   ? "--expert-cache-gb"
         : asked      ? "--expert-store"
                      : "--expert-speculate",
         caps.expert_streaming.why_not);
  }
  auto no_speculation = [&](const std::string& why) {
    if (f.speculate) fail("--expert-speculate: {}", why);
  };
  if (f.speculate && !caps.expert_speculation.on) no_speculation(caps.expert_speculation.why_not);
  if (f.slots == 0 || k == 0 || info.expert_bytes <= 0) {
    no_speculation("expert streaming is off (give --expert-cache-slots, --expert-cache-gb or --expert-store)");
    return;
  }
  int64_t slots = f.slots;
  std::string why;
  if (f.gb > 0) {
    slots = int64_t(f.gb * double(int64_t(1) << 30) / double(info.expert_bytes));
    why = fmt::format("--expert-cache-gb {}", f.gb);
    if (slots < k) fail("--expert-cache-gb {}: holds {} experts of {:.2f} MiB, fewer than the {} a token uses", f.gb, slots,
                        double(info.expert_bytes) / (1 << 20), k);
  } else if (f.slots < 0) {
    // Not asked: stream only when the weights do not fit (or a store is named).
    if (rt.backend->experts_on_host()) {
      // The device tier, chosen before the load because the checkpoint exceeds the device:
      // slots in 90% of what the dense part left (less the activations' reserve).
      const int64_t available = rt.backend->device_memory_available();
      const int64_t room = available * 9 / 10 - (int64_t(512) << 20);
      slots = std::max<int64_t>(room / info.expert_bytes, k);
      why = fmt::format("the weights ({:.1f} GiB) exceed the device memory: {:.1f} GiB resident, experts streamed into "
                        "90% of the {:.1f} GiB left",
                        double(info.weight_bytes) / (1 << 30),
                        double(info.weight_bytes - info.routed_weight_bytes) / (1 << 30), double(available) / (1 << 30));
    } else {
      if (rt.backend->name() != "cpu") {
        if (!f.store.empty()) fail("--expert-store: expert streaming is not supported on --device {} yet", rt.backend->name());
        no_speculation(fmt::format("on --device {} the weights fit, so experts are not streamed (give --expert-cache-gb "
                                   "X or --expert-cache-slots N to stream them anyway)",
                                   rt.backend->name()));
        return;
      }
      const int64_t avail = std::max<int64_t>(host_memory_available(), 0);
      const bool exceeds = avail > 0 && info.weight_bytes > avail * 9 / 10;
      if (!exceeds && f.store.empty()) {
        no_speculation("the weights fit in memory, so experts are not streamed (give --expert-cache-slots or "
                       "--expert-cache-gb to stream them anyway)");
        return;
      }
      const int64_t resident = info.weight_bytes - info.routed_weight_bytes;
      slots = std::max<int64_t>((avail * 8 / 10 - resident) / info.expert_bytes, 2 * k);
      why = exceeds ? fmt::format("the weights ({:.1f} GiB) exceed available memory ({:.1f} GiB): {:.1f} GiB resident, "
                                  "experts streamed into 80% of what is left",
                                  double(info.weight_bytes) / (1 << 30), double(avail) / (1 << 30),
                                  double(resident) / (1 << 30))
                    : std::string("--expert-store, sized from 80% of available memory");
    }
  } else {
    why = "--expert-cache-slots";
  }
  const int64_t n_routed = info.routed_weight_bytes / info.expert_bytes;
  slots = std::min(slots, std::max<int64_t>(n_routed, k));
  if (rt.backend->experts_on_host()) {
    // The device tier: slots in device memory, fed from the checkpoint's pages in host memory.
    if (f.speculate) fail("--expert-speculate: not on --device {} yet (the disk tier on --device cpu has it)", rt.backend->name());
    rt.backend->set_expert_cache(slots, k, policy, model.first_expert_of_each_layer());
    if (!quiet) {
      fmt::print(stderr, "expert streaming: {} device slots x {:.2f} MiB = {:.2f} GiB for {} routed experts ({:.2f} GiB) "
                 "in host memory, {} ({})\n",
                 slots, double(info.expert_bytes) / (1 << 20), double(slots * info.expert_bytes) / (1 << 30), n_routed,
                 double(info.routed_weight_bytes) / (1 << 30), eviction_policy_name(policy), why);
    }
    return;
  }
  ExpertStreamOptions o;
  o.slots = slots;
  o.top_k = k;
  o.policy = policy;
  o.prefetch_depth = f.prefetch;
  o.speculate = f.speculate;
  if (f.speculate && slots < 2 * int64_t(k))
    fail("--expert-speculate needs at least 2 x top-k = {} cache slots, the cache has {} (a guess would evict what the "
         "next steps need)", 2 * k, slots);
  if (!f.store.empty()) {
    o.store = ExpertStore::open(f.store);
    if (o.store->architecture() != info.architecture)
      fail("--expert-store {}: written from a {} model, this is {}", f.store, o.store->architecture(), info.architecture);
    check_expert_store_source(*o.store, model);
  }
  rt.experts = std::make_unique<ExpertStreamer>(o);
  rt.backend->set_expert_provider(rt.experts.get());  // refused by name where the backend has no tier
  if (!quiet) {
    fmt::print(stderr, "expert streaming: {} slots x {:.2f} MiB = {:.2f} GiB for {} routed experts ({:.2f} GiB), {} "
               "({})\n",
               slots, double(info.expert_bytes) / (1 << 20), double(slots * info.expert_bytes) / (1 << 30), n_routed,
               double(info.routed_weight_bytes) / (1 << 30), eviction_policy_name(policy), why);
    if (o.store) fmt::print(stderr, "expert streaming: reading from the expert store {} ({} records)\n", f.store, o.store->records());
  }
}

void print_expert_cache_summary(const LoadedRuntime& rt) {
  if (rt.experts) fmt::print(stderr, "{}\n", rt.experts->summary());
  if (rt.backend) {
    const std::string device = rt.backend->expert_cache_summary();
    if (!device.empty()) fmt::print(stderr, "{}\n", device);
  }
}

LoadedRuntime load_runtime(const std::string& path, const std::string& device, int threads, bool quiet,
                           const ExpertCacheFlags& experts, const CpuPrecision& cpu_precision) {
  validate_expert_cache_flags(experts);
  auto t0 = std::chrono::steady_clock::now();
  LoadedRuntime rt;
  rt.backend = make_backend(device, threads, cpu_precision);
  if (!quiet) fmt::print(stderr, "loading {} on {} ...\n", path, rt.backend->name());
  // Streaming asked for on a device: its routed experts must stay in host memory from the load on.
  if (experts.gpu_memory_gb > 0) {
    if (rt.backend->name() == "cpu") fail("--gpu-memory-gb: no GPU in use (--device {})", device);
    rt.backend->set_memory_limit(int64_t(experts.gpu_memory_gb * double(int64_t(1) << 30)));
  }
  // Not asked, on a device: a MoE checkpoint larger than the device memory left (1 GiB kept
  // for activations and the KV cache) streams its routed experts; any other that does not fit
  // is refused by the load with the byte counts.
  bool device_auto_stream = false;
  if (rt.backend->name() != "cpu" && experts.slots < 0 && experts.gb == 0 && experts.store.empty()) {
    const CheckpointFacts facts = probe_checkpoint(path);
    const int64_t available = rt.backend->device_memory_available();
    device_auto_stream = facts.routed_experts && available >= 0 && facts.bytes + (int64_t(1) << 30) > available;
  }
  // (--expert-cache-slots 0 is off, whatever else is given: configure_expert_streaming's rule.)
  if (rt.backend->name() != "cpu" &&
      (device_auto_stream || (experts.slots != 0 && (experts.slots > 0 || experts.gb > 0)))) {
    if (!experts.store.empty()) {
      fail("--expert-store: not on --device {} yet (its device tier streams from the checkpoint itself; the store "
           "serves the disk tier on --device cpu)",
           rt.backend->name());
    }
    rt.backend->keep_experts_on_host();
  }
  try {
    rt.model = load_model(path, *rt.backend);
  } catch (const Error& e) {
    // auto means "the GPU when it can run this model": a family the CUDA backend refuses, or
    // a model too large for the device, runs on the CPU instead, and says so.
    if (device != "auto" || rt.backend->name() == "cpu") throw;
    fmt::print(stderr, "--device auto: {}; running on cpu\n", e.what());
    rt.backend = make_cpu_backend(threads);
    rt.model = load_model(path, *rt.backend);
  }
  configure_expert_streaming(rt, experts, quiet);
  // Streamed experts are read from disk, never through the mapping: only the resident part
  // is paged in (the experts' bytes would spend the memory the cache is there to bound).
  if (rt.backend->name() == "cpu") {
    Checkpoint::SkipRanges skip;
    if (rt.experts) {
      rt.model.model->for_each_routed_expert([&](const ExpertWeights& e) {
        for (const auto& r : rt.experts->file_ranges(e)) skip[r.path].emplace_back(r.begin, r.end);
      });
    }
    prefault_weights(*rt.model.checkpoint, quiet, skip);
  }
  const ModelInfo& info = rt.model.model->info();
  rt.stop_ids = info.eos_ids;
  fs::path dir = fs::is_directory(path) ? fs::path(path) : fs::path(path).parent_path();
  fs::path gen = dir / "generation_config.json";
  if (fs::exists(gen)) {
    try {
      add_ids_from_json(nlohmann::json::parse(read_text_file(gen.string())), "eos_token_id", &rt.stop_ids);
    } catch (const nlohmann::json::exception& e) {
      fail("{}: malformed JSON: {}", gen.string(), e.what());
    }
  }
  fs::path tok = dir / "tokenizer.json";
  if (rt.model.checkpoint->is_gguf()) {
    const GgufFile& gguf = *rt.model.checkpoint->gguf();
    rt.tokenizer.emplace(Tokenizer::from_vocab(vocab_spec_from_gguf(gguf)));
    for (auto id : {rt.tokenizer->eos_token_id(), rt.tokenizer->eot_token_id()}) {
      if (id) rt.stop_ids.push_back(*id);
    }
    // Every end-of-generation token the vocabulary marks (<end_of_turn>, <|im_end|>, ...).
    for (int32_t id : rt.tokenizer->end_of_generation_ids()) rt.stop_ids.push_back(id);
    const std::string tmpl = gguf_chat_template(gguf);
    if (!tmpl.empty()) rt.chat_template.emplace(ChatTemplate::parse(tmpl, path));
  } else if (fs::exists(tok)) {
    rt.tokenizer.emplace(Tokenizer::from_file(tok.string()));
    for (const char* end : {"<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"}) {
      if (auto id = rt.tokenizer->token_id(end)) rt.stop_ids.push_back(*id);
    }
    if (auto eos = rt.tokenizer->eos_token_id()) rt.stop_ids.push_back(*eos);
    fs::path jinja = dir / "chat_template.jinja", cfg = dir / "tokenizer_config.json";
    if (fs::exists(jinja)) {
      rt.chat_template.emplace(ChatTemplate::parse(read_text_file(jinja.string()), jinja.string()));
    } else if (fs::exists(cfg)) {
      nlohmann::json j;
      try {
        j = nlohmann::json::parse(read_text_file(cfg.string()));
      } catch (const nlohmann::json::exception& e) {
        fail("{}: malformed JSON: {}", cfg.string(), e.what());
      }
      if (j.contains("chat_template") && j["chat_template"].is_string()) {
        rt.chat_template.emplace(ChatTemplate::parse(j["chat_template"].get<std::string>(), cfg.string()));
      }
    }
  }
  if (rt.tokenizer && !rt.chat_template) {
    if (const char* builtin = builtin_chat_template(info, *rt.tokenizer)) {
      rt.chat_template.emplace(ChatTemplate::parse(builtin, "built-in template"));
      if (!quiet) fmt::print(stderr, "no chat template in {}: using the built-in {} format\n", path, info.family);
    }
  }
  if (rt.tokenizer) {
    if (rt.tokenizer->vocab_size() > info.vocab_size) {
      fail("{}: tokenizer has {} tokens but the model's vocab_size is {}", tok.string(), rt.tokenizer->vocab_size(),
           info.vocab_size);
    }
  }
  rt.load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!quiet) {
    fmt::print(stderr, "loaded {} ({}, {} layers, {:.1f}M params, {:.1f} MiB of weights) in {:.2f}s\n",
               info.architecture, info.family, info.n_layers, double(info.n_params) / 1e6,
               double(info.weight_bytes) / (1 << 20), rt.load_seconds);
  }
  return rt;
}

std::vector<int32_t> conversation_tokens(const LoadedRuntime& rt, const std::vector<ChatMessage>& messages, bool raw,
                                         const nlohmann::ordered_json* tools) {
  if (!rt.tokenizer) fail("this model has no tokenizer (no tokenizer.json or GGUF vocabulary): use --tokens");
  const Tokenizer& tok = *rt.tokenizer;
  std::string text;
  if (raw || !rt.chat_template) {
    for (const auto& m : messages) text += m.content;
  } else {
    nlohmann::ordered_json extra = nlohmann::ordered_json::object();
    auto piece = [&](std::optional<int32_t> id) { return id ? std::string(tok.token_text(*id)) : std::string(); };
    extra["bos_token"] = piece(tok.bos_token_id());
    extra["eos_token"] = piece(tok.eos_token_id());
    extra["enable_thinking"] = false;  // a direct answer; thinking models can be asked with --raw
    if (tools) extra["tools"] = *tools;
    text = apply_chat_template(*rt.chat_template, messages, /*add_generation_prompt=*/true, extra);
  }
  std::vector<int32_t> ids = tok.encode(text, /*parse_special=*/true, /*add_special=*/true);
  // Templates often write the BOS text themselves while the vocabulary also adds one.
  if (ids.size() >= 2 && tok.bos_token_id() && ids[0] == *tok.bos_token_id() && ids[1] == ids[0]) ids.erase(ids.begin());
  return ids;
}

std::vector<int32_t> parse_token_list(const std::string& text) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t comma = text.find(',', pos);
    std::string item = text.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    while (!item.empty() && item.front() == ' ') item.erase(item.begin());
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (item.empty() && comma == std::string::npos && ids.empty()) break;
    char* end = nullptr;
    long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || v < INT32_MIN || v > INT32_MAX) fail("--tokens: {:?} is not a token id", item);
    ids.push_back(int32_t(v));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return ids;
}

std::string default_model_path() {
  if (const char* env = std::getenv("TURBOSPARK_MODEL"); env && *env) {
    if (!fs::exists(env)) fail("TURBOSPARK_MODEL={}: no such file or directory", env);
    return env;
  }
  fs::path data;
  if (const char* xdg = std::getenv("XDG_DATA_HOME"); xdg && *xdg) {
    data = xdg;
  } else if (const char* home = std::getenv("HOME"); home && *home) {
    data = fs::path(home) / ".local" / "share";
  }
  // A GGUF file (what scripts/setup.sh installs) or a Hugging Face model directory.
  for (const char* name : {"default-model.gguf", "default-model"}) {
    fs::path candidate = data / "turbospark" / name;
    if (!data.empty() && fs::exists(candidate)) return candidate.string();
  }
  fail("no model given and no default model installed in {} (set TURBOSPARK_MODEL, pass --model, or run scripts/setup.sh)",
       (data / "turbospark").string());
}

std::string join_ids(const std::vector<int32_t>& ids) {
  std::string s;
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace turbospark::cli
