// GGUF reader: files written here by a tiny writer (every metadata type, v2 and v3, custom
// alignment, quantized tensors) and one written by the reference writer (gguf-py,
// tests/data/quant/reference_writer.gguf from tools/gguf/make_quant_goldens.py); and every
// way a file can be broken, each refused with one line naming the file and the culprit.
// Every prefix of a valid file must be refused cleanly, and random corruption must never
// crash.
#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>

#include "core/error.h"
#include "core/quant.h"
#include "formats/gguf.h"
#include "formats/gguf_model.h"
#include "test_util.h"

namespace turbospark {
namespace {

using testing::TempDir;

// ---- a tiny GGUF writer -------------------------------------------------------------------

class Bytes {
 public:
  template <typename T>
  Bytes& put(T v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    data_.insert(data_.end(), p, p + sizeof(T));
    return *this;
  }
  Bytes& str(const std::string& s) {
    put<uint64_t>(s.size());
    data_.insert(data_.end(), s.begin(), s.end());
    return *this;
  }
  Bytes& raw(const std::vector<uint8_t>& b) {
    data_.insert(data_.end(), b.begin(), b.end());
    return *this;
  }
  std::vector<uint8_t>& data() { return data_; }

 private:
  std::vector<uint8_t> data_;
};

struct TensorSpec {
  std::string name;
  std::vector<uint64_t> dims;
  uint32_t ggml_type;
  std::vector<uint8_t> data;
  int64_t offset_override = -1;  // write this offset instead of the computed one
};

// Builds a GGUF file; each metadata entry is its already-encoded bytes (key, type, value)
// so tests can write anything, including broken values.
struct GgufBuilder {
  uint32_t magic = 0x46554747;
  uint32_t version = 3;
  uint64_t alignment = 32;
  std::vector<std::vector<uint8_t>> kvs;
  std::vector<TensorSpec> tensors;
  int64_t kv_count_override = -1;
  int64_t tensor_count_override = -1;

  template <typename T>
  GgufBuilder& kv(const std::string& key, GgufType type, T value) {
    Bytes b;
    b.str(key).put<uint32_t>(uint32_t(type)).put<T>(value);
    kvs.push_back(b.data());
    return *this;
  }
  GgufBuilder& kv_str(const std::string& key, const std::string& value) {
    Bytes b;
    b.str(key).put<uint32_t>(uint32_t(GgufType::STRING)).str(value);
    kvs.push_back(b.data());
    return *this;
  }
  GgufBuilder& kv_raw(const std::string& key, GgufType type, const std::vector<uint8_t>& value) {
    Bytes b;
    b.str(key).put<uint32_t>(uint32_t(type)).raw(value);
    kvs.push_back(b.data());
    return *this;
  }
  GgufBuilder& tensor(TensorSpec t) {
    tensors.push_back(std::move(t));
    return *this;
  }
  template <typename T>
  GgufBuilder& kv_array(const std::string& key, GgufType elem, const std::vector<T>& values) {
    Bytes b;
    b.str(key).put<uint32_t>(uint32_t(GgufType::ARRAY)).put<uint32_t>(uint32_t(elem)).put<uint64_t>(values.size());
    for (const T& v : values) b.put<T>(v);
    kvs.push_back(b.data());
    return *this;
  }

  std::vector<uint8_t> build() const {
    Bytes b;
    b.put<uint32_t>(magic).put<uint32_t>(version);
    b.put<uint64_t>(tensor_count_override >= 0 ? uint64_t(tensor_count_override) : tensors.size());
    b.put<uint64_t>(kv_count_override >= 0 ? uint64_t(kv_count_override) : kvs.size());
    for (const auto& kv : kvs) b.raw(kv);
    std::vector<uint64_t> offsets;
    uint64_t at = 0;
    for (const auto& t : tensors) {
      offsets.push_back(t.offset_override >= 0 ? uint64_t(t.offset_override) : at);
      at += (t.data.size() + alignment - 1) / alignment * alignment;
    }
    for (size_t i = 0; i < tensors.size(); ++i) {
      const auto& t = tensors[i];
      b.str(t.name).put<uint32_t>(uint32_t(t.dims.size()));
      for (uint64_t d : t.dims) b.put<uint64_t>(d);
      b.put<uint32_t>(t.ggml_type).put<uint64_t>(offsets[i]);
    }
    auto& out = b.data();
    if (!tensors.empty()) {
      out.resize((out.size() + alignment - 1) / alignment * alignment, 0);
      const size_t data_start = out.size();
      for (size_t i = 0; i < tensors.size(); ++i) {
        const size_t need = data_start + size_t(offsets[i]) + tensors[i].data.size();
        if (out.size() < need) out.resize(need, 0);
        std::memcpy(out.data() + data_start + offsets[i], tensors[i].data.data(), tensors[i].data.size());
      }
    }
    return out;
  }
};

std::string write_file(const TempDir& dir, const std::string& name, const std::vector<uint8_t>& bytes) {
  const std::string path = dir.str() + "/" + name;
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), std::streamsize(bytes.size()));
  return path;
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = uint8_t(seed + i * 13);
  return v;
}

template <typename T>
std::vector<uint8_t> le_bytes(std::initializer_list<T> values) {
  Bytes b;
  for (T v : values) b.put<T>(v);
  return b.data();
}

// Expects opening `bytes` to throw one line that mentions the file name and every fragment.
void expect_refused(const std::vector<uint8_t>& bytes, std::initializer_list<std::string> fragments) {
  TempDir dir;
  const std::string path = write_file(dir, "model.gguf", bytes);
  try {
    GgufFile f(path);
    ADD_FAILURE() << "accepted; expected an error mentioning " << *fragments.begin();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find("model.gguf"), std::string::npos) << msg;
    for (const auto& frag : fragments) EXPECT_NE(msg.find(frag), std::string::npos) << "missing '" << frag << "' in: " << msg;
  }
}

// A valid file with two quantized tensors and an F32 one.
GgufBuilder valid_builder() {
  GgufBuilder g;
  g.kv_str("general.architecture", "qwen3").kv<uint32_t>("qwen3.block_count", GgufType::U32, 2);
  g.tensor({"token_embd.weight", {256, 3}, 12, pattern(3 * 144, 1)});  // Q4_K [3, 256]
  g.tensor({"blk.0.attn_q.weight", {64, 2}, 8, pattern(2 * 2 * 34, 2)});  // Q8_0 [2, 64]
  g.tensor({"output_norm.weight", {5}, 0, pattern(20, 3)});             // F32 [5]
  return g;
}

