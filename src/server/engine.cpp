#include "server/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <optional>

#include "core/error.h"
#include "engine/session.h"
#include "formats/tokenizer.h"

namespace turbospark::server {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

ServeEvent RequestHandle::next() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !events_.empty() || finished_; });
  if (events_.empty()) return last_;
  ServeEvent e = std::move(events_.front());
  events_.pop_front();
  return e;
}

void RequestHandle::push(ServeEvent e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (finished_) return;
    if (e.done()) {
      finished_ = true;
      last_ = e;
      last_.text.clear();
    }
    events_.push_back(std::move(e));
  }
  cv_.notify_all();
}

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds.size() && v > bounds[i]) ++i;
  counts[i]++;
  sum += v;
  n++;
}

size_t stop_prefix_hold(const std::string& text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const std::string& s : stops) {
    const size_t max_len = std::min(text.size(), s.size() - 1);
    for (size_t len = max_len; len > hold; --len) {
      if (text.compare(text.size() - len, len, s, 0, len) == 0) {
        hold = len;
        break;
      }
    }
  }
  return hold;
}

struct ServeEngine::Slot {
  int seq = 0;                   // its row of the KV pool (and state slot)
  std::vector<int32_t> history;  // tokens its sequence holds, in order
  // Written by the worker, read by metrics() from other threads.
  std::atomic<bool> busy{false};
  std::atomic<int64_t> position{0};
  Pending p;
  uint64_t order = 0;         // admission order
  uint64_t last_step = 0;     // the engine step that last ran its rows
  std::optional<Sampler> sampler;
  std::optional<Tokenizer::StreamDecoder> decoder;
  // Tokens to prefill: the prompt, or after a preemption everything the sequence held plus
  // the sampled token not yet fed (recomputed; the reply goes on where it was).
  std::vector<int32_t> feed;
  size_t prompt_fed = 0;      // tokens of `feed` in the sequence (reused + fed)
  bool resumed = false;       // feed is a preempted sequence's (no second first token)
  bool needs_attach = false;  // preempted: attach cached blocks before reading feed again
  uint64_t preempted_at = 0;  // the step that preempted it (it sits that step out)
  int64_t completion = 0;     // tokens generated (the stop token not counted)
  int32_t last_token = -1;    // sampled, not yet fed
  std::string held;           // text held back while it may begin a stop string
  double first_token_at = 0, last_token_at = 0;
  // This step's rows of the slot, [row0, row0 + rows), the last wanted when `wants`.
  int64_t row0 = 0, rows = 0;
  bool wants = false;
};

static BatchOptions batch_options(int parallel, int64_t ctx, int64_t step_rows, int64_t pool_tokens) {
  TS_CHECK(parallel >= 1 && parallel <= 256, "--parallel must be in 1..256, got {}", parallel);
  if (pool_tokens != 0 && pool_tokens < ctx)
    fail("--kv-pool-tokens {} is less than one sequence's context (--ctx {}): a long reply could never finish",
         pool_tokens, ctx);
  BatchOptions o;
  o.n_seqs = parallel;
  o.max_context = ctx;
  o.max_rows = step_rows;
  o.pool_tokens = pool_tokens;
  return o;
}

ServeEngine::ServeEngine(cli::LoadedRuntime& rt, int parallel, int64_t ctx, int64_t step_rows, bool prefix_cache,
                         int64_t pool_tokens)
    : rt_(rt),
      ctx_(ctx),
      runner_(*rt.model.model, *rt.backend, batch_options(parallel, ctx, step_rows, pool_tokens)),
      prefix_cache_(prefix_cache && runner_.caches_prefixes()) {
  TS_CHECK(rt_.tokenizer.has_value(), "serve needs a model with a tokenizer (tokenizer.json or a GGUF vocabulary)");
  for (int i = 0; i < parallel; ++i) {
    slots_.push_back(std::make_unique<Slot>());
    slots_.back()->seq = i;
  }
  metrics_.kv_tokens_total = runner_.kv().total_blocks() * runner_.kv().block_size();
  metrics_.kv_blocks_total = runner_.kv().total_blocks();
  const char* check = std::getenv("TURBOSPARK_CHECK_KV");  // tests: the pool's bookkeeping after every step
  check_kv_ = check && *check && std::string(check) != "0";
  worker_ = std::thread([this] { run(); });
}

