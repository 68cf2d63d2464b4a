#include "engine/router_stats.h"

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <numeric>

#include "core/error.h"

namespace turbospark {

RouterStats::RouterStats(int n_layers, int64_t n_experts, int top_k)
    : n_layers_(n_layers), n_experts_(n_experts), top_k_(top_k) {
  TS_CHECK(n_layers > 0 && n_experts > 0 && top_k > 0 && top_k <= n_experts,
           "router stats: {} layers, {} experts, top-{}", n_layers, n_experts, top_k);
  counts_.assign(size_t(n_layers) * size_t(n_experts), 0);
  tokens_.assign(size_t(n_layers), 0);
}

void RouterStats::add(std::span<const float> probs, int64_t tokens) {
  TS_CHECK(int64_t(probs.size()) == int64_t(n_layers_) * tokens * n_experts_,
           "router stats: {} probabilities for {} layers x {} tokens x {} experts", probs.size(), n_layers_, tokens,
           n_experts_);
  std::vector<int64_t> order(static_cast<size_t>(n_experts_));
  for (int l = 0; l < n_layers_; ++l) {
    for (int64_t t = 0; t < tokens; ++t) {
      const float* row = probs.data() + (int64_t(l) * tokens + t) * n_experts_;
      bool any = false, nan = false;
      for (int64_t e = 0; e < n_experts_; ++e) {
        any = any || row[e] != 0.f;
        nan = nan || std::isnan(row[e]);
      }
      if (!any || nan) continue;
      std::iota(order.begin(), order.end(), int64_t(0));
      std::partial_sort(order.begin(), order.begin() + top_k_, order.end(), [&](int64_t a, int64_t b) {
        return row[a] > row[b] || (row[a] == row[b] && a < b);
      });
      for (int j = 0; j < top_k_; ++j) ++counts_[size_t(l) * size_t(n_experts_) + size_t(order[size_t(j)])];
      ++tokens_[size_t(l)];
    }
  }
}

int RouterStats::moe_layers() const {
  return int(std::count_if(tokens_.begin(), tokens_.end(), [](int64_t n) { return n > 0; }));
}

namespace {

// Mean over the layers that routed anything of f(sorted descending counts, total routings).
double mean_over_layers(const std::vector<int64_t>& counts, const std::vector<int64_t>& tokens, int64_t n_experts,
                        int top_k, const std::function<double(const std::vector<int64_t>&, int64_t)>& f) {
  double sum = 0;
  int n = 0;
  std::vector<int64_t> c(static_cast<size_t>(n_experts));
  for (size_t l = 0; l < tokens.size(); ++l) {
    if (tokens[l] == 0) continue;
    std::copy_n(counts.begin() + int64_t(l) * n_experts, n_experts, c.begin());
    std::sort(c.begin(), c.end(), std::greater<>());
    sum += f(c, tokens[l] * top_k);
    ++n;
  }
  return n > 0 ? sum / n : 0.0;
}

}  // namespace

double RouterStats::mean_experts_for_half() const {
  return mean_over_layers(counts_, tokens_, n_experts_, top_k_, [](const std::vector<int64_t>& c, int64_t total) {
    int64_t acc = 0, n = 0;
    for (int64_t v : c) {
      if (2 * acc >= total) break;
      acc += v;
      ++n;
    }
    return double(n);
  });
}

double RouterStats::mean_top_share() const {
  return mean_over_layers(counts_, tokens_, n_experts_, top_k_,
                          [](const std::vector<int64_t>& c, int64_t total) { return double(c[0]) / double(total); });
}

double RouterStats::mean_distinct() const {
  return mean_over_layers(counts_, tokens_, n_experts_, top_k_, [](const std::vector<int64_t>& c, int64_t) {
    return double(std::count_if(c.begin(), c.end(), [](int64_t v) { return v > 0; }));
  });
}

void RouterStats::write_csv(const std::string& path) const {
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (!f) fail("--router-stats: cannot write {}: {}", path, std::strerror(errno));
  bool ok = std::fputs("layer,expert,count,share\n", f) >= 0;
  for (int l = 0; l < n_layers_ && ok; ++l) {
    const int64_t total = tokens_[size_t(l)] * top_k_;
    if (total == 0) continue;
    for (int64_t e = 0; e < n_experts_ && ok; ++e) {
      const int64_t c = count(l, e);
      ok = std::fprintf(f, "%d,%lld,%lld,%.6f\n", l, static_cast<long long>(e), static_cast<long long>(c),
                        double(c) / double(total)) > 0;
    }
  }
  ok = std::fclose(f) == 0 && ok;
  if (!ok) fail("--router-stats: writing {} failed: {}", path, std::strerror(errno));
}

std::string RouterStats::summary() const {
  const int64_t tokens = tokens_.empty() ? 0 : *std::max_element(tokens_.begin(), tokens_.end());
  return fmt::format("router: {} tokens over {} MoE layers of {} experts (top-{}): {:.1f} experts picked per layer, "
                     "the most picked takes {:.1f}% of a layer's routings, {:.1f} experts take half",
                     tokens, moe_layers(), n_experts_, top_k_, mean_distinct(), 100.0 * mean_top_share(),
                     mean_experts_for_half());
}

}  // namespace turbospark
