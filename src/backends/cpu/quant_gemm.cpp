// Tiled multi-token products for the 4- and 5-bit formats and Q6_K (see quant_gemm.h).
// Structure:
//   1. a thread takes its output rows 8 at a time and packs the 8 weight rows, whole
//      length, into a tile in its scratch (TileQ4K / TileQ5K / TileQ6K per 256-column
//      superblock, TileB32 per 32-column block);
//   2. every group of up to 4 tokens runs one kernel over the tile, producing 8 outputs per
//      token in the 8 float lanes of one register (no horizontal sums).
// Packing reads the weights and costs a few tokens' worth of the kernel, so the caller uses
// this path only for batches of tokens (prefill; see kTiledMinTokens in quant_matmul.cpp);
// decode keeps the in-place row kernels.
#include "backends/cpu/quant_gemm.h"
#include "backends/cpu/quant_contract.h"
#include "backends/cpu/simd.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/quant.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TS_GEMM_AVX2 1
#include <immintrin.h>
#else
#define TS_GEMM_AVX2 0
#endif

namespace turbospark::cpu::quant_gemm {
namespace {

constexpr int R = kTileRows;
constexpr int kMaxTokens = 4;

// One Q4_K superblock (256 columns) of 8 rows. The integer lanes are laid out for the
// kernel: a maddubs of qs[c] against 4 activation bytes leaves row r's two int16 partial
// sums in lanes 2r and 2r + 1, so sc[s] (and m[p]) repeat each row's value in both lanes
// and one madd applies it and adds the pair.
struct alignas(32) TileQ4K {
  float d[R];             // each row's f16 d, widened
  float dmin[R];          // each row's f16 dmin, widened
  int16_t sc[8][2 * R];   // sc[s][2r] = sc[s][2r + 1] = row r's 6-bit scale of sub-block s
  int16_t m[4][2 * R];    // m[p][2r + k] = row r's 6-bit minimum of sub-block 2p + k
  uint8_t qs[32][4 * R];  // qs[c][4r + i] = row r's qs[4c + i] (the Q4_K nibble packing as is)
};

// One Q5_K superblock of 8 rows: scales as TileQ4K, the 5-bit quants widened to bytes in
// element order.
struct alignas(32) TileQ5K {
  float d[R];             // each row's f16 d, widened
  float dmin[R];          // each row's f16 dmin, widened
  int16_t sc[8][2 * R];   // sc[s][2r] = sc[s][2r + 1] = row r's 6-bit scale of sub-block s
  int16_t m[4][2 * R];    // m[p][2r + k] = row r's 6-bit minimum of sub-block 2p + k
  uint8_t q[64][4 * R];   // q[c][4r + i] = row r's quant of element 4c + i, in [0, 32)
};

// One Q6_K superblock of 8 rows, the 6-bit quants widened to bytes in element order.
struct alignas(32) TileQ6K {
  float d[R];              // each row's f16 d, widened
  int16_t sc[16][2 * R];   // sc[s][2r] = sc[s][2r + 1] = row r's int8 scale of sub-block s
  int16_t scp[8][2 * R];   // scp[p][2r + k] = row r's scale of sub-block 2p + k
  uint8_t q[64][4 * R];    // q[c][4r + i] = row r's quant of element 4c + i, in [0, 64)
};

static_assert(sizeof(TileQ4K) == 1472 && sizeof(TileQ5K) == 2496 && sizeof(TileQ6K) == 2848);

// One block of 32 columns of 8 rows, for the 32-element formats (activations BlockQ8x32):
// row r contributes d[r] * dy * sum(q * qy) + offset[r] * s_y, where s_y = dy * sum(qy).
struct alignas(32) TileB32 {
  float d[R];            // each row's f16 d, widened
  float offset[R];       // Q4_0: -8 d, Q5_0: -16 d, Q4_1 and Q5_1: m
  uint8_t q[8][4 * R];   // q[c][4r + i] = row r's quant of element 4c + i, in [0, 16) or [0, 32)
};
static_assert(sizeof(TileB32) == 320);

// The 32-element formats: unsigned quants of kBits bits and a per-block offset.
template <DType kType>
struct Format32;
template <>
struct Format32<DType::Q4_0> {
  using Block = BlockQ4_0;
  static constexpr int kBits = 4;
  static float offset(const Block& b) { return -8.f * f16_to_f32(b.d); }
};
template <>
struct Format32<DType::Q4_1> {
  using Block = BlockQ4_1;
  static constexpr int kBits = 4;
  static float offset(const Block& b) { return f16_to_f32(b.m); }
};
template <>
struct Format32<DType::Q5_0> {
  using Block = BlockQ5_0;
  static constexpr int kBits = 5;
  static float offset(const Block& b) { return -16.f * f16_to_f32(b.d); }
};
template <>
struct Format32<DType::Q5_1> {
  using Block = BlockQ5_1;
  static constexpr int kBits = 5;
  static float offset(const Block& b) { return f16_to_f32(b.m); }
};

// Quant i of a 32-element block: nibbles as Q4_0 (core/quant.h), the 5th bit from qh.
template <typename Block>
inline uint8_t q32_element(const Block& b, int i) {
  int q = i < 16 ? b.qs[i] & 0xF : b.qs[i - 16] >> 4;
  if constexpr (requires { b.qh; }) {
    uint32_t qh;
    std::memcpy(&qh, b.qh, 4);
    q |= int((qh >> i) & 1) << 4;
  }
  return uint8_t(q);
}

// Q6_K element e of a block: low 4 bits from ql, top 2 from qh (layout in core/quant.h).
inline uint8_t q6_element(const BlockQ6_K& blk, int e) {
  const int h = e / 128, quarter = (e % 128) / 32, l = e % 32;
  const uint8_t ql = blk.ql[64 * h + 32 * (quarter & 1) + l];
  const int low = quarter < 2 ? ql & 0xF : ql >> 4;
  const int top = (blk.qh[32 * h + l] >> (2 * quarter)) & 3;
  return uint8_t(low | top << 4);
}

// Q5_K element e of a block: 4 bits from the nibbles as Q4_K, the 5th from qh.
inline uint8_t q5_element(const BlockQ5_K& blk, int e) {
  const int j = e / 64, hi = (e % 64) / 32, l = e % 32;
  const uint8_t byte = blk.qs[32 * j + l];
  const int low = hi ? byte >> 4 : byte & 0xF;
  return uint8_t(low | ((blk.qh[l] >> (2 * j + hi)) & 1) << 4);
}

// ---------------------------------------------------------------------------------------
// Scalar reference: packing and kernels in plain loops (and the fallback without AVX2).

namespace scalar {

// Row r of a tile's scale lanes from one block (Q4_K and Q5_K share the scale fields).
template <typename Block, typename Tile>
void pack_scales_k4(const Block& blk, int r, Tile& tile) {
  uint8_t sc[8], m[8];
  quant::unpack_k4_scales(blk.scales, sc, m);
  for (int s = 0; s < 8; ++s) {
    tile.sc[s][2 * r] = tile.sc[s][2 * r + 1] = sc[s];
    tile.m[s / 2][2 * r + s % 2] = m[s];
  }
}

void pack_scales_q6k(const BlockQ6_K& blk, int r, TileQ6K& tile) {
  for (int s = 0; s < 16; ++s) {
    tile.sc[s][2 * r] = tile.sc[s][2 * r + 1] = blk.scales[s];
    tile.scp[s / 2][2 * r + s % 2] = blk.scales[s];
  }
}

void pack_q4k(const uint8_t* const* rows, int64_t nb, TileQ4K* tile) {
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      const BlockQ4_K& blk = reinterpret_cast<const BlockQ4_K*>(rows[r])[b];
      tile[b].d[r] = f16_to_f32(blk.d);
      tile[b].dmin[r] = f16_to_f32(blk.dmin);
      pack_scales_k4(blk, r, tile[b]);
      for (int c = 0; c < 32; ++c) std::memcpy(&tile[b].qs[c][4 * r], blk.qs + 4 * c, 4);
    }
  }
}

void pack_q5k(const uint8_t* const* rows, int64_t nb, TileQ5K* tile) {
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      const BlockQ5_K& blk = reinterpret_cast<const BlockQ5_K*>(rows[r])[b];
      tile[b].d[r] = f16_to_f32(blk.d);
      tile[b].dmin[r] = f16_to_f32(blk.dmin);
      pack_scales_k4(blk, r, tile[b]);
      for (int e = 0; e < 256; ++e) tile[b].q[e / 4][4 * r + e % 4] = q5_element(blk, e);
    }
  }
}

