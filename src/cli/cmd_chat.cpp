// turbospark chat: an interactive, multi-turn conversation with streamed replies.
//
// The conversation is rendered through the model's chat template every turn; the tokens
// already in the session (earlier turns and replies) are reused when the new rendering
// starts with them, so each turn only prefills what is new. Ctrl-C while a reply streams
// stops that reply (it stays in the history as far as it got); Ctrl-C or Ctrl-D at the
// prompt ends the chat. Lines: `/reset` clears the conversation, `/exit` quits; a line
// ending in `\` continues on the next line.
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <iostream>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "engine/generate.h"

namespace turbospark::cli {
namespace {

std::atomic<bool> g_interrupted{false};

extern "C" void on_sigint(int) { g_interrupted.store(true); }

// Installs the Ctrl-C handler without SA_RESTART, so a blocking read at the prompt returns.
void install_sigint_handler() {
  struct sigaction sa {};
  sa.sa_handler = on_sigint;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  sigaction(SIGINT, &sa, nullptr);
}

// Reads one user message (continuation lines end in '\'); false at end of input or Ctrl-C.
bool read_message(bool interactive, std::string* out) {
  out->clear();
  for (bool first = true;; first = false) {
    if (interactive) {
      fmt::print("{}", first ? "> " : ". ");
      std::fflush(stdout);
    }
    std::string line;
    if (!std::getline(std::cin, line)) {
      std::cin.clear();
      return false;
    }
    if (g_interrupted.load()) return false;
    if (!line.empty() && line.back() == '\\') {
      line.back() = '\n';
      *out += line;
      continue;
    }
    *out += line;
    return true;
  }
}

}  // namespace

void add_chat_command(CLI::App& app) {
  struct Opts {
    std::string model, system, device = "auto";
    int64_t max_tokens = 1024, ctx = 0;
    int threads = 0;
    bool quiet = false;
    SamplingParams sampling;
    ExpertCacheFlags experts;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "chat", "Chat with a model interactively: streamed replies, multi-turn; Ctrl-C stops a reply, /reset, /exit");
  cmd->add_option("--model,-m", o->model, "Model directory or .gguf file (default: $TURBOSPARK_MODEL, then the installed default)");
  cmd->add_option("--system", o->system, "System prompt");
  cmd->add_option("--max-tokens,-n", o->max_tokens, "Most tokens per reply")->capture_default_str();
  cmd->add_option("--temperature,-t", o->sampling.temperature, "Sampling temperature; 0 = greedy")->capture_default_str();
  cmd->add_option("--top-k", o->sampling.top_k, "Keep the k most likely tokens (0 = off)")->capture_default_str();
  cmd->add_option("--top-p", o->sampling.top_p, "Nucleus sampling mass (1 = off)")->capture_default_str();
  cmd->add_option("--min-p", o->sampling.min_p, "Drop tokens below min-p x the top probability (0 = off)")->capture_default_str();
  cmd->add_option("--seed", o->sampling.seed, "Random seed (0 .. 2^64-1)")->check(non_negative_integer)->capture_default_str();
  cmd->add_option("--ctx", o->ctx, "Context length in tokens (default: the model's, at most 8192)");
  cmd->add_option("--threads", o->threads, "Worker threads (default: all cores)");
  cmd->add_option("--device", o->device, "cpu, cuda or auto (cuda when built with it and a GPU is present)")
      ->capture_default_str();
  cmd->add_flag("--quiet,-q", o->quiet, "No load progress or per-reply timing on stderr");
  add_expert_cache_options(cmd, o->experts);
  cmd->callback([o] {
    const std::string path = o->model.empty() ? default_model_path() : o->model;
    if (o->max_tokens < 0) fail("--max-tokens must be >= 0, got {}", o->max_tokens);
    Sampler::validate(o->sampling);
    LoadedRuntime rt = load_runtime(path, o->device, o->threads, o->quiet, o->experts);
    if (!rt.tokenizer) fail("{}: no tokenizer (tokenizer.json or GGUF vocabulary); chat needs one", path);
    if (!rt.chat_template) fail("{}: no chat template; use `run --raw` or `generate` for a plain continuation", path);
    const Model& model = *rt.model.model;
    SessionOptions so;
    so.max_context = o->ctx != 0 ? o->ctx : std::min<int64_t>(model.info().max_context, 8192);  // negative: refused by the session
    Session session(model, *rt.backend, so);
    Sampler sampler(o->sampling);
    const bool interactive = isatty(STDIN_FILENO) != 0;
    install_sigint_handler();
    if (interactive && !o->quiet) {
      fmt::print(stderr, "chat with {} ({} tokens of context). Ctrl-C stops a reply; /reset, /exit, Ctrl-D.\n",
                 model.info().architecture, so.max_context);
    }

    std::vector<ChatMessage> messages;
    if (!o->system.empty()) messages.push_back({"system", o->system});
    std::vector<int32_t> in_session;  // tokens the session has consumed, in order
    std::string user;
    while (read_message(interactive, &user)) {
      if (user == "/exit" || user == "/quit") break;
      if (user == "/reset") {
        messages.resize(o->system.empty() ? 0 : 1);
        session.reset();
        in_session.clear();
        if (interactive) fmt::print(stderr, "(conversation cleared)\n");
        continue;
      }
      if (user.empty()) continue;
      messages.push_back({"user", user});
      const std::vector<int32_t> rendered = conversation_tokens(rt, messages, /*raw=*/false);
      // Reuse the session when the rendering extends what it holds; else start over (a
      // template may rewrite earlier turns, e.g. drop reasoning from past replies).
      size_t keep = 0;
      while (keep < in_session.size() && keep < rendered.size() && in_session[keep] == rendered[keep]) ++keep;
      if (keep < in_session.size() || keep == rendered.size()) {
        session.reset();
        in_session.clear();
        keep = 0;
      }
      const std::span<const int32_t> fresh(rendered.data() + keep, rendered.size() - keep);
      if (session.position() + int64_t(fresh.size()) >= session.max_context()) {
        fmt::print(stderr, "error: the conversation ({} tokens) no longer fits the context of {} tokens; /reset to start over\n",
                   rendered.size(), session.max_context());
        messages.pop_back();
        continue;
      }
      g_interrupted.store(false);
      Tokenizer::StreamDecoder stream(*rt.tokenizer, /*skip_special=*/true);
      std::string reply;
      std::vector<int32_t> generated;
      const GenerationStats stats =
          generate(session, sampler, fresh, o->max_tokens, rt.stop_ids, [&](int32_t token, bool stop) {
            generated.push_back(token);
            if (!stop) {
              const std::string piece = stream.push(token);
              reply += piece;
              std::fwrite(piece.data(), 1, piece.size(), stdout);
              std::fflush(stdout);
            }
            return !g_interrupted.load();
          });
      const std::string rest = stream.flush();
      reply += rest;
      std::fwrite(rest.data(), 1, rest.size(), stdout);
      fmt::print("\n");
      std::fflush(stdout);
      const bool interrupted = g_interrupted.exchange(false);
      if (interrupted && interactive) fmt::print(stderr, "(reply stopped)\n");
      // The session consumed the fresh prompt and every generated token but the last.
      in_session.insert(in_session.end(), fresh.begin(), fresh.end());
      if (!generated.empty()) in_session.insert(in_session.end(), generated.begin(), generated.end() - 1);
      messages.push_back({"assistant", reply});
      if (!o->quiet) {
        const double tps = stats.decode_seconds > 0 ? double(stats.generated_tokens - 1) / stats.decode_seconds : 0;
        fmt::print(stderr, "[{} new prompt tokens in {:.2f}s, {} tokens at {:.1f} tok/s, context {}/{}]\n",
                   stats.prompt_tokens, stats.prefill_seconds, stats.generated_tokens, tps, session.position(),
                   session.max_context());
      }
    }
    if (interactive) fmt::print("\n");
  });
}

}  // namespace turbospark::cli