// ---- reading ----------------------------------------------------------------------------

class GgufVersions : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufVersions, ReadsEveryMetadataType) {
  GgufBuilder g;
  g.version = GetParam();
  g.kv<uint8_t>("u8", GgufType::U8, 250)
      .kv<int8_t>("i8", GgufType::I8, -120)
      .kv<uint16_t>("u16", GgufType::U16, 65000)
      .kv<int16_t>("i16", GgufType::I16, -32000)
      .kv<uint32_t>("u32", GgufType::U32, 4000000000u)
      .kv<int32_t>("i32", GgufType::I32, -2000000000)
      .kv<float>("f32", GgufType::F32, 1.5f)
      .kv<uint8_t>("bool", GgufType::BOOL, 1)
      .kv_str("str", "héllo")
      .kv_str("empty_str", "")
      .kv<uint64_t>("u64", GgufType::U64, 18000000000000000000ull)
      .kv<int64_t>("i64", GgufType::I64, -9000000000000000000ll)
      .kv<double>("f64", GgufType::F64, -2.5e-300);
  {  // arrays: int32, float32, strings, bool, empty, nested [[1, 2], [3]] of u16
    Bytes a;
    a.put<uint32_t>(uint32_t(GgufType::I32)).put<uint64_t>(3).put<int32_t>(1).put<int32_t>(-2).put<int32_t>(3);
    g.kv_raw("arr_i32", GgufType::ARRAY, a.data());
    Bytes f;
    f.put<uint32_t>(uint32_t(GgufType::F32)).put<uint64_t>(2).put<float>(0.5f).put<float>(-1.25f);
    g.kv_raw("arr_f32", GgufType::ARRAY, f.data());
    Bytes s;
    s.put<uint32_t>(uint32_t(GgufType::STRING)).put<uint64_t>(3).str("a").str("").str("ccc");
    g.kv_raw("arr_str", GgufType::ARRAY, s.data());
    Bytes bo;
    bo.put<uint32_t>(uint32_t(GgufType::BOOL)).put<uint64_t>(2).put<uint8_t>(0).put<uint8_t>(1);
    g.kv_raw("arr_bool", GgufType::ARRAY, bo.data());
    Bytes e;
    e.put<uint32_t>(uint32_t(GgufType::U64)).put<uint64_t>(0);
    g.kv_raw("arr_empty", GgufType::ARRAY, e.data());
    Bytes n;
    n.put<uint32_t>(uint32_t(GgufType::ARRAY)).put<uint64_t>(2);
    n.put<uint32_t>(uint32_t(GgufType::U16)).put<uint64_t>(2).put<uint16_t>(1).put<uint16_t>(2);
    n.put<uint32_t>(uint32_t(GgufType::U16)).put<uint64_t>(1).put<uint16_t>(3);
    g.kv_raw("arr_nested", GgufType::ARRAY, n.data());
  }
  TempDir dir;
  GgufFile f(write_file(dir, "meta.gguf", g.build()));
  EXPECT_EQ(f.version(), GetParam());
  EXPECT_EQ(f.metadata().size(), 19u);
  EXPECT_EQ(f.get_u32("u8"), 250u);
  EXPECT_EQ(f.get_i64("i8"), -120);
  EXPECT_EQ(f.get_u32("u16"), 65000u);
  EXPECT_EQ(f.get_i64("i16"), -32000);
  EXPECT_EQ(f.get_u32("u32"), 4000000000u);
  EXPECT_EQ(f.get_i64("i32"), -2000000000);
  EXPECT_EQ(f.get_f32("f32"), 1.5f);
  EXPECT_TRUE(f.get_bool("bool", false));
  EXPECT_EQ(f.get_str("str"), "héllo");
  EXPECT_EQ(f.get_str("empty_str"), "");
  EXPECT_EQ(f.get_u64("u64"), 18000000000000000000ull);
  EXPECT_EQ(f.get_i64("i64"), -9000000000000000000ll);
  EXPECT_EQ(f.find_value("f64")->as_f64("f64"), -2.5e-300);
  EXPECT_EQ(f.get_int_arr("arr_i32"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(f.get_f32_arr("arr_f32"), (std::vector<float>{0.5f, -1.25f}));
  EXPECT_EQ(f.get_str_arr("arr_str"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(f.find_value("arr_bool")->elem_type(), GgufType::BOOL);
  EXPECT_TRUE(f.get_int_arr("arr_empty").empty());
  const GgufValue& nested = *f.find_value("arr_nested");
  EXPECT_EQ(nested.elem_type(), GgufType::ARRAY);
  ASSERT_EQ(nested.as_array("n").size(), 2u);
  EXPECT_EQ(nested.as_array("n")[0].elem_type(), GgufType::U16);
  EXPECT_EQ(nested.as_array("n")[0].as_array("n")[1].as_u64("n"), 2u);
  EXPECT_EQ(nested.as_array("n")[1].as_array("n")[0].as_u64("n"), 3u);
  EXPECT_EQ(f.metadata_json()["arr_nested"], nlohmann::json::parse("[[1,2],[3]]"));
  EXPECT_EQ(f.metadata_json(2)["arr_str"], "[3 x STRING]");
  EXPECT_EQ(f.find_value("u8")->type(), GgufType::U8);
  EXPECT_EQ(f.find_value("i64")->type(), GgufType::I64);
  EXPECT_TRUE(f.tensors().empty());
  // Fallback getters: absent keys give the fallback, present ones their value.
  EXPECT_EQ(f.get_u32("absent", 7), 7u);
  EXPECT_EQ(f.get_u32("u16", 7), 65000u);
  EXPECT_EQ(f.get_f32("absent", 0.25f), 0.25f);
  EXPECT_EQ(f.get_str("absent", "x"), "x");
}

INSTANTIATE_TEST_SUITE_P(V2AndV3, GgufVersions, ::testing::Values(2u, 3u));

TEST(Gguf, TypedGettersNameTheKeyOnMismatch) {
  GgufBuilder g;
  g.kv_str("general.name", "x").kv<int32_t>("neg", GgufType::I32, -1).kv<uint64_t>("big", GgufType::U64, 1ull << 40);
  TempDir dir;
  GgufFile f(write_file(dir, "model.gguf", g.build()));
  auto expect_msg = [](auto fn, const std::string& frag) {
    try {
      fn();
      ADD_FAILURE() << "no error, expected " << frag;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(frag), std::string::npos) << e.what();
    }
  };
  expect_msg([&] { f.get_u32("general.name"); }, "model.gguf: metadata general.name is STRING, expected an integer");
  expect_msg([&] { f.get_u32("neg"); }, "metadata neg is -1, expected a non-negative integer");
  expect_msg([&] { f.get_u32("big"); }, "metadata big = 1099511627776 does not fit uint32");
  expect_msg([&] { f.get_str("missing.key"); }, "model.gguf: missing metadata missing.key");
  expect_msg([&] { f.get_f32("neg"); }, "metadata neg is INT32, expected FLOAT32 or FLOAT64");
  expect_msg([&] { f.get_str_arr("general.name"); }, "metadata general.name is STRING, expected ARRAY");
  expect_msg([&] { f.get("nope.weight"); }, "model.gguf: missing tensor nope.weight");
}

TEST(Gguf, ReadsTensorsWithDimsTypesAndData) {
  for (uint64_t alignment : {32u, 64u}) {
    GgufBuilder g = valid_builder();
    g.alignment = alignment;
    if (alignment != 32) g.kv<uint32_t>("general.alignment", GgufType::U32, uint32_t(alignment));
    TempDir dir;
    GgufFile f(write_file(dir, "model.gguf", g.build()));
    EXPECT_EQ(f.alignment(), alignment);
    EXPECT_EQ(f.data_offset() % alignment, 0u);
    ASSERT_EQ(f.tensors().size(), 3u);
    EXPECT_EQ(f.tensors()[0].name, "token_embd.weight");  // file order
    const GgufTensor& emb = f.get("token_embd.weight");
    EXPECT_EQ(emb.ggml_type, 12u);
    EXPECT_EQ(emb.dtype, DType::Q4_K);
    EXPECT_EQ(emb.dims, (std::vector<int64_t>{256, 3}));
    EXPECT_EQ(emb.dims_str(), "[256, 3]");
    EXPECT_EQ(emb.numel(), 768);
    EXPECT_EQ(emb.nbytes, 3u * 144u);
    EXPECT_EQ(std::vector<uint8_t>(emb.data, emb.data + emb.nbytes), pattern(3 * 144, 1));
    const GgufTensor& q = f.get("blk.0.attn_q.weight");
    EXPECT_EQ(q.dtype, DType::Q8_0);
    EXPECT_EQ(q.nbytes, 136u);
    EXPECT_EQ(std::vector<uint8_t>(q.data, q.data + q.nbytes), pattern(136, 2));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(q.data) % alignment, 0u);
    const GgufTensor* norm = f.find("output_norm.weight");
    ASSERT_NE(norm, nullptr);
    EXPECT_EQ(norm->dtype, DType::F32);
    EXPECT_EQ(norm->nbytes, 20u);
    EXPECT_EQ(f.find("missing"), nullptr);
    const WeightView w = f.weight("token_embd.weight");
    EXPECT_EQ(w.dtype, DType::Q4_K);
    EXPECT_EQ(w.rows, 3);
    EXPECT_EQ(w.cols, 256);
    EXPECT_EQ(w.row_bytes, 144);
    EXPECT_EQ(w.row(2), emb.data + 288);
  }
}

// Written by gguf-py's GGUFWriter: metadata values and tensor bytes as the reference writes them.
TEST(Gguf, ReadsTheReferenceWritersFile) {
  const std::string dir = testing::source_dir() + "/tests/data/quant/";
  GgufFile f(dir + "reference_writer.gguf");
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_str("general.architecture"), "testarch");
  EXPECT_EQ(f.find_value("t.u8")->type(), GgufType::U8);
  EXPECT_EQ(f.get_u32("t.u8"), 200u);
  EXPECT_EQ(f.get_i64("t.i8"), -100);
  EXPECT_EQ(f.get_u32("t.u16"), 60000u);
  EXPECT_EQ(f.get_i64("t.i16"), -30000);
  EXPECT_EQ(f.get_u32("t.u32"), 4000000000u);
  EXPECT_EQ(f.get_i64("t.i32"), -2000000000);
  EXPECT_EQ(f.get_f32("t.f32"), 0.15625f);
  EXPECT_TRUE(f.get_bool("t.bool", false));
  EXPECT_EQ(f.get_str("t.str"), "héllo wörld");
  EXPECT_EQ(f.get_u64("t.u64"), 18000000000000000000ull);
  EXPECT_EQ(f.get_i64("t.i64"), -9000000000000000000ll);
  EXPECT_EQ(f.find_value("t.f64")->as_f64("t.f64"), -2.5e-300);
  EXPECT_EQ(f.get_int_arr("t.arr_i32"), (std::vector<int64_t>{1, -2, 3}));
  EXPECT_EQ(f.get_f32_arr("t.arr_f32"), (std::vector<float>{0.5f, -1.25f}));
  EXPECT_EQ(f.get_str_arr("t.arr_str"), (std::vector<std::string>{"a", "", "ccc"}));
  EXPECT_EQ(f.find_value("t.arr_u8")->elem_type(), GgufType::U8);
  EXPECT_EQ(f.get_int_arr("t.arr_u8"), (std::vector<int64_t>{1, 2, 255}));
  EXPECT_EQ(f.metadata_json()["t.arr_nested"], nlohmann::json::parse("[[1,2],[3]]"));
  EXPECT_EQ(f.metadata_json()["t.arr_bool"], nlohmann::json::parse("[true,false]"));

  const auto goldens = testing::read_json(dir + "goldens.json");
  int checked = 0;
  for (const auto& [name, g] : goldens.at("formats").items()) {
    const GgufTensor& t = f.get("golden." + name);
    EXPECT_EQ(dtype_name(t.dtype), name);
    EXPECT_EQ(t.ggml_type, g.at("ggml_type").get<uint32_t>()) << name;
    EXPECT_EQ(t.numel(), g.at("n").get<int64_t>()) << name;
    std::string hex;
    for (size_t i = 0; i < t.nbytes; ++i) hex += fmt::format("{:02x}", t.data[i]);
    EXPECT_EQ(hex, g.at("hex").get<std::string>()) << name;
    // The dequantized file tensor equals the reference values.
    std::vector<float> got(size_t(t.numel()));
    dequantize_row(t.dtype, t.data, got.data(), t.numel());
    EXPECT_EQ(got, g.at("values").get<std::vector<float>>()) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 10);
  const GgufTensor& plain = f.get("plain.f32");
  EXPECT_EQ(plain.dims, (std::vector<int64_t>{4, 3}));
  std::vector<float> v(12);
  std::memcpy(v.data(), plain.data, 48);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(v[size_t(i)], float(i));
}

// ---- refusing broken files ------------------------------------------------------------------

TEST(GgufErrors, WrongMagic) {
  GgufBuilder g = valid_builder();
  g.magic = 0x4c4c5547;  // "GULL"
  expect_refused(g.build(), {"not a GGUF file", "47 55 4c 4c"});
}

TEST(GgufErrors, BadVersions) {
  for (uint32_t v : {0u, 1u, 4u, 0x03000000u}) {
    GgufBuilder g = valid_builder();
    g.version = v;
    if (v == 1) expect_refused(g.build(), {"GGUF version 1 is not supported"});
    else if (v == 0x03000000u) expect_refused(g.build(), {"big-endian GGUF"});
    else expect_refused(g.build(), {"unsupported GGUF version " + std::to_string(v)});
  }
}

TEST(GgufErrors, TruncatedFiles) {
  const std::vector<uint8_t> full = valid_builder().build();
  expect_refused(std::vector<uint8_t>(full.begin(), full.begin() + 2), {"truncated"});
  expect_refused(std::vector<uint8_t>(full.begin(), full.begin() + 10), {"truncated", "tensor_count"});
  // Inside the data section: the last tensor's bytes run past the end.
  expect_refused(std::vector<uint8_t>(full.begin(), full.end() - 1), {"tensor output_norm.weight", "runs past the end"});
  // Every proper prefix must be refused with an Error, never accepted or crashed on (each
  // one through the header and tensor infos, a sample through the data).
  TempDir dir;
  const size_t data_offset = GgufFile(write_file(dir, "full.gguf", full)).data_offset();
  for (size_t n = 0; n < full.size(); n += n < data_offset + 8 ? 1 : 13) {
    const std::string path = write_file(dir, "prefix.gguf", std::vector<uint8_t>(full.begin(), full.begin() + long(n)));
    EXPECT_THROW(GgufFile f(path), Error) << "prefix of " << n << " bytes accepted";
  }
  EXPECT_NO_THROW(GgufFile f(write_file(dir, "full.gguf", full)));
}

TEST(GgufErrors, StringLengthPastEof) {
  GgufBuilder g;
  Bytes b;
  b.put<uint64_t>(1000).raw({'a', 'b'});  // claims 1000 bytes, has 2
  g.kv_raw("general.name", GgufType::STRING, b.data());
  expect_refused(g.build(), {"metadata general.name", "string length 1000", "past the end"});
  // A key whose length runs past the end.
  GgufBuilder k;
  std::vector<uint8_t> bytes = k.build();
  bytes[16] = 1;  // kv_count = 1
  Bytes key;
  key.put<uint64_t>(1ull << 40).put<uint64_t>(0).put<uint64_t>(0);  // room for kv_count's sanity bound
  bytes.insert(bytes.end(), key.data().begin(), key.data().end());
  expect_refused(bytes, {"metadata key #0", "string length 1099511627776"});
}

TEST(GgufErrors, ImplausibleCounts) {
  GgufBuilder g = valid_builder();
  g.kv_count_override = 1ll << 50;
  expect_refused(g.build(), {"kv_count 1125899906842624 is implausible"});
  GgufBuilder t = valid_builder();
  t.tensor_count_override = 1ll << 40;
  expect_refused(t.build(), {"tensor_count 1099511627776 is implausible"});
  GgufBuilder a;
  Bytes arr;
  arr.put<uint32_t>(uint32_t(GgufType::U32)).put<uint64_t>(1ull << 60);
  a.kv_raw("tokenizer.ggml.token_type", GgufType::ARRAY, arr.data());
  expect_refused(a.build(), {"metadata tokenizer.ggml.token_type", "array of 1152921504606846976 UINT32"});
}

TEST(GgufErrors, TensorOffsetPastEof) {
  GgufBuilder g = valid_builder();
  g.tensors[1].offset_override = 1 << 20;
  std::vector<uint8_t> bytes = g.build();
  bytes.resize(valid_builder().build().size());  // keep the file small: drop the zero fill
  expect_refused(bytes, {"tensor blk.0.attn_q.weight", "runs past the end of the file"});
}

TEST(GgufErrors, MisalignedOffset) {
  GgufBuilder g = valid_builder();
  g.tensors[2].offset_override = 1000;
  expect_refused(g.build(), {"tensor output_norm.weight", "data offset 1000 is not a multiple of the alignment 32"});
}

TEST(GgufErrors, UnsupportedGgmlTypeRefusedByNameAndNumber) {
  GgufBuilder g = valid_builder();
  g.tensors.push_back({"blk.0.ffn_up.weight", {256, 1}, 19, pattern(50, 4)});
  expect_refused(g.build(), {"model.gguf: tensor blk.0.ffn_up.weight has unsupported ggml type 19 (IQ1_S)"});
  GgufBuilder u = valid_builder();
  u.tensors[0].ggml_type = 99;
  expect_refused(u.build(), {"tensor token_embd.weight has unsupported ggml type 99 (unknown)"});
  // MXFP4 (39) parses since gpt-oss GGUFs load; outside gpt-oss's expert stacks the mapping
  // refuses it by name (GgufMxfp4.MalformedOrMisplacedBlocksAreRefusedByName).
}

TEST(GgufErrors, SizeMustMatchTypeAndDims) {
  GgufBuilder g = valid_builder();
  g.tensors[0].dims = {200, 3};  // Q4_K rows must be whole 256-blocks
  expect_refused(g.build(), {"tensor token_embd.weight", "ne0 = 200 is not a multiple of the Q4_K block size 256"});
  GgufBuilder d = valid_builder();
  d.tensors[2].dims = {5, 1, 1, 1, 1};
  expect_refused(d.build(), {"tensor output_norm.weight has 5 dims"});
  GgufBuilder h = valid_builder();
  h.tensors[2].dims = {1ull << 40, 1ull << 40};
  expect_refused(h.build(), {"tensor output_norm.weight has implausible dims"});
  // Within the element bound but not the byte bound: 2^62 F32 values would be 2^64 bytes, which
  // wrapped to 0 and passed the bounds checks (fuzz_gguf).
  GgufBuilder b = valid_builder();
  b.tensors[2].dims = {1ull << 62};
  expect_refused(b.build(), {"tensor output_norm.weight has implausible dims"});
}

TEST(GgufErrors, DuplicatesAndOverlaps) {
  GgufBuilder g = valid_builder();
  g.tensors[2].name = "token_embd.weight";
  expect_refused(g.build(), {"duplicate tensor name token_embd.weight"});
  GgufBuilder k = valid_builder();
  k.kv<uint32_t>("qwen3.block_count", GgufType::U32, 3);
  expect_refused(k.build(), {"duplicate metadata key qwen3.block_count"});
  GgufBuilder o = valid_builder();
  o.tensors[2].offset_override = 0;  // on top of token_embd.weight
  expect_refused(o.build(), {"overlap"});
}

TEST(GgufErrors, BadMetadataValues) {
  GgufBuilder t;
  t.kv<uint32_t>("weird", GgufType(13), 0);
  expect_refused(t.build(), {"metadata weird has unknown value type 13"});
  GgufBuilder b;
  b.kv<uint8_t>("flag", GgufType::BOOL, 2);
  expect_refused(b.build(), {"metadata flag", "BOOL byte is 2"});
  GgufBuilder a = valid_builder();
  a.kv<uint32_t>("general.alignment", GgufType::U32, 48);
  expect_refused(a.build(), {"general.alignment = 48 is not a power of two"});
  GgufBuilder at = valid_builder();
  at.kv<uint64_t>("general.alignment", GgufType::U64, 64);
  expect_refused(at.build(), {"general.alignment is UINT64, expected UINT32"});
  GgufBuilder e;
  Bytes elem;
  elem.put<uint32_t>(77).put<uint64_t>(1);
  e.kv_raw("arr", GgufType::ARRAY, elem.data());
  expect_refused(e.build(), {"metadata arr", "unknown array element type 77"});
  GgufBuilder deep;  // arrays nested past the limit
  Bytes nest;
  for (int i = 0; i < 20; ++i) nest.put<uint32_t>(uint32_t(GgufType::ARRAY)).put<uint64_t>(1);
  deep.kv_raw("deep", GgufType::ARRAY, nest.data());
  expect_refused(deep.build(), {"metadata deep", "nested deeper"});
}

// Random corruption of the header, metadata and tensor infos: every result is a parsed
// file or an Error, never a crash or a hang (run under ASan to make "never" strict).
TEST(GgufErrors, RandomCorruptionNeverCrashes) {
  GgufBuilder g = valid_builder();
  Bytes s;
  s.put<uint32_t>(uint32_t(GgufType::STRING)).put<uint64_t>(2).str("ab").str("c");
  g.kv_raw("tokens", GgufType::ARRAY, s.data());
  const std::vector<uint8_t> full = g.build();
  const size_t header_end = full.size() - 3 * 144 - 20;  // roughly where tensor data begins
  std::mt19937 rng(1);
  TempDir dir;
  int accepted = 0, refused = 0;
  for (int iter = 0; iter < 250; ++iter) {
    std::vector<uint8_t> bytes = full;
    const int flips = 1 + int(rng() % 3);
    for (int k = 0; k < flips; ++k) bytes[rng() % header_end] ^= uint8_t(1u << (rng() % 8));
    try {
      GgufFile f(write_file(dir, "fuzz.gguf", bytes));
      ++accepted;
      // What a parser accepts must still be self-consistent: every tensor's bytes inside the
      // file's data section, its size the one its type and dims give, no two overlapping.
      std::vector<std::pair<uint64_t, uint64_t>> spans;
      for (const GgufTensor& t : f.tensors()) {
        EXPECT_LE(f.data_offset() + t.offset + t.nbytes, bytes.size()) << t.name << " (iteration " << iter << ")";
        spans.emplace_back(t.offset, t.offset + t.nbytes);
      }
      std::sort(spans.begin(), spans.end());
      for (size_t i = 1; i < spans.size(); ++i) EXPECT_LE(spans[i - 1].second, spans[i].first) << "iteration " << iter;
    } catch (const Error&) {
      ++refused;
    }
  }
  // Both outcomes happen (flips in names and padding are harmless, in counts and types not):
  // a parser that refused everything, or nothing, would fail here.
  EXPECT_GT(refused, 60);
  EXPECT_GT(accepted, 10);
}

// ggml MXFP4 (type 39): 17-byte blocks of 32 values; read only as gpt-oss experts.
std::vector<uint8_t> f32_bytes(size_t n, float v) {
  std::vector<uint8_t> b(n * 4);
  for (size_t i = 0; i < n; ++i) std::memcpy(b.data() + 4 * i, &v, 4);
  return b;
}

GgufBuilder gpt_oss_layer(bool with_down_bias) {
  // One layer, 1 expert, hidden 32, expert width 32: gate/up [32 in, 32 out, 1], down likewise.
  GgufBuilder b;
  b.kv_str("general.architecture", "gpt-oss").kv("gpt-oss.attention.head_count", GgufType::U32, uint32_t(1));
  std::vector<uint8_t> gate(32 * 17), up(32 * 17), down(32 * 17);
  for (int r = 0; r < 32; ++r) {
    gate[size_t(r * 17)] = uint8_t(100 + r);  // E8M0 scales
    up[size_t(r * 17)] = uint8_t(200 - r);
    down[size_t(r * 17)] = uint8_t(r);
    for (int j = 0; j < 16; ++j) {
      gate[size_t(r * 17 + 1 + j)] = uint8_t(j | ((15 - j) << 4));  // value j: j, value j + 16: 15 - j
      up[size_t(r * 17 + 1 + j)] = uint8_t((r + j) & 15);
      down[size_t(r * 17 + 1 + j)] = uint8_t(j << 4);
    }
  }
  b.tensor({"blk.0.ffn_gate_exps.weight", {32, 32, 1}, kGgmlMxfp4, gate});
  b.tensor({"blk.0.ffn_up_exps.weight", {32, 32, 1}, kGgmlMxfp4, up});
  b.tensor({"blk.0.ffn_down_exps.weight", {32, 32, 1}, kGgmlMxfp4, down});
  b.tensor({"blk.0.ffn_gate_exps.bias", {32, 1}, 0, f32_bytes(32, 1.f)});
  b.tensor({"blk.0.ffn_up_exps.bias", {32, 1}, 0, f32_bytes(32, 2.f)});
  if (with_down_bias) b.tensor({"blk.0.ffn_down_exps.bias", {32, 1}, 0, f32_bytes(32, 3.f)});
  return b;
}

// A head count of zero is refused by name before anything divides by it (the GGUF fuzzer's
// first find once it ran the mapping: regressions/gguf/zero-head-count.gguf, a SIGFPE before).
TEST(GgufErrors, ZeroHeadCountRefusedByNameInTheMapping) {
  TempDir dir;
  GgufBuilder b = valid_builder();
  b.kv<uint32_t>("qwen3.embedding_length", GgufType::U32, 64).kv<uint32_t>("qwen3.attention.head_count", GgufType::U32, 0);
  GgufFile g(write_file(dir, "m.gguf", b.build()));
  std::vector<std::unique_ptr<uint8_t[]>> owned;
  for (auto fn : {std::function<void()>([&] { (void)gguf_hf_config(g); }),
                  std::function<void()>([&] { (void)gguf_hf_tensors(g, owned); })}) {
    try {
      fn();
      ADD_FAILURE() << "a head count of 0 was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("qwen3.attention.head_count"), std::string::npos) << e.what();
    }
  }
}

// A block count past the file's tensors is refused before a model sizes anything by it (the
// fuzzer's second find: 4 billion gpt-oss layer types ran out of memory; regression input
// huge-block-count.gguf).
TEST(GgufErrors, BlockCountPastTheTensorsRefusedByName) {
  TempDir dir;
  GgufBuilder b;
  b.kv_str("general.architecture", "qwen3").kv<uint32_t>("qwen3.block_count", GgufType::U32, 1000);
  b.kv<uint32_t>("qwen3.embedding_length", GgufType::U32, 64).kv<uint32_t>("qwen3.attention.head_count", GgufType::U32, 4);
  b.kv<uint32_t>("qwen3.feed_forward_length", GgufType::U32, 128);
  b.tensor({"output_norm.weight", {5}, 0, pattern(20, 3)});
  GgufFile g(write_file(dir, "m.gguf", b.build()));
  try {
    (void)gguf_hf_config(g);
    ADD_FAILURE() << "1000 blocks in a file of one tensor were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("qwen3.block_count 1000 is not between 1 and the file's 1 tensors"),
              std::string::npos)
        << e.what();
  }
}

