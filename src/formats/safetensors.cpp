#include "formats/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/quant.h"
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
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail("{}: tensor {}: bad shape {}", path, name, e["shape"].dump());
      t.shape.push_back(d.get<int64_t>());
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
    uint64_t want = uint64_t(t.numel()) * dtype_size(t.dtype);
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
        std::string p = (fs::path(path) / file.get<std::string>()).string();
        if (std::find(shard_paths.begin(), shard_paths.end(), p) == shard_paths.end()) shard_paths.push_back(p);
      }
    } else {
      for (const auto& entry : fs::directory_iterator(path)) {
        if (entry.path().extension() == ".safetensors") shard_paths.push_back(entry.path().string());
      }
      std::sort(shard_paths.begin(), shard_paths.end());
    }
    if (shard_paths.empty()) fail("{}: no *.safetensors files (and no model.safetensors.index.json)", path);
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
}

int64_t Checkpoint::total_bytes() const {
  int64_t total = 0;
  for (const auto& f : files_) total += int64_t(f->file().size());
  return total;
}

void Checkpoint::prefault(const std::function<void(int64_t, int64_t)>& progress) const {
  const int64_t total = total_bytes();
  int64_t before = 0;
  for (const auto& f : files_) {
    f->file().prefault(0, f->file().size(), [&](size_t done) {
      if (progress) progress(before + int64_t(done), total);
    });
    before += int64_t(f->file().size());
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

static bool is_weight_dtype(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32 || is_quantized(t); }

WeightView Checkpoint::matrix(const std::string& name, int64_t rows, int64_t cols) const {
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

}  // namespace turbospark
