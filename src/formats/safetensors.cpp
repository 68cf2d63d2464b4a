#include "formats/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/quant.h"
#include "core/quant_grouped.h"
#include "formats/gguf.h"
#include "formats/gguf_model.h"

namespace turbospark {

namespace fs = std::filesystem;
using nlohmann::json;

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

static std::string shape_str(const std::vector<int64_t>& shape) {
  TensorInfo t;
  t.shape = shape;
  return t.shape_str();
}

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const size_t size = file_.size();
  if (size < 8) fail("{}: truncated safetensors file ({} bytes, no header length)", path, size);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= uint64_t(file_.data()[i]) << (8 * i);
  // The safetensors library's own bound (MAX_HEADER_SIZE): parsed, a header takes about 13
  // times its size in memory (a 78 MB header of a million tensors: 1 GB, 3.8 s on the dev VM).
  constexpr uint64_t kMaxHeaderBytes = 100'000'000;
  if (header_len > kMaxHeaderBytes)
    fail("{}: safetensors header of {} bytes is larger than the limit of {} bytes", path, header_len, kMaxHeaderBytes);
  if (header_len > size - 8) {
    fail("{}: truncated safetensors file (header of {} bytes, file has {})", path, header_len, size);
  }
  json header;
  try {
    header = json::parse(file_.data() + 8, file_.data() + 8 + header_len);
  } catch (const json::exception& e) {
    fail("{}: malformed safetensors header JSON: {}", path, e.what());
  }
  if (!header.is_object()) fail("{}: safetensors header is not a JSON object", path);
  const uint8_t* base = file_.data() + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string& name = it.key();
    const json& e = it.value();
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets")) {
      fail("{}: tensor {}: header entry needs dtype, shape and data_offsets", path, name);
    }
    TensorInfo t;
    t.name = name;
    if (!e["dtype"].is_string() || !dtype_from_safetensors(e["dtype"].get<std::string>(), &t.dtype)) {
      fail("{}: tensor {}: unsupported dtype {}", path, name, e["dtype"].dump());
    }
    if (!e["shape"].is_array()) fail("{}: tensor {}: shape is not an array", path, name);
    // Elements and bytes bounded by 2^62 as each dim is taken, so no product below wraps (a
    // wrapped byte count could even equal the data range's length; fuzz_safetensors found the
    // signed overflow).
    constexpr uint64_t kMaxBytes = uint64_t(1) << 62;
    const uint64_t elem_bytes = std::max<uint64_t>(1, dtype_size(t.dtype));
    uint64_t elems = 1;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail("{}: tensor {}: bad shape {}", path, name, e["shape"].dump());
      const uint64_t n = uint64_t(d.get<int64_t>());
      if (n != 0 && elems > kMaxBytes / elem_bytes / n)
        fail("{}: tensor {}: implausible shape {} (its {} values pass 2^62 bytes)", path, name, e["shape"].dump(),
             dtype_name(t.dtype));
      elems *= n;
      t.shape.push_back(int64_t(n));
    }
    const json& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned()) {
      fail("{}: tensor {}: bad data_offsets {}", path, name, off.dump());
    }
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (b > en || en > data_size) {
      fail("{}: tensor {}: data_offsets [{}, {}] past the end of the data ({} bytes; file truncated?)", path, name,
           b, en, data_size);
    }
    const uint64_t want = elems * elem_bytes;
    if (en - b != want) {
      fail("{}: tensor {}: {} bytes for {} {} (expected {})", path, name, en - b, dtype_name(t.dtype),
           t.shape_str(), want);
    }
    t.data = base + b;
    t.nbytes = size_t(want);
    t.file = &file_.path();
    ranges.emplace_back(b, en);
    tensors_.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) fail("{}: tensor data ranges overlap", path);
  }
}

// ---- packed weight formats (MXFP4, INT4_AFFINE): see the comment on Checkpoint ----------

static bool is_weight_dtype(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32 || is_quantized(t); }

// NAME without a trailing ".weight": the prefix MLX's .scales/.biases and gpt-oss's
// _blocks/_scales hang off.
static std::string weight_stem(const std::string& name) {
  static const std::string kSuffix = ".weight";
  if (name.size() > kSuffix.size() && name.compare(name.size() - kSuffix.size(), kSuffix.size(), kSuffix) == 0)
    return name.substr(0, name.size() - kSuffix.size());
  return name;
}

