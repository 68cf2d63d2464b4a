// A session is one sequence being run: its KV cache, its position, and the model's
// workspace. Prompts are fed in micro-batches of at most max_prefill_batch tokens
// (chunked prefill); decode is a micro-batch of one. Chunk boundaries must not move the
// logits (tested at many chunk sizes).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "engine/kv_cache.h"
#include "models/model.h"

namespace turbospark {

constexpr int64_t kMaxPrefillBatch = kDefaultPrefillBatch;  // the CPU backend's micro-batch

struct SessionOptions {
  int64_t max_context = 0;  // 0: the model's max_position_embeddings
  int64_t max_prefill_batch = 0;  // 0: the backend's preferred_prefill_batch()
};

class Session {
 public:
  Session(const Model& model, Backend& backend, SessionOptions options = {});

  // Runs `tokens` at the current position. `chunk` > 0 splits them into micro-batches of
  // at most that many tokens (and never more than max_prefill_batch). With all_logits the
  // result is [n, vocab], else [vocab] for the last token. router_probs, when non-null,
  // receives [n_layers, n, n_experts] router probabilities.
  std::vector<float> feed(std::span<const int32_t> tokens, int64_t chunk = 0, bool all_logits = false,
                          std::vector<float>* router_probs = nullptr);
  // Runs `tokens` like feed() and returns the greedy next token, the argmax of the last
  // row's logits: only that id leaves the backend. A NaN logit fails as feed() does.
  int32_t feed_greedy(std::span<const int32_t> tokens, int64_t chunk = 0);

  int64_t position() const { return position_; }
  int64_t max_context() const { return max_context_; }
  const Model& model() const { return model_; }
  // Forgets the sequence (keeps the allocated blocks for reuse).
  void reset();

  TraceHook trace;  // optional per-activation hook for dump-and-diff tools and tests

 private:
  const Model& model_;
  Backend& backend_;
  SessionOptions options_;
  int64_t max_context_;
  int64_t position_ = 0;
  KvCache kv_;
  std::unique_ptr<ModelWorkspace> workspace_;
  std::unique_ptr<SequenceState> state_;
  bool decode_graphs_on_ = true;  // model_.capabilities().decode_graphs
  // Validates tokens and context room, then runs them in micro-batches; each forward's
  // outputs go to logits (when non-null, all rows or the last) or to the greedy id.
  void run(std::span<const int32_t> tokens, int64_t chunk, bool all_logits, std::vector<float>* router_probs,
           float* logits, int32_t* greedy_id);

  std::vector<int64_t> positions_;       // host staging of one micro-batch's positions
  BackendArray<int32_t> tokens_dev_;     // [max_prefill_batch] the micro-batch's ids
  BackendArray<int64_t> positions_dev_;  // [max_prefill_batch] their positions
  BackendArray<int32_t> greedy_dev_;     // [1] the greedy id of the last row
  int32_t greedy_host_ = -1;             // where it lands: one address for every replay
  // The one-row greedy decode step, replayed; one graph per span bound (a power of two: the
  // backend may choose kernels by it, KvLayerView::span_bound).
  std::map<int64_t, std::unique_ptr<StepGraph>> decode_graphs_;
};

}  // namespace turbospark
