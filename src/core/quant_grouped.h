// Grouped 4-bit weight formats: the packed values of a row are one plane and each group's
// scale (and bias) another, as checkpoints store them (not interleaved into blocks as in
// ggml). Both pack two 4-bit codes per byte, low nibble first: byte k of a row holds
// element 2k in its low nibble and element 2k + 1 in its high nibble.
//
//   MXFP4 (OCP microscaling, gpt-oss; transformers integrations/mxfp4.py):
//     NAME_blocks uint8 [..., rows, cols / 32, 16] and NAME_scales uint8 [..., rows, cols / 32];
//     w = kFp4Values[nibble] * 2^(scale - 127) (e8m0 scale per 32 elements), exactly what
//     transformers' convert_moe_packed_tensors computes with torch.ldexp.
//   INT4_AFFINE (MLX "affine" mode, bits 4):
//     NAME uint32 [..., rows, cols / 8] (8 codes per little-endian word, low nibble first =
//     first column, which is the byte order above), NAME.scales and NAME.biases
//     [..., rows, cols / group_size] in BF16/F16/F32; w = scale * q + bias.
//
// Everything here is the scalar ground truth the CPU kernels (backends/cpu/mxfp4.h,
// backends/cpu/int4_affine.h) are tested against; the quantizers are what `turbospark
// convert` writes.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/dtype.h"
#include "core/tensor.h"

namespace turbospark {

namespace mxfp4 {

constexpr int64_t kGroup = 32;       // elements per e8m0 scale
constexpr int64_t kGroupBytes = 16;  // packed bytes per group

// FP4 e2m1 code -> value (codes 8..15 are the negatives of 0..7).
inline constexpr float kFp4Values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(e - 127), as torch.ldexp computes it (255 gives +inf).
inline float e8m0_to_float(uint8_t e) { return std::ldexp(1.0f, int(e) - 127); }

// One row of `cols` elements (cols % 32 == 0): blocks [cols / 2] bytes, scales [cols / 32].
void dequantize_row(const uint8_t* blocks, const uint8_t* scales, float* dst, int64_t cols);
// Reference quantizer: per 32 elements the smallest power of two 2^e with 6 * 2^e >= amax
// (so nothing clips), then each element rounded to the nearest FP4 value, ties to even.
void quantize_row(const float* src, uint8_t* blocks, uint8_t* scales, int64_t cols);

}  // namespace mxfp4

namespace int4_affine {

constexpr int64_t kPerWord = 8;  // 4-bit codes per uint32

// Entry i of a scale or bias plane of dtype t (BF16, F16 or F32).
float plane_value(DType t, const void* plane, int64_t i);
// Stores v as entry i of a plane of dtype t (rounding to nearest even).
void set_plane_value(DType t, void* plane, int64_t i, float v);
bool is_plane_dtype(DType t);

// One row of `cols` elements (cols % group_size == 0, cols % 8 == 0).
void dequantize_row(const uint8_t* packed, const void* scales, const void* biases, DType plane_dtype,
                    int64_t group_size, float* dst, int64_t cols);
// Per group: MLX's fit first (scale = (max - min) / 15, bias = min), then least-squares
// refits of scale and bias for the codes, kept while they lower the squared error and leave
// every element within half a step. Codes are computed from the stored (rounded) scale and
// bias, q = round((w - bias) / scale) clamped to [0, 15], so |w - dequantized| <= scale / 2
// whenever the stored values are exact (F32 planes) and within the planes' rounding of it
// otherwise. Group sizes up to 128.
void quantize_row(const float* src, int64_t cols, int64_t group_size, DType plane_dtype, uint8_t* packed,
                  void* scales, void* biases);

}  // namespace int4_affine

// True for the formats above (their WeightViews carry scale planes).
inline bool is_grouped(DType t) { return t == DType::MXFP4 || t == DType::INT4_AFFINE; }
// Bytes of one packed row (both formats: cols / 2).
int64_t grouped_row_bytes(DType t, int64_t cols);

// Row r of any weight view (float, ggml block formats, MXFP4, INT4_AFFINE) as floats: the
// reference dequantizer every fast path is checked against. Throws Error for integer dtypes.
void dequantize_weight_row(const WeightView& w, int64_t r, float* dst);

}  // namespace turbospark
