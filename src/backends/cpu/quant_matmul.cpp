// Quantized matmul for the CPU backend. Structure:
//   1. quantize each activation row once (BlockQ8x32 or BlockQ8_K; AVX2 here, bit-identical
//      to the reference quantizers in core/quant.cpp);
//   2. split output rows across the pool; each weight row is unpacked once per group of up
//      to kMaxTokens activation rows and dotted with all of them, so prefill reuses the
//      nibble unpacking and the scale decoding across tokens while decode streams each
//      weight byte exactly once, a thread's rows read as kDecodeStreams interleaved runs;
//   3. except for batches of kTiledMinTokens or more with a format that has a tiled kernel
//      (all but Q8_0), which go to quant_gemm.h (8 rows x 4 tokens per call).
// Every kernel is a template over the number of tokens NT (1..4) so the per-token
// accumulators stay in registers.
#include "backends/cpu/quant_matmul.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <type_traits>
#include <vector>

#include "backends/cpu/quant_contract.h"
#include "backends/cpu/quant_gemm.h"
#include "backends/cpu/simd.h"
#include "core/error.h"
#include "core/quant.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TS_QUANT_AVX2 1
#include <immintrin.h>
#else
#define TS_QUANT_AVX2 0
#endif

namespace turbospark::cpu {
namespace {

constexpr int kMaxTokens = 4;
// From this many tokens on, formats with a tiled kernel (quant_gemm.h) take it: packing a
// tile reads the weights once more and costs a few tokens' worth of its kernel, so it pays
// off only across a batch. Measured on the 2-core EPYC dev VM (one thread, CPU time, Qwen2.5
// 1.5B shapes): at 4-8 tokens the tiled path loses on ffn_gate Q4_K [8960 x 1536] and
// ffn_down Q6_K [1536 x 8960], at 12 it still loses on Q6_K, from 16 it wins on all (and by
// ~1.3-2x at 32-64, the prefill micro-batch).
constexpr int64_t kTiledMinTokens = 16;
// Decode reads a thread's rows as this many interleaved sequential streams: one stream per
// core leaves DRAM bandwidth unused (the prefetchers track several streams). Measured on
// the 2-core EPYC dev VM, paired A/B, Q4_K and Q8_0 [151936 x 1024] GEMV, 2 threads:
// 1 stream ~4.5-5.0 GB/s, 4 streams ~6.9-7.3 GB/s, 8 streams ~4.8 GB/s.
constexpr int64_t kDecodeStreams = 4;

inline float half_to_float(uint16_t h) {
#if TS_QUANT_AVX2
  return _cvtsh_ss(h);
#else
  return f16_to_f32(h);
#endif
}

// One weight row against NT quantized activation rows: out[t] = dot(w_row, x_t), where x_t
// starts at x + t * x_stride bytes. nb is the number of weight blocks in the row.
template <int NT>
using DotFn = void (*)(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t x_stride, float* out);

template <typename B>
inline const B* act(const uint8_t* x, int64_t x_stride, int t) {
  return reinterpret_cast<const B*>(x + t * x_stride);
}

// After a quantized activation row's nb blocks (act_row_bytes): each block's dy, then for
// BlockQ8x32 each block's sy, as floats, zero-padded to padded_blocks(nb) entries each.
inline int64_t padded_blocks(int64_t nb) { return (nb + 7) / 8 * 8; }
template <typename B>
inline float* act_side(B* blocks, int64_t nb) {
  return reinterpret_cast<float*>(blocks + nb);
}
template <typename B>
inline const float* act_side(const B* blocks, int64_t nb) {
  return reinterpret_cast<const float*>(blocks + nb);
}

// ---------------------------------------------------------------------------------------
// Scalar kernels: the reference integer arithmetic (and the fallback without AVX2).

namespace scalar {

template <int NT>
void dot_q4_0(int64_t nb, const uint8_t* wp, const uint8_t* x, int64_t xs, float* out) {
  const auto* w = reinterpret_cast<const BlockQ4_0*>(wp);
  for (int t = 0; t < NT; ++t) {
    const BlockQ8x32* y = act<BlockQ8x32>(x, xs, t);
    contract::LaneSums acc;
    for (int64_t b = 0; b < nb; ++b) {
      int sum = 0;
      for (int i = 0; i < 16; ++i)
        sum += (w[b].qs[i] & 0xF) * y[b].qs[i] + (w[b].qs[i] >> 4) * y[b].qs[i + 16];
      const float d = half_to_float(w[b].d);
      acc.add(b, contract::b32_term(d, y[b].d, sum, -8.f * d, y[b].s));
    }
    out[t] = acc.total();
  }
}

template <int NT>
void dot_q4_1(int64_t nb, const uint8_t* wp, const uint8_t* x, int64_t xs, float* out) {
  const auto* w = reinterpret_cast<const BlockQ4_1*>(wp);
  for (int t = 0; t < NT; ++t) {
    const BlockQ8x32* y = act<BlockQ8x32>(x, xs, t);
    contract::LaneSums acc;
    for (int64_t b = 0; b < nb; ++b) {
      int sum = 0;
      for (int i = 0; i < 16; ++i)
        sum += (w[b].qs[i] & 0xF) * y[b].qs[i] + (w[b].qs[i] >> 4) * y[b].qs[i + 16];
      acc.add(b, contract::b32_term(half_to_float(w[b].d), y[b].d, sum, half_to_float(w[b].m), y[b].s));
    }
    out[t] = acc.total();
  }
}

// Q5_0 (w = d * (q - 16)) and Q5_1 (w = d * q + m).
template <int NT, typename Block>
void dot_q5(int64_t nb, const uint8_t* wp, const uint8_t* x, int64_t xs, float* out) {
  const auto* w = reinterpret_cast<const Block*>(wp);
  for (int t = 0; t < NT; ++t) {
    const BlockQ8x32* y = act<BlockQ8x32>(x, xs, t);
    contract::LaneSums acc;
    for (int64_t b = 0; b < nb; ++b) {
      uint32_t qh;
      std::memcpy(&qh, w[b].qh, 4);
      int sum = 0;
      for (int i = 0; i < 16; ++i) {
        const int q0 = (w[b].qs[i] & 0xF) | int((qh >> i) & 1) << 4;
        const int q1 = (w[b].qs[i] >> 4) | int((qh >> (i + 16)) & 1) << 4;
        sum += q0 * y[b].qs[i] + q1 * y[b].qs[i + 16];
      }
      const float d = half_to_float(w[b].d);
      float offset;
      if constexpr (std::is_same_v<Block, BlockQ5_0>) offset = -16.f * d;
      else offset = half_to_float(w[b].m);
      acc.add(b, contract::b32_term(d, y[b].d, sum, offset, y[b].s));
    }
    out[t] = acc.total();
  }
}
template <int NT>
void dot_q5_0(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_q5<NT, BlockQ5_0>(nb, w, x, xs, out);
}
template <int NT>
void dot_q5_1(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_q5<NT, BlockQ5_1>(nb, w, x, xs, out);
}

template <int NT>
void dot_q8_0(int64_t nb, const uint8_t* wp, const uint8_t* x, int64_t xs, float* out) {
  const auto* w = reinterpret_cast<const BlockQ8_0*>(wp);
  for (int t = 0; t < NT; ++t) {
    const BlockQ8x32* y = act<BlockQ8x32>(x, xs, t);
    contract::LaneSums acc;
    for (int64_t b = 0; b < nb; ++b) {
      int sum = 0;
      for (int i = 0; i < 32; ++i) sum += w[b].qs[i] * y[b].qs[i];
      acc.add(b, contract::b32_term(half_to_float(w[b].d), y[b].d, sum, 0.f, y[b].s));
    }
    out[t] = acc.total();
  }
}

// Q4_K and Q5_K: the 5th bit plane is the only difference.
template <int NT, bool kFiveBit>
void dot_k4(int64_t nb, const uint8_t* wp, const uint8_t* x, int64_t xs, float* out) {
  for (int t = 0; t < NT; ++t) {
    const BlockQ8_K* y = act<BlockQ8_K>(x, xs, t);
    contract::LaneSums acc;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t *scales, *qs, *qh = nullptr;
      uint16_t d16, dmin16;
      if constexpr (kFiveBit) {
        const auto& w = reinterpret_cast<const BlockQ5_K*>(wp)[b];
        scales = w.scales, qs = w.qs, qh = w.qh, d16 = w.d, dmin16 = w.dmin;
      } else {
        const auto& w = reinterpret_cast<const BlockQ4_K*>(wp)[b];
        scales = w.scales, qs = w.qs, d16 = w.d, dmin16 = w.dmin;
      }
      uint8_t sc[8], m[8];
      quant::unpack_k4_scales(scales, sc, m);
      int sumi = 0, summ = 0;
      for (int j = 0; j < 4; ++j) {
        int s0 = 0, s1 = 0;
        for (int l = 0; l < 32; ++l) {
          int q0 = qs[32 * j + l] & 0xF, q1 = qs[32 * j + l] >> 4;
          if constexpr (kFiveBit) {
            q0 |= ((qh[l] >> (2 * j)) & 1) << 4;
            q1 |= ((qh[l] >> (2 * j + 1)) & 1) << 4;
          }
          s0 += q0 * y[b].qs[64 * j + l];
          s1 += q1 * y[b].qs[64 * j + 32 + l];
        }
        sumi += sc[2 * j] * s0 + sc[2 * j + 1] * s1;
      }
      for (int s = 0; s < 8; ++s) summ += m[s] * (y[b].bsums[2 * s] + y[b].bsums[2 * s + 1]);
      acc.add(b, contract::k4_term(half_to_float(d16), half_to_float(dmin16), y[b].d, sumi, summ));
    }
    out[t] = acc.total();
  }
}

template <int NT>
void dot_q4_k(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_k4<NT, false>(nb, w, x, xs, out);
}
template <int NT>
void dot_q5_k(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_k4<NT, true>(nb, w, x, xs, out);
}

template <int NT>
void dot_q6_k(int64_t nb, const uint8_t* wp, const uint8_t* x, int64_t xs, float* out) {
  const auto* w = reinterpret_cast<const BlockQ6_K*>(wp);
  for (int t = 0; t < NT; ++t) {
    const BlockQ8_K* y = act<BlockQ8_K>(x, xs, t);
    contract::LaneSums acc;
    for (int64_t b = 0; b < nb; ++b) {
      int sumi = 0;
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = w[b].ql + 64 * h;
        const uint8_t* qh = w[b].qh + 32 * h;
        const int8_t* q8 = y[b].qs + 128 * h;
        const int8_t* sc = w[b].scales + 8 * h;
        int s[8] = {};
        for (int l = 0; l < 32; ++l) {
          const int g = l / 16;
          s[g + 0] += ((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) * q8[l];
          s[g + 2] += ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) * q8[l + 32];
          s[g + 4] += ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) * q8[l + 64];
          s[g + 6] += ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) * q8[l + 96];
        }
        for (int k = 0; k < 8; ++k) sumi += sc[k] * (s[k] - 32 * y[b].bsums[8 * h + k]);
      }
      acc.add(b, contract::q6_term(half_to_float(w[b].d), y[b].d, sumi));
    }
    out[t] = acc.total();
  }
}

}  // namespace scalar