void pack_q6k(const uint8_t* const* rows, int64_t nb, TileQ6K* tile) {
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      const BlockQ6_K& blk = reinterpret_cast<const BlockQ6_K*>(rows[r])[b];
      tile[b].d[r] = f16_to_f32(blk.d);
      pack_scales_q6k(blk, r, tile[b]);
      for (int e = 0; e < 256; ++e) tile[b].q[e / 4][4 * r + e % 4] = q6_element(blk, e);
    }
  }
}

template <DType kType>
void pack_b32(const uint8_t* const* rows, int64_t nb, TileB32* tile) {
  using F = Format32<kType>;
  for (int64_t b = 0; b < nb; ++b) {
    for (int r = 0; r < R; ++r) {
      const typename F::Block& blk = reinterpret_cast<const typename F::Block*>(rows[r])[b];
      tile[b].d[r] = f16_to_f32(blk.d);
      tile[b].offset[r] = F::offset(blk);
      for (int e = 0; e < 32; ++e) tile[b].q[e / 4][4 * r + e % 4] = q32_element(blk, e);
    }
  }
}

void kernel_b32(const TileB32* tile, int64_t nb, const uint8_t* x, int64_t xs, int nt, float* out) {
  for (int t = 0; t < nt; ++t) {
    const auto* y = reinterpret_cast<const BlockQ8x32*>(x + t * xs);
    contract::LaneSums acc[R];
    for (int64_t b = 0; b < nb; ++b) {
      for (int r = 0; r < R; ++r) {
        int sum = 0;
        for (int e = 0; e < 32; ++e) sum += tile[b].q[e / 4][4 * r + e % 4] * y[b].qs[e];
        acc[r].add(b, contract::b32_term(tile[b].d[r], y[b].d, sum, tile[b].offset[r], y[b].s));
      }
    }
    for (int r = 0; r < R; ++r) out[t * R + r] = acc[r].total();
  }
}

