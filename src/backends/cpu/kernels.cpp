// Fast CPU kernels. matmul reads weights in place in every case, widening BF16/F16 to f32
// in registers: decode (one activation row) is bound by weight streaming and reads each
// weight byte from DRAM once, as four long sequential streams per thread; prefill reuses a
// 4-row weight tile from L1 across all tokens in a 4 x 3 register-blocked micro-kernel.
// attention reuses that micro-kernel for Q.K^T. Every AVX2 path has a scalar twin for
// builds without AVX2/FMA; kernels_ref.cpp holds the ground truth both are tested against.
#include "backends/cpu/kernels.h"
#include "backends/cpu/simd.h"

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

// One register's sum in hsum4's order, ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), so
// an output does not depend on how many rows shared its tile (attention's last tile of a
// block has 1-4 positions depending on the other rows of the call).
inline float hsum_like4(__m256 a) {
  const __m256 h = _mm256_hadd_ps(a, a);
  const __m256 h2 = _mm256_hadd_ps(h, h);
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h2), _mm256_extractf128_ps(h2, 1)));
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
      for (int j = 0; j < MR; ++j) sums[t][j] = hsum_like4(acc[t][j]);
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
// Attention. A work unit is a block of query rows (all heads) times a chunk of cached
// positions. Within a unit, positions go in blocks of kPosBlock: the block's K and V rows
// ([n_kv_heads, head_dim] each, contiguous) serve every head, and every K/V vector loaded
// serves all the queries of its group (rows x heads per KV head) - the reuse that lets
// prefill run at FMA speed rather than memory speed. An online softmax (running max and
// denominator per query, output rescaled when the max grows) keeps scratch small whatever
// the context. Q.K^T is the matmul tile kernel (positions as weight rows, queries as
// activation rows); P.V is a broadcast tile over output dims.
//
// A query's result does not depend on the other rows of the call or on the thread count
// (serving batches one request's decode row with other requests' prompt chunks, and its
// tokens must not move): its positions are cut at fixed absolute boundaries, splits of
// kSplit positions and, inside a split, online-softmax blocks of kPosBlock; each split's
// partial softmax state starts empty, and the splits' states are merged in position order.
// Decode has one row, so its splits run on different threads; a prompt chunk's units walk
// their splits in order themselves. Both merge the same partial states the same way.

constexpr int kPosBlock = 32;  // positions per online-softmax step, aligned to multiples
// Target rows x heads per KV head in one unit: each K/V vector loaded serves this many
// queries. 24 measured faster than 12 at 4K context (less K/V traffic per FLOP); the unit's
// scratch (queries and outputs, 2 x 96 KiB at 16 heads x 128 dims) still fits L2.
constexpr int kGroupQueriesPerUnit = 24;
constexpr int64_t kSplit = 256;  // positions per split (a multiple of kPosBlock), the unit of decode parallelism

// In place: s[i] = exp(s[i] - m); returns the sum.
float exp_shift_sum(float* s, int64_t n, float m) {
  int64_t i = 0;
  float sum = 0.f;
#if TS_CPU_AVX2
  const __m256 mv = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
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

// o[q * ldo + d] += sum_{j < np} p[q * ldp + j] * v[j][d] for q < NQ and the NV * 8 dims
// from d0: NQ x NV accumulators, one V load per 8 dims shared by NQ queries.
template <int NQ, int NV>
void pv_tile(const float* const* v, int np, const float* p, int64_t ldp, float* o, int64_t ldo,
             int d0) {
#if TS_CPU_AVX2
  __m256 acc[NQ][NV];
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NV; ++c) acc[q][c] = _mm256_loadu_ps(o + q * ldo + d0 + 8 * c);
  for (int j = 0; j < np; ++j) {
    // Registers: NQ x NV accumulators + NQ probabilities + one V vector = 16 at 3 x 4.
    __m256 pq[NQ];
    for (int q = 0; q < NQ; ++q) pq[q] = _mm256_broadcast_ss(p + q * ldp + j);
    for (int c = 0; c < NV; ++c) {
      __m256 vv = _mm256_loadu_ps(v[j] + d0 + 8 * c);
      pin_register(vv);
      for (int q = 0; q < NQ; ++q) acc[q][c] = _mm256_fmadd_ps(pq[q], vv, acc[q][c]);
    }
  }
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(o + q * ldo + d0 + 8 * c, acc[q][c]);
#else
  for (int q = 0; q < NQ; ++q)
    for (int j = 0; j < np; ++j)
      for (int d = d0; d < d0 + 8 * NV; ++d) o[q * ldo + d] += p[q * ldp + j] * v[j][d];
#endif
}