// ---------------------------------------------------------------------------------------
// AVX2 kernels

#if TS_QUANT_AVX2
namespace avx2 {

// 16 packed bytes -> 32 bytes in element order: low nibbles (elements 0-15), then high
// nibbles (16-31), each in [0, 16).
inline __m256i unpack_nibbles16(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// Sum of u8 * s8 products, in 8 int32 lanes (lane i: bytes 4i .. 4i + 3). |u8| <= 128 and s8
// in [-127, 127] keep the pairwise int16 sums of maddubs from saturating (2 * 128 * 127 <
// 32768), so AVX-512 VNNI's one-instruction form (no int16 step) gives the same lanes.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The 32-element formats share one loop, dot_block32; Block32<format> says how to get a
// block's 32 quants as bytes and how they meet the activations (the per-block offset, folded
// in through the activation sums BlockQ8x32::s, is dot_block32's). The loop is uop-bound
// (about 20 per 18-34 byte block), so the float work is done eight blocks at a time.
template <DType kType>
struct Block32;
// Q4_0: q in [0, 16) unsigned against the signed activations, offset -8 d.
template <>
struct Block32<DType::Q4_0> {
  using Block = BlockQ4_0;
  static __m256i quants(const Block& b) { return unpack_nibbles16(b.qs); }
  static __m256i dot(__m256i q, const int8_t* y) { return dot_u8s8(q, load256(y)); }
};
// Q4_1: as Q4_0, offset m.
template <>
struct Block32<DType::Q4_1> {
  using Block = BlockQ4_1;
  static __m256i quants(const Block& b) { return unpack_nibbles16(b.qs); }
  static __m256i dot(__m256i q, const int8_t* y) { return dot_u8s8(q, load256(y)); }
};

// Q5_0/Q5_1's 32 fifth bits (bit i of the u32 = element i) as 0x10 bytes in element order.
inline __m256i fifth_bits(const uint8_t* qh_bytes) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  // Byte i takes qh byte i / 8 (pshufb works per 128-bit lane; both lanes hold qh), then
  // tests its own bit i % 8.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(int(qh)), _mm256_setr_epi64x(0, 0x0101010101010101ll, 0x0202020202020202ll, 0x0303030303030303ll));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ull));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}
// Q5_0: q in [0, 32), offset -16 d.
template <>
struct Block32<DType::Q5_0> {
  using Block = BlockQ5_0;
  static __m256i quants(const Block& b) { return _mm256_or_si256(unpack_nibbles16(b.qs), fifth_bits(b.qh)); }
  static __m256i dot(__m256i q, const int8_t* y) { return dot_u8s8(q, load256(y)); }
};
// Q5_1: as Q5_0, offset m.
template <>
struct Block32<DType::Q5_1> {
  using Block = BlockQ5_1;
  static __m256i quants(const Block& b) { return _mm256_or_si256(unpack_nibbles16(b.qs), fifth_bits(b.qh)); }
  static __m256i dot(__m256i q, const int8_t* y) { return dot_u8s8(q, load256(y)); }
};
// Q8_0: maddubs wants one unsigned operand: |w| (a stored -128 becomes 128, still safe)
// against the activations with w's sign; no offset.
template <>
struct Block32<DType::Q8_0> {
  using Block = BlockQ8_0;
  static __m256i quants(const Block& b) { return load256(b.qs); }
  static __m256i dot(__m256i q, const int8_t* y) { return dot_u8s8(_mm256_sign_epi8(q, q), _mm256_sign_epi8(load256(y), q)); }
};

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
  return _mm_cvtsi128_si32(s);
}

// get(i) for the n <= 8 items of a group of blocks, lanes past n zero. Built in registers:
// eight scalar stores read back as one vector would stall on store forwarding. A short group
// reads its last item again for the missing lanes, then masks them.
inline int clamp8(int g, int n) { return g < n ? g : n - 1; }
inline __m256i lanes_below(int n) { return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
template <typename Get>
inline __m256 gather8_f16(int n, Get get) {
  const __m256 v = _mm256_cvtph_ps(_mm_setr_epi16(short(get(clamp8(0, n))), short(get(clamp8(1, n))), short(get(clamp8(2, n))),
                                                  short(get(clamp8(3, n))), short(get(clamp8(4, n))), short(get(clamp8(5, n))),
                                                  short(get(clamp8(6, n))), short(get(clamp8(7, n)))));
  return n == 8 ? v : _mm256_and_ps(v, _mm256_castsi256_ps(lanes_below(n)));
}
template <typename Get>
inline __m256i gather8_epi32(int n, Get get) {
  const __m256i v = _mm256_setr_epi32(int(get(clamp8(0, n))), int(get(clamp8(1, n))), int(get(clamp8(2, n))),
                                      int(get(clamp8(3, n))), int(get(clamp8(4, n))), int(get(clamp8(5, n))),
                                      int(get(clamp8(6, n))), int(get(clamp8(7, n))));
  return n == 8 ? v : _mm256_and_si256(v, lanes_below(n));
}

// The row kernels follow the accumulation contract (quant_contract.h) eight blocks at a
// time: each block's integer lanes are kept, the eight are reduced by one tree, and the
// eight per-block floats go to the eight lane sums in one vector add.
template <DType kType, int NT>
void dot_block32(int64_t nb, const uint8_t* wp, const uint8_t* x, int64_t xs, float* out) {
  using F = Block32<kType>;
  const auto* w = reinterpret_cast<const typename F::Block*>(wp);
  const BlockQ8x32* y[NT];
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) y[t] = act<BlockQ8x32>(x, xs, t), acc[t] = _mm256_setzero_ps();
  __m256i sums[NT][8];
  const int64_t padded = padded_blocks(nb);
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int n = int(std::min<int64_t>(8, nb - b0));
    const auto* wb = w + b0;
    for (int g = 0; g < n; ++g) {
      const __m256i q = F::quants(wb[g]);
      for (int t = 0; t < NT; ++t) sums[t][g] = F::dot(q, y[t][b0 + g].qs);
    }
    for (int g = n; g < 8; ++g)
      for (int t = 0; t < NT; ++t) sums[t][g] = _mm256_setzero_si256();
    const __m256 d = gather8_f16(n, [&](int g) { return wb[g].d; });
    __m256 offset;
    if constexpr (kType == DType::Q4_0) offset = _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    else if constexpr (kType == DType::Q5_0) offset = _mm256_mul_ps(d, _mm256_set1_ps(-16.f));
    else if constexpr (kType == DType::Q8_0) offset = _mm256_setzero_ps();
    else offset = gather8_f16(n, [&](int g) { return wb[g].m; });
    for (int t = 0; t < NT; ++t) {
      const float* side = act_side(y[t], nb);  // dy, then sy
      const __m256 dy = _mm256_loadu_ps(side + b0), sy = _mm256_loadu_ps(side + padded + b0);
      const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(contract::reduce8_epi32(sums[t])),
                                       _mm256_mul_ps(offset, sy));
      acc[t] = _mm256_add_ps(acc[t], v);
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
}

template <int NT>
void dot_q4_0(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_block32<DType::Q4_0, NT>(nb, w, x, xs, out);
}
template <int NT>
void dot_q4_1(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_block32<DType::Q4_1, NT>(nb, w, x, xs, out);
}
template <int NT>
void dot_q8_0(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_block32<DType::Q8_0, NT>(nb, w, x, xs, out);
}
template <int NT>
void dot_q5_0(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_block32<DType::Q5_0, NT>(nb, w, x, xs, out);
}
template <int NT>
void dot_q5_1(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_block32<DType::Q5_1, NT>(nb, w, x, xs, out);
}

// For sub-block s, a shuffle mask that broadcasts int16 element s of a 128-bit lane.
inline __m256i broadcast16_mask(int s) { return _mm256_set1_epi16(int16_t((2 * s) | (2 * s + 1) << 8)); }

template <int NT, bool kFiveBit>
void dot_k4(int64_t nb, const uint8_t* wp, const uint8_t* x, int64_t xs, float* out) {
  using Block = std::conditional_t<kFiveBit, BlockQ5_K, BlockQ4_K>;
  const auto* w = reinterpret_cast<const Block*>(wp);
  const BlockQ8_K* y[NT];
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) y[t] = act<BlockQ8_K>(x, xs, t), acc[t] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256i sums[NT][8];
  __m128i mins[NT][8];
  for (int64_t b0 = 0; b0 < nb; b0 += 8) {
    const int n = int(std::min<int64_t>(8, nb - b0));
    for (int g = 0; g < n; ++g) {
      const Block& blk = w[b0 + g];
      const BlockQ8_K* yb[NT];
      for (int t = 0; t < NT; ++t) yb[t] = &y[t][b0 + g];
      __m256i hbits = _mm256_setzero_si256();
      if constexpr (kFiveBit) hbits = load256(blk.qh);
      const __m128i sc_m = unpack_k4_scales(blk.scales);
      const __m256i sc16 = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sc_m));
      const __m128i m16 = _mm_cvtepu8_epi16(_mm_unpackhi_epi64(sc_m, sc_m));
      __m256i sumi[NT];
      for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256i q = load256(blk.qs + 32 * j);
        __m256i lo = _mm256_and_si256(q, low4);
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low4);
        if constexpr (kFiveBit) {
          // Bits 2j and 2j+1 of each qh byte are the 5th bits; hbits shifts right by 2 per
          // group, so they are always bits 0 and 1 here (16-bit shifts move bits across byte
          // boundaries only into bits this never reads).
          const __m256i bit4 = _mm256_set1_epi8(0x10);
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16(hbits, 4), bit4));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16(hbits, 3), bit4));
          hbits = _mm256_srli_epi16(hbits, 2);
        }
        const __m256i sc_lo = _mm256_shuffle_epi8(sc16, broadcast16_mask(2 * j));
        const __m256i sc_hi = _mm256_shuffle_epi8(sc16, broadcast16_mask(2 * j + 1));
        for (int t = 0; t < NT; ++t) {
          const __m256i p_lo = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, load256(yb[t]->qs + 64 * j)), sc_lo);
          const __m256i p_hi = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, load256(yb[t]->qs + 64 * j + 32)), sc_hi);
          sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(p_lo, p_hi));
        }
      }
      for (int t = 0; t < NT; ++t) {
        // Minimums meet the activation sums of each 32-element sub-block (pairs of bsums).
        const __m128i bs_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(yb[t]->bsums));
        const __m128i bs_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(yb[t]->bsums + 8));
        sums[t][g] = sumi[t];
        mins[t][g] = _mm_madd_epi16(m16, _mm_hadd_epi16(bs_lo, bs_hi));
      }
    }
    for (int g = n; g < 8; ++g)
      for (int t = 0; t < NT; ++t) sums[t][g] = _mm256_setzero_si256(), mins[t][g] = _mm_setzero_si128();
    __m256 d, dmin;
    const Block* wb = w + b0;
    contract::f16_pairs(gather8_epi32(n, [&](int g) {
                          static_assert(offsetof(Block, d) == 0 && offsetof(Block, dmin) == 2);
                          uint32_t pair;  // d, dmin
                          std::memcpy(&pair, &wb[g], 4);
                          return pair;
                        }),
                        &d, &dmin);
    for (int t = 0; t < NT; ++t) {
      const __m256 dy = _mm256_loadu_ps(act_side(y[t], nb) + b0);
      const __m256 m = _mm256_mul_ps(_mm256_mul_ps(dmin, dy), _mm256_cvtepi32_ps(contract::reduce8x4_epi32(mins[t])));
      acc[t] = _mm256_add_ps(acc[t], _mm256_fmsub_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(contract::reduce8_epi32(sums[t])), m));
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
}

