// GGUF files (llama.cpp's single-file checkpoints), versions 2 and 3, little-endian.
// The file is memory-mapped and everything in it is validated at open, before any value or
// tensor is handed out: magic, version, counts against the file size, every string and
// array inside the file, metadata value types, tensor ranks, dims, ggml types (an
// unsupported one is refused by name and number), byte sizes against type and dims,
// data ranges inside the file, aligned and not overlapping, and duplicate names. A corrupt
// or unsupported file therefore fails at open with one line naming the file and the key or
// tensor at fault, never later as a crash.
//
// Layout (all integers little-endian; a string is a u64 byte length then the bytes, no NUL):
//   u32 magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
//   kv_count x  { string key | u32 value_type | value }
//   tensor_count x { string name | u32 n_dims | u64 ne[n_dims] | u32 ggml_type | u64 offset }
//   padding to general.alignment (default 32) | tensor data (offsets are relative to here)
// ne[0] is the fastest-varying dimension: a [rows, cols] matrix is stored as ne = {cols, rows}.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/mapped_file.h"
#include "core/tensor.h"

namespace turbospark {

// GGUF metadata value types (the numbers are the file's).
enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};
std::string_view gguf_type_name(GgufType t);

// Name of a ggml tensor type number ("Q4_K", "IQ1_S", ...; "unknown" for numbers ggml has
// never used), for messages.
std::string_view ggml_type_name(uint32_t ggml_type);
// The engine dtype of a ggml tensor type; false when the engine has no kernels for it.
bool dtype_from_ggml(uint32_t ggml_type, DType* out);
// ggml's MXFP4 (gpt-oss experts): a GgufTensor of this type has dtype U8 and nbytes of its
// 17-byte blocks of 32 values ({ u8 E8M0 scale, u8 nibbles[16] }, value j in the low nibble of
// byte j and value j + 16 in its high nibble); gguf_model.cpp repacks it.
inline constexpr uint32_t kGgmlMxfp4 = 39;
inline constexpr uint64_t kGgmlMxfp4Block = 32, kGgmlMxfp4BlockBytes = 17;

// One metadata value. Integers keep their signedness in one 64-bit field each, floats are
// widened to double, arrays hold their elements (which may themselves be arrays).
class GgufValue {
 public:
  GgufType type() const { return type_; }
  // Element type of an ARRAY value.
  GgufType elem_type() const { return elem_type_; }
  bool is_integer() const;
  bool is_float() const { return type_ == GgufType::F32 || type_ == GgufType::F64; }

  // Typed access; each throws Error (naming `what`, usually "FILE: metadata KEY") when the
  // value has another type or does not fit the requested one.
  uint64_t as_u64(std::string_view what) const;
  int64_t as_i64(std::string_view what) const;
  double as_f64(std::string_view what) const;  // F32 or F64
  bool as_bool(std::string_view what) const;
  const std::string& as_str(std::string_view what) const;
  const std::vector<GgufValue>& as_array(std::string_view what) const;

  // Strings are copied as their bytes, which need not be UTF-8 (byte-level vocabularies):
  // dump() the result with error_handler_t::replace.
  nlohmann::json to_json() const;

 private:
  friend class GgufParser;
  GgufType type_ = GgufType::U8;
  GgufType elem_type_ = GgufType::U8;
  uint64_t u_ = 0;  // unsigned integers and BOOL
  int64_t i_ = 0;   // signed integers
  double f_ = 0;
  std::string str_;
  std::vector<GgufValue> items_;
};

struct GgufTensor {
  std::string name;
  uint32_t ggml_type = 0;
  DType dtype = DType::F32;
  std::vector<int64_t> dims;  // ne0 first (fastest-varying)
  uint64_t offset = 0;        // relative to the data section
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  // "[ne0, ne1, ...]" as the file orders them.
  std::string dims_str() const;
};

class GgufFile {
 public:
  // Maps and validates `path`; throws Error naming the file and the field or tensor at fault.
  explicit GgufFile(const std::string& path);

  const std::string& path() const { return file_.path(); }
  const MappedFile& file() const { return file_; }
  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  // Start of the tensor data section (absolute file offset).
  uint64_t data_offset() const { return data_offset_; }

  // Metadata by key (sorted, not in file order).
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const GgufValue* find_value(const std::string& key) const;
  bool has(const std::string& key) const { return find_value(key) != nullptr; }
  // Typed getters: throw "FILE: missing metadata KEY" when absent, or a type error naming
  // the key; the overloads with a fallback return it when the key is absent (but still
  // refuse a present value of the wrong type).
  uint32_t get_u32(const std::string& key) const;
  uint32_t get_u32(const std::string& key, uint32_t fallback) const;
  uint64_t get_u64(const std::string& key) const;
  int64_t get_i64(const std::string& key) const;
  float get_f32(const std::string& key) const;
  float get_f32(const std::string& key, float fallback) const;
  bool get_bool(const std::string& key, bool fallback) const;
  const std::string& get_str(const std::string& key) const;
  std::string get_str(const std::string& key, const std::string& fallback) const;
  std::vector<std::string> get_str_arr(const std::string& key) const;
  std::vector<int64_t> get_int_arr(const std::string& key) const;
  std::vector<float> get_f32_arr(const std::string& key) const;
  // All metadata as JSON (arrays longer than `max_array` elements are summarised), for
  // `inspect` and debugging.
  nlohmann::json metadata_json(size_t max_array = SIZE_MAX) const;

  // Tensors in file order.
  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* find(const std::string& name) const;
  // Throws "FILE: missing tensor NAME" when absent.
  const GgufTensor& get(const std::string& name) const;
  // A tensor as a 2-D weight [rows = ne1 * ne2 * ..., cols = ne0], as stored.
  WeightView weight(const std::string& name) const;

 private:
  MappedFile file_;
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> tensor_index_;

  friend class GgufParser;
};

}  // namespace turbospark
