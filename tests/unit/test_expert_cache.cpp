// The expert cache (experts/expert_cache.h): refusals, eviction order per policy, protect sets,
// pipeline banks at every slot count from top_k to 3 x top_k, duplicates, invalidation.
#include "experts/expert_cache.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"

namespace turbospark {
namespace {

std::string error_of(auto&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Plans one expert and returns whether it had to be loaded.
bool use(ExpertCache& c, int layer, int expert) {
  const int32_t e[1] = {expert};
  return c.plan(layer, e).load[0] != 0;
}

TEST(ExpertCache, RefusesFewerSlotsThanTopKNamingTheMinimum) {
  const std::string msg = error_of([] { ExpertCache c(7, 8); });
  EXPECT_NE(msg.find("7 slots"), std::string::npos) << msg;
  EXPECT_NE(msg.find("at least 8"), std::string::npos) << msg;
  EXPECT_NE(error_of([] { ExpertCache c(8, 0); }), "");
  EXPECT_EQ(error_of([] { ExpertCache c(8, 8); }), "");
  EXPECT_NE(error_of([] { parse_eviction_policy("fifo"); }).find("fifo"), std::string::npos);
  EXPECT_EQ(parse_eviction_policy("freq-lru"), EvictionPolicy::kFrequencyLru);
}

TEST(ExpertCache, BanksNeedTwiceTopK) {
  for (int64_t slots = 8; slots <= 24; ++slots) EXPECT_EQ(ExpertCache(slots, 8).pipeline_banks(), slots >= 16 ? 2 : 1);
}

TEST(ExpertCache, LruEvictsTheLeastRecentlyUsed) {
  ExpertCache c(3, 1, EvictionPolicy::kLru);
  EXPECT_TRUE(use(c, 0, 10));
  EXPECT_TRUE(use(c, 0, 11));
  EXPECT_TRUE(use(c, 0, 12));
  EXPECT_FALSE(use(c, 0, 10));  // 11 is now the least recent
  EXPECT_TRUE(use(c, 0, 13));
  EXPECT_FALSE(c.slot_of(0, 11).has_value());
  EXPECT_TRUE(c.slot_of(0, 10) && c.slot_of(0, 12) && c.slot_of(0, 13));
  EXPECT_EQ(c.stats().hits, 1);
  EXPECT_EQ(c.stats().misses, 4);
  EXPECT_EQ(c.stats().evictions, 1);
}

TEST(ExpertCache, LfuEvictsTheLeastUsedThenTheOldest) {
  ExpertCache c(3, 1, EvictionPolicy::kLfu);
  for (int i = 0; i < 3; ++i) use(c, 0, 1);
  use(c, 0, 2);
  use(c, 0, 3);
  use(c, 0, 3);
  use(c, 0, 4);  // 2 has the fewest uses
  EXPECT_FALSE(c.slot_of(0, 2).has_value());
  use(c, 0, 5);  // now 4 has one use, 3 two, 1 three
  EXPECT_FALSE(c.slot_of(0, 4).has_value());
  EXPECT_TRUE(c.slot_of(0, 1) && c.slot_of(0, 3) && c.slot_of(0, 5));
}

TEST(ExpertCache, FrequencyLruAgesOutStaleFavourites) {
  // Expert 1 used 8 times, then expert 2 once, much later; then a newcomer needs a slot.
  auto run = [](double half_life) {
    ExpertCache c(2, 1, EvictionPolicy::kFrequencyLru, half_life);
    for (int i = 0; i < 8; ++i) use(c, 0, 1);
    for (int i = 0; i < 40; ++i) c.plan(0, {});  // time passes
    use(c, 0, 2);
    use(c, 0, 3);
    return c.slot_of(0, 1).has_value();
  };
  EXPECT_FALSE(run(2.0)) << "short half-life: the favourite's 8 uses decayed below one fresh use";
  EXPECT_TRUE(run(1000.0)) << "long half-life: 8 uses still outweigh one";
}

TEST(ExpertCache, LayersAreSeparateKeys) {
  ExpertCache c(4, 2);
  const int32_t e[2] = {0, 1};
  EXPECT_EQ(c.plan(0, e).misses, 2);
  EXPECT_EQ(c.plan(1, e).misses, 2);
  EXPECT_EQ(c.plan(0, e).misses, 0);
  EXPECT_NE(*c.slot_of(0, 0), *c.slot_of(1, 0));
}

TEST(ExpertCache, ProtectedSlotsAreNeverEvicted) {
  ExpertCache c(4, 2, EvictionPolicy::kLru);
  const int32_t first[2] = {0, 1}, second[2] = {2, 3};
  const ExpertCache::Plan a = c.plan(0, first);
  c.plan(0, second);
  // 0 and 1 are the least recent, but queued work still reads their slots.
  const int32_t third[2] = {4, 5};
  const ExpertCache::Plan b = c.plan(0, third, a.slot);
  for (int32_t s : b.slot) EXPECT_TRUE(s != a.slot[0] && s != a.slot[1]) << s;
  EXPECT_TRUE(c.slot_of(0, 0) && c.slot_of(0, 1));
  EXPECT_FALSE(c.slot_of(0, 2) || c.slot_of(0, 3));
}

TEST(ExpertCache, TooManyProtectedIsRefusedNotAsserted) {
  // One bank (3 slots, top-2) with the previous step's slots protected: the seed's panic.
  ExpertCache c(3, 2);
  const int32_t prev[2] = {0, 1}, next[2] = {2, 3};
  const ExpertCache::Plan a = c.plan(0, prev);
  const std::string msg = error_of([&] { c.plan(0, next, a.slot); });
  EXPECT_NE(msg.find("empty protect set"), std::string::npos) << msg;
  EXPECT_EQ(error_of([&] { c.plan(0, next); }), "");  // as the one-bank protocol plans it
}

TEST(ExpertCache, HitsAreKeptForTheSameStepsMisses) {
  // A miss must not evict an expert the same call needs (it would miss twice).
  ExpertCache c(2, 2, EvictionPolicy::kLru);
  const int32_t a[2] = {0, 1}, b[2] = {2, 0};
  c.plan(0, a);
  const ExpertCache::Plan p = c.plan(0, b);
  EXPECT_EQ(p.misses, 1);
  EXPECT_EQ(p.load[1], 0);
  EXPECT_TRUE(c.slot_of(0, 0) && c.slot_of(0, 2));
}

TEST(ExpertCache, DuplicatesShareASlotAndLoadOnce) {
  ExpertCache c(4, 3);
  const int32_t e[3] = {5, 5, 6};
  const ExpertCache::Plan p = c.plan(2, e);
  EXPECT_EQ(p.slot[0], p.slot[1]);
  EXPECT_EQ(p.load[0] + p.load[1] + p.load[2], 2);
  EXPECT_EQ(p.misses, 2);
}

TEST(ExpertCache, InvalidatedSlotsReload) {
  ExpertCache c(2, 1);
  use(c, 0, 7);
  c.invalidate(*c.slot_of(0, 7));
  EXPECT_FALSE(c.slot_of(0, 7).has_value());
  EXPECT_TRUE(use(c, 0, 7));
  EXPECT_NE(error_of([&] { c.invalidate(2); }), "");
}

// The pipeline protocol at every slot count from top_k to 3 x top_k and every policy: with two
// banks the previous step's slots stay protected while the next step plans; with one bank the
// previous step is waited for and nothing is protected. No plan may fail, a step's experts get
// distinct slots, and a protected slot keeps its expert.
TEST(ExpertCache, PipelineProtocolNeverFailsAtAnySlotCount) {
  const int top_k = 8, n_experts = 128, layers = 3;
  for (EvictionPolicy policy : {EvictionPolicy::kLru, EvictionPolicy::kLfu, EvictionPolicy::kFrequencyLru}) {
    for (int64_t slots = top_k; slots <= 3 * top_k; ++slots) {
      SCOPED_TRACE(std::string(eviction_policy_name(policy)) + " slots " + std::to_string(slots));
      ExpertCache c(slots, top_k, policy);
      std::mt19937 rng{uint32_t(slots)};
      std::vector<int32_t> previous;
      std::vector<std::pair<int32_t, int64_t>> previous_keys;  // slot, (layer, expert) it held
      for (int step = 0; step < 200; ++step) {
        const int layer = step % layers;
        std::vector<int32_t> pool(n_experts);
        for (int e = 0; e < n_experts; ++e) pool[size_t(e)] = e;
        std::shuffle(pool.begin(), pool.end(), rng);
        pool.resize(top_k);
        const bool two = c.pipeline_banks() == 2;
        ExpertCache::Plan p;
        const std::span<const int32_t> protect = two ? std::span<const int32_t>(previous) : std::span<const int32_t>();
        ASSERT_EQ(error_of([&] { p = c.plan(layer, pool, protect); }), "");
        std::set<int32_t> distinct(p.slot.begin(), p.slot.end());
        EXPECT_EQ(distinct.size(), size_t(top_k));
        for (size_t i = 0; i < pool.size(); ++i) EXPECT_EQ(c.slot_of(layer, pool[i]), p.slot[i]);
        if (two) {
          for (auto [slot, key] : previous_keys) {
            EXPECT_EQ(c.slot_of(int32_t(key >> 32), int32_t(key & 0xffffffff)), slot) << "a protected slot changed";
          }
        }
        previous = p.slot;
        previous_keys.clear();
        for (size_t i = 0; i < pool.size(); ++i) previous_keys.push_back({p.slot[i], int64_t(layer) << 32 | pool[i]});
      }
      EXPECT_GT(c.stats().misses, 0);
    }
  }
}

}  // namespace
}  // namespace turbospark