template <int NT>
void dot_q4_k(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_k4<NT, false>(nb, w, x, xs, out);
}
template <int NT>
void dot_q5_k(int64_t nb, const uint8_t* w, const uint8_t* x, int64_t xs, float* out) {
  dot_k4<NT, true>(nb, w, x, xs, out);
}

// Masks that spread int16 scales {2c, 2c+1} of a 128-bit lane over [8 x 2c | 8 x 2c+1].
inline __m256i q6_scale_mask(int c) {
  const int16_t a = int16_t((4 * c) | (4 * c + 1) << 8), b = int16_t((4 * c + 2) | (4 * c + 3) << 8);
  return _mm256_set_epi16(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a);
}

template <int NT>
void dot_q6_k(int64_t nb, const uint8_t* wp, const uint8_t* x, int64_t xs, float* out) {
  const auto* w = reinterpret_cast<const BlockQ6_K*>(wp);
  const BlockQ8_K* y[NT];
  __m256 acc[NT];
  for (int t = 0; t < NT; ++t) y[t] = act<BlockQ8_K>(x, xs, t), acc[t] = _mm256_setzero_ps();
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i top2 = _mm256_set1_epi8(0x30);
  __m256i sums[NT][8];
  for (int64_t b = 0; b < nb; ++b) {
    const int g = int(b & 7);
    const __m128i sc8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w[b].scales));
    const __m256i sc_all = _mm256_cvtepi8_epi16(sc8);  // 16 int16 sub-block scales
    __m256i sumi[NT];
    for (int t = 0; t < NT; ++t) {
      // q - 32: the 32 * scale * (activation sum) part, from the 16-element bsums.
      const __m256i bs = load256(y[t][b].bsums);
      sumi[t] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_madd_epi16(sc_all, bs), 5));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(h == 0 ? sc8 : _mm_unpackhi_epi64(sc8, sc8)));
      const __m256i ql0 = load256(w[b].ql + 64 * h);
      const __m256i ql1 = load256(w[b].ql + 64 * h + 32);
      const __m256i qh = load256(w[b].qh + 32 * h);
      __m256i e[4];
      e[0] = _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2));
      e[1] = _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2));
      e[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, top2));
      e[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                             _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2));
      for (int c = 0; c < 4; ++c) {
        const __m256i scale = _mm256_shuffle_epi8(sc, q6_scale_mask(c));
        for (int t = 0; t < NT; ++t) {
          const __m256i p = _mm256_maddubs_epi16(e[c], load256(y[t][b].qs + 128 * h + 32 * c));
          sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p, scale));
        }
      }
    }
    for (int t = 0; t < NT; ++t) sums[t][g] = sumi[t];
    if (g == 7 || b == nb - 1) {  // a group of eight blocks (or the row's last, fewer) is done
      const int64_t b0 = b - g;
      const int n = g + 1;
      for (int k = n; k < 8; ++k)
        for (int t = 0; t < NT; ++t) sums[t][k] = _mm256_setzero_si256();
      const BlockQ6_K* wb = w + b0;
      const __m256 d = gather8_f16(n, [&](int k) { return wb[k].d; });
      for (int t = 0; t < NT; ++t) {
        const __m256 dy = _mm256_loadu_ps(act_side(y[t], nb) + b0);
        acc[t] = _mm256_add_ps(acc[t], _mm256_fmadd_ps(_mm256_mul_ps(d, dy),
                                                       _mm256_cvtepi32_ps(contract::reduce8_epi32(sums[t])), _mm256_setzero_ps()));
      }
    }
  }
  for (int t = 0; t < NT; ++t) out[t] = hsum(acc[t]);
}

