#include "backends/cpu/mxfp4.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cmath>
#include <cstring>

#include "backends/cpu/grouped_matmul.h"
#include "backends/cpu/simd.h"
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
// as the sign). The activations are quantized to int8 once per call, one float scale per
// 32-element block, in the nibble order of the packed bytes (the layout INT4_AFFINE uses,
// grouped::int8_index): per 64 columns c, qs[c + k] = x[c + 2k] (low nibbles of the 32 bytes)
// and qs[c + 32 + k] = x[c + 2k + 1]; a trailing 32 columns the same on 16 bytes. maddubs
// wants its first operand unsigned, so the lookup table holds 2 * e2m1 + 12 (0 .. 24) and
// each block's integer sum drops 12 * sum(qs) again, exactly, in int32: a prepared row
// carries those terms per 64 columns as a ready vector. Each block's integer dot then takes
// one float FMA by d * 2^(e - 127) / 2. Only the activation rounding (at most
// amax(block) / 254 per element) separates it from the exact float path above.
//
// A prepared row: qs[cols] int8 | d[n_blocks] float | s12[n_blocks] int32 (12 * sum of the
// block's qs) | per full 64 columns an int32 x 8 vector {s12[2c], 0, 0, 0, s12[2c + 1], 0, 0, 0}.
constexpr int kOffset = 12;

struct IntRow {
  const int8_t* qs;
  const float* d;
  const int32_t* s12;
  const int32_t* corr;
};

inline IntRow int_row(const uint8_t* x, int64_t cols) {
  const int64_t nb = cols / 32;
  const auto* d = reinterpret_cast<const float*>(x + cols);
  const auto* s12 = reinterpret_cast<const int32_t*>(d + nb);
  return {reinterpret_cast<const int8_t*>(x), d, s12, s12 + nb};
}

int64_t act_row_bytes(int64_t cols) { return cols + 8 * (cols / 32) + 32 * (cols / 64); }

void quantize_activations(const float* x, uint8_t* dst, int64_t cols) {
  const int64_t nb = cols / 32;
  auto* qs = reinterpret_cast<int8_t*>(dst);
  auto* d = reinterpret_cast<float*>(dst + cols);
  auto* s12 = reinterpret_cast<int32_t*>(d + nb);
  int32_t* corr = s12 + nb;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + 32 * b;
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float db = amax / 127.f, id = db > 0.f ? 1.f / db : 0.f;
    int32_t sum = 0;
    for (int i = 0; i < 32; ++i) {
      const int q = std::clamp(int(std::nearbyint(xb[i] * id)), -127, 127);
      qs[grouped::int8_index(32 * b + i, cols)] = int8_t(q);
      sum += q;
    }
    d[b] = db;
    s12[b] = kOffset * sum;
  }
  for (int64_t c = 0; c < cols / 64; ++c) {
    int32_t* v = corr + 8 * c;
    std::fill(v, v + 8, 0);
    v[0] = s12[2 * c];
    v[4] = s12[2 * c + 1];
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

// One row against NT tokens. Per 64 columns (two blocks): one 32-byte load gives 64 codes
// as two registers (low nibbles: even elements, high: odd; one and, one shift), pshufb
// turns each into 2 * e2m1 + 12, maddubs meets the token's activations, the two products
// add in int16 (at most 2 * 2 * 24 * 127 = 12192), one madd to int32 (lanes 0-3 the first
// block, 4-7 the second), minus the offset terms, one convert and one FMA by the two
// blocks' d * scale as half-register broadcasts. Eight blocks' scales go as one vector.
template <int NT>
void dot_row_int(const WeightView& w, int64_t r, const uint8_t* x, int64_t x_stride, float* out) {
  constexpr int A = NT <= 2 ? 2 : 1;
  const uint8_t* q = w.row(r);
  const uint8_t* sp = w.scales_row(r);
  const int64_t cols = w.cols, n_blocks = cols / 32;
  IntRow y[NT];
  __m256 acc[NT][A];
  for (int t = 0; t < NT; ++t) {
    y[t] = int_row(x + t * x_stride, cols);
    for (int a = 0; a < A; ++a) acc[t][a] = _mm256_setzero_ps();
  }
  const __m256i lut = _mm256_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0,  //
                                       12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  int64_t b = 0;
  for (; b + 8 <= n_blocks; b += 8) {
    // 2^(e - 127) from the exponent bits (e = 0: the subnormal 2^-127), halved.
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sp + b)));
    const __m256i bits = _mm256_max_epi32(_mm256_slli_epi32(e, 23), _mm256_set1_epi32(0x00400000));
    const __m256 ws = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(0.5f));
    alignas(32) float sd[NT][8];
    for (int t = 0; t < NT; ++t) _mm256_store_ps(sd[t], _mm256_mul_ps(ws, _mm256_loadu_ps(y[t].d + b)));