static int64_t checked_group_size(const json& v, const std::string& where) {
  if (!v.is_number_integer()) fail("{}.group_size must be an integer, got {}", where, v.dump());
  const int64_t g = v.get<int64_t>();
  if (g != 32 && g != 64 && g != 128) fail("{}.group_size {} is not supported (32, 64 or 128)", where, g);
  return g;
}

static void check_affine_bits(const json& q, const std::string& where) {
  if (!q.contains("bits")) fail("{}: no bits field", where);
  if (!q["bits"].is_number_integer() || q["bits"].get<int64_t>() != 4)
    fail("{}.bits {} is not supported (only 4-bit affine)", where, q["bits"].dump());
}

QuantConfig read_quant_config(const std::string& dir) {
  QuantConfig qc;
  const fs::path path = fs::path(dir) / "config.json";
  std::error_code ec;
  if (!fs::exists(path, ec)) return qc;
  json j;
  try {
    j = json::parse(read_text_file(path.string()));
  } catch (const json::exception&) {
    return qc;  // the config reader reports malformed JSON with its own message
  }
  if (!j.is_object()) return qc;
  const char* key = nullptr;
  for (const char* k : {"quantization_config", "quantization"}) {
    if (j.contains(k) && j[k].is_object()) {
      key = k;
      break;
    }
  }
  if (!key) return qc;
  const json& q = j[key];
  const std::string where = path.string() + ": " + key;
  qc.source = where;
  if (q.contains("quant_method")) {
    const std::string m = q["quant_method"].is_string() ? q["quant_method"].get<std::string>() : q["quant_method"].dump();
    if (m == "mxfp4") {
      qc.method = QuantConfig::Method::kMxfp4;
      return qc;
    }
    if (m != "mlx" && m != "affine") fail("{}.quant_method {} is not supported (mxfp4, or MLX affine 4-bit)", where, m);
  }
  const std::string mode = q.contains("mode") && q["mode"].is_string() ? q["mode"].get<std::string>() : "affine";
  if (mode != "affine") fail("{}.mode {} is not supported (only affine)", where, mode);
  check_affine_bits(q, where);
  if (!q.contains("group_size")) fail("{}: no group_size field", where);
  qc.method = QuantConfig::Method::kInt4Affine;
  qc.group_size = checked_group_size(q["group_size"], where);
  // MLX per-module overrides: "model.layers.0.mlp.gate": {"group_size": 64, "bits": 4} or false.
  for (auto it = q.begin(); it != q.end(); ++it) {
    if (it.value().is_boolean() && !it.value().get<bool>()) {
      qc.group_overrides[it.key()] = 0;
    } else if (it.value().is_object()) {
      const std::string w = where + "." + it.key();
      check_affine_bits(it.value(), w);
      qc.group_overrides[it.key()] =
          it.value().contains("group_size") ? checked_group_size(it.value()["group_size"], w) : qc.group_size;
    }
  }
  return qc;
}

bool Checkpoint::has(const std::string& name) const {
  if (find(name)) return true;
  return quant_.method == QuantConfig::Method::kMxfp4 && find(weight_stem(name) + "_blocks") != nullptr;
}