// Activation quantizers, bit-identical to core/quant.cpp's: the same amax, the same d and
// 1/d, the same round-to-nearest-even of x * (1/d).
inline __m256 abs_ps(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), v); }

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// 32 floats -> 32 int8 (in order), returning the int32 lane sums of the quantized values.
inline __m256i quantize32(const float* x, float id, int8_t* q) {
  const __m256 vid = _mm256_set1_ps(id);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) {
    const __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), vid),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    i[k] = _mm256_max_epi32(_mm256_set1_epi32(-127), _mm256_min_epi32(_mm256_set1_epi32(127), _mm256_cvtps_epi32(v)));
  }
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
  // packs interleave 128-bit lanes; the permute restores element order.
  const __m256i p16a = _mm256_packs_epi32(i[0], i[1]);
  const __m256i p16b = _mm256_packs_epi32(i[2], i[3]);
  const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  return sum;
}

void quantize_row_q8x32(const float* x, BlockQ8x32* y, int64_t n) {
  for (int64_t b = 0; b < n / 32; ++b, x += 32) {
    __m256 m = abs_ps(_mm256_loadu_ps(x));
    for (int k = 1; k < 4; ++k) m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + 8 * k)));
    const float d = hmax(m) / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    const int sum = hsum_epi32(quantize32(x, id, y[b].qs));
    y[b].d = d;
    y[b].s = d * float(sum);
  }
}

