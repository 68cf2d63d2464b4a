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

// Quantization a checkpoint declares in the config.json beside it (read when the
// checkpoint opens; see Checkpoint below for the tensors each method implies).
struct QuantConfig {
  enum class Method : uint8_t { kNone, kMxfp4, kInt4Affine };
  Method method = Method::kNone;
  int64_t group_size = 0;                        // INT4_AFFINE default group size
  std::map<std::string, int64_t> group_overrides;  // MLX per-module entries; 0 = not quantized
  std::string source;                            // "DIR/config.json: quantization", for errors
};

// The quantization entry of DIR/config.json (kNone without one); an unsupported quant_method,
// mode, bits or group size is refused naming the field.
QuantConfig read_quant_config(const std::string& dir);

// Routed-expert stacks come in two layouts: [n, out, in] (Qwen-MoE fused experts, every
// packed format) and [n, in, out] (gpt-oss's bf16 gate_up_proj/down_proj).
enum class StackLayout : uint8_t { kOutIn, kInOut };

// What a model asked the checkpoint for, by name (Checkpoint::matrix_uses): a plain matrix
// [rows, cols] or a routed-expert stack [n, rows, cols] (transposed: stored [n, cols, rows]).
// `turbospark convert` quantizes exactly these tensors.
struct MatrixUse {
  bool expert_stack = false;
  bool transposed = false;
  int64_t rows = 0, cols = 0;
};

// All tensors of a checkpoint directory (or a single .safetensors file), by name.
//
// Packed weight formats (core/quant_grouped.h) are resolved here, once, for every family:
// matrix(), matrix_in_stack() and expert_matrix() return a WeightView of dtype MXFP4 or
// INT4_AFFINE whose scale (and bias) planes point into the mapped file, and the backends run
// them directly. Given a requested NAME and its stem (NAME without a trailing ".weight"):
//   - config "quantization" or "quantization_config" {"group_size": 32|64|128, "bits": 4,
//     "mode": "affine"} (MLX): NAME is uint32 [.., rows, cols / 8] with STEM.scales and
//     STEM.biases [.., rows, cols / group_size]; tensors still stored as floats load as before.
//   - config "quantization_config" {"quant_method": "mxfp4"} (gpt-oss): when NAME is absent,
//     STEM_blocks uint8 [.., rows, cols / 32, 16] and STEM_scales uint8 [.., rows, cols / 32]
//     stand for it, always in [out, in] order; has(NAME) is true for them.
// Any other quant_method, bits or mode is refused by name when the checkpoint opens.
//
// Loader API for routed experts (gpt-oss, Qwen-MoE, ...): expert e of a fused stack as a
// [rows = out, cols = in] matrix, bf16 or packed alike:
//   Weight w;
//   w.view = ckpt.expert_matrix("model.layers.3.mlp.experts.gate_up_proj", e, n_experts,
//                               2 * inter, hidden, StackLayout::kInOut);  // gpt-oss bf16 layout
//   w.expert = e; w.residency = Residency::kStreamedExpert;
// and view.rows_slice() for a row range of it (e.g. the up half of a gate-first gate_up).
// [0, size) minus the union of the [begin, end) ranges in skip, in order (Checkpoint::prefault).
std::vector<std::pair<int64_t, int64_t>> complement_ranges(int64_t size, std::vector<std::pair<int64_t, int64_t>> skip);

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
  // True when NAME is stored, or stands for an MXFP4 NAME_blocks/NAME_scales pair.
  bool has(const std::string& name) const;
  // Throws "missing tensor NAME in DIR" when absent.
  const TensorInfo& get(const std::string& name) const;
  const std::map<std::string, const TensorInfo*>& all() const { return index_; }
  int64_t total_bytes() const;
  // Faults every shard's pages in (see MappedFile::prefault), reporting bytes done; byte
  // ranges in `skip` (file path -> [begin, end) pairs, e.g. streamed experts) are left out.
  using SkipRanges = std::map<std::string, std::vector<std::pair<int64_t, int64_t>>>;
  void prefault(const std::function<void(int64_t done, int64_t total)>& progress, const SkipRanges& skip = {}) const;
  // The mapped files behind the tensors: the shards, or the one GGUF file.
  std::vector<const MappedFile*> mapped_files() const;

  // A matrix weight [rows, cols] of a float dtype (BF16, F16, F32); a wrong dtype or shape
  // is refused naming the tensor, the expected and the found value.
  WeightView matrix(const std::string& name, int64_t rows, int64_t cols) const;
  // A vector/tensor converted to float32 with the expected shape (norm weights, biases).
  std::vector<float> floats(const std::string& name, const std::vector<int64_t>& shape) const;
  // A slice of a 3-D [n, rows, cols] tensor as matrix `index` (fused expert stacks).
  WeightView matrix_in_stack(const std::string& name, int64_t index, int64_t n, int64_t rows,
                             int64_t cols) const;
  // Routed expert `index` of a stack `name` as a [rows, cols] (out, in) matrix, whatever the
  // storage: packed MXFP4/INT4_AFFINE ([n, rows, ...]), or floats in `layout` (kInOut float
  // stacks are transposed once into memory this checkpoint owns).
  WeightView expert_matrix(const std::string& name, int64_t index, int64_t n, int64_t rows, int64_t cols,
                           StackLayout layout = StackLayout::kOutIn) const;

  const QuantConfig& quantization() const { return quant_; }
  // Logical parameters: packed INT4 words count 8 each, MXFP4 block bytes 2 each, and the
  // scale/bias planes of packed weights count nothing.
  // `skip` leaves out tensors by name (e.g. a vision tower's).
  int64_t n_parameters(const std::function<bool(const std::string&)>& skip = {}) const;
  // Every name requested through matrix(), matrix_in_stack() or expert_matrix() so far.
  const std::map<std::string, MatrixUse>& matrix_uses() const { return uses_; }

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> index_;
  std::unique_ptr<GgufFile> gguf_;
  std::vector<TensorInfo> gguf_tensors_;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;  // rewritten tensor data (GGUF)

  void record_use(const std::string& name, const MatrixUse& use) const { uses_[name] = use; }
  WeightView packed_view(const std::string& name, int64_t index, int64_t n, int64_t rows, int64_t cols) const;
  QuantConfig quant_;
  mutable std::map<std::string, MatrixUse> uses_;
  mutable std::vector<std::unique_ptr<uint8_t[]>> transposed_;  // kInOut float experts, [rows, cols]
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
