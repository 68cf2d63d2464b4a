#include "experts/expert_cache.h"

#include <cmath>

#include "core/error.h"

namespace turbospark {

EvictionPolicy parse_eviction_policy(std::string_view name) {
  if (name == "lru") return EvictionPolicy::kLru;
  if (name == "lfu") return EvictionPolicy::kLfu;
  if (name == "freq-lru") return EvictionPolicy::kFrequencyLru;
  fail("expert cache: unknown eviction policy '{}' (lru, lfu, freq-lru)", name);
}

std::string_view eviction_policy_name(EvictionPolicy p) {
  switch (p) {
    case EvictionPolicy::kLru: return "lru";
    case EvictionPolicy::kLfu: return "lfu";
    case EvictionPolicy::kFrequencyLru: return "freq-lru";
  }
  return "?";
}

ExpertCache::ExpertCache(int64_t slots, int top_k, EvictionPolicy policy, double half_life)
    : slots_(slots), top_k_(top_k), policy_(policy) {
  if (top_k < 1) fail("expert cache: top-k {} must be at least 1", top_k);
  if (slots < top_k) {
    fail("expert cache: {} slots cannot hold one token's {} routed experts: use at least {} (--expert-cache-slots)",
         slots, top_k, top_k);
  }
  if (slots > (int64_t(1) << 31) - 1) fail("expert cache: {} slots is too many", slots);
  if (!(half_life > 0) || !std::isfinite(half_life)) fail("expert cache: half-life {} must be positive", half_life);
  decay_ = std::pow(0.5, 1.0 / half_life);
  table_.resize(size_t(slots));
}

double ExpertCache::score_now(const Slot& s) const {
  return s.score * std::pow(decay_, double(clock_ - s.last_use));
}

void ExpertCache::touch(Slot& s) {
  s.score = (s.last_use < 0 ? 0.0 : score_now(s)) + 1.0;
  s.last_use = clock_;
  ++s.uses;
}

int32_t ExpertCache::victim(const std::vector<uint8_t>& pinned) const {
  int32_t best = -1;
  for (int32_t i = 0; i < int32_t(slots_); ++i) {
    if (pinned[size_t(i)]) continue;
    const Slot& s = table_[size_t(i)];
    if (s.key < 0) return i;  // an empty slot costs no eviction
    if (best < 0) {
      best = i;
      continue;
    }
    const Slot& b = table_[size_t(best)];
    bool better = false;
    switch (policy_) {
      case EvictionPolicy::kLru: better = s.last_use < b.last_use; break;
      case EvictionPolicy::kLfu: better = s.uses < b.uses || (s.uses == b.uses && s.last_use < b.last_use); break;
      case EvictionPolicy::kFrequencyLru: {
        const double a = score_now(s), c = score_now(b);
        better = a < c || (a == c && s.last_use < b.last_use);
        break;
      }
    }
    if (better) best = i;
  }
  return best;
}

ExpertCache::Plan ExpertCache::plan(int32_t layer, std::span<const int32_t> experts, std::span<const int32_t> protect) {
  ++clock_;
  std::vector<uint8_t> pinned(size_t(slots_), 0);
  for (int32_t s : protect) {
    if (s < 0 || s >= slots_) fail("expert cache: protected slot {} outside [0, {})", s, slots_);
    pinned[size_t(s)] = 1;
  }
  Plan p;
  p.slot.assign(experts.size(), -1);
  p.load.assign(experts.size(), 0);
  // Hits first, so that a miss never evicts an expert this same call needs.
  std::vector<uint8_t> seen(size_t(slots_), 0);
  for (size_t i = 0; i < experts.size(); ++i) {
    if (layer < 0 || experts[i] < 0) fail("expert cache: layer {} expert {} is not a valid key", layer, experts[i]);
    const auto it = where_.find(key_of(layer, experts[i]));
    if (it == where_.end()) continue;
    p.slot[i] = it->second;
    if (!seen[size_t(it->second)]) {
      seen[size_t(it->second)] = 1;
      ++stats_.hits;
      touch(table_[size_t(it->second)]);
    }
    pinned[size_t(it->second)] = 1;
  }
  for (size_t i = 0; i < experts.size(); ++i) {
    if (p.slot[i] >= 0) continue;
    const int64_t key = key_of(layer, experts[i]);
    if (const auto it = where_.find(key); it != where_.end()) {  // a duplicate placed just now
      p.slot[i] = it->second;
      continue;
    }
    const int32_t v = victim(pinned);
    if (v < 0) {
      int64_t misses = 0, pinned_count = 0;
      for (size_t j = 0; j < experts.size(); ++j) misses += p.slot[j] < 0 && !where_.count(key_of(layer, experts[j]));
      for (uint8_t b : pinned) pinned_count += b;
      fail("expert cache: layer {} misses {} more experts but all {} slots are held ({} by protected queued work or "
           "this step's experts); at one pipeline bank (fewer than 2 x top-k = {} slots) plan with an empty protect set",
           layer, misses, slots_, pinned_count, 2 * top_k_);
    }
    Slot& s = table_[size_t(v)];
    if (s.key >= 0) {
      where_.erase(s.key);
      ++stats_.evictions;
    }
    s = Slot{};
    s.key = key;
    where_[key] = v;
    touch(s);
    pinned[size_t(v)] = 1;
    p.slot[i] = v;
    p.load[i] = 1;
    ++p.misses;
    ++stats_.misses;
  }
  return p;
}

void ExpertCache::invalidate(int32_t slot) {
  if (slot < 0 || slot >= slots_) fail("expert cache: slot {} outside [0, {})", slot, slots_);
  Slot& s = table_[size_t(slot)];
  if (s.key >= 0) where_.erase(s.key);
  s = Slot{};
}

std::optional<int32_t> ExpertCache::slot_of(int32_t layer, int32_t expert) const {
  const auto it = where_.find(key_of(layer, expert));
  if (it == where_.end()) return std::nullopt;
  return it->second;
}

}  // namespace turbospark
