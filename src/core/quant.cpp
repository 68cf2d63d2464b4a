#include "core/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.h"

namespace turbospark {
namespace {

inline float half(uint16_t h) { return f16_to_f32(h); }

// Round half away from zero, as ggml's reference quantizers do (roundf), so a block this
// file quantizes matches one ggml would write from the same scale.
inline int round_int(float v) { return int(std::lround(v)); }

inline int clamp_int(int v, int lo, int hi) { return std::min(hi, std::max(lo, v)); }

void check_blocks(const char* what, int64_t n, int64_t block) {
  if (n % block != 0) fail("{}: {} elements is not a multiple of the block size {}", what, n, block);
}

}  // namespace

// ---- activation formats ----------------------------------------------------------------------

void quantize_row_q8x32(const float* x, BlockQ8x32* y, int64_t n) {
  check_blocks("quantize_row_q8x32", n, 32);
  for (int64_t b = 0; b < n / 32; ++b, x += 32) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    int sum = 0;
    for (int i = 0; i < 32; ++i) {
      // |x * id| <= 127 up to rounding of id; the clamp keeps -128 out (see BlockQ8x32).
      const int q = clamp_int(int(std::nearbyint(x[i] * id)), -127, 127);
      y[b].qs[i] = int8_t(q);
      sum += q;
    }
    y[b].d = d;
    y[b].s = d * float(sum);
  }
}

void quantize_row_q8_K(const float* x, BlockQ8_K* y, int64_t n) {
  check_blocks("quantize_row_q8_K", n, 256);
  for (int64_t b = 0; b < n / 256; ++b, x += 256) {
    float amax = 0.f;
    for (int i = 0; i < 256; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.f;
    const float id = d > 0.f ? 1.f / d : 0.f;
    for (int g = 0; g < 16; ++g) {
      int sum = 0;
      for (int i = 16 * g; i < 16 * g + 16; ++i) {
        const int q = clamp_int(int(std::nearbyint(x[i] * id)), -127, 127);
        y[b].qs[i] = int8_t(q);
        sum += q;
      }
      y[b].bsums[g] = int16_t(sum);
    }
    y[b].d = d;
  }
}

namespace quant {

// ---- Q4_0 -----------------------------------------------------------------------------------

void Q4_0::dequantize_row(const void* src, float* dst, int64_t n) {
  check_blocks("Q4_0", n, kBlock);
  const auto* blocks = static_cast<const Block*>(src);
  for (int64_t b = 0; b < n / kBlock; ++b, dst += kBlock) {
    const float d = half(blocks[b].d);
    for (int i = 0; i < 16; ++i) {
      dst[i] = d * float(int(blocks[b].qs[i] & 0xF) - 8);
      dst[i + 16] = d * float(int(blocks[b].qs[i] >> 4) - 8);
    }
  }
}

void Q4_0::quantize_row(const float* src, void* dst, int64_t n) {
  check_blocks("Q4_0", n, kBlock);
  auto* blocks = static_cast<Block*>(dst);
  for (int64_t b = 0; b < n / kBlock; ++b, src += kBlock) {
    // The signed extreme maps to -8 exactly, using the one extra negative level.
    float extreme = 0.f;
    for (int i = 0; i < 32; ++i) if (std::fabs(src[i]) > std::fabs(extreme)) extreme = src[i];
    blocks[b].d = f32_to_f16(extreme / -8.f);
    const float d = half(blocks[b].d);
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < 16; ++i) {
      const int lo = clamp_int(round_int(src[i] * id) + 8, 0, 15);
      const int hi = clamp_int(round_int(src[i + 16] * id) + 8, 0, 15);
      blocks[b].qs[i] = uint8_t(lo | hi << 4);
    }
  }
}

// ---- Q4_1 -----------------------------------------------------------------------------------

void Q4_1::dequantize_row(const void* src, float* dst, int64_t n) {
  check_blocks("Q4_1", n, kBlock);
  const auto* blocks = static_cast<const Block*>(src);
  for (int64_t b = 0; b < n / kBlock; ++b, dst += kBlock) {
    const float d = half(blocks[b].d), m = half(blocks[b].m);
    for (int i = 0; i < 16; ++i) {
      dst[i] = d * float(blocks[b].qs[i] & 0xF) + m;
      dst[i + 16] = d * float(blocks[b].qs[i] >> 4) + m;
    }
  }
}

void Q4_1::quantize_row(const float* src, void* dst, int64_t n) {
  check_blocks("Q4_1", n, kBlock);
  auto* blocks = static_cast<Block*>(dst);
  for (int64_t b = 0; b < n / kBlock; ++b, src += kBlock) {
    float lo = src[0], hi = src[0];
    for (int i = 1; i < 32; ++i) lo = std::min(lo, src[i]), hi = std::max(hi, src[i]);
    blocks[b].d = f32_to_f16((hi - lo) / 15.f);
    blocks[b].m = f32_to_f16(lo);
    const float d = half(blocks[b].d), m = half(blocks[b].m);
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < 16; ++i) {
      const int q0 = clamp_int(round_int((src[i] - m) * id), 0, 15);
      const int q1 = clamp_int(round_int((src[i + 16] - m) * id), 0, 15);
      blocks[b].qs[i] = uint8_t(q0 | q1 << 4);
    }
  }
}