void quantize_row_q8_K(const float* x, BlockQ8_K* y, int64_t n) {
  for (int64_t b = 0; b < n / 256; ++b, x += 256) {
    __m256 m = abs_ps(_mm256_loadu_ps(x));
    for (int k = 1; k < 32; ++k) m = _mm256_max_ps(m, abs_ps(_mm256_loadu_ps(x + 8 * k)));
    const float d = hmax(m) / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    for (int c = 0; c < 8; ++c) quantize32(x + 32 * c, id, y[b].qs + 32 * c);
    // bsums from the stored int8 values: widen each 16 to int16 and add horizontally.
    for (int g = 0; g < 16; ++g) {
      const __m256i v = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(y[b].qs + 16 * g)));
      y[b].bsums[g] = int16_t(hsum_epi32(_mm256_madd_epi16(v, _mm256_set1_epi16(1))));
    }
    y[b].d = d;
  }
}

}  // namespace avx2
#endif

// ---------------------------------------------------------------------------------------
// Dispatch

struct Kernels {
  DotFn<1> dot1;
  DotFn<2> dot2;
  DotFn<3> dot3;
  DotFn<4> dot4;
};

enum class ActFormat { kQ8x32, kQ8K };

struct Format {
  ActFormat act;
  int64_t block;  // weight elements per block (== activation elements per block)
  Kernels kernels;
};

