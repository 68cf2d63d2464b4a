#include "backends/cpu/int4_affine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backends/cpu/grouped_matmul.h"
#include "backends/cpu/simd.h"
#include "core/error.h"
#include "core/quant.h"
#include "core/quant_grouped.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TS_INT4_AVX2 1
#include <immintrin.h>
#else
#define TS_INT4_AVX2 0
#endif

namespace turbospark::cpu {
namespace {

// Activations are quantized to int8 once per call, one scale per weight group of G = 32,
// 64 or 128 elements: x ~= d * qs, s = d * sum(qs). A prepared row is qs[cols] (int8),
// then d[n_groups] and s[n_groups] (float), so eight groups' scales load as one vector.
// qs follows the nibble order of the packed bytes, so the codes meet their activations in
// maddubs without shuffling the weights: for each full 64 columns starting at c (32 packed
// bytes, element c + 2k in the low nibble of byte k), qs[c + k] = x[c + 2k] and
// qs[c + 32 + k] = x[c + 2k + 1]; a trailing 32 columns (cols % 64 == 32) use the same
// order on 16 bytes (grouped::int8_index). Then
//   sum_i w_i x_i ~= sum_g scale_g * d_g * sum_{i in g} q_i qs_i + bias_g * s_g.
using grouped::int8_index;

struct ActRow {
  const int8_t* qs;
  const float* d;
  const float* s;
};

inline ActRow act_row(const uint8_t* x, int64_t cols, int64_t n_groups) {
  const auto* d = reinterpret_cast<const float*>(x + cols);
  return {reinterpret_cast<const int8_t*>(x), d, d + n_groups};
}

template <int G>
int64_t act_row_bytes(int64_t cols) {
  return cols + 2 * int64_t(sizeof(float)) * (cols / G);
}

template <int G>
void quantize_activations(const float* x, uint8_t* dst, int64_t cols) {
  const int64_t n_groups = cols / G;
  auto* qs = reinterpret_cast<int8_t*>(dst);
  auto* d = reinterpret_cast<float*>(dst + cols);
  float* s = d + n_groups;
  for (int64_t g = 0; g < n_groups; ++g) {
    const float* xg = x + G * g;
    float amax = 0.f;
    for (int i = 0; i < G; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float dg = amax / 127.f, id = dg > 0.f ? 1.f / dg : 0.f;
    int sum = 0;
    for (int i = 0; i < G; ++i) {
      const int q = std::clamp(int(std::nearbyint(xg[i] * id)), -127, 127);
      qs[int8_index(G * g + i, cols)] = int8_t(q);
      sum += q;
    }
    d[g] = dg;
    s[g] = dg * float(sum);
  }
}

template <int G>
constexpr grouped::ActivationPrep kPrep = {&act_row_bytes<G>, &quantize_activations<G>};

// The integer arithmetic in plain loops: the reference the AVX2 path must match to float
// rounding, and the fallback without AVX2.
template <int G, int NT>
void dot_row_scalar(const WeightView& w, int64_t r, const uint8_t* x, int64_t xs, float* out) {
  const uint8_t* q = w.row(r);
  const int64_t cols = w.cols, n_groups = cols / G;
  for (int t = 0; t < NT; ++t) {
    const ActRow a = act_row(x + t * xs, cols, n_groups);
    float acc = 0.f;
    for (int64_t g = 0; g < n_groups; ++g) {
      int sum = 0;
      for (int64_t i = G * g; i < G * (g + 1); ++i) sum += ((q[i / 2] >> (4 * (i & 1))) & 0xF) * a.qs[int8_index(i, cols)];
      const float scale = int4_affine::plane_value(w.scales_dtype, w.scales_row(r), g);
      const float bias = int4_affine::plane_value(w.scales_dtype, w.biases_row(r), g);
      acc += scale * a.d[g] * float(sum) + bias * a.s[g];
    }
    out[t] = acc;
  }
}

template <int G>
constexpr grouped::RowDots kScalarDots = {&dot_row_scalar<G, 1>, &dot_row_scalar<G, 2>, &dot_row_scalar<G, 3>,
                                          &dot_row_scalar<G, 4>};

#if TS_INT4_AVX2

template <DType kPlane>
inline float plane(const uint8_t* p, int64_t i) {
  if constexpr (kPlane == DType::F32) {
    float f;
    std::memcpy(&f, p + 4 * i, 4);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, 2);
    if constexpr (kPlane == DType::F16) return _cvtsh_ss(h);
    else return bf16_to_f32(h);
  }
}

// Eight consecutive plane values i .. i + 7 as floats.
template <DType kPlane>
inline __m256 plane8(const uint8_t* p, int64_t i) {
  if constexpr (kPlane == DType::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i));
    if constexpr (kPlane == DType::F16) return _mm256_cvtph_ps(h);
    else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
}

// One row against NT tokens. Per 64 columns: one 32-byte load gives 64 codes as two
// registers (low nibbles: the even elements, high nibbles: the odd ones; one and, one
// shift), each meets its token's int8 activations in one maddubs; the products add up in
// int16 over the group (at most 2 * 15 * 127 * G / 32 = 15240 for G = 128), then one madd
// to int32, one convert and one FMA by scale * d per group and token. Scales, d and the
// bias term go eight groups at a time as vectors. G = 32 takes two groups per 64 columns,
// lanes 0-3 the first and 4-7 the second, with a half-register scale each.
template <DType kPlane, int G, int NT>
void dot_row(const WeightView& w, int64_t r, const uint8_t* x, int64_t xs, float* out) {
  constexpr int A = NT <= 2 ? 2 : 1;  // accumulator chains per token (registers permitting)
  const uint8_t* q = w.row(r);
  const uint8_t* sp = w.scales_row(r);
  const uint8_t* bp = w.biases_row(r);
  const int64_t cols = w.cols, n_groups = cols / G;
  ActRow a[NT];
  __m256 acc[NT][A], bias_v[NT];
  float bias_tail[NT];
  for (int t = 0; t < NT; ++t) {
    a[t] = act_row(x + t * xs, cols, n_groups);
    for (int k = 0; k < A; ++k) acc[t][k] = _mm256_setzero_ps();
    bias_v[t] = _mm256_setzero_ps();
    bias_tail[t] = 0.f;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // int16 sums of the 64 columns at c into s16 (set when first, else added).
  auto chunk64 = [&](int64_t c, __m256i* s16, bool first) __attribute__((always_inline)) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c / 2));
    const __m256i lo = _mm256_and_si256(v, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
    for (int t = 0; t < NT; ++t) {
      const __m256i p = _mm256_add_epi16(
          _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t].qs + c))),
          _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[t].qs + c + 32))));
      s16[t] = first ? p : _mm256_add_epi16(s16[t], p);
    }
  };
  int64_t g = 0;
  for (; g + 8 <= n_groups; g += 8) {
    const __m256 sc = plane8<kPlane>(sp, g), bi = plane8<kPlane>(bp, g);
    alignas(32) float sd[NT][8];
    for (int t = 0; t < NT; ++t) {
      _mm256_store_ps(sd[t], _mm256_mul_ps(sc, _mm256_loadu_ps(a[t].d + g)));
      bias_v[t] = _mm256_fmadd_ps(bi, _mm256_loadu_ps(a[t].s + g), bias_v[t]);
    }
#pragma GCC unroll 8
    for (int j = 0; j < 8; j += (G == 32 ? 2 : 1)) {
      __m256i s16[NT];
#pragma GCC unroll 2
      for (int c = 0; c < (G == 32 ? 1 : G / 64); ++c) chunk64((g + j) * G + 64 * c, s16, c == 0);
      for (int t = 0; t < NT; ++t) {
        const __m256 scale = G == 32 ? _mm256_set_m128(_mm_broadcast_ss(&sd[t][j + 1]), _mm_broadcast_ss(&sd[t][j]))
                                     : _mm256_broadcast_ss(&sd[t][j]);
        const int k = (G == 32 ? j / 2 : j) % A;
        acc[t][k] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[t], ones)), acc[t][k]);
      }
    }
  }
  for (; g < n_groups; ++g) {  // the last n_groups % 8 groups, one at a time
    const float scale = plane<kPlane>(sp, g), bias = plane<kPlane>(bp, g);
    __m256i s32[NT];
    if constexpr (G == 32) {
      const int64_t c = 32 * g, c64 = c / 64 * 64, half = (c - c64) / 2;
      const bool full = c64 + 64 <= cols;
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c / 2));
      const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
      for (int t = 0; t < NT; ++t) {
        const int8_t* lo = a[t].qs + c64 + half;
        const int8_t* hi = a[t].qs + c64 + (full ? 32 + half : 16);
        const __m256i act = _mm256_loadu2_m128i(reinterpret_cast<const __m128i*>(hi), reinterpret_cast<const __m128i*>(lo));
        s32[t] = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, act), ones);
      }
    } else {
      __m256i s16[NT];
      for (int c = 0; c < G / 64; ++c) chunk64(g * G + 64 * c, s16, c == 0);
      for (int t = 0; t < NT; ++t) s32[t] = _mm256_madd_epi16(s16[t], ones);
    }
    for (int t = 0; t < NT; ++t) {
      acc[t][0] = _mm256_fmadd_ps(_mm256_set1_ps(scale * a[t].d[g]), _mm256_cvtepi32_ps(s32[t]), acc[t][0]);
      bias_tail[t] += bias * a[t].s[g];
    }
  }
  for (int t = 0; t < NT; ++t) {
    __m256 sum = acc[t][0];
    for (int k = 1; k < A; ++k) sum = _mm256_add_ps(sum, acc[t][k]);
    out[t] = hsum(sum) + hsum(bias_v[t]) + bias_tail[t];
  }
}

