#include "models/model.h"

#include <fmt/format.h>

namespace turbospark {

Capabilities Model::capabilities() const {
  Capabilities c;
  const std::string& arch = info().architecture;
  auto off = [&](const std::string& why) { return Capability{false, fmt::format("{} {}", arch, why)}; };
  const std::string state = sequence_state();
  if (!state.empty()) {
    // A step writes each sequence's own recurrent state, in place in backend memory, so decode
    // steps replay as graphs (the n-gram rows the host computes are uploaded before the
    // replay: Model::prepare_step) and rows of several sequences share a forward (its per-
    // sequence ops run once per sequence: ForwardBatch::runs). What a cached prefix would need
    // is that state at the prefix's end.
    c.prefix_cache = off(fmt::format("reuses no cached prefix: its {} is not kept at block boundaries", state));
  }
  if (experts_per_token() == 0) {
    c.expert_streaming = off("is a dense model (no routed experts to stream)");
    c.expert_speculation = c.expert_streaming;
  } else if (!guesses_next_experts()) {
    c.expert_speculation = off("does not guess its next layer's experts yet (qwen3_moe and qwen4_exp do)");
  }
  return c;
}

}  // namespace turbospark
