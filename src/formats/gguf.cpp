#include "formats/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/quant.h"

namespace turbospark {

std::string_view gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::U8: return "UINT8";
    case GgufType::I8: return "INT8";
    case GgufType::U16: return "UINT16";
    case GgufType::I16: return "INT16";
    case GgufType::U32: return "UINT32";
    case GgufType::I32: return "INT32";
    case GgufType::F32: return "FLOAT32";
    case GgufType::BOOL: return "BOOL";
    case GgufType::STRING: return "STRING";
    case GgufType::ARRAY: return "ARRAY";
    case GgufType::U64: return "UINT64";
    case GgufType::I64: return "INT64";
    case GgufType::F64: return "FLOAT64";
  }
  return "unknown";
}

std::string_view ggml_type_name(uint32_t ggml_type) {
  // ggml's enum ggml_type; gaps are numbers ggml has retired (4, 5: Q4_2/Q4_3; 31-33 and
  // 36-38: repacked Q4_0/IQ4_NL variants that are no longer written to files).
  static constexpr std::string_view kNames[] = {
      "F32",     "F16",    "Q4_0",    "Q4_1",   "Q4_2",   "Q4_3",     "Q5_0",     "Q5_1",
      "Q8_0",    "Q8_1",   "Q2_K",    "Q3_K",   "Q4_K",   "Q5_K",     "Q6_K",     "Q8_K",
      "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",  "IQ4_NL", "IQ3_S",    "IQ2_S",    "IQ4_XS",
      "I8",      "I16",    "I32",     "I64",    "F64",    "IQ1_M",    "BF16",     "Q4_0_4_4",
      "Q4_0_4_8", "Q4_0_8_8", "TQ1_0", "TQ2_0", "IQ4_NL_4_4", "IQ4_NL_4_8", "IQ4_NL_8_8", "MXFP4",
      "NVFP4",   "Q1_0"};
  return ggml_type < std::size(kNames) ? kNames[ggml_type] : "unknown";
}

bool dtype_from_ggml(uint32_t ggml_type, DType* out) {
  switch (ggml_type) {
    case 0: *out = DType::F32; return true;
    case 1: *out = DType::F16; return true;
    case 2: *out = DType::Q4_0; return true;
    case 3: *out = DType::Q4_1; return true;
    case 6: *out = DType::Q5_0; return true;
    case 7: *out = DType::Q5_1; return true;
    case 8: *out = DType::Q8_0; return true;
    case 12: *out = DType::Q4_K; return true;
    case 13: *out = DType::Q5_K; return true;
    case 14: *out = DType::Q6_K; return true;
    case 26: *out = DType::I32; return true;
    case 27: *out = DType::I64; return true;
    case 30: *out = DType::BF16; return true;
    default: return false;
  }
}

// ---- GgufValue ----------------------------------------------------------------------------

bool GgufValue::is_integer() const {
  switch (type_) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16:
    case GgufType::U32: case GgufType::I32: case GgufType::U64: case GgufType::I64: return true;
    default: return false;
  }
}

namespace {
bool is_signed(GgufType t) {
  return t == GgufType::I8 || t == GgufType::I16 || t == GgufType::I32 || t == GgufType::I64;
}
}  // namespace

uint64_t GgufValue::as_u64(std::string_view what) const {
  if (!is_integer()) fail("{} is {}, expected an integer", what, gguf_type_name(type_));
  if (is_signed(type_)) {
    if (i_ < 0) fail("{} is {}, expected a non-negative integer", what, i_);
    return uint64_t(i_);
  }
  return u_;
}

int64_t GgufValue::as_i64(std::string_view what) const {
  if (!is_integer()) fail("{} is {}, expected an integer", what, gguf_type_name(type_));
  if (is_signed(type_)) return i_;
  if (u_ > uint64_t(std::numeric_limits<int64_t>::max())) fail("{} = {} does not fit int64", what, u_);
  return int64_t(u_);
}

double GgufValue::as_f64(std::string_view what) const {
  if (!is_float()) fail("{} is {}, expected FLOAT32 or FLOAT64", what, gguf_type_name(type_));
  return f_;
}