ServeEngine::~ServeEngine() { shutdown(); }

void ServeEngine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

std::shared_ptr<RequestHandle> ServeEngine::submit(ServeRequest request) {
  if (request.prompt.empty()) fail("the prompt is empty");
  if (int64_t(request.prompt.size()) >= ctx_) {
    fail("the prompt is {} tokens, more than the context of {} allows (the server's --ctx)", request.prompt.size(),
         ctx_);
  }
  Sampler::validate(request.sampling);
  auto handle = std::make_shared<RequestHandle>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) fail("the server is shutting down");
    queue_.push_back(Pending{std::move(request), handle, now_seconds()});
    metrics_.requests++;
  }
  cv_.notify_all();
  return handle;
}

void ServeEngine::admit(Pending p) {
  // The free slot whose history is the longest proper prefix of this prompt; else any free one.
  Slot* best = nullptr;
  size_t best_keep = 0;
  for (auto& s : slots_) {
    if (s->busy) continue;
    const std::vector<int32_t>& h = s->history;
    const std::vector<int32_t>& prompt = p.request.prompt;
    const bool prefix = h.size() < prompt.size() && std::equal(h.begin(), h.end(), prompt.begin());
    const size_t keep = prefix ? h.size() : 0;
    if (!best || keep > best_keep) best = s.get(), best_keep = keep;
  }
  Slot& s = *best;
  if (best_keep == 0) {
    if (!s.history.empty()) {
      runner_.release(s.seq);
      s.history.clear();
    }
    // Blocks another request left holding the same prefix (a shared system prompt); the last
    // prompt token is always computed (its logits start the reply).
    const std::vector<int32_t>& prompt = p.request.prompt;
    best_keep = prefix_cache_ ? size_t(runner_.attach_prefix(s.seq, prompt, int64_t(prompt.size()) - 1)) : 0;
    s.history.assign(prompt.begin(), prompt.begin() + int64_t(best_keep));
    s.position.store(int64_t(best_keep));
  }
  s.busy.store(true);
  s.order = admitted_++;
  s.feed = p.request.prompt;
  s.resumed = false;
  s.prompt_fed = best_keep;
  s.completion = 0;
  s.last_token = -1;
  s.held.clear();
  s.first_token_at = s.last_token_at = 0;
  s.sampler.emplace(p.request.sampling);
  s.decoder.emplace(*rt_.tokenizer, /*skip_special=*/true);
  metrics_.prompt_tokens += p.request.prompt.size();
  metrics_.prompt_tokens_cached += best_keep;
  s.p = std::move(p);
}

void ServeEngine::publish_kv() {
  const KvCache& kv = runner_.kv();
  kv_blocks_held_.store(kv.total_blocks() - kv.free_blocks());
  kv_blocks_cached_.store(kv.cached_blocks());
}

void ServeEngine::finish(Slot& s, Finish why, std::string error, std::string stop_string) {
  ServeEvent e;
  e.finish = why;
  e.error = std::move(error);
  e.stop_string = std::move(stop_string);
  e.prompt_tokens = int64_t(s.p.request.prompt.size());
  e.completion_tokens = s.completion;
  if (why == Finish::kError) {
    // A forward that threw may have left the sequence part-written: start it over next time.
    runner_.release(s.seq);
    s.history.clear();
  } else if (prefix_cache_) {
    // Its full blocks stay cached for whoever shares the prefix; the slot holds nothing.
    runner_.register_prefix(s.seq, s.history);
    runner_.release(s.seq);
    s.history.clear();
  }
  publish_kv();
  if (s.completion > 1 && s.last_token_at > s.first_token_at) {
    std::lock_guard<std::mutex> lock(mu_);
    metrics_.tpot.observe((s.last_token_at - s.first_token_at) / double(s.completion - 1));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    metrics_.requests_finished++;
    if (why == Finish::kCancelled) metrics_.requests_cancelled++;
    if (why == Finish::kError) metrics_.requests_failed++;
  }
  s.p.handle->push(std::move(e));
  s.p = Pending{};
  s.position.store(int64_t(s.history.size()));
  s.busy.store(false);
}

