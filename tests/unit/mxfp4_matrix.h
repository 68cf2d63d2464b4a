// A random packed MXFP4 matrix [rows, cols] held in host memory, with its view (unit tests).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace turbospark::testing {

struct Mxfp4Matrix {
  std::vector<uint8_t> blocks, scales;
  WeightView view;
  // Uniform code bytes, e8m0 scales uniform in [scale_lo, scale_hi] (2^(e - 127)).
  Mxfp4Matrix(int64_t rows, int64_t cols, std::mt19937& rng, int scale_lo = 118, int scale_hi = 130) {
    blocks.resize(size_t(rows * cols / 2));
    scales.resize(size_t(rows * cols / 32));
    std::uniform_int_distribution<int> byte(0, 255), sc(scale_lo, scale_hi);
    for (auto& b : blocks) b = uint8_t(byte(rng));
    for (auto& s : scales) s = uint8_t(sc(rng));
    view.dtype = DType::MXFP4;
    view.data = blocks.data();
    view.rows = rows;
    view.cols = cols;
    view.row_bytes = cols / 2;
    view.scales = scales.data();
    view.scales_row_bytes = cols / 32;
    view.group_size = 32;
  }
};

}  // namespace turbospark::testing