#define TS_KERNELS(fn) Kernels{&fn<1>, &fn<2>, &fn<3>, &fn<4>}

template <bool kFast>
Format format_of(const WeightView& w, const char* op) {
#if TS_QUANT_AVX2
#define TS_PICK(fn) (kFast ? TS_KERNELS(avx2::fn) : TS_KERNELS(scalar::fn))
#else
#define TS_PICK(fn) TS_KERNELS(scalar::fn)
#endif
  switch (w.dtype) {
    case DType::Q4_0: return {ActFormat::kQ8x32, 32, TS_PICK(dot_q4_0)};
    case DType::Q4_1: return {ActFormat::kQ8x32, 32, TS_PICK(dot_q4_1)};
    case DType::Q5_0: return {ActFormat::kQ8x32, 32, TS_PICK(dot_q5_0)};
    case DType::Q5_1: return {ActFormat::kQ8x32, 32, TS_PICK(dot_q5_1)};
    case DType::Q8_0: return {ActFormat::kQ8x32, 32, TS_PICK(dot_q8_0)};
    case DType::Q4_K: return {ActFormat::kQ8K, 256, TS_PICK(dot_q4_k)};
    case DType::Q5_K: return {ActFormat::kQ8K, 256, TS_PICK(dot_q5_k)};
    case DType::Q6_K: return {ActFormat::kQ8K, 256, TS_PICK(dot_q6_k)};
    default:
      fail("{}: weight dtype {} is not a quantized format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)", op,
           dtype_name(w.dtype));
  }
#undef TS_PICK
}
#undef TS_KERNELS

void check_shapes(const WeightView& w, const Mat& x, const Mat& y, const Format& f, const char* op) {
  if (x.cols != w.cols || y.cols != w.rows || y.rows != x.rows)
    fail("{}: shape mismatch w [{}, {}] x [{}, {}] y [{}, {}]", op, w.rows, w.cols, x.rows, x.cols, y.rows, y.cols);
  if (w.cols % f.block != 0)
    fail("{}: {} weight has {} columns, not a multiple of its block size {}", op, dtype_name(w.dtype), w.cols, f.block);
  if (w.row_bytes < row_bytes(w.dtype, w.cols))
    fail("{}: {} weight rows are {} bytes apart, less than one row ({} bytes)", op, dtype_name(w.dtype), w.row_bytes,
         row_bytes(w.dtype, w.cols));
}