bool GgufValue::as_bool(std::string_view what) const {
  if (type_ != GgufType::BOOL) fail("{} is {}, expected BOOL", what, gguf_type_name(type_));
  return u_ != 0;
}

const std::string& GgufValue::as_str(std::string_view what) const {
  if (type_ != GgufType::STRING) fail("{} is {}, expected STRING", what, gguf_type_name(type_));
  return str_;
}

const std::vector<GgufValue>& GgufValue::as_array(std::string_view what) const {
  if (type_ != GgufType::ARRAY) fail("{} is {}, expected ARRAY", what, gguf_type_name(type_));
  return items_;
}

nlohmann::json GgufValue::to_json() const {
  switch (type_) {
    case GgufType::BOOL: return u_ != 0;
    case GgufType::STRING: return str_;
    case GgufType::F32: case GgufType::F64: return f_;
    case GgufType::ARRAY: {
      nlohmann::json a = nlohmann::json::array();
      for (const auto& v : items_) a.push_back(v.to_json());
      return a;
    }
    default: return is_signed(type_) ? nlohmann::json(i_) : nlohmann::json(u_);
  }
}

// ---- GgufTensor ---------------------------------------------------------------------------

int64_t GgufTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::string GgufTensor::dims_str() const {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// ---- parser -------------------------------------------------------------------------------

namespace {
constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr int kMaxDims = 4;              // GGML_MAX_DIMS
// Nested arrays recurse; a hostile file could nest deep enough to overflow the stack.
constexpr int kMaxArrayDepth = 8;

uint32_t byteswap32(uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0xff00) | ((v << 8) & 0xff0000) | (v << 24);
}

// Smallest encoding of one value of type t, to bound counts by the bytes that remain.
uint64_t min_value_bytes(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::U64: case GgufType::I64: case GgufType::F64: case GgufType::STRING: return 8;
    case GgufType::ARRAY: return 12;
  }
  return 1;
}

bool known_value_type(uint32_t t) { return t <= uint32_t(GgufType::F64); }
}  // namespace

class GgufParser {
 public:
  explicit GgufParser(GgufFile& f) : f_(f), base_(f.file_.data()), size_(f.file_.size()) {}

  void parse() {
    const std::string& path = f_.path();
    if (size_ < 4) fail("{}: truncated GGUF file ({} bytes, no magic)", path, size_);
    const uint32_t magic = read<uint32_t>("magic");
    if (magic != kMagic) {
      fail("{}: not a GGUF file (magic {:02x} {:02x} {:02x} {:02x}, expected 'GGUF')", path, base_[0],
           base_[1], base_[2], base_[3]);
    }
    const uint32_t version = read<uint32_t>("version");
    if (version != 2 && version != 3) {
      const uint32_t swapped = byteswap32(version);
      if (swapped >= 1 && swapped <= 3) fail("{}: big-endian GGUF (version {}) is not supported", path, swapped);
      if (version == 1) fail("{}: GGUF version 1 is not supported (only versions 2 and 3)", path);
      fail("{}: unsupported GGUF version {} (only versions 2 and 3)", path, version);
    }
    f_.version_ = version;
    const uint64_t n_tensors = read<uint64_t>("tensor_count");
    const uint64_t n_kv = read<uint64_t>("kv_count");
    // Every tensor info takes at least 24 bytes and every key/value at least 13, so counts
    // beyond what the file could hold are corruption, refused before anything is reserved.
    if (n_tensors > remaining() / 24)
      fail("{}: tensor_count {} is implausible for a {}-byte file", path, n_tensors, size_);
    if (n_kv > remaining() / 13) fail("{}: kv_count {} is implausible for a {}-byte file", path, n_kv, size_);

    for (uint64_t k = 0; k < n_kv; ++k) parse_kv(k);
    read_alignment();

    f_.tensors_.reserve(size_t(n_tensors));
    for (uint64_t t = 0; t < n_tensors; ++t) parse_tensor_info(t);

    const uint64_t data_offset = (pos_ + f_.alignment_ - 1) / f_.alignment_ * f_.alignment_;
    f_.data_offset_ = data_offset;
    place_tensors(data_offset);
  }

