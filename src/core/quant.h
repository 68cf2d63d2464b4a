// Block-quantized weight formats, byte-compatible with ggml (GGUF files), each a type that
// owns its byte layout, block geometry, a scalar reference dequantizer and a reference
// quantizer. Backends own the fast paths (backends/cpu/quant_matmul.h); everything here is
// the ground truth they are tested against, written for clarity rather than speed.
//
// A row of a quantized matrix is a whole number of blocks: cols must be a multiple of the
// format's block size, and a WeightView of a quantized dtype has
// row_bytes = cols / block_size * block_bytes.
//
// The activation formats at the bottom (BlockQ8x32, BlockQ8_K) are what the CPU backend
// quantizes float activations into so weight x activation dot products run in integers,
// as llama.cpp does; they never appear in files.
#pragma once

#include <cstdint>

#include "core/dtype.h"

namespace turbospark {

// ---- byte layouts (ggml's block_* structs; every scale marked f16 is IEEE half) ----------

// 32 weights: w[i] = d * (q[i] - 8), q 4-bit. Element i < 16 is the low nibble of qs[i],
// element 16 + i the high nibble.
struct BlockQ4_0 {
  uint16_t d;  // f16 scale
  uint8_t qs[16];
};

// 32 weights: w[i] = d * q[i] + m, q 4-bit, nibble order as Q4_0.
struct BlockQ4_1 {
  uint16_t d;  // f16 scale
  uint16_t m;  // f16 minimum
  uint8_t qs[16];
};

// 32 weights: w[i] = d * (q[i] - 16), q 5-bit: the low 4 bits as Q4_0, the 5th bit of
// element i is bit i of qh read as a little-endian u32.
struct BlockQ5_0 {
  uint16_t d;  // f16 scale
  uint8_t qh[4];
  uint8_t qs[16];
};

// 32 weights: w[i] = d * q[i] + m, q 5-bit as Q5_0.
struct BlockQ5_1 {
  uint16_t d;  // f16 scale
  uint16_t m;  // f16 minimum
  uint8_t qh[4];
  uint8_t qs[16];
};

// 32 weights: w[i] = d * qs[i].
struct BlockQ8_0 {
  uint16_t d;  // f16 scale
  int8_t qs[32];
};

// 256 weights in 8 sub-blocks of 32: w = d * sc[s] * q - dmin * m[s], q 4-bit, sc and m
// 6-bit. `scales` packs the 8 (sc, m) pairs into 12 bytes: for s < 4, sc[s] is the low 6
// bits of scales[s] and m[s] the low 6 bits of scales[s + 4]; for s >= 4 the low 4 bits come
// from the nibbles of scales[s + 4] (sc low, m high) and the top 2 bits from the spare top
// bits of scales[s - 4] (sc) and scales[s] (m). Each 32 bytes of qs hold two sub-blocks:
// low nibbles are sub-block 2j, high nibbles sub-block 2j + 1.
struct BlockQ4_K {
  uint16_t d;     // f16 scale of the sub-block scales
  uint16_t dmin;  // f16 scale of the sub-block minimums
  uint8_t scales[12];
  uint8_t qs[128];
};

// Q4_K plus a fifth bit: bit (2j) of qh[l] is the high bit of element 64j + l and bit
// (2j + 1) that of element 64j + 32 + l (l < 32), giving q in [0, 32).
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[32];
  uint8_t qs[128];
};

// 256 weights in 16 sub-blocks of 16: w = d * scales[s] * (q - 32), q 6-bit. Each half of
// 128 elements uses 64 bytes of ql and 32 of qh: for l < 32 the four elements
// l, l + 32, l + 64, l + 96 take their low 4 bits from ql[l] low, ql[l + 32] low, ql[l] high,
// ql[l + 32] high, and their top 2 bits from bits 0-1, 2-3, 4-5, 6-7 of qh[l].
struct BlockQ6_K {
  uint8_t ql[128];
  uint8_t qh[64];
  int8_t scales[16];
  uint16_t d;  // f16, last (unlike the other formats)
};

static_assert(sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20 && sizeof(BlockQ8_0) == 34);
static_assert(sizeof(BlockQ5_0) == 22 && sizeof(BlockQ5_1) == 24);
static_assert(sizeof(BlockQ4_K) == 144 && sizeof(BlockQ5_K) == 176 && sizeof(BlockQ6_K) == 210);

