// Fast CPU kernels. Decode is bound by weight streaming, so the GEMV path reads each weight
// exactly once, straight from the (usually memory-mapped) checkpoint, four rows at a time so
// the FMA latency hides behind the loads. Prefill is bound by FMAs, so the GEMM path widens
// a few weight rows to f32 once into an L1-resident buffer and reuses them across every
// token in a register-blocked micro-kernel. Every AVX2 path has a scalar twin below for
// builds without AVX2/FMA; kernels_ref.cpp holds the ground truth both are tested against.
#include "backends/cpu/kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"

#if defined(__AVX2__) && defined(__FMA__)
#define TS_CPU_AVX2 1
#include <immintrin.h>
#else
#define TS_CPU_AVX2 0
#endif

namespace turbospark::cpu {
namespace {

// ---------------------------------------------------------------------------------------
// Scalar and vector element access, one specialisation per weight dtype.

template <DType D>
inline float load1(const uint8_t* row, int64_t i) {
  if constexpr (D == DType::F32) {
    float v;
    std::memcpy(&v, row + i * 4, 4);
    return v;
  } else {
    uint16_t h;
    std::memcpy(&h, row + i * 2, 2);
    if constexpr (D == DType::BF16) return bf16_to_f32(h);
    else return f16_to_f32(h);
  }
}

template <DType D>
constexpr int64_t kElemBytes = D == DType::F32 ? 4 : 2;

void check_weight_dtype(const WeightView& w, const char* op) {
  if (w.dtype != DType::F32 && w.dtype != DType::BF16 && w.dtype != DType::F16)
    fail("{}: unsupported weight dtype {} (cpu kernels take BF16, F16 or F32)", op,
         dtype_name(w.dtype));
}

#if TS_CPU_AVX2
// Eight consecutive weights widened to f32. BF16 is the top half of an f32, so widening is
// a zero-extend and a 16-bit shift.
template <DType D>
inline __m256 load8(const uint8_t* row, int64_t i) {
  if constexpr (D == DType::F32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row + i * 4));
  } else if constexpr (D == DType::BF16) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i * 2));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i * 2));
    return _mm256_cvtph_ps(h);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Keeps v in a register. Without it GCC folds every use of a loaded vector into its FMA as
// a memory operand, turning a 4x3 tile's 7 loads per step into 16, which made the tile
// load-port bound (measured: 2-core GEMM at T = 64 rose from ~60 to ~115 GFLOP/s).
inline void pin_register(__m256& v) {
#if defined(__GNUC__)
  __asm__("" : "+x"(v));
#endif
}

// {sum(a), sum(b), sum(c), sum(d)} in one register.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  __m256 ab = _mm256_hadd_ps(a, b);  // a01 a23 b01 b23 | a45 a67 b45 b67
  __m256 cd = _mm256_hadd_ps(c, d);
  __m256 abcd = _mm256_hadd_ps(ab, cd);  // a0-3 b0-3 c0-3 d0-3 | a4-7 b4-7 c4-7 d4-7
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

// exp(x) for float32 lanes: Cephes' range reduction and degree-6 polynomial, within about
// 2 ulp of expf over the range softmax and silu use. Inputs below -87.3 (where expf is
// denormal) return 0; inputs above 88 saturate at exp(88) instead of overflowing.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#endif

// ---------------------------------------------------------------------------------------
// dot_row

template <DType D>
float dot_row_impl(const WeightView& w, int64_t row, const float* x) {
  const uint8_t* p = w.row(row);
  const int64_t n = w.cols;
  int64_t i = 0;
  float acc = 0.f;
#if TS_CPU_AVX2
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    a0 = _mm256_fmadd_ps(load8<D>(p, i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load8<D>(p, i + 8), _mm256_loadu_ps(x + i + 8), a1);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8<D>(p, i), _mm256_loadu_ps(x + i), a0);
  acc = hsum(_mm256_add_ps(a0, a1));
#endif
  for (; i < n; ++i) acc += load1<D>(p, i) * x[i];
  return acc;
}

