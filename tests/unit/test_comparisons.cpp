// The comparison helpers the golden and CLI tests share (tests/test_util.h) must fail on
// what a broken kernel or backend produces: a NaN or an infinity anywhere, on either side,
// including the last element. std::max(err, NaN) keeps err, so a NaN-blind maximum would
// let NaN logits pass `EXPECT_LT(max_rel_error(...), tol)`.
#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include "test_util.h"

namespace turbospark {
namespace {

using testing::all_finite;
using testing::max_rel_error;

constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr double kInfD = std::numeric_limits<double>::infinity();

const std::vector<float> kRef = {1.f, -2.f, 0.5f, 4.f, 3.f, -0.25f, 2.f};

TEST(Comparisons, MaxRelErrorMeasuresFiniteDifferences) {
  EXPECT_EQ(max_rel_error(kRef.data(), kRef.data(), kRef.size()), 0.0);
  std::vector<float> a = kRef;
  a[4] += 0.02f;  // |diff| 0.02 over max |ref| 4
  EXPECT_NEAR(max_rel_error(a.data(), kRef.data(), kRef.size()), 0.005, 1e-7);
  a = kRef;
  a.back() -= 0.4f;  // the last element's error is seen
  EXPECT_NEAR(max_rel_error(a.data(), kRef.data(), kRef.size()), 0.1, 1e-6);
  // All-zero reference: the scale floor (1e-6) keeps the result finite.
  const std::vector<float> zeros(4, 0.f), tiny = {0.f, 0.f, 0.f, 1e-7f};
  EXPECT_EQ(max_rel_error(zeros.data(), zeros.data(), zeros.size()), 0.0);
  EXPECT_NEAR(max_rel_error(tiny.data(), zeros.data(), zeros.size()), 0.1, 1e-6);
  EXPECT_EQ(max_rel_error(kRef.data(), kRef.data(), 0), 0.0);
}

TEST(Comparisons, MaxRelErrorIsInfiniteOnNonFiniteValuesAnywhere) {
  const size_t n = kRef.size();
  for (size_t at : {size_t(0), size_t(3), n - 1}) {  // the last element too: nothing may skip it
    for (float bad : {kNan, -kNan, kInf, -kInf}) {
      std::vector<float> a = kRef, b = kRef;
      a[at] = bad;
      b[at] = bad;
      EXPECT_EQ(max_rel_error(a.data(), kRef.data(), n), kInfD) << "a[" << at << "] = " << bad;
      EXPECT_EQ(max_rel_error(kRef.data(), b.data(), n), kInfD) << "b[" << at << "] = " << bad;
      EXPECT_EQ(max_rel_error(a.data(), b.data(), n), kInfD) << "both [" << at << "] = " << bad;
      // What the golden tests write: the comparison must fail.
      EXPECT_FALSE(max_rel_error(a.data(), kRef.data(), n) < 2e-4) << "a[" << at << "] = " << bad;
    }
  }
  // A NaN reference whose |b| would otherwise set the scale, and an all-NaN output.
  const std::vector<float> nans(n, kNan);
  EXPECT_EQ(max_rel_error(nans.data(), kRef.data(), n), kInfD);
  EXPECT_EQ(max_rel_error(kRef.data(), nans.data(), n), kInfD);
}

TEST(Comparisons, MaxRelErrorOnlyLooksAtTheFirstNValues) {
  std::vector<float> a = kRef;
  a.push_back(kNan);  // past n: not part of the comparison
  std::vector<float> b = kRef;
  b.push_back(1.f);
  EXPECT_EQ(max_rel_error(a.data(), b.data(), kRef.size()), 0.0);
  EXPECT_EQ(max_rel_error(a.data(), b.data(), a.size()), kInfD);
}

TEST(Comparisons, AllFiniteSeesEveryElement) {
  EXPECT_TRUE(all_finite(kRef.data(), kRef.size()));
  EXPECT_TRUE(all_finite(kRef.data(), 0));
  for (size_t at : {size_t(0), kRef.size() - 1}) {
    for (float bad : {kNan, kInf, -kInf}) {
      std::vector<float> a = kRef;
      a[at] = bad;
      EXPECT_FALSE(all_finite(a.data(), a.size())) << at << " " << bad;
    }
  }
  const float big = std::numeric_limits<float>::max(), denorm = std::numeric_limits<float>::denorm_min();
  const std::vector<float> edge = {big, -big, denorm, -0.f};
  EXPECT_TRUE(all_finite(edge.data(), edge.size()));
  // Finite values whose float difference would overflow: measured in double, still finite.
  const std::vector<float> neg = {-big, big, 0.f, 0.f};
  EXPECT_NEAR(max_rel_error(edge.data(), neg.data(), edge.size()), 2.0, 1e-6);
}

}  // namespace
}  // namespace turbospark