TokenLogprob ServeEngine::token_logprob(std::span<const float> logits, int32_t token, int top_n) const {
  // log_softmax in double: log p_i = l_i - max - log(sum exp(l - max)).
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float l : logits) sum += std::exp(double(l) - double(mx));
  const double log_z = double(mx) + std::log(sum);
  auto text = [&](int32_t id) { return rt_.tokenizer->decode({id}); };
  TokenLogprob t;
  t.token = text(token);
  t.logprob = float(double(logits[size_t(token)]) - log_z);
  std::vector<int32_t> order(logits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = int32_t(i);
  const size_t n = std::min(order.size(), size_t(top_n));
  std::partial_sort(order.begin(), order.begin() + n, order.end(), [&](int32_t a, int32_t b) {
    return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
  });
  for (size_t i = 0; i < n; ++i) t.top.emplace_back(text(order[i]), float(double(logits[size_t(order[i])]) - log_z));
  return t;
}

ServeEngine::Slot* ServeEngine::newest_holder(const std::vector<Slot*>& stepping) {
  Slot* newest = nullptr;
  for (auto& sp : slots_) {
    Slot& s = *sp;
    if (!s.busy || s.history.empty()) continue;
    // Rows already planned this step keep their blocks.
    if (std::find(stepping.begin(), stepping.end(), &s) != stepping.end()) continue;
    if (!newest || s.order > newest->order) newest = &s;
  }
  return newest;
}

void ServeEngine::preempt(Slot& s) {
  // Recompute later: what the sequence held, and the sampled token it was about to feed.
  std::vector<int32_t> again = s.history;
  if (s.prompt_fed == s.feed.size()) {
    again.push_back(s.last_token);
    s.resumed = true;
  } else {
    again = s.feed;  // still reading its prompt (or a resumed one): read it again
  }
  if (prefix_cache_) runner_.register_prefix(s.seq, s.history);
  runner_.release(s.seq);
  s.history.clear();
  s.feed = std::move(again);
  s.prompt_fed = 0;
  s.position.store(0);
  s.needs_attach = prefix_cache_;
  s.preempted_at = steps_;
  std::lock_guard<std::mutex> lock(mu_);
  metrics_.preemptions++;
}