// The packed view of NAME (expert `index` of `n` when index >= 0), or a view with null data
// when NAME is stored as a plain tensor.
WeightView Checkpoint::packed_view(const std::string& name, int64_t index, int64_t n, int64_t rows,
                                   int64_t cols) const {
  const std::string stem = weight_stem(name);
  auto lead = [&](std::vector<int64_t> tail) {
    if (index >= 0) tail.insert(tail.begin(), n);
    return tail;
  };
  const int64_t k = index < 0 ? 0 : index;
  WeightView w;
  const TensorInfo* t = find(name);
  if (!t && quant_.method == QuantConfig::Method::kMxfp4 && find(stem + "_blocks")) {
    const TensorInfo& blocks = get(stem + "_blocks");
    const TensorInfo* scales = find(stem + "_scales");
    if (!scales) fail("{}: tensor {}_blocks has no {}_scales beside it", *blocks.file, stem, stem);
    if (blocks.dtype != DType::U8 || scales->dtype != DType::U8)
      fail("{}: tensor {}_blocks/_scales: dtypes {}/{} where U8/U8 is expected", *blocks.file, stem,
           dtype_name(blocks.dtype), dtype_name(scales->dtype));
    if (blocks.shape.empty() || std::vector<int64_t>(blocks.shape.begin(), blocks.shape.end() - 1) != scales->shape)
      fail("{}: tensor {}_blocks: shape {} disagrees with {}_scales {}", *blocks.file, stem, blocks.shape_str(), stem,
           scales->shape_str());
    if (cols % mxfp4::kGroup != 0)
      fail("{}: tensor {}_blocks: MXFP4 rows of {} elements are not whole 32-element blocks", *blocks.file, stem, cols);
    const auto want = lead({rows, cols / mxfp4::kGroup, mxfp4::kGroupBytes});
    if (blocks.shape != want)
      fail("{}: tensor {}_blocks: shape {} where {} is expected", *blocks.file, stem, blocks.shape_str(), shape_str(want));
    w.dtype = DType::MXFP4;
    w.rows = rows;
    w.cols = cols;
    w.row_bytes = cols / 2;
    w.data = blocks.data + k * rows * w.row_bytes;
    w.group_size = int32_t(mxfp4::kGroup);
    w.scales_dtype = DType::U8;
    w.scales_row_bytes = cols / mxfp4::kGroup;
    w.scales = scales->data + k * rows * w.scales_row_bytes;
    return w;
  }
  if (!t || t->dtype != DType::U32 || quant_.method != QuantConfig::Method::kInt4Affine) return w;
  int64_t gs = quant_.group_size;
  // MLX keys overrides by module path (the stem without "model." variations kept verbatim).
  if (auto it = quant_.group_overrides.find(stem); it != quant_.group_overrides.end()) {
    if (it->second == 0) fail("{}: tensor {} is uint32 but {} marks {} as not quantized", *t->file, name, quant_.source, stem);
    gs = it->second;
  }
  if (cols % gs != 0)
    fail("{}: tensor {}: group_size {} ({}) does not divide its rows of {} elements", *t->file, name, gs, quant_.source,
         cols);
  const auto want = lead({rows, cols / int4_affine::kPerWord});
  if (t->shape != want)
    fail("{}: tensor {}: INT4_AFFINE packed shape {} where {} is expected (uint32, 8 codes per word)", *t->file, name,
         t->shape_str(), shape_str(want));
  const TensorInfo& scales = get(stem + ".scales");
  const TensorInfo& biases = get(stem + ".biases");
  const auto want_plane = lead({rows, cols / gs});
  for (const TensorInfo* p : {&scales, &biases}) {
    if (!int4_affine::is_plane_dtype(p->dtype))
      fail("{}: tensor {}: dtype {} where BF16, F16 or F32 is expected", *p->file, p->name, dtype_name(p->dtype));
    if (p->shape != want_plane)
      fail("{}: tensor {}: shape {} where {} is expected (group_size {})", *p->file, p->name, p->shape_str(),
           shape_str(want_plane), gs);
  }
  if (scales.dtype != biases.dtype)
    fail("{}: tensors {} and {} have different dtypes ({}, {})", *scales.file, scales.name, biases.name,
         dtype_name(scales.dtype), dtype_name(biases.dtype));
  w.dtype = DType::INT4_AFFINE;
  w.rows = rows;
  w.cols = cols;
  w.row_bytes = cols / 2;
  w.data = t->data + k * rows * w.row_bytes;
  w.group_size = int32_t(gs);
  w.scales_dtype = scales.dtype;
  w.scales_row_bytes = cols / gs * int64_t(dtype_size(scales.dtype));
  w.biases_row_bytes = w.scales_row_bytes;
  w.scales = scales.data + k * rows * w.scales_row_bytes;
  w.biases = biases.data + k * rows * w.biases_row_bytes;
  return w;
}