template <DType kPlane, int G>
grouped::RowDots dots_for() {
  return {&dot_row<kPlane, G, 1>, &dot_row<kPlane, G, 2>, &dot_row<kPlane, G, 3>, &dot_row<kPlane, G, 4>};
}

template <int G>
grouped::RowDots dots_for(DType plane_dtype) {
  return plane_dtype == DType::BF16  ? dots_for<DType::BF16, G>()
         : plane_dtype == DType::F16 ? dots_for<DType::F16, G>()
                                     : dots_for<DType::F32, G>();
}

#endif

void check_int4(const WeightView& w, const char* op) {
  if (w.dtype != DType::INT4_AFFINE) fail("{}: weight dtype {} is not INT4_AFFINE", op, dtype_name(w.dtype));
  if (!int4_affine::is_plane_dtype(w.scales_dtype))
    fail("{}: scale dtype {} is not BF16, F16 or F32", op, dtype_name(w.scales_dtype));
  if (w.group_size != 32 && w.group_size != 64 && w.group_size != 128)
    fail("{}: INT4_AFFINE group size {} is not 32, 64 or 128", op, w.group_size);
}

template <int G>
void run(ThreadPool* pool, const WeightView& w, const Mat& x, const Mat& y) {
  if (!pool) return grouped::matmul_serial(w, x, y, kScalarDots<G>, kPrep<G>, "ref::int4_affine_matmul");
#if TS_INT4_AVX2
  grouped::matmul(*pool, w, x, y, dots_for<G>(w.scales_dtype), kPrep<G>, "int4_affine_matmul");
#else
  grouped::matmul(*pool, w, x, y, kScalarDots<G>, kPrep<G>, "int4_affine_matmul");
#endif
}

void dispatch(ThreadPool* pool, const WeightView& w, const Mat& x, const Mat& y) {
  switch (w.group_size) {
    case 32: return run<32>(pool, w, x, y);
    case 64: return run<64>(pool, w, x, y);
    default: return run<128>(pool, w, x, y);
  }
}

}  // namespace

void int4_affine_matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y) {
  check_int4(w, "int4_affine_matmul");
  dispatch(&pool, w, x, y);
}

void int4_affine_embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out) {
  check_int4(table, "int4_affine_embedding");
  grouped::embedding(table, ids, n, scale, out, "int4_affine_embedding");
}

void ref::int4_affine_matmul(const WeightView& w, const Mat& x, const Mat& y) {
  check_int4(w, "ref::int4_affine_matmul");
  dispatch(nullptr, w, x, y);
}

}  // namespace turbospark::cpu
