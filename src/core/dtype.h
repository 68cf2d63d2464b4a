// Element types as stored in checkpoints, and the scalar conversions every backend's
// reference path uses. Quantized formats get their own type with a scalar dequantizer
// (see quant formats as they land); models never branch on a dtype.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace turbospark {

// Q4_0 ... Q5_1 are ggml's block-quantized formats (byte layouts in core/quant.h); their
// elements are not whole bytes, so dtype_size is 0 for them and row sizes come from
// row_bytes() in core/quant.h.
enum class DType : uint8_t { F32, F16, BF16, I64, I32, U8, U32, Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K,
                            Q5_0, Q5_1,
                            // Grouped formats whose scales (and biases) live in separate planes of
                            // the checkpoint (WeightView::scales/biases; core/quant_grouped.h).
                            MXFP4, INT4_AFFINE, kCount };

std::string_view dtype_name(DType t);
// Bytes per element for whole-byte dtypes; 0 for block-quantized ones (see core/quant.h).
size_t dtype_size(DType t);
// Parses a safetensors dtype string ("BF16", "F32", ...); returns false when unknown.
bool dtype_from_safetensors(std::string_view s, DType* out);

inline float bf16_to_f32(uint16_t h) {
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Round to nearest even, as torch does; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t((bits + rounding) >> 16);
}

float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);

}  // namespace turbospark