// dst[o][i] = src[i][o] for an [in, out] matrix of ES-byte elements, in tiles that keep both
// sides in cache (an element-at-a-time walk strides dst by a whole row per element and takes
// tens of seconds per gpt-oss layer). Elements are copied bytewise: safetensors data need not
// be aligned.
template <size_t ES>
static void transpose_elements(const uint8_t* src, uint8_t* dst, int64_t in, int64_t out) {
  constexpr int64_t kTile = 64;
  for (int64_t i0 = 0; i0 < in; i0 += kTile) {
    const int64_t i1 = std::min(in, i0 + kTile);
    for (int64_t o0 = 0; o0 < out; o0 += kTile) {
      const int64_t o1 = std::min(out, o0 + kTile);
      for (int64_t o = o0; o < o1; ++o) {
        uint8_t* d = dst + size_t(o * in) * ES;
        for (int64_t i = i0; i < i1; ++i) std::memcpy(d + size_t(i) * ES, src + size_t(i * out + o) * ES, ES);
      }
    }
  }
}

WeightView Checkpoint::expert_matrix(const std::string& name, int64_t index, int64_t n, int64_t rows, int64_t cols,
                                     StackLayout layout) const {
  const bool transposed = layout == StackLayout::kInOut;
  record_use(name, MatrixUse{true, transposed, rows, cols});
  if (index < 0 || index >= n) fail("{}: expert {} of tensor {} out of range [0, {})", dir_, index, name, n);
  WeightView packed = packed_view(name, index, n, rows, cols);
  if (packed.data) return packed;
  if (!transposed) return matrix_in_stack(name, index, n, rows, cols);
  const TensorInfo& t = get(name);
  if (!is_weight_dtype(t.dtype) || is_quantized(t.dtype))
    fail("{}: tensor {}: dtype {} where a float dtype is expected", *t.file, name, dtype_name(t.dtype));
  if (t.shape != std::vector<int64_t>{n, cols, rows})
    fail("{}: tensor {}: shape {} where [{}, {}, {}] ([experts, in, out]) is expected", *t.file, name, t.shape_str(), n,
         cols, rows);
  const size_t es = dtype_size(t.dtype);
  auto owned = std::make_unique<uint8_t[]>(size_t(rows * cols) * es);
  const uint8_t* src = t.data + size_t(index * rows * cols) * es;
  switch (es) {
    case 2: transpose_elements<2>(src, owned.get(), cols, rows); break;
    case 4: transpose_elements<4>(src, owned.get(), cols, rows); break;
    default: fail("{}: tensor {}: cannot transpose {}-byte elements", *t.file, name, es);
  }
  WeightView w;
  w.dtype = t.dtype;
  w.data = owned.get();
  w.rows = rows;
  w.cols = cols;
  w.row_bytes = cols * int64_t(es);
  transposed_.push_back(std::move(owned));
  return w;
}

Checkpoint::~Checkpoint() = default;

Checkpoint::Checkpoint(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec)) fail("{}: no such file or directory", path);
  if (is_gguf_path(path)) {
    dir_ = path;
    gguf_ = std::make_unique<GgufFile>(path);
    gguf_tensors_ = gguf_hf_tensors(*gguf_, owned_);
    for (const TensorInfo& t : gguf_tensors_) {
      if (!index_.emplace(t.name, &t).second) fail("{}: tensor {} appears twice", path, t.name);
      // gpt-oss's MXFP4 experts, repacked into transformers' planes (gguf_model.cpp).
      if (t.name.ends_with("_blocks")) {
        quant_.method = QuantConfig::Method::kMxfp4;
        quant_.source = path + ": ggml MXFP4 experts";
      }
    }
    return;
  }
  std::vector<std::string> shard_paths;
  if (fs::is_directory(path, ec)) {
    dir_ = path;
    fs::path index = fs::path(path) / "model.safetensors.index.json";
    if (fs::exists(index)) {
      json j;
      try {
        j = json::parse(read_text_file(index.string()));
      } catch (const json::exception& e) {
        fail("{}: malformed JSON: {}", index.string(), e.what());
      }
      if (!j.contains("weight_map") || !j["weight_map"].is_object()) fail("{}: no weight_map object", index.string());
      for (auto& [name, file] : j["weight_map"].items()) {
        if (!file.is_string()) fail("{}: weight_map entry {} is not a file name", index.string(), name);
        // Shards live beside the index: a path elsewhere (absolute, "..", a subfolder) or a
        // name the file system would cut short is refused, not opened.
        const std::string shard = file.get<std::string>();
        if (shard.empty() || shard == "." || shard == ".." || shard.find_first_of(std::string_view("/\0", 2)) != std::string::npos)
          fail("{}: weight_map entry {} names {:?}, not a file beside the index", index.string(), name, shard);
        std::string p = (fs::path(path) / shard).string();
        if (std::find(shard_paths.begin(), shard_paths.end(), p) == shard_paths.end()) shard_paths.push_back(p);
      }
    } else {
      for (const auto& entry : fs::directory_iterator(path)) {
        if (entry.path().extension() == ".safetensors") shard_paths.push_back(entry.path().string());
      }
      std::sort(shard_paths.begin(), shard_paths.end());
    }
    if (shard_paths.empty()) {
      if (fs::exists(index)) fail("{}: weight_map names no shard", index.string());
      fail("{}: no *.safetensors files (and no model.safetensors.index.json)", path);
    }
  } else {
    dir_ = fs::path(path).parent_path().string();
    if (dir_.empty()) dir_ = ".";
    shard_paths.push_back(path);
  }
  for (const auto& p : shard_paths) {
    files_.push_back(std::make_unique<SafetensorsFile>(p));
    for (const auto& [name, info] : files_.back()->tensors()) {
      if (!index_.emplace(name, &info).second) fail("{}: tensor {} appears in two shards", p, name);
    }
  }
  quant_ = read_quant_config(dir_);
}

