// The decode loop shared by generate, run, chat and bench: prefill the prompt in
// micro-batches, then sample one token at a time until max_new_tokens or a stop token.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "engine/sampler.h"
#include "engine/session.h"

namespace turbospark {

struct GenerationStats {
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double prefill_seconds = 0;
  double decode_seconds = 0;
  bool stopped_on_eos = false;
};

// on_token is called for each generated token (stop tokens included, flagged); returning
// false ends generation early (Ctrl-C in chat).
using TokenCallback = std::function<bool(int32_t token, bool is_stop)>;

GenerationStats generate(Session& session, Sampler& sampler, std::span<const int32_t> prompt, int64_t max_new_tokens,
                         const std::vector<int32_t>& stop_ids, const TokenCallback& on_token);

}  // namespace turbospark
