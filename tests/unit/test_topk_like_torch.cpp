// ops/topk_like_torch.h (what the CUDA QSA selector runs) against the std:: algorithms
// torch.topk calls on the CPU, over inputs full of ties: the same set must come out, and the
// nth_element path must leave the whole array in the same order.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <utility>
#include <vector>

#include "ops/topk_like_torch.h"

namespace turbospark {
namespace {

using Pair = std::pair<float, int>;

bool greater(const Pair& x, const Pair& y) { return x.first > y.first; }

std::vector<ScoredIndex> as_scored(const std::vector<float>& v) {
  std::vector<ScoredIndex> a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = {v[i], int(i)};
  return a;
}

std::vector<Pair> as_pairs(const std::vector<float>& v) {
  std::vector<Pair> a(v.size());
  for (size_t i = 0; i < v.size(); ++i) a[i] = {v[i], int(i)};
  return a;
}

// The indices of the first k elements, sorted: the set a top-k picked.
std::vector<int> front_set(const std::vector<Pair>& a, int k) {
  std::vector<int> s;
  for (int i = 0; i < k; ++i) s.push_back(a[size_t(i)].second);
  std::sort(s.begin(), s.end());
  return s;
}
std::vector<int> front_set(const std::vector<ScoredIndex>& a, int k) {
  std::vector<int> s;
  for (int i = 0; i < k; ++i) s.push_back(a[size_t(i)].index);
  std::sort(s.begin(), s.end());
  return s;
}

// Scores the way QSA's look: many exact zeros (relu), a few repeated values, some distinct.
std::vector<float> tie_heavy(int n, std::mt19937& rng, int flavour) {
  std::vector<float> v(static_cast<size_t>(n));
  std::uniform_int_distribution<int> small(0, 3);
  std::uniform_real_distribution<float> real(0.f, 1.f);
  for (int i = 0; i < n; ++i) {
    switch (flavour) {
      case 0: v[size_t(i)] = float(small(rng)) * 0.5f; break;                      // 4 values
      case 1: v[size_t(i)] = real(rng) < 0.7f ? 0.f : real(rng); break;            // mostly zeros
      case 2: v[size_t(i)] = 1.f; break;                                           // all tied
      case 3: v[size_t(i)] = float(i % 5); break;                                  // periodic
      case 4: v[size_t(i)] = float(n - i) * (i % 3 == 0 ? 0.f : 1.f); break;       // descending, zeros
      default: v[size_t(i)] = real(rng); break;                                    // distinct
    }
  }
  return v;
}

TEST(TopKLikeTorch, NthElementPathLeavesTheSameArrangement) {
  std::mt19937 rng(7);
  int cases = 0;
  for (int n : {2, 3, 4, 5, 7, 16, 17, 33, 64, 65, 100, 255, 1000, 4099})
    for (int flavour = 0; flavour < 6; ++flavour)
      for (int k : {1, 2, 3, n / 3, n / 2, n - 1, n}) {
        if (k < 1 || k > n) continue;
        const std::vector<float> v = tie_heavy(n, rng, flavour);
        std::vector<Pair> want = as_pairs(v);
        std::nth_element(want.begin(), want.begin() + (k - 1), want.end(), greater);
        std::vector<ScoredIndex> got = as_scored(v);
        topk_detail::nth_element(got.data(), k - 1, n);
        for (int i = 0; i < n; ++i) {
          ASSERT_EQ(got[size_t(i)].index, want[size_t(i)].second) << "n " << n << " k " << k << " flavour " << flavour
                                                                  << " at " << i;
        }
        ++cases;
      }
  EXPECT_GT(cases, 400);
}

TEST(TopKLikeTorch, HeapSelectPathPicksTheSameSet) {
  std::mt19937 rng(11);
  for (int n : {1, 2, 5, 64, 65, 128, 640, 1000, 5000})
    for (int flavour = 0; flavour < 6; ++flavour)
      for (int k : {1, 2, 3, 7, n / 64, n / 8, n}) {
        if (k < 1 || k > n) continue;
        const std::vector<float> v = tie_heavy(n, rng, flavour);
        // std::partial_sort = heap selection, then a heap sort of the front (set unchanged).
        std::vector<Pair> want = as_pairs(v);
        std::partial_sort(want.begin(), want.begin() + k, want.end(), greater);
        std::vector<ScoredIndex> got = as_scored(v);
        topk_detail::heap_select(got.data(), k, n);
        ASSERT_EQ(front_set(got, k), front_set(want, k)) << "n " << n << " k " << k << " flavour " << flavour;
      }
}

// The entry point takes torch's path by k * 64 <= n and yields torch's set.
TEST(TopKLikeTorch, SelectMatchesTorchsRuleOnTies) {
  std::mt19937 rng(3);
  for (int n = 1; n <= 300; n += 7)
    for (int k = 1; k <= n; k += std::max(1, n / 9))
      for (int flavour : {0, 1, 2}) {
        const std::vector<float> v = tie_heavy(n, rng, flavour);
        std::vector<Pair> want = as_pairs(v);
        if (int64_t(k) * 64 <= n) {
          std::partial_sort(want.begin(), want.begin() + k, want.end(), greater);
        } else {
          std::nth_element(want.begin(), want.begin() + (k - 1), want.end(), greater);
        }
        std::vector<ScoredIndex> got = as_scored(v);
        select_top_k_like_torch(got.data(), n, k);
        ASSERT_EQ(front_set(got, k), front_set(want, k)) << "n " << n << " k " << k << " flavour " << flavour;
      }
}

// The ties really are decided by the algorithm, not by index: some case picks a tied element
// other than the lowest-indexed ones (else this test would pass for any stable top-k).
TEST(TopKLikeTorch, TiesAreNotSimplyLowestIndexFirst) {
  std::mt19937 rng(5);
  int differs = 0;
  for (int n = 8; n <= 200; ++n) {
    const std::vector<float> v = tie_heavy(n, rng, 1);
    const int k = n / 4;
    std::vector<ScoredIndex> got = as_scored(v);
    select_top_k_like_torch(got.data(), n, k);
    std::vector<int> idx(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) idx[size_t(i)] = i;
    std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return v[size_t(a)] > v[size_t(b)]; });
    std::vector<int> stable(idx.begin(), idx.begin() + k), mine;
    for (int i = 0; i < k; ++i) mine.push_back(got[size_t(i)].index);
    std::sort(stable.begin(), stable.end());
    std::sort(mine.begin(), mine.end());
    differs += stable != mine;
  }
  EXPECT_GT(differs, 10);
}

}  // namespace
}  // namespace turbospark
