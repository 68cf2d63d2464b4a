#include "engine/generate.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"

namespace turbospark {

GenerationStats generate(Session& session, Sampler& sampler, std::span<const int32_t> prompt, int64_t max_new_tokens,
                         const std::vector<int32_t>& stop_ids, const TokenCallback& on_token) {
  using Clock = std::chrono::steady_clock;
  GenerationStats stats;
  stats.prompt_tokens = int64_t(prompt.size());
  if (max_new_tokens < 0) fail("--max-tokens must be >= 0, got {}", max_new_tokens);
  const int64_t room = session.max_context() - session.position() - int64_t(prompt.size());
  if (room < 0) {
    fail("prompt of {} tokens exceeds the context of {} tokens", prompt.size(), session.max_context());
  }
  max_new_tokens = std::min(max_new_tokens, room);
  const int64_t vocab = session.model().info().vocab_size;
  // Greedy decoding takes only the chosen id from the backend, never the logits.
  const bool greedy = sampler.greedy();
  std::vector<float> logits;
  int32_t next = -1;
  auto feed = [&](std::span<const int32_t> tokens) {
    if (greedy) {
      next = session.feed_greedy(tokens);
    } else {
      logits = session.feed(tokens);
    }
  };
  auto t0 = Clock::now();
  feed(prompt);
  stats.prefill_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  auto t1 = Clock::now();
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    int32_t token = greedy ? next : sampler.sample(logits.data(), vocab);
    ++stats.generated_tokens;
    bool stop = std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end();
    bool go_on = on_token(token, stop);
    if (stop) {
      stats.stopped_on_eos = true;
      break;
    }
    if (!go_on || i + 1 == max_new_tokens) break;
    int32_t one[1] = {token};
    feed(one);
  }
  stats.decode_seconds = std::chrono::duration<double>(Clock::now() - t1).count();
  return stats;
}

}  // namespace turbospark
