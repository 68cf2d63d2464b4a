// The router histogram (`--router-stats FILE` on logits and bench): how often each routed
// expert of each layer was picked, from the router probabilities a forward captures
// (Session::feed's router_probs, [layers, tokens, n_experts]). What an expert cache sees:
// a skewed histogram caches well, a flat one is the worst case (tools/make_random_gguf.py's
// files are flat unless --router-skew asks for favourites).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace turbospark {

class RouterStats {
 public:
  RouterStats(int n_layers, int64_t n_experts, int top_k);

  // probs: [n_layers, tokens, n_experts]. Each token's top_k experts (largest probability,
  // the lower index on ties, as the backends route) are counted; rows that are all zero (layers
  // without routed experts) or hold a NaN are skipped.
  void add(std::span<const float> probs, int64_t tokens);

  int64_t count(int layer, int64_t expert) const { return counts_[size_t(layer) * size_t(n_experts_) + size_t(expert)]; }
  int64_t routed_tokens(int layer) const { return tokens_[size_t(layer)]; }
  // Layers that routed at least one token.
  int moe_layers() const;
  // Per layer, the fewest experts that together took half of its routings; averaged over the
  // MoE layers (n_experts / 2 for a flat histogram, small for a skewed one).
  double mean_experts_for_half() const;
  // Per layer, the share of routings the most-picked expert took; averaged.
  double mean_top_share() const;
  // Per layer, experts picked at least once; averaged.
  double mean_distinct() const;

  // CSV with a header: layer,expert,count,share (share of that layer's routings).
  void write_csv(const std::string& path) const;
  // One line: tokens, the three means above.
  std::string summary() const;

 private:
  int n_layers_;
  int64_t n_experts_;
  int top_k_;
  std::vector<int64_t> counts_;  // [layer][expert]
  std::vector<int64_t> tokens_;  // routed tokens per layer
};

}  // namespace turbospark
