#include "backends/cpu/int4_affine.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backends/cpu/grouped_matmul.h"
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
// 64 or 128 elements: x ~= d * qs, s = d * sum(qs). Within each 32 elements qs follows the
// nibble order of a packed 16-byte block, qs[k] = x[2k] (the low nibbles) and
// qs[16 + k] = x[2k + 1] (the high nibbles), so codes meet their activations in one
// maddubs without shuffling the weights, and a whole group's integer sums add up before
// the one float FMA by scale * d:  sum_i w_i x_i ~= scale * d * sum_i q_i qs_i + bias * s.
template <int G>
struct ActGroup {
  float d;
  float s;
  int8_t qs[G];
};

template <int G>
int64_t act_row_bytes(int64_t cols) {
  return cols / G * int64_t(sizeof(ActGroup<G>));
}

template <int G>
void quantize_activations(const float* x, uint8_t* dst, int64_t cols) {
  auto* y = reinterpret_cast<ActGroup<G>*>(dst);
  for (int64_t g = 0; g < cols / G; ++g) {
    const float* xg = x + G * g;
    float amax = 0.f;
    for (int i = 0; i < G; ++i) amax = std::max(amax, std::fabs(xg[i]));
    const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int b = 0; b < G / 32; ++b) {
      for (int k = 0; k < 16; ++k) {
        const int q0 = std::clamp(int(std::nearbyint(xg[32 * b + 2 * k] * id)), -127, 127);
        const int q1 = std::clamp(int(std::nearbyint(xg[32 * b + 2 * k + 1] * id)), -127, 127);
        y[g].qs[32 * b + k] = int8_t(q0);
        y[g].qs[32 * b + 16 + k] = int8_t(q1);
        sum += q0 + q1;
      }
    }
    y[g].d = d;
    y[g].s = d * float(sum);
  }
}

template <int G>
constexpr grouped::ActivationPrep kPrep = {&act_row_bytes<G>, &quantize_activations<G>};

template <int G>
inline const ActGroup<G>* act(const uint8_t* x, int64_t x_stride, int t) {
  return reinterpret_cast<const ActGroup<G>*>(x + t * x_stride);
}

// The integer arithmetic in plain loops: the reference the AVX2 path must match to float
// rounding, and the fallback without AVX2.
template <int G, int NT>
void dot_row_scalar(const WeightView& w, int64_t r, const uint8_t* x, int64_t xs, float* out) {
  const uint8_t* q = w.row(r);
  for (int t = 0; t < NT; ++t) {
    const ActGroup<G>* y = act<G>(x, xs, t);
    float acc = 0.f;
    for (int64_t g = 0; g < w.cols / G; ++g) {
      int sum = 0;
      for (int b = 0; b < G / 32; ++b) {
        const uint8_t* qb = q + g * G / 2 + 16 * b;
        const int8_t* a = y[g].qs + 32 * b;
        for (int k = 0; k < 16; ++k) sum += (qb[k] & 0xF) * a[k] + (qb[k] >> 4) * a[16 + k];
      }
      const float scale = int4_affine::plane_value(w.scales_dtype, w.scales_row(r), g);
      const float bias = int4_affine::plane_value(w.scales_dtype, w.biases_row(r), g);
      acc += scale * y[g].d * float(sum) + bias * y[g].s;
    }
    out[t] = acc;
  }
}

template <int G>
constexpr grouped::RowDots kScalarDots = {&dot_row_scalar<G, 1>, &dot_row_scalar<G, 2>, &dot_row_scalar<G, 3>,
                                          &dot_row_scalar<G, 4>};

#if TS_INT4_AVX2

// The four-row decode kernel (dot_rows4); false falls back to one row per pass. Off: on
// qwen3-0.6b int4-affine g64 decode (2-core VM, paired runs) it read 7.3-8.6 GB/s against
// 11.6-13.3 GB/s for one row per pass; the cause is not yet understood.
constexpr bool kInt4Rows4 = false;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

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