const TensorInfo& tensor_named(const std::vector<TensorInfo>& ts, const std::string& name) {
  for (const auto& t : ts)
    if (t.name == name) return t;
  throw std::runtime_error("no tensor " + name);
}

TEST(GgufMxfp4, GptOssStacksRepackIntoTransformersPlanes) {
  TempDir dir;
  GgufFile g(write_file(dir, "m.gguf", gpt_oss_layer(true).build()));
  EXPECT_EQ(g.get("blk.0.ffn_gate_exps.weight").nbytes, 32u * 17);
  EXPECT_THROW(g.weight("blk.0.ffn_gate_exps.weight"), Error);
  std::vector<std::unique_ptr<uint8_t[]>> owned;
  const std::vector<TensorInfo> ts = gguf_hf_tensors(g, owned);
  auto find = [&](const std::string& n) -> const TensorInfo& { return tensor_named(ts, n); };
  const std::string p = "model.layers.0.mlp.experts.";
  const TensorInfo& blocks = find(p + "gate_up_proj_blocks");
  const TensorInfo& scales = find(p + "gate_up_proj_scales");
  EXPECT_EQ(blocks.shape, (std::vector<int64_t>{1, 64, 1, 16}));
  EXPECT_EQ(scales.shape, (std::vector<int64_t>{1, 64, 1}));
  // Rows interleave gate (even) and up (odd); each block's nibbles in transformers' order:
  // byte i holds values 2i (low) and 2i + 1 (high).
  for (int r = 0; r < 32; ++r) {
    EXPECT_EQ(scales.data[2 * r], 100 + r);
    EXPECT_EQ(scales.data[2 * r + 1], 200 - r);
    for (int i = 0; i < 16; ++i) {
      auto gate_value = [](int k) { return k < 16 ? k : 15 - (k - 16); };
      EXPECT_EQ(blocks.data[(2 * r) * 16 + i], uint8_t(gate_value(2 * i) | (gate_value(2 * i + 1) << 4))) << r << " " << i;
      auto up_value = [&](int k) { return k < 16 ? (r + k) & 15 : 0; };
      EXPECT_EQ(blocks.data[(2 * r + 1) * 16 + i], uint8_t(up_value(2 * i) | (up_value(2 * i + 1) << 4))) << r << " " << i;
    }
  }
  EXPECT_EQ(find(p + "down_proj_blocks").shape, (std::vector<int64_t>{1, 32, 1, 16}));
  const TensorInfo& bias = find(p + "gate_up_proj_bias");
  ASSERT_EQ(bias.shape, (std::vector<int64_t>{1, 64}));
  const float* bv = reinterpret_cast<const float*>(bias.data);
  EXPECT_EQ(bv[0], 1.f);
  EXPECT_EQ(bv[1], 2.f);
  EXPECT_EQ(bv[62], 1.f);
  EXPECT_EQ(bv[63], 2.f);
  EXPECT_EQ(find(p + "down_proj_bias").shape, (std::vector<int64_t>{1, 32}));
}

