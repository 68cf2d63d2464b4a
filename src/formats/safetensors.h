// safetensors checkpoints: one file or a sharded set with model.safetensors.index.json.
// Files are memory-mapped; every header entry is validated against the file (dtype known,
// offsets inside the data section, size == numel * dtype size, no overlaps) before any
// tensor is handed out, so a corrupt file fails at open with one line naming the file and
// tensor, never later as a crash.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/mapped_file.h"
#include "core/tensor.h"

namespace turbospark {

class GgufFile;

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  const std::string* file = nullptr;  // the shard it lives in, for error messages

  int64_t numel() const;
  std::string shape_str() const;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::string& path() const { return file_.path(); }
  const MappedFile& file() const { return file_; }

 private:
  MappedFile file_;
  std::map<std::string, TensorInfo> tensors_;
};

// All tensors of a checkpoint directory (or a single .safetensors file), by name.
class Checkpoint {
 public:
  // `path` is a directory holding model.safetensors.index.json or *.safetensors, one
  // .safetensors file, or a .gguf file (tensors under their Hugging Face names, see
  // formats/gguf_model.h).
  explicit Checkpoint(const std::string& path);
  ~Checkpoint();

  bool is_gguf() const { return gguf_ != nullptr; }
  const GgufFile* gguf() const { return gguf_.get(); }

  const std::string& dir() const { return dir_; }
  const TensorInfo* find(const std::string& name) const;
  bool has(const std::string& name) const { return find(name) != nullptr; }
  // Throws "missing tensor NAME in DIR" when absent.
  const TensorInfo& get(const std::string& name) const;
  const std::map<std::string, const TensorInfo*>& all() const { return index_; }
  int64_t total_bytes() const;
  // Faults every shard's pages in (see MappedFile::prefault), reporting bytes done.
  void prefault(const std::function<void(int64_t done, int64_t total)>& progress) const;

  // A matrix weight [rows, cols] of a float dtype (BF16, F16, F32); a wrong dtype or shape
  // is refused naming the tensor, the expected and the found value.
  WeightView matrix(const std::string& name, int64_t rows, int64_t cols) const;
  // A vector/tensor converted to float32 with the expected shape (norm weights, biases).
  std::vector<float> floats(const std::string& name, const std::vector<int64_t>& shape) const;
  // A slice of a 3-D [n, rows, cols] tensor as matrix `index` (fused expert stacks).
  WeightView matrix_in_stack(const std::string& name, int64_t index, int64_t n, int64_t rows,
                             int64_t cols) const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> index_;
  std::unique_ptr<GgufFile> gguf_;
  std::vector<TensorInfo> gguf_tensors_;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;  // rewritten tensor data (GGUF)
};

}  // namespace turbospark

namespace turbospark {

// One tensor to write: `fill` writes exactly numel * dtype_size bytes into dst.
struct TensorWriteSpec {
  std::string name;
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;
  std::function<void(uint8_t* dst, size_t nbytes)> fill;
};

// Writes a safetensors file tensor by tensor, so a multi-GiB checkpoint never sits in
// memory whole. Tensors are laid out in the given order.
void write_safetensors(const std::string& path, const std::vector<TensorWriteSpec>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace turbospark
