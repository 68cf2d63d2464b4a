// Steps that run rows of several sequences in one forward (continuous batching): each row
// carries its sequence and position; the sequences share one paged KV pool (engine/kv_cache.h)
// and each has its own block table row. The weight matmuls see every row of the step at once;
// attention and the cache writes index by row. A family with recurrent state per sequence
// (qwen4_exp: GatedDeltaNet, QSA keys, the PLE n-gram context) keeps a state slot per
// sequence and gets the step's rows as runs of one sequence (ForwardBatch::runs): its
// per-sequence ops run once per run, the rest over every row at once.
//
// Rows of one sequence must be consecutive and in position order within a step; a sequence's
// positions must follow what its cache holds (the caller tracks that, as Session does).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "engine/kv_cache.h"
#include "models/model.h"

namespace turbospark {

struct BatchOptions {
  int n_seqs = 1;
  int64_t max_context = 0;   // per sequence; 0: the model's
  int64_t pool_tokens = 0;   // KV positions shared by all sequences; 0: n_seqs x max_context
  int64_t max_rows = 0;      // rows a step may hold; 0: the backend's preferred micro-batch
};

struct BatchRow {
  int seq = 0;
  int32_t token = 0;
  int64_t position = 0;
  bool want = false;  // this row's logits (or greedy id) are returned
};

class BatchRunner {
 public:
  BatchRunner(const Model& model, Backend& backend, BatchOptions options);

  int64_t max_rows() const { return max_rows_; }
  int64_t max_context() const { return max_context_; }
  int n_seqs() const { return kv_.n_seqs(); }
  const KvCache& kv() const { return kv_; }

  // Makes positions [0, n_tokens) of seq addressable; false (nothing taken) when the pool has
  // too few free blocks.
  bool reserve(int seq, int64_t n_tokens) { return kv_.grow(seq, n_tokens); }
  // Forgets seq: its blocks go back to the pool, its recurrent state (if any) is reset.
  void release(int seq);
  // Prefix caching (KvCache::attach_prefix / register_prefix), for families without recurrent
  // state (their state at a block boundary is not kept): off otherwise, attaching nothing.
  bool caches_prefixes() const { return states_.empty(); }
  int64_t attach_prefix(int seq, std::span<const int32_t> tokens, int64_t max_tokens) {
    return caches_prefixes() ? kv_.attach_prefix(seq, tokens, max_tokens) : 0;
  }
  void register_prefix(int seq, std::span<const int32_t> tokens) {
    if (caches_prefixes()) kv_.register_prefix(seq, tokens);
  }

  // Runs `rows` (at most max_rows()). With `logits`, it receives [wanted rows, vocab] in row
  // order (resized; pass the same vector every step to reuse its memory); else `greedy` receives each wanted row's argmax (-1 for a row whose logits hold a
  // NaN). Non-finite logits are returned as they are: the caller fails that row's request.
  void step(std::span<const BatchRow> rows, std::vector<float>* logits, std::vector<int32_t>* greedy);

  // Optional per-activation hook (as Session::trace); while set, steps run eagerly (no graphs).
  TraceHook trace;

 private:
  void forward(std::span<const BatchRow> rows, float* logits, int32_t* greedy);

  const Model& model_;
  Backend& backend_;
  int64_t max_context_;
  int64_t max_rows_;
  KvCache kv_;
  std::unique_ptr<ModelWorkspace> workspace_;
  std::vector<std::unique_ptr<SequenceState>> states_;  // per sequence (stateful families)
  std::vector<SequenceRun> runs_;                        // the step's, for stateful families
  BackendArray<int32_t> tokens_dev_, row_seq_dev_, greedy_dev_;
  BackendArray<int64_t> positions_dev_;
  std::vector<int32_t> tokens_, row_seq_;
  std::vector<int64_t> positions_, wanted_;
  int32_t dropped_id_ = -1;  // where a forward with no wanted row puts its unused greedy id
  // Decode-only steps (every row wanted, greedy ids, no recurrent state) read and write the
  // same buffers whatever the rows' sequences and positions, which live in the device buffers
  // above: the backend may replay them as graphs, one per row count. Their ids land in
  // graph_greedy_ (allocated once: a captured download keeps its host address) and are copied
  // out after each step. Keyed by row count + (lone rows << 32) (KvLayerView::lone_rows).
  std::map<int64_t, std::unique_ptr<StepGraph>> decode_graphs_;
  std::vector<int32_t> graph_greedy_;
};

}  // namespace turbospark
