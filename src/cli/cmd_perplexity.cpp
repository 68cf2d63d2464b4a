// turbospark perplexity: perplexity of a text file, computed the way llama.cpp's
// llama-perplexity does (so the two numbers are comparable on the same GGUF): the text is
// tokenized once, cut into chunks of --ctx tokens (the first token of each chunk replaced by
// BOS when the vocabulary adds one), each chunk is run from an empty context, and the
// second half of every chunk is scored.
//
// --kl-divergence-base FILE also writes the scored log-probabilities in llama-perplexity's
// "_logits_" file format, so that
//   llama-perplexity -m MODEL.gguf --kl-divergence-base FILE --kl-divergence
// runs llama.cpp on exactly our tokens and reports its perplexity next to ours, the KL
// divergence between the two engines and how often their top-1 tokens agree.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>

#include "cli/commands.h"
#include "cli/common.h"
#include "core/error.h"
#include "engine/session.h"

namespace turbospark::cli {
namespace {

// One scored position in llama-perplexity's format: [scale, min_log_prob] as two floats,
// then one uint16 per vocabulary entry (the logit mapped onto [max-16, max]); row length
// 2*((n_vocab+1)/2) + 4 uint16s. Returns -log p(next).
double log_softmax_row(const float* logits, int32_t n_vocab, int32_t next, uint16_t* out) {
  float max_logit = logits[0], min_logit = logits[0];
  for (int32_t i = 1; i < n_vocab; ++i) {
    max_logit = std::max(max_logit, logits[i]);
    min_logit = std::min(min_logit, logits[i]);
  }
  min_logit = std::max(min_logit, max_logit - 16);
  double sum_exp = 0;
  for (int32_t i = 0; i < n_vocab; ++i) sum_exp += std::exp(double(logits[i]) - max_logit);
  const float log_sum_exp = float(std::log(sum_exp));
  if (out) {
    const float scale = (max_logit - min_logit) / 65535.f;
    const float header[2] = {scale, min_logit - max_logit - log_sum_exp};
    std::memcpy(out, header, sizeof(header));
    uint16_t* q = out + 4;
    for (int32_t i = 0; i < n_vocab; ++i) {
      q[i] = scale != 0 && logits[i] > min_logit ? uint16_t(std::lround((logits[i] - min_logit) / scale)) : 0;
    }
  }
  return double(max_logit) + log_sum_exp - logits[next];
}

}  // namespace

void add_perplexity_command(CLI::App& app) {
  struct Opts {
    std::string model, file, kld_out, device = "auto";
    int64_t ctx = 512, chunks = -1;
    int threads = 0;
    ExpertCacheFlags experts;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "perplexity", "Perplexity of a text file, chunked and scored like llama.cpp's llama-perplexity");
  cmd->add_option("--model,-m", o->model, "Model directory or .gguf file (default: the installed default model)");
  cmd->add_option("--file,-f", o->file, "UTF-8 text file")->required();
  cmd->add_option("--ctx,-c", o->ctx, "Tokens per chunk; the second half of each chunk is scored")
      ->check(CLI::Range(int64_t(4), int64_t(1) << 20));
  cmd->add_option("--chunks", o->chunks, "Use at most this many chunks (default: all)");
  cmd->add_option("--kl-divergence-base", o->kld_out,
                  "Also write the scored log-probabilities in llama-perplexity's format (for its --kl-divergence)");
  cmd->add_option("--device", o->device, "cpu, cuda or auto (cuda when built with it and a GPU is present)")
      ->capture_default_str();
  cmd->add_option("--threads,-t", o->threads, "Worker threads (default: all cores)");
  add_expert_cache_options(cmd, o->experts);
  cmd->callback([o] {
    std::ifstream in(o->file, std::ios::binary);
    if (!in) fail("{}: cannot open", o->file);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const std::string path = o->model.empty() ? default_model_path() : o->model;
    LoadedRuntime rt = load_runtime(path, o->device, o->threads, /*quiet=*/false, o->experts);
    if (!rt.tokenizer) fail("{}: no tokenizer (tokenizer.json or GGUF vocabulary) to tokenize the text", path);
    const Tokenizer& tok = *rt.tokenizer;
    const Model& model = *rt.model.model;
    const int64_t n_ctx = o->ctx;
    if (n_ctx > model.info().max_context) fail("--ctx {} exceeds the model's context of {}", n_ctx, model.info().max_context);

    // As llama-perplexity: tokenize with the vocabulary's special tokens (BOS when it adds
    // one), special-token text in the file stays plain text.
    std::vector<int32_t> tokens = tok.encode(text, /*parse_special=*/false, /*add_special=*/true);
    const std::vector<int32_t> probe = tok.encode("a", false, true), probe_plain = tok.encode("a", false, false);
    const bool add_bos = probe.size() > probe_plain.size() && tok.bos_token_id() && probe[0] == *tok.bos_token_id();
    if (int64_t(tokens.size()) < 2 * n_ctx) {
      fail("{}: {} tokens; at least {} (2 x --ctx) are needed", o->file, tokens.size(), 2 * n_ctx);
    }
    int64_t n_chunk = int64_t(tokens.size()) / n_ctx;
    if (o->chunks >= 0) n_chunk = std::min(n_chunk, o->chunks);
    const int32_t n_vocab = int32_t(model.info().vocab_size);
    const int64_t first = n_ctx / 2;

    std::ofstream kld;
    const int64_t nv = 2 * ((int64_t(n_vocab) + 1) / 2) + 4;
    std::vector<uint16_t> row_buf;
    if (!o->kld_out.empty()) {
      kld.open(o->kld_out, std::ios::binary);
      if (!kld) fail("{}: cannot open for writing", o->kld_out);
      const int32_t header_ctx = int32_t(n_ctx), header_chunks = int32_t(n_chunk);
      kld.write("_logits_", 8);
      kld.write(reinterpret_cast<const char*>(&header_ctx), 4);
      kld.write(reinterpret_cast<const char*>(&n_vocab), 4);
      kld.write(reinterpret_cast<const char*>(&header_chunks), 4);
      kld.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(n_chunk * n_ctx * 4));
      row_buf.resize(size_t(nv));
    }

    SessionOptions so;
    so.max_context = n_ctx;
    Session session(model, *rt.backend, so);
    double nll = 0, nll2 = 0;
    int64_t count = 0;
    const auto t0 = std::chrono::steady_clock::now();
    fmt::print(stderr, "perplexity: {} tokens, {} chunks of {} (scoring the last {} of each), BOS {}\n", tokens.size(),
               n_chunk, n_ctx, n_ctx - first - 1, add_bos ? "replaces each chunk's first token" : "not added");
    for (int64_t c = 0; c < n_chunk; ++c) {
      std::vector<int32_t> chunk(tokens.begin() + c * n_ctx, tokens.begin() + (c + 1) * n_ctx);
      if (add_bos) chunk[0] = *tok.bos_token_id();
      session.reset();
      const std::vector<float> logits = session.feed(chunk, 0, /*all_logits=*/true);
      for (int64_t i = first; i < n_ctx - 1; ++i) {
        const float* row = logits.data() + i * n_vocab;
        for (int32_t v = 0; v < n_vocab; ++v) {
          if (!std::isfinite(row[v])) fail("chunk {} position {}: non-finite logit", c, i);
        }
        const double v = log_softmax_row(row, n_vocab, chunk[size_t(i + 1)], row_buf.empty() ? nullptr : row_buf.data());
        if (!row_buf.empty()) kld.write(reinterpret_cast<const char*>(row_buf.data()), std::streamsize(nv * 2));
        nll += v, nll2 += v * v, ++count;
      }
      fmt::print(stderr, "[{}]{:.4f}{}", c + 1, std::exp(nll / double(count)), c + 1 == n_chunk ? "\n" : ",");
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double mean = nll / double(count);
    const double var = nll2 / double(count) - mean * mean;
    const double err = count > 1 && var > 0 ? std::sqrt(var / double(count - 1)) : 0.0;
    fmt::print("PPL = {:.4f} +/- {:.5f} over {} scored tokens ({} chunks of {}, {:.1f} s, {:.1f} tok/s)\n",
               std::exp(mean), std::exp(mean) * err, count, n_chunk, n_ctx, secs, double(n_chunk * n_ctx) / secs);
    if (kld.is_open()) {  // an ofstream never opened converts to true, and its close() fails
      kld.close();
      if (!kld) fail("{}: write failed", o->kld_out);
    }
  });
}

}  // namespace turbospark::cli
