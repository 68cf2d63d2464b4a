#include "backends/cpu/mxfp4.h"

#include <cstring>

#include "backends/cpu/grouped_matmul.h"
#include "core/error.h"
#include "core/quant_grouped.h"

#if defined(__AVX2__) && defined(__FMA__)
#define TS_MXFP4_AVX2 1
#include <immintrin.h>
#else
#define TS_MXFP4_AVX2 0
#endif

namespace turbospark::cpu {
namespace {

#if TS_MXFP4_AVX2

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 2^(e - 127) built from its bits (e = 0 is the subnormal 2^-127, 255 is +inf): the same
// values as mxfp4::e8m0_to_float without a libm call per block.
inline float e8m0(uint8_t e) {
  const uint32_t bits = e ? uint32_t(e) << 23 : 0x00400000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One row against NT tokens. Each 8-lane step decodes 8 weights: vpermps looks the low 3
// bits of each lane's nibble up in the magnitude table, bit 3 becomes the float sign, and
// the block scale multiplies; A independent accumulator chains per token.
template <int NT>
void dot_row(const WeightView& w, int64_t r, const uint8_t* x, int64_t x_stride, float* out) {
  const float* xp = reinterpret_cast<const float*>(x);
  const int64_t xs = x_stride / int64_t(sizeof(float));
  constexpr int A = NT == 1 ? 4 : (NT == 2 ? 2 : 1);
  const uint8_t* q = w.row(r);
  const uint8_t* sp = w.scales_row(r);
  const int64_t cols = w.cols;
  __m256 acc[NT][A];
  for (int t = 0; t < NT; ++t)
    for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
  const __m256 magnitudes = _mm256_setr_ps(0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f);
  const __m256i sign_bit = _mm256_set1_epi32(int32_t(0x80000000u));
  auto chunk = [&](__m256i v, float sa, float sb, const float* xc) __attribute__((always_inline)) {
    const __m256 sv = _mm256_set_m128(_mm_set1_ps(sb), _mm_set1_ps(sa));
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256 mag = _mm256_permutevar8x32_ps(magnitudes, v);
      const __m256 sign = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(v, 28), sign_bit));
      const __m256 wj = _mm256_mul_ps(_mm256_xor_ps(mag, sign), sv);
      v = _mm256_srli_epi32(v, 4);
      for (int t = 0; t < NT; ++t)
        acc[t][j % A] = _mm256_fmadd_ps(wj, _mm256_loadu_ps(xc + t * xs + 8 * j), acc[t][j % A]);
    }
  };
  int64_t c = 0;
  for (; c + 64 <= cols; c += 64) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c / 2));
    chunk(v, e8m0(sp[c / 32]), e8m0(sp[c / 32 + 1]), xp + c);
  }
  if (c < cols) {  // 32 trailing columns; lanes 4-7 decode to 0 against zero padding
    const __m256i v = _mm256_set_m128i(_mm_setzero_si128(), _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c / 2)));
    const float s = e8m0(sp[c / 32]);
    chunk(v, s, s, xp + c);
  }
  for (int t = 0; t < NT; ++t) {
    __m256 s = acc[t][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[t][a]);
    out[t] = hsum(s);
  }
}

#endif

void check_mxfp4(const WeightView& w, const char* op) {
  if (w.dtype != DType::MXFP4) fail("{}: weight dtype {} is not MXFP4", op, dtype_name(w.dtype));
  if (w.group_size != mxfp4::kGroup) fail("{}: MXFP4 group size {} (must be 32)", op, w.group_size);
}

}  // namespace

void mxfp4_matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y) {
  check_mxfp4(w, "mxfp4_matmul");
#if TS_MXFP4_AVX2
  const grouped::ActivationPrep prep = {
      [](int64_t cols) { return grouped::permuted_stride(cols) * int64_t(sizeof(float)); },
      [](const float* xr, uint8_t* dst, int64_t cols) { grouped::permute_activations(xr, reinterpret_cast<float*>(dst), cols); }};
  grouped::matmul(pool, w, x, y, {&dot_row<1>, &dot_row<2>, &dot_row<3>, &dot_row<4>}, prep, "mxfp4_matmul");
#else
  (void)pool;
  grouped::matmul_reference(w, x, y, "mxfp4_matmul");
#endif
}

void mxfp4_embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out) {
  check_mxfp4(table, "mxfp4_embedding");
  grouped::embedding(table, ids, n, scale, out, "mxfp4_embedding");
}

void ref::mxfp4_matmul(const WeightView& w, const Mat& x, const Mat& y) {
  check_mxfp4(w, "ref::mxfp4_matmul");
  grouped::matmul_reference(w, x, y, "ref::mxfp4_matmul");
}

}  // namespace turbospark::cpu