// ---------------------------------------------------------------------------------------
// matmul. The unit of work is a tile: up to kRowTile weight rows times up to kTokenTile
// activation rows, 12 vector accumulators, reduced along K, reading the weights in place
// (widened to f32 in registers). Decode reads each weight byte from DRAM exactly once; for
// longer batches a 4-row tile (8 KiB at K = 1024) stays in L1 while every token block
// passes over it. Widening a tile once into an f32 buffer and reusing it was measured slower
// for T = 4..64 (2.5x at T = 4, where the K-chunked buffer broke the weight stream) and no
// faster at T = 256: the conversion hides beside the FMAs.

constexpr int kRowTile = 4;    // weight rows per tile
constexpr int kTokenTile = 3;  // activation rows per tile (4 x 3 = 12 accumulators)
// Activation rows per pass over a thread's weight rows. It bounds the x working set
// ([128, K] f32: 1.5 MiB at K = 3072, L3-resident) for long prefill chunks; measured no
// different from unblocked at T <= 256.
constexpr int64_t kTokenBlock = 128;

// y[t * ldy + out[j]] = sum_{i < n} w_j[i] * x[t * ldx + i] for j < MR, t < NT, where w_j
// is the weight row at rows[j] (dtype D).
template <DType D, int MR, int NT>
void tile_kernel(const uint8_t* const* rows, int64_t n, const float* x, int64_t ldx, float* y,
                 int64_t ldy, const int64_t* out) {
  float sums[NT][MR];
  int64_t i = 0;
#if TS_CPU_AVX2
  __m256 acc[NT][MR];
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < MR; ++j) acc[t][j] = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 xv[NT];
    for (int t = 0; t < NT; ++t) {
      xv[t] = _mm256_loadu_ps(x + t * ldx + i);
      pin_register(xv[t]);
    }
    for (int j = 0; j < MR; ++j) {
      __m256 wv = load8<D>(rows[j], i);
      pin_register(wv);
      for (int t = 0; t < NT; ++t) acc[t][j] = _mm256_fmadd_ps(wv, xv[t], acc[t][j]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    if constexpr (MR == 4) {
      _mm_storeu_ps(sums[t], hsum4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]));
    } else {
      for (int j = 0; j < MR; ++j) sums[t][j] = hsum(acc[t][j]);
    }
  }
#else
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < MR; ++j) sums[t][j] = 0.f;
#endif
  for (; i < n; ++i)
    for (int j = 0; j < MR; ++j) {
      const float wv = load1<D>(rows[j], i);
      for (int t = 0; t < NT; ++t) sums[t][j] += wv * x[t * ldx + i];
    }
  for (int t = 0; t < NT; ++t)
    for (int j = 0; j < MR; ++j) y[t * ldy + out[j]] = sums[t][j];
}

// One row tile (MR rows) over activation rows [t0, t1), kTokenTile at a time.
template <DType D, int MR>
void tile_over_tokens(const uint8_t* const* rows, const int64_t* out, const Mat& x, const Mat& y,
                      int64_t t0, int64_t t1) {
  int64_t t = t0;
  for (; t + kTokenTile <= t1; t += kTokenTile)
    tile_kernel<D, MR, kTokenTile>(rows, x.cols, x.row(t), x.stride, y.row(t), y.stride, out);
  if (t1 - t == 2) tile_kernel<D, MR, 2>(rows, x.cols, x.row(t), x.stride, y.row(t), y.stride, out);
  if (t1 - t == 1) tile_kernel<D, MR, 1>(rows, x.cols, x.row(t), x.stride, y.row(t), y.stride, out);
}