void ServeEngine::step() {
  const int64_t vocab = rt_.model.model->info().vocab_size;
  // Requests that went away, and decodes at the end of their context.
  std::vector<Slot*> live;
  for (auto& sp : slots_) {
    Slot& s = *sp;
    if (!s.busy) continue;
    if (s.p.handle->cancelled()) {
      finish(s, Finish::kCancelled);
      continue;
    }
    if (s.prompt_fed == s.feed.size() && int64_t(s.history.size()) + 1 >= ctx_) {
      finish(s, Finish::kLength);
      continue;
    }
    live.push_back(&s);
  }
  if (live.empty()) return;
  // Decode rows first (every running reply advances each step), then prompt chunks first come
  // first served while the step has room.
  // (Decodes that waited longest first, should there be more of them than the step holds.)
  std::sort(live.begin(), live.end(), [](const Slot* a, const Slot* b) {
    const bool da = a->prompt_fed == a->feed.size(), db = b->prompt_fed == b->feed.size();
    if (da != db) return da;
    if (da && a->last_step != b->last_step) return a->last_step < b->last_step;
    return a->order < b->order;
  });
  ++steps_;
  std::vector<BatchRow> rows;
  std::vector<Slot*> stepped;
  bool need_logits = false;
  const int64_t budget = runner_.max_rows();
  for (Slot* sp : live) {
    Slot& s = *sp;
    const ServeRequest& req = s.p.request;
    const int64_t room = budget - int64_t(rows.size());
    if (room <= 0) break;
    if (s.preempted_at == steps_) continue;  // just gave its blocks back: not again this step
    if (s.needs_attach) {
      // A preempted sequence's blocks may still be cached (its prefix, another's).
      s.needs_attach = false;
      s.prompt_fed = size_t(runner_.attach_prefix(s.seq, s.feed, int64_t(s.feed.size()) - 1));
      s.history.assign(s.feed.begin(), s.feed.begin() + int64_t(s.prompt_fed));
    }
    s.row0 = int64_t(rows.size());
    const int64_t pos = int64_t(s.history.size());
    if (s.prompt_fed < s.feed.size()) {
      const int64_t n = std::min<int64_t>({room, kPrefillChunk, int64_t(s.feed.size() - s.prompt_fed)});
      if (!runner_.reserve(s.seq, pos + n)) continue;  // the pool is full: wait for blocks
      for (int64_t i = 0; i < n; ++i) rows.push_back({s.seq, s.feed[s.prompt_fed + size_t(i)], pos + i, false});
      s.rows = n;
      s.wants = s.prompt_fed + size_t(n) == s.feed.size();
    } else {
      // A decode that finds the pool full preempts the newest sequence holding blocks (itself,
      // when that is the newest): its blocks go back and it is recomputed later.
      if (!runner_.reserve(s.seq, pos + 1)) {
        Slot* victim = newest_holder(stepped);
        if (victim) preempt(*victim);
        if (victim == &s || !runner_.reserve(s.seq, pos + 1)) continue;
      }
      rows.push_back({s.seq, s.last_token, pos, false});
      s.rows = 1;
      s.wants = true;
    }
    rows.back().want = s.wants;
    s.last_step = steps_;
    if (s.wants) need_logits |= !s.sampler->greedy() || req.top_logprobs >= 0;
    stepped.push_back(&s);
  }
  if (rows.empty()) {
    // Nothing could run: prefills waiting on blocks that sequences in the middle of their own
    // prefill hold. The newest gives its blocks back so the oldest can go on.
    if (Slot* victim = newest_holder(stepped)) preempt(*victim);
    return;
  }
  std::vector<float>& logits = step_logits_;
  std::vector<int32_t>& greedy = step_greedy_;
  try {
    // Only the ids leave the backend when every wanted row is greedy without logprobs.
    runner_.step(rows, need_logits ? &logits : nullptr, need_logits ? nullptr : &greedy);
  } catch (const std::exception& ex) {
    for (Slot* sp : stepped) finish(*sp, Finish::kError, ex.what());
    return;
  }
  publish_kv();
  if (check_kv_) runner_.kv().check_invariants();
  ExpertCacheStats device_experts;
  const bool device_cache = !rt_.experts && rt_.backend->device_expert_cache_stats(&device_experts);
  const ExpertStreamStats disk_experts = rt_.experts ? rt_.experts->stats_snapshot() : ExpertStreamStats{};
  {
    std::lock_guard<std::mutex> lock(mu_);
    metrics_.steps++;
    metrics_.step_rows += rows.size();
    metrics_.step_seqs += stepped.size();
    if (rt_.experts) {
      metrics_.expert_cache = true;
      metrics_.expert_lookups = disk_experts.acquires - disk_experts.in_place;
      metrics_.expert_loads = disk_experts.loads();
      metrics_.expert_bytes_read = disk_experts.bytes_read;
    } else if (device_cache) {
      metrics_.expert_cache = true;
      metrics_.expert_lookups = device_experts.hits + device_experts.misses;
      metrics_.expert_loads = device_experts.misses;
    }
  }
  int64_t out = 0;
  for (Slot* sp : stepped) {
    Slot& s = *sp;
    const bool prefill = s.prompt_fed < s.feed.size();
    for (int64_t i = 0; i < s.rows; ++i) s.history.push_back(rows[size_t(s.row0 + i)].token);
    s.position.store(int64_t(s.history.size()));
    if (prefix_cache_) runner_.register_prefix(s.seq, s.history);  // blocks this step filled, for later requests
    if (prefill) s.prompt_fed += size_t(s.rows);
    if (!s.wants) continue;
    const int64_t k = out++;
    int32_t token = -1;
    std::span<const float> row;
    if (need_logits) {
      row = std::span<const float>(logits.data() + k * vocab, size_t(vocab));
      if (!std::all_of(row.begin(), row.end(), [](float v) { return std::isfinite(v); })) {
        finish(s, Finish::kError, fmt::format("non-finite logit at position {} (NaN or Inf in the forward pass)",
                                              s.history.size() - 1));
        continue;
      }
      token = s.sampler->sample(row.data(), vocab);
    } else {
      token = greedy[size_t(k)];
      if (token < 0) {
        finish(s, Finish::kError,
               fmt::format("non-finite logit at position {} (NaN in the forward pass)", s.history.size() - 1));
        continue;
      }
    }
    if (prefill && !s.resumed) {
      s.first_token_at = now_seconds();
      std::lock_guard<std::mutex> lock(mu_);
      metrics_.ttft.observe(s.first_token_at - s.p.submitted);
    } else {
      s.last_token_at = now_seconds();
    }
    deliver(s, token, row);
  }
}

