#include "core/quant_grouped.h"

#include <algorithm>
#include <cfloat>
#include <cstring>

#include "core/error.h"
#include "core/quant.h"

namespace turbospark {

namespace mxfp4 {

void dequantize_row(const uint8_t* blocks, const uint8_t* scales, float* dst, int64_t cols) {
  for (int64_t g = 0; g < cols / kGroup; ++g) {
    const float s = e8m0_to_float(scales[g]);
    const uint8_t* b = blocks + g * kGroupBytes;
    float* d = dst + g * kGroup;
    for (int k = 0; k < kGroupBytes; ++k) {
      d[2 * k] = kFp4Values[b[k] & 0xF] * s;
      d[2 * k + 1] = kFp4Values[b[k] >> 4] * s;
    }
  }
}

namespace {

// Nearest FP4 magnitude code (0..7) for a >= 0 already divided by the scale; ties go to the
// code with an even mantissa bit (0, 1, 2, 4, 6 are "even": codes 0, 2, 4, 6).
uint8_t fp4_magnitude_code(float a) {
  if (a <= 0.25f) return 0;
  if (a < 0.75f) return 1;
  if (a <= 1.25f) return 2;
  if (a < 1.75f) return 3;
  if (a <= 2.5f) return 4;
  if (a < 3.5f) return 5;
  if (a <= 5.0f) return 6;
  return 7;
}

}  // namespace

void quantize_row(const float* src, uint8_t* blocks, uint8_t* scales, int64_t cols) {
  for (int64_t g = 0; g < cols / kGroup; ++g) {
    const float* x = src + g * kGroup;
    float amax = 0.f;
    for (int i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(x[i]));
    int e = -127;
    if (amax > 0.f && std::isfinite(amax)) {
      int k;
      const float m = std::frexp(amax, &k) * 2.f;  // amax = m * 2^(k-1), m in [1, 2)
      e = (k - 1) - 2 + (m > 1.5f ? 1 : 0);           // smallest e with 6 * 2^e >= amax
      e = std::clamp(e, -127, 127);
    }
    scales[g] = uint8_t(e + 127);
    const float inv = std::ldexp(1.0f, -e);
    uint8_t* b = blocks + g * kGroupBytes;
    for (int k = 0; k < kGroupBytes; ++k) {
      uint8_t code[2];
      for (int h = 0; h < 2; ++h) {
        const float v = x[2 * k + h] * inv;
        const uint8_t mag = fp4_magnitude_code(std::fabs(v));
        code[h] = uint8_t(v < 0.f && mag != 0 ? mag | 8 : mag);
      }
      b[k] = uint8_t(code[0] | code[1] << 4);
    }
  }
}

}  // namespace mxfp4

namespace int4_affine {

bool is_plane_dtype(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32; }

float plane_value(DType t, const void* plane, int64_t i) {
  const auto* p = static_cast<const uint8_t*>(plane);
  switch (t) {
    case DType::F32: {
      float f;
      std::memcpy(&f, p + 4 * i, 4);
      return f;
    }
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return f16_to_f32(h);
    }
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, p + 2 * i, 2);
      return bf16_to_f32(h);
    }
    default: fail("INT4_AFFINE: scale/bias dtype {} is not BF16, F16 or F32", dtype_name(t));
  }
}