 private:
  uint64_t remaining() const { return size_ - pos_; }

  void need(uint64_t bytes, std::string_view what) const {
    if (bytes > remaining())
      fail("{}: truncated file reading {} at offset {} ({} bytes needed, {} left)", f_.path(), what, pos_, bytes,
           remaining());
  }

  template <typename T>
  T read(std::string_view what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(std::string_view what) {
    const uint64_t len = read<uint64_t>(what);
    if (len > remaining())
      fail("{}: {}: string length {} at offset {} runs past the end of the file ({} bytes)", f_.path(), what, len,
           pos_ - 8, size_);
    std::string s(reinterpret_cast<const char*>(base_ + pos_), size_t(len));
    pos_ += len;
    return s;
  }

  // Reads one value of type t into v; `what` names it ("metadata KEY") for errors.
  void read_value(GgufValue& v, GgufType t, const std::string& what, int depth) {
    v.type_ = t;
    switch (t) {
      case GgufType::U8: v.u_ = read<uint8_t>(what); break;
      case GgufType::I8: v.i_ = read<int8_t>(what); break;
      case GgufType::U16: v.u_ = read<uint16_t>(what); break;
      case GgufType::I16: v.i_ = read<int16_t>(what); break;
      case GgufType::U32: v.u_ = read<uint32_t>(what); break;
      case GgufType::I32: v.i_ = read<int32_t>(what); break;
      case GgufType::U64: v.u_ = read<uint64_t>(what); break;
      case GgufType::I64: v.i_ = read<int64_t>(what); break;
      case GgufType::F32: v.f_ = read<float>(what); break;
      case GgufType::F64: v.f_ = read<double>(what); break;
      case GgufType::BOOL: {
        const uint8_t b = read<uint8_t>(what);
        if (b > 1) fail("{}: {}: BOOL byte is {}, expected 0 or 1", f_.path(), what, b);
        v.u_ = b;
        break;
      }
      case GgufType::STRING: v.str_ = read_string(what); break;
      case GgufType::ARRAY: {
        if (depth >= kMaxArrayDepth)
          fail("{}: {}: arrays nested deeper than {} levels", f_.path(), what, kMaxArrayDepth);
        const uint32_t elem = read<uint32_t>(what);
        if (!known_value_type(elem)) fail("{}: {}: unknown array element type {}", f_.path(), what, elem);
        v.elem_type_ = GgufType(elem);
        const uint64_t n = read<uint64_t>(what);
        if (n > remaining() / min_value_bytes(v.elem_type_))
          fail("{}: {}: array of {} {} runs past the end of the file ({} bytes)", f_.path(), what, n,
               gguf_type_name(v.elem_type_), size_);
        v.items_.resize(size_t(n));
        for (auto& item : v.items_) read_value(item, v.elem_type_, what, depth + 1);
        break;
      }
    }
  }

  void parse_kv(uint64_t index) {
    const std::string key = read_string(fmt::format("metadata key #{}", index));
    const std::string what = "metadata " + key;
    if (key.empty()) fail("{}: metadata key #{} is empty", f_.path(), index);
    const uint32_t type = read<uint32_t>(what);
    if (!known_value_type(type)) fail("{}: {} has unknown value type {}", f_.path(), what, type);
    GgufValue v;
    read_value(v, GgufType(type), what, 0);
    if (!f_.metadata_.emplace(key, std::move(v)).second) fail("{}: duplicate metadata key {}", f_.path(), key);
  }

  void read_alignment() {
    const GgufValue* a = f_.find_value("general.alignment");
    if (!a) return;
    if (a->type() != GgufType::U32)
      fail("{}: metadata general.alignment is {}, expected UINT32", f_.path(), gguf_type_name(a->type()));
    const uint64_t v = a->as_u64("general.alignment");
    if (v == 0 || (v & (v - 1)) != 0) fail("{}: metadata general.alignment = {} is not a power of two", f_.path(), v);
    f_.alignment_ = v;
  }

  // blocks x bytes a block, refused past 2^62 bytes: the element bound alone let an F32 tensor of
  // 2^62 elements wrap its byte count to 0, which then passed every bounds check (found by
  // fuzz_gguf: a 0-byte buffer written 4 bytes a value).
  size_t checked_bytes(uint64_t blocks, uint64_t bytes_per_block, const std::string& what) const {
    constexpr uint64_t kMaxBytes = uint64_t(1) << 62;
    if (bytes_per_block != 0 && blocks > kMaxBytes / bytes_per_block)
      fail("{}: {} has implausible dims ({} blocks of {} bytes)", f_.path(), what, blocks, bytes_per_block);
    return size_t(blocks * bytes_per_block);
  }

  void parse_tensor_info(uint64_t index) {
    const std::string& path = f_.path();
    GgufTensor t;
    t.name = read_string(fmt::format("tensor #{} name", index));
    if (t.name.empty()) fail("{}: tensor #{} has an empty name", path, index);
    const std::string what = "tensor " + t.name;
    const uint32_t n_dims = read<uint32_t>(what);
    if (n_dims < 1 || n_dims > kMaxDims) fail("{}: {} has {} dims (1 to {} allowed)", path, what, n_dims, kMaxDims);
    uint64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t ne = read<uint64_t>(what);
      // Bounding every dim and the product by 2^62 keeps all later size arithmetic exact.
      constexpr uint64_t kMaxElems = uint64_t(1) << 62;
      if (ne > kMaxElems || (ne != 0 && numel > kMaxElems / ne))
        fail("{}: {} has implausible dims (ne{} = {})", path, what, d, ne);
      numel *= ne;
      t.dims.push_back(int64_t(ne));
    }
    t.ggml_type = read<uint32_t>(what);
    t.offset = read<uint64_t>(what);
    if (t.ggml_type == kGgmlMxfp4) {
      // Raw bytes: blocks of 32 values as { u8 E8M0 scale, 16 bytes of nibbles }; only the
      // architecture mappings that know the layout read them (gguf_model.cpp).
      t.dtype = DType::U8;
      if (t.dims[0] % kGgmlMxfp4Block != 0)
        fail("{}: tensor {}: ne0 = {} is not a multiple of the MXFP4 block size {}", path, t.name, t.dims[0],
             kGgmlMxfp4Block);
      t.nbytes = checked_bytes(numel / kGgmlMxfp4Block, kGgmlMxfp4BlockBytes, what);
    } else {
      if (!dtype_from_ggml(t.ggml_type, &t.dtype))
        fail("{}: tensor {} has unsupported ggml type {} ({})", path, t.name, t.ggml_type, ggml_type_name(t.ggml_type));
      const int64_t block = block_size(t.dtype);
      if (t.dims[0] % block != 0)
        fail("{}: tensor {}: ne0 = {} is not a multiple of the {} block size {}", path, t.name, t.dims[0],
             dtype_name(t.dtype), block);
      t.nbytes = checked_bytes(numel / uint64_t(block), uint64_t(block_bytes(t.dtype)), what);
    }
    if (t.offset % f_.alignment_ != 0)
      fail("{}: tensor {}: data offset {} is not a multiple of the alignment {}", path, t.name, t.offset,
           f_.alignment_);
    if (!f_.tensor_index_.emplace(t.name, f_.tensors_.size()).second)
      fail("{}: duplicate tensor name {}", path, t.name);
    f_.tensors_.push_back(std::move(t));
  }