// out[t * R + r] = dot(row r, token t) for t < nt.
void kernel_q4k(const TileQ4K* tile, int64_t nb, const uint8_t* x, int64_t xs, int nt, float* out) {
  for (int t = 0; t < nt; ++t) {
    const auto* y = reinterpret_cast<const BlockQ8_K*>(x + t * xs);
    contract::LaneSums acc[R];
    for (int64_t b = 0; b < nb; ++b) {
      const TileQ4K& tb = tile[b];
      for (int r = 0; r < R; ++r) {
        int sumi = 0, summ = 0;
        for (int s = 0; s < 8; ++s) {
          const int j = s / 2, hi = s % 2;
          int dot = 0;
          for (int k = 0; k < 32; ++k) {
            const uint8_t byte = tb.qs[8 * j + k / 4][4 * r + k % 4];
            dot += (hi ? byte >> 4 : byte & 0xF) * y[b].qs[64 * j + 32 * hi + k];
          }
          sumi += tb.sc[s][2 * r] * dot;
          summ += tb.m[s / 2][2 * r + s % 2] * (y[b].bsums[2 * s] + y[b].bsums[2 * s + 1]);
        }
        acc[r].add(b, contract::k4_term(tb.d[r], tb.dmin[r], y[b].d, sumi, summ));
      }
    }
    for (int r = 0; r < R; ++r) out[t * R + r] = acc[r].total();
  }
}

void kernel_q5k(const TileQ5K* tile, int64_t nb, const uint8_t* x, int64_t xs, int nt, float* out) {
  for (int t = 0; t < nt; ++t) {
    const auto* y = reinterpret_cast<const BlockQ8_K*>(x + t * xs);
    contract::LaneSums acc[R];
    for (int64_t b = 0; b < nb; ++b) {
      const TileQ5K& tb = tile[b];
      for (int r = 0; r < R; ++r) {
        int sumi = 0, summ = 0;
        for (int s = 0; s < 8; ++s) {
          int dot = 0;
          for (int k = 0; k < 32; ++k) {
            const int e = 32 * s + k;
            dot += tb.q[e / 4][4 * r + e % 4] * y[b].qs[e];
          }
          sumi += tb.sc[s][2 * r] * dot;
          summ += tb.m[s / 2][2 * r + s % 2] * (y[b].bsums[2 * s] + y[b].bsums[2 * s + 1]);
        }
        acc[r].add(b, contract::k4_term(tb.d[r], tb.dmin[r], y[b].d, sumi, summ));
      }
    }
    for (int r = 0; r < R; ++r) out[t * R + r] = acc[r].total();
  }
}

void kernel_q6k(const TileQ6K* tile, int64_t nb, const uint8_t* x, int64_t xs, int nt, float* out) {
  for (int t = 0; t < nt; ++t) {
    const auto* y = reinterpret_cast<const BlockQ8_K*>(x + t * xs);
    contract::LaneSums acc[R];
    for (int64_t b = 0; b < nb; ++b) {
      const TileQ6K& tb = tile[b];
      for (int r = 0; r < R; ++r) {
        int sumi = 0;
        for (int s = 0; s < 16; ++s) {
          int dot = 0;
          for (int k = 0; k < 16; ++k) {
            const int e = 16 * s + k;
            dot += tb.q[e / 4][4 * r + e % 4] * y[b].qs[e];
          }
          sumi += tb.sc[s][2 * r] * (dot - 32 * y[b].bsums[s]);
        }
        acc[r].add(b, contract::q6_term(tb.d[r], y[b].d, sumi));
      }
    }
    for (int r = 0; r < R; ++r) out[t * R + r] = acc[r].total();
  }
}

}  // namespace scalar

// ---------------------------------------------------------------------------------------
// AVX2