std::vector<const MappedFile*> Checkpoint::mapped_files() const {
  std::vector<const MappedFile*> out;
  if (gguf_) out.push_back(&gguf_->file());  // GGUF files were left out of prefault before
  for (const auto& f : files_) out.push_back(&f->file());
  return out;
}

int64_t Checkpoint::total_bytes() const {
  int64_t total = 0;
  for (const MappedFile* f : mapped_files()) total += int64_t(f->size());
  return total;
}

std::vector<std::pair<int64_t, int64_t>> complement_ranges(int64_t size, std::vector<std::pair<int64_t, int64_t>> skip) {
  std::sort(skip.begin(), skip.end());
  std::vector<std::pair<int64_t, int64_t>> keep;
  int64_t at = 0;
  for (const auto& [b, e] : skip) {
    const int64_t lo = std::clamp<int64_t>(b, 0, size), hi = std::clamp<int64_t>(e, 0, size);
    if (lo > at) keep.emplace_back(at, lo);
    at = std::max(at, hi);
  }
  if (at < size) keep.emplace_back(at, size);
  return keep;
}

void Checkpoint::prefault(const std::function<void(int64_t, int64_t)>& progress, const SkipRanges& skip) const {
  const int64_t total = total_bytes();
  int64_t before = 0;
  for (const MappedFile* f : mapped_files()) {
    const auto it = skip.find(f->path());
    const std::vector<std::pair<int64_t, int64_t>> keep =
        it == skip.end() ? std::vector<std::pair<int64_t, int64_t>>{{0, int64_t(f->size())}}
                         : complement_ranges(int64_t(f->size()), it->second);
    int64_t done_here = 0;
    for (const auto& [b, e] : keep) {
      f->prefault(size_t(b), size_t(e - b), [&](size_t done) {
        if (progress) progress(before + done_here + int64_t(done), total);
      });
      done_here += e - b;
    }
    before += int64_t(f->size());
    if (progress) progress(before, total);
  }
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

const TensorInfo& Checkpoint::get(const std::string& name) const {
  const TensorInfo* t = find(name);
  if (!t) fail("{}: missing tensor {}", dir_, name);
  return *t;
}


WeightView Checkpoint::matrix(const std::string& name, int64_t rows, int64_t cols) const {
  record_use(name, MatrixUse{false, false, rows, cols});
  if (WeightView packed = packed_view(name, -1, 0, rows, cols); packed.data) return packed;
  const TensorInfo& t = get(name);
  if (!is_weight_dtype(t.dtype)) fail("{}: tensor {}: dtype {} where a float or quantized dtype is expected", *t.file, name, dtype_name(t.dtype));
  if (t.shape != std::vector<int64_t>{rows, cols}) {
    fail("{}: tensor {}: shape {} where [{}, {}] is expected", *t.file, name, t.shape_str(), rows, cols);
  }
  WeightView w;
  w.dtype = t.dtype;
  w.data = t.data;
  w.rows = rows;
  w.cols = cols;
  w.row_bytes = row_bytes(t.dtype, cols);
  return w;
}

WeightView Checkpoint::matrix_in_stack(const std::string& name, int64_t index, int64_t n, int64_t rows,
                                       int64_t cols) const {
  record_use(name, MatrixUse{true, false, rows, cols});
  if (WeightView packed = packed_view(name, index, n, rows, cols); packed.data) return packed;
  const TensorInfo& t = get(name);
  if (!is_weight_dtype(t.dtype)) fail("{}: tensor {}: dtype {} where a float or quantized dtype is expected", *t.file, name, dtype_name(t.dtype));
  if (t.shape != std::vector<int64_t>{n, rows, cols}) {
    fail("{}: tensor {}: shape {} where [{}, {}, {}] is expected", *t.file, name, t.shape_str(), n, rows, cols);
  }
  WeightView w;
  w.dtype = t.dtype;
  w.row_bytes = row_bytes(t.dtype, cols);
  w.data = t.data + index * rows * w.row_bytes;
  w.rows = rows;
  w.cols = cols;
  return w;
}

std::vector<float> Checkpoint::floats(const std::string& name, const std::vector<int64_t>& shape) const {
  const TensorInfo& t = get(name);
  if (t.shape != shape) fail("{}: tensor {}: shape {} where {} is expected", *t.file, name, t.shape_str(), shape_str(shape));
  if (!is_weight_dtype(t.dtype)) fail("{}: tensor {}: dtype {} where a float dtype is expected", *t.file, name, dtype_name(t.dtype));
  std::vector<float> out(size_t(t.numel()));
  dequantize_row(t.dtype, t.data, out.data(), t.numel());
  return out;
}

}  // namespace turbospark