// ---- activation formats (in-memory only) --------------------------------------------------

// 32 activations: x[i] ~= d * qs[i], qs in [-127, 127] (never -128, so the AVX2 sign trick
// cannot overflow), plus s = d * sum(qs) so a weight format with an offset (Q4_0's -8,
// Q5_0's -16, Q4_1's and Q5_1's m) folds it in with one multiply. ggml's Q8_1 with f32
// fields: activations keep their full-precision scale.
struct BlockQ8x32 {
  float d;
  float s;
  int8_t qs[32];
};

// 256 activations: x[i] ~= d * qs[i], qs in [-127, 127], bsums[g] = sum of qs[16g..16g+15]
// (the k-quant minimums and Q6_K's -32 need only these sums). ggml's block_q8_K layout.
struct BlockQ8_K {
  float d;
  int8_t qs[256];
  int16_t bsums[16];
};

static_assert(sizeof(BlockQ8x32) == 40 && sizeof(BlockQ8_K) == 292);

// Quantizes n floats (n % 32 == 0) to n / 32 BlockQ8x32.
void quantize_row_q8x32(const float* x, BlockQ8x32* y, int64_t n);
// Quantizes n floats (n % 256 == 0) to n / 256 BlockQ8_K.
void quantize_row_q8_K(const float* x, BlockQ8_K* y, int64_t n);

// ---- formats as types ---------------------------------------------------------------------

namespace quant {

// Each format: kDType, kBlock (elements per block), kBlockBytes, Block, and
//   dequantize_row(src, dst, n): n elements (a multiple of kBlock) of src blocks to floats;
//   quantize_row(src, dst, n): round-to-nearest reference quantizer (tests and conversion;
//     it is not llama.cpp's error-minimising search, so files it writes are slightly worse).
#define TS_QUANT_FORMAT(Name, BlockType, block)                        \
  struct Name {                                                        \
    static constexpr DType kDType = DType::Name;                       \
    static constexpr int64_t kBlock = block;                           \
    using Block = BlockType;                                           \
    static constexpr int64_t kBlockBytes = int64_t(sizeof(BlockType)); \
    static void dequantize_row(const void* src, float* dst, int64_t n); \
    static void quantize_row(const float* src, void* dst, int64_t n);  \
  }

TS_QUANT_FORMAT(Q4_0, BlockQ4_0, 32);
TS_QUANT_FORMAT(Q4_1, BlockQ4_1, 32);
TS_QUANT_FORMAT(Q5_0, BlockQ5_0, 32);
TS_QUANT_FORMAT(Q5_1, BlockQ5_1, 32);
TS_QUANT_FORMAT(Q8_0, BlockQ8_0, 32);
TS_QUANT_FORMAT(Q4_K, BlockQ4_K, 256);
TS_QUANT_FORMAT(Q5_K, BlockQ5_K, 256);
TS_QUANT_FORMAT(Q6_K, BlockQ6_K, 256);

#undef TS_QUANT_FORMAT

// Unpacks Q4_K/Q5_K's 12 scale bytes into 8 sub-block scales and 8 minimums (6-bit each).
void unpack_k4_scales(const uint8_t* packed, uint8_t* sc, uint8_t* m);
// The inverse: packs 8 scales and 8 minimums (each < 64) into 12 bytes.
void pack_k4_scales(const uint8_t* sc, const uint8_t* m, uint8_t* packed);

}  // namespace quant

// ---- runtime dispatch over DType ----------------------------------------------------------

bool is_quantized(DType t);
// Elements per block: 1 for plain element dtypes.
int64_t block_size(DType t);
// Bytes per block: dtype_size for plain element dtypes.
int64_t block_bytes(DType t);
// Bytes of one row of `cols` elements; throws Error when cols is not a multiple of the
// block size (a quantized row is whole blocks).
int64_t row_bytes(DType t, int64_t cols);
// Dequantizes (or widens) n elements of F32, F16, BF16 or any quantized dtype; n must be a
// multiple of block_size(t). Throws Error naming the dtype for integer dtypes.
void dequantize_row(DType t, const void* src, float* dst, int64_t n);
// Reference quantizer (or narrowing conversion) for the same dtypes.
void quantize_row(DType t, const float* src, void* dst, int64_t n);

}  // namespace turbospark