#if TS_GEMM_AVX2
namespace avx2 {

inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store256(void* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }

// 4 activation bytes (one token, elements k..k+3) in every 32-bit lane.
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// An empty asm that claims to modify v: it stops GCC from reassociating a chain of integer
// adds into a tree, which in these kernels computes all of a block's maddubs first and
// spills them to the stack.
inline void in_register(__m256i& v) { asm("" : "+x"(v)); }

// v[r] holds 8 dwords of row r; afterwards v[k] holds dword k of rows 0-7.
inline void transpose8x8_epi32(__m256i v[8]) {
  const __m256i t0 = _mm256_unpacklo_epi32(v[0], v[1]), t1 = _mm256_unpackhi_epi32(v[0], v[1]);
  const __m256i t2 = _mm256_unpacklo_epi32(v[2], v[3]), t3 = _mm256_unpackhi_epi32(v[2], v[3]);
  const __m256i t4 = _mm256_unpacklo_epi32(v[4], v[5]), t5 = _mm256_unpackhi_epi32(v[4], v[5]);
  const __m256i t6 = _mm256_unpacklo_epi32(v[6], v[7]), t7 = _mm256_unpackhi_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
  const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
  const __m256i u4 = _mm256_unpacklo_epi64(t4, t6), u5 = _mm256_unpackhi_epi64(t4, t6);
  const __m256i u6 = _mm256_unpacklo_epi64(t5, t7), u7 = _mm256_unpackhi_epi64(t5, t7);
  v[0] = _mm256_permute2x128_si256(u0, u4, 0x20), v[4] = _mm256_permute2x128_si256(u0, u4, 0x31);
  v[1] = _mm256_permute2x128_si256(u1, u5, 0x20), v[5] = _mm256_permute2x128_si256(u1, u5, 0x31);
  v[2] = _mm256_permute2x128_si256(u2, u6, 0x20), v[6] = _mm256_permute2x128_si256(u2, u6, 0x31);
  v[3] = _mm256_permute2x128_si256(u3, u7, 0x20), v[7] = _mm256_permute2x128_si256(u3, u7, 0x31);
}

// int32 lanes holding a sign- or zero-extended int16 v -> the int16 pair (v, v).
inline __m256i dup16(__m256i w) {
  return _mm256_or_si256(_mm256_and_si256(w, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(w, 16));
}

// d, dmin, sc and m of a Q4_K/Q5_K tile from the 8 rows' blocks: each row's values are
// built as int32 lanes, then an 8x8 transpose turns row-major into the tile's lane order.
template <typename Block, typename Tile>
void pack_scales_k4_rows(const Block* const* blk, Tile& tile) {
  __m256i sc[R], m[R];
  for (int r = 0; r < R; ++r) {
    tile.d[r] = _cvtsh_ss(blk[r]->d);
    tile.dmin[r] = _cvtsh_ss(blk[r]->dmin);
    const __m128i sm = unpack_k4_scales(blk[r]->scales);
    sc[r] = dup16(_mm256_cvtepu8_epi32(sm));                         // lane s: (sc[s], sc[s])
    m[r] = _mm256_cvtepu8_epi16(_mm_unpackhi_epi64(sm, sm));          // lane p < 4: (m[2p], m[2p+1])
  }
  transpose8x8_epi32(sc);
  transpose8x8_epi32(m);
  for (int s = 0; s < 8; ++s) store256(tile.sc[s], sc[s]);
  for (int p = 0; p < 4; ++p) store256(tile.m[p], m[p]);
}

void pack_q4k(const uint8_t* const* rows, int64_t nb, TileQ4K* tile) {
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ4_K* blk[R];
    for (int r = 0; r < R; ++r) blk[r] = reinterpret_cast<const BlockQ4_K*>(rows[r]) + b;
    pack_scales_k4_rows(blk, tile[b]);
    for (int g = 0; g < 4; ++g) {
      __m256i v[R];
      for (int r = 0; r < R; ++r) v[r] = load256(blk[r]->qs + 32 * g);
      transpose8x8_epi32(v);
      for (int k = 0; k < 8; ++k) store256(tile[b].qs[8 * g + k], v[k]);
    }
  }
}

// The 8 rows' 256-byte unpacked blocks -> tile quants q[64][32] (4 bytes of each row per
// 32-byte chunk).
inline void interleave_rows(const uint8_t (*unpacked)[256], uint8_t (*q)[4 * R]) {
  for (int g = 0; g < 8; ++g) {
    __m256i v[R];
    for (int r = 0; r < R; ++r) v[r] = load256(unpacked[r] + 32 * g);
    transpose8x8_epi32(v);
    for (int k = 0; k < 8; ++k) store256(q[8 * g + k], v[k]);
  }
}

void pack_q5k(const uint8_t* const* rows, int64_t nb, TileQ5K* tile) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bit4 = _mm256_set1_epi8(0x10);
  alignas(32) uint8_t unpacked[R][256];  // each row's block, one byte per quant
  for (int64_t b = 0; b < nb; ++b) {
    const BlockQ5_K* blks[R];
    for (int r = 0; r < R; ++r) blks[r] = reinterpret_cast<const BlockQ5_K*>(rows[r]) + b;
    pack_scales_k4_rows(blks, tile[b]);
    for (int r = 0; r < R; ++r) {
      const BlockQ5_K& blk = *blks[r];
      // Bits 2j and 2j + 1 of each qh byte are the 5th bits of group j's two halves; hbits
      // shifts right by 2 per group (16-bit shifts carry bits across bytes only into bits
      // that are never read).
      __m256i hbits = load256(blk.qh);
      for (int j = 0; j < 4; ++j) {
        const __m256i q = load256(blk.qs + 32 * j);
        store256(unpacked[r] + 64 * j,
                 _mm256_or_si256(_mm256_and_si256(q, low4), _mm256_and_si256(_mm256_slli_epi16(hbits, 4), bit4)));
        store256(unpacked[r] + 64 * j + 32, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(q, 4), low4),
                                                            _mm256_and_si256(_mm256_slli_epi16(hbits, 3), bit4)));
        hbits = _mm256_srli_epi16(hbits, 2);
      }
    }
    interleave_rows(unpacked, tile[b].q);
  }
}

