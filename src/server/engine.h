// The serving engine behind `turbospark serve`: requests queue for one of N sequence slots,
// and one worker thread runs steps of continuous batching (engine/batch.h): each step holds
// every decoding request's next row plus prefill chunks of prompts still being read, up to
// the step's row budget, in one forward, the sequences sharing one paged KV pool. A long
// prompt is read a chunk a step, so replies already streaming keep their pace; a slot whose
// previous conversation is a prefix of the new prompt prefills only the new part.
//
// Prefix caching: full KV blocks are registered under their token prefix as they fill, a
// finished request's blocks stay cached, and a new prompt attaches the cached blocks that
// begin it (families with recurrent state keep the older rule instead: a free slot whose
// previous sequence is a prefix of the prompt). The pool holds every slot's whole context
// unless --kv-pool-tokens makes it smaller; then a decode that finds no free block preempts
// the newest sequence holding blocks (recomputed later from what it held plus its pending
// token, through the prefix cache where its blocks are still there).
//
// Thread safety: submit(), cancel() and metrics are for any thread; a RequestHandle is read by
// the one thread that submitted it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "cli/common.h"
#include "engine/batch.h"
#include "engine/sampler.h"

namespace turbospark::server {

constexpr int64_t kPrefillChunk = 256;

struct ServeRequest {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int64_t max_tokens = 256;
  std::vector<std::string> stop;  // stop strings: generation ends before the first of them
  int top_logprobs = -1;          // -1: no log-probabilities; else the chosen token's and the n best
};

// One generated token's log-probability (natural log of the model's softmax, temperature 1,
// before any sampling filter) and the most likely alternatives, best first.
struct TokenLogprob {
  std::string token;  // its text (decoded alone: may be part of a UTF-8 character)
  float logprob = 0;
  std::vector<std::pair<std::string, float>> top;
};

enum class Finish { kNone, kStop, kLength, kStopString, kCancelled, kError };

// One step's output for a request: text (possibly empty), and on the last event the reason
// and the counts.
struct ServeEvent {
  std::string text;
  Finish finish = Finish::kNone;
  std::string stop_string;  // the one matched (kStopString)
  std::string error;        // kError
  std::vector<TokenLogprob> logprobs;  // the tokens of this step (top_logprobs >= 0)
  int64_t prompt_tokens = 0;
  int64_t completion_tokens = 0;
  bool done() const { return finish != Finish::kNone; }
};

class RequestHandle {
 public:
  // The next event, waiting for it. After the event with done(), returns it again.
  ServeEvent next();
  // Asks the worker to stop this request (a client that went away); its slot is freed at the
  // worker's next step.
  void cancel() { cancelled_.store(true); }
  bool cancelled() const { return cancelled_.load(); }

 private:
  friend class ServeEngine;
  void push(ServeEvent e);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ServeEvent> events_;
  ServeEvent last_;
  bool finished_ = false;
  std::atomic<bool> cancelled_{false};
};

// Prometheus-style counters and histograms (seconds).
struct Histogram {
  std::vector<double> bounds;
  std::vector<uint64_t> counts;  // per bucket (cumulative at export), plus +Inf
  double sum = 0;
  uint64_t n = 0;
  explicit Histogram(std::vector<double> b) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double v);
};

struct ServeMetrics {
  uint64_t requests = 0, requests_finished = 0, requests_cancelled = 0, requests_failed = 0;
  uint64_t prompt_tokens = 0, prompt_tokens_cached = 0, generated_tokens = 0;
  int64_t queued = 0, running = 0;
  int64_t kv_tokens_used = 0, kv_tokens_total = 0;
  int64_t kv_blocks_used = 0, kv_blocks_total = 0, kv_blocks_cached = 0;
  uint64_t steps = 0, step_rows = 0, step_seqs = 0;  // forwards run, the rows and sequences they held
  uint64_t preemptions = 0;
  // Expert streaming (either tier), when on: experts looked up in the cache, loaded into it,
  // and bytes read from disk (the CPU tier's; the device tier copies from host memory).
  bool expert_cache = false;
  int64_t expert_lookups = 0, expert_loads = 0, expert_bytes_read = 0;
  Histogram ttft{{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
  Histogram tpot{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
};

class ServeEngine {
 public:
  // rt outlives the engine. parallel slots of ctx tokens each; a step holds at most
  // step_rows rows (0: the backend's micro-batch).
  // pool_tokens: KV positions shared by all slots (0: parallel x ctx, so the pool never runs
  // out; fewer: sequences wait for blocks, and a decode that finds none preempts the newest).
  ServeEngine(cli::LoadedRuntime& rt, int parallel, int64_t ctx, int64_t step_rows = 0, bool prefix_cache = true,
              int64_t pool_tokens = 0);
  ~ServeEngine();
  ServeEngine(const ServeEngine&) = delete;
  ServeEngine& operator=(const ServeEngine&) = delete;

  std::shared_ptr<RequestHandle> submit(ServeRequest request);
  // Cancels queued and running requests and stops the worker (each gets a kCancelled event).
  void shutdown();

  int64_t context() const { return ctx_; }
  int parallel() const { return int(slots_.size()); }
  int64_t step_rows() const { return runner_.max_rows(); }
  ServeMetrics metrics();  // a snapshot
  std::string prometheus();

 private:
  struct Slot;
  struct Pending {
    ServeRequest request;
    std::shared_ptr<RequestHandle> handle;
    double submitted = 0;
  };
  void run();
  void admit(Pending p);
  // One step of every running slot: rows gathered, one batched forward, tokens delivered.
  void step();
  // A sampled token to its request; false when that finished it (the slot is then free).
  bool deliver(Slot& s, int32_t token, std::span<const float> logits);
  void finish(Slot& s, Finish why, std::string error = {}, std::string stop_string = {});
  void publish_kv();  // the pool's block counts, for metrics() on other threads
  // The running sequence admitted last that holds blocks, not among `stepping`; null if none.
  Slot* newest_holder(const std::vector<Slot*>& stepping);
  void preempt(Slot& s);  // gives its blocks back; it is recomputed when blocks are free
  TokenLogprob token_logprob(std::span<const float> logits, int32_t token, int top_n) const;

  cli::LoadedRuntime& rt_;
  int64_t ctx_;
  BatchRunner runner_;
  bool prefix_cache_;  // the runner caches prefixes and the server wants it
  bool check_kv_ = false;  // TURBOSPARK_CHECK_KV: the pool's bookkeeping checked after every step
  std::vector<std::unique_ptr<Slot>> slots_;
  uint64_t admitted_ = 0;  // admission order, so prefill chunks go first come first served
  uint64_t steps_ = 0;     // steps run (the worker's)
  std::vector<float> step_logits_;    // a step's wanted rows' logits, reused step to step
  std::vector<int32_t> step_greedy_;  // or their greedy ids
  std::atomic<int64_t> kv_blocks_held_{0}, kv_blocks_cached_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> queue_;
  bool stopping_ = false;
  ServeMetrics metrics_;  // guarded by mu_
  std::thread worker_;
};

// The longest suffix of `text` that is a proper prefix of one of `stops`: what must be held
// back from the client until the next piece shows whether a stop string begins there.
size_t stop_prefix_hold(const std::string& text, const std::vector<std::string>& stops);

}  // namespace turbospark::server