// ---- Q5_0 / Q5_1 ----------------------------------------------------------------------------

namespace {
// The 5-bit quant of element i of a Q5_0/Q5_1 block.
inline int q5(const uint8_t* qs, const uint8_t* qh_bytes, int i) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const int low = i < 16 ? qs[i] & 0xF : qs[i - 16] >> 4;
  return low | int((qh >> i) & 1) << 4;
}

// Packs 32 quants (each < 32) into qs and qh.
void pack_q5(const int* q, uint8_t* qs, uint8_t* qh_bytes) {
  uint32_t qh = 0;
  for (int i = 0; i < 16; ++i) qs[i] = uint8_t((q[i] & 0xF) | (q[i + 16] & 0xF) << 4);
  for (int i = 0; i < 32; ++i) qh |= uint32_t(q[i] >> 4) << i;
  std::memcpy(qh_bytes, &qh, 4);
}
}  // namespace

void Q5_0::dequantize_row(const void* src, float* dst, int64_t n) {
  check_blocks("Q5_0", n, kBlock);
  const auto* blocks = static_cast<const Block*>(src);
  for (int64_t b = 0; b < n / kBlock; ++b, dst += kBlock) {
    const float d = half(blocks[b].d);
    for (int i = 0; i < 32; ++i) dst[i] = d * float(q5(blocks[b].qs, blocks[b].qh, i) - 16);
  }
}

void Q5_0::quantize_row(const float* src, void* dst, int64_t n) {
  check_blocks("Q5_0", n, kBlock);
  auto* blocks = static_cast<Block*>(dst);
  for (int64_t b = 0; b < n / kBlock; ++b, src += kBlock) {
    // As Q4_0: the signed extreme maps to -16 exactly.
    float extreme = 0.f;
    for (int i = 0; i < 32; ++i) if (std::fabs(src[i]) > std::fabs(extreme)) extreme = src[i];
    blocks[b].d = f32_to_f16(extreme / -16.f);
    const float d = half(blocks[b].d);
    const float id = d != 0.f ? 1.f / d : 0.f;
    int q[32];
    for (int i = 0; i < 32; ++i) q[i] = clamp_int(round_int(src[i] * id) + 16, 0, 31);
    pack_q5(q, blocks[b].qs, blocks[b].qh);
  }
}