// Visits the weight rows [b, e) as tiles of up to kRowTile rows: fn(const int64_t* rows, nr).
// A full tile takes one row from each quarter of the range, so a thread reads four long
// sequential streams. Four adjacent rows would be four streams too, but each only one row
// long (2 KiB at K = 1024), too short for the hardware prefetcher to ramp up: measured on
// Zen 3 at K = 1024, adjacent rows streamed at ~60% of DRAM bandwidth, quarters at ~90%.
template <typename Fn>
void for_each_row_tile(int64_t b, int64_t e, Fn&& fn) {
  const int64_t q = (e - b) / kRowTile;
  int64_t rows[kRowTile];
  for (int64_t j = 0; j < q; ++j) {
    for (int s = 0; s < kRowTile; ++s) rows[s] = b + s * q + j;
    fn(rows, kRowTile);
  }
  const int64_t rest = (e - b) - q * kRowTile;
  for (int s = 0; s < rest; ++s) rows[s] = b + q * kRowTile + s;
  if (rest > 0) fn(rows, int(rest));
}

template <DType D>
void matmul_rows(const WeightView& w, const Mat& x, const Mat& y, int64_t b, int64_t e) {
  for (int64_t t0 = 0; t0 < x.rows; t0 += kTokenBlock) {
    const int64_t t1 = std::min(x.rows, t0 + kTokenBlock);
    for_each_row_tile(b, e, [&](const int64_t* out, int nr) {
      const uint8_t* rows[kRowTile];
      for (int j = 0; j < nr; ++j) rows[j] = w.row(out[j]);
      switch (nr) {
        case 4: tile_over_tokens<D, 4>(rows, out, x, y, t0, t1); break;
        case 3: tile_over_tokens<D, 3>(rows, out, x, y, t0, t1); break;
        case 2: tile_over_tokens<D, 2>(rows, out, x, y, t0, t1); break;
        default: tile_over_tokens<D, 1>(rows, out, x, y, t0, t1); break;
      }
    });
  }
}

template <DType D>
void matmul_typed(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y) {
  // Contiguous row ranges per thread keep each thread's weight streams sequential; the grain
  // keeps the per-thread quarters long and the tiles full.
  pool.parallel_for(w.rows, 32, [&](int64_t b, int64_t e) { matmul_rows<D>(w, x, y, b, e); });
}

// ---------------------------------------------------------------------------------------
// Attention helpers

// dot(a, b) over n floats.
inline float dot_f32(const float* a, const float* b, int n) {
  int i = 0;
  float s = 0.f;
#if TS_CPU_AVX2
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = hsum(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// acc[:] += p * v[:] over n floats.
inline void axpy_f32(float* acc, float p, const float* v, int n) {
  int i = 0;
#if TS_CPU_AVX2
  __m256 pv = _mm256_set1_ps(p);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + i), _mm256_loadu_ps(acc + i)));
#endif
  for (; i < n; ++i) acc[i] += p * v[i];
}

// In place: s[i] = exp(s[i] - m); returns the sum.
float exp_shift_sum(float* s, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if TS_CPU_AVX2
  __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  return sum;
}

// One (query row, head) pair: out_h = softmax(q_h . K^T * scale [+ sink]) V over the
// positions [lo, pos]. scores and acc are per-thread scratch.
void attend_one(const float* qh, int64_t lo, int64_t pos, const KvView& kv, int g, float scale,
                const float* sink, float* out_h, std::vector<float>& scores, std::vector<float>& acc) {
  const int hd = kv.head_dim;
  const int64_t n = pos - lo + 1;
  if (int64_t(scores.size()) < n) scores.resize(size_t(n));
  const int64_t row_stride = int64_t(kv.n_kv_heads) * hd;
  const int64_t head_off = int64_t(g) * hd;
  float max_score = sink ? *sink : -INFINITY;

  // Pass 1: scores, walking the block table one block at a time; within a block the rows
  // are row_stride apart, so four positions go together and share one horizontal reduction.
  for (int64_t p = lo; p <= pos;) {
    const int64_t blk = p / kv.block_size;
    const int64_t in_blk = p % kv.block_size;
    const int64_t cnt = std::min<int64_t>(kv.block_size - in_blk, pos - p + 1);
    const float* k = kv.k_blocks[kv.block_table[blk]] + in_blk * row_stride + head_off;
    float* s = scores.data() + (p - lo);
    int64_t j = 0;
#if TS_CPU_AVX2
    if (hd % 8 == 0) {
      const __m256 sv = _mm256_set1_ps(scale);
      for (; j + 4 <= cnt; j += 4) {
        const float* k0 = k + j * row_stride;
        const float* k1 = k0 + row_stride;
        const float* k2 = k1 + row_stride;
        const float* k3 = k2 + row_stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
        __m256 a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (int i = 0; i < hd; i += 8) {
          __m256 qv = _mm256_loadu_ps(qh + i);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + i), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k1 + i), a1);
          a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k2 + i), a2);
          a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k3 + i), a3);
        }
        __m128 sc = _mm_mul_ps(hsum4(a0, a1, a2, a3), _mm256_castps256_ps128(sv));
        _mm_storeu_ps(s + j, sc);
      }
    }