TEST(GgufMxfp4, MalformedOrMisplacedBlocksAreRefusedByName) {
  TempDir dir;
  {
    GgufFile g(write_file(dir, "nobias.gguf", gpt_oss_layer(false).build()));
    std::vector<std::unique_ptr<uint8_t[]>> owned;
    try {
      gguf_hf_tensors(g, owned);
      ADD_FAILURE() << "a layer without ffn_down_exps.bias was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("layer 0 lacks one of ffn_{gate,up,down}_exps.{weight,bias}"), std::string::npos)
          << e.what();
    }
  }
  {
    GgufBuilder b;
    b.kv_str("general.architecture", "qwen3").kv("qwen3.attention.head_count", GgufType::U32, uint32_t(1));
    b.tensor({"blk.0.ffn_down.weight", {32, 2}, kGgmlMxfp4, std::vector<uint8_t>(2 * 17)});
    GgufFile g(write_file(dir, "qwen.gguf", b.build()));
    std::vector<std::unique_ptr<uint8_t[]>> owned;
    try {
      gguf_hf_tensors(g, owned);
      ADD_FAILURE() << "an MXFP4 tensor outside gpt-oss was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("ggml MXFP4 is supported for gpt-oss expert stacks only"), std::string::npos)
          << e.what();
    }
  }
  {
    GgufBuilder b;
    b.kv_str("general.architecture", "gpt-oss");
    b.tensor({"blk.0.ffn_down_exps.weight", {40, 2, 1}, kGgmlMxfp4, std::vector<uint8_t>(4 * 17)});
    try {
      GgufFile g(write_file(dir, "ragged.gguf", b.build()));
      ADD_FAILURE() << "MXFP4 rows of 40 values were accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a multiple of the MXFP4 block size 32"), std::string::npos) << e.what();
    }
  }
}

