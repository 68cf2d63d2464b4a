// What every model family provides to the engine: its facts (ModelInfo), the per-layer KV
// geometry the engine allocates (KvSpec), and a forward pass over a micro-batch of tokens
// recorded against a Backend. Families are built from the shared blocks in blocks/ and
// registered in registry.cpp.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <span>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "ops/backend.h"

namespace turbospark {

class Checkpoint;
class HfConfig;

struct ModelInfo {
  std::string architecture;  // e.g. "Qwen3ForCausalLM"
  std::string family;        // registry key, e.g. "qwen3"
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int n_layers = 0;
  int64_t max_context = 0;  // max_position_embeddings
  std::vector<int32_t> eos_ids;
  int64_t n_params = 0;
  int64_t weight_bytes = 0;          // every weight the model reads
  int64_t active_weight_bytes = 0;   // bytes one decode token reads (top-k experts only)
  int64_t expert_bytes = 0;          // one routed expert's weights (0: dense)
  int64_t routed_weight_bytes = 0;   // every routed expert of every layer
};

// One feature of the capability table: on, or off with the reason a user is told.
struct Capability {
  bool on = true;
  std::string why_not;  // when off: "<architecture> <reason>", a message's ending
};

// What a loaded model supports beyond its forward pass (`turbospark inspect` prints it; the
// README's capability table lists it per family). The engine consults it rather than deciding
// on its own, and a flag that asks for a feature that is off is refused with its why_not;
// nothing runs another way in silence.
struct Capabilities {
  Capability chunked_prefill;      // a prompt fed in chunks of any size gives the same logits
  Capability decode_graphs;        // greedy decode steps replayed as CUDA graphs
  Capability batched_sequences;    // rows of several sequences share one forward (serve)
  Capability prefix_cache;         // serve reuses earlier requests' full KV blocks
  Capability expert_streaming;     // routed experts through a bounded cache (--expert-cache-*)
  Capability expert_speculation;   // the next layer's experts guessed ahead (--expert-speculate)
};

// KV geometry per layer (n_kv_heads, head_dim); 0 heads for a layer without a KV cache.
struct KvLayerSpec {
  int n_kv_heads = 0;
  int head_dim = 0;
};

// Per-forward scratch a family allocates once (sized for the largest micro-batch) and the
// engine keeps per session, so a decode step allocates nothing.
class ModelWorkspace {
 public:
  virtual ~ModelWorkspace() = default;
};

// Per-sequence recurrent state a family needs beyond the paged KV cache (GatedDeltaNet conv
// and delta-rule states, PLE conv state and n-gram token context, QSA index keys). Created
// by the model, owned by the engine's Session, passed to every forward of that sequence.
class SequenceState {
 public:
  virtual ~SequenceState() = default;
  virtual void reset() = 0;  // back to an empty sequence
};

// Rows [first, first + rows) of a micro-batch, all of one sequence, and that sequence's state:
// a family with sequence state runs rows of several sequences in one forward as such runs
// (ForwardBatch::runs), its per-sequence ops (convolutions, recurrences, QSA's key tables,
// PLE's n-gram context) once per run, everything row-wise over every row at once.
struct SequenceRun {
  int64_t first = 0, rows = 0;
  SequenceState* state = nullptr;
};

// Names an intermediate activation for dump-and-diff against the reference (llama.cpp's
// cb(cur, name, il)). Called with the backend's view; a null hook costs nothing.
using TraceHook = std::function<void(const char* name, int layer, const Mat& value)>;

struct ForwardBatch {
  // Backend memory, uploaded by the engine before the forward (ops read them on the device).
  const int32_t* tokens = nullptr;      // [n] token ids (validated < vocab by the engine)
  const int64_t* positions = nullptr;   // [n] absolute positions
  // The same ids in host memory, for what a family computes on the host on purpose (PLE's
  // n-gram ids from the carried token context, refusing placeholder tokens).
  const int32_t* host_tokens = nullptr;  // [n]
  int64_t n = 0;                        // micro-batch rows, <= workspace capacity
  std::vector<KvLayerView> kv;          // per layer
  bool all_logits = false;              // logits for every row, else only the last
  // When non-empty (host, ascending row indices): the outputs of these rows, in this order,
  // instead of all rows or the last (a step of several sequences wants each one's last row).
  // Families with sequence state run one sequence a forward and refuse it.
  std::span<const int64_t> logit_rows;
  float* logits = nullptr;              // host [n or 1, vocab] f32
  // Greedy decoding: when logits is null, the argmax id of each wanted row lands here
  // (host [n or 1]; -1 for a row holding a NaN) and nothing else leaves the backend.
  int32_t* greedy_ids = nullptr;
  int32_t* greedy_ids_backend = nullptr;  // backend memory [n] the argmax is computed into
  // Router probabilities, when non-null: host [n_layers][n][n_experts] (rows of non-MoE
  // layers left untouched).
  float* router_probs = nullptr;
  ModelWorkspace* workspace = nullptr;
  SequenceState* state = nullptr;       // null for families without recurrent state
  // Rows of several sequences (BatchRunner), for families with state: consecutive runs
  // covering [0, n), each with its sequence's state (`state` stays null). Empty: every row
  // belongs to `state`.
  std::span<const SequenceRun> runs;
  const TraceHook* trace = nullptr;
  // Set by a caller that runs Model::prepare_step before forward (outside any recorded step)
  // and Model::finish_step after the step has completed; otherwise forward runs both itself.
  bool host_work_apart = false;