#endif
    for (; j < cnt; ++j) s[j] = dot_f32(qh, k + j * row_stride, hd) * scale;
    for (int64_t i = 0; i < cnt; ++i) max_score = std::max(max_score, s[i]);
    p += cnt;
  }

  // Pass 2: probabilities (unnormalised) and their sum, then the weighted sum of V.
  float denom = exp_shift_sum(scores.data(), n, max_score);
  if (sink) denom += std::exp(*sink - max_score);
  if (int64_t(acc.size()) < hd) acc.resize(size_t(hd));
  std::fill(acc.begin(), acc.begin() + hd, 0.f);
  for (int64_t p = lo; p <= pos;) {
    const int64_t blk = p / kv.block_size;
    const int64_t in_blk = p % kv.block_size;
    const int64_t cnt = std::min<int64_t>(kv.block_size - in_blk, pos - p + 1);
    const float* v = kv.v_blocks[kv.block_table[blk]] + in_blk * row_stride + head_off;
    const float* pr = scores.data() + (p - lo);
    for (int64_t j = 0; j < cnt; ++j) axpy_f32(acc.data(), pr[j], v + j * row_stride, hd);
    p += cnt;
  }
  const float inv = 1.f / denom;
  for (int i = 0; i < hd; ++i) out_h[i] = acc[size_t(i)] * inv;
}

}  // namespace

// -----------------------------------------------------------------------------------------
// Public kernels

float dot_row(const WeightView& w, int64_t row, const float* x) {
  switch (w.dtype) {
    case DType::BF16: return dot_row_impl<DType::BF16>(w, row, x);
    case DType::F16: return dot_row_impl<DType::F16>(w, row, x);
    case DType::F32: return dot_row_impl<DType::F32>(w, row, x);
    default: check_weight_dtype(w, "dot_row"); return 0.f;
  }
}

void matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y) {
  TS_CHECK(x.cols == w.cols && y.cols == w.rows && y.rows == x.rows,
           "matmul: shape mismatch w [{}, {}] x [{}, {}] y [{}, {}]", w.rows, w.cols, x.rows,
           x.cols, y.rows, y.cols);
  if (x.rows == 0 || w.rows == 0) return;
  switch (w.dtype) {
    case DType::BF16: matmul_typed<DType::BF16>(pool, w, x, y); break;
    case DType::F16: matmul_typed<DType::F16>(pool, w, x, y); break;
    case DType::F32: matmul_typed<DType::F32>(pool, w, x, y); break;
    default: check_weight_dtype(w, "matmul");
  }
}

void rmsnorm(const Mat& x, const float* weight, float eps, const Mat& y, float weight_offset) {
  const int64_t n = x.cols;
  for (int64_t t = 0; t < x.rows; ++t) {
    const float* xr = x.row(t);
    float* yr = y.row(t);
    int64_t i = 0;
    float sum_sq = 0.f;
#if TS_CPU_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      __m256 v0 = _mm256_loadu_ps(xr + i), v1 = _mm256_loadu_ps(xr + i + 8);
      a0 = _mm256_fmadd_ps(v0, v0, a0);
      a1 = _mm256_fmadd_ps(v1, v1, a1);
    }
    for (; i + 8 <= n; i += 8) {
      __m256 v0 = _mm256_loadu_ps(xr + i);
      a0 = _mm256_fmadd_ps(v0, v0, a0);
    }
    sum_sq = hsum(_mm256_add_ps(a0, a1));
#endif
    for (; i < n; ++i) sum_sq += xr[i] * xr[i];
    const float inv_rms = 1.f / std::sqrt(sum_sq / float(n) + eps);
    i = 0;
#if TS_CPU_AVX2
    const __m256 rv = _mm256_set1_ps(inv_rms), ov = _mm256_set1_ps(weight_offset);
    for (; i + 8 <= n; i += 8) {
      __m256 wv = _mm256_add_ps(_mm256_loadu_ps(weight + i), ov);
      _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), rv), wv));
    }
