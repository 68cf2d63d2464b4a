#include "engine/batch.h"

#include <algorithm>

#include "core/error.h"

namespace turbospark {

static KvPoolOptions pool_options(const Model& model, const BatchOptions& o) {
  TS_CHECK(o.n_seqs >= 1, "a batch runner needs at least one sequence, got {}", o.n_seqs);
  if (o.max_context < 0) fail("context length (--ctx) must be >= 0 (0 = the model's), got {}", o.max_context);
  KvPoolOptions p;
  p.n_seqs = o.n_seqs;
  p.max_tokens_per_seq = o.max_context > 0 ? o.max_context : model.info().max_context;
  p.pool_tokens = o.pool_tokens > 0 ? o.pool_tokens : p.max_tokens_per_seq * o.n_seqs;
  return p;
}

BatchRunner::BatchRunner(const Model& model, Backend& backend, BatchOptions options)
    : model_(model),
      backend_(backend),
      max_context_(pool_options(model, options).max_tokens_per_seq),
      max_rows_(options.max_rows > 0 ? options.max_rows : backend.preferred_prefill_batch()),
      kv_(backend, model.kv_spec(), pool_options(model, options)) {
  workspace_ = model_.new_workspace(backend_, max_rows_);
  for (int s = 0; s < options.n_seqs; ++s) {
    std::unique_ptr<SequenceState> st = model_.new_sequence_state(backend_, max_context_);
    if (!st) break;
    states_.push_back(std::move(st));
  }
  // Every family batches (those with sequence state through ForwardBatch::runs); one that
  // could not would say so in its capability table and need a runner that steps apart.
  TS_CHECK(model_.capabilities().batched_sequences.on, "{}: rows of several sequences cannot share a step: {}",
           model_.info().architecture, model_.capabilities().batched_sequences.why_not);
  tokens_dev_ = backend_.alloc_array<int32_t>(max_rows_);
  row_seq_dev_ = backend_.alloc_array<int32_t>(max_rows_);
  greedy_dev_ = backend_.alloc_array<int32_t>(max_rows_);
  positions_dev_ = backend_.alloc_array<int64_t>(max_rows_);
  graph_greedy_.assign(size_t(max_rows_), -1);
}

void BatchRunner::release(int seq) {
  kv_.release(seq);
  if (!states_.empty()) states_[size_t(seq)]->reset();
}

void BatchRunner::step(std::span<const BatchRow> rows, std::vector<float>* logits, std::vector<int32_t>* greedy) {
  const int64_t n = int64_t(rows.size());
  const ModelInfo& info = model_.info();
  TS_CHECK(n > 0 && n <= max_rows_, "a step of {} rows (at most {})", n, max_rows_);
  TS_CHECK((logits != nullptr) != (greedy != nullptr), "a step wants exactly one of logits or greedy ids");
  tokens_.resize(size_t(n));
  row_seq_.resize(size_t(n));
  positions_.resize(size_t(n));
  int64_t wanted = 0;
  for (int64_t t = 0; t < n; ++t) {
    const BatchRow& r = rows[size_t(t)];
    TS_CHECK(r.seq >= 0 && r.seq < kv_.n_seqs(), "row {}: sequence {} outside [0, {})", t, r.seq, kv_.n_seqs());
    if (r.token < 0 || r.token >= info.vocab_size)
      fail("token id {} at row {} is outside the vocabulary (vocab_size {})", r.token, t, info.vocab_size);
    TS_CHECK(r.position >= 0 && r.position < kv_.seq_tokens(r.seq),
             "row {}: position {} of sequence {} is not reserved ({} positions are)", t, r.position, r.seq,
             kv_.seq_tokens(r.seq));
    if (t > 0 && rows[size_t(t - 1)].seq == r.seq)
      TS_CHECK(r.position == rows[size_t(t - 1)].position + 1, "row {}: sequence {}'s rows must be consecutive", t, r.seq);
    tokens_[size_t(t)] = r.token;
    row_seq_[size_t(t)] = r.seq;
    positions_[size_t(t)] = r.position;
    wanted += r.want;
  }
  model_.check_tokens(tokens_);
  const int64_t V = info.vocab_size;
  // Every wanted row is written by its forward: sized, not cleared (a step's logits are
  // wanted rows x vocab, megabytes at real vocabularies).
  if (logits) logits->resize(size_t(wanted * V));
  if (greedy) greedy->resize(size_t(wanted));
  backend_.upload_array<int32_t>(tokens_dev_, tokens_);
  backend_.upload_array<int32_t>(row_seq_dev_, row_seq_);
  backend_.upload_array<int64_t>(positions_dev_, positions_);
  // Families with sequence state: the step's runs of one sequence, each with its state.
  runs_.clear();
  for (int64_t t0 = 0; !states_.empty() && t0 < n;) {
    int64_t t1 = t0 + 1;
    while (t1 < n && rows[size_t(t1)].seq == rows[size_t(t0)].seq) ++t1;
    SequenceState* state = states_[size_t(rows[size_t(t0)].seq)].get();
    TS_CHECK(std::none_of(runs_.begin(), runs_.end(), [&](const SequenceRun& r) { return r.state == state; }),
             "{}: sequence {}'s rows are split within a step", info.architecture, rows[size_t(t0)].seq);
    runs_.push_back({t0, t1 - t0, state});
    t0 = t1;
  }
  forward(rows, logits ? logits->data() : nullptr, greedy ? greedy->data() : nullptr);
}

void BatchRunner::forward(std::span<const BatchRow> rows, float* logits, int32_t* greedy) {
  const int64_t n = int64_t(rows.size());
  wanted_.clear();
  for (int64_t t = 0; t < n; ++t)
    if (rows[size_t(t)].want) wanted_.push_back(t);
  ForwardBatch b;
  b.workspace = workspace_.get();
  b.runs = runs_;
  b.tokens = tokens_dev_.data();
  b.positions = positions_dev_.data();
  b.host_tokens = tokens_.data();
  b.n = n;
  b.trace = trace ? &trace : nullptr;
  // Leading rows alone of their sequence in this step (decode rows: serve puts them first).
  int64_t lone = 0;
  while (lone < n && (lone == 0 || rows[size_t(lone - 1)].seq != rows[size_t(lone)].seq) &&
         (lone + 1 == n || rows[size_t(lone + 1)].seq != rows[size_t(lone)].seq))
    ++lone;
  for (int i = 0; i < kv_.n_layers(); ++i) {
    KvLayerView v = kv_.layer(i);
    v.row_seq = row_seq_dev_.data();
    v.lone_rows = lone;
    b.kv.push_back(v);
  }
  if (wanted_.empty()) {
    // Rows that only fill the cache (a prefill chunk that does not end its prompt): the last
    // row's greedy id is computed and dropped (only that id leaves the backend).
    b.greedy_ids = &dropped_id_;
    b.greedy_ids_backend = greedy_dev_.data();
    model_.forward(backend_, b);
    return;
  }
  b.logit_rows = wanted_;
  if (logits) {
    b.logits = logits;
  } else if (states_.empty() && int64_t(wanted_.size()) == n && !trace) {
    // A decode-only step (see decode_graphs_): replayable, keyed by its row count.
    b.greedy_ids = graph_greedy_.data();
    b.greedy_ids_backend = greedy_dev_.data();
    backend_.run_step(decode_graphs_[n + (lone << 32)], [&] { model_.forward(backend_, b); });
    std::copy_n(graph_greedy_.data(), n, greedy);
    return;
  } else {
    b.greedy_ids = greedy;
    b.greedy_ids_backend = greedy_dev_.data();
  }
  model_.forward(backend_, b);
}

}  // namespace turbospark