bool ServeEngine::deliver(Slot& s, int32_t token, std::span<const float> logits) {
  const ServeRequest& req = s.p.request;
  RequestHandle& h = *s.p.handle;
  const bool want_logprobs = req.top_logprobs >= 0;
  // The sampled token: a stop id ends the reply; else its text, less what may begin a stop string.
  ServeEvent e;
  const bool is_stop = std::find(rt_.stop_ids.begin(), rt_.stop_ids.end(), token) != rt_.stop_ids.end();
  if (want_logprobs && !is_stop) e.logprobs.push_back(token_logprob(logits, token, req.top_logprobs));
  if (!is_stop) {
    s.held += s.decoder->push(token);
    s.completion++;
    s.last_token = token;
    std::lock_guard<std::mutex> lock(mu_);
    metrics_.generated_tokens++;
  }
  const bool at_limit = !is_stop && s.completion >= req.max_tokens;
  if (is_stop || at_limit) s.held += s.decoder->flush();
  size_t cut = std::string::npos, which = 0;
  for (size_t i = 0; i < req.stop.size(); ++i) {
    const size_t at = s.held.find(req.stop[i]);
    if (at != std::string::npos && at < cut) cut = at, which = i;
  }
  if (cut != std::string::npos) {
    e.text = s.held.substr(0, cut);
    s.held.clear();
    if (!e.text.empty() || !e.logprobs.empty()) h.push(std::move(e));
    finish(s, Finish::kStopString, {}, req.stop[which]);
    return false;
  }
  if (is_stop || at_limit) {
    e.text = std::move(s.held);
    s.held.clear();
    if (!e.text.empty() || !e.logprobs.empty()) h.push(std::move(e));
    finish(s, is_stop ? Finish::kStop : Finish::kLength);
    return false;
  }
  const size_t hold = stop_prefix_hold(s.held, req.stop);
  if (s.held.size() > hold) {
    e.text = s.held.substr(0, s.held.size() - hold);
    s.held.erase(0, s.held.size() - hold);
  }
  if (!e.text.empty() || !e.logprobs.empty()) h.push(std::move(e));
  return true;
}

void ServeEngine::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        if (stopping_) break;
        while (!queue_.empty() &&
               std::any_of(slots_.begin(), slots_.end(), [](const auto& s) { return !s->busy.load(); })) {
          Pending p = std::move(queue_.front());
          queue_.pop_front();
          if (p.handle->cancelled()) {
            ServeEvent e;
            e.finish = Finish::kCancelled;
            e.prompt_tokens = int64_t(p.request.prompt.size());
            p.handle->push(std::move(e));
            metrics_.requests_finished++;
            metrics_.requests_cancelled++;
            continue;
          }
          admit(std::move(p));
        }
        if (std::any_of(slots_.begin(), slots_.end(), [](const auto& s) { return s->busy.load(); })) break;
        cv_.wait(lock);
      }
      if (stopping_) break;
    }
    step();
  }
  // Shutting down: everything still here is cancelled.
  for (auto& s : slots_)
    if (s->busy) finish(*s, Finish::kCancelled);
  std::lock_guard<std::mutex> lock(mu_);
  for (Pending& p : queue_) {
    ServeEvent e;
    e.finish = Finish::kCancelled;
    p.handle->push(std::move(e));
  }
  queue_.clear();
}

ServeMetrics ServeEngine::metrics() {
  std::lock_guard<std::mutex> lock(mu_);
  ServeMetrics m = metrics_;
  m.queued = int64_t(queue_.size());
  m.running = 0;
  m.kv_tokens_used = 0;
  // The worker's atomics: a snapshot may be one step stale.
  for (const auto& s : slots_) {
    if (!s->busy.load()) continue;
    m.running++;
    m.kv_tokens_used += s->position.load();
  }
  m.kv_blocks_used = kv_blocks_held_.load();
  m.kv_blocks_cached = kv_blocks_cached_.load();
  return m;
}