#endif
    for (; i < n; ++i) yr[i] = (xr[i] * inv_rms) * (weight[i] + weight_offset);
  }
}

void rope_neox(const Mat& x, int n_heads, int head_dim, int rotary_dim, const int64_t* positions,
               const float* inv_freq, float attention_factor) {
  TS_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim && int64_t(n_heads) * head_dim <= x.cols,
           "rope: bad shape (heads {}, head_dim {}, rotary_dim {}, cols {})", n_heads, head_dim,
           rotary_dim, x.cols);
  const int half = rotary_dim / 2;
  // cos/sin depend only on (row, i): computed once per row, shared by every head.
  thread_local std::vector<float> cos_sin;
  cos_sin.resize(size_t(2 * half));
  float* cs = cos_sin.data();
  float* sn = cs + half;
  for (int64_t t = 0; t < x.rows; ++t) {
    const float pos = float(positions[t]);
    for (int i = 0; i < half; ++i) {
      const float angle = pos * inv_freq[i];
      cs[i] = std::cos(angle) * attention_factor;
      sn[i] = std::sin(angle) * attention_factor;
    }
    for (int h = 0; h < n_heads; ++h) {
      float* v1 = x.row(t) + int64_t(h) * head_dim;
      float* v2 = v1 + half;
      int i = 0;
#if TS_CPU_AVX2
      for (; i + 8 <= half; i += 8) {
        __m256 a = _mm256_loadu_ps(v1 + i), b = _mm256_loadu_ps(v2 + i);
        __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(sn + i);
        _mm256_storeu_ps(v1 + i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
        _mm256_storeu_ps(v2 + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
      }
#endif
      for (; i < half; ++i) {
        const float a = v1[i], b = v2[i];
        v1[i] = a * cs[i] - b * sn[i];
        v2[i] = b * cs[i] + a * sn[i];
      }
    }
  }
}

void attention(ThreadPool& pool, const Mat& q, const int64_t* q_positions, const KvView& kv,
               int n_heads, float scale, int window, const float* sinks, const Mat& out) {
  TS_CHECK(kv.n_kv_heads > 0 && n_heads % kv.n_kv_heads == 0,
           "attention: {} heads not a multiple of {} kv heads", n_heads, kv.n_kv_heads);
  TS_CHECK(q.cols >= int64_t(n_heads) * kv.head_dim && out.cols >= int64_t(n_heads) * kv.head_dim,
           "attention: q/out have {}/{} columns, need {}", q.cols, out.cols,
           n_heads * kv.head_dim);
  const int group = n_heads / kv.n_kv_heads;
  const int64_t units = q.rows * n_heads;
  // Rows of a prefill chunk attend to different numbers of positions (causal), so units are
  // handed out dynamically rather than in fixed contiguous ranges. Consecutive units are
  // heads of one row: heads of a GQA group then run close together and share cached K/V.
  std::atomic<int64_t> next{0};
  pool.run([&](int, int) {
    thread_local std::vector<float> scores, acc;
    for (;;) {
      const int64_t u = next.fetch_add(1, std::memory_order_relaxed);
      if (u >= units) break;
      const int64_t t = u / n_heads;
      const int h = int(u % n_heads);
      const int64_t pos = q_positions[t];
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      attend_one(q.row(t) + int64_t(h) * kv.head_dim, lo, pos, kv, h / group, scale,
                 sinks ? sinks + h : nullptr, out.row(t) + int64_t(h) * kv.head_dim, scores, acc);
    }
  });
}

void swiglu(const Mat& gate, const Mat& up, const Mat& out) {
  const int64_t n = gate.cols;
  for (int64_t t = 0; t < gate.rows; ++t) {
    const float* g = gate.row(t);
    const float* u = up.row(t);
    float* o = out.row(t);
    int64_t i = 0;
#if TS_CPU_AVX2
    const __m256 one = _mm256_set1_ps(1.f);
    for (; i + 8 <= n; i += 8) {
      __m256 gv = _mm256_loadu_ps(g + i);
      __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
      __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, e));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
    }
#endif
    for (; i < n; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
  }
}

void embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out) {
  check_weight_dtype(table, "embedding");
  TS_CHECK(out.cols == table.cols && out.rows >= n, "embedding: out [{}, {}] for {} ids of dim {}",
           out.rows, out.cols, n, table.cols);
  const int64_t dim = table.cols;
  for (int64_t t = 0; t < n; ++t) {
    TS_CHECK(ids[t] >= 0 && ids[t] < table.rows, "embedding: token id {} outside vocabulary of {}",
             ids[t], table.rows);
    const uint8_t* p = table.row(ids[t]);
    float* o = out.row(t);
    auto widen = [&]<DType D>() {
      int64_t i = 0;
#if TS_CPU_AVX2
      const __m256 sv = _mm256_set1_ps(scale);
      for (; i + 8 <= dim; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(load8<D>(p, i), sv));
#endif
      for (; i < dim; ++i) o[i] = load1<D>(p, i) * scale;
    };
    switch (table.dtype) {
      case DType::BF16: widen.template operator()<DType::BF16>(); break;
      case DType::F16: widen.template operator()<DType::F16>(); break;
      default: widen.template operator()<DType::F32>(); break;
    }
  }
}

void router_softmax_topk(const Mat& logits, int k, bool renormalize, int32_t* idx, float* weight) {
  const int64_t n = logits.cols;
  TS_CHECK(k >= 1 && k <= n, "router: top-k {} with {} experts", k, n);
  thread_local std::vector<float> prob;
  prob.resize(size_t(n));
  for (int64_t t = 0; t < logits.rows; ++t) {
    const float* l = logits.row(t);
    float m = l[0];
    for (int64_t e = 1; e < n; ++e) m = std::max(m, l[e]);
    float sum = 0.f;
    for (int64_t e = 0; e < n; ++e) {
      prob[size_t(e)] = std::exp(l[e] - m);
      sum += prob[size_t(e)];
    }
    const float inv = 1.f / sum;
    // Insertion into a sorted list of k (k is small: 1..10): strict > keeps the earlier,
    // lower-indexed expert ahead on ties.
    int32_t* ti = idx + t * k;
    float* tw = weight + t * k;
    int filled = 0;
    for (int64_t e = 0; e < n; ++e) {
      const float pe = prob[size_t(e)] * inv;
      if (filled == k && !(pe > tw[k - 1])) continue;
      int j = filled < k ? filled++ : k - 1;
      while (j > 0 && pe > tw[j - 1]) {
        tw[j] = tw[j - 1];
        ti[j] = ti[j - 1];
        --j;
      }
      tw[j] = pe;
      ti[j] = int32_t(e);
    }
    if (renormalize) {
      float picked = 0.f;
      for (int j = 0; j < k; ++j) picked += tw[j];
      for (int j = 0; j < k; ++j) tw[j] /= picked;
    }
  }
}

void add_scaled(const Mat& y, const Mat& x, float alpha) {
  const int64_t n = y.cols;
  for (int64_t t = 0; t < y.rows; ++t) {
    float* yr = y.row(t);
    const float* xr = x.row(t);
    int64_t i = 0;
#if TS_CPU_AVX2
    const __m256 av = _mm256_set1_ps(alpha);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(yr + i, _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), av, _mm256_loadu_ps(yr + i)));
#endif
    for (; i < n; ++i) yr[i] += xr[i] * alpha;
  }
}

}  // namespace turbospark::cpu
