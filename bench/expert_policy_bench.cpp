// Expert-cache eviction policies (LRU, LFU, frequency-weighted LRU; experts/expert_cache.h) compared
// on the same routing traces, by hit rate at several budgets: the measurement the default
// policy rests on. Each token's routed experts go through ExpertCache::plan layer by layer in
// decode order, as a streamed decode step asks for them (one cache over all layers, as the
// tiers keep it).
//
// Traces:
//   synthetic (default): per layer a Zipf popularity over the experts (exponent --zipf, a random
//     order per layer) and temporal reuse: each of a token's k experts repeats one of the previous
//     token's at that layer with probability --reuse, else is drawn by popularity (no duplicates);
//   --router FILE.npy: router probabilities [layers, tokens, experts] as `turbospark logits
//     --router-out` writes them; each token's top-k (ties to the lower index), layers whose rows
//     are all zero (dense) skipped.
// Not built by CMake; from the repository root, after a build:
//
//   g++ -std=c++20 -O2 -Isrc bench/expert_policy_bench.cpp build/libturbospark_lib.a -lfmt
//       -pthread -o /tmp/expert_policy_bench  (one line)
//   /tmp/expert_policy_bench [--layers 12] [--experts 128] [--top-k 8] [--tokens 4000]
//       [--zipf 1.0] [--reuse 0.3] [--budgets 0.05,0.1,0.25,0.5] [--router R.npy] [--seed 1]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "core/npy.h"
#include "experts/expert_cache.h"

namespace {

using namespace turbospark;

struct Options {
  int layers = 12, experts = 128, top_k = 8, tokens = 4000;
  double zipf = 1.0, reuse = 0.3;
  std::vector<double> budgets = {0.05, 0.1, 0.25, 0.5};
  std::string router;
  uint32_t seed = 1;
};

// trace[t][l] = token t's experts at MoE layer l.
using Trace = std::vector<std::vector<std::vector<int32_t>>>;

Trace synthetic(const Options& o) {
  std::mt19937 rng(o.seed);
  std::vector<std::vector<double>> weight(size_t(o.layers));
  for (auto& w : weight) {
    std::vector<int> order(size_t(o.experts));
    std::iota(order.begin(), order.end(), 0);
    std::shuffle(order.begin(), order.end(), rng);
    w.assign(size_t(o.experts), 0.0);
    for (int r = 0; r < o.experts; ++r) w[size_t(order[size_t(r)])] = 1.0 / std::pow(double(r + 1), o.zipf);
  }
  std::uniform_real_distribution<double> u(0.0, 1.0);
  Trace trace(size_t(o.tokens), std::vector<std::vector<int32_t>>(size_t(o.layers)));
  for (int t = 0; t < o.tokens; ++t) {
    for (int l = 0; l < o.layers; ++l) {
      std::vector<int32_t>& picks = trace[size_t(t)][size_t(l)];
      std::vector<double> w = weight[size_t(l)];
      const std::vector<int32_t>* prev = t > 0 ? &trace[size_t(t - 1)][size_t(l)] : nullptr;
      while (int(picks.size()) < o.top_k) {
        int32_t e = -1;
        if (prev && u(rng) < o.reuse) {
          e = (*prev)[rng() % prev->size()];
        } else {
          std::discrete_distribution<int32_t> d(w.begin(), w.end());
          e = d(rng);
        }
        if (std::find(picks.begin(), picks.end(), e) != picks.end()) continue;
        picks.push_back(e);
        w[size_t(e)] = 0.0;  // no duplicates among a token's experts
      }
    }
  }
  return trace;
}

Trace from_router(const Options& o, int* n_experts) {
  const NpyArray a = read_npy_f32(o.router);
  if (a.shape.size() != 3) fail("expert_policy_bench: {} is not [layers, tokens, experts]", o.router);
  const int64_t layers = a.shape[0], tokens = a.shape[1], experts = a.shape[2];
  *n_experts = int(experts);
  Trace trace(static_cast<size_t>(tokens));
  for (int64_t l = 0; l < layers; ++l) {
    bool dense = true;
    for (int64_t i = 0; i < tokens * experts && dense; ++i) dense = a.data[size_t(l * tokens * experts + i)] == 0.f;
    if (dense) continue;
    for (int64_t t = 0; t < tokens; ++t) {
      const float* p = &a.data[size_t((l * tokens + t) * experts)];
      std::vector<int32_t> idx(static_cast<size_t>(experts));
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + o.top_k, idx.end(),
                        [&](int32_t x, int32_t y) { return p[x] > p[y] || (p[x] == p[y] && x < y); });
      trace[size_t(t)].emplace_back(idx.begin(), idx.begin() + o.top_k);
    }
  }
  if (trace.empty() || trace[0].empty()) fail("expert_policy_bench: {} holds no routed layer", o.router);
  return trace;
}

double hit_rate(const Trace& trace, int64_t slots, int top_k, EvictionPolicy policy) {
  ExpertCache cache(slots, top_k, policy);
  for (const auto& token : trace)
    for (size_t l = 0; l < token.size(); ++l) cache.plan(int32_t(l), token[l]);
  const ExpertCacheStats& s = cache.stats();
  return 100.0 * double(s.hits) / double(std::max<int64_t>(1, s.hits + s.misses));
}

std::vector<double> parse_list(std::string_view v) {
  std::vector<double> out;
  size_t start = 0;
  while (start <= v.size()) {
    const size_t comma = std::min(v.find(',', start), v.size());
    out.push_back(std::stod(std::string(v.substr(start, comma - start))));
    start = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string_view a = argv[i];
      if (i + 1 >= argc) fail("expert_policy_bench: {} needs a value", a);
      const std::string v = argv[++i];
      if (a == "--layers") o.layers = std::stoi(v);
      else if (a == "--experts") o.experts = std::stoi(v);
      else if (a == "--top-k") o.top_k = std::stoi(v);
      else if (a == "--tokens") o.tokens = std::stoi(v);
      else if (a == "--zipf") o.zipf = std::stod(v);
      else if (a == "--reuse") o.reuse = std::stod(v);
      else if (a == "--budgets") o.budgets = parse_list(v);
      else if (a == "--router") o.router = v;
      else if (a == "--seed") o.seed = uint32_t(std::stoul(v));
      else fail("expert_policy_bench: unknown option {}", a);
    }
    int experts = o.experts;
    const Trace trace = o.router.empty() ? synthetic(o) : from_router(o, &experts);
    const int64_t layers = int64_t(trace[0].size()), routed = layers * experts;
    if (o.router.empty())
      std::printf("synthetic trace: %d tokens, %lld layers of %d experts, top-%d, zipf %.2f, reuse %.2f, seed %u\n",
                  o.tokens, static_cast<long long>(layers), experts, o.top_k, o.zipf, o.reuse, o.seed);
    else
      std::printf("router trace %s: %zu tokens, %lld routed layers of %d experts, top-%d\n", o.router.c_str(),
                  trace.size(), static_cast<long long>(layers), experts, o.top_k);
    std::printf("%-8s %7s %8s %8s %9s\n", "budget", "slots", "lru", "lfu", "freq-lru");
    for (double b : o.budgets) {
      const int64_t slots = std::max<int64_t>(o.top_k, std::llround(b * double(routed)));
      std::printf("%6.1f%% %7lld", 100 * b, static_cast<long long>(slots));
      for (EvictionPolicy p : {EvictionPolicy::kLru, EvictionPolicy::kLfu, EvictionPolicy::kFrequencyLru})
        std::printf(" %7.1f%%", hit_rate(trace, slots, o.top_k, p));
      std::printf("\n");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