void pack_q6k(const uint8_t* const* rows, int64_t nb, TileQ6K* tile) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
  alignas(32) uint8_t unpacked[R][256];  // each row's block, one byte per quant
  for (int64_t b = 0; b < nb; ++b) {
    // Scales as in pack_scales_k4_rows: per row as int32 lanes, then transposed.
    __m256i lo[R], hi[R], pairs[R];
    for (int r = 0; r < R; ++r) {
      const BlockQ6_K& blk = reinterpret_cast<const BlockQ6_K*>(rows[r])[b];
      tile[b].d[r] = _cvtsh_ss(blk.d);
      const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.scales));
      lo[r] = dup16(_mm256_cvtepi8_epi32(s8));                          // lane s: (sc[s], sc[s])
      hi[r] = dup16(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(s8, s8)));  // lane s: (sc[8+s], sc[8+s])
      pairs[r] = _mm256_cvtepi8_epi16(s8);                              // lane p: (sc[2p], sc[2p+1])
    }
    transpose8x8_epi32(lo);
    transpose8x8_epi32(hi);
    transpose8x8_epi32(pairs);
    for (int s = 0; s < 8; ++s) {
      store256(tile[b].sc[s], lo[s]);
      store256(tile[b].sc[8 + s], hi[s]);
      store256(tile[b].scp[s], pairs[s]);
    }
    for (int r = 0; r < R; ++r) {
      const BlockQ6_K& blk = reinterpret_cast<const BlockQ6_K*>(rows[r])[b];
      for (int h = 0; h < 2; ++h) {
        const __m256i ql0 = load256(blk.ql + 64 * h), ql1 = load256(blk.ql + 64 * h + 32);
        const __m256i qh = load256(blk.qh + 32 * h);
        uint8_t* dst = unpacked[r] + 128 * h;
        store256(dst, _mm256_or_si256(_mm256_and_si256(ql0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2)));
        store256(dst + 32,
                 _mm256_or_si256(_mm256_and_si256(ql1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2)));
        store256(dst + 64, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4), _mm256_and_si256(qh, top2)));
        store256(dst + 96, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2)));
      }
    }
    interleave_rows(unpacked, tile[b].q);
  }
}

// Steps 3 and 4 of the accumulation contract (quant_contract.h) for eight rows in the float
// lanes: block b's floats go to lane sum b % 8 (kept in memory: eight per token would not
// fit the registers the kernels need), then the fixed tree.
struct RowLaneSums {
  __m256 lane[8];
  RowLaneSums() {
    for (auto& l : lane) l = _mm256_setzero_ps();
  }
  void add(int64_t b, __m256 v) { lane[b & 7] = _mm256_add_ps(lane[b & 7], v); }
  __m256 total() const {
    return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(lane[0], lane[4]), _mm256_add_ps(lane[2], lane[6])),
                         _mm256_add_ps(_mm256_add_ps(lane[1], lane[5]), _mm256_add_ps(lane[3], lane[7])));
  }
};

// Sum over token t's sub-block sums (pairs of bsums) times row minimums m[p], per row.
inline __m256i k4_minimums(const int16_t (*m)[2 * R], const int16_t* bsums) {
  const __m128i bs_lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bsums));
  const __m128i bs_hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bsums + 8));
  alignas(16) int32_t pairs[4];
  _mm_store_si128(reinterpret_cast<__m128i*>(pairs), _mm_hadd_epi16(bs_lo, bs_hi));
  __m256i summ = _mm256_madd_epi16(load256(m[0]), _mm256_set1_epi32(pairs[0]));
  for (int p = 1; p < 4; ++p) summ = _mm256_add_epi32(summ, _mm256_madd_epi16(load256(m[p]), _mm256_set1_epi32(pairs[p])));
  return summ;
}

// NT tokens against one Q4_K tile. Within a sub-block the 8 maddubs results are summed in
// int16 before the scale: each lane is at most 8 * 2 * 15 * 127 = 30480 < 32768.
template <int NT>
void kernel_q4k(const TileQ4K* tile, int64_t nb, const uint8_t* x, int64_t xs, float* out) {
  const BlockQ8_K* y[NT];
  RowLaneSums acc[NT];
  for (int t = 0; t < NT; ++t) y[t] = reinterpret_cast<const BlockQ8_K*>(x + t * xs);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const TileQ4K& tb = tile[b];
    __m256i sumi[NT];
    for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      // Sub-block 2j from the low nibbles, then 2j + 1 from the high nibbles of the same bytes.
      for (int hi = 0; hi < 2; ++hi) {
        __m256i a16[NT];
        for (int t = 0; t < NT; ++t) a16[t] = _mm256_setzero_si256();
        for (int c = 0; c < 8; ++c) {
          const __m256i q = load256(tb.qs[8 * j + c]);
          const __m256i v = hi ? _mm256_and_si256(_mm256_srli_epi16(q, 4), low4) : _mm256_and_si256(q, low4);
          for (int t = 0; t < NT; ++t) {
            a16[t] = _mm256_add_epi16(
                a16[t], _mm256_maddubs_epi16(v, broadcast4(y[t][b].qs + 64 * j + 32 * hi + 4 * c)));
            in_register(a16[t]);
          }
        }
        const __m256i scale = load256(tb.sc[2 * j + hi]);
        for (int t = 0; t < NT; ++t) sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(a16[t], scale));
      }
    }
    const __m256 d = _mm256_load_ps(tb.d), dmin = _mm256_load_ps(tb.dmin);
    for (int t = 0; t < NT; ++t) {
      const __m256i summ = k4_minimums(tb.m, y[t][b].bsums);
      const __m256 dy = _mm256_set1_ps(y[t][b].d);
      const __m256 m = _mm256_mul_ps(_mm256_mul_ps(dmin, dy), _mm256_cvtepi32_ps(summ));
      acc[t].add(b, _mm256_fmsub_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(sumi[t]), m));
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + t * R, acc[t].total());
}

