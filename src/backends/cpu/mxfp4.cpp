#include "backends/cpu/mxfp4.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
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

// ---- integer fast path ----------------------------------------------------------------
// Twice an e2m1 value is a small integer (0, 1, 2, 3, 4, 6, 8, 12, with the code's top bit
// as the sign), so a 16-entry int8 table applied with pshufb decodes 32 codes at once. The
// activations are quantized to int8 once per call, one float scale per 32-element block,
// in the nibble order of a packed block (qs[k] = x[2k] from the low nibbles, qs[16 + k] =
// x[2k + 1] from the high ones), so the weights need no shuffling; each block's integer dot
// then takes one float FMA by d * 2^(e - 127) / 2. Only the activation rounding (at most
// amax(block) / 254 per element) separates it from the exact float path above.
struct ActBlock {
  float d;
  int8_t qs[32];
};
static_assert(sizeof(ActBlock) == 36);

int64_t act_row_bytes(int64_t cols) { return cols / 32 * int64_t(sizeof(ActBlock)); }

void quantize_activations(const float* x, uint8_t* dst, int64_t cols) {
  auto* y = reinterpret_cast<ActBlock*>(dst);
  for (int64_t b = 0; b < cols / 32; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    for (int k = 0; k < 16; ++k) {
      y[b].qs[k] = int8_t(std::clamp(int(std::nearbyint(xb[2 * k] * id)), -127, 127));
      y[b].qs[16 + k] = int8_t(std::clamp(int(std::nearbyint(xb[2 * k + 1] * id)), -127, 127));
    }
    y[b].d = d;
  }
}

// e8m0 scale / 2 (the table holds twice the e2m1 values): 2^(e - 128), exact for every e
// (e = 0 gives the subnormal 2^-128, 255 gives +inf as ldexp would after the halving).
struct HalfScales {
  float v[256];
  HalfScales() {
    for (int e = 0; e < 256; ++e) v[e] = e == 255 ? INFINITY : std::ldexp(1.0f, e - 128);
  }
};
const HalfScales kHalfScales;

#if TS_MXFP4_AVX2

// The four-row decode kernel (dot_rows4_int); false falls back to one row per pass.
constexpr bool kMxfp4Rows4 = true;

// sum over 4-byte groups of a * b for signed int8 a (weights) and b (activations):
// maddubs wants unsigned x signed, so |a| meets b with a's sign moved onto it.
inline __m256 dot_i8_blocks(__m256i a, __m256i b) {
  const __m256i ua = _mm256_sign_epi8(a, a);
  const __m256i sb = _mm256_sign_epi8(b, a);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ua, sb), _mm256_set1_epi16(1)));
}

template <int NT>
void dot_row_int(const WeightView& w, int64_t r, const uint8_t* x, int64_t x_stride, float* out) {
  constexpr int A = NT == 1 ? 2 : 1;
  const uint8_t* q = w.row(r);
  const uint8_t* sp = w.scales_row(r);
  const int64_t n_blocks = w.cols / 32;
  const ActBlock* y[NT];
  __m256 acc[NT][A];
  for (int t = 0; t < NT; ++t) {
    y[t] = reinterpret_cast<const ActBlock*>(x + t * x_stride);
    for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
  }
  const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,  //
                                       0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  auto block = [&](int64_t b, int k) __attribute__((always_inline)) {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * b));
    const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
    const __m256i wv = _mm256_shuffle_epi8(lut, codes);
    const float ws = kHalfScales.v[sp[b]];
    for (int t = 0; t < NT; ++t) {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[t][b].qs));
      acc[t][k % A] = _mm256_fmadd_ps(_mm256_set1_ps(ws * y[t][b].d), dot_i8_blocks(wv, a), acc[t][k % A]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= n_blocks; b += 2) {
    block(b, 0);
    block(b + 1, 1);
  }
  if (b < n_blocks) block(b, 0);
  for (int t = 0; t < NT; ++t) {
    __m256 s = acc[t][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[t][a]);
    out[t] = hsum(s);
  }
}