template <int NQ>
void pv_queries(const float* const* v, int np, const float* p, int64_t ldp, float* o, int64_t ldo,
                int hd) {
  int d = 0;
  for (; d + 32 <= hd; d += 32) pv_tile<NQ, 4>(v, np, p, ldp, o, ldo, d);
  for (; d + 8 <= hd; d += 8) pv_tile<NQ, 1>(v, np, p, ldp, o, ldo, d);
  for (; d < hd; ++d)
    for (int q = 0; q < NQ; ++q) {
      float a = o[q * ldo + d];
      for (int j = 0; j < np; ++j) a += p[q * ldp + j] * v[j][d];
      o[q * ldo + d] = a;
    }
}

// Per-thread scratch for one work unit; sized on first use and then reused.
struct AttentionScratch {
  std::vector<float> q;    // [n_queries, head_dim] the unit's queries, gathered by KV head
  std::vector<float> s;    // [queries per KV head, kPosBlock] scores, then probabilities
  std::vector<int64_t> lo, hi;  // [rows] attended positions [lo, hi] of each row
  std::vector<int64_t> column;  // [kPosBlock] 0, 1, 2, ...: score columns for the tile kernel
  std::vector<const uint8_t*> k_rows;  // [kPosBlock] one KV head's K vector per position
  std::vector<const float*> v_rows;    // [kPosBlock] and its V vector
  std::vector<const float*> k_base, v_base;  // [kPosBlock] start of each position's row
  std::vector<float> state;  // a walking unit's running and per-split SoftmaxStates
};

// Running softmax state of a unit's queries, stored where attention() wants it: queries are
// numbered g * (rows * group) + r * group + j for head g * group + j of row r.
struct SoftmaxState {
  float* m;  // [n_queries] running max (starts at the sink logit, or -inf)
  float* l;  // [n_queries] running denominator, sink excluded
  float* o;  // [n_queries, head_dim] running unnormalised output
};

struct AttentionArgs {
  const Mat& q;
  const int64_t* q_positions;
  const KvView& kv;
  int n_heads;
  float scale;
  int window;
  const float* sinks;
};