#pragma GCC unroll 4
    for (int j = 0; j < 8; j += 2) {
      const int64_t c = 32 * (b + j);
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c / 2));
      const __m256i lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(v, low4));
      const __m256i hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      for (int t = 0; t < NT; ++t) {
        const __m256i p = _mm256_add_epi16(
            _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[t].qs + c))),
            _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[t].qs + c + 32))));
        const __m256i s32 = _mm256_sub_epi32(_mm256_madd_epi16(p, ones),
                                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[t].corr + 8 * (c / 64))));
        const __m256 scale = _mm256_set_m128(_mm_broadcast_ss(&sd[t][j + 1]), _mm_broadcast_ss(&sd[t][j]));
        acc[t][(j / 2) % A] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(s32), acc[t][(j / 2) % A]);
      }
    }
  }
  for (; b < n_blocks; ++b) {  // the last n_blocks % 8 blocks, one at a time
    const int64_t c = 32 * b, c64 = c / 64 * 64, half = (c - c64) / 2;
    const bool full = c64 + 64 <= cols;
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c / 2));
    const __m256i wv = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4));
    const float ws = kHalfScales.v[sp[b]];
    for (int t = 0; t < NT; ++t) {
      const int8_t* lo = y[t].qs + c64 + half;
      const int8_t* hi = y[t].qs + c64 + (full ? 32 + half : 16);
      const __m256i act = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(hi), reinterpret_cast<const __m128i*>(lo));
      const __m256i s32 = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, act), ones);
      // The offset comes off lane 0's partial sum: the lanes are summed before the FMA's
      // result is read, so where it goes does not matter.
      const __m256i s = _mm256_sub_epi32(s32, _mm256_setr_epi32(y[t].s12[b], 0, 0, 0, 0, 0, 0, 0));
      acc[t][0] = _mm256_fmadd_ps(_mm256_set1_ps(ws * y[t].d[b]), _mm256_cvtepi32_ps(s), acc[t][0]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    __m256 s = acc[t][0];
    for (int a = 1; a < A; ++a) s = _mm256_add_ps(s, acc[t][a]);
    out[t] = hsum(s);
  }
}

#endif

template <int NT>
void dot_row_int_scalar(const WeightView& w, int64_t r, const uint8_t* x, int64_t x_stride, float* out) {
  static constexpr int8_t kLut[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
  const uint8_t* q = w.row(r);
  const uint8_t* sp = w.scales_row(r);
  const int64_t cols = w.cols;
  for (int t = 0; t < NT; ++t) {
    const IntRow y = int_row(x + t * x_stride, cols);
    float acc = 0.f;
    for (int64_t b = 0; b < cols / 32; ++b) {
      int sum = 0;
      for (int64_t i = 32 * b; i < 32 * b + 32; ++i)
        sum += kLut[(q[i / 2] >> (4 * (i & 1))) & 0xF] * y.qs[grouped::int8_index(i, cols)];
      acc += kHalfScales.v[sp[b]] * y.d[b] * float(sum);
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
    return !(e && std::strcmp(e, "0") == 0);
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
  grouped::matmul(pool, w, x, y, {&dot_row_int<1>, &dot_row_int<2>, &dot_row_int<3>, &dot_row_int<4>}, kIntPrep,
                  "mxfp4_matmul_int8");
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