void Q5_1::dequantize_row(const void* src, float* dst, int64_t n) {
  check_blocks("Q5_1", n, kBlock);
  const auto* blocks = static_cast<const Block*>(src);
  for (int64_t b = 0; b < n / kBlock; ++b, dst += kBlock) {
    const float d = half(blocks[b].d), m = half(blocks[b].m);
    for (int i = 0; i < 32; ++i) dst[i] = d * float(q5(blocks[b].qs, blocks[b].qh, i)) + m;
  }
}

void Q5_1::quantize_row(const float* src, void* dst, int64_t n) {
  check_blocks("Q5_1", n, kBlock);
  auto* blocks = static_cast<Block*>(dst);
  for (int64_t b = 0; b < n / kBlock; ++b, src += kBlock) {
    float lo = src[0], hi = src[0];
    for (int i = 1; i < 32; ++i) lo = std::min(lo, src[i]), hi = std::max(hi, src[i]);
    blocks[b].d = f32_to_f16((hi - lo) / 31.f);
    blocks[b].m = f32_to_f16(lo);
    const float d = half(blocks[b].d), m = half(blocks[b].m);
    const float id = d != 0.f ? 1.f / d : 0.f;
    int q[32];
    for (int i = 0; i < 32; ++i) q[i] = clamp_int(round_int((src[i] - m) * id), 0, 31);
    pack_q5(q, blocks[b].qs, blocks[b].qh);
  }
}

// ---- Q8_0 -----------------------------------------------------------------------------------

void Q8_0::dequantize_row(const void* src, float* dst, int64_t n) {
  check_blocks("Q8_0", n, kBlock);
  const auto* blocks = static_cast<const Block*>(src);
  for (int64_t b = 0; b < n / kBlock; ++b, dst += kBlock) {
    const float d = half(blocks[b].d);
    for (int i = 0; i < 32; ++i) dst[i] = d * float(blocks[b].qs[i]);
  }
}

void Q8_0::quantize_row(const float* src, void* dst, int64_t n) {
  check_blocks("Q8_0", n, kBlock);
  auto* blocks = static_cast<Block*>(dst);
  for (int64_t b = 0; b < n / kBlock; ++b, src += kBlock) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(src[i]));
    blocks[b].d = f32_to_f16(amax / 127.f);
    const float d = half(blocks[b].d);
    const float id = d != 0.f ? 1.f / d : 0.f;
    for (int i = 0; i < 32; ++i) blocks[b].qs[i] = int8_t(clamp_int(round_int(src[i] * id), -127, 127));
  }
}

// ---- k-quant scale packing ------------------------------------------------------------------

void unpack_k4_scales(const uint8_t* packed, uint8_t* sc, uint8_t* m) {
  for (int s = 0; s < 4; ++s) {
    sc[s] = packed[s] & 63;
    m[s] = packed[s + 4] & 63;
  }
  for (int s = 4; s < 8; ++s) {
    sc[s] = uint8_t((packed[s + 4] & 0xF) | (packed[s - 4] >> 6) << 4);
    m[s] = uint8_t((packed[s + 4] >> 4) | (packed[s] >> 6) << 4);
  }
}

void pack_k4_scales(const uint8_t* sc, const uint8_t* m, uint8_t* packed) {
  for (int s = 0; s < 4; ++s) {
    packed[s] = uint8_t((sc[s] & 63) | (sc[s + 4] >> 4) << 6);
    packed[s + 4] = uint8_t((m[s] & 63) | (m[s + 4] >> 4) << 6);
    packed[s + 8] = uint8_t((sc[s + 4] & 0xF) | (m[s + 4] & 0xF) << 4);
  }
}