// Query rows [t0, t1), all heads, over cached positions [c0, c1] (each row further limited
// to its own causal window). Leaves the unnormalised state in st.
void attend_unit(const AttentionArgs& a, int64_t t0, int64_t t1, int64_t c0, int64_t c1,
                 const SoftmaxState& st, AttentionScratch& sc) {
  const int hd = a.kv.head_dim;
  const int n_kv = a.kv.n_kv_heads;
  const int group = a.n_heads / n_kv;
  const int rows = int(t1 - t0);
  const int gq = rows * group;  // queries per KV head
  const int nq = gq * n_kv;
  sc.q.resize(size_t(nq) * hd);
  sc.s.resize(size_t(gq) * kPosBlock);
  sc.lo.resize(size_t(rows));
  sc.hi.resize(size_t(rows));
  if (sc.column.size() != size_t(kPosBlock)) {
    sc.column.resize(size_t(kPosBlock));
    for (int j = 0; j < kPosBlock; ++j) sc.column[size_t(j)] = j;
  }
  sc.k_rows.resize(size_t(kPosBlock));
  sc.v_rows.resize(size_t(kPosBlock));
  sc.k_base.resize(size_t(kPosBlock));
  sc.v_base.resize(size_t(kPosBlock));

  for (int r = 0; r < rows; ++r) {
    const int64_t pos = a.q_positions[t0 + r];
    sc.lo[size_t(r)] = std::max(c0, a.window > 0 ? std::max<int64_t>(0, pos - a.window + 1) : 0);
    sc.hi[size_t(r)] = std::min(c1, pos);
    for (int h = 0; h < a.n_heads; ++h) {
      const size_t qi = size_t((h / group) * gq + r * group + h % group);
      std::memcpy(sc.q.data() + qi * hd, a.q.row(t0 + r) + int64_t(h) * hd, size_t(hd) * 4);
      st.m[qi] = -INFINITY;
      st.l[qi] = 0.f;
    }
  }
  std::fill(st.o, st.o + size_t(nq) * hd, 0.f);
  int64_t first = INT64_MAX, last = -1;
  for (int r = 0; r < rows; ++r) {
    if (sc.lo[size_t(r)] > sc.hi[size_t(r)]) continue;
    first = std::min(first, sc.lo[size_t(r)]);
    last = std::max(last, sc.hi[size_t(r)]);
  }

  const int64_t row_stride = int64_t(n_kv) * hd;
  auto row_of = [&](int64_t p, float* pool) {
    return pool + int64_t(a.kv.block_table[p / a.kv.block_size]) * a.kv.block_floats() +
           (p % a.kv.block_size) * row_stride;
  };
  // Blocks aligned to absolute positions, whatever this unit's first row attends.
  for (int64_t b0 = first == INT64_MAX ? first : first - first % kPosBlock; b0 <= last; b0 += kPosBlock) {
    const int np = int(std::min<int64_t>(kPosBlock, last - b0 + 1));
    for (int j = 0; j < np; ++j) {
      sc.k_base[size_t(j)] = row_of(b0 + j, a.kv.k_f32());
      sc.v_base[size_t(j)] = row_of(b0 + j, a.kv.v_f32());
    }
#if TS_CPU_AVX2
    // One head's walk over positions is strided (head_dim floats out of every
    // [n_kv_heads, head_dim] row) and hardware prefetchers stop at page boundaries, so when
    // the unit is memory bound (decode: few queries per K/V vector) the next block's whole
    // rows - which the unit reads in full - are fetched explicitly.
    for (int64_t p = b0 + kPosBlock; gq <= 4 && p < std::min(last + 1, b0 + 2 * kPosBlock); ++p) {
      const char* kp = reinterpret_cast<const char*>(row_of(p, a.kv.k_f32()));
      const char* vp = reinterpret_cast<const char*>(row_of(p, a.kv.v_f32()));
      for (int64_t c = 0; c < row_stride * 4; c += 64) {
        _mm_prefetch(kp + c, _MM_HINT_T1);
        _mm_prefetch(vp + c, _MM_HINT_T1);
      }
    }
#endif
    for (int g = 0; g < n_kv; ++g) {
      for (int j = 0; j < np; ++j) {
        sc.k_rows[size_t(j)] = reinterpret_cast<const uint8_t*>(sc.k_base[size_t(j)] + g * hd);
        sc.v_rows[size_t(j)] = sc.v_base[size_t(j)] + g * hd;
      }
      // Scores of this KV head's queries x the block's positions, 4 x 3 per tile.
      const Mat qm(sc.q.data() + size_t(g) * gq * hd, gq, hd);
      const Mat sm(sc.s.data(), gq, kPosBlock);
      for (int j = 0; j < np; j += kRowTile) {
        const uint8_t* const* k = sc.k_rows.data() + j;
        const int64_t* col = sc.column.data() + j;
        switch (std::min(kRowTile, np - j)) {
          case 4: tile_over_tokens<DType::F32, 4>(k, col, qm, sm, 0, gq); break;
          case 3: tile_over_tokens<DType::F32, 3>(k, col, qm, sm, 0, gq); break;
          case 2: tile_over_tokens<DType::F32, 2>(k, col, qm, sm, 0, gq); break;
          default: tile_over_tokens<DType::F32, 1>(k, col, qm, sm, 0, gq); break;
        }
      }
      // Online softmax: each query's attended part of the block becomes probabilities
      // relative to its running max (rescaling what was accumulated); the rest becomes 0.
      for (int i = 0; i < gq; ++i) {
        const int r = i / group;
        const size_t qi = size_t(g * gq + i);
        float* s = sc.s.data() + size_t(i) * kPosBlock;
        const int j0 = int(std::max<int64_t>(sc.lo[size_t(r)] - b0, 0));
        const int j1 = int(std::min<int64_t>(sc.hi[size_t(r)] - b0, np - 1));  // inclusive
        if (j0 > j1) {
          std::fill(s, s + np, 0.f);
          continue;
        }
        float block_max = -INFINITY;
        for (int j = j0; j <= j1; ++j) {
          s[j] *= a.scale;
          block_max = std::max(block_max, s[j]);
        }
        const float m_old = st.m[qi];
        const float m_new = std::max(m_old, block_max);
        const float sum = exp_shift_sum(s + j0, j1 - j0 + 1, m_new);
        std::fill(s, s + j0, 0.f);
        std::fill(s + j1 + 1, s + np, 0.f);
        if (m_new != m_old) {
          const float alpha = std::exp(m_old - m_new);  // 0 while nothing was accumulated
          float* o = st.o + qi * hd;
          for (int d = 0; d < hd; ++d) o[d] *= alpha;
          st.l[qi] *= alpha;
        }
        st.l[qi] += sum;
        st.m[qi] = m_new;
      }
      // O += P V, 3 queries at a time.
      const float* const* v = sc.v_rows.data();
      float* o = st.o + size_t(g) * gq * hd;
      int i = 0;
      for (; i + 3 <= gq; i += 3)
        pv_queries<3>(v, np, sc.s.data() + size_t(i) * kPosBlock, kPosBlock, o + size_t(i) * hd, hd, hd);
      if (gq - i == 2)
        pv_queries<2>(v, np, sc.s.data() + size_t(i) * kPosBlock, kPosBlock, o + size_t(i) * hd, hd, hd);
      if (gq - i == 1)
        pv_queries<1>(v, np, sc.s.data() + size_t(i) * kPosBlock, kPosBlock, o + size_t(i) * hd, hd, hd);
    }
  }
}

