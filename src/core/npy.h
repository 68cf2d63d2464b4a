// NumPy .npy files (version 1.0, little-endian float32, C order): the logits and router
// outputs the CLI writes, and the golden arrays the tests read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace turbospark {

struct NpyArray {
  std::vector<int64_t> shape;
  std::vector<float> data;
};

void write_npy_f32(const std::string& path, const std::vector<int64_t>& shape, const float* data);
// Reads a float32 ('<f4') C-order array; throws Error naming the file otherwise.
NpyArray read_npy_f32(const std::string& path);

}  // namespace turbospark