// ---- qwen4exp (llama.cpp's Qwen4-Exp files) -------------------------------------------------

std::vector<uint8_t> f32s(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

// The metadata llama.cpp's converter writes for a 2-layer Qwen4-Exp (GatedDeltaNet, then QSA;
// PLE on layer 0), minus what `skip` names, plus the tensors given.
GgufBuilder qwen4exp_file(const std::string& skip = "", std::vector<TensorSpec> tensors = {}) {
  GgufBuilder b;
  const std::string a = "qwen4exp.";
  auto u32 = [&](const std::string& k, uint32_t v) {
    if (k != skip) b.kv<uint32_t>(a + k, GgufType::U32, v);
  };
  b.kv_str("general.architecture", "qwen4exp");
  u32("block_count", 2);
  u32("context_length", 256);
  u32("embedding_length", 32);
  u32("attention.head_count", 4);
  u32("attention.head_count_kv", 2);
  u32("attention.key_length", 16);
  u32("attention.value_length", skip == "value_length" ? 8 : 16);
  u32("expert_count", 16);
  u32("expert_used_count", 10);
  u32("expert_feed_forward_length", 16);
  u32("expert_shared_feed_forward_length", 24);
  u32("ssm.conv_kernel", 4);
  u32("ssm.state_size", 8);
  u32("ssm.group_count", 2);
  u32("ssm.time_step_rank", 4);
  u32("ssm.inner_size", 32);
  u32("rope.dimension_count", 8);
  u32("hyper_connection.count", 2);
  u32("hyper_connection.low_rank", 8);
  u32("attention.indexer.head_count", 2);
  u32("attention.indexer.key_length", 16);
  u32("attention.indexer.top_k", 8);
  u32("ple.ngram_size", 3);
  u32("ple.heads_per_ngram", 2);
  u32("ple.conv_kernel", 4);
  u32("ple.eos_token_id", 3);
  u32("embedding_length_per_layer_input", 4);
  b.kv<float>(a + "rope.freq_base", GgufType::F32, 10000.f);
  b.kv<float>(a + "attention.layer_norm_rms_epsilon", GgufType::F32, 1e-6f);
  b.kv<uint32_t>("tokenizer.ggml.eos_token_id", GgufType::U32, 7);
  if (skip == "expert_weights_norm") b.kv<uint8_t>(a + "expert_weights_norm", GgufType::BOOL, 0);
  b.kv_array<uint8_t>(a + "attention.recurrent_layers", GgufType::BOOL, {1, 0});
  b.kv_array<uint32_t>(a + "attention.compress_ratios", GgufType::U32, {0, skip == "ratio" ? 0u : 4u});
  b.kv_array<uint32_t>(a + "ple.layers", GgufType::U32,
                       skip == "two_ple" ? std::vector<uint32_t>{0, 1} : std::vector<uint32_t>{0});
  if (skip != "ple.layer_multipliers")
    b.kv_array<uint64_t>(a + "ple.layer_multipliers", GgufType::U64, {4295158889762567ull, 35454616657218897ull, 3ull});
  b.kv_array<uint64_t>(a + "ple.head_offsets", GgufType::U64, {0, 97, 198, 301});
  b.kv_array<uint64_t>(a + "ple.head_vocab_sizes", GgufType::U64, {97, 101, 103, 107});
  b.tensor({"token_embd.weight", {32, 8}, 0, f32s(std::vector<float>(256, 0.5f))});
  b.tensor({"output_hc_norm.weight", {4}, 0, f32s({1.f, 1.5f, 0.25f, 2.f})});
  for (auto& t : tensors) b.tensor(std::move(t));
  return b;
}

TEST(Qwen4ExpGgufMapping, ConfigStatesWhatTheFileSays) {
  TempDir dir;
  GgufFile g(write_file(dir, "m.gguf", qwen4exp_file().build()));
  const nlohmann::json c = gguf_hf_config(g);
  EXPECT_EQ(c["architectures"][0], "Qwen4ExpForCausalLM");
  EXPECT_EQ(c["model_type"], "qwen4_exp_text");
  EXPECT_EQ(c["layer_types"], (nlohmann::json{"linear_attention", "qwen_sparse_attention"}));
  EXPECT_EQ(c["indexer_compress_ratio"], 4);
  EXPECT_EQ(c["indexer_budget"], 8);
  EXPECT_EQ(c["indexer_kv_heads"], 1);
  EXPECT_DOUBLE_EQ(c["rope_parameters"]["partial_rotary_factor"].get<double>(), 0.5);
  EXPECT_EQ(c["linear_num_key_heads"], 2);
  EXPECT_EQ(c["linear_num_value_heads"], 4);
  EXPECT_EQ(c["linear_value_head_dim"], 8);
  EXPECT_EQ(c["linear_value_heads_tiled"], true);
  EXPECT_EQ(c["ple_layer_ids"], (nlohmann::json{1}));  // 1-based, as transformers
  EXPECT_EQ(c["ple_embed_dim"], 16);                   // 4 per head, (3 - 1) * 2 heads
  EXPECT_EQ(c["ple_hash_constants"]["layer_multipliers"][1], 35454616657218897ull);
  EXPECT_EQ(c["ple_hash_constants"]["head_offsets"][3], 301);
  EXPECT_EQ(c["eos_token_id"], (nlohmann::json{3, 7}));  // the PLE's first, then the tokenizer's
  EXPECT_EQ(c["output_gate_type"], "sigmoid");
  EXPECT_EQ(c["norm_topk_prob"], true);
  EXPECT_EQ(c["shared_expert_intermediate_size"], 24);
  EXPECT_EQ(c["tie_word_embeddings"], false);
}

// What the format cannot say, or says in a way the model cannot run, is refused by name.
TEST(Qwen4ExpGgufMapping, WhatCannotBeRunIsRefusedByName) {
  TempDir dir;
  const std::pair<const char*, const char*> cases[] = {
      {"ratio", "layer 1 is an attention layer without a QSA compress ratio"},
      {"two_ple", "qwen4exp.ple.layers lists 2 layers; llama.cpp's qwen4exp holds one"},
      {"expert_weights_norm", "qwen4exp.expert_weights_norm false"},
      {"value_length", "attention.value_length 8 differs from key_length 16"},
      {"ple.layer_multipliers", "metadata qwen4exp.ple.layer_multipliers is missing"},
      {"ssm.group_count", "qwen4exp.ssm.group_count"},
  };
  for (const auto& [skip, message] : cases) {
    SCOPED_TRACE(skip);
    GgufFile g(write_file(dir, std::string(skip) + ".gguf", qwen4exp_file(skip).build()));
    try {
      (void)gguf_hf_config(g);
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

TEST(Qwen4ExpGgufMapping, TensorsUndoTheConvertersTransforms) {
  TempDir dir;
  std::vector<uint8_t> q(2 * 32 * 2), k(1 * 32 * 2);  // BF16 [32 in, 2 out] and [32 in, 1 out]
  for (size_t i = 0; i < q.size(); ++i) q[i] = uint8_t(i);
  for (size_t i = 0; i < k.size(); ++i) k[i] = uint8_t(200 + i % 50);
  GgufFile g(write_file(dir, "m.gguf",
                        qwen4exp_file("", {{"blk.0.ssm_a", {2}, 0, f32s({-0.5f, -2.f})},
                                           {"blk.0.ssm_conv1d.weight", {4, 3}, 0, f32s(std::vector<float>(12, 1.f))},
                                           {"blk.1.attn_q_norm.weight", {2}, 0, f32s({1.25f, 0.5f})},
                                           {"blk.1.indexer.q_proj.weight", {32, 2}, 30, q},
                                           {"blk.1.indexer.k_proj.weight", {32, 1}, 30, k},
                                           {"blk.0.ffn_gate_exps.weight", {32, 16, 16}, 0, f32s(std::vector<float>(8192))},
                                           {"per_layer_token_embd.weight", {4, 408}, 0, f32s(std::vector<float>(1632))}})
                            .build()));
  std::vector<std::unique_ptr<uint8_t[]>> owned;
  const std::vector<TensorInfo> ts = gguf_hf_tensors(g, owned);
  auto find = [&](const std::string& n) -> const TensorInfo& { return tensor_named(ts, n); };
  auto f = [](const TensorInfo& t, size_t i) { return reinterpret_cast<const float*>(t.data)[i]; };
  const TensorInfo& a_log = find("model.layers.0.linear_attn.A_log");
  EXPECT_NEAR(f(a_log, 0), std::log(0.5f), 1e-7);
  EXPECT_NEAR(f(a_log, 1), std::log(2.f), 1e-7);
  EXPECT_EQ(find("model.layers.0.linear_attn.conv1d.weight").shape, (std::vector<int64_t>{3, 1, 4}));
  const TensorInfo& qn = find("model.layers.1.self_attn.q_norm.weight");
  EXPECT_EQ(f(qn, 0), 0.25f);  // stored 1 + w
  EXPECT_EQ(f(qn, 1), -0.5f);
  EXPECT_EQ(f(find("model.hyper_connection_mixer.hc_norm.weight"), 3), 1.f);
  const TensorInfo& qk = find("model.layers.1.self_attn.indexer.index_qk_proj.weight");
  ASSERT_EQ(qk.shape, (std::vector<int64_t>{3, 32}));  // q rows, then k's
  EXPECT_EQ(std::vector<uint8_t>(qk.data, qk.data + q.size()), q);
  EXPECT_EQ(std::vector<uint8_t>(qk.data + q.size(), qk.data + q.size() + k.size()), k);
  EXPECT_EQ(find("model.layers.0.mlp.experts.gate_proj").shape, (std::vector<int64_t>{16, 16, 32}));
  EXPECT_EQ(find("model.layers.0.ple.ple_embedding.ngram_embedding.weight").shape, (std::vector<int64_t>{408, 4}));
  EXPECT_EQ(find("lm_head.weight").data, find("model.embed_tokens.weight").data);  // no output.weight: tied

  // A decay rate that -exp() cannot give, and a tensor the architecture does not have.
  for (const auto& [spec, message] :
       std::vector<std::pair<TensorSpec, std::string>>{
           {{"blk.0.ssm_a", {2}, 0, f32s({-0.5f, 0.f})}, "blk.0.ssm_a[1] = 0 where a negative decay rate"},
           {{"blk.0.attn_norm.weight", {2}, 0, f32s({1.f, 1.f})}, "tensor blk.0.attn_norm.weight (F32) is not supported"},
           {{"blk.1.indexer.q_proj.weight", {32, 2}, 30, q}, "blk.1.indexer.q_proj.weight without its indexer.k_proj"}}) {
    GgufFile bad(write_file(dir, "bad.gguf", qwen4exp_file("", {spec}).build()));
    try {
      (void)gguf_hf_tensors(bad, owned);
      ADD_FAILURE() << spec.name << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(message), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace turbospark