// Merges a split's partial state (pm, pl, po) into the running one (m, l, o) of one query,
// splits taken in position order. An empty partial (it saw none of the query's positions)
// leaves the running state as it is; into an empty running state it is copied.
void merge_split(float& m, float& l, float* o, float pm, float pl, const float* po, int hd) {
  if (pm == -INFINITY) return;
  if (m == -INFINITY) {
    m = pm, l = pl;
    std::memcpy(o, po, size_t(hd) * 4);
    return;
  }
  const float mx = std::max(m, pm);
  const float w = std::exp(m - mx), pw = std::exp(pm - mx);
  l = l * w + pl * pw;
  for (int d = 0; d < hd; ++d) o[d] = o[d] * w + po[d] * pw;
  m = mx;
}

// Writes rows [t0, t0 + rows) of the output from their merged states: the sink joins the
// denominator, and the sum is normalised.
void finish_rows(const AttentionArgs& a, const Mat& out, int64_t t0, int rows, const SoftmaxState& st) {
  const int hd = a.kv.head_dim;
  const int group = a.n_heads / a.kv.n_kv_heads;
  const int gq = rows * group;
  for (int r = 0; r < rows; ++r) {
    for (int h = 0; h < a.n_heads; ++h) {
      const int64_t qi = (h / group) * gq + r * group + h % group;
      const float m = st.m[qi];
      float* dst = out.row(t0 + r) + int64_t(h) * hd;
      const float m_all = a.sinks ? std::max(m, a.sinks[h]) : m;
      const float w = m == -INFINITY ? 0.f : std::exp(m - m_all);
      const float denom = st.l[qi] * w + (a.sinks ? std::exp(a.sinks[h] - m_all) : 0.f);
      const float scale = w / denom;
      const float* o = st.o + qi * hd;
      for (int d = 0; d < hd; ++d) dst[d] = o[d] * scale;
    }
  }
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
  if (q.rows == 0) return;
  const int hd = kv.head_dim;
  const int group = n_heads / kv.n_kv_heads;
  const int64_t min_units = 2 * int64_t(pool.size());
  // Rows per unit: about kGroupQueriesPerUnit queries per KV head, fewer if that would
  // leave threads idle.
  const int64_t rows_per_unit = std::clamp<int64_t>(kGroupQueriesPerUnit / group, 1,
                                                    std::max<int64_t>(1, q.rows / min_units));
  const int64_t row_blocks = (q.rows + rows_per_unit - 1) / rows_per_unit;
  int64_t first = INT64_MAX, last = 0;
  for (int64_t t = 0; t < q.rows; ++t) {
    first = std::min(first, window > 0 ? std::max<int64_t>(0, q_positions[t] - window + 1) : 0);
    last = std::max(last, q_positions[t]);
  }
  const int64_t split0 = first / kSplit, n_splits = last / kSplit - split0 + 1;
  // Too few row blocks to occupy the threads (decode): every split is a unit of its own.
  const bool split_units = row_blocks < min_units && n_splits > 1;
  const int64_t units = split_units ? row_blocks * n_splits : row_blocks;
  const int64_t unit_queries = rows_per_unit * n_heads;
  const int64_t state_floats = unit_queries * (2 + hd);

  const AttentionArgs args{q, q_positions, kv, n_heads, scale, window, sinks};
  auto split_range = [&](int64_t k, int64_t* c0, int64_t* c1) {
    *c0 = std::max(first, (split0 + k) * kSplit);
    *c1 = std::min(last, (split0 + k) * kSplit + kSplit - 1);
  };
  auto state_at = [&](float* p) { return SoftmaxState{p, p + unit_queries, p + 2 * unit_queries}; };
  auto merge_states = [&](const SoftmaxState& run, const SoftmaxState& part, int64_t nq) {
    for (int64_t i = 0; i < nq; ++i) merge_split(run.m[i], run.l[i], run.o + i * hd, part.m[i], part.l[i], part.o + i * hd, hd);
  };
  // Split units' partial states, [units][state_floats], merged after all are done. Owned by
  // the calling thread; workers reach it through this pointer (naming a thread_local inside
  // the worker lambda would give each worker its own empty copy).
  thread_local std::vector<float> shared_states;
  shared_states.resize(split_units ? size_t(units * state_floats) : 0);
  float* const shared = shared_states.data();
  // Causal rows cost different amounts, so units are handed out dynamically.
  std::atomic<int64_t> next{0};
  pool.run([&](int, int) {
    thread_local AttentionScratch scratch;
    for (;;) {
      const int64_t u = next.fetch_add(1, std::memory_order_relaxed);
      if (u >= units) break;
      int64_t c0, c1;
      if (split_units) {
        const int64_t t0 = (u / n_splits) * rows_per_unit;
        split_range(u % n_splits, &c0, &c1);
        attend_unit(args, t0, std::min(q.rows, t0 + rows_per_unit), c0, c1, state_at(shared + u * state_floats), scratch);
        continue;
      }
      const int64_t t0 = u * rows_per_unit, t1 = std::min(q.rows, t0 + rows_per_unit);
      const int64_t nq = (t1 - t0) * n_heads;
      scratch.state.resize(size_t(2 * state_floats));
      const SoftmaxState run = state_at(scratch.state.data()), part = state_at(scratch.state.data() + state_floats);
      std::fill(run.m, run.m + nq, -INFINITY);
      std::fill(run.l, run.l + nq, 0.f);
      for (int64_t k = 0; k < n_splits; ++k) {
        split_range(k, &c0, &c1);
        attend_unit(args, t0, t1, c0, c1, part, scratch);
        merge_states(run, part, nq);
      }
      finish_rows(args, out, t0, int(t1 - t0), run);
    }
  });
  if (split_units) {
    // Merged in place into the first split's state (an empty running state takes the first
    // split as it is, so this is the walking units' arithmetic).
    for (int64_t rb = 0; rb < row_blocks; ++rb) {
      const int64_t t0 = rb * rows_per_unit, rows = std::min(q.rows, t0 + rows_per_unit) - t0;
      const SoftmaxState run = state_at(shared + rb * n_splits * state_floats);
      for (int64_t k = 1; k < n_splits; ++k) merge_states(run, state_at(shared + (rb * n_splits + k) * state_floats), rows * n_heads);
      finish_rows(args, out, t0, int(rows), run);
    }
  }
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

void clamped_swiglu(const Mat& gate, const Mat& up, float alpha, float limit, const Mat& out) {
  for (int64_t t = 0; t < gate.rows; ++t) {
    const float* g = gate.row(t);
    const float* u = up.row(t);
    float* o = out.row(t);
    for (int64_t i = 0; i < gate.cols; ++i) {
      const float gc = std::min(g[i], limit);
      const float uc = std::clamp(u[i], -limit, limit);
      const float glu = gc * (1.f / (1.f + std::exp(-(gc * alpha))));
      o[i] = (uc + 1.f) * glu;
    }
  }
}

void add_bias(const Mat& y, const float* bias) {
  for (int64_t r = 0; r < y.rows; ++r) {
    float* row = y.row(r);
    for (int64_t c = 0; c < y.cols; ++c) row[c] += bias[c];
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
