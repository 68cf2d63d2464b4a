// AVX2 helpers the CPU kernels share.
#pragma once

#if defined(__AVX2__)
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace turbospark::cpu {

// The sum of a register's eight floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Q4_K/Q5_K 12-byte scale field -> 8 scales (bytes 0-7) and 8 minimums (bytes 8-15), the
// same unpacking as quant::unpack_k4_scales done on 32-bit words.
inline __m128i unpack_k4_scales(const uint8_t* packed) {
  uint32_t a, b, c;
  std::memcpy(&a, packed, 4);
  std::memcpy(&b, packed + 4, 4);
  std::memcpy(&c, packed + 8, 4);
  const uint32_t sc_lo = a & 0x3f3f3f3f;
  const uint32_t sc_hi = (c & 0x0f0f0f0f) | ((a >> 2) & 0x30303030);
  const uint32_t m_lo = b & 0x3f3f3f3f;
  const uint32_t m_hi = ((c >> 4) & 0x0f0f0f0f) | ((b >> 2) & 0x30303030);
  return _mm_set_epi32(int(m_hi), int(m_lo), int(sc_hi), int(sc_lo));
}

}  // namespace turbospark::cpu
#endif