  void place_tensors(uint64_t data_offset) {
    const std::string& path = f_.path();
    const uint64_t data_bytes = data_offset <= size_ ? size_ - data_offset : 0;
    for (auto& t : f_.tensors_) {
      if (t.offset > data_bytes || t.nbytes > data_bytes - t.offset)
        fail("{}: tensor {}: data [{}, {}) runs past the end of the file ({} bytes)", path, t.name,
             data_offset + t.offset, data_offset + t.offset + t.nbytes, size_);
      t.data = base_ + data_offset + t.offset;
    }
    std::vector<const GgufTensor*> by_offset;
    for (const auto& t : f_.tensors_) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(),
              [](const GgufTensor* a, const GgufTensor* b) { return a->offset < b->offset; });
    for (size_t i = 1; i < by_offset.size(); ++i) {
      const GgufTensor* a = by_offset[i - 1];
      const GgufTensor* b = by_offset[i];
      if (a->offset + a->nbytes > b->offset) fail("{}: tensors {} and {} overlap in the data section", path, a->name, b->name);
    }
  }

  GgufFile& f_;
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
};

// ---- GgufFile -----------------------------------------------------------------------------

GgufFile::GgufFile(const std::string& path) : file_(path) { GgufParser(*this).parse(); }

const GgufValue* GgufFile::find_value(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {
const GgufValue& require(const GgufFile& f, const std::string& key) {
  const GgufValue* v = f.find_value(key);
  if (!v) fail("{}: missing metadata {}", f.path(), key);
  return *v;
}
std::string what(const GgufFile& f, const std::string& key) { return f.path() + ": metadata " + key; }
}  // namespace

uint32_t GgufFile::get_u32(const std::string& key) const {
  const uint64_t v = require(*this, key).as_u64(what(*this, key));
  if (v > std::numeric_limits<uint32_t>::max()) fail("{} = {} does not fit uint32", what(*this, key), v);
  return uint32_t(v);
}

uint32_t GgufFile::get_u32(const std::string& key, uint32_t fallback) const {
  return has(key) ? get_u32(key) : fallback;
}

uint64_t GgufFile::get_u64(const std::string& key) const { return require(*this, key).as_u64(what(*this, key)); }

int64_t GgufFile::get_i64(const std::string& key) const { return require(*this, key).as_i64(what(*this, key)); }

float GgufFile::get_f32(const std::string& key) const { return float(require(*this, key).as_f64(what(*this, key))); }

float GgufFile::get_f32(const std::string& key, float fallback) const {
  return has(key) ? get_f32(key) : fallback;
}

bool GgufFile::get_bool(const std::string& key, bool fallback) const {
  return has(key) ? require(*this, key).as_bool(what(*this, key)) : fallback;
}

const std::string& GgufFile::get_str(const std::string& key) const {
  return require(*this, key).as_str(what(*this, key));
}

std::string GgufFile::get_str(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_str(key) : fallback;
}

std::vector<std::string> GgufFile::get_str_arr(const std::string& key) const {
  const std::string w = what(*this, key);
  std::vector<std::string> out;
  for (const auto& v : require(*this, key).as_array(w)) out.push_back(v.as_str(w + " element"));
  return out;
}

std::vector<int64_t> GgufFile::get_int_arr(const std::string& key) const {
  const std::string w = what(*this, key);
  std::vector<int64_t> out;
  for (const auto& v : require(*this, key).as_array(w)) out.push_back(v.as_i64(w + " element"));
  return out;
}

std::vector<float> GgufFile::get_f32_arr(const std::string& key) const {
  const std::string w = what(*this, key);
  std::vector<float> out;
  for (const auto& v : require(*this, key).as_array(w)) out.push_back(float(v.as_f64(w + " element")));
  return out;
}

nlohmann::json GgufFile::metadata_json(size_t max_array) const {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [key, v] : metadata_) {
    if (v.type() == GgufType::ARRAY && v.as_array(key).size() > max_array) {
      j[key] = fmt::format("[{} x {}]", v.as_array(key).size(), gguf_type_name(v.elem_type()));
    } else {
      j[key] = v.to_json();
    }
  }
  return j;
}

const GgufTensor* GgufFile::find(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

const GgufTensor& GgufFile::get(const std::string& name) const {
  const GgufTensor* t = find(name);
  if (!t) fail("{}: missing tensor {}", path(), name);
  return *t;
}

WeightView GgufFile::weight(const std::string& name) const {
  const GgufTensor& t = get(name);
  if (t.ggml_type == kGgmlMxfp4) fail("{}: tensor {}: ggml MXFP4 is read only as gpt-oss experts", path(), name);
  WeightView w;
  w.dtype = t.dtype;
  w.data = t.data;
  w.cols = t.dims[0];
  w.rows = t.dims[0] == 0 ? 0 : t.numel() / t.dims[0];
  w.row_bytes = row_bytes(t.dtype, w.cols);
  return w;
}

}  // namespace turbospark