std::string ServeEngine::prometheus() {
  const ServeMetrics m = metrics();
  std::string out;
  auto counter = [&](const char* name, const char* help, double v, const char* type = "counter") {
    out += fmt::format("# HELP turbospark_{} {}\n# TYPE turbospark_{} {}\nturbospark_{} {}\n", name, help, name, type,
                       name, v);
  };
  auto histogram = [&](const char* name, const char* help, const Histogram& h) {
    out += fmt::format("# HELP turbospark_{} {}\n# TYPE turbospark_{} histogram\n", name, help, name);
    uint64_t cum = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cum += h.counts[i];
      out += fmt::format("turbospark_{}_bucket{{le=\"{}\"}} {}\n", name, h.bounds[i], cum);
    }
    cum += h.counts.back();
    out += fmt::format("turbospark_{}_bucket{{le=\"+Inf\"}} {}\nturbospark_{}_sum {}\nturbospark_{}_count {}\n", name,
                       cum, name, h.sum, name, h.n);
  };
  counter("requests_total", "Requests received.", double(m.requests));
  counter("requests_finished_total", "Requests finished (any reason).", double(m.requests_finished));
  counter("requests_cancelled_total", "Requests cancelled (client gone or shutdown).", double(m.requests_cancelled));
  counter("requests_failed_total", "Requests that failed in the engine.", double(m.requests_failed));
  counter("prompt_tokens_total", "Prompt tokens of admitted requests.", double(m.prompt_tokens));
  counter("prompt_tokens_cached_total", "Prompt tokens reused from the KV cache (cached prefix blocks, or a slot's "
          "previous sequence where the family keeps no blocks).",
          double(m.prompt_tokens_cached));
  counter("generation_tokens_total", "Tokens generated.", double(m.generated_tokens));
  counter("requests_queued", "Requests waiting for a slot.", double(m.queued), "gauge");
  counter("requests_running", "Requests in a slot.", double(m.running), "gauge");
  counter("kv_cache_tokens_used", "KV cache positions held by running requests.", double(m.kv_tokens_used), "gauge");
  counter("kv_cache_tokens_total", "KV cache positions of the shared pool.", double(m.kv_tokens_total), "gauge");
  counter("kv_cache_blocks_used", "KV pool blocks held by sequences (running, or kept for prefix reuse).",
          double(m.kv_blocks_used), "gauge");
  counter("kv_cache_blocks_total", "KV pool blocks.", double(m.kv_blocks_total), "gauge");
  counter("kv_cache_blocks_cached", "KV pool blocks registered for prefix caching (held or not).",
          double(m.kv_blocks_cached), "gauge");
  counter("batch_steps_total", "Batched forwards run.", double(m.steps));
  counter("preemptions_total", "Running sequences whose KV blocks were taken back (recomputed later).",
          double(m.preemptions));
  counter("batch_step_rows_total", "Rows those forwards held (decode rows plus prefill tokens).", double(m.step_rows));
  counter("batch_step_sequences_total", "Sequences those forwards held (one row or a prompt chunk each).",
          double(m.step_seqs));
  const double hit = m.prompt_tokens ? double(m.prompt_tokens_cached) / double(m.prompt_tokens) : 0.0;
  counter("prefix_cache_hit_rate", "Share of prompt tokens reused from the KV cache.", hit, "gauge");
  if (m.expert_cache) {
    counter("expert_cache_lookups_total", "Routed experts looked up in the expert cache.", double(m.expert_lookups));
    counter("expert_cache_loads_total", "Routed experts loaded into the expert cache (misses and prefetches).",
            double(m.expert_loads));
    counter("expert_cache_read_bytes_total", "Bytes of experts read from disk (the CPU tier).",
            double(m.expert_bytes_read));
    const double expert_hit =
        m.expert_lookups ? std::max(0.0, 1.0 - double(m.expert_loads) / double(m.expert_lookups)) : 0.0;
    counter("expert_cache_hit_rate", "Share of expert lookups the cache served without a load.", expert_hit, "gauge");
  }
  histogram("time_to_first_token_seconds", "Time from request to its first token.", m.ttft);
  histogram("time_per_output_token_seconds", "Mean time between a request's tokens after the first.", m.tpot);
  return out;
}

}  // namespace turbospark::server