// NT tokens against one Q5_K tile. Quants reach 31, so four maddubs results fit an int16
// lane (4 * 2 * 31 * 127 = 31496); each 32-element sub-block takes two madds.
template <int NT>
void kernel_q5k(const TileQ5K* tile, int64_t nb, const uint8_t* x, int64_t xs, float* out) {
  const BlockQ8_K* y[NT];
  RowLaneSums acc[NT];
  for (int t = 0; t < NT; ++t) y[t] = reinterpret_cast<const BlockQ8_K*>(x + t * xs);
  for (int64_t b = 0; b < nb; ++b) {
    const TileQ5K& tb = tile[b];
    __m256i sumi[NT];
    for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
    for (int s = 0; s < 8; ++s) {
      const __m256i scale = load256(tb.sc[s]);
      for (int half = 0; half < 2; ++half) {
        const int c0 = 8 * s + 4 * half;
        const __m256i q0 = load256(tb.q[c0]), q1 = load256(tb.q[c0 + 1]);
        const __m256i q2 = load256(tb.q[c0 + 2]), q3 = load256(tb.q[c0 + 3]);
        for (int t = 0; t < NT; ++t) {
          const int8_t* ys = y[t][b].qs + 4 * c0;
          const __m256i a = _mm256_add_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(q0, broadcast4(ys)),
                                                              _mm256_maddubs_epi16(q1, broadcast4(ys + 4))),
                                             _mm256_add_epi16(_mm256_maddubs_epi16(q2, broadcast4(ys + 8)),
                                                              _mm256_maddubs_epi16(q3, broadcast4(ys + 12))));
          sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(a, scale));
          in_register(sumi[t]);
        }
      }
    }
    const __m256 d = _mm256_load_ps(tb.d), dmin = _mm256_load_ps(tb.dmin);
    for (int t = 0; t < NT; ++t) {
      const __m256 dy = _mm256_set1_ps(y[t][b].d);
      const __m256 m = _mm256_mul_ps(_mm256_mul_ps(dmin, dy), _mm256_cvtepi32_ps(k4_minimums(tb.m, y[t][b].bsums)));
      acc[t].add(b, _mm256_fmsub_ps(_mm256_mul_ps(d, dy), _mm256_cvtepi32_ps(sumi[t]), m));
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + t * R, acc[t].total());
}

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

template <DType kType>
void pack_b32(const uint8_t* const* rows, int64_t nb, TileB32* tile) {
  using F = Format32<kType>;
  for (int64_t b = 0; b < nb; ++b) {
    __m256i v[R];
    for (int r = 0; r < R; ++r) {
      const typename F::Block& blk = reinterpret_cast<const typename F::Block*>(rows[r])[b];
      tile[b].d[r] = _cvtsh_ss(blk.d);
      tile[b].offset[r] = F::offset(blk);
      // Elements 0-15 are the low nibbles, 16-31 the high ones.
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk.qs));
      v[r] = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0F));
      if constexpr (F::kBits == 5) v[r] = _mm256_or_si256(v[r], fifth_bits(blk.qh));
    }
    transpose8x8_epi32(v);
    for (int c = 0; c < 8; ++c) store256(tile[b].q[c], v[c]);
  }
}

// NT tokens against 32-element blocks. 4-bit quants: all 8 maddubs results of a block fit
// an int16 lane (8 * 2 * 15 * 127 = 30480); 5-bit ones in two halves of 4 (31496).
template <int kBits, int NT>
void kernel_b32(const TileB32* tile, int64_t nb, const uint8_t* x, int64_t xs, float* out) {
  constexpr int kGroup = kBits == 4 ? 8 : 4;
  const BlockQ8x32* y[NT];
  RowLaneSums acc[NT];
  for (int t = 0; t < NT; ++t) y[t] = reinterpret_cast<const BlockQ8x32*>(x + t * xs);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    const TileB32& tb = tile[b];
    __m256i sumi[NT];
    for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
    for (int c0 = 0; c0 < 8; c0 += kGroup) {
      __m256i a16[NT];
      for (int t = 0; t < NT; ++t) a16[t] = _mm256_setzero_si256();
      for (int c = c0; c < c0 + kGroup; ++c) {
        const __m256i q = load256(tb.q[c]);
        for (int t = 0; t < NT; ++t) {
          a16[t] = _mm256_add_epi16(a16[t], _mm256_maddubs_epi16(q, broadcast4(y[t][b].qs + 4 * c)));
          in_register(a16[t]);
        }
      }
      for (int t = 0; t < NT; ++t) sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(a16[t], ones));
    }
    const __m256 d = _mm256_load_ps(tb.d), offset = _mm256_load_ps(tb.offset);
    for (int t = 0; t < NT; ++t)
      acc[t].add(b, _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(y[t][b].d)), _mm256_cvtepi32_ps(sumi[t]),
                                    _mm256_mul_ps(offset, _mm256_set1_ps(y[t][b].s))));
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + t * R, acc[t].total());
}

