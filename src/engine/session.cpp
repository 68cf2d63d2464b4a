#include "engine/session.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace turbospark {

static int64_t resolve_context(const Model& model, const SessionOptions& o) {
  if (o.max_context < 0) fail("context length (--ctx) must be >= 0 (0 = the model's), got {}", o.max_context);
  int64_t ctx = o.max_context > 0 ? o.max_context : model.info().max_context;
  return ctx;
}

Session::Session(const Model& model, Backend& backend, SessionOptions options)
    : model_(model),
      backend_(backend),
      options_(options),
      max_context_(resolve_context(model, options)),
      kv_(backend, model.kv_spec(), resolve_context(model, options)) {
  if (options_.max_prefill_batch == 0) options_.max_prefill_batch = backend_.preferred_prefill_batch();
  if (options_.max_prefill_batch < 0) fail("prefill micro-batch must be >= 1 (0 = the backend's), got {}", options_.max_prefill_batch);
  workspace_ = model_.new_workspace(backend_, options_.max_prefill_batch);
  state_ = model_.new_sequence_state(backend_, max_context_);
  decode_graphs_on_ = model_.capabilities().decode_graphs.on;
  positions_.resize(size_t(options_.max_prefill_batch));
  tokens_dev_ = backend_.alloc_array<int32_t>(options_.max_prefill_batch);
  positions_dev_ = backend_.alloc_array<int64_t>(options_.max_prefill_batch);
  greedy_dev_ = backend_.alloc_array<int32_t>(1);
}

void Session::reset() {
  position_ = 0;
  if (state_) state_->reset();
}

std::vector<float> Session::feed(std::span<const int32_t> tokens, int64_t chunk, bool all_logits,
                                 std::vector<float>* router_probs) {
  const int64_t n = int64_t(tokens.size()), V = model_.info().vocab_size;
  std::vector<float> logits(size_t(all_logits ? n * V : V));
  run(tokens, chunk, all_logits, router_probs, logits.data(), nullptr);
  for (size_t i = 0; i < logits.size(); ++i) {
    if (!std::isfinite(logits[i])) {
      const int64_t pos = all_logits ? position_ - n + int64_t(i) / V : position_ - 1;
      fail("non-finite logit at position {} (NaN or Inf in the forward pass)", pos);
    }
  }
  return logits;
}

int32_t Session::feed_greedy(std::span<const int32_t> tokens, int64_t chunk) {
  int32_t id = -1;
  run(tokens, chunk, false, nullptr, nullptr, &id);
  if (id < 0) fail("non-finite logit at position {} (NaN in the forward pass)", position_ - 1);
  return id;
}

void Session::run(std::span<const int32_t> tokens, int64_t chunk, bool all_logits, std::vector<float>* router_probs,
                  float* logits, int32_t* greedy_id) {
  const int64_t n = int64_t(tokens.size());
  const ModelInfo& info = model_.info();
  if (n == 0) fail("empty prompt: at least one token is needed");
  for (int64_t i = 0; i < n; ++i) {
    if (tokens[size_t(i)] < 0 || tokens[size_t(i)] >= info.vocab_size) {
      fail("token id {} at index {} is outside the vocabulary (vocab_size {})", tokens[size_t(i)], i, info.vocab_size);
    }
  }
  model_.check_tokens(tokens);
  if (position_ + n > max_context_) {
    fail("{} tokens at position {} exceed the context of {} tokens", n, position_, max_context_);
  }
  kv_.reserve(position_ + n);
  int64_t step = options_.max_prefill_batch;
  if (chunk > 0) step = std::min(step, chunk);

  const int64_t V = info.vocab_size;
  const int64_t E = model_.n_experts();
  const int L = info.n_layers;
  std::vector<float> chunk_router;
  if (router_probs) {
    router_probs->assign(size_t(int64_t(L) * n * std::max<int64_t>(E, 1)), 0.f);
    chunk_router.resize(size_t(int64_t(L) * step * std::max<int64_t>(E, 1)));
  }
  ForwardBatch batch;
  batch.workspace = workspace_.get();
  batch.state = state_.get();
  batch.trace = trace ? &trace : nullptr;
  // prepare_step / finish_step run here, around the step, so that a replayed step (which runs
  // no host code of forward) still gets its host work and checks.
  batch.host_work_apart = true;
  for (int i = 0; i < L; ++i) batch.kv.push_back(kv_.layer(i));
  for (int64_t start = 0; start < n; start += step) {
    const int64_t m = std::min(step, n - start);
    for (int64_t t = 0; t < m; ++t) positions_[size_t(t)] = position_ + t;
    // Uploads ordered with the queued work: the previous micro-batch has consumed these
    // buffers by the time the copies land.
    backend_.upload_array<int32_t>(tokens_dev_, tokens.subspan(size_t(start), size_t(m)));
    backend_.upload_array<int64_t>(positions_dev_, std::span<const int64_t>(positions_.data(), size_t(m)));
    batch.tokens = tokens_dev_.data();
    batch.positions = positions_dev_.data();
    batch.host_tokens = tokens.data() + start;
    batch.n = m;
    batch.all_logits = all_logits;
    if (logits) {
      batch.logits = all_logits ? logits + start * V : logits;
    } else {
      batch.greedy_ids = &greedy_host_;
      batch.greedy_ids_backend = greedy_dev_.data();
    }
    if (router_probs) {
      std::fill(chunk_router.begin(), chunk_router.end(), 0.f);
      batch.router_probs = chunk_router.data();
    }
    model_.prepare_step(backend_, batch);
    // A one-row greedy step reads and writes the same buffers whatever its position (the
    // position, the id and prepare_step's rows were uploaded above): the backend may replay
    // it as a graph. Traces and router captures read activations on the host mid-step, so
    // those run eagerly.
    const bool replayable = m == 1 && !logits && !router_probs && !trace && decode_graphs_on_;
    // The rows see at most position_ + m positions; a replayed graph is keyed by that bound
    // rounded up to a power of two (from 256), so one graph serves a range of positions.
    const int64_t span_bound =
        replayable ? int64_t(std::bit_ceil(uint64_t(std::max<int64_t>(position_ + m, 256)))) : position_ + m;
    for (KvLayerView& view : batch.kv) view.span_bound = span_bound;
    if (replayable) {
      backend_.run_step(decode_graphs_[span_bound], [&] { model_.forward(backend_, batch); });
    } else {
      model_.forward(backend_, batch);
    }
    model_.finish_step(backend_, batch);
    if (greedy_id) *greedy_id = greedy_host_;
    if (router_probs && E > 0) {
      for (int l = 0; l < L; ++l) {
        std::memcpy(router_probs->data() + (int64_t(l) * n + start) * E, chunk_router.data() + int64_t(l) * m * E,
                    size_t(m * E) * 4);
      }
    }
    position_ += m;
  }
}

}  // namespace turbospark