// Decode: four rows against one token, sharing each block's activation load and scale.
void dot_rows4_int(const WeightView& w, int64_t r, const uint8_t* x, float* out) {
  constexpr int R = 4;
  const int64_t n_blocks = w.cols / 32;
  const auto* y = reinterpret_cast<const ActBlock*>(x);
  const uint8_t* q[R];
  const uint8_t* sp[R];
  __m256 acc[R];
  for (int i = 0; i < R; ++i) {
    q[i] = w.row(r + i);
    sp[i] = w.scales_row(r + i);
    acc[i] = _mm256_setzero_ps();
  }
  const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12,  //
                                       0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < n_blocks; ++b) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[b].qs));
    const float d = y[b].d;
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[i] + 16 * b));
      const __m256i wv = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(kHalfScales.v[sp[i][b]] * d), dot_i8_blocks(wv, a), acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) out[i] = hsum(acc[i]);
}

#endif

template <int NT>
void dot_row_int_scalar(const WeightView& w, int64_t r, const uint8_t* x, int64_t x_stride, float* out) {
  static constexpr int8_t kLut[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  const uint8_t* q = w.row(r);
  const uint8_t* sp = w.scales_row(r);
  for (int t = 0; t < NT; ++t) {
    const auto* y = reinterpret_cast<const ActBlock*>(x + t * x_stride);
    float acc = 0.f;
    for (int64_t b = 0; b < w.cols / 32; ++b) {
      int sum = 0;
      for (int k = 0; k < 16; ++k)
        sum += kLut[q[16 * b + k] & 0xF] * y[b].qs[k] + kLut[q[16 * b + k] >> 4] * y[b].qs[16 + k];
      acc += kHalfScales.v[sp[b]] * y[b].d * float(sum);
    }
    out[t] = acc;
  }
}

constexpr grouped::ActivationPrep kIntPrep = {&act_row_bytes, &quantize_activations};

void check_mxfp4(const WeightView& w, const char* op) {
  if (w.dtype != DType::MXFP4) fail("{}: weight dtype {} is not MXFP4", op, dtype_name(w.dtype));
  if (w.group_size != mxfp4::kGroup) fail("{}: MXFP4 group size {} (must be 32)", op, w.group_size);
}

}  // namespace

namespace {
std::atomic<bool>& int8_mode() {
  static std::atomic<bool> on = [] {
    const char* e = std::getenv("TURBOSPARK_MXFP4_INT8");
    return e && *e && std::strcmp(e, "0") != 0;
  }();
  return on;
}
}  // namespace

void mxfp4_set_int8_activations(bool on) { int8_mode().store(on, std::memory_order_relaxed); }
bool mxfp4_int8_activations() { return int8_mode().load(std::memory_order_relaxed); }

void mxfp4_matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y) {
  if (mxfp4_int8_activations()) mxfp4_matmul_int8(pool, w, x, y);
  else mxfp4_matmul_exact(pool, w, x, y);
}

void mxfp4_matmul_int8(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y) {
  check_mxfp4(w, "mxfp4_matmul_int8");
#if TS_MXFP4_AVX2
  grouped::matmul(pool, w, x, y,
                  {&dot_row_int<1>, &dot_row_int<2>, &dot_row_int<3>, &dot_row_int<4>, kMxfp4Rows4 ? &dot_rows4_int : nullptr},
                  kIntPrep, "mxfp4_matmul_int8");
#else
  grouped::matmul(pool, w, x, y,
                  {&dot_row_int_scalar<1>, &dot_row_int_scalar<2>, &dot_row_int_scalar<3>, &dot_row_int_scalar<4>},
                  kIntPrep, "mxfp4_matmul_int8");
#endif
}

void mxfp4_matmul_exact(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y) {
  check_mxfp4(w, "mxfp4_matmul_exact");
#if TS_MXFP4_AVX2
  const grouped::ActivationPrep prep = {
      [](int64_t cols) { return grouped::permuted_stride(cols) * int64_t(sizeof(float)); },
      [](const float* xr, uint8_t* dst, int64_t cols) { grouped::permute_activations(xr, reinterpret_cast<float*>(dst), cols); }};
  grouped::matmul(pool, w, x, y, {&dot_row<1>, &dot_row<2>, &dot_row<3>, &dot_row<4>}, prep, "mxfp4_matmul_exact");
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

void ref::mxfp4_matmul_int8(const WeightView& w, const Mat& x, const Mat& y) {
  check_mxfp4(w, "ref::mxfp4_matmul_int8");
  grouped::matmul_serial(w, x, y,
                         {&dot_row_int_scalar<1>, &dot_row_int_scalar<2>, &dot_row_int_scalar<3>, &dot_row_int_scalar<4>},
                         kIntPrep, "ref::mxfp4_matmul_int8");
}

}  // namespace turbospark::cpu