// A quantized activation row: its blocks, then the side arrays (act_side; filled by the AVX2
// quantizer for the row kernels), so a group of eight blocks' dy or sy is one vector load.
int64_t act_row_bytes(const Format& f, int64_t cols) {
  const int64_t nb = cols / f.block, padded = padded_blocks(nb);
  return f.act == ActFormat::kQ8K ? nb * int64_t(sizeof(BlockQ8_K)) + padded * 4
                                  : nb * int64_t(sizeof(BlockQ8x32)) + 2 * padded * 4;
}

template <bool kFast>
void quantize_act_row(const Format& f, const float* x, uint8_t* dst, int64_t cols) {
#if TS_QUANT_AVX2
  if constexpr (kFast) {
    const int64_t nb = cols / f.block, padded = padded_blocks(nb);
    if (f.act == ActFormat::kQ8K) {
      auto* y = reinterpret_cast<BlockQ8_K*>(dst);
      avx2::quantize_row_q8_K(x, y, cols);
      float* dy = act_side(y, nb);
      for (int64_t b = 0; b < padded; ++b) dy[b] = b < nb ? y[b].d : 0.f;
    } else {
      auto* y = reinterpret_cast<BlockQ8x32*>(dst);
      avx2::quantize_row_q8x32(x, y, cols);
      float* dy = act_side(y, nb);
      for (int64_t b = 0; b < padded; ++b) dy[b] = b < nb ? y[b].d : 0.f, dy[padded + b] = b < nb ? y[b].s : 0.f;
    }
    return;
  }
#endif
  if (f.act == ActFormat::kQ8K) turbospark::quantize_row_q8_K(x, reinterpret_cast<BlockQ8_K*>(dst), cols);
  else turbospark::quantize_row_q8x32(x, reinterpret_cast<BlockQ8x32*>(dst), cols);
}

// Rows [row_begin, row_end) of y for all tokens. Weight rows are taken in tiles small
// enough to stay in L1/L2 while every group of kMaxTokens activation rows passes over them.
void matmul_rows(const Format& f, const WeightView& w, const uint8_t* xq, int64_t xq_stride, int64_t n_tokens,
                 const Mat& y, int64_t row_begin, int64_t row_end) {
  const int64_t nb = w.cols / f.block;
  const int64_t tile = n_tokens <= kMaxTokens ? row_end - row_begin
                                              : std::max<int64_t>(1, (int64_t(16) << 10) / std::max<int64_t>(1, w.row_bytes));
  float out[kMaxTokens];
  for (int64_t r0 = row_begin; r0 < row_end; r0 += tile) {
    const int64_t r1 = std::min(row_end, r0 + tile);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kMaxTokens) {
      const int nt = int(std::min<int64_t>(kMaxTokens, n_tokens - t0));
      const uint8_t* xt = xq + t0 * xq_stride;
      // Decode: visit the rows as kDecodeStreams interleaved runs, row i of each in turn.
      const int64_t n = r1 - r0;
      const int64_t streams = n_tokens <= kMaxTokens && n >= 4 * kDecodeStreams ? kDecodeStreams : 1;
      const int64_t per = (n + streams - 1) / streams;
      for (int64_t i = 0; i < per * streams; ++i) {
        const int64_t r = r0 + (i % streams) * per + i / streams;
        if (r >= r1) continue;
        const uint8_t* wr = w.row(r);
        switch (nt) {
          case 1: f.kernels.dot1(nb, wr, xt, xq_stride, out); break;
          case 2: f.kernels.dot2(nb, wr, xt, xq_stride, out); break;
          case 3: f.kernels.dot3(nb, wr, xt, xq_stride, out); break;
          default: f.kernels.dot4(nb, wr, xt, xq_stride, out); break;
        }
        for (int k = 0; k < nt; ++k) y.row(t0 + k)[r] = out[k];
      }
    }
  }
}

// Scratch for the quantized activations, reused across calls so decode does not allocate
// per op. Thread-local (not shared) because each calling thread runs its own matmuls; the
// pool's workers only read the caller's buffer during the call.
std::vector<uint8_t>& activation_scratch() {
  thread_local std::vector<uint8_t> buffer;
  return buffer;
}

}  // namespace

void quant_matmul(ThreadPool& pool, const WeightView& w, const Mat& x, const Mat& y) {
  const Format f = format_of<true>(w, "quant_matmul");
  check_shapes(w, x, y, f, "quant_matmul");
  if (x.rows == 0 || w.rows == 0) return;
  const int64_t xq_stride = act_row_bytes(f, w.cols);
  std::vector<uint8_t>& xq = activation_scratch();
  if (int64_t(xq.size()) < xq_stride * x.rows) xq.resize(size_t(xq_stride * x.rows));
  uint8_t* xq_data = xq.data();
  if (x.rows >= 4 && pool.size() > 1) {
    pool.parallel_for(x.rows, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) quantize_act_row<true>(f, x.row(t), xq_data + t * xq_stride, w.cols);
    });
  } else {
    for (int64_t t = 0; t < x.rows; ++t) quantize_act_row<true>(f, x.row(t), xq_data + t * xq_stride, w.cols);
  }
  if (x.rows >= kTiledMinTokens && quant_gemm::has_tiled_kernel(w.dtype)) {
    pool.parallel_for(w.rows, quant_gemm::kTileRows, [&](int64_t b, int64_t e) {
      quant_gemm::matmul_rows(w, xq_data, xq_stride, x.rows, y, b, e, /*fast=*/true);
    });
    return;
  }
  pool.parallel_for(w.rows, 8, [&](int64_t b, int64_t e) { matmul_rows(f, w, xq_data, xq_stride, x.rows, y, b, e); });
}