// NT tokens against one Q6_K tile. Quants reach 63, so only two maddubs results fit an
// int16 lane (2 * 2 * 63 * 127 = 32004); each 16-element sub-block takes two madds. The
// -32 offset is applied through the activation sums, as in the row kernels.
template <int NT>
void kernel_q6k(const TileQ6K* tile, int64_t nb, const uint8_t* x, int64_t xs, float* out) {
  const BlockQ8_K* y[NT];
  RowLaneSums acc[NT];
  for (int t = 0; t < NT; ++t) y[t] = reinterpret_cast<const BlockQ8_K*>(x + t * xs);
  for (int64_t b = 0; b < nb; ++b) {
    const TileQ6K& tb = tile[b];
    __m256i sumi[NT];
    for (int t = 0; t < NT; ++t) sumi[t] = _mm256_setzero_si256();
    for (int s = 0; s < 16; ++s) {
      const __m256i scale = load256(tb.sc[s]);
      const __m256i q0 = load256(tb.q[4 * s]), q1 = load256(tb.q[4 * s + 1]);
      const __m256i q2 = load256(tb.q[4 * s + 2]), q3 = load256(tb.q[4 * s + 3]);
      for (int t = 0; t < NT; ++t) {
        const int8_t* ys = y[t][b].qs + 16 * s;
        const __m256i a = _mm256_add_epi16(_mm256_maddubs_epi16(q0, broadcast4(ys)),
                                           _mm256_maddubs_epi16(q1, broadcast4(ys + 4)));
        const __m256i c = _mm256_add_epi16(_mm256_maddubs_epi16(q2, broadcast4(ys + 8)),
                                           _mm256_maddubs_epi16(q3, broadcast4(ys + 12)));
        sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_madd_epi16(a, scale), _mm256_madd_epi16(c, scale)));
        in_register(sumi[t]);
      }
    }
    const __m256 d = _mm256_load_ps(tb.d);
    for (int t = 0; t < NT; ++t) {
      // sum_s scale[s] * bsums[s], from int32 loads of bsum pairs (2p, 2p + 1).
      const int16_t* bs = y[t][b].bsums;
      __m256i offset = _mm256_setzero_si256();
      for (int p = 0; p < 8; ++p) {
        int32_t pair;
        std::memcpy(&pair, bs + 2 * p, 4);
        offset = _mm256_add_epi32(offset, _mm256_madd_epi16(load256(tb.scp[p]), _mm256_set1_epi32(pair)));
      }
      sumi[t] = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(offset, 5));
      acc[t].add(b, _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(y[t][b].d)), _mm256_cvtepi32_ps(sumi[t]),
                                    _mm256_setzero_ps()));
    }
  }
  for (int t = 0; t < NT; ++t) _mm256_storeu_ps(out + t * R, acc[t].total());
}

}  // namespace avx2
#endif

// ---------------------------------------------------------------------------------------
// Driver

// Thread-local so each pool worker packs its own tiles; grown once to the largest tile.
uint8_t* tile_scratch(size_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < bytes + 32) buffer.resize(bytes + 32);
  const auto p = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((32 - p % 32) % 32);
}

template <typename Tile>
using PackFn = void (*)(const uint8_t* const*, int64_t, Tile*);

template <typename Tile>
struct TiledFormat {
  PackFn<Tile> pack;
  void (*scalar_kernel)(const Tile*, int64_t, const uint8_t*, int64_t, int, float*);
  // kernels[nt - 1] for nt tokens; null without AVX2.
  void (*kernels[kMaxTokens])(const Tile*, int64_t, const uint8_t*, int64_t, float*);
};

template <typename Tile>
void run_tiles(const TiledFormat<Tile>& f, bool fast, const WeightView& w, const uint8_t* xq, int64_t xs,
               int64_t n_tokens, const Mat& y, int64_t row_begin, int64_t row_end) {
  const int64_t nb = w.cols / block_size(w.dtype);
  Tile* tile = reinterpret_cast<Tile*>(tile_scratch(size_t(nb) * sizeof(Tile)));
  fast = fast && f.kernels[0] != nullptr;
  float out[kMaxTokens * R];
  for (int64_t r0 = row_begin; r0 < row_end; r0 += R) {
    const int n = int(std::min<int64_t>(R, row_end - r0));
    // Rows past the end repeat the last one; their outputs are dropped.
    const uint8_t* rows[R];
    for (int r = 0; r < R; ++r) rows[r] = static_cast<const uint8_t*>(w.row(r0 + std::min(r, n - 1)));
    f.pack(rows, nb, tile);
    for (int64_t t0 = 0; t0 < n_tokens; t0 += kMaxTokens) {
      const int nt = int(std::min<int64_t>(kMaxTokens, n_tokens - t0));
      const uint8_t* xt = xq + t0 * xs;
      if (fast) f.kernels[nt - 1](tile, nb, xt, xs, out);
      else f.scalar_kernel(tile, nb, xt, xs, nt, out);
      for (int k = 0; k < nt; ++k) std::memcpy(y.row(t0 + k) + r0, out + k * R, size_t(n) * sizeof(float));
    }
  }
}

const TiledFormat<TileQ4K>& q4k_format(bool fast) {
#if TS_GEMM_AVX2
  static const TiledFormat<TileQ4K> fast_f{&avx2::pack_q4k, &scalar::kernel_q4k,
                                           {&avx2::kernel_q4k<1>, &avx2::kernel_q4k<2>, &avx2::kernel_q4k<3>,
                                            &avx2::kernel_q4k<4>}};
  if (fast) return fast_f;
#endif
  static const TiledFormat<TileQ4K> scalar_f{&scalar::pack_q4k, &scalar::kernel_q4k, {}};
  return scalar_f;
}