// One row against NT tokens. Per 32 elements: 16 packed bytes become 32 unsigned codes
// [low nibbles | high nibbles] (one and, one shift), maddubs/madd against each token's int8
// activations, summed in int32 over the group; per group one FMA by scale * d per token.
// Two accumulator chains per token take alternate groups (indices fixed at compile time so
// they stay in registers).
template <DType kPlane, int G, int NT>
void dot_row(const WeightView& w, int64_t r, const uint8_t* x, int64_t xs, float* out) {
  const uint8_t* q = w.row(r);
  const uint8_t* sp = w.scales_row(r);
  const uint8_t* bp = w.biases_row(r);
  const int64_t n_groups = w.cols / G;
  const ActGroup<G>* y[NT];
  __m256 acc[NT][2];
  float bias_acc[NT];
  for (int t = 0; t < NT; ++t) {
    y[t] = act<G>(x, xs, t);
    acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    bias_acc[t] = 0.f;
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  auto group = [&](int64_t g, int k) __attribute__((always_inline)) {
    __m256i isum[NT];
    const uint8_t* qg = q + g * (G / 2);
#pragma GCC unroll 4
    for (int b = 0; b < G / 32; ++b) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16 * b));
      const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
      for (int t = 0; t < NT; ++t) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[t][g].qs + 32 * b));
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, a), ones);
        isum[t] = b == 0 ? p : _mm256_add_epi32(isum[t], p);
      }
    }
    const float scale = plane<kPlane>(sp, g), bias = plane<kPlane>(bp, g);
    for (int t = 0; t < NT; ++t) {
      acc[t][k] = _mm256_fmadd_ps(_mm256_set1_ps(scale * y[t][g].d), _mm256_cvtepi32_ps(isum[t]), acc[t][k]);
      bias_acc[t] += bias * y[t][g].s;
    }
  };
  int64_t g = 0;
  for (; g + 2 <= n_groups; g += 2) {
    group(g, 0);
    group(g + 1, 1);
  }
  if (g < n_groups) group(g, 0);
  for (int t = 0; t < NT; ++t) out[t] = hsum(_mm256_add_ps(acc[t][0], acc[t][1])) + bias_acc[t];
}

// Decode: four rows against one token. Each group's activation blocks are loaded once and
// meet all four rows; the maddubs products of a group add up in int16 (at most
// 2 * 15 * 127 * G / 32 = 15240 for G = 128) before one madd to int32, then one FMA by
// scale * d per row and group. The bias term, sum_g bias[g] * s[g], is a separate short dot.
template <DType kPlane, int G>
void dot_rows4(const WeightView& w, int64_t r, const uint8_t* x, float* out) {
  constexpr int R = 4, B = G / 32;
  const int64_t n_groups = w.cols / G;
  const ActGroup<G>* y = act<G>(x, 0, 0);
  const uint8_t* q[R];
  const uint8_t* sp[R];
  __m256 acc[R];
  for (int i = 0; i < R; ++i) {
    q[i] = w.row(r + i);
    sp[i] = w.scales_row(r + i);
    acc[i] = _mm256_setzero_ps();
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < n_groups; ++g) {
    __m256i a[B];
#pragma GCC unroll 4
    for (int b = 0; b < B; ++b) a[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(y[g].qs + 32 * b));
    const float d = y[g].d;
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const uint8_t* qg = q[i] + g * (G / 2);
      __m256i s16;
#pragma GCC unroll 4
      for (int b = 0; b < B; ++b) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qg + 16 * b));
        const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
        const __m256i p = _mm256_maddubs_epi16(codes, a[b]);
        s16 = b == 0 ? p : _mm256_add_epi16(s16, p);
      }
      const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(plane<kPlane>(sp[i], g) * d), f, acc[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    const uint8_t* bp = w.biases_row(r + i);
    float bias_acc = 0.f;
    for (int64_t g = 0; g < n_groups; ++g) bias_acc += plane<kPlane>(bp, g) * y[g].s;
    out[i] = hsum(acc[i]) + bias_acc;
  }
}

template <DType kPlane, int G>
grouped::RowDots dots_for() {
  return {&dot_row<kPlane, G, 1>, &dot_row<kPlane, G, 2>, &dot_row<kPlane, G, 3>, &dot_row<kPlane, G, 4>,
          kInt4Rows4 ? &dot_rows4<kPlane, G> : nullptr};
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
