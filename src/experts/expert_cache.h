// The bounded expert cache of expert streaming: which (layer, expert) each of a fixed number
// of slots holds, which slot a routed expert goes to, and which resident expert makes room.
// It owns no weight bytes: a tier (CPU RAM slots fed from disk, GPU slots fed from pinned RAM)
// keeps one buffer per slot and loads what plan() says to load.
//
// Protect sets: plan() never evicts a slot in `protect`, the slots queued work still reads
// (the previous step's experts while the next step's loads overlap its compute), nor a slot it
// assigned earlier in the same call. Pipeline banks: loading step n + 1's experts while step n
// computes needs room for both, up to 2 x top_k slots, so pipeline_banks() is 2 only when the
// cache has that many; with fewer it is 1 and the caller must wait for the previous step and
// pass an EMPTY protect set. Passing the previous step's slots anyway at one bank is the seed
// driver's `banks == 1` panic: `slots - top_k` places for up to top_k misses. plan() refuses
// that with a message rather than asserting, and the tests run every slot count from top_k to
// 3 x top_k through the pipeline protocol to show the default paths never reach it.
//
// Eviction policies (one interface, chosen by measurement): LRU (least recently used), LFU
// (fewest uses, ties to the least recent), and frequency-weighted LRU (uses decayed by age,
// half-life in plan() calls: frequent experts survive a burst of one-off ones, yet stale
// favourites age out). Victims are found by a scan over the slots: O(slots) per miss.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace turbospark {

enum class EvictionPolicy { kLru, kLfu, kFrequencyLru };

// "lru", "lfu", "freq-lru"; anything else is refused by name.
EvictionPolicy parse_eviction_policy(std::string_view name);
std::string_view eviction_policy_name(EvictionPolicy p);

struct ExpertCacheStats {
  int64_t hits = 0, misses = 0, evictions = 0;
};

class ExpertCache {
 public:
  // Refuses fewer slots than top_k (a token's experts must fit at once), naming the minimum.
  ExpertCache(int64_t slots, int top_k, EvictionPolicy policy = EvictionPolicy::kLru, double half_life = 64.0);

  // 2 when loads of one step can overlap the previous step's compute (slots >= 2 x top_k), else 1.
  int pipeline_banks() const { return slots_ >= 2 * int64_t(top_k_) ? 2 : 1; }

  struct Plan {
    std::vector<int32_t> slot;  // per requested expert: the slot that holds it after the loads
    std::vector<uint8_t> load;  // 1 where the expert is not resident and must be loaded there
    int64_t misses = 0;
  };
  // Places `experts` of `layer` (duplicates share one slot) and updates the policy's state.
  // Slots in `protect` and slots placed earlier in this call are never evicted; when the
  // misses outnumber the slots left to evict, the call is refused with the counts.
  Plan plan(int32_t layer, std::span<const int32_t> experts, std::span<const int32_t> protect = {});

  // Marks a slot empty (its load failed: the bytes there are not the expert's).
  void invalidate(int32_t slot);

  std::optional<int32_t> slot_of(int32_t layer, int32_t expert) const;
  int64_t slots() const { return slots_; }
  int top_k() const { return top_k_; }
  EvictionPolicy policy() const { return policy_; }
  const ExpertCacheStats& stats() const { return stats_; }

 private:
  struct Slot {
    int64_t key = -1;  // layer << 32 | expert, -1 when empty
    int64_t last_use = -1;
    int64_t uses = 0;
    double score = 0;  // frequency-weighted LRU: decayed uses as of last_use
  };
  static int64_t key_of(int32_t layer, int32_t expert) { return int64_t(layer) << 32 | uint32_t(expert); }
  void touch(Slot& s);
  double score_now(const Slot& s) const;
  // The slot to evict among those not pinned, or -1.
  int32_t victim(const std::vector<uint8_t>& pinned) const;

  int64_t slots_;
  int top_k_;
  EvictionPolicy policy_;
  double decay_;  // per plan() call, 0.5^(1 / half_life)
  int64_t clock_ = 0;
  std::vector<Slot> table_;
  std::unordered_map<int64_t, int32_t> where_;
  ExpertCacheStats stats_;
};

}  // namespace turbospark