namespace {

// Shared by Q4_K and Q5_K (they differ only in the number of levels and the qh plane).
// Fills d, dmin, scales and q[256] (values in [0, levels]).
void quantize_k_asymmetric(const float* x, int levels, uint16_t* d_out, uint16_t* dmin_out,
                           uint8_t* scales_out, uint8_t* q) {
  float scale[8], minimum[8];
  for (int s = 0; s < 8; ++s) {
    // The minimum is stored as a non-negative amount to subtract, so the range always
    // includes 0.
    float lo = 0.f, hi = x[32 * s];
    for (int i = 32 * s; i < 32 * s + 32; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
    hi = std::max(hi, lo);
    scale[s] = (hi - lo) / float(levels);
    minimum[s] = -lo;
  }
  const float max_scale = *std::max_element(scale, scale + 8);
  const float max_min = *std::max_element(minimum, minimum + 8);
  *d_out = f32_to_f16(max_scale / 63.f);
  *dmin_out = f32_to_f16(max_min / 63.f);
  const float d = half(*d_out), dmin = half(*dmin_out);
  uint8_t sc[8], m[8];
  for (int s = 0; s < 8; ++s) {
    sc[s] = uint8_t(d > 0.f ? clamp_int(round_int(scale[s] / d), 0, 63) : 0);
    m[s] = uint8_t(dmin > 0.f ? clamp_int(round_int(minimum[s] / dmin), 0, 63) : 0);
    const float step = d * float(sc[s]), offset = dmin * float(m[s]);
    for (int i = 32 * s; i < 32 * s + 32; ++i)
      q[i] = uint8_t(step > 0.f ? clamp_int(round_int((x[i] + offset) / step), 0, levels) : 0);
  }
  pack_k4_scales(sc, m, scales_out);
}

}  // namespace

// ---- Q4_K -----------------------------------------------------------------------------------

void Q4_K::dequantize_row(const void* src, float* dst, int64_t n) {
  check_blocks("Q4_K", n, kBlock);
  const auto* blocks = static_cast<const Block*>(src);
  for (int64_t b = 0; b < n / kBlock; ++b, dst += kBlock) {
    const Block& blk = blocks[b];
    const float d = half(blk.d), dmin = half(blk.dmin);
    uint8_t sc[8], m[8];
    unpack_k4_scales(blk.scales, sc, m);
    for (int j = 0; j < 4; ++j) {  // 64 elements: sub-blocks 2j (low nibbles), 2j+1 (high)
      const uint8_t* qs = blk.qs + 32 * j;
      const float d0 = d * sc[2 * j], m0 = dmin * m[2 * j];
      const float d1 = d * sc[2 * j + 1], m1 = dmin * m[2 * j + 1];
      for (int l = 0; l < 32; ++l) {
        dst[64 * j + l] = d0 * float(qs[l] & 0xF) - m0;
        dst[64 * j + 32 + l] = d1 * float(qs[l] >> 4) - m1;
      }
    }
  }
}

void Q4_K::quantize_row(const float* src, void* dst, int64_t n) {
  check_blocks("Q4_K", n, kBlock);
  auto* blocks = static_cast<Block*>(dst);
  uint8_t q[256];
  for (int64_t b = 0; b < n / kBlock; ++b, src += kBlock) {
    Block& blk = blocks[b];
    quantize_k_asymmetric(src, 15, &blk.d, &blk.dmin, blk.scales, q);
    for (int j = 0; j < 4; ++j)
      for (int l = 0; l < 32; ++l) blk.qs[32 * j + l] = uint8_t(q[64 * j + l] | q[64 * j + 32 + l] << 4);
  }
}

// ---- Q5_K -----------------------------------------------------------------------------------

void Q5_K::dequantize_row(const void* src, float* dst, int64_t n) {
  check_blocks("Q5_K", n, kBlock);
  const auto* blocks = static_cast<const Block*>(src);
  for (int64_t b = 0; b < n / kBlock; ++b, dst += kBlock) {
    const Block& blk = blocks[b];
    const float d = half(blk.d), dmin = half(blk.dmin);
    uint8_t sc[8], m[8];
    unpack_k4_scales(blk.scales, sc, m);
    for (int j = 0; j < 4; ++j) {
      const uint8_t* qs = blk.qs + 32 * j;
      const float d0 = d * sc[2 * j], m0 = dmin * m[2 * j];
      const float d1 = d * sc[2 * j + 1], m1 = dmin * m[2 * j + 1];
      for (int l = 0; l < 32; ++l) {
        const int h0 = (blk.qh[l] >> (2 * j)) & 1, h1 = (blk.qh[l] >> (2 * j + 1)) & 1;
        dst[64 * j + l] = d0 * float((qs[l] & 0xF) | h0 << 4) - m0;
        dst[64 * j + 32 + l] = d1 * float((qs[l] >> 4) | h1 << 4) - m1;
      }
    }
  }
}

void Q5_K::quantize_row(const float* src, void* dst, int64_t n) {
  check_blocks("Q5_K", n, kBlock);
  auto* blocks = static_cast<Block*>(dst);
  uint8_t q[256];
  for (int64_t b = 0; b < n / kBlock; ++b, src += kBlock) {
    Block& blk = blocks[b];
    quantize_k_asymmetric(src, 31, &blk.d, &blk.dmin, blk.scales, q);
    std::memset(blk.qh, 0, sizeof blk.qh);
    for (int j = 0; j < 4; ++j) {
      for (int l = 0; l < 32; ++l) {
        const int q0 = q[64 * j + l], q1 = q[64 * j + 32 + l];
        blk.qs[32 * j + l] = uint8_t((q0 & 0xF) | (q1 & 0xF) << 4);
        blk.qh[l] |= uint8_t((q0 >> 4) << (2 * j) | (q1 >> 4) << (2 * j + 1));
      }
    }
  }
}

// ---- Q6_K -----------------------------------------------------------------------------------

void Q6_K::dequantize_row(const void* src, float* dst, int64_t n) {
  check_blocks("Q6_K", n, kBlock);
  const auto* blocks = static_cast<const Block*>(src);
  for (int64_t b = 0; b < n / kBlock; ++b, dst += kBlock) {
    const Block& blk = blocks[b];
    const float d = half(blk.d);
    for (int h = 0; h < 2; ++h) {  // two halves of 128 elements
      const uint8_t* ql = blk.ql + 64 * h;
      const uint8_t* qh = blk.qh + 32 * h;
      const int8_t* sc = blk.scales + 8 * h;
      float* y = dst + 128 * h;
      for (int l = 0; l < 32; ++l) {
        const int g = l / 16;  // sub-block of 16 within each 32-element quarter
        const int q0 = ((ql[l] & 0xF) | ((qh[l] >> 0) & 3) << 4) - 32;
        const int q1 = ((ql[l + 32] & 0xF) | ((qh[l] >> 2) & 3) << 4) - 32;
        const int q2 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
        const int q3 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
        y[l] = d * float(sc[g]) * float(q0);
        y[l + 32] = d * float(sc[g + 2]) * float(q1);
        y[l + 64] = d * float(sc[g + 4]) * float(q2);
        y[l + 96] = d * float(sc[g + 6]) * float(q3);
      }
    }
  }
}

void Q6_K::quantize_row(const float* src, void* dst, int64_t n) {
  check_blocks("Q6_K", n, kBlock);
  auto* blocks = static_cast<Block*>(dst);
  for (int64_t b = 0; b < n / kBlock; ++b, src += kBlock) {
    Block& blk = blocks[b];
    // Per 16-element sub-block, the signed extreme maps to -32 (the extra negative level).
    float scale[16];
    float max_abs_scale = 0.f;
    for (int s = 0; s < 16; ++s) {
      float extreme = 0.f;
      for (int i = 16 * s; i < 16 * s + 16; ++i) if (std::fabs(src[i]) > std::fabs(extreme)) extreme = src[i];
      scale[s] = extreme / -32.f;
      max_abs_scale = std::max(max_abs_scale, std::fabs(scale[s]));
    }
    blk.d = f32_to_f16(max_abs_scale / 127.f);
    const float d = half(blk.d);
    uint8_t q[256];
    for (int s = 0; s < 16; ++s) {
      blk.scales[s] = int8_t(d > 0.f ? clamp_int(round_int(scale[s] / d), -128, 127) : 0);
      const float step = d * float(blk.scales[s]);
      for (int i = 16 * s; i < 16 * s + 16; ++i)
        q[i] = uint8_t(step != 0.f ? clamp_int(round_int(src[i] / step) + 32, 0, 63) : 32);
    }
    std::memset(blk.qh, 0, sizeof blk.qh);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* qq = q + 128 * h;
      uint8_t* ql = blk.ql + 64 * h;
      uint8_t* qh = blk.qh + 32 * h;
      for (int l = 0; l < 32; ++l) {
        ql[l] = uint8_t((qq[l] & 0xF) | (qq[l + 64] & 0xF) << 4);
        ql[l + 32] = uint8_t((qq[l + 32] & 0xF) | (qq[l + 96] & 0xF) << 4);
        qh[l] = uint8_t((qq[l] >> 4) | (qq[l + 32] >> 4) << 2 | (qq[l + 64] >> 4) << 4 | (qq[l + 96] >> 4) << 6);
      }
    }
  }
}

}  // namespace quant

