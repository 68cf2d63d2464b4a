// turbospark generate / run: sample a continuation of a prompt.
#include <fmt/format.h>

#include <cstdio>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "engine/generate.h"

namespace turbospark::cli {

namespace {

struct GenOpts {
  std::string model, prompt, tokens, format = "text", device = "auto", image;
  int64_t max_tokens = 128, ctx = 0;
  int threads = 0;
  bool raw = false, quiet = false, verbose_prompt = false;
  SamplingParams sampling;
  ExpertCacheFlags experts;
};

void add_sampling_options(CLI::App* cmd, GenOpts& o) {
  cmd->add_option("--max-tokens,-n", o.max_tokens, "Most tokens to generate")->capture_default_str();
  cmd->add_option("--temperature,-t", o.sampling.temperature, "Sampling temperature; 0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", o.sampling.top_k, "Keep the k most likely tokens (0 = off)")->capture_default_str();
  cmd->add_option("--top-p", o.sampling.top_p, "Nucleus sampling mass (1 = off)")->capture_default_str();
  cmd->add_option("--min-p", o.sampling.min_p, "Drop tokens below min-p x the top probability (0 = off)")->capture_default_str();
  cmd->add_option("--seed", o.sampling.seed, "Random seed (0 .. 2^64-1)")->check(non_negative_integer)->capture_default_str();
  cmd->add_option("--ctx", o.ctx, "Context length in tokens (default: the model's)");
  cmd->add_option("--threads", o.threads, "Worker threads (default: all cores)");
  cmd->add_option("--device", o.device, "cpu, cuda or auto (cuda when built with it and a GPU is present)")
      ->capture_default_str();
  cmd->add_option("--image", o.image, "Image input (refused: vision towers are not supported yet)");
  cmd->add_flag("--verbose-prompt", o.verbose_prompt, "Print the prompt as the model sees it (after the chat template)");
  add_expert_cache_options(cmd, o.experts);
}

void run_generation(const GenOpts& o, const std::string& model_path, bool chat_format) {
  if (!o.image.empty()) {
    fail("--image {}: image input is not supported (vision tensors are skipped on load; text only)", o.image);
  }
  // Checked before the (possibly long) load: the sampler checks its own flags again.
  if (o.max_tokens < 0) fail("--max-tokens must be >= 0, got {}", o.max_tokens);
  Sampler::validate(o.sampling);
  LoadedRuntime rt = load_runtime(model_path, o.device, o.threads, o.quiet, o.experts);
  const Model& model = *rt.model.model;
  std::vector<int32_t> prompt;
  if (!o.tokens.empty()) {
    prompt = parse_token_list(o.tokens);
  } else {
    if (!rt.tokenizer) fail("{}: no tokenizer.json beside the model; pass --tokens instead of a text prompt", model_path);
    prompt = conversation_tokens(rt, {ChatMessage{"user", o.prompt}}, !chat_format);
    if (o.verbose_prompt) {
      fmt::print(stderr, "prompt ({} tokens): {}\n[{}]\n", prompt.size(), rt.tokenizer->decode(prompt), join_ids(prompt));
    }
  }
  if (o.format != "text" && o.format != "ids") fail("--format {}: expected text or ids", o.format);
  if (o.format == "text" && !rt.tokenizer) fail("{}: no tokenizer.json beside the model; use --format ids", model_path);
  SessionOptions so;
  so.max_context = o.ctx;  // 0: the model's; negative refused by the session
  Session session(model, *rt.backend, so);
  Sampler sampler(o.sampling);
  std::vector<int32_t> generated;
  std::optional<Tokenizer::StreamDecoder> stream;
  if (o.format == "text") stream.emplace(*rt.tokenizer);
  GenerationStats stats = generate(session, sampler, prompt, o.max_tokens, rt.stop_ids, [&](int32_t token, bool stop) {
    if (o.format == "ids") {
      generated.push_back(token);
    } else if (!stop) {
      std::string piece = stream->push(token);
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
    }
    return true;
  });
  if (o.format == "ids") {
    fmt::print("{}\n", join_ids(generated));
  } else {
    std::string rest = stream->flush();
    std::fwrite(rest.data(), 1, rest.size(), stdout);
    fmt::print("\n");
  }
  // The answer's last line out before the statistics on stderr (unbuffered): without this a
  // piped or redirected stdout delivered its newline after them, gluing the two lines.
  std::fflush(stdout);
  if (!o.quiet) {
    const double decode_tps = stats.decode_seconds > 0 ? double(stats.generated_tokens - 1) / stats.decode_seconds : 0;
    fmt::print(stderr, "prompt {} tokens in {:.2f}s ({:.1f} tok/s), generated {} tokens ({:.1f} tok/s)\n",
               stats.prompt_tokens, stats.prefill_seconds, double(stats.prompt_tokens) / stats.prefill_seconds,
               stats.generated_tokens, decode_tps);
    print_expert_cache_summary(rt);
  }
}

}  // namespace

void add_generate_command(CLI::App& app) {
  auto o = std::make_shared<GenOpts>();
  o->sampling.temperature = 0.7f;
  CLI::App* cmd = app.add_subcommand("generate", "Continue a prompt (raw text or token ids), no chat formatting");
  cmd->add_option("--model,-m", o->model, "Model directory or .gguf file (default: $TURBOSPARK_MODEL, then the installed default)");
  auto* p = cmd->add_option("--prompt,-p", o->prompt, "Prompt text");
  auto* t = cmd->add_option("--tokens", o->tokens, "Prompt as comma-separated token ids");
  p->excludes(t);
  cmd->add_option("--format", o->format, "Output: text, or ids (comma-separated generated ids)")->capture_default_str();
  cmd->add_flag("--quiet,-q", o->quiet, "No progress or timing on stderr");
  add_sampling_options(cmd, *o);
  cmd->callback([o] {
    if (o->prompt.empty() && o->tokens.empty()) fail("generate: give --prompt TEXT or --tokens IDS");
    run_generation(*o, o->model.empty() ? default_model_path() : o->model, /*chat_format=*/false);
  });
}

void add_run_command(CLI::App& app) {
  auto o = std::make_shared<GenOpts>();
  CLI::App* cmd = app.add_subcommand(
      "run", "Answer a prompt with the given model, or the installed default model (chat formatting unless --raw)");
  cmd->add_option("prompt", o->prompt, "The prompt")->required();
  cmd->add_option("--model,-m", o->model, "Model directory (default: $TURBOSPARK_MODEL, then the installed default)");
  cmd->add_flag("--raw", o->raw, "Feed the prompt as is, without chat formatting");
  cmd->add_flag("--quiet,-q", o->quiet, "No progress or timing on stderr");
  add_sampling_options(cmd, *o);
  cmd->callback([o] {
    if (o->prompt.empty()) fail("run: empty prompt");
    std::string path = o->model.empty() ? default_model_path() : o->model;
    run_generation(*o, path, !o->raw);
  });
}

}  // namespace turbospark::cli
