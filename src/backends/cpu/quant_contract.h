// The accumulation contract every quantized matmul kernel of the CPU backend follows (row
// kernels in quant_matmul.cpp, tiled kernels in quant_gemm.cpp; AVX2 and scalar), so that
// an output's bits do not depend on which kernel computed it or on how many tokens shared
// the call. Serving needs this: a request's decode row runs alone in one step and inside a
// batch with other requests' prefill chunks (the tiled kernels) in the next, and its tokens
// must not depend on the company it keeps.
//
// For one output (weight row . activation row), block by block (256 elements for the
// k-quants, 32 for the others):
//   1. the block's integer sums are exact (int32): isum = sum(scale * q * qy) over the block
//      (Q6_K with its -32 folded in), msum = sum(min * bsum) (Q4_K/Q5_K);
//   2. one float per block, v:
//        Q4_K, Q5_K:  v = fma(d * dy, isum, -((dmin * dy) * msum))
//        Q6_K:        v = fma(d * dy, isum, 0)
//        32-element:  v = fma(d * dy, isum, offset * sy), offset = -8d (Q4_0), -16d (Q5_0),
//                     m (Q4_1, Q5_1), 0 (Q8_0); sy = dy * sum(qy)
//   3. eight lane sums, lane k adding the v of blocks b = k, k + 8, k + 16, ... in order,
//      each starting at +0;
//   4. the result ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), the order of an AVX
//      horizontal sum.
// Step 3 lets a row kernel reduce eight blocks' integer lanes at once (one horizontal tree
// per eight blocks instead of one per block) while reading the row in place, and lets the
// tiled kernels, which hold one row per float lane, keep their per-block float work.
// Compile these files with -ffp-contract=off: a fused multiply-add the compiler chooses
// would break step 2's rounding.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace turbospark::cpu::contract {

inline float k4_term(float d, float dmin, float dy, int32_t isum, int32_t msum) {
  return std::fma(d * dy, float(isum), -((dmin * dy) * float(msum)));
}
inline float q6_term(float d, float dy, int32_t isum) { return std::fma(d * dy, float(isum), 0.f); }
inline float b32_term(float d, float dy, int32_t isum, float offset, float sy) {
  return std::fma(d * dy, float(isum), offset * sy);
}

// Steps 3 and 4 for scalar code.
struct LaneSums {
  float lane[8] = {};
  void add(int64_t block, float v) { lane[block & 7] += v; }
  float total() const {
    return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
  }
};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// Tree steps that add lane pairs with one shuffle per two vectors (blends run on every ALU
// port; shuffles compete for one on most x86 cores, with the kernels' own shuffles).
// Even lanes: a[k] + a[k + 1]; odd lanes: b[k - 1] + b[k].
inline __m256i pair_add32(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_blend_epi32(a, b, 0xAA), _mm256_shuffle_epi32(_mm256_blend_epi32(b, a, 0xAA), 0xB1));
}
// Lanes 4i, 4i + 1 from a, 4i + 2, 4i + 3 from b: each the sum of its 64-bit pair's halves.
inline __m256i pair_add64(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_blend_epi32(a, b, 0xCC), _mm256_shuffle_epi32(_mm256_blend_epi32(b, a, 0xCC), 0x4E));
}
// Low half: a's two halves added; high half: b's.
inline __m256i pair_add128(__m256i a, __m256i b) {
  return _mm256_add_epi32(_mm256_blend_epi32(a, b, 0xF0), _mm256_permute2x128_si256(a, b, 0x21));
}

// Lane g of the result = the sum of v[g]'s eight int32 lanes (exact): the integer sums of
// eight blocks at once.
inline __m256i reduce8_epi32(const __m256i* v) {
  return pair_add128(pair_add64(pair_add32(v[0], v[1]), pair_add32(v[2], v[3])),
                     pair_add64(pair_add32(v[4], v[5]), pair_add32(v[6], v[7])));
}

// Lane g of the result = the sum of v[g]'s four int32 lanes (exact).
inline __m256i reduce8x4_epi32(const __m128i* v) {
  const __m256i x = pair_add32(_mm256_set_m128i(v[1], v[0]), _mm256_set_m128i(v[3], v[2]));
  const __m256i y = pair_add32(_mm256_set_m128i(v[5], v[4]), _mm256_set_m128i(v[7], v[6]));
  // pair_add64(x, y) = [v0, v2, v4, v6 | v1, v3, v5, v7].
  return _mm256_permutevar8x32_epi32(pair_add64(x, y), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Eight f16 values, given as u32 lanes, low or high halves, widened: the d/dmin pairs that
// Q4_K/Q5_K (and d/m of Q4_1/Q5_1) store as one 32-bit word.
inline void f16_pairs(__m256i words, __m256* lo, __m256* hi) {
  const __m256i packed = _mm256_packus_epi32(_mm256_and_si256(words, _mm256_set1_epi32(0xFFFF)), _mm256_srli_epi32(words, 16));
  const __m256i ordered = _mm256_permute4x64_epi64(packed, 0xD8);  // [lo 0-3, lo 4-7, hi 0-3, hi 4-7]
  *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(ordered));
  *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(ordered, 1));
}
#endif

}  // namespace turbospark::cpu::contract