// ---- runtime dispatch -----------------------------------------------------------------------

namespace {

struct FormatEntry {
  DType dtype;
  int64_t block;
  int64_t block_bytes;
  void (*dequantize)(const void*, float*, int64_t);
  void (*quantize)(const float*, void*, int64_t);
};

template <typename F>
constexpr FormatEntry entry() {
  return {F::kDType, F::kBlock, F::kBlockBytes, &F::dequantize_row, &F::quantize_row};
}

constexpr FormatEntry kFormats[] = {entry<quant::Q4_0>(), entry<quant::Q4_1>(), entry<quant::Q5_0>(),
                                    entry<quant::Q5_1>(), entry<quant::Q8_0>(),
                                    entry<quant::Q4_K>(), entry<quant::Q5_K>(), entry<quant::Q6_K>()};

const FormatEntry* find_format(DType t) {
  for (const auto& f : kFormats)
    if (f.dtype == t) return &f;
  return nullptr;
}

}  // namespace

bool is_quantized(DType t) { return find_format(t) != nullptr; }

int64_t block_size(DType t) {
  const FormatEntry* f = find_format(t);
  return f ? f->block : 1;
}

int64_t block_bytes(DType t) {
  const FormatEntry* f = find_format(t);
  return f ? f->block_bytes : int64_t(dtype_size(t));
}

int64_t row_bytes(DType t, int64_t cols) {
  const int64_t block = block_size(t);
  if (cols % block != 0)
    fail("{} row of {} elements is not a whole number of {}-element blocks", dtype_name(t), cols, block);
  return cols / block * block_bytes(t);
}

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  if (const FormatEntry* f = find_format(t)) return f->dequantize(src, dst, n);
  const auto* p = static_cast<const uint8_t*>(src);
  switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = f16_to_f32(h);
      }
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        dst[i] = bf16_to_f32(h);
      }
      return;
    default: fail("dequantize_row: dtype {} is neither float nor quantized", dtype_name(t));
  }
}

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
  if (const FormatEntry* f = find_format(t)) return f->quantize(src, dst, n);
  auto* p = static_cast<uint8_t*>(dst);
  switch (t) {
    case DType::F32: std::memcpy(dst, src, size_t(n) * 4); return;
    case DType::F16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_f16(src[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      return;
    case DType::BF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(src[i]);
        std::memcpy(p + 2 * i, &h, 2);
      }
      return;
    default: fail("quantize_row: dtype {} is neither float nor quantized", dtype_name(t));
  }
}

}  // namespace turbospark