bool quant_matmul_takes(DType dtype) {
  switch (dtype) {
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1: case DType::Q8_0:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: return true;
    default: return false;
  }
}

void quant_matmul_jobs(ThreadPool& pool, std::span<const QuantMatmulJob> jobs) {
  // Per fused job: its format, where its quantized x lives, and its first row in the
  // concatenation of every fused job's output rows.
  struct Fused {
    const QuantMatmulJob* job;
    Format f;
    int64_t xq_stride, xq_offset, first_row;
    bool quantizes;  // the first job to name its x quantizes it
  };
  thread_local std::vector<Fused> fused;
  fused.clear();
  int64_t xq_bytes = 0, total_rows = 0;
  for (size_t j = 0; j < jobs.size(); ++j) {
    const QuantMatmulJob& job = jobs[j];
    if (!job.w) fail("quant_matmul_jobs: job {} has no weight", j);
    const Format f = format_of<true>(*job.w, "quant_matmul_jobs");
    check_shapes(*job.w, job.x, job.y, f, "quant_matmul_jobs");
    if (job.x.rows == 0 || job.w->rows == 0) continue;
    if (job.x.rows >= kTiledMinTokens && quant_gemm::has_tiled_kernel(job.w->dtype)) {
      quant_matmul(pool, *job.w, job.x, job.y);  // a batch: the tiled kernels, on their own
      continue;
    }
    const int64_t stride = act_row_bytes(f, job.w->cols);
    int64_t offset = -1;
    for (const Fused& o : fused)  // the same activation rows, quantized the same way
      if (o.job->x.data == job.x.data && o.job->x.rows == job.x.rows && o.job->x.cols == job.x.cols &&
          o.job->x.stride == job.x.stride && o.f.act == f.act)
        offset = o.xq_offset;
    const bool quantizes = offset < 0;
    if (quantizes) offset = xq_bytes, xq_bytes += stride * job.x.rows;
    fused.push_back({&job, f, stride, offset, total_rows, quantizes});
    total_rows += job.w->rows;
  }
  if (fused.empty()) return;
  std::vector<uint8_t>& xq = activation_scratch();
  if (int64_t(xq.size()) < xq_bytes) xq.resize(size_t(xq_bytes));
  uint8_t* xq_data = xq.data();
  for (const Fused& u : fused) {
    if (!u.quantizes) continue;
    for (int64_t t = 0; t < u.job->x.rows; ++t)
      quantize_act_row<true>(u.f, u.job->x.row(t), xq_data + u.xq_offset + t * u.xq_stride, u.job->w->cols);
  }
  const Fused* list = fused.data();
  const size_t n_fused = fused.size();
  pool.parallel_for(total_rows, 8, [&](int64_t b, int64_t e) {
    // The last job starting at or before b, then each job the range [b, e) crosses.
    size_t j = size_t(std::upper_bound(list, list + n_fused, b,
                                       [](int64_t row, const Fused& u) { return row < u.first_row; }) -
                      list) - 1;
    for (; j < n_fused && list[j].first_row < e; ++j) {
      const Fused& u = list[j];
      const int64_t lo = std::max(b, u.first_row) - u.first_row;
      const int64_t hi = std::min(e, u.first_row + u.job->w->rows) - u.first_row;
      if (lo < hi)
        matmul_rows(u.f, *u.job->w, xq_data + u.xq_offset, u.xq_stride, u.job->x.rows, u.job->y, lo, hi);
    }
  });
}

void ref::quant_matmul(const WeightView& w, const Mat& x, const Mat& y) {
  const Format f = format_of<false>(w, "ref::quant_matmul");
  check_shapes(w, x, y, f, "ref::quant_matmul");
  const int64_t xq_stride = act_row_bytes(f, w.cols);
  std::vector<uint8_t> xq(size_t(xq_stride * x.rows));
  for (int64_t t = 0; t < x.rows; ++t) quantize_act_row<false>(f, x.row(t), xq.data() + t * xq_stride, w.cols);
  matmul_rows(f, w, xq.data(), xq_stride, x.rows, y, 0, w.rows);
}

void quant_embedding(const WeightView& table, const int32_t* ids, int64_t n, float scale, const Mat& out) {
  if (out.rows != n || out.cols != table.cols)
    fail("quant_embedding: out is [{}, {}], expected [{}, {}]", out.rows, out.cols, n, table.cols);
  if (table.row_bytes < row_bytes(table.dtype, table.cols))
    fail("quant_embedding: {} table rows are {} bytes apart, less than one row", dtype_name(table.dtype), table.row_bytes);
  for (int64_t t = 0; t < n; ++t) {
    if (ids[t] < 0 || ids[t] >= table.rows)
      fail("quant_embedding: token id {} out of range [0, {})", ids[t], table.rows);
    float* dst = out.row(t);
    dequantize_row(table.dtype, table.row(ids[t]), dst, table.cols);
    if (scale != 1.f)
      for (int64_t i = 0; i < table.cols; ++i) dst[i] *= scale;
  }
}

}  // namespace turbospark::cpu