void set_plane_value(DType t, void* plane, int64_t i, float v) {
  auto* p = static_cast<uint8_t*>(plane);
  switch (t) {
    case DType::F32: std::memcpy(p + 4 * i, &v, 4); return;
    case DType::F16: {
      const uint16_t h = f32_to_f16(v);
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
    case DType::BF16: {
      const uint16_t h = f32_to_bf16(v);
      std::memcpy(p + 2 * i, &h, 2);
      return;
    }
    default: fail("INT4_AFFINE: scale/bias dtype {} is not BF16, F16 or F32", dtype_name(t));
  }
}

void dequantize_row(const uint8_t* packed, const void* scales, const void* biases, DType plane_dtype,
                    int64_t group_size, float* dst, int64_t cols) {
  for (int64_t g = 0; g < cols / group_size; ++g) {
    const float s = plane_value(plane_dtype, scales, g), b = plane_value(plane_dtype, biases, g);
    for (int64_t i = g * group_size; i < (g + 1) * group_size; ++i) {
      const int q = (packed[i / 2] >> (4 * (i & 1))) & 0xF;
      dst[i] = s * float(q) + b;
    }
  }
}

namespace {

// A value as a plane of dtype t stores it.
float rounded(DType t, float v) {
  uint8_t buf[4];
  set_plane_value(t, buf, 0, v);
  return plane_value(t, buf, 0);
}

// How far a plane of dtype t may move a stored scale s and bias b: the slack the round-trip
// bound allows beyond half a step (codes reach 15 steps; 8 mantissa bits for BF16, 11 F16).
float plane_slack(DType t, float s, float b) {
  const float ulp = t == DType::BF16 ? 1.f / 128.f : t == DType::F16 ? 1.f / 1024.f : 0.f;
  return ulp * (16.f * s + std::fabs(b));
}

struct AffineFit {
  float scale = 0.f, bias = 0.f;
  double sse = 0.0;  // squared error of the group's dequantized values
  bool within_bound = false;
  uint8_t q[128];
};

// Codes for one group under a stored (rounded) scale and bias, and how well they fit. Eight
// interleaved partial sums and maxima (group sizes are multiples of 32): one running sum
// was a latency chain that made this most of convert's time.
void fit_codes(const float* x, int64_t n, float s, float b, DType t, AffineFit* f) {
  f->scale = s;
  f->bias = b;
  const float inv = s > 0.f ? 1.f / s : 0.f;
  double sse[8] = {};
  float worst[8] = {}, amax[8] = {};  // float rounding of s * q + b is relative to the group's magnitude
  for (int64_t i = 0; i < n; i += 8) {
    for (int k = 0; k < 8; ++k) {
      const float xi = x[i + k];
      const float q = std::clamp(std::nearbyint((xi - b) * inv), 0.f, 15.f);
      f->q[i + k] = uint8_t(q);
      const float err = std::fabs(s * q + b - xi);
      worst[k] = std::max(worst[k], err);
      amax[k] = std::max(amax[k], std::fabs(xi));
      sse[k] += double(err) * err;
    }
  }
  for (int k = 1; k < 8; ++k) {
    sse[0] += sse[k];
    worst[0] = std::max(worst[0], worst[k]);
    amax[0] = std::max(amax[0], amax[k]);
  }
  f->sse = sse[0];
  f->within_bound = worst[0] <= 0.5f * s * (1 + 1e-5f) + plane_slack(t, s, b) + 4 * FLT_EPSILON * amax[0];
}

}  // namespace

void quantize_row(const float* src, int64_t cols, int64_t group_size, DType plane_dtype, uint8_t* packed,
                  void* scales, void* biases) {
  TS_CHECK(group_size <= 128 && group_size % 8 == 0, "int4_affine::quantize_row: group size {} (8 .. 128, a multiple of 8)",
           group_size);
  std::memset(packed, 0, size_t(cols / 2));
  AffineFit best, trial;
  for (int64_t g = 0; g < cols / group_size; ++g) {
    const float* x = src + g * group_size;
    const int64_t n = group_size;
    float lo = x[0], hi = x[0];
    for (int64_t i = 1; i < n; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
    // MLX's fit: the range split in 15 steps from the minimum.
    fit_codes(x, n, rounded(plane_dtype, (hi - lo) / 15.f), rounded(plane_dtype, lo), plane_dtype, &best);
    // Then least-squares scale and bias for the current codes, re-rounded, a few times; a
    // refit is kept when it lowers the squared error and still leaves every element within
    // half a step (plus the planes' rounding), the bound the MLX fit guarantees.
    const AffineFit* cur = &best;
    for (int it = 0; it < 4; ++it) {
      double p[4][8] = {};  // sums of q, q^2, x, q x, eight interleaved partials each
      for (int64_t i = 0; i < n; i += 8) {
        for (int k = 0; k < 8; ++k) {
          const double q = cur->q[i + k], xi = x[i + k];
          p[0][k] += q, p[1][k] += q * q, p[2][k] += xi, p[3][k] += q * xi;
        }
      }
      double sq = 0, sqq = 0, sx = 0, sqx = 0;
      for (int k = 0; k < 8; ++k) sq += p[0][k], sqq += p[1][k], sx += p[2][k], sqx += p[3][k];
      const double det = double(n) * sqq - sq * sq;
      if (det <= 0) break;
      const double sc = (double(n) * sqx - sq * sx) / det;
      if (!(sc > 0)) break;
      fit_codes(x, n, rounded(plane_dtype, float(sc)), rounded(plane_dtype, float((sx - sc * sq) / double(n))),
                plane_dtype, &trial);
      if (!trial.within_bound || trial.sse >= best.sse) break;
      best = trial;
      cur = &best;
    }
    set_plane_value(plane_dtype, scales, g, best.scale);
    set_plane_value(plane_dtype, biases, g, best.bias);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = g * group_size + i;
      packed[c / 2] = uint8_t(packed[c / 2] | best.q[i] << (4 * (c & 1)));
    }
  }
}

}  // namespace int4_affine

int64_t grouped_row_bytes(DType t, int64_t cols) {
  TS_CHECK(is_grouped(t), "grouped_row_bytes: {} is not a grouped format", dtype_name(t));
  return cols / 2;
}

void dequantize_weight_row(const WeightView& w, int64_t r, float* dst) {
  switch (w.dtype) {
    case DType::MXFP4: return mxfp4::dequantize_row(w.row(r), w.scales_row(r), dst, w.cols);
    case DType::INT4_AFFINE:
      return int4_affine::dequantize_row(w.row(r), w.scales_row(r), w.biases_row(r), w.scales_dtype, w.group_size,
                                         dst, w.cols);
    default: return dequantize_row(w.dtype, w.row(r), dst, w.cols);
  }
}

}  // namespace turbospark