namespace turbospark {

void write_safetensors(const std::string& path, const std::vector<TensorWriteSpec>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<uint64_t> sizes;
  for (const auto& t : tensors) {
    uint64_t n = dtype_size(t.dtype);
    for (int64_t d : t.shape) n *= uint64_t(d);
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))}, {"shape", t.shape}, {"data_offsets", {offset, offset + n}}};
    offset += n;
    sizes.push_back(n);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // keep the data section 8-byte aligned
  std::unique_ptr<FILE, int (*)(FILE*)> f(std::fopen(path.c_str(), "wb"), std::fclose);
  if (!f) fail("{}: cannot open for writing", path);
  uint64_t hlen = text.size();
  uint8_t len_bytes[8];
  for (int i = 0; i < 8; ++i) len_bytes[i] = uint8_t(hlen >> (8 * i));
  if (std::fwrite(len_bytes, 1, 8, f.get()) != 8 || std::fwrite(text.data(), 1, text.size(), f.get()) != text.size()) {
    fail("{}: write failed", path);
  }
  std::vector<uint8_t> buf;
  for (size_t i = 0; i < tensors.size(); ++i) {
    buf.resize(sizes[i]);
    tensors[i].fill(buf.data(), buf.size());
    if (std::fwrite(buf.data(), 1, buf.size(), f.get()) != buf.size()) fail("{}: write failed at tensor {}", path, tensors[i].name);
  }
}

int64_t Checkpoint::n_parameters(const std::function<bool(const std::string&)>& skip) const {
  auto ends_with = [](const std::string& s, std::string_view suffix) {
    return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  int64_t params = 0;
  for (const auto& [name, t] : index_) {
    if (skip && skip(name)) continue;
    int64_t n = t->numel();
    if (quant_.method == QuantConfig::Method::kInt4Affine) {
      const std::string stem = ends_with(name, ".weight") ? name.substr(0, name.size() - 7) : name;
      if ((ends_with(name, ".scales") || ends_with(name, ".biases")) && t->dtype != DType::U32) {
        const std::string base = name.substr(0, name.size() - 7);
        if (has(base + ".weight") || has(base)) continue;
      }
      if (t->dtype == DType::U32 && has(stem + ".scales")) n *= 8;
    } else if (quant_.method == QuantConfig::Method::kMxfp4) {
      if (ends_with(name, "_scales") && has(name.substr(0, name.size() - 7) + "_blocks")) continue;
      if (ends_with(name, "_blocks") && t->dtype == DType::U8) n *= 2;
    }
    params += n;
  }
  return params;
}

}  // namespace turbospark