  // Hands an activation to the trace hook, when one is set.
  void emit(const char* name, int layer, const Mat& value) const {
    if (trace && *trace) (*trace)(name, layer, value);
  }
  // The checks every family's forward starts with.
  void check(int64_t workspace_rows, int n_layers) const {
    TS_CHECK(n > 0 && n <= workspace_rows, "micro-batch of {} rows exceeds the workspace ({})", n, workspace_rows);
    TS_CHECK(int(kv.size()) == n_layers, "KV views for {} layers, model has {}", kv.size(), n_layers);
    TS_CHECK((logits != nullptr) != (greedy_ids != nullptr), "a forward wants exactly one of logits or greedy ids");
    for (size_t i = 0; i < logit_rows.size(); ++i)
      TS_CHECK(logit_rows[i] >= 0 && logit_rows[i] < n && (i == 0 || logit_rows[i] > logit_rows[i - 1]),
               "logit row {} of a micro-batch of {} rows (ascending, in range)", logit_rows[i], n);
  }
};

// A micro-batch's runs: b.runs (checked to cover its rows in order, each with a state), or one
// run of every row over b.state.
inline std::vector<SequenceRun> sequence_runs(const ForwardBatch& b) {
  if (b.runs.empty()) return {SequenceRun{0, b.n, b.state}};
  int64_t next = 0;
  for (const SequenceRun& r : b.runs) {
    TS_CHECK(r.first == next && r.rows > 0 && r.state, "sequence run [{}, +{}) after row {} (state {})", r.first,
             r.rows, next, r.state != nullptr);
    next += r.rows;
  }
  TS_CHECK(next == b.n, "sequence runs cover {} of {} rows", next, b.n);
  return {b.runs.begin(), b.runs.end()};
}

class Model {
 public:
  virtual ~Model() = default;
  virtual const ModelInfo& info() const = 0;
  virtual std::vector<KvLayerSpec> kv_spec() const = 0;
  virtual int64_t n_experts() const { return 0; }
  // Routed experts each token uses (top-k); 0 for dense models.
  virtual int experts_per_token() const { return 0; }
  // Whether forward() hands expert streaming the next MoE layer's likely experts
  // (Backend::speculate_experts; --expert-speculate).
  virtual bool guesses_next_experts() const { return false; }
  // Every routed expert's weights (expert streaming: which bytes not to page in).
  virtual void for_each_routed_expert(const std::function<void(const ExpertWeights&)>& fn) const { (void)fn; }
  // The first routed expert of every MoE layer (pointers into the model), in layer order:
  // what a device expert cache lays its slots out from (Backend::set_expert_cache).
  std::vector<const ExpertWeights*> first_expert_of_each_layer() const {
    std::vector<const ExpertWeights*> out;
    for_each_routed_expert([&](const ExpertWeights& e) {
      if (out.empty() || out.back()->gate.layer != e.gate.layer) out.push_back(&e);
    });
    return out;
  }
  virtual std::unique_ptr<ModelWorkspace> new_workspace(Backend& backend, int64_t max_rows) const = 0;
  virtual std::unique_ptr<SequenceState> new_sequence_state(Backend& backend, int64_t max_context) const {
    return nullptr;
  }
  // What that state holds ("" for families without one), for the capability table's reasons.
  virtual std::string sequence_state() const { return ""; }
  // The capability table, from the facts above (models/model.cpp).
  Capabilities capabilities() const;
  virtual void forward(Backend& backend, const ForwardBatch& batch) const = 0;
  // The host work of a step that no recorded step (CUDA graph) can hold, apart from forward's
  // device work (ForwardBatch::host_work_apart): prepare_step before it, ordered with the
  // queued work (Qwen4-Exp: the n-gram rows computed from the carried token context, gathered
  // from the mapped table and uploaded), finish_step once the step has completed (its checks
  // of what the step wrote, such as a NaN flag). A replayed decode step runs no host code of
  // forward, so Session calls these around every step.
  virtual void prepare_step(Backend& backend, const ForwardBatch& batch) const { (void)backend, (void)batch; }
  virtual void finish_step(Backend& backend, const ForwardBatch& batch) const { (void)backend, (void)batch; }
  // Refuses, by name, token ids this model cannot take beyond the vocabulary range (which the
  // callers check): Gemma 4's multimodal placeholders. Called by Session and BatchRunner on
  // every step's tokens before it runs, so a replayed step graph (which runs no host code of
  // forward) checks them too.
  virtual void check_tokens(std::span<const int32_t> tokens) const { (void)tokens; }
};

// Keeps the checkpoint mapped for as long as the model's weight views live (and, for a
// model loaded onto a backend of its own, that backend: declared first, destroyed last).
struct LoadedModel {
  std::shared_ptr<Backend> owned_backend;
  std::shared_ptr<Checkpoint> checkpoint;
  std::unique_ptr<Model> model;
};

}  // namespace turbospark