template <DType kType>
const TiledFormat<TileB32>& b32_format(bool fast) {
#if TS_GEMM_AVX2
  constexpr int kBits = Format32<kType>::kBits;
  static const TiledFormat<TileB32> fast_f{&avx2::pack_b32<kType>, &scalar::kernel_b32,
                                           {&avx2::kernel_b32<kBits, 1>, &avx2::kernel_b32<kBits, 2>,
                                            &avx2::kernel_b32<kBits, 3>, &avx2::kernel_b32<kBits, 4>}};
  if (fast) return fast_f;
#endif
  static const TiledFormat<TileB32> scalar_f{&scalar::pack_b32<kType>, &scalar::kernel_b32, {}};
  return scalar_f;
}

const TiledFormat<TileQ5K>& q5k_format(bool fast) {
#if TS_GEMM_AVX2
  static const TiledFormat<TileQ5K> fast_f{&avx2::pack_q5k, &scalar::kernel_q5k,
                                           {&avx2::kernel_q5k<1>, &avx2::kernel_q5k<2>, &avx2::kernel_q5k<3>,
                                            &avx2::kernel_q5k<4>}};
  if (fast) return fast_f;
#endif
  static const TiledFormat<TileQ5K> scalar_f{&scalar::pack_q5k, &scalar::kernel_q5k, {}};
  return scalar_f;
}

const TiledFormat<TileQ6K>& q6k_format(bool fast) {
#if TS_GEMM_AVX2
  static const TiledFormat<TileQ6K> fast_f{&avx2::pack_q6k, &scalar::kernel_q6k,
                                           {&avx2::kernel_q6k<1>, &avx2::kernel_q6k<2>, &avx2::kernel_q6k<3>,
                                            &avx2::kernel_q6k<4>}};
  if (fast) return fast_f;
#endif
  static const TiledFormat<TileQ6K> scalar_f{&scalar::pack_q6k, &scalar::kernel_q6k, {}};
  return scalar_f;
}

}  // namespace

bool has_tiled_kernel(DType t) {
  switch (t) {
    case DType::Q4_0: case DType::Q4_1: case DType::Q5_0: case DType::Q5_1:
    case DType::Q4_K: case DType::Q5_K: case DType::Q6_K: return true;
    default: return false;
  }
}

void matmul_rows(const WeightView& w, const uint8_t* xq, int64_t xq_stride, int64_t n_tokens, const Mat& y,
                 int64_t row_begin, int64_t row_end, bool fast) {
  switch (w.dtype) {
    case DType::Q4_0: run_tiles(b32_format<DType::Q4_0>(fast), fast, w, xq, xq_stride, n_tokens, y, row_begin, row_end); break;
    case DType::Q4_1: run_tiles(b32_format<DType::Q4_1>(fast), fast, w, xq, xq_stride, n_tokens, y, row_begin, row_end); break;
    case DType::Q5_0: run_tiles(b32_format<DType::Q5_0>(fast), fast, w, xq, xq_stride, n_tokens, y, row_begin, row_end); break;
    case DType::Q5_1: run_tiles(b32_format<DType::Q5_1>(fast), fast, w, xq, xq_stride, n_tokens, y, row_begin, row_end); break;
    case DType::Q4_K: run_tiles(q4k_format(fast), fast, w, xq, xq_stride, n_tokens, y, row_begin, row_end); break;
    case DType::Q5_K: run_tiles(q5k_format(fast), fast, w, xq, xq_stride, n_tokens, y, row_begin, row_end); break;
    case DType::Q6_K: run_tiles(q6k_format(fast), fast, w, xq, xq_stride, n_tokens, y, row_begin, row_end); break;
    default: fail("quant_gemm: no tiled kernel for {}", dtype_name(w.dtype));
  }
}

void matmul(ThreadPool* pool, const WeightView& w, const Mat& x, const Mat& y, bool fast) {
  if (!has_tiled_kernel(w.dtype)) fail("quant_gemm: no tiled kernel for {}", dtype_name(w.dtype));
  const int64_t block = block_size(w.dtype);
  if (x.cols != w.cols || y.cols != w.rows || y.rows != x.rows || w.cols % block != 0)
    fail("quant_gemm: shape mismatch w [{}, {}] x [{}, {}] y [{}, {}]", w.rows, w.cols, x.rows, x.cols, y.rows, y.cols);
  // The k-quants meet BlockQ8_K activations, the 32-element formats BlockQ8x32.
  const bool k_quant = block == 256;
  const int64_t xs = w.cols / block * int64_t(k_quant ? sizeof(BlockQ8_K) : sizeof(BlockQ8x32));
  std::vector<uint8_t> xq(size_t(xs * x.rows));
  for (int64_t t = 0; t < x.rows; ++t) {
    if (k_quant) quantize_row_q8_K(x.row(t), reinterpret_cast<BlockQ8_K*>(xq.data() + t * xs), w.cols);
    else quantize_row_q8x32(x.row(t), reinterpret_cast<BlockQ8x32*>(xq.data() + t * xs), w.cols);
  }
  if (pool) {
    pool->parallel_for(w.rows, R, [&](int64_t b, int64_t e) { matmul_rows(w, xq.data(), xs, x.rows, y, b, e, fast); });
  } else {
    matmul_rows(w, xq.data(), xs, x.rows, y, 0, w.rows, fast);
  }
}

}  // namespace turbospark::cpu::quant_gemm
